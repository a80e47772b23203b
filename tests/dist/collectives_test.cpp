// Collectives on 1-4 real processes: values, dtypes, padding, empty shards and bytes on the wire.
#include <fsdp/collectives.h>

#include "dist/selftest.h"
#include "harness/multi_rank.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <gtest/gtest.h>

#include "harness/error_message.h"

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

// query() is the event-like half of CollectiveWork (Note [a block returns after its last use]): it
// must say "not done", without blocking, while a peer has not sent yet, and "done" after wait().
TEST_P(Collectives, QueryIsFalseWithoutBlockingWhileAPeerHasNotSentAndTrueAfterWait) {
  testing::run_on_ranks(GetParam(), [](const DistributedContext& context) {
    const auto& world = context.world();
    const int64_t size = world.size();
    auto gathered = at::empty({size * 4}, at::kFloat);
    auto shard = at::full({4}, static_cast<float>(world.rank()), at::kFloat);
    if (world.rank() == 0) {
      auto work = all_gather_async(world, gathered, shard);
      // The other ranks issue theirs only after this barrier, so nothing can have arrived yet.
      if (size > 1) {
        EXPECT_FALSE(work.query());
      }
      barrier(context.control());
      work.wait();
      EXPECT_TRUE(work.query());
      EXPECT_TRUE(work.completed());
    } else {
      barrier(context.control());
      all_gather(world, gathered, shard);
    }
    for (int64_t peer = 0; peer < size; ++peer) EXPECT_EQ(gathered[peer * 4 + 3].item<float>(), peer);
  });
}

INSTANTIATE_TEST_SUITE_P(WorldSizes, Collectives, ::testing::Values(1, 2, 3, 4),
                         [](const ::testing::TestParamInfo<int>& info) {
                           std::string name = "N";  // appended: GCC 12 warns falsely on "N" + std::string
                           return name += std::to_string(info.param);
                         });

TEST(CollectiveErrors, BadBuffersAreNamed) {
  auto context = DistributedContext::initialize(DistributedEnvironment{});
  const auto& world = context.world();
  auto message = error_message_of([&] { all_gather(world, at::empty({3}), at::empty({2})); });
  EXPECT_NE(message.find("output has 3 elements but expected 1 ranks x 2 = 2"), std::string::npos) << message;
  message = error_message_of([&] { all_gather(world, at::empty({2}, at::kDouble), at::empty({2})); });
  EXPECT_NE(message.find("dtype"), std::string::npos) << message;
  message = error_message_of([&] { reduce_scatter(world, at::empty({2}), at::empty({4, 2}).t().reshape({8}).narrow(0, 0, 1)); });
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
  message = error_message_of([] { ProcessGroup empty; (void)empty.size(); });
  EXPECT_NE(message.find("handle is empty"), std::string::npos) << message;
}

}  // namespace
}  // namespace fsdp
