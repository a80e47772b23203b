#include "io/read_only_file.h"

#include <c10/util/Exception.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <limits>
#include <utility>

namespace fsdp::detail {
namespace {

const char* kind_of(mode_t mode) {
  if (S_ISDIR(mode)) return "a directory";
  if (S_ISFIFO(mode)) return "a FIFO";
  if (S_ISCHR(mode)) return "a character device";
  if (S_ISBLK(mode)) return "a block device";
  if (S_ISSOCK(mode)) return "a socket";
  return "not a file";
}

std::string with_fix(const std::string& fix) { return fix.empty() ? std::string() : "; " + fix; }

}  // namespace

std::optional<ReadOnlyFile> ReadOnlyFile::open_if_exists(const std::string& path, uint64_t max_bytes,
                                                         const std::string& what, const std::string& fix) {
  struct stat status{};
  if (::stat(path.c_str(), &status) != 0 && errno == ENOENT) return std::nullopt;
  return ReadOnlyFile(path, max_bytes, what, fix);
}

ReadOnlyFile::ReadOnlyFile(const std::string& path, uint64_t max_bytes, const std::string& what, const std::string& fix)
    : path_(path), what_(what) {
  // O_NONBLOCK: opening a FIFO must not wait for a writer (it is refused below); reads of a
  // regular file ignore the flag.
  descriptor_ = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  if (descriptor_ < 0) {
    const int error = errno;
    TORCH_CHECK(error != ELOOP, what, " '", path, "' is a loop of symbolic links", with_fix(fix));
    TORCH_CHECK(false, "cannot open ", what, " '", path, "': it cannot be read (", std::strerror(error), ")",
                with_fix(fix));
  }
  struct stat status{};
  if (::fstat(descriptor_, &status) != 0) {
    const int error = errno;
    release();
    TORCH_CHECK(false, "cannot open ", what, " '", path, "': it cannot be read (", std::strerror(error), ")",
                with_fix(fix));
  }
  if (!S_ISREG(status.st_mode)) {
    release();
    TORCH_CHECK(false, what, " '", path, "' is not a regular file (it is ", kind_of(status.st_mode), ")",
                with_fix(fix));
  }
  size_ = static_cast<uint64_t>(status.st_size);
  if (size_ > max_bytes) {
    const auto size = size_;
    release();
    TORCH_CHECK(false, what, " '", path, "' has ", size, " bytes, more than the ", max_bytes, " a ", what,
                " can have: it is refused before anything is read", with_fix(fix));
  }
}

ReadOnlyFile::~ReadOnlyFile() { release(); }

void ReadOnlyFile::release() noexcept {
  if (mapping_) ::munmap(const_cast<uint8_t*>(mapping_), size_);
  mapping_ = nullptr;
  if (descriptor_ >= 0) ::close(descriptor_);
  descriptor_ = -1;
}

ReadOnlyFile::ReadOnlyFile(ReadOnlyFile&& other) noexcept
    : path_(std::move(other.path_)),
      what_(std::move(other.what_)),
      descriptor_(std::exchange(other.descriptor_, -1)),
      size_(std::exchange(other.size_, 0)),
      mapping_(std::exchange(other.mapping_, nullptr)) {}

ReadOnlyFile& ReadOnlyFile::operator=(ReadOnlyFile&& other) noexcept {
  if (this != &other) {
    release();
    path_ = std::move(other.path_);
    what_ = std::move(other.what_);
    descriptor_ = std::exchange(other.descriptor_, -1);
    size_ = std::exchange(other.size_, 0);
    mapping_ = std::exchange(other.mapping_, nullptr);
  }
  return *this;
}

size_t ReadOnlyFile::read_at_most(void* buffer, size_t count, uint64_t offset) const {
  TORCH_INTERNAL_ASSERT(descriptor_ >= 0, "read from a moved-from file");
  size_t done = 0;
  while (done < count) {
    const auto got =
        ::pread(descriptor_, static_cast<char*>(buffer) + done, count - done, static_cast<off_t>(offset + done));
    if (got < 0 && errno == EINTR) continue;
    TORCH_CHECK(got >= 0, what_, " '", path_, "' could not be read at byte ", offset + done, ": ",
                std::strerror(errno));
    if (got == 0) break;
    done += static_cast<size_t>(got);
  }
  return done;
}

void ReadOnlyFile::read_exactly(void* buffer, size_t count, uint64_t offset, const std::string& item) const {
  const size_t done = read_at_most(buffer, count, offset);
  TORCH_CHECK(done == count, item, ": the file ended after ", done, " of ", count, " bytes at byte ", offset, " of ",
              what_, " '", path_, "' (", size_,
              " bytes when opened): it was truncated while being read, or is still "
              "being written");
}

void ReadOnlyFile::copy_exactly_to(int destination, uint64_t offset, uint64_t count, const std::string& item) const {
  TORCH_INTERNAL_ASSERT(descriptor_ >= 0, "copy from a moved-from file");
  uint64_t done = 0;
  auto ended = [&] {
    TORCH_CHECK(false, item, ": the file ended after ", done, " of ", count, " bytes at byte ", offset, " of ", what_,
                " '", path_, "' (", size_,
                " bytes when opened): it was truncated while being read, or is still being written");
  };
  bool in_kernel = true;
  while (done < count && in_kernel) {
    auto position = static_cast<loff_t>(offset + done);
    const auto copied = ::copy_file_range(descriptor_, &position, destination, nullptr,
                                          static_cast<size_t>(std::min<uint64_t>(count - done, 1u << 30)), 0);
    if (copied < 0 && errno == EINTR) continue;
    // Copy through a buffer instead where the kernel will not: another filesystem, an old kernel, a
    // file kind it refuses, a sandbox that forbids the call (EPERM), network and FUSE filesystems
    // (EIO), or one that copies nothing at all on the first call.
    if ((copied < 0 && (errno == EXDEV || errno == ENOSYS || errno == EOPNOTSUPP || errno == EINVAL || errno == EPERM ||
                        errno == EIO)) ||
        (copied == 0 && done == 0)) {
      in_kernel = false;
      break;
    }
    TORCH_CHECK(copied >= 0, item, ": copying from ", what_, " '", path_, "' at byte ", offset + done,
                " into the file being written failed: ", std::strerror(errno));
    if (copied == 0) ended();
    done += static_cast<uint64_t>(copied);
  }
  std::vector<char> buffer;
  while (done < count) {
    buffer.resize(static_cast<size_t>(std::min<uint64_t>(count - done, 1u << 20)));
    const size_t got = read_at_most(buffer.data(), buffer.size(), offset + done);
    if (got == 0) ended();
    for (size_t written = 0; written < got;) {
      const auto n = ::write(destination, buffer.data() + written, got - written);
      if (n < 0 && errno == EINTR) continue;
      TORCH_CHECK(n > 0, item, ": writing the bytes copied from ", what_, " '", path_,
                  "' failed: ", std::strerror(errno));
      written += static_cast<size_t>(n);
    }
    done += got;
  }
}

std::vector<char> ReadOnlyFile::read_all() const {
  std::vector<char> bytes(static_cast<size_t>(size_));
  read_exactly(bytes.data(), bytes.size(), 0, what_ + " '" + path_ + "'");
  return bytes;
}

std::string ReadOnlyFile::read_text() const {
  std::string text(static_cast<size_t>(size_), '\0');
  read_exactly(text.data(), text.size(), 0, what_ + " '" + path_ + "'");
  return text;
}

const uint8_t* ReadOnlyFile::map() const {
  if (mapping_ || size_ == 0) return mapping_;
  void* mapping = ::mmap(nullptr, size_, PROT_READ, MAP_PRIVATE, descriptor_, 0);
  TORCH_CHECK(mapping != MAP_FAILED, "cannot map ", what_, " '", path_, "': ", std::strerror(errno));
  mapping_ = static_cast<const uint8_t*>(mapping);
  return mapping_;
}

uint64_t in_memory_bound() {
  const long pages = ::sysconf(_SC_PHYS_PAGES);
  const long page_size = ::sysconf(_SC_PAGE_SIZE);
  if (pages <= 0 || page_size <= 0) return std::numeric_limits<uint64_t>::max();
  return static_cast<uint64_t>(pages) * static_cast<uint64_t>(page_size);
}

std::string read_text_file(const std::string& path, uint64_t max_bytes, const std::string& what,
                           const std::string& fix) {
  return ReadOnlyFile(path, max_bytes, what, fix).read_text();
}

}  // namespace fsdp::detail
