// Private: write a file so that readers see either the old contents or the new, never a part.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>

namespace fsdp::detail {

/// Writes `contents` to a temporary name beside `path`, fsyncs it, renames it over `path` and
/// fsyncs the directory. On failure the temporary is removed and `path` is untouched.
void write_file_atomically(const std::string& path, const std::string& contents);

/// Appends bytes to the file being written.
using ByteSink = std::function<void(const void* data, size_t size)>;

/// The same, for contents produced in pieces (large files are never held in memory twice):
/// `produce` receives a sink and calls it with consecutive pieces. An exception from `produce`
/// leaves `path` untouched.
void write_file_atomically(const std::string& path, const std::function<void(const ByteSink& sink)>& produce);

class ReadOnlyFile;  // io/read_only_file.h
/// Appends `count` bytes of `source` from `offset` to the file being written, copied inside the
/// kernel where it can (ReadOnlyFile::copy_exactly_to); `item` names them in errors.
using RangeSink =
    std::function<void(const ReadOnlyFile& source, uint64_t offset, uint64_t count, const std::string& item)>;

/// The same, for contents that are partly bytes in memory (`sink`) and partly ranges of other
/// files (`copy`), in any interleaving.
void write_file_atomically_with_copies(const std::string& path,
                                       const std::function<void(const ByteSink& sink, const RangeSink& copy)>& produce);

}  // namespace fsdp::detail
