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
#include <functional>

namespace fsdp::detail {

/// Free blocks kept at most, over all sizes; the least recently returned go first.
constexpr size_t kMaxKeptBlocks = 6;

/// A block of exactly `nbytes` bytes on `device`, reused if one of that size is free. The pool holds
/// host blocks; a GPU block comes from the device's caching allocator on the current stream and goes
/// back to it when returned (the allocator reuses it in stream order).
at::DataPtr take_pooled_block(int64_t nbytes, c10::Device device = c10::kCPU);
/// Gives a block obtained from take_pooled_block back for reuse.
void return_pooled_block(at::DataPtr block, int64_t nbytes);

/// Takes the memory out of `tensor`'s storage and returns it (and its size in `nbytes`): every view
/// of the storage keeps its shape and is left with zero bytes. The one place that empties a storage
/// in place; dropping the result frees the memory.
at::DataPtr take_storage_memory(const at::Tensor& tensor, int64_t* nbytes = nullptr);

/// A 1-D uint8 tensor of `nbytes` bytes on `device` whose memory comes from the pool.
at::Tensor pooled_bytes(int64_t nbytes, c10::Device device = c10::kCPU);
/// Returns the memory of a tensor made by pooled_bytes (or a view of one) to the pool. Every view of
/// it is left without memory, so call it only once nothing reads them any more.
void return_pooled_bytes(const at::Tensor& tensor);

/// Note [a block returns after its last use]
/// The issuer of a collective is done with its send buffer as soon as it is issued, but the transport
/// is not: it reads the block until the collective completes. FSDP2 on CUDA records the collective's
/// stream on the block so the caching allocator reuses it only after that work; this is the same
/// contract for the pool. return_pooled_bytes_after hands the tensor to the pool at once, but the
/// pool keeps its memory in place (the tensor intact, so a transport holding it still reads valid
/// bytes) and makes it a free block only once `is_complete()` returns true. take_pooled_block never
/// hands out a block in use and never waits for one; it polls the blocks in use, and a block in use is
/// never freed to make room. `is_complete` must be cheap and non-blocking (CollectiveWork::query; on
/// Gloo's point-to-point collectives it turns true when the unit waits for the collective, so on CPU
/// the block comes back then; on CUDA an event's query answers earlier). A collective that failed
/// and was never completed keeps its blocks out of the pool.
void return_pooled_bytes_after(const at::Tensor& tensor, std::function<bool()> is_complete);

/// Bytes of free blocks the pool holds now (for tests).
int64_t pooled_free_bytes();
/// Bytes of blocks returned with return_pooled_bytes_after whose work has not completed when last
/// polled (for tests).
int64_t pooled_busy_bytes();

}  // namespace fsdp::detail
