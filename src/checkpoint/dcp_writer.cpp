#include "checkpoint/dcp_writer.h"

#include <ATen/ATen.h>
#include <fsdp/dcp.h>
#include <fsdp/safetensors.h>
#include <fsdp/sharded_checkpoint.h>
#include <fsdp/torch_file.h>

#include <cstdio>
#include <filesystem>
#include <map>
#include <nlohmann/json.hpp>

#include "checkpoint/dcp_metadata.h"
#include "checkpoint/optimizer_state.h"
#include "checkpoint/save_identity.h"
#include "dist/agreement.h"
#include "dist/control_channel.h"
#include "io/atomic_file.h"
#include "io/pickle_writer.h"
#include "io/read_only_file.h"

namespace fsdp::detail {
namespace {

namespace fs = std::filesystem;

// Note [metadata pieces]
// A DCP save's `.metadata` lists every rank's chunks. Each rank writes its own piece of it, the
// items of its .distcp file as JSON with the save's id, its rank and the world size, atomically
// into `<directory>/.metadata.pieces/<rank>.json` right after its file; the save's only collective
// between the files and rank 0's join is one all-reduce of the longest error
// (raise_if_any_rank_failed), whatever N, and no rank's items cross the network. Rank 0 then reads
// the N pieces, checks each belongs to this save (save id, rank, world size: a piece left by an
// earlier save is refused by name), writes `.metadata` in PyTorch's format and removes the pieces.
// PyTorch's dcp.load reads the same `.metadata` as before. At 1000 ranks rank 0 reads 1000 small
// files where it used to receive, and every other rank receive, every rank's items (an all-gather:
// N times the items per rank). A synchronous SHARDED checkpoint (checkpoint.cpp) runs these steps
// inside its own five collectives, the same whatever N: the agreement on the call, the save's id,
// one step in which rank 0 clears the directories and every rank creates them and writes its
// progress files, the one all-reduce of both directories' errors, and one step in which rank 0
// joins both `.metadata` and writes the marker after them (its error raised on every rank). The
// directory must be one file system every rank sees, as PyTorch's DCP needs for loading: rank 0
// reads the pieces.
constexpr const char* kMetadataPieces = ".metadata.pieces";

std::string metadata_piece_path(const std::string& directory, int64_t rank) {
  return (fs::path(directory) / kMetadataPieces / (std::to_string(rank) + ".json")).string();
}

// Rank `rank`'s piece of this save's metadata: its items, after checking that it is this save's.
nlohmann::json read_metadata_piece(const std::string& directory, int64_t rank, int64_t world_size,
                                   const std::string& save_id) {
  const auto path = metadata_piece_path(directory, rank);
  TORCH_CHECK(fs::exists(path), "DCP checkpoint '", directory, "': the metadata piece of rank ", rank, " ('", path,
              "') is missing, although every rank reported its file written. The checkpoint directory must be "
              "one file system every rank sees (a shared file system across machines), and no other save may "
              "write into it at once; save again, to a directory of its own");
  nlohmann::json piece;
  try {
    piece = nlohmann::json::parse(read_text_file(path, uint64_t{1} << 30, "DCP metadata piece"));
  } catch (const nlohmann::json::exception& error) {
    TORCH_CHECK(false, "DCP checkpoint '", directory, "': the metadata piece '", path, "' is not valid JSON (",
                error.what(), ")");
  }
  TORCH_CHECK(piece.is_object() && piece.contains("save_id") && piece["save_id"].is_string() &&
                  piece.contains("rank") && piece["rank"].is_number_integer() && piece.contains("world_size") &&
                  piece["world_size"].is_number_integer() && piece.contains("items") && piece["items"].is_array(),
              "DCP checkpoint '", directory, "': the metadata piece '", path,
              "' lacks save_id, rank, world_size or items");
  TORCH_CHECK(piece["save_id"].get<std::string>() == save_id && piece["rank"].get<int64_t>() == rank &&
                  piece["world_size"].get<int64_t>() == world_size,
              "DCP checkpoint '", directory, "': the metadata piece '", path, "' belongs to save '",
              piece["save_id"].get<std::string>(), "' (rank ", piece["rank"].get<int64_t>(), " of ",
              piece["world_size"].get<int64_t>(), "), not to this one ('", save_id, "', rank ", rank, " of ",
              world_size, "): two saves wrote into this directory at once. Save again, to a directory of its own");
  return piece["items"];
}

constexpr const char* kMetadataModule = "torch.distributed.checkpoint.metadata";
// What torch 2.13's FileSystemWriter records as Metadata.version.
constexpr const char* kMetadataVersion = "1.0.0";

std::string distcp_file_name(int64_t rank) { return "__" + std::to_string(rank) + "_0.distcp"; }

// One item this rank wrote: a chunk of a tensor (offsets and sizes) or a byte item (no offsets).
struct WrittenItem {
  std::string key;
  bool is_bytes = false;
  std::vector<int64_t> offsets;
  std::vector<int64_t> sizes;
  std::string file;
  int64_t offset = 0;
  int64_t length = 0;
};

nlohmann::json to_json(const WrittenItem& item) {
  return {{"key", item.key},   {"bytes", item.is_bytes}, {"offsets", item.offsets}, {"sizes", item.sizes},
          {"file", item.file}, {"offset", item.offset},  {"length", item.length}};
}

WrittenItem from_json(const nlohmann::json& value) {
  WrittenItem item;
  item.key = value.at("key").get<std::string>();
  item.is_bytes = value.at("bytes").get<bool>();
  item.offsets = value.at("offsets").get<std::vector<int64_t>>();
  item.sizes = value.at("sizes").get<std::vector<int64_t>>();
  item.file = value.at("file").get<std::string>();
  item.offset = value.at("offset").get<int64_t>();
  item.length = value.at("length").get<int64_t>();
  return item;
}

// A tensor whose storage is exactly its elements: DCP's loader reads the archive's storage as the
// chunk. A contiguous view into a larger storage (a shard inside its unit's buffer) becomes a tensor
// over the same bytes with a storage of its own, not a copy: the caller's tensor outlives the write.
at::Tensor compact(const at::Tensor& tensor) {
  auto result = tensor.contiguous();
  if (result.storage_offset() != 0 ||
      static_cast<int64_t>(result.storage().nbytes()) != result.numel() * static_cast<int64_t>(result.element_size())) {
    TORCH_INTERNAL_ASSERT(result.is_same(tensor) || result.storage().is_alias_of(tensor.storage()),
                          "compact: contiguous() of a view made a copy with a larger storage");
    result = at::from_blob(result.data_ptr(), result.sizes(), result.options());
  }
  return result;
}

// Python's pickle of the DCP dataclasses, in the order Python's pickler emits them.
class MetadataPickle {
 public:
  // torch.Size((values...)): REDUCE of the class with a one-element argument tuple.
  void size(const std::vector<int64_t>& values) {
    out_.global("torch", "Size");
    out_.mark();
    out_.mark();
    for (const auto value : values) out_.integer(value);
    out_.tuple_from_mark();
    out_.tuple_from_mark();
    out_.reduce();
  }

  // Begins a dataclass instance: class, NEWOBJ, then the field dict opened for SETITEMS.
  void begin_dataclass(const std::string& module, const std::string& name) {
    out_.global(module, name);
    out_.empty_tuple();
    out_.new_object();
    out_.empty_dict();
    out_.mark();
  }
  void end_dataclass() {
    out_.set_items_from_mark();
    out_.build();
  }

  void tensor_properties(c10::ScalarType dtype) {
    out_.global(kMetadataModule, "TensorProperties");
    out_.empty_tuple();
    out_.new_object();
    // TensorProperties.__getstate__: (dtype, layout, requires_grad, memory format, pin_memory).
    out_.mark();
    out_.global("torch", dcp_dtype_name(dtype));
    out_.global("torch.serialization", "_get_layout");
    out_.mark();
    out_.string("torch.strided");
    out_.tuple_from_mark();
    out_.reduce();
    out_.boolean(false);
    out_.global(kMetadataModule, "_MEM_FORMAT_ENCODING");
    out_.mark();
    out_.integer(0);  // TORCH_CONTIGUOUS_FORMAT
    out_.tuple_from_mark();
    out_.reduce();
    out_.boolean(false);
    out_.tuple_from_mark();
    out_.build();
  }

  PickleWriter& out() { return out_; }

 private:
  PickleWriter out_;
};

}  // namespace

std::string dcp_flat_key(const DcpPath& path) {
  std::string key;
  for (size_t index = 0; index < path.size(); ++index) {
    if (index) key += ".";
    key += path[index].index >= 0 ? std::to_string(path[index].index) : path[index].key;
  }
  return key;
}

std::vector<DcpTensorEntry> model_dcp_entries(const ShardedTensorList& state) {
  std::vector<DcpTensorEntry> entries;
  for (const auto& [name, tensor] : state) entries.push_back({{{"model"}, {name}}, tensor});
  return entries;
}

void clear_dcp_directory(const std::string& directory) {
  // An earlier checkpoint here stops being one before any of its files is replaced; the pieces an
  // unfinished save left go too (rank 0 would refuse them by their save id anyway). The pieces'
  // directory itself stays: other ranks may be creating it at this moment, and a directory removed
  // between their mkdir and its check makes create_directories fail with "File exists".
  fs::remove(fs::path(directory) / ".metadata");
  fs::remove(fs::path(directory) / kShardedMetadataFile);
  const auto pieces = fs::path(directory) / kMetadataPieces;
  if (!fs::is_directory(pieces)) {
    fs::remove(pieces);
    return;
  }
  for (const auto& entry : fs::directory_iterator(pieces)) fs::remove_all(entry.path());
}

void create_dcp_directory(const std::string& directory) {
  fs::create_directories(fs::path(directory) / kMetadataPieces);
}

void prepare_dcp_directory(const std::string& directory, const DistributedContext& context) {
  run_on_every_rank(context, [&] {
    if (context.rank() == 0) clear_dcp_directory(directory);
  });
  run_on_every_rank(context, [&] { create_dcp_directory(directory); });
}

std::string write_dcp_rank_file(const std::string& directory, const std::vector<DcpTensorEntry>& tensors,
                                const std::vector<DcpByteEntry>& byte_items, int64_t rank, int64_t world_size,
                                const std::string& save_id) {
  TORCH_INTERNAL_ASSERT(!save_id.empty(), "writing DCP checkpoint '", directory, "': no save id");
  const auto file = distcp_file_name(rank);
  std::vector<WrittenItem> written;
  std::string report;
  try {
    write_file_atomically((fs::path(directory) / file).string(), [&](const ByteSink& sink) {
      int64_t position = 0;
      auto counted = [&](const void* data, size_t size) {
        sink(data, size);
        position += static_cast<int64_t>(size);
      };
      // Byte items first, then tensors, as FileSystemWriter orders a file.
      if (rank == 0) {
        for (const auto& entry : byte_items) {
          WrittenItem item;
          item.key = dcp_flat_key(entry.path);
          item.is_bytes = true;
          item.file = file;
          item.offset = position;
          write_torch_archive(entry.value, counted, directory + "/" + file);
          item.length = position - item.offset;
          written.push_back(std::move(item));
        }
      }
      for (const auto& entry : tensors) {
        const auto& tensor = entry.tensor;
        if ((tensor.replicated && rank != 0) || tensor.duplicate) continue;
        const bool scalar = tensor.global_shape.empty();
        // A sharded tensor's rank without rows has no chunk; a tensor with no elements at all still
        // gets one (from rank 0) so that the metadata lists it.
        if (!tensor.replicated && tensor.local.numel() == 0) {
          int64_t global_numel = 1;
          for (const auto size : tensor.global_shape) global_numel *= size;
          const bool empty_tensor = !scalar && global_numel == 0;
          if (!(empty_tensor && rank == 0)) continue;
        }
        WrittenItem item;
        item.key = dcp_flat_key(entry.path);
        item.file = file;
        at::Tensor chunk = scalar ? tensor.local.reshape({}) : tensor.local;
        item.sizes = chunk.sizes().vec();
        item.offsets.assign(item.sizes.size(), 0);
        if (!scalar && !tensor.replicated) item.offsets[0] = tensor.row_offset;
        item.offset = position;
        write_torch_archive(compact(chunk), counted, directory + "/" + file);
        item.length = position - item.offset;
        written.push_back(std::move(item));
      }
      const auto footer = identity_footer({save_id, rank, world_size});
      sink(footer.data(), footer.size());
    });
    auto items = nlohmann::json::array();
    for (const auto& item : written) items.push_back(to_json(item));
    report = items.dump();
    // This rank's piece of the metadata, beside its file (Note [metadata pieces]).
    const nlohmann::json piece = {{"save_id", save_id}, {"rank", rank}, {"world_size", world_size}, {"items", items}};
    write_file_atomically(metadata_piece_path(directory, rank), piece.dump());
  } catch (const std::exception& error) {
    report = "ERROR:" + message_of(error);
  }
  return report;
}

std::string dcp_write_error(const std::string& directory, int64_t rank, const std::string& report) {
  if (report.rfind("ERROR:", 0) != 0) return {};
  return "writing DCP checkpoint '" + directory + "': rank " + std::to_string(rank) + " failed: " + report.substr(6);
}

void finish_dcp_directory(const std::string& directory, const std::vector<DcpTensorEntry>& tensors,
                          const std::vector<DcpByteEntry>& byte_items, const DistributedContext& context,
                          const std::string& save_id, const std::string& report) {
  // Note [metadata pieces]: one all-reduce of the longest error whatever N; rank 0 then reads the
  // pieces every rank wrote beside its file, so the metadata never describes a file that does not
  // exist yet, and no rank's items travel over the network.
  raise_if_any_rank_failed(context, dcp_write_error(directory, context.rank(), report));
  run_on_every_rank(context, [&] {
    if (context.rank() == 0) write_dcp_metadata(directory, tensors, byte_items, context.world_size(), save_id);
  });
}

void write_dcp_metadata(const std::string& directory, const std::vector<DcpTensorEntry>& tensors,
                        const std::vector<DcpByteEntry>& byte_items, int64_t world_size, const std::string& save_id) {
  const auto metadata_path = (fs::path(directory) / ".metadata").string();
  std::map<std::string, std::vector<WrittenItem>> chunks;  // key -> chunks in rank order
  for (int64_t other = 0; other < world_size; ++other) {
    for (const auto& value : read_metadata_piece(directory, other, world_size, save_id)) {
      auto item = from_json(value);
      chunks[item.key].push_back(std::move(item));
    }
  }
  MetadataPickle pickle;
  auto& out = pickle.out();
  pickle.begin_dataclass(kMetadataModule, "Metadata");
  out.string("state_dict_metadata");
  out.empty_dict();
  out.mark();
  for (const auto& entry : byte_items) {
    out.string(dcp_flat_key(entry.path));
    out.global(kMetadataModule, "BytesStorageMetadata");
    out.empty_tuple();
    out.new_object();
    out.empty_dict();
    out.build();
  }
  for (const auto& entry : tensors) {
    const auto key = dcp_flat_key(entry.path);
    const auto found = chunks.find(key);
    TORCH_INTERNAL_ASSERT(found != chunks.end(), "DCP writer: no rank wrote tensor '", key, "'");
    out.string(key);
    pickle.begin_dataclass(kMetadataModule, "TensorStorageMetadata");
    out.string("properties");
    pickle.tensor_properties(entry.tensor.local.scalar_type());
    out.string("size");
    pickle.size(entry.tensor.global_shape);
    out.string("chunks");
    out.empty_list();
    out.mark();
    for (const auto& chunk : found->second) {
      pickle.begin_dataclass(kMetadataModule, "ChunkStorageMetadata");
      out.string("offsets");
      pickle.size(chunk.offsets);
      out.string("sizes");
      pickle.size(chunk.sizes);
      pickle.end_dataclass();
    }
    out.appends_from_mark();
    pickle.end_dataclass();
  }
  out.set_items_from_mark();

  // planner_data: each key's path, so that loaders rebuild the nesting.
  out.string("planner_data");
  out.empty_dict();
  out.mark();
  auto path_of = [&](const DcpPath& path) {
    out.mark();
    for (const auto& element : path) {
      if (element.index >= 0)
        out.integer(element.index);
      else
        out.string(element.key);
    }
    out.tuple_from_mark();
  };
  for (const auto& entry : byte_items) {
    out.string(dcp_flat_key(entry.path));
    path_of(entry.path);
  }
  for (const auto& entry : tensors) {
    out.string(dcp_flat_key(entry.path));
    path_of(entry.path);
  }
  out.set_items_from_mark();

  out.string("storage_data");
  out.empty_dict();
  out.mark();
  auto storage_of = [&](const WrittenItem& item, int64_t index) {
    pickle.begin_dataclass(kMetadataModule, "MetadataIndex");
    out.string("fqn");
    out.string(item.key);
    out.string("offset");
    if (item.is_bytes)
      out.none();
    else
      pickle.size(item.offsets);
    out.string("index");
    if (item.is_bytes)
      out.none();
    else
      out.integer(index);
    pickle.end_dataclass();
    pickle.begin_dataclass("torch.distributed.checkpoint.filesystem", "_StorageInfo");
    out.string("relative_path");
    out.string(item.file);
    out.string("offset");
    out.integer(item.offset);
    out.string("length");
    out.integer(item.length);
    pickle.end_dataclass();
  };
  for (const auto& [key, items] : chunks) {
    for (size_t index = 0; index < items.size(); ++index) storage_of(items[index], static_cast<int64_t>(index));
  }
  out.set_items_from_mark();

  out.string("storage_meta");
  pickle.begin_dataclass(kMetadataModule, "StorageMeta");
  out.string("checkpoint_id");
  out.none();
  out.string("save_id");
  out.string(save_id);
  out.string("load_id");
  out.none();
  out.string("modules");
  out.empty_list();
  pickle.end_dataclass();
  out.string("version");
  out.string(kMetadataVersion);
  pickle.end_dataclass();
  write_file_atomically(metadata_path, out.finish());
  // What PyTorch's loader reads is complete; the pieces are not needed any more.
  fs::remove_all(fs::path(directory) / kMetadataPieces);
}

void write_dcp_directory(const std::string& directory, const std::vector<DcpTensorEntry>& tensors,
                         const std::vector<DcpByteEntry>& byte_items, const DistributedContext& context,
                         const std::string& save_id_on_rank0) {
  // Every rank's file records rank 0's id (Note [save identity]).
  const auto save_id = broadcast_string(context, context.rank() == 0 ? save_id_on_rank0 : std::string(), 0);
  prepare_dcp_directory(directory, context);
  const auto report =
      write_dcp_rank_file(directory, tensors, byte_items, context.rank(), context.world_size(), save_id);
  finish_dcp_directory(directory, tensors, byte_items, context, save_id, report);
}

}  // namespace fsdp::detail

namespace fsdp::detail {

void optimizer_dcp_entries(const OptimizerStateDict& state, std::vector<DcpTensorEntry>& tensors,
                           std::vector<DcpByteEntry>& byte_items) {
  for (const auto& [name, tensor] : state.tensors) {
    // "state.<parameter>.<field>": the field is the last component; parameter names contain dots.
    const auto last_dot = name.rfind('.');
    TORCH_INTERNAL_ASSERT(name.rfind("state.", 0) == 0 && last_dot != std::string::npos && last_dot > 6,
                          "optimizer state tensor '", name, "'");
    tensors.push_back(
        {{{"optimizer"}, {"state"}, {name.substr(6, last_dot - 6)}, {name.substr(last_dot + 1)}}, tensor});
  }
  const auto groups = nlohmann::json::parse(state.param_groups_json);
  for (size_t index = 0; index < groups.size(); ++index) {
    const auto& group = groups[index];
    const DcpPathElement position{"", static_cast<int64_t>(index)};
    for (auto& [option, value] : pytorch_param_group(state.optimizer, group)) {
      byte_items.push_back({{{"optimizer"}, {"param_groups"}, position, {option}}, std::move(value)});
    }
    c10::impl::GenericList names(c10::StringType::get());
    for (const auto& name : group.at("params")) names.push_back(name.get<std::string>());
    byte_items.push_back({{{"optimizer"}, {"param_groups"}, position, {"params"}}, names});
  }
}

}  // namespace fsdp::detail

namespace fsdp {

void write_dcp_model_directory(const std::string& directory, const ShardedTensorList& tensors,
                               const DistributedContext& context) {
  const auto save_id = context.rank() == 0 ? detail::new_save_id() : std::string();
  detail::write_dcp_directory(directory, detail::model_dcp_entries(tensors), {}, context, save_id);
}

}  // namespace fsdp
