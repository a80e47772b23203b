// Private: the one way a file is opened for reading (Note [reading untrusted files]).
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace fsdp::detail {

/// Note [reading untrusted files]
/// Every byte a reader takes from disk may be hostile or half
/// written, so every reader opens its file through this one type, which applies one policy:
/// - regular files only: a FIFO in place of a file would block the open or the first read forever
///   (opened with O_NONBLOCK, then refused); a directory or a device is not a file. Symbolic links
///   are followed (Hugging Face caches are links into blobs); a loop is the kernel's ELOOP, named;
/// - a size bound from the caller, checked before a byte is read: a reader never sizes a buffer
///   from a file it has not bounded;
/// - positioned reads (pread) retried on EINTR; a read that comes back short is "the file ended
///   after N of M bytes": truncated while being read, named instead of returning garbage;
/// - mmap only where a reader asks for it (one mapping, made once, released with the file);
/// - the descriptor is closed on every path (RAII), and is O_CLOEXEC so launched ranks never inherit it.
/// Errors name the file as the caller calls it (`what`: "safetensors file", "config file") and
/// end with the caller's fix.
class ReadOnlyFile {
 public:
  /// Opens `path`; refuses anything but a regular file of at most `max_bytes` bytes.
  ReadOnlyFile(const std::string& path, uint64_t max_bytes, const std::string& what, const std::string& fix = "");
  /// The same, but nullopt (instead of an error) where `path` does not exist, for readers whose
  /// missing file has a message of its own.
  static std::optional<ReadOnlyFile> open_if_exists(const std::string& path, uint64_t max_bytes,
                                                    const std::string& what, const std::string& fix = "");
  ~ReadOnlyFile();
  ReadOnlyFile(ReadOnlyFile&& other) noexcept;
  ReadOnlyFile& operator=(ReadOnlyFile&& other) noexcept;
  ReadOnlyFile(const ReadOnlyFile&) = delete;
  ReadOnlyFile& operator=(const ReadOnlyFile&) = delete;

  const std::string& path() const { return path_; }
  /// The size when it was opened.
  uint64_t size() const { return size_; }
  /// Up to `count` bytes at `offset` (fewer only where the file ends); an I/O error is an error.
  size_t read_at_most(void* buffer, size_t count, uint64_t offset) const;
  /// Exactly `count` bytes at `offset`; fewer is an error naming `item` and the truncation.
  void read_exactly(void* buffer, size_t count, uint64_t offset, const std::string& item) const;
  /// Appends exactly `count` bytes at `offset` to the open file `destination` (at its position),
  /// copied inside the kernel (copy_file_range: no pass through this process's memory) where the
  /// filesystems allow, else through a buffer. Fewer is an error as for read_exactly.
  void copy_exactly_to(int destination, uint64_t offset, uint64_t count, const std::string& item) const;
  /// The whole file (size() bytes; a file that shrank meanwhile is an error).
  std::vector<char> read_all() const;
  std::string read_text() const;
  /// The whole file mapped read-only, mapped on the first call; nullptr for an empty file.
  const uint8_t* map() const;

 private:
  ReadOnlyFile() = default;
  void release() noexcept;
  std::string path_;
  std::string what_;
  int descriptor_ = -1;
  uint64_t size_ = 0;
  mutable const uint8_t* mapping_ = nullptr;
};

/// The bound for a file read whole into memory: this machine's physical memory (a larger file
/// could not be held anyway; refusing it names the file instead of being killed for memory).
uint64_t in_memory_bound();

/// A whole small file as text (configs, JSON indexes, markers) through ReadOnlyFile.
std::string read_text_file(const std::string& path, uint64_t max_bytes, const std::string& what,
                           const std::string& fix = "");

}  // namespace fsdp::detail
