#include <fsdp/shard_layout.h>
#include <gtest/gtest.h>

#include "harness/error_message.h"

namespace fsdp {
namespace {

std::vector<int64_t> owned_rows(const std::vector<int64_t>& sizes, int64_t world_size) {
  std::vector<int64_t> rows;
  for (int64_t rank = 0; rank < world_size; ++rank) rows.push_back(shard_layout(sizes, world_size, rank).owned_rows);
  return rows;
}

TEST(ShardLayout, FollowsTorchChunkNotABalancedSplit) {
  EXPECT_EQ(owned_rows({5}, 4), (std::vector<int64_t>{2, 2, 1, 0}));
  EXPECT_EQ(owned_rows({4}, 3), (std::vector<int64_t>{2, 2, 0}));
  EXPECT_EQ(owned_rows({10}, 4), (std::vector<int64_t>{3, 3, 3, 1}));
  EXPECT_EQ(owned_rows({2, 7}, 4), (std::vector<int64_t>{1, 1, 0, 0}));
  EXPECT_EQ(owned_rows({0, 3}, 2), (std::vector<int64_t>{0, 0}));
}

TEST(ShardLayout, DescribesOffsetsPaddingAndShapes) {
  auto layout = shard_layout({5, 3}, 4, 2);
  EXPECT_EQ(layout.rows, 5);
  EXPECT_EQ(layout.row_numel, 3);
  EXPECT_EQ(layout.rows_per_shard, 2);
  EXPECT_EQ(layout.row_offset, 4);
  EXPECT_EQ(layout.owned_rows, 1);
  EXPECT_EQ(layout.numel_padded_shard, 6);
  EXPECT_EQ(layout.numel_owned, 3);
  EXPECT_EQ(layout.element_offset(), 12);
  EXPECT_EQ(layout.sharded_sizes, (std::vector<int64_t>{1, 3}));
  EXPECT_EQ(layout.numel_unsharded(), 15);

  auto empty = shard_layout({5, 3}, 4, 3);
  EXPECT_EQ(empty.row_offset, 5);
  EXPECT_EQ(empty.owned_rows, 0);
  EXPECT_EQ(empty.sharded_sizes, (std::vector<int64_t>{0, 3}));
  EXPECT_EQ(empty.numel_padded_shard, 6);
}

TEST(ShardLayout, TreatsAScalarAsOneRow) {
  auto first = shard_layout({}, 3, 0);
  EXPECT_EQ(first.rows, 1);
  EXPECT_EQ(first.owned_rows, 1);
  EXPECT_EQ(first.sharded_sizes, (std::vector<int64_t>{1}));
  EXPECT_EQ(shard_layout({}, 3, 1).owned_rows, 0);
  EXPECT_EQ(shard_layout({}, 3, 1).sharded_sizes, (std::vector<int64_t>{0}));
  EXPECT_TRUE(shard_layout({}, 1, 0).sharded_sizes.empty());
}

TEST(ShardLayout, FlatLayoutPlacesPaddedShardsBackToBack) {
  auto flat = flat_shard_layout({shard_layout({5, 3}, 2, 0), shard_layout({7}, 2, 0), shard_layout({1}, 2, 1)});
  EXPECT_EQ(flat.offsets, (std::vector<int64_t>{0, 9, 13}));
  EXPECT_EQ(flat.numel, 14);
}

TEST(ShardLayout, PreDivideFactorMatchesFsdp) {
  EXPECT_EQ(gradient_pre_divide_factor(1), 1.0);
  EXPECT_EQ(gradient_pre_divide_factor(2), 2.0);
  EXPECT_EQ(gradient_pre_divide_factor(3), 2.0);
  EXPECT_EQ(gradient_pre_divide_factor(6), 4.0);  // post-divide 1.5, as FSDP
  EXPECT_EQ(gradient_pre_divide_factor(8), 4.0);
  EXPECT_EQ(gradient_pre_divide_factor(16), 4.0);
  EXPECT_EQ(gradient_pre_divide_factor(64), 8.0);
}

TEST(ShardLayout, RejectsBadArguments) {
  auto message = testing::error_message_of([] { shard_layout({4}, 2, 2); });
  EXPECT_NE(message.find("rank 2 is outside a world of 2 ranks"), std::string::npos) << message;
  message = testing::error_message_of([] { rows_per_shard(4, 0); });
  EXPECT_NE(message.find("world_size must be at least 1"), std::string::npos) << message;
}

// Every rank's rows, as a reduce-scatter's input needs them: torch.chunk of 5 rows over 4 ranks
// gives 2, 2, 1 and none; each agrees with that rank's own ShardLayout.
TEST(ShardLayout, OwnedRowsOfEveryRankFollowTorchChunk) {
  const std::vector<std::pair<int64_t, int64_t>> expected = {{0, 2}, {2, 2}, {4, 1}, {5, 0}};
  for (int64_t rank = 0; rank < 4; ++rank) {
    const auto owned = fsdp::owned_rows(5, rows_per_shard(5, 4), rank);
    EXPECT_EQ(owned.first, expected[rank].first) << rank;
    EXPECT_EQ(owned.count, expected[rank].second) << rank;
    const auto layout = shard_layout({5, 3}, 4, rank);
    EXPECT_EQ(layout.row_offset, owned.first);
    EXPECT_EQ(layout.owned_rows, owned.count);
  }
}

}  // namespace
}  // namespace fsdp
