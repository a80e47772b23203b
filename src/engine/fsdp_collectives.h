// Copy-in and copy-out around a unit's two collectives (FSDP2's _fsdp_collectives: foreach_all_gather,
// foreach_all_gather_copy_out, foreach_reduce): free functions between a unit's parameters and the
// flat buffers that src/dist's collectives move. No collective is issued here and nothing waits, so
// the same functions serve any device; the unit decides when to call them and owns the buffers.
#pragma once

#include <ATen/core/Tensor.h>

#include <vector>

#include "engine/fsdp_param.h"

namespace fsdp::detail {

/// All-gather copy-in: each parameter's padded shard, cast to its compute dtype, at its
/// all_gather_offset_bytes in `row` (uint8, one rank's row).
void all_gather_copy_in(const std::vector<FSDPParam>& parameters, const at::Tensor& row);

/// All-gather copy-out: `rows` (uint8, shard_size rows of the row width) holds every rank's row;
/// each parameter's region of `unsharded` (uint8, at unsharded_offset_bytes) becomes its full
/// tensor, dim 0 padded, rank r's shard at r.
void all_gather_copy_out(const at::Tensor& rows, int64_t shard_size, const std::vector<FSDPParam>& parameters,
                         const at::Tensor& unsharded);

/// Post-forward copy-in (Note [resharding after forward to a smaller group], param_group.h): each
/// parameter's post-forward shard, the `factor` consecutive padded shards from shard `first_shard`
/// of its region of `unsharded`, at its post_forward_offset_bytes in `row` (uint8, one rank's row).
void post_forward_copy_in(const std::vector<FSDPParam>& parameters, const at::Tensor& unsharded, int64_t first_shard,
                          int64_t factor, const at::Tensor& row);

/// Post-forward copy-out: `rows` (uint8, group_size rows) holds the post-forward rows of a group;
/// each parameter's region of `unsharded` becomes its full tensor again, row g's shards at g * factor.
void post_forward_copy_out(const at::Tensor& rows, int64_t group_size, int64_t factor,
                           const std::vector<FSDPParam>& parameters, const at::Tensor& unsharded);

/// Reduce-scatter copy-in: `rows` ([shard_size, row_numel] of the reduce dtype, zeroed) gets, in row
/// r, rank r's rows of every trainable parameter's full gradient at its reduce_offset, and the flag
/// columns from `flags_offset` (one per trainable parameter, in order) 1 where this rank has a
/// gradient (Note [gradient flags], param_group.h). `gradients[i]` belongs to `parameters[i]`;
/// undefined where there is none.
void reduce_scatter_copy_in(const std::vector<FSDPParam>& parameters, const std::vector<at::Tensor>& gradients,
                            int64_t flags_offset, const at::Tensor& rows);

/// Reduce-scatter copy-out: each trainable parameter's sharded gradient from the reduced `row`, as an
/// own tensor of its original dtype (optimizers detach_() and zero_() gradients, so never a view of
/// the buffer). One entry per trainable parameter, in order.
std::vector<at::Tensor> reduce_scatter_copy_out(const std::vector<FSDPParam>& parameters, const at::Tensor& row);

}  // namespace fsdp::detail
