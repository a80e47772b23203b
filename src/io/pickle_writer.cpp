#include "io/pickle_writer.h"

#include <c10/util/Exception.h>

#include <cstring>

namespace fsdp::detail {

PickleWriter::PickleWriter() { bytes_ = std::string("\x80\x02", 2); }

void PickleWriter::none() { bytes_ += 'N'; }

void PickleWriter::boolean(bool value) { bytes_ += value ? '\x88' : '\x89'; }

void PickleWriter::integer(int64_t value) {
  if (value >= INT32_MIN && value <= INT32_MAX) {
    // BININT: 4-byte little-endian signed.
    const auto word = static_cast<uint32_t>(static_cast<int32_t>(value));
    bytes_ += 'J';
    for (int shift = 0; shift < 32; shift += 8) bytes_ += static_cast<char>((word >> shift) & 0xff);
    return;
  }
  // LONG1: 8 bytes of little-endian two's complement (the sign is in the top byte).
  const auto word = static_cast<uint64_t>(value);
  bytes_ += '\x8a';
  bytes_ += '\x08';
  for (int shift = 0; shift < 64; shift += 8) bytes_ += static_cast<char>((word >> shift) & 0xff);
}

void PickleWriter::floating(double value) {
  // BINFLOAT: big-endian IEEE 754 double.
  uint64_t word = 0;
  std::memcpy(&word, &value, sizeof(word));
  bytes_ += 'G';
  for (int shift = 56; shift >= 0; shift -= 8) bytes_ += static_cast<char>((word >> shift) & 0xff);
}

void PickleWriter::string(const std::string& value) {
  TORCH_CHECK(value.size() <= UINT32_MAX, "pickle: a string of ", value.size(), " bytes is too long");
  // BINUNICODE: 4-byte little-endian length, then UTF-8.
  const auto length = static_cast<uint32_t>(value.size());
  bytes_ += 'X';
  for (int shift = 0; shift < 32; shift += 8) bytes_ += static_cast<char>((length >> shift) & 0xff);
  bytes_ += value;
}

void PickleWriter::global(const std::string& module, const std::string& name) {
  TORCH_INTERNAL_ASSERT(module.find('\n') == std::string::npos && name.find('\n') == std::string::npos);
  bytes_ += 'c';
  bytes_ += module + "\n" + name + "\n";
}

void PickleWriter::mark() { bytes_ += '('; }
void PickleWriter::tuple_from_mark() { bytes_ += 't'; }
void PickleWriter::empty_tuple() { bytes_ += ')'; }
void PickleWriter::empty_dict() { bytes_ += '}'; }
void PickleWriter::set_items_from_mark() { bytes_ += 'u'; }
void PickleWriter::empty_list() { bytes_ += ']'; }
void PickleWriter::appends_from_mark() { bytes_ += 'e'; }
void PickleWriter::reduce() { bytes_ += 'R'; }
void PickleWriter::new_object() { bytes_ += '\x81'; }
void PickleWriter::build() { bytes_ += 'b'; }

void PickleWriter::put(uint32_t index) {
  bytes_ += 'r';
  for (int shift = 0; shift < 32; shift += 8) bytes_ += static_cast<char>((index >> shift) & 0xff);
}

void PickleWriter::get(uint32_t index) {
  bytes_ += 'j';
  for (int shift = 0; shift < 32; shift += 8) bytes_ += static_cast<char>((index >> shift) & 0xff);
}

std::string PickleWriter::finish() {
  bytes_ += '.';
  return std::move(bytes_);
}

}  // namespace fsdp::detail
