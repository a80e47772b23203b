// The pool of unit-sized blocks: a returned block is handed out again for the same size, and the
// pool never keeps more than kMaxKeptBlocks free blocks.
#include <gtest/gtest.h>

#include <ATen/ATen.h>

#include "memory/buffer_pool.h"

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

}  // namespace
}  // namespace fsdp::detail
