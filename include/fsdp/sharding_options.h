// The vocabulary the sharding engine needs from a configuration: which ranks shard and which
// replicate, mixed precision and CPU offload. The engine (fully_shard.h) includes this header, and
// the plugin (plugin.h) includes it too to resolve a user's configuration into these values; the
// engine never sees the plugin.
#pragma once

#include <c10/core/ScalarType.h>

#include <cstdint>
#include <optional>
#include <string>

namespace fsdp {

/// torch.distributed.fsdp.ShardingStrategy; the numbers are torch's (digit strings map to them).
enum class ShardingStrategy {
  /// Shard parameters, gradients and optimizer state; reshard after forward (ZeRO-3).
  kFullShard = 1,
  /// Shard gradients and optimizer state; keep parameters unsharded between forward and backward (ZeRO-2).
  kShardGradOp = 2,
  /// Replicate everything; all-reduce gradients (DDP).
  kNoShard = 3,
  /// FULL_SHARD inside a machine, replicate across machines.
  kHybridShard = 4,
  /// SHARD_GRAD_OP inside a machine, replicate across machines.
  kHybridShardZero2 = 5,
};

/// torch's name: "FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD", "HYBRID_SHARD_ZERO2".
const char* to_string(ShardingStrategy strategy);

/// torch.distributed.fsdp.BackwardPrefetch: when, in backward, the next unit's all-gather is issued.
/// "NO_PREFETCH" is represented by an empty optional.
enum class BackwardPrefetch {
  /// Before the current unit's gradient computation (its pre-backward), so the two overlap.
  kBackwardPre = 1,
  /// After the current unit's gradient computation, before its reduce-scatter.
  kBackwardPost = 2,
};

/// FULL_SHARD and HYBRID_SHARD free unsharded parameters after forward; the others keep them.
bool reshards_after_forward(ShardingStrategy strategy);

/// FSDP2's `reshard_after_forward: bool | int`: what a unit keeps of its parameters between its
/// forward and its backward (Note [resharding after forward to a smaller group], src/engine/param_group.h).
///   true          free them; backward all-gathers over the whole shard group (ZeRO-3, FULL_SHARD).
///   false         keep them unsharded until backward (ZeRO-2, SHARD_GRAD_OP).
///   an int k      keep them sharded over groups of k consecutive ranks of the shard group (ZeRO++
///                 hpZ): k = ranks per machine keeps backward's all-gather inside the machine, at
///                 1/k of the unsharded size between forward and backward. k must divide the shard
///                 group's size; k = 1 means false and k = that size means true, as in FSDP2.
/// Converts implicitly from bool and from an integer, so `options.reshard_after_forward = 8` reads
/// as it does in Python.
class ReshardAfterForward {
 public:
  ReshardAfterForward(bool reshard) : reshard_(reshard) {}  // NOLINT(google-explicit-constructor)
  ReshardAfterForward(int group_size) : ReshardAfterForward(static_cast<int64_t>(group_size)) {}  // NOLINT
  ReshardAfterForward(int64_t group_size);  // NOLINT(google-explicit-constructor)

  /// Whether an integer was given (before it is resolved against a group size).
  bool is_group_size() const { return group_size_.has_value(); }
  /// The integer given; only when is_group_size().
  int64_t group_size() const;
  /// The bool given; only when !is_group_size().
  bool reshards() const;
  /// Whether forward frees the unsharded parameters at all: true, or an integer above 1.
  explicit operator bool() const { return group_size_ ? *group_size_ > 1 : reshard_; }
  /// The size of the group the parameters stay sharded over after forward, for a unit whose shard
  /// group has `shard_size` ranks: shard_size (true), 1 (false: every rank keeps everything) or k.
  /// Throws, naming `unit`, when k does not divide shard_size.
  int64_t post_forward_group_size(int64_t shard_size, const std::string& unit) const;
  /// "true", "false" or the integer, as Python prints it.
  std::string to_string() const;
  bool operator==(const ReshardAfterForward& other) const {
    return reshard_ == other.reshard_ && group_size_ == other.group_size_;
  }
  bool operator!=(const ReshardAfterForward& other) const { return !(*this == other); }

 private:
  bool reshard_ = true;
  std::optional<int64_t> group_size_;
};

/// Mixed precision. Version 1 uses buffer_dtype (torch's MixedPrecision); version 2 uses
/// output_dtype and cast_forward_inputs (torch's MixedPrecisionPolicy). Unset means "as stored".
struct MixedPrecisionPolicy {
  /// dtype of unsharded parameters in forward and backward. Default: unset.
  std::optional<c10::ScalarType> param_dtype;
  /// dtype of gradient reduction. Default: unset (param_dtype).
  std::optional<c10::ScalarType> reduce_dtype;
  /// dtype of buffers (version 1). Default: unset.
  std::optional<c10::ScalarType> buffer_dtype;
  /// dtype of the root's outputs (version 2). Default: unset.
  std::optional<c10::ScalarType> output_dtype;
  /// Cast floating inputs of forward to param_dtype. Default: true (torch's default).
  bool cast_forward_inputs = true;

  bool operator==(const MixedPrecisionPolicy& other) const;
};

/// CPU offload of parameters (and their gradients and optimizer state).
struct CpuOffloadPolicy {
  /// Keep sharded parameters on CPU between uses. Default: false.
  bool offload_params = false;
  /// Pin the CPU copies (CUDA builds). Default: true, as torch's CPUOffloadPolicy.
  bool pin_memory = true;
};

}  // namespace fsdp
