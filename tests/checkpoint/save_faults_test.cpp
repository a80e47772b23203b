// A save killed at each write, fsync and rename (Note [fault injection in saves]): train_llama on 2
// ranks saves checkpoint_0 after step 2; a resumed run saving checkpoint_1 after step 4 is killed
// (SIGKILL, one rank) just before the k-th operation of the atomic-file layer that belongs to that
// save. For each k: checkpoint_0 is byte for byte what it was, nothing outside checkpoint_1 changed
// but the run's own log, checkpoint_1 is taken only if its marker was written, and the run resumed
// from the latest complete checkpoint ends with the weights of a run never killed. CI tries a sample
// of k on each rank, synchronous and asynchronous; `FSDP_SAVE_FAULT_TRIALS=all ctest --test-dir build
// -R SaveFaults` tries every k that leaves the directory in another state: each file's first and last
// write, its fsync and rename, and each directory fsync (README, "Failure behavior").
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <map>
#include <set>
#include <sstream>

#include "harness/file_bytes.h"
#include "harness/run_command.h"

namespace {

namespace fs = std::filesystem;
using fsdp::testing::run_command;

// Every regular file under `directory`, by relative path, with its bytes; `skip` relative paths
// (and everything under them) are left out.
std::map<std::string, std::string> files_under(const fs::path& directory, const std::set<std::string>& skip) {
  std::map<std::string, std::string> files;
  if (!fs::exists(directory)) return files;
  for (auto it = fs::recursive_directory_iterator(directory); it != fs::recursive_directory_iterator(); ++it) {
    const auto relative = fs::relative(it->path(), directory).string();
    if (skip.count(relative)) {
      if (it->is_directory()) it.disable_recursion_pending();
      continue;
    }
    if (it->is_regular_file()) files[relative] = fsdp::testing::file_bytes(it->path());
  }
  return files;
}

// One line of FSDP_TEST_FAULT_LOG: "<rank> <k> <operation> <file>".
struct FaultPoint {
  int rank = 0;
  long long number = 0;
  std::string operation, file;
};

std::vector<FaultPoint> read_fault_log(const fs::path& path) {
  std::vector<FaultPoint> points;
  std::ifstream file(path);
  for (std::string line; std::getline(file, line);) {
    std::istringstream fields(line);
    FaultPoint point;
    fields >> point.rank >> point.number >> point.operation;
    std::getline(fields >> std::ws, point.file);
    points.push_back(point);
  }
  return points;
}

class SaveFaults : public ::testing::Test {
 protected:
  void SetUp() override {
    root_ = fs::temp_directory_path() / ("fsdp_save_faults_" + std::to_string(::getpid()));
    fs::remove_all(root_);
    fs::create_directories(root_);
    std::ofstream train(root_ / "train.txt");
    for (int index = 0; index < 400; ++index) train << "Line " << index << ": a save cut short never counts. ";
  }
  void TearDown() override { fs::remove_all(root_); }

  std::string command(const fs::path& directory, int steps, bool resume, bool async,
                      const std::string& environment) const {
    return "env " + environment + " timeout 240 " + std::string(FSDP_CLI_PATH) +
           " launch --nproc-per-node 2 --master-port 0 --termination-grace 1 -- /usr/bin/env LD_PRELOAD=" +
           FSDP_SAVE_FAULT_POINTS_PATH + " " + FSDP_TRAIN_LLAMA_PATH + " --output-dir " + directory.string() +
           " --data " + (root_ / "train.txt").string() + " --steps " + std::to_string(steps) +
           " --seq-len 32 --global-batch-size 6 --eval-every 0 --eval-tokens 256 --sample-bytes 4 --warmup-steps 2 "
           "--checkpoint-every 2 --total-limit 0" +
           (resume ? " --resume-from latest" : "") + (async ? " --async-checkpoint" : "");
  }

  fs::path root_;
};

TEST_F(SaveFaults, AKillAtAnyWriteFsyncOrRenameOfASaveLeavesThePreviousCheckpointTheLatest) {
  // The run never killed; each trial starts from its state after step 2 (checkpoint_0 complete;
  // what the run writes later taken away).
  auto result = run_command(command(root_ / "reference", 4, false, false, ""));
  ASSERT_EQ(result.exit_code, 0) << result.output;
  const auto expected = fsdp::testing::file_bytes(root_ / "reference" / "final" / "model.safetensors");
  ASSERT_FALSE(expected.empty());
  const auto prefix = root_ / "prefix";
  fs::copy(root_ / "reference", prefix, fs::copy_options::recursive);
  for (const auto* later : {"checkpoints/checkpoint_1", "final", "loss.svg"}) fs::remove_all(prefix / later);
  ASSERT_TRUE(fs::exists(prefix / "checkpoints" / "checkpoint_0" / "checkpoint_complete.json")) << result.output;
  const auto before = files_under(prefix, {});

  const char* trials_text = std::getenv("FSDP_SAVE_FAULT_TRIALS");
  const bool every_point = trials_text != nullptr && std::string(trials_text) == "all";
  int trial = 0, taken = 0;
  for (const bool async : {false, true}) {
    // Which operations belong to checkpoint_1's save, on each rank: a run that counts them.
    const auto counted = root_ / (async ? "counted_async" : "counted");
    fs::copy(prefix, counted, fs::copy_options::recursive);
    result = run_command(command(counted, 4, true, async, "FSDP_TEST_FAULT_LOG=" + (root_ / "faults.log").string()));
    ASSERT_EQ(result.exit_code, 0) << result.output;
    ASSERT_EQ(fsdp::testing::file_bytes(counted / "final" / "model.safetensors"), expected) << result.output;
    std::map<int, std::vector<FaultPoint>> save_points;
    for (const auto& point : read_fault_log(root_ / "faults.log")) {
      if (point.file.find("/checkpoints/checkpoint_1") != std::string::npos) save_points[point.rank].push_back(point);
    }
    fs::remove(root_ / "faults.log");
    ASSERT_EQ(save_points.size(), 2u) << "every rank writes its part of the save";
    for (auto& [rank, points] : save_points) {
      std::cout << (async ? "asynchronous" : "synchronous") << " save, rank " << rank << ": " << points.size()
                << " writes, fsyncs and renames\n";
      // Between two writes of one file the directory is in the same state (that file partly
      // written under its temporary name), so every distinct state of a kill is met by killing
      // before each file's first and last write, its fsync and rename, and each directory fsync.
      std::vector<FaultPoint> boundaries;
      for (size_t index = 0; index < points.size(); ++index) {
        const auto& point = points[index];
        const bool write = point.operation == "write";
        const bool first_write =
            write && (index == 0 || points[index - 1].operation != "write" || points[index - 1].file != point.file);
        const bool last_write = write && (index + 1 == points.size() || points[index + 1].operation != "write" ||
                                          points[index + 1].file != point.file);
        if (!write || first_write || last_write) boundaries.push_back(point);
      }
      std::vector<FaultPoint> chosen;
      if (every_point) {
        chosen = boundaries;
      } else {
        // CI's sample: on rank 0 the first rename (synchronous saves) or one from the middle
        // (asynchronous) and the last operation, the fsync of the directory after the marker's
        // rename (the checkpoint is then complete and must be taken); on rank 1 its first write.
        auto first_rename = std::find_if(boundaries.begin(), boundaries.end(),
                                         [](const FaultPoint& p) { return p.operation == "rename"; });
        if (rank == 0) {
          if (!async && first_rename != boundaries.end()) chosen.push_back(*first_rename);
          if (async) chosen.push_back(boundaries[boundaries.size() / 2]);
          chosen.push_back(boundaries.back());
        } else {
          chosen.push_back(boundaries.front());
        }
      }
      std::cout << "  " << boundaries.size() << " distinct states to kill in; trying " << chosen.size() << "\n";
      for (const auto& point : chosen) {
        SCOPED_TRACE(std::string(async ? "asynchronous" : "synchronous") + " save: rank " + std::to_string(rank) +
                     " killed before operation " + std::to_string(point.number) + " (" + point.operation + " " +
                     point.file + ")");
        const auto directory = root_ / ("trial_" + std::to_string(trial++));
        fs::copy(prefix, directory, fs::copy_options::recursive);
        result = run_command(command(directory, 4, true, async,
                                     "FSDP_TEST_FAULT_KILL_AT=" + std::to_string(point.number) +
                                         " FSDP_TEST_FAULT_KILL_RANK=" + std::to_string(rank)));
        ASSERT_EQ(result.exit_code, 137) << result.output;
        ASSERT_NE(result.output.find("rank " + std::to_string(rank) + " (local rank " + std::to_string(rank) +
                                     ") failed first, with exit code 137 (SIGKILL)"),
                  std::string::npos)
            << result.output;
        // Nothing but the new checkpoint and the run's own log changed.
        const auto after = files_under(directory, {"checkpoints/checkpoint_1", "metrics.jsonl"});
        auto unchanged = before;
        unchanged.erase("metrics.jsonl");
        EXPECT_EQ(after.size(), unchanged.size());
        for (const auto& [name, bytes] : unchanged) {
          EXPECT_TRUE(after.count(name) && after.at(name) == bytes) << name << " changed";
        }
        const bool complete = fs::exists(directory / "checkpoints" / "checkpoint_1" / "checkpoint_complete.json");
        taken += complete;
        // The latest complete checkpoint loads and the run ends with the weights of one never killed.
        result = run_command(command(directory, 4, true, async, ""));
        ASSERT_EQ(result.exit_code, 0) << result.output;
        const auto latest = (directory / "checkpoints" / (complete ? "checkpoint_1" : "checkpoint_0")).string();
        EXPECT_NE(result.output.find("resumed from " + latest + " at step " + (complete ? "4" : "2")),
                  std::string::npos)
            << result.output;
        EXPECT_EQ(fsdp::testing::file_bytes(directory / "final" / "model.safetensors"), expected)
            << "the final weights differ\n"
            << result.output;
        fs::remove_all(directory);
      }
    }
  }
  std::cout << trial << " kills; after " << taken << " of them the new checkpoint was complete\n";
}

}  // namespace
