// Private: write a file so that readers see either the old contents or the new, never a part.
#pragma once

#include <string>

namespace fsdp::detail {

/// Writes `contents` to a temporary name beside `path`, fsyncs it, renames it over `path` and
/// fsyncs the directory. On failure the temporary is removed and `path` is untouched.
void write_file_atomically(const std::string& path, const std::string& contents);

}  // namespace fsdp::detail
