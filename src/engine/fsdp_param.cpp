#include "engine/fsdp_param.h"

#include <ATen/ATen.h>

#include "memory/device.h"

namespace fsdp::detail {

void FSDPParam::init_sharded(int64_t shard_size, int64_t shard_rank, const std::optional<c10::ScalarType>& param_dtype,
                             std::optional<bool> offload_pin_memory) {
  auto full = parameter.detach();
  original_dtype = full.scalar_type();
  compute_dtype = param_dtype && at::isFloatingType(original_dtype) ? *param_dtype : original_dtype;
  layout = shard_layout(full.sizes().vec(), shard_size, shard_rank);
  if (offload_pin_memory) {
    // cpu_offload: the shard lives in host memory (page-locked where a GPU can copy it
    // asynchronously), wherever the full parameter was.
    sharded_padded = empty_host({layout.numel_padded_shard}, original_dtype, *offload_pin_memory).zero_();
  } else {
    sharded_padded = at::zeros({layout.numel_padded_shard}, full.options());
  }
  const bool has_data = full.numel() == 0 || full.storage().nbytes() > 0;
  if (layout.numel_owned > 0 && has_data) {
    sharded_padded.narrow(0, 0, layout.numel_owned)
        .copy_(full.reshape({-1}).narrow(0, layout.element_offset(), layout.numel_owned));
  }
  sharded_data = sharded_padded.narrow(0, 0, layout.numel_owned).view(layout.sharded_sizes);
  // The full tensor is released here: the parameter now owns only its shard.
  to_sharded();
}

int64_t FSDPParam::padded_shard_bytes() const {
  return layout.numel_padded_shard * static_cast<int64_t>(c10::elementSize(compute_dtype));
}

}  // namespace fsdp::detail
