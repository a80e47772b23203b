// libfsdp_save_fault_points.so: the counting save_fault_point that tests/checkpoint/save_faults_test.cpp
// preloads into the ranks it starts, in place of the library's empty one (Note [fault injection in
// saves], src/io/fault_point.h). Never installed.
#include <fcntl.h>
#include <unistd.h>

#include <atomic>
#include <csignal>
#include <cstdlib>
#include <string>

namespace fsdp::detail {

__attribute__((visibility("default"))) void save_fault_point(const char* operation, const char* file) {
  static const char* const rank = std::getenv("RANK");
  static const char* const kill_rank = std::getenv("FSDP_TEST_FAULT_KILL_RANK");
  static const bool this_rank = kill_rank == nullptr || std::string(kill_rank) == (rank ? rank : "0");
  static const long long kill_at = [] {
    const char* text = std::getenv("FSDP_TEST_FAULT_KILL_AT");
    return text ? std::atoll(text) : -1LL;
  }();
  static const char* const log = std::getenv("FSDP_TEST_FAULT_LOG");
  static std::atomic<long long> count{0};
  if (kill_at < 0 && log == nullptr) return;
  const long long number = ++count;
  if (log != nullptr) {
    const std::string line =
        std::string(rank ? rank : "0") + " " + std::to_string(number) + " " + operation + " " + file + "\n";
    const int fd = ::open(log, O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
    if (fd >= 0) {
      ssize_t ignored = ::write(fd, line.data(), line.size());
      (void)ignored;
      ::close(fd);
    }
  }
  if (this_rank && number == kill_at) ::raise(SIGKILL);
}

}  // namespace fsdp::detail
