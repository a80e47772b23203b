// The main job end to end: train on 2 ranks, stop at a checkpoint, resume, finish; merge; evaluate
// the merged weights in one process; the same run on 1 and 3 ranks.
#include <gtest/gtest.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <regex>
#include <sstream>
#include <tuple>

#include "harness/python_peer.h"
#include "harness/run_command.h"

namespace {

namespace fs = std::filesystem;

using fsdp::testing::run_command;

std::vector<nlohmann::json> metrics_of(const std::string& directory) {
  std::vector<nlohmann::json> lines;
  std::ifstream file(directory + "/metrics.jsonl");
  std::string line;
  while (std::getline(file, line)) lines.push_back(nlohmann::json::parse(line));
  return lines;
}

double reported_eval_loss(const std::string& output) {
  const auto position = output.rfind("eval_loss=");
  return position == std::string::npos ? -1 : std::stod(output.substr(position + 10));
}

class TrainLlama : public ::testing::Test {
 protected:
  void SetUp() override {
    root_ = fs::temp_directory_path() / ("fsdp_train_llama_" + std::to_string(::getpid()));
    fs::remove_all(root_);
    fs::create_directories(root_);
    // A small deterministic text, so the test needs nothing from the machine.
    std::ofstream train(root_ / "train.txt");
    std::ofstream eval(root_ / "eval.txt");
    for (int index = 0; index < 400; ++index) {
      train << "Line " << index << ": every rank keeps one shard of each parameter and gathers the rest. ";
      if (index % 4 == 0) eval << "Evaluation " << index << " checks the merged weights against the training run. ";
    }
  }
  void TearDown() override { fs::remove_all(root_); }

  std::string train_command(int ranks, const std::string& directory, const std::string& extra) const {
    return std::string(FSDP_CLI_PATH) + " launch --nproc-per-node " + std::to_string(ranks) + " --master-port 0 -- " +
           FSDP_TRAIN_LLAMA_PATH + " --output-dir " + directory + " --data " + (root_ / "train.txt").string() +
           " --eval-data " + (root_ / "eval.txt").string() +
           " --steps 6 --seq-len 32 --global-batch-size 6 --eval-every 3 --eval-tokens 2048 --sample-bytes 16 " +
           "--warmup-steps 2 " + extra;
  }

  fs::path root_;
};

TEST_F(TrainLlama, ResumesExactlyMergesAndAgreesAcrossWorldSizes) {
  const auto uninterrupted = (root_ / "uninterrupted").string();
  auto result = run_command(train_command(2, uninterrupted, ""));
  ASSERT_EQ(result.exit_code, 0) << result.output;
  const auto reference = metrics_of(uninterrupted);
  ASSERT_EQ(reference.size(), 6u);
  EXPECT_LT(reference.back()["loss"].get<double>(), reference.front()["loss"].get<double>()) << "it must learn";
  for (const char* field : {"step", "loss", "lr", "tokens_per_s", "peak_rss_mb"})
    EXPECT_TRUE(reference[0].contains(field));
  const double trained_eval = reported_eval_loss(result.output);
  ASSERT_GT(trained_eval, 0) << result.output;
  for (const char* file : {"loss.svg", "final/model.safetensors", "final/config.json", "final/sample.txt"}) {
    EXPECT_TRUE(fs::exists(fs::path(uninterrupted) / file)) << file;
  }
  std::ifstream config_file(uninterrupted + "/final/config.json");
  const auto config = nlohmann::json::parse(config_file);
  for (const char* key : {"architectures", "model_type", "vocab_size", "hidden_size", "intermediate_size",
                          "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "max_position_embeddings",
                          "rms_norm_eps", "rope_theta", "tie_word_embeddings", "hidden_act", "torch_dtype"}) {
    EXPECT_TRUE(config.contains(key)) << key;
  }
  EXPECT_EQ(config["architectures"][0], "LlamaForCausalLM");

  // Stop at step 3 with a checkpoint, then resume: the same losses as the uninterrupted run.
  const auto resumed = (root_ / "resumed").string();
  result = run_command(train_command(2, resumed, "--stop-after 3"));
  ASSERT_EQ(result.exit_code, 0) << result.output;
  EXPECT_EQ(metrics_of(resumed).size(), 3u);
  result = run_command(train_command(2, resumed, "--resume-from latest"));
  ASSERT_EQ(result.exit_code, 0) << result.output;
  EXPECT_NE(result.output.find("resumed from"), std::string::npos) << result.output;
  const auto continued = metrics_of(resumed);
  ASSERT_EQ(continued.size(), 6u);
  for (size_t step = 0; step < continued.size(); ++step) {
    EXPECT_EQ(continued[step]["loss"].get<double>(), reference[step]["loss"].get<double>()) << "step " << step + 1;
  }

  // Merge the last checkpoint and evaluate it in one process: the eval loss the run reported.
  std::string latest;
  for (const auto& item : fs::directory_iterator(resumed + "/checkpoints")) {
    if (latest.empty() || item.path().string() > latest) latest = item.path().string();
  }
  result = run_command(std::string(FSDP_CLI_PATH) + " merge-weights " + latest + "/pytorch_model_fsdp_0 " + resumed +
                       "/merged");
  ASSERT_EQ(result.exit_code, 0) << result.output;
  fs::copy_file(resumed + "/final/config.json", resumed + "/merged/config.json");
  result = run_command(std::string(FSDP_TRAIN_LLAMA_PATH) + " --eval-only --init-from " + resumed + "/merged --data " +
                       (root_ / "eval.txt").string() + " --seq-len 32 --eval-tokens 2048");
  ASSERT_EQ(result.exit_code, 0) << result.output;
  EXPECT_NEAR(reported_eval_loss(result.output), trained_eval, 1e-5 * trained_eval) << result.output;

  // The same global batch on 1 and 3 ranks: the same losses.
  for (int ranks : {1, 3}) {
    const auto directory = (root_ / ("ranks" + std::to_string(ranks))).string();
    result = run_command(train_command(ranks, directory, ""));
    ASSERT_EQ(result.exit_code, 0) << result.output;
    const auto losses = metrics_of(directory);
    ASSERT_EQ(losses.size(), reference.size());
    for (size_t step = 0; step < losses.size(); ++step) {
      const double expected = reference[step]["loss"].get<double>();
      EXPECT_NEAR(losses[step]["loss"].get<double>(), expected, 1e-5 * expected)
          << ranks << " ranks, step " << step + 1;
    }
  }
}

// A run PyTorch trained and Accelerate saved resumes in train_llama: tests/python/llama_resume.py
// trains transformers' Llama with FSDP2 on 2 ranks exactly as train_llama would (the same batches,
// schedule, clipping and AdamW), saves with Accelerate's own functions into
// checkpoints/checkpoint_0 after step 3 and goes on to step 6; `train_llama --resume-from latest`
// finds that checkpoint, continues from step 3 and reports PyTorch's losses for steps 4 to 6.
TEST_F(TrainLlama, ResumesFromAnAccelerateCheckpointWithPyTorchsLosses) {
  fsdp::testing::PythonOptions options;
  options.world_size = 2;
  options.timeout = std::chrono::seconds(240);
  ASSERT_TRUE(fsdp::testing::run_python("llama_resume.py", {root_.string(), "3", "3"}, options).ok);
  nlohmann::json expected;
  std::ifstream(root_ / "losses.json") >> expected;
  const auto run = (root_ / "run").string();
  const auto result = run_command(
      std::string(FSDP_CLI_PATH) + " launch --nproc-per-node 2 --master-port 0 -- " + FSDP_TRAIN_LLAMA_PATH +
      " --output-dir " + run + " --resume-from latest --init-from " + (root_ / "init").string() + " --data " +
      (root_ / "train.txt").string() + " --eval-data " + (root_ / "eval.txt").string() +
      " --steps 6 --seq-len 32 --global-batch-size 4 --micro-batch-size 1 --lr 3e-3 --min-lr 3e-4 --warmup-steps 2 "
      "--weight-decay 0.1 --max-grad-norm 1.0 --seed 1234 --eval-every 0 --eval-tokens 256 --sample-bytes 8");
  ASSERT_EQ(result.exit_code, 0) << result.output;
  EXPECT_NE(result.output.find("was written by Accelerate; resumed at optimizer step 3"), std::string::npos)
      << result.output;
  EXPECT_NE(result.output.find("resumed from " + run + "/checkpoints/checkpoint_0 at step 3"), std::string::npos)
      << result.output;
  const auto metrics = metrics_of(run);
  ASSERT_EQ(metrics.size(), 3u) << result.output;
  for (const auto& line : metrics) {
    const auto step = std::to_string(line["step"].get<int64_t>());
    ASSERT_TRUE(expected["resumed"].contains(step)) << line.dump();
    EXPECT_NEAR(line["loss"].get<double>(), expected["resumed"][step].get<double>(), 1e-5) << "step " << step;
  }
}

// Ranks started with other flags or other data (issue Reliability: another --seed trained to the end
// with a wrong result and exit 0; a data file of another size waited for the collective timeout)
// stop at once with one error naming each difference and each rank's value.
// --meta-init (always on for --preset large): every rank builds the model on the meta device and
// fully_shard initializes one unit at a time; the run trains as the default one does.
TEST_F(TrainLlama, MetaInitBuildsOnTheMetaDeviceOnEveryRankTrainsAndStreamsPretrainedWeights) {
  const auto directory = (root_ / "meta").string();
  auto result = run_command(train_command(2, directory, "--meta-init"));
  ASSERT_EQ(result.exit_code, 0) << result.output;
  const auto metrics = metrics_of(directory);
  ASSERT_EQ(metrics.size(), 6u);
  EXPECT_LT(metrics.back()["loss"].get<double>(), metrics.front()["loss"].get<double>()) << "it must learn";
  // The same seed gives the same initial model on every run: meta initialization is reproducible.
  const auto again = (root_ / "meta_again").string();
  result = run_command(train_command(2, again, "--meta-init --stop-after 1"));
  ASSERT_EQ(result.exit_code, 0) << result.output;
  EXPECT_EQ(metrics_of(again).at(0)["loss"].get<double>(), metrics.front()["loss"].get<double>());

  // --init-from with --meta-init: rank 0 streams the weights one tensor at a time into the sharded
  // model; the first loss is the one the default path (rank 0 loads the whole model) gives.
  const auto streamed = (root_ / "streamed").string(), whole = (root_ / "whole").string();
  const std::string init = " --init-from " + directory + "/final --stop-after 1";
  result = run_command(train_command(2, streamed, "--meta-init" + init));
  ASSERT_EQ(result.exit_code, 0) << result.output;
  result = run_command(train_command(2, whole, init));
  ASSERT_EQ(result.exit_code, 0) << result.output;
  EXPECT_EQ(metrics_of(streamed).at(0)["loss"].get<double>(), metrics_of(whole).at(0)["loss"].get<double>());
  EXPECT_LT(metrics_of(streamed).at(0)["loss"].get<double>(), metrics.front()["loss"].get<double>())
      << "trained weights";
  // Weights of another shape than config.json says are named, not loaded.
  fs::copy(directory + "/final", root_ / "other_shape");
  nlohmann::json other;
  std::ifstream(root_ / "other_shape" / "config.json") >> other;
  other["intermediate_size"] = other["intermediate_size"].get<int64_t>() + 8;
  std::ofstream(root_ / "other_shape" / "config.json") << other.dump();
  result = run_command(train_command(2, (root_ / "other").string(),
                                     "--meta-init --stop-after 1 --init-from " + (root_ / "other_shape").string()));
  EXPECT_NE(result.exit_code, 0) << result.output;
  EXPECT_NE(result.output.find("mlp.gate_proj.weight"), std::string::npos) << result.output;
}

TEST_F(TrainLlama, RanksStartedWithOtherFlagsOrDataAreANamedError) {
  {
    std::ofstream other(root_ / "other.txt");
    for (int index = 0; index < 300; ++index) other << "Another text " << index << " that only rank 1 reads. ";
  }
  const auto command = std::string(FSDP_CLI_PATH) + " launch --nproc-per-node 2 --master-port 0 -- sh -c '" +
                       "if [ \"$RANK\" = 1 ]; then data=" + (root_ / "other.txt").string() +
                       "; else data=" + (root_ / "train.txt").string() + "; fi; exec " + FSDP_TRAIN_LLAMA_PATH +
                       " --output-dir " + (root_ / "disagree").string() +
                       " --data $data --steps $((4 + RANK)) --seq-len 32" +
                       " --global-batch-size 4 --eval-every 0 --sample-bytes 8'";
  const auto result = run_command(command);
  EXPECT_NE(result.exit_code, 0) << result.output;
  EXPECT_NE(result.output.find("train_llama's settings: the ranks disagree: '--steps' is 4 on rank 0 and 5 on rank 1"),
            std::string::npos)
      << result.output;
  EXPECT_NE(result.output.find("'training text' is"), std::string::npos) << result.output;
  EXPECT_NE(result.output.find("Start every rank with the same flags"), std::string::npos) << result.output;
  EXPECT_EQ(result.output.find("EnforceNotMet"), std::string::npos) << result.output;
}

// A NaN or infinite loss or gradient norm stops the run before the optimizer step, naming the step
// (it used to train on to the end with NaN weights and exit 0, issue Reliability);
// --skip-nonfinite-steps skips such steps instead. An absurd learning rate gets there in two steps.
TEST_F(TrainLlama, ANonFiniteLossStopsTheRunNamingTheStep) {
  const auto directory = (root_ / "nan").string();
  auto result = run_command(train_command(2, directory, "--lr 1e30 --checkpoint-every 1"));
  EXPECT_NE(result.exit_code, 0) << result.output;
  const std::regex stopped(
      "step ([0-9]+): the training loss is [^ ]+ and the gradient norm [^ ;]+; training stopped "
      "before this optimizer step, so the weights are those of step ([0-9]+)");
  std::smatch match;
  ASSERT_TRUE(std::regex_search(result.output, match, stopped)) << result.output;
  const int step = std::stoi(match[1].str());
  EXPECT_EQ(std::stoi(match[2].str()), step - 1);
  EXPECT_NE(result.output.find("--skip-nonfinite-steps"), std::string::npos) << result.output;
  // The checkpoints before it are complete; none is written for the failed step.
  EXPECT_TRUE(fs::exists(fs::path(directory) / "checkpoints" / ("checkpoint_" + std::to_string(step - 2)) /
                         "checkpoint_complete.json"));
  EXPECT_FALSE(fs::exists(fs::path(directory) / "checkpoints" / ("checkpoint_" + std::to_string(step - 1))));

  result = run_command(train_command(2, (root_ / "skip").string(), "--lr 1e30 --skip-nonfinite-steps"));
  EXPECT_EQ(result.exit_code, 0) << result.output;
  EXPECT_NE(result.output.find("the optimizer step is skipped (--skip-nonfinite-steps)"), std::string::npos)
      << result.output;
}

// Each flag the issue found aborting in Gloo (--preset, --checkpoint-every), waiting for the
// timeout (--seq-len) or training to a wrong result with exit 0 (--seed, --global-batch-size) when
// one rank had another value is named with both values before any data collective.
TEST_F(TrainLlama, EachFlagOneRankHasOtherwiseIsNamed) {
  for (const auto& [flag, rank0, rank1] :
       std::vector<std::tuple<std::string, std::string, std::string>>{{"--preset", "tiny", "small"},
                                                                      {"--checkpoint-every", "2", "3"},
                                                                      {"--seq-len", "32", "64"},
                                                                      {"--seed", "1", "2"},
                                                                      {"--global-batch-size", "4", "8"}}) {
    const auto command = std::string(FSDP_CLI_PATH) + " launch --nproc-per-node 2 --master-port 0 -- sh -c '" +
                         "if [ \"$RANK\" = 1 ]; then value=" + rank1 + "; else value=" + rank0 + "; fi; exec " +
                         FSDP_TRAIN_LLAMA_PATH + " --output-dir " + (root_ / "flags").string() + " --data " +
                         (root_ / "train.txt").string() + " --steps 4 --eval-every 0 --sample-bytes 8 " + flag +
                         " $value'";
    const auto result = run_command(command);
    EXPECT_NE(result.exit_code, 0) << flag << ": " << result.output;
    EXPECT_NE(result.output.find("the ranks disagree: '" + flag + "' is "), std::string::npos)
        << flag << ": " << result.output;
    EXPECT_NE(result.output.find(rank0 + " on rank 0"), std::string::npos) << flag << ": " << result.output;
    EXPECT_NE(result.output.find(rank1 + " on rank 1"), std::string::npos) << flag << ": " << result.output;
    EXPECT_EQ(result.output.find("EnforceNotMet"), std::string::npos) << flag << ": " << result.output;
  }
  // A flag without a value, given on one rank only.
  const auto result =
      run_command(std::string(FSDP_CLI_PATH) + " launch --nproc-per-node 2 --master-port 0 -- sh -c '" +
                  "if [ \"$RANK\" = 1 ]; then extra=--meta-init; fi; exec " + FSDP_TRAIN_LLAMA_PATH + " --output-dir " +
                  (root_ / "flags").string() + " --data " + (root_ / "train.txt").string() +
                  " --steps 4 --eval-every 0 --sample-bytes 8 $extra'");
  EXPECT_NE(result.output.find("the ranks disagree: '--meta-init' is false on rank 0 and true on rank 1"),
            std::string::npos)
      << result.output;
}

TEST_F(TrainLlama, BadFlagsAreErrors) {
  auto result =
      run_command(std::string(FSDP_TRAIN_LLAMA_PATH) + " --preset enormous --output-dir " + (root_ / "x").string());
  EXPECT_EQ(result.exit_code, 2) << result.output;
  EXPECT_NE(
      result.output.find(
          "unknown model preset 'enormous'; choose tiny, small, medium, large, llama3-1b, llama3-8b or llama3-70b"),
      std::string::npos)
      << result.output;
  result = run_command(std::string(FSDP_TRAIN_LLAMA_PATH) + " --eval-only");
  EXPECT_EQ(result.exit_code, 1);
  EXPECT_NE(result.output.find("--eval-only needs --init-from"), std::string::npos) << result.output;
  EXPECT_EQ(run_command(std::string(FSDP_TRAIN_LLAMA_PATH) + " --no-such-flag").exit_code, 2);
  // Nonsense values are errors naming the flag and the value (they used to run, issue Reliability).
  for (const auto& [flags, expected] : std::vector<std::pair<std::string, std::string>>{
           {"--steps 0", "--steps: must be positive, got 0"},
           {"--steps -5", "--steps: must be positive, got -5"},
           {"--seq-len 0", "--seq-len: must be positive, got 0"},
           {"--checkpoint-every -1", "--checkpoint-every: must be 0 or positive, got -1"},
           {"--warmup-steps -3", "--warmup-steps: must be 0 or positive, got -3"},
           {"--eval-every -1", "--eval-every: must be 0 or positive, got -1"},
           {"--micro-batch-size -2", "--micro-batch-size: must be 0 or positive, got -2"},
           {"--lr nan", "--lr: must be positive, got nan"},
           {"--global-batch-size x", "--global-batch-size: expected a number, got 'x'"}}) {
    result = run_command(std::string(FSDP_TRAIN_LLAMA_PATH) + " " + flags + " --output-dir " + (root_ / "y").string());
    EXPECT_EQ(result.exit_code, 2) << flags << ": " << result.output;
    EXPECT_NE(result.output.find(expected), std::string::npos) << flags << ": " << result.output;
  }
  EXPECT_FALSE(std::filesystem::exists(root_ / "y")) << "a refused run writes nothing";
  // A directory as --data used to say it "has 0 bytes".
  result = run_command(std::string(FSDP_TRAIN_LLAMA_PATH) + " --data " + root_.string() + " --output-dir " +
                       (root_ / "z").string());
  EXPECT_EQ(result.exit_code, 1) << result.output;
  EXPECT_NE(result.output.find("data file '" + root_.string() +
                               "' is a directory; --data and --eval-data take one text file"),
            std::string::npos)
      << result.output;
}

}  // namespace
