// Benchmark: one training step of an MLP-block model under FSDP, per rank: median step time, bytes
// sent per step against the (N-1)/N theory, and the bytes of parameters, gradients and optimizer state
// each rank holds against 16 bytes/parameter / N. Run under `fsdp launch`; prints one JSON line on
// rank 0. `--strategy SINGLE` runs the whole global batch in one process without FSDP (the compute
// floor). bench/ddp_peer.py is the same model under PyTorch's DDP.
//
//   fsdp launch --nproc-per-node 2 -- build/bin/step_bench --strategy FULL_SHARD
#include <fsdp/fsdp.h>

#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <iostream>
#include <sys/resource.h>

namespace {

struct BlockImpl : torch::nn::Module {
  BlockImpl(int64_t width, int64_t hidden)
      : up(register_module("up", torch::nn::Linear(width, hidden))),
        down(register_module("down", torch::nn::Linear(hidden, width))) {}
  torch::Tensor forward(const torch::Tensor& x) { return x + fsdp::forward(down, torch::gelu(fsdp::forward(up, x))); }
  torch::nn::Linear up, down;
};
TORCH_MODULE(Block);

struct StackImpl : torch::nn::Module {
  StackImpl(int64_t width, int64_t hidden, int64_t blocks) {
    for (int64_t index = 0; index < blocks; ++index) {
      layers.push_back(register_module("block" + std::to_string(index), Block(width, hidden)));
    }
  }
  torch::Tensor forward(torch::Tensor x) {
    for (auto& layer : layers) x = fsdp::forward(layer, x);
    return x;
  }
  std::vector<Block> layers;
};
TORCH_MODULE(Stack);

int64_t bytes_of(const torch::Tensor& tensor) { return tensor.defined() ? tensor.numel() * tensor.element_size() : 0; }

}  // namespace

int main(int argc, char** argv) {
  std::string strategy = "FULL_SHARD";
  int64_t steps = 10, width = 512, hidden = 2048, blocks = 8, batch = 64;
  for (int index = 1; index + 1 < argc; index += 2) {
    const std::string flag = argv[index], value = argv[index + 1];
    if (flag == "--strategy") strategy = value;
    else if (flag == "--steps") steps = std::stoll(value);
    else if (flag == "--width") width = std::stoll(value);
    else if (flag == "--hidden") hidden = std::stoll(value);
    else if (flag == "--blocks") blocks = std::stoll(value);
    else if (flag == "--batch") batch = std::stoll(value);
    else {
      std::cerr << "usage: step_bench [--strategy FULL_SHARD|SHARD_GRAD_OP|NO_SHARD|SINGLE] [--steps N] [--width W] "
                   "[--hidden H] [--blocks B] [--batch GLOBAL]\n";
      return 2;
    }
  }
  try {
    auto context = fsdp::DistributedContext::initialize_from_environment();
    const bool single = strategy == "SINGLE";
    const int64_t world = single ? 1 : context.world_size();
    torch::manual_seed(0);
    Stack model(width, hidden, blocks);
    int64_t parameters = 0;
    for (const auto& parameter : model->parameters()) parameters += parameter.numel();
    if (!single) {
      fsdp::FullyShardOptions options;
      options.sharding_strategy = fsdp::parse_sharding_strategy(strategy, "--strategy", "the command line");
      for (auto& layer : model->layers) fsdp::fully_shard(layer.ptr(), context, options);
      fsdp::fully_shard(model.ptr(), context, options);
    }
    torch::optim::AdamW optimizer(model->parameters(), torch::optim::AdamWOptions(1e-4));
    const auto input = torch::randn({batch / world, width});
    std::vector<double> times;
    int64_t bytes_before = 0;
    for (int64_t step = 0; step < steps + 2; ++step) {
      if (step == 2) bytes_before = context.world().bytes_sent().total();
      if (!single) fsdp::barrier(context.world());
      const auto start = std::chrono::steady_clock::now();
      fsdp::forward(model, input).pow(2).mean().backward();
      optimizer.step();
      optimizer.zero_grad();
      if (!single) fsdp::barrier(context.world());
      if (step >= 2) times.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
    }
    const int64_t bytes_per_step = (context.world().bytes_sent().total() - bytes_before) / steps;
    // What this rank holds: the parameters' storage (shards), their gradients and AdamW's two moments.
    int64_t state_bytes = 0;
    for (const auto& parameter : model->parameters()) {
      state_bytes += static_cast<int64_t>(parameter.storage().nbytes()) + bytes_of(parameter.grad());
      auto found = optimizer.state().find(c10::guts::to_string(parameter.unsafeGetTensorImpl()));
      if (found != optimizer.state().end()) {
        auto& adam = static_cast<torch::optim::AdamWParamState&>(*found->second);
        state_bytes += bytes_of(adam.exp_avg()) + bytes_of(adam.exp_avg_sq());
      }
    }
    std::sort(times.begin(), times.end());
    const double factor = strategy == "FULL_SHARD" ? 3.0 : 2.0;
    const double theory = single ? 0.0 : factor * (world - 1) / world * parameters * 4.0;
    struct rusage usage {};
    ::getrusage(RUSAGE_SELF, &usage);
    if (context.rank() == 0) {
      std::printf("{\"benchmark\": \"step\", \"peer\": \"fsdp.cpp\", \"strategy\": \"%s\", \"world_size\": %lld, "
                  "\"parameters\": %lld, \"median_step_s\": %.4f, \"bytes_sent_per_step\": %lld, "
                  "\"bytes_theory\": %.0f, \"model_state_bytes_per_rank\": %lld, \"model_state_formula\": %.0f, "
                  "\"peak_rss_mb\": %.1f}\n",
                  strategy.c_str(), static_cast<long long>(world), static_cast<long long>(parameters),
                  times[times.size() / 2], static_cast<long long>(bytes_per_step), theory,
                  static_cast<long long>(state_bytes),
                  16.0 * parameters / (strategy == "NO_SHARD" || single ? 1 : world), usage.ru_maxrss / 1024.0);
    }
  } catch (const c10::Error& error) {
    std::cerr << "step_bench: " << error.what_without_backtrace() << "\n";
    return 1;
  }
  return 0;
}
