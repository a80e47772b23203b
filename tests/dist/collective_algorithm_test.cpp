// Note [Algorithms by measurement]: the thresholds the sweep in bench/README.md measured.
#include "dist/collective_algorithm.h"

#include <gtest/gtest.h>

namespace fsdp::detail {
namespace {

TEST(CollectiveAlgorithm, AllReduceTakesGloosRingBelowEightRanksAndTheDirectExchangeFromEight) {
  for (const int64_t bytes : {int64_t{64} << 10, int64_t{4} << 20, int64_t{64} << 20}) {
    EXPECT_EQ(choose_all_reduce(2, bytes), AllReduceAlgorithm::kGlooRing) << bytes;
    EXPECT_EQ(choose_all_reduce(4, bytes), AllReduceAlgorithm::kGlooRing) << bytes;
    EXPECT_EQ(choose_all_reduce(7, bytes), AllReduceAlgorithm::kGlooRing) << bytes;
    EXPECT_EQ(choose_all_reduce(8, bytes), AllReduceAlgorithm::kDirect) << bytes;
    EXPECT_EQ(choose_all_reduce(16, bytes), AllReduceAlgorithm::kDirect) << bytes;
    EXPECT_EQ(choose_all_reduce(1000, bytes), AllReduceAlgorithm::kDirect) << bytes;
  }
}

}  // namespace
}  // namespace fsdp::detail
