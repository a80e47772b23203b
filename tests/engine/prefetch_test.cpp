// Prefetch (module_state.h, Note [prefetch]): while a unit computes, the next unit's all-gather is
// already issued. Observed from inside the units' forward and backward, and checked not to change a
// single bit of training, including when the sequence of units changes between iterations.
#include <fsdp/fsdp.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <fstream>
#include <functional>
#include <map>
#include <nlohmann/json.hpp>
#include <set>

#include "harness/error_message.h"
#include "harness/multi_rank.h"
#include "harness/parity.h"
#include "harness/python_peer.h"

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
      if (index + 1 < units.size())
        seen.next_gathered_in_forward[index] = units[index + 1].unsharded_buffer_bytes() > 0;
    };
    block->on_backward = [&seen, &units, index] {
      if (index > 0) seen.previous_gathered_in_backward[index] = units[index - 1].unsharded_buffer_bytes() > 0;
    };
  }
}

// Both on (the default), both off, and each alone: each switch acts on its own pass.
TEST(Prefetch, NeighbouringUnitIsGatheredWhileTheCurrentOneComputes) {
  testing::run_on_ranks(2, [](const DistributedContext& context) {
    struct Switches {
      bool forward;
      bool backward;
    };
    for (const Switches switches :
         {Switches{true, true}, Switches{false, false}, Switches{false, true}, Switches{true, false}}) {
      torch::manual_seed(5);
      ProbeStack model;
      FullyShardOptions options;
      options.fsdp1.forward_prefetch = switches.forward;
      if (!switches.backward) options.fsdp1.backward_prefetch.reset();
      auto units = shard_probe_stack(model, context, options);
      for (int step = 0; step < 2; ++step) {
        Observations seen;
        install_probes(model, units, seen);
        auto [inputs, targets] = batch(step, context);
        torch::mse_loss(fsdp::forward(model, inputs), targets).backward();
        const std::string what = std::string("forward prefetch ") + (switches.forward ? "on" : "off") +
                                 ", backward prefetch " + (switches.backward ? "on" : "off") + ", step " +
                                 std::to_string(step);
        for (size_t index = 0; index < 4; ++index) {
          // Forward prefetch follows the previous forward's order, so it starts at the second step.
          const bool expect_forward = switches.forward && step > 0 && index < 3;
          const bool expect_backward = switches.backward && index > 0;
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

// FSDP1's backward_prefetch, observed two ways: the order of all-gathers (G) and reduce-scatters (R)
// on the wire during backward, and whether block 2 is already gathering while block 3 computes its
// gradients. BACKWARD_PRE issues block 2's all-gather before block 3's gradients, BACKWARD_POST
// after them (but still before block 3's reduce-scatter), NO_PREFETCH when block 2's backward starts.
TEST(Prefetch, BackwardPrefetchModesIssueTheAllGatherWhereFsdp1Does) {
  testing::run_on_ranks(2, [](const DistributedContext& context) {
    struct Mode {
      std::optional<BackwardPrefetch> prefetch;
      const char* name;
      const char* wire;
      bool gathered_during_gradients;
    };
    for (const Mode& mode : {Mode{BackwardPrefetch::kBackwardPre, "BACKWARD_PRE", "GGRGRGRRR", true},
                             Mode{BackwardPrefetch::kBackwardPost, "BACKWARD_POST", "GGRGRGRRR", false},
                             Mode{std::nullopt, "NO_PREFETCH", "GRGRGRGRR", false}}) {
      torch::manual_seed(5);
      ProbeStack model;
      FullyShardOptions options;
      options.fsdp1.forward_prefetch = false;
      options.fsdp1.backward_prefetch = mode.prefetch;
      auto units = shard_probe_stack(model, context, options);
      bool gathered = !mode.gathered_during_gradients;
      model->blocks[3]->on_backward = [&] { gathered = units[2].unsharded_buffer_bytes() > 0; };
      auto [inputs, targets] = batch(0, context);
      auto loss = torch::mse_loss(fsdp::forward(model, inputs), targets);
      context.world().start_trace();
      loss.backward();
      std::string wire;
      for (const auto& entry : context.world().stop_trace()) {
        if (entry.rfind("all_gather", 0) == 0) wire += 'G';
        if (entry.rfind("reduce_scatter", 0) == 0) wire += 'R';
      }
      EXPECT_EQ(wire, mode.wire) << mode.name;
      EXPECT_EQ(gathered, mode.gathered_during_gradients) << mode.name;
      for (const auto& unit : fsdp_modules(*model)) EXPECT_EQ(unit.unsharded_buffer_bytes(), 0) << mode.name;
    }
  });
}

// limit_all_gathers (max_all_gathers_in_flight): block 0 asks to prefetch the three blocks after it;
// with a limit of 2 only one of them may gather beside block 0's own all-gather.
TEST(Prefetch, TheAllGatherLimitBoundsWhatIsInFlight) {
  testing::run_on_ranks(2, [](const DistributedContext& context) {
    for (const std::optional<int64_t> limit :
         {std::optional<int64_t>(), std::optional<int64_t>(2), std::optional<int64_t>(3)}) {
      torch::manual_seed(5);
      ProbeStack model;
      FullyShardOptions options;
      options.fsdp1.max_all_gathers_in_flight = limit;
      auto units = shard_probe_stack(model, context, options);
      units[0].set_modules_to_forward_prefetch({units[1], units[2], units[3]});
      int64_t gathered = 0;
      model->blocks[0]->on_forward = [&] {
        for (size_t index = 1; index < 4; ++index) gathered += units[index].unsharded_buffer_bytes() > 0 ? 1 : 0;
      };
      auto [inputs, targets] = batch(0, context);
      torch::mse_loss(fsdp::forward(model, inputs), targets).backward();
      const int64_t expected = limit ? *limit - 1 : 3;
      EXPECT_EQ(gathered, expected) << "limit " << (limit ? std::to_string(*limit) : "none");
      for (const auto& unit : fsdp_modules(*model)) EXPECT_EQ(unit.unsharded_buffer_bytes(), 0);
    }
    FullyShardOptions bad;
    bad.fsdp1.max_all_gathers_in_flight = 0;
    const auto message = testing::error_message_of([&] { validate(bad); });
    EXPECT_NE(message.find("max_all_gathers_in_flight must be at least 1"), std::string::npos) << message;
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
      options.fsdp1.forward_prefetch = implicit_prefetch;
      if (!implicit_prefetch) options.fsdp1.backward_prefetch.reset();
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

namespace fsdp {
namespace {

// The order of the collectives of a training step under fsdp_version=1, against PyTorch FSDP1 as
// Accelerate wraps it (tests/python/fsdp1_collective_order.py): every all-gather and reduce-scatter
// of the second step, each unit named by its size rank (the units have different sizes, and each
// side's padding keeps their order), for no backward prefetch, BACKWARD_PRE, and BACKWARD_POST with
// forward prefetch. FSDP1's BACKWARD_PRE and BACKWARD_POST issue the same sequence (they differ in
// where the prefetch sits relative to the unit's gradient computation, which the
// BackwardPrefetchModesIssueTheAllGatherWhereFsdp1Does test above checks); NO_PREFETCH differs.
struct OrderBlockImpl : torch::nn::Module {
  explicit OrderBlockImpl(int64_t k)
      : up(register_module("up", torch::nn::Linear(8, 8 * k))),
        down(register_module("down", torch::nn::Linear(8 * k, 8))) {}
  torch::Tensor forward(const torch::Tensor& x) { return x + fsdp::forward(down, torch::relu(fsdp::forward(up, x))); }
  torch::nn::Linear up, down;
};
TORCH_MODULE(OrderBlock);

struct OrderModelImpl : torch::nn::Module {
  OrderModelImpl()
      : input(register_module("input", torch::nn::Linear(3, 8))),
        head(register_module("head", torch::nn::Linear(8, 2))) {
    auto list = register_module("blocks", torch::nn::ModuleList());
    for (int64_t k = 1; k <= 4; ++k) {
      blocks.emplace_back(k);
      list->push_back(blocks.back());
    }
  }
  torch::Tensor forward(const torch::Tensor& x) {
    auto hidden = fsdp::forward(input, x);
    for (auto& block : blocks) hidden = fsdp::forward(block, hidden);
    return fsdp::forward(head, hidden);
  }
  torch::nn::Linear input, head;
  std::vector<OrderBlock> blocks;
};
TORCH_MODULE(OrderModel);

// "AG<i>" / "RS<i>" for each [kind, size], i the rank of the size among that kind's sizes.
std::vector<std::string> by_size_rank(const std::vector<std::pair<std::string, int64_t>>& events) {
  std::map<std::string, std::set<int64_t>> sizes;
  for (const auto& [kind, size] : events) sizes[kind].insert(size);
  std::vector<std::string> tokens;
  for (const auto& [kind, size] : events) {
    const auto& ordered = sizes[kind];
    const auto rank = std::distance(ordered.begin(), ordered.find(size));
    tokens.push_back((kind == "all_gather" ? "AG" : "RS") + std::to_string(rank));
  }
  return tokens;
}

TEST(Prefetch, VersionOneIssuesCollectivesInPyTorchFsdp1sOrder) {
  const std::string directory = testing::shared_temporary_directory();
  const std::vector<std::tuple<std::string, std::string, bool>> cases = {
      {"NO_PREFETCH", "NO_PREFETCH", false},
      {"BACKWARD_PRE", "BACKWARD_PRE", false},
      {"BACKWARD_POST_FORWARD_PREFETCH", "BACKWARD_POST", true}};
  if (!testing::is_rank_process()) {
    testing::PythonOptions options;
    options.world_size = 2;
    ASSERT_TRUE(testing::run_python("fsdp1_collective_order.py", {directory + "/fsdp1.json"}, options).ok);
  }
  testing::run_on_ranks(2, [&](const DistributedContext& context) {
    nlohmann::json ours;
    for (const auto& [name, backward_prefetch, forward_prefetch] : cases) {
      torch::manual_seed(0);
      OrderModel model;
      FullyShardedDataParallelPluginArgs args;
      args.fsdp_version = int64_t{1};
      args.auto_wrap_policy = std::string("transformer_based_wrap");
      args.transformer_cls_names_to_wrap = std::string("OrderBlock");
      args.backward_prefetch = backward_prefetch;
      args.forward_prefetch = forward_prefetch;
      AcceleratorOptions options;
      options.fsdp_plugin = FullyShardedDataParallelPlugin(args, EnvironmentMap{});
      Accelerator accelerator(context, options, EnvironmentMap{});
      torch::optim::SGD optimizer(model->parameters(), torch::optim::SGDOptions(0.1));
      accelerator.prepare(model, optimizer);
      for (int step = 0; step < 2; ++step) {
        if (step == 1) context.world().start_trace();
        fsdp::forward(model, torch::randn({4, 3})).sum().backward();
        optimizer.zero_grad();
      }
      nlohmann::json events = nlohmann::json::array();
      for (const auto& entry : context.world().stop_trace()) {
        const auto space = entry.find(' ');
        const auto kind = entry.substr(0, space);
        if (kind == "all_gather" || kind == "reduce_scatter")
          events.push_back({kind, std::stoll(entry.substr(space + 1))});
      }
      ours[name] = events;
    }
    if (context.rank() == 0) std::ofstream(directory + "/ours.json") << ours.dump();
  });
  if (testing::is_rank_process()) return;
  nlohmann::json theirs, ours;
  std::ifstream(directory + "/fsdp1.json") >> theirs;
  std::ifstream(directory + "/ours.json") >> ours;
  for (const auto& [name, backward_prefetch, forward_prefetch] : cases) {
    auto tokens = [](const nlohmann::json& events) {
      std::vector<std::pair<std::string, int64_t>> list;
      for (const auto& event : events) list.emplace_back(event[0].get<std::string>(), event[1].get<int64_t>());
      return by_size_rank(list);
    };
    const auto expected = tokens(theirs[name]);
    ASSERT_EQ(expected.size(), 14u) << name
                                    << ": FSDP1 gathers the 5 units in forward, 4 again in backward, and reduces 5";
    EXPECT_EQ(tokens(ours[name]), expected) << name;
  }
}

}  // namespace
}  // namespace fsdp
