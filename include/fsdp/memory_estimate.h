// What a model costs each rank under fully_shard, before the job runs: `fsdp estimate-memory`.
//
// Note [estimating memory per rank]
// Pure arithmetic over the shapes of a model's units, with the engine's own shard math
// (shard_layout.h) and its own collectives, so the figures are what the engine allocates and sends,
// not a rule of thumb:
// - parameters, gradients and optimizer state: every parameter's padded shard (ceil(rows / S) rows,
//   S ranks in the shard group; NO_SHARD: S = 1) in the storage dtype, once each; the optimizer
//   keeps `states` more copies (AdamW's two moments);
// - unsharded parameters held at once, in the compute dtype: the units that stay unsharded after
//   forward (the root, which FSDP2 never reshards then, and Accelerate's tail) plus the largest
//   other unit, plus the next one when prefetch is on; with reshard_after_forward false
//   (SHARD_GRAD_OP) every unit stays unsharded until its backward, and an integer k keeps each
//   unit's 1/k row between forward and backward;
// - bytes each rank sends per step: every all-gather sends (S - 1) padded shards, every
//   reduce-scatter (S - 1), HYBRID_SHARD's all-reduce across R replicas 2 (R - 1) / R of a shard,
//   NO_SHARD's all-reduce 2 (N - 1) / N of the model; backward gathers again every unit that
//   resharded after forward (over k ranks for an integer k);
// - checkpoint bytes: SHARDED_STATE_DICT writes each rank's owned rows (not the padding) of the
//   parameters and the optimizer state, only on the first replica; FULL_STATE_DICT writes everything
//   on rank 0.
// The step's peak is the largest of three moments, each the model state plus what exists then:
// - the end of forward: the unsharded parameters held at once and the activations;
// - the reduction of the largest unit's gradients, in its post-backward (the root's, last, for a
//   Llama whose embedding and head are the root): the kept units' unsharded parameters (and the
//   unit's own, if it resharded), its unsharded gradients, and the reduce-scatter's input and
//   received rows in the reduce dtype; beside them, the blocks the pool kept from the unit reduced
//   before it (counted as the largest other unit's); the activations are gone by then for the root;
// - the optimizer step: the step's temporaries (libtorch's AdamW makes two the size of a
//   parameter's shard, one for exp_avg_sq's square root and one for its quotient; SGD one, for
//   weight decay), and the blocks the pool (src/memory/buffer_pool.h) keeps from the last unit
//   whose gradients were reduced: its unsharded parameters, reduce-scatter input and received rows
//   (NO_SHARD: the all-reduce's received rows). The pool keeps them for the next step's units;
//   freeing them when backward ends cost the next step their page faults (1-5 % of a 34 M model's
//   step, paired) and lowered no measured peak, which was one of the other two moments.
// The resident peak adds libtorch and the process itself (runtime_bytes): 150 MiB, what a job of a
// 0.7 M-parameter model peaks at per rank on CPU here (142-160 MiB at 2 to 8 ranks, torch 2.13),
// its code, thread stacks and allocator arenas; a GPU's CUDA context is not included. It holds for
// host memory with limit_retained_host_memory() (host_memory.h): with glibc's default thresholds,
// freed blocks of up to 32 MiB stay resident in the heap, an amount the model does not decide
// (bench/README.md, "Memory per rank: estimate and measured peak", has both).
// Activations depend on the model's forward and are not part of this estimate; the command adds a
// Llama-specific estimate and labels it so. The figures are validated against the engine's counters
// and against measured peak RSS by tests/cli/estimate_command_test.cpp.
#pragma once

#include <fsdp/sharding_options.h>
#include <torch/nn/module.h>

#include <algorithm>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace fsdp {

/// The optimizer whose state the estimate counts: how many tensors the size of a parameter's shard
/// it keeps per parameter.
enum class OptimizerKind {
  /// AdamW or Adam: exp_avg and exp_avg_sq.
  kAdamW,
  /// SGD with momentum: momentum_buffer.
  kSgdMomentum,
  /// Plain SGD: nothing.
  kSgd,
};

/// "adamw", "sgd-momentum", "sgd".
const char* to_string(OptimizerKind kind);
/// Parses "adamw" (and "adam"), "sgd-momentum", "sgd"; `what` names the setting in the error.
OptimizerKind parse_optimizer_kind(const std::string& text, const std::string& what);
/// State tensors per parameter: 2, 1 or 0.
int64_t optimizer_states_per_parameter(OptimizerKind kind);

/// The parameter shapes of one unit (what one fully_shard call owns).
struct UnitShape {
  /// The unit's module path ("model.layers.3"; several joined by "+"); the root's is "".
  std::string name;
  /// The shape of each parameter the unit owns.
  std::vector<std::vector<int64_t>> parameter_sizes;
  /// False for a unit that stays unsharded from its forward to its backward whatever the options
  /// say: the root (FSDP2 never reshards it after forward) and Accelerate's tail unit.
  bool reshard_after_forward = true;
};

/// The modules of one fully_shard call, in the order the model runs them.
struct UnitModules {
  std::vector<std::shared_ptr<torch::nn::Module>> modules;
  /// As UnitShape::reshard_after_forward. Default: true (the options decide).
  bool reshard_after_forward = true;
};

/// The shapes of `units` (each owning the parameters under its modules that no earlier unit owns)
/// and, last, of the root: `model`'s parameters outside every unit. A tied parameter counts once,
/// in the first unit that holds it. Works on a model built under MetaDeviceGuard (no memory).
std::vector<UnitShape> unit_shapes(const torch::nn::Module& model, const std::vector<UnitModules>& units);

/// How the job will run. One validation function: validate().
struct MemoryEstimateOptions {
  /// Ranks in the job. Default: 1.
  int64_t world_size = 1;
  /// Default: FULL_SHARD.
  ShardingStrategy sharding_strategy = ShardingStrategy::kFullShard;
  /// Ranks on one machine: HYBRID_SHARD shards over them and replicates across machines; the
  /// off-machine bytes are counted against it. Default: 0, meaning world_size (one machine).
  int64_t ranks_per_machine = 0;
  /// FSDP2's reshard_after_forward of every unit but the root (a bool or a group size that divides
  /// the shard group). Default: unset, the strategy's.
  std::optional<ReshardAfterForward> reshard_after_forward;
  /// Dtype the parameters are stored in; gradients and optimizer state have it too. Default: float32.
  c10::ScalarType storage_dtype = c10::kFloat;
  /// param_dtype (all-gathers, unsharded parameters) and reduce_dtype (reductions). Default: unset,
  /// the storage dtype.
  MixedPrecisionPolicy mixed_precision;
  /// Default: AdamW.
  OptimizerKind optimizer = OptimizerKind::kAdamW;
  /// Forward and backward prefetch of one unit ahead. Default: true (FSDP2's implicit prefetch).
  bool prefetch = true;

  /// Throws naming the field: world_size >= 1, ranks_per_machine dividing world_size, no group size
  /// with NO_SHARD, floating dtypes (a group size that does not divide the shard group is refused by
  /// estimate_memory, which knows the group).
  void validate() const;
};

/// Per rank, in bytes, for one training step. The largest rank's figure where ranks differ (rank 0
/// owns the most rows).
struct MemoryEstimate {
  int64_t parameters = 0;  ///< elements in the model (a tied weight once)
  int64_t units = 0;       ///< fully_shard units, the root included
  int64_t shard_group_size = 1;
  int64_t replicate_group_size = 1;
  int64_t parameter_bytes = 0;     ///< the rank's (padded) parameter shards
  int64_t gradient_bytes = 0;      ///< their gradients
  int64_t optimizer_bytes = 0;     ///< the optimizer's state
  int64_t largest_unit_bytes = 0;  ///< the largest unit, unsharded, in the compute dtype
  int64_t kept_unit_bytes = 0;     ///< the units that stay unsharded after forward (root, tail), unsharded
  int64_t unsharded_peak_bytes_without_prefetch = 0;  ///< unsharded parameters held at once, no prefetch
  int64_t unsharded_peak_bytes_with_prefetch = 0;     ///< the same with one unit prefetched
  int64_t unsharded_gradient_bytes = 0;   ///< the largest unit's unsharded gradients, reduce-scatter input and rows
  int64_t pooled_bytes_in_reduction = 0;  ///< the pool's blocks from the unit reduced before it
  int64_t reduction_bytes = 0;            ///< what its reduction adds to the model state (all of the above)
  int64_t bytes_sent_per_step = 0;        ///< what the rank sends per step
  int64_t bytes_sent_off_machine_per_step =
      0;                                 ///< of which to other machines (by the algorithms the engine's table takes)
  int64_t sharded_checkpoint_bytes = 0;  ///< SHARDED_STATE_DICT: model and optimizer, this rank's file(s)
  int64_t full_checkpoint_bytes = 0;     ///< FULL_STATE_DICT: model and optimizer, written by rank 0

  int64_t optimizer_step_temporary_bytes = 0;  ///< the optimizer step's own temporaries
  int64_t pooled_bytes_in_optimizer_step = 0;  ///< the pool's blocks kept from the last reduction
  int64_t runtime_bytes = 0;                   ///< libtorch and the process (CPU)

  int64_t model_state_bytes() const { return parameter_bytes + gradient_bytes + optimizer_bytes; }
  /// The training step's peak: model state plus the larger of the end of forward (the unsharded
  /// parameters held at once, prefetch as chosen, and `activation_bytes`) and the largest reduction.
  int64_t training_step_bytes(bool prefetch, int64_t activation_bytes) const;
  /// Model state plus the optimizer step's temporaries and the pool's kept blocks.
  int64_t optimizer_step_bytes() const {
    return model_state_bytes() + optimizer_step_temporary_bytes + pooled_bytes_in_optimizer_step;
  }
  /// What the process holds at its peak: the runtime plus the larger of the training step and the
  /// optimizer step.
  int64_t resident_peak_bytes(bool prefetch, int64_t activation_bytes) const {
    return runtime_bytes + std::max(training_step_bytes(prefetch, activation_bytes), optimizer_step_bytes());
  }
};

/// libtorch and the process on CPU, per rank (Note [estimating memory per rank]).
constexpr int64_t kRuntimeBytes = int64_t{150} << 20;

/// The estimate for `units` (from unit_shapes()) under `options`.
MemoryEstimate estimate_memory(const std::vector<UnitShape>& units, const MemoryEstimateOptions& options);

}  // namespace fsdp
