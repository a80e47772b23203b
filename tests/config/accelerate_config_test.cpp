// Accelerate YAML configs: loading, strict keys, launcher export and to-fsdp2.
#include <c10/util/Exception.h>
#include <fsdp/accelerate_config.h>
#include <fsdp/plugin.h>
#include <gtest/gtest.h>

#include <fstream>
#include <functional>
#include <sstream>

#include "harness/error_message.h"

namespace fsdp {
namespace {

std::string read_data(const std::string& name) {
  std::ifstream file(std::string(FSDP_TEST_DATA_DIR) + "/" + name);
  std::stringstream text;
  text << file.rdbuf();
  return text.str();
}

using testing::error_message_of;

TEST(AccelerateConfig, LoadsAccelerateOutput) {
  auto config = parse_accelerate_config(read_data("accelerate_fsdp1.yaml"), "fsdp1.yaml");
  EXPECT_EQ(config.distributed_type, "FSDP");
  EXPECT_EQ(config.mixed_precision, "bf16");
  EXPECT_EQ(config.num_processes, 2);
  EXPECT_EQ(config.num_machines, 1);
  EXPECT_EQ(config.fsdp_config.at("fsdp_reshard_after_forward"), "SHARD_GRAD_OP");
  EXPECT_EQ(config.fsdp_config.at("fsdp_cpu_ram_efficient_loading"), "true");
}

// A YAML alias bomb: 1 KB that expands to 387 million strings. to-fsdp2 used to spin on it
// (issue Reliability); every reader now refuses it before expanding anything.
TEST(AccelerateConfig, AliasBombsAreRefusedBeforeTheyExpand) {
  std::string bomb = "distributed_type: FSDP\ntpu_env: [&a [x, x, x, x, x, x, x, x, x]";
  std::string previous = "a";
  for (const char* name : {"b", "c", "d", "e", "f", "g", "h", "i"}) {
    bomb += std::string(", &") + name + " [";
    for (int index = 0; index < 9; ++index) bomb += (index ? ", *" : "*") + previous;
    bomb += "]";
    previous = name;
  }
  bomb += "]\nfsdp_config:\n  fsdp_version: 1\n";
  ASSERT_LT(bomb.size(), 1200u);
  for (const auto& body : std::vector<std::function<void()>>{[&] { parse_accelerate_config(bomb, "bomb.yaml"); },
                                                             [&] { convert_config_to_fsdp2(bomb, "bomb.yaml"); }}) {
    const auto message = testing::error_message_of(body);
    EXPECT_NE(message.find("config file 'bomb.yaml' expands (through YAML aliases) to more than 100000 values"),
              std::string::npos)
        << message;
  }
}

TEST(AccelerateConfig, KeysWithoutPrefixGetIt) {
  auto config =
      parse_accelerate_config("distributed_type: FSDP\nfsdp_config:\n  version: 2\n  offload_params: true\n", "f.yaml");
  EXPECT_EQ(config.fsdp_config.at("fsdp_version"), "2");
  EXPECT_EQ(config.fsdp_config.at("fsdp_offload_params"), "true");
}

TEST(AccelerateConfig, UnknownKeysAreRejectedWithSuggestions) {
  auto message = error_message_of([] {
    parse_accelerate_config("distributed_type: FSDP\nfsdp_config:\n  fsdp_backward_prefetch_policy: BACKWARD_PRE\n",
                            "a.yaml");
  });
  EXPECT_NE(message.find("'a.yaml': unknown key 'fsdp_backward_prefetch_policy' in fsdp_config; did you mean "
                         "'fsdp_backward_prefetch'?"),
            std::string::npos)
      << message;
  message = error_message_of([] { parse_accelerate_config("num_proceses: 2\n", "b.yaml"); });
  EXPECT_NE(message.find("unknown key 'num_proceses' at the top level; did you mean 'num_processes'?"),
            std::string::npos)
      << message;
  message = error_message_of([] { parse_accelerate_config("zzz_unrelated: 1\n", "c.yaml"); });
  EXPECT_NE(message.find("unknown key 'zzz_unrelated'"), std::string::npos) << message;
  EXPECT_EQ(message.find("did you mean"), std::string::npos) << message;
}

TEST(AccelerateConfig, UnsupportedFeaturesAndBadValuesAreErrors) {
  EXPECT_NE(error_message_of([] {
              parse_accelerate_config("deepspeed_config:\n  zero_stage: 3\n", "d.yaml");
            }).find("'deepspeed_config' configures a feature fsdp.cpp does not provide"),
            std::string::npos);
  EXPECT_TRUE(error_message_of([] { parse_accelerate_config("deepspeed_config: {}\n", "d.yaml"); }).empty());
  EXPECT_NE(error_message_of([] {
              parse_accelerate_config("distributed_type: DEEPSPEED\n", "e.yaml");
            }).find("FSDP, MULTI_CPU"),
            std::string::npos);
  EXPECT_NE(error_message_of([] {
              parse_accelerate_config("num_processes: two\n", "f.yaml");
            }).find("'f.yaml': key 'num_processes' must be an integer, got 'two'"),
            std::string::npos);
  EXPECT_NE(
      error_message_of([] { parse_accelerate_config("rdzv_backend: c10d\n", "g.yaml"); }).find("static rendezvous"),
      std::string::npos);
  EXPECT_NE(error_message_of([] {
              parse_accelerate_config("mixed_precision: fp4\n", "h.yaml");
            }).find("fp8, fp16, bf16, fp32"),
            std::string::npos);
  EXPECT_NE(error_message_of([] { parse_accelerate_config("- a\n- b\n", "i.yaml"); }).find("must be a YAML mapping"),
            std::string::npos);
  EXPECT_NE(error_message_of([] { load_accelerate_config("/nonexistent/config.yaml"); }).find("cannot be read"),
            std::string::npos);
  // A directory used to be reported as an empty file.
  EXPECT_NE(error_message_of([] { load_accelerate_config("/tmp"); }).find("config file '/tmp' is not a regular file"),
            std::string::npos);
  EXPECT_NE(
      error_message_of([] { parse_accelerate_config("a: [1, 2\n", "j.yaml"); }).find("'j.yaml' is not valid YAML"),
      std::string::npos);
  EXPECT_NE(error_message_of([] { parse_accelerate_config("[1]: 2\n", "k.yaml"); }).find("must be a plain name"),
            std::string::npos);
}

TEST(AccelerateConfig, LaunchExportMatchesAccelerate) {
  auto config = parse_accelerate_config(read_data("accelerate_fsdp1.yaml"), "fsdp1.yaml");
  auto exported = fsdp_launch_environment(&config, {{"fsdp_offload_params", "True"}}, false, std::nullopt);
  ASSERT_TRUE(exported.use_fsdp);
  const auto& variables = exported.variables;
  EXPECT_EQ(variables.at("ACCELERATE_USE_FSDP"), "true");
  EXPECT_EQ(variables.at("FSDP_VERSION"), "1");
  EXPECT_EQ(variables.at("FSDP_SHARDING_STRATEGY"), "SHARD_GRAD_OP");  // Accelerate exports FULL_SHARD (Q1)
  EXPECT_EQ(variables.at("FSDP_OFFLOAD_PARAMS"), "true");              // the flag beats the file, lowercased
  EXPECT_EQ(exported.origins.at("FSDP_OFFLOAD_PARAMS"), "--fsdp-offload-params flag");
  EXPECT_EQ(variables.at("FSDP_MIN_NUM_PARAMS"), "100000000");  // launcher default
  EXPECT_EQ(variables.at("FSDP_STATE_DICT_TYPE"), "SHARDED_STATE_DICT");
  EXPECT_EQ(exported.origins.at("FSDP_STATE_DICT_TYPE"), "fsdp_config.fsdp_state_dict_type in fsdp1.yaml");
  EXPECT_EQ(variables.at("FSDP_TRANSFORMER_CLS_TO_WRAP"), "LlamaDecoderLayer, MLPBlock");
  EXPECT_EQ(variables.at("ACCELERATE_MIXED_PRECISION"), "bf16");
  EXPECT_EQ(variables.count("FSDP_IGNORED_MODULES"), 0u);
  // The processes resolve what was exported to what the file says.
  auto plugin = resolve_plugin({}, variables);
  EXPECT_EQ(plugin.sharding_strategy, ShardingStrategy::kShardGradOp);
  EXPECT_TRUE(plugin.cpu_offload.offload_params);
  EXPECT_EQ(*plugin.transformer_cls_names_to_wrap, (std::vector<std::string>{"LlamaDecoderLayer", "MLPBlock"}));
}

TEST(AccelerateConfig, LaunchExportErrorsNameTheKeyAndFile) {
  auto config =
      parse_accelerate_config("distributed_type: FSDP\nfsdp_config:\n  fsdp_state_dict_type: FULL\n", "bad.yaml");
  auto message = error_message_of([&] { fsdp_launch_environment(&config, {}, false, std::nullopt); });
  EXPECT_NE(message.find("state_dict_type='FULL' (from environment variable FSDP_STATE_DICT_TYPE set from "
                         "fsdp_config.fsdp_state_dict_type in bad.yaml)"),
            std::string::npos)
      << message;
  config = parse_accelerate_config(
      "distributed_type: FSDP\nfsdp_config:\n  fsdp_cpu_ram_efficient_loading: true\n  fsdp_sync_module_states: "
      "false\n",
      "c.yaml");
  message = error_message_of([&] { fsdp_launch_environment(&config, {}, false, std::nullopt); });
  EXPECT_NE(message.find("set fsdp_sync_module_states to true"), std::string::npos) << message;
  message = error_message_of([] { fsdp_launch_environment(nullptr, {{"fsdp_version", "2"}}, false, std::nullopt); });
  EXPECT_NE(message.find("--fsdp_version was given but FSDP is not on"), std::string::npos) << message;
}

TEST(AccelerateConfig, NoFsdpNoExport) {
  auto config = parse_accelerate_config("distributed_type: MULTI_CPU\nnum_processes: 2\n", "m.yaml");
  EXPECT_TRUE(fsdp_launch_environment(&config, {}, false, std::nullopt).variables.empty());
  EXPECT_EQ(fsdp_launch_environment(nullptr, {}, true, std::nullopt).variables.at("FSDP_VERSION"), "1");
}

// Accelerate's launcher exports the key as it is (str(8).lower()) and its plugin then refuses an
// integer; ours reads it as FSDP2's group size (docs/plugin.md, "Differences").
TEST(AccelerateConfig, AnIntegerReshardAfterForwardReachesThePluginAsAGroupSize) {
  auto config = parse_accelerate_config(
      "distributed_type: FSDP\nfsdp_config:\n  fsdp_version: 2\n  fsdp_reshard_after_forward: 8\n", "hpz.yaml");
  const auto exported = fsdp_launch_environment(&config, {}, false, std::nullopt);
  EXPECT_EQ(exported.variables.at("FSDP_RESHARD_AFTER_FORWARD"), "8");
  auto plugin = resolve_plugin({}, exported.variables);
  EXPECT_EQ(plugin.reshard_after_forward, ReshardAfterForward(8));
}

TEST(AccelerateConfig, ToFsdp2MatchesAccelerate) {
  auto conversion = convert_config_to_fsdp2(read_data("accelerate_fsdp1.yaml"), "fsdp1.yaml");
  EXPECT_EQ(conversion.yaml, read_data("accelerate_fsdp2_expected.yaml"));
  EXPECT_EQ(conversion.warnings.size(), 4u);
  auto converted = parse_accelerate_config(conversion.yaml, "out.yaml");
  EXPECT_EQ(converted.fsdp_config.at("fsdp_version"), "2");
  EXPECT_EQ(converted.fsdp_config.at("fsdp_reshard_after_forward"), "false");
  const auto exported = fsdp_launch_environment(&converted, {}, false, std::nullopt);
  auto plugin = resolve_plugin({}, exported.variables);
  EXPECT_EQ(plugin.fsdp_version, 2);
  EXPECT_FALSE(plugin.reshard_after_forward);
  // Version 1's settings that the launcher would fill in by default are not exported for version 2,
  // so a plain version-2 launch is free of warnings about variables nobody set.
  for (const char* variable : {"FSDP_FORWARD_PREFETCH", "FSDP_USE_ORIG_PARAMS", "FSDP_SYNC_MODULE_STATES"}) {
    EXPECT_EQ(exported.variables.count(variable), 0u) << variable;
  }
  EXPECT_TRUE(plugin.warnings.empty()) << plugin.warnings.front();
}

TEST(AccelerateConfig, VersionTwoExportsTheVersionOneSettingsAUserChose) {
  auto config = parse_accelerate_config(
      "distributed_type: FSDP\nfsdp_config:\n  fsdp_version: 2\n  fsdp_forward_prefetch: true\n", "v2.yaml");
  const auto exported = fsdp_launch_environment(&config, {}, false, std::nullopt);
  EXPECT_EQ(exported.variables.at("FSDP_FORWARD_PREFETCH"), "true");
  const auto plugin = resolve_plugin({}, exported.variables, exported.origins);
  ASSERT_EQ(plugin.warnings.size(), 1u);
  EXPECT_NE(plugin.warnings[0].find("FSDP_FORWARD_PREFETCH='true' (from environment variable FSDP_FORWARD_PREFETCH set "
                                    "from fsdp_config.fsdp_forward_prefetch in v2.yaml) is not read by FSDP version 2"),
            std::string::npos)
      << plugin.warnings[0];
}

TEST(AccelerateConfig, ToFsdp2StrategyMappingAndEdgeCases) {
  for (const auto& [strategy, expected] :
       std::vector<std::pair<std::string, std::string>>{{"FULL_SHARD", "true"},
                                                        {"SHARD_GRAD_OP", "false"},
                                                        {"HYBRID_SHARD", "true"},
                                                        {"HYBRID_SHARD_ZERO2", "false"},
                                                        {"NO_SHARD", "false"},
                                                        {"1", "true"}}) {
    auto yaml = convert_config_to_fsdp2("fsdp_config:\n  fsdp_sharding_strategy: " + strategy + "\n", "s.yaml").yaml;
    EXPECT_NE(yaml.find("fsdp_reshard_after_forward: " + expected), std::string::npos) << strategy << ":\n" << yaml;
    EXPECT_EQ(yaml.find("fsdp_sharding_strategy"), std::string::npos) << yaml;
  }
  auto unchanged = convert_config_to_fsdp2("fsdp_config:\n  fsdp_version: 2\n", "v2.yaml");
  EXPECT_NE(unchanged.warnings.at(0).find("already fsdp_version 2"), std::string::npos);
  auto no_fsdp = convert_config_to_fsdp2("num_processes: 2\n", "n.yaml");
  EXPECT_NE(no_fsdp.warnings.at(0).find("no fsdp_config"), std::string::npos);
  EXPECT_NE(error_message_of([] { convert_config_to_fsdp2("", "empty.yaml"); }).find("is empty"), std::string::npos);
  EXPECT_NE(error_message_of([] {
              convert_config_to_fsdp2("fsdp_config:\n  fsdp_state_dict_type: LOCAL_STATE_DICT\n", "l.yaml");
            }).find("LOCAL_STATE_DICT does not exist in FSDP version 2"),
            std::string::npos);
  // A NUL in a quoted value (found by plugin_config_fuzz) is kept, and so is everything after it.
  auto nul = convert_config_to_fsdp2("fsdp_config:\n  fsdp_activation_checkpointing: \"a\\0b\"\n", "nul.yaml");
  const auto reread = parse_accelerate_config(nul.yaml, "nul converted");
  EXPECT_EQ(reread.fsdp_config.at("fsdp_version"), "2") << nul.yaml;
  EXPECT_EQ(reread.fsdp_config.at("fsdp_activation_checkpointing"), std::string("a\0b", 3)) << nul.yaml;
}

}  // namespace
}  // namespace fsdp
