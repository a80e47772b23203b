// SHARDED checkpoints are PyTorch distributed checkpoints (src/checkpoint/dcp_writer.h): what
// save_checkpoint writes on N ranks, the venv's PyTorch loads into an FSDP2 model on M ranks (M not N)
// the way Accelerate's load_fsdp_model / load_fsdp_optimizer do, and gets fsdp.cpp's weights and
// AdamW state bitwise; dcp_to_torch_save converts both directories (tests/python/dcp_load_ours.py).
// From3To2 saves asynchronously (AsyncCheckpointer) and trains a step while the files are written:
// they hold the state of the save, and the directory counts only after finish.
#include "checkpoint/dcp_writer.h"

#include <fsdp/fsdp.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <filesystem>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>

#include "checkpoint/dcp_metadata.h"
#include "harness/error_message.h"
#include "harness/multi_rank.h"
#include "harness/python_peer.h"
#include "harness/test_models.h"

namespace fsdp {
namespace {

namespace fs = std::filesystem;

using testing::FourLinears;

class DcpWrittenByUs : public ::testing::TestWithParam<std::pair<int, int>> {};

TEST_P(DcpWrittenByUs, PyTorchLoadsItOnAnotherNumberOfRanksBitwise) {
  const auto [saving_ranks, loading_ranks] = GetParam();
  const auto root = testing::shared_temporary_directory();
  testing::run_on_ranks(saving_ranks, [root](const DistributedContext& context) {
    torch::manual_seed(7);
    FourLinears model;
    fully_shard(model->first.ptr(), context);
    fully_shard(model->second.ptr(), context);
    fully_shard(model->third.ptr(), context);
    fully_shard(model->fourth.ptr(), context);
    fully_shard(model.ptr(), context);
    torch::optim::AdamW optimizer(model->parameters(),
                                  torch::optim::AdamWOptions(0.01).betas({0.8, 0.9}).weight_decay(0.1));
    auto train_step = [&](int step) {
      torch::manual_seed(100 + step);
      const auto batch = torch::randn({6, 3});
      const int64_t local = 6 / context.world_size();
      fsdp::forward(model, batch.narrow(0, context.rank() * local, local)).pow(2).sum().backward();
      optimizer.step();
      optimizer.zero_grad();
    };
    for (int step = 0; step < 2; ++step) train_step(step);
    const bool async = context.world_size() == 3;
    AsyncCheckpointer checkpointer;
    if (async) {
      checkpointer.start(root + "/checkpoint", *model, optimizer, context, {});
    } else {
      save_checkpoint(root + "/checkpoint", *model, optimizer, context, {});
    }
    const auto full_model = full_model_state_dict(*model, StateDictConfig{true, true});
    const auto full_optimizer = full_optimizer_state_dict(*model, optimizer, StateDictConfig{true, true});
    if (async) {
      ASSERT_TRUE(checkpointer.in_flight());
      EXPECT_FALSE(is_complete_checkpoint(root + "/checkpoint")) << "complete before finish";
      // One copy of this rank's rows of the 92 weights and of AdamW's two moments (and, on rank 0, the
      // 7 replicated step counts): something, and less than the whole state.
      EXPECT_GT(checkpointer.staging_bytes(), 0);
      EXPECT_LT(checkpointer.staging_bytes(), 3 * 92 * 4 + 7 * 8);
      train_step(2);
      ASSERT_TRUE(checkpointer.finish(context, true));
      EXPECT_FALSE(checkpointer.in_flight());
      EXPECT_TRUE(is_complete_checkpoint(root + "/checkpoint"));
    }
    if (context.rank() != 0) return;
    write_safetensors(root + "/expected_model.safetensors", full_model);
    TensorList optimizer_tensors;
    for (const auto& [name, tensor] : full_optimizer.tensors) optimizer_tensors.emplace_back(name, tensor.local);
    write_safetensors(root + "/expected_optimizer.safetensors", optimizer_tensors);
  });
  if (testing::is_rank_process()) return;
  // The layout PyTorch's FileSystemWriter makes, and nothing of the rank-file format.
  for (const std::string directory : {"pytorch_model_fsdp_0", "optimizer_0"}) {
    const auto path = root + "/checkpoint/" + directory;
    EXPECT_TRUE(fs::is_regular_file(path + "/.metadata")) << path;
    for (int rank = 0; rank < saving_ranks; ++rank) {
      EXPECT_TRUE(fs::is_regular_file(path + "/__" + std::to_string(rank) + "_0.distcp")) << path << " rank " << rank;
    }
    EXPECT_FALSE(fs::exists(path + "/metadata.json")) << path;
  }
  const auto metadata = detail::read_dcp_metadata(root + "/checkpoint/pytorch_model_fsdp_0");
  EXPECT_EQ(metadata.version, "1.0.0");
  EXPECT_EQ(metadata.keys.size(), 7u);
  testing::PythonOptions options;
  options.world_size = loading_ranks;
  const auto result = testing::run_python("dcp_load_ours.py", {root}, options);
  ASSERT_TRUE(result.ok);
  EXPECT_NE(result.output.at(0).find("loaded 7 model and 21 optimizer tensors bitwise on " +
                                     std::to_string(loading_ranks) + " ranks"),
            std::string::npos)
      << result.output.at(0);
}

INSTANTIATE_TEST_SUITE_P(Ranks, DcpWrittenByUs, ::testing::Values(std::make_pair(2, 3), std::make_pair(3, 2)),
                         [](const ::testing::TestParamInfo<std::pair<int, int>>& info) {
                           return "From" + std::to_string(info.param.first) + "To" + std::to_string(info.param.second);
                         });

}  // namespace
}  // namespace fsdp

namespace fsdp {
namespace {

// Note [metadata pieces]: each rank writes its piece of the metadata beside its file, rank 0 writes
// `.metadata` from them and removes them. A piece missing or left by another save is a named error
// on every rank, and no `.metadata` is written.
TEST(DcpMetadataPieces, APieceMissingOrFromAnotherSaveIsANamedErrorOnEveryRank) {
  const auto root = testing::shared_temporary_directory();
  testing::run_on_ranks(2, [root](const DistributedContext& context) {
    ShardedTensorList state;
    const auto weight = torch::arange(35, torch::kFloat).reshape({7, 5});
    const int64_t first = context.rank() == 0 ? 0 : 4, rows = context.rank() == 0 ? 4 : 3;
    state.push_back({"w", ShardedTensor{weight.narrow(0, first, rows).clone(), {7, 5}, first, false, false}});
    const auto entries = detail::model_dcp_entries(state);
    auto save = [&](const std::string& directory, const std::function<void(const std::string&)>& damage) {
      detail::prepare_dcp_directory(directory, context);
      const auto report = detail::write_dcp_rank_file(directory, entries, {}, context.rank(), 2, "save-A");
      barrier(context.world());
      if (context.rank() == 0) damage((fs::path(directory) / ".metadata.pieces" / "1.json").string());
      barrier(context.world());
      return testing::error_message_of(
          [&] { detail::finish_dcp_directory(directory, entries, {}, context, "save-A", report); });
    };
    auto message = save(root + "/good", [](const std::string&) {});
    EXPECT_EQ(message, "");
    EXPECT_TRUE(fs::exists(root + "/good/.metadata"));
    EXPECT_FALSE(fs::exists(root + "/good/.metadata.pieces")) << "the pieces are removed once .metadata is written";
    message = save(root + "/missing", [](const std::string& piece) { fs::remove(piece); });
    EXPECT_NE(message.find("the metadata piece of rank 1"), std::string::npos) << message;
    EXPECT_NE(message.find("is missing"), std::string::npos) << message;
    EXPECT_FALSE(fs::exists(root + "/missing/.metadata"));
    message = save(root + "/other", [](const std::string& piece) {
      std::ifstream in(piece);
      auto text = nlohmann::json::parse(in);
      text["save_id"] = "save-B";
      std::ofstream(piece) << text.dump();
    });
    EXPECT_NE(message.find("belongs to save 'save-B' (rank 1 of 2), not to this one ('save-A', rank 1 of 2)"),
              std::string::npos)
        << message;
    EXPECT_FALSE(fs::exists(root + "/other/.metadata"));
  });
}

}  // namespace
}  // namespace fsdp
