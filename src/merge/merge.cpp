#include <ATen/ATen.h>
#include <fsdp/distributed_environment.h>
#include <fsdp/merge.h>
#include <fsdp/safetensors.h>
#include <fsdp/sharded_checkpoint.h>
#include <fsdp/state_dict.h>
#include <fsdp/torch_file.h>

#include <cmath>
#include <filesystem>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>

#include "checkpoint/dcp_metadata.h"
#include "checkpoint/hf_shards.h"
#include "checkpoint/sharded_directory.h"
#include "dist/agreement.h"
#include "dist/control_channel.h"
#include "io/atomic_file.h"

namespace fsdp {
namespace {

namespace fs = std::filesystem;

constexpr int64_t kReadBufferBytes = 64 << 20;

/// The input must be one sharded directory; a checkpoint root is the classic mistake.
/// The directory itself, with a trailing slash or "." components removed.
fs::path normalized(const std::string& directory) {
  auto path = fs::path(directory).lexically_normal();
  if (!path.has_filename()) path = path.parent_path();
  return path;
}

void check_input(const std::string& checkpoint_dir) {
  TORCH_CHECK(fs::exists(checkpoint_dir), "merge: checkpoint directory '", checkpoint_dir, "' does not exist");
  TORCH_CHECK(
      fs::is_directory(checkpoint_dir), "merge: '", checkpoint_dir,
      "' is a file, not a checkpoint directory; give the sharded directory (e.g. CHECKPOINT/pytorch_model_fsdp_0)");
  TORCH_CHECK(!fs::exists(fs::path(checkpoint_dir) / "pytorch_model_fsdp.bin") &&
                  !fs::exists(fs::path(checkpoint_dir) / "pytorch_model_fsdp.safetensors"),
              "merge: '", checkpoint_dir,
              "' is a FULL_STATE_DICT checkpoint: its pytorch_model_fsdp file already holds "
              "the full weights, so there is nothing to merge");
  // Note [sharded directories]: DCP (what fsdp.cpp and Accelerate's FSDP2 save) or rank files.
  const auto format = detail::sharded_directory_format(checkpoint_dir);
  if (format == detail::ShardedFormat::kDcp) return;
  if (format == detail::ShardedFormat::kNone) {
    std::vector<std::string> sharded;
    for (const auto& item : fs::directory_iterator(checkpoint_dir)) {
      if (item.is_directory() &&
          detail::sharded_directory_format(item.path().string()) != detail::ShardedFormat::kNone) {
        sharded.push_back(item.path().filename());
      }
    }
    std::sort(sharded.begin(), sharded.end());
    std::string list;
    for (const auto& name : sharded) list += (list.empty() ? "" : ", ") + name;
    TORCH_CHECK(sharded.empty(), "merge: '", checkpoint_dir,
                "' is a checkpoint, not a sharded directory; merge one of "
                "its sharded directories: ",
                list, " (e.g. '", (fs::path(checkpoint_dir) / sharded.front()).string(), "')");
    TORCH_CHECK(false, "merge: '", checkpoint_dir, "' has no ", kShardedMetadataFile,
                ": it is not a sharded checkpoint directory, or its save did not finish");
  }
  // A directory written by save_checkpoint counts only once the whole checkpoint was marked complete.
  const auto parent = normalized(checkpoint_dir).parent_path();
  if (fs::exists(parent / "random_states_0.pkl") && !fs::exists(parent / "checkpoint_complete.json")) {
    TORCH_CHECK(false, "merge: checkpoint '", parent.string(),
                "' is incomplete (checkpoint_complete.json is missing: "
                "its save did not finish on every rank); merge an earlier checkpoint");
  }
}

using Output = detail::ShardFile;

/// Writes the rows of `name` into `writer`, at most kReadBufferBytes at a time: as ranges of the
/// checkpoint's files copied inside the kernel where the format keeps the rows there as they are
/// (DCP), else read into one buffer and written from it.
void stream_tensor(const detail::ShardedDirectory& reader, const std::string& name, const ByteWriter& writer,
                   const detail::FileRangeWriter& copy, const std::function<void(int64_t)>& advance) {
  const auto shape = reader.shape(name);
  if (shape.empty()) {
    auto tensor = reader.rows(name, 0, 1);
    writer(tensor.data_ptr(), static_cast<size_t>(tensor.numel() * tensor.element_size()));
    advance(tensor.numel() * tensor.element_size());
    return;
  }
  const int64_t row_bytes = shape[0] == 0 ? 0 : safetensors_byte_size(reader.dtype(name), shape) / shape[0];
  if (row_bytes == 0) return;
  const int64_t rows_per_read = std::max<int64_t>(1, kReadBufferBytes / row_bytes);
  // One buffer, reused: the bytes go from the rank files to the output without other copies.
  // Sized on the first read that needs it.
  static thread_local std::vector<char> buffer;
  for (int64_t row = 0; row < shape[0]; row += rows_per_read) {
    const int64_t count = std::min(rows_per_read, shape[0] - row);
    if (reader.copy_rows(name, row, count, copy)) {
      advance(count * row_bytes);
      continue;
    }
    buffer.resize(static_cast<size_t>(std::min(rows_per_read, shape[0]) * row_bytes));
    reader.read_rows(name, row, count, buffer.data());
    writer(buffer.data(), static_cast<size_t>(count * row_bytes));
    advance(count * row_bytes);
  }
}

/// `groups`: the optimizer's, when the directory holds an optimizer (merged like a FULL
/// checkpoint's optimizer.bin); nullopt for a model.
MergeResult write_merged(const detail::ShardedDirectory& reader, const std::optional<detail::OptimizerGroups>& groups,
                         const std::string& checkpoint_dir, const std::string& output_path,
                         const MergeOptions& options) {
  const bool optimizer = groups.has_value();
  const std::string stem = optimizer ? "optimizer" : "model";

  std::map<std::string, int64_t> sizes;
  int64_t total = 0;
  for (const auto& name : reader.names()) {
    sizes[name] = safetensors_byte_size(reader.dtype(name), reader.shape(name));
    total += sizes[name];
  }
  // Plan the output files.
  std::vector<Output> outputs;
  if (!options.safe_serialization) {
    outputs.push_back({optimizer ? "optimizer.bin" : "pytorch_model.bin", reader.names(), total});
  } else if (options.max_shard_size == 0) {
    outputs.push_back({stem + ".safetensors", reader.names(), total});
  } else {
    std::vector<std::pair<std::string, int64_t>> tensors;
    for (const auto& name : reader.names()) tensors.emplace_back(name, sizes[name]);
    outputs = detail::plan_shard_files(tensors, options.max_shard_size, stem);
  }
  std::vector<std::string> names;
  for (const auto& output : outputs) names.push_back(output.name);
  const bool indexed = options.safe_serialization && options.max_shard_size > 0;
  const std::string index_name = stem + ".safetensors.index.json";
  if (indexed) names.push_back(index_name);

  {
    // An output inside the input would be deleted with it.
    const auto input = fs::weakly_canonical(normalized(checkpoint_dir));
    const auto output = fs::weakly_canonical(normalized(output_path));
    const auto relative = output.lexically_relative(input);
    TORCH_CHECK(!options.remove_checkpoint_dir || relative.empty() || *relative.begin() == "..", "merge: the output '",
                output_path, "' is inside the checkpoint directory '", checkpoint_dir,
                "', which --remove-checkpoint-dir would delete; write the output elsewhere");
  }
  try {
    fs::create_directories(output_path);
  } catch (const fs::filesystem_error& error) {
    TORCH_CHECK(false, "merge: cannot create output directory '", output_path, "': ", error.code().message());
  }
  // Files of another layout would be loaded instead of ours (transformers prefers model.safetensors
  // to an index): every file of any layout of this stem counts.
  std::vector<std::string> stale;
  for (const auto& item : fs::directory_iterator(output_path)) {
    const auto name = item.path().filename().string();
    const bool ours = name == stem + ".safetensors" || name == stem + ".safetensors.index.json" ||
                      name == (optimizer ? "optimizer.bin" : "pytorch_model.bin") ||
                      (name.rfind(stem + "-", 0) == 0 && name.find("-of-") != std::string::npos);
    if (ours) stale.push_back(name);
  }
  if (!stale.empty() && !options.overwrite) {
    std::string list;
    for (const auto& name : stale) list += (list.empty() ? "" : ", ") + name;
    TORCH_CHECK(false, "merge: '", output_path, "' already holds ", list,
                "; choose another output directory or pass --overwrite (which replaces them)");
  }
  const auto staging = fs::path(output_path) / (".merge-" + std::to_string(::getpid()));
  fs::remove_all(staging);
  fs::create_directories(staging);
  MergeResult result;
  int64_t written = 0;
  auto advance = [&](int64_t bytes) {
    written += bytes;
    if (options.progress) options.progress(written, total);
  };
  try {
    for (const auto& output : outputs) {
      const auto path = (staging / output.name).string();
      if (!options.safe_serialization) {
        // torch.load's format: a dict of placeholders pickled first, each tensor written when reached.
        std::map<const c10::TensorImpl*, std::string> placeholder_names;
        TensorList placeholders;
        for (const auto& name : output.tensors) {
          auto placeholder = placeholder_tensor(reader.shape(name), safetensors_scalar_type(reader.dtype(name)));
          placeholder_names[placeholder.unsafeGetTensorImpl()] = name;
          placeholders.emplace_back(name, placeholder);
        }
        c10::IValue value;
        if (optimizer) {
          // The same structure as optimizer.bin of a FULL checkpoint.
          OptimizerStateDict state;
          state.optimizer = groups->optimizer;
          state.param_groups_json = groups->json;
          for (const auto& [name, placeholder] : placeholders) {
            ShardedTensor tensor;
            tensor.local = placeholder;
            tensor.replicated = true;
            state.tensors.emplace_back(name, tensor);
          }
          value = optimizer_state_dict_to_ivalue(state);
        } else {
          value = tensor_dict(placeholders);
        }
        save_torch_file_streaming(path, value, [&](const at::Tensor& placeholder) {
          const auto& name = placeholder_names.at(placeholder.unsafeGetTensorImpl());
          const auto shape = reader.shape(name);
          auto tensor = reader.rows(name, 0, shape.empty() ? 1 : shape[0]).reshape(shape);
          advance(tensor.numel() * tensor.element_size());
          return tensor;
        });
      } else {
        std::vector<SafetensorsEntry> entries;
        for (const auto& name : output.tensors) entries.push_back({name, reader.dtype(name), reader.shape(name)});
        std::map<std::string, std::string> metadata;
        if (optimizer) {
          metadata["optimizer"] = groups->optimizer;
          metadata["param_groups"] = groups->json;
        }
        detail::write_safetensors_streaming(
            path, entries, metadata,
            [&](const SafetensorsEntry& entry, const ByteWriter& writer, const detail::FileRangeWriter& copy) {
              stream_tensor(reader, entry.name, writer, copy, advance);
            });
      }
      result.tensors += static_cast<int64_t>(output.tensors.size());
    }
    if (indexed)
      detail::write_file_atomically((staging / index_name).string(), detail::shard_index_json(outputs, total));
    // Every file is complete and fsynced: drop the previous layout's files, then move ours into place.
    for (const auto& name : stale) {
      if (std::find(names.begin(), names.end(), name) == names.end()) fs::remove(fs::path(output_path) / name);
    }
    for (const auto& name : names) fs::rename(staging / name, fs::path(output_path) / name);
    fs::remove_all(staging);
  } catch (...) {
    std::error_code ignored;
    fs::remove_all(staging, ignored);
    throw;
  }
  result.bytes = total;
  for (const auto& name : names) result.files.push_back((fs::path(output_path) / name).string());
  if (options.remove_checkpoint_dir) {
    // Only the directory given, as Accelerate does. The checkpoint's completion marker stays: the
    // directory beside it (optimizer_0 after pytorch_model_fsdp_0) must still merge, and loading the
    // whole checkpoint names the missing directory.
    fs::remove_all(checkpoint_dir);
  }
  if (options.progress && total == 0) options.progress(0, 0);
  return result;
}

}  // namespace

int64_t detail::parse_byte_size(const std::string& text) {
  static const std::vector<std::pair<std::string, double>> units = {
      {"KIB", 1024.0}, {"MIB", 1048576.0}, {"GIB", 1073741824.0}, {"TIB", 1099511627776.0},
      {"KB", 1e3},     {"MB", 1e6},        {"GB", 1e9},           {"TB", 1e12},
      {"B", 1.0}};
  std::string upper;
  for (char c : text) {
    if (c != ' ') upper += static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
  }
  double factor = 1.0;
  std::string number = upper;
  for (const auto& [unit, value] : units) {
    if (upper.size() > unit.size() && upper.compare(upper.size() - unit.size(), unit.size(), unit) == 0) {
      factor = value;
      number = upper.substr(0, upper.size() - unit.size());
      break;
    }
  }
  size_t used = 0;
  double amount = 0;
  try {
    amount = std::stod(number, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  TORCH_CHECK(used == number.size() && !number.empty() && std::isfinite(amount) && amount * factor >= 1 &&
                  amount * factor < 9.2e18,
              "'", text,
              "' is not a size; write a number of at least 1 byte with an optional unit, e.g. 5GB, 500MB, "
              "2GiB or 1000000");
  return static_cast<int64_t>(amount * factor);
}

MergeResult merge_fsdp_weights(const std::string& checkpoint_dir, const std::string& output_path,
                               bool safe_serialization, bool remove_checkpoint_dir) {
  MergeOptions options;
  options.safe_serialization = safe_serialization;
  options.remove_checkpoint_dir = remove_checkpoint_dir;
  return merge_fsdp_weights(checkpoint_dir, output_path, options);
}

MergeResult merge_fsdp_weights(const std::string& checkpoint_dir, const std::string& output_path,
                               const MergeOptions& options, const DistributedContext& context) {
  MergeResult result;
  // Rank 0 merges inside the agreement, so its failure is every rank's error and nobody waits forever.
  detail::run_on_every_rank(context, [&] {
    if (context.rank() == 0) result = merge_fsdp_weights(checkpoint_dir, output_path, options);
  });
  nlohmann::json summary;
  if (context.rank() == 0) summary = {{"files", result.files}, {"tensors", result.tensors}, {"bytes", result.bytes}};
  summary = nlohmann::json::parse(detail::broadcast_string(context, context.rank() == 0 ? summary.dump() : "", 0));
  result.files = summary["files"].get<std::vector<std::string>>();
  result.tensors = summary["tensors"].get<int64_t>();
  result.bytes = summary["bytes"].get<int64_t>();
  return result;
}

MergeResult merge_fsdp_weights(const std::string& checkpoint_dir, const std::string& output_path,
                               const MergeOptions& options) {
  // Only RANK and WORLD_SIZE matter here: a local merge must not fail on unrelated variables.
  const auto environment = current_process_environment();
  auto integer_of = [&](const char* name) -> int64_t {
    auto found = environment.find(name);
    if (found == environment.end()) return -1;
    try {
      return std::stoll(found->second);
    } catch (const std::exception&) {
      return -1;
    }
  };
  const int64_t rank = integer_of("RANK");
  const int64_t world_size = integer_of("WORLD_SIZE");
  TORCH_CHECK(world_size <= 1 || rank <= 0, "merge_fsdp_weights: called on rank ", rank, " of ", world_size,
              " without a DistributedContext, so this rank would write the same files as rank 0. Call it on the main "
              "process only, or pass the context (merge_fsdp_weights(checkpoint_dir, output_path, options, context)): "
              "rank 0 then merges and the others wait, as Accelerate does");
  check_input(checkpoint_dir);
  TORCH_CHECK(options.max_shard_size >= 0, "merge: max_shard_size must be positive (or 0 for one file), got ",
              options.max_shard_size);
  TORCH_CHECK(options.safe_serialization || options.max_shard_size == 0,
              "merge: sharded output (max_shard_size) is written as safetensors only; drop unsafe serialization");
  const auto reader = detail::open_sharded_directory(checkpoint_dir);
  return write_merged(*reader, reader->optimizer_groups(""), checkpoint_dir, output_path, options);
}

}  // namespace fsdp
