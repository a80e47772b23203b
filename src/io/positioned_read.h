// Private: reading a file at an offset without moving its position (pread), for readers that jump
// between items of one descriptor from several places.
#pragma once

#include <cstddef>
#include <cstdint>

namespace fsdp::detail {

/// Reads up to `count` bytes at `offset` (fewer only where the file ends), retrying interrupted
/// reads; -1 with errno set on an error.
int64_t read_at(int descriptor, void* buffer, size_t count, int64_t offset);

}  // namespace fsdp::detail
