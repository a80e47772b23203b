// Prefetch (module_state.h, [Note: prefetch]): while a unit computes, the next unit's all-gather is
// already issued. Observed from inside the units' forward and backward, and checked not to change a
// single bit of training, including when the sequence of units changes between iterations.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <functional>

#include <fsdp/fsdp.h>

#include "harness/parity.h"
#include "harness/multi_rank.h"

namespace fsdp {
namespace {

/// A residual block that calls `on_forward` inside its forward and `on_backward` inside its backward
/// (a hook on an intermediate tensor: it runs after the unit's pre-backward, before its parameters'
/// gradients).
struct ProbeBlockImpl : torch::nn::Module {
  ProbeBlockImpl() : fc(register_module("fc", torch::nn::Linear(5, 5))) {}
  torch::Tensor forward(const torch::Tensor& input) {
    if (on_forward) on_forward();
    auto hidden = torch::tanh(fc->forward(input));
    if (hidden.requires_grad() && on_backward) {
      auto callback = on_backward;
      hidden.register_hook([callback](const torch::Tensor&) { callback(); });
    }
    return input + hidden;
  }
  torch::nn::Linear fc;
  std::function<void()> on_forward;
  std::function<void()> on_backward;
};
TORCH_MODULE(ProbeBlock);

struct ProbeStackImpl : torch::nn::Module {
  ProbeStackImpl() : head(register_module("head", torch::nn::Linear(5, 2))) {
    for (int index = 0; index < 4; ++index) {
      blocks.push_back(register_module("blocks_" + std::to_string(index), ProbeBlock()));
    }
  }
  torch::Tensor forward(const torch::Tensor& input) {
    auto hidden = input;
    for (size_t index = 0; index < blocks.size(); ++index) {
      if (static_cast<int64_t>(index) == skipped_block) continue;
      hidden = fsdp::forward(blocks[index], hidden);
    }
    return fsdp::forward(head, hidden);
  }
  std::vector<ProbeBlock> blocks;
  torch::nn::Linear head;
  int64_t skipped_block = -1;
};
TORCH_MODULE(ProbeStack);

std::vector<FSDPModule> shard_probe_stack(ProbeStack& model, const DistributedContext& context,
                                          const FullyShardOptions& options) {
  std::vector<FSDPModule> units;
  for (auto& block : model->blocks) units.push_back(fully_shard(block.ptr(), context, options));
  fully_shard(model.ptr(), context, options);
  return units;
}

std::pair<torch::Tensor, torch::Tensor> batch(int step, const DistributedContext& context) {
  torch::manual_seed(300 + step);
  auto inputs = torch::randn({8, 5});
  auto targets = torch::randn({8, 2});
  const int64_t local = 8 / context.world_size();
  return {inputs.narrow(0, context.rank() * local, local), targets.narrow(0, context.rank() * local, local)};
}

/// For each block, whether its neighbour held gathered (or gathering) parameters while it ran: the
/// next block during forward, the previous block during backward.
struct Observations {
  std::vector<bool> next_gathered_in_forward = std::vector<bool>(4, false);
  std::vector<bool> previous_gathered_in_backward = std::vector<bool>(4, false);
};

void install_probes(ProbeStack& model, const std::vector<FSDPModule>& units, Observations& seen) {
  for (size_t index = 0; index < model->blocks.size(); ++index) {
    auto& block = model->blocks[index];
    block->on_forward = [&seen, &units, index] {
      if (index + 1 < units.size()) seen.next_gathered_in_forward[index] = units[index + 1].unsharded_buffer_bytes() > 0;
    };
    block->on_backward = [&seen, &units, index] {
      if (index > 0) seen.previous_gathered_in_backward[index] = units[index - 1].unsharded_buffer_bytes() > 0;
    };
  }
}

TEST(Prefetch, NeighbouringUnitIsGatheredWhileTheCurrentOneComputes) {
  testing::run_on_ranks(2, [](const DistributedContext& context) {
    for (const bool implicit_prefetch : {true, false}) {
      torch::manual_seed(5);
      ProbeStack model;
      FullyShardOptions options;
      options.implicit_prefetch = implicit_prefetch;
      auto units = shard_probe_stack(model, context, options);
      for (int step = 0; step < 2; ++step) {
        Observations seen;
        install_probes(model, units, seen);
        auto [inputs, targets] = batch(step, context);
        torch::mse_loss(fsdp::forward(model, inputs), targets).backward();
        const std::string what = std::string(implicit_prefetch ? "prefetch on" : "prefetch off") + ", step " +
                                 std::to_string(step);
        for (size_t index = 0; index < 4; ++index) {
          // Forward prefetch follows the previous forward's order, so it starts at the second step.
          const bool expect_forward = implicit_prefetch && step > 0 && index < 3;
          const bool expect_backward = implicit_prefetch && index > 0;
          EXPECT_EQ(seen.next_gathered_in_forward[index], expect_forward) << what << ", forward of block " << index;
          EXPECT_EQ(seen.previous_gathered_in_backward[index], expect_backward)
              << what << ", backward of block " << index;
        }
        for (const auto& unit : fsdp_modules(*model)) EXPECT_EQ(unit.unsharded_buffer_bytes(), 0) << what;
      }
    }
  });
}

TEST(Prefetch, ExplicitListsReplaceTheImplicitChoice) {
  testing::run_on_ranks(2, [](const DistributedContext& context) {
    torch::manual_seed(5);
    ProbeStack model;
    auto units = shard_probe_stack(model, context, {});
    units[0].set_modules_to_forward_prefetch({units[2]});
    units[3].set_modules_to_backward_prefetch({});
    bool block1_gathered = true, block2_gathered = false, block2_gathered_in_backward = true;
    model->blocks[0]->on_forward = [&] {
      block1_gathered = units[1].unsharded_buffer_bytes() > 0;
      block2_gathered = units[2].unsharded_buffer_bytes() > 0;
    };
    model->blocks[3]->on_backward = [&] { block2_gathered_in_backward = units[2].unsharded_buffer_bytes() > 0; };
    auto [inputs, targets] = batch(0, context);
    torch::mse_loss(fsdp::forward(model, inputs), targets).backward();
    // Already in the first step: explicit lists need no history.
    EXPECT_TRUE(block2_gathered);
    EXPECT_FALSE(block1_gathered);
    EXPECT_FALSE(block2_gathered_in_backward);
    for (const auto& unit : fsdp_modules(*model)) EXPECT_EQ(unit.unsharded_buffer_bytes(), 0);
  });
}

// Prefetch moves no numbers: with it on or off, and when a step skips a block (so the forward
// prefetch gathers a unit that does not run), training is bit for bit the same.
TEST(Prefetch, TrainingIsBitForBitTheSameWithAndWithoutPrefetch) {
  testing::run_on_ranks(3, [](const DistributedContext& context) {
    std::vector<std::vector<torch::Tensor>> final_parameters;
    for (const bool implicit_prefetch : {true, false}) {
      torch::manual_seed(6);
      ProbeStack model;
      FullyShardOptions options;
      options.implicit_prefetch = implicit_prefetch;
      shard_probe_stack(model, context, options);
      torch::optim::AdamW optimizer(model->parameters(), torch::optim::AdamWOptions(1e-2));
      for (int step = 0; step < 4; ++step) {
        model->skipped_block = step == 2 ? 1 : -1;
        auto [inputs, targets] = batch(step, context);
        torch::mse_loss(fsdp::forward(model, inputs), targets).backward();
        optimizer.step();
        optimizer.zero_grad();
        for (const auto& unit : fsdp_modules(*model)) {
          EXPECT_EQ(unit.unsharded_buffer_bytes(), 0) << "step " << step << ", " << unit.module()->name();
        }
      }
      std::vector<torch::Tensor> parameters;
      for (const auto& parameter : testing::full_parameters(*model)) parameters.push_back(parameter.second);
      final_parameters.push_back(parameters);
    }
    ASSERT_EQ(final_parameters[0].size(), final_parameters[1].size());
    for (size_t index = 0; index < final_parameters[0].size(); ++index) {
      EXPECT_TRUE(torch::equal(final_parameters[0][index], final_parameters[1][index])) << "parameter " << index;
    }
  });
}

}  // namespace
}  // namespace fsdp
