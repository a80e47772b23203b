#include "checkpoint/hf_shards.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <c10/util/accumulate.h>
#include <fsdp/safetensors.h>
#include <fsdp/state_dict.h>
#include <fsdp/torch_file.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <unordered_map>

#include "dist/agreement.h"
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

namespace {

// One file of a save_pretrained layout and the entries it holds, in the state dict's order (and,
// for a safetensors file, what its header says of each).
struct PretrainedFile {
  std::string name;
  std::vector<size_t> entries;
  bool torch_format = false;
  std::vector<SafetensorsEntry> described;
};

bool is_pretrained_model_file(const std::string& name) {
  return name == "model.safetensors" || name == "model.safetensors.index.json" || name == "pytorch_model.bin" ||
         (name.rfind("model-", 0) == 0 && name.find("-of-") != std::string::npos);
}

}  // namespace

std::string save_pretrained_files(const std::string& directory, const std::vector<FullModelTensors::Entry>& entries,
                                  int64_t max_shard_size, bool safe_serialization, bool writes,
                                  const std::function<at::Tensor(size_t index)>& tensor) {
  namespace fs = std::filesystem;
  int64_t total = 0;
  std::vector<std::pair<std::string, int64_t>> sizes;
  for (const auto& entry : entries) {
    sizes.emplace_back(entry.name,
                       c10::multiply_integers(entry.shape) * static_cast<int64_t>(c10::elementSize(entry.dtype)));
    total += sizes.back().second;
  }
  // What a safetensors file says of each tensor, on every rank before any gather: a dtype it cannot
  // hold is the same error everywhere.
  std::vector<SafetensorsEntry> described;
  if (safe_serialization) {
    for (const auto& entry : entries) {
      std::string dtype;
      try {
        dtype = safetensors_dtype_name(entry.dtype);
      } catch (const std::exception&) {
        TORCH_CHECK(false, "save_model: tensor '", entry.name, "' is ", entry.dtype,
                    ", which a safetensors file cannot hold; save with safe_serialization=false (pytorch_model.bin) "
                    "or convert the tensor first");
      }
      described.push_back({entry.name, dtype, entry.shape});
    }
  }
  std::vector<size_t> all(entries.size());
  for (size_t index = 0; index < all.size(); ++index) all[index] = index;
  std::vector<PretrainedFile> files;
  std::vector<ShardFile> shards;
  if (!safe_serialization) {
    files.push_back({"pytorch_model.bin", all, true, {}});
  } else if (max_shard_size <= 0 || total <= max_shard_size) {
    files.push_back({"model.safetensors", all, false, {}});
  } else {
    // The files hold consecutive runs of the state dict, in order.
    shards = plan_shard_files(sizes, max_shard_size, "model");
    size_t next = 0;
    for (const auto& shard : shards) {
      PretrainedFile file{shard.name, {}, false, {}};
      for (size_t count = 0; count < shard.tensors.size(); ++count) file.entries.push_back(next++);
      files.push_back(std::move(file));
    }
  }
  // The order every rank asks for the tensors in: a torch file's is its dict's (the pickler's order),
  // a safetensors file's the library's layout.
  std::vector<size_t> sequence;
  for (auto& file : files) {
    if (file.torch_format) {
      sequence.insert(sequence.end(), file.entries.begin(), file.entries.end());
      continue;
    }
    for (const size_t index : file.entries) file.described.push_back(described[index]);
    for (const size_t position : safetensors_write_order(file.described)) sequence.push_back(file.entries[position]);
  }
  size_t taken = 0;
  bool tensor_failed = false;
  auto take = [&](size_t index) {
    TORCH_INTERNAL_ASSERT(taken < sequence.size() && sequence[taken] == index, "save_pretrained_files: tensor ", index,
                          " asked for out of the planned order");
    ++taken;
    try {
      auto data = tensor(index);  // undefined on a rank that gathers without keeping (rank0_only)
      return data.defined() ? data.to(at::kCPU).contiguous() : data;
    } catch (...) {
      tensor_failed = true;
      throw;
    }
  };
  std::string error;
  if (writes) {
    try {
      fs::create_directories(directory);
      std::vector<std::string> stale;
      for (const auto& item : fs::directory_iterator(directory)) {
        const auto name = item.path().filename().string();
        if (is_pretrained_model_file(name)) stale.push_back(name);
      }
      // The old index goes first: shards rewritten under the same names beside it would otherwise,
      // after a failure part way, make a mix of two saves that loads. The new index is written last.
      if (!shards.empty()) fs::remove(fs::path(directory) / "model.safetensors.index.json");
      std::unordered_map<std::string, size_t> by_name;
      for (size_t index = 0; index < entries.size(); ++index) by_name.emplace(entries[index].name, index);
      std::vector<std::string> written;
      for (const auto& file : files) {
        const auto path = (fs::path(directory) / file.name).string();
        if (file.torch_format) {
          TensorList placeholders;
          std::unordered_map<const c10::TensorImpl*, size_t> index_of;
          for (const size_t index : file.entries) {
            auto placeholder = placeholder_tensor(entries[index].shape, entries[index].dtype);
            index_of.emplace(placeholder.unsafeGetTensorImpl(), index);
            placeholders.emplace_back(entries[index].name, std::move(placeholder));
          }
          save_torch_file_streaming(path, tensor_dict(placeholders), [&](const at::Tensor& placeholder) {
            return take(index_of.at(placeholder.unsafeGetTensorImpl()));
          });
        } else {
          write_safetensors_streaming(
              path, file.described, {}, [&](const SafetensorsEntry& entry, const ByteWriter& writer) {
                const auto data = take(by_name.at(entry.name));
                writer(data.data_ptr(), static_cast<size_t>(data.numel() * data.element_size()));
              });
        }
        written.push_back(file.name);
      }
      if (!shards.empty()) {
        write_file_atomically((fs::path(directory) / "model.safetensors.index.json").string(),
                              shard_index_json(shards, total));
        written.push_back("model.safetensors.index.json");
      }
      for (const auto& name : stale) {
        if (std::find(written.begin(), written.end(), name) == written.end()) fs::remove(fs::path(directory) / name);
      }
    } catch (const std::exception& failure) {
      if (tensor_failed) throw;
      error = message_of(failure);
    }
  }
  // The ranks that do not write, and a writer that stopped early, take the tensors left.
  while (taken < sequence.size()) take(sequence[taken]);
  return error;
}

}  // namespace fsdp::detail
