// Note [Algorithms by measurement]: every CPU algorithm (direct, ring, two-level with a direct or ring
// exchange across machines) on ranks that look like several machines, their bytes off each machine
// and their messages, the table the engine reads, and failures inside and across machines.
#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <fsdp/collectives.h>
#include <gtest/gtest.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>

#include "dist/c10d/backend.h"
#include "dist/selftest.h"
#include "harness/error_message.h"
#include "harness/multi_rank.h"

namespace fsdp {
namespace {

using detail::CollectiveAlgorithm;
using detail::CollectiveOperation;
using testing::error_message_of;

constexpr CollectiveOperation kOperations[] = {CollectiveOperation::kAllGather, CollectiveOperation::kReduceScatter,
                                               CollectiveOperation::kAllReduce};

// Ranks that look like machines of `per_machine` ranks, with one more variable set on every rank.
testing::MultiRankOptions machines_with(int per_machine, const std::string& name, const std::string& value) {
  auto options = testing::simulated_machines(per_machine);
  const auto machines = options.environment_for_rank;
  options.environment_for_rank = [machines, name, value](int rank) {
    auto variables = machines(rank);
    variables[name] = value;
    return variables;
  };
  return options;
}

void force_everywhere(const ProcessGroup& group, std::optional<CollectiveAlgorithm> algorithm) {
  for (const auto operation : kOperations) detail::force_algorithm(group, operation, algorithm);
}

struct Layout {
  int machines;
  int per_machine;
};

class Schedules : public ::testing::TestWithParam<Layout> {};

// The selftest (every dtype, sizes that do not divide, empty shards, async, bytes, bytes off the
// machine and messages against each algorithm's theory) with each algorithm forced on the world.
TEST_P(Schedules, EveryAlgorithmPassesTheSelftest) {
  const auto layout = GetParam();
  auto options = testing::simulated_machines(layout.per_machine);
  options.timeout = std::chrono::seconds(240);
  testing::run_on_ranks(
      layout.machines * layout.per_machine,
      [](const DistributedContext& context) {
        const auto& world = context.world();
        for (const auto algorithm : {CollectiveAlgorithm::kDirect, CollectiveAlgorithm::kRing,
                                     CollectiveAlgorithm::kTwoLevelDirect, CollectiveAlgorithm::kTwoLevelRing}) {
          if (!detail::algorithm_applies(algorithm, detail::state_of(world).members->shape)) continue;
          force_everywhere(world, algorithm);
          auto report = detail::run_collective_selftest(context);
          for (const auto& failure : report.failures) ADD_FAILURE() << detail::to_string(algorithm) << ": " << failure;
          EXPECT_TRUE(report.passed) << detail::to_string(algorithm);
          for (const auto& line : report.lines) std::cout << detail::to_string(algorithm) << ": " << line << "\n";
        }
        force_everywhere(world, std::nullopt);
      },
      options);
}

INSTANTIATE_TEST_SUITE_P(Layouts, Schedules, ::testing::Values(Layout{1, 3}, Layout{2, 2}, Layout{3, 2}),
                         [](const ::testing::TestParamInfo<Layout>& info) {
                           std::string name = "M";
                           return name +=
                                  std::to_string(info.param.machines) + "xL" + std::to_string(info.param.per_machine);
                         });

// 2 machines of 3 ranks: what leaves each rank's machine, in bytes the test states, not the theory
// function the selftest uses. A 6 x 1000-float buffer: chunks of 4000 bytes.
TEST(SchedulesOnTwoMachines, TwoLevelSendsOneChunkPerHalfOffTheMachineAndFewerMessages) {
  testing::run_on_ranks(
      6,
      [](const DistributedContext& context) {
        const auto& world = context.world();
        auto full = at::ones({6000});
        auto shard = at::ones({1000});
        struct Expected {
          CollectiveAlgorithm algorithm;
          int64_t gather_off, gather_messages, reduce_off, reduce_messages;
        };
        // Direct: 3 of the 5 peers are on the other machine. Two levels: one peer across, two inside.
        for (const auto& expected : {Expected{CollectiveAlgorithm::kDirect, 3 * 4000, 5, 6 * 4000, 10},
                                     Expected{CollectiveAlgorithm::kTwoLevelDirect, 4000, 3, 2 * 4000, 6},
                                     Expected{CollectiveAlgorithm::kTwoLevelRing, 4000, 3, 2 * 4000, 6}}) {
          force_everywhere(world, expected.algorithm);
          const auto name = detail::to_string(expected.algorithm);
          world.reset_bytes_sent();
          all_gather(world, full, shard);
          auto sent = world.bytes_sent();
          EXPECT_EQ(sent.all_gather, 5 * 4000) << name;
          EXPECT_EQ(sent.off_machine, expected.gather_off) << name;
          EXPECT_EQ(sent.inside_machine, 5 * 4000 - expected.gather_off) << name;
          EXPECT_EQ(sent.messages, expected.gather_messages) << name;
          world.reset_bytes_sent();
          all_reduce(world, full);
          sent = world.bytes_sent();
          EXPECT_EQ(sent.all_reduce, 2 * 5 * 4000) << name;
          EXPECT_EQ(sent.off_machine, expected.reduce_off) << name;
          EXPECT_EQ(sent.messages, expected.reduce_messages) << name;
          EXPECT_TRUE(full.equal(at::full({6000}, 6.0f))) << name;
          full.fill_(1.0f);
        }
        force_everywhere(world, std::nullopt);
      },
      testing::simulated_machines(3));
}

// two_level_direct cuts a chunk of 1 MiB into 4 pieces of 256 KiB (two_level_pieces), each forwarded
// to the second level on its own: every element lands where it belongs, with 4 x ((M-1) + (L-1))
// messages per half.
TEST(SchedulesOnTwoMachines, TwoLevelPiecesPutEveryElementInItsPlace) {
  testing::run_on_ranks(
      4,
      [](const DistributedContext& context) {
        const auto& world = context.world();
        force_everywhere(world, CollectiveAlgorithm::kTwoLevelDirect);
        const int64_t chunk = int64_t{1} << 18;  // floats: 1 MiB
        ASSERT_EQ(detail::two_level_pieces(chunk, 4), 4);
        const double rank = static_cast<double>(context.rank());
        auto pattern = at::arange(4 * chunk, at::kDouble).remainder(997);
        // All-gather: shard r is r * 1000 + the pattern of its positions.
        auto shard = (pattern.narrow(0, context.rank() * chunk, chunk) + rank * 1000).to(at::kFloat);
        auto gathered = at::empty({4 * chunk});
        world.reset_bytes_sent();
        all_gather(world, gathered, shard);
        EXPECT_EQ(world.bytes_sent().messages, 4 * 2);
        auto expected = pattern + at::arange(4, at::kDouble).repeat_interleave(chunk) * 1000;
        EXPECT_TRUE(gathered.to(at::kDouble).equal(expected));
        // Reduce-scatter and all-reduce of rank * 1000 + the pattern: 6000 + 4 x the pattern.
        auto input = (pattern + rank * 1000).to(at::kFloat);
        auto reduced = at::empty({chunk});
        world.reset_bytes_sent();
        reduce_scatter(world, reduced, input);
        EXPECT_EQ(world.bytes_sent().messages, 4 * 2);
        auto summed = pattern * 4 + 6000;
        EXPECT_TRUE(reduced.to(at::kDouble).equal(summed.narrow(0, context.rank() * chunk, chunk)));
        world.reset_bytes_sent();
        all_reduce(world, input);
        EXPECT_EQ(world.bytes_sent().messages, 2 * 4 * 2);
        EXPECT_EQ(world.bytes_sent().off_machine, 2 * chunk * 4);
        EXPECT_TRUE(input.to(at::kDouble).equal(summed));
        force_everywhere(world, std::nullopt);
      },
      testing::simulated_machines(2));
}

// Note [Collective check]: the check sends nothing of its own. The same collectives post the same
// messages and bytes with FSDP_CHECK_COLLECTIVES on and off; rank 0 writes what it counted.
TEST(SchedulesOnTwoMachines, TheCheckAddsNoMessageAndNoByte) {
  const auto directory = testing::shared_temporary_directory();
  for (const std::string check : {"1", "0"}) {
    const auto options = machines_with(2, "FSDP_CHECK_COLLECTIVES", check);
    testing::run_on_ranks(
        4,
        [directory, check](const DistributedContext& context) {
          const auto& world = context.world();
          world.reset_bytes_sent();
          auto full = at::ones({4000});
          auto shard = at::ones({1000});
          all_gather(world, full, shard);
          reduce_scatter(world, shard, full);
          all_reduce(world, full);
          broadcast(world, shard, 1);
          barrier(world);
          auto gathered = at::empty({4000});
          auto work = all_gather_async(world, gathered, shard);
          work.wait();
          const auto sent = world.bytes_sent();
          EXPECT_EQ(sent.check, 0);
          if (context.rank() == 0) {
            std::ofstream(directory + "/check_" + check)
                << sent.messages << " " << sent.total() << " " << sent.off_machine;
          }
        },
        options);
  }
  if (testing::is_rank_process()) return;
  auto read = [&](const std::string& name) {
    std::ifstream file(directory + "/" + name);
    std::string text((std::istreambuf_iterator<char>(file)), std::istreambuf_iterator<char>());
    return text;
  };
  EXPECT_FALSE(read("check_1").empty());
  EXPECT_EQ(read("check_1"), read("check_0")) << "messages, bytes and bytes off the machine, check on then off";
}

// The engine takes the algorithm the table's row says, from FSDP_COLLECTIVE_TABLE's file, and
// FSDP_DEBUG=1 prints each choice once with the row that made it.
TEST(SchedulesOnTwoMachines, TheEngineRunsWhatTheTableSays) {
  const auto directory = testing::shared_temporary_directory();
  const auto table = directory + "/table.tsv";
  if (!testing::is_rank_process()) {
    std::ofstream(table) << "# for the test\n"
                            "operation machines ranks_per_machine max_bytes algorithm\n"
                            "all_gather 2 2 4096 two_level_ring\n"
                            "all_gather 2 2 - direct\n"
                            "reduce_scatter 2 2 - ring\n"
                            "all_reduce 2 2 - two_level_direct\n"
                            "all_reduce 1 2 - ring\n"
                            "all_gather 1 2 - direct\n"
                            "all_gather 2 1 - direct\n"
                            "all_reduce 2 1 - ring\n";
  }
  const auto options = machines_with(2, "FSDP_COLLECTIVE_TABLE", table);
  testing::run_on_ranks(
      4,
      [](const DistributedContext& context) {
        const auto& world = context.world();
        auto& state = detail::state_of(world);
        EXPECT_EQ(detail::algorithm_for(state, CollectiveOperation::kAllGather, 4096),
                  CollectiveAlgorithm::kTwoLevelRing);
        EXPECT_EQ(detail::algorithm_for(state, CollectiveOperation::kAllGather, 4097), CollectiveAlgorithm::kDirect);
        EXPECT_EQ(detail::algorithm_for(state, CollectiveOperation::kReduceScatter, 1 << 20),
                  CollectiveAlgorithm::kRing);
        EXPECT_EQ(detail::algorithm_for(state, CollectiveOperation::kAllReduce, 8),
                  CollectiveAlgorithm::kTwoLevelDirect);
        EXPECT_EQ(detail::algorithm_for(detail::state_of(context.cross_node()), CollectiveOperation::kAllReduce, 8),
                  CollectiveAlgorithm::kRing);
        // And the collectives run it: two levels post 2 messages for an all-gather here, direct 3.
        auto small = at::empty({1024});  // 4096 bytes
        world.reset_bytes_sent();
        all_gather(world, small, at::full({256}, 1.0f));
        EXPECT_EQ(world.bytes_sent().messages, 2);
        EXPECT_EQ(world.bytes_sent().off_machine, 1024);
        auto large = at::empty({2048});
        world.reset_bytes_sent();
        all_gather(world, large, at::full({512}, 1.0f));
        EXPECT_EQ(world.bytes_sent().messages, 3);
        EXPECT_EQ(world.bytes_sent().off_machine, 2 * 2048);
        EXPECT_TRUE(large.equal(at::ones({2048})));
      },
      options);
  if (testing::is_rank_process()) return;
  // FSDP_DEBUG=1: `fsdp selftest` on the same layout prints each choice once, naming the file and line.
  testing::LoopbackJob job;
  job.timeout = std::chrono::seconds(120);
  job.argv = [](int) { return std::vector<std::string>{FSDP_CLI_PATH, "selftest"}; };
  job.environment = [table](int rank) {
    return std::map<std::string, std::string>{{"LOCAL_WORLD_SIZE", "2"},
                                              {"LOCAL_RANK", std::to_string(rank % 2)},
                                              {"GROUP_RANK", std::to_string(rank / 2)},
                                              {"FSDP_COLLECTIVE_TABLE", table},
                                              {"FSDP_DEBUG", "1"}};
  };
  const auto result = testing::run_loopback_job(4, job);
  ASSERT_FALSE(result.failed) << result.report;
  const auto& output = result.output[1];
  EXPECT_NE(output.find("[rank 1] fsdp: all_gather of "), std::string::npos) << output;
  EXPECT_NE(output.find("bytes on group 'world' (2 machines x 2 ranks): two_level_ring ('" + table +
                        "', line 3: all_gather 2 x 2 up to 4096 bytes)"),
            std::string::npos)
      << output;
  EXPECT_NE(output.find("): direct ('" + table + "', line 4: all_gather 2 x 2 up to any size)"), std::string::npos)
      << output;
  EXPECT_NE(output.find("on group 'world' (2 machines x 2 ranks): ring ('" + table + "', line 5"), std::string::npos)
      << output;
  // Once per group, operation and row.
  const auto first = output.find("line 3: all_gather 2 x 2");
  EXPECT_EQ(output.find("line 3: all_gather 2 x 2", first + 1), std::string::npos) << output;
  EXPECT_NE(result.output[0].find("PASSED"), std::string::npos) << result.output[0];
}

TEST(SchedulesOnTwoMachines, AnUnreadableTableIsANamedErrorOnEveryRank) {
  const auto directory = testing::shared_temporary_directory();
  const auto table = directory + "/bad.tsv";
  if (!testing::is_rank_process())
    std::ofstream(table) << "operation machines ranks_per_machine max_bytes algorithm\n"
                            "all_gather 2 2 - sideways\n";
  for (const auto& path : {table, directory + "/missing.tsv"}) {
    testing::LoopbackJob job;
    job.timeout = std::chrono::seconds(60);
    job.argv = [](int) { return std::vector<std::string>{FSDP_CLI_PATH, "selftest"}; };
    job.environment = [path](int) { return std::map<std::string, std::string>{{"FSDP_COLLECTIVE_TABLE", path}}; };
    const auto result = testing::run_loopback_job(2, job);
    ASSERT_TRUE(result.failed) << result.report;
    for (const auto& output : result.output) {
      EXPECT_NE(output.find("FSDP_COLLECTIVE_TABLE: "), std::string::npos) << output;
      EXPECT_NE(output.find(path == table ? "line 2: column 'algorithm' must be one of" : "missing.tsv"),
                std::string::npos)
          << output;
      EXPECT_NE(output.find("Unset FSDP_COLLECTIVE_TABLE to use the built-in table"), std::string::npos) << output;
    }
  }
}

// A rank that is gone: its peer across machines fails in the first level, its peer inside the
// machine in the second, and the rank that waits only for them (never for the lost one) learns it
// from their reports (Note [Collective check]): every survivor names the lost rank, and none waits
// for the timeout.
TEST(SchedulesOnTwoMachines, ARankLostInEitherLevelIsNamedOnEverySurvivor) {
  for (const auto algorithm : {CollectiveAlgorithm::kTwoLevelDirect, CollectiveAlgorithm::kTwoLevelRing}) {
    auto options = testing::simulated_machines(2);
    options.collective_timeout = std::chrono::seconds(20);
    testing::run_on_ranks(
        4,
        [algorithm](const DistributedContext& context) {
          const auto& world = context.world();
          force_everywhere(world, algorithm);
          barrier(context.control());
          if (context.rank() == 3) std::_Exit(0);  // gone, as a machine that lost power
          auto full = at::ones({400});
          const auto message = error_message_of([&] {
            if (algorithm == CollectiveAlgorithm::kTwoLevelDirect) {
              all_gather(world, full, at::ones({100}));
            } else {
              all_reduce(world, full);
            }
          });
          EXPECT_NE(message.find("rank 3"), std::string::npos) << message;
          EXPECT_EQ(message.find("Ranks that never issued it"), std::string::npos) << message;
          EXPECT_EQ(message.find("imed out"), std::string::npos) << message;
          if (context.rank() == 0) {
            // Rank 0 exchanges only with ranks 1 and 2 (inside, across): it hears it from their reports,
            // while they wait (or after they exited).
            EXPECT_TRUE(message.find("which this rank waits for, failed in it") != std::string::npos ||
                        message.find("had failed in it") != std::string::npos)
                << message;
          }
        },
        options);
  }
}

}  // namespace
}  // namespace fsdp
