#include <fsdp/torch_file.h>

#include <c10/util/Exception.h>
#include <caffe2/serialize/inline_container.h>
#include <torch/csrc/jit/serialization/pickle.h>
#include <torch/csrc/jit/serialization/pickler.h>

#include <fstream>
#include <iterator>

#include "io/atomic_file.h"

namespace fsdp {

void save_torch_file(const std::string& path, const c10::IValue& value) {
  const std::vector<char> bytes = torch::pickle_save(value);
  detail::write_file_atomically(path, [&](const detail::ByteSink& sink) { sink(bytes.data(), bytes.size()); });
}

at::Tensor placeholder_tensor(const std::vector<int64_t>& shape, c10::ScalarType dtype) {
  // The pickler reads shapes, strides and storage sizes, never the bytes: any address will do, and
  // each placeholder gets its own storage so none is mistaken for another's view.
  static char no_data = 0;
  return at::from_blob(&no_data, shape, [](void*) {}, at::TensorOptions().dtype(dtype));
}

void save_torch_file_streaming(const std::string& path, const c10::IValue& value,
                               const std::function<at::Tensor(const at::Tensor& placeholder)>& materialize) {
  std::vector<char> pickle;
  torch::jit::Pickler pickler([&](const char* bytes, size_t size) { pickle.insert(pickle.end(), bytes, bytes + size); },
                              nullptr, nullptr, nullptr);
  pickler.protocol();
  pickler.pushIValue(value);
  pickler.stop();
  const auto placeholders = pickler.tensorData();
  detail::write_file_atomically(path, [&](const detail::ByteSink& sink) {
    caffe2::serialize::PyTorchStreamWriter writer([&](const void* bytes, size_t size) -> size_t {
      sink(bytes, size);
      return size;
    });
    // The record layout of torch::pickle_save (jit::writeArchiveAndTensors): data/<i>, then data.pkl.
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
  });
}

c10::IValue load_torch_file(const std::string& path) {
  std::ifstream file(path, std::ios::binary);
  TORCH_CHECK(file, "cannot open torch file '", path, "'");
  std::vector<char> bytes((std::istreambuf_iterator<char>(file)), std::istreambuf_iterator<char>());
  try {
    return torch::pickle_load(bytes);
  } catch (const c10::Error& error) {
    TORCH_CHECK(false, "cannot read torch file '", path, "' (", bytes.size(), " bytes): ", error.what_without_backtrace(),
                ". Expected a torch.save zip of plain dicts, lists and tensors (save dict(state_dict) from Python)");
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
