// The rows each rank trains on (include/fsdp/data_split.h): Accelerate's documented example, the
// rows of an epoch partitioned exactly when they split evenly, and the named errors and warning.
// Accelerate's own prepare_data_loader on every case is data_split_side_by_side_test.cpp.
#include <fsdp/data_split.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <functional>
#include <string>

namespace fsdp {
namespace {

std::string error_of(const std::function<void()>& call) {
  try {
    call();
  } catch (const c10::Error& error) {
    return error.what_without_backtrace();
  }
  return "";
}

TEST(DataSplit, AccelerateDocumentedExample) {
  // BatchSamplerShard's docstring: [[0, 1, 2, 3], [4, 5, 6, 7]] on two processes.
  const auto order = sequential_order(8);
  BatchSplitOptions whole;
  whole.batch_size = 4;
  EXPECT_EQ(split_batches_for_rank(order, whole, 2, 0), (std::vector<std::vector<int64_t>>{{0, 1, 2, 3}}));
  EXPECT_EQ(split_batches_for_rank(order, whole, 2, 1), (std::vector<std::vector<int64_t>>{{4, 5, 6, 7}}));
  BatchSplitOptions cut = whole;
  cut.split_batches = true;
  EXPECT_EQ(split_batches_for_rank(order, cut, 2, 0), (std::vector<std::vector<int64_t>>{{0, 1}, {4, 5}}));
  EXPECT_EQ(split_batches_for_rank(order, cut, 2, 1), (std::vector<std::vector<int64_t>>{{2, 3}, {6, 7}}));
}

TEST(DataSplit, AnEvenSplitPartitionsTheEpoch) {
  const auto order = seeded_random_order(96, 5, 0);
  for (bool split : {false, true}) {
    BatchSplitOptions options;
    options.batch_size = split ? 12 : 4;
    options.split_batches = split;
    std::vector<int64_t> seen;
    for (int64_t rank = 0; rank < 3; ++rank) {
      for (const auto& batch : split_batches_for_rank(order, options, 3, rank)) {
        EXPECT_EQ(batch.size(), 4u);
        seen.insert(seen.end(), batch.begin(), batch.end());
      }
    }
    std::sort(seen.begin(), seen.end());
    EXPECT_EQ(seen, sequential_order(96)) << "split_batches " << split;
  }
  // Another epoch, another order; the same seed and epoch, the same order.
  EXPECT_NE(seeded_random_order(96, 5, 1), order);
  EXPECT_EQ(seeded_random_order(96, 5, 0), order);
}

TEST(DataSplit, AGlobalBatchThatDoesNotCutIntoEqualPiecesIsANamedError) {
  BatchSplitOptions options;
  options.batch_size = 32;
  options.split_batches = true;
  const auto message = error_of([&] { split_batches_for_rank(sequential_order(64), options, 3, 0); });
  EXPECT_NE(message.find("batch_size (32"), std::string::npos) << message;
  EXPECT_NE(message.find("multiple of the number of processes (3)"), std::string::npos) << message;
  EXPECT_NE(message.find("use a batch_size of 33"), std::string::npos) << message;
  options.batch_size = 0;
  EXPECT_NE(error_of([&] { validate(options, 2); }).find("batch_size must be at least 1, got 0"), std::string::npos);
  options.batch_size = 4;
  EXPECT_NE(error_of([&] { split_batches_for_rank(sequential_order(8), options, 2, 2); }).find("process_index 2"),
            std::string::npos);
}

TEST(DataSplit, UnevenBatchesAcrossRanksAreWarnedAbout) {
  BatchSplitOptions options;
  options.batch_size = 4;
  options.even_batches = false;
  std::string warned;
  struct Capture : c10::WarningHandler {
    std::string* into;
    explicit Capture(std::string* into_) : into(into_) {}
    void process(const c10::Warning& warning) override { *into += warning.msg(); }
  } capture(&warned);
  c10::WarningUtils::WarningHandlerGuard capturing(&capture);
  // 5 batches over 2 ranks: rank 0 gets 3, rank 1 gets 2.
  EXPECT_EQ(split_batches_for_rank(sequential_order(20), options, 2, 1).size(), 2u);
  EXPECT_NE(warned.find("rank 0 gets 3 batches of 20 rows and rank 1 gets 2"), std::string::npos) << warned;
  EXPECT_NE(warned.find("Keep even_batches on"), std::string::npos) << warned;
}

}  // namespace
}  // namespace fsdp
