// The options of `fully_shard` (fully_shard.h), in a header of their own so that the engine's
// unit (src/engine/param_group.h) can hold them without including the public fully_shard API.
#pragma once

#include <ATen/core/Tensor.h>
#include <fsdp/sharding_options.h>
#include <torch/nn/module.h>

#include <cstdint>
#include <functional>
#include <optional>
#include <vector>

namespace fsdp {

/// The knobs of FSDP1's FullyShardedDataParallel that FSDP2's fully_shard does not have. Their
/// defaults are FSDP2's behaviour (no broadcast, the module's own initializer, FSDP2's implicit
/// prefetching, no all-gather limit); Accelerate's FSDP1 plugin fields map onto them.
struct Fsdp1Options {
  /// Broadcast every managed parameter and buffer from rank 0 before sharding, so ranks that
  /// initialized differently start identical (FSDP1's sync_module_states). Default: false.
  bool sync_module_states = false;
  /// How a module whose own parameters or buffers are on the meta device gets its values (FSDP1's
  /// param_init_fn; Note [building on the meta device], meta_device.h). Before sharding, the unit's
  /// meta tensors are given memory (zeros), and each such module, in FSDP1's order (breadth-first
  /// from the unit's modules, not entering other units), is passed to this function, which fills its
  /// direct tensors in place. Unset: the module's own initializer (fsdp::reset_parameters), an error
  /// naming the module when it has none. Every rank runs it (equal seeds give equal values); under
  /// sync_module_states only rank 0 does, and the others receive rank 0's values. Default: unset.
  std::function<void(torch::nn::Module&)> param_init_fn;
  /// Forward prefetch: while a unit computes its forward, the unit that ran after it in the previous
  /// forward is all-gathered (FSDP1's forward_prefetch; FSDP2 gets the same overlap on CUDA from its
  /// streams, and on CPU it must be issued explicitly: Note [prefetch]). Costs one more unit's
  /// unsharded parameters at peak. The root's setting applies to its whole tree; explicit lists from
  /// FSDPModule::set_modules_to_forward_prefetch replace it for their unit. Default: true (FSDP2).
  bool forward_prefetch = true;
  /// Backward prefetch of the unit before this one in forward order (FSDP2's default target):
  /// kBackwardPre issues it before this unit's gradient computation, kBackwardPost after it and
  /// before this unit's reduce-scatter, unset not at all (FSDP1's NO_PREFETCH). Explicit lists from
  /// FSDPModule::set_modules_to_backward_prefetch replace the target, at the same moment (before
  /// the gradients when unset). The root's setting applies to its whole tree. Default: kBackwardPre
  /// (FSDP2's implicit prefetch).
  std::optional<BackwardPrefetch> backward_prefetch = BackwardPrefetch::kBackwardPre;
  /// At most this many all-gathers in flight in one tree (FSDP1's limit_all_gathers rate limiter,
  /// which allows two): a prefetch that would exceed it is not issued, and its unit is all-gathered
  /// when it runs. Unset: no limit (FSDP2). Default: unset. Must be at least 1.
  std::optional<int64_t> max_all_gathers_in_flight;
};

/// Options for `fully_shard`, with FSDP2's names (mp_policy, offload_policy, ignored_params); FSDP1's
/// knobs are in `fsdp1`. Check them with `validate`.
struct FullyShardOptions {
  /// Which ranks shard and which replicate: FULL_SHARD and SHARD_GRAD_OP shard over the world,
  /// NO_SHARD replicates over the world (gradients all-reduced), HYBRID_SHARD and
  /// HYBRID_SHARD_ZERO2 shard inside a machine and replicate across machines (what FSDP2 says with
  /// its device mesh: one dimension shards, a second replicates). Default: FULL_SHARD.
  ShardingStrategy sharding_strategy = ShardingStrategy::kFullShard;
  /// Free the unsharded parameters after forward and all-gather them again in backward (true), keep
  /// them (false), or keep them sharded over groups of k consecutive ranks (an integer k: hpZ), see
  /// ReshardAfterForward. Default: unset, meaning the strategy's choice (FULL_SHARD, HYBRID_SHARD:
  /// true) for every unit except the root, which keeps them because backward starts with it
  /// (FSDP2's `None`).
  std::optional<ReshardAfterForward> reshard_after_forward;
  /// param_dtype (all-gather and compute), reduce_dtype (gradient reduction), output_dtype (floating
  /// outputs of the unit's forward), cast_forward_inputs, buffer_dtype (buffers of managed modules).
  /// Default: no casts.
  MixedPrecisionPolicy mp_policy;
  /// CPU offload of sharded parameters, gradients and optimizer state (FSDP2's CPUOffloadPolicy):
  /// shards in host memory (pinned when pin_memory and a GPU is present), the unit computing on its
  /// parameters' GPU or on default_device(local rank), gradients moved to host memory at the end of
  /// each backward so the optimizer steps there. Without a GPU everything is in host memory already
  /// and it holds by construction. Default: off.
  CpuOffloadPolicy offload_policy;
  /// Parameters that stay whole and unmanaged: not sharded, gradients not reduced. Default: none.
  std::vector<at::Tensor> ignored_params;
  /// FSDP1's knobs. Default: FSDP2's behaviour.
  Fsdp1Options fsdp1;
};

/// Throws c10::Error naming the field when the options cannot work.
void validate(const FullyShardOptions& options);

}  // namespace fsdp
