#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <fsdp/safetensors.h>

#include <algorithm>
#include <cstring>
#include <limits>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>

#include "io/atomic_file.h"
#include "io/read_only_file.h"

namespace fsdp {
namespace {

constexpr uint64_t kMaxHeaderBytes = 100'000'000;

struct DtypeEntry {
  const char* name;
  int bits;
  std::optional<c10::ScalarType> scalar_type;
};

// In the reference's enum order, which is increasing alignment: the writer sorts on it.
const std::vector<DtypeEntry>& dtype_table() {
  static const std::vector<DtypeEntry> table = {
      {"BOOL", 8, c10::kBool},
      {"F4", 4, std::nullopt},
      {"F6_E2M3", 6, std::nullopt},
      {"F6_E3M2", 6, std::nullopt},
      {"U8", 8, c10::kByte},
      {"I8", 8, c10::kChar},
      {"F8_E5M2", 8, c10::kFloat8_e5m2},
      {"F8_E4M3", 8, c10::kFloat8_e4m3fn},
      {"F8_E8M0", 8, c10::kFloat8_e8m0fnu},
      {"F8_E4M3FNUZ", 8, c10::kFloat8_e4m3fnuz},
      {"F8_E5M2FNUZ", 8, c10::kFloat8_e5m2fnuz},
      {"I16", 16, c10::kShort},
      {"U16", 16, c10::kUInt16},
      {"F16", 16, c10::kHalf},
      {"BF16", 16, c10::kBFloat16},
      {"I32", 32, c10::kInt},
      {"U32", 32, c10::kUInt32},
      {"F32", 32, c10::kFloat},
      {"C64", 64, c10::kComplexFloat},
      {"F64", 64, c10::kDouble},
      {"I64", 64, c10::kLong},
      {"U64", 64, c10::kUInt64},
  };
  return table;
}

const DtypeEntry* find_dtype(const std::string& name) {
  for (const auto& entry : dtype_table()) {
    if (name == entry.name) return &entry;
  }
  return nullptr;
}

size_t dtype_rank(const std::string& name) {
  const auto& table = dtype_table();
  for (size_t index = 0; index < table.size(); ++index) {
    if (name == table[index].name) return index;
  }
  return table.size();
}

bool valid_utf8(const uint8_t* bytes, size_t size) {
  size_t index = 0;
  while (index < size) {
    const uint8_t lead = bytes[index];
    size_t extra = 0;
    uint32_t code = 0;
    if (lead < 0x80) {
      ++index;
      continue;
    } else if ((lead & 0xE0) == 0xC0) {
      extra = 1, code = lead & 0x1F;
    } else if ((lead & 0xF0) == 0xE0) {
      extra = 2, code = lead & 0x0F;
    } else if ((lead & 0xF8) == 0xF0) {
      extra = 3, code = lead & 0x07;
    } else {
      return false;
    }
    for (size_t k = 1; k <= extra; ++k) {
      if (index + k >= size || (bytes[index + k] & 0xC0) != 0x80) return false;
      code = (code << 6) | (bytes[index + k] & 0x3F);
    }
    if ((extra == 1 && code < 0x80) || (extra == 2 && code < 0x800) || (extra == 3 && code < 0x10000) ||
        code > 0x10FFFF || (code >= 0xD800 && code <= 0xDFFF)) {
      return false;
    }
    index += extra + 1;
  }
  return true;
}

int64_t checked_nonnegative(const nlohmann::json& value, const std::string& source, const std::string& name,
                            const char* field) {
  TORCH_CHECK(value.is_number_integer() && (value.is_number_unsigned() || value.get<int64_t>() >= 0),
              "safetensors file '", source, "': tensor '", name, "' has a ", field, " entry ", value.dump(),
              " that is not a non-negative integer");
  TORCH_CHECK(!value.is_number_unsigned() || value.get<uint64_t>() <= static_cast<uint64_t>(INT64_MAX),
              "safetensors file '", source, "': tensor '", name, "' has a ", field, " entry ", value.dump(),
              " that overflows 64 bits");
  return value.get<int64_t>();
}

}  // namespace

std::string safetensors_dtype_name(c10::ScalarType dtype) {
  for (const auto& entry : dtype_table()) {
    if (entry.scalar_type && *entry.scalar_type == dtype) return entry.name;
  }
  TORCH_CHECK(false, "safetensors has no dtype for ", dtype, "; convert the tensor to a supported dtype first");
}

c10::ScalarType safetensors_scalar_type(const std::string& dtype) {
  const auto* entry = find_dtype(dtype);
  TORCH_CHECK(entry, "unknown safetensors dtype '", dtype, "'");
  TORCH_CHECK(entry->scalar_type, "safetensors dtype '", dtype,
              "' packs values into fewer than 8 bits, which fsdp.cpp does not read; convert the file's tensors to "
              "F32, F16, BF16 or an F8 dtype first");
  return *entry->scalar_type;
}

const SafetensorsTensorInfo* SafetensorsHeader::find(const std::string& name) const {
  if (index.size() == tensors.size()) {
    auto found = index.find(name);
    return found == index.end() ? nullptr : &tensors[found->second];
  }
  for (const auto& tensor : tensors) {
    if (tensor.name == name) return &tensor;
  }
  return nullptr;
}

SafetensorsHeader parse_safetensors(const uint8_t* bytes, size_t size, const std::string& source) {
  TORCH_CHECK(size >= 8, "safetensors file '", source, "' is ", size,
              " bytes long, shorter than the 8-byte header length; it is truncated or not a safetensors file");
  uint64_t header_length = 0;
  for (int index = 7; index >= 0; --index) header_length = (header_length << 8) | bytes[index];
  TORCH_CHECK(header_length <= kMaxHeaderBytes, "safetensors file '", source, "' declares a ", header_length,
              "-byte header; the limit is 100000000 bytes. The file is corrupt or not a safetensors file");
  TORCH_CHECK(header_length <= size - 8, "safetensors file '", source, "' declares a ", header_length,
              "-byte header but only ", size - 8, " bytes follow the length; the file is truncated");
  const uint8_t* header_bytes = bytes + 8;
  TORCH_CHECK(valid_utf8(header_bytes, header_length), "safetensors file '", source,
              "': the header is not valid UTF-8");
  std::set<std::string> seen_keys;
  std::string duplicate;
  nlohmann::json header;
  try {
    header =
        nlohmann::json::parse(header_bytes, header_bytes + header_length,
                              [&](int depth, nlohmann::json::parse_event_t event, nlohmann::json& parsed) {
                                if (depth == 1 && event == nlohmann::json::parse_event_t::key && parsed.is_string()) {
                                  if (!seen_keys.insert(parsed.get<std::string>()).second && duplicate.empty())
                                    duplicate = parsed.get<std::string>();
                                }
                                return true;
                              });
  } catch (const nlohmann::json::exception& error) {
    TORCH_CHECK(false, "safetensors file '", source, "': the header is not valid JSON (", error.what(), ")");
  }
  TORCH_CHECK(duplicate.empty(), "safetensors file '", source, "': tensor name '", duplicate,
              "' appears twice in the header");
  TORCH_CHECK(header.is_object(), "safetensors file '", source, "': the header must be a JSON object, found ",
              header.type_name());

  SafetensorsHeader result;
  result.data_offset = static_cast<int64_t>(8 + header_length);
  const uint64_t data_size = size - 8 - header_length;
  for (const auto& [name, value] : header.items()) {
    if (name == "__metadata__") {
      TORCH_CHECK(value.is_object(), "safetensors file '", source, "': __metadata__ must be an object of strings");
      for (const auto& [key, entry] : value.items()) {
        TORCH_CHECK(entry.is_string(), "safetensors file '", source, "': __metadata__ entry '", key,
                    "' must be a string, found ", entry.type_name());
        result.metadata[key] = entry.get<std::string>();
      }
      continue;
    }
    TORCH_CHECK(
        value.is_object() && value.contains("dtype") && value.contains("shape") && value.contains("data_offsets"),
        "safetensors file '", source, "': tensor '", name,
        "' must be an object with dtype, shape and data_offsets, found ", value.dump());
    SafetensorsTensorInfo info;
    info.name = name;
    TORCH_CHECK(value["dtype"].is_string(), "safetensors file '", source, "': tensor '", name,
                "' has a non-string dtype");
    info.dtype = value["dtype"].get<std::string>();
    const auto* dtype = find_dtype(info.dtype);
    TORCH_CHECK(dtype, "safetensors file '", source, "': tensor '", name, "' has unknown dtype '", info.dtype, "'");
    TORCH_CHECK(value["shape"].is_array(), "safetensors file '", source, "': tensor '", name,
                "' has a non-array shape");
    uint64_t numel = 1;
    for (const auto& dimension : value["shape"]) {
      const int64_t extent = checked_nonnegative(dimension, source, name, "shape");
      // The format's schema bounds every size by 2^48 - 1; with it a zero-sized dimension cannot hide
      // an overflow in the others.
      TORCH_CHECK(extent < (int64_t{1} << 48), "safetensors file '", source, "': tensor '", name, "' has size ", extent,
                  ", over the format's limit of 2^48 - 1; the shape element count overflows");
      info.shape.push_back(extent);
      TORCH_CHECK(!__builtin_mul_overflow(numel, static_cast<uint64_t>(extent), &numel) &&
                      numel <= static_cast<uint64_t>(INT64_MAX),
                  "safetensors file '", source, "': tensor '", name, "' has a shape whose element count overflows");
    }
    TORCH_CHECK(info.shape.size() <= 64, "safetensors file '", source, "': tensor '", name, "' has ", info.shape.size(),
                " dimensions");
    uint64_t trailing = 8;
    for (size_t dimension = 1; dimension < info.shape.size(); ++dimension) {
      TORCH_CHECK(!__builtin_mul_overflow(trailing, static_cast<uint64_t>(info.shape[dimension]), &trailing) &&
                      trailing <= static_cast<uint64_t>(INT64_MAX),
                  "safetensors file '", source, "': tensor '", name, "' has a row size that overflows");
    }
    const auto& offsets = value["data_offsets"];
    TORCH_CHECK(offsets.is_array() && offsets.size() == 2, "safetensors file '", source, "': tensor '", name,
                "' must have data_offsets [begin, end], found ", offsets.dump());
    info.begin = checked_nonnegative(offsets[0], source, name, "data_offsets");
    info.end = checked_nonnegative(offsets[1], source, name, "data_offsets");
    uint64_t bits = 0;
    TORCH_CHECK(!__builtin_mul_overflow(numel, static_cast<uint64_t>(dtype->bits), &bits), "safetensors file '", source,
                "': tensor '", name, "' has a byte size that overflows");
    TORCH_CHECK(bits % 8 == 0, "safetensors file '", source, "': tensor '", name, "' (", info.dtype,
                ") does not fill whole bytes");
    TORCH_CHECK(info.end >= info.begin && static_cast<uint64_t>(info.end - info.begin) == bits / 8,
                "safetensors file '", source, "': tensor '", name, "' has data_offsets [", info.begin, ", ", info.end,
                "] spanning ", info.end - info.begin, " bytes, but shape and dtype need ", bits / 8, " bytes");
    result.tensors.push_back(std::move(info));
  }
  std::sort(result.tensors.begin(), result.tensors.end(), [](const auto& left, const auto& right) {
    return std::tie(left.begin, left.end) < std::tie(right.begin, right.end);
  });
  int64_t expected_begin = 0;
  for (const auto& tensor : result.tensors) {
    TORCH_CHECK(tensor.begin == expected_begin, "safetensors file '", source, "': tensor '", tensor.name,
                "' starts at data offset ", tensor.begin, " but the previous tensor ends at ", expected_begin,
                tensor.begin < expected_begin ? " (the tensors overlap)" : " (a gap of unclaimed bytes)");
    expected_begin = tensor.end;
  }
  TORCH_CHECK(static_cast<uint64_t>(expected_begin) == data_size, "safetensors file '", source,
              "': the tensors end at data offset ", expected_begin, " but the data section is ", data_size,
              " bytes long", static_cast<uint64_t>(expected_begin) < data_size ? " (trailing bytes)" : " (truncated)");
  for (size_t position = 0; position < result.tensors.size(); ++position)
    result.index[result.tensors[position].name] = position;
  return result;
}

SafetensorsReader::SafetensorsReader(const std::string& path)
    // No bound on the size: the file is mapped, not read; only the header's pages are touched
    // while parsing (the header's own length is bounded by the parser), tensor data is read with pread.
    : path_(path),
      file_(std::make_unique<detail::ReadOnlyFile>(path, std::numeric_limits<uint64_t>::max(), "safetensors file")) {
  header_ = parse_safetensors(file_->map(), static_cast<size_t>(file_->size()), path);
}

SafetensorsReader::~SafetensorsReader() = default;
SafetensorsReader::SafetensorsReader(SafetensorsReader&& other) noexcept = default;
SafetensorsReader& SafetensorsReader::operator=(SafetensorsReader&& other) noexcept = default;

int64_t SafetensorsReader::row_bytes(const std::string& name) const {
  const auto& found = info(name);
  const auto dtype = safetensors_scalar_type(found.dtype);
  int64_t bytes = static_cast<int64_t>(c10::elementSize(dtype));
  for (size_t dimension = 1; dimension < found.shape.size(); ++dimension) bytes *= found.shape[dimension];
  return bytes;
}

void SafetensorsReader::read_rows(const std::string& name, int64_t row_begin, int64_t row_count,
                                  void* destination) const {
  const auto& found = info(name);
  const int64_t total_rows = found.shape.empty() ? 1 : found.shape[0];
  TORCH_CHECK(row_begin >= 0 && row_count >= 0 && row_begin + row_count <= total_rows, "safetensors file '", path_,
              "': rows [", row_begin, ", ", row_begin + row_count, ") of tensor '", name, "' are outside its ",
              total_rows, " rows");
  const int64_t bytes = row_count * row_bytes(name);
  const int64_t offset = header_.data_offset + found.begin + row_begin * row_bytes(name);
  file_->read_exactly(
      destination, static_cast<size_t>(bytes), static_cast<uint64_t>(offset),
      "tensor '" + name + "' rows [" + std::to_string(row_begin) + ", " + std::to_string(row_begin + row_count) + ")");
}

const SafetensorsTensorInfo& SafetensorsReader::info(const std::string& name) const {
  const auto* found = header_.find(name);
  TORCH_CHECK(found, "safetensors file '", path_, "' has no tensor named '", name, "' (it has ", header_.tensors.size(),
              " tensors)");
  return *found;
}

at::Tensor SafetensorsReader::tensor(const std::string& name) const {
  const auto& found = info(name);
  return rows(name, 0, found.shape.empty() ? 1 : found.shape[0]);
}

at::Tensor SafetensorsReader::rows(const std::string& name, int64_t row_begin, int64_t row_count) const {
  const auto& found = info(name);
  const auto dtype = safetensors_scalar_type(found.dtype);
  const int64_t total_rows = found.shape.empty() ? 1 : found.shape[0];
  TORCH_CHECK(row_begin >= 0 && row_count >= 0 && row_begin + row_count <= total_rows, "safetensors file '", path_,
              "': rows [", row_begin, ", ", row_begin + row_count, ") of tensor '", name, "' are outside its ",
              total_rows, " rows");
  std::vector<int64_t> shape = found.shape;
  int64_t row_bytes = static_cast<int64_t>(c10::elementSize(dtype));
  for (size_t dimension = 1; dimension < shape.size(); ++dimension) row_bytes *= shape[dimension];
  if (shape.empty()) {
    TORCH_CHECK(row_begin == 0 && row_count == 1, "a 0-dim tensor has one row");
  } else {
    shape[0] = row_count;
  }
  // Bytes go into a byte tensor first: a BOOL byte other than 0 or 1 would be undefined as a bool.
  auto bytes = at::empty({row_count * row_bytes}, at::TensorOptions().dtype(at::kByte));
  if (row_count > 0 && row_bytes > 0) read_rows(name, row_begin, row_count, bytes.data_ptr());
  if (dtype == at::kBool) {
    TORCH_CHECK(bytes.numel() == 0 || bytes.max().item<uint8_t>() <= 1, "safetensors file '", path_, "': BOOL tensor '",
                name, "' holds bytes other than 0 and 1");
  }
  return bytes.view(dtype).view(shape);
}

namespace {

// The file's order, as the safetensors library lays tensors out: wider dtypes first (the table's
// later entries), then by name.
bool written_before(const SafetensorsEntry& left, const SafetensorsEntry& right) {
  const auto left_rank = dtype_rank(left.dtype), right_rank = dtype_rank(right.dtype);
  if (left_rank != right_rank) return left_rank > right_rank;
  return left.name < right.name;
}

struct PlannedTensor {
  SafetensorsEntry entry;
  /// Set when the bytes come from a tensor in memory.
  at::Tensor tensor;
  int64_t begin = 0;
  int64_t end = 0;
};

void assign_offsets(std::vector<PlannedTensor>& planned) {
  std::set<std::string> names;
  for (const auto& item : planned) {
    TORCH_CHECK(names.insert(item.entry.name).second, "write_safetensors: tensor name '", item.entry.name,
                "' is given twice");
  }
  std::sort(planned.begin(), planned.end(), [](const PlannedTensor& left, const PlannedTensor& right) {
    return written_before(left.entry, right.entry);
  });
  int64_t offset = 0;
  for (auto& item : planned) {
    item.begin = offset;
    offset += safetensors_byte_size(item.entry.dtype, item.entry.shape);
    item.end = offset;
  }
}

std::vector<PlannedTensor> plan(const std::vector<std::pair<std::string, at::Tensor>>& tensors) {
  std::vector<PlannedTensor> planned;
  std::map<const void*, std::string> storages;
  for (const auto& [name, tensor] : tensors) {
    TORCH_CHECK(tensor.defined() && tensor.device().is_cpu(), "write_safetensors: tensor '", name,
                "' must be a defined CPU tensor");
    if (tensor.numel() > 0) {
      auto [found, inserted] = storages.emplace(tensor.storage().data(), name);
      TORCH_CHECK(inserted, "write_safetensors: tensors '", found->second, "' and '", name,
                  "' share memory (tied weights?); save one of the names only");
    }
    PlannedTensor item;
    item.entry = {name, safetensors_dtype_name(tensor.scalar_type()), tensor.sizes().vec()};
    item.tensor = tensor;
    planned.push_back(std::move(item));
  }
  assign_offsets(planned);
  return planned;
}

std::string header_text(const std::vector<PlannedTensor>& planned, const std::map<std::string, std::string>& metadata) {
  std::string text = "{";
  bool first = true;
  if (!metadata.empty()) {
    text += "\"__metadata__\":" + nlohmann::json(metadata).dump();
    first = false;
  }
  for (const auto& item : planned) {
    if (!first) text += ",";
    first = false;
    text += nlohmann::json(item.entry.name).dump() + ":{\"dtype\":\"" + item.entry.dtype +
            "\",\"shape\":" + nlohmann::json(item.entry.shape).dump() + ",\"data_offsets\":[" +
            std::to_string(item.begin) + "," + std::to_string(item.end) + "]}";
  }
  text += "}";
  text.append((8 - text.size() % 8) % 8, ' ');
  TORCH_CHECK(text.size() <= kMaxHeaderBytes, "write_safetensors: the header would be ", text.size(),
              " bytes, over the format's 100000000-byte limit; split the tensors over several files");
  return text;
}

using DataWriter = std::function<void(const SafetensorsEntry&, const ByteWriter&, const detail::FileRangeWriter& copy)>;

void emit(const std::vector<PlannedTensor>& planned, const std::map<std::string, std::string>& metadata,
          const ByteWriter& sink, const detail::RangeSink& copy, const DataWriter& write_data) {
  const auto header = header_text(planned, metadata);
  uint8_t length[8];
  uint64_t value = header.size();
  for (auto& byte : length) {
    byte = static_cast<uint8_t>(value & 0xFF);
    value >>= 8;
  }
  sink(length, 8);
  sink(header.data(), header.size());
  for (const auto& item : planned) {
    const int64_t expected = item.end - item.begin;
    int64_t written = 0;
    ByteWriter counted = [&](const void* data, size_t size) {
      written += static_cast<int64_t>(size);
      TORCH_CHECK(written <= expected, "write_safetensors: more than ", expected, " bytes given for '", item.entry.name,
                  "'");
      sink(data, size);
    };
    detail::FileRangeWriter counted_copy = [&](const detail::ReadOnlyFile& source, uint64_t offset, uint64_t count,
                                               const std::string& what) {
      written += static_cast<int64_t>(count);
      TORCH_CHECK(written <= expected, "write_safetensors: more than ", expected, " bytes given for '", item.entry.name,
                  "'");
      copy(source, offset, count, what);
    };
    if (item.tensor.defined()) {
      auto contiguous = item.tensor.contiguous();
      counted(contiguous.data_ptr(), static_cast<size_t>(expected));
    } else {
      write_data(item.entry, counted, counted_copy);
    }
    TORCH_CHECK(written == expected, "write_safetensors: ", written, " bytes given for '", item.entry.name,
                "', expected ", expected);
  }
}

}  // namespace

std::vector<size_t> safetensors_write_order(const std::vector<SafetensorsEntry>& entries) {
  std::vector<size_t> order(entries.size());
  for (size_t index = 0; index < order.size(); ++index) order[index] = index;
  std::stable_sort(order.begin(), order.end(),
                   [&](size_t left, size_t right) { return written_before(entries[left], entries[right]); });
  return order;
}

int64_t safetensors_byte_size(const std::string& dtype, const std::vector<int64_t>& shape) {
  const auto* entry = find_dtype(dtype);
  TORCH_CHECK(entry, "unknown safetensors dtype '", dtype, "'");
  int64_t numel = 1;
  for (auto extent : shape) {
    TORCH_CHECK(extent >= 0 && !__builtin_mul_overflow(numel, extent, &numel),
                "a shape with a negative or overflowing size");
  }
  int64_t bits = 0;
  TORCH_CHECK(!__builtin_mul_overflow(numel, static_cast<int64_t>(entry->bits), &bits) && bits % 8 == 0, "a ", dtype,
              " tensor of this shape does not fill whole bytes");
  return bits / 8;
}

std::string serialize_safetensors(const std::vector<std::pair<std::string, at::Tensor>>& tensors,
                                  const std::map<std::string, std::string>& metadata) {
  std::string bytes;
  emit(
      plan(tensors), metadata,
      [&](const void* data, size_t size) { bytes.append(static_cast<const char*>(data), size); }, nullptr, nullptr);
  return bytes;
}

std::vector<std::pair<std::string, at::Tensor>> read_safetensors(const std::string& path) {
  SafetensorsReader reader(path);
  std::vector<std::pair<std::string, at::Tensor>> tensors;
  for (const auto& info : reader.header().tensors) tensors.emplace_back(info.name, reader.tensor(info.name));
  return tensors;
}

void write_safetensors(const std::string& path, const std::vector<std::pair<std::string, at::Tensor>>& tensors,
                       std::map<std::string, std::string> metadata) {
  metadata["format"] = "pt";
  const auto planned = plan(tensors);
  detail::write_file_atomically_with_copies(path, [&](const detail::ByteSink& sink, const detail::RangeSink& copy) {
    emit(planned, metadata, sink, copy, nullptr);
  });
}

void detail::write_safetensors_streaming(const std::string& path, const std::vector<SafetensorsEntry>& entries,
                                         std::map<std::string, std::string> metadata, const DataWriter& write_data) {
  metadata["format"] = "pt";
  std::vector<PlannedTensor> planned;
  for (const auto& entry : entries) {
    PlannedTensor item;
    item.entry = entry;
    planned.push_back(std::move(item));
  }
  assign_offsets(planned);
  detail::write_file_atomically_with_copies(path, [&](const detail::ByteSink& sink, const detail::RangeSink& copy) {
    emit(planned, metadata, sink, copy, write_data);
  });
}

void write_safetensors_streaming(
    const std::string& path, const std::vector<SafetensorsEntry>& entries, std::map<std::string, std::string> metadata,
    const std::function<void(const SafetensorsEntry& entry, const ByteWriter& writer)>& write_data) {
  detail::write_safetensors_streaming(path, entries, std::move(metadata),
                                      [&](const SafetensorsEntry& entry, const ByteWriter& writer,
                                          const detail::FileRangeWriter&) { write_data(entry, writer); });
}

}  // namespace fsdp
