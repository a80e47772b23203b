#include "checkpoint/dcp_reader.h"

#include <ATen/ATen.h>
#include <c10/util/safe_numerics.h>
#include <caffe2/serialize/inline_container.h>
#include <caffe2/serialize/read_adapter_interface.h>
#include <fsdp/safetensors.h>
#include <fsdp/torch_file.h>

#include <cstring>
#include <filesystem>
#include <limits>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>

#include "checkpoint/optimizer_state.h"
#include "checkpoint/save_identity.h"
#include "io/read_only_file.h"
#include "io/restricted_unpickler.h"

namespace fsdp::detail {
namespace {

namespace fs = std::filesystem;

std::string join(const std::vector<std::string>& parts, size_t first) {
  std::string text;
  for (size_t index = first; index < parts.size(); ++index) text += (index > first ? "." : "") + parts[index];
  return text;
}

// One item of a .distcp file as a zip archive, read with pread: the archive's reader never sees
// bytes outside [offset, offset + length).
class ItemAdapter : public caffe2::serialize::ReadAdapterInterface {
 public:
  ItemAdapter(const ReadOnlyFile& file, int64_t offset, int64_t length)
      : file_(file), offset_(offset), length_(length) {}
  size_t size() const override { return static_cast<size_t>(length_); }
  size_t read(uint64_t position, void* buffer, size_t count, const char* /*what*/) const override {
    if (position >= static_cast<uint64_t>(length_)) return 0;
    count = std::min<uint64_t>(count, static_cast<uint64_t>(length_) - position);
    return file_.read_at_most(buffer, count, static_cast<uint64_t>(offset_) + position);
  }

 private:
  const ReadOnlyFile& file_;
  int64_t offset_;
  int64_t length_;
};

// The legacy storage class torch.save names for each dtype (what _rebuild_tensor_v2 refers to).
const char* storage_class(c10::ScalarType dtype) {
  switch (dtype) {
    case c10::kDouble:
      return "torch.DoubleStorage";
    case c10::kFloat:
      return "torch.FloatStorage";
    case c10::kHalf:
      return "torch.HalfStorage";
    case c10::kBFloat16:
      return "torch.BFloat16Storage";
    case c10::kLong:
      return "torch.LongStorage";
    case c10::kInt:
      return "torch.IntStorage";
    case c10::kShort:
      return "torch.ShortStorage";
    case c10::kChar:
      return "torch.CharStorage";
    case c10::kByte:
      return "torch.ByteStorage";
    case c10::kBool:
      return "torch.BoolStorage";
    case c10::kComplexFloat:
      return "torch.ComplexFloatStorage";
    case c10::kComplexDouble:
      return "torch.ComplexDoubleStorage";
    default:
      return "";
  }
}

}  // namespace

DcpDirectoryReader::~DcpDirectoryReader() = default;

const ReadOnlyFile& DcpDirectoryReader::file(const std::string& relative_path) const {
  auto found = open_files_.find(relative_path);
  if (found != open_files_.end()) return *found->second;
  // A checkpoint of thousands of ranks must not take thousands of descriptors (Gloo needs some too):
  // at most 64 files stay open; reads go through tensors in order, so evicting all costs little.
  // (No caller keeps a file across a call of this function.)
  if (open_files_.size() >= 64) open_files_.clear();
  // No size bound: items are read by the lengths .metadata gives, each checked against the size.
  auto opened = std::make_unique<ReadOnlyFile>((fs::path(directory_) / relative_path).string(),
                                               std::numeric_limits<uint64_t>::max(), "checkpoint file");
  return *open_files_.emplace(relative_path, std::move(opened)).first->second;
}

std::optional<int64_t> DcpDirectoryReader::raw_data_offset(const std::string& key, const DcpTensor& tensor,
                                                           size_t chunk_index) const {
  // Where the chunk's elements lie in its file, when its archive holds exactly what torch.save of a
  // contiguous tensor writes: then rows are read from there straight into the caller's memory.
  // Anything else returns nullopt and goes through the unpickler, which checks it in full.
  const auto cache_key = std::make_pair(key, chunk_index);
  if (auto found = raw_offsets_.find(cache_key); found != raw_offsets_.end()) return found->second;
  std::optional<int64_t> result;
  const auto& chunk = tensor.chunks[chunk_index];
  const auto& storage = chunk.storage;
  const char* expected_class = storage_class(tensor.dtype);
  try {
    if (*expected_class == 0 || storage.length < 0) throw std::runtime_error("no fast path");
    caffe2::serialize::PyTorchStreamReader archive(
        std::make_shared<ItemAdapter>(file(storage.relative_path), storage.offset, storage.length));
    auto [pickle, pickle_size] = archive.getRecord("data.pkl");
    static const std::set<std::string> allowed = [] {
      std::set<std::string> names = {kPersistentLoad, "torch._utils._rebuild_tensor_v2", "collections.OrderedDict"};
      for (auto dtype : {c10::kDouble, c10::kFloat, c10::kHalf, c10::kBFloat16, c10::kLong, c10::kInt, c10::kShort,
                         c10::kChar, c10::kByte, c10::kBool, c10::kComplexFloat, c10::kComplexDouble}) {
        names.insert(storage_class(dtype));
      }
      return names;
    }();
    const auto document = restricted_unpickle(static_cast<const uint8_t*>(pickle.get()), pickle_size, allowed, "item");
    using Kind = PickleValue::Kind;
    const auto& root = *document.root;
    auto integers = [](const PickleValue& tuple, std::vector<int64_t>& out) {
      if (tuple.kind != Kind::kTuple) return false;
      for (const auto* item : tuple.items) {
        if (item->kind != Kind::kInt) return false;
        out.push_back(item->integer);
      }
      return true;
    };
    int64_t numel = 1;
    for (const auto size : chunk.sizes) numel *= size;
    std::vector<int64_t> sizes, strides, contiguous(chunk.sizes.size(), 1);
    for (size_t dim = chunk.sizes.size(); dim-- > 1;) contiguous[dim - 1] = contiguous[dim] * chunk.sizes[dim];
    if (root.kind == Kind::kObject && root.callee->text == "torch._utils._rebuild_tensor_v2" &&
        root.arguments->items.size() >= 4) {
      const auto& arguments = root.arguments->items;
      const auto* reference = arguments[0];
      if (reference->kind == Kind::kObject && reference->callee->text == kPersistentLoad &&
          reference->arguments->items.size() == 1 && reference->arguments->items[0]->kind == Kind::kTuple) {
        const auto& fields = reference->arguments->items[0]->items;
        if (fields.size() == 5 && fields[1]->kind == Kind::kGlobal && fields[1]->text == expected_class &&
            fields[2]->kind == Kind::kString && fields[4]->kind == Kind::kInt && fields[4]->integer == numel &&
            arguments[1]->kind == Kind::kInt && arguments[1]->integer == 0 && integers(*arguments[2], sizes) &&
            integers(*arguments[3], strides) && sizes == chunk.sizes && (numel == 0 || strides == contiguous)) {
          const auto record = "data/" + fields[2]->text;
          int64_t bytes = 0;
          if (!c10::mul_overflows(numel, static_cast<int64_t>(c10::elementSize(tensor.dtype)), &bytes) &&
              archive.hasRecord(record) && static_cast<int64_t>(archive.getRecordSize(record)) == bytes) {
            const auto offset = static_cast<int64_t>(archive.getRecordOffset(record));
            if (offset >= 0 && offset <= storage.length - bytes) result = storage.offset + offset;
          }
        }
      }
    }
  } catch (const std::exception&) {
    result.reset();  // the unpickler's path names what is wrong
  }
  raw_offsets_[cache_key] = result;
  return result;
}

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

void DcpDirectoryReader::check_files() {
  // Every file the metadata names is there, a regular file, long enough for its items and (when
  // fsdp.cpp wrote it) of this save and its rank, before anything is loaded: a missing rank's
  // file, or one from another save, is named here, not half way through a load.
  std::map<std::string, File> files;
  auto open_file = [&](const DcpStorage& storage, const std::string& key) {
    if (storage.length < 0 || files.count(storage.relative_path)) return;  // an empty chunk has no item
    const auto path = fs::path(directory_) / storage.relative_path;
    std::error_code error;
    TORCH_CHECK(fs::is_regular_file(fs::symlink_status(path, error)), "'", directory_, "' lacks '",
                storage.relative_path, "', which its .metadata names for '", key,
                "' (or it is not a regular file): the checkpoint is incomplete, or a rank's file was removed");
    const auto& opened = file(storage.relative_path);
    File checked;
    checked.size = static_cast<int64_t>(opened.size());
    checked.found = read_identity_footer(opened);
    if (checked.found) checked.size -= checked.found->footer_bytes;
    files.emplace(storage.relative_path, std::move(checked));
  };
  auto check_bounds = [&](const DcpStorage& storage, const std::string& key) {
    if (storage.length < 0) return;
    const auto size = files.at(storage.relative_path).size;
    TORCH_CHECK(storage.offset <= size && storage.length <= size - storage.offset, item_name(storage), " (item '", key,
                "') runs past the end of the file (", size,
                " bytes): the file is truncated or belongs to another save");
  };
  for (const auto& [key, tensor] : metadata_.tensors) {
    for (const auto& chunk : tensor.chunks) open_file(chunk.storage, key);
  }
  for (const auto& [key, storage] : metadata_.byte_items) open_file(storage, key);
  // Files of another save or rank first (the clearest message), then items past a file's end (a
  // truncated file has lost its footer too), then files without the footer the others have.
  check_identities(files, /*require_footer=*/false);
  for (const auto& [key, tensor] : metadata_.tensors) {
    for (const auto& chunk : tensor.chunks) check_bounds(chunk.storage, key);
  }
  for (const auto& [key, storage] : metadata_.byte_items) check_bounds(storage, key);
  check_identities(files, /*require_footer=*/true);
}

void DcpDirectoryReader::check_identities(const std::map<std::string, File>& files, bool require_footer) {
  // Note [save identity]: one file with a footer makes every file need one, of this save and rank.
  std::string with_footer;
  for (const auto& [name, file] : files) {
    if (file.found) with_footer = name;
  }
  if (with_footer.empty()) return;
  const auto where = [&](const std::string& name) { return "'" + (fs::path(directory_) / name).string() + "'"; };
  const std::string remedy = ". Put back the files of one save, or load an earlier checkpoint";
  TORCH_CHECK(!metadata_.save_id.empty(), where(with_footer), " belongs to save ",
              files.at(with_footer).found->identity.save_id, ", but '", directory_,
              "/.metadata' records no save: the .metadata was replaced by one fsdp.cpp did not write", remedy);
  for (const auto& [name, file] : files) {
    if (!file.found && !require_footer) continue;
    TORCH_CHECK(file.found, where(name), " carries no save identity, but ", where(with_footer),
                " of the same directory does: it was replaced by a file another program wrote", remedy);
    const auto& identity = file.found->identity;
    TORCH_CHECK(identity.save_id == metadata_.save_id, where(name), " belongs to save ", identity.save_id, ", but '",
                directory_, "/.metadata' describes save ", metadata_.save_id,
                ": the file or the .metadata was copied from another checkpoint", remedy);
    const auto expected = "__" + std::to_string(identity.rank) + "_0.distcp";
    TORCH_CHECK(name == expected, where(name), " was written by rank ", identity.rank, " of ", identity.world_size,
                " as '", expected, "': rank files were swapped or renamed. Give each file its own name back", remedy);
  }
  identified_ = require_footer;
}

const DcpTensor& DcpDirectoryReader::tensor(const std::string& name) const {
  auto found = keys_.find(name);
  TORCH_CHECK(found != keys_.end(), description(), " has no tensor '", name, "'");
  return metadata_.tensors.at(found->second);
}

bool DcpDirectoryReader::contains(const std::string& name) const { return keys_.count(name) > 0; }

std::vector<int64_t> DcpDirectoryReader::shape(const std::string& name) const { return tensor(name).size; }

c10::ScalarType DcpDirectoryReader::scalar_type(const std::string& name) const { return tensor(name).dtype; }

std::string DcpDirectoryReader::dtype(const std::string& name) const {
  return safetensors_dtype_name(tensor(name).dtype);
}

c10::IValue DcpDirectoryReader::load_item(const DcpStorage& storage, const std::string& item) const {
  // check_files() has seen every file the metadata names (a regular file in the directory, long enough).
  const auto& opened = file(storage.relative_path);
  const auto file_size = static_cast<int64_t>(opened.size());
  TORCH_CHECK(storage.offset <= file_size && storage.length <= file_size - storage.offset, item,
              " runs past the end of the file (", file_size,
              " bytes): the file is truncated or belongs to another save");
  std::vector<char> bytes(static_cast<size_t>(storage.length));
  opened.read_exactly(bytes.data(), bytes.size(), static_cast<uint64_t>(storage.offset), item);
  return load_torch_bytes(bytes, item);
}

std::string DcpDirectoryReader::item_name(const DcpStorage& storage) const {
  return "'" + (fs::path(directory_) / storage.relative_path).string() + "' bytes " + std::to_string(storage.offset) +
         "+" + std::to_string(storage.length);
}

c10::IValue DcpDirectoryReader::byte_item(const std::string& key) const {
  auto found = metadata_.byte_items.find(key);
  TORCH_CHECK(found != metadata_.byte_items.end(), description(), " has no byte item '", key, "'");
  return load_item(found->second, item_name(found->second) + " (byte item '" + key + "')");
}

at::Tensor DcpDirectoryReader::load_chunk(const std::string& key, const DcpTensor& tensor, size_t chunk_index) const {
  const auto& chunk = tensor.chunks[chunk_index];
  const std::string item =
      item_name(chunk.storage) + " (chunk of '" + key + "' at offsets " + c10::str(chunk.offsets) + ")";
  const auto value = load_item(chunk.storage, item);
  TORCH_CHECK(value.isTensor(), item, " holds a ", value.tagKind(), ", not a tensor");
  auto loaded = value.toTensor();
  TORCH_CHECK(loaded.scalar_type() == tensor.dtype && loaded.sizes() == at::IntArrayRef(chunk.sizes), item, " holds a ",
              loaded.scalar_type(), " tensor of shape ", loaded.sizes(), ", but the metadata says ", tensor.dtype, " ",
              c10::str(chunk.sizes));
  return loaded.contiguous();
}

std::vector<int64_t> DcpDirectoryReader::block_sizes(const std::string& name, int64_t row_begin,
                                                     int64_t row_count) const {
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

void DcpDirectoryReader::read_rows(const std::string& name, int64_t row_begin, int64_t row_count,
                                   void* destination) const {
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

bool DcpDirectoryReader::copy_rows(const std::string& name, int64_t row_begin, int64_t row_count,
                                   const FileRangeWriter& copy) const {
  const auto& key = keys_.at(name);
  const auto& entry = tensor(name);
  const auto sizes = block_sizes(name, row_begin, row_count);
  if (sizes.empty()) return false;  // a scalar: one element, through read_rows
  int64_t row_bytes = static_cast<int64_t>(c10::elementSize(entry.dtype));
  for (size_t dim = 1; dim < sizes.size(); ++dim) row_bytes *= sizes[dim];
  // Chunks are listed in any order; the ranges go out in row order, so they must tile the rows.
  struct Piece {
    int64_t first;
    int64_t last;
    size_t chunk;
  };
  std::vector<Piece> pieces;
  for (size_t index = 0; index < entry.chunks.size(); ++index) {
    const auto& chunk = entry.chunks[index];
    const int64_t first = std::max(row_begin, chunk.offsets[0]);
    const int64_t last = std::min(row_begin + row_count, chunk.offsets[0] + chunk.sizes[0]);
    if (first >= last) continue;
    for (size_t dim = 1; dim < sizes.size(); ++dim) {
      if (chunk.offsets[dim] != 0 || chunk.sizes[dim] != sizes[dim]) return false;
    }
    pieces.push_back({first, last, index});
  }
  std::sort(pieces.begin(), pieces.end(), [](const Piece& a, const Piece& b) { return a.first < b.first; });
  int64_t next = row_begin;
  for (const auto& piece : pieces) {
    if (piece.first != next) return false;
    next = piece.last;
  }
  if (next != row_begin + row_count) return false;
  std::lock_guard<std::mutex> lock(cache_mutex_);
  std::vector<int64_t> offsets;
  for (const auto& piece : pieces) {
    const auto offset = raw_data_offset(key, entry, piece.chunk);
    if (!offset) return false;
    offsets.push_back(*offset);
  }
  for (size_t index = 0; index < pieces.size(); ++index) {
    const auto& piece = pieces[index];
    const auto& chunk = entry.chunks[piece.chunk];
    const int64_t start = offsets[index] + (piece.first - chunk.offsets[0]) * row_bytes;
    copy(file(chunk.storage.relative_path), static_cast<uint64_t>(start),
         static_cast<uint64_t>((piece.last - piece.first) * row_bytes),
         item_name(chunk.storage) + " (chunk of '" + key + "')");
  }
  return true;
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
    auto target = result.narrow(0, first - row_begin, last - first);
    // Rows spanning the other dimensions: read from the file straight into the result.
    bool whole_rows = result.is_contiguous();
    for (size_t dim = 1; dim < sizes.size(); ++dim)
      whole_rows = whole_rows && chunk.offsets[dim] == 0 && chunk.sizes[dim] == sizes[dim];
    if (whole_rows) {
      std::lock_guard<std::mutex> lock(cache_mutex_);
      if (const auto offset = raw_data_offset(key, entry, index)) {
        const int64_t row_bytes = target.numel() / (last - first) * static_cast<int64_t>(target.element_size());
        const int64_t start = *offset + (first - chunk.offsets[0]) * row_bytes;
        const int64_t count = (last - first) * row_bytes;
        file(chunk.storage.relative_path)
            .read_exactly(target.data_ptr(), static_cast<size_t>(count), static_cast<uint64_t>(start),
                          item_name(chunk.storage) + " (chunk of '" + key + "')");
        continue;
      }
    }
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
    for (size_t dim = 1; dim < sizes.size(); ++dim)
      target = target.narrow(static_cast<int64_t>(dim), chunk.offsets[dim], chunk.sizes[dim]);
    target.copy_(loaded.narrow(0, first - chunk.offsets[0], last - first));
  }
}

}  // namespace fsdp::detail

namespace fsdp::detail {

DcpParamGroups dcp_param_groups(const DcpDirectoryReader& reader, const std::string& expected_type) {
  const auto& metadata = reader.metadata();
  auto groups = nlohmann::json::array();
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
      // Older writers: the whole list of groups in one item (a tuple stays whole in newer ones too).
      const auto value = reader.byte_item(key);
      TORCH_CHECK(value.isList() || value.isTuple(), where, " is a ", value.tagKind(),
                  ", expected the list of parameter groups");
      const std::vector<c10::IValue> elements =
          value.isList() ? value.toList().vec() : value.toTupleRef().elements().vec();
      size_t index = 0;
      for (const auto& group : elements) {
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
