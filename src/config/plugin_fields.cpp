#include "config/plugin_fields.h"

#include <c10/util/Exception.h>

namespace fsdp::detail {

const std::vector<PluginField>& plugin_fields() {
  // A table, one field per entry: kept as written.
  // clang-format off
  static const std::vector<PluginField> fields = {
      // name, variable, yaml_key, launch_default, launch_lowercase, example, read_when, doc
      {"fsdp_version", "FSDP_VERSION", "fsdp_version", "1", false, "2", {},
       "1 (FSDP1's options) or 2 (fully_shard's)"},
      {"sharding_strategy", "FSDP_SHARDING_STRATEGY", "fsdp_sharding_strategy", "FULL_SHARD", false, "SHARD_GRAD_OP", {},
       "FULL_SHARD, SHARD_GRAD_OP, NO_SHARD, HYBRID_SHARD, HYBRID_SHARD_ZERO2 (version 1; deprecated for "
       "reshard_after_forward)"},
      {"reshard_after_forward", "FSDP_RESHARD_AFTER_FORWARD", "fsdp_reshard_after_forward", "true", true, "false",
       {{"FSDP_VERSION", "2"}},
       "version 2: free the unsharded parameters after forward (a bool, or a group size); version 1: a strategy"},
      {"backward_prefetch", "FSDP_BACKWARD_PREFETCH", "fsdp_backward_prefetch", nullptr, false, "BACKWARD_POST", {},
       "BACKWARD_PRE, BACKWARD_POST or NO_PREFETCH (version 1)"},
      {"mixed_precision_policy", nullptr, nullptr, nullptr, false, nullptr, {},
       "param, reduce, buffer and output dtypes (an argument, or the accelerator's mixed_precision)"},
      {"auto_wrap_policy", "FSDP_AUTO_WRAP_POLICY", "fsdp_auto_wrap_policy", nullptr, false, "TRANSFORMER_BASED_WRAP",
       {}, "TRANSFORMER_BASED_WRAP, SIZE_BASED_WRAP, NO_WRAP or a callable: which modules become units"},
      {"cpu_offload", "FSDP_OFFLOAD_PARAMS", "fsdp_offload_params", "false", true, "true", {},
       "keep shards, gradients and optimizer state in host memory"},
      {"ignored_modules", "FSDP_IGNORED_MODULES", "fsdp_ignored_modules", nullptr, false, "lm_head", {},
       "a regex fullmatched against module names, or modules: their parameters are not sharded"},
      {"state_dict_type", "FSDP_STATE_DICT_TYPE", "fsdp_state_dict_type", nullptr, false, "SHARDED_STATE_DICT", {},
       "FULL_STATE_DICT, SHARDED_STATE_DICT or LOCAL_STATE_DICT (version 1): what checkpoints hold"},
      {"state_dict_config", nullptr, nullptr, nullptr, false, nullptr, {},
       "offload_to_cpu and rank0_only of the model state dict (derived from state_dict_type)"},
      {"optim_state_dict_config", nullptr, nullptr, nullptr, false, nullptr, {},
       "offload_to_cpu and rank0_only of the optimizer state dict (derived from state_dict_type)"},
      {"limit_all_gathers", nullptr, nullptr, nullptr, false, nullptr, {},
       "version 1: at most two all-gathers in flight"},
      {"use_orig_params", "FSDP_USE_ORIG_PARAMS", "fsdp_use_orig_params", "true", true, "false", {},
       "version 1: train the original parameters (always, here)"},
      {"param_init_fn", nullptr, nullptr, nullptr, false, nullptr, {},
       "how modules built on the meta device get their values (a function)"},
      {"sync_module_states", "FSDP_SYNC_MODULE_STATES", "fsdp_sync_module_states", "true", true, "true", {},
       "version 1: broadcast rank 0's parameters and buffers before sharding"},
      {"forward_prefetch", "FSDP_FORWARD_PREFETCH", "fsdp_forward_prefetch", "false", true, "true", {},
       "version 1: all-gather the next unit during this unit's forward"},
      {"activation_checkpointing", "FSDP_ACTIVATION_CHECKPOINTING", "fsdp_activation_checkpointing", "false", true,
       "true", {{"FSDP_AUTO_WRAP_POLICY", "TRANSFORMER_BASED_WRAP"}},
       "recompute each wrapped block's activations in backward"},
      {"activation_checkpointing_offload", "FSDP_ACTIVATION_CHECKPOINTING_OFFLOAD",
       "fsdp_activation_checkpointing_offload", "false", true, "true",
       {{"FSDP_VERSION", "2"}, {"FSDP_AUTO_WRAP_POLICY", "TRANSFORMER_BASED_WRAP"},
        {"FSDP_ACTIVATION_CHECKPOINTING", "true"}},
       "version 2: keep each checkpointed block's input in host memory"},
      {"cpu_ram_efficient_loading", "FSDP_CPU_RAM_EFFICIENT_LOADING", "fsdp_cpu_ram_efficient_loading", "true", true,
       "true", {}, "only rank 0 loads pretrained weights; the others build on the meta device"},
      {"transformer_cls_names_to_wrap", "FSDP_TRANSFORMER_CLS_TO_WRAP", "fsdp_transformer_layer_cls_to_wrap", nullptr,
       false, "LlamaDecoderLayer", {{"FSDP_AUTO_WRAP_POLICY", "TRANSFORMER_BASED_WRAP"}},
       "the module classes that become units under TRANSFORMER_BASED_WRAP (comma-separated)"},
      {"min_num_params", "FSDP_MIN_NUM_PARAMS", "fsdp_min_num_params", "100000000", false, "1000",
       {{"FSDP_AUTO_WRAP_POLICY", "SIZE_BASED_WRAP"}}, "the parameters a unit needs under SIZE_BASED_WRAP"},
  };
  // clang-format on
  return fields;
}

const PluginField& plugin_field(const std::string& name) {
  for (const auto& field : plugin_fields()) {
    if (name == field.name) return field;
  }
  TORCH_INTERNAL_ASSERT(false, "no plugin field '", name, "' in src/config/plugin_fields.cpp");
}

const std::vector<VersionTwoUnreadField>& version_two_unread_fields() {
  static const std::vector<VersionTwoUnreadField> fields = {
      {"forward_prefetch", false, "version 2 prefetches the next unit's all-gather by itself"},
      {"use_orig_params", true, "version 2 always trains the original parameters"},
      {"sync_module_states", false,
       "version 2 does not broadcast rank 0's weights; use cpu_ram_efficient_loading for that"},
  };
  return fields;
}

}  // namespace fsdp::detail
