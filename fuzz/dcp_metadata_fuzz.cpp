// Any bytes as a DCP `.metadata`: a parsed DcpMetadata whose every chunk lies inside its tensor, or a
// c10::Error; anything else (a crash, a sanitizer report, a hang, runaway memory) is a bug.
#include <c10/util/Exception.h>

#include <cstddef>
#include <cstdint>
#include <cstdlib>

#include "checkpoint/dcp_metadata.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  try {
    const auto metadata = fsdp::detail::parse_dcp_metadata(data, size, "fuzz input");
    // What the parser promises its callers.
    for (const auto& [key, tensor] : metadata.tensors) {
      for (const auto& chunk : tensor.chunks) {
        if (chunk.offsets.size() != tensor.size.size() || chunk.sizes.size() != tensor.size.size()) std::abort();
        for (size_t dim = 0; dim < tensor.size.size(); ++dim) {
          if (chunk.offsets[dim] + chunk.sizes[dim] > tensor.size[dim]) std::abort();
        }
        if (chunk.storage.length >= 0 &&
            (chunk.storage.offset < 0 || chunk.storage.relative_path.find('/') != std::string::npos)) {
          std::abort();
        }
      }
    }
  } catch (const c10::Error&) {
  }
  return 0;
}
