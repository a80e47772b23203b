// A collective that fails names what it was for: the unit and the iteration (src/dist/activity.h),
// recorded when it was issued (issue Reliability: a stuck rank's report named only the collective
// and the group).
#include "dist/activity.h"

#include <fsdp/fsdp.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "harness/error_message.h"
#include "harness/multi_rank.h"
#include "harness/test_models.h"

namespace fsdp {
namespace {

TEST(Activity, ScopesNestAndRestore) {
  EXPECT_EQ(detail::current_activity(), "");
  {
    const detail::ActivityScope outer("outer");
    {
      const detail::ActivityScope inner("inner");
      EXPECT_EQ(detail::current_activity(), "inner");
    }
    EXPECT_EQ(detail::current_activity(), "outer");
  }
  EXPECT_EQ(detail::current_activity(), "");
}

TEST(Activity, AFailedAllGatherNamesTheUnitAndTheIteration) {
  testing::run_on_ranks(2, [](const DistributedContext& context) {
    torch::manual_seed(2);
    testing::MlpStack model;
    for (auto& block : model->blocks) fully_shard(block.ptr(), context);
    fully_shard(model.ptr(), context);
    const auto input = torch::randn({2, 3});
    fsdp::forward(model, input).sum().backward();
    if (context.rank() == 1) return;  // rank 1 leaves; rank 0's next all-gather fails at once
    const auto message = testing::error_message_of([&] { fsdp::forward(model, input).sum().backward(); });
    EXPECT_NE(message.find("(for FSDP unit"), std::string::npos) << message;
    EXPECT_NE(message.find(", iteration 2, "), std::string::npos) << message;
  });
}

}  // namespace
}  // namespace fsdp
