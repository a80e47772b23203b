// Keeping freed host memory from staying resident.
//
// FSDP allocates and frees unit-sized buffers many times per step (gathered parameters, all-gather
// output, full-size gradients, reduce-scatter input). glibc's malloc serves a block of more than
// M_MMAP_THRESHOLD bytes with its own mapping, returned to the system on free, but it raises that
// threshold to the size of every such block freed (up to 32 MiB). After the first step, unit-sized
// buffers therefore come from the heap, whose free space stays resident: at 4 ranks a 50 M-parameter
// model peaked at 788 MB per rank instead of 441 MB (bench/README.md). Fixing the thresholds keeps
// every large block a mapping of its own; the page faults that costs were not measurable against the
// step time here.
#pragma once

#include <cstdint>

namespace fsdp {

/// Sets glibc's M_MMAP_THRESHOLD and M_TRIM_THRESHOLD to `threshold_bytes` for this process, which
/// also stops malloc from raising them. Process-wide, so it is the application's call (Accelerator
/// makes it unless AcceleratorOptions::limit_retained_host_memory is false). Throws on a C library
/// without these settings.
void limit_retained_host_memory(int64_t threshold_bytes = int64_t{1} << 20);

}  // namespace fsdp
