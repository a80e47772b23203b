// The tensors of a PyTorch distributed checkpoint (DCP) directory as one TensorSource: what
// dcp_to_torch_save and Accelerate's merge_fsdp_weights read, chunk by chunk from the `.distcp`
// files. A chunk is one torch.save archive at (offset, length) of its file (FileSystemWriter's
// layout, docs/checkpoint-format.md): each offset and length is checked against the file, the file
// must be a regular file inside the directory, and the archive must hold a tensor of the chunk's
// dtype and sizes. At most one chunk is held in memory beyond what the caller asks for.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/core/ivalue.h>
#include <fsdp/safetensors.h>
#include <fsdp/state_dict.h>

#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "checkpoint/dcp_metadata.h"
#include "checkpoint/save_identity.h"

namespace fsdp::detail {

class ReadOnlyFile;  // io/read_only_file.h

class DcpDirectoryReader : public TensorSource {
 public:
  /// With `unwrap_single_key`, a checkpoint whose state dict has one top-level key ({"model":
  /// {...}}, as Accelerate saves) is read under the names inside it ("0.weight"), as Accelerate's
  /// merge does; otherwise under the flattened keys ("model.0.weight").
  explicit DcpDirectoryReader(const std::string& directory, bool unwrap_single_key = true);
  ~DcpDirectoryReader() override;
  DcpDirectoryReader(const DcpDirectoryReader&) = delete;
  DcpDirectoryReader& operator=(const DcpDirectoryReader&) = delete;
  bool contains(const std::string& name) const override;
  std::vector<int64_t> shape(const std::string& name) const override;
  at::Tensor rows(const std::string& name, int64_t row_begin, int64_t row_count) const override;
  size_t size() const override { return names_.size(); }
  std::string description() const override { return "DCP checkpoint directory '" + directory_ + "'"; }
  /// The raw bytes of rows [row_begin, row_begin + row_count) into `destination`.
  void read_rows(const std::string& name, int64_t row_begin, int64_t row_count, void* destination) const;
  /// Appends the raw bytes of rows [row_begin, row_begin + row_count) of `name` through `copy`, as
  /// ranges of the checkpoint's files, when every chunk they span holds whole rows as torch.save
  /// writes a contiguous tensor and the chunks tile the rows; false (nothing appended) otherwise.
  bool copy_rows(const std::string& name, int64_t row_begin, int64_t row_count, const FileRangeWriter& copy) const;
  /// Tensor names in the metadata's order.
  const std::vector<std::string>& names() const { return names_; }
  /// The safetensors dtype name ("F32", "BF16", ...).
  std::string dtype(const std::string& name) const;
  c10::ScalarType scalar_type(const std::string& name) const;
  /// Keys of the non-tensor items (optimizer steps stored as numbers, hyper-parameters), flattened.
  const std::vector<std::string>& byte_item_keys() const { return byte_item_keys_; }
  const DcpMetadata& metadata() const { return metadata_; }
  /// The value of byte item `key` (flattened, "optimizer.param_groups.0.lr"), read with libtorch's
  /// unpickler (plain values only: no Python object is built).
  c10::IValue byte_item(const std::string& key) const;
  const std::string& directory() const { return directory_; }
  /// The save this directory belongs to (StorageMeta.save_id), empty when none was recorded.
  const std::string& save_id() const { return metadata_.save_id; }
  /// Whether every file carried fsdp.cpp's save identity (checked against save_id()); false for a
  /// directory PyTorch wrote (Note [save identity], src/checkpoint/save_identity.h).
  bool identified() const { return identified_; }

 private:
  const DcpTensor& tensor(const std::string& name) const;
  /// The sizes of rows [row_begin, row_begin + row_count) of `name` (checked), empty for a scalar.
  std::vector<int64_t> block_sizes(const std::string& name, int64_t row_begin, int64_t row_count) const;
  /// Copies the chunks' part of rows [row_begin, row_begin + result.size(0)) into `result`.
  void fill_rows(const std::string& name, int64_t row_begin, at::Tensor& result) const;
  struct File {
    int64_t size = 0;  // bytes available to items (the footer excluded)
    std::optional<FoundIdentity> found;
  };
  void check_files();
  /// Note [save identity]; `require_footer`: also every file must carry one (when any does).
  void check_identities(const std::map<std::string, File>& files, bool require_footer);
  c10::IValue load_item(const DcpStorage& storage, const std::string& item) const;
  std::string item_name(const DcpStorage& storage) const;
  at::Tensor load_chunk(const std::string& key, const DcpTensor& tensor, size_t chunk) const;
  /// Where in its file the chunk's elements start, when the archive is torch.save of a contiguous
  /// tensor of the chunk's dtype and sizes (checked); nullopt otherwise. Call under cache_mutex_.
  std::optional<int64_t> raw_data_offset(const std::string& key, const DcpTensor& tensor, size_t chunk) const;
  /// The open file `relative_path` of the directory (a few stay open; see its definition).
  const ReadOnlyFile& file(const std::string& relative_path) const;

  std::string directory_;
  DcpMetadata metadata_;
  std::vector<std::string> names_;
  std::map<std::string, std::string> keys_;  // name -> flattened key
  std::vector<std::string> byte_item_keys_;
  bool identified_ = false;
  // The last chunk loaded, for reads of consecutive rows of one large chunk.
  mutable std::mutex cache_mutex_;
  mutable std::string cached_key_;
  mutable size_t cached_chunk_ = 0;
  mutable at::Tensor cached_;
  mutable std::map<std::pair<std::string, size_t>, std::optional<int64_t>> raw_offsets_;
  mutable std::map<std::string, std::unique_ptr<ReadOnlyFile>> open_files_;
};

}  // namespace fsdp::detail

namespace fsdp::detail {

/// The parameter groups of an optimizer checkpoint in DCP (what get_optimizer_state_dict saves:
/// one byte item per group and option, `<top>.param_groups.<i>.<option>`, or in older writers the
/// whole list as one item `<top>.param_groups`), as load_optimizer_state_dict takes them.
struct DcpParamGroups {
  /// The optimizer class the groups' options belong to ("AdamW", ...).
  std::string optimizer;
  /// [{option: value, ..., "params": [names]}].
  std::string json;
};
/// `expected_type` (the optimizer being loaded) settles what the groups cannot tell: Adam and AdamW
/// saved before torch 2.9 have the same options.
DcpParamGroups dcp_param_groups(const DcpDirectoryReader& reader, const std::string& expected_type);

}  // namespace fsdp::detail
