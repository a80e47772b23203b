#include <c10/util/Exception.h>
#include <caffe2/serialize/in_memory_adapter.h>
#include <caffe2/serialize/inline_container.h>
#include <fsdp/torch_file.h>
#include <torch/csrc/jit/serialization/import_read.h>
#include <torch/csrc/jit/serialization/pickle.h>
#include <torch/csrc/jit/serialization/pickler.h>
#include <torch/csrc/jit/serialization/storage_context.h>

#include <cstring>
#include <map>
#include <memory>
#include <set>
#include <unordered_set>

#include "io/atomic_file.h"
#include "io/read_only_file.h"
#include "io/restricted_unpickler.h"
#include "io/zip_writer.h"

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
void write_archive(const c10::IValue& value,
                   const std::function<at::Tensor(const at::Tensor& placeholder)>& materialize,
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
  // Our zip writer, not libtorch's: the same layout, with the checksums at memory speed (Note
  // [checksums at memory speed], src/io/crc32.h).
  detail::ZipWriter writer(sink);
  for (size_t index = 0; index < placeholders.size(); ++index) {
    const auto& placeholder = placeholders[index];
    auto tensor = materialize(placeholder).contiguous();
    TORCH_CHECK(tensor.sizes() == placeholder.sizes() && tensor.scalar_type() == placeholder.scalar_type(),
                "save_torch_file_streaming: tensor ", index, " is ", tensor.sizes(), " ", tensor.scalar_type(),
                " but its placeholder is ", placeholder.sizes(), " ", placeholder.scalar_type());
    writer.write_record("data/" + std::to_string(index), tensor.data_ptr(),
                        static_cast<size_t>(tensor.numel() * tensor.element_size()));
  }
  writer.write_record("data.pkl", pickle.data(), pickle.size());
  writer.finish();
}

}  // namespace

void save_torch_file_streaming(const std::string& path, const c10::IValue& value,
                               const std::function<at::Tensor(const at::Tensor& placeholder)>& materialize) {
  detail::write_file_atomically(path,
                                [&](const detail::ByteSink& sink) { write_archive(value, materialize, sink, path); });
}

void write_torch_archive(const c10::IValue& value, const std::function<void(const void* data, size_t size)>& sink,
                         const std::string& source) {
  write_archive(value, [](const at::Tensor& tensor) { return tensor; }, sink, source);
}

c10::IValue load_torch_file(const std::string& path) {
  return load_torch_bytes(detail::ReadOnlyFile(path, detail::in_memory_bound(), "torch file").read_all(), path);
}

namespace {

// libtorch's reader sizes its buffers from the lengths an archive declares, before reading a byte:
// a record's uncompressed size in the zip directory, a pickled string's length, the largest memo
// index (the memo grows to it). Tens of bytes can ask for gigabytes, which kills the process or
// escapes as std::bad_alloc (found by fuzz/torch_file_fuzz.cpp). This pass refuses, first, what no
// writer produces: a record larger than the archive (torch.save stores records uncompressed), a
// length beyond the bytes that follow it in data.pkl, a memo index beyond data.pkl's size (picklers
// number memo entries from 0). It only walks the opcodes' arguments; libtorch judges the rest.
void check_declared_sizes(caffe2::serialize::PyTorchStreamReader& reader, size_t archive_size) {
  for (const auto& name : reader.getAllRecords()) {
    const size_t record_size = reader.getRecordSize(name);
    TORCH_CHECK(record_size <= archive_size, "record '", name, "' declares ", record_size,
                " bytes, more than the whole archive");
  }
  if (!reader.hasRecord("data.pkl")) return;  // the unpickler names what is missing
  const auto record = reader.getRecord("data.pkl");
  const auto* data = static_cast<const uint8_t*>(std::get<0>(record).get());
  const size_t size = std::get<1>(record);
  size_t position = 0;
  auto need = [&](uint64_t count, size_t at) {
    TORCH_CHECK(count <= size - position, "data.pkl: the opcode at byte ", at, " needs ", count, " bytes but only ",
                size - position, " follow");
  };
  auto little_endian = [&](size_t count, size_t at) {
    need(count, at);
    uint64_t value = 0;
    for (size_t index = 0; index < count; ++index) {
      value |= static_cast<uint64_t>(data[position + index]) << (8 * index);
    }
    position += count;
    return value;
  };
  auto skip = [&](uint64_t count, size_t at) {
    need(count, at);
    position += static_cast<size_t>(count);
  };
  auto skip_line = [&](size_t at) {
    const void* end = std::memchr(data + position, '\n', size - position);
    TORCH_CHECK(end, "data.pkl: the opcode at byte ", at, " has no end of line");
    position = static_cast<size_t>(static_cast<const uint8_t*>(end) - data) + 1;
  };
  // The argument of every pickle opcode (protocols 0 to 5).
  while (position < size) {
    const size_t at = position;
    switch (data[position++]) {
      case '.':  // STOP
        return;
      case 0x80:
      case 'K':
      case 'q':
      case 'h':
      case 0x82:  // PROTO BININT1 BINPUT BINGET EXT1
        skip(1, at);
        break;
      case 'M':
      case 0x83:  // BININT2 EXT2
        skip(2, at);
        break;
      case 'J':
      case 'j':
      case 0x84:  // BININT LONG_BINGET EXT4
        skip(4, at);
        break;
      case 'r': {  // LONG_BINPUT
        const uint64_t index = little_endian(4, at);
        TORCH_CHECK(index < size, "data.pkl: the opcode at byte ", at, " stores memo entry ", index, " of a ", size,
                    "-byte pickle");
        break;
      }
      case 'G':  // BINFLOAT
        skip(8, at);
        break;
      case 0x95:  // FRAME: the length of the frame that follows
        need(little_endian(8, at), at);
        break;
      case 'U':
      case 'C':
      case 0x8c:
      case 0x8a:  // SHORT_BINSTRING SHORT_BINBYTES SHORT_BINUNICODE LONG1
        skip(little_endian(1, at), at);
        break;
      case 'T':
      case 'B':
      case 'X':
      case 0x8b:  // BINSTRING BINBYTES BINUNICODE LONG4
        skip(little_endian(4, at), at);
        break;
      case 0x8e:
      case 0x8d:
      case 0x96:  // BINBYTES8 BINUNICODE8 BYTEARRAY8
        skip(little_endian(8, at), at);
        break;
      case 'I':
      case 'L':
      case 'F':
      case 'S':
      case 'V':
      case 'P':
      case 'p':
      case 'g':  // text arguments
        skip_line(at);
        break;
      case 'c':
      case 'i':  // GLOBAL INST: module and name lines
        skip_line(at);
        skip_line(at);
        break;
      case '(':
      case '0':
      case '1':
      case '2':
      case 'N':
      case 0x88:
      case 0x89:
      case ')':
      case ']':
      case '}':
      case 0x85:
      case 0x86:
      case 0x87:
      case 't':
      case 'l':
      case 'a':
      case 'e':
      case 'd':
      case 's':
      case 'u':
      case 'R':
      case 'b':
      case 0x81:
      case 0x92:
      case 0x93:
      case 0x94:
      case 'Q':
      case 0x8f:
      case 0x90:
      case 0x91:
      case 'o':
      case 0x97:
      case 0x98:  // no argument
        break;
      default:  // not an opcode: the unpickler names it
        return;
    }
  }
}

// libtorch sizes a storage by the element count the pickle states, whatever the size of the record
// holding its bytes, so a short or empty record makes a tensor that reads past its buffer or from
// null (found by fuzz/torch_file_fuzz.cpp). The unpickler takes a storage from this context when
// it holds one under the record's key: here, every data/<key> record, sized as it is.
std::shared_ptr<torch::jit::DeserializationStorageContext> record_storages(
    caffe2::serialize::PyTorchStreamReader& reader) {
  auto storages = std::make_shared<torch::jit::DeserializationStorageContext>();
  for (const auto& name : reader.getAllRecords()) {
    if (name.rfind("data/", 0) != 0) continue;
    auto [data, size] = reader.getRecord(name);
    storages->addStorage(name.substr(5), c10::Storage(c10::Storage::use_byte_size_t(), size, std::move(data),
                                                      /*allocator=*/nullptr, /*resizable=*/false));
  }
  return storages;
}

// Offsets, sizes and strides come from the pickle unchecked too: every tensor must lie inside its
// storage. Each aggregate once (memo references share them), with an explicit stack.
// Whether a view of `sizes` and `strides` at `offset`, of elements of `element_size` bytes, lies
// inside a storage of `storage_bytes` bytes (an empty view always does), without overflow.
bool view_fits(int64_t offset, at::IntArrayRef sizes, at::IntArrayRef strides, int64_t element_size,
               int64_t storage_bytes) {
  for (const auto size : sizes) {
    if (size == 0) return true;
  }
  int64_t last = offset;
  bool fits = last >= 0;
  for (size_t dim = 0; fits && dim < sizes.size(); ++dim) {
    int64_t reach = 0;
    fits = strides[dim] >= 0 && !__builtin_mul_overflow(sizes[dim] - 1, strides[dim], &reach) &&
           !__builtin_add_overflow(last, reach, &last);
  }
  int64_t bytes = 0;
  return fits && !__builtin_add_overflow(last, int64_t{1}, &last) &&
         !__builtin_mul_overflow(last, element_size, &bytes) && bytes <= storage_bytes;
}

void check_tensors_inside_storages(const c10::IValue& root) {
  std::unordered_set<const void*> seen;
  std::vector<c10::IValue> pending{root};
  while (!pending.empty()) {
    const c10::IValue value = std::move(pending.back());
    pending.pop_back();
    if (value.isPtrType() && !seen.insert(value.internalToPointer()).second) continue;
    if (value.isTuple()) {
      for (const auto& element : value.toTupleRef().elements()) pending.push_back(element);
    } else if (value.isList()) {
      for (const auto& element : value.toListRef()) pending.push_back(element);
    } else if (value.isGenericDict()) {
      for (const auto& entry : value.toGenericDict()) {
        pending.push_back(entry.key());
        pending.push_back(entry.value());
      }
    }
    if (!value.isTensor()) continue;
    const auto& tensor = value.toTensor();
    if (!tensor.defined() || tensor.layout() != at::kStrided || !tensor.has_storage() || tensor.numel() == 0) continue;
    const bool fits =
        view_fits(tensor.storage_offset(), tensor.sizes(), tensor.strides(),
                  static_cast<int64_t>(tensor.element_size()), static_cast<int64_t>(tensor.storage().nbytes()));
    TORCH_CHECK(fits, "a ", tensor.scalar_type(), " tensor of shape ", tensor.sizes(), ", strides ", tensor.strides(),
                " and storage offset ", tensor.storage_offset(), " reaches past its ", tensor.storage().nbytes(),
                "-byte storage");
  }
}

// Note [torch files through the restricted unpickler]
// libtorch's unpickler reads what libtorch writes, and Python's torch.save of plain dicts, lists and
// tensors of the legacy dtypes; it cannot build an OrderedDict (which model.state_dict() and
// therefore Accelerate's FULL_STATE_DICT pytorch_model_fsdp.bin are) or read _rebuild_tensor_v3 (how
// torch.save writes float8 and uint16/32/64 tensors). Those files are read again through the
// restricted unpickler (src/io/restricted_unpickler.h), which builds nothing but an allow-list of
// names: dicts (OrderedDict as a dict; the _metadata it carries is ignored), lists, tuples, numbers,
// strings, None, and tensors made by _rebuild_tensor_v2 or _rebuild_tensor_v3 (or
// _rebuild_parameter around one) over a storage the archive holds, each storage record exactly as
// long as its reference says, each tensor inside its storage. No code runs and no other class is
// built; anything else is an error naming it.
class RestrictedArchive {
 public:
  RestrictedArchive(caffe2::serialize::PyTorchStreamReader& reader, const std::string& source,
                    bool sharded_tensors = false)
      : reader_(reader), source_(source), sharded_tensors_(sharded_tensors) {}

  c10::IValue convert(const detail::PickleValue& value, int depth = 0) {
    using Kind = detail::PickleValue::Kind;
    TORCH_CHECK(depth < kMaxDepth, where(), "nests deeper than ", kMaxDepth, " levels");
    switch (value.kind) {
      case Kind::kNone:
        return c10::IValue();
      case Kind::kBool:
        return value.boolean;
      case Kind::kInt:
        return value.integer;
      case Kind::kFloat:
        return value.floating;
      case Kind::kString:
      case Kind::kBytes:
        return value.text;
      default:
        break;
    }
    // Shared through the memo: one IValue (one tensor) for one pickled object.
    if (auto done = converted_.find(&value); done != converted_.end()) return done->second;
    TORCH_CHECK(in_progress_.insert(&value).second, where(), "contains itself (a cycle)");
    c10::IValue result;
    switch (value.kind) {
      case Kind::kTuple: {
        std::vector<c10::IValue> elements;
        for (const auto* item : value.items) elements.push_back(convert(*item, depth + 1));
        result = c10::ivalue::Tuple::create(std::move(elements));
        break;
      }
      case Kind::kList: {
        c10::impl::GenericList list(c10::AnyType::get());
        for (const auto* item : value.items) list.push_back(convert(*item, depth + 1));
        result = list;
        break;
      }
      case Kind::kDict: {
        bool strings = true, integers = true;
        for (size_t index = 0; index < value.items.size(); index += 2) {
          strings = strings && value.items[index]->kind == Kind::kString;
          integers = integers && value.items[index]->kind == Kind::kInt;
        }
        TORCH_CHECK(strings || integers, where(), "has a dict whose keys are neither all strings nor all integers");
        c10::impl::GenericDict dict(strings ? c10::TypePtr(c10::StringType::get()) : c10::TypePtr(c10::IntType::get()),
                                    c10::AnyType::get());
        for (size_t index = 0; index < value.items.size(); index += 2) {
          dict.insert_or_assign(convert(*value.items[index], depth + 1), convert(*value.items[index + 1], depth + 1));
        }
        result = dict;
        break;
      }
      case Kind::kObject:
        if (sharded_tensors_ && value.callee->text == "torch._tensor._rebuild_from_type_v2") {
          result = sharded_tensor(value, depth);
        } else {
          result = tensor(value, depth);
        }
        break;
      default:
        TORCH_CHECK(false, where(), "holds a bare ", value.describe(), ", which is not data");
    }
    in_progress_.erase(&value);
    converted_.emplace(&value, result);
    return result;
  }

  static const std::set<std::string>& allowed_globals() {
    static const std::set<std::string> names = [] {
      std::set<std::string> allowed = {detail::kPersistentLoad,           "collections.OrderedDict",
                                       "torch._utils._rebuild_tensor_v2", "torch._utils._rebuild_tensor_v3",
                                       "torch._utils._rebuild_parameter", "torch.storage.UntypedStorage"};
      for (const auto& [name, dtype] : typed_storages()) allowed.insert(name);
      for (const auto& [name, dtype] : dtype_names()) allowed.insert(name);
      return allowed;
    }();
    return names;
  }

  // What a torch.save of a torch.distributed ShardedTensor adds (FSDP1's LOCAL_STATE_DICT): the
  // subclass rebuild, the dataclasses of its shards and metadata, and the names inside them. They
  // become objects of the restricted unpickler, never called; `__builtin__.getattr` is how the
  // pickle names the nested class ShardedTensor.ProcessGroupState, which the unpickler turns into
  // that class's name (allowed here) without calling getattr.
  static const std::set<std::string>& sharded_tensor_globals() {
    static const std::set<std::string> names = [] {
      auto allowed = allowed_globals();
      for (const char* name :
           {"torch._tensor._rebuild_from_type_v2", "torch._utils._rebuild_wrapper_subclass",
            "torch.distributed._shard.sharded_tensor.api.ShardedTensor",
            "torch.distributed._shard.sharded_tensor.shard.Shard", "torch.distributed._shard.metadata.ShardMetadata",
            "torch.distributed._shard.sharded_tensor.metadata.ShardedTensorMetadata",
            "torch.distributed._shard.sharded_tensor.metadata.TensorProperties",
            "torch.distributed._shard.sharded_tensor.metadata.MEM_FORMAT_ENCODING",
            "torch.distributed._shard.sharding_spec.chunk_sharding_spec.ChunkShardingSpec",
            "torch.distributed.remote_device._remote_device", "torch.Size", "torch.device",
            "torch.serialization._get_layout", "__builtin__.getattr",
            "torch.distributed._shard.sharded_tensor.api.ShardedTensor.ProcessGroupState"}) {
        allowed.insert(name);
      }
      return allowed;
    }();
    return names;
  }

 private:
  static constexpr int kMaxDepth = 100;

  // A dataclass's pickled state: its field dict, or (None, field dict) for one with __slots__.
  const detail::PickleValue& fields_of(const detail::PickleValue& object, const char* what) const {
    using Kind = detail::PickleValue::Kind;
    const auto* state = object.state;
    if (state != nullptr && state->kind == Kind::kTuple && state->items.size() == 2 &&
        state->items[1]->kind == Kind::kDict) {
      state = state->items[1];
    }
    TORCH_CHECK(state != nullptr && state->kind == Kind::kDict, where(), "has a ", what, " (", object.describe(),
                ") without its fields");
    return *state;
  }

  // _rebuild_from_type_v2(_rebuild_wrapper_subclass, ShardedTensor, args, state), state being
  // (local_shards, ShardedTensorMetadata, ProcessGroupState, sharding spec, init_rrefs): read as
  // {"sharded_tensor_size": [...], "local_shards": [{"tensor", "offsets", "sizes"}, ...]}.
  c10::IValue sharded_tensor(const detail::PickleValue& call, int depth) {
    using Kind = detail::PickleValue::Kind;
    const auto& arguments = call.arguments->items;
    TORCH_CHECK(arguments.size() == 4 && arguments[1]->kind == Kind::kGlobal &&
                    arguments[1]->text == "torch.distributed._shard.sharded_tensor.api.ShardedTensor" &&
                    arguments[3]->kind == Kind::kTuple && arguments[3]->items.size() >= 2 &&
                    arguments[3]->items[0]->kind == Kind::kList && arguments[3]->items[1]->kind == Kind::kObject,
                where(), "has a tensor subclass that is not a ShardedTensor with its local shards and metadata");
    const auto& state = arguments[3]->items;
    const auto& metadata = fields_of(*state[1], "ShardedTensorMetadata");
    const auto* size = metadata.find("size");
    TORCH_CHECK(size != nullptr && size->kind == Kind::kObject && size->callee->text == "torch.Size" &&
                    size->arguments->items.size() == 1,
                where(), "has a ShardedTensor without its torch.Size");
    const auto global = integers(size->arguments->items[0], "has a ShardedTensor whose size", /*list_too=*/true);
    c10::impl::GenericList shards(c10::AnyType::get());
    for (const auto* shard : state[0]->items) {
      TORCH_CHECK(
          shard->kind == Kind::kObject && shard->callee->text == "torch.distributed._shard.sharded_tensor.shard.Shard",
          where(), "has a ShardedTensor whose local shard is a ", shard->describe());
      const auto& fields = fields_of(*shard, "Shard");
      const auto* data = fields.find("tensor");
      const auto* shard_metadata = fields.find("metadata");
      TORCH_CHECK(data != nullptr && data->kind == Kind::kObject && shard_metadata != nullptr &&
                      shard_metadata->kind == Kind::kObject,
                  where(), "has a ShardedTensor's Shard without its tensor and metadata");
      const auto& placement = fields_of(*shard_metadata, "ShardMetadata");
      const auto offsets = integers(placement.find("shard_offsets"), "has a ShardedTensor shard whose offsets", true);
      const auto sizes = integers(placement.find("shard_sizes"), "has a ShardedTensor shard whose sizes", true);
      // Whether the shard lies inside the whole and its tensor has its sizes is checked once, by
      // state_dict_with_sharded_tensors_from_bytes, which reads this dict (or one a file spells so).
      auto local = convert(*data, depth + 1);
      c10::impl::GenericDict entry(c10::StringType::get(), c10::AnyType::get());
      entry.insert("tensor", local);
      entry.insert("offsets", c10::IValue(offsets));
      entry.insert("sizes", c10::IValue(sizes));
      shards.push_back(entry);
    }
    c10::impl::GenericDict result(c10::StringType::get(), c10::AnyType::get());
    result.insert("sharded_tensor_size", c10::IValue(global));
    result.insert("local_shards", shards);
    return result;
  }

  static const std::map<std::string, c10::ScalarType>& typed_storages() {
    static const std::map<std::string, c10::ScalarType> storages = {
        {"torch.DoubleStorage", c10::kDouble},
        {"torch.FloatStorage", c10::kFloat},
        {"torch.HalfStorage", c10::kHalf},
        {"torch.BFloat16Storage", c10::kBFloat16},
        {"torch.LongStorage", c10::kLong},
        {"torch.IntStorage", c10::kInt},
        {"torch.ShortStorage", c10::kShort},
        {"torch.CharStorage", c10::kChar},
        {"torch.ByteStorage", c10::kByte},
        {"torch.BoolStorage", c10::kBool},
        {"torch.ComplexFloatStorage", c10::kComplexFloat},
        {"torch.ComplexDoubleStorage", c10::kComplexDouble}};
    return storages;
  }
  // The dtypes _rebuild_tensor_v3 names (a torch.dtype pickles as the global torch.<name>).
  static const std::map<std::string, c10::ScalarType>& dtype_names() {
    static const std::map<std::string, c10::ScalarType> dtypes = {{"torch.float64", c10::kDouble},
                                                                  {"torch.float32", c10::kFloat},
                                                                  {"torch.float16", c10::kHalf},
                                                                  {"torch.bfloat16", c10::kBFloat16},
                                                                  {"torch.int64", c10::kLong},
                                                                  {"torch.int32", c10::kInt},
                                                                  {"torch.int16", c10::kShort},
                                                                  {"torch.int8", c10::kChar},
                                                                  {"torch.uint8", c10::kByte},
                                                                  {"torch.bool", c10::kBool},
                                                                  {"torch.complex64", c10::kComplexFloat},
                                                                  {"torch.complex128", c10::kComplexDouble},
                                                                  {"torch.uint16", c10::kUInt16},
                                                                  {"torch.uint32", c10::kUInt32},
                                                                  {"torch.uint64", c10::kUInt64},
                                                                  {"torch.float8_e4m3fn", c10::kFloat8_e4m3fn},
                                                                  {"torch.float8_e5m2", c10::kFloat8_e5m2},
                                                                  {"torch.float8_e4m3fnuz", c10::kFloat8_e4m3fnuz},
                                                                  {"torch.float8_e5m2fnuz", c10::kFloat8_e5m2fnuz}};
    return dtypes;
  }

  std::string where() const { return "torch file '" + source_ + "' "; }

  // At most 64 non-negative integers: a tensor's sizes and strides (a tuple), a ShardedTensor's size
  // and its shards' offsets and sizes (a tuple or, in the dataclasses, a list). `what`, for errors:
  // "has a tensor whose size".
  std::vector<int64_t> integers(const detail::PickleValue* sequence, const std::string& what,
                                bool list_too = false) const {
    using Kind = detail::PickleValue::Kind;
    TORCH_CHECK(sequence != nullptr &&
                    (sequence->kind == Kind::kTuple || (list_too && sequence->kind == Kind::kList)) &&
                    sequence->items.size() <= 64,
                where(), what, " is ", sequence ? "a " + sequence->describe() : std::string("missing"), ", expected a ",
                list_too ? "list or tuple" : "tuple", " of at most 64 integers");
    std::vector<int64_t> values;
    for (const auto* item : sequence->items) {
      TORCH_CHECK(item->kind == Kind::kInt && item->integer >= 0, where(), what, " holds a ", item->describe(),
                  " that is not a non-negative integer");
      values.push_back(item->integer);
    }
    return values;
  }

  at::Tensor tensor(const detail::PickleValue& call, int depth) {
    using Kind = detail::PickleValue::Kind;
    const auto& name = call.callee->text;
    const auto& arguments = call.arguments->items;
    if (name == "torch._utils._rebuild_parameter") {
      // _rebuild_parameter(data, requires_grad, backward_hooks): the tensor is what is kept.
      TORCH_CHECK(!arguments.empty() && arguments[0]->kind == Kind::kObject, where(),
                  "has a _rebuild_parameter without a tensor");
      return convert(*arguments[0], depth + 1).toTensor();
    }
    const bool v3 = name == "torch._utils._rebuild_tensor_v3";
    TORCH_CHECK(v3 || name == "torch._utils._rebuild_tensor_v2", where(), "holds an object of ", name,
                ", which a torch file of tensors does not hold");
    TORCH_CHECK(arguments.size() >= (v3 ? 7u : 4u) && arguments[1]->kind == Kind::kInt && arguments[1]->integer >= 0,
                where(), "has a ", name, " call with arguments it does not take");
    const auto* reference = arguments[0];
    TORCH_CHECK(reference->kind == Kind::kObject && reference->callee->text == detail::kPersistentLoad &&
                    reference->arguments->items.size() == 1 && reference->arguments->items[0]->kind == Kind::kTuple,
                where(), "has a tensor without a storage reference");
    const auto& fields = reference->arguments->items[0]->items;
    TORCH_CHECK(fields.size() == 5 && fields[0]->kind == Kind::kString && fields[0]->text == "storage" &&
                    fields[1]->kind == Kind::kGlobal && fields[2]->kind == Kind::kString &&
                    fields[4]->kind == Kind::kInt && fields[4]->integer >= 0,
                where(), "has a storage reference that is not ('storage', class, key, location, size)");
    c10::ScalarType dtype;
    int64_t bytes = 0;
    if (v3) {
      TORCH_CHECK(fields[1]->text == "torch.storage.UntypedStorage", where(), "has a _rebuild_tensor_v3 over a ",
                  fields[1]->text, ", expected torch.storage.UntypedStorage");
      TORCH_CHECK(arguments[6]->kind == Kind::kGlobal && dtype_names().count(arguments[6]->text), where(),
                  "has a _rebuild_tensor_v3 whose dtype is a ", arguments[6]->describe());
      dtype = dtype_names().at(arguments[6]->text);
      bytes = fields[4]->integer;
    } else {
      auto storage_class = typed_storages().find(fields[1]->text);
      TORCH_CHECK(storage_class != typed_storages().end(), where(), "has a _rebuild_tensor_v2 over a storage of class ",
                  fields[1]->text,
                  ", expected one of torch's typed storages (torch.FloatStorage, torch.HalfStorage, ...)");
      dtype = storage_class->second;
      TORCH_CHECK(!c10::mul_overflows(fields[4]->integer, static_cast<int64_t>(c10::elementSize(dtype)), &bytes),
                  where(), "has a storage of ", fields[4]->integer, " elements, too many");
    }
    const auto& key = fields[2]->text;
    auto storage = storages_.find(key);
    if (storage == storages_.end()) {
      const auto record = "data/" + key;
      TORCH_CHECK(reader_.hasRecord(record), where(), "lacks the storage record '", record, "'");
      auto [data, size] = reader_.getRecord(record);
      TORCH_CHECK(static_cast<int64_t>(size) == bytes, where(), "has a storage record '", record, "' of ", size,
                  " bytes where its reference says ", bytes);
      storage = storages_
                    .emplace(key, c10::Storage(c10::Storage::use_byte_size_t(), size, std::move(data),
                                               /*allocator=*/nullptr, /*resizable=*/false))
                    .first;
    }
    // A storage shared by several tensors: every reference must give it the same length.
    TORCH_CHECK(static_cast<int64_t>(storage->second.nbytes()) == bytes, where(), "refers to storage '", key, "' as ",
                bytes, " bytes and elsewhere as ", storage->second.nbytes());
    const auto sizes = integers(arguments[2], "has a tensor whose size");
    const auto strides = integers(arguments[3], "has a tensor whose stride");
    TORCH_CHECK(sizes.size() == strides.size(), where(), "has a tensor with ", sizes.size(), " sizes and ",
                strides.size(), " strides");
    // The view must lie inside its storage before it is made (set_ would try to grow the storage);
    // check_tensors_inside_storages checks the whole value again afterwards.
    const int64_t offset = arguments[1]->integer;
    TORCH_CHECK(view_fits(offset, sizes, strides, static_cast<int64_t>(c10::elementSize(dtype)),
                          static_cast<int64_t>(storage->second.nbytes())),
                where(), "has a ", dtype, " tensor of sizes ", sizes, ", strides ", strides, " and storage offset ",
                offset, " that reaches past its ", storage->second.nbytes(), "-byte storage '", key, "'");
    return at::empty({0}, at::TensorOptions().dtype(dtype))
        .set_(storage->second, arguments[1]->integer, sizes, strides);
  }

  caffe2::serialize::PyTorchStreamReader& reader_;
  std::string source_;
  std::map<std::string, c10::Storage> storages_;
  std::map<const detail::PickleValue*, c10::IValue> converted_;
  std::set<const detail::PickleValue*> in_progress_;
  bool sharded_tensors_ = false;
};

c10::IValue load_torch_bytes_restricted(const std::vector<char>& bytes, const std::string& path,
                                        bool sharded_tensors = false) {
  caffe2::serialize::PyTorchStreamReader reader(
      std::make_shared<caffe2::serialize::MemoryReadAdapter>(bytes.data(), static_cast<off_t>(bytes.size())));
  check_declared_sizes(reader, bytes.size());
  auto [pickle, pickle_size] = reader.getRecord("data.pkl");
  const auto document = detail::restricted_unpickle(
      static_cast<const uint8_t*>(pickle.get()), pickle_size,
      sharded_tensors ? RestrictedArchive::sharded_tensor_globals() : RestrictedArchive::allowed_globals(), path);
  RestrictedArchive archive(reader, path, sharded_tensors);
  auto value = archive.convert(*document.root);
  check_tensors_inside_storages(value);
  return value;
}

}  // namespace

c10::IValue load_torch_bytes(const std::vector<char>& bytes, const std::string& path) {
  try {
    // What torch::pickle_load does, with the checks above around libtorch's unpickler.
    caffe2::serialize::PyTorchStreamReader reader(
        std::make_shared<caffe2::serialize::MemoryReadAdapter>(bytes.data(), static_cast<off_t>(bytes.size())));
    check_declared_sizes(reader, bytes.size());
    auto value = torch::jit::readArchiveAndTensors("data", /*pickle_prefix=*/"", /*tensor_prefix=*/"",
                                                   /*type_resolver=*/std::nullopt, /*obj_loader=*/std::nullopt,
                                                   /*device=*/std::nullopt, reader,
                                                   torch::jit::Unpickler::defaultTypeParser, record_storages(reader));
    check_tensors_inside_storages(value);
    return value;
  } catch (const c10::Error& error) {
    const std::string what = error.what_without_backtrace();
    // libtorch's unpickler turns collections.OrderedDict into None and then fails an internal assert,
    // and does not know _rebuild_tensor_v3: Note [torch files through the restricted unpickler].
    const bool ordered_dict = what.find("Expected GenericDict but got None") != std::string::npos;
    const bool newer_dtype = what.find("_rebuild_tensor_v3") != std::string::npos;
    if (ordered_dict || newer_dtype) {
      try {
        return load_torch_bytes_restricted(bytes, path);
      } catch (const c10::Error& restricted) {
        TORCH_CHECK(false, "cannot read torch file '", path, "' (", bytes.size(), " bytes), which holds ",
                    ordered_dict ? "an OrderedDict" : "a tensor written with _rebuild_tensor_v3", ": ",
                    restricted.what_without_backtrace());
      } catch (const std::exception& restricted) {
        // The zip reader under it throws std::exception subclasses too (std::bad_alloc, ...).
        TORCH_CHECK(false, "cannot read torch file '", path, "' (", bytes.size(), " bytes), which holds ",
                    ordered_dict ? "an OrderedDict" : "a tensor written with _rebuild_tensor_v3", ": ",
                    restricted.what());
      }
    }
    TORCH_CHECK(false, "cannot read torch file '", path, "' (", bytes.size(), " bytes): ", what,
                ". Expected a torch.save zip of dicts, lists and tensors");
  } catch (const std::exception& error) {
    // libtorch's unpickler also throws std::bad_alloc, std::out_of_range, ... on malformed bytes.
    TORCH_CHECK(false, "cannot read torch file '", path, "' (", bytes.size(), " bytes): ", error.what(),
                ". Expected a torch.save zip of dicts, lists and tensors");
  }
}

detail::StateDictWithShardedTensors detail::load_state_dict_with_sharded_tensors(const std::string& path) {
  return state_dict_with_sharded_tensors_from_bytes(ReadOnlyFile(path, in_memory_bound(), "torch file").read_all(),
                                                    path);
}

detail::StateDictWithShardedTensors detail::state_dict_with_sharded_tensors_from_bytes(const std::vector<char>& bytes,
                                                                                       const std::string& path) {
  c10::IValue value;
  try {
    value = load_torch_bytes_restricted(bytes, path, /*sharded_tensors=*/true);
  } catch (const c10::Error& failure) {
    TORCH_CHECK(false, "cannot read torch file '", path, "' (", bytes.size(), " bytes) as a state dict of tensors and ",
                "ShardedTensors: ", failure.what_without_backtrace());
  } catch (const std::exception& failure) {
    TORCH_CHECK(false, "cannot read torch file '", path, "' (", bytes.size(), " bytes) as a state dict of tensors and ",
                "ShardedTensors: ", failure.what());
  }
  TORCH_CHECK(value.isGenericDict(), "torch file '", path, "' holds a ", value.tagKind(), ", expected a state dict");
  StateDictWithShardedTensors result;
  for (const auto& entry : value.toGenericDict()) {
    TORCH_CHECK(entry.key().isString(), "torch file '", path, "' has a key of type ", entry.key().tagKind(),
                "; expected names (strings)");
    const auto& name = entry.key().toStringRef();
    if (entry.value().isTensor()) {
      result.tensors.emplace_back(name, entry.value().toTensor());
      continue;
    }
    // Only sharded_tensor() builds a dict with these two keys; a dict the file spells that way is
    // read the same, and every field is checked below.
    TORCH_CHECK(entry.value().isGenericDict() && entry.value().toGenericDict().contains("sharded_tensor_size") &&
                    entry.value().toGenericDict().contains("local_shards"),
                "torch file '", path, "': entry '", name, "' is a ", entry.value().tagKind(),
                ", expected a tensor or a ShardedTensor");
    const auto dict = entry.value().toGenericDict();
    ShardedTensorEntry sharded;
    TORCH_CHECK(dict.at("sharded_tensor_size").isIntList() && dict.at("local_shards").isList(), "torch file '", path,
                "': entry '", name, "' is not a ShardedTensor");
    sharded.size = dict.at("sharded_tensor_size").toIntVector();
    for (const auto& item : dict.at("local_shards").toListRef()) {
      TORCH_CHECK(item.isGenericDict(), "torch file '", path, "': entry '", name, "' has a malformed shard");
      const auto shard = item.toGenericDict();
      TORCH_CHECK(shard.contains("tensor") && shard.at("tensor").isTensor() && shard.contains("offsets") &&
                      shard.at("offsets").isIntList() && shard.contains("sizes") && shard.at("sizes").isIntList(),
                  "torch file '", path, "': entry '", name, "' has a malformed shard");
      ShardedTensorShard piece{shard.at("tensor").toTensor(), shard.at("offsets").toIntVector(),
                               shard.at("sizes").toIntVector()};
      bool inside = piece.offsets.size() == sharded.size.size() && piece.sizes.size() == sharded.size.size() &&
                    piece.tensor.sizes() == at::IntArrayRef(piece.sizes);
      for (size_t dim = 0; inside && dim < sharded.size.size(); ++dim) {
        inside = piece.offsets[dim] >= 0 && piece.sizes[dim] >= 0 && piece.offsets[dim] <= sharded.size[dim] &&
                 piece.sizes[dim] <= sharded.size[dim] - piece.offsets[dim];
      }
      TORCH_CHECK(inside, "torch file '", path, "': entry '", name, "' has a shard at ", piece.offsets, " of sizes ",
                  piece.sizes, " (a tensor of ", piece.tensor.sizes(), ") that is not inside its size ", sharded.size);
      sharded.local_shards.push_back(std::move(piece));
    }
    result.sharded.emplace_back(name, std::move(sharded));
  }
  return result;
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
