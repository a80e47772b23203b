// Rendezvous, node groups and their errors.
#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <fsdp/collectives.h>
#include <fsdp/process_group.h>
#include <gtest/gtest.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <thread>

#include "dist/control_channel.h"
#include "dist/node_layout.h"
#include "harness/error_message.h"
#include "harness/multi_rank.h"
#include "launch/launcher.h"

namespace fsdp {
namespace {

using testing::error_message_of;

TEST(PlanNodeLayout, TwoMachinesOfTwo) {
  std::vector<detail::RankReport> reports = {{0, 0, 2, 0}, {1, 1, 2, 0}, {2, 0, 2, 1}, {3, 1, 2, 1}};
  auto layout = detail::plan_node_layout(reports);
  EXPECT_EQ(layout.num_nodes, 2);
  EXPECT_EQ(layout.intra_node_groups, (std::vector<std::vector<int64_t>>{{0, 1}, {2, 3}}));
  EXPECT_EQ(layout.cross_node_groups, (std::vector<std::vector<int64_t>>{{0, 2}, {1, 3}}));
}

TEST(PlanNodeLayout, DisagreementIsNamed) {
  auto message = error_message_of([] { detail::plan_node_layout({{0, 0, 2, 0}, {1, 0, 1, 1}}); });
  EXPECT_NE(message.find("disagree on LOCAL_WORLD_SIZE"), std::string::npos) << message;
  EXPECT_NE(message.find("rank 1 has 1"), std::string::npos) << message;
  message = error_message_of([] { detail::plan_node_layout({{0, 0, 2, 0}, {1, 0, 2, 0}}); });
  EXPECT_NE(message.find("rank 1 reports node 0 and local rank 0"), std::string::npos) << message;
  EXPECT_NE(message.find("--node-rank"), std::string::npos) << message;
}

TEST(DistributedContext, SingleProcessNeedsNoNetwork) {
  auto context = DistributedContext::initialize(DistributedEnvironment{});
  EXPECT_EQ(context.world_size(), 1);
  EXPECT_EQ(context.world().size(), 1);
  EXPECT_EQ(context.intra_node().size(), 1);
  EXPECT_EQ(context.cross_node().size(), 1);
  auto tensor = at::arange(5, at::kFloat);
  all_reduce(context.world(), tensor);
  EXPECT_TRUE(tensor.equal(at::arange(5, at::kFloat)));
  auto gathered = at::empty({3}, at::kFloat);
  all_gather(context.world(), gathered, at::ones({3}, at::kFloat));
  EXPECT_TRUE(gathered.equal(at::ones({3}, at::kFloat)));
  EXPECT_EQ(context.world().bytes_sent().total(), 0);
}

TEST(DistributedContext, UnreachableMasterNamesAddressAndPort) {
  const int port = detail::pick_free_port();  // nothing listens there
  DistributedEnvironment environment;
  environment.rank = 1;
  environment.world_size = 2;
  environment.local_rank = 1;
  environment.local_world_size = 2;
  environment.master_port = port;
  environment.timeout = std::chrono::milliseconds(1500);
  auto message = error_message_of([&] { DistributedContext::initialize(environment); });
  EXPECT_NE(message.find("could not reach the master at 127.0.0.1:" + std::to_string(port)), std::string::npos)
      << message;
  EXPECT_NE(message.find("FSDP_COLLECTIVE_TIMEOUT"), std::string::npos) << message;
}

TEST(DistributedContext, HybridGroupsOnTwoSimulatedMachines) {
  const auto options = testing::simulated_machines(2);
  testing::run_on_ranks(
      4,
      [](const DistributedContext& context) {
        const int64_t rank = context.rank();
        EXPECT_EQ(context.environment().num_nodes(), 2);
        EXPECT_EQ(context.intra_node().global_ranks(), (std::vector<int64_t>{rank / 2 * 2, rank / 2 * 2 + 1}));
        EXPECT_EQ(context.cross_node().global_ranks(), (std::vector<int64_t>{rank % 2, rank % 2 + 2}));
        EXPECT_EQ(context.intra_node().rank(), rank % 2);
        EXPECT_EQ(context.cross_node().rank(), rank / 2);
        auto intra = at::tensor({rank}, at::kLong);
        all_reduce(context.intra_node(), intra);
        EXPECT_EQ(intra.item<int64_t>(), (rank / 2 * 2) * 2 + 1);
        auto cross = at::tensor({rank}, at::kLong);
        all_reduce(context.cross_node(), cross);
        EXPECT_EQ(cross.item<int64_t>(), 2 * (rank % 2) + 2);
      },
      options);
}

// Note [the control channel]: host-side messages never touch the data groups.
TEST(DistributedContext, ControlMessagesTravelApartFromTheDataGroups) {
  testing::run_on_ranks(3, [](const DistributedContext& context) {
    const auto& control = context.control();
    EXPECT_EQ(control.name(), "control");
    EXPECT_EQ(control.global_ranks(), (std::vector<int64_t>{0, 1, 2}));
    EXPECT_NE(&detail::state_of(control), &detail::state_of(context.world()))
        << "the control channel must be a group of its own";
    context.world().reset_bytes_sent();
    control.reset_bytes_sent();
    const auto texts = detail::all_gather_strings(context, std::string(context.rank() * 5, 'x'));
    ASSERT_EQ(texts.size(), 3u);
    for (int64_t rank = 0; rank < 3; ++rank) EXPECT_EQ(texts[rank], std::string(rank * 5, 'x'));
    EXPECT_EQ(detail::broadcast_string(context, context.rank() == 2 ? "from two" : "", 2), "from two");
    EXPECT_EQ(context.world().bytes_sent().total(), 0);
    EXPECT_GT(control.bytes_sent().total(), 0);
  });
}

TEST(DistributedContext, RanksThatDisagreeOnTheLayoutAreNamed) {
  testing::MultiRankOptions options;
  options.environment_for_rank = [](int rank) {
    // Rank 1 was started as if it were alone on a second machine.
    if (rank == 1)
      return std::map<std::string, std::string>{{"LOCAL_WORLD_SIZE", "1"}, {"LOCAL_RANK", "0"}, {"GROUP_RANK", "1"}};
    return std::map<std::string, std::string>{{"LOCAL_WORLD_SIZE", "2"}, {"LOCAL_RANK", "0"}};
  };
  testing::run_processes(
      2,
      [](int) {
        auto message = error_message_of([] { DistributedContext::initialize_from_environment(); });
        EXPECT_NE(message.find("disagree on LOCAL_WORLD_SIZE: rank 0 has 2 but rank 1 has 1"), std::string::npos)
            << message;
      },
      options);
}

// A machine whose ranks arrive after the timeout: every rank fails with a rendezvous error that says
// what to check, none hangs (issue 47: a machine whose ranks arrive late).
TEST(DistributedContext, AMachineWhoseRanksArriveLateIsANamedErrorOnEveryRank) {
  auto options = testing::simulated_machines(2);
  options.collective_timeout = std::chrono::seconds(2);
  testing::run_processes(
      4,
      [](int rank) {
        // Machine 1, late: well past the timeout, since on a loaded machine rank 0 may start its own
        // wait a second or more after the others.
        if (rank >= 2) std::this_thread::sleep_for(std::chrono::milliseconds(5000));
        const auto message = error_message_of([] { DistributedContext::initialize_from_environment(); });
        EXPECT_NE(message.find("rendezvous"), std::string::npos) << message;
        EXPECT_NE(message.find("within 2 s"), std::string::npos) << message;
        // Rank 0 names how many ranks it waited for, whether the store's wait or the group's
        // connections ran out first.
        if (rank == 0) {
          EXPECT_NE(message.find(" 4 ranks "), std::string::npos) << message;
        }
      },
      options);
}

// The listening sockets on `port` in /proc/net/tcp and tcp6, as "address:port" in the kernel's hex.
std::vector<std::string> listeners_on(int port) {
  std::vector<std::string> found;
  char wanted[8];
  std::snprintf(wanted, sizeof(wanted), "%04X", port);
  for (const char* table : {"/proc/net/tcp", "/proc/net/tcp6"}) {
    std::ifstream file(table);
    std::string line;
    std::getline(file, line);  // header
    while (std::getline(file, line)) {
      std::istringstream fields(line);
      std::string slot, local, remote, state;
      fields >> slot >> local >> remote >> state;
      const auto colon = local.rfind(':');
      if (state == "0A" && colon != std::string::npos && local.substr(colon + 1) == wanted) found.push_back(local);
    }
  }
  return found;
}

// c10d's TCPStore listens on every interface (`::`); rank 0's store listens only on MASTER_ADDR
// (issue Reliability: it bound `::` with MASTER_ADDR=127.0.0.1 on one machine).
TEST(DistributedContext, TheStoreListensOnlyOnTheMasterAddress) {
  testing::run_on_ranks(2, [](const DistributedContext& context) {
    const int port = std::atoi(std::getenv("MASTER_PORT"));
    if (context.rank() == 0) {
      const auto listeners = listeners_on(port);
      ASSERT_EQ(listeners.size(), 1u) << "listening sockets on port " << port << ": "
                                      << ::testing::PrintToString(listeners);
      EXPECT_EQ(listeners[0], "0100007F:" + listeners[0].substr(listeners[0].rfind(':') + 1))
          << "the store listens on " << listeners[0] << ", not 127.0.0.1";
    }
    barrier(context.world());
  });
}

TEST(DistributedContext, DeadPeerIsAnErrorNotAHang) {
  testing::run_on_ranks(2, [](const DistributedContext& context) {
    if (context.rank() == 1) std::_Exit(0);  // leaves without a word, like a crashed process
    auto tensor = at::ones({1024}, at::kFloat);
    auto message = error_message_of([&] { all_reduce(context.world(), tensor); });
    EXPECT_NE(message.find("[rank 0] all_reduce on group 'world'"), std::string::npos) << message;
    EXPECT_NE(message.find("failed"), std::string::npos) << message;
  });
}

}  // namespace
}  // namespace fsdp
