// Training parity with PyTorch FSDP2 itself: the same model, initial weights, global batches, AdamW
// and gradient clipping under fsdp.cpp's fully_shard and under torch.distributed.fsdp.fully_shard
// (CPU, gloo, the venv's torch; tests/python/fsdp2_parity.py is the Python half). The loss and the
// gradient norm of every step and the final weights must agree. Two models: an MLP whose first
// dimensions (5, 7, 2) do not divide evenly over 2-4 ranks, and our Llama against transformers'
// LlamaForCausalLM with the same config (GQA, untied). Cases: one rank (the models' own difference,
// without communication); reshard_after_forward true (FULL_SHARD) and false (SHARD_GRAD_OP) on 2, 3
// and 4 ranks; HYBRID_SHARD (and HYBRID_SHARD_ZERO2) on two simulated machines of two ranks against
// FSDP2 on a 2 x 2 device mesh; gradient accumulation (no gradient sync for the first micro-batch of
// two); bf16 parameters with fp32 reduction (MixedPrecisionPolicy). The Fsdp1_ cases run
// fsdp_version=1 through the Accelerator against PyTorch FSDP1 (FullyShardedDataParallel) as
// Accelerate builds it from the same plugin. Tolerances are at kTolerance's comment. The GpuCases
// run the same comparison on CUDA devices, one per rank, against FSDP2 over NCCL on the same GPU
// count (skipped where fewer GPUs are visible; scripts/gpu-check.sh runs them on a GPU machine).
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <map>

#include <nlohmann/json.hpp>

#include <fsdp/fsdp.h>
#include <fsdp/models/llama.h>

#include "harness/multi_rank.h"
#include "harness/python_peer.h"

namespace fsdp {
namespace {

constexpr int kParitySteps = 20;
constexpr int64_t kParityGlobalBatch = 24;  // rows per step: 12, 8 or 6 per rank, two micro-batches of them
constexpr int64_t kSequenceLength = 16;
// Below every step's gradient norm in every case, so that the clipping under test acts (checked).
constexpr double kMaxNorm = 0.05;

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

struct ParityCase {
  std::string name;
  bool llama = false;
  int world_size = 2;
  /// A bool, or FSDP2's int (hpZ: sharded over groups of that many ranks between forward and backward).
  ReshardAfterForward reshard_after_forward = true;
  /// HYBRID_SHARD over simulated machines of two ranks (FSDP2: a [world / 2, 2] device mesh).
  bool hybrid = false;
  int accumulation = 1;
  bool bf16 = false;
  /// fsdp_version=1 through the Accelerator (its FSDP1 units: the blocks and the root) against
  /// PyTorch FSDP1 as Accelerate builds it from the same plugin.
  bool fsdp1 = false;
  /// On cuda:<local rank> (the C++ side over NCCL, FSDP2 over NCCL), instead of the CPU and Gloo.
  bool gpu = false;
};
// ctest's test names (CMake 3.25) carry the printed parameter: the case's name keeps them stable.
void PrintTo(const ParityCase& parity, std::ostream* out) { *out << parity.name; }

std::string case_json(const ParityCase& parity) {
  nlohmann::json json;
  json["model"] = parity.llama ? "llama" : "mlp";
  json["reshard"] = parity.reshard_after_forward.is_group_size()
                        ? nlohmann::json(parity.reshard_after_forward.group_size())
                        : nlohmann::json(parity.reshard_after_forward.reshards());
  json["mesh"] = parity.hybrid ? std::vector<int>{parity.world_size / 2, 2} : std::vector<int>{};
  json["accumulation"] = parity.accumulation;
  json["bf16"] = parity.bf16;
  json["clip"] = kMaxNorm;
  json["fsdp1"] = parity.fsdp1;
  json["device"] = parity.gpu ? "cuda" : "cpu";
  return json.dump();
}

models::LlamaConfig parity_llama_config() {
  models::LlamaConfig config;
  config.vocab_size = 256;
  config.hidden_size = 64;
  config.intermediate_size = 96;
  config.num_hidden_layers = 2;
  config.num_attention_heads = 4;
  config.num_key_value_heads = 2;  // GQA
  config.max_position_embeddings = 64;
  config.rms_norm_eps = 1e-3;
  config.rope_theta = 777.0;
  config.tie_word_embeddings = false;
  return config;
}

// The model and its units in creation order (children, then the root), as build() in fsdp2_parity.py.
struct ParityModel {
  std::shared_ptr<torch::nn::Module> root;
  std::vector<std::shared_ptr<torch::nn::Module>> units;
  std::function<torch::Tensor(const torch::Tensor& x, const torch::Tensor& y)> loss;
};

ParityModel build_model(bool llama) {
  ParityModel built;
  if (llama) {
    models::LlamaForCausalLM model(parity_llama_config());
    for (auto& layer : model->model->decoder_layers) built.units.push_back(layer.ptr());
    built.root = model.ptr();
    built.loss = [model](const torch::Tensor& x, const torch::Tensor& /*y*/) mutable {
      const auto length = x.size(1) - 1;
      auto logits = fsdp::forward(model, x.narrow(1, 0, length)).to(torch::kFloat);
      return models::causal_lm_loss(logits, x.narrow(1, 1, length));
    };
  } else {
    ParityMlp model;
    built.units.push_back(model->input.ptr());
    for (auto& block : model->blocks) built.units.push_back(block.ptr());
    built.root = model.ptr();
    built.loss = [model](const torch::Tensor& x, const torch::Tensor& y) mutable {
      return torch::mse_loss(fsdp::forward(model, x).to(torch::kFloat), y);
    };
  }
  return built;
}

void write_inputs(const std::string& directory, const ParityCase& parity) {
  {
    std::ofstream file(directory + "/case.json");
    file << case_json(parity);
  }
  torch::manual_seed(0);
  auto model = build_model(parity.llama);
  std::vector<std::pair<std::string, at::Tensor>> initial;
  for (const auto& item : model.root->named_parameters()) {
    auto value = item.value().detach().clone();
    // Norm weights start at one: make them matter.
    if (item.key().find("norm.weight") != std::string::npos) value.uniform_(0.5, 1.5);
    initial.emplace_back(item.key(), value);
  }
  write_safetensors(directory + "/initial.safetensors", initial);
  if (parity.llama) {
    std::ofstream file(directory + "/config.json");
    file << parity_llama_config().to_json();
  }
  std::vector<std::pair<std::string, at::Tensor>> batches;
  const int64_t vocab = parity_llama_config().vocab_size;
  const auto successor = torch::randperm(vocab, torch::kLong);
  const auto target_map = torch::randn({3, 2});
  for (int step = 0; step < kParitySteps; ++step) {
    if (parity.llama) {
      // Each next token is a fixed permutation of the one before: a bigram the model can learn.
      auto tokens = torch::empty({kParityGlobalBatch, kSequenceLength + 1}, torch::kLong);
      tokens.select(1, 0).copy_(torch::randint(0, vocab, {kParityGlobalBatch}, torch::kLong));
      for (int64_t position = 1; position <= kSequenceLength; ++position) {
        tokens.select(1, position).copy_(successor.index_select(0, tokens.select(1, position - 1)));
      }
      batches.emplace_back("x." + std::to_string(step), tokens);
    } else {
      batches.emplace_back("x." + std::to_string(step), torch::randn({kParityGlobalBatch, 3}));
      // A linear map plus noise: the MLP can learn it.
      batches.emplace_back("y." + std::to_string(step),
                           torch::matmul(batches.back().second, target_map) + 0.1 * torch::randn({kParityGlobalBatch, 2}));
    }
  }
  write_safetensors(directory + "/batches.safetensors", batches);
}

void train_with_fsdp_cpp(const DistributedContext& context, const std::string& directory, const ParityCase& parity) {
  // The CPU cases stay on the CPU also on a machine with GPUs (the Accelerator would move the model
  // to its default device).
  if (!parity.gpu) ::setenv("FSDP_DEVICE", "cpu", 1);
  const c10::Device device = parity.gpu ? default_device(context.environment().local_rank) : c10::Device(c10::kCPU);
  auto model = build_model(parity.llama);
  {
    torch::NoGradGuard no_grad;
    SafetensorsReader initial(directory + "/initial.safetensors");
    for (auto& item : model.root->named_parameters()) item.value().copy_(initial.tensor(item.key()));
  }
  model.root->to(device);
  const auto adamw = torch::optim::AdamWOptions(1e-2).weight_decay(0.01);
  std::unique_ptr<torch::optim::AdamW> optimizer;
  std::optional<Accelerator> accelerator;
  if (parity.fsdp1) {
    // What Accelerate builds for fsdp_version=1 with these plugin fields.
    FullyShardedDataParallelPluginArgs args;
    args.fsdp_version = int64_t{1};
    args.sharding_strategy = std::string(static_cast<bool>(parity.reshard_after_forward) ? "FULL_SHARD" : "SHARD_GRAD_OP");
    args.auto_wrap_policy = std::string("transformer_based_wrap");
    args.transformer_cls_names_to_wrap = std::string(parity.llama ? "LlamaDecoderLayer" : "ParityBlock");
    if (parity.bf16) {
      args.mixed_precision_policy = std::map<std::string, c10::ScalarType>{
          {"param_dtype", torch::kBFloat16}, {"reduce_dtype", torch::kFloat}, {"buffer_dtype", torch::kBFloat16}};
    }
    AcceleratorOptions accelerator_options;
    accelerator_options.fsdp_plugin = FullyShardedDataParallelPlugin(args, EnvironmentMap{});
    accelerator.emplace(context, accelerator_options, EnvironmentMap{});
    optimizer = std::make_unique<torch::optim::AdamW>(model.root->parameters(), adamw);
    accelerator->prepare(model.root, *optimizer);
  } else {
    FullyShardOptions options;
    options.reshard_after_forward = parity.reshard_after_forward;
    if (parity.hybrid) {
      options.sharding_strategy =
          static_cast<bool>(parity.reshard_after_forward) ? ShardingStrategy::kHybridShard : ShardingStrategy::kHybridShardZero2;
    }
    if (parity.bf16) {
      options.mixed_precision.param_dtype = torch::kBFloat16;
      options.mixed_precision.reduce_dtype = torch::kFloat;
    }
    for (auto& unit : model.units) fully_shard(unit, context, options);
    fully_shard(model.root, context, options);
    optimizer = std::make_unique<torch::optim::AdamW>(model.root->parameters(), adamw);
  }
  const auto root = *fsdp_module_of(*model.root);
  SafetensorsReader batches(directory + "/batches.safetensors");
  const int64_t rows = kParityGlobalBatch / context.world_size();
  const int64_t micro = rows / parity.accumulation;
  std::vector<double> losses, norms;
  for (int step = 0; step < kParitySteps; ++step) {
    const auto x = batches.tensor("x." + std::to_string(step)).narrow(0, context.rank() * rows, rows).to(device);
    const auto y =
        parity.llama ? x : batches.tensor("y." + std::to_string(step)).narrow(0, context.rank() * rows, rows).to(device);
    auto total = torch::zeros({1}, torch::TensorOptions().device(device));
    for (int index = 0; index < parity.accumulation; ++index) {
      root.set_requires_gradient_sync(index == parity.accumulation - 1);
      auto loss = model.loss(x.narrow(0, index * micro, micro), y.narrow(0, index * micro, micro)) / parity.accumulation;
      loss.backward();
      total += loss.detach();
    }
    const double norm = clip_grad_norm_(*model.root, kMaxNorm);
    EXPECT_GT(norm, kMaxNorm) << "step " << step << ": the clipping under test did not act";
    norms.push_back(norm);
    optimizer->step();
    optimizer->zero_grad();
    all_reduce(context.world(), total);
    losses.push_back(total.item<double>() / static_cast<double>(context.world_size()));
  }
  StateDictConfig config;
  config.rank0_only = true;
  auto full = full_model_state_dict(*model.root, config);
  for (auto& entry : full) entry.second = entry.second.cpu();
  if (context.rank() == 0) {
    full.emplace_back("loss", torch::tensor(losses, torch::kDouble));
    full.emplace_back("norm", torch::tensor(norms, torch::kDouble));
    write_safetensors(directory + "/ours_result.safetensors", full);
  }
}

using Result = std::map<std::string, at::Tensor>;

Result read_result(const std::string& path) {
  Result result;
  for (auto& [name, tensor] : read_safetensors(path)) result[name] = tensor;
  return result;
}

double relative_difference(const Result& a, const Result& b, const std::string& series, int step) {
  const double x = a.at(series)[step].item<double>(), y = b.at(series)[step].item<double>();
  return std::abs(x - y) / std::abs(y);
}

// How far two runs ended apart: the largest relative difference of the per-step losses and gradient
// norms, and the largest absolute difference of a final weight.
struct Differences {
  double loss = 0;
  double norm = 0;
  double weight = 0;
};

Differences compare(const Result& ours, const Result& theirs) {
  Differences worst;
  EXPECT_EQ(ours.size(), theirs.size());
  for (const std::string series : {"loss", "norm"}) {
    EXPECT_TRUE(ours.count(series) && theirs.count(series)) << series;
    if (!ours.count(series) || !theirs.count(series)) return worst;
    const auto our_values = ours.at(series), their_values = theirs.at(series);
    EXPECT_EQ(our_values.numel(), kParitySteps) << series;
    EXPECT_EQ(their_values.numel(), kParitySteps) << series;
    for (int step = 0; step < std::min<int64_t>(kParitySteps, std::min(our_values.numel(), their_values.numel())); ++step) {
      auto& largest = series == "loss" ? worst.loss : worst.norm;
      largest = std::max(largest, relative_difference(ours, theirs, series, step));
    }
  }
  for (const auto& [name, tensor] : theirs) {
    if (name == "loss" || name == "norm") continue;
    EXPECT_TRUE(ours.count(name)) << name;
    if (!ours.count(name)) continue;
    EXPECT_EQ(ours.at(name).sizes(), tensor.sizes()) << name;
    EXPECT_EQ(ours.at(name).scalar_type(), tensor.scalar_type()) << name;
    if (ours.at(name).sizes() != tensor.sizes()) continue;
    worst.weight = std::max(worst.weight, (ours.at(name) - tensor).abs().max().item<double>());
  }
  return worst;
}

testing::PythonResult run_fsdp2(const std::string& directory, int world_size, const std::string& output) {
  testing::PythonOptions options;
  options.world_size = world_size;
  options.timeout = std::chrono::seconds(240);
  auto python = testing::run_python("fsdp2_parity.py", {directory, output}, options);
  if (python.ok) std::printf("%s", python.output[0].c_str());
  return python;
}

// fp32, and bf16 on the MLP: both sides run the same libtorch kernels on the same operations and
// differ only in the order of the additions of the gradient reduction: losses within 1e-5 relative
// and weights within 1e-5 (measured at most 9.4e-7 and 3.9e-6). The gradient norm gets 1e-4: as the
// Llama's loss falls from 5.5 to 0.13 its gradients shrink and their relative rounding grows
// (measured at most 9.8e-6).
//
// bf16 on the Llama: the two models (ours and transformers') round differently somewhere in the
// bf16 backward (step 0's gradient norm differs by about 1e-6 relative), and bf16 training amplifies
// one-ulp differences through AdamW and the bf16 casts of the updated weights: on one rank, with no
// communication at all, the two models end 1e-2 apart in loss. PyTorch FSDP2 against itself on 1 and
// on N ranks (the same global batches) spreads as far: measured 3e-2 (losses), 4e-2 (norms), 7e-2
// (weights). So this case runs FSDP2 on one rank too, in the same test, and requires fsdp.cpp to stay
// within 3x that spread of PyTorch against itself, and the first step, before any update, within
// the fp32 tolerances (measured: loss 0, norm 8e-7). The MLP case proves the mixed-precision semantics themselves to 1e-5.
//
// fp32 on the Llama over several ranks: the same amplification, smaller. The two models' one-ulp
// differences (step 0's gradient norm, 2e-8 relative) and the order of the ranks' additions grow
// through 20 AdamW steps by an amount that depends on the machine's kernels: on one machine (where
// the 1e-5 tolerances were set) the weights ended at most 3.9e-6 apart; on an AMD EPYC (OpenBLAS's
// Haswell kernels) at 4 ranks 4.4e-5, where PyTorch FSDP2 on 1 against 4 ranks spreads 2.7e-5 by
// itself. So these cases too are held to 3x PyTorch's own spread (and their first step to the fp32
// tolerances); one rank, with nothing to spread, keeps 1e-5.
constexpr double kTolerance = 1e-5;
constexpr double kNormTolerance = 1e-4;
constexpr double kSpreadFactor = 3.0;

class Fsdp2Parity : public ::testing::TestWithParam<ParityCase> {};

TEST_P(Fsdp2Parity, LossesNormsAndFinalWeightsMatchPyTorchFsdp2) {
  const auto parity = GetParam();
  if (parity.gpu && cuda_device_count() < parity.world_size) {
    GTEST_SKIP() << parity.name << " needs " << parity.world_size << " GPU(s), one per rank; this process sees "
                 << cuda_device_count() << (built_with_cuda() ? "" : " (a build without the GPU path)");
  }
  // FSDP2 on one rank is the reference spread: not for HSDP (its mesh needs 4 ranks) or FSDP1.
  const bool against_spread =
      parity.llama && ((parity.bf16) || (parity.world_size > 1 && !parity.hybrid && !parity.fsdp1));
  const auto directory = testing::shared_temporary_directory();
  if (!testing::is_rank_process()) {
    write_inputs(directory, parity);
    ASSERT_TRUE(run_fsdp2(directory, parity.world_size, "fsdp2_result.safetensors").ok);
    if (against_spread) {
      ASSERT_TRUE(run_fsdp2(directory, 1, "fsdp2_one_rank.safetensors").ok);
    }
  }
  auto rank_options = parity.hybrid ? testing::simulated_machines(2) : testing::MultiRankOptions{};
  rank_options.timeout = std::chrono::seconds(240);
  testing::run_on_ranks(
      parity.world_size, [&](const DistributedContext& context) { train_with_fsdp_cpp(context, directory, parity); },
      rank_options);
  if (testing::is_rank_process()) return;

  const auto theirs = read_result(directory + "/fsdp2_result.safetensors");
  const auto ours = read_result(directory + "/ours_result.safetensors");
  const auto worst = compare(ours, theirs);
  ASSERT_FALSE(HasFailure());
  EXPECT_LT(ours.at("loss")[kParitySteps - 1].item<double>(), ours.at("loss")[0].item<double>());  // it trained
  Differences allowed{kTolerance, kNormTolerance, kTolerance};
  if (against_spread) {
    const auto spread = compare(read_result(directory + "/fsdp2_one_rank.safetensors"), theirs);
    std::printf("FSDP2 on 1 against %d ranks: losses %.2e, norms %.2e (relative), weights %.2e (absolute)\n",
                parity.world_size, spread.loss, spread.norm, spread.weight);
    allowed = {std::max(kTolerance, kSpreadFactor * spread.loss), std::max(kNormTolerance, kSpreadFactor * spread.norm),
               std::max(kTolerance, kSpreadFactor * spread.weight)};
    EXPECT_LE(relative_difference(ours, theirs, "loss", 0), kTolerance) << "the first step";
    EXPECT_LE(relative_difference(ours, theirs, "norm", 0), kNormTolerance) << "the first step";
  }
  std::printf("%s: largest difference of the losses %.2e and gradient norms %.2e (relative), weights %.2e (absolute)\n",
              parity.name.c_str(), worst.loss, worst.norm, worst.weight);
  EXPECT_LE(worst.loss, allowed.loss) << "per-step loss, fsdp.cpp against FSDP2";
  EXPECT_LE(worst.norm, allowed.norm) << "per-step gradient norm, fsdp.cpp against FSDP2";
  EXPECT_LE(worst.weight, allowed.weight) << "final weights, fsdp.cpp against FSDP2";
  if (HasFailure()) {
    for (const std::string series : {"loss", "norm"}) {
      for (int step = 0; step < kParitySteps; ++step) {
        std::printf("%s[%d]: fsdp.cpp %.9g, FSDP2 %.9g\n", series.c_str(), step, ours.at(series)[step].item<double>(),
                    theirs.at(series)[step].item<double>());
      }
    }
  }
}

std::vector<ParityCase> parity_cases() {
  std::vector<ParityCase> cases;
  auto add = [&](bool llama, const std::string& name, int world_size, bool reshard, bool hybrid, int accumulation,
                 bool bf16) {
    cases.push_back({std::string(llama ? "Llama_" : "Mlp_") + name, llama, world_size, reshard, hybrid, accumulation, bf16});
  };
  for (const bool llama : {false, true}) {
    add(llama, "1ranks_reshard", 1, true, false, 1, false);  // one rank: the baseline without communication
    for (const int world_size : {2, 3, 4}) {
      for (const bool reshard : {true, false}) {
        add(llama, std::to_string(world_size) + "ranks_" + (reshard ? "reshard" : "noreshard"), world_size, reshard,
            false, 1, false);
      }
    }
    add(llama, "HybridShard2x2", 4, true, true, 1, false);
    // FSDP2's int reshard_after_forward (hpZ): sharded over pairs of ranks between forward and backward.
    add(llama, "4ranks_reshard2", 4, true, false, 1, false);
    cases.back().reshard_after_forward = 2;
    add(llama, "3ranks_GradientAccumulation", 3, true, false, 2, false);
    add(llama, "2ranks_Bf16ParamsFp32Reduce", 2, true, false, 1, true);
    // fsdp_version=1 against PyTorch FSDP1.
    auto fsdp1 = [&](const std::string& name, int world_size, bool reshard, int accumulation, bool bf16) {
      add(llama, "Fsdp1_" + name, world_size, reshard, false, accumulation, bf16);
      cases.back().fsdp1 = true;
    };
    fsdp1("2ranks_FullShard", 2, true, 1, false);
    if (!llama) {
      fsdp1("3ranks_ShardGradOp", 3, false, 1, false);
      fsdp1("3ranks_GradientAccumulation", 3, true, 2, false);
      fsdp1("2ranks_Bf16ParamsFp32Reduce", 2, true, 1, true);
    }
  }
  add(false, "HybridShardZero2_2x2", 4, false, true, 1, false);
  return cases;
}

INSTANTIATE_TEST_SUITE_P(Cases, Fsdp2Parity, ::testing::ValuesIn(parity_cases()),
                         [](const ::testing::TestParamInfo<ParityCase>& info) { return info.param.name; });

// On GPUs: one GPU (the engine on CUDA without communication), then 2, 4 and 8 (NCCL), each skipped
// where fewer GPUs are visible. fp32 (FULL_SHARD, SHARD_GRAD_OP) and bf16 parameters with fp32
// reduction.
std::vector<ParityCase> gpu_parity_cases() {
  std::vector<ParityCase> cases;
  for (const int gpus : {1, 2, 4, 8}) {
    for (const bool llama : {false, true}) {
      const std::string prefix = std::string(llama ? "Llama_" : "Mlp_") + std::to_string(gpus) + "gpus_";
      cases.push_back({prefix + "reshard", llama, gpus, true, false, 1, false});
      if (gpus > 1) cases.push_back({prefix + "noreshard", llama, gpus, false, false, 1, false});
      if (!llama) cases.push_back({prefix + "Bf16ParamsFp32Reduce", llama, gpus, true, false, 1, true});
    }
  }
  for (auto& parity : cases) parity.gpu = true;
  return cases;
}

INSTANTIATE_TEST_SUITE_P(GpuCases, Fsdp2Parity, ::testing::ValuesIn(gpu_parity_cases()),
                         [](const ::testing::TestParamInfo<ParityCase>& info) { return info.param.name; });

}  // namespace
}  // namespace fsdp
