#include "checkpoint/dcp_metadata.h"

#include <c10/util/Exception.h>
#include <c10/util/safe_numerics.h>

#include <algorithm>
#include <filesystem>
#include <set>
#include <utility>
#include <vector>

#include "io/read_only_file.h"
#include "io/restricted_unpickler.h"

namespace fsdp::detail {
namespace {

using Kind = PickleValue::Kind;
namespace fs = std::filesystem;

constexpr uint64_t kMaxMetadataBytes = uint64_t{1} << 30;
// torch's limit on a tensor's dimensions, and a nesting no state dict comes near.
constexpr size_t kMaxDims = 64;
constexpr size_t kMaxPathElements = 256;
// Chunks that are not runs of rows (tensor parallelism) are checked pairwise: 5e7 comparisons at most.
constexpr size_t kMaxPairwiseChunks = 10000;

// torch's dtypes as the globals `torch.<name>` that TensorProperties pickles.
const std::vector<std::pair<const char*, c10::ScalarType>>& dtype_globals() {
  static const std::vector<std::pair<const char*, c10::ScalarType>> table = {{"float64", c10::kDouble},
                                                                             {"float32", c10::kFloat},
                                                                             {"float16", c10::kHalf},
                                                                             {"bfloat16", c10::kBFloat16},
                                                                             {"int64", c10::kLong},
                                                                             {"int32", c10::kInt},
                                                                             {"int16", c10::kShort},
                                                                             {"int8", c10::kChar},
                                                                             {"uint8", c10::kByte},
                                                                             {"bool", c10::kBool},
                                                                             {"complex64", c10::kComplexFloat},
                                                                             {"complex128", c10::kComplexDouble},
                                                                             {"float8_e4m3fn", c10::kFloat8_e4m3fn},
                                                                             {"float8_e5m2", c10::kFloat8_e5m2},
                                                                             {"uint16", c10::kUInt16},
                                                                             {"uint32", c10::kUInt32},
                                                                             {"uint64", c10::kUInt64}};
  return table;
}

// What DCP's .metadata references, across the torch versions that write it (older ones import
// TensorProperties and the memory-format enum from the sharded-tensor package).
const std::set<std::string>& dcp_metadata_globals() {
  static const std::set<std::string> names = [] {
    std::set<std::string> result;
    for (const char* name : {"Metadata", "TensorStorageMetadata", "ChunkStorageMetadata", "BytesStorageMetadata",
                             "MetadataIndex", "TensorProperties", "_MEM_FORMAT_ENCODING", "StorageMeta"}) {
      result.insert(std::string("torch.distributed.checkpoint.metadata.") + name);
    }
    result.insert("torch.distributed._shard.sharded_tensor.metadata.TensorProperties");
    result.insert("torch.distributed._shard.sharded_tensor.metadata.MEM_FORMAT_ENCODING");
    result.insert("torch.distributed.checkpoint.filesystem._StorageInfo");
    result.insert("torch.Size");
    result.insert("torch.serialization._get_layout");
    result.insert("torch.strided");
    for (const char* path : {"pathlib.PosixPath", "pathlib.WindowsPath", "pathlib.PurePosixPath",
                             "pathlib._local.PosixPath", "pathlib._local.WindowsPath"}) {
      result.insert(path);
    }
    for (const auto& [name, dtype] : dtype_globals()) result.insert(std::string("torch.") + name);
    return result;
  }();
  return names;
}

c10::ScalarType dtype_of(const std::string& name, const std::string& where) {
  for (const auto& [global, dtype] : dtype_globals()) {
    if (name == std::string("torch.") + global) return dtype;
  }
  TORCH_CHECK(false, where, ": dtype ", name, " is not one fsdp.cpp reads");
}

class Interpreter {
 public:
  // `budget`: how many values the walk may visit. Memo references let a few bytes name one long list
  // from many places (a memo bomb); a file of n bytes describes fewer than n distinct chunks, paths
  // and storage entries, so visiting more means the file repeats itself and is refused.
  Interpreter(std::string source, size_t budget) : source_(std::move(source)), budget_(budget) {}

  DcpMetadata run(const PickleValue& root) {
    const auto& fields = state_of(root, "torch.distributed.checkpoint.metadata.Metadata", "the metadata");
    DcpMetadata metadata;
    const auto* entries = field(fields, "state_dict_metadata", "Metadata", Kind::kDict);
    for (size_t index = 0; index + 1 < entries->items.size(); index += 2) {
      const auto& key = string_of(*entries->items[index], "a state_dict_metadata key");
      const auto& entry = *entries->items[index + 1];
      const std::string where = "entry '" + key + "'";
      TORCH_CHECK(!metadata.tensors.count(key) && !metadata.byte_items.count(key), fail(where), "is listed twice");
      metadata.keys.push_back(key);
      if (is_object(entry, "torch.distributed.checkpoint.metadata.BytesStorageMetadata")) {
        metadata.byte_items[key] = DcpStorage{"", 0, -1};
      } else {
        metadata.tensors[key] = tensor_of(entry, where);
      }
    }
    if (const auto* planner = fields.find("planner_data"); planner && planner->kind == Kind::kDict) {
      for (size_t index = 0; index + 1 < planner->items.size(); index += 2) {
        const auto& key = string_of(*planner->items[index], "a planner_data key");
        const auto& path = *planner->items[index + 1];
        TORCH_CHECK(path.kind == Kind::kTuple || path.kind == Kind::kList, fail("planner_data of '" + key + "'"),
                    "is a ", path.describe(), ", not a tuple of path elements");
        TORCH_CHECK(path.items.size() <= kMaxPathElements, fail("planner_data of '" + key + "'"), "has ",
                    path.items.size(), " elements; no state dict is nested that deep");
        spend(path.items.size());
        std::vector<std::string> elements;
        for (const auto* element : path.items) {
          if (element->kind == Kind::kInt)
            elements.push_back(std::to_string(element->integer));
          else
            elements.push_back(string_of(*element, "an element of planner_data '" + key + "'"));
        }
        metadata.paths[key] = std::move(elements);
      }
    }
    if (const auto* version = fields.find("version"); version && version->kind == Kind::kString) {
      metadata.version = version->text;
    }
    if (const auto* meta = fields.find("storage_meta"); meta && meta->kind != Kind::kNone) {
      const auto& storage_meta = state_of(*meta, "torch.distributed.checkpoint.metadata.StorageMeta", "storage_meta");
      if (const auto* id = storage_meta.find("save_id"); id && id->kind != Kind::kNone) {
        metadata.save_id = string_of(*id, "storage_meta.save_id");
      }
    }
    const auto* storage = field(fields, "storage_data", "Metadata", Kind::kDict);
    for (size_t index = 0; index + 1 < storage->items.size(); index += 2) {
      place(metadata, *storage->items[index], *storage->items[index + 1]);
    }
    for (const auto& [key, tensor] : metadata.tensors) {
      for (const auto& chunk : tensor.chunks) {
        int64_t numel = 1;
        for (const auto size : chunk.sizes) numel *= size;
        TORCH_CHECK(chunk.storage.length >= 0 || numel == 0, fail("tensor '" + key + "'"),
                    "has no storage entry for its chunk at offsets ", text_of(chunk.offsets),
                    ": the checkpoint is incomplete");
      }
    }
    for (const auto& [key, item] : metadata.byte_items) {
      TORCH_CHECK(item.length >= 0, fail("byte item '" + key + "'"),
                  "has no storage entry: the checkpoint is incomplete");
    }
    return metadata;
  }

 private:
  std::string fail(const std::string& where) const { return "'" + source_ + "': " + where + " "; }

  static std::string text_of(const std::vector<int64_t>& values) {
    std::string text = "[";
    for (size_t index = 0; index < values.size(); ++index) text += (index ? ", " : "") + std::to_string(values[index]);
    return text + "]";
  }

  static bool is_object(const PickleValue& value, const std::string& class_name) {
    return value.kind == Kind::kObject && value.callee->text == class_name;
  }

  // The dataclass fields of `value` (its BUILD state), which must be an instance of `class_name`.
  const PickleValue& state_of(const PickleValue& value, const std::string& class_name, const std::string& where) const {
    TORCH_CHECK(is_object(value, class_name), fail(where), "is a ", value.describe(), ", expected ", class_name);
    TORCH_CHECK(value.state && value.state->kind == Kind::kDict, fail(where), "(", class_name,
                ") has no field dictionary");
    return *value.state;
  }

  const PickleValue* field(const PickleValue& fields, const std::string& name, const std::string& where,
                           Kind kind) const {
    const auto* value = fields.find(name);
    TORCH_CHECK(value, fail(where), "lacks field '", name, "'");
    TORCH_CHECK(value->kind == kind, fail(where), "field '", name, "' is a ", value->describe());
    return value;
  }

  const std::string& string_of(const PickleValue& value, const std::string& where) const {
    TORCH_CHECK(value.kind == Kind::kString, fail(where), "is a ", value.describe(), ", not a string");
    return value.text;
  }

  int64_t integer_of(const PickleValue& value, const std::string& where) const {
    TORCH_CHECK(value.kind == Kind::kInt, fail(where), "is a ", value.describe(), ", not an integer");
    return value.integer;
  }

  // torch.Size((...)) or a plain tuple of non-negative integers.
  std::vector<int64_t> size_of(const PickleValue& value, const std::string& where) const {
    const PickleValue* tuple = &value;
    if (is_object(value, "torch.Size")) {
      TORCH_CHECK(value.arguments->items.size() == 1, fail(where), "is a torch.Size with ",
                  value.arguments->items.size(), " arguments");
      tuple = value.arguments->items[0];
    }
    TORCH_CHECK(tuple->kind == Kind::kTuple || tuple->kind == Kind::kList, fail(where), "is a ", tuple->describe(),
                ", not a size");
    TORCH_CHECK(tuple->items.size() <= kMaxDims, fail(where), "has ", tuple->items.size(), " dimensions; torch allows ",
                kMaxDims);
    spend(tuple->items.size() + 1);
    std::vector<int64_t> sizes;
    for (const auto* element : tuple->items) {
      const auto size = integer_of(*element, where + " element");
      TORCH_CHECK(size >= 0, fail(where), "has a negative entry ", size);
      sizes.push_back(size);
    }
    return sizes;
  }

  DcpTensor tensor_of(const PickleValue& entry, const std::string& where) const {
    const auto& fields = state_of(entry, "torch.distributed.checkpoint.metadata.TensorStorageMetadata", where);
    DcpTensor tensor;
    const auto* properties = fields.find("properties");
    TORCH_CHECK(properties && properties->kind == Kind::kObject, fail(where), "lacks its TensorProperties");
    // TensorProperties.__getstate__: (dtype, layout, requires_grad, memory format, pin_memory).
    const auto* state = properties->state;
    const PickleValue* dtype = nullptr;
    if (state && state->kind == Kind::kTuple && !state->items.empty()) dtype = state->items[0];
    if (state && state->kind == Kind::kDict) dtype = state->find("dtype");
    TORCH_CHECK(dtype && dtype->kind == Kind::kGlobal, fail(where), "has no dtype in its TensorProperties");
    tensor.dtype = dtype_of(dtype->text, fail(where));
    const auto* size = fields.find("size");
    TORCH_CHECK(size, fail(where), "lacks its size");
    tensor.size = size_of(*size, where + " size");
    const auto* chunks = field(fields, "chunks", where, Kind::kList);
    int64_t covered = 0;
    for (const auto* chunk_value : chunks->items) {
      const auto& chunk_fields =
          state_of(*chunk_value, "torch.distributed.checkpoint.metadata.ChunkStorageMetadata", where + " chunk");
      DcpChunk chunk;
      TORCH_CHECK(chunk_fields.find("offsets") && chunk_fields.find("sizes"), fail(where),
                  "has a chunk without offsets or sizes");
      chunk.offsets = size_of(*chunk_fields.find("offsets"), where + " chunk offsets");
      chunk.sizes = size_of(*chunk_fields.find("sizes"), where + " chunk sizes");
      TORCH_CHECK(chunk.offsets.size() == tensor.size.size() && chunk.sizes.size() == tensor.size.size(), fail(where),
                  "has a chunk of rank ", chunk.sizes.size(), " for a tensor of rank ", tensor.size.size());
      int64_t numel = 1;
      for (size_t dim = 0; dim < tensor.size.size(); ++dim) {
        TORCH_CHECK(chunk.sizes[dim] <= tensor.size[dim] && chunk.offsets[dim] <= tensor.size[dim] - chunk.sizes[dim],
                    fail(where), "has a chunk at offsets ", text_of(chunk.offsets), " of sizes ", text_of(chunk.sizes),
                    " outside its size ", text_of(tensor.size));
        TORCH_CHECK(!c10::mul_overflows(numel, chunk.sizes[dim], &numel), fail(where),
                    "has a chunk too large to count");
      }
      TORCH_CHECK(!c10::add_overflows(covered, numel, &covered), fail(where), "has chunks too large to count");
      tensor.chunks.push_back(std::move(chunk));
    }
    int64_t numel = 1;
    for (const auto size : tensor.size)
      TORCH_CHECK(!c10::mul_overflows(numel, size, &numel), fail(where), "is too large");
    TORCH_CHECK(covered == numel, fail(where), "has chunks covering ", covered, " of its ", numel,
                " elements: the checkpoint does not hold the whole tensor");
    check_tiling(tensor, where);
    return tensor;
  }

  void spend(size_t values) const {
    TORCH_CHECK(values <= budget_, "'", source_,
                "' describes more values than its bytes can hold: it refers to the "
                "same lists again and again (a memo bomb) and is refused");
    budget_ -= values;
  }

  // Chunks that cover as many elements as the tensor has could still overlap and leave a gap, whose
  // rows would then be read from nowhere: every pair must be disjoint. FSDP's chunks are runs of rows
  // spanning the other dimensions, checked in order after sorting; others pairwise.
  void check_tiling(const DcpTensor& tensor, const std::string& where) const {
    const auto& chunks = tensor.chunks;
    if (chunks.size() < 2 || tensor.size.empty()) return;
    auto text_of_chunk = [](const DcpChunk& chunk) {
      return text_of(chunk.offsets) + " of sizes " + text_of(chunk.sizes);
    };
    bool rows_only = true;
    for (const auto& chunk : chunks) {
      for (size_t dim = 1; dim < tensor.size.size(); ++dim) {
        rows_only = rows_only && chunk.offsets[dim] == 0 && chunk.sizes[dim] == tensor.size[dim];
      }
    }
    if (rows_only) {
      std::vector<const DcpChunk*> order;
      for (const auto& chunk : chunks) {
        if (chunk.sizes[0] > 0) order.push_back(&chunk);
      }
      std::sort(order.begin(), order.end(),
                [](const DcpChunk* a, const DcpChunk* b) { return a->offsets[0] < b->offsets[0]; });
      for (size_t index = 1; index < order.size(); ++index) {
        TORCH_CHECK(order[index - 1]->offsets[0] + order[index - 1]->sizes[0] <= order[index]->offsets[0], fail(where),
                    "has overlapping chunks at offsets ", text_of_chunk(*order[index - 1]), " and ",
                    text_of_chunk(*order[index]), ": they do not tile the tensor");
      }
      return;
    }
    // Pairwise: bounded on its own (the walk budget counts values read, not comparisons).
    TORCH_CHECK(chunks.size() <= kMaxPairwiseChunks, fail(where), "has ", chunks.size(),
                " chunks that are not runs of whole rows; fsdp.cpp checks that at most ", kMaxPairwiseChunks,
                " such chunks tile a tensor, so it does not read this checkpoint");
    for (size_t first = 0; first < chunks.size(); ++first) {
      for (size_t second = first + 1; second < chunks.size(); ++second) {
        bool overlap = true;
        for (size_t dim = 0; dim < tensor.size.size(); ++dim) {
          const auto& a = chunks[first];
          const auto& b = chunks[second];
          overlap = overlap && a.sizes[dim] > 0 && b.sizes[dim] > 0 && a.offsets[dim] < b.offsets[dim] + b.sizes[dim] &&
                    b.offsets[dim] < a.offsets[dim] + a.sizes[dim];
        }
        TORCH_CHECK(!overlap, fail(where), "has overlapping chunks at offsets ", text_of_chunk(chunks[first]), " and ",
                    text_of_chunk(chunks[second]), ": they do not tile the tensor");
      }
    }
  }

  void place(DcpMetadata& metadata, const PickleValue& index_value, const PickleValue& info_value) const {
    const auto& index =
        state_of(index_value, "torch.distributed.checkpoint.metadata.MetadataIndex", "a storage_data key");
    const auto& key = string_of(*field(index, "fqn", "MetadataIndex", Kind::kString), "MetadataIndex.fqn");
    const std::string where = "storage of '" + key + "'";
    const auto& info = state_of(info_value, "torch.distributed.checkpoint.filesystem._StorageInfo", where);
    DcpStorage storage;
    storage.relative_path = string_of(*field(info, "relative_path", where, Kind::kString), where + " relative_path");
    storage.offset = integer_of(*field(info, "offset", where, Kind::kInt), where + " offset");
    storage.length = integer_of(*field(info, "length", where, Kind::kInt), where + " length");
    TORCH_CHECK(storage.offset >= 0 && storage.length >= 0, fail(where), "has offset ", storage.offset, " and length ",
                storage.length);
    const auto& name = storage.relative_path;
    TORCH_CHECK(!name.empty() && name != "." && name != ".." && name.find('/') == std::string::npos &&
                    name.find('\\') == std::string::npos && name.find('\0') == std::string::npos,
                fail(where), "names file '", name, "', which is not a plain file name in the checkpoint directory");
    if (const auto* transforms = info.find("transform_descriptors");
        transforms && transforms->kind != Kind::kNone && !transforms->items.empty()) {
      const auto* first = transforms->items[0];
      TORCH_CHECK(false, fail(where), "is stored through stream transforms (",
                  first->kind == Kind::kString ? first->text : first->describe(),
                  "), which fsdp.cpp does not read; save without DCP's _extensions");
    }
    if (auto found = metadata.byte_items.find(key); found != metadata.byte_items.end()) {
      TORCH_CHECK(found->second.length < 0, fail(where), "is listed twice");
      found->second = storage;
      return;
    }
    auto tensor = metadata.tensors.find(key);
    TORCH_CHECK(tensor != metadata.tensors.end(), fail(where), "is not an entry of state_dict_metadata");
    const auto* offset = index.find("offset");
    TORCH_CHECK(offset && offset->kind != Kind::kNone, fail(where), "has no chunk offsets");
    const auto offsets = size_of(*offset, where + " offsets");
    for (auto& chunk : tensor->second.chunks) {
      if (chunk.offsets != offsets) continue;
      TORCH_CHECK(chunk.storage.length < 0, fail(where), "lists the chunk at offsets ", text_of(offsets), " twice");
      chunk.storage = storage;
      return;
    }
    TORCH_CHECK(false, fail(where), "names a chunk at offsets ", text_of(offsets), ", which the tensor does not have");
  }

  std::string source_;
  mutable size_t budget_;
};

}  // namespace

DcpMetadata parse_dcp_metadata(const uint8_t* data, size_t size, const std::string& source) {
  const auto document = restricted_unpickle(data, size, dcp_metadata_globals(), source);
  return Interpreter(source, size + 1024).run(*document.root);
}

std::string dcp_dtype_name(c10::ScalarType dtype) {
  for (const auto& [name, entry] : dtype_globals()) {
    if (entry == dtype) return name;
  }
  TORCH_CHECK(false, "a DCP checkpoint cannot hold a tensor of dtype ", dtype);
}

bool is_dcp_directory(const std::string& directory) {
  std::error_code error;
  return fs::is_regular_file(fs::path(directory) / ".metadata", error);
}

DcpMetadata read_dcp_metadata(const std::string& directory) {
  const auto path = (fs::path(directory) / ".metadata").string();
  const auto data = ReadOnlyFile(path, kMaxMetadataBytes, "DCP metadata file",
                                 "'" + directory + "' is not a PyTorch distributed checkpoint (DCP) directory")
                        .read_all();
  return parse_dcp_metadata(reinterpret_cast<const uint8_t*>(data.data()), data.size(), path);
}

}  // namespace fsdp::detail
