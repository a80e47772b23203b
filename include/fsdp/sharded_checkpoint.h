// The rank-file sharded directory of fsdp.cpp before DCP: one safetensors file per rank and a
// metadata file that says which file holds which rows of every tensor. save_checkpoint writes DCP
// now; these directories still load and merge, and write_sharded_directory still makes them. The
// format is specified in docs/checkpoint-format.md.
#pragma once

#include <fsdp/process_group.h>
#include <fsdp/safetensors.h>
#include <fsdp/state_dict.h>

#include <map>
#include <memory>
#include <string>
#include <vector>

namespace fsdp {

/// "metadata.json" inside a sharded directory.
extern const char* const kShardedMetadataFile;

/// Writes `tensors` (this rank's rows) into `directory`: every rank writes rank_<r>.safetensors (a
/// replicated tensor only from rank 0), then rank 0 writes metadata.json with every chunk, after
/// all ranks finished their files. `extra_json` (a JSON object text, or "") is stored as "extra".
/// Collective over `context.world()`.
void write_sharded_directory(const std::string& directory, const ShardedTensorList& tensors,
                             const DistributedContext& context, const std::string& extra_json = "");

/// Reads a sharded directory. Opening validates the metadata and every referenced file: a missing
/// rank file, a chunk that does not match its file, rows that overlap or leave gaps are errors that
/// name the directory and the tensor. Rows are read from the files that hold them and nowhere else.
class ShardedDirectoryReader : public TensorSource {
 public:
  explicit ShardedDirectoryReader(const std::string& directory);
  bool contains(const std::string& name) const override;
  std::vector<int64_t> shape(const std::string& name) const override;
  at::Tensor rows(const std::string& name, int64_t row_begin, int64_t row_count) const override;
  /// The raw bytes of rows [row_begin, row_begin + row_count) into `destination`, straight from the
  /// files that hold them (for streaming writers).
  void read_rows(const std::string& name, int64_t row_begin, int64_t row_count, void* destination) const;
  size_t size() const override { return tensors_.size(); }
  std::string description() const override { return "sharded checkpoint directory '" + directory_ + "'"; }
  /// Names in the order they were written.
  const std::vector<std::string>& names() const { return names_; }
  std::string dtype(const std::string& name) const;
  /// The "extra" object as JSON text ("{}" when absent).
  const std::string& extra_json() const { return extra_json_; }
  /// Number of ranks that wrote the directory.
  int64_t world_size() const { return world_size_; }

 private:
  struct Chunk {
    std::string file;
    int64_t row_offset = 0;
    int64_t rows = 0;
  };
  struct Entry {
    std::string dtype;
    std::vector<int64_t> shape;
    std::vector<Chunk> chunks;
  };
  const Entry& entry(const std::string& name) const;
  void open();
  std::string directory_;
  int64_t world_size_ = 0;
  std::vector<std::string> names_;
  std::map<std::string, Entry> tensors_;
  std::map<std::string, std::shared_ptr<SafetensorsReader>> files_;
  std::string extra_json_ = "{}";
};

}  // namespace fsdp
