// Accelerator::prepare and fsdp2_prepare_model: the seed's unit layout, the optimizer switch, and
// training that matches single-process libtorch.
#include <fsdp/fsdp.h>
#include <fsdp/models/llama.h>
#include <gtest/gtest.h>
#include <torch/torch.h>
#include <unistd.h>

#include <filesystem>

#include "harness/error_message.h"
#include "harness/multi_rank.h"
#include "harness/parity.h"
#include "harness/test_models.h"

namespace fsdp {
namespace {

using testing::tensors_close;
using testing::unique_parameters;

Accelerator make_accelerator(const DistributedContext& context, const std::string& auto_wrap = "transformer_based_wrap",
                             const std::string& mixed_precision = "no", int64_t version = 2) {
  FullyShardedDataParallelPluginArgs args;
  args.fsdp_version = version;
  args.auto_wrap_policy = auto_wrap;
  AcceleratorOptions options;
  options.fsdp_plugin = FullyShardedDataParallelPlugin(args, EnvironmentMap{});
  options.mixed_precision = mixed_precision;
  return Accelerator(context, options, EnvironmentMap{});
}

std::vector<std::string> unit_names(torch::nn::Module& model) {
  std::vector<std::string> names;
  for (const auto& unit : fsdp_modules(model)) names.push_back(unit.module()->name());
  return names;
}

void train_prepared_and_compare(const DistributedContext& context, bool tied, bool activation_checkpointing = false,
                                int64_t version = 2) {
  torch::manual_seed(21);
  testing::TinyTransformer reference(tied);
  torch::manual_seed(21);
  testing::TinyTransformer model(tied);
  auto accelerator = make_accelerator(context, "transformer_based_wrap", "no", version);
  accelerator.fsdp_plugin().activation_checkpointing = activation_checkpointing;
  torch::optim::AdamW optimizer(unique_parameters(*model), torch::optim::AdamWOptions(1e-2).weight_decay(0.1));
  torch::optim::AdamW reference_optimizer(unique_parameters(*reference),
                                          torch::optim::AdamWOptions(1e-2).weight_decay(0.1));
  accelerator.prepare(model, optimizer);

  // Version 2: blocks bottom-up, then the input embedding (untied only), then the tail, then the
  // root. Version 1 (FSDP1): the blocks, then the root.
  const std::string block = "fsdp::testing::TransformerBlockImpl";
  if (version == 1) {
    EXPECT_EQ(unit_names(*model), (std::vector<std::string>{block, block, "fsdp::testing::TinyTransformerImpl"}));
    EXPECT_FALSE(is_fsdp_module(*model->embed_tokens));
    EXPECT_FALSE(is_fsdp_module(*model->norm));
  } else if (tied) {
    EXPECT_EQ(unit_names(*model), (std::vector<std::string>{block, block, "torch::nn::LayerNormImpl",
                                                            "fsdp::testing::TinyTransformerImpl"}));
    EXPECT_TRUE(is_fsdp_module(*model->embed_tokens));
    EXPECT_FALSE(is_fsdp_module(*model->lm_head));
  } else {
    EXPECT_EQ(unit_names(*model),
              (std::vector<std::string>{block, block, "torch::nn::EmbeddingImpl", "torch::nn::LayerNormImpl",
                                        "fsdp::testing::TinyTransformerImpl"}));
    EXPECT_TRUE(is_fsdp_module(*model->lm_head));
  }
  EXPECT_EQ(model->lm_head->weight.unsafeGetTensorImpl() == model->embed_tokens->weight.unsafeGetTensorImpl(), tied);
  // Accelerate's fsdp2_apply_ac: the children of each block the policy selects, not the block;
  // FSDP1's apply_activation_checkpointing: the block itself.
  for (const auto& layer : model->layers) {
    EXPECT_EQ(is_checkpointed(*layer), activation_checkpointing && version == 1);
    for (const auto& child : layer->children())
      EXPECT_EQ(is_checkpointed(*child), activation_checkpointing && version == 2);
  }
  EXPECT_FALSE(is_checkpointed(*model->embed_tokens));
  // The optimizer steps the model's own (sharded) parameters.
  std::unordered_set<const c10::TensorImpl*> model_parameters;
  for (const auto& parameter : model->parameters()) model_parameters.insert(parameter.unsafeGetTensorImpl());
  for (const auto& parameter : optimizer.param_groups().at(0).params()) {
    EXPECT_TRUE(model_parameters.count(parameter.unsafeGetTensorImpl()));
  }
  EXPECT_EQ(optimizer.param_groups().at(0).params().size(), unique_parameters(*model).size());

  for (int step = 0; step < 3; ++step) {
    torch::manual_seed(500 + step);
    auto tokens = torch::randint(0, 11, {12, 6});
    auto inputs = tokens.narrow(1, 0, 5), targets = tokens.narrow(1, 1, 5);
    auto loss_of = [](const torch::Tensor& logits, const torch::Tensor& labels) {
      return torch::nn::functional::cross_entropy(logits.reshape({-1, 11}), labels.reshape({-1}));
    };
    const int64_t local = 12 / context.world_size();
    auto loss = loss_of(fsdp::forward(model, inputs.narrow(0, context.rank() * local, local)),
                        targets.narrow(0, context.rank() * local, local));
    loss.backward();
    optimizer.step();
    optimizer.zero_grad();
    loss_of(reference->forward(inputs), targets).backward();
    reference_optimizer.step();
    reference_optimizer.zero_grad();
  }
  auto actual = testing::full_parameters(*model);
  for (const auto& [name, expected] : testing::named_copies(*reference)) {
    EXPECT_TRUE(tensors_close(actual.at(name), expected)) << (tied ? "tied: " : "untied: ") << name;
  }
}

TEST(Fsdp2PrepareModel, PluginAutoWrapPolicyFollowsAccelerate) {
  testing::TinyTransformer model;
  FullyShardedDataParallelPluginArgs args;
  args.fsdp_version = int64_t{2};
  args.auto_wrap_policy = std::string("transformer_based_wrap");
  FullyShardedDataParallelPlugin plugin(args, EnvironmentMap{});
  // No class names configured: the model's no_split_modules().
  auto policy = fsdp2_prepare_auto_wrap_policy(plugin, model.ptr());
  ASSERT_TRUE(policy);
  EXPECT_EQ(modules_to_wrap(model.ptr(), *policy).size(), 2u);
  plugin.transformer_cls_names_to_wrap = std::vector<std::string>{"LayerNorm"};
  EXPECT_EQ(modules_to_wrap(model.ptr(), *fsdp2_prepare_auto_wrap_policy(plugin, model.ptr())).size(), 5u);
  plugin.auto_wrap_policy = AutoWrapKind::kNoWrap;
  EXPECT_FALSE(fsdp2_prepare_auto_wrap_policy(plugin, model.ptr()));
}

TEST(Fsdp2PrepareModel, TiedModelTrainsLikeSingleProcessOnTwoRanks) {
  testing::run_on_ranks(2, [](const DistributedContext& context) { train_prepared_and_compare(context, true); });
}

TEST(Fsdp2PrepareModel, UntiedModelTrainsLikeSingleProcessOnThreeRanks) {
  testing::run_on_ranks(3, [](const DistributedContext& context) { train_prepared_and_compare(context, false); });
}

TEST(Fsdp2PrepareModel, ActivationCheckpointingOfBlockChildrenTrainsLikeSingleProcess) {
  testing::run_on_ranks(2, [](const DistributedContext& context) { train_prepared_and_compare(context, true, true); });
}

TEST(Fsdp2PrepareModel, VersionOneCheckpointsTheBlocksThemselvesAndTrainsLikeSingleProcess) {
  testing::run_on_ranks(2,
                        [](const DistributedContext& context) { train_prepared_and_compare(context, true, true, 1); });
}

TEST(Fsdp2PrepareModel, VersionOneShardsTheUntiedModelLikeFsdp1AndTrainsLikeSingleProcess) {
  testing::run_on_ranks(
      3, [](const DistributedContext& context) { train_prepared_and_compare(context, false, false, 1); });
}

// Which dtype a unit's forward receives: FSDP1 casts the root's floating inputs to param_dtype only
// (cast_root_forward_inputs); FSDP2 casts every unit's (cast_forward_inputs).
struct RecordingBlockImpl : torch::nn::Module {
  RecordingBlockImpl() : fc(register_module("fc", torch::nn::Linear(4, 4))) {}
  torch::Tensor forward(const torch::Tensor& x) {
    seen = x.scalar_type();
    return fsdp::forward(fc, x.to(fc->weight.scalar_type()));
  }
  torch::nn::Linear fc;
  c10::ScalarType seen = c10::kDouble;
};
TORCH_MODULE(RecordingBlock);

struct CastProbeImpl : torch::nn::Module {
  CastProbeImpl()
      : block(register_module("block", RecordingBlock())), head(register_module("head", torch::nn::Linear(4, 2))) {}
  torch::Tensor forward(const torch::Tensor& x) {
    seen = x.scalar_type();
    // A float32 tensor made inside the root reaches the block as it is under FSDP1.
    return fsdp::forward(head, fsdp::forward(block, x.to(torch::kFloat)).to(head->weight.scalar_type()));
  }
  RecordingBlock block;
  torch::nn::Linear head;
  c10::ScalarType seen = c10::kDouble;
};
TORCH_MODULE(CastProbe);

TEST(Fsdp2PrepareModel, VersionOneCastsOnlyTheRootsInputsAsFsdp1) {
  testing::run_on_ranks(2, [](const DistributedContext& context) {
    for (const int64_t version : {int64_t{1}, int64_t{2}}) {
      CastProbe model;
      FullyShardedDataParallelPluginArgs args;
      args.fsdp_version = version;
      args.auto_wrap_policy = std::string("transformer_based_wrap");
      args.transformer_cls_names_to_wrap = std::string("RecordingBlock");
      AcceleratorOptions options;
      options.fsdp_plugin = FullyShardedDataParallelPlugin(args, EnvironmentMap{});
      options.mixed_precision = "bf16";
      Accelerator accelerator(context, options, EnvironmentMap{});
      torch::optim::AdamW optimizer(unique_parameters(*model));
      accelerator.prepare(model, optimizer);
      EXPECT_EQ(unit_names(*model).size(), 2u) << "version " << version;
      fsdp::forward(model, torch::randn({3, 4})).sum().backward();
      EXPECT_EQ(model->seen, torch::kBFloat16) << "version " << version << ": the root casts its inputs";
      EXPECT_EQ(model->block->seen, version == 1 ? torch::kFloat : torch::kBFloat16) << "version " << version;
    }
  });
}

void expect_prepare_upcasts_to_fp32(const std::string& mixed_precision, c10::ScalarType dtype) {
  auto context = DistributedContext::initialize(DistributedEnvironment{});
  testing::MlpStack model;
  model->to(dtype);
  auto accelerator = make_accelerator(context, "no_wrap", mixed_precision);
  ASSERT_TRUE(accelerator.fsdp_plugin().mixed_precision_policy);
  EXPECT_EQ(*accelerator.fsdp_plugin().mixed_precision_policy->param_dtype, dtype);
  torch::optim::AdamW optimizer(unique_parameters(*model));
  accelerator.prepare(model, optimizer);
  for (const auto& parameter : model->parameters()) EXPECT_EQ(parameter.scalar_type(), torch::kFloat);
  auto output = fsdp::forward(model, torch::randn({4, 3}));
  EXPECT_EQ(output.scalar_type(), dtype);  // output_dtype = the precision, as Accelerate sets it
  output.to(torch::kFloat).pow(2).mean().backward();
  optimizer.step();
  for (const auto& parameter : model->parameters()) {
    ASSERT_TRUE(parameter.grad().defined());
    EXPECT_EQ(parameter.grad().scalar_type(), torch::kFloat);
  }
}

TEST(Fsdp2PrepareModel, MixedPrecisionUpcastsTrainableParametersToFp32) {
  expect_prepare_upcasts_to_fp32("bf16", torch::kBFloat16);
}

// fp16 on CPU, as Accelerate runs it there: no GradScaler (Accelerate makes one on GPUs only).
TEST(Fsdp2PrepareModel, Fp16MixedPrecisionRunsOnCpu) { expect_prepare_upcasts_to_fp32("fp16", torch::kHalf); }

// cpu_ram_efficient_loading and sync_module_states: every rank ends with rank 0's weights, under
// both versions and on 2 and 3 ranks. Version 1 with efficient loading once aborted rank 1 in Gloo
// (`op.preamble.length <= op.nbytes`): its forced sync skipped parameters whose storage was
// released, so the ranks issued different broadcasts. Efficient loading now loads from rank 0
// instead of syncing at fully_shard; the sync of released parameters itself is covered by
// FullyShard.SyncModuleStatesGivesEveryRankRankZerosValuesEvenWithoutStorage.
// With `meta`, the ranks other than 0 build the model on the meta device (MetaDeviceGuard), holding
// no memory until their shards arrive.
struct LoadingCase {
  int64_t version;
  int ranks;
  bool efficient_loading;
  bool sync_module_states;
  bool meta = false;
};

// A stable test name for ctest (CMake appends the printed parameter).
void PrintTo(const LoadingCase& value, std::ostream* out) {
  *out << "version " << value.version << ", " << value.ranks << " ranks";
}

class RankZerosWeights : public ::testing::TestWithParam<LoadingCase> {};

TEST_P(RankZerosWeights, EveryRankEndsWithRankZerosWeights) {
  const auto parameters = GetParam();
  testing::run_on_ranks(parameters.ranks, [parameters](const DistributedContext& context) {
    torch::manual_seed(41);
    testing::TinyTransformer rank_zero_model;
    const auto expected = testing::named_copies(*rank_zero_model);
    // Every other rank starts from different weights: only rank 0's may survive.
    torch::manual_seed(context.rank() == 0 ? 41 : 100 + context.rank());
    testing::TinyTransformer model{nullptr};
    if (parameters.meta && context.rank() != 0) {
      MetaDeviceGuard meta;
      model = testing::TinyTransformer();
    } else {
      model = testing::TinyTransformer();
    }
    FullyShardedDataParallelPluginArgs args;
    args.fsdp_version = parameters.version;
    args.auto_wrap_policy = std::string("transformer_based_wrap");
    args.cpu_ram_efficient_loading = std::string(parameters.efficient_loading ? "true" : "false");
    if (parameters.version == 1)
      args.sync_module_states = std::string(parameters.sync_module_states ? "true" : "false");
    AcceleratorOptions options;
    options.fsdp_plugin = FullyShardedDataParallelPlugin(args, EnvironmentMap{});
    Accelerator accelerator(context, options, EnvironmentMap{});
    torch::optim::AdamW optimizer(unique_parameters(*model));
    accelerator.prepare(model, optimizer);
    const auto actual = testing::full_parameters(*model);
    for (const auto& [name, tensor] : expected) EXPECT_TRUE(torch::equal(actual.at(name), tensor)) << name;
  });
}

INSTANTIATE_TEST_SUITE_P(Loading, RankZerosWeights,
                         ::testing::Values(LoadingCase{2, 3, true, false}, LoadingCase{2, 2, true, false},
                                           LoadingCase{1, 2, true, true}, LoadingCase{1, 3, true, true},
                                           LoadingCase{1, 2, false, true}, LoadingCase{1, 3, false, true},
                                           LoadingCase{2, 3, true, false, true}, LoadingCase{2, 2, true, false, true},
                                           LoadingCase{1, 3, true, true, true}, LoadingCase{1, 2, false, true, true},
                                           LoadingCase{1, 3, false, true, true}),
                         [](const ::testing::TestParamInfo<LoadingCase>& info) {
                           std::string name = "V";
                           name +=
                               std::to_string(info.param.version) + "_" + std::to_string(info.param.ranks) + "ranks";
                           if (info.param.efficient_loading) name += "_EfficientLoading";
                           if (info.param.sync_module_states) name += "_SyncModuleStates";
                           if (info.param.meta) name += "_MetaOnOtherRanks";
                           return name;
                         });

TEST(AcceleratorPrepare, RejectsAnOptimizerThatSteppedOrHoldsForeignParameters) {
  auto context = DistributedContext::initialize(DistributedEnvironment{});
  {
    testing::MlpStack model;
    torch::optim::SGD optimizer(unique_parameters(*model), torch::optim::SGDOptions(0.1).momentum(0.9));
    model->forward(torch::randn({2, 3})).sum().backward();
    optimizer.step();
    auto accelerator = make_accelerator(context, "no_wrap");
    auto message = testing::error_message_of([&] { accelerator.prepare(model, optimizer); });
    EXPECT_NE(message.find("the optimizer has already stepped"), std::string::npos) << message;
  }
  {
    testing::MlpStack model;
    auto foreign = torch::zeros({3}, torch::requires_grad());
    auto parameters = unique_parameters(*model);
    parameters.push_back(foreign);
    torch::optim::AdamW optimizer(parameters);
    auto accelerator = make_accelerator(context, "no_wrap");
    auto message = testing::error_message_of([&] { accelerator.prepare(model, optimizer); });
    EXPECT_NE(message.find("couldn't be switched to its sharded version (param group 0, parameter " +
                           std::to_string(parameters.size() - 1) + ")"),
              std::string::npos)
        << message;
  }
}

// The plugin's param_init_fn (FSDP1's): a model built on the meta device on every rank gets its
// values from it, one module at a time, under both versions.
TEST(AcceleratorPrepare, ParamInitFnInitializesAModelBuiltOnTheMetaDevice) {
  for (const int64_t version : {int64_t{1}, int64_t{2}}) {
    testing::run_on_ranks(2, [version](const DistributedContext& context) {
      testing::MlpStack model{nullptr};
      {
        MetaDeviceGuard meta;
        model = testing::MlpStack();
      }
      torch::optim::AdamW optimizer(unique_parameters(*model));
      auto accelerator = make_accelerator(context, "no_wrap", "no", version);
      auto modules = std::make_shared<std::vector<std::string>>();
      accelerator.fsdp_plugin().param_init_fn = [modules](torch::nn::Module& module) {
        modules->push_back(module.name());
        torch::NoGradGuard no_grad;
        for (auto& parameter : module.parameters(/*recurse=*/false)) parameter.fill_(0.25);
      };
      accelerator.prepare(model, optimizer);
      EXPECT_FALSE(modules->empty());
      for (const auto& [name, tensor] : testing::full_parameters(*model)) {
        EXPECT_TRUE(torch::equal(tensor, torch::full_like(tensor, 0.25))) << "version " << version << ": " << name;
      }
      // The optimizer steps the materialized shards.
      EXPECT_EQ(optimizer.param_groups().at(0).params().size(), unique_parameters(*model).size());
      for (const auto& parameter : optimizer.param_groups().at(0).params()) EXPECT_FALSE(parameter.is_meta());
    });
  }
}

// Without a param_init_fn, a PretrainedModel built on the meta device gets its own initialization
// (init_weights: transformers' _init_weights), identical on every rank for the same seed, and trains.
TEST(AcceleratorPrepare, LlamaBuiltOnTheMetaDeviceGetsItsOwnInitialization) {
  testing::run_on_ranks(2, [](const DistributedContext& context) {
    auto config = models::LlamaConfig::preset("tiny");
    config.tie_word_embeddings = false;
    torch::manual_seed(5);
    models::LlamaForCausalLM model{nullptr};
    {
      MetaDeviceGuard meta;
      model = models::LlamaForCausalLM(config);
    }
    torch::optim::AdamW optimizer(unique_parameters(*model));
    auto accelerator = make_accelerator(context);
    accelerator.prepare(model, optimizer);
    const auto full = testing::full_parameters(*model);
    for (const auto& [name, tensor] : full) {
      if (name.find("norm") != std::string::npos) {
        EXPECT_TRUE(torch::equal(tensor, torch::ones_like(tensor))) << name;
      } else {
        EXPECT_NEAR(tensor.std().item<double>(), config.initializer_range, 0.25 * config.initializer_range) << name;
        EXPECT_NEAR(tensor.mean().item<double>(), 0.0, 0.2 * config.initializer_range) << name;
      }
    }
    // Equal seeds, equal values: rank 1's gathered weights equal rank 0's.
    for (const auto& [name, tensor] : full) {
      auto rank_zeros = tensor.clone();
      broadcast(context.world(), rank_zeros, 0);
      EXPECT_TRUE(torch::equal(rank_zeros, tensor)) << name;
    }
    auto tokens = torch::randint(0, config.vocab_size, {2, 9});
    auto loss = models::causal_lm_loss(fsdp::forward(model, tokens.narrow(1, 0, 8)), tokens.narrow(1, 1, 8));
    accelerator.backward(loss);
    optimizer.step();
    EXPECT_TRUE(std::isfinite(loss.item<double>()));
  });
}

// Checkpoint rotation (total_limit) counts complete checkpoints only: after saves that crashed (no
// completion marker), the newest complete checkpoint before them is kept, and latest_checkpoint
// finds the newest complete one. Issue "Reliability": incomplete checkpoints used to count, and a
// resume after a crash deleted the only complete older checkpoint.
TEST(AcceleratorSaveState, RotationCountsCompleteCheckpointsOnly) {
  namespace fs = std::filesystem;
  auto context = DistributedContext::initialize(DistributedEnvironment{});
  const auto project = fs::temp_directory_path() / ("fsdp_rotation_" + std::to_string(::getpid()));
  fs::remove_all(project);
  testing::MlpStack model;
  torch::optim::AdamW optimizer(unique_parameters(*model));
  FullyShardedDataParallelPluginArgs args;
  AcceleratorOptions options;
  options.fsdp_plugin = FullyShardedDataParallelPlugin(args, EnvironmentMap{});
  options.project_dir = project.string();
  options.total_limit = 2;
  Accelerator accelerator(context, options, EnvironmentMap{});
  accelerator.prepare(model, optimizer);
  auto checkpoint = [&](int number) { return project / "checkpoints" / ("checkpoint_" + std::to_string(number)); };
  for (int save = 0; save < 3; ++save) accelerator.save_state(TrainingProgress{});
  EXPECT_FALSE(fs::exists(checkpoint(0)));
  EXPECT_TRUE(is_complete_checkpoint(checkpoint(1).string()));
  EXPECT_TRUE(is_complete_checkpoint(checkpoint(2).string()));
  // Two saves that crash before their marker.
  for (const int number : {3, 4}) {
    EXPECT_EQ(accelerator.save_state(TrainingProgress{}), checkpoint(number).string());
    fs::remove(checkpoint(number) / "checkpoint_complete.json");
  }
  EXPECT_TRUE(is_complete_checkpoint(checkpoint(2).string())) << "the newest complete checkpoint was deleted";
  accelerator.save_state(TrainingProgress{});
  EXPECT_TRUE(is_complete_checkpoint(checkpoint(2).string()));
  EXPECT_TRUE(is_complete_checkpoint(checkpoint(5).string()));
  EXPECT_FALSE(fs::exists(checkpoint(1)));
  EXPECT_EQ(accelerator.latest_checkpoint(), checkpoint(5).string());
  // Once two complete checkpoints are newer, the incomplete ones before them go too.
  accelerator.save_state(TrainingProgress{});
  EXPECT_FALSE(fs::exists(checkpoint(2)));
  EXPECT_FALSE(fs::exists(checkpoint(3)));
  EXPECT_FALSE(fs::exists(checkpoint(4)));
  EXPECT_TRUE(is_complete_checkpoint(checkpoint(5).string()));
  EXPECT_TRUE(is_complete_checkpoint(checkpoint(6).string()));
  fs::remove_all(project);
}

TEST(AcceleratorPrepare, UnsupportedPluginOptionsAreErrorsNotIgnored) {
  auto context = DistributedContext::initialize(DistributedEnvironment{});
  testing::MlpStack model;
  torch::optim::AdamW optimizer(unique_parameters(*model));
  auto accelerator = make_accelerator(context, "no_wrap");
  accelerator.fsdp_plugin().activation_checkpointing = true;
  auto message = testing::error_message_of([&] { accelerator.prepare(model, optimizer); });
  // Accelerate crashes with a TypeError here (its issue #3822).
  EXPECT_NE(message.find("activation_checkpointing=true checkpoints the children of the modules the auto-wrap policy "
                         "selects, but auto_wrap_policy is NO_WRAP"),
            std::string::npos)
      << message;
  EXPECT_FALSE(is_fsdp_module(*model)) << "a refused prepare shards nothing";
  accelerator.fsdp_plugin().activation_checkpointing = false;
  message = testing::error_message_of([&] {
    AcceleratorOptions options;
    options.mixed_precision = "fp8";
    Accelerator(context, options, EnvironmentMap{});
  });
  EXPECT_NE(message.find("mixed_precision is 'fp8'; expected 'no', 'bf16' or 'fp16'"), std::string::npos) << message;
}

}  // namespace
}  // namespace fsdp

namespace fsdp {
namespace {

// prepare says what it made, on the main process: the plugin's version, strategy and wrap policy,
// the units (count and first paths), state_dict_type, precision; and warns when nothing configured
// FSDP at all (Accelerate's defaults: the whole model one unit). load_state of latest_checkpoint()
// before any save names the project's checkpoints directory and the fix.
// What prepare printed on stdout and warned, for `model` and `optimizer`.
template <typename Model>
std::pair<std::string, std::string> printed_and_warned(Accelerator& accelerator, Model& model,
                                                       torch::optim::Optimizer& optimizer) {
  struct Capture : c10::WarningHandler {
    std::string text;
    void process(const c10::Warning& warning) override { text += warning.msg(); }
  } capture;
  c10::WarningUtils::WarningHandlerGuard guard(&capture);
  ::testing::internal::CaptureStdout();
  accelerator.prepare(model, optimizer);
  return {::testing::internal::GetCapturedStdout(), capture.text};
}

TEST(AcceleratorPrepare, SaysWhatItMadeAndWarnsWhenNothingWasConfigured) {
  auto context = DistributedContext::initialize(DistributedEnvironment{});
  {
    auto accelerator = make_accelerator(context);
    testing::TinyTransformer model;
    torch::optim::AdamW optimizer(unique_parameters(*model));
    const auto [printed, warned] = printed_and_warned(accelerator, model, optimizer);
    EXPECT_NE(printed.find("fsdp: prepared with FSDP version 2, reshard_after_forward true, auto_wrap_policy "
                           "TRANSFORMER_BASED_WRAP: "),
              std::string::npos)
        << printed;
    // TinyTransformer is a PretrainedModel: its embedding and final norm are units too (version 2).
    EXPECT_NE(printed.find(": 5 units (embed_tokens, norm, layers_0, ... 1 more and the root)"), std::string::npos)
        << printed;
    EXPECT_NE(printed.find(" and the root), state_dict_type SHARDED_STATE_DICT, mixed precision no"), std::string::npos)
        << printed;
    EXPECT_EQ(warned.find("no FSDP configuration was given"), std::string::npos) << warned;
    const auto message = testing::error_message_of([&] { accelerator.load_state(accelerator.latest_checkpoint()); });
    EXPECT_NE(message.find("latest_checkpoint() returns when"), std::string::npos) << message;
    EXPECT_NE(message.find("checkpoints' holds no complete checkpoint yet"), std::string::npos) << message;
  }
  {
    Accelerator accelerator(context, AcceleratorOptions{}, EnvironmentMap{});
    testing::MlpStack model;
    torch::optim::AdamW optimizer(unique_parameters(*model));
    const auto [printed, warned] = printed_and_warned(accelerator, model, optimizer);
    EXPECT_NE(printed.find("FSDP version 1, sharding_strategy FULL_SHARD, auto_wrap_policy NO_WRAP: 1 unit (the root "
                           "alone), state_dict_type FULL_STATE_DICT"),
              std::string::npos)
        << printed;
    EXPECT_NE(warned.find("no FSDP configuration was given"), std::string::npos) << warned;
    EXPECT_NE(warned.find("examples/accelerate.yaml"), std::string::npos) << warned;
  }
}

}  // namespace
}  // namespace fsdp
