// Shard math: where each rank's piece of a tensor lives. Pure functions, no communication.
//
// FSDP shards every parameter on dim 0 with torch.chunk semantics (FSDPParam._init_sharded_param): each rank owns
// ceil(D / N) rows except that trailing ranks may own fewer or none (D = 4 over N = 3 ranks is
// 2, 2, 0, not 2, 1, 1), and every rank stores its rows zero-padded to ceil(D / N) rows so that a
// collective sees N equal shards. Checkpoint offsets (DCP, SHARDED_STATE_DICT) use the same rule,
// so this file is the single definition of "which rows does rank r hold".
#pragma once
#include <cstdint>
#include <vector>

namespace fsdp {

/// One rank's piece of a tensor sharded on dim 0. A 0-dim tensor is treated as one row of one element
/// (its shard is 1-D, of one or zero elements, unless there is only one rank).
struct ShardLayout {
  /// The full tensor's shape.
  std::vector<int64_t> unsharded_sizes;
  /// Rows on dim 0 of the full tensor (1 for a 0-dim tensor).
  int64_t rows = 0;
  /// Elements in one row (the product of the sizes after dim 0).
  int64_t row_numel = 1;
  /// ceil(rows / N): rows every rank stores, padding included.
  int64_t rows_per_shard = 0;
  /// First row this rank owns (may equal `rows` when it owns none).
  int64_t row_offset = 0;
  /// Rows this rank owns: rows_per_shard, fewer on the last owning rank, 0 after it.
  int64_t owned_rows = 0;
  /// rows_per_shard * row_numel: the size of every rank's padded shard.
  int64_t numel_padded_shard = 0;
  /// owned_rows * row_numel.
  int64_t numel_owned = 0;
  /// The shape of the unpadded local shard: owned_rows followed by the sizes after dim 0.
  std::vector<int64_t> sharded_sizes;
  /// Element offset of the owned rows inside the flattened full tensor.
  int64_t element_offset() const { return row_offset * row_numel; }
  /// Elements of the full tensor.
  int64_t numel_unsharded() const { return rows * row_numel; }
};

/// ceil(rows / world_size); 0 rows gives 0.
int64_t rows_per_shard(int64_t rows, int64_t world_size);

/// The rows of dim 0 that one rank owns: [first, first + count).
struct OwnedRows {
  int64_t first = 0;
  int64_t count = 0;
};
/// The rows `rank` owns of `rows` when every rank holds `rows_per_shard` (torch.chunk semantics:
/// the last owning rank may own fewer, later ranks none). ShardLayout's row_offset and owned_rows
/// are this for its own rank; code that needs every rank's piece (a reduce-scatter's input) asks here.
OwnedRows owned_rows(int64_t rows, int64_t rows_per_shard, int64_t rank);

/// The piece of a tensor of shape `sizes` that `rank` of `world_size` holds.
ShardLayout shard_layout(const std::vector<int64_t>& sizes, int64_t world_size, int64_t rank);

/// Where consecutive padded shards of several tensors sit in one flat buffer: the layout of one
/// FSDP unit's all-gather input and reduce-scatter output row.
struct FlatShardLayout {
  /// offsets[i]: first element of tensor i's padded shard.
  std::vector<int64_t> offsets;
  /// Sum of every tensor's numel_padded_shard.
  int64_t numel = 0;
};
FlatShardLayout flat_shard_layout(const std::vector<ShardLayout>& layouts);

/// FSDP1's gradient pre-divide factor for `world_size` ranks: a power of two near
/// sqrt(world_size), so sum-reductions in low precision cannot overflow; the post-divide factor is
/// world_size / pre (1.5 for 3 and 6 ranks). (1 -> 1, 2 -> 2, 3 -> 2, 4 -> 2, 6 -> 4, 8 -> 4, 16 -> 4.)
double gradient_pre_divide_factor(int64_t world_size);

}  // namespace fsdp
