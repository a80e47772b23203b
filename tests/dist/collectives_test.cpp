// Collectives on 1-4 real processes: values, dtypes, padding, empty shards and bytes on the wire.
#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <fsdp/collectives.h>
#include <gtest/gtest.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <map>
#include <thread>

#include "dist/activity.h"
#include "dist/c10d/backend.h"
#include "dist/selftest.h"
#include "harness/error_message.h"
#include "harness/multi_rank.h"

namespace fsdp {
namespace {

using testing::error_message_of;

class Collectives : public ::testing::TestWithParam<int> {};

// The selftest checks every collective x dtype x size (including sizes not divisible by N and
// empty shards) against closed forms, and the byte counters against (N-1)/N.
TEST_P(Collectives, SelftestPassesOnEveryRank) {
  testing::run_on_ranks(GetParam(), [](const DistributedContext& context) {
    auto report = detail::run_collective_selftest(context);
    for (const auto& failure : report.failures) ADD_FAILURE() << failure;
    EXPECT_TRUE(report.passed);
  });
}

TEST_P(Collectives, ReduceScatterSendsOnlyOtherRanksShards) {
  testing::run_on_ranks(GetParam(), [](const DistributedContext& context) {
    const auto& world = context.world();
    const int64_t size = world.size();
    // FSDP's layout: shard r of a padded flat gradient belongs to rank r.
    auto input = at::arange(size * 3, at::kFloat) * (world.rank() + 1);
    auto output = at::empty({3}, at::kFloat);
    world.reset_bytes_sent();
    reduce_scatter(world, output, input);
    const double rank_sum = size * (size + 1) / 2.0;
    auto expected = at::arange(world.rank() * 3, world.rank() * 3 + 3, at::kFloat) * rank_sum;
    EXPECT_TRUE(output.equal(expected)) << output << " vs " << expected;
    EXPECT_EQ(world.bytes_sent().reduce_scatter, (size - 1) * 3 * 4);
    EXPECT_EQ(world.bytes_sent().all_reduce, 0);
  });
}

TEST_P(Collectives, AsyncWorkCompletesInIssueOrder) {
  testing::run_on_ranks(GetParam(), [](const DistributedContext& context) {
    const auto& world = context.world();
    const int64_t size = world.size();
    std::vector<at::Tensor> outputs;
    std::vector<CollectiveWork> works;
    for (int64_t round = 0; round < 4; ++round) {
      outputs.push_back(at::empty({size * 2}, at::kBFloat16));
      works.push_back(all_gather_async(world, outputs.back(), at::full({2}, world.rank() * 10 + round, at::kBFloat16)));
    }
    for (auto& work : works) work.wait();
    for (int64_t round = 0; round < 4; ++round) {
      EXPECT_TRUE(works[round].completed());
      for (int64_t rank = 0; rank < size; ++rank) {
        EXPECT_EQ(outputs[round][rank * 2].item<float>(), rank * 10 + round);
      }
    }
  });
}

// All-gathers and reduce-scatters are point-to-point exchanges with one slot per call: several in
// flight at once (as prefetch and overlapped reductions issue them) must not take each other's bytes,
// whatever order they are waited in.
TEST_P(Collectives, InterleavedAsyncCollectivesKeepTheirOwnData) {
  testing::run_on_ranks(GetParam(), [](const DistributedContext& context) {
    const auto& world = context.world();
    const int64_t size = world.size();
    const int64_t rank = world.rank();
    auto gathered = at::empty({size * 3}, at::kFloat);
    auto gather = all_gather_async(world, gathered, at::full({3}, 100.0 + rank));
    // Rank r contributes r + 1 + column to every chunk: sums and maxima are known in closed form.
    auto contribution = (at::arange(size * 4, at::kFloat).remainder(4) + rank + 1).to(at::kBFloat16);
    auto summed = at::empty({4}, at::kBFloat16);
    auto sum = reduce_scatter_async(world, summed, contribution);
    ReduceScatterOptions maximum_options;
    maximum_options.op = ReduceOp::kMax;
    auto maximum = at::empty({4}, at::kFloat);
    auto max_work = reduce_scatter_async(world, maximum, contribution.to(at::kFloat), maximum_options);
    auto gathered_again = at::empty({size * 2}, at::kDouble);
    auto gather_again = all_gather_async(world, gathered_again, at::full({2}, -1.0 - rank, at::kDouble));
    gather_again.wait();
    max_work.wait();
    sum.wait();
    gather.wait();
    const double rank_sum = static_cast<double>(size * (size + 1) / 2);
    for (int64_t column = 0; column < 4; ++column) {
      EXPECT_EQ(summed[column].item<float>(), static_cast<float>(column * size + rank_sum)) << "column " << column;
      EXPECT_EQ(maximum[column].item<float>(), static_cast<float>(column + size)) << "column " << column;
    }
    for (int64_t peer = 0; peer < size; ++peer) {
      EXPECT_EQ(gathered[peer * 3 + 2].item<float>(), 100.0F + peer);
      EXPECT_EQ(gathered_again[peer * 2 + 1].item<double>(), -1.0 - peer);
    }
  });
}

// Polls for `path`, which another rank writes, for up to 5 s.
bool appears_within_five_seconds(const std::string& path) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(5);
  while (!std::filesystem::exists(path) && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  return std::filesystem::exists(path);
}

// query() is the event-like half of CollectiveWork (Note [a block returns after its last use]): it
// says "done" after wait(). An async collective returns without waiting for any peer (Note
// [Collective check]): the peers here issue theirs only once rank 0's issue has returned, so an issue
// that waited for them (the frames of before) fails this test after the peers' deadline.
TEST_P(Collectives, AnAsyncCollectiveReturnsBeforeAnyPeerIssuedItAndQueryIsTrueAfterWait) {
  const auto directory = testing::shared_temporary_directory();
  testing::MultiRankOptions options;
  options.collective_timeout = std::chrono::seconds(10);
  testing::run_on_ranks(
      GetParam(),
      [directory](const DistributedContext& context) {
        const auto& world = context.world();
        const int64_t size = world.size();
        auto gathered = at::empty({size * 4}, at::kFloat);
        auto shard = at::full({4}, static_cast<float>(world.rank()), at::kFloat);
        const auto mark = directory + "/rank0_issued";
        barrier(context.control());
        if (world.rank() == 0) {
          world.reset_bytes_sent();
          auto work = all_gather_async(world, gathered, shard);
          std::ofstream(mark) << "issued";
          work.wait();
          EXPECT_TRUE(work.query());
          EXPECT_TRUE(work.completed());
          // The data and nothing else: the check travels in the messages' slots (Note [Collective check]).
          EXPECT_EQ(world.bytes_sent().check, 0);
          EXPECT_EQ(world.bytes_sent().all_gather, (size - 1) * 4 * 4);
        } else {
          ASSERT_TRUE(appears_within_five_seconds(mark))
              << "rank 0's all_gather_async did not return before its peers issued";
          all_gather(world, gathered, shard);
        }
        for (int64_t peer = 0; peer < size; ++peer) EXPECT_EQ(gathered[peer * 4 + 3].item<float>(), peer);
      },
      options);
}

// The same for an all-reduce, whose steps after the first the group's queue runs, and for a
// broadcast: neither waits for a peer when issued.
TEST_P(Collectives, AsyncAllReduceAndBroadcastReturnBeforeAnyPeerIssuedThem) {
  const auto directory = testing::shared_temporary_directory();
  testing::MultiRankOptions options;
  options.collective_timeout = std::chrono::seconds(10);
  testing::run_on_ranks(
      GetParam(),
      [directory](const DistributedContext& context) {
        const auto& world = context.world();
        const int64_t size = world.size();
        auto summed = at::full({5}, static_cast<float>(world.rank() + 1), at::kFloat);
        auto sent = at::full({3}, world.rank() == 0 ? 7.0 : 0.0, at::kDouble);
        const auto mark = directory + "/rank0_issued";
        barrier(context.control());
        // int16, which Gloo's own all-reduce cannot reduce, queued behind the float one.
        auto counts = at::full({3}, static_cast<int16_t>(world.rank() + 1), at::kShort);
        if (world.rank() == 0) {
          auto reduction = all_reduce_async(world, summed);
          auto counted = all_reduce_async(world, counts);
          auto spread = broadcast_async(world, sent, 0);
          std::ofstream(mark) << "issued";
          spread.wait();
          counted.wait();
          reduction.wait();
        } else {
          ASSERT_TRUE(appears_within_five_seconds(mark))
              << "rank 0's async all_reduce or broadcast waited for its peers";
          all_reduce(world, summed);
          all_reduce(world, counts);
          broadcast(world, sent, 0);
        }
        EXPECT_TRUE(counts.equal(at::full({3}, static_cast<int16_t>(size * (size + 1) / 2), at::kShort))) << counts;
        EXPECT_TRUE(summed.equal(at::full({5}, static_cast<float>(size * (size + 1) / 2), at::kFloat))) << summed;
        EXPECT_TRUE(sent.equal(at::full({3}, 7.0, at::kDouble))) << sent;
      },
      options);
}

INSTANTIATE_TEST_SUITE_P(WorldSizes, Collectives, ::testing::Values(1, 2, 3, 4),
                         [](const ::testing::TestParamInfo<int>& info) {
                           std::string name = "N";  // appended: GCC 12 warns falsely on "N" + std::string
                           return name += std::to_string(info.param);
                         });

// Eight ranks: the selftest passes with the table's algorithms; rank 0's two async all-reduces return
// before any peer issued them and are reduced in issue order; a parameter that requires grad is
// reduced under the caller's NoGradGuard, which the queue's thread does not inherit by itself.
TEST(CollectivesAtEightRanks, TheSelftestPassesAndAnAllReduceReturnsBeforeAnyPeerIssuedIt) {
  const auto directory = testing::shared_temporary_directory();
  testing::MultiRankOptions options;
  options.collective_timeout = std::chrono::seconds(20);
  testing::run_on_ranks(
      8,
      [directory](const DistributedContext& context) {
        const auto& world = context.world();
        auto report = detail::run_collective_selftest(context);
        for (const auto& failure : report.failures) ADD_FAILURE() << failure;
        EXPECT_TRUE(report.passed);
        auto summed = at::full({5}, static_cast<float>(world.rank() + 1), at::kFloat);
        auto largest = at::full({3}, static_cast<int16_t>(world.rank()), at::kShort);
        const auto mark = directory + "/rank0_issued";
        barrier(context.control());
        world.reset_bytes_sent();
        if (world.rank() == 0) {
          auto reduction = all_reduce_async(world, summed);
          auto maximum = all_reduce_async(world, largest, ReduceOp::kMax);
          std::ofstream(mark) << "issued";
          maximum.wait();
          reduction.wait();
        } else {
          ASSERT_TRUE(appears_within_five_seconds(mark)) << "rank 0's all_reduce waited for its peers";
          all_reduce(world, summed);
          all_reduce(world, largest, ReduceOp::kMax);
        }
        EXPECT_TRUE(summed.equal(at::full({5}, 36.0f, at::kFloat))) << summed;
        EXPECT_TRUE(largest.equal(at::full({3}, static_cast<int16_t>(7), at::kShort))) << largest;
        // 5 floats pad to 8 x 1 and 3 int16 to 8 x 1: each rank sends 7 chunks twice per all-reduce,
        // whatever the algorithm.
        EXPECT_EQ(world.bytes_sent().all_reduce, 2 * 7 * 4 + 2 * 7 * 2);
        auto weight = at::ones({16}).set_requires_grad(true);
        {
          at::NoGradGuard no_grad;
          all_reduce(world, weight);
        }
        EXPECT_TRUE(weight.detach().equal(at::full({16}, 8.0f))) << weight;
      },
      options);
}

// Note [Collective check]: ranks whose programs diverged get one error on every rank naming what
// each issued. A longer all-gather on one rank used to abort the process inside Gloo
// ("op.preamble.length <= op.nbytes", exit 134), and two units of the same size exchanged each
// other's bytes without a word (issue Reliability). The collectives' messages travel on slots keyed
// by what each rank issued, so they never meet; the stalled waits are diagnosed through the store.
// After the error the group still works.
TEST(CollectiveFrames, RanksThatIssueDifferentCollectivesGetANamedErrorNotAnAbort) {
  testing::run_on_ranks(3, [](const DistributedContext& context) {
    const auto& world = context.world();
    const int64_t rank = world.rank();
    auto expect_error = [&](const std::function<void()>& body, const std::vector<std::string>& expected) {
      const auto message = error_message_of(body);
      EXPECT_NE(message.find("the ranks of group 'world' issued different collectives: this rank issued "),
                std::string::npos)
          << message;
      for (const auto& part : expected)
        EXPECT_NE(message.find(part), std::string::npos) << part << " not in: " << message;
    };
    // Another size on rank 2.
    const int64_t numel = rank == 2 ? 8 : 4;
    auto shard = at::full({numel}, static_cast<float>(rank));
    auto gathered = at::empty({3 * numel});
    expect_error([&] { all_gather(world, gathered, shard); },
                 rank == 2
                     ? std::vector<std::string>{"this rank issued all_gather of 8 x Float; rank 0 issued all_gather "
                                                "of 4 x Float; rank 1 issued all_gather of 4 x Float"}
                     : std::vector<std::string>{"rank 2 issued all_gather of 8 x Float"});
    // The same size, for different units.
    {
      detail::ActivityScope unit(rank == 1 ? "FSDP unit model.layers.1 (Block), iteration 3, FORWARD"
                                           : "FSDP unit model.layers.0 (Block), iteration 3, FORWARD");
      auto same = at::full({4}, 1.0f);
      auto out = at::empty({12});
      expect_error([&] { all_gather(world, out, same); },
                   {rank == 1 ? "rank 0 issued all_gather of 4 x Float (for FSDP unit model.layers.0 (Block)"
                              : "rank 1 issued all_gather of 4 x Float (for FSDP unit model.layers.1 (Block)"});
    }
    // Another operation on rank 0.
    auto values = at::ones({12});
    expect_error(
        [&] {
          if (rank == 0) {
            all_reduce(world, values);
          } else {
            broadcast(world, values, 0);
          }
        },
        {rank == 0 ? "rank 1 issued broadcast of 12 x Float from root 0" : "rank 0 issued all_reduce of 12 x Float"});
    // The group goes on working.
    auto ok = at::full({2}, static_cast<float>(rank));
    auto all = at::empty({6});
    all_gather(world, all, ok);
    EXPECT_TRUE(all.equal(at::tensor({0.0f, 0.0f, 1.0f, 1.0f, 2.0f, 2.0f})));
  });
}

// A rank that never issues the collective (stuck elsewhere) is named once the others time out
// (issue Reliability: the report named the collective and group, not who did not arrive).
TEST(CollectiveFrames, ARankThatNeverIssuesTheCollectiveIsNamedAfterTheTimeout) {
  testing::MultiRankOptions options;
  options.collective_timeout = std::chrono::seconds(2);
  testing::run_on_ranks(
      3,
      [](const DistributedContext& context) {
        const auto& world = context.world();
        // The direct exchange, where ranks 0 and 1 both wait for rank 2 itself (in a ring, rank 1 would
        // wait for rank 0 and name it; SchedulesOnTwoMachines.ARankLost... covers such chains).
        for (const auto operation :
             {detail::CollectiveOperation::kAllGather, detail::CollectiveOperation::kReduceScatter,
              detail::CollectiveOperation::kAllReduce}) {
          detail::force_algorithm(world, operation, detail::CollectiveAlgorithm::kDirect);
        }
        if (world.rank() == 2) {
          // Alive past the others' 2 s timeout (so that they time out rather than see it leave), by a
          // margin for their start-up skew.
          std::this_thread::sleep_for(std::chrono::milliseconds(3500));
          return;
        }
        auto shard = at::ones({4});
        auto gathered = at::empty({12});
        const auto message = error_message_of([&] { all_gather(world, gathered, shard); });
        EXPECT_NE(message.find("all_gather on group 'world'"), std::string::npos) << message;
        EXPECT_NE(message.find("in the exchange with rank 2"), std::string::npos) << message;
        EXPECT_NE(message.find("Ranks that never issued it: 2."), std::string::npos) << message;
      },
      options);
}

// FSDP_CHECK_COLLECTIVES=0 diagnoses nothing, but the data still travels on a slot keyed by what
// each rank issued: two units of the same size on different ranks never take each other's bytes;
// they time out naming the collective instead of a named difference.
TEST(CollectiveFrames, WithTheCheckOffNoHeaderIsSentAndDivergedRanksTimeOutInsteadOfSwappingBytes) {
  testing::MultiRankOptions options;
  options.collective_timeout = std::chrono::seconds(2);
  options.environment_for_rank = [](int) {
    return std::map<std::string, std::string>{{"FSDP_CHECK_COLLECTIVES", "0"}};
  };
  testing::run_on_ranks(
      2,
      [](const DistributedContext& context) {
        const auto& world = context.world();
        const int64_t rank = world.rank();
        world.reset_bytes_sent();
        auto gathered = at::empty({4});
        all_gather(world, gathered, at::full({2}, static_cast<float>(rank)));
        EXPECT_TRUE(gathered.equal(at::tensor({0.0f, 0.0f, 1.0f, 1.0f}))) << gathered;
        EXPECT_EQ(world.bytes_sent().check, 0);
        auto out = at::full({4}, -1.0f);
        const auto message = error_message_of([&] {
          detail::ActivityScope unit(rank == 1 ? "FSDP unit model.layers.1" : "FSDP unit model.layers.0");
          all_gather(world, out, at::full({2}, 5.0f + rank));
        });
        // Alive a while after its own timeout, so that the peer times out too rather than see it leave.
        std::this_thread::sleep_for(std::chrono::seconds(1));
        EXPECT_NE(message.find("all_gather on group 'world'"), std::string::npos) << message;
        EXPECT_NE(message.find("imed out"), std::string::npos) << message;
        // Only this rank's own chunk was written: the peer's chunk for another unit never arrived.
        EXPECT_EQ(out[(1 - rank) * 2].item<float>(), -1.0f) << out;
      },
      options);
}

TEST(CollectiveErrors, BadBuffersAreNamed) {
  auto context = DistributedContext::initialize(DistributedEnvironment{});
  const auto& world = context.world();
  auto message = error_message_of([&] { all_gather(world, at::empty({3}), at::empty({2})); });
  EXPECT_NE(message.find("output has 3 elements but expected 1 ranks x 2 = 2"), std::string::npos) << message;
  message = error_message_of([&] { all_gather(world, at::empty({2}, at::kDouble), at::empty({2})); });
  EXPECT_NE(message.find("dtype"), std::string::npos) << message;
  message = error_message_of(
      [&] { reduce_scatter(world, at::empty({2}), at::empty({4, 2}).t().reshape({8}).narrow(0, 0, 1)); });
  EXPECT_NE(message.find("reduce_scatter"), std::string::npos) << message;
  message = error_message_of([&] { all_reduce(world, at::empty({4, 4}).t()); });
  EXPECT_NE(message.find("must be contiguous"), std::string::npos) << message;
  message = error_message_of([&] {
    ReduceScatterOptions options;
    options.post_divide_factor = 2;
    reduce_scatter(world, at::empty({2}, at::kLong), at::empty({2}, at::kLong), options);
  });
  EXPECT_NE(message.find("needs a floating dtype"), std::string::npos) << message;
  message = error_message_of([&] { broadcast(world, at::empty({2}), 1); });
  EXPECT_NE(message.find("root 1 is outside [0, 1)"), std::string::npos) << message;
  message = error_message_of([] {
    ProcessGroup empty;
    (void)empty.size();
  });
  EXPECT_NE(message.find("handle is empty"), std::string::npos) << message;
}

}  // namespace
}  // namespace fsdp
