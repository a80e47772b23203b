// Which device a rank computes on, and whether this build can compute on a GPU at all.
//
// fsdp.cpp is one code base for CPU and GPU: a unit runs on its parameters' device (or, with CPU
// offload, on default_device()). The GPU path (CUDA tensors over NCCL, Note [The GPU path] in
// docs/design.md) exists only in a build against a CUDA libtorch.
#pragma once

#include <c10/core/Device.h>

#include <cstdint>

namespace fsdp {

/// Whether this build has the GPU path: it was compiled against a CUDA libtorch, with NCCL groups.
bool built_with_cuda();

/// CUDA devices this process can use: 0 on a CPU-only build, and on a CUDA build without a GPU or
/// driver.
int64_t cuda_device_count();

/// The device a rank with this LOCAL_RANK computes on: `cuda:<local_rank>` when this build has the
/// GPU path and the process sees more than local_rank GPUs (one GPU per rank, as torchrun and
/// Accelerate place them); CPU when it sees none. `FSDP_DEVICE=cpu` forces CPU and
/// `FSDP_DEVICE=cuda` requires a GPU. Throws, naming the rank and the counts, when a GPU is required
/// or some GPUs are visible but fewer than local_rank + 1 (two ranks would share a GPU, which NCCL
/// refuses).
c10::Device default_device(int64_t local_rank);

/// The most bytes the caching allocator of GPU `device` has held in tensors since the process
/// started or since reset_peak_device_memory (torch.cuda.max_memory_allocated). Throws on a device
/// that is not a GPU of this build.
int64_t peak_device_memory_bytes(c10::Device device);
/// Starts the peak over from what is allocated now (torch.cuda.reset_peak_memory_stats).
void reset_peak_device_memory(c10::Device device);

}  // namespace fsdp
