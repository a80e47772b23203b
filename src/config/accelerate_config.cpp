// Accelerate YAML configs: loading, launcher export (as `accelerate launch`'s prepare_multi_gpu_env,
// accelerate/utils/launch.py) and to-fsdp2 (as accelerate/commands/to_fsdp2.py).
#include <c10/util/Exception.h>
#include <fsdp/accelerate_config.h>
#include <fsdp/plugin.h>
#include <yaml-cpp/yaml.h>

#include <algorithm>
#include <filesystem>
#include <sstream>

#include "config/did_you_mean.h"
#include "config/plugin_fields.h"
#include "config/text.h"
#include "io/read_only_file.h"

namespace fsdp {
namespace {

// Top-level keys fsdp.cpp reads.
const std::vector<std::string> kHandledKeys = {"distributed_type",  "mixed_precision", "num_processes",
                                               "num_machines",      "machine_rank",    "main_process_ip",
                                               "main_process_port", "fsdp_config"};
// Keys `accelerate config` writes that do not change an FSDP run here; accepted and not used.
const std::vector<std::string> kInertKeys = {"compute_environment",
                                             "debug",
                                             "downcast_bf16",
                                             "enable_cpu_affinity",
                                             "gpu_ids",
                                             "main_training_function",
                                             "rdzv_backend",
                                             "same_network",
                                             "tpu_env",
                                             "tpu_use_cluster",
                                             "tpu_use_sudo",
                                             "use_cpu",
                                             "tpu_name",
                                             "tpu_zone",
                                             "dynamo_backend"};
// Keys that configure something fsdp.cpp does not do: an error unless empty.
const std::vector<std::string> kUnsupportedSections = {"deepspeed_config",  "megatron_lm_config", "dynamo_config",
                                                       "ipex_config",       "mpirun_config",      "fp8_config",
                                                       "parallelism_config"};

std::string scalar_text(const YAML::Node& node, const std::string& key, const std::string& path) {
  if (node.IsNull()) return "";
  if (node.IsScalar()) return node.Scalar();
  if (node.IsSequence()) {
    std::string joined;
    for (const auto& item : node) {
      TORCH_CHECK(item.IsScalar(), "config file '", path, "': key '", key, "' must be a value or a list of values.");
      joined += (joined.empty() ? "" : ",") + item.Scalar();
    }
    return joined;
  }
  TORCH_CHECK(false, "config file '", path, "': key '", key, "' must be a value, not a mapping.");
}

int64_t integer_value(const YAML::Node& node, const std::string& key, const std::string& path) {
  const std::string text = scalar_text(node, key, path);
  size_t used = 0;
  int64_t value = 0;
  try {
    value = std::stoll(text, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  TORCH_CHECK(!text.empty() && used == text.size(), "config file '", path, "': key '", key,
              "' must be an integer, got '", text, "'.");
  return value;
}

void reject_unknown_key(const std::string& key, const std::vector<std::string>& candidates, const std::string& where,
                        const std::string& path) {
  std::string suggestion = detail::did_you_mean(key, candidates);
  std::string known;
  for (const auto& candidate : candidates) known += (known.empty() ? "" : ", ") + candidate;
  TORCH_CHECK(false, "config file '", path, "': unknown key '", key, "'", where,
              suggestion.empty() ? "" : "; did you mean '" + suggestion + "'?", " Known keys: ", known, ".");
}

std::string normalized_fsdp_key(const std::string& key) { return key.rfind("fsdp", 0) == 0 ? key : "fsdp_" + key; }

// Emits `node` keeping the quotes of quoted scalars, so 'no' stays a string and does not turn
// into the boolean `no` for the next YAML 1.1 reader (PyYAML, i.e. Accelerate).
void emit_preserving_quotes(YAML::Emitter& emitter, const YAML::Node& node) {
  switch (node.Type()) {
    case YAML::NodeType::Map:
      emitter << YAML::BeginMap;
      for (const auto& entry : node) {
        emitter << YAML::Key;
        emit_preserving_quotes(emitter, entry.first);
        emitter << YAML::Value;
        emit_preserving_quotes(emitter, entry.second);
      }
      emitter << YAML::EndMap;
      break;
    case YAML::NodeType::Sequence:
      if (node.size() == 0) emitter << YAML::Flow;  // `key: []`, as PyYAML writes it
      emitter << YAML::BeginSeq;
      for (const auto& item : node) emit_preserving_quotes(emitter, item);
      emitter << YAML::EndSeq;
      break;
    case YAML::NodeType::Scalar:
      if (node.Tag() == "!") emitter << YAML::SingleQuoted;
      emitter << node.Scalar();
      break;
    default:
      emitter << YAML::Null;
  }
}

// YAML aliases let a 1 KB file describe billions of nodes (an "alias bomb"), which writing the file
// back (to-fsdp2) would expand. A config file is small: its tree, aliases expanded, must be too.
constexpr size_t kMaxYamlNodes = 100000;
constexpr int kMaxYamlDepth = 64;

void check_expansion(const YAML::Node& node, size_t& budget, int depth, const std::string& path) {
  TORCH_CHECK(depth <= kMaxYamlDepth, "config file '", path, "' nests deeper than ", kMaxYamlDepth,
              " levels; an Accelerate config is a flat mapping");
  TORCH_CHECK(budget > 0, "config file '", path, "' expands (through YAML aliases) to more than ", kMaxYamlNodes,
              " values; an Accelerate config has a few dozen. Write the values out instead of aliasing them");
  --budget;
  if (node.IsSequence()) {
    for (const auto& child : node) check_expansion(child, budget, depth + 1, path);
  } else if (node.IsMap()) {
    for (const auto& entry : node) {
      check_expansion(entry.first, budget, depth + 1, path);
      check_expansion(entry.second, budget, depth + 1, path);
    }
  }
}

YAML::Node load_yaml(const std::string& yaml_text, const std::string& path) {
  YAML::Node root;
  try {
    root = YAML::Load(yaml_text);
  } catch (const YAML::Exception& error) {
    TORCH_CHECK(false, "config file '", path, "' is not valid YAML: ", error.what(), ".");
  }
  size_t budget = kMaxYamlNodes;
  check_expansion(root, budget, 0, path);
  return root;
}

}  // namespace

const std::vector<std::string>& known_fsdp_config_keys() {
  static const std::vector<std::string> keys = [] {
    std::vector<std::string> names;
    for (const auto& field : detail::plugin_fields()) {
      if (field.yaml_key) names.push_back(field.yaml_key);
    }
    return names;
  }();
  return keys;
}

AccelerateConfig parse_accelerate_config(const std::string& yaml_text, const std::string& path) {
  YAML::Node root = load_yaml(yaml_text, path);
  TORCH_CHECK(root.IsMap(), "config file '", path,
              "' must be a YAML mapping of keys to values (as `accelerate config` "
              "writes); it is ",
              root.IsNull() ? "empty" : "not a mapping", ".");
  AccelerateConfig config;
  config.path = path;
  std::vector<std::string> all_keys = kHandledKeys;
  all_keys.insert(all_keys.end(), kInertKeys.begin(), kInertKeys.end());
  all_keys.insert(all_keys.end(), kUnsupportedSections.begin(), kUnsupportedSections.end());
  for (const auto& entry : root) {
    TORCH_CHECK(entry.first.IsScalar(), "config file '", path, "': every top-level key must be a plain name.");
    const std::string key = entry.first.Scalar();
    const YAML::Node& value = entry.second;
    if (std::find(kUnsupportedSections.begin(), kUnsupportedSections.end(), key) != kUnsupportedSections.end()) {
      TORCH_CHECK(value.IsNull() || (value.IsMap() && value.size() == 0), "config file '", path, "': key '", key,
                  "' configures a feature fsdp.cpp does not provide; remove it (fsdp.cpp runs FSDP only).");
      continue;
    }
    if (std::find(kInertKeys.begin(), kInertKeys.end(), key) != kInertKeys.end()) {
      if (key == "rdzv_backend") {
        const std::string backend = detail::to_lower(scalar_text(value, key, path));
        TORCH_CHECK(backend.empty() || backend == "static", "config file '", path, "': rdzv_backend '", backend,
                    "' is not supported; fsdp launch uses static rendezvous (rank 0 hosts the store). Use 'static'.");
      }
      if (key == "compute_environment") {
        const std::string environment = detail::to_upper(scalar_text(value, key, path));
        TORCH_CHECK(environment.empty() || environment == "LOCAL_MACHINE", "config file '", path,
                    "': compute_environment '", environment, "' is not supported; use LOCAL_MACHINE.");
      }
      continue;
    }
    if (key == "distributed_type") {
      config.distributed_type = detail::to_upper(scalar_text(value, key, path));
      const std::vector<std::string> accepted = {"FSDP", "MULTI_CPU", "MULTI_GPU", "NO"};
      TORCH_CHECK(std::find(accepted.begin(), accepted.end(), *config.distributed_type) != accepted.end(),
                  "config file '", path, "': distributed_type '", *config.distributed_type,
                  "' is not supported by fsdp.cpp; expected one of FSDP, MULTI_CPU, MULTI_GPU, NO.");
    } else if (key == "mixed_precision") {
      config.mixed_precision = detail::to_lower(scalar_text(value, key, path));
      if (*config.mixed_precision != "no")
        mixed_precision_dtype(*config.mixed_precision, "config file '" + path + "': mixed_precision");
    } else if (key == "num_processes") {
      config.num_processes = integer_value(value, key, path);
    } else if (key == "num_machines") {
      config.num_machines = integer_value(value, key, path);
    } else if (key == "machine_rank") {
      config.machine_rank = integer_value(value, key, path);
    } else if (key == "main_process_ip") {
      config.main_process_ip = scalar_text(value, key, path);
    } else if (key == "main_process_port") {
      config.main_process_port = integer_value(value, key, path);
    } else if (key == "fsdp_config") {
      if (value.IsNull()) continue;
      TORCH_CHECK(value.IsMap(), "config file '", path, "': fsdp_config must be a mapping of fsdp_* keys.");
      for (const auto& fsdp_entry : value) {
        TORCH_CHECK(fsdp_entry.first.IsScalar(), "config file '", path,
                    "': every fsdp_config key must be a plain name.");
        const std::string raw_key = fsdp_entry.first.Scalar();
        const std::string fsdp_key = normalized_fsdp_key(raw_key);
        const auto& known = known_fsdp_config_keys();
        if (std::find(known.begin(), known.end(), fsdp_key) == known.end()) {
          reject_unknown_key(raw_key, known, " in fsdp_config", path);
        }
        config.fsdp_config[fsdp_key] = scalar_text(fsdp_entry.second, "fsdp_config." + raw_key, path);
      }
    } else {
      reject_unknown_key(key, all_keys, " at the top level", path);
    }
  }
  return config;
}

std::string read_config_file(const std::string& path) {
  // An Accelerate YAML file is a few kilobytes.
  const std::string fix = "give the path of an Accelerate YAML file";
  const auto file = detail::ReadOnlyFile::open_if_exists(path, uint64_t{16} << 20, "config file", fix);
  TORCH_CHECK(file, "config file '", path, "' cannot be read: it does not exist; ", fix);
  return file->read_text();
}

AccelerateConfig load_accelerate_config(const std::string& path) {
  return parse_accelerate_config(read_config_file(path), path);
}

FsdpLaunchEnvironment fsdp_launch_environment(const AccelerateConfig* config,
                                              const std::map<std::string, std::string>& flags, bool use_fsdp_flag,
                                              const std::optional<std::string>& mixed_precision_flag) {
  FsdpLaunchEnvironment result;
  result.use_fsdp = use_fsdp_flag || (config && config->distributed_type == std::string("FSDP"));
  if (!result.use_fsdp) {
    TORCH_CHECK(flags.empty(), "fsdp launch: --", flags.begin()->first,
                " was given but FSDP is not on; add --use-fsdp or set distributed_type: FSDP in the config file.");
    return result;
  }
  // Flags override the file (as `accelerate launch`'s _validate_launch_command); remember which one spoke for each key.
  std::map<std::string, std::pair<std::string, std::string>> settings;  // key -> (value, origin)
  if (config) {
    for (const auto& [key, value] : config->fsdp_config)
      settings[key] = {value, "fsdp_config." + key + " in " + config->path};
  }
  for (const auto& [key, value] : flags) {
    std::string flag = key;
    std::replace(flag.begin(), flag.end(), '_', '-');
    settings[key] = {value, "--" + flag + " flag"};
  }
  auto value_of = [&](const std::string& key) -> std::optional<std::pair<std::string, std::string>> {
    auto found = settings.find(key);
    if (found == settings.end()) return std::nullopt;
    return found->second;
  };
  auto set = [&](const std::string& variable, const std::string& value, const std::string& origin) {
    result.variables[variable] = value;
    result.origins[variable] = origin;
  };
  auto set_from = [&](const std::string& variable, const std::string& key, const std::optional<std::string>& fallback,
                      bool lowercase) {
    if (auto found = value_of(key))
      set(variable, lowercase ? detail::to_lower(found->first) : found->first, found->second);
    else if (fallback)
      set(variable, *fallback, "launcher default");
  };

  set("ACCELERATE_USE_FSDP", "true", "fsdp launch");
  // Note [one table of plugin fields]: every field with a variable and a key is exported, from the
  // flag, the file or accelerate launch's default; the strategy follows quirk Q1 below.
  const auto& version_field = detail::plugin_field("fsdp_version");
  set_from(version_field.variable, version_field.yaml_key, std::string(version_field.launch_default), false);
  const std::string version = result.variables[version_field.variable];
  // Quirk Q1: Accelerate exports FULL_SHARD here even when a version-1 file names its strategy
  // under fsdp_reshard_after_forward (which is where `accelerate config` writes it).
  const auto& strategy_field = detail::plugin_field("sharding_strategy");
  auto strategy = value_of(strategy_field.yaml_key);
  auto reshard = value_of(detail::plugin_field("reshard_after_forward").yaml_key);
  const bool reshard_is_bool =
      reshard && (detail::to_lower(reshard->first) == "true" || detail::to_lower(reshard->first) == "false");
  if (strategy)
    set(strategy_field.variable, strategy->first, strategy->second);
  else if (version == "1" && reshard && !reshard_is_bool)
    set(strategy_field.variable, reshard->first, reshard->second);
  else
    set(strategy_field.variable, strategy_field.launch_default, "launcher default");
  for (const auto& field : detail::plugin_fields()) {
    const std::string name = field.name;
    if (!field.variable || !field.yaml_key || name == "fsdp_version" || name == "sharding_strategy") continue;
    set_from(field.variable, field.yaml_key,
             field.launch_default ? std::optional<std::string>(field.launch_default) : std::nullopt,
             field.launch_lowercase);
  }
  if (version == "2") {
    // Accelerate's launcher exports these for every version; version 2 does not read them, so only a
    // value the user chose goes to the processes (the plugin warns about it there).
    for (const auto& unread : detail::version_two_unread_fields()) {
      const std::string variable = detail::plugin_field(unread.name).variable;
      if (result.origins[variable] == "launcher default") {
        result.variables.erase(variable);
        result.origins.erase(variable);
      }
    }
  }
  if (mixed_precision_flag)
    set("ACCELERATE_MIXED_PRECISION", detail::to_lower(*mixed_precision_flag), "--mixed-precision flag");
  else if (config && config->mixed_precision)
    set("ACCELERATE_MIXED_PRECISION", *config->mixed_precision, "mixed_precision in " + config->path);
  else
    set("ACCELERATE_MIXED_PRECISION", "no", "launcher default");  // as accelerate launch exports it

  auto describe = [&](const std::string& variable) { return variable + " (from " + result.origins[variable] + ")"; };
  if (version == "1") {
    const bool ram_efficient = detail::parse_bool(result.variables["FSDP_CPU_RAM_EFFICIENT_LOADING"],
                                                  describe("FSDP_CPU_RAM_EFFICIENT_LOADING"));
    const bool sync =
        detail::parse_bool(result.variables["FSDP_SYNC_MODULE_STATES"], describe("FSDP_SYNC_MODULE_STATES"));
    TORCH_CHECK(!ram_efficient || sync, "fsdp launch: fsdp_cpu_ram_efficient_loading is true (",
                result.origins["FSDP_CPU_RAM_EFFICIENT_LOADING"], ") but fsdp_sync_module_states is false (",
                result.origins["FSDP_SYNC_MODULE_STATES"],
                "); with RAM-efficient loading only rank 0 has the weights, so set fsdp_sync_module_states to true.");
  }
  // Check every value now, in the launcher, where the error can name the YAML key or flag.
  resolve_plugin(FullyShardedDataParallelPluginArgs{}, result.variables, result.origins);
  return result;
}

Fsdp2Conversion convert_config_to_fsdp2(const std::string& yaml_text, const std::string& path) {
  YAML::Node root = load_yaml(yaml_text, path);
  TORCH_CHECK(!root.IsNull(), "config file '", path, "' is empty.");
  parse_accelerate_config(yaml_text, path);  // the same key checks as launch
  Fsdp2Conversion conversion;
  YAML::Node fsdp = root["fsdp_config"];
  if (!fsdp || fsdp.IsNull()) {
    conversion.warnings.push_back("'" + path + "' has no fsdp_config; nothing to convert.");
  } else if (fsdp["fsdp_version"] && fsdp["fsdp_version"].Scalar() == "2") {
    conversion.warnings.push_back("'" + path + "' is already fsdp_version 2; nothing to convert.");
  } else {
    // As `accelerate to-fsdp2`: strategies that reshard become true (digits too, which Accelerate skips).
    auto to_bool = [&](const std::string& raw_key, const std::string& value) -> bool {
      const std::string lowered = detail::to_lower(value);
      if (lowered == "true" || lowered == "false") return lowered == "true";
      return reshards_after_forward(parse_sharding_strategy(value, raw_key, "fsdp_config." + raw_key + " in " + path));
    };
    bool has_reshard_key = false;
    for (const auto& entry : fsdp)
      has_reshard_key |= normalized_fsdp_key(entry.first.Scalar()) == "fsdp_reshard_after_forward";
    YAML::Node converted(YAML::NodeType::Map);
    for (const auto& entry : fsdp) {
      const std::string raw_key = entry.first.as<std::string>();
      const std::string key = normalized_fsdp_key(raw_key);
      const std::string value = entry.second.IsScalar() ? entry.second.Scalar() : "";
      if (key == "fsdp_sharding_strategy" || key == "fsdp_reshard_after_forward") {
        if (key == "fsdp_sharding_strategy" && has_reshard_key) continue;  // the newer key wins
        const bool reshard = to_bool(raw_key, value);
        converted["fsdp_reshard_after_forward"] = reshard;
        if (key == "fsdp_sharding_strategy") {
          conversion.warnings.push_back("fsdp_sharding_strategy: " + value +
                                        " became fsdp_reshard_after_forward: " + (reshard ? "true" : "false") + ".");
        }
      } else if (key == "fsdp_backward_prefetch" || key == "fsdp_sync_module_states" || key == "fsdp_use_orig_params") {
        conversion.warnings.push_back(key + " is not used by FSDP version 2; removed.");
      } else if (key == "fsdp_forward_prefetch") {
        conversion.warnings.push_back("fsdp_forward_prefetch is not implemented for FSDP version 2; removed.");
      } else if (key == "fsdp_version") {
        continue;
      } else {
        TORCH_CHECK(!(key == "fsdp_state_dict_type" && (detail::to_upper(value) == "LOCAL_STATE_DICT" || value == "2")),
                    "config file '", path,
                    "': fsdp_state_dict_type LOCAL_STATE_DICT does not exist in FSDP version 2; "
                    "set it to SHARDED_STATE_DICT or FULL_STATE_DICT before converting.");
        converted[raw_key] = entry.second;
      }
    }
    converted["fsdp_version"] = 2;
    root["fsdp_config"] = converted;
  }
  YAML::Emitter emitter;
  emit_preserving_quotes(emitter, root);
  // By size, not c_str(): a scalar may hold a NUL ("\0" in double quotes), which c_str() would end at.
  conversion.yaml = std::string(emitter.c_str(), emitter.size()) + "\n";
  return conversion;
}

}  // namespace fsdp
