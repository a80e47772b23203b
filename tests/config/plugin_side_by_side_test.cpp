// The plugin against Accelerate's own FullyShardedDataParallelPlugin (the venv's accelerate,
// tests/python/accelerate_plugin.py): the same FSDP_* environment and arguments resolve to the same
// value of every field Accelerate has, or both refuse. (fsdp_version 3, which Accelerate accepts and
// fsdp.cpp refuses, is in plugin_test.cpp; so is sync_module_states on a machine without a GPU,
// which Accelerate refuses and fsdp.cpp runs: accelerate_plugin.py resolves it as on a CUDA machine.) Where Accelerate
// leaves a field unset (None) and fsdp.cpp shows its default or a value derived from another field (the source says
// which), the two agree by construction. The deliberate differences are listed in kDeliberate with the reason; the
// quirk cases of docs/plugin.md (Q1, Q2, NO_WRAP with activation checkpointing) are tested in plugin_test.cpp against
// the spec instead.
#include <fsdp/plugin.h>
#include <gtest/gtest.h>

#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <string>

#include "harness/multi_rank.h"
#include "harness/python_peer.h"

namespace fsdp {
namespace {

struct SideBySideCase {
  SideBySideCase(std::string name_, std::map<std::string, std::string> environment_,
                 std::optional<std::string> mixed_precision_ = std::nullopt,
                 std::optional<bool> forward_prefetch_ = std::nullopt, std::string accepted_on_purpose_ = "")
      : name(std::move(name_)),
        environment(std::move(environment_)),
        mixed_precision(std::move(mixed_precision_)),
        forward_prefetch(forward_prefetch_),
        accepted_on_purpose(std::move(accepted_on_purpose_)) {}
  std::string name;
  std::map<std::string, std::string> environment;
  /// mixed_precision_policy as a string argument, when set.
  std::optional<std::string> mixed_precision;
  /// forward_prefetch as a bool argument, when set.
  std::optional<bool> forward_prefetch;
  /// Set where Accelerate refuses and fsdp.cpp accepts on purpose: why (docs/plugin.md).
  std::string accepted_on_purpose;
};

std::vector<SideBySideCase> side_by_side_cases() {
  return {
      {"V1Defaults", {}},
      {"V2Defaults", {{"FSDP_VERSION", "2"}}},
      {"V1EveryVariable",
       {{"FSDP_SHARDING_STRATEGY", "SHARD_GRAD_OP"},
        {"FSDP_BACKWARD_PREFETCH", "BACKWARD_POST"},
        {"FSDP_OFFLOAD_PARAMS", "true"},
        {"FSDP_STATE_DICT_TYPE", "SHARDED_STATE_DICT"},
        {"FSDP_FORWARD_PREFETCH", "true"},
        {"FSDP_SYNC_MODULE_STATES", "true"},
        {"FSDP_USE_ORIG_PARAMS", "true"},
        {"FSDP_IGNORED_MODULES", "lm_head"},
        {"FSDP_CPU_RAM_EFFICIENT_LOADING", "true"}}},
      {"V1DigitsAndNoPrefetch",
       {{"FSDP_SHARDING_STRATEGY", "3"},
        {"FSDP_BACKWARD_PREFETCH", "NO_PREFETCH"},
        {"FSDP_STATE_DICT_TYPE", "LOCAL_STATE_DICT"}}},
      {"V1HybridPrefetchPre", {{"FSDP_SHARDING_STRATEGY", "HYBRID_SHARD"}, {"FSDP_BACKWARD_PREFETCH", "BACKWARD_PRE"}}},
      {"V1TransformerWrapWithCheckpointing",
       {{"FSDP_AUTO_WRAP_POLICY", "TRANSFORMER_BASED_WRAP"},
        {"FSDP_TRANSFORMER_CLS_TO_WRAP", "LlamaDecoderLayer,MLPBlock"},
        {"FSDP_ACTIVATION_CHECKPOINTING", "true"}}},
      {"V1SizeWrap", {{"FSDP_AUTO_WRAP_POLICY", "SIZE_BASED_WRAP"}, {"FSDP_MIN_NUM_PARAMS", "1000"}}},
      {"V1EfficientLoadingForcesSync",
       {{"FSDP_CPU_RAM_EFFICIENT_LOADING", "true"}, {"FSDP_SYNC_MODULE_STATES", "false"}}},
      {"V2EveryVariable",
       {{"FSDP_VERSION", "2"},
        {"FSDP_RESHARD_AFTER_FORWARD", "false"},
        {"FSDP_STATE_DICT_TYPE", "FULL_STATE_DICT"},
        {"FSDP_CPU_RAM_EFFICIENT_LOADING", "true"},
        {"FSDP_OFFLOAD_PARAMS", "true"},
        {"FSDP_AUTO_WRAP_POLICY", "TRANSFORMER_BASED_WRAP"},
        {"FSDP_TRANSFORMER_CLS_TO_WRAP", "LlamaDecoderLayer"},
        {"FSDP_ACTIVATION_CHECKPOINTING", "true"},
        {"FSDP_ACTIVATION_CHECKPOINTING_OFFLOAD", "true"},
        {"FSDP_IGNORED_MODULES", "model\\.layers\\.0\\..*"}}},
      // Version 2 does not read these (fsdp.cpp warns; Accelerate drops them): the values are the same.
      {"V2UnreadVariables",
       {{"FSDP_VERSION", "2"},
        {"FSDP_FORWARD_PREFETCH", "true"},
        {"FSDP_USE_ORIG_PARAMS", "false"},
        {"FSDP_SYNC_MODULE_STATES", "true"}}},
      {"V2ReshardTrueSizeWrap",
       {{"FSDP_VERSION", "2"},
        {"FSDP_RESHARD_AFTER_FORWARD", "yes"},
        {"FSDP_AUTO_WRAP_POLICY", "size_based_wrap"},
        {"FSDP_MIN_NUM_PARAMS", "50"}}},
      {"V1MixedPrecisionFp16", {}, std::string("fp16")},
      {"V1MixedPrecisionBf16", {}, std::string("bf16")},
      {"V2MixedPrecisionBf16", {{"FSDP_VERSION", "2"}}, std::string("bf16")},
      {"V2MixedPrecisionFp32", {{"FSDP_VERSION", "2"}}, std::string("fp32")},
      {"V1ForwardPrefetchArgument", {}, std::nullopt, true},
      // Accelerate's str_to_bool refuses "8"; FSDP2 takes the int (hpZ), and so does fsdp.cpp.
      {"V2ReshardGroupSize",
       {{"FSDP_VERSION", "2"}, {"FSDP_RESHARD_AFTER_FORWARD", "8"}},
       std::nullopt,
       std::nullopt,
       "an integer reshard_after_forward is FSDP2's group size (hpZ)"},
      // Both refuse.
      {"V2LocalStateDict", {{"FSDP_VERSION", "2"}, {"FSDP_STATE_DICT_TYPE", "LOCAL_STATE_DICT"}}},
      {"V2ForwardPrefetchArgument", {{"FSDP_VERSION", "2"}}, std::nullopt, true},
      {"CheckpointingOffloadWithoutCheckpointing",
       {{"FSDP_VERSION", "2"}, {"FSDP_ACTIVATION_CHECKPOINTING_OFFLOAD", "true"}}},
      {"CheckpointingOffloadOnVersionOne",
       {{"FSDP_AUTO_WRAP_POLICY", "TRANSFORMER_BASED_WRAP"},
        {"FSDP_ACTIVATION_CHECKPOINTING", "true"},
        {"FSDP_ACTIVATION_CHECKPOINTING_OFFLOAD", "true"}}},
  };
}

// Fields where fsdp.cpp differs from Accelerate on purpose, with the reason (docs/plugin.md).
const std::map<std::string, std::string> kDeliberate = {
    {"use_orig_params",
     "resolves to true: fsdp.cpp always trains the original parameters (no flat parameters), so the resolved value "
     "says what happens; Accelerate's default is false (version 1) and None (version 2)"},
};

// Quirk Q15: with sync_module_states on, Accelerate replaces param_init_fn by its own to_empty;
// fsdp.cpp never overwrites it (its ranks other than 0 receive rank 0's values without one).
bool deliberately_different(const std::string& field, const nlohmann::json& accelerate_values) {
  if (kDeliberate.count(field)) return true;
  return field == "param_init_fn" && accelerate_values["sync_module_states"] == true;
}

// Accelerate's dtype names for c10's.
std::string python_dtype(const std::string& name) {
  static const std::map<std::string, std::string> names = {
      {"Float", "float32"}, {"Half", "float16"}, {"BFloat16", "bfloat16"}, {"Double", "float64"}};
  auto found = names.find(name);
  return found == names.end() ? name : found->second;
}

// fsdp.cpp's value of `field` (from `fsdp config show`'s JSON) in the plain form accelerate_plugin.py writes.
nlohmann::json plain_value(const std::string& field, const nlohmann::json& value) {
  if (value.is_null()) return value;
  if (field == "state_dict_config" || field == "optim_state_dict_config") {
    return nlohmann::json::array({value["offload_to_cpu"], value["rank0_only"]});
  }
  if (field == "cpu_offload") return value["offload_params"];
  if (field == "auto_wrap_policy") {
    std::string name = value.get<std::string>();
    for (auto& c : name) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
    return name == "no_wrap" ? nlohmann::json(nullptr) : nlohmann::json(name);
  }
  if (field == "backward_prefetch" && value == "NO_PREFETCH") return nullptr;
  if (field == "mixed_precision_policy") {
    nlohmann::json dtypes;
    for (const char* key : {"param_dtype", "reduce_dtype", "buffer_dtype", "output_dtype"}) {
      dtypes[key] =
          value[key].is_null() ? nlohmann::json(nullptr) : nlohmann::json(python_dtype(value[key].get<std::string>()));
    }
    return dtypes;
  }
  if (field == "param_init_fn") return value == "set" ? nlohmann::json("set") : nlohmann::json(nullptr);
  return value;
}

TEST(PluginSideBySide, EveryFieldResolvesAsAcceleratesOwnPlugin) {
  const auto directory = testing::shared_temporary_directory();
  const auto cases = side_by_side_cases();
  nlohmann::json listed = nlohmann::json::array();
  for (const auto& side : cases) {
    nlohmann::json entry = {
        {"name", side.name}, {"environment", side.environment}, {"arguments", nlohmann::json::object()}};
    if (side.mixed_precision) entry["arguments"]["mixed_precision_policy"] = *side.mixed_precision;
    if (side.forward_prefetch) entry["arguments"]["forward_prefetch"] = *side.forward_prefetch;
    listed.push_back(entry);
  }
  std::ofstream(directory + "/cases.json") << listed.dump();
  ASSERT_TRUE(
      testing::run_python("accelerate_plugin.py", {directory + "/cases.json", directory + "/accelerate.json"}).ok);
  nlohmann::json theirs;
  std::ifstream(directory + "/accelerate.json") >> theirs;
  std::set<std::string> compared_fields;
  for (const auto& side : cases) {
    SCOPED_TRACE(side.name);
    ASSERT_TRUE(theirs.contains(side.name));
    const auto& accelerate = theirs[side.name];
    FullyShardedDataParallelPluginArgs args;
    if (side.mixed_precision) args.mixed_precision_policy = *side.mixed_precision;
    if (side.forward_prefetch) args.forward_prefetch = *side.forward_prefetch;
    EnvironmentMap environment(side.environment.begin(), side.environment.end());
    std::optional<FullyShardedDataParallelPlugin> plugin;
    std::string our_error;
    try {
      plugin.emplace(args, environment);
    } catch (const c10::Error& error) {
      our_error = error.what_without_backtrace();
    }
    if (accelerate.contains("error") && !side.accepted_on_purpose.empty()) {
      EXPECT_TRUE(plugin) << side.accepted_on_purpose << ", but fsdp.cpp refuses: " << our_error;
      continue;
    }
    EXPECT_TRUE(side.accepted_on_purpose.empty()) << "Accelerate accepts a case listed as refused there";
    if (accelerate.contains("error")) {
      EXPECT_FALSE(plugin) << "Accelerate refuses (" << accelerate["error"].get<std::string>() << "); fsdp.cpp accepts";
      continue;
    }
    ASSERT_TRUE(plugin) << "Accelerate accepts; fsdp.cpp refuses: " << our_error;
    const auto ours = nlohmann::json::parse(plugin->to_json());
    for (const auto& [field, their_value] : accelerate["values"].items()) {
      ASSERT_TRUE(ours.contains(field)) << "Accelerate's plugin has field '" << field << "', which fsdp.cpp's lacks";
      if (deliberately_different(field, accelerate["values"])) continue;
      compared_fields.insert(field);
      const auto our_value = plain_value(field, ours[field]["value"]);
      const auto source = ours[field]["source"].get<std::string>();
      // Accelerate leaves it unset; fsdp.cpp shows the default or what another field implies.
      const bool unset_there =
          their_value.is_null() && (source.rfind("default", 0) == 0 || source.rfind("derived", 0) == 0);
      EXPECT_TRUE(unset_there || our_value == their_value) << "field " << field << ": fsdp.cpp " << our_value.dump()
                                                           << " (" << source << "), Accelerate " << their_value.dump();
    }
  }
  // Every field but the deliberate differences was compared at least once.
  EXPECT_EQ(compared_fields.size() + kDeliberate.size(), theirs["V1Defaults"]["values"].size());
}

}  // namespace
}  // namespace fsdp
