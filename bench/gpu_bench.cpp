// GPU benchmark: a Llama of about 1.1B parameters (TinyLlama's shape: hidden 2048, 22 layers, 32
// heads, 4 key-value heads, intermediate 5632, vocabulary 32000, untied) trained under fully_shard
// on cuda:<LOCAL_RANK>, bf16 parameters with fp32 reduction, every decoder layer a unit, AdamW.
// bench/gpu_peer.py is the same model (transformers' LlamaForCausalLM, eager attention as ours)
// under PyTorch FSDP2 with the same settings; scripts/gpu-check.sh runs both in the same check.
// Run under `fsdp launch`; rank 0 writes one JSON line (--json FILE, and stdout):
//   side, gpus, parameters, tokens_per_step, step_seconds (median), tokens_per_second (all GPUs),
//   peak_memory_bytes (rank 0, torch.cuda.max_memory_allocated's measure), mfu, losses.
// MFU = tokens/s x (6 x parameters + 12 x layers x hidden x sequence) / (GPUs x peak bf16 FLOP/s),
// the PaLM paper's count; the peak is --peak-tflops (default 989.5, an H100/H200 SXM's dense bf16).
//
//   fsdp launch --nproc-per-node 1 -- build/bin/gpu_bench [--steps 10] [--warmup 3] [--batch 8]
//       [--sequence 1024] [--layers 22] [--json out.json] [--peak-tflops 989.5]
#include <fsdp/fsdp.h>
#include <fsdp/models/llama.h>
#include <torch/cuda.h>
#include <torch/torch.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <string>

int main(int argc, char** argv) {
  CLI::App app{"fsdp.cpp GPU benchmark: a 1.1B Llama under fully_shard"};
  int steps = 10, warmup = 3;
  int64_t batch = 8, sequence = 1024, layers = 22;
  double peak_tflops = 989.5;
  std::string json_path;
  app.add_option("--steps", steps, "timed steps")->check(CLI::PositiveNumber);
  app.add_option("--warmup", warmup, "untimed steps first")->check(CLI::NonNegativeNumber);
  app.add_option("--batch", batch, "sequences per rank per step")->check(CLI::PositiveNumber);
  app.add_option("--sequence", sequence, "tokens per sequence")->check(CLI::PositiveNumber);
  app.add_option("--layers", layers, "decoder layers (22: 1.1B parameters)")->check(CLI::PositiveNumber);
  app.add_option("--peak-tflops", peak_tflops, "the GPU's dense bf16 peak, for MFU")->check(CLI::PositiveNumber);
  app.add_option("--json", json_path, "also write the result line here (rank 0)");
  CLI11_PARSE(app, argc, argv);
  try {
    auto context = fsdp::DistributedContext::initialize_from_environment();
    const auto device = fsdp::default_device(context.environment().local_rank);
    TORCH_CHECK(device.is_cuda(), "gpu_bench: rank ", context.rank(), " has no GPU (default_device is ", device,
                "); run it on a machine with one GPU per rank and a CUDA build of fsdp.cpp");
    fsdp::models::LlamaConfig config;
    config.vocab_size = 32000;
    config.hidden_size = 2048;
    config.intermediate_size = 5632;
    config.num_hidden_layers = layers;
    config.num_attention_heads = 32;
    config.num_key_value_heads = 4;
    config.max_position_embeddings = std::max<int64_t>(2048, sequence);
    config.tie_word_embeddings = false;
    torch::manual_seed(0);
    fsdp::models::LlamaForCausalLM model(config);
    model->to(device);
    int64_t parameters = 0;
    for (const auto& parameter : model->parameters()) parameters += parameter.numel();
    fsdp::FullyShardOptions options;
    options.mp_policy.param_dtype = torch::kBFloat16;
    options.mp_policy.reduce_dtype = torch::kFloat;
    for (auto& layer : model->model->decoder_layers) fsdp::fully_shard(layer.ptr(), context, options);
    fsdp::fully_shard(model.ptr(), context, options);
    torch::optim::AdamW optimizer(model->parameters(), torch::optim::AdamWOptions(1e-4));
    torch::manual_seed(1 + context.rank());
    std::vector<double> step_seconds, losses;
    fsdp::reset_peak_device_memory(device);
    for (int step = 0; step < warmup + steps; ++step) {
      auto tokens = torch::randint(0, config.vocab_size, {batch, sequence + 1}, torch::kLong).to(device);
      torch::cuda::synchronize(device.index());
      const auto start = std::chrono::steady_clock::now();
      auto logits = fsdp::forward(model, tokens.narrow(1, 0, sequence));
      auto loss = fsdp::models::causal_lm_loss(logits, tokens.narrow(1, 1, sequence));
      loss.backward();
      optimizer.step();
      optimizer.zero_grad();
      torch::cuda::synchronize(device.index());
      const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      if (step >= warmup) step_seconds.push_back(seconds);
      losses.push_back(loss.item<double>());
    }
    // The slowest rank sets the pace: every rank's median, the largest kept.
    std::sort(step_seconds.begin(), step_seconds.end());
    auto median = torch::tensor({step_seconds[step_seconds.size() / 2]}, torch::kDouble);
    fsdp::all_reduce(context.control(), median, fsdp::ReduceOp::kMax);
    const double step_time = median.item<double>();
    const int64_t gpus = context.world_size();
    const double tokens_per_step = static_cast<double>(batch * sequence * gpus);
    const double tokens_per_second = tokens_per_step / step_time;
    const double flops_per_token =
        6.0 * static_cast<double>(parameters) + 12.0 * static_cast<double>(layers * config.hidden_size * sequence);
    const double mfu = tokens_per_second * flops_per_token / (static_cast<double>(gpus) * peak_tflops * 1e12);
    if (context.rank() == 0) {
      std::string line = "{\"side\": \"fsdp_cpp\", \"gpus\": " + std::to_string(gpus) +
                         ", \"parameters\": " + std::to_string(parameters) +
                         ", \"tokens_per_step\": " + std::to_string(static_cast<int64_t>(tokens_per_step)) +
                         ", \"step_seconds\": " + std::to_string(step_time) +
                         ", \"tokens_per_second\": " + std::to_string(tokens_per_second) +
                         ", \"peak_memory_bytes\": " + std::to_string(fsdp::peak_device_memory_bytes(device)) +
                         ", \"mfu\": " + std::to_string(mfu) + ", \"loss_first\": " + std::to_string(losses.front()) +
                         ", \"loss_last\": " + std::to_string(losses.back()) + ", \"batch\": " + std::to_string(batch) +
                         ", \"sequence\": " + std::to_string(sequence) + ", \"layers\": " + std::to_string(layers) +
                         "}";
      std::cout << line << std::endl;
      if (!json_path.empty()) std::ofstream(json_path) << line << "\n";
    }
  } catch (const std::exception& error) {
    std::cerr << "gpu_bench: " << error.what() << std::endl;
    return 1;
  }
  return 0;
}
