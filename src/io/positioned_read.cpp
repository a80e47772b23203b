#include "io/positioned_read.h"

#include <unistd.h>

#include <cerrno>

namespace fsdp::detail {

int64_t read_at(int descriptor, void* buffer, size_t count, int64_t offset) {
  size_t done = 0;
  while (done < count) {
    const auto got = ::pread(descriptor, static_cast<char*>(buffer) + done, count - done,
                             static_cast<off_t>(offset + static_cast<int64_t>(done)));
    if (got < 0 && errno == EINTR) continue;
    if (got < 0) return -1;
    if (got == 0) break;
    done += static_cast<size_t>(got);
  }
  return static_cast<int64_t>(done);
}

}  // namespace fsdp::detail
