// See process_set.h. POSIX only (fork/exec, process groups, poll).
#include "launch/process_set.h"

#include <c10/util/Exception.h>
#include <fcntl.h>
#include <poll.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <csignal>
#include <cstring>
#include <thread>

namespace fsdp::detail {
namespace {

// Written by the signal handler, read by the wait loop.
std::atomic<int> received_signal{0};

void remember_signal(int signal_number) { received_signal.store(signal_number); }

// Installs the forwarding handlers for the lifetime of a run and restores the previous ones.
class SignalForwarding {
 public:
  explicit SignalForwarding(bool enabled) : enabled_(enabled) {
    if (!enabled_) return;
    received_signal.store(0);
    struct sigaction action{};
    action.sa_handler = remember_signal;
    sigemptyset(&action.sa_mask);
    sigaction(SIGINT, &action, &previous_interrupt_);
    sigaction(SIGTERM, &action, &previous_terminate_);
  }
  ~SignalForwarding() {
    if (!enabled_) return;
    sigaction(SIGINT, &previous_interrupt_, nullptr);
    sigaction(SIGTERM, &previous_terminate_, nullptr);
  }
  SignalForwarding(const SignalForwarding&) = delete;
  SignalForwarding& operator=(const SignalForwarding&) = delete;

 private:
  bool enabled_;
  struct sigaction previous_interrupt_{};
  struct sigaction previous_terminate_{};
};

// Which child failed first: a rank that dies because another did (its connection closed) exits
// milliseconds later, so the wait loop must learn of each exit at once, not on its next poll, when
// both would look simultaneous and the lower index would be named. A SIGCHLD handler writes a byte
// to a pipe the loop polls (the self-pipe trick); where a handler is already installed by another
// run, the loop falls back to polling every 20 ms.
std::atomic<int> child_exit_pipe_write{-1};

void note_child_exit(int) {
  const int saved = errno;
  const int descriptor = child_exit_pipe_write.load();
  if (descriptor >= 0) {
    const char byte = 0;
    ssize_t ignored = ::write(descriptor, &byte, 1);
    (void)ignored;
  }
  errno = saved;
}

class ChildExitWakeup {
 public:
  ChildExitWakeup() {
    int descriptors[2];
    if (::pipe2(descriptors, O_CLOEXEC | O_NONBLOCK) != 0) return;
    int expected = -1;
    if (!child_exit_pipe_write.compare_exchange_strong(expected, descriptors[1])) {
      ::close(descriptors[0]);
      ::close(descriptors[1]);
      return;
    }
    read_ = descriptors[0];
    write_ = descriptors[1];
    struct sigaction action{};
    action.sa_handler = note_child_exit;
    sigemptyset(&action.sa_mask);
    action.sa_flags = SA_RESTART | SA_NOCLDSTOP;
    ::sigaction(SIGCHLD, &action, &previous_);
  }
  ~ChildExitWakeup() {
    if (read_ < 0) return;
    ::sigaction(SIGCHLD, &previous_, nullptr);
    child_exit_pipe_write.store(-1);
    ::close(read_);
    ::close(write_);
  }
  ChildExitWakeup(const ChildExitWakeup&) = delete;
  ChildExitWakeup& operator=(const ChildExitWakeup&) = delete;
  /// The descriptor that becomes readable when a child exits; -1 without the handler.
  int descriptor() const { return read_; }
  void drain() const {
    char buffer[256];
    while (::read(read_, buffer, sizeof(buffer)) > 0) {
    }
  }

 private:
  int read_ = -1;
  int write_ = -1;
  struct sigaction previous_{};
};

struct RelayedStream {
  int fd = -1;
  int destination = STDOUT_FILENO;
  std::string pending;
};

struct Child {
  pid_t pid = -1;
  bool running = false;
  std::string label;
  std::vector<RelayedStream> streams;
};

void write_all(int fd, const std::string& text) {
  size_t written = 0;
  while (written < text.size()) {
    ssize_t n = ::write(fd, text.data() + written, text.size() - written);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return;  // the terminal went away; output is best effort
    written += static_cast<size_t>(n);
  }
}

void relay_lines(RelayedStream& stream, const std::string& label, bool flush_partial) {
  size_t start = 0;
  for (size_t newline; (newline = stream.pending.find('\n', start)) != std::string::npos; start = newline + 1) {
    write_all(stream.destination, "[" + label + "]: " + stream.pending.substr(start, newline - start + 1));
  }
  stream.pending.erase(0, start);
  if (flush_partial && !stream.pending.empty()) {
    write_all(stream.destination, "[" + label + "]: " + stream.pending + "\n");
    stream.pending.clear();
  }
}

std::vector<char*> as_c_strings(std::vector<std::string>& strings) {
  std::vector<char*> pointers;
  for (auto& text : strings) pointers.push_back(text.data());
  pointers.push_back(nullptr);
  return pointers;
}

int shell_status(int status) {
  if (WIFEXITED(status)) return WEXITSTATUS(status);
  if (WIFSIGNALED(status)) return 128 + WTERMSIG(status);
  return 1;
}

Child spawn(const ProcessSpec& spec) {
  std::string program = resolve_program(spec.argv.at(0), spec.environment);
  std::vector<std::string> arguments = spec.argv;
  std::vector<std::string> environment;
  for (const auto& [name, value] : spec.environment) environment.push_back(name + "=" + value);
  auto argv = as_c_strings(arguments);
  auto envp = as_c_strings(environment);

  int output_pipes[2][2] = {{-1, -1}, {-1, -1}};
  int output_file = -1;
  if (spec.output == OutputMode::kLinePrefix) {
    for (auto& pipe_fds : output_pipes)
      TORCH_CHECK(::pipe2(pipe_fds, O_CLOEXEC) == 0, "launch: pipe failed: ", std::strerror(errno));
  } else if (spec.output == OutputMode::kFile) {
    output_file = ::open(spec.output_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    TORCH_CHECK(output_file >= 0, "launch: cannot open log file '", spec.output_path, "' for ", spec.label, ": ",
                std::strerror(errno));
  }
  // Closed by a successful exec; otherwise carries the exec errno back to the parent.
  int exec_error_pipe[2];
  TORCH_CHECK(::pipe2(exec_error_pipe, O_CLOEXEC) == 0, "launch: pipe failed: ", std::strerror(errno));
  const pid_t parent = ::getpid();

  pid_t pid = ::fork();
  TORCH_CHECK(pid >= 0, "launch: fork failed for ", spec.label, ": ", std::strerror(errno));
  if (pid == 0) {
    // Child: only async-signal-safe calls until exec.
    ::setpgid(0, 0);
    ::prctl(PR_SET_PDEATHSIG, SIGTERM);
    if (::getppid() != parent) ::_exit(128 + SIGTERM);
    struct sigaction default_action{};
    default_action.sa_handler = SIG_DFL;
    sigemptyset(&default_action.sa_mask);
    ::sigaction(SIGINT, &default_action, nullptr);
    ::sigaction(SIGTERM, &default_action, nullptr);
    if (spec.output == OutputMode::kLinePrefix) {
      ::dup2(output_pipes[0][1], STDOUT_FILENO);
      ::dup2(output_pipes[1][1], STDERR_FILENO);
    } else if (spec.output == OutputMode::kFile) {
      ::dup2(output_file, STDOUT_FILENO);
      ::dup2(output_file, STDERR_FILENO);
    }
    ::execve(program.c_str(), argv.data(), envp.data());
    int error = errno;
    ssize_t ignored = ::write(exec_error_pipe[1], &error, sizeof(error));
    (void)ignored;
    ::_exit(127);
  }
  ::setpgid(pid, pid);  // also here, so a kill(-pid) right after fork cannot miss
  ::close(exec_error_pipe[1]);
  int exec_error = 0;
  ssize_t got;
  do {
    got = ::read(exec_error_pipe[0], &exec_error, sizeof(exec_error));
  } while (got < 0 && errno == EINTR);
  ::close(exec_error_pipe[0]);
  if (output_file >= 0) ::close(output_file);

  Child child;
  child.pid = pid;
  child.running = true;
  child.label = spec.label;
  if (spec.output == OutputMode::kLinePrefix) {
    ::close(output_pipes[0][1]);
    ::close(output_pipes[1][1]);
    child.streams.push_back({output_pipes[0][0], STDOUT_FILENO, {}});
    child.streams.push_back({output_pipes[1][0], STDERR_FILENO, {}});
  }
  if (got == static_cast<ssize_t>(sizeof(exec_error))) {
    int status = 0;
    ::waitpid(pid, &status, 0);
    for (auto& stream : child.streams) ::close(stream.fd);
    TORCH_CHECK(false, "launch: cannot execute '", program, "' for ", spec.label, ": ", std::strerror(exec_error), ".");
  }
  return child;
}

void signal_all(std::vector<Child>& children, int signal_number) {
  // Exited children's groups may still hold grandchildren; ESRCH just means nothing is left.
  for (auto& child : children) ::kill(-child.pid, signal_number);
}

}  // namespace

std::string resolve_program(const std::string& program, const EnvironmentMap& environment) {
  TORCH_CHECK(!program.empty(),
              "launch: no program given; put the command after `--`, e.g. `fsdp launch "
              "--nproc-per-node 2 -- ./train`.");
  auto executable = [](const std::string& path) {
    struct stat info{};
    return ::stat(path.c_str(), &info) == 0 && S_ISREG(info.st_mode) && ::access(path.c_str(), X_OK) == 0;
  };
  if (program.find('/') != std::string::npos) {
    TORCH_CHECK(executable(program), "launch: program '", program,
                "' does not exist or is not an executable file; check the path (relative paths are resolved from ",
                "the current directory).");
    return program;
  }
  auto path_entry = environment.find("PATH");
  std::string path = path_entry == environment.end() ? "/usr/local/bin:/usr/bin:/bin" : path_entry->second;
  size_t start = 0;
  while (true) {
    size_t colon = path.find(':', start);
    std::string directory = path.substr(start, colon == std::string::npos ? std::string::npos : colon - start);
    std::string candidate = (directory.empty() ? std::string(".") : directory) + "/" + program;
    if (executable(candidate)) return candidate;
    if (colon == std::string::npos) break;
    start = colon + 1;
  }
  TORCH_CHECK(false, "launch: program '", program, "' was not found in PATH (", path, "); give its path, e.g. ./",
              program, ".");
}

ProcessSetResult run_process_set(const std::vector<ProcessSpec>& specs, const ProcessSetOptions& options) {
  using Clock = std::chrono::steady_clock;
  SignalForwarding forwarding(options.forward_signals);
  ChildExitWakeup wakeup;  // before the children exist, so no exit goes unnoticed
  ProcessSetResult result;
  result.outcomes.resize(specs.size());
  std::vector<Child> children;
  try {
    for (const auto& spec : specs) children.push_back(spawn(spec));
  } catch (...) {
    signal_all(children, SIGKILL);
    for (auto& child : children) ::waitpid(child.pid, nullptr, 0);
    throw;
  }

  const auto started = Clock::now();
  auto next_stop_poll = started + options.stop_poll_interval;
  std::exception_ptr stop_error;
  std::optional<Clock::time_point> kill_deadline;  // set once the set is being stopped
  auto stop_all = [&](int signal_number) {
    if (kill_deadline) return;
    for (size_t index = 0; index < children.size(); ++index) {
      if (children[index].running) result.outcomes[index].stopped_by_parent = true;
    }
    signal_all(children, signal_number);
    kill_deadline = Clock::now() + options.termination_grace;
  };

  auto any_running = [&] {
    for (const auto& child : children) {
      if (child.running || !child.streams.empty()) return true;
    }
    return false;
  };
  while (any_running()) {
    std::vector<pollfd> descriptors;
    std::vector<std::pair<size_t, size_t>> owners;
    for (size_t index = 0; index < children.size(); ++index) {
      for (size_t stream = 0; stream < children[index].streams.size(); ++stream) {
        descriptors.push_back({children[index].streams[stream].fd, POLLIN, 0});
        owners.emplace_back(index, stream);
      }
    }
    const size_t stream_count = descriptors.size();
    if (wakeup.descriptor() >= 0) descriptors.push_back({wakeup.descriptor(), POLLIN, 0});
    int ready = ::poll(descriptors.data(), descriptors.size(), 20);
    if (wakeup.descriptor() >= 0) {
      if (descriptors.back().revents != 0) wakeup.drain();
      descriptors.pop_back();
    }
    if (ready > 0) {
      for (size_t position = stream_count; position-- > 0;) {
        if (descriptors[position].revents == 0) continue;
        auto [index, stream_index] = owners[position];
        auto& child = children[index];
        auto& stream = child.streams[stream_index];
        char buffer[65536];
        ssize_t n = ::read(stream.fd, buffer, sizeof(buffer));
        if (n > 0) {
          stream.pending.append(buffer, static_cast<size_t>(n));
          relay_lines(stream, child.label, false);
        } else if (n == 0 || (errno != EINTR && errno != EAGAIN)) {
          relay_lines(stream, child.label, true);
          ::close(stream.fd);
          child.streams.erase(child.streams.begin() + static_cast<std::ptrdiff_t>(stream_index));
        }
      }
    }

    for (size_t index = 0; index < children.size(); ++index) {
      auto& child = children[index];
      if (!child.running) continue;
      int status = 0;
      pid_t reaped = ::waitpid(child.pid, &status, WNOHANG);
      if (reaped != child.pid) continue;
      child.running = false;
      result.outcomes[index].exit_code = shell_status(status);
      if (result.outcomes[index].exit_code != 0) result.failure_order.push_back(index);
      if (result.outcomes[index].exit_code != 0 && !result.first_failure && !kill_deadline) {
        result.first_failure = index;
        result.exit_code = result.outcomes[index].exit_code;
        stop_all(SIGTERM);
        if (options.on_first_failure) options.on_first_failure(index, result.exit_code);
      }
    }

    if (int signal_number = received_signal.exchange(0); signal_number != 0 && options.forward_signals) {
      // The first failure keeps its exit code; a signal during the stop still counts as one.
      if (!result.interrupted && !result.first_failure) result.exit_code = 128 + signal_number;
      result.interrupted = true;
      stop_all(signal_number);
    }
    if (options.stop_requested && !kill_deadline && Clock::now() >= next_stop_poll) {
      next_stop_poll = Clock::now() + options.stop_poll_interval;
      try {
        if (auto reason = options.stop_requested()) {
          result.stop_reason = std::move(reason);
          stop_all(SIGTERM);
        }
      } catch (...) {
        stop_error = std::current_exception();
        stop_all(SIGTERM);
      }
    }
    if (options.timeout && !kill_deadline && Clock::now() - started > *options.timeout) {
      result.timed_out = true;
      result.exit_code = 124;
      stop_all(SIGTERM);
    }
    if (kill_deadline && Clock::now() > *kill_deadline) {
      signal_all(children, SIGKILL);
      kill_deadline = Clock::time_point::max();
    }
  }
  // Leave no grandchildren behind once the set is being stopped.
  if (kill_deadline) signal_all(children, SIGKILL);
  // A signal after the loop's last look still ends the job: the launcher must not restart it.
  if (received_signal.exchange(0) != 0 && options.forward_signals) result.interrupted = true;
  if (stop_error && !result.interrupted) std::rethrow_exception(stop_error);
  return result;
}

}  // namespace fsdp::detail
