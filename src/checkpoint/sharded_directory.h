// Private: one interface over the two formats of a sharded checkpoint directory (Note [sharded
// directories]).
#pragma once

#include <fsdp/safetensors.h>
#include <fsdp/state_dict.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace fsdp::detail {

/// An optimizer's type and parameter groups as load_optimizer_state_dict takes them.
struct OptimizerGroups {
  /// The optimizer class the groups' options belong to ("AdamW", ...).
  std::string optimizer;
  /// [{option: value, ..., "params": [names]}].
  std::string json;
};

/// Note [sharded directories]
/// A SHARDED model or optimizer directory is in one of two formats: PyTorch's distributed checkpoint
/// (DCP: .metadata and __<rank>_0.distcp files, what fsdp.cpp, PyTorch and Accelerate's FSDP2 write;
/// src/checkpoint/dcp_reader.h) or the rank-file format earlier fsdp.cpp versions wrote
/// (metadata.json and rank_<i>.safetensors, docs/checkpoint-format.md; sharded_checkpoint.h).
/// load_checkpoint, Accelerator::load_state and `fsdp merge-weights` read both through this one
/// interface, and which format a directory holds is decided once, by sharded_directory_format.
class ShardedDirectory : public TensorSource {
 public:
  /// Tensor names in the directory's order.
  virtual const std::vector<std::string>& names() const = 0;
  /// The safetensors dtype name of `name` ("F32", "BF16", ...).
  virtual std::string dtype(const std::string& name) const = 0;
  /// The raw bytes of rows [row_begin, row_begin + row_count) of `name` into `destination`.
  virtual void read_rows(const std::string& name, int64_t row_begin, int64_t row_count, void* destination) const = 0;
  /// Appends the raw bytes of those rows through `copy` as ranges of the directory's files (copied
  /// inside the kernel), where the format keeps them there as they are; false, with nothing
  /// appended, where they must go through read_rows. Default: false.
  virtual bool copy_rows(const std::string& /*name*/, int64_t /*row_begin*/, int64_t /*row_count*/,
                         const FileRangeWriter& /*copy*/) const {
    return false;
  }
  /// The optimizer's groups when the directory holds an optimizer's state; nullopt for a model's.
  /// `expected_type` (the optimizer being loaded, or "") settles what DCP's groups cannot tell:
  /// Adam and AdamW saved before torch 2.9 have the same options.
  virtual std::optional<OptimizerGroups> optimizer_groups(const std::string& expected_type) const = 0;
  /// Note [save identity]: the save the directory belongs to ("" when the writer recorded none);
  /// nullopt for the rank-file format, which has no place for one.
  virtual std::optional<std::string> save_id() const = 0;
  /// The entries (tensors and other items) the directory lists.
  virtual int64_t entry_count() const = 0;
};

enum class ShardedFormat { kNone, kDcp, kRankFiles };

/// The one probe: which format `directory` holds, by its metadata file (.metadata for DCP,
/// metadata.json for rank files); kNone when it has neither. Both is an error naming the
/// directory: two saves were written into it.
ShardedFormat sharded_directory_format(const std::string& directory);

/// Opens `directory` in the format the probe finds. With neither metadata file, the rank-file
/// reader's errors apply (it names what is missing, and a directory that looks like DCP).
std::unique_ptr<ShardedDirectory> open_sharded_directory(const std::string& directory);

}  // namespace fsdp::detail
