#include <c10/util/Exception.h>
#include <fsdp/host_memory.h>

#if defined(__GLIBC__)
#include <malloc.h>
#endif

namespace fsdp {

void limit_retained_host_memory(int64_t threshold_bytes) {
  // glibc caps M_MMAP_THRESHOLD at HEAP_MAX_SIZE / 2 (32 MiB on 64-bit) and rejects larger values.
  TORCH_CHECK(threshold_bytes >= 4096 && threshold_bytes <= (int64_t{32} << 20),
              "limit_retained_host_memory: threshold_bytes must be between 4096 and 32 MiB, got ", threshold_bytes);
#if defined(__SANITIZE_ADDRESS__)
  // AddressSanitizer replaces malloc; its mallopt accepts nothing (scripts/sanitize.sh builds).
  TORCH_CHECK(false,
              "limit_retained_host_memory: this build uses AddressSanitizer's allocator, which has no "
              "mallopt thresholds; set AcceleratorOptions::limit_retained_host_memory = false in sanitizer builds");
#elif defined(__GLIBC__)
  TORCH_CHECK(mallopt(M_MMAP_THRESHOLD, static_cast<int>(threshold_bytes)) == 1 &&
                  mallopt(M_TRIM_THRESHOLD, static_cast<int>(threshold_bytes)) == 1,
              "limit_retained_host_memory: glibc refused a threshold of ", threshold_bytes, " bytes");
#else
  TORCH_CHECK(false,
              "limit_retained_host_memory: this C library has no mallopt thresholds; set "
              "AcceleratorOptions::limit_retained_host_memory = false");
#endif
}

}  // namespace fsdp
