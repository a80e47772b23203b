#include <fsdp/torch_file.h>

#include <c10/util/Exception.h>
#include <caffe2/serialize/inline_container.h>
#include <torch/csrc/jit/serialization/pickle.h>
#include <torch/csrc/jit/serialization/pickler.h>

#include <filesystem>
#include <fstream>
#include <iterator>

#include "io/atomic_file.h"

namespace fsdp {

namespace {

// The dtypes Python's torch.save writes through a legacy storage class (torch.FloatStorage, ...) and
// _rebuild_tensor_v2, which is what libtorch's pickler writes and what torch.load(weights_only=True)
// accepts. Newer dtypes (float8, uint16/32/64) go through _rebuild_tensor_v3 in Python, which
// libtorch neither writes nor reads.
bool has_legacy_storage_class(c10::ScalarType dtype) {
  switch (dtype) {
    case c10::kDouble:
    case c10::kFloat:
    case c10::kHalf:
    case c10::kBFloat16:
    case c10::kLong:
    case c10::kInt:
    case c10::kShort:
    case c10::kChar:
    case c10::kByte:
    case c10::kBool:
    case c10::kComplexFloat:
    case c10::kComplexDouble:
      return true;
    default:
      return false;
  }
}

}  // namespace

void save_torch_file(const std::string& path, const c10::IValue& value) {
  save_torch_file_streaming(path, value, [](const at::Tensor& tensor) { return tensor; });
}

at::Tensor placeholder_tensor(const std::vector<int64_t>& shape, c10::ScalarType dtype) {
  // The pickler reads shapes, strides and storage sizes, never the bytes: any address will do, and
  // each placeholder gets its own storage so none is mistaken for another's view.
  static char no_data = 0;
  return at::from_blob(&no_data, shape, [](void*) {}, at::TensorOptions().dtype(dtype));
}

namespace {

// The record layout of torch::pickle_save (jit::writeArchiveAndTensors): data/<i>, then data.pkl.
void write_archive(const c10::IValue& value, const std::function<at::Tensor(const at::Tensor& placeholder)>& materialize,
                   const std::function<void(const void* data, size_t size)>& sink, const std::string& source) {
  std::vector<char> pickle;
  // Untagged aggregates: a tagged dict is a call of torch.jit._pickle.restore_type_tag, which
  // torch.load(weights_only=True), the default since PyTorch 2.6, refuses to run.
  torch::jit::Pickler pickler([&](const char* bytes, size_t size) { pickle.insert(pickle.end(), bytes, bytes + size); },
                              nullptr, nullptr, nullptr, nullptr, /*tag_aggregates=*/false);
  pickler.protocol();
  pickler.pushIValue(value);
  pickler.stop();
  const auto placeholders = pickler.tensorData();
  for (const auto& placeholder : placeholders) {
    TORCH_CHECK(has_legacy_storage_class(placeholder.scalar_type()), "torch file '", source, "': a tensor of dtype ",
                placeholder.scalar_type(),
                " cannot be written in torch.save's format by libtorch (Python writes it with _rebuild_tensor_v3, "
                "which libtorch lacks). Save such tensors in safetensors instead, or convert them first.");
  }
  caffe2::serialize::PyTorchStreamWriter writer([&](const void* bytes, size_t size) -> size_t {
    sink(bytes, size);
    return size;
  });
  for (size_t index = 0; index < placeholders.size(); ++index) {
    const auto& placeholder = placeholders[index];
    auto tensor = materialize(placeholder).contiguous();
    TORCH_CHECK(tensor.sizes() == placeholder.sizes() && tensor.scalar_type() == placeholder.scalar_type(),
                "save_torch_file_streaming: tensor ", index, " is ", tensor.sizes(), " ", tensor.scalar_type(),
                " but its placeholder is ", placeholder.sizes(), " ", placeholder.scalar_type());
    writer.writeRecord("data/" + std::to_string(index), tensor.data_ptr(),
                       static_cast<size_t>(tensor.numel() * tensor.element_size()));
  }
  writer.writeRecord("data.pkl", pickle.data(), pickle.size());
  writer.writeEndOfFile();
}

}  // namespace

void save_torch_file_streaming(const std::string& path, const c10::IValue& value,
                               const std::function<at::Tensor(const at::Tensor& placeholder)>& materialize) {
  detail::write_file_atomically(path, [&](const detail::ByteSink& sink) { write_archive(value, materialize, sink, path); });
}

void write_torch_archive(const c10::IValue& value, const std::function<void(const void* data, size_t size)>& sink,
                         const std::string& source) {
  write_archive(value, [](const at::Tensor& tensor) { return tensor; }, sink, source);
}

c10::IValue load_torch_file(const std::string& path) {
  // Only regular files: opening a FIFO would wait for a writer forever.
  std::error_code error;
  TORCH_CHECK(!std::filesystem::exists(path, error) || std::filesystem::is_regular_file(path, error), "torch file '", path,
              "' is not a regular file");
  std::ifstream file(path, std::ios::binary);
  TORCH_CHECK(file, "cannot open torch file '", path, "'");
  std::vector<char> bytes((std::istreambuf_iterator<char>(file)), std::istreambuf_iterator<char>());
  return load_torch_bytes(bytes, path);
}

c10::IValue load_torch_bytes(const std::vector<char>& bytes, const std::string& path) {
  try {
    return torch::pickle_load(bytes);
  } catch (const c10::Error& error) {
    const std::string what = error.what_without_backtrace();
    // libtorch's unpickler turns collections.OrderedDict into None and then fails an internal assert.
    TORCH_CHECK(what.find("Expected GenericDict but got None") == std::string::npos, "cannot read torch file '", path,
                "': it holds an OrderedDict (what model.state_dict() returns), which libtorch's unpickler cannot read; "
                "save dict(state_dict) or a safetensors file instead");
    const bool newer_dtype = what.find("_rebuild_tensor_v3") != std::string::npos;
    TORCH_CHECK(false, "cannot read torch file '", path, "' (", bytes.size(), " bytes): ", what,
                newer_dtype ? ". The file holds a tensor of a dtype torch.save writes with _rebuild_tensor_v3 (float8, "
                              "uint16/32/64), which libtorch cannot read; save it with safetensors instead"
                            : ". Expected a torch.save zip of dicts, lists and tensors");
  }
}

c10::IValue tensor_dict(const std::vector<std::pair<std::string, at::Tensor>>& tensors) {
  c10::Dict<std::string, at::Tensor> dict;
  for (const auto& [name, tensor] : tensors) dict.insert(name, tensor);
  return dict;
}

std::vector<std::pair<std::string, at::Tensor>> tensor_dict_items(const c10::IValue& value, const std::string& source) {
  TORCH_CHECK(value.isGenericDict(), "torch file '", source, "' holds a ", value.tagKind(),
              ", expected a dict of tensors");
  std::vector<std::pair<std::string, at::Tensor>> items;
  for (const auto& entry : value.toGenericDict()) {
    TORCH_CHECK(entry.key().isString(), "torch file '", source, "' has a key of type ", entry.key().tagKind(),
                "; expected tensor names (strings)");
    TORCH_CHECK(entry.value().isTensor(), "torch file '", source, "': entry '", entry.key().toStringRef(), "' is a ",
                entry.value().tagKind(), ", expected a tensor");
    items.emplace_back(entry.key().toStringRef(), entry.value().toTensor());
  }
  return items;
}

}  // namespace fsdp
