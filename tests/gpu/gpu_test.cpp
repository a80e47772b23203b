// The GPU path on real GPUs (Note [The GPU path], docs/design.md): NCCL collectives and their byte
// counters, the engine on CUDA against the same training on the CPU, cpu_offload in pinned host
// memory, and fp16 with the sharded gradient scaler. Every test skips, saying why, where this
// process sees fewer GPUs than it needs (or the build has no GPU path); scripts/gpu-check.sh runs
// them on a GPU machine. Training parity with PyTorch FSDP2 on GPUs is GpuCases/Fsdp2Parity in
// tests/engine/fsdp2_parity_test.cpp.
#include <fsdp/fsdp.h>
#include <fsdp/models/llama.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cstdlib>

#include "harness/multi_rank.h"

namespace fsdp {
namespace {

#define SKIP_WITHOUT_GPUS(count)                                                                                  \
  if (cuda_device_count() < (count)) {                                                                            \
    GTEST_SKIP() << "needs " << (count) << " GPU(s); this process sees " << cuda_device_count()                   \
                 << (built_with_cuda() ? "" : " (this build has no GPU path: build it against a CUDA libtorch)"); \
  }

c10::Device rank_device(const DistributedContext& context) {
  return c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(context.environment().local_rank));
}

// ---------------------------------------------------------------------------------------------------
// Collectives over NCCL: the values of every collective and the bytes the counters report, the same
// formulas as on Gloo ((N-1)/N of the full buffer for all-gather and reduce-scatter).

TEST(GpuCollectives, NcclMovesTheValuesAndBytesTheCountersSay) {
  SKIP_WITHOUT_GPUS(2);
  const int world = static_cast<int>(std::min<int64_t>(cuda_device_count(), 4));
  testing::run_on_ranks(world, [](const DistributedContext& context) {
    const auto device = rank_device(context);
    const int64_t n = context.world_size(), r = context.rank();
    const auto& group = context.world();
    group.reset_bytes_sent();
    const auto options = torch::TensorOptions().device(device);
    // all_gather: rank r contributes [r, r + 0.5, r + 1]; bf16 too.
    for (const auto dtype : {torch::kFloat, torch::kBFloat16}) {
      auto input = (torch::arange(3, options.dtype(torch::kFloat)) * 0.5 + r).to(dtype);
      auto output = torch::empty({3 * n}, options.dtype(dtype));
      all_gather(group, output, input);
      for (int64_t peer = 0; peer < n; ++peer) {
        EXPECT_TRUE(
            torch::equal(output.narrow(0, 3 * peer, 3).cpu(), (torch::arange(3, torch::kFloat) * 0.5 + peer).to(dtype)))
            << "all_gather of " << dtype << ": rank " << peer << "'s part";
      }
    }
    const int64_t gathered_bytes = (n - 1) * 3 * 4 + (n - 1) * 3 * 2;
    EXPECT_EQ(group.bytes_sent().all_gather, gathered_bytes);
    // reduce_scatter with FSDP's divide factors: the mean over ranks of (rank + 1) * index.
    auto full = (torch::arange(4 * n, options.dtype(torch::kFloat)) * (r + 1));
    auto shard = torch::empty({4}, options);
    ReduceScatterOptions reduce_options;
    reduce_options.pre_divide_factor = 2.0;
    reduce_options.post_divide_factor = static_cast<double>(n) / 2.0;
    reduce_scatter(group, shard, full, reduce_options);
    const double rank_sum = static_cast<double>(n * (n + 1)) / 2.0;
    auto expected = torch::arange(4 * r, 4 * r + 4, torch::kFloat) * rank_sum / static_cast<double>(n);
    EXPECT_TRUE(torch::allclose(shard.cpu(), expected, 1e-6, 1e-5)) << shard.cpu() << " vs " << expected;
    EXPECT_EQ(group.bytes_sent().reduce_scatter, (n - 1) * 4 * 4);
    // all_reduce: sum and max of doubles (what clip_grad_norm_ reduces), and bool ("any rank").
    auto total = torch::full({2}, static_cast<double>(r + 1), options.dtype(torch::kDouble));
    all_reduce(group, total);
    EXPECT_DOUBLE_EQ(total[0].item<double>(), rank_sum);
    auto largest = torch::full({1}, static_cast<double>(r), options.dtype(torch::kDouble));
    all_reduce(group, largest, ReduceOp::kMax);
    EXPECT_DOUBLE_EQ(largest.item<double>(), static_cast<double>(n - 1));
    auto any = torch::full({1}, r == n - 1, options.dtype(torch::kBool));
    all_reduce(group, any);
    EXPECT_TRUE(any.item<bool>());
    // broadcast from the last rank, as bytes.
    auto value = torch::full({5}, static_cast<float>(r), options);
    broadcast(group, value, n - 1);
    EXPECT_TRUE(torch::equal(value.cpu(), torch::full({5}, static_cast<float>(n - 1))));
    // Asynchronous work: the host is not blocked, the result is there after wait().
    auto output = torch::empty({2 * n}, options);
    auto work = all_gather_async(group, output, torch::full({2}, static_cast<float>(r), options));
    work.wait();
    EXPECT_EQ(output.sum().item<float>(), 2.0f * static_cast<float>(rank_sum - n));
    // A CPU buffer beside a GPU buffer is a named error, not a crash.
    try {
      all_gather(group, torch::empty({2 * n}), torch::zeros({2}, options));
      ADD_FAILURE() << "mixed devices were accepted";
    } catch (const c10::Error& error) {
      EXPECT_NE(std::string(error.what()).find("put both on the device"), std::string::npos) << error.what();
    }
  });
}

// ---------------------------------------------------------------------------------------------------
// The engine on CUDA.

models::LlamaConfig small_llama() {
  models::LlamaConfig config;
  config.vocab_size = 256;
  config.hidden_size = 64;
  config.intermediate_size = 128;
  config.num_hidden_layers = 3;
  config.num_attention_heads = 4;
  config.num_key_value_heads = 2;
  config.tie_word_embeddings = false;
  return config;
}

struct RunOptions {
  c10::Device device = c10::kCPU;
  bool offload = false;
  bool bf16 = false;
  int steps = 6;
};

// Trains the small Llama under fully_shard (every decoder layer a unit, then the root) and returns
// each step's loss; same seed, same batches on every device.
std::vector<double> train_llama(const DistributedContext& context, const RunOptions& run,
                                std::vector<torch::Tensor>* parameters_after = nullptr) {
  torch::manual_seed(7);
  models::LlamaForCausalLM model(small_llama());
  model->to(run.device);
  FullyShardOptions options;
  options.offload_policy.offload_params = run.offload;
  if (run.bf16) {
    options.mp_policy.param_dtype = torch::kBFloat16;
    options.mp_policy.reduce_dtype = torch::kFloat;
  }
  for (auto& layer : model->model->decoder_layers) fully_shard(layer.ptr(), context, options);
  fully_shard(model.ptr(), context, options);
  if (run.offload) {
    for (const auto& parameter : model->parameters()) {
      EXPECT_TRUE(parameter.device().is_cpu()) << "an offloaded shard is on " << parameter.device();
      EXPECT_TRUE(parameter.is_pinned()) << "an offloaded shard is not in pinned memory";
    }
  }
  torch::optim::AdamW optimizer(model->parameters(), torch::optim::AdamWOptions(1e-2));
  torch::manual_seed(11);
  std::vector<double> losses;
  for (int step = 0; step < run.steps; ++step) {
    // The unit computes on the GPU under offload even when the model was built on the CPU.
    const auto compute = run.offload ? default_device(context.environment().local_rank) : run.device;
    auto tokens = torch::randint(0, 256, {4, 33}, torch::kLong).to(compute);
    auto logits = fsdp::forward(model, tokens.narrow(1, 0, 32));
    auto loss = models::causal_lm_loss(logits, tokens.narrow(1, 1, 32));
    loss.backward();
    for (const auto& parameter : model->parameters()) {
      if (!parameter.grad().defined()) continue;
      EXPECT_EQ(parameter.grad().device(), parameter.device()) << "a sharded gradient is not beside its shard";
    }
    optimizer.step();
    optimizer.zero_grad();
    losses.push_back(loss.item<double>());
  }
  if (parameters_after) {
    for (const auto& parameter : model->parameters()) parameters_after->push_back(parameter.detach().cpu().clone());
  }
  return losses;
}

void expect_close(const std::vector<double>& actual, const std::vector<double>& expected, double relative,
                  const std::string& what) {
  ASSERT_EQ(actual.size(), expected.size());
  for (size_t step = 0; step < actual.size(); ++step) {
    EXPECT_NEAR(actual[step], expected[step], relative * std::abs(expected[step])) << what << ", step " << step;
  }
}

// One GPU: the same training on cuda:0 and on the CPU. fp32 matmuls on the GPU (no TF32: libtorch's
// default) differ from the CPU's only in summation order, so the losses stay within 1e-4.
TEST(GpuEngine, TrainsTheLlamaOnTheGpuAsOnTheCpu) {
  SKIP_WITHOUT_GPUS(1);
  testing::run_on_ranks(1, [](const DistributedContext& context) {
    const auto on_cpu = train_llama(context, {c10::kCPU});
    const auto on_gpu = train_llama(context, {rank_device(context)});
    expect_close(on_gpu, on_cpu, 1e-4, "fp32 on cuda:0 against the CPU");
    EXPECT_LT(on_gpu.back(), on_gpu.front());
    // bf16 parameters with fp32 reduction: looser, bf16 rounds differently on the two devices.
    RunOptions bf16_gpu{rank_device(context)};
    bf16_gpu.bf16 = true;
    RunOptions bf16_cpu{c10::kCPU};
    bf16_cpu.bf16 = true;
    expect_close(train_llama(context, bf16_gpu), train_llama(context, bf16_cpu), 3e-2,
                 "bf16 on cuda:0 against the CPU");
  });
}

// cpu_offload: shards (pinned) and gradients in host memory, compute on the GPU, the optimizer step
// on the host: the same arithmetic as without offload.
TEST(GpuEngine, CpuOffloadKeepsShardsInPinnedHostMemoryAndTrainsAsWithout) {
  SKIP_WITHOUT_GPUS(1);
  testing::run_on_ranks(std::min<int>(static_cast<int>(cuda_device_count()), 2), [](const DistributedContext& context) {
    std::vector<torch::Tensor> without_offload, with_offload;
    RunOptions plain{rank_device(context)};
    const auto expected = train_llama(context, plain, &without_offload);
    RunOptions offloaded{rank_device(context)};
    offloaded.offload = true;
    const auto losses = train_llama(context, offloaded, &with_offload);
    // The AdamW step runs on the host under offload, on the GPU without: same formula, other kernels.
    expect_close(losses, expected, 1e-5, "cpu_offload against no offload");
    ASSERT_EQ(with_offload.size(), without_offload.size());
    for (size_t index = 0; index < with_offload.size(); ++index) {
      EXPECT_TRUE(torch::allclose(with_offload[index], without_offload[index], 1e-4, 1e-5)) << "parameter " << index;
    }
  });
}

// A model on the CPU with cpu_offload computes on this rank's GPU (default_device), as FSDP2
// computes on its mesh's device.
TEST(GpuEngine, AnOffloadedModelBuiltOnTheCpuComputesOnTheGpu) {
  SKIP_WITHOUT_GPUS(1);
  testing::run_on_ranks(1, [](const DistributedContext& context) {
    RunOptions from_cpu{c10::kCPU};
    from_cpu.offload = true;
    RunOptions from_gpu{rank_device(context)};
    from_gpu.offload = true;
    expect_close(train_llama(context, from_cpu), train_llama(context, from_gpu), 1e-6,
                 "an offloaded model built on the CPU against one built on the GPU");
  });
}

// fp16 parameters with the sharded gradient scaler: scaled losses, a step with an inf gradient is
// skipped on every rank and halves the scale, the others step and the scale grows after
// growth_interval clean steps.
TEST(GpuEngine, Fp16TrainingWithTheShardedGradScalerSkipsStepsWithInfs) {
  SKIP_WITHOUT_GPUS(1);
  testing::run_on_ranks(std::min<int>(static_cast<int>(cuda_device_count()), 2), [](const DistributedContext& context) {
    torch::manual_seed(3);
    models::LlamaForCausalLM model(small_llama());
    model->to(rank_device(context));
    FullyShardOptions options;
    options.mp_policy.param_dtype = torch::kHalf;
    options.mp_policy.reduce_dtype = torch::kFloat;
    for (auto& layer : model->model->decoder_layers) fully_shard(layer.ptr(), context, options);
    fully_shard(model.ptr(), context, options);
    torch::optim::AdamW optimizer(model->parameters(), torch::optim::AdamWOptions(1e-3));
    ShardedGradScalerOptions scaler_options;
    scaler_options.init_scale = 1024.0;
    scaler_options.growth_interval = 2;
    ShardedGradScaler scaler(context.world(), scaler_options);
    torch::manual_seed(5 + context.rank());
    double first_loss = 0, last_loss = 0;
    for (int step = 0; step < 8; ++step) {
      auto tokens = torch::randint(0, 256, {4, 33}, torch::kLong).to(rank_device(context));
      auto logits = fsdp::forward(model, tokens.narrow(1, 0, 32));
      auto loss = models::causal_lm_loss(logits, tokens.narrow(1, 1, 32));
      scaler.scale(loss).backward();
      if (step == 3 && context.rank() == 0) {
        // One rank's gradient overflows: every rank must skip the step.
        model->parameters().front().mutable_grad().view(-1)[0] = std::numeric_limits<float>::infinity();
      }
      const double scale_before = scaler.get_scale();
      const bool stepped = scaler.step(optimizer);
      scaler.update();
      EXPECT_EQ(stepped, step != 3) << "step " << step;
      if (step == 3) {
        EXPECT_DOUBLE_EQ(scaler.get_scale(), scale_before * 0.5);
      }
      optimizer.zero_grad();
      if (step == 0) first_loss = loss.item<double>();
      last_loss = loss.item<double>();
    }
    EXPECT_GT(scaler.get_scale(), 1024.0 * 0.5) << "the scale grew again after the skipped step";
    EXPECT_LT(last_loss, first_loss);
  });
}

}  // namespace
}  // namespace fsdp
