// Private: streams, events and stream-ordered memory for the GPU path, written against c10's
// device-generic interfaces (c10::Stream, c10::Event, the device's guard implementation) so that
// the engine never includes a CUDA header and the same code runs, as no-ops, on CPU.
//
// Note [streams of a unit]
// FSDP2's (torch/distributed/fsdp/_fully_shard/_fsdp_state.py and _fsdp_param_group.py): on a GPU
// the engine keeps two kinds of work off the compute stream, each on a stream of its own per device:
//   - kAllGather: the all-gather copy-in and the issue of the all-gather, after waiting for the
//     compute stream's work so far (the optimizer step that wrote the shards). NCCL then runs the
//     collective on its own stream, which waits for this one, not for the compute stream: the next
//     unit's all-gather overlaps this unit's compute. The compute stream waits for the all-gather
//     only when the unit needs its parameters (CollectiveWork::wait makes the current stream wait).
//   - kReduceScatter: the reduce-scatter copy-in and issue, after waiting for the compute stream
//     (which produced the gradients): the reduction overlaps the next unit's backward.
// cpu_offload's copies between host memory and the GPU stay on the compute stream: the parameter
// shards are copied in by the all-gather's copy-in on kAllGather, and the gradients go back to the
// host at the end of the iteration, synchronously, because the optimizer step on the host reads
// them next (ParamGroup::end_iteration).
// A buffer written or read on a side stream is either allocated there or recorded on it
// (record_stream), so the caching allocator hands its memory out again only after the work of
// every stream that uses it: Note [a block returns after its last use].
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Event.h>
#include <c10/core/Stream.h>

#include <optional>

namespace fsdp::detail {

enum class SideStream { kAllGather, kReduceScatter };

/// Whether `device` has streams (a GPU): on CPU every function below is a no-op.
bool has_streams(c10::Device device);

/// The current (compute) stream of `device`.
c10::Stream current_stream(c10::Device device);
/// The process-wide side stream `kind` of `device`, created on first use.
c10::Stream side_stream(c10::Device device, SideStream kind);

/// Makes `waiter` wait (on the device, not the host) for the work issued on `producer` so far.
void stream_wait_stream(const c10::Stream& waiter, const c10::Stream& producer);

/// Marks `tensor`'s memory as used by `stream`, so that the caching allocator does not reuse it
/// before the work queued there so far completes (torch's Tensor.record_stream).
void record_stream(const at::Tensor& tensor, const c10::Stream& stream);

/// While alive, `stream` is the current stream of its device (nothing on CPU).
class StreamScope {
 public:
  explicit StreamScope(std::optional<c10::Stream> stream);
  ~StreamScope();
  StreamScope(const StreamScope&) = delete;
  StreamScope& operator=(const StreamScope&) = delete;

 private:
  std::optional<c10::Stream> previous_;
};

/// An empty host tensor in page-locked memory when a GPU is present (copies to and from it can be
/// asynchronous), ordinary memory otherwise.
at::Tensor empty_host(at::IntArrayRef sizes, c10::ScalarType dtype, bool pin_memory);

}  // namespace fsdp::detail
