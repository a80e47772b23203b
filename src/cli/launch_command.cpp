// `fsdp launch`: thin CLI over launch/launcher.h.
#include "cli/commands.h"

#include "launch/launcher.h"

#include <c10/util/Exception.h>

#include <iostream>

namespace fsdp::cli {

Command add_launch_command(CLI::App& parent, const std::vector<std::string>& command_after_separator) {
  auto options = std::make_shared<detail::LaunchOptions>();
  auto grace_seconds = std::make_shared<double>(3.0);
  CLI::App* app = parent.add_subcommand(
      "launch",
      "Start PROGRAM on --nproc-per-node local processes with torchrun's variables (RANK, WORLD_SIZE, LOCAL_RANK, "
      "LOCAL_WORLD_SIZE, GROUP_RANK, MASTER_ADDR, MASTER_PORT; OMP_NUM_THREADS=1 unless set). When one process "
      "fails the others get SIGTERM, then SIGKILL after the grace period, and the launcher exits with the failing "
      "process's exit code. Ctrl-C stops them all.\n\nUsage: fsdp launch [OPTIONS] -- PROGRAM [ARGS...]");
  app->add_option("--nproc-per-node,--nproc_per_node", options->nproc_per_node, "Processes on this machine")
      ->capture_default_str();
  app->add_option("--nnodes", options->nnodes, "Machines in the job")->capture_default_str();
  app->add_option("--node-rank,--node_rank", options->node_rank, "Index of this machine, in [0, nnodes)")
      ->capture_default_str();
  app->add_option("--master-addr,--master_addr", options->master_addr,
                  "Address of the machine with node rank 0 (rank 0 hosts the rendezvous store)")
      ->capture_default_str();
  app->add_option("--master-port,--master_port", options->master_port,
                  "Port of the rendezvous store; 0 picks a free port (single machine only)")
      ->capture_default_str();
  app->add_flag("--rank-prefix,--rank_prefix", options->rank_prefix,
                "Prefix every output line with \"[rank R]: \"");
  app->add_option("--termination-grace", *grace_seconds,
                   "Seconds between SIGTERM and SIGKILL when stopping the other processes")
      ->capture_default_str()
      ->check(CLI::Range(0.0, 60.0));
  app->prefix_command();
  app->allow_extras();
  Command command;
  command.app = app;
  command.run = [app, options, grace_seconds, &command_after_separator] {
    options->command = app->remaining();
    TORCH_CHECK(options->command.empty() || command_after_separator.empty(), "fsdp launch: unexpected arguments before `--`: '",
                options->command.front(), "'; put the program and all its arguments after `--`.");
    if (options->command.empty()) options->command = command_after_separator;
    options->termination_grace = std::chrono::milliseconds(static_cast<int64_t>(*grace_seconds * 1000.0));
    auto result = detail::launch(*options, current_process_environment());
    if (!result.message.empty()) std::cerr << "fsdp launch: " << result.message << std::endl;
    return result.exit_code;
  };
  return command;
}

}  // namespace fsdp::cli
