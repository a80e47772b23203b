// Private: `fsdp launch`, a torchrun-compatible launcher for one machine of a job.
//
// It starts --nproc-per-node copies of a program with torchrun's variables (RANK, WORLD_SIZE,
// LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK, GROUP_WORLD_SIZE, ROLE_RANK, ROLE_WORLD_SIZE, MASTER_ADDR, MASTER_PORT),
// and they live and die together (see process_set.h). Rank 0's process hosts the store, as in
// torchrun's static rendezvous. With --max-restarts K a failed job is started again, all of it, up to
// K times (Note [restarting a failed job]); on several machines the launchers agree on each round
// through a store of their own, and --nnodes MIN:MAX lets a round run with fewer machines (Note
// [elastic rounds]).
#pragma once

#include <chrono>
#include <functional>
#include <string>
#include <vector>

#include <fsdp/distributed_environment.h>

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

/// This machine's place in one round: its machine index, the machines and ranks there are.
struct RoundPlace {
  int64_t group_rank = 0;
  int64_t nodes = 1;
  int64_t restart_count = 0;
  /// Workers use the launchers' store (TORCHELASTIC_USE_AGENT_STORE).
  bool agent_store = false;
};

/// The environment of local process `local_rank` in restart round `restart_count` (0 for the first
/// start): `base` plus torchrun's variables.
EnvironmentMap worker_environment(const LaunchOptions& options, const EnvironmentMap& base, int64_t local_rank,
                                  int64_t restart_count = 0);
/// The same for a round whose place the rendezvous gave.
EnvironmentMap worker_environment(const LaunchOptions& options, const EnvironmentMap& base, int64_t local_rank,
                                  const RoundPlace& place);

/// "exit code 3", or "exit code 137 (SIGKILL)" for a process a signal ended (128 + signal).
std::string describe_exit(int exit_code);

/// A TCP port on 127.0.0.1 that was free a moment ago, outside the kernel's ephemeral range when
/// there is room (so that no bind to port 0 or outgoing connection takes it before rank 0 binds it).
int pick_free_port();

struct LaunchResult {
  /// The launcher's exit code: 0, the first failing process's code, or 128 + signal.
  int exit_code = 0;
  /// What went wrong, for the CLI to print; empty on success.
  std::string message;
};

/// Runs the job on this machine.
LaunchResult launch(LaunchOptions options, const EnvironmentMap& base);

}  // namespace fsdp::detail
