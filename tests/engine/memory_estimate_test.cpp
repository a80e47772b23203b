// The estimate's arithmetic on shapes whose figures can be written down by hand (Note [estimating
// memory per rank], include/fsdp/memory_estimate.h); tests/cli/estimate_command_test.cpp checks
// it against the engine's counters.
#include <fsdp/memory_estimate.h>
#include <fsdp/meta_device.h>
#include <gtest/gtest.h>

#include "harness/error_message.h"

namespace fsdp {
namespace {

using testing::error_message_of;

// Two units of one 8 x 4 weight each and a root of one 6-element weight: 70 parameters.
std::vector<UnitShape> two_units_and_a_root() {
  return {{"0", {{8, 4}}, true}, {"1", {{8, 4}}, true}, {"", {{6}}, false}};
}

TEST(MemoryEstimate, StateIsTheRanksPaddedShardsAndBytesSentFollowTheCollectives) {
  MemoryEstimateOptions options;
  options.world_size = 4;
  auto estimate = estimate_memory(two_units_and_a_root(), options);
  EXPECT_EQ(estimate.parameters, 70);
  // Shards: 2 x 4 rows of each unit, ceil(6 / 4) = 2 of the root: 8 + 8 + 2 = 18 elements.
  EXPECT_EQ(estimate.parameter_bytes, 18 * 4);
  EXPECT_EQ(estimate.optimizer_bytes, 2 * 18 * 4);
  EXPECT_EQ(estimate.model_state_bytes(), 4 * 18 * 4);
  // Forward all-gather and reduce-scatter of every unit: 3 peers x 18; backward all-gather of the
  // two resharding units: 3 x 16.
  EXPECT_EQ(estimate.bytes_sent_per_step, (3 * 18 * 2 + 3 * 16) * 4);
  // Root (8 padded elements) kept, plus one or two 32-element units.
  EXPECT_EQ(estimate.unsharded_peak_bytes_without_prefetch, (8 + 32) * 4);
  EXPECT_EQ(estimate.unsharded_peak_bytes_with_prefetch, (8 + 64) * 4);
  // Rank 0 owns 2 rows of each unit and 2 of the root: 18 elements, three copies (weights, moments).
  EXPECT_EQ(estimate.sharded_checkpoint_bytes, 18 * 4 * 3);
  EXPECT_EQ(estimate.full_checkpoint_bytes, 70 * 4 * 3);
  // The optimizer step: AdamW's two temporaries of the largest shard (2 rows of 4), and the root's
  // pooled blocks (8 padded elements: unsharded parameters, reduce-scatter input, received rows).
  EXPECT_EQ(estimate.optimizer_step_temporary_bytes, 2 * 8 * 4);
  EXPECT_EQ(estimate.pooled_bytes_in_optimizer_step, 8 * 4 * 3);
  EXPECT_EQ(estimate.optimizer_step_bytes(), (4 * 18 + 2 * 8 + 8 * 3) * 4);
  // The largest unit's reduction: the root (8) and that unit (32) unsharded, its gradients, the
  // reduce-scatter's input and received rows (3 x 32), and the pool's blocks of the unit reduced
  // before it (the other 32-element unit's three).
  EXPECT_EQ(estimate.unsharded_gradient_bytes, 3 * 32 * 4);
  EXPECT_EQ(estimate.pooled_bytes_in_reduction, 3 * 32 * 4);
  EXPECT_EQ(estimate.reduction_bytes, (8 + 32 + 3 * 32 + 3 * 32) * 4);
  // The training step: the larger of the end of forward (72 unsharded elements and the activations)
  // and the reduction; the resident peak adds the runtime to the larger of it and the optimizer step.
  EXPECT_EQ(estimate.training_step_bytes(true, 0), (4 * 18 + 8 + 32 + 6 * 32) * 4);
  EXPECT_EQ(estimate.training_step_bytes(true, 1000), (4 * 18 + 72) * 4 + 1000);
  EXPECT_EQ(estimate.resident_peak_bytes(true, 1000), kRuntimeBytes + (4 * 18 + 72) * 4 + 1000);
  // A step without activations or unsharded units (NO_SHARD of one rank): the optimizer step is the peak.
  {
    MemoryEstimateOptions one_rank;
    one_rank.sharding_strategy = ShardingStrategy::kNoShard;
    const auto alone = estimate_memory(two_units_and_a_root(), one_rank);
    EXPECT_EQ(alone.pooled_bytes_in_optimizer_step, 0);
    EXPECT_EQ(alone.optimizer_step_temporary_bytes, 2 * 32 * 4);
    EXPECT_EQ(alone.resident_peak_bytes(false, 0), kRuntimeBytes + (4 * 70 + 2 * 32) * 4);
  }

  // hpZ k = 2: backward gathers over 2 ranks, each sending its row of 2 shards (16 elements) to
  // the other; between forward and backward each unit keeps that row, 16 of its 32 elements.
  options.reshard_after_forward = 2;
  estimate = estimate_memory(two_units_and_a_root(), options);
  EXPECT_EQ(estimate.bytes_sent_per_step, (3 * 18 * 2 + 2 * 16) * 4);
  EXPECT_EQ(estimate.unsharded_peak_bytes_without_prefetch, (8 + 32 + 16 + 16) * 4);

  // SHARD_GRAD_OP keeps everything: no backward all-gather.
  options.reshard_after_forward.reset();
  options.sharding_strategy = ShardingStrategy::kShardGradOp;
  estimate = estimate_memory(two_units_and_a_root(), options);
  EXPECT_EQ(estimate.bytes_sent_per_step, 3 * 18 * 2 * 4);
  EXPECT_EQ(estimate.unsharded_peak_bytes_with_prefetch, (8 + 64) * 4);

  // HYBRID_SHARD over 2 machines of 2: shard over 2 (rows 4, 4, 3), all-reduce each shard across 2.
  options.sharding_strategy = ShardingStrategy::kHybridShard;
  options.ranks_per_machine = 2;
  estimate = estimate_memory(two_units_and_a_root(), options);
  EXPECT_EQ(estimate.shard_group_size, 2);
  EXPECT_EQ(estimate.replicate_group_size, 2);
  EXPECT_EQ(estimate.parameter_bytes, (16 + 16 + 3) * 4);
  EXPECT_EQ(estimate.bytes_sent_per_step, ((35 + 35 + 32) + 35) * 4);
  EXPECT_EQ(estimate.bytes_sent_off_machine_per_step, 35 * 4);

  // NO_SHARD with bf16 reduction: the all-reduce moves 2 (N - 1) / N of the model in bf16.
  options = MemoryEstimateOptions{};
  options.world_size = 4;
  options.sharding_strategy = ShardingStrategy::kNoShard;
  options.mixed_precision.reduce_dtype = c10::kBFloat16;
  options.optimizer = OptimizerKind::kSgd;
  estimate = estimate_memory(two_units_and_a_root(), options);
  EXPECT_EQ(estimate.model_state_bytes(), 2 * 70 * 4);
  EXPECT_EQ(estimate.bytes_sent_per_step, static_cast<int64_t>(2.0 * 3 / 4 * 70 * 2));
  EXPECT_EQ(estimate.unsharded_peak_bytes_with_prefetch, 0);
  EXPECT_EQ(estimate.optimizer_step_temporary_bytes, 32 * 4);  // SGD's one, for weight decay
  EXPECT_EQ(estimate.pooled_bytes_in_optimizer_step, 8 * 2);   // the root's received rows, padded to 4 ranks
}

TEST(MemoryEstimate, UnitShapesCountATiedWeightOnceAndWorkOnTheMetaDevice) {
  torch::nn::Sequential model;
  {
    MetaDeviceGuard meta;
    model = torch::nn::Sequential(torch::nn::Embedding(1000000, 4096), torch::nn::Linear(4096, 4096));
  }
  auto shapes = unit_shapes(*model, {{{model[1]}}});
  ASSERT_EQ(shapes.size(), 2u);
  EXPECT_EQ(shapes[0].name, "1");
  EXPECT_EQ(shapes[0].parameter_sizes.size(), 2u);  // weight and bias
  EXPECT_FALSE(shapes[1].reshard_after_forward);
  ASSERT_EQ(shapes[1].parameter_sizes.size(), 1u);  // the root: the embedding
  EXPECT_EQ(shapes[1].parameter_sizes[0], (std::vector<int64_t>{1000000, 4096}));

  MemoryEstimateOptions options;
  options.world_size = 6;
  options.ranks_per_machine = 4;
  EXPECT_NE(error_message_of([&] { options.validate(); }).find("ranks per machine must divide the 6 ranks, got 4"),
            std::string::npos);
  options.ranks_per_machine = 0;
  options.sharding_strategy = ShardingStrategy::kNoShard;
  options.reshard_after_forward = 2;
  EXPECT_NE(error_message_of([&] { options.validate(); }).find("NO_SHARD shards nothing"), std::string::npos);
  options.sharding_strategy = ShardingStrategy::kFullShard;
  options.reshard_after_forward = 4;
  EXPECT_NE(error_message_of([&] { estimate_memory(shapes, options); }).find("4"), std::string::npos);
  EXPECT_NE(error_message_of([] { parse_optimizer_kind("lion", "--optimizer"); }).find("unknown optimizer 'lion'"),
            std::string::npos);
}

}  // namespace
}  // namespace fsdp
