// Hugging Face's sharded layout of a state dict: files `<stem>-00001-of-0000N.safetensors`, each
// holding whole tensors in state-dict order and at most `max_shard_size` bytes (a tensor larger
// than that gets a file of its own), and `<stem>.safetensors.index.json` mapping every tensor to
// its file. The one planner behind Accelerator::save_model and merge_fsdp_weights, and the writer of
// a full state dict in save_pretrained's layout.
#pragma once

#include <fsdp/state_dict.h>

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

/// Writes the full state dict `state` into `directory` as transformers' save_pretrained lays it out
/// (what Accelerator::save_model writes): model.safetensors, or model-0000i-of-0000N.safetensors and
/// model.safetensors.index.json past `max_shard_size` (> 0; 0 for one file), or pytorch_model.bin
/// without `safe_serialization`. A previous save's files of another layout are removed first
/// (transformers would load them instead: it prefers model.safetensors to an index). Each file is
/// written atomically. Not collective: one rank writes.
void save_pretrained_files(const std::string& directory, const TensorList& state, int64_t max_shard_size,
                           bool safe_serialization);

}  // namespace fsdp::detail
