// fsdp.cpp's Llama against transformers' LlamaForCausalLM, both directions
// (tests/python/llama_transformers.py is the Python half):
//  - a model our Accelerator saves (model.safetensors + config.json) loads with from_pretrained, every
//    weight taken, and gives our logits within 1e-5 (fp32): tied and untied embeddings, GQA and MHA;
//  - a model transformers creates and saves (one file, and sharded with an index) loads with
//    `train_llama --init-from` and `--eval-only` prints the loss transformers computes on the same bytes.
// The configurations use a rope_theta and an rms_norm_eps far from the defaults, and random norm
// weights, so that a field or a weight read wrongly changes the numbers.
#include <fsdp/fsdp.h>
#include <fsdp/models/llama.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cstdio>
#include <filesystem>
#include <fstream>

#include "harness/python_peer.h"
#include "harness/run_command.h"

namespace fsdp {
namespace {

namespace fs = std::filesystem;
using models::LlamaConfig;
using models::LlamaForCausalLM;

class LlamaTransformers : public ::testing::Test {
 protected:
  void SetUp() override {
    root_ = fs::temp_directory_path() / ("fsdp_llama_transformers_" + std::to_string(::getpid()));
    fs::remove_all(root_);
    fs::create_directories(root_);
  }
  void TearDown() override { fs::remove_all(root_); }
  std::string path(const std::string& name) const { return (root_ / name).string(); }
  fs::path root_;
};

void expect_transformers_logits(const std::string& directory, const LlamaConfig& config) {
  auto context = DistributedContext::initialize(DistributedEnvironment{});
  torch::manual_seed(99);
  LlamaForCausalLM model(config);
  {
    torch::NoGradGuard no_grad;
    for (auto& item : model->named_parameters()) {
      if (item.key().find("norm.weight") != std::string::npos) item.value().uniform_(0.5, 1.5);
    }
  }
  AcceleratorOptions options;
  FullyShardedDataParallelPluginArgs args;
  args.fsdp_version = int64_t{2};
  options.fsdp_plugin = FullyShardedDataParallelPlugin(args, EnvironmentMap{});
  Accelerator accelerator(context, options, EnvironmentMap{});
  torch::optim::AdamW optimizer(model->parameters());
  accelerator.prepare(model, optimizer);
  accelerator.save_model(directory + "/model");
  {
    std::ofstream file(directory + "/model/config.json");
    file << config.to_json();
  }
  torch::manual_seed(5);
  const auto input_ids = torch::randint(0, config.vocab_size, {2, 24}, torch::kLong);
  torch::Tensor logits;
  {
    torch::NoGradGuard no_grad;
    logits = fsdp::forward(model, input_ids).contiguous();
  }
  write_safetensors(directory + "/inputs.safetensors", {{"input_ids", input_ids}, {"logits", logits}});
  const auto python =
      testing::run_python("llama_transformers.py", {"logits", directory + "/model", directory + "/inputs.safetensors"});
  ASSERT_TRUE(python.ok);
  EXPECT_NE(python.output[0].find("max_abs_diff="), std::string::npos) << python.output[0];
  std::printf("%s", python.output[0].c_str());
}

LlamaConfig crosscheck_config(bool tied, int64_t kv_heads) {
  LlamaConfig config;
  config.vocab_size = 256;
  config.hidden_size = 64;
  config.intermediate_size = 96;
  config.num_hidden_layers = 2;
  config.num_attention_heads = 4;
  config.num_key_value_heads = kv_heads;
  config.max_position_embeddings = 256;
  config.rms_norm_eps = 1e-3;
  config.rope_theta = 777.0;
  config.tie_word_embeddings = tied;
  return config;
}

TEST_F(LlamaTransformers, OurTiedGqaModelLoadsInTransformersWithTheSameLogits) {
  expect_transformers_logits(root_.string(), crosscheck_config(true, 2));
}

TEST_F(LlamaTransformers, OurUntiedModelsLoadInTransformersWithTheSameLogits) {
  fs::create_directories(root_ / "mqa");
  fs::create_directories(root_ / "mha");
  expect_transformers_logits((root_ / "mqa").string(), crosscheck_config(false, 1));
  expect_transformers_logits((root_ / "mha").string(), crosscheck_config(false, 4));
}

double value_after(const std::string& text, const std::string& key) {
  const auto position = text.rfind(key);
  return position == std::string::npos ? -1.0 : std::stod(text.substr(position + key.size()));
}

void expect_train_llama_loss(const fs::path& root, bool tied, int kv_heads, bool sharded) {
  const auto data = (root / "data.txt").string();
  {
    std::ofstream file(data);
    for (int index = 0; index < 60; ++index) file << "Sentence " << index << " is read by both sides, byte by byte. ";
  }
  const auto model = (root / "model").string();
  const auto python = testing::run_python(
      "llama_transformers.py",
      {"make", model, tied ? "1" : "0", std::to_string(kv_heads), sharded ? "1" : "0", data, "32", "2000"});
  ASSERT_TRUE(python.ok);
  const double expected = value_after(python.output[0], "transformers_loss=");
  ASSERT_GT(expected, 0) << python.output[0];
  EXPECT_EQ(fs::exists(root / "model" / "model.safetensors.index.json"), sharded);
  const auto ours = testing::run_command(std::string(FSDP_TRAIN_LLAMA_PATH) + " --eval-only --init-from " + model +
                                         " --data " + data + " --seq-len 32 --eval-tokens 2000");
  ASSERT_EQ(ours.exit_code, 0) << ours.output;
  const double loss = value_after(ours.output, "eval_loss=");
  // train_llama prints 6 decimals; fp32 logits agree to about 1e-6 relative.
  EXPECT_NEAR(loss, expected, 1e-5 * expected + 1e-6) << ours.output << "\n" << python.output[0];
  std::printf("transformers %.8f, train_llama %.6f\n", expected, loss);
}

TEST_F(LlamaTransformers, TransformersModelLoadsInTrainLlamaWithTheSameLoss) {
  expect_train_llama_loss(root_, /*tied=*/false, /*kv_heads=*/2, /*sharded=*/false);
}

TEST_F(LlamaTransformers, ShardedTransformersModelLoadsInTrainLlamaWithTheSameLoss) {
  expect_train_llama_loss(root_, /*tied=*/true, /*kv_heads=*/1, /*sharded=*/true);
}

// What the model does not compute is an error naming the field, never ignored; the config.json
// transformers 5 writes is accepted (the tests above load it).
TEST(LlamaConfig, UnsupportedConfigFieldsAreErrorsNamingThem) {
  const std::string base = R"({"model_type": "llama", "vocab_size": 256, "hidden_size": 64, "intermediate_size": 96, )"
                           R"("num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2)";
  const std::vector<std::pair<std::string, std::string>> cases = {
      {R"("rope_scaling": {"rope_type": "llama3", "factor": 8.0})", "sets rope_scaling"},
      {R"("rope_parameters": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0})",
       "uses rope_type \"linear\""},
      {R"("attention_bias": true)", "enables attention_bias or mlp_bias"},
      {R"("mlp_bias": true)", "enables attention_bias or mlp_bias"},
      {R"("head_dim": 32)", "sets head_dim 32, but hidden_size / num_attention_heads is 16"},
      {R"("hidden_act": "gelu")", "uses hidden_act \"gelu\""},
      {R"("attention_dropout": 0.1)", "sets attention_dropout 0.1"},
      {R"("pretraining_tp": 2)", "sets pretraining_tp 2"},
      // Values that would be truncated or make no sense (issue Reliability).
      {R"("max_position_embeddings": 64.5)", "'max_position_embeddings' must be an integer, got 64.5"},
      {R"("rms_norm_eps": -1)", "'rms_norm_eps' must be a positive number, got -1"},
      {R"("rope_theta": -5)", "'rope_theta' must be a positive number, got -5"},
      {R"("rope_theta": "big")", "'rope_theta' must be a positive number, got \"big\""},
  };
  for (const auto& [field, expected] : cases) {
    std::string message;
    try {
      LlamaConfig::from_json(base + ", " + field + "}", "config.json");
    } catch (const c10::Error& error) {
      message = error.what_without_backtrace();
    }
    EXPECT_NE(message.find(expected), std::string::npos) << field << " gave: " << message;
  }
  // A required integer written as a fraction.
  std::string message;
  try {
    LlamaConfig::from_json(
        R"({"model_type": "llama", "vocab_size": 256, "hidden_size": 64.5, "intermediate_size": 96, )"
        R"("num_hidden_layers": 2, "num_attention_heads": 4})",
        "config.json");
  } catch (const c10::Error& error) {
    message = error.what_without_backtrace();
  }
  EXPECT_NE(message.find("'config.json': 'hidden_size' must be an integer, got 64.5"), std::string::npos) << message;
  const auto accepted = LlamaConfig::from_json(
      base + R"(, "attention_dropout": 0.0, "head_dim": 16, "dtype": "float32"})", "config.json");
  EXPECT_EQ(accepted.head_dim(), 16);
}

}  // namespace
}  // namespace fsdp
