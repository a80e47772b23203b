// The pool of unit-sized blocks: a returned block is handed out again for the same size, and the
// pool never keeps more than kMaxKeptBlocks free blocks.
#include "memory/buffer_pool.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>

namespace fsdp::detail {
namespace {

TEST(BufferPool, AReturnedBlockIsReusedForTheSameSize) {
  auto block = take_pooled_block(12344);
  void* address = block.get();
  return_pooled_block(std::move(block), 12344);
  auto other_size = take_pooled_block(12348);
  EXPECT_NE(other_size.get(), address);
  auto again = take_pooled_block(12344);
  EXPECT_EQ(again.get(), address);
  return_pooled_block(std::move(again), 12344);
  return_pooled_block(std::move(other_size), 12348);

  auto bytes = pooled_bytes(12344);
  EXPECT_EQ(bytes.data_ptr(), address);
  auto view = bytes.view(at::kInt);
  return_pooled_bytes(view);
  EXPECT_EQ(bytes.storage().nbytes(), 0u) << "the tensor must not keep memory the pool may hand out";
}

TEST(BufferPool, KeepsAtMostTheCapOfFreeBlocks) {
  std::vector<at::DataPtr> blocks;
  for (size_t index = 0; index < kMaxKeptBlocks + 3; ++index) blocks.push_back(take_pooled_block(4096 + index));
  for (size_t index = 0; index < blocks.size(); ++index) return_pooled_block(std::move(blocks[index]), 4096 + index);
  int64_t newest = 0;
  for (size_t index = 3; index < kMaxKeptBlocks + 3; ++index) newest += 4096 + static_cast<int64_t>(index);
  EXPECT_EQ(pooled_free_bytes(), newest) << "the oldest blocks are freed first";
}

TEST(BufferPool, ABlockReturnedAfterWorkIsNotReusedBeforeTheWorkCompletes) {
  auto bytes = pooled_bytes(23456);
  void* address = bytes.data_ptr();
  bytes.fill_(7);
  bool complete = false;
  return_pooled_bytes_after(bytes, [&complete] { return complete; });
  EXPECT_EQ(pooled_busy_bytes(), 23456);
  EXPECT_EQ(bytes.storage().nbytes(), 23456u) << "a transport may still read the block: it must stay in place";
  EXPECT_EQ(bytes[0].item<uint8_t>(), 7);

  auto while_busy = take_pooled_block(23456);
  EXPECT_NE(while_busy.get(), address) << "a block in use was handed out";
  // Filling the free list past its cap must not free the busy block either.
  std::vector<at::DataPtr> others;
  for (size_t index = 0; index < kMaxKeptBlocks + 2; ++index)
    others.push_back(take_pooled_block(23456 + 16 * (index + 1)));
  for (size_t index = 0; index < others.size(); ++index)
    return_pooled_block(std::move(others[index]), 23456 + 16 * (index + 1));
  EXPECT_EQ(pooled_busy_bytes(), 23456);
  EXPECT_EQ(bytes.data_ptr(), address);

  complete = true;
  EXPECT_EQ(pooled_busy_bytes(), 0);
  EXPECT_EQ(bytes.storage().nbytes(), 0u) << "once the work completed the pool owns the memory";
  auto after = take_pooled_block(23456);
  EXPECT_EQ(after.get(), address) << "a completed block is reused";
  return_pooled_block(std::move(after), 23456);
  return_pooled_block(std::move(while_busy), 23456);
}

TEST(BufferPool, ABlockWhoseWorkAlreadyCompletedReturnsAtOnce) {
  auto bytes = pooled_bytes(34567);
  return_pooled_bytes_after(bytes, [] { return true; });
  EXPECT_EQ(bytes.storage().nbytes(), 0u);
  EXPECT_EQ(pooled_busy_bytes(), 0);
}

}  // namespace
}  // namespace fsdp::detail
