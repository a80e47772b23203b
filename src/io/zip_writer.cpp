#include "io/zip_writer.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <cstdio>

#include "io/crc32.h"

namespace fsdp::detail {

namespace {

constexpr uint64_t kRecordAlignment = 64;           // of each record's data (libtorch's kFieldAlignment)
constexpr uint64_t kZip32Limit = 0xFFFFFFFFu;       // a field of this value means "see the ZIP64 field"
constexpr uint16_t kStoredWithDescriptor = 0x0808;  // bit 3: data descriptor; bit 11: UTF-8 names
constexpr uint16_t kVersionZip64 = 45;
// The CRC is taken over pieces of this size just before each is written, while they are in cache.
constexpr size_t kChecksumPiece = size_t{1} << 20;

// Little-endian fields appended to a header being built.
class LittleEndianBytes {
 public:
  LittleEndianBytes& u16(uint64_t value) { return put(value, 2); }
  LittleEndianBytes& u32(uint64_t value) { return put(value, 4); }
  LittleEndianBytes& u64(uint64_t value) { return put(value, 8); }
  LittleEndianBytes& text(const std::string& value) {
    data_.insert(data_.end(), value.begin(), value.end());
    return *this;
  }
  LittleEndianBytes& fill(size_t count, char value) {
    data_.insert(data_.end(), count, value);
    return *this;
  }
  const std::vector<char>& data() const { return data_; }
  size_t size() const { return data_.size(); }

 private:
  LittleEndianBytes& put(uint64_t value, int count) {
    for (int index = 0; index < count; ++index) data_.push_back(static_cast<char>((value >> (8 * index)) & 0xFF));
    return *this;
  }
  std::vector<char> data_;
};

}  // namespace

ZipWriter::ZipWriter(Sink sink, uint64_t zip64_from) : sink_(std::move(sink)), zip64_from_(zip64_from) {}

void ZipWriter::emit(const void* data, size_t size) {
  if (size == 0) return;
  sink_(data, size);
  position_ += size;
}

void ZipWriter::write_record(const std::string& name, const void* data, size_t size) {
  TORCH_INTERNAL_ASSERT(!finished_, "zip archive: record '", name, "' written after the archive was finished");
  Entry entry;
  entry.name = "archive/" + name;
  entry.offset = position_;
  entry.size = size;
  TORCH_CHECK(entry.name.size() < 0xFFFF, "zip archive: record name '", name, "' is too long");
  // A local header whose sizes the descriptor gives; ZIP64 when the record or its offset needs it.
  const bool zip64 = size >= zip64_from_;
  LittleEndianBytes header;
  header.u32(0x04034b50).u16(zip64 ? kVersionZip64 : 0).u16(kStoredWithDescriptor).u16(0).u16(0).u16(0);
  header.u32(0).u32(zip64 ? kZip32Limit : 0).u32(zip64 ? kZip32Limit : 0);
  const size_t zip64_field = zip64 ? 4 + 16 : 0;
  // The padding field ("FB", its length, then 'Z's) that puts the data on a 64-byte boundary.
  const uint64_t before_padding = position_ + 30 + entry.name.size() + zip64_field + 4;
  const uint64_t padding = (kRecordAlignment - before_padding % kRecordAlignment) % kRecordAlignment;
  header.u16(entry.name.size()).u16(zip64_field + 4 + padding).text(entry.name);
  if (zip64) header.u16(0x0001).u16(16).u64(0).u64(0);
  header.u16(0x4246).u16(padding).fill(padding, 'Z');
  emit(header.data().data(), header.size());
  // The bytes, each piece checksummed just before it goes out.
  const auto* bytes = static_cast<const char*>(data);
  uint32_t crc = 0;
  for (size_t done = 0; done < size;) {
    const size_t piece = std::min(kChecksumPiece, size - done);
    crc = crc32(crc, bytes + done, piece);
    emit(bytes + done, piece);
    done += piece;
  }
  entry.crc = crc;
  LittleEndianBytes descriptor;
  descriptor.u32(0x08074b50).u32(crc);
  if (zip64) {
    descriptor.u64(size).u64(size);
  } else {
    descriptor.u32(size).u32(size);
  }
  emit(descriptor.data().data(), descriptor.size());
  entries_.push_back(std::move(entry));
}

void ZipWriter::finish() {
  TORCH_INTERNAL_ASSERT(!finished_, "zip archive finished twice");
  // libtorch's closing records: its file format version (3, what its pickler writes), the byte order,
  // and an identifier of the archive's contents (the names' hash, then the records' checksums).
  write_record("version", "3\n", 2);
  write_record("byteorder", "little", 6);
  uint64_t name_hash = 14695981039346656037ull;  // FNV-1a over the names written
  uint32_t combined_crc = 0;
  for (const auto& entry : entries_) {
    for (const char c : entry.name) name_hash = (name_hash ^ static_cast<unsigned char>(c)) * 1099511628211ull;
    combined_crc = crc32(combined_crc, &entry.crc, sizeof(entry.crc));
  }
  char identifier[48];
  std::snprintf(identifier, sizeof(identifier), "%020llu%020llu", static_cast<unsigned long long>(name_hash),
                static_cast<unsigned long long>(combined_crc));
  write_record(".data/serialization_id", identifier, 40);
  finished_ = true;

  const uint64_t directory_offset = position_;
  for (const auto& entry : entries_) {
    const bool large_size = entry.size >= zip64_from_;
    const bool large_offset = entry.offset >= zip64_from_;
    const size_t zip64_field = (large_size || large_offset) ? 4 + (large_size ? 16 : 0) + (large_offset ? 8 : 0) : 0;
    LittleEndianBytes header;
    header.u32(0x02014b50).u16(zip64_field ? kVersionZip64 : 0).u16(zip64_field ? kVersionZip64 : 0);
    header.u16(kStoredWithDescriptor).u16(0).u16(0).u16(0).u32(entry.crc);
    header.u32(large_size ? kZip32Limit : entry.size).u32(large_size ? kZip32Limit : entry.size);
    header.u16(entry.name.size()).u16(zip64_field).u16(0).u16(0).u16(0).u32(0);
    header.u32(large_offset ? kZip32Limit : entry.offset).text(entry.name);
    if (zip64_field) {
      header.u16(0x0001).u16(zip64_field - 4);
      if (large_size) header.u64(entry.size).u64(entry.size);
      if (large_offset) header.u64(entry.offset);
    }
    emit(header.data().data(), header.size());
  }
  const uint64_t directory_size = position_ - directory_offset;
  const uint64_t end_offset = position_;
  const uint64_t count = entries_.size();
  LittleEndianBytes end;
  // ZIP64 end of central directory record and its locator, always, as libtorch's writer does.
  end.u32(0x06064b50).u64(44).u16(0x031e).u16(kVersionZip64).u32(0).u32(0).u64(count).u64(count);
  end.u64(directory_size).u64(directory_offset);
  end.u32(0x07064b50).u32(0).u64(end_offset).u32(1);
  end.u32(0x06054b50).u16(0).u16(0).u16(std::min<uint64_t>(count, 0xFFFF)).u16(std::min<uint64_t>(count, 0xFFFF));
  end.u32(directory_size >= zip64_from_ ? kZip32Limit : directory_size);
  end.u32(directory_offset >= zip64_from_ ? kZip32Limit : directory_offset).u16(0);
  emit(end.data().data(), end.size());
}

}  // namespace fsdp::detail
