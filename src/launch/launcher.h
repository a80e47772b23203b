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

#include <fsdp/distributed_environment.h>

#include <chrono>
#include <functional>
#include <string>
#include <vector>

#include "launch/launch_options.h"

namespace fsdp::detail {

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
