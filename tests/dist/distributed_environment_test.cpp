// Parsing of launcher variables: pure, no processes.
#include <c10/util/Exception.h>
#include <fsdp/distributed_environment.h>
#include <gtest/gtest.h>

#include "harness/error_message.h"

namespace fsdp {
namespace {

std::string error_of(const EnvironmentMap& variables) {
  return testing::error_message_of([&] { parse_distributed_environment(variables); });
}

TEST(DistributedEnvironment, NoVariablesIsASingleProcess) {
  auto environment = parse_distributed_environment({});
  EXPECT_EQ(environment.rank, 0);
  EXPECT_EQ(environment.world_size, 1);
  EXPECT_FALSE(environment.is_distributed());
  EXPECT_EQ(environment.launcher, "none");
  EXPECT_EQ(environment.timeout, std::chrono::milliseconds(kDefaultCollectiveTimeout));
}

TEST(DistributedEnvironment, TorchrunVariables) {
  auto environment = parse_distributed_environment({{"RANK", "5"},
                                                    {"WORLD_SIZE", "8"},
                                                    {"LOCAL_RANK", "1"},
                                                    {"LOCAL_WORLD_SIZE", "4"},
                                                    {"GROUP_RANK", "1"},
                                                    {"MASTER_ADDR", "10.1.2.3"},
                                                    {"MASTER_PORT", "1234"},
                                                    {"FSDP_COLLECTIVE_TIMEOUT", "2.5"},
                                                    {"FSDP_CHECK_COLLECTIVES", "0"}});
  EXPECT_EQ(environment.launcher, "torchrun");
  EXPECT_FALSE(environment.check_collectives);
  EXPECT_TRUE(parse_distributed_environment({}).check_collectives);
  EXPECT_EQ(environment.rank, 5);
  EXPECT_EQ(environment.world_size, 8);
  EXPECT_EQ(environment.local_rank, 1);
  EXPECT_EQ(environment.local_world_size, 4);
  EXPECT_EQ(environment.node_rank, 1);
  EXPECT_EQ(environment.num_nodes(), 2);
  EXPECT_EQ(environment.master_addr, "10.1.2.3");
  EXPECT_EQ(environment.master_port, 1234);
  EXPECT_EQ(environment.timeout, std::chrono::milliseconds(2500));
  EXPECT_FALSE(environment.use_agent_store);
}

TEST(DistributedEnvironment, MissingLocalVariablesMeanOneMachine) {
  auto environment = parse_distributed_environment({{"RANK", "2"}, {"WORLD_SIZE", "3"}});
  EXPECT_EQ(environment.local_rank, 2);
  EXPECT_EQ(environment.local_world_size, 3);
  EXPECT_EQ(environment.master_addr, "127.0.0.1");
  EXPECT_EQ(environment.master_port, 29500);
}

TEST(DistributedEnvironment, AgentStore) {
  auto environment =
      parse_distributed_environment({{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"TORCHELASTIC_USE_AGENT_STORE", "True"}});
  EXPECT_TRUE(environment.use_agent_store);
}

// torchrun's restart round (fsdp launch --max-restarts exports the same two variables).
TEST(DistributedEnvironment, RestartCountAndMaxRestarts) {
  EXPECT_EQ(parse_distributed_environment({}).restart_count, 0);
  auto environment = parse_distributed_environment(
      {{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"TORCHELASTIC_RESTART_COUNT", "2"}, {"TORCHELASTIC_MAX_RESTARTS", "3"}});
  EXPECT_EQ(environment.restart_count, 2);
  EXPECT_EQ(environment.max_restarts, 3);
  EXPECT_EQ(parse_distributed_environment({{"TORCHELASTIC_RESTART_COUNT", "1"}}).restart_count, 1);
  try {
    parse_distributed_environment({{"TORCHELASTIC_RESTART_COUNT", "-1"}});
    FAIL() << "a negative restart count was accepted";
  } catch (const c10::Error& error) {
    EXPECT_NE(std::string(error.what()).find("TORCHELASTIC_RESTART_COUNT=-1 is negative"), std::string::npos)
        << error.what();
  }
  try {
    parse_distributed_environment({{"TORCHELASTIC_MAX_RESTARTS", "three"}});
    FAIL() << "a word was accepted";
  } catch (const c10::Error& error) {
    EXPECT_NE(std::string(error.what()).find("TORCHELASTIC_MAX_RESTARTS='three' is not an integer"), std::string::npos)
        << error.what();
  }
}

TEST(DistributedEnvironment, OpenMpiVariables) {
  auto environment = parse_distributed_environment({{"OMPI_COMM_WORLD_RANK", "3"},
                                                    {"OMPI_COMM_WORLD_SIZE", "4"},
                                                    {"OMPI_COMM_WORLD_LOCAL_RANK", "1"},
                                                    {"OMPI_COMM_WORLD_LOCAL_SIZE", "2"},
                                                    {"MASTER_ADDR", "head"}});
  EXPECT_EQ(environment.launcher, "openmpi");
  EXPECT_EQ(environment.rank, 3);
  EXPECT_EQ(environment.world_size, 4);
  EXPECT_EQ(environment.local_rank, 1);
  EXPECT_EQ(environment.node_rank, 1);
  EXPECT_EQ(environment.master_addr, "head");
}

TEST(DistributedEnvironment, MpichAndMvapichVariables) {
  auto mpich = parse_distributed_environment(
      {{"PMI_RANK", "1"}, {"PMI_SIZE", "2"}, {"MPI_LOCALRANKID", "1"}, {"MPI_LOCALNRANKS", "2"}});
  EXPECT_EQ(mpich.launcher, "mpich");
  EXPECT_EQ(mpich.rank, 1);
  auto mvapich = parse_distributed_environment({{"MV2_COMM_WORLD_RANK", "0"}, {"MV2_COMM_WORLD_SIZE", "2"}});
  EXPECT_EQ(mvapich.launcher, "mvapich2");
  EXPECT_EQ(mvapich.world_size, 2);
}

TEST(DistributedEnvironment, SlurmVariables) {
  auto environment = parse_distributed_environment({{"SLURM_PROCID", "5"},
                                                    {"SLURM_NTASKS", "8"},
                                                    {"SLURM_LOCALID", "1"},
                                                    {"SLURM_TASKS_PER_NODE", "4(x2)"},
                                                    {"SLURM_NODEID", "1"},
                                                    {"SLURM_JOB_NODELIST", "gpu[07-08],login"}});
  EXPECT_EQ(environment.launcher, "slurm");
  EXPECT_EQ(environment.rank, 5);
  EXPECT_EQ(environment.local_world_size, 4);
  EXPECT_EQ(environment.node_rank, 1);
  EXPECT_EQ(environment.master_addr, "gpu07");
}

TEST(DistributedEnvironment, TorchrunWinsOverSlurm) {
  auto environment =
      parse_distributed_environment({{"RANK", "1"}, {"WORLD_SIZE", "2"}, {"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "1"}});
  EXPECT_EQ(environment.launcher, "torchrun");
  EXPECT_EQ(environment.rank, 1);
}

TEST(DistributedEnvironment, SlurmNodelistFirstHost) {
  EXPECT_EQ(first_host_of_slurm_nodelist("node1"), "node1");
  EXPECT_EQ(first_host_of_slurm_nodelist("node[01-04]"), "node01");
  EXPECT_EQ(first_host_of_slurm_nodelist("rack2-node[3,5-7],other"), "rack2-node3");
  EXPECT_EQ(first_host_of_slurm_nodelist("a,b"), "a");
  EXPECT_THROW(first_host_of_slurm_nodelist("node[01-04"), c10::Error);
}

struct BadEnvironment {
  friend std::ostream& operator<<(std::ostream& stream, const BadEnvironment& value) {
    return stream << value.description;
  }
  const char* description;
  EnvironmentMap variables;
  std::vector<std::string> message_parts;
};

class DistributedEnvironmentErrors : public ::testing::TestWithParam<BadEnvironment> {};

TEST_P(DistributedEnvironmentErrors, NamesVariableValueAndFix) {
  const auto& bad = GetParam();
  auto message = error_of(bad.variables);
  ASSERT_FALSE(message.empty()) << bad.description << ": no error raised";
  for (const auto& part : bad.message_parts) {
    EXPECT_NE(message.find(part), std::string::npos)
        << bad.description << ": '" << part << "' missing from: " << message;
  }
}

INSTANTIATE_TEST_SUITE_P(
    Table, DistributedEnvironmentErrors,
    ::testing::Values(
        BadEnvironment{"rank not a number", {{"RANK", "one"}, {"WORLD_SIZE", "2"}}, {"RANK='one'", "not an integer"}},
        BadEnvironment{"trailing garbage", {{"RANK", "1x"}, {"WORLD_SIZE", "2"}}, {"RANK='1x'"}},
        BadEnvironment{"rank without world size", {{"RANK", "0"}}, {"WORLD_SIZE is not set", "fsdp launch"}},
        BadEnvironment{"world size without rank", {{"WORLD_SIZE", "2"}}, {"RANK is not set"}},
        BadEnvironment{"rank >= world size", {{"RANK", "2"}, {"WORLD_SIZE", "2"}}, {"RANK=2", "[0, 2)"}},
        BadEnvironment{"negative rank", {{"RANK", "-1"}, {"WORLD_SIZE", "2"}}, {"RANK=-1"}},
        BadEnvironment{"zero world size", {{"RANK", "0"}, {"WORLD_SIZE", "0"}}, {"WORLD_SIZE=0", "at least 1"}},
        BadEnvironment{"local rank alone",
                       {{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"LOCAL_RANK", "0"}},
                       {"LOCAL_WORLD_SIZE is not set"}},
        BadEnvironment{"local rank too big",
                       {{"RANK", "0"}, {"WORLD_SIZE", "4"}, {"LOCAL_RANK", "2"}, {"LOCAL_WORLD_SIZE", "2"}},
                       {"LOCAL_RANK=2", "[0, 2)"}},
        BadEnvironment{"uneven machines",
                       {{"RANK", "0"}, {"WORLD_SIZE", "3"}, {"LOCAL_RANK", "0"}, {"LOCAL_WORLD_SIZE", "2"}},
                       {"not a multiple", "--nproc-per-node"}},
        BadEnvironment{"multi-node without master",
                       {{"RANK", "0"}, {"WORLD_SIZE", "4"}, {"LOCAL_RANK", "0"}, {"LOCAL_WORLD_SIZE", "2"}},
                       {"MASTER_ADDR is not set", "2 machines"}},
        BadEnvironment{"port out of range",
                       {{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"MASTER_PORT", "70000"}},
                       {"MASTER_PORT=70000", "[1, 65535]"}},
        BadEnvironment{
            "port not a number", {{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"MASTER_PORT", "http"}}, {"MASTER_PORT='http'"}},
        BadEnvironment{
            "group rank out of range", {{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"GROUP_RANK", "3"}}, {"GROUP_RANK=3"}},
        BadEnvironment{
            "bad timeout", {{"FSDP_COLLECTIVE_TIMEOUT", "soon"}}, {"FSDP_COLLECTIVE_TIMEOUT='soon'", "seconds"}},
        BadEnvironment{"negative timeout", {{"FSDP_COLLECTIVE_TIMEOUT", "-3"}}, {"FSDP_COLLECTIVE_TIMEOUT='-3'"}},
        BadEnvironment{"check neither 0 nor 1",
                       {{"FSDP_CHECK_COLLECTIVES", "off"}},
                       {"FSDP_CHECK_COLLECTIVES='off'", "set it to 1 or 0"}},
        BadEnvironment{"open mpi rank without size", {{"OMPI_COMM_WORLD_RANK", "0"}}, {"OMPI_COMM_WORLD_SIZE"}},
        BadEnvironment{
            "slurm bad tasks per node",
            {{"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "2"}, {"SLURM_LOCALID", "0"}, {"SLURM_TASKS_PER_NODE", "x"}},
            {"SLURM_TASKS_PER_NODE"}}),
    [](const ::testing::TestParamInfo<BadEnvironment>& info) {
      std::string name;
      for (const char* c = info.param.description; *c; ++c)
        name += std::isalnum(static_cast<unsigned char>(*c)) ? *c : '_';
      return name;
    });

}  // namespace
}  // namespace fsdp
