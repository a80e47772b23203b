// safetensors files: a strict reader and the reference writer's layout.
//
// Layout: an 8-byte little-endian header length N, N bytes of JSON header, then the data section;
// every tensor's "data_offsets" are relative to the data section. The reader treats every byte as
// untrusted: it maps the file and rejects, naming the file and the tensor, a header longer than
// 100 MB or than the file, a header that is not UTF-8 JSON object text, unknown dtypes, duplicate
// names, sizes that overflow, offsets that overlap, leave gaps or do not end exactly at the end of the
// file, and byte sizes that differ from numel x element size. The writer sorts tensors by dtype
// alignment (largest first) then name, writes compact JSON with "__metadata__" first, and pads the
// header with spaces to a multiple of 8, as huggingface/safetensors does.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace fsdp {
namespace detail {
class ReadOnlyFile;  // src/io/read_only_file.h (private)
}  // namespace detail

/// "F32", "BF16", ... for a libtorch dtype. Throws for dtypes safetensors has no name for.
std::string safetensors_dtype_name(c10::ScalarType dtype);
/// The libtorch dtype of a safetensors dtype name. The sub-byte names (F4, F6_*) throw, naming the
/// dtype.
c10::ScalarType safetensors_scalar_type(const std::string& dtype);

struct SafetensorsTensorInfo {
  std::string name;
  /// The dtype name as written in the file.
  std::string dtype;
  std::vector<int64_t> shape;
  /// Byte range [begin, end) relative to the data section.
  int64_t begin = 0;
  int64_t end = 0;
};

struct SafetensorsHeader {
  /// The "__metadata__" entries (string values only).
  std::map<std::string, std::string> metadata;
  /// Every tensor, in data-section order.
  std::vector<SafetensorsTensorInfo> tensors;
  /// File offset of the data section (8 + header length).
  int64_t data_offset = 0;
  /// Name -> position in `tensors` (filled by the parser).
  std::map<std::string, size_t> index;
  /// The tensor named `name`, or nullptr.
  const SafetensorsTensorInfo* find(const std::string& name) const;
};

/// Parses and validates the bytes of a whole file. `source` names the file in errors.
SafetensorsHeader parse_safetensors(const uint8_t* bytes, size_t size, const std::string& source);

/// A read-only, memory-mapped safetensors file.
class SafetensorsReader {
 public:
  explicit SafetensorsReader(const std::string& path);
  ~SafetensorsReader();
  SafetensorsReader(SafetensorsReader&& other) noexcept;
  SafetensorsReader& operator=(SafetensorsReader&& other) noexcept;
  SafetensorsReader(const SafetensorsReader&) = delete;
  SafetensorsReader& operator=(const SafetensorsReader&) = delete;

  const std::string& path() const { return path_; }
  const SafetensorsHeader& header() const { return header_; }
  bool contains(const std::string& name) const { return header_.find(name) != nullptr; }
  /// A copy of tensor `name` (an error names the file and lists nothing else when it is missing).
  at::Tensor tensor(const std::string& name) const;
  /// A copy of rows [row_begin, row_begin + row_count) on dim 0 of tensor `name`; only those bytes
  /// are touched.
  at::Tensor rows(const std::string& name, int64_t row_begin, int64_t row_count) const;
  /// The raw bytes of those rows, read into `destination` (row_count x row bytes) without mapping
  /// them: large reads leave no file pages in this process's resident memory.
  void read_rows(const std::string& name, int64_t row_begin, int64_t row_count, void* destination) const;
  /// Bytes in one row (dim 0) of tensor `name` (the whole tensor for 0-dim).
  int64_t row_bytes(const std::string& name) const;

 private:
  const SafetensorsTensorInfo& info(const std::string& name) const;
  std::string path_;
  std::unique_ptr<detail::ReadOnlyFile> file_;
  SafetensorsHeader header_;
};

/// One tensor of a file written piece by piece.
struct SafetensorsEntry {
  std::string name;
  /// A safetensors dtype name ("F32", ...).
  std::string dtype;
  std::vector<int64_t> shape;
};

/// Appends bytes to the file being written.
using ByteWriter = std::function<void(const void* data, size_t size)>;

/// Writes a safetensors file atomically without holding its tensors: `write_data(entry, writer)` is
/// called once per tensor, in file order, and must write exactly that tensor's bytes (row-major,
/// little-endian). "format": "pt" is added to `metadata`.
void write_safetensors_streaming(
    const std::string& path, const std::vector<SafetensorsEntry>& entries, std::map<std::string, std::string> metadata,
    const std::function<void(const SafetensorsEntry& entry, const ByteWriter& writer)>& write_data);

namespace detail {
/// Not part of the API (detail): appends `count` bytes of an open file from `offset`, copied inside
/// the kernel where it can; `item` names them in errors (src/io/atomic_file.h's RangeSink).
using FileRangeWriter =
    std::function<void(const ReadOnlyFile& source, uint64_t offset, uint64_t count, const std::string& item)>;
/// Not part of the API (detail): write_safetensors_streaming whose `write_data` may also hand over
/// byte ranges of other files (the merge's rows, which lie in the checkpoint's files as they are).
void write_safetensors_streaming(const std::string& path, const std::vector<SafetensorsEntry>& entries,
                                 std::map<std::string, std::string> metadata,
                                 const std::function<void(const SafetensorsEntry& entry, const ByteWriter& writer,
                                                          const FileRangeWriter& copy)>& write_data);
}  // namespace detail

/// The order in which write_safetensors_streaming asks for the tensors of `entries` (indices into
/// it): the file's order, as the safetensors library lays them out (wider dtypes first, then by name).
/// A writer that produces tensors collectively (every rank gathering the same one) follows it on
/// the ranks that do not write.
std::vector<size_t> safetensors_write_order(const std::vector<SafetensorsEntry>& entries);

/// Bytes of a tensor of `dtype` and `shape` (an error for dtypes that do not fill whole bytes).
int64_t safetensors_byte_size(const std::string& dtype, const std::vector<int64_t>& shape);

/// The file's bytes for `tensors` with `metadata` as "__metadata__" (omitted when empty). Tensors must
/// be distinct, contiguous CPU tensors.
std::string serialize_safetensors(const std::vector<std::pair<std::string, at::Tensor>>& tensors,
                                  const std::map<std::string, std::string>& metadata);

/// Every tensor of a safetensors file (copies), in data-section order.
std::vector<std::pair<std::string, at::Tensor>> read_safetensors(const std::string& path);

/// Writes a safetensors file atomically (temporary name, fsync, rename) with "format": "pt" added to
/// `metadata`, as transformers requires. Tensors are written piece by piece, never copied whole.
void write_safetensors(const std::string& path, const std::vector<std::pair<std::string, at::Tensor>>& tensors,
                       std::map<std::string, std::string> metadata = {});

}  // namespace fsdp
