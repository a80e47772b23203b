// Hugging Face checkpoints as full state dicts: a model.safetensors file, or a
// model.safetensors.index.json with its shard files (transformers' save_pretrained layout).
#pragma once

#include <fsdp/process_group.h>
#include <fsdp/safetensors.h>
#include <fsdp/state_dict.h>

#include <map>
#include <memory>
#include <string>
#include <vector>

namespace fsdp {

/// The tensors of a Hugging Face checkpoint. `path` is a .safetensors file, an index file, or a
/// directory holding model.safetensors or model.safetensors.index.json. Opening validates every file
/// and the index (each tensor in the file the index names).
class SafetensorsCheckpointSource : public TensorSource {
 public:
  explicit SafetensorsCheckpointSource(const std::string& path);
  bool contains(const std::string& name) const override;
  std::vector<int64_t> shape(const std::string& name) const override;
  at::Tensor rows(const std::string& name, int64_t row_begin, int64_t row_count) const override;
  size_t size() const override { return location_.size(); }
  std::string description() const override { return "Hugging Face checkpoint '" + path_ + "'"; }

 private:
  const SafetensorsReader& reader_of(const std::string& name) const;
  std::string path_;
  std::vector<std::unique_ptr<SafetensorsReader>> files_;
  std::map<std::string, size_t> location_;
};

struct PretrainedWeightsOptions {
  /// Rank 0 alone opens the files and broadcasts one tensor at a time, every rank keeping its rows:
  /// for storage only rank 0 can see. Otherwise every rank opens them and reads, with positioned
  /// reads, only the byte ranges of its own shards (a replicated tensor whole): no tensor is sent,
  /// and a rank holds its shards plus the rows it is reading. Default: false.
  bool rank0_only = false;
};

/// Loads a Hugging Face checkpoint into a sharded model, each rank reading its own rows (or, with
/// options.rank0_only, through rank 0). A file a rank cannot open or read, a tensor missing or of
/// another shape, is an error on every rank naming the rank. Collective.
void load_pretrained_weights(torch::nn::Module& model, const DistributedContext& context, const std::string& path,
                             const PretrainedWeightsOptions& options = {});

}  // namespace fsdp
