#include "checkpoint/dcp_reader.h"

#include <ATen/ATen.h>

#include <cstring>
#include <filesystem>
#include <fstream>

#include <fsdp/safetensors.h>
#include <fsdp/torch_file.h>

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

at::Tensor DcpDirectoryReader::load_chunk(const std::string& key, const DcpTensor& tensor, size_t chunk_index) const {
  const auto& chunk = tensor.chunks[chunk_index];
  const auto& storage = chunk.storage;
  const auto path = (fs::path(directory_) / storage.relative_path).string();
  const std::string item = "'" + path + "' bytes " + std::to_string(storage.offset) + "+" + std::to_string(storage.length) +
                           " (chunk of '" + key + "' at offsets " + c10::str(chunk.offsets) + ")";
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
  const auto value = load_torch_bytes(bytes, item);
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
