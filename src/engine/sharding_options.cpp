#include <c10/util/Exception.h>
#include <fsdp/sharding_options.h>

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

ReshardAfterForward::ReshardAfterForward(int64_t group_size) : group_size_(group_size) {
  TORCH_CHECK(group_size >= 1, "reshard_after_forward=", group_size,
              ": an integer must be a group size of at least 1 (1 keeps the parameters unsharded like false; the "
              "shard group's size frees them like true); set true, false or a divisor of the shard group's size");
}

int64_t ReshardAfterForward::group_size() const {
  TORCH_INTERNAL_ASSERT(group_size_, "reshard_after_forward=", to_string(), " is a bool, not a group size");
  return *group_size_;
}

bool ReshardAfterForward::reshards() const {
  TORCH_INTERNAL_ASSERT(!group_size_, "reshard_after_forward=", to_string(), " is a group size, not a bool");
  return reshard_;
}

int64_t ReshardAfterForward::post_forward_group_size(int64_t shard_size, const std::string& unit) const {
  if (!group_size_) return reshard_ ? shard_size : 1;
  TORCH_CHECK(*group_size_ <= shard_size && shard_size % *group_size_ == 0, unit,
              ": reshard_after_forward=", *group_size_, " must divide the size of the group that shards the unit, ",
              shard_size, " ranks (FSDP2 requires the same). Set a divisor of ", shard_size,
              " (typically the ranks per machine), true or false");
  return *group_size_;
}

std::string ReshardAfterForward::to_string() const {
  if (group_size_) return std::to_string(*group_size_);
  return reshard_ ? "true" : "false";
}

bool MixedPrecisionPolicy::operator==(const MixedPrecisionPolicy& other) const {
  return param_dtype == other.param_dtype && reduce_dtype == other.reduce_dtype && buffer_dtype == other.buffer_dtype &&
         output_dtype == other.output_dtype && cast_forward_inputs == other.cast_forward_inputs;
}

}  // namespace fsdp
