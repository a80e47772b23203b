// Note [one table of plugin fields]: the walk over every field, driven by the table, through each
// reader that the table drives: the environment reader, Accelerate's YAML, the launcher's exports and
// `fsdp config show`'s JSON. A field added to the plugin without its row fails the JSON check; a row
// whose variable or key is not read fails the walk.
#include "config/plugin_fields.h"

#include <fsdp/accelerate_config.h>
#include <fsdp/plugin.h>
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include "config/text.h"

namespace fsdp {
namespace {

using detail::plugin_fields;

TEST(PluginFields, TheListsOfVariablesAndKeysAreTheTables) {
  std::vector<std::string> variables, keys;
  for (const auto& field : plugin_fields()) {
    if (field.variable) variables.push_back(field.variable);
    if (field.yaml_key) keys.push_back(field.yaml_key);
  }
  EXPECT_EQ(plugin_environment_variables(), variables);
  EXPECT_EQ(known_fsdp_config_keys(), keys);
  EXPECT_EQ(variables.size(), 16u);  // Accelerate's FSDP_* variables (docs/plugin.md)
}

TEST(PluginFields, ConfigShowListsEveryFieldInTheTablesOrderWithItsLine) {
  const auto document = nlohmann::ordered_json::parse(FullyShardedDataParallelPlugin().to_json());
  std::vector<std::string> shown;
  for (const auto& item : document.items()) {
    if (item.key() != "warnings" && item.key() != "differences_from_accelerate") shown.push_back(item.key());
  }
  std::vector<std::string> names;
  for (const auto& field : plugin_fields()) {
    names.push_back(field.name);
    EXPECT_EQ(document[field.name]["doc"], field.doc) << field.name;
  }
  EXPECT_EQ(shown, names);
}

TEST(PluginFields, EveryVariableIsReadIntoItsField) {
  for (const auto& field : plugin_fields()) {
    if (!field.variable) continue;
    EnvironmentMap environment;
    for (const auto& [variable, value] : field.read_when) environment[variable] = value;
    environment[field.variable] = field.example;
    const auto plugin = resolve_plugin({}, environment);
    const auto document = nlohmann::json::parse(plugin.to_json());
    const auto source = document[field.name]["source"].get<std::string>();
    EXPECT_EQ(source, std::string("environment variable ") + field.variable) << field.name;
    EXPECT_NE(document[field.name]["value"],
              nlohmann::json::parse(FullyShardedDataParallelPlugin().to_json())[field.name]["value"])
        << field.name << ": the example " << field.example << " must differ from the default";
  }
}

TEST(PluginFields, EveryKeyIsExportedAsItsVariableAndEveryDefaultAsAccelerateLaunchDoes) {
  for (const auto& field : plugin_fields()) {
    if (!field.yaml_key) continue;
    ASSERT_NE(field.variable, nullptr) << field.name << " has a YAML key but no variable to export it as";
    // What the resolver needs to read it (the launcher resolves the plugin to check it), as keys too.
    std::string yaml = "distributed_type: FSDP\nfsdp_config:\n";
    for (const auto& [variable, value] : field.read_when) {
      for (const auto& other : plugin_fields()) {
        if (other.variable && std::string(other.variable) == variable) {
          yaml += std::string("  ") + other.yaml_key + ": " + value + "\n";
        }
      }
    }
    yaml += std::string("  ") + field.yaml_key + ": " + field.example + "\n";
    const auto config = parse_accelerate_config(yaml, "t.yaml");
    const auto exported = fsdp_launch_environment(&config, {}, false, std::nullopt);
    const std::string expected = field.launch_lowercase ? detail::to_lower(field.example) : field.example;
    EXPECT_EQ(exported.variables.at(field.variable), expected) << field.name;
    EXPECT_EQ(exported.origins.at(field.variable), std::string("fsdp_config.") + field.yaml_key + " in t.yaml")
        << field.name;
    // The same key as a flag wins over the file.
    const auto flagged = fsdp_launch_environment(&config, {{field.yaml_key, field.example}}, false, std::nullopt);
    EXPECT_NE(flagged.origins.at(field.variable).find("flag"), std::string::npos) << field.name;
  }
  const auto empty = parse_accelerate_config("distributed_type: FSDP\nfsdp_config: {}\n", "t.yaml");
  const auto defaults = fsdp_launch_environment(&empty, {}, false, std::nullopt);
  for (const auto& field : plugin_fields()) {
    if (!field.variable) continue;
    if (field.launch_default) {
      EXPECT_EQ(defaults.variables.at(field.variable), field.launch_default) << field.name;
      EXPECT_EQ(defaults.origins.at(field.variable), "launcher default") << field.name;
    } else {
      EXPECT_EQ(defaults.variables.count(field.variable), 0u) << field.name << " is exported without a value given";
    }
  }
}

}  // namespace
}  // namespace fsdp
