// Note [Algorithms by measurement]: group shapes, the table's parser and the choice it makes.
#include "dist/collective_algorithm.h"

#include <c10/util/Exception.h>
#include <gtest/gtest.h>

#include "harness/error_message.h"

namespace fsdp::detail {
namespace {

using testing::error_message_of;

TEST(GroupShape, NodeMajorGroupsHaveTwoLevelsAndOthersAreFlat) {
  auto shape = group_shape({0, 0, 0, 0, 1, 1, 1, 1});
  EXPECT_EQ(shape.machines, 2);
  EXPECT_EQ(shape.ranks_per_machine, 4);
  EXPECT_TRUE(shape.two_level());
  shape = group_shape({5, 5, 3, 3, 9, 9});  // any machine labels, in order of first appearance
  EXPECT_EQ(shape.machines, 3);
  EXPECT_EQ(shape.ranks_per_machine, 2);
  EXPECT_TRUE(shape.two_level());
  shape = group_shape({0, 0, 0});
  EXPECT_EQ(shape.machines, 1);
  EXPECT_FALSE(shape.two_level());
  shape = group_shape({0, 1, 2, 3});  // one rank per machine: HYBRID_SHARD's replicate group
  EXPECT_EQ(shape.machines, 4);
  EXPECT_EQ(shape.ranks_per_machine, 1);
  EXPECT_FALSE(shape.two_level());
  // Interleaved members, or machines of unequal size: flat, every member a machine of its own.
  for (const auto& machines : {std::vector<int64_t>{0, 1, 0, 1}, std::vector<int64_t>{0, 0, 0, 1}}) {
    shape = group_shape(machines);
    EXPECT_FALSE(shape.regular);
    EXPECT_FALSE(shape.two_level());
    EXPECT_EQ(shape.machines, 4);
    EXPECT_EQ(shape.ranks_per_machine, 1);
  }
}

const char* kTable = R"(# a comment
operation machines ranks_per_machine max_bytes algorithm
all_gather	1	4	1048576	ring
all_gather	1	4	-	direct
all_gather	2	4	65536	two_level_ring
all_gather	2	4	-	two_level_direct
all_gather	4	4	-	two_level_ring
all_gather	2	1	-	ring
reduce_scatter	1	8	-	direct
)";

TEST(AlgorithmTable, TheChoiceIsTheRowOfTheNearestLayoutOfTheGroupsKindWhoseSizeHoldsTheBuffer) {
  const auto table = parse_algorithm_table(kTable, "test");
  ASSERT_EQ(table.rows.size(), 7u);
  auto choose = [&](CollectiveOperation operation, int64_t machines, int64_t per_machine, int64_t bytes) {
    return choose_algorithm(table, operation, GroupShape{machines, per_machine, true}, bytes);
  };
  const auto gather = CollectiveOperation::kAllGather;
  EXPECT_EQ(choose(gather, 1, 4, 1000).algorithm, CollectiveAlgorithm::kRing);
  EXPECT_EQ(choose(gather, 1, 4, 1048576).algorithm, CollectiveAlgorithm::kRing);
  EXPECT_EQ(choose(gather, 1, 4, 1048577).algorithm, CollectiveAlgorithm::kDirect);
  EXPECT_EQ(choose(gather, 1, 4, 1048577).row->line, 4);
  // One machine of 16: the nearest one-machine layout (1 x 4), never a two-machine row.
  EXPECT_EQ(choose(gather, 1, 16, 1000).algorithm, CollectiveAlgorithm::kRing);
  EXPECT_EQ(choose(gather, 2, 4, 1000).algorithm, CollectiveAlgorithm::kTwoLevelRing);
  EXPECT_EQ(choose(gather, 2, 4, 1 << 20).algorithm, CollectiveAlgorithm::kTwoLevelDirect);
  // 2 x 8 is nearer 2 x 4 than 4 x 4 (machines first); 3 x 4 nearer 4 x 4 by log2.
  EXPECT_EQ(choose(gather, 2, 8, 1 << 20).algorithm, CollectiveAlgorithm::kTwoLevelDirect);
  EXPECT_EQ(choose(gather, 3, 4, 1 << 20).algorithm, CollectiveAlgorithm::kTwoLevelRing);
  // One rank per machine: only rows of that kind.
  EXPECT_EQ(choose(gather, 8, 1, 1 << 20).algorithm, CollectiveAlgorithm::kRing);
  // No row of the group's kind: direct, or two_level_direct where there are two levels.
  const auto scatter = CollectiveOperation::kReduceScatter;
  EXPECT_EQ(choose(scatter, 1, 2, 100).algorithm, CollectiveAlgorithm::kDirect);
  EXPECT_EQ(choose(scatter, 2, 2, 100).algorithm, CollectiveAlgorithm::kTwoLevelDirect);
  EXPECT_EQ(choose(scatter, 2, 2, 100).row, nullptr);
  EXPECT_EQ(choose(CollectiveOperation::kAllReduce, 4, 1, 100).algorithm, CollectiveAlgorithm::kDirect);
  // A flat (irregular) group never takes a two-level row.
  EXPECT_EQ(choose_algorithm(table, gather, group_shape({0, 1, 0, 1}), 100).algorithm, CollectiveAlgorithm::kRing);
}

TEST(AlgorithmTable, TheBuiltInTableParsesAndCoversEveryOperationOnEveryKindOfLayout) {
  const auto table = parse_algorithm_table(builtin_algorithm_table_text(), "the built-in table");
  for (const auto operation :
       {CollectiveOperation::kAllGather, CollectiveOperation::kReduceScatter, CollectiveOperation::kAllReduce}) {
    for (const auto& shape : {GroupShape{1, 2, true}, GroupShape{1, 16, true}, GroupShape{2, 4, true},
                              GroupShape{4, 4, true}, GroupShape{4, 1, true}}) {
      const auto choice = choose_algorithm(table, operation, shape, 1 << 20);
      EXPECT_NE(choice.row, nullptr) << to_string(operation) << " on " << shape.machines << " x "
                                     << shape.ranks_per_machine;
      EXPECT_TRUE(algorithm_applies(choice.algorithm, shape));
    }
  }
}

TEST(AlgorithmTable, ABadTableIsANamedErrorWithTheLineAndTheFix) {
  auto message = error_message_of([] { parse_algorithm_table("all_gather 1 2 - direct\n", "'t.tsv'"); });
  EXPECT_NE(message.find("collective algorithm table 't.tsv', line 1: expected the header line"), std::string::npos)
      << message;
  const std::string header = "operation machines ranks_per_machine max_bytes algorithm\n";
  message = error_message_of([&] { parse_algorithm_table(header + "all_gather 1 2 - teleport\n", "'t.tsv'"); });
  EXPECT_NE(message.find("line 2: column 'algorithm' must be one of direct, ring, two_level_direct, two_level_ring, "
                         "found 'teleport'"),
            std::string::npos)
      << message;
  message = error_message_of([&] { parse_algorithm_table(header + "gather 1 2 - direct\n", "'t.tsv'"); });
  EXPECT_NE(message.find("column 'operation' must be one of all_gather, reduce_scatter, all_reduce"), std::string::npos)
      << message;
  message = error_message_of([&] { parse_algorithm_table(header + "all_gather 1 x - direct\n", "'t.tsv'"); });
  EXPECT_NE(message.find("column 'ranks_per_machine' must be a positive integer, found 'x'"), std::string::npos)
      << message;
  message = error_message_of([&] { parse_algorithm_table(header + "all_gather 1 4 -5 direct\n", "'t.tsv'"); });
  EXPECT_NE(message.find("column 'max_bytes' must be a positive integer, found '-5'"), std::string::npos) << message;
  message = error_message_of([&] { parse_algorithm_table(header + "all_gather 1 4 two_level_ring\n", "'t.tsv'"); });
  EXPECT_NE(message.find("expected 5 columns"), std::string::npos) << message;
  message = error_message_of([&] { parse_algorithm_table(header + "all_gather 1 4 - two_level_ring\n", "'t.tsv'"); });
  EXPECT_NE(message.find("two_level_ring needs several machines of several ranks each, but the row's layout is 1 x 4"),
            std::string::npos)
      << message;
  message = error_message_of(
      [&] { parse_algorithm_table(header + "all_gather 1 4 - ring\nall_gather 1 4 - direct\n", "'t.tsv'"); });
  EXPECT_NE(message.find("line 3: the same operation, layout and max_bytes as line 2"), std::string::npos) << message;
  message = error_message_of([&] { parse_algorithm_table("# nothing\n", "'t.tsv'"); });
  EXPECT_NE(message.find("no header line and no rows"), std::string::npos) << message;
}

TEST(AlgorithmTable, FormattedRowsParseBackToTheSameChoices) {
  const auto table = parse_algorithm_table(kTable, "test");
  const auto text = format_algorithm_table(table.rows, "made by a test\non two lines");
  EXPECT_EQ(text.rfind("# made by a test\n# on two lines\noperation\t", 0), 0u) << text;
  const auto again = parse_algorithm_table(text, "again");
  ASSERT_EQ(again.rows.size(), table.rows.size());
  for (size_t index = 0; index < table.rows.size(); ++index) {
    EXPECT_EQ(again.rows[index].algorithm, table.rows[index].algorithm);
    EXPECT_EQ(again.rows[index].max_bytes, table.rows[index].max_bytes);
    EXPECT_EQ(again.rows[index].machines, table.rows[index].machines);
  }
}

}  // namespace
}  // namespace fsdp::detail
