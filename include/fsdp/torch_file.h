// Files in PyTorch's torch.save format (a zip of a pickle and raw storages), for `.bin` checkpoints.
//
// Writing uses libtorch's own pickler, whose output Python's torch.load reads; reading accepts those
// files and Python's torch.save of plain dicts, lists, tuples, numbers, strings and tensors
// (tests/io/tensor_files_crosscheck_test.cpp). What libtorch 2.13's unpickler cannot read, an
// OrderedDict (which model.state_dict() returns) and tensors torch.save writes with
// _rebuild_tensor_v3 (float8, uint16/32/64), is read through the restricted unpickler (Note [torch
// files through the restricted unpickler], src/io/torch_file.cpp).
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/core/ivalue.h>

#include <functional>
#include <string>
#include <utility>
#include <vector>

namespace fsdp {

/// Writes `value` atomically (temporary name, fsync, rename), loadable by torch.load(weights_only=True).
/// Tensors must have a dtype torch.save writes with a legacy storage class (float64/32/16, bf16,
/// int64/32/16/8, uint8, bool, complex); others (float8, uint16/32/64) are an error naming the dtype.
void save_torch_file(const std::string& path, const c10::IValue& value);
/// Reads a torch.save file. Errors name the file.
c10::IValue load_torch_file(const std::string& path);
/// The same for a torch.save archive in memory (an item of a DCP .distcp file); `source` names it.
c10::IValue load_torch_bytes(const std::vector<char>& bytes, const std::string& source);

/// A tensor with a shape and dtype but no data: describes a file's structure for save_torch_file_streaming.
at::Tensor placeholder_tensor(const std::vector<int64_t>& shape, c10::ScalarType dtype);

/// Writes `value` like save_torch_file, except that every tensor in it is a placeholder whose data
/// `materialize(placeholder)` returns when that tensor is written, one at a time: only one tensor's
/// data is ever in memory.
void save_torch_file_streaming(const std::string& path, const c10::IValue& value,
                               const std::function<at::Tensor(const at::Tensor& placeholder)>& materialize);

/// The torch.save archive of `value` (tensors as they are, each with a storage of exactly its own
/// elements) to `sink`, in pieces: what one item of a DCP `.distcp` file is. `source` names the
/// output in errors.
void write_torch_archive(const c10::IValue& value, const std::function<void(const void* data, size_t size)>& sink,
                         const std::string& source);

namespace detail {
// For the checkpoint layer (Accelerate's FSDP1 LOCAL_STATE_DICT files), not a user API.

/// One local shard of a torch.distributed ShardedTensor: its tensor and where it lies in the whole.
struct ShardedTensorShard {
  at::Tensor tensor;
  std::vector<int64_t> offsets;
  std::vector<int64_t> sizes;
};
struct ShardedTensorEntry {
  std::vector<int64_t> size;  ///< the whole tensor's
  std::vector<ShardedTensorShard> local_shards;
};
/// A torch.save'd state dict whose values are tensors or ShardedTensors (what FSDP1's
/// LOCAL_STATE_DICT model.state_dict() is), read through the restricted unpickler (Note [torch
/// files through the restricted unpickler]): the plain tensors and the ShardedTensors, each in file
/// order. Anything else in the dict is an error naming the file and the entry.
struct StateDictWithShardedTensors {
  std::vector<std::pair<std::string, at::Tensor>> tensors;
  std::vector<std::pair<std::string, ShardedTensorEntry>> sharded;
};
StateDictWithShardedTensors load_state_dict_with_sharded_tensors(const std::string& path);
/// The same for the file's bytes in memory; `source` names them in errors.
StateDictWithShardedTensors state_dict_with_sharded_tensors_from_bytes(const std::vector<char>& bytes,
                                                                       const std::string& source);
}  // namespace detail

/// A dict {name: tensor} in the given order.
c10::IValue tensor_dict(const std::vector<std::pair<std::string, at::Tensor>>& tensors);
/// The entries of a {name: tensor} dict; `source` names the file in errors.
std::vector<std::pair<std::string, at::Tensor>> tensor_dict_items(const c10::IValue& value, const std::string& source);

}  // namespace fsdp
