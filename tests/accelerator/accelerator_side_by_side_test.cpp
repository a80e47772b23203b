// fsdp::Accelerator's collectives and training-loop calls against Accelerate's own on the same
// tensors, on 2 and 3 CPU processes (tests/python/accelerate_collectives.py is the Python half):
// gather (2-D, 0-dim, integer), reduce (sum and mean, 0-dim, integer), wait_for_everyone, and
// gradient accumulation through accumulate(), backward(), clip_grad_norm_() and the optimizer step
// (SGD, so that a wrong loss scale shows in the weights; Adam would hide it). Collectives must be
// equal, dtypes included; the training within fp32 rounding (the two sides reduce gradients in
// another order: FSDP's reduce-scatter against DDP's all-reduce). Where Accelerate raises (the mean
// of an integer tensor; a gather of tensors whose shapes differ across ranks, which Accelerate
// catches only with ACCELERATE_DEBUG_MODE and otherwise answers with garbage on one rank and an
// abort on another), fsdp::Accelerator raises a named error on every rank.
// Not taken, on purpose: nested containers (Accelerate's gather and reduce walk dicts and lists;
// ours take one tensor) and reduce's `scale` (which Accelerate applies only on XLA).
#include <fsdp/fsdp.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <fstream>
#include <nlohmann/json.hpp>
#include <thread>

#include "harness/multi_rank.h"
#include "harness/python_peer.h"

namespace fsdp {
namespace {

constexpr int kSteps = 3;
constexpr int kAccumulation = 2;
constexpr double kLearningRate = 0.1;
constexpr double kMaxNorm = 0.5;

torch::nn::Sequential make_model() {
  return torch::nn::Sequential(torch::nn::Linear(3, 4), torch::nn::ReLU(), torch::nn::Linear(4, 2));
}

void write_inputs(const std::string& directory, int world_size) {
  std::ofstream(directory + "/case.json") << nlohmann::json{
      {"steps", kSteps},
      {"accumulation", kAccumulation},
      {"lr", kLearningRate},
      {"max_norm", kMaxNorm}}.dump();
  torch::manual_seed(3);
  auto model = make_model();
  std::vector<std::pair<std::string, at::Tensor>> initial;
  for (const auto& item : model->named_parameters()) initial.emplace_back(item.key(), item.value().detach().clone());
  write_safetensors(directory + "/initial.safetensors", initial);
  std::vector<std::pair<std::string, at::Tensor>> batches;
  const int64_t rows = world_size * kAccumulation * 2;
  for (int step = 0; step < kSteps; ++step) {
    batches.emplace_back("x." + std::to_string(step), torch::randn({rows, 3}));
    batches.emplace_back("y." + std::to_string(step), torch::randn({rows, 2}));
  }
  write_safetensors(directory + "/batches.safetensors", batches);
}

void run_ours(const DistributedContext& context, const std::string& directory) {
  ::setenv("FSDP_DEVICE", "cpu", 1);
  AcceleratorOptions options;
  options.fsdp_plugin = FullyShardedDataParallelPlugin(FullyShardedDataParallelPluginArgs{}, EnvironmentMap{});
  options.gradient_accumulation_steps = kAccumulation;
  Accelerator accelerator(context, options, EnvironmentMap{});
  const auto rank = context.rank();
  std::vector<std::pair<std::string, at::Tensor>> results;
  const auto matrix = torch::arange(6, torch::kFloat).reshape({2, 3}) + 10 * rank;
  results.emplace_back("gather_2d", accelerator.gather(matrix));
  results.emplace_back("gather_0d", accelerator.gather(torch::tensor(rank + 0.5, torch::kFloat)));
  results.emplace_back("gather_int", accelerator.gather(torch::arange(4, torch::kLong) + rank));
  results.emplace_back("reduce_sum", accelerator.reduce(matrix, "sum"));
  results.emplace_back("reduce_mean", accelerator.reduce(matrix, "mean"));
  results.emplace_back("reduce_sum_int", accelerator.reduce(torch::arange(3, torch::kLong) + rank, "sum"));
  results.emplace_back("reduce_mean_0d", accelerator.reduce(torch::tensor(rank + 1.0, torch::kFloat), "mean"));
  nlohmann::json errors;
  try {
    accelerator.reduce(torch::arange(3, torch::kLong) + rank, "mean");
  } catch (const c10::Error& error) {
    errors["reduce_mean_int"] = error.what_without_backtrace();
  }
  try {
    accelerator.gather(torch::ones({rank + 1, 3}));
  } catch (const c10::Error& error) {
    errors["gather_uneven"] = error.what_without_backtrace();
  }
  // wait_for_everyone: no rank leaves before the last arrives.
  const auto arrived = directory + "/arrived_" + std::to_string(rank);
  if (rank == context.world_size() - 1) std::this_thread::sleep_for(std::chrono::milliseconds(300));
  std::ofstream(arrived) << "1";
  accelerator.wait_for_everyone();
  for (int64_t other = 0; other < context.world_size(); ++other) {
    EXPECT_TRUE(std::filesystem::exists(directory + "/arrived_" + std::to_string(other)))
        << "rank " << rank << " left wait_for_everyone before rank " << other << " arrived";
  }

  auto model = make_model();
  {
    torch::NoGradGuard no_grad;
    SafetensorsReader initial(directory + "/initial.safetensors");
    for (auto& item : model->named_parameters()) item.value().copy_(initial.tensor(item.key()));
  }
  torch::optim::SGD optimizer(model->parameters(), torch::optim::SGDOptions(kLearningRate));
  accelerator.prepare(model, optimizer);
  SafetensorsReader batches(directory + "/batches.safetensors");
  std::vector<double> losses, norms, syncs;
  for (int step = 0; step < kSteps; ++step) {
    const auto x = batches.tensor("x." + std::to_string(step)), y = batches.tensor("y." + std::to_string(step));
    const int64_t rows = x.size(0) / context.world_size(), micro = rows / kAccumulation;
    for (int index = 0; index < kAccumulation; ++index) {
      at::Tensor loss;
      {
        auto scope = accelerator.accumulate();
        loss = torch::mse_loss(fsdp::forward(model, x.narrow(0, rank * rows + index * micro, micro)),
                               y.narrow(0, rank * rows + index * micro, micro));
        accelerator.backward(loss);
        syncs.push_back(accelerator.sync_gradients() ? 1.0 : 0.0);
        if (accelerator.sync_gradients()) {
          norms.push_back(accelerator.clip_grad_norm_(kMaxNorm));
          accelerator.step();
          optimizer.zero_grad();
        }
      }
      losses.push_back(accelerator.reduce(loss.detach(), "mean").item<double>());
    }
  }
  auto weights = accelerator.get_state_dict();
  if (rank != 0) return;
  for (auto& [name, tensor] : weights) results.emplace_back("weight." + name, tensor);
  results.emplace_back("loss", torch::tensor(losses, torch::kDouble));
  results.emplace_back("norm", torch::tensor(norms, torch::kDouble));
  results.emplace_back("sync", torch::tensor(syncs, torch::kDouble));
  write_safetensors(directory + "/ours.safetensors", results);
  std::ofstream(directory + "/ours.json") << errors.dump();
}

class AcceleratorSideBySide : public ::testing::TestWithParam<int> {};

TEST_P(AcceleratorSideBySide, CollectivesAndAccumulationMatchAccelerate) {
  const int world_size = GetParam();
  const auto directory = testing::shared_temporary_directory();
  if (!testing::is_rank_process()) {
    write_inputs(directory, world_size);
    testing::PythonOptions options;
    options.world_size = world_size;
    options.environment["ACCELERATE_DEBUG_MODE"] = "1";
    ASSERT_TRUE(testing::run_python("accelerate_collectives.py", {directory}, options).ok);
  }
  testing::run_on_ranks(world_size, [&](const DistributedContext& context) { run_ours(context, directory); });
  if (testing::is_rank_process()) return;

  std::map<std::string, at::Tensor> theirs, ours;
  for (auto& [name, tensor] : read_safetensors(directory + "/theirs.safetensors")) theirs[name] = tensor;
  for (auto& [name, tensor] : read_safetensors(directory + "/ours.safetensors")) ours[name] = tensor;
  EXPECT_EQ(ours.size(), theirs.size());
  for (const auto& [name, expected] : theirs) {
    ASSERT_TRUE(ours.count(name)) << name;
    const auto& found = ours.at(name);
    EXPECT_EQ(found.scalar_type(), expected.scalar_type()) << name;
    EXPECT_EQ(found.sizes(), expected.sizes()) << name;
    if (found.sizes() != expected.sizes() || found.scalar_type() != expected.scalar_type()) continue;
    if (name.rfind("gather", 0) == 0 || name.rfind("reduce", 0) == 0 || name == "sync") {
      EXPECT_TRUE(torch::equal(found, expected)) << name << ": ours " << found << "\nAccelerate's " << expected;
    } else if (name == "loss" || name == "norm") {
      EXPECT_TRUE(torch::allclose(found, expected, /*rtol=*/1e-6, /*atol=*/0))
          << name << ": ours " << found << "\nAccelerate's " << expected;
    } else {
      EXPECT_LE((found - expected).abs().max().item<double>(), 1e-6) << name;
    }
  }
  nlohmann::json their_errors, our_errors;
  std::ifstream(directory + "/theirs.json") >> their_errors;
  std::ifstream(directory + "/ours.json") >> our_errors;
  // Both raise; ours names the call, what it got and what to do.
  EXPECT_NE(their_errors["reduce_mean_int"].get<std::string>().find("can't be cast"), std::string::npos)
      << their_errors;
  EXPECT_NE(their_errors["gather_uneven"].get<std::string>().find("shape mismatches"), std::string::npos)
      << their_errors;
  ASSERT_TRUE(our_errors.contains("reduce_mean_int")) << our_errors;
  EXPECT_NE(our_errors["reduce_mean_int"].get<std::string>().find(
                "Accelerator::reduce: the mean of an integer tensor (Long) is not an integer"),
            std::string::npos)
      << our_errors;
  ASSERT_TRUE(our_errors.contains("gather_uneven")) << our_errors;
  EXPECT_NE(our_errors["gather_uneven"].get<std::string>().find("issued different collectives"), std::string::npos)
      << our_errors;
}

INSTANTIATE_TEST_SUITE_P(Ranks, AcceleratorSideBySide, ::testing::Values(2, 3),
                         [](const ::testing::TestParamInfo<int>& info) {
                           return std::to_string(info.param) + "ranks";
                         });

}  // namespace
}  // namespace fsdp
