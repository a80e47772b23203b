#include <fsdp/fsdp.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <filesystem>
#include <fstream>

#include "harness/error_message.h"
#include "harness/multi_rank.h"
#include "harness/parity.h"
#include "harness/test_models.h"

namespace fsdp {
namespace {

namespace fs = std::filesystem;

/// The model's distinct tensors in two safetensors files with a transformers-style index.
void write_hugging_face_checkpoint(const std::string& directory, const torch::nn::Module& model) {
  TensorList first, second;
  std::string weight_map;
  std::unordered_set<const c10::TensorImpl*> seen;
  size_t index = 0;
  for (const auto& item : model.named_parameters()) {
    if (!seen.insert(item.value().unsafeGetTensorImpl()).second) continue;
    auto& target = index++ % 2 == 0 ? first : second;
    target.emplace_back(item.key(), item.value().detach().clone());
    weight_map += std::string(weight_map.empty() ? "" : ",") + "\"" + item.key() + "\":\"model-0000" +
                  (&target == &first ? "1" : "2") + "-of-00002.safetensors\"";
  }
  write_safetensors((fs::path(directory) / "model-00001-of-00002.safetensors").string(), first);
  write_safetensors((fs::path(directory) / "model-00002-of-00002.safetensors").string(), second);
  std::ofstream((fs::path(directory) / "model.safetensors.index.json").string())
      << "{\"metadata\":{\"total_size\":0},\"weight_map\":{" << weight_map << "}}";
}

TensorList tensor_list_of(const torch::nn::Module& model) {
  TensorList tensors;
  for (const auto& item : model.named_parameters()) tensors.emplace_back(item.key(), item.value().detach().clone());
  return tensors;
}

// What this process has read through read()/pread() so far (/proc/self/io rchar): page cache or disk.
int64_t bytes_read_by_this_process() {
  std::ifstream io("/proc/self/io");
  std::string key;
  int64_t value = 0;
  while (io >> key >> value) {
    if (key == "rchar:") return value;
  }
  return -1;
}

// Every rank opens the files and reads only its own rows: each reads about a third of the bytes on
// 3 ranks (its rows of each weight, the headers and the index), none is sent, and the values are
// the checkpoint's. rank0_only reads everything on rank 0.
TEST(PretrainedWeights, EveryRankReadsOnlyTheRowsOfItsOwnShards) {
  const auto directory = testing::shared_temporary_directory();
  torch::manual_seed(31);
  auto make = [] { return torch::nn::Sequential(torch::nn::Linear(64, 600), torch::nn::Linear(600, 64)); };
  auto source = make();
  write_safetensors((fs::path(directory) / "model.safetensors").string(), tensor_list_of(*source));
  const auto expected = testing::named_copies(*source);
  const auto file_bytes = static_cast<int64_t>(fs::file_size(fs::path(directory) / "model.safetensors"));
  testing::run_on_ranks(3, [&](const DistributedContext& context) {
    for (bool rank0_only : {false, true}) {
      torch::manual_seed(32);
      auto model = make();
      fully_shard(model.ptr(), context);
      PretrainedWeightsOptions options;
      options.rank0_only = rank0_only;
      const auto before = bytes_read_by_this_process();
      load_pretrained_weights(*model, context, directory, options);
      const auto read = bytes_read_by_this_process() - before;
      const auto actual = testing::full_parameters(*model);
      for (const auto& [name, tensor] : expected) EXPECT_TRUE(torch::equal(actual.at(name), tensor)) << name;
      if (!rank0_only) {
        EXPECT_LT(read, file_bytes * 4 / 10)
            << "rank " << context.rank() << " of 3 read " << read << " of " << file_bytes << " bytes";
      } else if (context.rank() == 0) {
        EXPECT_GE(read, file_bytes * 9 / 10) << "rank 0 reads every tensor: " << read << " of " << file_bytes;
      }
    }
  });
}

// A rank that cannot open the files: an error on every rank, naming that rank and the rank-0 path.
TEST(PretrainedWeights, ARankThatCannotSeeTheFilesIsAnErrorOnEveryRank) {
  const auto directory = testing::shared_temporary_directory();
  auto model_of = [] { return torch::nn::Sequential(torch::nn::Linear(4, 6)); };
  write_safetensors((fs::path(directory) / "model.safetensors").string(), tensor_list_of(*model_of()));
  testing::run_on_ranks(2, [&](const DistributedContext& context) {
    auto model = model_of();
    fully_shard(model.ptr(), context);
    const auto message = testing::error_message_of(
        [&] { load_pretrained_weights(*model, context, context.rank() == 1 ? "/nonexistent/model" : directory); });
    EXPECT_NE(message.find("rank 1"), std::string::npos) << message;
    EXPECT_NE(message.find("PretrainedWeightsOptions::rank0_only"), std::string::npos) << message;
  });
}

TEST(PretrainedWeights, OnlyRankZeroReadsTheFilesAndEveryRankGetsItsRows) {
  const auto directory = testing::shared_temporary_directory();
  torch::manual_seed(31);
  testing::TinyTransformer source;
  write_hugging_face_checkpoint(directory, *source);
  const auto expected = testing::named_copies(*source);
  testing::run_on_ranks(3, [directory, expected](const DistributedContext& context) {
    torch::manual_seed(32);
    testing::TinyTransformer model;
    for (auto& layer : model->layers) fully_shard(layer.ptr(), context);
    fully_shard(model.ptr(), context);
    // With rank0_only, other ranks are given a path that does not exist: they never look at it.
    PretrainedWeightsOptions options;
    options.rank0_only = true;
    load_pretrained_weights(*model, context, context.rank() == 0 ? directory : "/nonexistent/checkpoint", options);
    const auto actual = testing::full_parameters(*model);
    for (const auto& [name, tensor] : expected) EXPECT_TRUE(torch::equal(actual.at(name), tensor)) << name;
  });
}

TEST(PretrainedWeights, BrokenIndexesAreNamedErrors) {
  const auto directory = testing::shared_temporary_directory();
  std::ofstream((fs::path(directory) / "model.safetensors.index.json").string())
      << R"({"weight_map":{"w":"model-00001-of-00001.safetensors"}})";
  auto message = testing::error_message_of([&] { SafetensorsCheckpointSource source(directory); });
  EXPECT_NE(message.find("names 'model-00001-of-00001.safetensors', which does not exist"), std::string::npos)
      << message;
  write_safetensors((fs::path(directory) / "model-00001-of-00001.safetensors").string(), {{"v", torch::ones(2)}});
  message = testing::error_message_of([&] { SafetensorsCheckpointSource source(directory); });
  EXPECT_NE(message.find("says 'w' is in 'model-00001-of-00001.safetensors' but that file has no such tensor"),
            std::string::npos)
      << message;
  // Two files holding the same tensor: the index names one, and the other is not ignored.
  write_safetensors((fs::path(directory) / "model-00001-of-00002.safetensors").string(), {{"w", torch::ones(2)}});
  write_safetensors((fs::path(directory) / "model-00002-of-00002.safetensors").string(),
                    {{"v", torch::ones(2)}, {"w", torch::zeros(2)}});
  std::ofstream((fs::path(directory) / "model.safetensors.index.json").string())
      << R"({"weight_map":{"w":"model-00001-of-00002.safetensors","v":"model-00002-of-00002.safetensors"}})";
  message = testing::error_message_of([&] { SafetensorsCheckpointSource source(directory); });
  EXPECT_NE(message.find("tensor 'w' is in both 'model-00001-of-00002.safetensors' (where index"), std::string::npos)
      << message;
  EXPECT_NE(message.find("and 'model-00002-of-00002.safetensors'; a checkpoint holds each tensor once"),
            std::string::npos)
      << message;
  message =
      testing::error_message_of([&] { SafetensorsCheckpointSource source(directory + "/empty_dir_that_is_missing"); });
  EXPECT_NE(message.find("does not exist"), std::string::npos) << message;
}

TEST(AcceleratorState, SaveStateAndLoadStateUseThePluginsLayout) {
  const auto directory = testing::shared_temporary_directory();
  testing::run_on_ranks(2, [directory](const DistributedContext& context) {
    FullyShardedDataParallelPluginArgs args;
    args.fsdp_version = int64_t{2};
    args.auto_wrap_policy = std::string("transformer_based_wrap");
    args.state_dict_type = std::string("FULL_STATE_DICT");
    AcceleratorOptions options;
    options.fsdp_plugin = FullyShardedDataParallelPlugin(args, EnvironmentMap{});
    Accelerator accelerator(context, options, EnvironmentMap{});
    torch::manual_seed(33);
    testing::TinyTransformer model;
    torch::optim::AdamW optimizer(testing::unique_parameters(*model));
    accelerator.prepare(model, optimizer);
    const auto before = testing::full_parameters(*model);
    TrainingProgress saved;
    saved.step = 5;
    saved.data_position = 60;
    saved.scheduler = {{"last_epoch", 5}};
    accelerator.save_state(directory, saved);
    EXPECT_TRUE(fs::exists(fs::path(directory) / "pytorch_model_fsdp.bin"));
    EXPECT_TRUE(fs::exists(fs::path(directory) / "optimizer.bin"));
    {
      torch::NoGradGuard no_grad;
      for (auto& parameter : model->parameters()) parameter.zero_();
    }
    const auto progress = accelerator.load_state(directory);
    EXPECT_EQ(progress.step, 5);
    EXPECT_EQ(progress.data_position, 60);
    const auto after = testing::full_parameters(*model);
    for (const auto& [name, tensor] : before) EXPECT_TRUE(torch::equal(after.at(name), tensor)) << name;

    // save_model in Hugging Face shards: the index maps every tensor to the file that holds it.
    accelerator.save_model(directory + "/hf", /*max_shard_size=*/500);
    if (context.rank() == 0) {
      EXPECT_TRUE(fs::exists(fs::path(directory) / "hf" / "model.safetensors.index.json"));
      SafetensorsCheckpointSource saved(directory + "/hf");
      EXPECT_EQ(saved.size(), testing::unique_parameters(*model).size());
      for (const auto& [name, tensor] : before) {
        if (!saved.contains(name)) continue;  // the tied lm_head is stored once, under the embedding's name
        EXPECT_TRUE(torch::equal(saved.rows(name, 0, tensor.size(0)), tensor)) << name;
      }
    }
  });
}

}  // namespace
}  // namespace fsdp
