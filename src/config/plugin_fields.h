// Private: the one table of FullyShardedDataParallelPlugin's fields as the world outside the program
// names them (Note [one table of plugin fields]).
#pragma once

#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace fsdp::detail {

/// Note [one table of plugin fields]
/// Each field of the plugin is named in several vocabularies: its C++ name (also its key in
/// to_json(), which `fsdp config show` prints), the FSDP_* variable the resolver reads, the
/// fsdp_config key of Accelerate's YAML (also `fsdp launch --<key>`), and what `fsdp launch` exports
/// when neither the file nor a flag sets it (accelerate launch's defaults). They live here, once:
/// plugin_environment_variables(), known_fsdp_config_keys(), the launcher's exports, to_json()'s
/// field list and documentation, and the tests' walk over the fields (tests/config/plugin_fields_test.cpp)
/// are all read from this table, so a field added here is read, exported, shown and tested
/// everywhere, and one added elsewhere fails that test.
/// The fields version 2 leaves unread have a short list of their own beside it
/// (version_two_unread_fields()), which the launcher's exports and the plugin's warning both read.
struct PluginField {
  /// The field of FullyShardedDataParallelPlugin (and of its Args), and its to_json() key.
  const char* name;
  /// The FSDP_* variable the resolver reads for it; nullptr when none (set from code only).
  const char* variable;
  /// Its key under fsdp_config in Accelerate's YAML; nullptr when none.
  const char* yaml_key;
  /// What `fsdp launch` exports when neither the file nor a flag gives it (accelerate launch's
  /// default); nullptr: nothing is exported.
  const char* launch_default;
  /// Whether the launcher exports the value lowercased (booleans: Accelerate writes "True").
  bool launch_lowercase;
  /// A value a user may give through the variable, other than the default (docs and tests).
  const char* example;
  /// Variables the resolver needs set before it reads this one (e.g. the wrap policy it belongs to).
  std::vector<std::pair<const char*, const char*>> read_when;
  /// One line for `fsdp config show`.
  const char* doc;
};

/// Every field, in the order of FullyShardedDataParallelPlugin's members.
const std::vector<PluginField>& plugin_fields();

/// The row of field `name` (an internal error when there is none).
const PluginField& plugin_field(const std::string& name);

/// A field whose variable Accelerate's launcher exports for every version but FSDP version 2 does
/// not read. The launcher exports such a variable under version 2 only when the user chose its
/// value; the plugin warns about a chosen value unless it is what version 2 does anyway.
struct VersionTwoUnreadField {
  const char* name;
  /// The value that asks for nothing version 2 lacks, and so is not warned about.
  bool version_two_value;
  /// Why version 2 does not read it, for the warning.
  const char* why;
};

/// The fields version 2 does not read, in plugin_fields() order.
const std::vector<VersionTwoUnreadField>& version_two_unread_fields();

}  // namespace fsdp::detail
