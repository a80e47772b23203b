#include "checkpoint/hf_shards.h"

#include <c10/util/Exception.h>

#include <cstdio>
#include <nlohmann/json.hpp>

namespace fsdp::detail {

std::vector<ShardFile> plan_shard_files(const std::vector<std::pair<std::string, int64_t>>& tensors,
                                        int64_t max_shard_size, const std::string& stem) {
  TORCH_INTERNAL_ASSERT(max_shard_size > 0, "plan_shard_files needs a positive max_shard_size");
  std::vector<ShardFile> files;
  for (const auto& [name, bytes] : tensors) {
    if (files.empty() || (files.back().bytes > 0 && files.back().bytes + bytes > max_shard_size)) files.emplace_back();
    files.back().tensors.push_back(name);
    files.back().bytes += bytes;
  }
  for (size_t index = 0; index < files.size(); ++index) {
    char name[160];
    std::snprintf(name, sizeof(name), "%s-%05zu-of-%05zu.safetensors", stem.c_str(), index + 1, files.size());
    files[index].name = name;
  }
  return files;
}

std::string shard_index_json(const std::vector<ShardFile>& files, int64_t total_size) {
  // Names are escaped by the JSON library.
  nlohmann::json index;
  index["metadata"] = {{"total_size", total_size}};
  index["weight_map"] = nlohmann::json::object();
  for (const auto& file : files) {
    for (const auto& tensor : file.tensors) index["weight_map"][tensor] = file.name;
  }
  return index.dump(2);
}

}  // namespace fsdp::detail
