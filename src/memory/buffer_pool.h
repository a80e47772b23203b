// Unit-sized host buffers kept for reuse across units and steps (what PyTorch's CUDA caching allocator
// does for FSDP on GPUs). Each step allocates and frees, for every unit, the gathered parameters, the
// all-gather output, the reduce-scatter input and its receive buffer (src/dist). From malloc, a fresh
// block of that size either costs a page fault per 4 KiB (a mapping of its own) or stays resident in
// the heap after it is freed (glibc serves such sizes from the heap once one was freed). The pool
// hands the same few blocks round: the memory it keeps is bounded by kMaxKeptBlocks blocks.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Allocator.h>

#include <cstdint>

namespace fsdp::detail {

/// Free blocks kept at most, over all sizes; the least recently returned go first.
constexpr size_t kMaxKeptBlocks = 6;

/// A block of exactly `nbytes` bytes, reused if one of that size is free.
at::DataPtr take_pooled_block(int64_t nbytes);
/// Gives a block obtained from take_pooled_block back for reuse.
void return_pooled_block(at::DataPtr block, int64_t nbytes);

/// Takes the memory out of `tensor`'s storage and returns it (and its size in `nbytes`): every view
/// of the storage keeps its shape and is left with zero bytes. The one place that empties a storage
/// in place; dropping the result frees the memory.
at::DataPtr take_storage_memory(const at::Tensor& tensor, int64_t* nbytes = nullptr);

/// A 1-D uint8 tensor of `nbytes` bytes whose memory comes from the pool.
at::Tensor pooled_bytes(int64_t nbytes);
/// Returns the memory of a tensor made by pooled_bytes (or a view of one) to the pool. Every view of
/// it is left without memory, so call it only once nothing reads them any more.
void return_pooled_bytes(const at::Tensor& tensor);

/// Bytes of free blocks the pool holds now (for tests).
int64_t pooled_free_bytes();

}  // namespace fsdp::detail
