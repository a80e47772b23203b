// Training parity with PyTorch FSDP2 itself: the same model, initial weights, global batches, AdamW
// and gradient clipping under fsdp.cpp's fully_shard and under torch.distributed.fsdp.fully_shard
// (CPU, gloo, the venv's torch; tests/python/fsdp2_parity.py). The loss of every step and the final
// weights must agree within 1e-5 (fp32), for reshard_after_forward true (FULL_SHARD) and false
// (SHARD_GRAD_OP), on 2, 3 and 4 ranks. The model's first dimensions (5, 7, 2) do not divide evenly.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cstdio>

#include <fsdp/fsdp.h>

#include "harness/multi_rank.h"
#include "harness/python_peer.h"

namespace fsdp {
namespace {

constexpr int kSteps = 20;
constexpr int64_t kGlobalBatch = 12;

// Mirrors Block and ParityMlp in fsdp2_parity.py, with the same parameter names.
struct ParityBlockImpl : torch::nn::Module {
  ParityBlockImpl()
      : fc1(register_module("fc1", torch::nn::Linear(5, 7))), fc2(register_module("fc2", torch::nn::Linear(7, 5))) {}
  torch::Tensor forward(const torch::Tensor& x) { return x + fsdp::forward(fc2, torch::gelu(fsdp::forward(fc1, x))); }
  torch::nn::Linear fc1, fc2;
};
TORCH_MODULE(ParityBlock);

struct ParityMlpImpl : torch::nn::Module {
  ParityMlpImpl()
      : input(register_module("input", torch::nn::Linear(3, 5))),
        block_list(register_module("blocks", torch::nn::ModuleList())),
        head(register_module("head", torch::nn::Linear(5, 2))) {
    for (int index = 0; index < 3; ++index) {
      blocks.emplace_back();
      block_list->push_back(blocks.back());
    }
  }
  torch::Tensor forward(const torch::Tensor& x) {
    auto hidden = fsdp::forward(input, x);
    for (auto& block : blocks) hidden = fsdp::forward(block, hidden);
    return fsdp::forward(head, hidden);
  }
  torch::nn::Linear input;
  torch::nn::ModuleList block_list;
  std::vector<ParityBlock> blocks;
  torch::nn::Linear head;
};
TORCH_MODULE(ParityMlp);

void write_inputs(const std::string& directory) {
  torch::manual_seed(0);
  ParityMlp model;
  std::vector<std::pair<std::string, at::Tensor>> initial;
  for (const auto& item : model->named_parameters()) initial.emplace_back(item.key(), item.value().detach().clone());
  write_safetensors(directory + "/initial.safetensors", initial);
  std::vector<std::pair<std::string, at::Tensor>> batches;
  for (int step = 0; step < kSteps; ++step) {
    batches.emplace_back("x." + std::to_string(step), torch::randn({kGlobalBatch, 3}));
    batches.emplace_back("y." + std::to_string(step), torch::randn({kGlobalBatch, 2}));
  }
  write_safetensors(directory + "/batches.safetensors", batches);
}

void train_with_fsdp_cpp(const DistributedContext& context, const std::string& directory, bool reshard_after_forward) {
  ParityMlp model;
  {
    torch::NoGradGuard no_grad;
    SafetensorsReader initial(directory + "/initial.safetensors");
    for (auto& item : model->named_parameters()) item.value().copy_(initial.tensor(item.key()));
  }
  FullyShardOptions options;
  options.reshard_after_forward = reshard_after_forward;
  fully_shard(model->input.ptr(), context, options);
  for (auto& block : model->blocks) fully_shard(block.ptr(), context, options);
  fully_shard(model.ptr(), context, options);
  torch::optim::AdamW optimizer(model->parameters(), torch::optim::AdamWOptions(1e-2).weight_decay(0.01));
  SafetensorsReader batches(directory + "/batches.safetensors");
  const int64_t rows = kGlobalBatch / context.world_size();
  std::vector<double> losses;
  for (int step = 0; step < kSteps; ++step) {
    auto x = batches.tensor("x." + std::to_string(step)).narrow(0, context.rank() * rows, rows);
    auto y = batches.tensor("y." + std::to_string(step)).narrow(0, context.rank() * rows, rows);
    auto loss = torch::mse_loss(fsdp::forward(model, x), y);
    loss.backward();
    const double norm = clip_grad_norm_(*model, 0.05);
    EXPECT_GT(norm, 0.05) << "step " << step << ": the clipping under test did not act";
    optimizer.step();
    optimizer.zero_grad();
    auto total = loss.detach().clone().reshape({1});
    all_reduce(context.world(), total);
    losses.push_back(total.item<double>() / static_cast<double>(context.world_size()));
  }
  StateDictConfig config;
  config.rank0_only = true;
  auto full = full_model_state_dict(*model, config);
  if (context.rank() == 0) {
    full.emplace_back("loss", torch::tensor(losses, torch::kDouble));
    write_safetensors(directory + "/ours_result.safetensors", full);
  }
}

class Fsdp2Parity : public ::testing::TestWithParam<std::tuple<int, bool>> {};

TEST_P(Fsdp2Parity, LossesAndFinalWeightsMatchPyTorchFsdp2) {
  const auto [world_size, reshard_after_forward] = GetParam();
  const auto directory = testing::shared_temporary_directory();
  if (!testing::is_rank_process()) {
    write_inputs(directory);
    testing::PythonOptions python_options;
    python_options.world_size = world_size;
    const auto python = testing::run_python("fsdp2_parity.py", {directory, reshard_after_forward ? "1" : "0"},
                                            python_options);
    ASSERT_TRUE(python.ok);
    std::printf("%s", python.output[0].c_str());
  }
  testing::run_on_ranks(world_size, [&, reshard = reshard_after_forward](const DistributedContext& context) {
    train_with_fsdp_cpp(context, directory, reshard);
  });
  if (testing::is_rank_process()) return;

  std::map<std::string, at::Tensor> theirs, ours;
  for (auto& [name, tensor] : read_safetensors(directory + "/fsdp2_result.safetensors")) theirs[name] = tensor;
  for (auto& [name, tensor] : read_safetensors(directory + "/ours_result.safetensors")) ours[name] = tensor;
  ASSERT_EQ(ours.size(), theirs.size());
  const auto our_losses = ours.at("loss"), their_losses = theirs.at("loss");
  ASSERT_EQ(our_losses.numel(), kSteps);
  double worst_loss = 0;
  for (int step = 0; step < kSteps; ++step) {
    const double a = our_losses[step].item<double>(), b = their_losses[step].item<double>();
    worst_loss = std::max(worst_loss, std::abs(a - b) / std::abs(b));
    EXPECT_LE(std::abs(a - b), 1e-5 * std::abs(b)) << "step " << step << ": fsdp.cpp " << a << ", FSDP2 " << b;
  }
  EXPECT_LT(our_losses[kSteps - 1].item<double>(), our_losses[0].item<double>());  // it trained
  double worst_weight = 0;
  for (const auto& [name, tensor] : theirs) {
    if (name == "loss") continue;
    ASSERT_TRUE(ours.count(name)) << name;
    ASSERT_EQ(ours.at(name).sizes(), tensor.sizes()) << name;
    const double difference = (ours.at(name) - tensor).abs().max().item<double>();
    worst_weight = std::max(worst_weight, difference);
    EXPECT_LE(difference, 1e-5) << name;
  }
  std::printf("N=%d reshard_after_forward=%d: largest loss difference %.2e (relative), weights %.2e (absolute)\n",
              world_size, reshard_after_forward ? 1 : 0, worst_loss, worst_weight);
}

INSTANTIATE_TEST_SUITE_P(WorldSizes, Fsdp2Parity,
                         ::testing::Combine(::testing::Values(2, 3, 4), ::testing::Bool()),
                         [](const ::testing::TestParamInfo<std::tuple<int, bool>>& info) {
                           return std::to_string(std::get<0>(info.param)) + "ranks_" +
                                  (std::get<1>(info.param) ? "reshard" : "noreshard");
                         });

}  // namespace
}  // namespace fsdp
