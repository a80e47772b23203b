// fsdp::ShardedGradScaler against PyTorch's ShardedGradScaler (tests/python/sharded_grad_scaler_peer.py)
// on 2 ranks: the same shards, the same raw gradients per step (inf and NaN planted on one rank at a
// time, a parameter without a gradient on one rank, fp16 and fp32 gradients), the same SGD: the
// scaled losses, the scale and growth tracker after every update, the unscaled gradients and the
// parameters after every step must be equal bitwise. Also the errors for calls out of order.
#include <fsdp/fsdp.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <fstream>
#include <limits>
#include <map>
#include <nlohmann/json.hpp>

#include "harness/multi_rank.h"
#include "harness/python_peer.h"

namespace fsdp {
namespace {

constexpr int kRanks = 2;
constexpr int kScalerSteps = 9;
const std::vector<std::string> kParameters = {"a", "b", "c"};  // fp32 [5], fp16 [3], fp32 [2, 2]

torch::ScalarType dtype_of(const std::string& name) { return name == "b" ? torch::kHalf : torch::kFloat; }

void write_inputs(const std::string& directory) {
  nlohmann::json json;
  json["init_scale"] = 1024.0;
  json["growth_interval"] = 2;
  json["steps"] = kScalerSteps;
  json["lr"] = 0.1;
  json["explicit_unscale"] = std::vector<int>{1, 4, 7};
  std::ofstream(directory + "/case.json") << json.dump();
  torch::manual_seed(0);
  std::vector<std::pair<std::string, at::Tensor>> inputs;
  const std::map<std::string, std::vector<int64_t>> shapes = {{"a", {5}}, {"b", {3}}, {"c", {2, 2}}};
  const float inf = std::numeric_limits<float>::infinity();
  for (int rank = 0; rank < kRanks; ++rank) {
    for (const auto& name : kParameters) {
      const auto prefix = std::to_string(rank) + "." + name;
      inputs.emplace_back(prefix + ".initial", torch::randn(shapes.at(name)).to(dtype_of(name)));
      for (int step = 0; step < kScalerSteps; ++step) {
        if (step == 6 && rank == 0 && name == "c") continue;  // no gradient on one rank for one step
        auto raw = torch::randn(shapes.at(name)) * (name == "b" ? 1.0 : 1e-3);
        if (step == 2 && rank == 1 && name == "a") raw[1] = inf;  // one rank overflows: all skip
        if (step == 5 && rank == 0 && name == "b") raw[0] = std::numeric_limits<float>::quiet_NaN();
        inputs.emplace_back(prefix + "." + std::to_string(step), raw);
      }
    }
  }
  write_safetensors(directory + "/inputs.safetensors", inputs);
}

void run_ours(const DistributedContext& context, const std::string& directory) {
  SafetensorsReader inputs(directory + "/inputs.safetensors");
  auto has = [&](const std::string& key) { return inputs.contains(key); };
  const auto rank = std::to_string(context.rank());
  std::vector<torch::Tensor> parameters;
  for (const auto& name : kParameters) {
    parameters.push_back(inputs.tensor(rank + "." + name + ".initial").clone().set_requires_grad(true));
  }
  torch::optim::SGD optimizer(parameters, torch::optim::SGDOptions(0.1));
  ShardedGradScalerOptions options;
  options.init_scale = 1024.0;
  options.growth_interval = 2;
  ShardedGradScaler scaler(context.world(), options);
  std::vector<std::pair<std::string, at::Tensor>> record;
  std::vector<double> scaled, scales, trackers;
  for (int step = 0; step < kScalerSteps; ++step) {
    scaled.push_back(scaler.scale(torch::tensor(1.5f)).item<double>());
    const auto scale = scaler.scale(torch::tensor(1.0f));
    for (size_t index = 0; index < kParameters.size(); ++index) {
      const auto key = rank + "." + kParameters[index] + "." + std::to_string(step);
      parameters[index].mutable_grad() =
          has(key) ? (inputs.tensor(key) * scale).to(parameters[index].scalar_type()) : torch::Tensor();
    }
    if (step == 1 || step == 4 || step == 7) scaler.unscale_(optimizer);
    const bool stepped = scaler.step(optimizer);
    EXPECT_EQ(stepped, step != 2 && step != 5) << "step " << step;
    for (size_t index = 0; index < kParameters.size(); ++index) {
      const auto prefix = rank + "." + kParameters[index];
      record.emplace_back(prefix + "." + std::to_string(step), parameters[index].detach().clone());
      const auto& gradient = parameters[index].grad();
      if (gradient.defined() && torch::isfinite(gradient).all().item<bool>()) {
        record.emplace_back(prefix + ".grad." + std::to_string(step), gradient.detach().clone());
      }
    }
    scaler.update();
    optimizer.zero_grad();
    scales.push_back(scaler.get_scale());
    trackers.push_back(static_cast<double>(scaler.growth_tracker()));
  }
  // Every rank's record to rank 0, through the file system (the test compares files).
  record.emplace_back("scaled_loss", torch::tensor(scaled, torch::kDouble));
  record.emplace_back("scale", torch::tensor(scales, torch::kDouble));
  record.emplace_back("tracker", torch::tensor(trackers, torch::kDouble));
  write_safetensors(directory + "/ours." + rank + ".safetensors", record);
}

TEST(ShardedGradScaler, MatchesPyTorchsShardedGradScalerBitwise) {
  const auto directory = testing::shared_temporary_directory();
  if (!testing::is_rank_process()) {
    write_inputs(directory);
    testing::PythonOptions options;
    options.world_size = kRanks;
    ASSERT_TRUE(testing::run_python("sharded_grad_scaler_peer.py", {directory}, options).ok);
  }
  testing::run_on_ranks(kRanks, [&](const DistributedContext& context) { run_ours(context, directory); });
  if (testing::is_rank_process()) return;
  std::map<std::string, at::Tensor> theirs;
  for (auto& [name, tensor] : read_safetensors(directory + "/theirs.safetensors")) theirs[name] = tensor;
  std::map<std::string, at::Tensor> ours;
  for (int rank = 0; rank < kRanks; ++rank) {
    for (auto& [name, tensor] : read_safetensors(directory + "/ours." + std::to_string(rank) + ".safetensors")) {
      if (rank == 0 || name.rfind(std::to_string(rank) + ".", 0) == 0) ours[name] = tensor;
    }
  }
  ASSERT_EQ(ours.size(), theirs.size());
  for (const auto& [name, tensor] : theirs) {
    ASSERT_TRUE(ours.count(name)) << name << " is missing from fsdp.cpp's record";
    EXPECT_TRUE(torch::equal(ours.at(name), tensor)) << name << ": fsdp.cpp " << ours.at(name) << " PyTorch " << tensor;
  }
  // The scale backed off twice (steps 2 and 5) and grew after two clean steps in a row.
  const auto scales = theirs.at("scale");
  EXPECT_EQ(scales[2].item<double>(), scales[1].item<double>() * 0.5);
  EXPECT_EQ(scales[4].item<double>(), scales[3].item<double>() * 2.0);
}

TEST(ShardedGradScaler, CallsOutOfOrderAreNamedErrors) {
  testing::run_on_ranks(1, [](const DistributedContext& context) {
    auto parameter = torch::ones({2}).set_requires_grad(true);
    torch::optim::SGD optimizer({parameter}, torch::optim::SGDOptions(0.1));
    ShardedGradScaler scaler(context.world());
    auto message = [](const std::function<void()>& call) {
      try {
        call();
      } catch (const c10::Error& error) {
        return std::string(error.what_without_backtrace());
      }
      return std::string("no error");
    };
    EXPECT_NE(message([&] { scaler.step(optimizer); }).find("no loss was scaled yet"), std::string::npos);
    scaler.scale((parameter * 2).sum()).backward();
    EXPECT_TRUE(torch::equal(parameter.grad(), torch::full({2}, 2.0f * 65536.0f))) << "scaled by init_scale";
    EXPECT_FALSE(scaler.unscaled(optimizer));
    scaler.unscale_(optimizer);
    EXPECT_TRUE(scaler.unscaled(optimizer));
    EXPECT_NE(message([&] { scaler.unscale_(optimizer); }).find("already been called"), std::string::npos);
    EXPECT_TRUE(scaler.step(optimizer));
    EXPECT_NE(message([&] { scaler.step(optimizer); }).find("already been called since the last update"),
              std::string::npos);
    scaler.update();
    EXPECT_FALSE(scaler.unscaled(optimizer));
    EXPECT_NE(message([&] { scaler.update(); }).find("no inf checks were recorded"), std::string::npos);
    ShardedGradScalerOptions bad;
    bad.backoff_factor = 1.5;
    EXPECT_NE(message([&] { validate(bad); }).find("backoff_factor must be between 0 and 1"), std::string::npos);
    ShardedGradScalerOptions off;
    off.enabled = false;
    ShardedGradScaler disabled(context.world(), off);
    auto loss = torch::tensor(3.0f);
    EXPECT_TRUE(disabled.scale(loss).is_same(loss));
    EXPECT_EQ(disabled.get_scale(), 1.0);
  });
}

}  // namespace
}  // namespace fsdp
