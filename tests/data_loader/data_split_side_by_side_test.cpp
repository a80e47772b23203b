// split_batches_for_rank against Accelerate's own prepare_data_loader (the venv's accelerate,
// tests/python/accelerate_data_split.py): on 2 and 3 processes, with and without split_batches,
// even_batches, drop_last and shuffle, datasets shorter than one round included, every process
// trains on the same rows in the same batches, or both refuse.
#include <fsdp/data_split.h>
#include <gtest/gtest.h>

#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "harness/multi_rank.h"
#include "harness/python_peer.h"

namespace fsdp {
namespace {

struct Case {
  int64_t rows, batch_size, processes;
  bool drop_last, split_batches, even_batches, shuffle;
};

std::vector<Case> cases() {
  std::vector<Case> all;
  for (int64_t processes : {2, 3}) {
    // Rows: exact rounds, one row over, a short last round, fewer rows than one round, none.
    for (int64_t rows : {24, 25, 31, 5, 0}) {
      for (int64_t batch_size : {4, 6}) {
        for (int flags = 0; flags < 16; ++flags) {
          all.push_back(
              {rows, batch_size, processes, (flags & 1) != 0, (flags & 2) != 0, (flags & 4) != 0, (flags & 8) != 0});
        }
      }
    }
  }
  return all;
}

TEST(DataSplitSideBySide, EveryRankTrainsOnTheRowsAccelerateGivesIt) {
  constexpr uint64_t kSeed = 1234;
  constexpr int64_t kEpoch = 2;
  const auto all = cases();
  nlohmann::json input = nlohmann::json::array();
  for (const auto& c : all) {
    input.push_back({{"rows", c.rows},
                     {"batch_size", c.batch_size},
                     {"drop_last", c.drop_last},
                     {"split_batches", c.split_batches},
                     {"even_batches", c.even_batches},
                     {"processes", c.processes},
                     {"shuffle", c.shuffle},
                     {"seed", kSeed},
                     {"epoch", kEpoch}});
  }
  const auto directory = testing::shared_temporary_directory();
  std::ofstream(directory + "/cases.json") << input.dump();
  ASSERT_TRUE(testing::run_python("accelerate_data_split.py",
                                  {directory + "/cases.json", directory + "/accelerate.json"},
                                  {1, std::chrono::seconds(300), {}})
                  .ok);
  const auto accelerate = nlohmann::json::parse(std::ifstream(directory + "/accelerate.json"));
  ASSERT_EQ(accelerate.size(), all.size());
  int64_t compared = 0, refused = 0;
  for (size_t index = 0; index < all.size(); ++index) {
    const auto& c = all[index];
    SCOPED_TRACE(input[index].dump());
    BatchSplitOptions options;
    options.batch_size = c.batch_size;
    options.drop_last = c.drop_last;
    options.split_batches = c.split_batches;
    options.even_batches = c.even_batches;
    auto order_of = [&] { return c.shuffle ? seeded_random_order(c.rows, kSeed, kEpoch) : sequential_order(c.rows); };
    if (accelerate[index].contains("error")) {
      EXPECT_THROW(split_batches_for_rank(order_of(), options, c.processes, 0), c10::Error)
          << "Accelerate refused: " << accelerate[index]["error"];
      ++refused;
      continue;
    }
    const auto order = order_of();
    for (int64_t rank = 0; rank < c.processes; ++rank) {
      const auto expected =
          accelerate[index]["ranks"][static_cast<size_t>(rank)].get<std::vector<std::vector<int64_t>>>();
      EXPECT_EQ(split_batches_for_rank(order, options, c.processes, rank), expected) << "rank " << rank;
      ++compared;
    }
  }
  // Both kinds occur: batch 4 on 3 processes with split_batches and a shuffled empty dataset are
  // refused, the rest compared.
  EXPECT_GT(refused, 0);
  EXPECT_GT(compared, 300);
}

}  // namespace
}  // namespace fsdp
