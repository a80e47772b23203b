// The `fsdp` command-line tool: parse arguments, call the library, map exceptions to exit codes.
//
// Exit codes: 0 success; 1 an error (message on stderr); 2 bad command-line usage; a launched
// job's own exit code for `fsdp launch`.
#include <c10/util/Exception.h>
#include <fsdp/version.h>

#include <iostream>

#include "cli/commands.h"

int main(int argc, char** argv) {
  CLI::App app{
      "fsdp.cpp " + fsdp::version() +
      ": Fully Sharded Data Parallel training for libtorch.\nRun `fsdp COMMAND --help` for a command's flags."};
  app.require_subcommand(1);
  app.set_version_flag("--version", fsdp::version());
  // Everything after the first `--` belongs to the launched program, never to our parser.
  std::vector<std::string> command_after_separator;
  for (int index = 1; index < argc; ++index) {
    if (std::string(argv[index]) == "--") {
      command_after_separator.assign(argv + index + 1, argv + argc);
      argc = index;
      break;
    }
  }
  std::vector<fsdp::cli::Command> commands = {
      fsdp::cli::add_launch_command(app, command_after_separator),
      fsdp::cli::add_selftest_command(app),
      fsdp::cli::add_env_command(app),
      fsdp::cli::add_config_command(app),
      fsdp::cli::add_to_fsdp2_command(app),
      fsdp::cli::add_merge_command(app),
      fsdp::cli::add_estimate_command(app),
  };
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& error) {
    // --help and --version exit 0; every usage error exits 2, whatever CLI11's own code for it.
    return app.exit(error) == 0 ? 0 : 2;
  }
  try {
    for (const auto& command : commands) {
      if (command.app->parsed()) return command.run();
    }
  } catch (const c10::Error& error) {
    std::cerr << "fsdp: error: " << error.what_without_backtrace() << std::endl;
    return 1;
  } catch (const std::exception& error) {
    std::cerr << "fsdp: error: " << error.what() << std::endl;
    return 1;
  }
  return 2;
}
