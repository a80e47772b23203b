#include <c10/util/Exception.h>
#include <fsdp/shard_layout.h>

#include <algorithm>

namespace fsdp {

int64_t rows_per_shard(int64_t rows, int64_t world_size) {
  TORCH_CHECK(world_size >= 1, "rows_per_shard: world_size must be at least 1, got ", world_size);
  TORCH_CHECK(rows >= 0, "rows_per_shard: rows must be non-negative, got ", rows);
  return (rows + world_size - 1) / world_size;
}

OwnedRows owned_rows(int64_t rows, int64_t rows_per_shard, int64_t rank) {
  OwnedRows owned;
  owned.first = std::min(rows, rank * rows_per_shard);
  owned.count = std::min(rows_per_shard, rows - owned.first);
  return owned;
}

ShardLayout shard_layout(const std::vector<int64_t>& sizes, int64_t world_size, int64_t rank) {
  TORCH_CHECK(rank >= 0 && rank < world_size, "shard_layout: rank ", rank, " is outside a world of ", world_size,
              " ranks");
  ShardLayout layout;
  layout.unsharded_sizes = sizes;
  layout.rows = sizes.empty() ? 1 : sizes[0];
  for (size_t dim = 1; dim < sizes.size(); ++dim) {
    TORCH_CHECK(sizes[dim] >= 0, "shard_layout: negative size in dim ", dim);
    layout.row_numel *= sizes[dim];
  }
  layout.rows_per_shard = rows_per_shard(layout.rows, world_size);
  const auto owned = owned_rows(layout.rows, layout.rows_per_shard, rank);
  layout.row_offset = owned.first;
  layout.owned_rows = owned.count;
  layout.numel_padded_shard = layout.rows_per_shard * layout.row_numel;
  layout.numel_owned = layout.owned_rows * layout.row_numel;
  if (sizes.empty()) {
    // One rank holds the scalar itself; over several ranks the owner holds a one-element shard.
    if (world_size > 1) layout.sharded_sizes = {layout.owned_rows};
  } else {
    layout.sharded_sizes = sizes;
    layout.sharded_sizes[0] = layout.owned_rows;
  }
  return layout;
}

FlatShardLayout flat_shard_layout(const std::vector<ShardLayout>& layouts) {
  FlatShardLayout flat;
  flat.offsets.reserve(layouts.size());
  for (const auto& layout : layouts) {
    flat.offsets.push_back(flat.numel);
    flat.numel += layout.numel_padded_shard;
  }
  return flat;
}

double gradient_pre_divide_factor(int64_t world_size) {
  TORCH_CHECK(world_size >= 1, "gradient_pre_divide_factor: world_size must be at least 1, got ", world_size);
  int64_t factor = 1;
  while (world_size % factor == 0 && world_size / factor > factor) factor *= 2;
  return static_cast<double>(factor);
}

}  // namespace fsdp
