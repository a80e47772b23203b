// One FSDP unit (FSDP2's FSDPParamGroup): the parameters of one or more modules that are gathered
// with one all-gather and whose gradients are reduced with one reduce-scatter.
//
// Note [storage, not tensors, is what gets freed]
// Autograd saves views of the parameters it multiplies with (a Linear saves `weight.t()`, a view of
// the weight's storage at forward time). Swapping the parameter's data with `set_data` after forward
// would leave those views pointing at the old full storage, so nothing would be freed and backward
// would read stale values. Instead every unsharded parameter is a view into one per-unit uint8
// buffer whose StorageImpl lives as long as the unit; resharding takes that storage's memory back to
// the pool (data pointer null, nbytes 0: take_storage_memory) and unsharding gives it a block again
// (`set_data_ptr_noswap`, `set_nbytes`) and refills it, so views saved by autograd see the new data.
// This is FSDP2's `untyped_storage().resize_(0)` in libtorch's C++ terms. The registered parameter
// itself (the TensorImpl the optimizer and the user hold) never changes identity: `set_data` points
// it at the sharded view (between steps) or at the unsharded view.
//
// Note [gradients while unsharded]
// AccumulateGrad writes a full-shape gradient into `param.grad`, which must therefore be empty when
// backward runs. From the start of a training iteration (the first forward with grad mode on) until
// its end (the end of backward), each parameter's sharded gradient is stashed in the unit and put
// back afterwards, so between steps `param.grad()` is the sharded gradient the optimizer expects.
//
// Note [resharding after forward to a smaller group]
// An integer reshard_after_forward k (FSDP2's int, ZeRO++'s hpZ) sits between true and false: after
// forward each rank keeps not its 1/N shard (true: backward all-gathers over all N) nor everything
// (false) but 1/k of the unsharded parameters, so backward's all-gather runs over a group of k
// consecutive ranks only (DistributedContext::consecutive_subgroup), the ranks of one machine when k
// is the ranks per machine: the all-gather that true sends across machines in backward stays inside
// one. As in FSDP2 (to_sharded_post_forward), rank r_k of its k-group keeps the r_k-th of k equal
// slices of every padded unsharded tensor, which is the N/k consecutive padded shards from
// r_k * N / k, and backward's all-gather over the k-group puts the full padded tensors back
// (post_forward_copy_in / _copy_out). What is kept is the unsharded buffer's bytes, so in the compute
// dtype under mixed precision, as FSDP2's. The registered parameters point at their own shards
// meanwhile (nothing reads them between forward and backward), and the reduce-scatter still runs
// over the whole shard group: only the re-gather changes. Bytes each rank sends in backward's
// all-gather: (k - 1) * N / k shards instead of N - 1, none of them off the k-group.
#pragma once

#include <ATen/core/Tensor.h>
#include <fsdp/collectives.h>
#include <fsdp/fully_shard_options.h>
#include <fsdp/shard_layout.h>

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "engine/fsdp_param.h"

namespace fsdp::detail {

/// Where a unit's parameters currently point.
enum class ShardedState {
  /// Parameters are views of their padded shards; the unsharded buffer holds no memory.
  kSharded,
  /// Parameters are views of their padded shards, and the unit holds its post-forward row of a
  /// smaller group (FSDP2's SHARDED_POST_FORWARD): Note [resharding after forward to a smaller group].
  kShardedPostForward,
  /// Parameters are views of the full tensors in the unsharded buffer.
  kUnsharded,
};

/// Where a unit is in the training iteration (FSDP2's TrainingState). Transitions, each checked:
///   kIdle -> kForward            begin_iteration (the root's first forward with grad, or a backward
///                                through a graph whose iteration ended)
///   kForward -> kPreBackward     the first hook on the unit's outputs in backward (prefetch here)
///   kPreBackward -> kPostBackward the gradients are reduced (or accumulated while sync is off)
///   kPostBackward -> kForward    the unit runs forward again in the same iteration
///   kPostBackward -> kPreBackward its outputs are backpropagated again (a unit used twice)
///   any -> kIdle                 end_iteration
/// Unlike FSDP2's FORWARD, kForward lasts from the unit's forward until backward reaches it: what
/// matters here is that its gradients are still to be reduced.
enum class TrainingState { kIdle, kForward, kPreBackward, kPostBackward };
const char* to_string(TrainingState state);

/// "[rank N] ": every engine error raised with a context at hand starts with it, since N ranks log
/// together.
std::string on_rank(const DistributedContext& context);

/// Note [overlapping reductions]
/// A unit's reduce-scatter (or NO_SHARD all-reduce) is issued asynchronously, so Gloo moves the bytes
/// while autograd computes the next units' gradients, as DDP overlaps its buckets. The tree keeps at
/// most two reductions in flight (their buffers are the extra memory) and finishes them in issue
/// order; the end of backward finishes the rest before the sharded gradients are put back.
/// Its input went back to the pool when it was issued, to be reused once the transport is done with
/// it (Note [a block returns after its last use], src/memory/buffer_pool.h).
struct PendingReduction {
  std::optional<CollectiveWork> work;
  at::Tensor output;
  /// The output is the pooled input itself (one shard), returned once the result is copied out.
  bool pooled_output = false;
  double post_divide = 1.0;
};

/// An all-gather in flight (FSDP2's all-gather result before copy-out): the unit's parameters still
/// point at their shards until wait_for_unshard copies the rows out and switches them. Its input row
/// is already back in the pool, like a reduction's.
struct PendingUnshard {
  CollectiveWork work;
  at::Tensor output;
  /// Gathered over the post-forward group (the rows are post-forward rows).
  bool post_forward = false;
};

/// Note [gradient flags]
/// Each reduce-scatter row carries, after the gradients, one flag per trainable parameter: 1 where
/// this rank had a gradient. After the reduction a flag is non-zero where any rank had one, and a
/// parameter that no rank had a gradient for must be left without one, as in single-process training
/// (every rank must agree, or the optimizers would step different parameters). Reading the flags is
/// a host read of device memory, a synchronization on a GPU: a unit keeps them on its device, OR-ed
/// over the iteration's reductions, and the root state reads every unit's flags at once at the end of
/// the iteration (one host read per step, none per unit).

class ParamGroup : public std::enable_shared_from_this<ParamGroup> {
 public:
  ParamGroup(std::vector<std::shared_ptr<torch::nn::Module>> modules, const DistributedContext& context,
             const FullyShardOptions& options, std::vector<FSDPParam> parameters);

  /// Builds the unit: shards every parameter in place (each rank keeps only its rows).
  void initialize();

  const std::vector<std::weak_ptr<torch::nn::Module>>& modules() const { return modules_; }
  std::vector<FSDPParam>& parameters() { return parameters_; }
  const std::vector<FSDPParam>& parameters() const { return parameters_; }
  const FullyShardOptions& options() const { return options_; }
  const DistributedContext& context() const { return context_; }
  /// The group that shards (size 1 for NO_SHARD) and the group that replicates (absent unless
  /// NO_SHARD or HYBRID_SHARD).
  int64_t shard_world_size() const { return shard_group_ ? shard_group_->size() : 1; }
  int64_t shard_rank() const { return shard_group_ ? shard_group_->rank() : 0; }
  const std::optional<ProcessGroup>& shard_group() const { return shard_group_; }
  const std::optional<ProcessGroup>& replicate_group() const { return replicate_group_; }
  /// How errors name the unit: its module path in the model (FSDP2's naming, "unit model.layers.3
  /// (LlamaDecoderLayerImpl)"), known once the root is (lazy_init or the first forward); before
  /// that, its modules' classes.
  std::string description() const;
  /// Set by the root state for every unit of its tree; "" is the root module itself.
  void set_module_path(std::string path) { module_path_ = std::move(path); }
  /// on_rank(context()): every engine error that a unit raises starts with it.
  std::string on_rank() const { return detail::on_rank(context_); }

  ShardedState sharded_state() const { return sharded_state_; }
  bool is_root() const { return is_root_; }
  void set_root(bool is_root) { is_root_ = is_root; }
  /// Whether forward frees the unsharded parameters, fully or to the post-forward group.
  bool reshard_after_forward() const;
  void set_reshard_after_forward(bool value) { reshard_after_forward_override_ = value; }
  /// The group that backward all-gathers over after an integer reshard_after_forward, when it is in
  /// effect (not overridden with a bool): Note [resharding after forward to a smaller group].
  const ProcessGroup* post_forward_group() const;
  /// Bytes of the post-forward row this rank holds now (0 unless kShardedPostForward).
  int64_t post_forward_bytes() const { return post_forward_row_.defined() ? post_forward_row_bytes_ : 0; }
  bool requires_gradient_sync() const { return requires_gradient_sync_; }
  void set_requires_gradient_sync(bool value) { requires_gradient_sync_ = value; }
  /// Bytes the unsharded buffer holds now (0 while sharded, or for units that never need one).
  int64_t unsharded_buffer_bytes() const;

  /// All-gathers the parameters (a no-op when already unsharded). With `async_op` the all-gather is
  /// only issued, so Gloo moves the bytes while the caller computes (prefetch); wait_for_unshard, or
  /// any use of the unit, completes it.
  void unshard(bool async_op = false);
  void wait_for_unshard();
  /// Points the parameters back at their shards and frees the unsharded buffer (after completing an
  /// all-gather in flight: every rank issued it, so every rank must finish it).
  void reshard();

  /// Explicit prefetch targets (FSDP2's set_modules_to_forward_prefetch / _backward_prefetch). When
  /// set they replace the implicit choice made by RootState for this unit.
  using PrefetchList = std::vector<std::weak_ptr<ParamGroup>>;
  void set_forward_prefetch(PrefetchList targets) { forward_prefetch_ = std::move(targets); }
  void set_backward_prefetch(PrefetchList targets) { backward_prefetch_ = std::move(targets); }
  /// Unset unless set explicitly.
  const std::optional<PrefetchList>& forward_prefetch() const { return forward_prefetch_; }
  const std::optional<PrefetchList>& backward_prefetch() const { return backward_prefetch_; }
  /// Indices of this unit's post-forwards in the tree's post-forward order; the default backward
  /// prefetch pops the last one (FSDP2's _post_forward_indices).
  std::vector<size_t>& post_forward_indices() { return post_forward_indices_; }

  // Training-iteration protocol. The root state (module_state.h) drives it from its hooks and calls
  // the unit, never the reverse: a unit knows nothing of its tree.
  /// Issues this unit's all-gather, then the prefetches `targets`, then waits for its own.
  void pre_forward(bool grad_enabled, const std::vector<std::shared_ptr<ParamGroup>>& prefetch_targets);
  void post_forward();
  /// Whether this backward has not prefetched yet: the unit's outputs each carry a hook, and only
  /// the first of them prefetches.
  bool backward_prefetch_pending() const { return training_state_ != TrainingState::kPreBackward; }
  /// Issues this unit's all-gather, then (the first time in this backward) the prefetches
  /// `targets`, then waits for its own.
  void pre_backward(const std::vector<std::shared_ptr<ParamGroup>>& prefetch_targets);
  /// A forward input of this unit was wrapped; its gradient will report through on_input_gradient.
  void expect_input_gradient() { ++pending_input_gradients_; }
  /// The gradient of one wrapped input arrived: the unit's backward for it is complete. True when
  /// every wrapped input has reported: the unit's gradients are due for reduction (FSDP2's
  /// post-backward trigger).
  bool on_input_gradient();
  /// Takes the gradients, reshards, issues the all-gathers of `prefetch_targets` (BACKWARD_POST),
  /// then reduces the gradients (or accumulates them while sync is off); the reduction may still be
  /// in flight when it returns (see the note above), which the caller then tracks.
  void post_backward(const std::vector<std::shared_ptr<ParamGroup>>& prefetch_targets = {});
  bool has_reduction_in_flight() const { return reduction_in_flight_.has_value(); }
  bool has_unshard_in_flight() const { return unshard_in_flight_.has_value(); }
  /// Whether unshard() would issue an all-gather now (sharded, none in flight, more than one shard).
  bool needs_all_gather() const {
    return sharded_state_ != ShardedState::kUnsharded && !unshard_in_flight_ && !unshard_is_identity_ &&
           shard_world_size() > 1;
  }
  /// Waits for this unit's reduction in flight, if any, and adds its result to the sharded gradients.
  void finish_reduction();
  /// Whether the end-of-backward callback must still reduce this unit: it was used since its last
  /// reduction, or it was not reduced at all this iteration (every rank reduces every unit).
  bool needs_post_backward() const {
    return training_state_ != TrainingState::kIdle && training_state_ != TrainingState::kPostBackward;
  }
  TrainingState training_state() const { return training_state_; }
  void begin_iteration();
  /// "FSDP unit model.layers.3 (Block), iteration 12, FORWARD": what its collectives are for.
  std::string activity_text() const;
  /// Whether any rank had a gradient, per trainable parameter, over this iteration's reductions
  /// (undefined before the first): Note [gradient flags].
  const at::Tensor& gradient_flags() const { return gradient_flags_; }
  /// Reshards and puts the sharded gradients back; `had_gradient` is gradient_flags() read on the
  /// host (null when the unit reduced nothing). With `check`, a gradient written on a sharded
  /// parameter (a unit called without fsdp::forward) is reported after the state is restored.
  void end_iteration(const bool* had_gradient, bool check = true);
  /// The device the unit computes on: where its unsharded parameters, its collective buffers and its
  /// collectives live. Its parameters' device, or with cpu_offload default_device(local rank).
  c10::Device device() const { return device_; }
  /// Where the sharded parameters, their gradients and so the optimizer step live: device(), or host
  /// memory under cpu_offload.
  c10::Device storage_device() const { return storage_device_; }

 private:
  /// Keeps this rank's post-forward row and frees the unsharded buffer (kShardedPostForward).
  void reshard_to_post_forward();
  /// Which parameters take part in gradient reduction (those that require grad now) and where.
  void refresh_trainable_parameters();
  /// Issues the reduction of `unsharded_gradients` (one per parameter, undefined where none).
  void reduce_gradients(const std::vector<at::Tensor>& unsharded_gradients);

  std::vector<std::weak_ptr<torch::nn::Module>> modules_;
  DistributedContext context_;
  FullyShardOptions options_;
  std::vector<FSDPParam> parameters_;
  std::optional<ProcessGroup> shard_group_;
  std::optional<ProcessGroup> replicate_group_;
  /// An integer reshard_after_forward between 1 and the shard size: its group and the unit's row in
  /// it, shard_size / group size padded shards of every parameter (Note [resharding after forward
  /// to a smaller group]).
  std::optional<ProcessGroup> post_forward_group_;
  int64_t post_forward_row_bytes_ = 0;
  at::Tensor post_forward_row_;
  /// True when unsharding changes nothing (one shard, no dtype cast): parameters keep their data.
  bool unshard_is_identity_ = false;
  int64_t all_gather_row_bytes_ = 0;
  int64_t unsharded_buffer_bytes_ = 0;
  int64_t reduce_row_numel_ = 0;
  int64_t trainable_count_ = 0;
  std::optional<c10::ScalarType> reduce_dtype_;
  /// uint8 buffer whose storage is freed while sharded (see the note above).
  at::Tensor unsharded_buffer_;
  ShardedState sharded_state_ = ShardedState::kSharded;
  c10::Device device_{c10::kCPU};
  c10::Device storage_device_{c10::kCPU};
  /// cpu_offload with a GPU to compute on: shards and gradients cross between host and device.
  bool offloaded_ = false;
  at::Tensor gradient_flags_;
  bool is_root_ = false;
  std::optional<bool> reshard_after_forward_override_;
  bool requires_gradient_sync_ = true;
  std::optional<std::string> module_path_;

  TrainingState training_state_ = TrainingState::kIdle;
  /// Training iterations this unit has begun (1 during the first), named in collective failures.
  int64_t iterations_ = 0;
  int64_t pending_input_gradients_ = 0;
  std::optional<PendingReduction> reduction_in_flight_;
  std::optional<PendingUnshard> unshard_in_flight_;
  std::optional<PrefetchList> forward_prefetch_;
  std::optional<PrefetchList> backward_prefetch_;
  std::vector<size_t> post_forward_indices_;
};

}  // namespace fsdp::detail
