#include <fsdp/torch_file.h>

#include <c10/util/Exception.h>
#include <caffe2/serialize/in_memory_adapter.h>
#include <caffe2/serialize/inline_container.h>
#include <torch/csrc/jit/serialization/import_read.h>
#include <torch/csrc/jit/serialization/pickle.h>
#include <torch/csrc/jit/serialization/pickler.h>
#include <torch/csrc/jit/serialization/storage_context.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <memory>
#include <unordered_set>

#include "io/atomic_file.h"

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
void write_archive(const c10::IValue& value, const std::function<at::Tensor(const at::Tensor& placeholder)>& materialize,
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
  caffe2::serialize::PyTorchStreamWriter writer([&](const void* bytes, size_t size) -> size_t {
    sink(bytes, size);
    return size;
  });
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
}

}  // namespace

void save_torch_file_streaming(const std::string& path, const c10::IValue& value,
                               const std::function<at::Tensor(const at::Tensor& placeholder)>& materialize) {
  detail::write_file_atomically(path, [&](const detail::ByteSink& sink) { write_archive(value, materialize, sink, path); });
}

void write_torch_archive(const c10::IValue& value, const std::function<void(const void* data, size_t size)>& sink,
                         const std::string& source) {
  write_archive(value, [](const at::Tensor& tensor) { return tensor; }, sink, source);
}

c10::IValue load_torch_file(const std::string& path) {
  // Only regular files: opening a FIFO would wait for a writer forever.
  std::error_code error;
  TORCH_CHECK(!std::filesystem::exists(path, error) || std::filesystem::is_regular_file(path, error), "torch file '", path,
              "' is not a regular file");
  std::ifstream file(path, std::ios::binary);
  TORCH_CHECK(file, "cannot open torch file '", path, "'");
  std::vector<char> bytes((std::istreambuf_iterator<char>(file)), std::istreambuf_iterator<char>());
  return load_torch_bytes(bytes, path);
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
      case 0x80: case 'K': case 'q': case 'h': case 0x82:  // PROTO BININT1 BINPUT BINGET EXT1
        skip(1, at);
        break;
      case 'M': case 0x83:  // BININT2 EXT2
        skip(2, at);
        break;
      case 'J': case 'j': case 0x84:  // BININT LONG_BINGET EXT4
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
      case 'U': case 'C': case 0x8c: case 0x8a:  // SHORT_BINSTRING SHORT_BINBYTES SHORT_BINUNICODE LONG1
        skip(little_endian(1, at), at);
        break;
      case 'T': case 'B': case 'X': case 0x8b:  // BINSTRING BINBYTES BINUNICODE LONG4
        skip(little_endian(4, at), at);
        break;
      case 0x8e: case 0x8d: case 0x96:  // BINBYTES8 BINUNICODE8 BYTEARRAY8
        skip(little_endian(8, at), at);
        break;
      case 'I': case 'L': case 'F': case 'S': case 'V': case 'P': case 'p': case 'g':  // text arguments
        skip_line(at);
        break;
      case 'c': case 'i':  // GLOBAL INST: module and name lines
        skip_line(at);
        skip_line(at);
        break;
      case '(': case '0': case '1': case '2': case 'N': case 0x88: case 0x89: case ')': case ']': case '}':
      case 0x85: case 0x86: case 0x87: case 't': case 'l': case 'a': case 'e': case 'd': case 's': case 'u':
      case 'R': case 'b': case 0x81: case 0x92: case 0x93: case 0x94: case 'Q': case 0x8f: case 0x90: case 0x91:
      case 'o': case 0x97: case 0x98:  // no argument
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
    int64_t last = tensor.storage_offset();
    bool fits = last >= 0;
    for (int64_t dim = 0; fits && dim < tensor.dim(); ++dim) {
      int64_t reach = 0;
      fits = tensor.stride(dim) >= 0 && !__builtin_mul_overflow(tensor.size(dim) - 1, tensor.stride(dim), &reach) &&
             !__builtin_add_overflow(last, reach, &last);
    }
    int64_t bytes = 0;
    fits = fits && !__builtin_add_overflow(last, int64_t{1}, &last) &&
           !__builtin_mul_overflow(last, static_cast<int64_t>(tensor.element_size()), &bytes) &&
           bytes <= static_cast<int64_t>(tensor.storage().nbytes());
    TORCH_CHECK(fits, "a ", tensor.scalar_type(), " tensor of shape ", tensor.sizes(), ", strides ", tensor.strides(),
                " and storage offset ", tensor.storage_offset(), " reaches past its ", tensor.storage().nbytes(),
                "-byte storage");
  }
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
    // libtorch's unpickler turns collections.OrderedDict into None and then fails an internal assert.
    TORCH_CHECK(what.find("Expected GenericDict but got None") == std::string::npos, "cannot read torch file '", path,
                "': it holds an OrderedDict (what model.state_dict() returns), which libtorch's unpickler cannot read; "
                "save dict(state_dict) or a safetensors file instead");
    const bool newer_dtype = what.find("_rebuild_tensor_v3") != std::string::npos;
    TORCH_CHECK(false, "cannot read torch file '", path, "' (", bytes.size(), " bytes): ", what,
                newer_dtype ? ". The file holds a tensor of a dtype torch.save writes with _rebuild_tensor_v3 (float8, "
                              "uint16/32/64), which libtorch cannot read; save it with safetensors instead"
                            : ". Expected a torch.save zip of dicts, lists and tensors");
  } catch (const std::exception& error) {
    // libtorch's unpickler also throws std::bad_alloc, std::out_of_range, ... on malformed bytes.
    TORCH_CHECK(false, "cannot read torch file '", path, "' (", bytes.size(), " bytes): ", error.what(),
                ". Expected a torch.save zip of dicts, lists and tensors");
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
