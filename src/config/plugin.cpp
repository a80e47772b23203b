// Resolution of FullyShardedDataParallelPlugin, following Accelerate's
// FullyShardedDataParallelPlugin.__post_init__ (accelerate/utils/dataclasses.py)
// step by step, with the deliberate fixes listed in include/fsdp/plugin.h.
#include <c10/util/Exception.h>
#include <fsdp/plugin.h>

#include <algorithm>
#include <cctype>
#include <initializer_list>
#include <nlohmann/json.hpp>
#include <regex>
#include <sstream>

#include "config/did_you_mean.h"
#include "config/plugin_fields.h"
#include "config/text.h"

namespace fsdp {
namespace {

// FSDP_* variables read by the rest of fsdp.cpp rather than the plugin: the collectives' (timeout,
// check, algorithm table, FSDP_DEBUG's choices), the device, and the build and test scripts' settings
// (scripts/setup.sh); FSDP_TEST_*
// names belong to the test suite too. Any other FSDP_* variable is a warning when a plugin is
// resolved, so these are known here, not exported.
const std::vector<std::string>& tool_environment_variables() {
  static const std::vector<std::string> variables = {"FSDP_COLLECTIVE_TIMEOUT",
                                                     "FSDP_CHECK_COLLECTIVES",
                                                     "FSDP_COLLECTIVE_TABLE",
                                                     "FSDP_DEBUG",
                                                     "FSDP_DEVICE",
                                                     "FSDP_BUILD_DIR",
                                                     "FSDP_BUILD_JOBS",
                                                     "FSDP_PYTHON",
                                                     "FSDP_TEST_JOBS",
                                                     "FSDP_TEST_PYTHON",
                                                     "FSDP_TORCH_PREFIX",
                                                     "FSDP_VENV"};
  return variables;
}

// The FSDP_* variable of plugin field `field` (Note [one table of plugin fields]).
const char* variable_of(const char* field) { return detail::plugin_field(field).variable; }

bool is_digits(const std::string& text) {
  return !text.empty() &&
         std::all_of(text.begin(), text.end(), [](char c) { return std::isdigit(static_cast<unsigned char>(c)); });
}

template <class Enum>
struct EnumNames {
  std::vector<std::pair<std::string, Enum>> names;  // index + 1 is the torch value

  std::string accepted() const {
    std::string text;
    for (size_t index = 0; index < names.size(); ++index) {
      text += (index ? ", " : "") + names[index].first;
    }
    return text + " (case-insensitive) or 1-" + std::to_string(names.size());
  }

  Enum parse(const std::string& field, const std::string& value, const std::string& origin) const {
    const std::string key = detail::to_upper(detail::trim(value));
    for (const auto& [name, entry] : names) {
      if (name == key) return entry;
    }
    if (is_digits(key)) {
      const auto number = std::stoll(key);
      if (number >= 1 && number <= static_cast<long long>(names.size())) return names[number - 1].second;
    }
    TORCH_CHECK(false, "FullyShardedDataParallelPlugin: ", field, "='", value, "' (from ", origin,
                ") is not valid; expected one of ", accepted(), ".");
  }

  Enum from_number(const std::string& field, int64_t number, const std::string& origin) const {
    TORCH_CHECK(number >= 1 && number <= static_cast<int64_t>(names.size()), "FullyShardedDataParallelPlugin: ", field,
                "=", number, " (from ", origin, ") is not valid; expected one of ", accepted(), ".");
    return names[number - 1].second;
  }

  /// A typed value, a torch number or a name; `Value` is any variant of those (and of bool, which
  /// callers reject before asking).
  template <class Value>
  Enum parse_value(const std::string& field, const Value& value, const std::string& origin) const {
    return std::visit(
        [&](const auto& alternative) -> Enum {
          using T = std::decay_t<decltype(alternative)>;
          if constexpr (std::is_same_v<T, Enum>) {
            return alternative;
          } else if constexpr (std::is_same_v<T, int64_t>) {
            return from_number(field, alternative, origin);
          } else if constexpr (std::is_same_v<T, std::string>) {
            return parse(field, alternative, origin);
          } else {
            TORCH_INTERNAL_ASSERT(false, field, ": unexpected alternative");
          }
        },
        value);
  }

  const std::string& name_of(Enum value) const {
    for (const auto& [name, entry] : names) {
      if (entry == value) return name;
    }
    TORCH_INTERNAL_ASSERT(false, "unnamed enum value");
  }
};

/// The names of `values` as their layer's to_string gives them, in torch's order (a digit string
/// is the position).
template <class Enum>
EnumNames<Enum> named_by_to_string(std::initializer_list<Enum> values) {
  EnumNames<Enum> names;
  for (auto value : values) names.names.emplace_back(to_string(value), value);
  return names;
}

const EnumNames<ShardingStrategy>& sharding_names() {
  static const auto names =
      named_by_to_string({ShardingStrategy::kFullShard, ShardingStrategy::kShardGradOp, ShardingStrategy::kNoShard,
                          ShardingStrategy::kHybridShard, ShardingStrategy::kHybridShardZero2});
  return names;
}

const EnumNames<BackwardPrefetch>& prefetch_names() {
  static const EnumNames<BackwardPrefetch> names{
      {{"BACKWARD_PRE", BackwardPrefetch::kBackwardPre}, {"BACKWARD_POST", BackwardPrefetch::kBackwardPost}}};
  return names;
}

const EnumNames<StateDictType>& state_dict_names() {
  static const auto names = named_by_to_string(
      {StateDictType::kFullStateDict, StateDictType::kLocalStateDict, StateDictType::kShardedStateDict});
  return names;
}

const std::vector<std::pair<std::string, AutoWrapKind>>& wrap_names() {
  static const std::vector<std::pair<std::string, AutoWrapKind>> names = {
      {"TRANSFORMER_BASED_WRAP", AutoWrapKind::kTransformerBasedWrap},
      {"SIZE_BASED_WRAP", AutoWrapKind::kSizeBasedWrap},
      {"NO_WRAP", AutoWrapKind::kNoWrap}};
  return names;
}

StateDictConfig default_config(StateDictType type) {
  switch (type) {
    case StateDictType::kFullStateDict:
      return {true, true};
    case StateDictType::kShardedStateDict:
      return {true, false};
    case StateDictType::kLocalStateDict:
      return {false, false};
  }
  return {};
}

// One resolution: the inputs, and the plugin being filled in.
class Resolver {
 public:
  Resolver(const FullyShardedDataParallelPluginArgs& args, const EnvironmentMap& environment,
           const std::map<std::string, std::string>& origins, FullyShardedDataParallelPlugin& plugin)
      : args_(args), environment_(environment), origins_(origins), plugin_(plugin) {}

  void run() {
    resolve_version();
    resolve_sharding();
    resolve_cpu_offload();
    resolve_backward_prefetch();
    resolve_state_dict_type();
    resolve_auto_wrap();
    resolve_version_one_bools();
    resolve_remaining_bools();
    resolve_ignored_modules();
    resolve_mixed_precision();
    resolve_param_init_fn();
    validate_combinations();
    warn_about_unread_variables();
    warn_about_values_without_effect();
  }

 private:
  struct Found {
    std::string value;
    std::string origin;
  };

  std::optional<Found> environment_value(const std::string& name) const {
    auto entry = environment_.find(name);
    if (entry == environment_.end()) return std::nullopt;
    std::string origin = "environment variable " + name;
    if (auto described = origins_.find(name); described != origins_.end()) origin += " set from " + described->second;
    return Found{entry->second, origin};
  }

  void source(const std::string& field, const std::string& origin) { plugin_.sources[field] = origin; }

  bool parse_bool_setting(const std::string& field, const std::optional<std::variant<bool, std::string>>& argument,
                          const char* variable, bool fallback) {
    if (argument) {
      source(field, "argument");
      if (std::holds_alternative<bool>(*argument)) return std::get<bool>(*argument);
      return detail::parse_bool(std::get<std::string>(*argument), field + " (from argument)");
    }
    if (variable != nullptr) {
      if (auto found = environment_value(variable)) {
        source(field, found->origin);
        return detail::parse_bool(found->value, field + " (from " + found->origin + ")");
      }
    }
    source(field, "default");
    return fallback;
  }

  void resolve_version() {
    std::string text;
    std::string origin;
    if (args_.fsdp_version) {
      origin = "argument";
      text = std::holds_alternative<int64_t>(*args_.fsdp_version)
                 ? std::to_string(std::get<int64_t>(*args_.fsdp_version))
                 : std::get<std::string>(*args_.fsdp_version);
    } else if (auto found = environment_value(variable_of("fsdp_version"))) {
      text = found->value;
      origin = found->origin;
    } else {
      text = "1";
      origin = "default";
    }
    TORCH_CHECK(detail::trim(text) == "1" || detail::trim(text) == "2",
                "FullyShardedDataParallelPlugin: fsdp_version='", text, "' (from ", origin,
                ") is not valid; expected 1 or 2.");
    plugin_.fsdp_version = std::stoll(detail::trim(text));
    source("fsdp_version", origin);
  }

  void resolve_sharding() {
    std::optional<ShardingStrategy> explicit_strategy;
    if (args_.sharding_strategy) {
      explicit_strategy = sharding_names().parse_value("sharding_strategy", *args_.sharding_strategy, "argument");
      warn("sharding_strategy is deprecated in favor of reshard_after_forward; set reshard_after_forward instead.");
    }
    if (plugin_.fsdp_version == 1) {
      std::optional<ShardingStrategy> explicit_reshard;
      if (args_.reshard_after_forward) {
        TORCH_CHECK(!std::holds_alternative<bool>(*args_.reshard_after_forward),
                    "FullyShardedDataParallelPlugin: reshard_after_forward=",
                    std::get<bool>(*args_.reshard_after_forward) ? "true" : "false",
                    " (from argument) is a bool, which FSDP version 1 does not take; pass a strategy (",
                    sharding_names().accepted(), "), or set fsdp_version=2.");
        explicit_reshard =
            sharding_names().parse_value("reshard_after_forward", *args_.reshard_after_forward, "argument");
      }
      TORCH_CHECK(!explicit_strategy || !explicit_reshard || *explicit_strategy == *explicit_reshard,
                  "FullyShardedDataParallelPlugin: sharding_strategy=", to_string(*explicit_strategy),
                  " and reshard_after_forward=", to_string(*explicit_reshard),
                  " (both arguments) disagree; set only reshard_after_forward.");
      if (explicit_strategy || explicit_reshard) {
        plugin_.sharding_strategy = explicit_strategy ? *explicit_strategy : *explicit_reshard;
        source("sharding_strategy", "argument");
      } else if (auto found = environment_value(variable_of("sharding_strategy"))) {
        plugin_.sharding_strategy = sharding_names().parse("sharding_strategy", found->value, found->origin);
        source("sharding_strategy", found->origin);
      } else if (auto found = environment_value(variable_of("reshard_after_forward"))) {
        // Version 1 reads its strategy from here too (Accelerate never does: quirk Q1); a bool
        // string means FULL_SHARD (true) or SHARD_GRAD_OP (false), as `fsdp to-fsdp2` maps them.
        const std::string key = detail::to_lower(detail::trim(found->value));
        if (key == "true" || key == "false") {
          plugin_.sharding_strategy = key == "true" ? ShardingStrategy::kFullShard : ShardingStrategy::kShardGradOp;
        } else {
          plugin_.sharding_strategy = sharding_names().parse("reshard_after_forward", found->value, found->origin);
        }
        source("sharding_strategy", found->origin);
      } else {
        plugin_.sharding_strategy = ShardingStrategy::kFullShard;
        source("sharding_strategy", "default");
      }
      plugin_.reshard_after_forward = reshards_after_forward(plugin_.sharding_strategy);
      source("reshard_after_forward", "derived from sharding_strategy");
      return;
    }

    // Version 2: a bool, or a group size of 2 or more (FSDP2's int, hpZ). Accelerate raises on an
    // int; torch's fully_shard takes it, so we pass it on (docs/plugin.md, "Differences"). "1" and
    // "0" stay bools, as Accelerate's str_to_bool reads them.
    if (args_.reshard_after_forward) {
      const auto& value = *args_.reshard_after_forward;
      const auto* number = std::get_if<int64_t>(&value);
      const auto* text = std::get_if<std::string>(&value);
      if (auto* flag = std::get_if<bool>(&value)) {
        plugin_.reshard_after_forward = *flag;
      } else if (text && is_bool_string(*text)) {
        plugin_.reshard_after_forward = detail::parse_bool(*text, "reshard_after_forward (from argument)");
      } else if (number && *number >= 2) {
        plugin_.reshard_after_forward = *number;
      } else if (auto size = text ? group_size_string(*text) : std::nullopt) {
        plugin_.reshard_after_forward = *size;
      } else {
        std::string shown = std::holds_alternative<ShardingStrategy>(value)
                                ? to_string(std::get<ShardingStrategy>(value))
                            : std::holds_alternative<int64_t>(value) ? std::to_string(std::get<int64_t>(value))
                                                                     : std::get<std::string>(value);
        TORCH_CHECK(false, "FullyShardedDataParallelPlugin: reshard_after_forward='", shown,
                    "' (from argument) is not supported with FSDP version 2; set a bool (true behaves as FULL_SHARD, "
                    "false as SHARD_GRAD_OP) or a group size of 2 or more (hpZ: parameters stay sharded over that "
                    "many ranks between forward and backward). `fsdp to-fsdp2` converts a version-1 config file.");
      }
      source("reshard_after_forward", "argument");
    } else if (explicit_strategy) {
      // Accelerate raises here (quirk Q2); converting as `to-fsdp2` does is what the user meant.
      plugin_.reshard_after_forward = reshards_after_forward(*explicit_strategy);
      source("reshard_after_forward", "derived from the sharding_strategy argument");
    } else if (auto found = environment_value(variable_of("reshard_after_forward"))) {
      const auto size = group_size_string(found->value);
      TORCH_CHECK(is_bool_string(found->value) || size, "FullyShardedDataParallelPlugin: reshard_after_forward='",
                  found->value, "' (from ", found->origin,
                  ") is not supported with FSDP version 2; expected a bool (true/false, yes/no, 1/0, ...) or a group "
                  "size of 2 or more (hpZ). `fsdp to-fsdp2` converts a version-1 config file.");
      if (size)
        plugin_.reshard_after_forward = *size;
      else
        plugin_.reshard_after_forward = detail::parse_bool(found->value, "reshard_after_forward");
      source("reshard_after_forward", found->origin);
    } else {
      plugin_.reshard_after_forward = true;
      source("reshard_after_forward", "default");
    }
    if (explicit_strategy) {
      plugin_.sharding_strategy = *explicit_strategy;
      source("sharding_strategy", "argument");
    } else {
      plugin_.sharding_strategy = static_cast<bool>(plugin_.reshard_after_forward) ? ShardingStrategy::kFullShard
                                                                                   : ShardingStrategy::kShardGradOp;
      source("sharding_strategy", "derived from reshard_after_forward");
    }
  }

  static bool is_bool_string(const std::string& text) { return detail::truth_value(text).has_value(); }
  // A decimal group size of 2 or more with nothing around it ("8"); "1" and "0" are bools.
  static std::optional<int64_t> group_size_string(const std::string& text) {
    if (!is_digits(text) || text.size() > 9) return std::nullopt;
    const int64_t value = std::stoll(text);
    return value >= 2 ? std::optional<int64_t>(value) : std::nullopt;
  }

  void resolve_cpu_offload() {
    if (args_.cpu_offload && std::holds_alternative<CpuOffloadPolicy>(*args_.cpu_offload)) {
      plugin_.cpu_offload = std::get<CpuOffloadPolicy>(*args_.cpu_offload);
      source("cpu_offload", "argument");
      return;
    }
    std::optional<std::variant<bool, std::string>> flag;
    if (args_.cpu_offload) {
      if (auto* value = std::get_if<bool>(&*args_.cpu_offload))
        flag = *value;
      else
        flag = std::get<std::string>(*args_.cpu_offload);
    }
    plugin_.cpu_offload.offload_params = parse_bool_setting("cpu_offload", flag, variable_of("cpu_offload"), false);
  }

  void resolve_backward_prefetch() {
    std::optional<BackwardPrefetch> prefetch;
    if (args_.backward_prefetch) {
      source("backward_prefetch", "argument");
      const auto& value = *args_.backward_prefetch;
      auto* text = std::get_if<std::string>(&value);
      if (text == nullptr || detail::to_upper(detail::trim(*text)) != "NO_PREFETCH") {
        prefetch = prefetch_names().parse_value("backward_prefetch", value, "argument");
      }
    } else if (auto found = environment_value(variable_of("backward_prefetch"))) {
      source("backward_prefetch", found->origin);
      if (detail::to_upper(detail::trim(found->value)) != "NO_PREFETCH")
        prefetch = prefetch_names().parse("backward_prefetch", found->value, found->origin);
    } else {
      source("backward_prefetch", "default");
    }
    if (plugin_.fsdp_version == 2 && prefetch) {
      warn("backward_prefetch is not supported in FSDP version 2 (it prefetches by itself); set to none.");
      prefetch.reset();
    }
    plugin_.backward_prefetch = prefetch;
  }

  void resolve_state_dict_type() {
    std::string origin;
    if (args_.state_dict_type) {
      origin = "argument";
      plugin_.state_dict_type = state_dict_names().parse_value("state_dict_type", *args_.state_dict_type, origin);
    } else if (auto found = environment_value(variable_of("state_dict_type"))) {
      origin = found->origin;
      plugin_.state_dict_type = state_dict_names().parse("state_dict_type", found->value, origin);
    } else {
      origin = "default";
      plugin_.state_dict_type =
          plugin_.fsdp_version == 2 ? StateDictType::kShardedStateDict : StateDictType::kFullStateDict;
    }
    source("state_dict_type", origin);
    TORCH_CHECK(!(plugin_.fsdp_version == 2 && plugin_.state_dict_type == StateDictType::kLocalStateDict),
                "FullyShardedDataParallelPlugin: state_dict_type=LOCAL_STATE_DICT (from ", origin,
                ") is not supported with FSDP version 2; set it to SHARDED_STATE_DICT or FULL_STATE_DICT.");
    plugin_.state_dict_config_explicit = args_.state_dict_config.has_value();
    plugin_.optim_state_dict_config_explicit = args_.optim_state_dict_config.has_value();
    if (args_.state_dict_config) plugin_.state_dict_config = *args_.state_dict_config;
    if (args_.optim_state_dict_config) plugin_.optim_state_dict_config = *args_.optim_state_dict_config;
    plugin_.set_state_dict_type(plugin_.state_dict_type);
    source("state_dict_config", plugin_.state_dict_config_explicit ? "argument" : "derived from state_dict_type");
    source("optim_state_dict_config",
           plugin_.optim_state_dict_config_explicit ? "argument" : "derived from state_dict_type");
  }

  void resolve_auto_wrap() {
    std::string policy;
    std::string origin;
    if (args_.auto_wrap_policy && std::holds_alternative<AutoWrapCallable>(*args_.auto_wrap_policy)) {
      plugin_.auto_wrap_policy = AutoWrapKind::kCallable;
      plugin_.auto_wrap_callable = std::get<AutoWrapCallable>(*args_.auto_wrap_policy);
      TORCH_CHECK(plugin_.auto_wrap_callable,
                  "FullyShardedDataParallelPlugin: auto_wrap_policy (from argument) is an "
                  "empty function; pass a callable or a policy name.");
      source("auto_wrap_policy", "argument");
    } else {
      if (args_.auto_wrap_policy) {
        policy = std::get<std::string>(*args_.auto_wrap_policy);
        origin = "argument";
      } else if (auto found = environment_value(variable_of("auto_wrap_policy"))) {
        policy = found->value;
        origin = found->origin;
      } else {
        policy = "NO_WRAP";
        origin = "default";
      }
      source("auto_wrap_policy", origin);
      bool known = false;
      for (const auto& [name, kind] : wrap_names()) {
        if (name == detail::to_upper(detail::trim(policy))) {
          plugin_.auto_wrap_policy = kind;
          known = true;
        }
      }
      TORCH_CHECK(known, "FullyShardedDataParallelPlugin: auto_wrap_policy='", policy, "' (from ", origin,
                  ") is not valid; expected one of TRANSFORMER_BASED_WRAP, SIZE_BASED_WRAP, NO_WRAP (case-insensitive) "
                  "or a callable.");
    }

    // Class names: read from the environment only for the transformer policy, as Accelerate does.
    if (args_.transformer_cls_names_to_wrap) {
      const auto& value = *args_.transformer_cls_names_to_wrap;
      plugin_.transformer_cls_names_to_wrap =
          std::holds_alternative<std::string>(value)
              ? split_class_names(std::get<std::string>(value), "argument")
              : clean_class_names(std::get<std::vector<std::string>>(value), "argument");
      source("transformer_cls_names_to_wrap", "argument");
      if (plugin_.auto_wrap_policy != AutoWrapKind::kTransformerBasedWrap) {
        warn(std::string("transformer_cls_names_to_wrap is set but auto_wrap_policy is ") +
             to_string(plugin_.auto_wrap_policy) + ", so the names are not used.");
      }
    } else if (plugin_.auto_wrap_policy == AutoWrapKind::kTransformerBasedWrap) {
      if (auto found = environment_value(variable_of("transformer_cls_names_to_wrap"))) {
        plugin_.transformer_cls_names_to_wrap = split_class_names(found->value, found->origin);
        source("transformer_cls_names_to_wrap", found->origin);
      } else {
        source("transformer_cls_names_to_wrap", "default (the model's no-split modules)");
      }
    } else {
      source("transformer_cls_names_to_wrap", "default");
    }

    if (args_.min_num_params) {
      const auto& value = *args_.min_num_params;
      plugin_.min_num_params = std::holds_alternative<int64_t>(value)
                                   ? std::get<int64_t>(value)
                                   : parse_integer("min_num_params", std::get<std::string>(value), "argument");
      source("min_num_params", "argument");
    } else if (plugin_.auto_wrap_policy == AutoWrapKind::kSizeBasedWrap) {
      if (auto found = environment_value(variable_of("min_num_params"))) {
        plugin_.min_num_params = parse_integer("min_num_params", found->value, found->origin);
        source("min_num_params", found->origin);
      } else {
        source("min_num_params", "default");
      }
    } else {
      source("min_num_params", "default");
    }
    TORCH_CHECK(plugin_.min_num_params >= 0, "FullyShardedDataParallelPlugin: min_num_params=", plugin_.min_num_params,
                " (from ", plugin_.sources["min_num_params"], ") must not be negative.");
    // Accelerate silently wraps nothing here; a size policy that can never fire is a mistake.
    TORCH_CHECK(plugin_.auto_wrap_policy != AutoWrapKind::kSizeBasedWrap || plugin_.min_num_params > 0,
                "FullyShardedDataParallelPlugin: auto_wrap_policy=SIZE_BASED_WRAP needs min_num_params > 0 but it is ",
                plugin_.min_num_params, " (from ", plugin_.sources["min_num_params"],
                "); set min_num_params (FSDP_MIN_NUM_PARAMS), e.g. 100000000, or use NO_WRAP.");
  }

  static int64_t parse_integer(const std::string& field, const std::string& value, const std::string& origin) {
    const std::string text = detail::trim(value);
    size_t used = 0;
    int64_t number = 0;
    bool ok = !text.empty();
    try {
      number = std::stoll(text, &used);
    } catch (const std::exception&) {
      ok = false;
    }
    TORCH_CHECK(ok && used == text.size(), "FullyShardedDataParallelPlugin: ", field, " must be an integer but got '",
                value, "' (from ", origin, ").");
    return number;
  }

  static std::vector<std::string> clean_class_names(const std::vector<std::string>& names, const std::string& origin) {
    std::vector<std::string> cleaned;
    for (const auto& name : names) {
      std::string stripped = detail::trim(name);
      TORCH_CHECK(!stripped.empty(), "FullyShardedDataParallelPlugin: transformer_cls_names_to_wrap (from ", origin,
                  ") has an empty class name; write names such as \"LlamaDecoderLayer,MLPBlock\".");
      cleaned.push_back(stripped);
    }
    return cleaned;
  }

  // Accelerate splits on "," without stripping (quirk Q16): "A, B" would look for " B".
  static std::vector<std::string> split_class_names(const std::string& text, const std::string& origin) {
    std::vector<std::string> names;
    std::stringstream stream(text);
    for (std::string name; std::getline(stream, name, ',');) names.push_back(name);
    if (!text.empty() && text.back() == ',') names.emplace_back();
    return clean_class_names(names, origin);
  }

  void resolve_version_one_bools() {
    struct VersionOneBool {
      const char* field;
      const std::optional<std::variant<bool, std::string>>& argument;
      const char* variable;
      bool& target;
    };
    for (VersionOneBool setting : {VersionOneBool{"use_orig_params", args_.use_orig_params,
                                                  variable_of("use_orig_params"), plugin_.use_orig_params},
                                   VersionOneBool{"sync_module_states", args_.sync_module_states,
                                                  variable_of("sync_module_states"), plugin_.sync_module_states}}) {
      if (plugin_.fsdp_version == 1) {
        // fsdp.cpp always trains the original parameters (no flat parameters), so use_orig_params
        // resolves to true unless set, and false is a warning (warn_about_values_without_effect).
        const bool fallback = std::string(setting.field) == "use_orig_params";
        setting.target = parse_bool_setting(setting.field, setting.argument, setting.variable, fallback);
      } else {
        // Version 2 always trains the original parameters and never syncs at wrap time: the resolved
        // values say so.
        setting.target = std::string(setting.field) == "use_orig_params";
        source(setting.field, "default (not used by FSDP version 2)");
        if (setting.argument) {
          warn(std::string(setting.field) + " is not used by FSDP version 2 (" +
               (std::string(setting.field) == "use_orig_params" ? "parameters are always the original ones"
                                                                : "sharding from a materialized rank 0 replaces it") +
               "); ignoring the value given.");
        }
      }
    }
    if (plugin_.fsdp_version == 1) {
      plugin_.forward_prefetch =
          parse_bool_setting("forward_prefetch", args_.forward_prefetch, variable_of("forward_prefetch"), false);
    } else {
      const bool requested =
          args_.forward_prefetch && (std::holds_alternative<bool>(*args_.forward_prefetch)
                                         ? std::get<bool>(*args_.forward_prefetch)
                                         : detail::parse_bool(std::get<std::string>(*args_.forward_prefetch),
                                                              "forward_prefetch (from argument)"));
      TORCH_CHECK(!requested,
                  "FullyShardedDataParallelPlugin: forward_prefetch=true (from argument) is not implemented "
                  "for FSDP version 2; leave it unset or use fsdp_version=1.");
      plugin_.forward_prefetch = false;
      source("forward_prefetch", "default");
    }
  }

  void resolve_remaining_bools() {
    plugin_.activation_checkpointing = parse_bool_setting("activation_checkpointing", args_.activation_checkpointing,
                                                          variable_of("activation_checkpointing"), false);
    plugin_.activation_checkpointing_offload =
        parse_bool_setting("activation_checkpointing_offload", args_.activation_checkpointing_offload,
                           variable_of("activation_checkpointing_offload"), false);
    // Accelerate's two checks, in its order and with its words, plus where the value came from.
    TORCH_CHECK(!plugin_.activation_checkpointing_offload || plugin_.activation_checkpointing,
                "`activation_checkpointing_offload=True` requires `activation_checkpointing=True`. (",
                "activation_checkpointing_offload from ", plugin_.sources["activation_checkpointing_offload"],
                "; turn activation_checkpointing on, FSDP_ACTIVATION_CHECKPOINTING=true, or the offload off.)");
    TORCH_CHECK(!plugin_.activation_checkpointing_offload || plugin_.fsdp_version == 2,
                "`activation_checkpointing_offload=True` requires `fsdp_version=2`. (activation_checkpointing_offload "
                "from ",
                plugin_.sources["activation_checkpointing_offload"], ", fsdp_version ", plugin_.fsdp_version, " from ",
                plugin_.sources["fsdp_version"], ".)");
    plugin_.cpu_ram_efficient_loading = parse_bool_setting("cpu_ram_efficient_loading", args_.cpu_ram_efficient_loading,
                                                           variable_of("cpu_ram_efficient_loading"), false);
    plugin_.limit_all_gathers = args_.limit_all_gathers.value_or(true);
    source("limit_all_gathers", args_.limit_all_gathers ? "argument" : "default");
    if (plugin_.fsdp_version == 1 && plugin_.cpu_ram_efficient_loading && !plugin_.sync_module_states) {
      warn(
          "sync_module_states cannot be false with cpu_ram_efficient_loading on (the other ranks start with empty "
          "weights); setting sync_module_states to true.");
      plugin_.sync_module_states = true;
      source("sync_module_states", "derived from cpu_ram_efficient_loading");
    }
  }

  void resolve_ignored_modules() {
    std::optional<Found> regex;
    if (args_.ignored_modules) {
      source("ignored_modules", "argument");
      if (auto* text = std::get_if<std::string>(&*args_.ignored_modules)) {
        regex = Found{*text, "argument"};
      } else {
        plugin_.ignored_modules.modules =
            std::get<std::vector<std::shared_ptr<torch::nn::Module>>>(*args_.ignored_modules);
        for (const auto& module : plugin_.ignored_modules.modules) {
          TORCH_CHECK(module != nullptr,
                      "FullyShardedDataParallelPlugin: ignored_modules (from argument) contains a "
                      "null module.");
        }
      }
    } else if (auto found = environment_value(variable_of("ignored_modules"))) {
      source("ignored_modules", found->origin);
      regex = found;
    } else {
      source("ignored_modules", "default");
    }
    if (regex) {
      try {
        std::regex compiled(regex->value);
        (void)compiled;
      } catch (const std::regex_error& error) {
        TORCH_CHECK(false, "FullyShardedDataParallelPlugin: ignored_modules='", regex->value, "' (from ", regex->origin,
                    ") is not a valid regular expression: ", error.what(),
                    ". It is fullmatched against module names such as 'model.layers.0.mlp'.");
      }
      plugin_.ignored_modules.name_regex = regex->value;
    }
  }

  void resolve_mixed_precision() {
    if (!args_.mixed_precision_policy) {
      source("mixed_precision_policy", "default");
      return;
    }
    source("mixed_precision_policy", "argument");
    const auto& value = *args_.mixed_precision_policy;
    if (auto* name = std::get_if<std::string>(&value)) {
      plugin_.set_mixed_precision(*name, false, true);
      return;
    }
    if (auto* policy = std::get_if<MixedPrecisionPolicy>(&value)) {
      plugin_.mixed_precision_policy = *policy;
      return;
    }
    const auto& dict = std::get<std::map<std::string, c10::ScalarType>>(value);
    const std::string third = plugin_.fsdp_version == 1 ? "buffer_dtype" : "output_dtype";
    const std::vector<std::string> required = {"param_dtype", "reduce_dtype", third};
    std::string shown = "{";
    for (const auto& [key, dtype] : dict) shown += (shown.size() > 1 ? ", " : "") + key + ": " + c10::toString(dtype);
    shown += "}";
    for (const auto& key : required) {
      TORCH_CHECK(dict.count(key), "FullyShardedDataParallelPlugin: mixed_precision_policy ", shown,
                  " (from argument) lacks '", key, "'; FSDP version ", plugin_.fsdp_version,
                  " needs keys param_dtype, reduce_dtype and ", third, ".");
    }
    MixedPrecisionPolicy policy;
    for (const auto& [key, dtype] : dict) {
      TORCH_CHECK(dtype == c10::kFloat || dtype == c10::kHalf || dtype == c10::kBFloat16,
                  "FullyShardedDataParallelPlugin: mixed_precision_policy ", shown, " (from argument) has ", key, "=",
                  c10::toString(dtype), "; values must be Float, Half or BFloat16.");
      if (key == "param_dtype")
        policy.param_dtype = dtype;
      else if (key == "reduce_dtype")
        policy.reduce_dtype = dtype;
      else if (key == "buffer_dtype")
        policy.buffer_dtype = dtype;
      else if (key == "output_dtype")
        policy.output_dtype = dtype;
      else
        TORCH_CHECK(false, "FullyShardedDataParallelPlugin: mixed_precision_policy ", shown,
                    " (from argument) has an "
                    "unknown key '",
                    key, "'; expected param_dtype, reduce_dtype, ", third, ".");
    }
    plugin_.mixed_precision_policy = policy;
  }

  void resolve_param_init_fn() {
    if (args_.param_init_fn) {
      plugin_.param_init_fn = *args_.param_init_fn;
      source("param_init_fn", "argument");
    } else {
      source("param_init_fn", "default");
    }
  }

  void validate_combinations() {
    TORCH_CHECK(!(plugin_.activation_checkpointing && plugin_.auto_wrap_policy == AutoWrapKind::kNoWrap),
                "FullyShardedDataParallelPlugin: activation_checkpointing=true (from ",
                plugin_.sources["activation_checkpointing"],
                ") needs an auto-wrap policy that picks the blocks to "
                "checkpoint, but auto_wrap_policy is NO_WRAP (from ",
                plugin_.sources["auto_wrap_policy"],
                "). Set auto_wrap_policy=TRANSFORMER_BASED_WRAP (FSDP_AUTO_WRAP_POLICY) with the block class names, "
                "or turn activation checkpointing off.");
  }

  void warn(const std::string& text) { plugin_.warnings.push_back(text); }

  // Values that the engine cannot act on in this build are named, so `fsdp config show` never shows
  // a setting that then changes nothing. (This build computes on CPU: offloading to CPU is what
  // already happens. The GPU build acts on these.)
  void warn_about_values_without_effect() {
    const auto& sources = plugin_.sources;
    auto origin_of = [&](const char* field) {
      auto found = sources.find(field);
      return found == sources.end() ? std::string("default") : found->second;
    };
    if (plugin_.activation_checkpointing_offload) {
      warn("activation_checkpointing_offload=true (from " + origin_of("activation_checkpointing_offload") +
           ") has no effect in this CPU build: the activations a checkpointed block saves are in host memory "
           "already.");
    }
    if (plugin_.cpu_offload.offload_params) {
      warn("cpu_offload=true (from " + origin_of("cpu_offload") +
           ") has no effect in this CPU build: sharded parameters, gradients and the optimizer step are in host "
           "memory already.");
    }
    if (plugin_.state_dict_config_explicit) {
      warn(
          "state_dict_config.offload_to_cpu (from argument) has no effect in this CPU build: state dicts are in "
          "host memory either way. Its rank0_only is honored.");
    }
    if (plugin_.optim_state_dict_config_explicit) {
      warn(
          "optim_state_dict_config.offload_to_cpu (from argument) has no effect in this CPU build: state dicts "
          "are in host memory either way. Its rank0_only is honored.");
    }
    if (plugin_.fsdp_version == 1 && !plugin_.use_orig_params) {
      warn("use_orig_params=false (from " + origin_of("use_orig_params") +
           ") is not implemented: fsdp.cpp always trains the original parameters (FSDP1's use_orig_params=true); "
           "the optimizer and state dicts see them, never a flat parameter.");
    }
    if (plugin_.fsdp_version == 2 && args_.limit_all_gathers) {
      warn(
          "limit_all_gathers (from argument) is not used by FSDP version 2, which bounds its all-gathers by "
          "itself; ignoring the value given.");
    }
  }

  // Nothing set is dropped without a word: an FSDP_* variable nobody reads (a typo) and, under
  // version 2, a version-1 variable that asks for what version 2 does not do (Accelerate drops both
  // silently). A value the launcher filled in by default (origin "launcher default") is not the
  // user's request and is not reported.
  void warn_about_unread_variables() {
    const auto& read = plugin_environment_variables();
    for (const auto& [name, value] : environment_) {
      if (name.rfind("FSDP_", 0) != 0 || std::find(read.begin(), read.end(), name) != read.end()) continue;
      const auto& tools = tool_environment_variables();
      if (std::find(tools.begin(), tools.end(), name) != tools.end()) continue;
      if (name.rfind("FSDP_TEST_", 0) == 0) continue;  // the test suite's own (FSDP_TEST_HARNESS_RANK, ...)
      std::vector<std::string> candidates(read.begin(), read.end());
      candidates.insert(candidates.end(), tools.begin(), tools.end());
      const auto suggestion = detail::did_you_mean(name, candidates);
      warn("environment variable " + name + "='" + value + "' is not a setting fsdp.cpp reads" +
           (suggestion.empty() ? std::string(".") : "; did you mean " + suggestion + "?") + " It is ignored.");
    }
    if (plugin_.fsdp_version != 2) return;
    // The fields a caller may also pass as arguments, which then win over the variable.
    const std::map<std::string, bool> given_as_argument = {
        {"forward_prefetch", args_.forward_prefetch.has_value()},
        {"use_orig_params", args_.use_orig_params.has_value()},
        {"sync_module_states", args_.sync_module_states.has_value()},
    };
    for (const auto& unread : detail::version_two_unread_fields()) {
      const auto argument = given_as_argument.find(unread.name);
      TORCH_INTERNAL_ASSERT(argument != given_as_argument.end(), "version 2 leaves ", unread.name,
                            " unread, but the plugin has no argument check for it");
      const std::string variable = variable_of(unread.name);
      auto found = environment_value(variable);
      if (!found || argument->second) continue;
      if (auto described = origins_.find(variable);
          described != origins_.end() && described->second == "launcher default") {
        continue;
      }
      const auto truth = detail::truth_value(found->value);
      if (truth && *truth == unread.version_two_value) continue;
      warn(variable + "='" + found->value + "' (from " + found->origin +
           ") is not read by FSDP version 2: " + unread.why + ". It is ignored.");
    }
  }

  const FullyShardedDataParallelPluginArgs& args_;
  const EnvironmentMap& environment_;
  const std::map<std::string, std::string>& origins_;
  FullyShardedDataParallelPlugin& plugin_;
};

nlohmann::json dtype_json(const std::optional<c10::ScalarType>& dtype) {
  return dtype ? nlohmann::json(c10::toString(*dtype)) : nlohmann::json(nullptr);
}

}  // namespace

const char* to_string(BackwardPrefetch prefetch) { return prefetch_names().name_of(prefetch).c_str(); }
const char* to_string(AutoWrapKind kind) {
  if (kind == AutoWrapKind::kCallable) return "CALLABLE";
  for (const auto& [name, entry] : wrap_names()) {
    if (entry == kind) return name.c_str();
  }
  return "UNKNOWN";
}

ShardingStrategy parse_sharding_strategy(const std::string& value, const std::string& field,
                                         const std::string& origin) {
  return sharding_names().parse(field, value, origin);
}

bool fsdp_enabled_by_environment(const EnvironmentMap& environment) {
  auto entry = environment.find("ACCELERATE_USE_FSDP");
  if (entry == environment.end() || entry->second.empty()) return false;
  return detail::parse_bool(entry->second, "ACCELERATE_USE_FSDP");
}

c10::ScalarType mixed_precision_dtype(const std::string& name, const std::string& what) {
  const std::string key = detail::to_lower(detail::trim(name));
  if (key == "fp8" || key == "bf16") return c10::kBFloat16;
  if (key == "fp16") return c10::kHalf;
  if (key == "fp32") return c10::kFloat;
  TORCH_CHECK(false, what, ": '", name, "' is not a mixed precision; expected one of fp8, fp16, bf16, fp32.");
}

const std::vector<std::string>& plugin_environment_variables() {
  static const std::vector<std::string> variables = [] {
    std::vector<std::string> names;
    for (const auto& field : detail::plugin_fields()) {
      if (field.variable) names.push_back(field.variable);
    }
    return names;
  }();
  return variables;
}

FullyShardedDataParallelPlugin::FullyShardedDataParallelPlugin() {
  state_dict_config = default_config(state_dict_type);
  optim_state_dict_config = default_config(state_dict_type);
}

FullyShardedDataParallelPlugin::FullyShardedDataParallelPlugin(const FullyShardedDataParallelPluginArgs& args,
                                                               const EnvironmentMap& environment)
    : FullyShardedDataParallelPlugin(resolve_plugin(args, environment)) {}

FullyShardedDataParallelPlugin resolve_plugin(const FullyShardedDataParallelPluginArgs& args,
                                              const EnvironmentMap& environment,
                                              const std::map<std::string, std::string>& environment_origins) {
  FullyShardedDataParallelPlugin plugin;
  Resolver(args, environment, environment_origins, plugin).run();
  if (!plugin.warnings.empty()) {
    // One readable message (Accelerate joins its list with the header as separator: quirk Q4).
    std::string text = "FullyShardedDataParallelPlugin: " + std::to_string(plugin.warnings.size()) +
                       (plugin.warnings.size() == 1 ? " warning:" : " warnings:");
    for (const auto& warning : plugin.warnings) text += "\n  - " + warning;
    TORCH_WARN(text);
  }
  return plugin;
}

void FullyShardedDataParallelPlugin::set_state_dict_type(StateDictType type) {
  TORCH_CHECK(!(fsdp_version == 2 && type == StateDictType::kLocalStateDict),
              "FullyShardedDataParallelPlugin: LOCAL_STATE_DICT is not supported with FSDP version 2; use "
              "SHARDED_STATE_DICT or FULL_STATE_DICT.");
  state_dict_type = type;
  if (!state_dict_config_explicit) state_dict_config = default_config(type);
  if (!optim_state_dict_config_explicit) optim_state_dict_config = default_config(type);
}

void FullyShardedDataParallelPlugin::set_mixed_precision(const std::string& mixed_precision, bool buffer_autocast,
                                                         bool override_existing) {
  const auto dtype = mixed_precision_dtype(mixed_precision, "FullyShardedDataParallelPlugin: mixed_precision_policy");
  if (!override_existing && mixed_precision_policy) return;
  MixedPrecisionPolicy policy;
  policy.param_dtype = dtype;
  policy.reduce_dtype = dtype;
  if (fsdp_version == 1)
    policy.buffer_dtype = buffer_autocast ? c10::kFloat : dtype;
  else
    policy.output_dtype = dtype;
  mixed_precision_policy = policy;
}

std::string FullyShardedDataParallelPlugin::to_json() const {
  nlohmann::json values;
  values["fsdp_version"] = fsdp_version;
  values["sharding_strategy"] = to_string(sharding_strategy);
  values["reshard_after_forward"] = reshard_after_forward.is_group_size()
                                        ? nlohmann::json(reshard_after_forward.group_size())
                                        : nlohmann::json(reshard_after_forward.reshards());
  values["backward_prefetch"] =
      backward_prefetch ? nlohmann::json(to_string(*backward_prefetch)) : nlohmann::json("NO_PREFETCH");
  if (mixed_precision_policy) {
    values["mixed_precision_policy"] = {{"param_dtype", dtype_json(mixed_precision_policy->param_dtype)},
                                        {"reduce_dtype", dtype_json(mixed_precision_policy->reduce_dtype)},
                                        {"buffer_dtype", dtype_json(mixed_precision_policy->buffer_dtype)},
                                        {"output_dtype", dtype_json(mixed_precision_policy->output_dtype)},
                                        {"cast_forward_inputs", mixed_precision_policy->cast_forward_inputs}};
  } else {
    values["mixed_precision_policy"] = nullptr;
  }
  values["auto_wrap_policy"] = to_string(auto_wrap_policy);
  values["cpu_offload"] = {{"offload_params", cpu_offload.offload_params}, {"pin_memory", cpu_offload.pin_memory}};
  if (ignored_modules.name_regex)
    values["ignored_modules"] = *ignored_modules.name_regex;
  else if (!ignored_modules.modules.empty())
    values["ignored_modules"] = std::to_string(ignored_modules.modules.size()) + " modules";
  else
    values["ignored_modules"] = nullptr;
  values["state_dict_type"] = to_string(state_dict_type);
  values["state_dict_config"] = {{"offload_to_cpu", state_dict_config.offload_to_cpu},
                                 {"rank0_only", state_dict_config.rank0_only}};
  values["optim_state_dict_config"] = {{"offload_to_cpu", optim_state_dict_config.offload_to_cpu},
                                       {"rank0_only", optim_state_dict_config.rank0_only}};
  values["limit_all_gathers"] = limit_all_gathers;
  values["use_orig_params"] = use_orig_params;
  values["param_init_fn"] = param_init_fn ? nlohmann::json("set") : nlohmann::json(nullptr);
  values["sync_module_states"] = sync_module_states;
  values["forward_prefetch"] = forward_prefetch;
  values["activation_checkpointing"] = activation_checkpointing;
  values["activation_checkpointing_offload"] = activation_checkpointing_offload;
  values["cpu_ram_efficient_loading"] = cpu_ram_efficient_loading;
  values["transformer_cls_names_to_wrap"] =
      transformer_cls_names_to_wrap ? nlohmann::json(*transformer_cls_names_to_wrap) : nlohmann::json(nullptr);
  values["min_num_params"] = min_num_params;

  // Note [one table of plugin fields]: the fields shown are the table's, in its order, each with its line.
  nlohmann::ordered_json document;
  TORCH_INTERNAL_ASSERT(values.size() == detail::plugin_fields().size(), "to_json has ", values.size(),
                        " fields, src/config/plugin_fields.cpp ", detail::plugin_fields().size());
  for (const auto& field : detail::plugin_fields()) {
    TORCH_INTERNAL_ASSERT(values.contains(field.name), "to_json does not show plugin field '", field.name, "'");
    auto found = sources.find(field.name);
    document[field.name] = {{"value", values[field.name]},
                            {"source", found == sources.end() ? "default" : found->second},
                            {"doc", field.doc}};
  }
  document["warnings"] = warnings;
  // Where fsdp.cpp does on purpose something other than what Accelerate does with this
  // configuration (docs/plugin.md), so that `fsdp config show` shows it beside the values.
  std::vector<std::string> differences;
  if (fsdp_version == 1) {
    differences.push_back("parameters: always the original ones (FSDP1's use_orig_params=true); no flat parameters");
    differences.push_back(
        "mixed precision: BatchNorm modules are cast like every other module (FSDP1 wraps them separately in full "
        "precision, its _module_classes_to_ignore), and trainable parameters are upcast to fp32 before sharding "
        "when the accelerator uses mixed precision, as under version 2");
  }
  document["differences_from_accelerate"] = differences;
  // Values and warnings quote the environment's bytes, which need not be UTF-8 (found by
  // fuzz/plugin_config_fuzz.cpp): such bytes print as U+FFFD instead of throwing a JSON error.
  return document.dump(2, ' ', false, nlohmann::ordered_json::error_handler_t::replace);
}

}  // namespace fsdp
