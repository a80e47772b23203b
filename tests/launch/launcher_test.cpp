// `fsdp launch` end to end: the real binary starting real processes.
#include "launch/launcher.h"

#include <c10/util/Exception.h>
#include <gtest/gtest.h>
#include <torch/version.h>

#include <csignal>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>
#include <thread>
#include <tuple>

#include "harness/python_peer.h"
#include "launch/process_set.h"

namespace fsdp {
namespace {

namespace fs = std::filesystem;

struct CommandResult {
  int exit_code = -1;
  std::string output;  // stdout and stderr, interleaved
};

class LaunchTest : public ::testing::Test {
 protected:
  void SetUp() override {
    directory_ = fs::temp_directory_path() / ("fsdp_launch_test_" + std::to_string(::getpid()) + "_" +
                                              ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(directory_);
    fs::create_directories(directory_);
  }
  void TearDown() override { fs::remove_all(directory_); }

  CommandResult run(std::vector<std::string> arguments) {
    detail::ProcessSpec spec;
    spec.argv = {FSDP_CLI_PATH};
    spec.argv.insert(spec.argv.end(), arguments.begin(), arguments.end());
    spec.environment = current_process_environment();
    spec.environment.erase("OMP_NUM_THREADS");
    spec.label = "fsdp";
    spec.output = detail::OutputMode::kFile;
    spec.output_path = (directory_ / "launcher.log").string();
    detail::ProcessSetOptions options;
    options.timeout = std::chrono::seconds(120);
    options.forward_signals = false;
    auto result = detail::run_process_set({spec}, options);
    return {result.outcomes.at(0).exit_code, read(spec.output_path)};
  }

  static std::string read(const fs::path& path) {
    std::ifstream file(path);
    std::stringstream text;
    text << file.rdbuf();
    return text.str();
  }

  std::string path(const std::string& name) const { return (directory_ / name).string(); }

  fs::path directory_;
};

TEST_F(LaunchTest, SetsTorchrunVariablesForEveryRank) {
  auto result =
      run({"launch", "--nproc-per-node", "3", "--master-port", "0", "--", "sh", "-c",
           "echo \"$RANK $WORLD_SIZE $LOCAL_RANK $LOCAL_WORLD_SIZE $GROUP_RANK $MASTER_ADDR $OMP_NUM_THREADS\" > " +
               path("rank_") + "$RANK; echo \"$MASTER_PORT\" > " + path("port_") + "$RANK"});
  ASSERT_EQ(result.exit_code, 0) << result.output;
  for (int rank = 0; rank < 3; ++rank) {
    EXPECT_EQ(read(path("rank_" + std::to_string(rank))),
              std::to_string(rank) + " 3 " + std::to_string(rank) + " 3 0 127.0.0.1 1\n");
  }
  const std::string port = read(path("port_0"));
  EXPECT_NE(port, "0\n");  // --master-port 0 picked a real port
  EXPECT_EQ(read(path("port_1")), port);
  EXPECT_EQ(read(path("port_2")), port);
}

TEST_F(LaunchTest, SecondMachineGetsOffsetRanks) {
  auto result = run(
      {"launch", "--nproc-per-node", "2", "--nnodes", "2", "--node-rank", "1", "--master-addr", "10.0.0.1",
       "--master-port", "1234", "--", "sh", "-c",
       "echo \"$RANK $WORLD_SIZE $LOCAL_RANK $GROUP_RANK $MASTER_ADDR $MASTER_PORT\" > " + path("rank_") + "$RANK"});
  ASSERT_EQ(result.exit_code, 0) << result.output;
  EXPECT_EQ(read(path("rank_2")), "2 4 0 1 10.0.0.1 1234\n");
  EXPECT_EQ(read(path("rank_3")), "3 4 1 1 10.0.0.1 1234\n");
}

// A rank that fails because another did exits a few milliseconds after it. The launcher used to
// look every 20 ms and, finding both gone, name the lower rank (1 in 4 runs, issue Reliability); it
// now learns of each exit at once. Rank 0 here waits until rank 1 has exited (a zombie), ignores
// SIGTERM, and exits 10 ms later with its own code: rank 1 is named first, rank 0 after it.
TEST_F(LaunchTest, TheRankThatFailedFirstIsNamedAndTheOthersAfterIt) {
  for (int attempt = 0; attempt < 6; ++attempt) {
    const auto pid_file = path("pid_of_rank_1_" + std::to_string(attempt));
    const std::string script =
        "if [ \"$RANK\" = 1 ]; then echo $$ > " + pid_file + ".tmp; mv " + pid_file + ".tmp " + pid_file +
        "; exit 3; fi; trap '' TERM; while [ ! -s " + pid_file + " ]; do :; done; pid=$(cat " + pid_file +
        "); while [ -e /proc/$pid ] && ! grep -q '^[0-9]* ([^)]*) Z' /proc/$pid/stat 2>/dev/null; do :; done; "
        "sleep 0.01; exit 1";
    auto result = run({"launch", "--nproc-per-node", "2", "--master-port", "0", "--", "sh", "-c", script});
    EXPECT_EQ(result.exit_code, 3) << result.output;
    EXPECT_NE(result.output.find("rank 1 (local rank 1) failed first, with exit code 3; stopped the other 1 local "
                                 "process(es); after it failed rank 0 with exit code 1."),
              std::string::npos)
        << "attempt " << attempt << ": " << result.output;
  }
}

TEST_F(LaunchTest, FailingRankStopsTheOthersAndSetsTheExitCode) {
  // Ranks 0 and 2 would sleep for 100 s; rank 1 fails with exit code 3 after they started.
  const std::string script = "echo $$ > " + path("pid_") +
                             "$RANK; if [ \"$RANK\" = 1 ]; then sleep 0.5; exit 3; fi; "
                             "exec sleep 100";
  const auto started = std::chrono::steady_clock::now();
  auto result = run(
      {"launch", "--nproc-per-node", "3", "--master-port", "0", "--termination-grace", "2", "--", "sh", "-c", script});
  const auto elapsed = std::chrono::steady_clock::now() - started;
  EXPECT_EQ(result.exit_code, 3) << result.output;
  EXPECT_NE(result.output.find("rank 1 (local rank 1) failed first, with exit code 3"), std::string::npos)
      << result.output;
  // The sleeps were stopped rather than waited for.
  EXPECT_LT(elapsed, std::chrono::seconds(100));
  for (int rank : {0, 2}) {
    const pid_t pid = std::stoi(read(path("pid_" + std::to_string(rank))));
    EXPECT_NE(::kill(pid, 0), 0) << "rank " << rank << " (pid " << pid << ") is still alive";
  }
}

// A rank that ignores SIGTERM is killed (SIGKILL) once --termination-grace has passed, and so are
// the processes it started (its process group): rank 0 traps SIGTERM and starts a grandchild that
// would sleep 100 s; rank 1 fails. The launcher ends after the grace, not after 100 s, and neither
// rank 0 nor its grandchild is left.
TEST_F(LaunchTest, ARankIgnoringSigtermIsKilledAfterTheGraceWithItsGrandchildren) {
  const std::string script = "if [ \"$RANK\" = 1 ]; then while [ ! -s " + path("grandchild") +
                             " ]; do sleep 0.05; done; exit 3; fi; "
                             "trap '' TERM; echo $$ > " +
                             path("rank_0.tmp") + "; mv " + path("rank_0.tmp") + " " + path("rank_0") +
                             "; "
                             "sleep 100 & echo $! > " +
                             path("grandchild.tmp") + "; mv " + path("grandchild.tmp") + " " + path("grandchild") +
                             "; while :; do sleep 0.1; done";
  const auto started = std::chrono::steady_clock::now();
  auto result = run(
      {"launch", "--nproc-per-node", "2", "--master-port", "0", "--termination-grace", "1", "--", "sh", "-c", script});
  const auto elapsed = std::chrono::steady_clock::now() - started;
  EXPECT_EQ(result.exit_code, 3) << result.output;
  EXPECT_NE(result.output.find("rank 1 (local rank 1) failed first, with exit code 3"), std::string::npos)
      << result.output;
  EXPECT_GE(elapsed, std::chrono::seconds(1)) << "rank 0 ignores SIGTERM: only SIGKILL after the grace ends it";
  EXPECT_LT(elapsed, std::chrono::seconds(30));
  for (const auto* name : {"rank_0", "grandchild"}) {
    const pid_t pid = std::stoi(read(path(name)));
    // Reaped (rank 0) or gone with its group (the grandchild, which init reaps): no such process,
    // or at most a zombie about to be reaped.
    bool alive = ::kill(pid, 0) == 0;
    if (alive) {
      const auto stat = read("/proc/" + std::to_string(pid) + "/stat");
      alive = stat.find(") Z") == std::string::npos;
    }
    EXPECT_FALSE(alive) << name << " (pid " << pid << ") is still running";
  }
}

TEST_F(LaunchTest, RankKilledBySignalGives128PlusSignal) {
  auto result = run({"launch", "--nproc-per-node", "2", "--master-port", "0", "--", "sh", "-c",
                     "if [ \"$RANK\" = 0 ]; then kill -9 $$; fi; exec sleep 100"});
  EXPECT_EQ(result.exit_code, 128 + SIGKILL) << result.output;
}

// --max-restarts (torchrun's): a failure stops the others, then every rank starts again with
// TORCHELASTIC_RESTART_COUNT one higher, one line naming the failure and the restart; the job
// succeeds once a round does. Here rank 1 fails in rounds 0 and 1 (killed by SIGKILL, then exit 3).
TEST_F(LaunchTest, MaxRestartsStartsEveryRankAgainWithTheRestartCount) {
  const std::string script =
      "echo \"$TORCHELASTIC_RESTART_COUNT $TORCHELASTIC_MAX_RESTARTS\" >> " + path("rounds_") +
      "$RANK; "
      "if [ \"$RANK\" = 1 ] && [ \"$TORCHELASTIC_RESTART_COUNT\" = 0 ]; then kill -9 $$; fi; "
      "if [ \"$RANK\" = 1 ] && [ \"$TORCHELASTIC_RESTART_COUNT\" = 1 ]; then exit 3; fi; "
      "if [ \"$RANK\" = 0 ] && [ \"$TORCHELASTIC_RESTART_COUNT\" != 2 ]; then exec sleep 100; fi; exit 0";
  auto result = run({"launch", "--nproc-per-node", "2", "--master-port", "0", "--max-restarts", "3",
                     "--termination-grace", "1", "--", "sh", "-c", script});
  EXPECT_EQ(result.exit_code, 0) << result.output;
  EXPECT_EQ(read(path("rounds_0")), "0 3\n1 3\n2 3\n");
  EXPECT_EQ(read(path("rounds_1")), "0 3\n1 3\n2 3\n");
  EXPECT_NE(result.output.find("fsdp launch: rank 1 (local rank 1) failed first, with exit code 137 (SIGKILL); stopped "
                               "the other 1 local process(es). Restarting all 2 local process(es): restart 1 of 3."),
            std::string::npos)
      << result.output;
  EXPECT_NE(result.output.find("failed first, with exit code 3; stopped the other 1 local process(es). Restarting all "
                               "2 local process(es): restart 2 of 3."),
            std::string::npos)
      << result.output;
}

// --max-restarts against the venv's real torchrun on the same program: every rank records
// torchrun's variables in every round, rank 1 fails in rounds 0 and 1. Both give each rank the same
// lines (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK, GROUP_WORLD_SIZE, ROLE_RANK, ROLE_WORLD_SIZE,
// TORCHELASTIC_RESTART_COUNT, TORCHELASTIC_MAX_RESTARTS). Restarts run out: the same rounds; torchrun
// exits 1 (ChildFailedError), fsdp launch with the failure's own code, on purpose (README).
class TorchrunSideBySide : public LaunchTest {};

TEST_F(TorchrunSideBySide, RestartsGiveEveryRoundTorchrunsVariables) {
  for (const int failing_rounds : {2, 5}) {
    SCOPED_TRACE("rank 1 fails in its first " + std::to_string(failing_rounds) + " rounds");
    std::map<std::string, std::string> lines;
    std::map<std::string, int> exit_codes;
    for (const std::string launcher : {"torchrun", "fsdp"}) {
      const auto prefix = path(launcher + "_" + std::to_string(failing_rounds) + "_rank_");
      const std::string script =
          "echo $RANK $WORLD_SIZE $LOCAL_RANK $LOCAL_WORLD_SIZE $GROUP_RANK $GROUP_WORLD_SIZE $ROLE_RANK "
          "$ROLE_WORLD_SIZE "
          "$TORCHELASTIC_RESTART_COUNT $TORCHELASTIC_MAX_RESTARTS >> " +
          prefix +
          "$RANK; "
          "if [ $RANK = 1 ] && [ $TORCHELASTIC_RESTART_COUNT -lt " +
          std::to_string(failing_rounds) +
          " ]; then "
          // Rank 1 fails only once rank 0 has written this round's line: a launcher stops rank 0
          // when rank 1 fails, and how soon it does is not what this test compares.
          "while [ \"$(cat " +
          prefix + "0 2>/dev/null | wc -l)\" -le $TORCHELASTIC_RESTART_COUNT ]; do sleep 0.02; done; exit 3; fi";
      detail::ProcessSpec spec;
      spec.argv = launcher == "torchrun" ? std::vector<std::string>{testing::venv_python(),
                                                                    "-m",
                                                                    "torch.distributed.run",
                                                                    "--standalone",
                                                                    "--nproc-per-node",
                                                                    "2",
                                                                    "--max-restarts",
                                                                    "2",
                                                                    "--monitor-interval",
                                                                    "0.1",
                                                                    "--no-python",
                                                                    "sh",
                                                                    "-c",
                                                                    script}
                                         : std::vector<std::string>{FSDP_CLI_PATH,
                                                                    "launch",
                                                                    "--nproc-per-node",
                                                                    "2",
                                                                    "--master-port",
                                                                    "0",
                                                                    "--max-restarts",
                                                                    "2",
                                                                    "--",
                                                                    "sh",
                                                                    "-c",
                                                                    script};
      spec.environment = current_process_environment();
      spec.label = launcher;
      spec.output = detail::OutputMode::kFile;
      spec.output_path = path(launcher + ".log");
      detail::ProcessSetOptions options;
      options.timeout = std::chrono::seconds(120);
      options.forward_signals = false;
      exit_codes[launcher] = detail::run_process_set({spec}, options).outcomes.at(0).exit_code;
      for (const auto rank : {"0", "1"}) lines[launcher + rank] = read(prefix + rank);
      SCOPED_TRACE(read(spec.output_path));
      EXPECT_FALSE(lines[launcher + "0"].empty());
    }
    EXPECT_EQ(lines["fsdp0"], lines["torchrun0"]);
    EXPECT_EQ(lines["fsdp1"], lines["torchrun1"]);
    // Three rounds either way: the first start and --max-restarts 2.
    EXPECT_EQ(lines["fsdp1"], "1 2 1 2 0 1 1 2 0 2\n1 2 1 2 0 1 1 2 1 2\n1 2 1 2 0 1 1 2 2 2\n");
    EXPECT_EQ(exit_codes["torchrun"], failing_rounds == 2 ? 0 : 1) << read(path("torchrun.log"));
    EXPECT_EQ(exit_codes["fsdp"], failing_rounds == 2 ? 0 : 3) << read(path("fsdp.log"));
  }
}

// Restarts run out: the last failure's code, and the line says none is left. Without the flag,
// no restart at all (the default of 0, as torchrun).
TEST_F(LaunchTest, ExhaustedRestartsExitWithTheLastFailuresCode) {
  const std::string script = "echo x >> " + path("starts") + "; exit $((3 + ${TORCHELASTIC_RESTART_COUNT}))";
  auto result = run({"launch", "--master-port", "0", "--max-restarts", "2", "--", "sh", "-c", script});
  EXPECT_EQ(result.exit_code, 5) << result.output;
  EXPECT_EQ(read(path("starts")), "x\nx\nx\n");
  EXPECT_NE(result.output.find("rank 0 (local rank 0) failed first, with exit code 5; stopped the other 0 local "
                               "process(es). No restart left (--max-restarts 2, 2 made)."),
            std::string::npos)
      << result.output;
  fs::remove(path("starts"));
  result = run({"launch", "--master-port", "0", "--", "sh", "-c", script});
  EXPECT_EQ(result.exit_code, 3) << result.output;
  EXPECT_EQ(read(path("starts")), "x\n");
  EXPECT_EQ(result.output.find("Restarting"), std::string::npos) << result.output;
}

TEST_F(LaunchTest, InterruptStopsEveryRank) {
  std::thread interrupter([this] {
    // The workers record the launcher's pid ($PPID of sh) once they run.
    for (int attempt = 0; attempt < 600 && !fs::exists(path("ready_1")); ++attempt) {
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    const std::string launcher_pid = read(path("ready_1"));
    if (!launcher_pid.empty()) ::kill(std::stoi(launcher_pid), SIGINT);
  });
  auto result = run({"launch", "--nproc-per-node", "2", "--master-port", "0", "--", "sh", "-c",
                     "echo $$ > " + path("pid_") + "$RANK; echo $PPID > " + path("ready_") + "$RANK; exec sleep 100"});
  interrupter.join();
  EXPECT_EQ(result.exit_code, 128 + SIGINT) << result.output;
  EXPECT_NE(result.output.find("interrupted"), std::string::npos) << result.output;
  for (int rank : {0, 1}) {
    const pid_t pid = std::stoi(read(path("pid_" + std::to_string(rank))));
    EXPECT_NE(::kill(pid, 0), 0) << "rank " << rank << " is still alive";
  }
}

TEST_F(LaunchTest, RankPrefixLabelsEachLine) {
  auto result = run({"launch", "--nproc-per-node", "2", "--master-port", "0", "--rank-prefix", "--", "sh", "-c",
                     "echo hello; echo oops >&2; printf partial"});
  ASSERT_EQ(result.exit_code, 0) << result.output;
  for (const char* expected : {"[rank 0]: hello\n", "[rank 1]: hello\n", "[rank 0]: oops\n", "[rank 1]: partial\n"}) {
    EXPECT_NE(result.output.find(expected), std::string::npos) << expected << " missing from:\n" << result.output;
  }
}

TEST_F(LaunchTest, MissingProgramIsAClearError) {
  auto result = run({"launch", "--nproc-per-node", "2", "--", "no_such_program_fsdp_test"});
  EXPECT_EQ(result.exit_code, 1);
  EXPECT_NE(result.output.find("program 'no_such_program_fsdp_test' was not found in PATH"), std::string::npos)
      << result.output;
  result = run({"launch", "--", path("missing.sh")});
  EXPECT_EQ(result.exit_code, 1);
  EXPECT_NE(result.output.find("does not exist or is not an executable file"), std::string::npos) << result.output;
  result = run({"launch", "--nproc-per-node", "2"});
  EXPECT_EQ(result.exit_code, 1);
  EXPECT_NE(result.output.find("no program given"), std::string::npos) << result.output;
}

TEST_F(LaunchTest, InconsistentFlagsAreRejected) {
  auto result = run({"launch", "--nnodes", "2", "--node-rank", "2", "--", "true"});
  EXPECT_EQ(result.exit_code, 1);
  EXPECT_NE(result.output.find("--node-rank 2 must be in [0, --nnodes 2)"), std::string::npos) << result.output;
  result = run({"launch", "--nnodes", "2", "--master-addr", "10.0.0.1", "--master-port", "0", "--", "true"});
  EXPECT_NE(result.output.find("--master-port 0 picks a port on this machine only"), std::string::npos)
      << result.output;
  result = run({"launch", "--nnodes", "2", "--", "true"});
  EXPECT_NE(result.output.find("is a loopback address"), std::string::npos) << result.output;
  result = run({"launch", "--max-restarts", "-1", "--", "true"});
  EXPECT_EQ(result.exit_code, 1) << result.output;
  EXPECT_NE(result.output.find("--max-restarts -1 must be 0 or more"), std::string::npos) << result.output;
  // --nnodes MIN:MAX and --rdzv-conf, torchrun's: usage errors, naming the value.
  for (const auto& [flag, value, expected] : std::vector<std::tuple<std::string, std::string, std::string>>{
           {"--nnodes", "3:2", "--nnodes 3:2 is not MIN:MAX with 1 <= MIN <= MAX"},
           {"--nnodes", "0:2", "--nnodes 0:2 is not MIN:MAX with 1 <= MIN <= MAX"},
           {"--nnodes", "two", "--nnodes 'two' is not N or MIN:MAX"},
           {"--nnodes", "1:", "--nnodes '1:' is not N or MIN:MAX"},
           {"--rdzv-conf", "read_timeout=3",
            "--rdzv-conf 'read_timeout=3' is not join_timeout=SECONDS or "
            "last_call_timeout=SECONDS"},
           {"--rdzv-conf", "join_timeout=soon", "--rdzv-conf join_timeout=soon: expected seconds in [0, 86400]"}}) {
    result = run({"launch", flag, value, "--", "true"});
    EXPECT_EQ(result.exit_code, 2) << value << ": " << result.output;
    EXPECT_NE(result.output.find(expected), std::string::npos) << result.output;
  }
  // --rdzv-conf where the rendezvous is fixed: a warning naming it, and the job runs.
  result = run({"launch", "--master-port", "0", "--rdzv-conf", "join_timeout=5", "--", "true"});
  EXPECT_EQ(result.exit_code, 0) << result.output;
  EXPECT_NE(result.output.find("warning: --rdzv-conf is ignored"), std::string::npos) << result.output;
  result = run({"launch", "--nproc-per-node", "zero", "--", "true"});
  EXPECT_EQ(result.exit_code, 2) << result.output;
  EXPECT_NE(result.output.find("--nproc-per-node"), std::string::npos) << result.output;
  EXPECT_NE(result.output.find("zero"), std::string::npos) << result.output;
}

TEST_F(LaunchTest, SelftestPassesOnThreeRanksWithBytesAtTheory) {
  auto result = run({"launch", "--nproc-per-node", "3", "--master-port", "0", "--", FSDP_CLI_PATH, "selftest"});
  ASSERT_EQ(result.exit_code, 0) << result.output;
  EXPECT_NE(result.output.find("PASSED"), std::string::npos) << result.output;
  EXPECT_EQ(result.output.find("MISMATCH"), std::string::npos) << result.output;
  // Whichever algorithm the table takes (Note [Algorithms by measurement]): its name, then the bytes.
  EXPECT_NE(result.output.find("all_gather on 'world' ("), std::string::npos) << result.output;
  EXPECT_NE(result.output.find("): sent 8000 bytes of a 12000-byte buffer; theory (N-1)/N x buffer = 8000  ok; off the "
                               "machine 0 (theory 0), 2 messages (theory 2)"),
            std::string::npos)
      << result.output;
  EXPECT_NE(result.output.find("reduce_scatter on 'world' ("), std::string::npos) << result.output;
}

TEST_F(LaunchTest, EnvCommandReportsTheParsedLayout) {
  auto result =
      run({"launch", "--nproc-per-node", "2", "--master-port", "0", "--rank-prefix", "--", FSDP_CLI_PATH, "env"});
  ASSERT_EQ(result.exit_code, 0) << result.output;
  EXPECT_NE(result.output.find("[rank 1]: parsed:               launcher=torchrun rank=1 world_size=2"),
            std::string::npos)
      << result.output;
  // The version and ABI of the headers this test was compiled with, and the libtorch it was linked to.
  EXPECT_NE(result.output.find(std::string("libtorch version:     ") + TORCH_VERSION + "\n"), std::string::npos)
      << result.output;
  EXPECT_NE(result.output.find(std::string("libtorch CXX11 ABI:   ") + (_GLIBCXX_USE_CXX11_ABI ? "1" : "0")),
            std::string::npos)
      << result.output;
  EXPECT_NE(result.output.find("libtorch library:     /"), std::string::npos) << result.output;
  EXPECT_NE(result.output.find("libtorch_cpu.so"), std::string::npos) << result.output;
}

TEST_F(LaunchTest, ConfigFileSetsProcessCountsAndExportsFsdpVariables) {
  {
    std::ofstream config(path("accelerate.yaml"));
    config
        << "distributed_type: FSDP\nnum_processes: 3\nmixed_precision: bf16\nfsdp_config:\n"
           "  fsdp_version: 2\n  fsdp_reshard_after_forward: false\n  fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP\n"
           "  fsdp_transformer_layer_cls_to_wrap: Block\n";
  }
  // Each launched process resolves the plugin from what it was given.
  auto result = run({"launch", "--config-file", path("accelerate.yaml"), "--master-port", "0", "--rank-prefix",
                     "--fsdp-state-dict-type", "FULL_STATE_DICT", "--", FSDP_CLI_PATH, "config", "show"});
  ASSERT_EQ(result.exit_code, 0) << result.output;
  for (int rank = 0; rank < 3; ++rank) {
    const std::string prefix = "[rank " + std::to_string(rank) + "]: ";
    for (const std::string expected :
         {"\"value\": 2,", "\"value\": false,", "\"value\": \"FULL_STATE_DICT\",",
          "\"source\": \"environment variable FSDP_RESHARD_AFTER_FORWARD\"", "  \"Block\""}) {
      EXPECT_NE(result.output.find(prefix + "    " + expected), std::string::npos)
          << prefix << expected << " missing from:\n"
          << result.output;
    }
  }
  EXPECT_EQ(result.output.find("[rank 3]"), std::string::npos) << result.output;
}

TEST_F(LaunchTest, ConfigFileErrorsStopBeforeLaunching) {
  {
    std::ofstream config(path("typo.yaml"));
    config << "distributed_type: FSDP\nfsdp_config:\n  fsdp_backward_prefetch_policy: BACKWARD_PRE\n";
  }
  auto result = run({"launch", "--config-file", path("typo.yaml"), "--", "sh", "-c", "touch " + path("started")});
  EXPECT_EQ(result.exit_code, 1);
  EXPECT_NE(result.output.find("did you mean 'fsdp_backward_prefetch'?"), std::string::npos) << result.output;
  EXPECT_FALSE(fs::exists(path("started")));
}

TEST_F(LaunchTest, ToFsdp2Command) {
  {
    std::ofstream config(path("v1.yaml"));
    config << "distributed_type: FSDP\nfsdp_config:\n  fsdp_sharding_strategy: SHARD_GRAD_OP\n  fsdp_use_orig_params: "
              "true\n";
  }
  auto result = run({"to-fsdp2", "--config-file", path("v1.yaml")});
  EXPECT_EQ(result.exit_code, 1);
  EXPECT_NE(result.output.find("--output-file PATH, or --overwrite"), std::string::npos) << result.output;
  result = run({"to-fsdp2", "--config-file", path("v1.yaml"), "--output-file", path("v2.yaml")});
  ASSERT_EQ(result.exit_code, 0) << result.output;
  EXPECT_NE(result.output.find("fsdp_use_orig_params is not used by FSDP version 2; removed."), std::string::npos);
  const std::string converted = read(path("v2.yaml"));
  EXPECT_NE(converted.find("fsdp_reshard_after_forward: false"), std::string::npos) << converted;
  EXPECT_NE(converted.find("fsdp_version: 2"), std::string::npos) << converted;
  result = run({"to-fsdp2", "--config-file", path("v1.yaml"), "--output-file", path("v2.yaml")});
  EXPECT_NE(result.output.find("already exists; pass --overwrite"), std::string::npos) << result.output;
  result = run({"to-fsdp2", "--config-file", path("v1.yaml"), "--overwrite"});
  ASSERT_EQ(result.exit_code, 0) << result.output;
  EXPECT_EQ(read(path("v1.yaml")), converted);
  result = run({"to-fsdp2", "--config-file", path("missing.yaml"), "--overwrite"});
  EXPECT_NE(result.output.find("does not exist"), std::string::npos) << result.output;
}

}  // namespace
}  // namespace fsdp
