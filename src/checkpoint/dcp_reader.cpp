#include "checkpoint/dcp_reader.h"

#include <ATen/ATen.h>

#include <cstring>
#include <filesystem>
#include <fstream>

#include <fsdp/safetensors.h>
#include <fsdp/torch_file.h>

#include <nlohmann/json.hpp>

#include "checkpoint/optimizer_state.h"

namespace fsdp::detail {
namespace {

namespace fs = std::filesystem;

std::string join(const std::vector<std::string>& parts, size_t first) {
  std::string text;
  for (size_t index = first; index < parts.size(); ++index) text += (index > first ? "." : "") + parts[index];
  return text;
}

}  // namespace

DcpDirectoryReader::DcpDirectoryReader(const std::string& directory, bool unwrap_single_key)
    : directory_(directory), metadata_(read_dcp_metadata(directory)) {
  // Accelerate's merge: the state dict rebuilt from planner_data, unwrapped when it has one key.
  std::string top;
  bool single = unwrap_single_key && !metadata_.paths.empty();
  for (const auto& key : metadata_.keys) {
    auto path = metadata_.paths.find(key);
    if (path == metadata_.paths.end() || path->second.size() < 2) {
      single = false;
      break;
    }
    if (top.empty()) top = path->second[0];
    single = single && path->second[0] == top;
  }
  for (const auto& key : metadata_.keys) {
    if (metadata_.byte_items.count(key)) {
      byte_item_keys_.push_back(key);
      continue;
    }
    const std::string name = single ? join(metadata_.paths.at(key), 1) : key;
    TORCH_CHECK(keys_.emplace(name, key).second, "'", directory_, "': two entries would both be named '", name, "'");
    names_.push_back(name);
  }
  check_files();
}

void DcpDirectoryReader::check_files() const {
  // Every file the metadata names is there, a regular file, and long enough for its items, before
  // anything is loaded: a missing rank's file is named here, not half way through a load.
  std::map<std::string, int64_t> sizes;
  auto check = [&](const DcpStorage& storage, const std::string& key) {
    if (storage.length < 0) return;  // an empty chunk without an item
    auto found = sizes.find(storage.relative_path);
    if (found == sizes.end()) {
      const auto path = fs::path(directory_) / storage.relative_path;
      std::error_code error;
      TORCH_CHECK(fs::is_regular_file(fs::symlink_status(path, error)), "'", directory_, "' lacks '",
                  storage.relative_path, "', which its .metadata names for '", key,
                  "' (or it is not a regular file): the checkpoint is incomplete, or a rank's file was removed");
      const auto size = static_cast<int64_t>(fs::file_size(path, error));
      TORCH_CHECK(!error, "'", path.string(), "' cannot be read: ", error.message());
      found = sizes.emplace(storage.relative_path, size).first;
    }
    TORCH_CHECK(storage.offset <= found->second && storage.length <= found->second - storage.offset, item_name(storage),
                " (item '", key, "') runs past the end of the file (", found->second,
                " bytes): the file is truncated or belongs to another save");
  };
  for (const auto& [key, tensor] : metadata_.tensors) {
    for (const auto& chunk : tensor.chunks) check(chunk.storage, key);
  }
  for (const auto& [key, storage] : metadata_.byte_items) check(storage, key);
}

const DcpTensor& DcpDirectoryReader::tensor(const std::string& name) const {
  auto found = keys_.find(name);
  TORCH_CHECK(found != keys_.end(), description(), " has no tensor '", name, "'");
  return metadata_.tensors.at(found->second);
}

bool DcpDirectoryReader::contains(const std::string& name) const { return keys_.count(name) > 0; }

std::vector<int64_t> DcpDirectoryReader::shape(const std::string& name) const { return tensor(name).size; }

c10::ScalarType DcpDirectoryReader::scalar_type(const std::string& name) const { return tensor(name).dtype; }

std::string DcpDirectoryReader::dtype(const std::string& name) const { return safetensors_dtype_name(tensor(name).dtype); }

c10::IValue DcpDirectoryReader::load_item(const DcpStorage& storage, const std::string& key, const std::string& item) const {
  const auto path = (fs::path(directory_) / storage.relative_path).string();
  std::error_code error;
  TORCH_CHECK(fs::is_regular_file(fs::symlink_status(path, error)), "'", directory_, "': '", storage.relative_path,
              "', which the metadata names for '", key, "', is not a regular file in the directory: the checkpoint is incomplete");
  const auto file_size = static_cast<int64_t>(fs::file_size(path, error));
  TORCH_CHECK(!error && storage.offset <= file_size && storage.length <= file_size - storage.offset, item,
              " runs past the end of the file (", file_size, " bytes): the file is truncated or belongs to another save");
  std::ifstream file(path, std::ios::binary);
  file.seekg(storage.offset);
  std::vector<char> bytes(static_cast<size_t>(storage.length));
  file.read(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  TORCH_CHECK(file.gcount() == static_cast<std::streamsize>(bytes.size()), item, " could not be read");
  return load_torch_bytes(bytes, item);
}

std::string DcpDirectoryReader::item_name(const DcpStorage& storage) const {
  return "'" + (fs::path(directory_) / storage.relative_path).string() + "' bytes " + std::to_string(storage.offset) + "+" +
         std::to_string(storage.length);
}

c10::IValue DcpDirectoryReader::byte_item(const std::string& key) const {
  auto found = metadata_.byte_items.find(key);
  TORCH_CHECK(found != metadata_.byte_items.end(), description(), " has no byte item '", key, "'");
  return load_item(found->second, key, item_name(found->second) + " (byte item '" + key + "')");
}

bool DcpDirectoryReader::has_byte_item(const std::string& key) const { return metadata_.byte_items.count(key) > 0; }

at::Tensor DcpDirectoryReader::load_chunk(const std::string& key, const DcpTensor& tensor, size_t chunk_index) const {
  const auto& chunk = tensor.chunks[chunk_index];
  const std::string item = item_name(chunk.storage) + " (chunk of '" + key + "' at offsets " + c10::str(chunk.offsets) + ")";
  const auto value = load_item(chunk.storage, key, item);
  TORCH_CHECK(value.isTensor(), item, " holds a ", value.tagKind(), ", not a tensor");
  auto loaded = value.toTensor();
  TORCH_CHECK(loaded.scalar_type() == tensor.dtype && loaded.sizes() == at::IntArrayRef(chunk.sizes), item, " holds a ",
              loaded.scalar_type(), " tensor of shape ", loaded.sizes(), ", but the metadata says ", tensor.dtype, " ",
              c10::str(chunk.sizes));
  return loaded.contiguous();
}

std::vector<int64_t> DcpDirectoryReader::block_sizes(const std::string& name, int64_t row_begin, int64_t row_count) const {
  const auto& entry = tensor(name);
  if (entry.size.empty()) {
    TORCH_CHECK(entry.chunks.size() == 1, description(), ": scalar '", name, "' has ", entry.chunks.size(), " chunks");
    return {};
  }
  TORCH_CHECK(row_begin >= 0 && row_count >= 0 && row_begin + row_count <= entry.size[0], description(), ": rows ",
              row_begin, "+", row_count, " of '", name, "', which has ", entry.size[0]);
  auto sizes = entry.size;
  sizes[0] = row_count;
  return sizes;
}

at::Tensor DcpDirectoryReader::rows(const std::string& name, int64_t row_begin, int64_t row_count) const {
  const auto sizes = block_sizes(name, row_begin, row_count);
  if (sizes.empty()) return load_chunk(keys_.at(name), tensor(name), 0);
  auto result = at::empty(sizes, at::TensorOptions().dtype(tensor(name).dtype));
  fill_rows(name, row_begin, result);
  return result;
}

void DcpDirectoryReader::read_rows(const std::string& name, int64_t row_begin, int64_t row_count, void* destination) const {
  const auto sizes = block_sizes(name, row_begin, row_count);
  const auto options = at::TensorOptions().dtype(tensor(name).dtype);
  if (sizes.empty()) {
    const auto scalar = load_chunk(keys_.at(name), tensor(name), 0);
    std::memcpy(destination, scalar.data_ptr(), static_cast<size_t>(scalar.element_size()));
    return;
  }
  // The chunks are copied straight into the caller's buffer.
  auto result = at::from_blob(destination, sizes, options);
  fill_rows(name, row_begin, result);
}

void DcpDirectoryReader::fill_rows(const std::string& name, int64_t row_begin, at::Tensor& result) const {
  const auto& key = keys_.at(name);
  const auto& entry = tensor(name);
  const auto& sizes = result.sizes();
  const int64_t row_count = sizes[0];
  for (size_t index = 0; index < entry.chunks.size(); ++index) {
    const auto& chunk = entry.chunks[index];
    const int64_t first = std::max(row_begin, chunk.offsets[0]);
    const int64_t last = std::min(row_begin + row_count, chunk.offsets[0] + chunk.sizes[0]);
    if (first >= last) continue;
    int64_t numel = 1;
    for (const auto size : chunk.sizes) numel *= size;
    if (numel == 0) continue;
    at::Tensor loaded;
    {
      std::lock_guard<std::mutex> lock(cache_mutex_);
      if (!cached_.defined() || cached_key_ != key || cached_chunk_ != index) {
        cached_ = at::Tensor();  // the previous chunk goes before the next one comes
        cached_ = load_chunk(key, entry, index);
        cached_key_ = key;
        cached_chunk_ = index;
      }
      loaded = cached_;
    }
    auto target = result.narrow(0, first - row_begin, last - first);
    for (size_t dim = 1; dim < sizes.size(); ++dim) target = target.narrow(static_cast<int64_t>(dim), chunk.offsets[dim], chunk.sizes[dim]);
    target.copy_(loaded.narrow(0, first - chunk.offsets[0], last - first));
  }
}

}  // namespace fsdp::detail

namespace fsdp::detail {

DcpParamGroups dcp_param_groups(const DcpDirectoryReader& reader, const std::string& expected_type) {
  const auto& metadata = reader.metadata();
  auto groups = nlohmann::json::array();
  std::vector<bool> seen;
  auto group_at = [&](size_t index) -> nlohmann::json& {
    TORCH_CHECK(index < 4096, reader.description(), ": parameter group ", index, " is past any optimizer's");
    while (groups.size() <= index) groups.push_back(nlohmann::json::object());
    return groups[index];
  };
  for (const auto& key : reader.byte_item_keys()) {
    auto found = metadata.paths.find(key);
    TORCH_CHECK(found != metadata.paths.end(), reader.description(), ": byte item '", key,
                "' has no path in the metadata's planner_data, so its place in the optimizer state is unknown");
    const auto& path = found->second;
    // The path below the single top-level key ("optimizer"), when there is one.
    size_t first = (!path.empty() && path[0] == "param_groups") ? 0 : 1;
    TORCH_CHECK(path.size() > first && path[first] == "param_groups", reader.description(), ": byte item '", key,
                "' is not a parameter group option; fsdp.cpp restores optimizer state held in tensors and the "
                "parameter groups only");
    const auto where = reader.description() + " item '" + key + "'";
    if (path.size() == first + 1) {
      // Older writers: the whole list of groups in one item.
      const auto value = reader.byte_item(key);
      TORCH_CHECK(value.isList(), where, " is a ", value.tagKind(), ", expected the list of parameter groups");
      size_t index = 0;
      for (const auto& element : value.toList()) {
        const c10::IValue group = element;
        TORCH_CHECK(group.isGenericDict(), where, ": group ", index, " is a ", group.tagKind(), ", expected a dict");
        auto& target = group_at(index);
        for (const auto& entry : group.toGenericDict()) {
          TORCH_CHECK(entry.key().isString(), where, ": group ", index, " has a key that is not a string");
          const auto& option = entry.key().toStringRef();
          target[option] = param_group_value_json(entry.value(), where + " option '" + option + "'");
        }
        ++index;
      }
      continue;
    }
    TORCH_CHECK(path.size() == first + 3, where, " has path of ", path.size(), " elements; expected ",
                "param_groups.<index>.<option>");
    size_t index = 0;
    try {
      size_t used = 0;
      index = std::stoul(path[first + 1], &used);
      TORCH_CHECK(used == path[first + 1].size(), "");
    } catch (const std::exception&) {
      TORCH_CHECK(false, where, ": '", path[first + 1], "' is not a parameter group index");
    }
    group_at(index)[path[first + 2]] = param_group_value_json(reader.byte_item(key), where);
  }
  TORCH_CHECK(!groups.empty(), reader.description(), " holds no parameter groups: it is not an optimizer checkpoint");
  DcpParamGroups result;
  for (size_t index = 0; index < groups.size(); ++index) {
    const auto& group = groups[index];
    TORCH_CHECK(group.contains("params"), reader.description(), ": parameter group ", index,
                " lacks 'params' (the names of its parameters)");
    auto type = optimizer_type_of_param_group(group);
    TORCH_CHECK(!type.empty(), reader.description(), ": parameter group ", index, " has options ", group.dump(),
                ", which are none of AdamW, Adam, SGD, Adagrad and RMSprop");
    if (type == "AdamW" && !group.contains("decoupled_weight_decay") && expected_type == "Adam") type = "Adam";
    TORCH_CHECK(result.optimizer.empty() || result.optimizer == type, reader.description(), ": parameter group ", index,
                " is ", type, "'s but group 0 is ", result.optimizer, "'s");
    result.optimizer = type;
    check_pytorch_only_options(type, group, reader.description());
  }
  result.json = groups.dump();
  return result;
}

}  // namespace fsdp::detail
