// Note [checksums at memory speed]: both of our CRC-32 paths against zlib's crc32, the checksum zip
// tools and Python's zipfile verify, on every length around the folding's block sizes, every
// alignment, and checksums continued across pieces.
#include "io/crc32.h"

#include <gtest/gtest.h>
#include <zlib.h>

#include <random>
#include <vector>

namespace fsdp::detail {
namespace {

std::vector<unsigned char> random_bytes(size_t size, unsigned seed) {
  std::mt19937 generator(seed);
  std::vector<unsigned char> bytes(size);
  for (auto& byte : bytes) byte = static_cast<unsigned char>(generator());
  return bytes;
}

uint32_t zlib_crc(uint32_t crc, const unsigned char* data, size_t size) {
  return static_cast<uint32_t>(::crc32(crc, data, static_cast<uInt>(size)));
}

TEST(Crc32, EqualsZlibForEveryLengthAndAlignment) {
  const auto bytes = random_bytes(600, 7);
  for (size_t alignment = 0; alignment < 16; ++alignment) {
    for (size_t size = 0; size + alignment <= bytes.size(); ++size) {
      const auto* data = bytes.data() + alignment;
      const uint32_t expected = zlib_crc(0, data, size);
      ASSERT_EQ(crc32(0, data, size), expected) << "size " << size << ", alignment " << alignment;
      ASSERT_EQ(crc32_portable(0, data, size), expected) << "size " << size << ", alignment " << alignment;
    }
  }
}

TEST(Crc32, EqualsZlibOnLargeBuffersAndAcrossPieces) {
  const auto bytes = random_bytes((size_t{5} << 20) + 13, 11);
  const uint32_t expected = zlib_crc(0, bytes.data(), bytes.size());
  EXPECT_EQ(crc32(0, bytes.data(), bytes.size()), expected);
  EXPECT_EQ(crc32_portable(0, bytes.data(), bytes.size()), expected);
  // Continued from a previous value, split at uneven points, as the zip writer feeds it.
  for (const size_t piece : {size_t{1}, size_t{63}, size_t{64}, size_t{1000}, size_t{1} << 20}) {
    uint32_t crc = 0;
    for (size_t done = 0; done < bytes.size(); done += piece) {
      crc = crc32(crc, bytes.data() + done, std::min(piece, bytes.size() - done));
    }
    EXPECT_EQ(crc, expected) << "pieces of " << piece;
  }
  // Patterns the folding could get wrong where random bytes would not: zeros and all ones.
  for (const unsigned char fill : {0x00, 0xFF}) {
    const std::vector<unsigned char> uniform(4099, fill);
    EXPECT_EQ(crc32(0, uniform.data(), uniform.size()), zlib_crc(0, uniform.data(), uniform.size()));
  }
}

}  // namespace
}  // namespace fsdp::detail
