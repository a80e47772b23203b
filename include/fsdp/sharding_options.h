// The vocabulary the sharding engine needs from a configuration: which ranks shard and which
// replicate, mixed precision and CPU offload. The engine (fully_shard.h) includes this header, and
// the plugin (plugin.h) includes it too to resolve a user's configuration into these values; the
// engine never sees the plugin.
#pragma once

#include <c10/core/ScalarType.h>

#include <optional>

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
