#include <ATen/ATen.h>
#include <fsdp/collectives.h>
#include <fsdp/sharded_checkpoint.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>

#include "dist/agreement.h"
#include "dist/control_channel.h"
#include "io/atomic_file.h"
#include "io/read_only_file.h"

namespace fsdp {

const char* const kShardedMetadataFile = "metadata.json";

namespace {

constexpr const char* kFormatName = "fsdp.cpp sharded checkpoint";
constexpr int64_t kFormatVersion = 1;

std::string rank_file_name(int64_t rank) {
  char name[64];
  std::snprintf(name, sizeof(name), "rank_%05lld.safetensors", static_cast<long long>(rank));
  return name;
}

int64_t rows_of(const std::vector<int64_t>& shape) { return shape.empty() ? 1 : shape[0]; }

void write_metadata(const std::string& directory, const ShardedTensorList& tensors,
                    const std::vector<std::string>& all_chunks, int64_t world_size, const std::string& extra_json);

/// Chunk files are named by the writer's pattern; anything else (a path, "..") is refused.
bool is_rank_file_name(const std::string& name) {
  if (name.size() != std::string("rank_00000.safetensors").size() || name.rfind("rank_", 0) != 0) return false;
  for (size_t index = 5; index < 10; ++index) {
    if (!std::isdigit(static_cast<unsigned char>(name[index]))) return false;
  }
  return name.compare(10, std::string::npos, ".safetensors") == 0;
}

}  // namespace

void write_sharded_directory(const std::string& directory, const ShardedTensorList& tensors,
                             const DistributedContext& context, const std::string& extra_json) {
  std::filesystem::create_directories(directory);
  const int64_t rank = context.rank();
  const auto file = rank_file_name(rank);
  std::vector<std::pair<std::string, at::Tensor>> local;
  nlohmann::json chunks = nlohmann::json::object();
  for (const auto& [name, tensor] : tensors) {
    if ((tensor.replicated && rank != 0) || tensor.duplicate) continue;
    if (tensor.global_shape.empty()) {
      // A 0-dim tensor is one row, held whole by one rank; the others hold an empty shard.
      if (tensor.local.numel() == 0) continue;
      local.emplace_back(name, tensor.local.reshape({}).contiguous());
      chunks[name] = {{"file", file}, {"row_offset", 0}, {"rows", 1}};
      continue;
    }
    local.emplace_back(name, tensor.local.contiguous());
    const int64_t rows = tensor.replicated ? rows_of(tensor.global_shape) : tensor.local.size(0);
    chunks[name] = {{"file", file}, {"row_offset", tensor.replicated ? 0 : tensor.row_offset}, {"rows", rows}};
  }
  // A rank whose write fails says so in place of its chunks, so no rank waits for it.
  std::string report;
  try {
    write_safetensors((std::filesystem::path(directory) / file).string(), local);
    report = chunks.dump();
  } catch (const std::exception& error) {
    report = "ERROR:" + detail::message_of(error);
  }
  // Rank 0 learns every rank's chunks only after each has written its file, so the metadata never
  // describes a file that does not exist yet.
  const auto all_chunks = detail::all_gather_strings(context, report);
  for (size_t other = 0; other < all_chunks.size(); ++other) {
    if (all_chunks[other].rfind("ERROR:", 0) == 0) {
      TORCH_CHECK(false, "writing sharded directory '", directory, "': rank ", other,
                  " failed: ", all_chunks[other].substr(6));
    }
  }
  detail::run_on_every_rank(context, [&] {
    if (rank == 0) write_metadata(directory, tensors, all_chunks, context.world_size(), extra_json);
  });
}

namespace {

void write_metadata(const std::string& directory, const ShardedTensorList& tensors,
                    const std::vector<std::string>& all_chunks, int64_t world_size, const std::string& extra_json) {
  nlohmann::json metadata;
  metadata["format"] = kFormatName;
  metadata["version"] = kFormatVersion;
  metadata["world_size"] = world_size;
  metadata["extra"] = extra_json.empty() ? nlohmann::json::object() : nlohmann::json::parse(extra_json);
  auto entries = nlohmann::json::array();
  std::vector<nlohmann::json> parsed;
  for (const auto& text : all_chunks) parsed.push_back(nlohmann::json::parse(text));
  for (const auto& [name, tensor] : tensors) {
    nlohmann::json entry;
    entry["name"] = name;
    entry["dtype"] = safetensors_dtype_name(tensor.local.scalar_type());
    entry["shape"] = tensor.global_shape;
    auto list = nlohmann::json::array();
    for (const auto& rank_chunks : parsed) {
      if (rank_chunks.contains(name) && rank_chunks[name]["rows"].get<int64_t>() > 0) list.push_back(rank_chunks[name]);
    }
    if (list.empty() && !parsed.empty() && parsed[0].contains(name)) list.push_back(parsed[0][name]);
    entry["chunks"] = list;
    entries.push_back(entry);
  }
  metadata["tensors"] = entries;
  detail::write_file_atomically((std::filesystem::path(directory) / kShardedMetadataFile).string(), metadata.dump(1));
}

}  // namespace

ShardedDirectoryReader::ShardedDirectoryReader(const std::string& directory) : directory_(directory) {
  try {
    open();
  } catch (const nlohmann::json::exception& error) {
    TORCH_CHECK(false, "'", (std::filesystem::path(directory) / kShardedMetadataFile).string(),
                "' does not describe a sharded checkpoint (", error.what(), ")");
  }
}

void ShardedDirectoryReader::open() {
  const std::string& directory = directory_;
  const auto metadata_path = std::filesystem::path(directory) / kShardedMetadataFile;
  // It lists every tensor's pieces: a few megabytes for the largest models.
  const auto file =
      detail::ReadOnlyFile::open_if_exists(metadata_path.string(), uint64_t{1} << 30, "sharded checkpoint metadata",
                                           "the directory is not a sharded checkpoint");
  if (!file && std::filesystem::exists(std::filesystem::path(directory) / ".metadata")) {
    TORCH_CHECK(false, "'", directory,
                "' is a PyTorch DCP checkpoint (.metadata and .distcp files), not the rank-file ",
                "format this reader takes (docs/checkpoint-format.md). load_checkpoint, Accelerator::load_state and "
                "`fsdp merge-weights` read both and choose by the files they find: use one of them");
  }
  TORCH_CHECK(file, "sharded checkpoint directory '", directory, "' has no ", kShardedMetadataFile,
              ": it is not a checkpoint directory, or its save did not finish");
  nlohmann::json metadata;
  try {
    metadata = nlohmann::json::parse(file->read_text());
  } catch (const nlohmann::json::exception& error) {
    TORCH_CHECK(false, "'", metadata_path.string(), "' is not valid JSON (", error.what(), ")");
  }
  auto fail = [&](const std::string& what) { TORCH_CHECK(false, "'", metadata_path.string(), "': ", what); };
  if (!metadata.is_object() || !metadata.contains("format") || metadata["format"] != kFormatName) {
    fail("not an fsdp.cpp sharded checkpoint");
  }
  if (!metadata.contains("version") || metadata["version"] != kFormatVersion) {
    fail("format version " + (metadata.contains("version") ? metadata["version"].dump() : std::string("(none)")) +
         ", this build reads version 1");
  }
  if (!metadata.contains("world_size") || !metadata["world_size"].is_number_integer()) fail("no world_size");
  world_size_ = metadata["world_size"].get<int64_t>();
  // The rank files are probed one by one below, and their names have five digits: a world_size of
  // 10^12 would hang the reader (found by fuzz/sharded_metadata_fuzz.cpp), and one below 1 would
  // skip the check that the metadata lists everything the files hold.
  if (world_size_ < 1 || world_size_ > 100000) {
    fail("world_size " + std::to_string(world_size_) + " is not between 1 and 100000");
  }
  // nlohmann's get<int64_t> truncates 6.5 to 6, and a number beyond int64's range is undefined
  // behavior there (found by fuzz/sharded_metadata_fuzz.cpp): integers must be written as integers.
  auto integer = [&](const nlohmann::json& value, const std::string& what) {
    if (!value.is_number_integer()) fail(what + " is " + value.dump() + ", not an integer");
    return value.get<int64_t>();
  };
  if (metadata.contains("extra")) extra_json_ = metadata["extra"].dump();
  if (!metadata.contains("tensors") || !metadata["tensors"].is_array()) fail("no tensor list");
  for (const auto& item : metadata["tensors"]) {
    if (!item.is_object() || !item.contains("name") || !item["name"].is_string() || !item.contains("shape") ||
        !item.contains("chunks") || !item.contains("dtype")) {
      fail("malformed tensor entry " + item.dump());
    }
    const auto name = item["name"].get<std::string>();
    // A second entry would replace the first and list the name twice (found by
    // fuzz/sharded_metadata_fuzz.cpp).
    if (tensors_.count(name)) fail("tensor '" + name + "' is listed twice");
    Entry entry;
    if (!item["dtype"].is_string()) fail("tensor '" + name + "' has dtype " + item["dtype"].dump() + ", not a string");
    entry.dtype = item["dtype"].get<std::string>();
    try {
      (void)safetensors_scalar_type(entry.dtype);
    } catch (const c10::Error&) {
      fail("tensor '" + name + "' has dtype '" + entry.dtype +
           "', which is not a dtype fsdp.cpp writes (F64, F32, F16, BF16, I64, I32, I16, I8, U8, BOOL, ...)");
    }
    if (!item["shape"].is_array()) fail("tensor '" + name + "' has shape " + item["shape"].dump() + ", not a list");
    for (const auto& extent : item["shape"]) {
      entry.shape.push_back(integer(extent, "tensor '" + name + "' has a size that"));
    }
    TORCH_CHECK(entry.shape.size() <= 64, "'", metadata_path.string(), "': tensor '", name, "' has ",
                entry.shape.size(), " dimensions");
    for (auto extent : entry.shape) {
      if (extent < 0 || extent > (int64_t{1} << 48)) fail("tensor '" + name + "' has an impossible size");
    }
    for (const auto& chunk : item["chunks"]) {
      Chunk parsed{chunk.at("file").get<std::string>(),
                   integer(chunk.at("row_offset"), "tensor '" + name + "' has a row_offset that"),
                   integer(chunk.at("rows"), "tensor '" + name + "' has a rows count that")};
      if (!is_rank_file_name(parsed.file))
        fail("tensor '" + name + "' names file '" + parsed.file + "', not a rank file");
      if (parsed.row_offset < 0 || parsed.rows < 0 || parsed.row_offset > rows_of(entry.shape) ||
          parsed.rows > rows_of(entry.shape) - parsed.row_offset) {
        fail("tensor '" + name + "' has a chunk outside its rows");
      }
      entry.chunks.push_back(parsed);
    }
    std::sort(entry.chunks.begin(), entry.chunks.end(),
              [](const Chunk& left, const Chunk& right) { return left.row_offset < right.row_offset; });
    int64_t covered = 0;
    for (const auto& chunk : entry.chunks) {
      if (chunk.row_offset != covered) {
        fail("tensor '" + name + "' has rows " + std::to_string(covered) + ".." + std::to_string(chunk.row_offset) +
             (chunk.row_offset > covered ? " in no file" : " in two files"));
      }
      covered += chunk.rows;
      if (!files_.count(chunk.file)) {
        const auto path = std::filesystem::path(directory) / chunk.file;
        TORCH_CHECK(std::filesystem::exists(path), "sharded checkpoint directory '", directory, "' lacks '", chunk.file,
                    "' (it was written by ", world_size_, " ranks); the checkpoint is incomplete");
        files_[chunk.file] = std::make_shared<SafetensorsReader>(path.string());
      }
      const auto* info = files_[chunk.file]->header().find(name);
      TORCH_CHECK(info, "'", chunk.file, "' in '", directory, "' has no tensor '", name, "' although ",
                  kShardedMetadataFile, " says it does");
      auto expected_shape = entry.shape;
      if (!expected_shape.empty()) expected_shape[0] = chunk.rows;
      TORCH_CHECK(info->shape == expected_shape && info->dtype == entry.dtype, "'", chunk.file, "' in '", directory,
                  "' holds '", name, "' as ", info->dtype, " ", c10::str(c10::IntArrayRef(info->shape)), " but ",
                  kShardedMetadataFile, " says ", entry.dtype, " ", c10::str(c10::IntArrayRef(expected_shape)),
                  " for its rows there; the directory mixes files of different saves");
    }
    if (covered != rows_of(entry.shape)) {
      fail("tensor '" + name + "' covers " + std::to_string(covered) + " of its " +
           std::to_string(rows_of(entry.shape)) + " rows");
    }
    names_.push_back(name);
    tensors_[name] = std::move(entry);
  }
  // Every byte of every rank file must be accounted for by the metadata: a metadata.json that lists
  // fewer tensors than the files hold (an interrupted save, files mixed from two saves) would
  // otherwise merge or load part of the checkpoint without a word, and a merge with
  // --remove-checkpoint-dir would then delete the rest.
  std::set<std::pair<std::string, std::string>> listed;
  for (const auto& [name, entry] : tensors_) {
    for (const auto& chunk : entry.chunks) listed.emplace(chunk.file, name);
  }
  for (int64_t rank = 0; rank < world_size_; ++rank) {
    const auto file_name = rank_file_name(rank);
    const auto path = std::filesystem::path(directory) / file_name;
    if (!files_.count(file_name)) {
      if (!std::filesystem::exists(path)) continue;  // a rank that held nothing writes no file
      files_[file_name] = std::make_shared<SafetensorsReader>(path.string());
    }
    for (const auto& info : files_[file_name]->header().tensors) {
      // A rank that owns no rows of a tensor writes it empty, and the metadata leaves it out.
      if (info.end == info.begin) continue;
      TORCH_CHECK(listed.count({file_name, info.name}), "'", file_name, "' in '", directory, "' holds tensor '",
                  info.name, "', which ", kShardedMetadataFile, " does not list (it lists ", tensors_.size(),
                  " tensors): the metadata and the rank files disagree, so the directory is not one complete save. "
                  "Nothing was read; use another checkpoint");
    }
  }
}

const ShardedDirectoryReader::Entry& ShardedDirectoryReader::entry(const std::string& name) const {
  auto found = tensors_.find(name);
  TORCH_CHECK(found != tensors_.end(), description(), " has no tensor '", name, "'");
  return found->second;
}

bool ShardedDirectoryReader::contains(const std::string& name) const { return tensors_.count(name) > 0; }

std::vector<int64_t> ShardedDirectoryReader::shape(const std::string& name) const { return entry(name).shape; }

std::string ShardedDirectoryReader::dtype(const std::string& name) const { return entry(name).dtype; }

void ShardedDirectoryReader::read_rows(const std::string& name, int64_t row_begin, int64_t row_count,
                                       void* destination) const {
  const auto& found = entry(name);
  if (found.shape.empty()) {
    files_.at(found.chunks.at(0).file)->read_rows(name, 0, 1, destination);
    return;
  }
  auto* output = static_cast<char*>(destination);
  const int64_t row_end = row_begin + row_count;
  for (const auto& chunk : found.chunks) {
    const int64_t begin = std::max(row_begin, chunk.row_offset);
    const int64_t end = std::min(row_end, chunk.row_offset + chunk.rows);
    if (begin >= end) continue;
    const auto& file = *files_.at(chunk.file);
    file.read_rows(name, begin - chunk.row_offset, end - begin, output + (begin - row_begin) * file.row_bytes(name));
  }
}

at::Tensor ShardedDirectoryReader::rows(const std::string& name, int64_t row_begin, int64_t row_count) const {
  const auto& found = entry(name);
  if (found.shape.empty()) return files_.at(found.chunks.at(0).file)->tensor(name);
  std::vector<at::Tensor> pieces;
  const int64_t row_end = row_begin + row_count;
  for (const auto& chunk : found.chunks) {
    const int64_t begin = std::max(row_begin, chunk.row_offset);
    const int64_t end = std::min(row_end, chunk.row_offset + chunk.rows);
    if (begin >= end) continue;
    pieces.push_back(files_.at(chunk.file)->rows(name, begin - chunk.row_offset, end - begin));
  }
  if (pieces.empty()) {
    auto shape = found.shape;
    shape[0] = 0;
    return at::empty(shape, at::TensorOptions().dtype(safetensors_scalar_type(found.dtype)));
  }
  return pieces.size() == 1 ? pieces.front() : at::cat(pieces);
}

}  // namespace fsdp
