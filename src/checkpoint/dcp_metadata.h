// The `.metadata` file of a PyTorch distributed checkpoint (DCP) directory, as
// torch.distributed.checkpoint's FileSystemWriter writes it (torch/distributed/checkpoint/
// filesystem.py and metadata.py; docs/checkpoint-format.md): which flattened keys the checkpoint
// holds, each tensor's dtype, global size and chunks, and where in which `.distcp` file each chunk
// or byte item lies. Read with the restricted unpickler (Note [a restricted unpickler],
// src/io/restricted_unpickler.h): only the classes DCP writes are allowed, and every field is
// checked before anything is read from the data files.
#pragma once

#include <c10/core/ScalarType.h>

#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace fsdp::detail {

/// Where one item lies: `length` bytes at `offset` of `relative_path` (a file name in the directory).
struct DcpStorage {
  std::string relative_path;
  int64_t offset = 0;
  int64_t length = 0;
};

struct DcpChunk {
  std::vector<int64_t> offsets;
  std::vector<int64_t> sizes;
  /// Unset (length -1) only for a chunk with no elements, which DCP may leave without an item.
  DcpStorage storage{"", 0, -1};
};

struct DcpTensor {
  c10::ScalarType dtype = c10::kFloat;
  std::vector<int64_t> size;
  std::vector<DcpChunk> chunks;
};

struct DcpMetadata {
  /// Flattened keys in the order the metadata lists them ("model.layers.0.weight",
  /// "optimizer.param_groups.0.lr"), each either a tensor or a byte item.
  std::vector<std::string> keys;
  std::map<std::string, DcpTensor> tensors;
  std::map<std::string, DcpStorage> byte_items;
  /// planner_data: each flattened key's path in the nested state dict ({"model": {"a.weight": t}}
  /// gives "model.a.weight" -> ["model", "a.weight"]); list indices as decimal strings. Empty when
  /// the writer did not record it.
  std::map<std::string, std::vector<std::string>> paths;
  /// Metadata.version ("1.0.0" in torch 2.13), empty for older writers.
  std::string version;
  /// StorageMeta.save_id: the save's identity (Note [save identity], src/checkpoint/
  /// save_identity.h); empty when the writer recorded none.
  std::string save_id;
};

/// Parses `.metadata` bytes; `source` names the file in errors.
DcpMetadata parse_dcp_metadata(const uint8_t* data, size_t size, const std::string& source);
/// Reads `directory`/.metadata (a regular file of at most 1 GiB).
DcpMetadata read_dcp_metadata(const std::string& directory);
/// The name of `dtype`'s global `torch.<name>` in TensorProperties ("float32"); an error for a dtype
/// DCP does not hold.
std::string dcp_dtype_name(c10::ScalarType dtype);
/// Whether `directory` holds a `.metadata` file (a DCP checkpoint).
bool is_dcp_directory(const std::string& directory);

}  // namespace fsdp::detail
