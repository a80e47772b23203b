// Collectives on flat, contiguous buffers, on the CPU (Gloo) or, in a CUDA build, on a GPU (NCCL:
// Note [The GPU path], docs/design.md): the only communication the FSDP engine uses.
//
// Free functions, no knowledge of modules or parameters. Layout contract (FSDP's): a full buffer of
// N * s elements is N equal shards of s elements, shard r belonging to group rank r; callers pad.
//
// Every dtype works: payloads travel as bytes and reductions are done locally. Reduce-scatter is an
// exchange plus a local sum, so each rank sends (N-1)/N of the buffer rather than the 2(N-1)/N of an
// all-reduce followed by a slice (Note [Collectives on Gloo], docs/design.md).
// Low-precision floating sums accumulate in fp32 and are summed in rank order, so results are
// deterministic.
//
// Each collective has an `_async` form that returns a `CollectiveWork`; the synchronous form is
// `_async(...).wait()`. Output buffers must not be read before `wait()` returns. Inputs must stay
// alive and unmodified until then.
#pragma once

#include <ATen/core/Tensor.h>
#include <fsdp/process_group.h>

#include <functional>
#include <memory>

namespace fsdp {

enum class ReduceOp {
  /// Elementwise sum (logical or for bool).
  kSum,
  /// Elementwise maximum (logical or for bool).
  kMax,
  /// Elementwise minimum (logical and for bool).
  kMin,
};

const char* to_string(ReduceOp op);

namespace detail {
struct CollectiveWorkState;
}

/// A collective in flight, used as FSDP2 uses a CUDA event: `wait()` blocks until the output is ready
/// (on GPU buffers it makes the current stream wait instead, and the host goes on) and rethrows a failure of the
/// collective with the group, the rank and the operation in the message; waiting twice is a no-op. `query()` asks
/// without blocking whether the transport is done with the buffers, which is what decides when a buffer may be reused
/// (Note [a block returns after its last use], src/memory/buffer_pool.h).
class CollectiveWork {
 public:
  CollectiveWork() = default;
  explicit CollectiveWork(std::shared_ptr<detail::CollectiveWorkState> state);
  void wait();
  /// True once `wait()` has returned (or the collective needed no communication).
  bool completed() const;
  /// Non-blocking: true once every transfer of the collective is known to have finished (or
  /// failed), so that nothing reads or writes its buffers any more. Gloo's point-to-point transfers,
  /// which all-gather and reduce-scatter are made of, report completion only through their wait, so
  /// for those it turns true once `wait()` has run; Gloo's own collectives (all-reduce, broadcast)
  /// turn true as they finish. The output of a reduction is ready only after `wait()`.
  bool query() const;

 private:
  std::shared_ptr<detail::CollectiveWorkState> state_;
};

struct ReduceScatterOptions {
  /// Elementwise reduction. Default: sum.
  ReduceOp op = ReduceOp::kSum;
  /// Divide the input by this before sending (FSDP pre-divides so large N cannot overflow fp16).
  /// Default: 1 (no division). Floating dtypes only.
  double pre_divide_factor = 1.0;
  /// Divide the reduced shard by this. Default: 1. Floating dtypes only.
  double post_divide_factor = 1.0;
};

/// output (N * s elements) <- concatenation of every rank's input (s elements), in rank order.
CollectiveWork all_gather_async(const ProcessGroup& group, const at::Tensor& output, const at::Tensor& input);
void all_gather(const ProcessGroup& group, const at::Tensor& output, const at::Tensor& input);

/// output (s elements) <- reduction over ranks of shard `group.rank()` of every rank's input (N * s).
CollectiveWork reduce_scatter_async(const ProcessGroup& group, const at::Tensor& output, const at::Tensor& input,
                                    const ReduceScatterOptions& options = {});
void reduce_scatter(const ProcessGroup& group, const at::Tensor& output, const at::Tensor& input,
                    const ReduceScatterOptions& options = {});

/// tensor <- reduction of `tensor` over all ranks, in place. Any size; no padding needed.
CollectiveWork all_reduce_async(const ProcessGroup& group, const at::Tensor& tensor, ReduceOp op = ReduceOp::kSum);
void all_reduce(const ProcessGroup& group, const at::Tensor& tensor, ReduceOp op = ReduceOp::kSum);

/// tensor <- root's tensor, in place. `root` is a group rank.
CollectiveWork broadcast_async(const ProcessGroup& group, const at::Tensor& tensor, int64_t root);
void broadcast(const ProcessGroup& group, const at::Tensor& tensor, int64_t root);

/// Returns once every rank of the group has called it.
void barrier(const ProcessGroup& group);

}  // namespace fsdp
