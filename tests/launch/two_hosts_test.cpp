// Two hosts on one machine: two Linux network namespaces joined by a veth pair, two ranks each,
// started as on two machines (`fsdp launch --nnodes 2 --node-rank r --master-addr <host 0>`), with
// Gloo on the veth interface (issue Reliability, item 3). FULL_SHARD and HYBRID_SHARD train to the
// losses of the same job on one host, and killing host 1's ranks stops host 0 within 10 s with an
// error naming them. Making namespaces needs root (CAP_NET_ADMIN) and iproute2; where they cannot be
// made the tests say so and are skipped.
#include <gtest/gtest.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <map>
#include <nlohmann/json.hpp>
#include <regex>
#include <sstream>
#include <thread>

#include "harness/run_command.h"

namespace {

namespace fs = std::filesystem;
using fsdp::testing::run_command;

class TwoHosts : public ::testing::Test {
 protected:
  void SetUp() override {
    const auto id = std::to_string(::getpid() % 100000);
    namespaces_ = {"fsdp" + id + "h0", "fsdp" + id + "h1"};
    links_ = {"fv" + id + "a", "fv" + id + "b"};  // interface names have at most 15 characters
    const auto subnet = "10.231." + std::to_string(::getpid() % 250) + ".";
    addresses_ = {subnet + "1", subnet + "2"};
    root_ = fs::temp_directory_path() / ("fsdp_two_hosts_" + id);
    fs::remove_all(root_);
    fs::create_directories(root_);
    const std::string setup = "ip netns add " + namespaces_[0] + " && ip netns add " + namespaces_[1] +
                              " && ip link add " + links_[0] + " type veth peer name " + links_[1] +
                              " && ip link set " + links_[0] + " netns " + namespaces_[0] + " && ip link set " +
                              links_[1] + " netns " + namespaces_[1];
    std::string addresses;
    for (int host = 0; host < 2; ++host) {
      addresses += " && ip -n " + namespaces_[host] + " addr add " + addresses_[host] + "/24 dev " + links_[host] +
                   " && ip -n " + namespaces_[host] + " link set lo up && ip -n " + namespaces_[host] + " link set " +
                   links_[host] + " up";
    }
    const auto result = run_command(setup + addresses);
    if (result.exit_code != 0) {
      made_ = false;
      GTEST_SKIP() << "skipped: network namespaces cannot be made here (needs root and iproute2): " << result.output;
    }
    made_ = true;
    std::ofstream train(root_ / "train.txt");
    for (int index = 0; index < 400; ++index) {
      train << "Line " << index << ": each host keeps half of the ranks, and the ranks keep shards. ";
    }
  }

  void TearDown() override {
    if (made_) {
      for (const auto& name : namespaces_) {
        run_command("ip netns pids " + name + " | xargs -r kill -9; ip netns delete " + name);
      }
    }
    fs::remove_all(root_);
  }

  // `fsdp launch` of train_llama as host `host` of two, in its namespace, with Gloo on its veth.
  std::string host_command(int host, const std::string& environment, const std::string& flags) const {
    return "ip netns exec " + namespaces_[host] + " env GLOO_SOCKET_IFNAME=" + links_[host] + " " + environment + " " +
           FSDP_CLI_PATH + " launch --nnodes 2 --node-rank " + std::to_string(host) + " --nproc-per-node 2" +
           " --master-addr " + addresses_[0] + " --master-port " + std::to_string(port_) + " -- " +
           FSDP_TRAIN_LLAMA_PATH + " " + flags;
  }

  // The same with launch flags of the test's own (--nnodes MIN:MAX, --max-restarts, --rdzv-conf).
  std::string elastic_command(int host, const std::string& launch_flags, const std::string& program) const {
    return "ip netns exec " + namespaces_[host] + " env GLOO_SOCKET_IFNAME=" + links_[host] + " " + FSDP_CLI_PATH +
           " launch " + launch_flags + " --node-rank " + std::to_string(host) + " --nproc-per-node 2 --master-addr " +
           addresses_[0] + " --master-port " + std::to_string(port_) + " -- " + program;
  }

  // Runs `command` in the background; its exit status lands in `status` once it ends.
  static void start(const std::string& command, const std::string& log, const std::string& status) {
    run_command("(" + command + " > " + log + " 2>&1; echo $? > " + status + ".tmp; mv " + status + ".tmp " + status +
                ") > /dev/null 2>&1 < /dev/null &");
  }

  // Waits up to `limit` for `status` and returns the exit status, or -1.
  static int wait_for(const std::string& status, std::chrono::seconds limit) {
    const auto started = std::chrono::steady_clock::now();
    while (!fs::exists(status) && std::chrono::steady_clock::now() - started < limit) {
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    if (!fs::exists(status)) return -1;
    std::ifstream file(status);
    int code = -1;
    file >> code;
    return code;
  }

  static std::string read(const std::string& path) {
    std::ifstream file(path);
    std::stringstream text;
    text << file.rdbuf();
    return text.str();
  }

  static std::map<int64_t, double> losses_by_step(const fs::path& directory) {
    std::map<int64_t, double> values;
    std::ifstream file(directory / "metrics.jsonl");
    std::string line;
    while (std::getline(file, line)) {
      const auto record = nlohmann::json::parse(line);
      values[record.at("step").get<int64_t>()] = record.at("loss").get<double>();
    }
    return values;
  }

  std::string train_flags(const std::string& directory, int steps) const {
    return "--output-dir " + directory + " --data " + (root_ / "train.txt").string() + " --steps " +
           std::to_string(steps) + " --seq-len 32 --global-batch-size 8 --eval-every 0 --sample-bytes 8";
  }

  static std::vector<double> losses(const fs::path& directory) {
    std::vector<double> values;
    std::ifstream file(directory / "metrics.jsonl");
    std::string line;
    while (std::getline(file, line)) values.push_back(nlohmann::json::parse(line).at("loss").get<double>());
    return values;
  }

  std::vector<std::string> namespaces_, links_, addresses_;
  fs::path root_;
  int port_ = 20000 + ::getpid() % 20000;
  bool made_ = false;
};

TEST_F(TwoHosts, FullShardAndHybridShardGiveTheOneHostLosses) {
  for (const auto& [name, environment] : std::vector<std::pair<std::string, std::string>>{
           {"FULL_SHARD", ""}, {"HYBRID_SHARD", "FSDP_VERSION=1 FSDP_SHARDING_STRATEGY=HYBRID_SHARD"}}) {
    const auto one_host = (root_ / ("one_" + name)).string();
    auto result =
        run_command("env " + environment + " " + FSDP_CLI_PATH + " launch --nproc-per-node 4 --master-port 0 -- " +
                    FSDP_TRAIN_LLAMA_PATH + " " + train_flags(one_host, 4));
    ASSERT_EQ(result.exit_code, 0) << name << " on one host: " << result.output;
    // Both hosts write the one output directory, as on a shared file system.
    const auto two_hosts = (root_ / ("two_" + name)).string();
    const auto log = (root_ / ("host1_" + name + ".log")).string();
    ++port_;
    result = run_command("(" + host_command(1, environment, train_flags(two_hosts, 4)) + " > " + log + " 2>&1 &) ; " +
                         host_command(0, environment, train_flags(two_hosts, 4)));
    ASSERT_EQ(result.exit_code, 0) << name << " on two hosts, host 0: " << result.output;
    const auto expected = losses(one_host);
    const auto found = losses(two_hosts);
    ASSERT_EQ(found.size(), 4u) << name;
    ASSERT_EQ(expected.size(), 4u) << name;
    // HYBRID_SHARD on two hosts sums gradients in another order than on one host (shards of 2, then
    // across the hosts): the same losses up to rounding.
    for (size_t step = 0; step < found.size(); ++step) {
      EXPECT_NEAR(found[step], expected[step], 1e-5) << name << " step " << step + 1;
    }
  }
}

TEST_F(TwoHosts, KillingHostOnesRanksStopsHostZeroWithinTenSecondsNamingThem) {
  const auto directory = (root_ / "killed").string();
  const auto log0 = (root_ / "host0.log").string();
  const auto status0 = (root_ / "host0.status").string();
  const auto environment = std::string("FSDP_VERSION=1 FSDP_SHARDING_STRATEGY=HYBRID_SHARD");
  run_command("(" + host_command(1, environment, train_flags(directory, 100000)) + " > " +
              (root_ / "host1.log").string() + " 2>&1 &) ; (" +
              host_command(0, environment, train_flags(directory, 100000)) + " > " + log0 + " 2>&1; echo $? > " +
              status0 + ".tmp; mv " + status0 + ".tmp " + status0 + ") > /dev/null 2>&1 < /dev/null &");
  // Training has begun once two steps are recorded.
  const auto started = std::chrono::steady_clock::now();
  while (losses(directory).size() < 2 && !fs::exists(status0) &&
         std::chrono::steady_clock::now() - started < std::chrono::seconds(120)) {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  ASSERT_GE(losses(directory).size(), 2u) << "the two hosts did not start training";
  ASSERT_FALSE(fs::exists(status0));
  run_command("ip netns pids " + namespaces_[1] + " | xargs -r kill -9");
  const auto killed = std::chrono::steady_clock::now();
  while (!fs::exists(status0) && std::chrono::steady_clock::now() - killed < std::chrono::seconds(10)) {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  std::ifstream log_file(log0);
  std::stringstream log;
  log << log_file.rdbuf();
  ASSERT_TRUE(fs::exists(status0)) << "host 0 was still running 10 s after host 1's ranks were killed: " << log.str();
  std::ifstream status_file(status0);
  int status = 0;
  status_file >> status;
  EXPECT_NE(status, 0) << log.str();
  // Host 0's ranks meet the loss posting an exchange or in the frame exchange, whose groups pair each
  // rank with one of host 1's: each names it. A rank that meets it first in Gloo's own all-reduce on
  // the world (the loss), where Gloo does not say which rank, names the ranks it may be (host 1's among
  // them) and Gloo names host 1's address; the other rank of host 0 then names that rank or host 1's.
  std::string address1;
  for (const char character : addresses_[1])
    address1 += character == '.' ? std::string("\\.") : std::string(1, character);
  EXPECT_TRUE(std::regex_search(log.str(), std::regex("(in the exchange with|the connection to) rank [23]")) ||
              std::regex_search(log.str(), std::regex("in an exchange with one of ranks [0-9, ]*\\b[23]\\b[^\\n]*\\[" +
                                                      address1 + "\\]")))
      << "host 0's error does not name a rank or the address of host 1: " << log.str();
  EXPECT_NE(log.str().find("fsdp launch: rank "), std::string::npos) << log.str();
}

// Issue "Training that survives a lost machine", item 2 (Note [elastic rounds]): host 1's launcher
// and ranks killed; host 0 goes on alone (--nnodes 1:2) from the latest complete checkpoint, on 2
// ranks accumulating twice as much, with the losses of the same checkpoint resumed by hand there.
TEST_F(TwoHosts, LosingHostOneLeavesHostZeroToFinishAloneWithTheLossesOfAResumeByHand) {
  const auto directory = (root_ / "elastic").string();
  const auto flags = train_flags(directory, 14) + " --checkpoint-every 2 --total-limit 0 --micro-batch-size 2";
  const auto launch_flags =
      std::string("--nnodes 1:2 --max-restarts 1 --rdzv-conf last_call_timeout=2,join_timeout=120");
  const auto log0 = (root_ / "host0.log").string(), status0 = (root_ / "host0.status").string();
  start(elastic_command(1, launch_flags, std::string(FSDP_TRAIN_LLAMA_PATH) + " " + flags),
        (root_ / "host1.log").string(), (root_ / "host1.status").string());
  start(elastic_command(0, launch_flags, std::string(FSDP_TRAIN_LLAMA_PATH) + " " + flags), log0, status0);
  const auto started = std::chrono::steady_clock::now();
  while (losses(directory).size() < 5 && !fs::exists(status0) &&
         std::chrono::steady_clock::now() - started < std::chrono::seconds(120)) {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  const auto steps_at_kill = static_cast<int64_t>(losses(directory).size());
  ASSERT_GE(steps_at_kill, 5) << "the two hosts did not train: " << read(log0);
  ASSERT_FALSE(fs::exists(status0)) << read(log0);
  run_command("ip netns pids " + namespaces_[1] + " | xargs -r kill -9");
  ASSERT_EQ(wait_for(status0, std::chrono::seconds(180)), 0) << read(log0);
  const auto log = read(log0);
  EXPECT_NE(log.find("fsdp launch: on node rank 0, rank "), std::string::npos) << log;
  EXPECT_NE(log.find("Restarting: this machine joins round 1 (restart 1 of 1)"), std::string::npos) << log;
  EXPECT_NE(log.find("round 1: 1 of up to 2 machines (node ranks 0), 2 ranks (was 4)"), std::string::npos) << log;
  EXPECT_NE(log.find("the checkpoint was saved by 4 ranks and this run has 2: --global-batch-size 8 is kept, each "
                     "rank accumulating 2 micro-batch(es) of 2 per step (was 1 of 2)"),
            std::string::npos)
      << log;
  std::smatch resumed;
  ASSERT_TRUE(std::regex_search(log, resumed, std::regex("restart 1 of 1: resumed from (\\S+) at step (\\d+)"))) << log;
  const auto checkpoint = resumed[1].str();
  const int64_t step = std::stoll(resumed[2].str());
  // At most the steps since the last complete checkpoint are lost (one is saved every 2 steps).
  EXPECT_GE(step, steps_at_kill - 2) << log;

  const auto by_hand = (root_ / "by_hand").string();
  auto result = run_command(std::string(FSDP_CLI_PATH) + " launch --nproc-per-node 2 --master-port 0 -- " +
                            FSDP_TRAIN_LLAMA_PATH + " " + train_flags(by_hand, 14) +
                            " --checkpoint-every 2 --micro-batch-size 2 --resume-from " + checkpoint);
  ASSERT_EQ(result.exit_code, 0) << result.output;
  const auto expected = losses_by_step(by_hand);
  const auto found = losses_by_step(directory);
  ASSERT_EQ(expected.size(), static_cast<size_t>(14 - step)) << result.output;
  for (int64_t at = 1; at <= 14; ++at) EXPECT_EQ(found.count(at), 1u) << "step " << at << " missing: " << log;
  for (const auto& [at, loss] : expected) {
    ASSERT_EQ(found.count(at), 1u) << at;
    EXPECT_NEAR(found.at(at), loss, 1e-5) << "step " << at;
  }
  // The global batch is kept: the whole run has the losses of one never interrupted on 4 ranks, up
  // to the order of the sums (2 ranks accumulating 2 micro-batches each against 4 ranks one each).
  const auto four = (root_ / "four_ranks").string();
  result =
      run_command(std::string(FSDP_CLI_PATH) + " launch --nproc-per-node 4 --master-port 0 -- " +
                  FSDP_TRAIN_LLAMA_PATH + " " + train_flags(four, 14) + " --checkpoint-every 2 --micro-batch-size 2");
  ASSERT_EQ(result.exit_code, 0) << result.output;
  const auto uninterrupted = losses_by_step(four);
  ASSERT_EQ(uninterrupted.size(), 14u) << result.output;
  double largest = 0;
  for (const auto& [at, loss] : uninterrupted) largest = std::max(largest, std::abs(found.at(at) - loss));
  EXPECT_LT(largest, 1e-5) << "the largest difference from the run on 4 ranks";
  std::cout << "largest loss difference from the uninterrupted 4-rank run: " << largest << std::endl;
}

// A rank killed on host 1 (its launcher lives): both launchers start round 1 with all 4 ranks, and
// the run ends with the losses of one that was never interrupted (on one host, 4 ranks).
TEST_F(TwoHosts, ARankKilledOnHostOneRestartsBothHostsAndTheLossesAreThoseOfARunWithoutIt) {
  const auto one_host = (root_ / "one_host").string();
  const auto flags = [&](const std::string& directory) { return train_flags(directory, 10) + " --checkpoint-every 2"; };
  auto result = run_command(std::string(FSDP_CLI_PATH) + " launch --nproc-per-node 4 --master-port 0 -- " +
                            FSDP_TRAIN_LLAMA_PATH + " " + flags(one_host));
  ASSERT_EQ(result.exit_code, 0) << result.output;
  const auto directory = (root_ / "restarted").string();
  const auto launch_flags = std::string("--nnodes 2 --max-restarts 1");
  const auto log0 = (root_ / "host0.log").string(), status0 = (root_ / "host0.status").string();
  const auto log1 = (root_ / "host1.log").string(), status1 = (root_ / "host1.status").string();
  start(elastic_command(1, launch_flags, std::string(FSDP_TRAIN_LLAMA_PATH) + " " + flags(directory)), log1, status1);
  start(elastic_command(0, launch_flags, std::string(FSDP_TRAIN_LLAMA_PATH) + " " + flags(directory)), log0, status0);
  const auto started = std::chrono::steady_clock::now();
  while (losses(directory).size() < 3 && !fs::exists(status0) &&
         std::chrono::steady_clock::now() - started < std::chrono::seconds(120)) {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  ASSERT_GE(losses(directory).size(), 3u) << read(log0);
  // One of host 1's train_llama processes, not its launcher.
  run_command("for pid in $(ip netns pids " + namespaces_[1] +
              "); do if tr '\\0' ' ' < /proc/$pid/cmdline | "
              "grep -q '^[^ ]*train_llama '; then kill -9 $pid; break; fi; done");
  ASSERT_EQ(wait_for(status0, std::chrono::seconds(180)), 0) << read(log0);
  ASSERT_EQ(wait_for(status1, std::chrono::seconds(30)), 0) << read(log1);
  const auto host1 = read(log1);
  EXPECT_TRUE(std::regex_search(host1, std::regex("on node rank 1, rank [23] \\(local rank [01]\\) failed first, "
                                                  "with exit code 137 \\(SIGKILL\\)")))
      << host1;
  EXPECT_NE(
      read(log0).find("round 1: 2 of up to 2 machines (node ranks 0, 1), 4 ranks; this machine runs ranks 0 to 1."),
      std::string::npos)
      << read(log0);
  const auto expected = losses_by_step(one_host);
  const auto found = losses_by_step(directory);
  ASSERT_EQ(found.size(), 10u) << read(log0);
  for (const auto& [at, loss] : expected) EXPECT_NEAR(found.at(at), loss, 1e-5) << "step " << at;
}

// A machine that arrives while a round runs: host 1 starts once round 0 runs on host 0 alone
// (--nnodes 1:2), waits, and joins round 1 when host 0's processes fail; round 1 runs on both, with
// the ranks, world size, GROUP_RANK and restart count of two machines. (torchrun's agents would
// restart the running round to admit it; Note [elastic rounds].)
TEST_F(TwoHosts, AMachineThatArrivesWhileARoundRunsJoinsAtTheNextRestart) {
  const auto file = [&](const std::string& name) { return (root_ / name).string(); };
  const std::string program = "sh -c 'echo $RANK $WORLD_SIZE $GROUP_RANK $TORCHELASTIC_RESTART_COUNT >> " +
                              file("ranks_") + "$RANK; " + "if [ $TORCHELASTIC_RESTART_COUNT = 0 ]; then touch " +
                              file("round_0") + "; while [ ! -e " + file("host1") +
                              " ]; do sleep 0.05; done; sleep 3; exit 3; fi'";
  // Host 1 has 3 s to start and wait for round 1, which host 0 opens once its processes failed.
  const auto launch_flags = std::string("--nnodes 1:2 --max-restarts 1 --rdzv-conf last_call_timeout=3");
  const auto log0 = file("host0.log"), status0 = file("host0.status");
  const auto log1 = file("host1.log"), status1 = file("host1.status");
  start(elastic_command(0, launch_flags, program), log0, status0);
  const auto started = std::chrono::steady_clock::now();
  while (!fs::exists(file("round_0")) && !fs::exists(status0) &&
         std::chrono::steady_clock::now() - started < std::chrono::seconds(30)) {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  ASSERT_TRUE(fs::exists(file("round_0"))) << read(log0);
  start("touch " + file("host1") + "; " + elastic_command(1, launch_flags, program), log1, status1);
  ASSERT_EQ(wait_for(status0, std::chrono::seconds(60)), 0) << read(log0);
  ASSERT_EQ(wait_for(status1, std::chrono::seconds(30)), 0) << read(log1);
  // RANK WORLD_SIZE GROUP_RANK TORCHELASTIC_RESTART_COUNT, a line per round the rank ran in.
  EXPECT_EQ(read(file("ranks_0")), "0 2 0 0\n0 4 0 1\n");
  EXPECT_EQ(read(file("ranks_1")), "1 2 0 0\n1 4 0 1\n");
  EXPECT_EQ(read(file("ranks_2")), "2 4 1 1\n");
  EXPECT_EQ(read(file("ranks_3")), "3 4 1 1\n");
  const auto host0 = read(log0), host1 = read(log1);
  EXPECT_NE(host0.find("round 0: 1 of up to 2 machines (node ranks 0), 2 ranks; this machine runs ranks 0 to 1."),
            std::string::npos)
      << host0;
  EXPECT_NE(host0.find("fsdp launch: on node rank 0, rank "), std::string::npos) << host0;
  EXPECT_NE(host0.find("round 1: 2 of up to 2 machines (node ranks 0, 1), 4 ranks (was 2); this machine runs ranks 0 "
                       "to 1."),
            std::string::npos)
      << host0;
  EXPECT_NE(host1.find("round 1: 2 of up to 2 machines (node ranks 0, 1), 4 ranks; this machine runs ranks 2 to 3."),
            std::string::npos)
      << host1;
}

// A preemption: SIGTERM to host 1's launcher stops its processes and takes the machine out of the
// job as a lost one (it exits 143); host 0 stops its own and goes on alone in round 1 (--nnodes 1:2),
// as torchrun's agents do.
TEST_F(TwoHosts, ASignalToHostOnesLauncherTakesItOutAndHostZeroGoesOnAlone) {
  const auto file = [&](const std::string& name) { return (root_ / name).string(); };
  const std::string program = "sh -c 'echo $RANK $WORLD_SIZE $TORCHELASTIC_RESTART_COUNT >> " + file("ranks_") +
                              "$RANK; if [ $TORCHELASTIC_RESTART_COUNT = 0 ]; then exec sleep 100; fi'";
  const auto launch_flags =
      std::string("--nnodes 1:2 --max-restarts 1 --termination-grace 1 --rdzv-conf last_call_timeout=1");
  start(elastic_command(1, launch_flags, program), file("host1.log"), file("host1.status"));
  start(elastic_command(0, launch_flags, program), file("host0.log"), file("host0.status"));
  const auto started = std::chrono::steady_clock::now();
  while (!(fs::exists(file("ranks_0")) && fs::exists(file("ranks_3"))) &&
         std::chrono::steady_clock::now() - started < std::chrono::seconds(30)) {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  ASSERT_TRUE(fs::exists(file("ranks_3"))) << read(file("host1.log"));
  run_command("ip netns pids " + namespaces_[1] +
              " | xargs -r ps -o pid=,comm= -p | awk '$2 == \"fsdp\" {print $1}' | "
              "xargs -r kill -TERM");
  EXPECT_EQ(wait_for(file("host1.status"), std::chrono::seconds(30)), 143) << read(file("host1.log"));
  ASSERT_EQ(wait_for(file("host0.status"), std::chrono::seconds(30)), 0) << read(file("host0.log"));
  EXPECT_EQ(read(file("ranks_0")), "0 4 0\n0 2 1\n");
  EXPECT_EQ(read(file("ranks_3")), "3 4 0\n");
  const auto host0 = read(file("host0.log"));
  EXPECT_NE(host0.find("on node rank 1, interrupted (exit code 143); stopped all 2 local process(es). This machine "
                       "stopped its 2 local process(es). Restarting: this machine joins round 1"),
            std::string::npos)
      << host0;
  EXPECT_NE(host0.find("round 1: 1 of up to 2 machines (node ranks 0), 2 ranks (was 4)"), std::string::npos) << host0;
}

// Fewer than MIN machines: the host waits out the join timeout, then every launcher names who is
// present and exits 1. Launchers with other settings: every launcher names the one that differs.
// The machine hosting the store lost: the others say so.
TEST_F(TwoHosts, FewerThanMinMachinesDisagreeingLaunchersAndALostStoreHostAreNamedErrors) {
  const auto file = [&](const std::string& name) { return (root_ / name).string(); };
  auto both = [&](const std::string& flags0, const std::string& flags1, const std::string& program,
                  const std::string& name) {
    start(elastic_command(1, flags1, program), file(name + "1.log"), file(name + "1.status"));
    start(elastic_command(0, flags0, program), file(name + "0.log"), file(name + "0.status"));
  };
  both("--nnodes 3:3 --max-restarts 1 --rdzv-conf join_timeout=3",
       "--nnodes 3:3 --max-restarts 1 --rdzv-conf join_timeout=3", "true", "few");
  for (const auto host : {"0", "1"}) {
    EXPECT_EQ(wait_for(file(std::string("few") + host + ".status"), std::chrono::seconds(30)), 1) << host;
    EXPECT_NE(read(file(std::string("few") + host + ".log"))
                  .find("round 0: only 2 of at least 3 machines (--nnodes 3:3) joined within the join timeout of 3 s; "
                        "present: node rank 0, 1."),
              std::string::npos)
        << read(file(std::string("few") + host + ".log"));
  }

  ++port_;
  both("--nnodes 1:2 --max-restarts 1", "--nnodes 1:2 --max-restarts 2", "true", "differ");
  for (const auto host : {"0", "1"}) {
    EXPECT_EQ(wait_for(file(std::string("differ") + host + ".status"), std::chrono::seconds(30)), 1) << host;
    EXPECT_TRUE(
        std::regex_search(read(file(std::string("differ") + host + ".log")),
                          std::regex("round 0: the launcher of --node-rank 1 \\(on \\S+\\) has --nproc-per-node 2 "
                                     "--nnodes 1:2 --max-restarts 2 --termination-grace 3 but the host's are "
                                     "--nproc-per-node 2 --nnodes 1:2 --max-restarts 1 --termination-grace 3; "
                                     "every machine's launcher needs the same ones")))
        << read(file(std::string("differ") + host + ".log"));
  }

  ++port_;
  const auto log1 = file("orphan.log"), status1 = file("orphan.status");
  start(elastic_command(1, "--nnodes 1:2 --max-restarts 1", "sleep 100"), log1, status1);
  start(elastic_command(0, "--nnodes 1:2 --max-restarts 1", "sleep 100"), file("host0.log"), file("host0.status"));
  // Both run their processes once host 1's show in its namespace.
  const auto started = std::chrono::steady_clock::now();
  while (run_command("ip netns pids " + namespaces_[1] + " | xargs -r ps -o comm= -p | grep -q sleep").exit_code != 0 &&
         std::chrono::steady_clock::now() - started < std::chrono::seconds(30)) {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  ASSERT_EQ(run_command("ip netns pids " + namespaces_[1] + " | xargs -r ps -o comm= -p | grep -q sleep").exit_code, 0)
      << "host 1's processes never started: " << read(log1);
  run_command("ip netns pids " + namespaces_[0] + " | xargs -r kill -9");
  EXPECT_EQ(wait_for(status1, std::chrono::seconds(30)), 1) << read(log1);
  EXPECT_NE(
      read(log1).find("the launchers' rendezvous store at " + addresses_[0] + ":" + std::to_string(port_) + " failed"),
      std::string::npos)
      << read(log1);
  EXPECT_NE(read(log1).find("without it the job cannot go on"), std::string::npos) << read(log1);
}

}  // namespace
