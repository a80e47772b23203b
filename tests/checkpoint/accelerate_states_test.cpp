// Resuming from what Accelerate wrote (src/checkpoint/accelerate_states.h, checkpoint.h): a
// checkpoint tests/python/accelerate_checkpoint.py saves with Accelerate's own save_fsdp_model,
// save_fsdp_optimizer and save_accelerator_state under FSDP2 on 2 ranks, with SHARDED_STATE_DICT
// (DCP directories) or FULL_STATE_DICT (rank 0's torch.save of an OrderedDict and of the optimizer's
// state dict), found by Accelerator::latest_checkpoint as checkpoints/checkpoint_0 and loaded by
// Accelerator::load_state on 2 and 3 ranks, continues with the losses PyTorch got continuing from it
// (within 1e-5); what cannot be restored (NumPy's and Python's generators, the PyTorch scheduler) is
// named.
#include "checkpoint/accelerate_states.h"

#include <fsdp/fsdp.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <tuple>

#include "harness/error_message.h"
#include "harness/multi_rank.h"
#include "harness/python_peer.h"
#include "harness/test_models.h"

namespace fsdp {
namespace {

namespace fs = std::filesystem;

using testing::FourLinears;

bool lists(const std::vector<std::string>& entries, const std::string& text) {
  for (const auto& entry : entries) {
    if (entry.find(text) != std::string::npos) return true;
  }
  return false;
}

class ResumeFromAccelerate : public ::testing::TestWithParam<std::tuple<int, std::string>> {};

TEST_P(ResumeFromAccelerate, ContinuesWithTheLossesPyTorchGetsFromIt) {
  const auto [world_size, state_dict_type] = GetParam();
  const auto root = testing::shared_temporary_directory();
  if (!testing::is_rank_process()) {
    testing::PythonOptions options;
    options.world_size = 2;
    ASSERT_TRUE(testing::run_python("accelerate_checkpoint.py", {root, state_dict_type}, options).ok);
    const auto checkpoint = fs::path(root) / "checkpoints" / "checkpoint_0";
    // The layout under test, as Accelerate wrote it.
    EXPECT_EQ(fs::exists(checkpoint / "pytorch_model_fsdp.bin"), state_dict_type == "FULL_STATE_DICT");
    EXPECT_EQ(fs::exists(checkpoint / "pytorch_model_fsdp_0" / ".metadata"), state_dict_type == "SHARDED_STATE_DICT");
    EXPECT_EQ(fs::exists(checkpoint / "pytorch_model_fsdp_rank1.bin"), state_dict_type == "LOCAL_STATE_DICT");
    if (state_dict_type == "LOCAL_STATE_DICT") {
      nlohmann::json recorded;
      std::ifstream(root + "/losses.json") >> recorded;
      std::printf("Accelerate's own load_fsdp_model of this LOCAL_STATE_DICT checkpoint: %s\n",
                  recorded.value("accelerate_load", std::string("(not recorded)")).c_str());
    }
  }
  testing::run_on_ranks(world_size, [root](const DistributedContext& context) {
    nlohmann::json expected;
    std::ifstream(root + "/losses.json") >> expected;
    torch::manual_seed(99);  // other weights than the saved ones: the load must replace every one
    FourLinears model;
    torch::optim::AdamW optimizer(model->parameters(), torch::optim::AdamWOptions(0.5));
    AcceleratorOptions options;
    options.fsdp_plugin = FullyShardedDataParallelPlugin(FullyShardedDataParallelPluginArgs{}, EnvironmentMap{});
    options.project_dir = root;
    Accelerator accelerator(context, options, EnvironmentMap{});
    accelerator.prepare(model, optimizer);
    const auto latest = accelerator.latest_checkpoint();
    ASSERT_EQ(latest, (fs::path(root) / "checkpoints" / "checkpoint_0").string());
    const auto progress = accelerator.load_state(latest);
    EXPECT_EQ(progress.step, 2) << "the optimizer's step count";
    EXPECT_TRUE(lists(progress.not_restored, "scheduler.bin (a PyTorch LR scheduler's state"))
        << progress.not_restored.size();
    if (context.rank() < 2) {
      EXPECT_TRUE(lists(progress.not_restored, "numpy_random_seed (NumPy's generator)"));
      EXPECT_TRUE(lists(progress.not_restored, "random_state (Python's random module)"));
    }
    auto& group = static_cast<torch::optim::AdamWOptions&>(optimizer.param_groups().at(0).options());
    EXPECT_EQ(group.lr(), 0.01);
    EXPECT_EQ(std::get<0>(group.betas()), 0.8);
    EXPECT_EQ(group.weight_decay(), 0.1);
    const auto& resumed = expected.at("resumed");
    for (size_t index = 0; index < resumed.size(); ++index) {
      torch::manual_seed(100 + 2 + static_cast<int64_t>(index));
      const auto batch = torch::randn({6, 3});
      const int64_t local = 6 / context.world_size();
      auto loss = fsdp::forward(model, batch.narrow(0, context.rank() * local, local)).pow(2).mean();
      loss.backward();
      optimizer.step();
      optimizer.zero_grad();
      const double mean = accelerator.reduce(loss.detach(), "mean").item<double>();
      EXPECT_NEAR(mean, resumed[index].get<double>(), 1e-5) << "step " << 2 + index;
    }
  });
}

INSTANTIATE_TEST_SUITE_P(Ranks, ResumeFromAccelerate,
                         ::testing::Combine(::testing::Values(2, 3),
                                            ::testing::Values("SHARDED_STATE_DICT", "FULL_STATE_DICT",
                                                              "LOCAL_STATE_DICT")),
                         [](const ::testing::TestParamInfo<std::tuple<int, std::string>>& info) {
                           const auto& type = std::get<1>(info.param);
                           return type.substr(0, type.find('_')) + "_" + std::to_string(std::get<0>(info.param)) +
                                  "ranks";
                         });

// A checkpoint directory Accelerate left incomplete is named for what it is, never "did not finish
// on every rank" of an fsdp.cpp save.
TEST(ResumeFromAccelerateRefuses, IncompleteCheckpointsAreNamed) {
  const auto root = testing::shared_temporary_directory();
  if (!testing::is_rank_process()) {
    testing::PythonOptions options;
    options.world_size = 2;
    ASSERT_TRUE(testing::run_python("accelerate_checkpoint.py", {root}, options).ok);
    const auto checkpoint = root + "/checkpoints/checkpoint_0";
    fs::rename(checkpoint + "/optimizer_0/.metadata", checkpoint + "/optimizer_0/.metadata.away");
    EXPECT_FALSE(is_complete_checkpoint(checkpoint));
  }
  testing::run_on_ranks(2, [root](const DistributedContext& context) {
    FourLinears model;
    fully_shard(model.ptr(), context);
    torch::optim::AdamW optimizer(model->parameters());
    const auto message = testing::error_message_of(
        [&] { load_checkpoint(root + "/checkpoints/checkpoint_0", *model, optimizer, context); });
    EXPECT_NE(message.find("was written by Accelerate (its random_states_0.pkl holds NumPy's generator), but not as a "
                           "complete SHARDED_STATE_DICT, FULL_STATE_DICT or LOCAL_STATE_DICT checkpoint"),
              std::string::npos)
        << message;
    EXPECT_EQ(message.find("did not finish on every rank"), std::string::npos) << message;
  });
}

// A Linear that registers its bias before its weight: the same sizes in another order.
struct BiasFirstLinearImpl : torch::nn::Module {
  BiasFirstLinearImpl(int64_t in, int64_t out)
      : bias(register_parameter("bias", torch::zeros({out}))),
        weight(register_parameter("weight", torch::zeros({out, in}))) {}
  torch::Tensor forward(const torch::Tensor& x) { return torch::nn::functional::linear(x, weight, bias); }
  torch::Tensor bias, weight;
};
TORCH_MODULE(BiasFirstLinear);

// Accelerate's LOCAL_STATE_DICT checkpoint without one rank's model file, or loaded into a model
// whose layers differ, or whose parameters come in another order with the same total (the flat
// parameter's size alone cannot tell): named errors (Note [FSDP1 flat parameters]).
TEST(ResumeFromAccelerateRefuses, ALocalCheckpointWithoutARanksFileOrOfAnotherModelIsNamed) {
  const auto root = testing::shared_temporary_directory();
  const auto checkpoint = root + "/checkpoints/checkpoint_0";
  const auto partial = root + "/partial";
  if (!testing::is_rank_process()) {
    testing::PythonOptions options;
    options.world_size = 2;
    ASSERT_TRUE(testing::run_python("accelerate_checkpoint.py", {root, "LOCAL_STATE_DICT"}, options).ok);
    fs::copy(checkpoint, partial, fs::copy_options::recursive);
    fs::remove(partial + "/pytorch_model_fsdp_rank1.bin");
  }
  testing::run_on_ranks(2, [&](const DistributedContext& context) {
    FourLinears model;
    fully_shard(model.ptr(), context);
    torch::optim::AdamW optimizer(model->parameters());
    auto message = testing::error_message_of([&] { load_checkpoint(partial, *model, optimizer, context); });
    EXPECT_NE(message.find("holds 2 ranks' random states (Accelerate's LOCAL_STATE_DICT) but lacks "
                           "pytorch_model_fsdp_rank1.bin"),
              std::string::npos)
        << message;
    // The second layer 5 -> 8 instead of 5 -> 7: its unit's flat parameter does not fit.
    auto other = torch::nn::Sequential(torch::nn::Linear(3, 5), torch::nn::Linear(5, 8), torch::nn::Linear(8, 3),
                                       torch::nn::Linear(torch::nn::LinearOptions(3, 2).bias(false)));
    fully_shard(other.ptr(), context);
    torch::optim::AdamW other_optimizer(other->parameters());
    message = testing::error_message_of([&] { load_checkpoint(checkpoint, *other, other_optimizer, context); });
    EXPECT_NE(message.find("the flat parameter of unit '1' holds 44 elements, but the 2 parameters of the model it "
                           "covers (the first '1.weight') make 48 without alignment"),
              std::string::npos)
        << message;
    // Layer 1 as bias (7) then weight (35): aligned to 4 elements that is 7 + 1 + 35 + 1 = 44 elements,
    // the saved total, cut in the wrong places.
    auto reordered = torch::nn::Sequential(torch::nn::Linear(3, 5), BiasFirstLinear(5, 7), torch::nn::Linear(7, 3),
                                           torch::nn::Linear(torch::nn::LinearOptions(3, 2).bias(false)));
    fully_shard(reordered.ptr(), context);
    torch::optim::AdamW reordered_optimizer(reordered->parameters());
    message = testing::error_message_of([&] { load_checkpoint(checkpoint, *reordered, reordered_optimizer, context); });
    EXPECT_NE(message.find("differs from its own piece in the file"), std::string::npos) << message;
    EXPECT_NE(message.find("registers its parameters in another order"), std::string::npos) << message;
  });
}

// The random states file itself: the step, the generator (equal to what torch saved), and the names
// of what is not restored; a damaged file is a named error.
TEST(AccelerateRandomStates, ReadsStepAndGeneratorAndNamesTheRest) {
  const auto root = testing::shared_temporary_directory();
  testing::PythonOptions options;
  options.world_size = 2;
  ASSERT_TRUE(testing::run_python("accelerate_checkpoint.py", {root}, options).ok);
  const auto path = root + "/checkpoints/checkpoint_0/random_states_1.pkl";
  const auto states = detail::read_accelerate_random_states(path);
  EXPECT_EQ(states.step, 2);
  ASSERT_TRUE(states.torch_cpu_state.defined());
  const auto python = testing::run_python_code("import torch\nprint(torch.load('" + path +
                                               "', weights_only=False)['torch_manual_seed'].sum().item())");
  ASSERT_TRUE(python.ok);
  EXPECT_EQ(std::to_string(states.torch_cpu_state.sum().item<int64_t>()),
            python.output.at(0).substr(0, python.output.at(0).find('\n')));
  EXPECT_TRUE(lists(states.not_restored, "numpy_random_seed"));
  const auto damaged = root + "/damaged.pkl";
  fs::copy_file(path, damaged);
  fs::resize_file(damaged, fs::file_size(damaged) / 2);
  const auto message = testing::error_message_of([&] { detail::read_accelerate_random_states(damaged); });
  EXPECT_NE(message.find("damaged.pkl' is not a torch.save archive"), std::string::npos) << message;
}

}  // namespace
}  // namespace fsdp
