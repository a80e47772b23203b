// Accelerate's YAML config files (`accelerate config` output) for `fsdp launch --config-file`.
//
// The loader is strict where Accelerate is lax: an unknown key, top level or inside `fsdp_config`,
// is an error with a "did you mean" suggestion (Accelerate silently ignores typos such as
// `fsdp_backward_prefetch_policy`), and keys that configure something fsdp.cpp does not do
// (DeepSpeed, Megatron-LM, TPU pods, dynamo) are errors rather than silently dropped.
#pragma once

#include <fsdp/distributed_environment.h>

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

namespace fsdp {

struct AccelerateConfig {
  /// The file it came from, for messages.
  std::string path;
  std::optional<std::string> distributed_type;
  std::optional<std::string> mixed_precision;
  std::optional<int64_t> num_processes;
  std::optional<int64_t> num_machines;
  std::optional<int64_t> machine_rank;
  std::optional<std::string> main_process_ip;
  std::optional<int64_t> main_process_port;
  /// fsdp_config entries; keys carry the `fsdp_` prefix (added when missing, as Accelerate does),
  /// values are the YAML scalars' text (lists joined with ",").
  std::map<std::string, std::string> fsdp_config;
};

/// Parses YAML text; `path` names it in errors.
AccelerateConfig parse_accelerate_config(const std::string& yaml_text, const std::string& path);
AccelerateConfig load_accelerate_config(const std::string& path);
/// The text of a config file; an error naming the path when it cannot be read.
std::string read_config_file(const std::string& path);

/// The fsdp_config keys Accelerate's launcher knows, with the `fsdp_` prefix.
const std::vector<std::string>& known_fsdp_config_keys();

/// What `fsdp launch` exports to its processes for FSDP (as `accelerate launch`'s
/// prepare_multi_gpu_env), and where each variable came from.
struct FsdpLaunchEnvironment {
  /// Whether FSDP is on (distributed_type FSDP, or --use-fsdp). Nothing is exported otherwise.
  bool use_fsdp = false;
  EnvironmentMap variables;
  /// Variable name -> "fsdp_config.fsdp_x in FILE", "--fsdp-x flag" or "launcher default".
  std::map<std::string, std::string> origins;
};

/// Merges the config file's fsdp_config with `flags` (fsdp_* key -> value; flags win), applies the
/// launcher's defaults, and checks every value by resolving the plugin from the result; an invalid
/// value's error names the YAML key and file or the flag.
FsdpLaunchEnvironment fsdp_launch_environment(const AccelerateConfig* config,
                                              const std::map<std::string, std::string>& flags, bool use_fsdp_flag,
                                              const std::optional<std::string>& mixed_precision_flag);

/// `accelerate to-fsdp2`: the version-2 YAML for a version-1 config file, and the warnings to show.
struct Fsdp2Conversion {
  std::string yaml;
  std::vector<std::string> warnings;
};
Fsdp2Conversion convert_config_to_fsdp2(const std::string& yaml_text, const std::string& path);

}  // namespace fsdp
