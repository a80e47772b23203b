// The fault test of `fsdp launch --max-restarts` (Note [restarting a failed job]): a train_llama run
// on 2 ranks with a checkpoint every 2 steps; in each seeded trial one rank, chosen at random, gets
// SIGKILL at a random moment (after a random number of logged steps, plus a random delay: inside a
// step, a save or between them). The launcher restarts the job, train_llama resumes from the latest
// complete checkpoint without being told, and the final weights equal, byte for byte, those of the
// same run without the kill; so with asynchronous checkpoints (--async-checkpoint, Note
// [asynchronous checkpoints]), whose run without a kill ends with the weights of the synchronous one.
// CI runs 2 trials of each; `FSDP_RESTART_TRIALS=20 ctest --test-dir build -R TrainLlamaRestart`
// runs 20 of each (README, "Failure behavior").
#include <gtest/gtest.h>

#include <csignal>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <random>
#include <thread>

#include "harness/file_bytes.h"
#include "harness/run_command.h"

namespace {

namespace fs = std::filesystem;
using fsdp::testing::run_command;

constexpr int kSteps = 8, kCheckpointEvery = 2;

int logged_steps(const fs::path& directory) {
  std::ifstream file(directory / "metrics.jsonl");
  int lines = 0;
  for (std::string line; std::getline(file, line);) ++lines;
  return lines;
}

// The pid of train_llama's rank `rank` writing into `directory`, or 0 while there is none.
pid_t rank_process(const fs::path& directory, int rank) {
  for (const auto& entry : fs::directory_iterator("/proc")) {
    const auto name = entry.path().filename().string();
    if (name.find_first_not_of("0123456789") != std::string::npos) continue;
    std::error_code error;
    if (fs::read_symlink(entry.path() / "exe", error).filename() != "train_llama") continue;
    if (fsdp::testing::file_bytes(entry.path() / "cmdline").find(directory.string()) == std::string::npos) continue;
    const auto environment = fsdp::testing::file_bytes(entry.path() / "environ");
    if (environment.find(std::string("RANK=") + std::to_string(rank) + '\0') == 0 ||
        environment.find(std::string("\0RANK=", 6) + std::to_string(rank) + '\0') != std::string::npos) {
      return static_cast<pid_t>(std::stol(name));
    }
  }
  return 0;
}

class TrainLlamaRestart : public ::testing::Test {
 protected:
  void SetUp() override {
    root_ = fs::temp_directory_path() / ("fsdp_train_llama_restart_" + std::to_string(::getpid()));
    fs::remove_all(root_);
    fs::create_directories(root_);
    std::ofstream train(root_ / "train.txt");
    for (int index = 0; index < 400; ++index) train << "Line " << index << ": a lost rank costs at most two steps. ";
  }
  void TearDown() override { fs::remove_all(root_); }

  std::string command(const fs::path& directory, bool async) const {
    return "timeout 240 " + std::string(FSDP_CLI_PATH) +
           " launch --nproc-per-node 2 --master-port 0 --max-restarts 3 " + "--termination-grace 1 -- " +
           FSDP_TRAIN_LLAMA_PATH + " --output-dir " + directory.string() + " --data " + (root_ / "train.txt").string() +
           " --steps " + std::to_string(kSteps) +
           " --seq-len 32 --global-batch-size 6 --eval-every 0 --eval-tokens 256 --sample-bytes 4 --warmup-steps 2 "
           "--checkpoint-every " +
           std::to_string(kCheckpointEvery) + " --total-limit 1" + (async ? " --async-checkpoint" : "");
  }

  fs::path root_;
};

TEST_F(TrainLlamaRestart, AKilledRankIsRestartedAndTheRunEndsWithTheWeightsOfOneWithoutTheKill) {
  const auto reference = root_ / "reference";
  auto result = run_command(command(reference, false));
  ASSERT_EQ(result.exit_code, 0) << result.output;
  EXPECT_EQ(result.output.find("Restarting"), std::string::npos) << result.output;
  const auto expected = fsdp::testing::file_bytes(reference / "final" / "model.safetensors");
  ASSERT_FALSE(expected.empty());
  // Asynchronous checkpoints change nothing of the training: the same weights, and the same
  // checkpoints (the last one, the only one --total-limit 1 keeps, loads to the same model).
  const auto reference_async = root_ / "reference_async";
  result = run_command(command(reference_async, true));
  ASSERT_EQ(result.exit_code, 0) << result.output;
  EXPECT_NE(result.output.find("asynchronous checkpoint " +
                               (reference_async / "checkpoints" / "checkpoint_0").string() + ": staged "),
            std::string::npos)
      << result.output;
  EXPECT_EQ(fsdp::testing::file_bytes(reference_async / "final" / "model.safetensors"), expected) << result.output;
  std::vector<std::string> kept;
  for (const auto& entry : fs::directory_iterator(reference_async / "checkpoints")) {
    kept.push_back(entry.path().filename().string());
  }
  EXPECT_EQ(kept, std::vector<std::string>{"checkpoint_3"}) << "--total-limit 1 keeps the last of the 4 checkpoints";
  EXPECT_TRUE(fs::exists(reference_async / "checkpoints" / "checkpoint_3" / "checkpoint_complete.json"));

  const char* trials_text = std::getenv("FSDP_RESTART_TRIALS");
  // Each trial count is of synchronous and of asynchronous checkpoints both.
  const int trials = 2 * (trials_text ? std::atoi(trials_text) : 2);
  int restarted = 0;
  for (int trial = 0; trial < trials; ++trial) {
    const bool async = trial % 2 == 1;
    std::mt19937 random(1000 + trial / 2);
    const int rank = static_cast<int>(random() % 2);
    const int after_steps = 1 + static_cast<int>(random() % (kSteps - 2));
    const auto delay = std::chrono::milliseconds(random() % 60);
    SCOPED_TRACE(std::string(async ? "asynchronous" : "synchronous") + " checkpoints, trial " +
                 std::to_string(trial / 2) + ": SIGKILL to rank " + std::to_string(rank) + " after " +
                 std::to_string(after_steps) + " logged steps and " + std::to_string(delay.count()) + " ms");
    const auto directory = root_ / ("trial_" + std::to_string(trial));
    fsdp::testing::CommandResult run;
    std::thread job([&] { run = run_command(command(directory, async)); });
    // The first round only: a restarted rank has the same command line, and it must not be killed.
    bool killed = false;
    for (auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(120);
         !killed && std::chrono::steady_clock::now() < deadline;) {
      if (logged_steps(directory) >= after_steps) {
        std::this_thread::sleep_for(delay);
        if (const pid_t pid = rank_process(directory, rank); pid > 0) killed = ::kill(pid, SIGKILL) == 0;
      }
      if (!killed) std::this_thread::sleep_for(std::chrono::milliseconds(2));
    }
    job.join();
    ASSERT_TRUE(killed) << run.output;
    ASSERT_EQ(run.exit_code, 0) << run.output;
    if (run.output.find("Restarting") == std::string::npos) {
      // The kill landed as the rank was exiting after the last step: nothing to restart.
      EXPECT_EQ(fsdp::testing::file_bytes(directory / "final" / "model.safetensors"), expected);
      continue;
    }
    EXPECT_NE(run.output.find("fsdp launch: rank " + std::to_string(rank) + " (local rank " + std::to_string(rank) +
                              ") failed first, with exit code 137 (SIGKILL)"),
              std::string::npos)
        << run.output;
    EXPECT_NE(run.output.find("Restarting all 2 local process(es): restart 1 of 3."), std::string::npos) << run.output;
    ++restarted;
    // Where it resumed: the latest complete checkpoint, at most a checkpoint interval (and the step
    // under way) behind the steps logged before the kill.
    const auto resumed = run.output.find("restart 1 of 3: resumed from ");
    if (resumed == std::string::npos) {
      EXPECT_NE(run.output.find("restart 1 of 3: no complete checkpoint in"), std::string::npos) << run.output;
      EXPECT_LE(after_steps, (async ? 2 : 1) * kCheckpointEvery) << run.output;
    } else {
      const auto at = run.output.find(" at step ", resumed);
      const int step = std::stoi(run.output.substr(at + 9));
      // An asynchronous checkpoint counts from the step after its files are written: one more
      // interval may be lost (Note [asynchronous checkpoints]).
      EXPECT_GE(step, after_steps - (async ? 2 : 1) * kCheckpointEvery - 1) << run.output;
      EXPECT_EQ(step % kCheckpointEvery, 0) << run.output;
    }
    EXPECT_EQ(fsdp::testing::file_bytes(directory / "final" / "model.safetensors"), expected)
        << "the final weights differ\n"
        << run.output;
    EXPECT_EQ(logged_steps(directory), kSteps) << "metrics.jsonl keeps one line a step";
  }
  // Kills land after 1 to 6 of the 8 steps: nearly every trial restarts, or the test proves little.
  std::cout << restarted << " of " << trials << " trials were restarted\n";
  EXPECT_GE(2 * restarted, trials) << "only " << restarted << " of " << trials << " kills led to a restart";
}

}  // namespace
