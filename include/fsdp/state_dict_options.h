// The vocabulary of state dicts shared by the checkpoint code and the plugin: which kind of state
// dict, and where its tensors live. The checkpoint layer includes this header, never the plugin.
#pragma once

namespace fsdp {

/// torch.distributed.fsdp.StateDictType.
enum class StateDictType {
  /// Full, unsharded tensors (gathered, by default on rank 0 and on CPU).
  kFullStateDict = 1,
  /// Each unit's flat local shard (version 1 only; same world size to load).
  kLocalStateDict = 2,
  /// Each rank's shards with their global shapes and offsets.
  kShardedStateDict = 3,
};

/// torch's name: "FULL_STATE_DICT", "LOCAL_STATE_DICT", "SHARDED_STATE_DICT".
const char* to_string(StateDictType type);

/// FullStateDictConfig / ShardedStateDictConfig and their optimizer twins.
struct StateDictConfig {
  /// Move tensors to CPU as they are gathered. Default: derived from the type (true).
  bool offload_to_cpu = false;
  /// Only rank 0 holds the full state dict (FULL only). Default: derived (true for FULL).
  bool rank0_only = false;
};

}  // namespace fsdp
