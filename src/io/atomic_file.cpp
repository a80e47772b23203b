#include "io/atomic_file.h"

#include <c10/util/Exception.h>
#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>

#include "io/fault_point.h"
#include "io/read_only_file.h"

namespace fsdp::detail {

namespace {

// Note [fault injection in saves] (src/io/fault_point.h): every write, fsync and rename below.
void fault_point(const char* operation, const std::string& file) { save_fault_point(operation, file.c_str()); }

}  // namespace

void write_file_atomically(const std::string& path, const std::string& contents) {
  write_file_atomically(path, [&](const ByteSink& sink) { sink(contents.data(), contents.size()); });
}

void write_file_atomically(const std::string& path, const std::function<void(const ByteSink& sink)>& produce) {
  write_file_atomically_with_copies(path, [&](const ByteSink& sink, const RangeSink&) { produce(sink); });
}

void write_file_atomically_with_copies(
    const std::string& path, const std::function<void(const ByteSink& sink, const RangeSink& copy)>& produce) {
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
  auto copy = [&](const ReadOnlyFile& source, uint64_t offset, uint64_t count, const std::string& item) {
    fault_point("write", temporary);
    source.copy_exactly_to(fd, offset, count, item);
  };
  try {
    produce(sink, copy);
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
