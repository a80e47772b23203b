// Private: the zip container of a torch.save archive, written record by record to a sink, with
// each record's CRC-32 computed as its bytes go out (Note [checksums at memory speed],
// src/io/crc32.h).
//
// The layout is the one libtorch's writer (caffe2::serialize::PyTorchStreamWriter) produces, so
// torch.load, PyTorch's DCP reader and zip tools read it as they read libtorch's: every entry is
// stored (never compressed) under "archive/<name>", its data aligned to 64 bytes by an "FB" padding
// field in the local header, followed by a data descriptor (general purpose flag bit 3) holding the
// CRC-32 and sizes; a central directory, a ZIP64 end record and its locator, and the end record
// close the archive. Records and offsets past 4 GiB get ZIP64 fields (APPNOTE 4.5.3) where the
// format needs them: a record of 4 GiB or more a ZIP64 local field and 64-bit descriptor, a size or
// offset past 4 GiB its ZIP64 directory field. (libtorch's writer also gives records that merely
// start past 4 GiB a local ZIP64 field; readers take the offset from the directory either way.)
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

namespace fsdp::detail {

class ZipWriter {
 public:
  using Sink = std::function<void(const void* data, size_t size)>;
  /// `zip64_from`: records and offsets from this many bytes get ZIP64 fields. Default: 2^32 - 1,
  /// where the zip format needs them; the tests pass less to reach that path without 4 GiB records.
  explicit ZipWriter(Sink sink, uint64_t zip64_from = 0xFFFFFFFFu);
  /// Appends record `name` (stored as "archive/<name>") with `size` bytes at `data`.
  void write_record(const std::string& name, const void* data, size_t size);
  /// Appends libtorch's closing records (version, byteorder, .data/serialization_id) and the
  /// central directory. The writer takes no record after this.
  void finish();

 private:
  struct Entry {
    std::string name;
    uint64_t offset = 0;  // of the local header
    uint64_t size = 0;
    uint32_t crc = 0;
  };
  void emit(const void* data, size_t size);
  Sink sink_;
  uint64_t zip64_from_;
  uint64_t position_ = 0;
  std::vector<Entry> entries_;
  bool finished_ = false;
};

}  // namespace fsdp::detail
