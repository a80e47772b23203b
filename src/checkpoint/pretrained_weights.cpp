#include <fsdp/pretrained_weights.h>

#include <filesystem>
#include <nlohmann/json.hpp>
#include <sstream>

#include "dist/agreement.h"
#include "io/read_only_file.h"

namespace fsdp {
namespace {

namespace fs = std::filesystem;

constexpr const char* kSingleFile = "model.safetensors";
constexpr const char* kIndexFile = "model.safetensors.index.json";

bool ends_with(const std::string& text, const std::string& suffix) {
  return text.size() >= suffix.size() && text.compare(text.size() - suffix.size(), suffix.size(), suffix) == 0;
}

}  // namespace

SafetensorsCheckpointSource::SafetensorsCheckpointSource(const std::string& path) : path_(path) {
  std::string file = path;
  if (fs::is_directory(path)) {
    if (fs::exists(fs::path(path) / kIndexFile)) {
      file = (fs::path(path) / kIndexFile).string();
    } else {
      file = (fs::path(path) / kSingleFile).string();
      TORCH_CHECK(fs::exists(file), "'", path, "' holds neither ", kSingleFile, " nor ", kIndexFile,
                  "; point at a Hugging Face model directory or a .safetensors file");
    }
  }
  TORCH_CHECK(fs::exists(file), "Hugging Face checkpoint '", file, "' does not exist");
  if (!ends_with(file, ".json")) {
    files_.push_back(std::make_unique<SafetensorsReader>(file));
    for (const auto& info : files_.back()->header().tensors) location_[info.name] = 0;
    return;
  }
  nlohmann::json index;
  try {
    // An index maps each tensor to its file: megabytes for the largest models.
    index = nlohmann::json::parse(detail::read_text_file(file, uint64_t{1} << 30, "safetensors index"));
  } catch (const nlohmann::json::exception& error) {
    TORCH_CHECK(false, "index '", file, "' is not valid JSON (", error.what(), ")");
  }
  TORCH_CHECK(index.is_object() && index.contains("weight_map") && index["weight_map"].is_object(), "index '", file,
              "' has no weight_map object");
  std::map<std::string, size_t> opened;
  for (const auto& [name, shard] : index["weight_map"].items()) {
    TORCH_CHECK(shard.is_string(), "index '", file, "' maps '", name, "' to ", shard.dump(), ", not a file name");
    const auto shard_name = shard.get<std::string>();
    TORCH_CHECK(shard_name.find('/') == std::string::npos && shard_name != "..", "index '", file, "' maps '", name,
                "' to '", shard_name, "', which is not a file next to the index");
    auto found = opened.find(shard_name);
    if (found == opened.end()) {
      const auto shard_path = (fs::path(file).parent_path() / shard_name).string();
      TORCH_CHECK(fs::exists(shard_path), "index '", file, "' names '", shard_name, "', which does not exist");
      files_.push_back(std::make_unique<SafetensorsReader>(shard_path));
      found = opened.emplace(shard_name, files_.size() - 1).first;
    }
    TORCH_CHECK(files_[found->second]->contains(name), "index '", file, "' says '", name, "' is in '", shard_name,
                "' but that file has no such tensor");
    location_[name] = found->second;
  }
  // A tensor in two files would load from whichever the index names, silently: a checkpoint holds
  // each tensor once.
  for (const auto& [shard_name, index_of_file] : opened) {
    for (const auto& info : files_[index_of_file]->header().tensors) {
      const auto mapped = location_.find(info.name);
      if (mapped == location_.end() || mapped->second == index_of_file) continue;
      std::string named_in;
      for (const auto& [other_name, other_index] : opened) {
        if (other_index == mapped->second) named_in = other_name;
      }
      TORCH_CHECK(false, "Hugging Face checkpoint '", path_, "': tensor '", info.name, "' is in both '", named_in,
                  "' (where index '", file, "' maps it) and '", shard_name,
                  "'; a checkpoint holds each tensor once: remove it from '", shard_name, "'");
    }
  }
}

const SafetensorsReader& SafetensorsCheckpointSource::reader_of(const std::string& name) const {
  auto found = location_.find(name);
  TORCH_CHECK(found != location_.end(), description(), " has no tensor '", name, "'");
  return *files_[found->second];
}

bool SafetensorsCheckpointSource::contains(const std::string& name) const { return location_.count(name) > 0; }

std::vector<int64_t> SafetensorsCheckpointSource::shape(const std::string& name) const {
  return reader_of(name).header().find(name)->shape;
}

at::Tensor SafetensorsCheckpointSource::rows(const std::string& name, int64_t row_begin, int64_t row_count) const {
  const auto& reader = reader_of(name);
  if (reader.header().find(name)->shape.empty()) return reader.tensor(name);
  return reader.rows(name, row_begin, row_count);
}

void load_pretrained_weights(torch::nn::Module& model, const DistributedContext& context, const std::string& path,
                             const PretrainedWeightsOptions& options) {
  std::unique_ptr<SafetensorsCheckpointSource> source;
  if (options.rank0_only) {
    detail::run_on_every_rank(context, [&] {
      if (context.rank() == 0) source = std::make_unique<SafetensorsCheckpointSource>(path);
    });
    load_model_state_dict_from_rank0(model, context, source.get());
    return;
  }
  // Every rank opens the files (their headers and the index: validated on each) and reads its own
  // rows; a failure anywhere, opening or reading, is raised on every rank before the next collective.
  detail::run_on_every_rank(context, [&] {
    try {
      source = std::make_unique<SafetensorsCheckpointSource>(path);
    } catch (const c10::Error& error) {
      TORCH_CHECK(false, "[rank ", context.rank(), "] ", error.what_without_backtrace(),
                  ". Every rank reads its own rows of the files; where only rank 0 can see them, load with "
                  "PretrainedWeightsOptions::rank0_only (train_llama --init-from-rank0)");
    }
  });
  detail::run_on_every_rank(context, [&] { load_model_state_dict(model, *source); });
}

}  // namespace fsdp
