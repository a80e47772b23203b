// Any bytes, twice: as an Accelerate YAML config file and as an environment (NAME=VALUE lines) that
// FullyShardedDataParallelPlugin resolves its FSDP_* settings from. A config that parses holds only
// known fsdp_config keys and supported values; the launcher environment built from it names an
// origin for every variable and resolves to a valid plugin; its to-fsdp2 conversion is YAML that
// parses again as a version-2 config. A plugin that resolves obeys the combinations the resolver
// enforces and prints as JSON. Everything else must be a c10::Error; anything else (a crash, a
// sanitizer report, an exception of another type, a hang, runaway memory) is a bug.
#include <c10/util/Exception.h>
#include <fsdp/accelerate_config.h>
#include <fsdp/plugin.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>

namespace {

// TORCH_WARN from every resolution would fill the log and slow the target down.
class SilentWarnings : public c10::WarningHandler {
 public:
  void process(const c10::Warning&) override {}
};

bool trimmed(const std::string& text) {
  return !text.empty() && text.find_first_of(" \t\r\n") != 0 && text.find_last_of(" \t\r\n") != text.size() - 1;
}

void check_plugin(const fsdp::FullyShardedDataParallelPlugin& plugin) {
  using fsdp::AutoWrapKind;
  if (plugin.fsdp_version != 1 && plugin.fsdp_version != 2) std::abort();
  if (plugin.min_num_params < 0) std::abort();
  if (plugin.auto_wrap_policy == AutoWrapKind::kSizeBasedWrap && plugin.min_num_params <= 0) std::abort();
  if (plugin.auto_wrap_policy == AutoWrapKind::kCallable) std::abort();  // no callable was passed
  if (plugin.activation_checkpointing && plugin.auto_wrap_policy == AutoWrapKind::kNoWrap) std::abort();
  if (plugin.activation_checkpointing_offload && (!plugin.activation_checkpointing || plugin.fsdp_version != 2)) {
    std::abort();
  }
  if (plugin.fsdp_version == 1) {
    if (plugin.reshard_after_forward != fsdp::reshards_after_forward(plugin.sharding_strategy)) std::abort();
    if (plugin.cpu_ram_efficient_loading && !plugin.sync_module_states) std::abort();
  } else {
    if (plugin.backward_prefetch || plugin.forward_prefetch || plugin.sync_module_states || !plugin.use_orig_params ||
        plugin.state_dict_type == fsdp::StateDictType::kLocalStateDict) {
      std::abort();
    }
  }
  if (plugin.transformer_cls_names_to_wrap) {
    for (const auto& name : *plugin.transformer_cls_names_to_wrap) {
      if (!trimmed(name)) std::abort();
    }
  }
  // What `fsdp config show` prints: it must be JSON, whatever bytes the values held.
  (void)nlohmann::json::parse(plugin.to_json());
}

void check_config(const fsdp::AccelerateConfig& config) {
  const auto& known = fsdp::known_fsdp_config_keys();
  for (const auto& [key, value] : config.fsdp_config) {
    if (std::find(known.begin(), known.end(), key) == known.end()) std::abort();
  }
  if (config.distributed_type && *config.distributed_type != "FSDP" && *config.distributed_type != "MULTI_CPU" &&
      *config.distributed_type != "MULTI_GPU" && *config.distributed_type != "NO") {
    std::abort();
  }
}

void fuzz_yaml(const std::string& text) {
  fsdp::AccelerateConfig config;
  try {
    config = fsdp::parse_accelerate_config(text, "fuzz.yaml");
  } catch (const c10::Error&) {
    return;
  }
  check_config(config);
  try {
    const auto launch = fsdp::fsdp_launch_environment(&config, {}, /*use_fsdp_flag=*/false, std::nullopt);
    if (launch.use_fsdp != (config.distributed_type == std::string("FSDP"))) std::abort();
    for (const auto& [variable, value] : launch.variables) {
      if (!launch.origins.count(variable)) std::abort();
    }
    // The launcher checked the values by resolving them; each process resolves them again.
    if (launch.use_fsdp) check_plugin(fsdp::resolve_plugin({}, launch.variables, launch.origins));
  } catch (const c10::Error&) {
  }
  try {
    const auto conversion = fsdp::convert_config_to_fsdp2(text, "fuzz.yaml");
    const auto converted = fsdp::parse_accelerate_config(conversion.yaml, "fuzz.yaml converted");
    check_config(converted);
    const auto version = converted.fsdp_config.find("fsdp_version");
    if (!config.fsdp_config.empty() && (version == converted.fsdp_config.end() || version->second != "2")) std::abort();
  } catch (const c10::Error&) {
    // A version-1 value that has no version-2 form (an invalid strategy, LOCAL_STATE_DICT) is refused.
  }
}

void fuzz_environment(const std::string& text) {
  fsdp::EnvironmentMap environment;
  size_t begin = 0;
  while (begin <= text.size()) {
    size_t end = text.find('\n', begin);
    if (end == std::string::npos) end = text.size();
    const std::string line = text.substr(begin, end - begin);
    const size_t equals = line.find('=');
    if (equals != std::string::npos) environment[line.substr(0, equals)] = line.substr(equals + 1);
    begin = end + 1;
  }
  try {
    check_plugin(fsdp::resolve_plugin({}, environment));
  } catch (const c10::Error&) {
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static SilentWarnings silent;
  static const bool installed = (c10::WarningUtils::set_warning_handler(&silent), true);
  (void)installed;
  const std::string text(reinterpret_cast<const char*>(data), size);
  fuzz_yaml(text);
  fuzz_environment(text);
  return 0;
}
