// Asynchronous checkpoints (include/fsdp/async_checkpoint.h, Note [asynchronous checkpoints]): what
// is written is the state at start() however training changes it meanwhile, a run resumed from it
// continues as one resumed from a synchronous save of the same moment, it counts only once
// finished, one save at most is in flight, and a write that fails on one rank is an error on every
// rank that leaves the checkpoint incomplete. (Ranks/DcpWrittenByUs/From3To2 loads one in PyTorch.)
#include <fsdp/fsdp.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <thread>

#include "harness/error_message.h"
#include "harness/multi_rank.h"
#include "harness/parity.h"
#include "harness/test_models.h"

namespace fsdp {
namespace {

namespace fs = std::filesystem;
using testing::expect_bitwise_equal;
using testing::FourLinears;

struct AsyncJob {
  FourLinears model;
  std::unique_ptr<torch::optim::AdamW> optimizer;

  AsyncJob(const DistributedContext& context, uint64_t seed) {
    torch::manual_seed(seed);
    fully_shard(model->first.ptr(), context);
    fully_shard(model->second.ptr(), context);
    fully_shard(model->third.ptr(), context);
    fully_shard(model.ptr(), context);
    optimizer = std::make_unique<torch::optim::AdamW>(model->parameters(), torch::optim::AdamWOptions(0.01));
  }
  void step(const DistributedContext& context, int index) {
    torch::manual_seed(100 + index);
    const auto batch = torch::randn({4, 3});
    const int64_t local = 4 / context.world_size();
    fsdp::forward(model, batch.narrow(0, context.rank() * local, local)).pow(2).sum().backward();
    optimizer->step();
    optimizer->zero_grad();
  }
};

TEST(AsyncCheckpoint, HoldsTheStateAtStartCountsOnceFinishedAndResumesAsASynchronousSave) {
  const auto root = testing::shared_temporary_directory();
  testing::run_on_ranks(2, [root](const DistributedContext& context) {
    AsyncJob job(context, 7);
    job.step(context, 0);
    job.step(context, 1);
    TrainingProgress progress;
    progress.step = 2;
    progress.data_position = 8;
    save_checkpoint(root + "/sync", *job.model, *job.optimizer, context, progress);
    AsyncCheckpointer checkpointer;
    checkpointer.start(root + "/async", *job.model, *job.optimizer, context, progress);
    EXPECT_TRUE(checkpointer.in_flight());
    EXPECT_EQ(checkpointer.directory(), root + "/async");
    EXPECT_FALSE(is_complete_checkpoint(root + "/async")) << "complete before finish";
    job.step(context, 2);  // changes what the thread may still be writing from: it must not see it
    // The next save finishes this one first (waiting for its files if need be).
    TrainingProgress later = progress;
    later.step = 3;
    checkpointer.start(root + "/async_later", *job.model, *job.optimizer, context, later);
    EXPECT_TRUE(is_complete_checkpoint(root + "/async"));
    EXPECT_FALSE(is_complete_checkpoint(root + "/async_later"));
    // Polling: every rank finishes at the same call, once every rank's files are written.
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
    bool finished = false;
    while (!finished && std::chrono::steady_clock::now() < deadline) {
      finished = checkpointer.finish(context, false);
      if (!finished) std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    ASSERT_TRUE(finished);
    EXPECT_FALSE(checkpointer.in_flight());
    EXPECT_TRUE(is_complete_checkpoint(root + "/async_later"));
    EXPECT_TRUE(checkpointer.finish(context, true)) << "nothing in flight: nothing to do";

    AsyncJob from_sync(context, 99), from_async(context, 98);  // other weights: everything comes from the files
    EXPECT_EQ(load_checkpoint(root + "/sync", *from_sync.model, *from_sync.optimizer, context).step, 2);
    const auto loaded = load_checkpoint(root + "/async", *from_async.model, *from_async.optimizer, context);
    EXPECT_EQ(loaded.step, 2);
    EXPECT_EQ(loaded.data_position, 8);
    expect_bitwise_equal(*from_async.model, *from_sync.model, "loaded");
    // The optimizer state too: the same step from both.
    from_sync.step(context, 2);
    from_async.step(context, 2);
    expect_bitwise_equal(*from_async.model, *from_sync.model, "a step after loading");
    expect_bitwise_equal(*from_async.model, *job.model, "a step after loading, against the run that went on");
    AsyncJob from_later(context, 97);
    EXPECT_EQ(load_checkpoint(root + "/async_later", *from_later.model, *from_later.optimizer, context).step, 3);
    expect_bitwise_equal(*from_later.model, *job.model, "the later save");
  });
}

TEST(AsyncCheckpoint, AFailedWriteOnOneRankIsAnErrorOnEveryRankAndTheCheckpointStaysIncomplete) {
  const auto root = testing::shared_temporary_directory();
  testing::run_on_ranks(2, [root](const DistributedContext& context) {
    AsyncJob job(context, 7);
    job.step(context, 0);
    // A non-empty directory where rank 1's model file goes: its rename fails, on the thread.
    const auto blocked = fs::path(root) / "checkpoint" / "pytorch_model_fsdp_0" / "__1_0.distcp";
    if (context.rank() == 1) {
      fs::create_directories(blocked);
      std::ofstream(blocked / "in_the_way") << "x";
    }
    barrier(context.world());
    AsyncCheckpointer checkpointer;
    checkpointer.start(root + "/checkpoint", *job.model, *job.optimizer, context, {});
    job.step(context, 1);
    const auto message = testing::error_message_of([&] { checkpointer.finish(context, true); });
    EXPECT_NE(message.find("rank 1 failed"), std::string::npos) << message;
    EXPECT_NE(message.find("__1_0.distcp"), std::string::npos) << message;
    EXPECT_FALSE(checkpointer.in_flight());
    EXPECT_FALSE(is_complete_checkpoint(root + "/checkpoint"));
    // The job goes on: the next save, elsewhere, works.
    checkpointer.start(root + "/next", *job.model, *job.optimizer, context, {});
    EXPECT_TRUE(checkpointer.finish(context, true));
    EXPECT_TRUE(is_complete_checkpoint(root + "/next"));
  });
}

}  // namespace
}  // namespace fsdp
