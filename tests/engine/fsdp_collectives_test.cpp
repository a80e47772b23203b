// FSDPParam's sharding and the copy-in/copy-out around a unit's collectives, on N simulated ranks in
// one process: the collectives themselves are replaced by their definitions (concatenate the rows;
// sum the rows), so these pure functions are checked without a process group.
#include "engine/fsdp_collectives.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include "engine/fsdp_param.h"

namespace fsdp::detail {
namespace {

constexpr int64_t kAlign = 16;
int64_t align_up(int64_t bytes) { return (bytes + kAlign - 1) / kAlign * kAlign; }

// Shapes whose dim 0 does not divide evenly, one smaller than the rank count, and a scalar.
std::vector<at::Tensor> full_tensors() {
  torch::manual_seed(3);
  return {torch::randn({5, 3}), torch::randn({2}), torch::randn({7, 2, 2}), torch::randn({})};
}

// Rank `rank`'s parameters, sharded over `shard_size`, with the offsets a unit gives them.
std::vector<FSDPParam> sharded_on_rank(int64_t shard_size, int64_t rank, std::optional<c10::ScalarType> param_dtype,
                                       int64_t* row_bytes, int64_t* unsharded_bytes) {
  std::vector<FSDPParam> parameters;
  int64_t all_gather = 0;
  int64_t unsharded = 0;
  for (const auto& full : full_tensors()) {
    FSDPParam parameter;
    parameter.name = "p";
    parameter.name += std::to_string(parameters.size());
    parameter.parameter = full.clone().requires_grad_(true);
    parameter.requires_grad = true;
    const auto* identity = parameter.parameter.unsafeGetTensorImpl();
    parameter.init_sharded(shard_size, rank, param_dtype);
    EXPECT_EQ(parameter.parameter.unsafeGetTensorImpl(), identity) << "the registered parameter keeps its identity";
    parameter.all_gather_offset_bytes = all_gather;
    all_gather = align_up(all_gather + parameter.padded_shard_bytes());
    parameter.unsharded_offset_bytes = unsharded;
    unsharded = align_up(unsharded + shard_size * parameter.padded_shard_bytes());
    parameters.push_back(std::move(parameter));
  }
  *row_bytes = all_gather;
  *unsharded_bytes = unsharded;
  return parameters;
}

class CopyInCopyOut : public ::testing::TestWithParam<int> {};

TEST_P(CopyInCopyOut, ShardingKeepsThisRanksRowsAndTheParameterPointsAtThem) {
  const int64_t shard_size = GetParam();
  const auto fulls = full_tensors();
  for (int64_t rank = 0; rank < shard_size; ++rank) {
    int64_t row_bytes = 0;
    int64_t unsharded_bytes = 0;
    auto parameters = sharded_on_rank(shard_size, rank, std::nullopt, &row_bytes, &unsharded_bytes);
    for (size_t index = 0; index < parameters.size(); ++index) {
      const auto& parameter = parameters[index];
      const auto& layout = parameter.layout;
      auto expected = fulls[index].reshape({-1}).narrow(0, layout.element_offset(), layout.numel_owned);
      EXPECT_TRUE(parameter.sharded_data.reshape({-1}).equal(expected)) << parameter.name << " rank " << rank;
      EXPECT_TRUE(parameter.parameter.detach().reshape({-1}).equal(expected)) << parameter.name;
      EXPECT_EQ(parameter.sharded_padded.numel(), layout.numel_padded_shard);
      // The padding is zeros, so padded rows add nothing to a reduction.
      EXPECT_EQ(parameter.sharded_padded.narrow(0, layout.numel_owned, layout.numel_padded_shard - layout.numel_owned)
                    .count_nonzero()
                    .item<int64_t>(),
                0);
    }
  }
}

TEST_P(CopyInCopyOut, AllGatherRowsRebuildEveryFullTensorInTheComputeDtype) {
  const int64_t shard_size = GetParam();
  const auto fulls = full_tensors();
  for (auto dtype : {std::optional<c10::ScalarType>(), std::optional<c10::ScalarType>(at::kBFloat16)}) {
    int64_t row_bytes = 0;
    int64_t unsharded_bytes = 0;
    std::vector<std::vector<FSDPParam>> ranks;
    for (int64_t rank = 0; rank < shard_size; ++rank) {
      ranks.push_back(sharded_on_rank(shard_size, rank, dtype, &row_bytes, &unsharded_bytes));
    }
    // The all-gather, by definition: rank r's row at r.
    auto rows = at::zeros({shard_size * row_bytes}, at::kByte);
    for (int64_t rank = 0; rank < shard_size; ++rank) {
      all_gather_copy_in(ranks[rank], rows.narrow(0, rank * row_bytes, row_bytes));
    }
    auto unsharded = at::zeros({unsharded_bytes}, at::kByte);
    all_gather_copy_out(rows, shard_size, ranks[0], unsharded);
    for (size_t index = 0; index < fulls.size(); ++index) {
      const auto& parameter = ranks[0][index];
      const auto numel = parameter.layout.numel_unsharded();
      auto rebuilt =
          unsharded.narrow(0, parameter.unsharded_offset_bytes, numel * c10::elementSize(parameter.compute_dtype))
              .view(parameter.compute_dtype)
              .view(parameter.layout.unsharded_sizes);
      EXPECT_EQ(parameter.compute_dtype, dtype.value_or(at::kFloat));
      EXPECT_TRUE(rebuilt.equal(fulls[index].to(parameter.compute_dtype))) << parameter.name << " N=" << shard_size;
    }
  }
}

TEST_P(CopyInCopyOut, ReduceScatterRowsGiveEachRankTheSumOfItsRowsAndTheFlags) {
  const int64_t shard_size = GetParam();
  const auto fulls = full_tensors();
  std::vector<std::vector<FSDPParam>> ranks;
  for (int64_t rank = 0; rank < shard_size; ++rank) {
    int64_t row_bytes = 0;
    int64_t unsharded_bytes = 0;
    ranks.push_back(sharded_on_rank(shard_size, rank, std::nullopt, &row_bytes, &unsharded_bytes));
  }
  // Reduce offsets as a unit gives them: the flat layout of the trainable parameters' shards.
  std::vector<ShardLayout> layouts;
  for (const auto& parameter : ranks[0]) layouts.push_back(parameter.layout);
  const auto flat = flat_shard_layout(layouts);
  const int64_t trainable = static_cast<int64_t>(fulls.size());
  const int64_t row_numel = flat.numel + trainable;
  for (auto& parameters : ranks) {
    for (size_t index = 0; index < parameters.size(); ++index) parameters[index].reduce_offset = flat.offsets[index];
  }
  // Rank r's gradient of parameter i is (r + 1) * full_i; parameter 1 has a gradient on rank 0 only.
  auto reduced = at::zeros({shard_size, row_numel});
  for (int64_t rank = 0; rank < shard_size; ++rank) {
    std::vector<at::Tensor> gradients;
    for (size_t index = 0; index < fulls.size(); ++index) {
      gradients.push_back(index == 1 && rank > 0 ? at::Tensor() : fulls[index] * (rank + 1));
    }
    auto rows = at::zeros({shard_size, row_numel});
    reduce_scatter_copy_in(ranks[rank], gradients, flat.numel, rows);
    reduced += rows;  // the reduce-scatter, by definition: row r of the sum goes to rank r
  }
  const double rank_sum = shard_size * (shard_size + 1) / 2.0;
  for (int64_t rank = 0; rank < shard_size; ++rank) {
    auto row = reduced[rank];
    const auto sharded = reduce_scatter_copy_out(ranks[rank], row);
    ASSERT_EQ(static_cast<int64_t>(sharded.size()), trainable);
    for (size_t index = 0; index < fulls.size(); ++index) {
      const auto& layout = ranks[rank][index].layout;
      auto expected = fulls[index].reshape({-1}).narrow(0, layout.element_offset(), layout.numel_owned) *
                      (index == 1 ? 1.0 : rank_sum);
      EXPECT_TRUE(torch::allclose(sharded[index].reshape({-1}), expected)) << "parameter " << index << " rank " << rank;
      EXPECT_EQ(sharded[index].sizes(), at::IntArrayRef(layout.sharded_sizes));
      EXPECT_FALSE(sharded[index].is_alias_of(row)) << "a gradient must be its own tensor";
      // The flag column counts the ranks that had a gradient.
      EXPECT_EQ(row[flat.numel + index].item<float>(), index == 1 ? 1.0F : static_cast<float>(shard_size));
    }
  }
}

INSTANTIATE_TEST_SUITE_P(ShardSizes, CopyInCopyOut, ::testing::Values(1, 2, 3, 4),
                         [](const ::testing::TestParamInfo<int>& info) {
                           std::string name = "N";  // appended: GCC 12 warns falsely on "N" + std::string
                           return name += std::to_string(info.param);
                         });

}  // namespace
}  // namespace fsdp::detail
