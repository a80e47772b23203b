#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <fsdp/fully_shard_options.h>

namespace fsdp {

namespace {

void check_floating(const std::optional<c10::ScalarType>& dtype, const char* field) {
  TORCH_CHECK(!dtype || at::isFloatingType(*dtype), "FullyShardOptions.mp_policy.", field,
              " must be a floating dtype (float32, bfloat16, float16, float64), got ", *dtype);
}

}  // namespace

void validate(const FullyShardOptions& options) {
  check_floating(options.mp_policy.param_dtype, "param_dtype");
  check_floating(options.mp_policy.reduce_dtype, "reduce_dtype");
  check_floating(options.mp_policy.output_dtype, "output_dtype");
  check_floating(options.mp_policy.buffer_dtype, "buffer_dtype");
  for (size_t index = 0; index < options.ignored_params.size(); ++index) {
    TORCH_CHECK(options.ignored_params[index].defined(), "FullyShardOptions.ignored_params[", index,
                "] is an undefined tensor; pass the module's parameter tensors");
  }
  TORCH_CHECK(!options.fsdp1.max_all_gathers_in_flight || *options.fsdp1.max_all_gathers_in_flight >= 1,
              "FullyShardOptions.fsdp1.max_all_gathers_in_flight must be at least 1 (a unit's own all-gather), got ",
              *options.fsdp1.max_all_gathers_in_flight, "; leave it unset for no limit");
}

}  // namespace fsdp
