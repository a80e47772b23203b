#include <fsdp/torch_file.h>

#include <c10/util/Exception.h>
#include <torch/csrc/jit/serialization/pickle.h>

#include <fstream>
#include <iterator>

#include "io/atomic_file.h"

namespace fsdp {

void save_torch_file(const std::string& path, const c10::IValue& value) {
  const std::vector<char> bytes = torch::pickle_save(value);
  detail::write_file_atomically(path, [&](const detail::ByteSink& sink) { sink(bytes.data(), bytes.size()); });
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
