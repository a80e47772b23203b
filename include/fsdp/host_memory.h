// Keeping freed host memory from staying resident.
//
// A training step allocates and frees large blocks many times (autograd's full-size gradients and
// activations; FSDP's own unit-sized buffers come from a small pool, src/memory/buffer_pool.h).
// glibc's malloc serves a block of more than M_MMAP_THRESHOLD bytes with its own mapping, returned
// to the system on free, but raises that threshold to the size of every such block freed (up to
// 32 MiB), so later blocks of that size come from the heap, whose free space stays resident. Fixing
// the thresholds keeps every large block a mapping of its own: at 4 ranks a 50 M-parameter model
// peaked at 457 MB per rank instead of 570 MB, for about 10% more step time (a page fault per 4 KiB
// of every fresh block). bench/README.md has the figures.
#pragma once

#include <cstdint>

namespace fsdp {

/// Sets glibc's M_MMAP_THRESHOLD and M_TRIM_THRESHOLD to `threshold_bytes` for this process, which
/// also stops malloc from raising them. Process-wide, so it is the application's call (Accelerator
/// makes it when AcceleratorOptions::limit_retained_host_memory is set). Throws on a C library
/// without these settings.
void limit_retained_host_memory(int64_t threshold_bytes = int64_t{1} << 20);

}  // namespace fsdp
