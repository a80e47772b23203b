#include <fsdp/sharding_options.h>

#include <c10/util/Exception.h>

namespace fsdp {

const char* to_string(ShardingStrategy strategy) {
  switch (strategy) {
    case ShardingStrategy::kFullShard:
      return "FULL_SHARD";
    case ShardingStrategy::kShardGradOp:
      return "SHARD_GRAD_OP";
    case ShardingStrategy::kNoShard:
      return "NO_SHARD";
    case ShardingStrategy::kHybridShard:
      return "HYBRID_SHARD";
    case ShardingStrategy::kHybridShardZero2:
      return "HYBRID_SHARD_ZERO2";
  }
  TORCH_INTERNAL_ASSERT(false, "ShardingStrategy ", static_cast<int>(strategy), " has no name");
}

bool reshards_after_forward(ShardingStrategy strategy) {
  return strategy == ShardingStrategy::kFullShard || strategy == ShardingStrategy::kHybridShard;
}

bool MixedPrecisionPolicy::operator==(const MixedPrecisionPolicy& other) const {
  return param_dtype == other.param_dtype && reduce_dtype == other.reduce_dtype && buffer_dtype == other.buffer_dtype &&
         output_dtype == other.output_dtype && cast_forward_inputs == other.cast_forward_inputs;
}

}  // namespace fsdp
