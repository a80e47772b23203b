// limit_retained_host_memory: large blocks stay mappings of their own, even after one was freed
// (which, by default, makes glibc serve blocks of that size from the heap, where freed memory stays).
#include <fsdp/fsdp.h>
#include <gtest/gtest.h>

#include <cstdlib>

#include "harness/error_message.h"

#if defined(__GLIBC__)
#include <malloc.h>
#endif

namespace fsdp {
namespace {

TEST(HostMemory, LargeBlocksStayMappingsAfterOneWasFreed) {
#if defined(__SANITIZE_ADDRESS__)
  GTEST_SKIP() << "skipped: AddressSanitizer's allocator has no mallopt thresholds to test";
#elif defined(__GLIBC__)
  limit_retained_host_memory();
  constexpr size_t kBlock = size_t{8} << 20;
  void* first = std::malloc(kBlock);
  ASSERT_NE(first, nullptr);
  std::free(first);  // without the limit, this raises the threshold above 8 MiB
  const auto before = mallinfo2().hblkhd;
  void* second = std::malloc(kBlock);
  ASSERT_NE(second, nullptr);
  const auto during = mallinfo2().hblkhd;
  std::free(second);
  EXPECT_GE(during - before, kBlock) << "an 8 MiB block came from the heap, where it would stay resident when freed";
  EXPECT_EQ(mallinfo2().hblkhd, before) << "freeing it did not unmap it";
#else
  GTEST_SKIP() << "not glibc";
#endif
}

TEST(HostMemory, ThresholdsOutsideWhatGlibcAcceptsAreErrors) {
  auto message = testing::error_message_of([] { limit_retained_host_memory(100); });
  EXPECT_NE(message.find("must be between 4096 and 32 MiB, got 100"), std::string::npos) << message;
  message = testing::error_message_of([] { limit_retained_host_memory(int64_t{64} << 20); });
  EXPECT_NE(message.find("got 67108864"), std::string::npos) << message;
}

}  // namespace
}  // namespace fsdp
