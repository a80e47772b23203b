// One parameter managed by a unit (FSDP2's FSDPParam): how it is sharded, and the switch of the
// registered parameter between its shard and its full view. Knows nothing of its unit, its tree or
// any collective; the unit (param_group.h) packs many of these into one all-gather and one
// reduce-scatter through the copy-in/copy-out functions of fsdp_collectives.h.
#pragma once

#include <ATen/core/Tensor.h>
#include <fsdp/shard_layout.h>

#include <optional>
#include <string>

namespace fsdp::detail {

struct FSDPParam {
  /// Name relative to the unit's first module, e.g. "fc1.weight".
  std::string name;
  /// The registered parameter. Its identity never changes; its data is set to one of the views below
  /// (Note [storage, not tensors, is what gets freed], param_group.h).
  at::Tensor parameter;
  c10::ScalarType original_dtype = c10::kFloat;
  /// dtype of the unsharded parameter (the mixed-precision param_dtype for floating parameters).
  c10::ScalarType compute_dtype = c10::kFloat;
  bool requires_grad = false;
  ShardLayout layout;
  /// This rank's rows, zero-padded to layout.numel_padded_shard, original dtype (1-D, own storage).
  at::Tensor sharded_padded;
  /// The unpadded view of sharded_padded with layout.sharded_sizes: the parameter's data at rest.
  at::Tensor sharded_data;
  /// The full tensor, a view into the unit's unsharded buffer (or of sharded_padded when unsharding
  /// changes nothing).
  at::Tensor unsharded_data;
  /// Byte offset of this parameter's padded shard in one rank's all-gather row.
  int64_t all_gather_offset_bytes = 0;
  /// Byte offset of this parameter's post-forward shard (N/k padded shards) in one rank's row of the
  /// post-forward all-gather: Note [resharding after forward to a smaller group], param_group.h.
  int64_t post_forward_offset_bytes = 0;
  /// Byte offset of this parameter's region (N padded shards) in the unsharded buffer.
  int64_t unsharded_offset_bytes = 0;
  /// Element offset of this parameter's padded shard in one reduce-scatter row (trainable only).
  int64_t reduce_offset = 0;

  /// Per-iteration state.
  at::Tensor stashed_sharded_gradient;
  bool gradient_stashed = false;
  /// Whether the parameter had a (sharded) gradient when the iteration began: if no rank produces
  /// one during it, that is what it is left with (Note [gradient flags], param_group.h).
  bool had_gradient_before_iteration = false;
  /// Gradients summed over micro-steps while gradient sync is off, in the reduce dtype, full shape.
  at::Tensor unsharded_accumulated_gradient;

  /// Shards the parameter in place (FSDP2's init_sharded_param): this rank's rows of the full tensor
  /// go into `sharded_padded` and the parameter's data becomes `sharded_data`, releasing the full
  /// tensor. A parameter without memory (a released storage: this build's meta device) gets a zero
  /// shard that a state-dict load fills.
  /// With `offload_pin_memory` set the shard is kept in host memory (pinned when true and a GPU is
  /// present: cpu_offload), wherever the parameter was.
  void init_sharded(int64_t shard_size, int64_t shard_rank, const std::optional<c10::ScalarType>& param_dtype,
                    std::optional<bool> offload_pin_memory = std::nullopt);
  /// Bytes of this parameter's padded shard in the compute dtype: its width in an all-gather row.
  int64_t padded_shard_bytes() const;
  /// Points the registered parameter at its shard (FSDP2's to_sharded).
  void to_sharded() { parameter.set_data(sharded_data); }
  /// Points the registered parameter at its full view (FSDP2's to_unsharded).
  void to_unsharded() { parameter.set_data(unsharded_data); }
};

}  // namespace fsdp::detail
