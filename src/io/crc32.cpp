#include "io/crc32.h"

#include <array>
#include <cstring>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define FSDP_CRC32_FOLDING 1
#endif

namespace fsdp::detail {

namespace {

constexpr uint32_t kReflectedPolynomial = 0xEDB88320u;

// tables[k][b]: the remainder of byte b followed by k zero bytes (slicing-by-8).
using CrcTables = std::array<std::array<uint32_t, 256>, 8>;

const CrcTables& crc_tables() {
  static const CrcTables built = [] {
    CrcTables result{};
    for (uint32_t byte = 0; byte < 256; ++byte) {
      uint32_t value = byte;
      for (int bit = 0; bit < 8; ++bit) value = (value >> 1) ^ ((value & 1u) ? kReflectedPolynomial : 0u);
      result[0][byte] = value;
    }
    for (uint32_t byte = 0; byte < 256; ++byte) {
      for (size_t k = 1; k < 8; ++k)
        result[k][byte] = (result[k - 1][byte] >> 8) ^ result[0][result[k - 1][byte] & 0xFF];
    }
    return result;
  }();
  return built;
}

// On the running register (not inverted).
uint32_t update_portable(uint32_t state, const unsigned char* bytes, size_t size) {
  const auto& table = crc_tables();
  while (size >= 8) {
    uint32_t low = 0;
    uint32_t high = 0;
    std::memcpy(&low, bytes, 4);  // little-endian: x86-64 and aarch64 as built here
    std::memcpy(&high, bytes + 4, 4);
    low ^= state;
    state = table[7][low & 0xFF] ^ table[6][(low >> 8) & 0xFF] ^ table[5][(low >> 16) & 0xFF] ^ table[4][low >> 24] ^
            table[3][high & 0xFF] ^ table[2][(high >> 8) & 0xFF] ^ table[1][(high >> 16) & 0xFF] ^ table[0][high >> 24];
    bytes += 8;
    size -= 8;
  }
  while (size-- > 0) state = (state >> 8) ^ table[0][(state ^ *bytes++) & 0xFF];
  return state;
}

#ifdef FSDP_CRC32_FOLDING
// The folding constants are powers of x modulo the polynomial, bit-reflected (the paper's k1..k6
// for the reflected CRC-32): the first pair folds a 128-bit lane 64 bytes forward, the second 16
// bytes forward, the fifth folds 64 bits into 32, and the Barrett pair is the polynomial with its
// 33rd bit and floor(x^64 / P).
#define FSDP_FOLDING_TARGET __attribute__((target("pclmul,sse4.1")))

FSDP_FOLDING_TARGET inline __m128i load_lane(const unsigned char* at) {
  return _mm_loadu_si128(reinterpret_cast<const __m128i*>(at));
}

// The lane carried forward (its halves times the two constants) plus the data it lands on.
FSDP_FOLDING_TARGET inline __m128i fold_lane(__m128i lane, __m128i constants, __m128i next) {
  const __m128i low = _mm_clmulepi64_si128(lane, constants, 0x00);
  const __m128i high = _mm_clmulepi64_si128(lane, constants, 0x11);
  return _mm_xor_si128(_mm_xor_si128(low, high), next);
}

// Requires size >= 64 and a multiple of 16 (the caller passes the rest to the tables).
FSDP_FOLDING_TARGET uint32_t update_folding(uint32_t state, const unsigned char* bytes, size_t size) {
  const __m128i fold_by_four = _mm_set_epi64x(0x01c6e41596, 0x0154442bd4);
  const __m128i fold_by_one = _mm_set_epi64x(0x00ccaa009e, 0x01751997d0);
  const __m128i fold_to_32 = _mm_set_epi64x(0, 0x0163cd6124);
  const __m128i barrett = _mm_set_epi64x(0x01f7011641, 0x01db710641);
  const __m128i low_32_of_each_half = _mm_setr_epi32(-1, 0, -1, 0);

  __m128i lane0 = _mm_xor_si128(load_lane(bytes), _mm_cvtsi32_si128(static_cast<int>(state)));
  __m128i lane1 = load_lane(bytes + 16);
  __m128i lane2 = load_lane(bytes + 32);
  __m128i lane3 = load_lane(bytes + 48);
  bytes += 64;
  size -= 64;
  while (size >= 64) {
    lane0 = fold_lane(lane0, fold_by_four, load_lane(bytes));
    lane1 = fold_lane(lane1, fold_by_four, load_lane(bytes + 16));
    lane2 = fold_lane(lane2, fold_by_four, load_lane(bytes + 32));
    lane3 = fold_lane(lane3, fold_by_four, load_lane(bytes + 48));
    bytes += 64;
    size -= 64;
  }
  // Four lanes into one, then the remaining 16-byte blocks.
  __m128i remainder = fold_lane(lane0, fold_by_one, lane1);
  remainder = fold_lane(remainder, fold_by_one, lane2);
  remainder = fold_lane(remainder, fold_by_one, lane3);
  while (size >= 16) {
    remainder = fold_lane(remainder, fold_by_one, load_lane(bytes));
    bytes += 16;
    size -= 16;
  }
  // 128 bits to 64: the low half carried onto the high half.
  __m128i product = _mm_clmulepi64_si128(remainder, fold_by_one, 0x10);
  remainder = _mm_xor_si128(_mm_srli_si128(remainder, 8), product);
  // 64 bits to 32 (plus the carry into bit 32).
  product = _mm_srli_si128(remainder, 4);
  remainder = _mm_clmulepi64_si128(_mm_and_si128(remainder, low_32_of_each_half), fold_to_32, 0x00);
  remainder = _mm_xor_si128(remainder, product);
  // Barrett reduction: quotient = floor(R / P) by the precomputed inverse, remainder = R - quotient * P.
  __m128i quotient = _mm_clmulepi64_si128(_mm_and_si128(remainder, low_32_of_each_half), barrett, 0x10);
  quotient = _mm_clmulepi64_si128(_mm_and_si128(quotient, low_32_of_each_half), barrett, 0x00);
  remainder = _mm_xor_si128(remainder, quotient);
  return static_cast<uint32_t>(_mm_extract_epi32(remainder, 1));
}

bool folding_available() {
  static const bool available = __builtin_cpu_supports("pclmul") && __builtin_cpu_supports("sse4.1");
  return available;
}
#endif

}  // namespace

uint32_t crc32_portable(uint32_t crc, const void* data, size_t size) {
  return ~update_portable(~crc, static_cast<const unsigned char*>(data), size);
}

uint32_t crc32(uint32_t crc, const void* data, size_t size) {
  const auto* bytes = static_cast<const unsigned char*>(data);
  uint32_t state = ~crc;
#ifdef FSDP_CRC32_FOLDING
  if (size >= 64 && folding_available()) {
    const size_t folded = size & ~static_cast<size_t>(15);
    state = update_folding(state, bytes, folded);
    bytes += folded;
    size -= folded;
  }
#endif
  return ~update_portable(state, bytes, size);
}

}  // namespace fsdp::detail
