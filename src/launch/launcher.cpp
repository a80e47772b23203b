// See launcher.h.
#include "launch/launcher.h"

#include <arpa/inet.h>
#include <c10/util/Exception.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <csignal>
#include <cstring>
#include <fstream>
#include <random>
#include <sstream>
#include <utility>

#include "launch/elastic_rendezvous.h"
#include "launch/process_set.h"

namespace fsdp::detail {

EnvironmentMap worker_environment(const LaunchOptions& options, const EnvironmentMap& base, int64_t local_rank,
                                  int64_t restart_count) {
  return worker_environment(options, base, local_rank, RoundPlace{options.node_rank, options.nnodes, restart_count});
}

EnvironmentMap worker_environment(const LaunchOptions& options, const EnvironmentMap& base, int64_t local_rank,
                                  const RoundPlace& place) {
  EnvironmentMap environment = base;
  for (const auto& [name, value] : options.extra_environment) environment[name] = value;
  const int64_t world_size = place.nodes * options.nproc_per_node;
  const int64_t rank = place.group_rank * options.nproc_per_node + local_rank;
  const int64_t restart_count = place.restart_count;
  environment["RANK"] = std::to_string(rank);
  environment["WORLD_SIZE"] = std::to_string(world_size);
  environment["LOCAL_RANK"] = std::to_string(local_rank);
  environment["LOCAL_WORLD_SIZE"] = std::to_string(options.nproc_per_node);
  environment["GROUP_RANK"] = std::to_string(place.group_rank);
  environment["GROUP_WORLD_SIZE"] = std::to_string(place.nodes);
  environment["ROLE_RANK"] = std::to_string(rank);
  environment["ROLE_WORLD_SIZE"] = std::to_string(world_size);
  environment["MASTER_ADDR"] = options.master_addr;
  environment["MASTER_PORT"] = std::to_string(options.master_port);
  // torchrun's names, which programs read to resume after a restart (Note [restarting a failed job]).
  environment["TORCHELASTIC_RESTART_COUNT"] = std::to_string(restart_count);
  environment["TORCHELASTIC_MAX_RESTARTS"] = std::to_string(options.max_restarts);
  // The launchers' store serves the workers too (Note [elastic rounds]), as torchrun's agent's does.
  if (place.agent_store)
    environment["TORCHELASTIC_USE_AGENT_STORE"] = "True";
  else
    environment.erase("TORCHELASTIC_USE_AGENT_STORE");
  // As torchrun: several processes each spawning one thread per core would oversubscribe the CPU.
  if (options.nproc_per_node > 1 && environment.find("OMP_NUM_THREADS") == environment.end()) {
    environment["OMP_NUM_THREADS"] = "1";
  }
  return environment;
}

namespace {

// Whether `port` on 127.0.0.1 can be bound now (it is then closed again).
bool port_can_be_bound(int port) {
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return false;
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  address.sin_port = htons(static_cast<uint16_t>(port));
  const bool ok = ::bind(fd, reinterpret_cast<sockaddr*>(&address), sizeof(address)) == 0;
  ::close(fd);
  return ok;
}

// The kernel's ephemeral range (net.ipv4.ip_local_port_range), which bind(port 0) and outgoing
// connections draw from; Linux's default when the file cannot be read. (A kernel file, not
// untrusted input, and one whose stat size is 0: read as a stream, not as a ReadOnlyFile.)
std::pair<int, int> ephemeral_port_range() {
  std::ifstream file("/proc/sys/net/ipv4/ip_local_port_range");
  int low = 32768, high = 60999;
  if (!(file >> low >> high) || low < 1 || high > 65535 || low > high) return {32768, 60999};
  return {low, high};
}

}  // namespace

int pick_free_port() {
  // Chosen outside the ephemeral range: the port stays unbound from this pick until rank 0's store
  // binds it (seconds, for a Python peer importing torch), and inside the range any bind(0) or
  // outgoing connection on the machine (Gloo opens many) could take it meanwhile, so that a rank
  // would reach another program's socket. Outside it only another explicit pick can, and the start
  // is random so that two launches at once rarely try the same ports.
  const auto [low, high] = ephemeral_port_range();
  const int first = low > 11000 ? 10000 : high + 1;
  const int last = low > 11000 ? low - 1 : 65535;
  if (last - first >= 100) {
    std::random_device random;
    const int span = last - first + 1;
    const int start = static_cast<int>(random() % static_cast<unsigned>(span));
    for (int attempt = 0; attempt < 200; ++attempt) {
      const int port = first + (start + attempt * 7919) % span;
      if (port_can_be_bound(port)) return port;
    }
  }
  // No room outside the range (an unusual ip_local_port_range): a port the kernel says is free.
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  TORCH_CHECK(fd >= 0, "fsdp launch: socket() failed while picking a free port: ", std::strerror(errno));
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  address.sin_port = 0;
  socklen_t length = sizeof(address);
  const bool ok = ::bind(fd, reinterpret_cast<sockaddr*>(&address), sizeof(address)) == 0 &&
                  ::getsockname(fd, reinterpret_cast<sockaddr*>(&address), &length) == 0;
  const int error = errno;
  ::close(fd);
  TORCH_CHECK(ok, "fsdp launch: could not find a free port on 127.0.0.1: ", std::strerror(error),
              "; pass --master-port explicitly.");
  return ntohs(address.sin_port);
}

std::string describe_exit(int exit_code) {
  std::string text = "exit code " + std::to_string(exit_code);
  // The signals that end processes in practice (glibc's sigabbrev_np is 2.32 and later only).
  static const std::pair<int, const char*> kNames[] = {
      {SIGHUP, "SIGHUP"},   {SIGINT, "SIGINT"},   {SIGQUIT, "SIGQUIT"}, {SIGILL, "SIGILL"},   {SIGABRT, "SIGABRT"},
      {SIGBUS, "SIGBUS"},   {SIGFPE, "SIGFPE"},   {SIGKILL, "SIGKILL"}, {SIGSEGV, "SIGSEGV"}, {SIGPIPE, "SIGPIPE"},
      {SIGALRM, "SIGALRM"}, {SIGTERM, "SIGTERM"}, {SIGXCPU, "SIGXCPU"}, {SIGXFSZ, "SIGXFSZ"}};
  for (const auto& [number, name] : kNames) {
    if (exit_code == 128 + number) text += std::string(" (") + name + ")";
  }
  return text;
}

namespace {

struct RoundResult {
  LaunchResult result;
  /// Ctrl-C or SIGTERM to the launcher: the job ends without a restart.
  bool interrupted = false;
  /// Stopped because another machine's launcher reported a failure (Note [elastic rounds]).
  bool stopped_on_request = false;
};

// What a round of several machines adds (Note [elastic rounds]); neither may block.
struct RoundHooks {
  /// Another machine's failure, once seen: this machine's processes are stopped.
  std::function<std::optional<std::string>()> stop_requested;
  /// "rank 3 (local rank 1) failed first, with exit code 137 (SIGKILL)" and the code, at once.
  std::function<void(const std::string&, int)> on_first_failure;
};

// One round: every local process started, run until all have exited, and what went wrong.
RoundResult run_round(const LaunchOptions& options, const EnvironmentMap& base, const RoundPlace& place,
                      const RoundHooks& hooks = {}) {
  std::vector<ProcessSpec> specs;
  for (int64_t local_rank = 0; local_rank < options.nproc_per_node; ++local_rank) {
    ProcessSpec spec;
    spec.argv = options.command;
    spec.environment = worker_environment(options, base, local_rank, place);
    spec.label = "rank " + spec.environment["RANK"];
    spec.output = options.rank_prefix ? OutputMode::kLinePrefix : OutputMode::kInherit;
    specs.push_back(std::move(spec));
  }
  ProcessSetOptions set_options;
  set_options.termination_grace = options.termination_grace;
  set_options.stop_requested = hooks.stop_requested;
  if (hooks.on_first_failure) {
    set_options.on_first_failure = [&](size_t index, int exit_code) {
      hooks.on_first_failure(specs[index].label + " (local rank " + std::to_string(index) + ") failed first, with " +
                                 describe_exit(exit_code),
                             exit_code);
    };
  }
  auto outcome = run_process_set(specs, set_options);
  RoundResult round;
  round.result.exit_code = outcome.exit_code;
  round.interrupted = outcome.interrupted;
  round.stopped_on_request = outcome.stop_reason.has_value();
  std::ostringstream message;
  if (outcome.stop_reason && !outcome.interrupted) {
    const auto& reason = *outcome.stop_reason;
    message << reason << (!reason.empty() && reason.back() == '.' ? " " : ". ") << "This machine stopped its "
            << specs.size() << " local process(es).";
  } else if (outcome.first_failure) {
    message << specs[*outcome.first_failure].label << " (local rank " << *outcome.first_failure
            << ") failed first, with " << describe_exit(outcome.exit_code) << "; stopped the other "
            << (specs.size() - 1) << " local process(es)";
    // The ones that failed after it, most likely because it did.
    std::string following;
    for (const auto index : outcome.failure_order) {
      const auto& other = outcome.outcomes[index];
      const bool stopped =
          other.stopped_by_parent && (other.exit_code == 128 + SIGTERM || other.exit_code == 128 + SIGKILL);
      if (index == *outcome.first_failure || stopped) continue;
      following += (following.empty() ? "" : ", ") + specs[index].label + " with " +
                   describe_exit(outcome.outcomes[index].exit_code);
    }
    if (!following.empty()) message << "; after it failed " << following;
    message << ".";
  } else if (outcome.interrupted) {  // a signal before any failure
    message << "interrupted (exit code " << outcome.exit_code << "); stopped all " << specs.size()
            << " local process(es).";
  }
  round.result.message = message.str();
  return round;
}

}  // namespace

// Note [restarting a failed job]
// `fsdp launch --max-restarts K` is torchrun's: when a process fails, the launcher stops the others
// (SIGTERM, then SIGKILL after the grace) and, while fewer than K restarts have been made, starts
// every local process again with TORCHELASTIC_RESTART_COUNT one higher; Ctrl-C ends the job without
// one, and exhausted restarts exit with the last failure's code. Nothing of the failed round is
// left when the next starts (its process groups are gone), so the new round's ranks meet only each
// other; a port picked with --master-port 0 is picked again. The program decides what a restart
// means: Accelerator::resume_after_restart() loads the latest complete checkpoint when the count is
// above 0 (train_llama calls it when --resume-from is not given), so a job resumes without being
// told and loses at most the steps since that checkpoint. With several machines every launcher
// restarts its machine's ranks in the same round, agreed through the store, and the round may have
// fewer machines than the last (Note [elastic rounds]).

namespace {

std::string list_of(const std::vector<int64_t>& values) {
  std::string text;
  for (const auto value : values) text += (text.empty() ? "" : ", ") + std::to_string(value);
  return text;
}

// Note [elastic rounds]: the job as rounds agreed with the other machines' launchers.
LaunchResult launch_elastic(const LaunchOptions& options, const EnvironmentMap& base) {
  ElasticRendezvous rendezvous(options);
  const bool host = options.node_rank == 0;
  const auto here = "on node rank " + std::to_string(options.node_rank) + ", ";
  std::optional<RoundMembership> last;
  for (int64_t round = 0;; ++round) {
    int ended_with = 0;
    auto membership = rendezvous.join(round, last, ended_with);
    if (!membership) {
      LaunchResult result;
      result.exit_code = ended_with;
      result.message = "the job ended (" + describe_exit(ended_with) + ") while this machine (--node-rank " +
                       std::to_string(options.node_rank) +
                       ") waited to join it; a machine that arrives while a round "
                       "runs joins at the next restart, and there was none.";
      return result;
    }
    round = membership->round;
    const bool shrunk = static_cast<int64_t>(membership->node_ranks.size()) < options.nnodes;
    if (options.report_restart && (round > 0 || shrunk)) {
      std::string line = "round " + std::to_string(round) + ": " + std::to_string(membership->node_ranks.size()) +
                         " of up to " + std::to_string(options.nnodes) + " machines (node ranks " +
                         list_of(membership->node_ranks) + "), " + std::to_string(membership->world_size) + " ranks";
      if (last && last->world_size != membership->world_size) line += " (was " + std::to_string(last->world_size) + ")";
      line += "; this machine runs ranks " + std::to_string(membership->first_rank) + " to " +
              std::to_string(membership->first_rank + options.nproc_per_node - 1) + ".";
      options.report_restart(line);
    }
    last = membership;
    const RoundPlace place{membership->group_rank, static_cast<int64_t>(membership->node_ranks.size()), round, true};
    RoundResult outcome;
    {
      RoundWatch watch(rendezvous, round);
      RoundHooks hooks;
      hooks.stop_requested = [&watch] { return watch.stop_reason(); };
      hooks.on_first_failure = [&](const std::string& message, int exit_code) {
        watch.report(RoundFailure{exit_code, here + message, false});
      };
      try {
        outcome = run_round(options, base, place, hooks);
      } catch (const std::exception& error) {
        // The others learn of it now rather than at their next collective's timeout.
        const std::string what = dynamic_cast<const c10::Error*>(&error) != nullptr
                                     ? static_cast<const c10::Error&>(error).what_without_backtrace()
                                     : error.what();
        watch.report(RoundFailure{1, here + "the launcher failed: " + what, false});
        try {
          watch.finish();
        } catch (const std::exception&) {  // the launcher's own error is the one to raise
        }
        throw;
      }
      watch.finish();  // the store's error, which names it, ends the job here
    }
    auto& result = outcome.result;
    RoundFailure failure;
    if (outcome.stopped_on_request && !outcome.interrupted) {
      failure = rendezvous.failure(round).value();
      result.exit_code = failure.exit_code;
    } else if (result.exit_code == 0 && !outcome.interrupted) {
      if (rendezvous.finish_round(*membership)) {
        rendezvous.leave(*membership, 0);
        return result;
      }
      failure = rendezvous.failure(round).value();
      result.exit_code = failure.exit_code;
      result.message = "this machine's processes finished, but " + failure.message;
    } else {
      result.message = here + result.message;
      // A signal on a machine other than the host's (a preemption, say) takes that machine out of
      // the job as a lost one would be: the others go on without it, as torchrun's agents do. On the
      // host, whose store the others need, it ends the job.
      failure =
          rendezvous.report_failure(round, RoundFailure{result.exit_code, result.message, outcome.interrupted && host});
    }
    if (outcome.interrupted || failure.interrupted) {
      rendezvous.leave(*membership, result.exit_code);
      return result;
    }
    if (round >= options.max_restarts) {
      result.message += " No restart left (--max-restarts " + std::to_string(options.max_restarts) + ", " +
                        std::to_string(round) + " made).";
      rendezvous.leave(*membership, result.exit_code);
      return result;
    }
    if (options.report_restart) {
      options.report_restart(result.message + " Restarting: this machine joins round " + std::to_string(round + 1) +
                             " (restart " + std::to_string(round + 1) + " of " + std::to_string(options.max_restarts) +
                             "), which goes on with the machines that join it (at least " +
                             std::to_string(min_nodes(options)) + ").");
    }
  }
}

}  // namespace

LaunchResult launch(LaunchOptions options, const EnvironmentMap& base) {
  validate(options);
  resolve_program(options.command.front(), base);  // a clear error before anything starts
  if (is_elastic(options)) return launch_elastic(options, base);
  const bool pick_port = options.master_port == 0;
  for (int64_t restart = 0;; ++restart) {
    if (pick_port) options.master_port = pick_free_port();
    auto [result, interrupted, stopped] =
        run_round(options, base, RoundPlace{options.node_rank, options.nnodes, restart});
    if (result.exit_code == 0 || interrupted || restart >= options.max_restarts) {
      if (result.exit_code != 0 && options.max_restarts > 0 && !interrupted) {
        result.message += " No restart left (--max-restarts " + std::to_string(options.max_restarts) + ", " +
                          std::to_string(restart) + " made).";
      }
      return result;
    }
    if (options.report_restart) {
      options.report_restart(result.message + " Restarting all " + std::to_string(options.nproc_per_node) +
                             " local process(es): restart " + std::to_string(restart + 1) + " of " +
                             std::to_string(options.max_restarts) + ".");
    }
  }
}

}  // namespace fsdp::detail
