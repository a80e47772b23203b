// Private: start a set of processes, relay or capture their output, and stop them together.
//
// The launcher and the multi-rank test harness both need the same thing: N children that live and
// die as one job. When one fails (non-zero exit or a signal), the others get SIGTERM and, after a
// grace period, SIGKILL, to their whole process group, so grandchildren (`sh -c ...`) go too. A
// watchdog timeout and SIGINT/SIGTERM to the parent stop the set the same way.
#pragma once

#include <fsdp/distributed_environment.h>

#include <chrono>
#include <functional>
#include <optional>
#include <string>
#include <vector>

namespace fsdp::detail {

enum class OutputMode {
  /// The child writes straight to the parent's stdout and stderr.
  kInherit,
  /// Each line the child writes is relayed with "[<label>]: " in front.
  kLinePrefix,
  /// stdout and stderr go to `output_path`.
  kFile,
};

struct ProcessSpec {
  /// argv[0] is the program: a path, or a name looked up in the child's PATH.
  std::vector<std::string> argv;
  /// The child's complete environment.
  EnvironmentMap environment;
  /// Names the child in prefixes and reports, e.g. "rank 3".
  std::string label;
  OutputMode output = OutputMode::kInherit;
  /// Where kFile output goes.
  std::string output_path;
};

struct ProcessSetOptions {
  /// Time between SIGTERM and SIGKILL when stopping the set. Default: 3 s (all gone within 5 s).
  std::chrono::milliseconds termination_grace{3000};
  /// Stop the set when it runs longer than this. Default: none.
  std::optional<std::chrono::milliseconds> timeout;
  /// Forward SIGINT/SIGTERM received by this process to the children and stop. Default: true.
  bool forward_signals = true;
  /// Asked every `stop_poll_interval` while children run, and must not block: a reason stops the
  /// set as a failure would (another machine's launcher saw one; Note [elastic rounds]). An exception
  /// from it stops the set and is rethrown once every child is gone. Default: none.
  std::function<std::optional<std::string>()> stop_requested;
  /// Called once, without blocking, when the first child fails (its index and exit code), as the
  /// others are told to stop: another machine's launcher can then stop its own at once instead of
  /// after this one's grace period (Note [elastic rounds]). Default: none.
  std::function<void(size_t index, int exit_code)> on_first_failure;
  /// Default: 250 ms.
  std::chrono::milliseconds stop_poll_interval{250};
};

struct ProcessOutcome {
  /// Exit status as a shell reports it: the exit code, or 128 + signal number.
  int exit_code = 0;
  /// Still running when the set was stopped (by a failure, the watchdog or a signal).
  bool stopped_by_parent = false;
};

struct ProcessSetResult {
  /// 0 when every child exited 0; else the first failing child's code, 124 on watchdog timeout, or
  /// 128 + signal when this process was interrupted.
  int exit_code = 0;
  /// Index of the first child that failed, if one did.
  std::optional<size_t> first_failure;
  /// Every child that exited non-zero, in the order their exits were seen (first_failure first
  /// when it is set): each exit is seen within microseconds, so a rank that failed because another
  /// did comes after it.
  std::vector<size_t> failure_order;
  bool timed_out = false;
  /// Why ProcessSetOptions::stop_requested stopped the set, if it did (before any child failed).
  std::optional<std::string> stop_reason;
  /// This process received SIGINT or SIGTERM (also after a child had failed).
  bool interrupted = false;
  std::vector<ProcessOutcome> outcomes;
};

/// Runs the children to completion. Throws only when a child cannot be started at all.
ProcessSetResult run_process_set(const std::vector<ProcessSpec>& specs, const ProcessSetOptions& options);

/// Resolves `program` as execvp would (a name with '/' is a path; otherwise each PATH entry).
/// Throws a c10::Error that names the program and what was searched when it is not executable.
std::string resolve_program(const std::string& program, const EnvironmentMap& environment);

}  // namespace fsdp::detail
