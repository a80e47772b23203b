// `fsdp selftest`: checks every collective across the ranks of the job it runs in.
#include <fsdp/process_group.h>

#include <iostream>

#include "cli/commands.h"
#include "dist/selftest.h"

namespace fsdp::cli {

Command add_selftest_command(CLI::App& parent) {
  CLI::App* app = parent.add_subcommand(
      "selftest",
      "Check all-gather, reduce-scatter, all-reduce, broadcast and barrier across the ranks of this job (run it under "
      "`fsdp launch`), for every dtype, sizes not divisible by the world size and empty shards; print the bytes each "
      "rank sent against the (N-1)/N theory. Exits 1 when any check fails on any rank.");
  Command command;
  command.app = app;
  command.run = [] {
    auto context = DistributedContext::initialize_from_environment();
    auto report = detail::run_collective_selftest(context);
    for (const auto& failure : report.failures) std::cerr << failure << std::endl;
    if (context.is_main_process()) {
      for (const auto& line : report.lines) std::cout << line << std::endl;
    }
    return report.passed ? 0 : 1;
  };
  return command;
}

}  // namespace fsdp::cli
