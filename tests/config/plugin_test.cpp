// FullyShardedDataParallelPlugin resolution, table-driven: for each field the default, the
// environment variable, explicit values in every accepted form, and every invalid form.
#include <c10/util/Exception.h>
#include <fsdp/plugin.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <nlohmann/json.hpp>

#include "config/plugin_fields.h"
#include "config/text.h"
#include "harness/error_message.h"

namespace fsdp {
namespace {

using Args = FullyShardedDataParallelPluginArgs;
using Plugin = FullyShardedDataParallelPlugin;

struct ResolveCase {
  std::string name;
  std::function<Args()> args;
  EnvironmentMap environment;
  std::function<void(const Plugin&)> check;
};

std::ostream& operator<<(std::ostream& stream, const ResolveCase& value) { return stream << value.name; }

class PluginResolves : public ::testing::TestWithParam<ResolveCase> {};

TEST_P(PluginResolves, AsAccelerateDoes) {
  const auto& test_case = GetParam();
  GetParam().check(resolve_plugin(test_case.args(), test_case.environment));
}

Args none() { return {}; }

std::vector<ResolveCase> resolve_cases() {
  std::vector<ResolveCase> cases;
  auto add = [&](std::string name, std::function<Args()> args, EnvironmentMap environment,
                 std::function<void(const Plugin&)> check) {
    cases.push_back({std::move(name), std::move(args), std::move(environment), std::move(check)});
  };
  // fsdp_version
  add("VersionDefault", none, {}, [](const Plugin& p) {
    EXPECT_EQ(p.fsdp_version, 1);
    EXPECT_EQ(p.sources.at("fsdp_version"), "default");
  });
  add("VersionFromEnvironment", none, {{"FSDP_VERSION", "2"}}, [](const Plugin& p) {
    EXPECT_EQ(p.fsdp_version, 2);
    EXPECT_EQ(p.sources.at("fsdp_version"), "environment variable FSDP_VERSION");
  });
  add(
      "VersionArgumentBeatsEnvironment",
      [] {
        Args a;
        a.fsdp_version = int64_t{1};
        return a;
      },
      {{"FSDP_VERSION", "2"}},
      [](const Plugin& p) {
        EXPECT_EQ(p.fsdp_version, 1);
        EXPECT_EQ(p.sources.at("fsdp_version"), "argument");
      });
  add(
      "VersionAsString",
      [] {
        Args a;
        a.fsdp_version = std::string("2");
        return a;
      },
      {}, [](const Plugin& p) { EXPECT_EQ(p.fsdp_version, 2); });
  // sharding strategy / reshard_after_forward, version 1
  add("V1StrategyDefault", none, {}, [](const Plugin& p) {
    EXPECT_EQ(p.sharding_strategy, ShardingStrategy::kFullShard);
    EXPECT_TRUE(p.reshard_after_forward);
  });
  add("V1StrategyFromEnvironmentName", none, {{"FSDP_SHARDING_STRATEGY", "shard_grad_op"}}, [](const Plugin& p) {
    EXPECT_EQ(p.sharding_strategy, ShardingStrategy::kShardGradOp);
    EXPECT_FALSE(p.reshard_after_forward);
  });
  add("V1StrategyFromEnvironmentDigit", none, {{"FSDP_SHARDING_STRATEGY", "3"}},
      [](const Plugin& p) { EXPECT_EQ(p.sharding_strategy, ShardingStrategy::kNoShard); });
  add("V1StrategyFromReshardVariable", none, {{"FSDP_RESHARD_AFTER_FORWARD", "HYBRID_SHARD"}}, [](const Plugin& p) {
    EXPECT_EQ(p.sharding_strategy, ShardingStrategy::kHybridShard);
    EXPECT_TRUE(p.reshard_after_forward);
  });
  add("V1StrategyVariableBeatsReshardVariable", none,
      {{"FSDP_SHARDING_STRATEGY", "NO_SHARD"}, {"FSDP_RESHARD_AFTER_FORWARD", "FULL_SHARD"}},
      [](const Plugin& p) { EXPECT_EQ(p.sharding_strategy, ShardingStrategy::kNoShard); });
  add(
      "V1StrategyArgumentTyped",
      [] {
        Args a;
        a.sharding_strategy = ShardingStrategy::kHybridShardZero2;
        return a;
      },
      {{"FSDP_SHARDING_STRATEGY", "NO_SHARD"}},
      [](const Plugin& p) {
        EXPECT_EQ(p.sharding_strategy, ShardingStrategy::kHybridShardZero2);
        ASSERT_EQ(p.warnings.size(), 1u);
        EXPECT_NE(p.warnings[0].find("deprecated in favor of reshard_after_forward"), std::string::npos);
      });
  add(
      "V1StrategyArgumentInteger",
      [] {
        Args a;
        a.sharding_strategy = int64_t{2};
        return a;
      },
      {}, [](const Plugin& p) { EXPECT_EQ(p.sharding_strategy, ShardingStrategy::kShardGradOp); });
  add(
      "V1ReshardArgumentString",
      [] {
        Args a;
        a.reshard_after_forward = std::string("no_shard");
        return a;
      },
      {},
      [](const Plugin& p) {
        EXPECT_EQ(p.sharding_strategy, ShardingStrategy::kNoShard);
        EXPECT_TRUE(p.warnings.empty());
      });
  // version 2
  add("V2ReshardDefault", none, {{"FSDP_VERSION", "2"}}, [](const Plugin& p) {
    EXPECT_TRUE(p.reshard_after_forward);
    EXPECT_EQ(p.sharding_strategy, ShardingStrategy::kFullShard);
  });
  add("V2ReshardFromEnvironment", none, {{"FSDP_VERSION", "2"}, {"FSDP_RESHARD_AFTER_FORWARD", "Off"}},
      [](const Plugin& p) {
        EXPECT_FALSE(p.reshard_after_forward);
        EXPECT_EQ(p.sharding_strategy, ShardingStrategy::kShardGradOp);
      });
  add("V2IgnoresStrategyVariable", none, {{"FSDP_VERSION", "2"}, {"FSDP_SHARDING_STRATEGY", "SHARD_GRAD_OP"}},
      [](const Plugin& p) { EXPECT_TRUE(p.reshard_after_forward); });
  add(
      "V2ReshardArgumentBool",
      [] {
        Args a;
        a.fsdp_version = int64_t{2};
        a.reshard_after_forward = false;
        return a;
      },
      {{"FSDP_RESHARD_AFTER_FORWARD", "true"}}, [](const Plugin& p) { EXPECT_FALSE(p.reshard_after_forward); });
  add(
      "V2ReshardArgumentBoolString",
      [] {
        Args a;
        a.fsdp_version = int64_t{2};
        a.reshard_after_forward = std::string("Y");
        return a;
      },
      {}, [](const Plugin& p) { EXPECT_TRUE(p.reshard_after_forward); });
  // An integer of 2 or more is a group size (FSDP2's int, hpZ), where Accelerate raises; "1" stays a bool.
  add("V2ReshardGroupSizeFromEnvironment", none, {{"FSDP_VERSION", "2"}, {"FSDP_RESHARD_AFTER_FORWARD", "8"}},
      [](const Plugin& p) {
        ASSERT_TRUE(p.reshard_after_forward.is_group_size());
        EXPECT_EQ(p.reshard_after_forward.group_size(), 8);
        EXPECT_EQ(p.sharding_strategy, ShardingStrategy::kFullShard);
        EXPECT_EQ(p.sources.at("reshard_after_forward"), "environment variable FSDP_RESHARD_AFTER_FORWARD");
      });
  add("V2ReshardOneFromEnvironmentIsTrue", none, {{"FSDP_VERSION", "2"}, {"FSDP_RESHARD_AFTER_FORWARD", "1"}},
      [](const Plugin& p) { EXPECT_EQ(p.reshard_after_forward, ReshardAfterForward(true)); });
  add(
      "V2ReshardGroupSizeArgument",
      [] {
        Args a;
        a.fsdp_version = int64_t{2};
        a.reshard_after_forward = int64_t{4};
        return a;
      },
      {{"FSDP_RESHARD_AFTER_FORWARD", "false"}},
      [](const Plugin& p) {
        EXPECT_EQ(p.reshard_after_forward, ReshardAfterForward(4));
        EXPECT_EQ(nlohmann::json::parse(p.to_json())["reshard_after_forward"]["value"], 4) << p.to_json();
      });
  add(
      "V2ReshardGroupSizeString",
      [] {
        Args a;
        a.fsdp_version = int64_t{2};
        a.reshard_after_forward = std::string("2");
        return a;
      },
      {}, [](const Plugin& p) { EXPECT_EQ(p.reshard_after_forward, ReshardAfterForward(2)); });
  add(
      "V2StrategyAloneConverts",  // Accelerate raises here (Q2)
      [] {
        Args a;
        a.fsdp_version = int64_t{2};
        a.sharding_strategy = std::string("SHARD_GRAD_OP");
        return a;
      },
      {},
      [](const Plugin& p) {
        EXPECT_FALSE(p.reshard_after_forward);
        EXPECT_EQ(p.sharding_strategy, ShardingStrategy::kShardGradOp);
        EXPECT_EQ(p.warnings.size(), 1u);
      });
  // cpu_offload
  add("OffloadDefault", none, {}, [](const Plugin& p) { EXPECT_FALSE(p.cpu_offload.offload_params); });
  add("OffloadFromEnvironment", none, {{"FSDP_OFFLOAD_PARAMS", "TRUE"}}, [](const Plugin& p) {
    EXPECT_TRUE(p.cpu_offload.offload_params);
    EXPECT_EQ(p.sources.at("cpu_offload"), "environment variable FSDP_OFFLOAD_PARAMS");
  });
  add(
      "OffloadArgumentBeatsEnvironment",
      [] {
        Args a;
        a.cpu_offload = false;
        return a;
      },
      {{"FSDP_OFFLOAD_PARAMS", "1"}}, [](const Plugin& p) { EXPECT_FALSE(p.cpu_offload.offload_params); });
  add(
      "OffloadPolicy",
      [] {
        Args a;
        a.cpu_offload = CpuOffloadPolicy{true, false};
        return a;
      },
      {},
      [](const Plugin& p) {
        EXPECT_TRUE(p.cpu_offload.offload_params);
        EXPECT_FALSE(p.cpu_offload.pin_memory);
      });
  // backward_prefetch
  add("PrefetchDefault", none, {}, [](const Plugin& p) { EXPECT_FALSE(p.backward_prefetch); });
  add("PrefetchFromEnvironment", none, {{"FSDP_BACKWARD_PREFETCH", "backward_post"}},
      [](const Plugin& p) { EXPECT_EQ(p.backward_prefetch, BackwardPrefetch::kBackwardPost); });
  add(
      "PrefetchDigit",
      [] {
        Args a;
        a.backward_prefetch = std::string("1");
        return a;
      },
      {}, [](const Plugin& p) { EXPECT_EQ(p.backward_prefetch, BackwardPrefetch::kBackwardPre); });
  add("PrefetchNone", none, {{"FSDP_BACKWARD_PREFETCH", "NO_PREFETCH"}},
      [](const Plugin& p) { EXPECT_FALSE(p.backward_prefetch); });
  add(
      "V2DropsPrefetch",
      [] {
        Args a;
        a.fsdp_version = int64_t{2};
        a.backward_prefetch = BackwardPrefetch::kBackwardPre;
        return a;
      },
      {},
      [](const Plugin& p) {
        EXPECT_FALSE(p.backward_prefetch);
        ASSERT_EQ(p.warnings.size(), 1u);
        EXPECT_NE(p.warnings[0].find("backward_prefetch is not supported in FSDP version 2"), std::string::npos);
      });
  // state_dict_type and configs
  add("StateDictDefaultV1", none, {}, [](const Plugin& p) {
    EXPECT_EQ(p.state_dict_type, StateDictType::kFullStateDict);
    EXPECT_TRUE(p.state_dict_config.offload_to_cpu);
    EXPECT_TRUE(p.state_dict_config.rank0_only);
    EXPECT_TRUE(p.optim_state_dict_config.rank0_only);
  });
  add("StateDictDefaultV2", none, {{"FSDP_VERSION", "2"}}, [](const Plugin& p) {
    EXPECT_EQ(p.state_dict_type, StateDictType::kShardedStateDict);
    EXPECT_TRUE(p.state_dict_config.offload_to_cpu);
    EXPECT_FALSE(p.state_dict_config.rank0_only);
  });
  add("StateDictFromEnvironmentDigit", none, {{"FSDP_STATE_DICT_TYPE", "2"}}, [](const Plugin& p) {
    EXPECT_EQ(p.state_dict_type, StateDictType::kLocalStateDict);
    EXPECT_FALSE(p.state_dict_config.offload_to_cpu);
  });
  add(
      "StateDictExplicitConfigKept",
      [] {
        Args a;
        a.state_dict_type = std::string("sharded_state_dict");
        a.state_dict_config = StateDictConfig{false, false};
        return a;
      },
      {},
      [](const Plugin& p) {
        EXPECT_EQ(p.state_dict_type, StateDictType::kShardedStateDict);
        EXPECT_FALSE(p.state_dict_config.offload_to_cpu);
        EXPECT_TRUE(p.optim_state_dict_config.offload_to_cpu);
      });
  // auto wrap
  add("WrapDefault", none, {}, [](const Plugin& p) { EXPECT_EQ(p.auto_wrap_policy, AutoWrapKind::kNoWrap); });
  add("WrapTransformerFromEnvironmentStripsSpaces", none,
      {{"FSDP_AUTO_WRAP_POLICY", "transformer_based_wrap"},
       {"FSDP_TRANSFORMER_CLS_TO_WRAP", "LlamaDecoderLayer, MLPBlock "}},
      [](const Plugin& p) {
        EXPECT_EQ(p.auto_wrap_policy, AutoWrapKind::kTransformerBasedWrap);
        EXPECT_EQ(*p.transformer_cls_names_to_wrap, (std::vector<std::string>{"LlamaDecoderLayer", "MLPBlock"}));
      });
  add("WrapTransformerNamesDefaultToModel", none, {{"FSDP_AUTO_WRAP_POLICY", "TRANSFORMER_BASED_WRAP"}},
      [](const Plugin& p) { EXPECT_FALSE(p.transformer_cls_names_to_wrap); });
  add("WrapNamesVariableIgnoredForOtherPolicies", none, {{"FSDP_TRANSFORMER_CLS_TO_WRAP", "Block"}},
      [](const Plugin& p) { EXPECT_FALSE(p.transformer_cls_names_to_wrap); });
  add(
      "WrapNamesListArgument",
      [] {
        Args a;
        a.auto_wrap_policy = std::string("transformer_based_wrap");
        a.transformer_cls_names_to_wrap = std::vector<std::string>{"Block"};
        return a;
      },
      {}, [](const Plugin& p) { EXPECT_EQ(*p.transformer_cls_names_to_wrap, std::vector<std::string>{"Block"}); });
  add("WrapSizeFromEnvironment", none, {{"FSDP_AUTO_WRAP_POLICY", "SIZE_BASED_WRAP"}, {"FSDP_MIN_NUM_PARAMS", "1000"}},
      [](const Plugin& p) {
        EXPECT_EQ(p.auto_wrap_policy, AutoWrapKind::kSizeBasedWrap);
        EXPECT_EQ(p.min_num_params, 1000);
      });
  add(
      "WrapSizeArgumentString",
      [] {
        Args a;
        a.auto_wrap_policy = std::string("size_based_wrap");
        a.min_num_params = std::string("20");
        return a;
      },
      {{"FSDP_MIN_NUM_PARAMS", "5"}}, [](const Plugin& p) { EXPECT_EQ(p.min_num_params, 20); });
  add(
      "WrapCallable",
      [] {
        Args a;
        a.auto_wrap_policy =
            AutoWrapCallable([](const torch::nn::Module&, const std::string&, int64_t) { return true; });
        return a;
      },
      {},
      [](const Plugin& p) {
        EXPECT_EQ(p.auto_wrap_policy, AutoWrapKind::kCallable);
        EXPECT_TRUE(p.auto_wrap_callable);
      });
  // version-1 booleans
  add("V1BoolsDefault", none, {}, [](const Plugin& p) {
    // Accelerate's plugin default is false; fsdp.cpp has no flat parameters, so its default says
    // what it does (docs/plugin.md), and false is a warning.
    EXPECT_TRUE(p.use_orig_params);
    EXPECT_TRUE(p.warnings.empty());
    EXPECT_FALSE(p.sync_module_states);
    EXPECT_FALSE(p.forward_prefetch);
    EXPECT_TRUE(p.limit_all_gathers);
    EXPECT_FALSE(p.param_init_fn);
  });
  add("V1BoolsFromEnvironment", none,
      {{"FSDP_USE_ORIG_PARAMS", "yes"}, {"FSDP_SYNC_MODULE_STATES", "t"}, {"FSDP_FORWARD_PREFETCH", "on"}},
      [](const Plugin& p) {
        EXPECT_TRUE(p.use_orig_params);
        EXPECT_TRUE(p.sync_module_states);
        EXPECT_TRUE(p.forward_prefetch);
        EXPECT_FALSE(p.param_init_fn);
      });
  add(
      "V2DropsVersionOneBools",
      [] {
        Args a;
        a.fsdp_version = int64_t{2};
        a.use_orig_params = true;
        a.sync_module_states = true;
        return a;
      },
      {{"FSDP_USE_ORIG_PARAMS", "true"}},
      [](const Plugin& p) {
        EXPECT_TRUE(p.use_orig_params) << "version 2 always trains the original parameters";
        EXPECT_FALSE(p.sync_module_states);
        EXPECT_EQ(p.warnings.size(), 2u);
      });
  // Accelerate drops these silently under version 2; we say so, naming the variable.
  add("V2WarnsAboutVersionOneVariablesItDoesNotRead", none,
      {{"FSDP_VERSION", "2"},
       {"FSDP_SYNC_MODULE_STATES", "true"},
       {"FSDP_FORWARD_PREFETCH", "true"},
       {"FSDP_USE_ORIG_PARAMS", "false"}},
      [](const Plugin& p) {
        EXPECT_FALSE(p.sync_module_states);
        EXPECT_FALSE(p.forward_prefetch);
        ASSERT_EQ(p.warnings.size(), 3u);
        EXPECT_NE(
            p.warnings[0].find("FSDP_FORWARD_PREFETCH='true' (from environment variable FSDP_FORWARD_PREFETCH) is "
                               "not read by FSDP version 2"),
            std::string::npos)
            << p.warnings[0];
        EXPECT_NE(p.warnings[1].find("FSDP_USE_ORIG_PARAMS='false'"), std::string::npos) << p.warnings[1];
        EXPECT_NE(p.warnings[2].find("FSDP_SYNC_MODULE_STATES='true'"), std::string::npos) << p.warnings[2];
      });
  add("V2IsQuietAboutValuesItHonorsAnyway", none,
      {{"FSDP_VERSION", "2"},
       {"FSDP_SYNC_MODULE_STATES", "false"},
       {"FSDP_FORWARD_PREFETCH", "false"},
       {"FSDP_USE_ORIG_PARAMS", "true"}},
      [](const Plugin& p) { EXPECT_TRUE(p.warnings.empty()) << p.warnings.front(); });
  add("UnknownFsdpVariableIsAWarningWithTheClosestName", none,
      {{"FSDP_SHARDING_STRATEGIE", "NO_SHARD"},
       {"FSDP_COLLECTIVE_TIMEOUT", "30"},
       {"FSDP_CHECK_COLLECTIVES", "0"},
       {"FSDP_COLLECTIVE_TABLE", "/tmp/table.tsv"},
       {"FSDP_DEBUG", "1"},
       {"FSDP_DEVICE", "cpu"},
       {"FSDPX", "1"},
       {"FSDP_TEST_HARNESS_RANK", "1"}},
      [](const Plugin& p) {
        EXPECT_EQ(p.sharding_strategy, ShardingStrategy::kFullShard);
        ASSERT_EQ(p.warnings.size(), 1u);
        EXPECT_NE(
            p.warnings[0].find("environment variable FSDP_SHARDING_STRATEGIE='NO_SHARD' is not a setting fsdp.cpp "
                               "reads; did you mean FSDP_SHARDING_STRATEGY? It is ignored."),
            std::string::npos)
            << p.warnings[0];
      });
  add("RamEfficientLoadingForcesSync", none, {{"FSDP_CPU_RAM_EFFICIENT_LOADING", "1"}}, [](const Plugin& p) {
    EXPECT_TRUE(p.cpu_ram_efficient_loading);
    EXPECT_TRUE(p.sync_module_states);
    EXPECT_EQ(p.sources.at("sync_module_states"), "derived from cpu_ram_efficient_loading");
    EXPECT_EQ(p.warnings.size(), 1u);
  });
  add("V1UseOrigParamsFalseAndCpuOffloadAreNamedWarnings", none,
      {{"FSDP_USE_ORIG_PARAMS", "false"}, {"FSDP_OFFLOAD_PARAMS", "true"}}, [](const Plugin& p) {
        EXPECT_FALSE(p.use_orig_params);
        ASSERT_EQ(p.warnings.size(), 2u);
        EXPECT_NE(
            p.warnings[0].find("cpu_offload=true (from environment variable FSDP_OFFLOAD_PARAMS) has no effect in "
                               "this CPU build"),
            std::string::npos)
            << p.warnings[0];
        EXPECT_NE(p.warnings[1].find("use_orig_params=false (from environment variable FSDP_USE_ORIG_PARAMS) is not "
                                     "implemented"),
                  std::string::npos)
            << p.warnings[1];
      });
  add(
      "StateDictConfigOffloadIsANamedWarningAndV2LimitAllGathersToo",
      [] {
        Args a;
        a.fsdp_version = int64_t{2};
        a.state_dict_config = StateDictConfig{false, false};
        a.limit_all_gathers = false;
        return a;
      },
      {},
      [](const Plugin& p) {
        ASSERT_EQ(p.warnings.size(), 2u);
        EXPECT_NE(p.warnings[0].find("state_dict_config.offload_to_cpu (from argument) has no effect"),
                  std::string::npos);
        EXPECT_NE(p.warnings[1].find("limit_all_gathers (from argument) is not used by FSDP version 2"),
                  std::string::npos);
      });
  add(
      "UserParamInitFnKeptWithSync",  // Accelerate overwrites it (Q15)
      [] {
        Args a;
        a.sync_module_states = true;
        a.param_init_fn = ParamInitFn([](torch::nn::Module&) {});
        return a;
      },
      {}, [](const Plugin& p) { EXPECT_EQ(p.sources.at("param_init_fn"), "argument"); });
  add("ActivationCheckpointingFromEnvironment", none,
      {{"FSDP_ACTIVATION_CHECKPOINTING", "true"}, {"FSDP_AUTO_WRAP_POLICY", "TRANSFORMER_BASED_WRAP"}},
      [](const Plugin& p) { EXPECT_TRUE(p.activation_checkpointing); });
  add("ActivationCheckpointingOffloadFromEnvironment", none,
      {{"FSDP_VERSION", "2"},
       {"FSDP_ACTIVATION_CHECKPOINTING", "true"},
       {"FSDP_ACTIVATION_CHECKPOINTING_OFFLOAD", "yes"},
       {"FSDP_AUTO_WRAP_POLICY", "TRANSFORMER_BASED_WRAP"}},
      [](const Plugin& p) {
        EXPECT_TRUE(p.activation_checkpointing_offload);
        EXPECT_EQ(p.sources.at("activation_checkpointing_offload"),
                  "environment variable FSDP_ACTIVATION_CHECKPOINTING_OFFLOAD");
        ASSERT_EQ(p.warnings.size(), 1u);
        EXPECT_NE(p.warnings[0].find("activation_checkpointing_offload=true (from environment variable "
                                     "FSDP_ACTIVATION_CHECKPOINTING_OFFLOAD) has no effect in this CPU build"),
                  std::string::npos);
      });
  // ignored modules
  add("IgnoredModulesRegexFromEnvironment", none, {{"FSDP_IGNORED_MODULES", "model\\.layers\\.[0-3]\\..*"}},
      [](const Plugin& p) { EXPECT_EQ(*p.ignored_modules.name_regex, "model\\.layers\\.[0-3]\\..*"); });
  add(
      "IgnoredModulesList",
      [] {
        Args a;
        a.ignored_modules = std::vector<std::shared_ptr<torch::nn::Module>>{std::make_shared<torch::nn::Module>()};
        return a;
      },
      {}, [](const Plugin& p) { EXPECT_EQ(p.ignored_modules.modules.size(), 1u); });
  // mixed precision
  add("MixedPrecisionNone", none, {}, [](const Plugin& p) { EXPECT_FALSE(p.mixed_precision_policy); });
  add(
      "MixedPrecisionStringV1",
      [] {
        Args a;
        a.mixed_precision_policy = std::string("BF16");
        return a;
      },
      {},
      [](const Plugin& p) {
        EXPECT_EQ(p.mixed_precision_policy->param_dtype, c10::kBFloat16);
        EXPECT_EQ(p.mixed_precision_policy->buffer_dtype, c10::kBFloat16);
        EXPECT_FALSE(p.mixed_precision_policy->output_dtype);
      });
  add(
      "MixedPrecisionStringV2",
      [] {
        Args a;
        a.fsdp_version = int64_t{2};
        a.mixed_precision_policy = std::string("fp16");
        return a;
      },
      {},
      [](const Plugin& p) {
        EXPECT_EQ(p.mixed_precision_policy->reduce_dtype, c10::kHalf);
        EXPECT_EQ(p.mixed_precision_policy->output_dtype, c10::kHalf);
        EXPECT_FALSE(p.mixed_precision_policy->buffer_dtype);
      });
  add(
      "MixedPrecisionFp8MapsToBf16",
      [] {
        Args a;
        a.mixed_precision_policy = std::string("fp8");
        return a;
      },
      {}, [](const Plugin& p) { EXPECT_EQ(p.mixed_precision_policy->param_dtype, c10::kBFloat16); });
  add(
      "MixedPrecisionDict",
      [] {
        Args a;
        a.mixed_precision_policy = std::map<std::string, c10::ScalarType>{
            {"param_dtype", c10::kBFloat16}, {"reduce_dtype", c10::kFloat}, {"buffer_dtype", c10::kFloat}};
        return a;
      },
      {},
      [](const Plugin& p) {
        EXPECT_EQ(p.mixed_precision_policy->param_dtype, c10::kBFloat16);
        EXPECT_EQ(p.mixed_precision_policy->reduce_dtype, c10::kFloat);
      });
  add(
      "MixedPrecisionPolicyStruct",
      [] {
        Args a;
        MixedPrecisionPolicy policy;
        policy.param_dtype = c10::kBFloat16;
        policy.cast_forward_inputs = false;
        a.mixed_precision_policy = policy;
        return a;
      },
      {}, [](const Plugin& p) { EXPECT_FALSE(p.mixed_precision_policy->cast_forward_inputs); });
  return cases;
}

INSTANTIATE_TEST_SUITE_P(Fields, PluginResolves, ::testing::ValuesIn(resolve_cases()),
                         [](const ::testing::TestParamInfo<ResolveCase>& info) { return info.param.name; });

struct ErrorCase {
  std::string name;
  std::function<Args()> args;
  EnvironmentMap environment;
  std::vector<std::string> message_parts;
};

std::ostream& operator<<(std::ostream& stream, const ErrorCase& value) { return stream << value.name; }

class PluginRejects : public ::testing::TestWithParam<ErrorCase> {};

TEST_P(PluginRejects, NamingFieldValueOriginAndAcceptedValues) {
  const auto& test_case = GetParam();
  const std::string message =
      testing::error_message_of([&] { resolve_plugin(test_case.args(), test_case.environment); });
  ASSERT_FALSE(message.empty()) << "no error";
  for (const auto& part : test_case.message_parts) {
    EXPECT_NE(message.find(part), std::string::npos) << "'" << part << "' missing from: " << message;
  }
}

std::vector<ErrorCase> error_cases() {
  return {
      {"VersionThree",
       none,
       {{"FSDP_VERSION", "3"}},
       {"fsdp_version='3'", "environment variable FSDP_VERSION", "1 or 2"}},
      {"StrategyUnknown",
       none,
       {{"FSDP_SHARDING_STRATEGY", "FULL"}},
       {"sharding_strategy='FULL'", "FSDP_SHARDING_STRATEGY", "FULL_SHARD, SHARD_GRAD_OP", "or 1-5"}},
      {"StrategyDigitOutOfRange",
       [] {
         Args a;
         a.sharding_strategy = std::string("6");
         return a;
       },
       {},
       {"sharding_strategy='6'", "argument"}},
      {"StrategyIntegerOutOfRange",
       [] {
         Args a;
         a.sharding_strategy = int64_t{0};
         return a;
       },
       {},
       {"sharding_strategy=0"}},
      {"V1ReshardBool",
       [] {
         Args a;
         a.reshard_after_forward = true;
         return a;
       },
       {},
       {"FSDP version 1 does not take", "fsdp_version=2"}},
      {"V1StrategyAndReshardDisagree",
       [] {
         Args a;
         a.sharding_strategy = ShardingStrategy::kNoShard;
         a.reshard_after_forward = ShardingStrategy::kFullShard;
         return a;
       },
       {},
       {"disagree"}},
      {"V2ReshardStrategy",
       [] {
         Args a;
         a.fsdp_version = int64_t{2};
         a.reshard_after_forward = std::string("FULL_SHARD");
         return a;
       },
       {},
       {"reshard_after_forward='FULL_SHARD'", "set a bool", "fsdp to-fsdp2"}},
      {"V2ReshardVariableStrategy",
       none,
       {{"FSDP_VERSION", "2"}, {"FSDP_RESHARD_AFTER_FORWARD", "SHARD_GRAD_OP"}},
       {"FSDP_RESHARD_AFTER_FORWARD", "expected a bool"}},
      {"V2ReshardIntegerOne",
       [] {
         Args a;
         a.fsdp_version = int64_t{2};
         a.reshard_after_forward = int64_t{1};
         return a;
       },
       {},
       {"reshard_after_forward='1'", "set a bool", "group size of 2 or more"}},
      {"V2ReshardVariableNegative",
       none,
       {{"FSDP_VERSION", "2"}, {"FSDP_RESHARD_AFTER_FORWARD", "-8"}},
       {"reshard_after_forward='-8'", "FSDP_RESHARD_AFTER_FORWARD", "group size of 2 or more"}},
      {"OffloadNotBool",
       none,
       {{"FSDP_OFFLOAD_PARAMS", "maybe"}},
       {"cpu_offload", "FSDP_OFFLOAD_PARAMS", "'maybe'", "y, yes, t, true"}},
      {"PrefetchThree",
       none,
       {{"FSDP_BACKWARD_PREFETCH", "3"}},
       {"backward_prefetch='3'", "BACKWARD_PRE, BACKWARD_POST"}},
      {"StateDictUnknown", none, {{"FSDP_STATE_DICT_TYPE", "FULL"}}, {"state_dict_type='FULL'", "SHARDED_STATE_DICT"}},
      {"V2LocalStateDict",
       none,
       {{"FSDP_VERSION", "2"}, {"FSDP_STATE_DICT_TYPE", "LOCAL_STATE_DICT"}},
       {"LOCAL_STATE_DICT", "not supported with FSDP version 2", "SHARDED_STATE_DICT or FULL_STATE_DICT"}},
      {"WrapUnknown",
       none,
       {{"FSDP_AUTO_WRAP_POLICY", "transformer"}},
       {"auto_wrap_policy='transformer'", "TRANSFORMER_BASED_WRAP"}},
      {"MinNumParamsNotInteger",
       none,
       {{"FSDP_AUTO_WRAP_POLICY", "SIZE_BASED_WRAP"}, {"FSDP_MIN_NUM_PARAMS", "1e8"}},
       {"min_num_params must be an integer", "'1e8'", "FSDP_MIN_NUM_PARAMS"}},
      {"SizeWrapWithoutMinimum",
       [] {
         Args a;
         a.auto_wrap_policy = std::string("size_based_wrap");
         return a;
       },
       {},
       {"min_num_params > 0", "FSDP_MIN_NUM_PARAMS"}},
      {"EmptyClassName",
       none,
       {{"FSDP_AUTO_WRAP_POLICY", "TRANSFORMER_BASED_WRAP"}, {"FSDP_TRANSFORMER_CLS_TO_WRAP", "Block,,MLP"}},
       {"empty class name"}},
      {"CheckpointingWithoutWrap",
       none,
       {{"FSDP_ACTIVATION_CHECKPOINTING", "true"}},
       {"activation_checkpointing=true", "NO_WRAP", "TRANSFORMER_BASED_WRAP"}},
      {"CheckpointingOffloadWithoutCheckpointing",
       none,
       {{"FSDP_VERSION", "2"}, {"FSDP_ACTIVATION_CHECKPOINTING_OFFLOAD", "true"}},
       {"`activation_checkpointing_offload=True` requires `activation_checkpointing=True`",
        "environment variable FSDP_ACTIVATION_CHECKPOINTING_OFFLOAD"}},
      {"CheckpointingOffloadVersionOne",
       none,
       {{"FSDP_ACTIVATION_CHECKPOINTING", "true"},
        {"FSDP_ACTIVATION_CHECKPOINTING_OFFLOAD", "true"},
        {"FSDP_AUTO_WRAP_POLICY", "TRANSFORMER_BASED_WRAP"}},
       {"`activation_checkpointing_offload=True` requires `fsdp_version=2`", "fsdp_version 1 from default"}},
      {"V2ForwardPrefetch",
       [] {
         Args a;
         a.fsdp_version = int64_t{2};
         a.forward_prefetch = true;
         return a;
       },
       {},
       {"forward_prefetch=true", "fsdp_version=1"}},
      {"IgnoredModulesBadRegex",
       none,
       {{"FSDP_IGNORED_MODULES", "layers.[0-"}},
       {"ignored_modules='layers.[0-'", "regular expression"}},
      {"MixedPrecisionUnknown",
       [] {
         Args a;
         a.mixed_precision_policy = std::string("int8");
         return a;
       },
       {},
       {"'int8'", "fp8, fp16, bf16, fp32"}},
      {"MixedPrecisionDictMissingKey",
       [] {
         Args a;
         a.mixed_precision_policy =
             std::map<std::string, c10::ScalarType>{{"param_dtype", c10::kHalf}, {"reduce_dtype", c10::kHalf}};
         return a;
       },
       {},
       {"lacks 'buffer_dtype'"}},
      {"MixedPrecisionDictBadDtype",
       [] {
         Args a;
         a.fsdp_version = int64_t{2};
         a.mixed_precision_policy = std::map<std::string, c10::ScalarType>{
             {"param_dtype", c10::kDouble}, {"reduce_dtype", c10::kHalf}, {"output_dtype", c10::kHalf}};
         return a;
       },
       {},
       {"param_dtype=Double", "Float, Half or BFloat16"}},
  };
}

INSTANTIATE_TEST_SUITE_P(Fields, PluginRejects, ::testing::ValuesIn(error_cases()),
                         [](const ::testing::TestParamInfo<ErrorCase>& info) { return info.param.name; });

TEST(Plugin, SwitchingStateDictTypeRederivesDefaultConfigs) {
  auto plugin = resolve_plugin({}, {{"FSDP_STATE_DICT_TYPE", "SHARDED_STATE_DICT"}});
  EXPECT_FALSE(plugin.state_dict_config.rank0_only);
  plugin.set_state_dict_type(StateDictType::kFullStateDict);
  EXPECT_TRUE(plugin.state_dict_config.rank0_only);  // Accelerate keeps the sharded config (Q5)
  EXPECT_TRUE(plugin.optim_state_dict_config.rank0_only);
}

TEST(Plugin, WarningsAreOneReadableMessage) {
  Args args;
  args.fsdp_version = int64_t{2};
  args.use_orig_params = true;
  args.backward_prefetch = BackwardPrefetch::kBackwardPre;
  std::vector<std::string> emitted;
  struct Capture : c10::WarningHandler {
    std::vector<std::string>* out;
    void process(const c10::Warning& warning) override { out->push_back(warning.msg()); }
  } capture;
  capture.out = &emitted;
  c10::WarningUtils::WarningHandlerGuard guard(&capture);
  resolve_plugin(args, {});
  ASSERT_EQ(emitted.size(), 1u);
  EXPECT_NE(emitted[0].find("FullyShardedDataParallelPlugin: 2 warnings:\n  - backward_prefetch"), std::string::npos)
      << emitted[0];
  EXPECT_NE(emitted[0].find("\n  - use_orig_params"), std::string::npos) << emitted[0];
}

TEST(Plugin, BoolStringsAndFsdpSwitch) {
  for (const char* yes : {"y", "YES", "t", "True", "on", "1"}) EXPECT_TRUE(detail::parse_bool(yes, "x")) << yes;
  for (const char* no : {"n", "No", "f", "FALSE", "off", "0"}) EXPECT_FALSE(detail::parse_bool(no, "x")) << no;
  EXPECT_THROW(detail::parse_bool("2", "x"), c10::Error);
  EXPECT_TRUE(fsdp_enabled_by_environment({{"ACCELERATE_USE_FSDP", "1"}}));  // Accelerate: only "true" (Q14)
  EXPECT_TRUE(fsdp_enabled_by_environment({{"ACCELERATE_USE_FSDP", "TRUE"}}));
  EXPECT_FALSE(fsdp_enabled_by_environment({{"ACCELERATE_USE_FSDP", "false"}}));
  EXPECT_FALSE(fsdp_enabled_by_environment({}));
}

TEST(Plugin, JsonNamesEveryFieldWithItsSource) {
  auto plugin = resolve_plugin({}, {{"FSDP_STATE_DICT_TYPE", "SHARDED_STATE_DICT"}},
                               {{"FSDP_STATE_DICT_TYPE", "key k in f.yaml"}});
  const auto json = plugin.to_json();
  for (const auto& row : detail::plugin_fields()) {  // Note [one table of plugin fields]
    const char* field = row.name;
    EXPECT_NE(json.find(std::string("\"") + field + "\""), std::string::npos) << field;
  }
  EXPECT_NE(json.find("environment variable FSDP_STATE_DICT_TYPE set from key k in f.yaml"), std::string::npos) << json;
  // Version 1's deliberate differences from FSDP1 are shown beside the values; version 2 has none.
  const auto document = nlohmann::json::parse(json);
  ASSERT_EQ(document["differences_from_accelerate"].size(), 2u) << json;
  EXPECT_EQ(
      document["differences_from_accelerate"][0].get<std::string>().rfind("parameters: always the original ones", 0),
      0u);
  EXPECT_EQ(
      document["differences_from_accelerate"][1].get<std::string>().rfind("mixed precision: BatchNorm modules", 0), 0u);
  const auto version_two = nlohmann::json::parse(resolve_plugin({}, {{"FSDP_VERSION", "2"}}).to_json());
  EXPECT_TRUE(version_two["differences_from_accelerate"].empty());
}

}  // namespace
}  // namespace fsdp
