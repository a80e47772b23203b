// Any bytes as a torch.save file, through load_torch_bytes (load_torch_file reads the whole file and
// calls it) and through state_dict_with_sharded_tensors_from_bytes (FSDP1's LOCAL_STATE_DICT files): a value in which
// every tensor lies inside its storage and every storage's bytes can be read, or a c10::Error; anything else (a crash,
// a sanitizer report, an exception of another type, a hang, runaway memory) is a bug.
//
// Random bytes rarely get past the zip layer (miniz checks every record's CRC-32), so an input that
// starts with 'S' is not an archive but its records, which this target archives the way
// save_torch_file does before loading: after the 'S', a 4-byte little-endian length and that many
// bytes of data.pkl, then any number of storages, each a 4-byte length and its bytes (data/0,
// data/1, ...; a length past the end takes the rest). Any other input is loaded as it is.
#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <caffe2/serialize/inline_container.h>
#include <fsdp/torch_file.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <set>
#include <string>
#include <vector>

// libtorch's PyTorchStreamReader leaks miniz's reader state (under 1 KB) when its constructor throws
// after opening the zip directory (a malformed archive); and libtorch's own Unpickler lets a pickle
// put a container inside itself through the memo, a cycle that reference counting never frees (a
// few hundred bytes; fuzz/regressions/torch_file/libtorch_unpickler_cycle). Both are libtorch's,
// not this reader's; the restricted unpickler refuses cycles.
extern "C" const char* __lsan_default_suppressions() {
  return "leak:mz_zip_reader_init\nleak:mz_zip_reader_read_central_dir\nleak:torch::jit::Unpickler::run\n";
}

namespace {

uint32_t read_length(const uint8_t* data, size_t size, size_t& position) {
  uint32_t length = 0;
  for (int byte = 0; byte < 4 && position < size; ++byte) {
    length |= static_cast<uint32_t>(data[position++]) << (8 * byte);
  }
  return std::min<size_t>(length, size - position);
}

std::vector<char> archive_of_records(const uint8_t* data, size_t size) {
  size_t position = 1;
  const uint32_t pickle_length = read_length(data, size, position);
  const uint8_t* pickle = data + position;
  position += pickle_length;
  std::vector<char> archive;
  caffe2::serialize::PyTorchStreamWriter writer([&](const void* bytes, size_t count) -> size_t {
    archive.insert(archive.end(), static_cast<const char*>(bytes), static_cast<const char*>(bytes) + count);
    return count;
  });
  for (int index = 0; position < size; ++index) {
    const uint32_t length = read_length(data, size, position);
    writer.writeRecord("data/" + std::to_string(index), data + position, length);
    position += length;
  }
  writer.writeRecord("data.pkl", pickle, pickle_length);
  writer.writeEndOfFile();
  return archive;
}

// Every tensor must stay inside its storage, which must hold the bytes it claims: code that reads
// the loaded tensors (tensor_dict_items, the model loaders) trusts both.
void check_tensor(const at::Tensor& tensor) {
  if (!tensor.defined() || tensor.layout() != at::kStrided || !tensor.has_storage()) return;
  const auto& storage = tensor.storage();
  const int64_t item = static_cast<int64_t>(tensor.element_size());
  if (tensor.storage_offset() < 0) std::abort();
  if (tensor.numel() > 0) {
    int64_t last = tensor.storage_offset();
    for (int64_t dim = 0; dim < tensor.dim(); ++dim) {
      if (tensor.stride(dim) < 0) std::abort();
      last += (tensor.size(dim) - 1) * tensor.stride(dim);
    }
    if ((last + 1) * item > static_cast<int64_t>(storage.nbytes())) std::abort();
  }
  // Under AddressSanitizer, memcpy checks that the storage's buffer really has nbytes bytes.
  std::vector<char> bytes(storage.nbytes());
  if (!bytes.empty()) std::memcpy(bytes.data(), storage.data(), bytes.size());
}

// Each aggregate once (memo references may share or even nest them), with an explicit stack.
void walk(const c10::IValue& root) {
  std::set<const void*> seen;
  std::vector<c10::IValue> stack{root};
  while (!stack.empty()) {
    const c10::IValue value = std::move(stack.back());
    stack.pop_back();
    if (value.isPtrType() && !seen.insert(value.internalToPointer()).second) continue;
    if (value.isTensor()) {
      check_tensor(value.toTensor());
    } else if (value.isTuple()) {
      for (const auto& element : value.toTupleRef().elements()) stack.push_back(element);
    } else if (value.isList()) {
      for (const auto& element : value.toListRef()) stack.push_back(element);
    } else if (value.isGenericDict()) {
      for (const auto& entry : value.toGenericDict()) {
        stack.push_back(entry.key());
        stack.push_back(entry.value());
      }
    } else if (value.isString()) {
      (void)value.toStringRef().size();
    }
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::vector<char> bytes;
  if (size > 0 && data[0] == 'S') {
    bytes = archive_of_records(data, size);
  } else {
    bytes.assign(reinterpret_cast<const char*>(data), reinterpret_cast<const char*>(data) + size);
  }
  try {
    const auto value = fsdp::load_torch_bytes(bytes, "fuzz input");
    walk(value);
    // What the model loaders do with a file: a dict of named tensors, or a c10::Error saying why not.
    try {
      for (const auto& [name, tensor] : fsdp::tensor_dict_items(value, "fuzz input")) check_tensor(tensor);
    } catch (const c10::Error&) {
    }
  } catch (const c10::Error&) {
  }
  // The same bytes as a state dict of tensors and ShardedTensors (Accelerate's FSDP1 LOCAL_STATE_DICT
  // files), the restricted path with the ShardedTensor classes allowed: every tensor and every shard
  // inside its storage and its shard inside the whole, or a c10::Error.
  try {
    const auto state = fsdp::detail::state_dict_with_sharded_tensors_from_bytes(bytes, "fuzz input");
    for (const auto& [name, tensor] : state.tensors) check_tensor(tensor);
    for (const auto& [name, sharded] : state.sharded) {
      for (const auto& shard : sharded.local_shards) {
        check_tensor(shard.tensor);
        if (shard.offsets.size() != sharded.size.size() || shard.sizes.size() != sharded.size.size()) std::abort();
        for (size_t dim = 0; dim < sharded.size.size(); ++dim) {
          if (shard.offsets[dim] < 0 || shard.sizes[dim] < 0 ||
              shard.offsets[dim] + shard.sizes[dim] > sharded.size[dim]) {
            std::abort();
          }
        }
      }
    }
  } catch (const c10::Error&) {
  }
  return 0;
}
