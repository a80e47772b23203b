// The engine against single-process libtorch training on the same global batch: losses and final
// parameters must agree to 1e-5 relative in fp32, for every strategy and world size.
#include <fsdp/fsdp.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "engine/param_group.h"
#include "harness/error_message.h"
#include "harness/multi_rank.h"
#include "harness/parity.h"
#include "harness/test_models.h"

namespace fsdp {
namespace {

using testing::adamw_options;
using testing::full_parameters;
using testing::local_slice;
using testing::named_copies;
using testing::next_token_loss;
using testing::tensors_close;
using testing::token_batch;
using testing::unique_parameters;

constexpr int64_t kGlobalBatch = 12;  // divisible by 1, 2, 3 and 4 ranks
constexpr int kSteps = 3;

double global_mean(const DistributedContext& context, const torch::Tensor& local_loss) {
  auto total = local_loss.detach().clone().to(torch::kDouble).reshape({1});
  all_reduce(context.world(), total);
  return total.item<double>() / static_cast<double>(context.world_size());
}

void expect_parameters_match(torch::nn::Module& sharded, const torch::nn::Module& reference, const std::string& what) {
  auto actual = full_parameters(sharded);
  auto expected = named_copies(reference);
  ASSERT_EQ(actual.size(), expected.size()) << what;
  for (const auto& [name, tensor] : expected) {
    EXPECT_TRUE(tensors_close(actual.at(name), tensor)) << what << ": parameter " << name;
  }
}

/// Trains `sharded` (already wrapped) and `reference` (same initial weights) for kSteps steps.
template <typename Model, typename MakeBatch, typename Loss>
void train_and_compare(const DistributedContext& context, Model& sharded, Model& reference, MakeBatch make_batch,
                       Loss loss_of, const std::string& what) {
  torch::optim::AdamW optimizer(unique_parameters(*sharded), adamw_options());
  torch::optim::AdamW reference_optimizer(unique_parameters(*reference), adamw_options());
  for (int step = 0; step < kSteps; ++step) {
    auto [inputs, targets] = make_batch(step);
    auto local_loss = loss_of(fsdp::forward(sharded, local_slice(inputs, context)), local_slice(targets, context));
    local_loss.backward();
    auto reference_loss = loss_of(reference->forward(inputs), targets);
    reference_loss.backward();
    // AdamW hardly notices a wrongly scaled gradient, so the reduction is checked directly.
    testing::expect_sharded_gradients_match(*sharded, *reference, what + ", step " + std::to_string(step));
    optimizer.step();
    optimizer.zero_grad();
    reference_optimizer.step();
    reference_optimizer.zero_grad();
    const double expected = reference_loss.template item<double>();
    EXPECT_NEAR(global_mean(context, local_loss), expected, 1e-5 * std::abs(expected) + 1e-7)
        << what << ": loss of step " << step;
  }
  expect_parameters_match(*sharded, *reference, what);
}

std::pair<torch::Tensor, torch::Tensor> mlp_batch(int step) {
  torch::manual_seed(1000 + step);
  return {torch::randn({kGlobalBatch, 3}), torch::randn({kGlobalBatch, 2})};
}

torch::Tensor mse(const torch::Tensor& output, const torch::Tensor& target) { return torch::mse_loss(output, target); }

void shard_mlp(testing::MlpStack& model, const DistributedContext& context, const FullyShardOptions& options) {
  fully_shard(model->input.ptr(), context, options);
  for (auto& block : model->blocks) fully_shard(block.ptr(), context, options);
  fully_shard(model.ptr(), context, options);
}

void shard_transformer(testing::TinyTransformer& model, const DistributedContext& context,
                       const FullyShardOptions& options) {
  for (auto& layer : model->layers) fully_shard(layer.ptr(), context, options);
  auto tail_options = options;
  tail_options.reshard_after_forward = false;
  fully_shard({model->norm.ptr(), model->embed_tokens.ptr()}, context, tail_options);
  fully_shard(model.ptr(), context, options);
}

void run_parity(const DistributedContext& context, const FullyShardOptions& options, const std::string& what = "") {
  {
    auto [reference, sharded] = testing::twin_models<testing::MlpStack>(7);
    shard_mlp(sharded, context, options);
    train_and_compare(context, sharded, reference, mlp_batch, mse, "MLP stack" + what);
  }
  {
    auto [reference, sharded] = testing::twin_models<testing::TinyTransformer>(8);
    shard_transformer(sharded, context, options);
    train_and_compare(
        context, sharded, reference, [](int step) { return token_batch(2000 + step, kGlobalBatch); }, next_token_loss,
        "transformer" + what);
  }
}

void run_parity(const DistributedContext& context, ShardingStrategy strategy) {
  FullyShardOptions options;
  options.sharding_strategy = strategy;
  run_parity(context, options);
}

struct StrategyCase {
  int world_size;
  ShardingStrategy strategy;
};

class FullyShardParity : public ::testing::TestWithParam<StrategyCase> {};

TEST_P(FullyShardParity, MatchesSingleProcessTraining) {
  const auto strategy = GetParam().strategy;
  testing::run_on_ranks(GetParam().world_size,
                        [strategy](const DistributedContext& context) { run_parity(context, strategy); });
}

std::vector<StrategyCase> strategy_cases() {
  std::vector<StrategyCase> cases;
  for (int world_size = 1; world_size <= 4; ++world_size) {
    for (auto strategy : {ShardingStrategy::kFullShard, ShardingStrategy::kShardGradOp, ShardingStrategy::kNoShard}) {
      cases.push_back({world_size, strategy});
    }
  }
  return cases;
}

INSTANTIATE_TEST_SUITE_P(Strategies, FullyShardParity, ::testing::ValuesIn(strategy_cases()),
                         [](const ::testing::TestParamInfo<StrategyCase>& info) {
                           std::string name = to_string(info.param.strategy);
                           name.erase(std::remove(name.begin(), name.end(), '_'), name.end());
                           return name + "_" + std::to_string(info.param.world_size) + "ranks";
                         });

TEST(FullyShard, HybridShardOnTwoSimulatedMachinesMatchesSingleProcess) {
  const auto options = testing::simulated_machines(2);
  testing::run_on_ranks(
      4,
      [](const DistributedContext& context) {
        run_parity(context, ShardingStrategy::kHybridShard);
        run_parity(context, ShardingStrategy::kHybridShardZero2);
      },
      options);
}

// An integer reshard_after_forward (FSDP2's int, hpZ): Note [resharding after forward to a smaller
// group]. Four ranks on two simulated machines, k = 2 = the ranks per machine: training equals
// single-process training; between forward and backward each unit holds its post-forward row (N/k
// padded shards of every parameter) and no unsharded buffer; backward's all-gathers run over the
// machine's two ranks only, each rank sending (k - 1) post-forward rows, and none runs on the world.
TEST(FullyShard, IntegerReshardAfterForwardTrainsLikeSingleProcessAndGathersBackwardInsideTheMachine) {
  testing::run_on_ranks(
      4,
      [](const DistributedContext& context) {
        FullyShardOptions options;
        options.reshard_after_forward = 2;
        run_parity(context, options, ", reshard_after_forward=2");

        torch::manual_seed(7);
        testing::MlpStack model;
        shard_mlp(model, context, options);
        const auto units = fsdp_modules(*model);
        const auto* group = detail::group_of(units.front()).post_forward_group();
        ASSERT_NE(group, nullptr);
        EXPECT_EQ(group->global_ranks(), context.intra_node().global_ranks());
        auto [inputs, targets] = mlp_batch(0);
        auto loss = mse(fsdp::forward(model, local_slice(inputs, context)), local_slice(targets, context));
        int64_t expected_sent = 0;
        for (const auto& unit : units) {
          const auto& unit_group = detail::group_of(unit);
          EXPECT_EQ(unit_group.sharded_state(), detail::ShardedState::kShardedPostForward) << unit.description();
          EXPECT_EQ(unit.unsharded_buffer_bytes(), 0) << unit.description();
          // Theory: factor = N / k = 2 padded shards of each parameter, each at a 16-byte boundary.
          int64_t row = 0;
          for (const auto& info : detail::sharded_parameters(unit)) {
            row = (row + 2 * info.layout.numel_padded_shard * 4 + 15) / 16 * 16;
            EXPECT_EQ(info.parameter.sizes(), at::IntArrayRef(info.layout.sharded_sizes)) << info.name;
          }
          EXPECT_EQ(unit_group.post_forward_bytes(), row) << unit.description();
          expected_sent += (2 - 1) * row;
        }
        group->reset_bytes_sent();
        context.world().start_trace();
        loss.backward();
        for (const auto& entry : context.world().stop_trace()) {
          EXPECT_EQ(entry.rfind("all_gather", 0), std::string::npos)
              << "an all-gather on the world in backward: " << entry;
        }
        EXPECT_EQ(group->bytes_sent().all_gather, expected_sent);
        for (const auto& unit : units) {
          EXPECT_EQ(detail::group_of(unit).sharded_state(), detail::ShardedState::kSharded) << unit.description();
          EXPECT_EQ(detail::group_of(unit).post_forward_bytes(), 0) << unit.description();
        }

        // A size that does not divide the shard group is named, on every rank.
        options.reshard_after_forward = 3;
        auto message = testing::error_message_of([&] { fully_shard(torch::nn::Linear(2, 2).ptr(), context, options); });
        EXPECT_NE(
            message.find("reshard_after_forward=3 must divide the size of the group that shards the unit, 4 ranks"),
            std::string::npos)
            << message;
      },
      testing::simulated_machines(2));
}

TEST(FullyShard, EachRankStoresOnlyItsShardOfParametersAndOptimizerState) {
  testing::run_on_ranks(3, [](const DistributedContext& context) {
    torch::manual_seed(7);
    testing::MlpStack model;
    const auto full_shapes = named_copies(*model);
    shard_mlp(model, context, {});
    int64_t stored = 0, unsharded_total = 0;
    for (const auto& unit : fsdp_modules(*model)) {
      for (const auto& info : detail::sharded_parameters(unit)) {
        // The parameter's own storage is its padded shard: nothing of the full tensor remains.
        EXPECT_EQ(info.parameter.sizes(), at::IntArrayRef(info.layout.sharded_sizes)) << info.name;
        EXPECT_EQ(static_cast<int64_t>(info.parameter.storage().nbytes()), info.layout.numel_padded_shard * 4)
            << info.name;
        stored += info.layout.numel_padded_shard;
        unsharded_total += info.layout.numel_unsharded();
      }
      EXPECT_EQ(unit.unsharded_buffer_bytes(), 0);
    }
    int64_t expected_total = 0;
    for (const auto& [name, tensor] : full_shapes) expected_total += tensor.numel();
    EXPECT_EQ(unsharded_total, expected_total);
    // About 1/N plus padding (each parameter pads to a multiple of N rows).
    EXPECT_LE(stored, expected_total / 3 + 60);

    torch::optim::AdamW optimizer(unique_parameters(*model), adamw_options());
    auto [inputs, targets] = mlp_batch(0);
    mse(fsdp::forward(model, local_slice(inputs, context)), local_slice(targets, context)).backward();
    optimizer.step();
    for (const auto& parameter : unique_parameters(*model)) {
      ASSERT_TRUE(parameter.grad().defined());
      EXPECT_EQ(parameter.grad().sizes(), parameter.sizes());
      auto& state = static_cast<torch::optim::AdamWParamState&>(*optimizer.state().at(optimizer_state_key(parameter)));
      EXPECT_EQ(state.exp_avg().numel(), parameter.numel());
      EXPECT_EQ(state.exp_avg_sq().numel(), parameter.numel());
    }
  });
}

TEST(FullyShard, FullShardFreesUnshardedParametersAfterForwardAndBackward) {
  testing::run_on_ranks(2, [](const DistributedContext& context) {
    torch::manual_seed(7);
    testing::MlpStack model;
    shard_mlp(model, context, {});
    auto [inputs, targets] = mlp_batch(0);
    auto loss = mse(fsdp::forward(model, local_slice(inputs, context)), local_slice(targets, context));
    for (const auto& unit : fsdp_modules(*model)) {
      if (unit.is_root()) {
        // FSDP2 keeps the root gathered: backward starts with it.
        EXPECT_GT(unit.unsharded_buffer_bytes(), 0);
        continue;
      }
      EXPECT_EQ(unit.unsharded_buffer_bytes(), 0) << unit.module()->name();
      for (const auto& info : detail::sharded_parameters(unit)) {
        EXPECT_EQ(info.parameter.sizes(), at::IntArrayRef(info.layout.sharded_sizes)) << info.name;
      }
    }
    loss.backward();
    for (const auto& unit : fsdp_modules(*model)) EXPECT_EQ(unit.unsharded_buffer_bytes(), 0);
  });
}

TEST(FullyShard, ShardGradOpKeepsParametersGatheredUntilBackward) {
  testing::run_on_ranks(2, [](const DistributedContext& context) {
    torch::manual_seed(7);
    testing::MlpStack model;
    FullyShardOptions options;
    options.sharding_strategy = ShardingStrategy::kShardGradOp;
    shard_mlp(model, context, options);
    auto [inputs, targets] = mlp_batch(0);
    auto loss = mse(fsdp::forward(model, local_slice(inputs, context)), local_slice(targets, context));
    for (const auto& unit : fsdp_modules(*model)) EXPECT_GT(unit.unsharded_buffer_bytes(), 0);
    loss.backward();
    for (const auto& unit : fsdp_modules(*model)) EXPECT_EQ(unit.unsharded_buffer_bytes(), 0);
  });
}

TEST(FullyShard, GradientAccumulationOverFourMicroStepsEqualsOneLargeBatch) {
  testing::run_on_ranks(2, [](const DistributedContext& context) {
    auto [reference, sharded] = testing::twin_models<testing::MlpStack>(7);
    shard_mlp(sharded, context, {});
    auto root = *fsdp_module_of(*sharded);
    torch::optim::AdamW optimizer(unique_parameters(*sharded), adamw_options());
    torch::optim::AdamW reference_optimizer(unique_parameters(*reference), adamw_options());
    for (int step = 0; step < 2; ++step) {
      torch::manual_seed(3000 + step);
      auto inputs = torch::randn({4 * kGlobalBatch, 3});
      auto targets = torch::randn({4 * kGlobalBatch, 2});
      for (int micro = 0; micro < 4; ++micro) {
        root.set_requires_gradient_sync(micro == 3);
        auto micro_inputs = local_slice(inputs.narrow(0, micro * kGlobalBatch, kGlobalBatch), context);
        auto micro_targets = local_slice(targets.narrow(0, micro * kGlobalBatch, kGlobalBatch), context);
        (mse(fsdp::forward(sharded, micro_inputs), micro_targets) / 4).backward();
        if (micro < 3) {
          // Nothing reduced yet: the sharded gradients are untouched.
          for (const auto& parameter : unique_parameters(*sharded)) {
            EXPECT_TRUE(!parameter.grad().defined() || parameter.grad().abs().sum().item<double>() == 0.0);
          }
        }
      }
      mse(reference->forward(inputs), targets).backward();
      testing::expect_sharded_gradients_match(*sharded, *reference, "accumulated gradients");
      optimizer.step();
      optimizer.zero_grad();
      reference_optimizer.step();
      reference_optimizer.zero_grad();
    }
    expect_parameters_match(*sharded, *reference, "accumulated");
  });
}

TEST(FullyShard, ClipGradNormEqualsSingleProcessNorm) {
  testing::run_on_ranks(3, [](const DistributedContext& context) {
    for (double norm_type : {2.0, std::numeric_limits<double>::infinity()}) {
      auto [reference, sharded] = testing::twin_models<testing::TinyTransformer>(9);
      shard_transformer(sharded, context, {});
      torch::optim::AdamW optimizer(unique_parameters(*sharded), adamw_options());
      torch::optim::AdamW reference_optimizer(unique_parameters(*reference), adamw_options());
      auto [inputs, targets] = token_batch(2000, kGlobalBatch);
      next_token_loss(fsdp::forward(sharded, local_slice(inputs, context)), local_slice(targets, context)).backward();
      next_token_loss(reference->forward(inputs), targets).backward();
      const double norm = fsdp::clip_grad_norm_(*sharded, 0.05, norm_type);
      const double expected = torch::nn::utils::clip_grad_norm_(unique_parameters(*reference), 0.05, norm_type);
      EXPECT_NEAR(norm, expected, 1e-5 * expected) << "norm type " << norm_type;
      EXPECT_GT(expected, 0.05) << "the test must actually clip";
      optimizer.step();
      reference_optimizer.step();
      expect_parameters_match(*sharded, *reference, "after clipping");
    }
  });
}

struct BranchImpl : torch::nn::Module {
  BranchImpl()
      : used(register_module("used", torch::nn::Linear(3, 2))),
        unused(register_module("unused", torch::nn::Linear(3, 5))) {}
  torch::Tensor forward(const torch::Tensor& input) { return fsdp::forward(used, input); }
  torch::nn::Linear used;
  torch::nn::Linear unused;
};
TORCH_MODULE(Branch);

struct TwoBranchesImpl : torch::nn::Module {
  TwoBranchesImpl() : first(register_module("first", Branch())), second(register_module("second", Branch())) {}
  torch::Tensor forward(const torch::Tensor& input) {
    return fsdp::forward(first, input) + fsdp::forward(second, input);
  }
  Branch first;
  Branch second;
};
TORCH_MODULE(TwoBranches);

TEST(FullyShard, UnusedParametersDoNotHangAndStayWithoutGradient) {
  testing::run_on_ranks(2, [](const DistributedContext& context) {
    auto [reference, sharded] = testing::twin_models<TwoBranches>(4);
    fully_shard(sharded->first.ptr(), context);
    fully_shard(sharded->second->unused.ptr(), context);  // a unit that never runs
    fully_shard(sharded.ptr(), context);
    torch::optim::AdamW optimizer(unique_parameters(*sharded), adamw_options());
    torch::optim::AdamW reference_optimizer(unique_parameters(*reference), adamw_options());
    for (int step = 0; step < 2; ++step) {
      auto [inputs, targets] = mlp_batch(step);
      mse(fsdp::forward(sharded, local_slice(inputs, context)), local_slice(targets, context)).backward();
      EXPECT_FALSE(sharded->first->unused->weight.grad().defined());
      EXPECT_FALSE(sharded->second->unused->weight.grad().defined());
      EXPECT_TRUE(sharded->first->used->weight.grad().defined());
      optimizer.step();
      optimizer.zero_grad();
      mse(reference->forward(inputs), targets).backward();
      reference_optimizer.step();
      reference_optimizer.zero_grad();
    }
    expect_parameters_match(*sharded, *reference, "with unused parameters");
  });
}

/// A frozen base layer plus a trainable low-rank adapter (LoRA): the base's backward still reads
/// the gathered weight after the adapter's gradients are ready.
struct AdaptedLinearImpl : torch::nn::Module {
  AdaptedLinearImpl()
      : base(register_module("base", torch::nn::Linear(3, 5))),
        down(register_module("down", torch::nn::Linear(torch::nn::LinearOptions(3, 2).bias(false)))),
        up(register_module("up", torch::nn::Linear(torch::nn::LinearOptions(2, 5).bias(false)))) {
    for (auto& parameter : base->parameters()) parameter.requires_grad_(false);
  }
  torch::Tensor forward(const torch::Tensor& input) {
    return fsdp::forward(base, input) + fsdp::forward(up, fsdp::forward(down, input));
  }
  torch::nn::Linear base, down, up;
};
TORCH_MODULE(AdaptedLinear);

struct AdaptedStackImpl : torch::nn::Module {
  AdaptedStackImpl()
      : first(register_module("first", AdaptedLinear())), head(register_module("head", torch::nn::Linear(5, 2))) {}
  torch::Tensor forward(const torch::Tensor& input) {
    // The block's input requires grad only through `pre`, so the block's post-backward trigger runs.
    auto hidden = fsdp::forward(first, input * pre);
    return fsdp::forward(head, torch::tanh(hidden));
  }
  AdaptedLinear first;
  torch::nn::Linear head;
  torch::Tensor pre = register_parameter("pre", torch::ones({3}));
};
TORCH_MODULE(AdaptedStack);

TEST(FullyShard, FrozenParametersInAUnitWithTrainableOnesTrainLikeSingleProcess) {
  testing::run_on_ranks(2, [](const DistributedContext& context) {
    auto [reference, sharded] = testing::twin_models<AdaptedStack>(5);
    fully_shard(sharded->first.ptr(), context);
    fully_shard(sharded.ptr(), context);
    train_and_compare(context, sharded, reference, mlp_batch, mse, "frozen base with adapter");
  });
}

/// One block applied twice (weight sharing): its backward runs twice before it may reduce.
struct SharedBlockTwiceImpl : torch::nn::Module {
  SharedBlockTwiceImpl()
      : input(register_module("input", torch::nn::Linear(3, 5))),
        block(register_module("block", testing::MlpBlock(5, 7))),
        head(register_module("head", torch::nn::Linear(5, 2))) {}
  torch::Tensor forward(const torch::Tensor& x) {
    auto hidden = fsdp::forward(input, x);
    hidden = fsdp::forward(block, fsdp::forward(block, hidden));
    return fsdp::forward(head, hidden);
  }
  torch::nn::Linear input;
  testing::MlpBlock block;
  torch::nn::Linear head;
};
TORCH_MODULE(SharedBlockTwice);

TEST(FullyShard, AUnitCalledTwicePerForwardTrainsLikeSingleProcess) {
  testing::run_on_ranks(3, [](const DistributedContext& context) {
    for (bool mixed_precision : {false, true}) {
      auto [reference, sharded] = testing::twin_models<SharedBlockTwice>(6);
      FullyShardOptions options;
      if (mixed_precision) {
        options.mp_policy.param_dtype = torch::kBFloat16;
        options.mp_policy.reduce_dtype = torch::kFloat;
      }
      fully_shard(sharded->block.ptr(), context, options);
      fully_shard(sharded.ptr(), context, options);
      if (!mixed_precision) {
        train_and_compare(context, sharded, reference, mlp_batch, mse, "block used twice");
        continue;
      }
      auto [inputs, targets] = mlp_batch(0);
      // bf16 compute: the gradients exist, have the sharded shapes and are close to fp32 ones.
      auto output = fsdp::forward(sharded, local_slice(inputs, context).to(torch::kBFloat16));
      mse(output.to(torch::kFloat), local_slice(targets, context)).backward();
      for (const auto& parameter : unique_parameters(*sharded)) {
        ASSERT_TRUE(parameter.grad().defined());
        EXPECT_EQ(parameter.grad().sizes(), parameter.sizes());
      }
    }
  });
}

TEST(FullyShard, AStepWhoseBackwardThrowsDoesNotBreakTheNextStep) {
  testing::run_on_ranks(2, [](const DistributedContext& context) {
    auto [reference, sharded] = testing::twin_models<testing::MlpStack>(7);
    shard_mlp(sharded, context, {});
    {
      auto [inputs, targets] = mlp_batch(0);
      auto loss = mse(fsdp::forward(sharded, local_slice(inputs, context)), local_slice(targets, context));
      auto hidden = loss * 1.0;
      hidden.register_hook([](const torch::Tensor&) -> torch::Tensor { TORCH_CHECK(false, "a failing hook"); });
      EXPECT_NE(testing::error_message_of([&] { hidden.backward(); }).find("a failing hook"), std::string::npos);
    }
    // The failed step left nothing behind: training continues exactly like single-process training.
    train_and_compare(context, sharded, reference, mlp_batch, mse, "after a failed backward");
  });
}

/// Ranks take different branches inside one unit (data-dependent parameter use).
struct RankBranchesImpl : torch::nn::Module {
  RankBranchesImpl()
      : a(register_module("a", torch::nn::Linear(3, 4))),
        b(register_module("b", torch::nn::Linear(3, 4))),
        head(register_module("head", torch::nn::Linear(4, 2))) {}
  torch::Tensor forward(const torch::Tensor& x, int64_t branch) {
    return fsdp::forward(head, torch::relu(branch == 0 ? fsdp::forward(a, x) : fsdp::forward(b, x)));
  }
  torch::nn::Linear a, b, head;
};
TORCH_MODULE(RankBranches);

struct BranchesModelImpl : torch::nn::Module {
  BranchesModelImpl() : inner(register_module("inner", RankBranches())) {}
  torch::Tensor forward(const torch::Tensor& x, int64_t branch) { return fsdp::forward(inner, x * scale, branch); }
  RankBranches inner;
  torch::Tensor scale = register_parameter("scale", torch::ones({3}));
};
TORCH_MODULE(BranchesModel);

TEST(FullyShard, RanksUsingDifferentParametersOfAUnitAgreeOnTheCollectives) {
  testing::run_on_ranks(2, [](const DistributedContext& context) {
    auto [reference, sharded] = testing::twin_models<BranchesModel>(8);
    fully_shard(sharded->inner.ptr(), context);
    fully_shard(sharded.ptr(), context);
    auto [inputs, targets] = mlp_batch(0);
    mse(fsdp::forward(sharded, local_slice(inputs, context), context.rank()), local_slice(targets, context)).backward();
    // Single process: the average of what each rank computed.
    torch::Tensor reference_loss = torch::zeros({});
    for (int64_t rank = 0; rank < 2; ++rank) {
      reference_loss = reference_loss +
                       mse(reference->forward(inputs.narrow(0, rank * 6, 6), rank), targets.narrow(0, rank * 6, 6)) / 2;
    }
    reference_loss.backward();
    testing::expect_sharded_gradients_match(*sharded, *reference, "different branches");
  });
}

void expect_mixed_precision_trains(c10::ScalarType param_dtype) {
  testing::run_on_ranks(2, [param_dtype](const DistributedContext& context) {
    auto [reference, sharded] = testing::twin_models<testing::MlpStack>(7);
    FullyShardOptions options;
    options.mp_policy.param_dtype = param_dtype;
    options.mp_policy.reduce_dtype = torch::kFloat;
    shard_mlp(sharded, context, options);
    auto [inputs, targets] = mlp_batch(0);
    auto output = fsdp::forward(sharded, local_slice(inputs, context));
    EXPECT_EQ(output.scalar_type(), param_dtype);
    auto loss = mse(output.to(torch::kFloat), local_slice(targets, context));
    loss.backward();
    for (const auto& parameter : unique_parameters(*sharded)) {
      EXPECT_EQ(parameter.scalar_type(), torch::kFloat);
      ASSERT_TRUE(parameter.grad().defined());
      EXPECT_EQ(parameter.grad().scalar_type(), torch::kFloat);
    }
    const double expected = mse(reference->forward(inputs), targets).item<double>();
    EXPECT_NEAR(global_mean(context, loss), expected, 0.02 * expected);
  });
}

TEST(FullyShard, MixedPrecisionComputesInBfloat16AndKeepsFp32Shards) {
  expect_mixed_precision_trains(torch::kBFloat16);
}

// libtorch 2.x multiplies fp16 matrices on CPU (1.13 had no addmm for Half).
TEST(FullyShard, MixedPrecisionComputesInFloat16AndKeepsFp32Shards) { expect_mixed_precision_trains(torch::kHalf); }

TEST(FullyShard, EvaluationWithoutGradFreesEveryUnitIncludingTheRoot) {
  testing::run_on_ranks(2, [](const DistributedContext& context) {
    torch::manual_seed(7);
    testing::MlpStack model;
    shard_mlp(model, context, {});
    torch::NoGradGuard no_grad;
    auto [inputs, targets] = mlp_batch(0);
    auto output = fsdp::forward(model, local_slice(inputs, context));
    EXPECT_EQ(output.size(0), kGlobalBatch / 2);
    for (const auto& unit : fsdp_modules(*model)) EXPECT_EQ(unit.unsharded_buffer_bytes(), 0);

    // A tied output head outside the embedding's unit still sees the gathered weight.
    auto [reference, sharded] = testing::twin_models<testing::TinyTransformer>(9);
    shard_transformer(sharded, context, {});
    auto [tokens, unused] = token_batch(2000, kGlobalBatch);
    EXPECT_TRUE(tensors_close(fsdp::forward(sharded, tokens), reference->forward(tokens)));
    for (const auto& unit : fsdp_modules(*sharded)) EXPECT_EQ(unit.unsharded_buffer_bytes(), 0);
  });
}

TEST(FullyShard, OptionsAndMisuseGiveClearErrors) {
  FullyShardOptions options;
  options.mp_policy.param_dtype = torch::kInt;
  auto message = testing::error_message_of([&] { validate(options); });
  EXPECT_NE(message.find("param_dtype must be a floating dtype"), std::string::npos) << message;

  auto context = DistributedContext::initialize(DistributedEnvironment{});
  torch::nn::Linear linear(3, 4);
  fully_shard(linear.ptr(), context);
  message = testing::error_message_of([&] { fully_shard(linear.ptr(), context); });
  EXPECT_NE(message.find("is already an FSDP unit"), std::string::npos) << message;
}

// Engine errors say which rank raised them, and units are named by their module path in the model
// once the root is known (FSDP2's naming), by their class before.
TEST(FullyShard, ErrorsNameTheRankAndUnitsByModulePath) {
  testing::run_on_ranks(2, [](const DistributedContext& context) {
    torch::manual_seed(0);
    testing::TinyTransformer model;
    for (auto& layer : model->layers) fully_shard(layer.ptr(), context);
    fully_shard(model.ptr(), context);
    const auto layer = *fsdp_module_of(*model->layers[1]);
    EXPECT_EQ(layer.description(), "FSDP unit over fsdp::testing::TransformerBlockImpl");
    layer.lazy_init();
    EXPECT_EQ(layer.description(), "FSDP unit layers_1 (fsdp::testing::TransformerBlockImpl)");
    EXPECT_EQ(fsdp_module_of(*model)->description(), "FSDP unit <root> (fsdp::testing::TinyTransformerImpl)");
    auto loss = fsdp::forward(model, torch::randint(0, 11, {2, 5})).sum();
    auto message = testing::error_message_of([&] { clip_grad_norm_(*model, 1.0); });
    const std::string rank = "[rank " + std::to_string(context.rank()) + "] ";
    EXPECT_EQ(message.rfind(rank + "clip_grad_norm_: a forward", 0), 0u) << message;
    loss.backward();
    // Argument errors too.
    message = testing::error_message_of([&] { clip_grad_norm_(*model, -1.0); });
    EXPECT_EQ(message.rfind(rank + "clip_grad_norm_: max_norm must be non-negative", 0), 0u) << message;
    message = testing::error_message_of([&] { fully_shard(model->layers[0].ptr(), context); });
    EXPECT_EQ(message.rfind(rank + "fully_shard: ", 0), 0u) << message;
    EXPECT_NE(message.find("is already an FSDP unit"), std::string::npos) << message;
    FullyShardOptions options;
    options.mp_policy.reduce_dtype = torch::kLong;
    message = testing::error_message_of([&] { fully_shard(torch::nn::Linear(2, 2).ptr(), context, options); });
    EXPECT_EQ(message.rfind(rank + "fully_shard: FullyShardOptions.mp_policy.reduce_dtype must be a floating", 0), 0u)
        << message;
  });
}

// What users hold: a ModuleList's elements (std::shared_ptr<torch::nn::Module>, through forward_as),
// a temporary std::shared_ptr, a ModuleHolder. A unit called directly, without fsdp::forward,
// computes with its shard: the error ATen raises then names that unit (and not the one before it,
// which ran through fsdp::forward and resharded) and says to call it through fsdp::forward.
struct ListedBlockImpl : torch::nn::Module {
  ListedBlockImpl() : norm(register_module("norm", torch::nn::LayerNorm(torch::nn::LayerNormOptions({8})))) {}
  torch::Tensor forward(const torch::Tensor& x) { return x + norm(x); }
  torch::nn::LayerNorm norm;
};
struct ListedModelImpl : torch::nn::Module {
  ListedModelImpl() : blocks(register_module("blocks", torch::nn::ModuleList())) {
    for (int index = 0; index < 3; ++index) blocks->push_back(std::make_shared<ListedBlockImpl>());
  }
  torch::Tensor forward(const torch::Tensor& x) {
    auto hidden = fsdp::forward_as<ListedBlockImpl>(blocks[0], x);
    hidden = call_second_directly ? blocks->ptr<ListedBlockImpl>(1)->forward(hidden)
                                  : fsdp::forward(blocks->ptr<ListedBlockImpl>(1), hidden);
    return fsdp::forward_as<ListedBlockImpl>(blocks[2], hidden);
  }
  torch::nn::ModuleList blocks;
  bool call_second_directly = false;
};
TORCH_MODULE(ListedModel);

TEST(FullyShard, ForwardTakesWhatUsersHoldAndAUnitCalledDirectlyIsNamed) {
  testing::run_on_ranks(2, [](const DistributedContext& context) {
    torch::manual_seed(0);
    ListedModel model;
    for (size_t index = 0; index < model->blocks->size(); ++index) fully_shard(model->blocks[index], context);
    fully_shard(model.ptr(), context);
    const auto input = torch::randn({2, 8});
    fsdp::forward(model, input).sum().backward();  // forward_as, a temporary shared_ptr, a holder
    auto message = testing::error_message_of([&] { fsdp::forward_as<torch::nn::LinearImpl>(model->blocks[0], input); });
    EXPECT_NE(message.find("the module is a "), std::string::npos) << message;
    EXPECT_NE(message.find("ListedBlockImpl, not a torch::nn::LinearImpl"), std::string::npos) << message;
    model->call_second_directly = true;
    message = testing::error_message_of([&] { fsdp::forward(model, input); });
    EXPECT_NE(message.find("where these units hold only their shards: FSDP unit blocks.1 ("), std::string::npos)
        << message;
    EXPECT_EQ(message.find("FSDP unit blocks.0 ("), std::string::npos)
        << "blocks.0 ran through fsdp::forward: " << message;
    EXPECT_NE(message.find("call each unit through fsdp::forward(block, x)"), std::string::npos) << message;
  });
}

// One iteration as each unit sees it (FSDP2's TrainingState): FORWARD from the root's first forward
// with grad until backward reaches the unit, PRE_BACKWARD while its backward runs, POST_BACKWARD
// once reduced, IDLE after the iteration; a forward without grad starts no iteration.
TEST(FullyShard, EachUnitWalksTheTrainingStatesOfAnIteration) {
  auto context = DistributedContext::initialize(DistributedEnvironment{});
  torch::manual_seed(0);
  testing::TinyTransformer model;
  for (auto& layer : model->layers) fully_shard(layer.ptr(), context);
  fully_shard(model.ptr(), context);
  auto state_of = [](const torch::nn::Module& module) {
    return std::string(detail::to_string(detail::group_of(*fsdp_module_of(module)).training_state()));
  };
  const auto tokens = torch::randint(0, 11, {2, 5});
  {
    torch::NoGradGuard no_grad;
    fsdp::forward(model, tokens);
  }
  EXPECT_EQ(state_of(*model->layers[0]), "IDLE");
  auto loss = fsdp::forward(model, tokens).sum();
  EXPECT_EQ(state_of(*model->layers[0]), "FORWARD");
  EXPECT_EQ(state_of(*model), "FORWARD");
  // A hook on a weight of layer 0 runs inside layer 0's backward, after layer 1 was reduced.
  std::vector<std::string> seen_in_backward;
  auto hook = model->layers[0]->parameters()[0].register_hook(
      [&](const torch::Tensor&) { seen_in_backward = {state_of(*model->layers[0]), state_of(*model->layers[1])}; });
  loss.backward();
  model->layers[0]->parameters()[0].remove_hook(hook);
  EXPECT_EQ(seen_in_backward, (std::vector<std::string>{"PRE_BACKWARD", "POST_BACKWARD"}));
  EXPECT_EQ(state_of(*model->layers[0]), "IDLE");
  EXPECT_EQ(state_of(*model->layers[1]), "IDLE");
  EXPECT_EQ(state_of(*model), "IDLE");
}

}  // namespace
}  // namespace fsdp

namespace fsdp {
namespace {

// sync_module_states makes rank 0's values every rank's, whatever the others hold: here rank 2's
// parameters have no memory at all (as after release_parameter_storage on a rank that is not 0) and
// rank 1's hold other values. Every rank issues the same broadcasts, so nothing aborts in Gloo.
TEST(FullyShard, SyncModuleStatesGivesEveryRankRankZerosValuesEvenWithoutStorage) {
  testing::run_on_ranks(3, [](const DistributedContext& context) {
    torch::manual_seed(7);
    testing::TinyTransformer reference;
    const auto expected = named_copies(*reference);
    torch::manual_seed(context.rank() == 0 ? 7 : 70 + context.rank());
    testing::TinyTransformer model;
    if (context.rank() == 2) release_parameter_storage(*model);
    FullyShardOptions options;
    options.fsdp1.sync_module_states = true;
    for (auto& layer : model->layers) fully_shard(layer.ptr(), context, options);
    fully_shard(model.ptr(), context, options);
    const auto actual = full_parameters(*model);
    for (const auto& [name, tensor] : expected) EXPECT_TRUE(torch::equal(actual.at(name), tensor)) << name;
  });
}

TEST(FullyShard, SyncModuleStatesWithoutValuesOnRankZeroIsAnErrorOnEveryRank) {
  testing::run_on_ranks(2, [](const DistributedContext& context) {
    testing::TinyTransformer model;
    if (context.rank() == 0) release_parameter_storage(*model);
    FullyShardOptions options;
    options.fsdp1.sync_module_states = true;
    const auto message = testing::error_message_of([&] { fully_shard(model->layers[0].ptr(), context, options); });
    EXPECT_EQ(
        message.rfind("[rank " + std::to_string(context.rank()) + "] fully_shard(sync_module_states): parameter '", 0),
        0u)
        << message;
    EXPECT_NE(message.find("holds no values on rank 0, the source of sync_module_states"), std::string::npos)
        << message;
  });
}

}  // namespace
}  // namespace fsdp

namespace fsdp {
namespace {

// Gradients accumulate across backwards without zero_grad, as in single-process training, also for
// a 0-dim parameter (its sharded gradient keeps shape [] on one shard).
struct ScaledLinearImpl : torch::nn::Module {
  ScaledLinearImpl() {
    linear = register_module("linear", torch::nn::Linear(3, 2));
    scale = register_parameter("scale", torch::tensor(1.5));
  }
  torch::Tensor forward(const torch::Tensor& input) { return linear->forward(input) * scale; }
  torch::nn::Linear linear{nullptr};
  torch::Tensor scale;
};
TORCH_MODULE(ScaledLinear);

TEST(FullyShard, GradientsAccumulateAcrossBackwardsWithoutZeroGradScalarsIncluded) {
  for (const int ranks : {1, 2}) {
    testing::run_on_ranks(ranks, [](const DistributedContext& context) {
      torch::manual_seed(4);
      ScaledLinear reference;
      torch::manual_seed(4);
      ScaledLinear model;
      fully_shard(model.ptr(), context);
      for (int step = 0; step < 2; ++step) {
        torch::manual_seed(40 + step);
        auto input = torch::randn({4, 3});
        const int64_t local = 4 / context.world_size();
        fsdp::forward(model, input.narrow(0, context.rank() * local, local)).sum().backward();
        reference->forward(input).sum().backward();
      }
      // The reference sums over the whole batch; FSDP averages over ranks, so scale it back.
      const auto& layout = detail::sharded_parameters(*fsdp_module_of(*model));
      // Held: find() points into the dict, which a temporary would free at once (found by ASan).
      const auto reference_parameters = reference->named_parameters();
      for (const auto& parameter : layout) {
        const auto* expected = reference_parameters.find(parameter.name);
        ASSERT_NE(expected, nullptr) << parameter.name;
        auto full = expected->grad().reshape({-1}) / context.world_size();
        auto mine = parameter.parameter.grad().reshape({-1});
        auto rows = full.narrow(0, parameter.layout.element_offset(), parameter.layout.numel_owned);
        EXPECT_TRUE(torch::allclose(mine, rows, 1e-5, 1e-6))
            << parameter.name << " on " << context.world_size() << " ranks";
        EXPECT_EQ(parameter.parameter.grad().sizes(), parameter.parameter.sizes()) << parameter.name;
      }
    });
  }
}

}  // namespace
}  // namespace fsdp
