#include "engine/fsdp_collectives.h"

#include <ATen/ATen.h>

namespace fsdp::detail {

void all_gather_copy_in(const std::vector<FSDPParam>& parameters, const at::Tensor& row) {
  for (const auto& parameter : parameters) {
    row.narrow(0, parameter.all_gather_offset_bytes, parameter.padded_shard_bytes())
        .view(parameter.compute_dtype)
        .copy_(parameter.sharded_padded, /*non_blocking=*/row.device() != parameter.sharded_padded.device());
  }
}

namespace {

// Row r of `rows` holds, at each parameter's `offset` in it, `factor` consecutive padded shards of
// that parameter starting at shard r * factor; its region of `unsharded` becomes the dim-0-padded
// full tensor. The all-gather's copy-out is factor 1 (row r is rank r's shard).
void copy_rows_out(const at::Tensor& rows, int64_t row_count, int64_t factor, const std::vector<FSDPParam>& parameters,
                   int64_t FSDPParam::* offset, const at::Tensor& unsharded) {
  auto by_row = rows.view({row_count, -1});
  for (const auto& parameter : parameters) {
    const int64_t bytes = factor * parameter.padded_shard_bytes();
    if (bytes == 0) continue;
    unsharded.narrow(0, parameter.unsharded_offset_bytes, row_count * bytes)
        .view({row_count, bytes})
        .copy_(by_row.narrow(1, parameter.*offset, bytes));
  }
}

}  // namespace

void all_gather_copy_out(const at::Tensor& rows, int64_t shard_size, const std::vector<FSDPParam>& parameters,
                         const at::Tensor& unsharded) {
  copy_rows_out(rows, shard_size, 1, parameters, &FSDPParam::all_gather_offset_bytes, unsharded);
}

void post_forward_copy_in(const std::vector<FSDPParam>& parameters, const at::Tensor& unsharded, int64_t first_shard,
                          int64_t factor, const at::Tensor& row) {
  for (const auto& parameter : parameters) {
    const int64_t bytes = parameter.padded_shard_bytes();
    if (bytes == 0) continue;
    row.narrow(0, parameter.post_forward_offset_bytes, factor * bytes)
        .copy_(unsharded.narrow(0, parameter.unsharded_offset_bytes + first_shard * bytes, factor * bytes));
  }
}

void post_forward_copy_out(const at::Tensor& rows, int64_t group_size, int64_t factor,
                           const std::vector<FSDPParam>& parameters, const at::Tensor& unsharded) {
  copy_rows_out(rows, group_size, factor, parameters, &FSDPParam::post_forward_offset_bytes, unsharded);
}

void reduce_scatter_copy_in(const std::vector<FSDPParam>& parameters, const std::vector<at::Tensor>& gradients,
                            int64_t flags_offset, const at::Tensor& rows) {
  const int64_t shard_size = rows.size(0);
  int64_t trainable_index = 0;
  for (size_t index = 0; index < parameters.size(); ++index) {
    const auto& parameter = parameters[index];
    if (!parameter.requires_grad) continue;
    const int64_t flag_column = flags_offset + trainable_index++;
    if (!gradients[index].defined()) continue;
    rows.select(1, flag_column).fill_(1);
    auto flat = gradients[index].reshape({-1});
    const auto& layout = parameter.layout;
    for (int64_t rank = 0; rank < shard_size; ++rank) {
      const auto owned = owned_rows(layout.rows, layout.rows_per_shard, rank);
      const int64_t owned_numel = owned.count * layout.row_numel;
      if (owned_numel == 0) continue;
      rows.select(0, rank)
          .narrow(0, parameter.reduce_offset, owned_numel)
          .copy_(flat.narrow(0, owned.first * layout.row_numel, owned_numel));
    }
  }
}

std::vector<at::Tensor> reduce_scatter_copy_out(const std::vector<FSDPParam>& parameters, const at::Tensor& row) {
  std::vector<at::Tensor> sharded_gradients;
  for (const auto& parameter : parameters) {
    if (!parameter.requires_grad) continue;
    sharded_gradients.push_back(row.narrow(0, parameter.reduce_offset, parameter.layout.numel_owned)
                                    .view(parameter.layout.sharded_sizes)
                                    .to(parameter.original_dtype, /*non_blocking=*/false, /*copy=*/true));
  }
  return sharded_gradients;
}

}  // namespace fsdp::detail
