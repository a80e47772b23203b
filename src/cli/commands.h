// Private: the subcommands of the `fsdp` tool. Each registers its flags on the app and returns the
// action to run if the user chose it; actions return the process exit code and let exceptions
// escape to main(), which maps them to messages and exit codes.
#pragma once

#include <CLI/CLI.hpp>
#include <functional>

namespace fsdp::cli {

struct Command {
  CLI::App* app = nullptr;
  std::function<int()> run;
};

/// `command_after_separator` holds the words after the first `--` on the command line, which
/// main() keeps away from CLI11 so that a program's own flags are never parsed as ours.
Command add_launch_command(CLI::App& parent, const std::vector<std::string>& command_after_separator);
Command add_selftest_command(CLI::App& parent);
Command add_env_command(CLI::App& parent);
Command add_config_command(CLI::App& parent);
Command add_to_fsdp2_command(CLI::App& parent);
Command add_merge_command(CLI::App& parent);
Command add_estimate_command(CLI::App& parent);

}  // namespace fsdp::cli
