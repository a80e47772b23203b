// Private: write a file so that readers see either the old contents or the new, never a part.
#pragma once

#include <cstddef>
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

}  // namespace fsdp::detail
