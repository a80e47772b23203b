// Private: the zip format's CRC-32 (ISO-HDLC: polynomial 0x04C11DB7, reflected, inverted), as
// zlib's crc32() computes it, at memory speed.
//
// Note [checksums at memory speed]
// Every record of a torch.save archive carries the CRC-32 of its bytes, and a SHARDED save writes
// one archive per tensor chunk: the checksum covers every byte a save writes. libtorch's zip writer
// computes it at 1.8-2.6 GB/s here, the same order as writing to the page cache: for the 6.54 GB
// checkpoint of a 0.544 B model, 2.5-3.6 CPU-seconds beside a 6.35 s save on 2 cores, most of what
// the save took over cp + sync (bench/README.md, "SHARDED save and merge-weights"). With the
// carry-less multiply (PCLMULQDQ, every x86-64 since 2010) the data is folded 64 bytes at a time
// into a 128-bit remainder and reduced once at the end (Gopal et al., "Fast CRC Computation for
// Generic Polynomials Using PCLMULQDQ", Intel, 2009): 6.7-8.1 GB/s here, against zlib's 2.1-2.7.
// Machines without it take slicing-by-8 tables. Both paths are checked against zlib on every length
// and alignment (tests/io/crc32_test.cpp).
#pragma once

#include <cstddef>
#include <cstdint>

namespace fsdp::detail {

/// The CRC-32 of `size` bytes at `data`, continuing from `crc` (0 to start), as zlib's
/// crc32(crc, data, size) returns it.
uint32_t crc32(uint32_t crc, const void* data, size_t size);

/// The same with the portable tables only (what crc32 falls back to), for the tests.
uint32_t crc32_portable(uint32_t crc, const void* data, size_t size);

}  // namespace fsdp::detail
