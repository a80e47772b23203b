// `fsdp config show` and `fsdp to-fsdp2`.
#include <c10/util/Exception.h>
#include <fsdp/accelerate_config.h>
#include <fsdp/plugin.h>

#include <filesystem>
#include <iostream>

#include "cli/commands.h"
#include "io/atomic_file.h"

namespace fsdp::cli {

Command add_config_command(CLI::App& parent) {
  CLI::App* app = parent.add_subcommand("config", "Inspect FSDP configuration.");
  CLI::App* show = app->add_subcommand(
      "show",
      "Print the fully resolved FullyShardedDataParallelPlugin as JSON, with where each value came from (argument, "
      "FSDP_* environment variable, config file key, or default).");
  app->require_subcommand(1);
  auto config_file = std::make_shared<std::string>();
  show->add_option("--config-file,--config_file", *config_file,
                   "Resolve as `fsdp launch --config-file` would export it to the processes");
  Command command;
  command.app = app;
  command.run = [config_file] {
    auto environment = current_process_environment();
    std::map<std::string, std::string> origins;
    if (!config_file->empty()) {
      auto config = load_accelerate_config(*config_file);
      auto exported = fsdp_launch_environment(&config, {}, false, std::nullopt);
      for (const auto& [name, value] : exported.variables) environment[name] = value;
      origins = exported.origins;
    }
    std::cout << resolve_plugin(FullyShardedDataParallelPluginArgs{}, environment, origins).to_json() << std::endl;
    return 0;
  };
  return command;
}

Command add_to_fsdp2_command(CLI::App& parent) {
  CLI::App* app = parent.add_subcommand(
      "to-fsdp2", "Convert an Accelerate config file from FSDP version 1 to version 2, as `accelerate to-fsdp2` does.");
  auto config_file = std::make_shared<std::string>();
  auto output_file = std::make_shared<std::string>();
  auto overwrite = std::make_shared<bool>(false);
  app->add_option("--config-file,--config_file", *config_file, "The version-1 config file")->required();
  app->add_option("--output-file,--output_file", *output_file, "Where to write the version-2 file");
  app->add_flag("--overwrite", *overwrite, "Replace the config file (or an existing output file)");
  Command command;
  command.app = app;
  command.run = [config_file, output_file, overwrite] {
    const std::string text = read_config_file(*config_file);
    TORCH_CHECK(*overwrite || !output_file->empty(),
                "fsdp to-fsdp2: say where to write the result: --output-file PATH, or --overwrite to replace '",
                *config_file, "'.");
    const std::string target = output_file->empty() ? *config_file : *output_file;
    TORCH_CHECK(*overwrite || !std::filesystem::exists(target), "fsdp to-fsdp2: output file '", target,
                "' already exists; pass --overwrite to replace it.");
    auto conversion = convert_config_to_fsdp2(text, *config_file);
    for (const auto& warning : conversion.warnings) std::cerr << "fsdp to-fsdp2: " << warning << std::endl;
    detail::write_file_atomically(target, conversion.yaml);
    std::cout << "fsdp to-fsdp2: wrote " << target << std::endl;
    return 0;
  };
  return command;
}

}  // namespace fsdp::cli
