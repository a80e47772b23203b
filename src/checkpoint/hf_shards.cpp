#include "checkpoint/hf_shards.h"

#include <c10/util/Exception.h>
#include <fsdp/safetensors.h>
#include <fsdp/torch_file.h>

#include <cstdio>
#include <filesystem>
#include <nlohmann/json.hpp>

#include "io/atomic_file.h"

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

void save_pretrained_files(const std::string& directory, const TensorList& state, int64_t max_shard_size,
                           bool safe_serialization) {
  namespace fs = std::filesystem;
  fs::create_directories(directory);
  for (const auto& item : fs::directory_iterator(directory)) {
    const auto name = item.path().filename().string();
    if (name == "model.safetensors" || name == "model.safetensors.index.json" || name == "pytorch_model.bin" ||
        (name.rfind("model-", 0) == 0 && name.find("-of-") != std::string::npos)) {
      fs::remove(item.path());
    }
  }
  int64_t total = 0;
  for (const auto& [name, tensor] : state) total += tensor.numel() * tensor.element_size();
  if (!safe_serialization) {
    save_torch_file((fs::path(directory) / "pytorch_model.bin").string(), tensor_dict(state));
  } else if (max_shard_size <= 0 || total <= max_shard_size) {
    write_safetensors((fs::path(directory) / "model.safetensors").string(), state);
  } else {
    std::vector<std::pair<std::string, int64_t>> sizes;
    for (const auto& [name, tensor] : state) sizes.emplace_back(name, tensor.numel() * tensor.element_size());
    const auto files = plan_shard_files(sizes, max_shard_size, "model");
    // The files hold consecutive runs of the state dict, in order.
    auto next = state.begin();
    for (const auto& file : files) {
      const auto end = next + static_cast<std::ptrdiff_t>(file.tensors.size());
      write_safetensors((fs::path(directory) / file.name).string(), TensorList(next, end));
      next = end;
    }
    write_file_atomically((fs::path(directory) / "model.safetensors.index.json").string(),
                          shard_index_json(files, total));
  }
}

}  // namespace fsdp::detail
