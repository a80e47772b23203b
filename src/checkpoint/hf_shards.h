// Hugging Face's sharded layout of a state dict: files `<stem>-00001-of-0000N.safetensors`, each
// holding whole tensors in state-dict order and at most `max_shard_size` bytes (a tensor larger
// than that gets a file of its own), and `<stem>.safetensors.index.json` mapping every tensor to
// its file. The one planner behind Accelerator::save_model and merge_fsdp_weights.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace fsdp::detail {

struct ShardFile {
  std::string name;
  std::vector<std::string> tensors;
  int64_t bytes = 0;
};

/// Splits `tensors` (name, bytes), in order, into files of at most `max_shard_size` bytes (> 0).
std::vector<ShardFile> plan_shard_files(const std::vector<std::pair<std::string, int64_t>>& tensors,
                                        int64_t max_shard_size, const std::string& stem);

/// The index file's text: {"metadata": {"total_size": ...}, "weight_map": {tensor: file}}.
std::string shard_index_json(const std::vector<ShardFile>& files, int64_t total_size);

}  // namespace fsdp::detail
