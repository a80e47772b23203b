// Private: the options of `fsdp launch` (torchrun's flags), in a pair of their own so that the
// launcher and the elastic rendezvous (elastic_rendezvous.h) both read them without including
// each other.
#pragma once

#include <fsdp/distributed_environment.h>

#include <chrono>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

namespace fsdp::detail {

struct LaunchOptions {
  /// Processes on this machine. Default: 1.
  int64_t nproc_per_node = 1;
  /// Machines in the job; with --nnodes MIN:MAX, MAX. Default: 1.
  int64_t nnodes = 1;
  /// The fewest machines a round may run with (--nnodes MIN:MAX); 0 means `nnodes` (a fixed size).
  /// Default: 0.
  int64_t min_nnodes = 0;
  /// How long the host waits for MIN machines to join a round before it fails the job, and how
  /// long a launcher waits for the store and for the others to finish (torchrun's
  /// --rdzv-conf join_timeout). Default: 600 s.
  std::chrono::milliseconds join_timeout{600000};
  /// Once MIN machines joined a round, how long the host waits for more, up to MAX (torchrun's
  /// --rdzv-conf last_call_timeout). Default: 30 s.
  std::chrono::milliseconds last_call_timeout{30000};
  /// This machine's index in [0, nnodes). Default: 0.
  int64_t node_rank = 0;
  /// Address of the machine running rank 0. Default: 127.0.0.1 (one machine only).
  std::string master_addr = "127.0.0.1";
  /// Port of the rendezvous store; 0 picks a free one (one machine only). Default: 29500.
  int master_port = 29500;
  /// Prefix each output line with "[rank R]: ". Default: off.
  bool rank_prefix = false;
  /// SIGTERM -> SIGKILL grace when stopping the others after a failure. Default: 3 s.
  std::chrono::milliseconds termination_grace{3000};
  /// The program and its arguments.
  std::vector<std::string> command;
  /// Variables exported to every process (e.g. FSDP_* from --config-file). Default: none.
  EnvironmentMap extra_environment;
  /// Times the job is started again after a process fails (torchrun's --max-restarts): the others
  /// are stopped as without it, then every local process starts again with TORCHELASTIC_RESTART_COUNT
  /// one higher. Not after Ctrl-C. With several machines the launchers agree on each round through
  /// the store (Note [elastic rounds]). Default: 0.
  int64_t max_restarts = 0;
  /// Receives one line for each failure that is followed by a restart (the CLI prints it). Default: none.
  std::function<void(const std::string&)> report_restart;
};

/// Throws a c10::Error naming the flag, its value and the fix for any inconsistent option.
void validate(const LaunchOptions& options);

/// The fewest machines a round may run with: --nnodes MIN:MAX's MIN, or N for a fixed --nnodes N.
int64_t min_nodes(const LaunchOptions& options);

/// Whether the launchers run the job in rounds agreed through the store (Note [elastic rounds]):
/// several machines with --max-restarts or with --nnodes MIN:MAX.
bool is_elastic(const LaunchOptions& options);

}  // namespace fsdp::detail
