// Run a GoogleTest body on N real processes that talk over Gloo on loopback.
//
// The parent (the ordinary test process) re-executes this test binary once per rank, filtered to
// the current test, with torchrun's variables and a free MASTER_PORT, so tests running in parallel
// never share a port and no rank inherits the parent's threads (fork-safety). Inside a rank,
// `run_on_ranks` calls the body instead; the rank's process fails the usual gtest way. The parent
// waits with a watchdog: the first failing rank stops the others, a hang is killed after
// `timeout`, and every rank's output is attached to the failure.
#pragma once

#include <fsdp/process_group.h>

#include <chrono>
#include <functional>
#include <map>
#include <string>
#include <vector>

namespace fsdp::testing {

struct MultiRankOptions {
  /// Kill every rank and fail when the job runs longer. Default: 120 s.
  std::chrono::seconds timeout{120};
  /// FSDP_COLLECTIVE_TIMEOUT inside the ranks, so a lost peer errors before the watchdog. Default: 30 s.
  std::chrono::seconds collective_timeout{30};
  /// Extra variables for a given rank (overriding the defaults), e.g. to feed a rank bad input.
  std::function<std::map<std::string, std::string>(int rank)> environment_for_rank;
};

/// A directory shared by the test process and its rank processes, emptied when the test (not a
/// rank) first asks for it. Several run_on_ranks calls in one test (save on N ranks, load on M) run
/// one after another; each rank process runs only the call it was started for.
std::string shared_temporary_directory();

/// Options under which the ranks look like machines of `ranks_per_machine` ranks each (LOCAL_RANK,
/// LOCAL_WORLD_SIZE and GROUP_RANK as a launcher on each machine would set them).
MultiRankOptions simulated_machines(int ranks_per_machine);

/// One job of processes on loopback, the shape every harness here shares: each process gets
/// torchrun's variables for its rank (MASTER_ADDR=127.0.0.1, a free MASTER_PORT for the job,
/// OMP_NUM_THREADS=1) plus `environment(rank)`, writes its output to a log file, and the job runs
/// under a watchdog that stops it on the first failure or after `timeout`.
struct LoopbackJob {
  /// Names a process in the report: "<label> <rank>".
  std::string label = "rank";
  std::chrono::seconds timeout{120};
  std::function<std::vector<std::string>(int rank)> argv;
  std::function<std::map<std::string, std::string>(int rank)> environment;
};

struct LoopbackJobResult {
  /// A process failed, or the watchdog stopped a hang.
  bool failed = false;
  /// Each process's output, by rank.
  std::vector<std::string> output;
  /// Every process's exit and output, for a failure message.
  std::string report;
};

LoopbackJobResult run_loopback_job(int world_size, const LoopbackJob& job);

/// True inside a rank process started by the harness.
bool is_rank_process();

/// Runs `body(rank)` on `world_size` processes; the body reads its environment itself.
void run_processes(int world_size, const std::function<void(int rank)>& body, const MultiRankOptions& options = {});

/// Runs `body(context)` on `world_size` processes, each with a DistributedContext initialized from
/// the harness's environment.
void run_on_ranks(int world_size, const std::function<void(const DistributedContext&)>& body,
                  const MultiRankOptions& options = {});

}  // namespace fsdp::testing
