#include "io/atomic_file.h"

#include <c10/util/Exception.h>
#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>

#ifdef FSDP_FAULT_INJECTION
#include <atomic>
#include <csignal>
#include <cstdlib>
#endif

namespace fsdp::detail {

namespace {

#ifdef FSDP_FAULT_INJECTION
// Note [fault injection in saves]
// A build with FSDP_FAULT_INJECTION (CMake's option of that name: off by default, on in the tests'
// build that scripts/setup.sh configures) numbers every write, fsync and rename this layer makes in a process, and with
// FSDP_TEST_FAULT_KILL_AT=k (and FSDP_TEST_FAULT_KILL_RANK=r, matched against RANK) kills the process with
// SIGKILL just before the k-th: a machine losing power in the middle of a save, at a chosen byte
// boundary. FSDP_TEST_FAULT_LOG=path appends "<rank> <k> <operation> <file>" for each, so a test can
// learn which numbers belong to a save and try each (tests/checkpoint/save_faults_test.cpp). Without
// the variables nothing is counted; without the option none of this is compiled.
void fault_point(const char* operation, const std::string& file) {
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
#else
inline void fault_point(const char*, const std::string&) {}
#endif

}  // namespace

void write_file_atomically(const std::string& path, const std::string& contents) {
  write_file_atomically(path, [&](const ByteSink& sink) { sink(contents.data(), contents.size()); });
}

void write_file_atomically(const std::string& path, const std::function<void(const ByteSink& sink)>& produce) {
  const std::filesystem::path target(path);
  const auto directory = target.has_parent_path() ? target.parent_path() : std::filesystem::path(".");
  // Built by appending: GCC 12 misreads `"." + std::string` as an oversized copy (-Wstringop-overflow).
  std::string temporary_name = ".";
  temporary_name += target.filename().string();
  temporary_name += ".tmp.";
  temporary_name += std::to_string(::getpid());
  const std::string temporary = (directory / temporary_name).string();
  int fd = ::open(temporary.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  TORCH_CHECK(fd >= 0, "writing '", path, "': cannot create temporary file '", temporary, "': ", std::strerror(errno));
  auto fail = [&](const char* step) {
    const int error = errno;
    ::close(fd);
    fd = -1;
    ::unlink(temporary.c_str());
    TORCH_CHECK(false, "writing '", path, "': ", step, " failed: ", std::strerror(error), "; the file is unchanged.");
  };
  auto sink = [&](const void* data, size_t size) {
    const auto* bytes = static_cast<const char*>(data);
    size_t written = 0;
    fault_point("write", temporary);  // once per write asked for, however many calls the kernel needs
    while (written < size) {
      ssize_t n = ::write(fd, bytes + written, size - written);
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) fail("write");
      written += static_cast<size_t>(n);
    }
  };
  try {
    produce(sink);
  } catch (...) {
    if (fd >= 0) {
      ::close(fd);
      ::unlink(temporary.c_str());
    }
    throw;
  }
  fault_point("fsync", temporary);
  if (::fsync(fd) != 0) fail("fsync");
  if (::close(fd) != 0) {
    const int error = errno;
    ::unlink(temporary.c_str());
    TORCH_CHECK(false, "writing '", path, "': close failed: ", std::strerror(error), "; the file is unchanged.");
  }
  fault_point("rename", path);
  if (::rename(temporary.c_str(), path.c_str()) != 0) {
    const int error = errno;
    ::unlink(temporary.c_str());
    TORCH_CHECK(false, "writing '", path, "': rename failed: ", std::strerror(error), "; the file is unchanged.");
  }
  int directory_fd = ::open(directory.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (directory_fd >= 0) {
    fault_point("fsync-directory", directory.string());
    ::fsync(directory_fd);  // makes the rename durable; best effort on filesystems that refuse
    ::close(directory_fd);
  }
}

}  // namespace fsdp::detail
