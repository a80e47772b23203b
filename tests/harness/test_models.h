// Small models for the engine tests. Their sizes are chosen so that dim 0 of most parameters is not
// divisible by 2, 3 or 4 ranks and some are smaller than the number of ranks (trailing ranks own
// nothing). Submodules are called through fsdp::forward, so any of them can be made a unit.
#pragma once

#include <fsdp/fsdp.h>
#include <torch/torch.h>

#include <cmath>
#include <memory>
#include <string>
#include <vector>

namespace fsdp::testing {

struct MlpBlockImpl : torch::nn::Module {
  MlpBlockImpl(int64_t width, int64_t hidden)
      : fc1(register_module("fc1", torch::nn::Linear(width, hidden))),
        fc2(register_module("fc2", torch::nn::Linear(hidden, width))) {}
  torch::Tensor forward(const torch::Tensor& input) {
    return input + fsdp::forward(fc2, torch::gelu(fsdp::forward(fc1, input)));
  }
  torch::nn::Linear fc1;
  torch::nn::Linear fc2;
};
TORCH_MODULE(MlpBlock);

/// torch.nn.Sequential(Linear(3, 5), Linear(5, 7), Linear(7, 3), Linear(3, 2, bias=False)), the model
/// of the DCP scripts in tests/python (dcp_fixture.py and those that import its build()), with the
/// same parameter names; every Linear can be made a unit.
struct FourLinearsImpl : torch::nn::Module {
  FourLinearsImpl()
      : first(register_module("0", torch::nn::Linear(3, 5))),
        second(register_module("1", torch::nn::Linear(5, 7))),
        third(register_module("2", torch::nn::Linear(7, 3))),
        fourth(register_module("3", torch::nn::Linear(torch::nn::LinearOptions(3, 2).bias(false)))) {}
  torch::Tensor forward(torch::Tensor x) {
    x = fsdp::forward(first, x);
    x = fsdp::forward(second, x);
    x = fsdp::forward(third, x);
    return fsdp::forward(fourth, x);
  }
  torch::nn::Linear first, second, third, fourth;
};
TORCH_MODULE(FourLinears);

/// input Linear(3 -> 5), `depth` residual blocks of Linear(5 -> 7) and Linear(7 -> 5), a head
/// Linear(5 -> 2), a one-element scale and a 0-dim temperature.
struct MlpStackImpl : torch::nn::Module {
  explicit MlpStackImpl(int64_t depth = 3)
      : input(register_module("input", torch::nn::Linear(3, 5))),
        head(register_module("head", torch::nn::Linear(5, 2))),
        scale(register_parameter("scale", torch::ones({1}))),
        temperature(register_parameter("temperature", torch::tensor(1.5))) {
    for (int64_t index = 0; index < depth; ++index) {
      blocks.push_back(register_module("blocks_" + std::to_string(index), MlpBlock(5, 7)));
    }
  }
  torch::Tensor forward(const torch::Tensor& x) {
    auto hidden = fsdp::forward(input, x);
    for (auto& block : blocks) hidden = fsdp::forward(block, hidden);
    return fsdp::forward(head, hidden) * scale / temperature;
  }
  torch::nn::Linear input;
  std::vector<MlpBlock> blocks;
  torch::nn::Linear head;
  torch::Tensor scale;
  torch::Tensor temperature;  // 0-dim
};
TORCH_MODULE(MlpStack);

/// Pre-norm transformer block: causal self-attention with 2 heads, then an MLP.
struct TransformerBlockImpl : torch::nn::Module {
  explicit TransformerBlockImpl(int64_t width)
      : width(width),
        attention_norm(register_module("attention_norm", torch::nn::LayerNorm(torch::nn::LayerNormOptions({width})))),
        // No bias: a key bias has a zero gradient in theory (softmax ignores a per-query constant), and
        // AdamW turns rounding noise in a zero gradient into full-size steps.
        qkv(register_module("qkv", torch::nn::Linear(torch::nn::LinearOptions(width, 3 * width).bias(false)))),
        projection(register_module("projection", torch::nn::Linear(width, width))),
        mlp_norm(register_module("mlp_norm", torch::nn::LayerNorm(torch::nn::LayerNormOptions({width})))),
        up(register_module("up", torch::nn::Linear(width, 10))),
        down(register_module("down", torch::nn::Linear(10, width))) {}
  torch::Tensor forward(const torch::Tensor& input) {
    const int64_t batch = input.size(0), length = input.size(1), heads = 2, head_width = width / heads;
    auto qkv_out = fsdp::forward(qkv, fsdp::forward(attention_norm, input));
    auto split = qkv_out.view({batch, length, 3, heads, head_width}).permute({2, 0, 3, 1, 4});
    auto scores = torch::matmul(split[0], split[1].transpose(-2, -1)) / std::sqrt(static_cast<double>(head_width));
    auto mask = torch::ones({length, length}, torch::kBool).triu(1);
    auto attention = torch::softmax(scores.masked_fill(mask, -1e9), -1);
    auto mixed = torch::matmul(attention, split[2]).transpose(1, 2).reshape({batch, length, width});
    auto hidden = input + fsdp::forward(projection, mixed);
    return hidden + fsdp::forward(down, torch::gelu(fsdp::forward(up, fsdp::forward(mlp_norm, hidden))));
  }
  int64_t width;
  torch::nn::LayerNorm attention_norm;
  torch::nn::Linear qkv;
  torch::nn::Linear projection;
  torch::nn::LayerNorm mlp_norm;
  torch::nn::Linear up;
  torch::nn::Linear down;
};
TORCH_MODULE(TransformerBlock);

/// An output projection that uses a weight owned elsewhere (weight tying by construction: a libtorch
/// module cannot re-register a parameter under an existing name).
struct TiedHeadImpl : torch::nn::Module {
  explicit TiedHeadImpl(const torch::Tensor& shared_weight) : weight(register_parameter("weight", shared_weight)) {}
  torch::Tensor forward(const torch::Tensor& input) { return torch::nn::functional::linear(input, weight); }
  torch::Tensor weight;
};
TORCH_MODULE(TiedHead);

/// Embedding(11 tokens, width 6), two blocks, a final LayerNorm and an output head whose weight
/// is the embedding's (tied) unless `tied` is false.
struct TinyTransformerImpl : torch::nn::Module, fsdp::PretrainedModel {
  explicit TinyTransformerImpl(bool tied = true, int64_t vocabulary = 11, int64_t width = 6, int64_t depth = 2)
      : embed_tokens(register_module("embed_tokens", torch::nn::Embedding(vocabulary, width))),
        norm(register_module("norm", torch::nn::LayerNorm(torch::nn::LayerNormOptions({width})))),
        lm_head(register_module("lm_head",
                                TiedHead(tied ? embed_tokens->weight : torch::randn({vocabulary, width}) * 0.3))) {
    for (int64_t index = 0; index < depth; ++index) {
      layers.push_back(register_module("layers_" + std::to_string(index), TransformerBlock(width)));
    }
  }
  torch::Tensor forward(const torch::Tensor& tokens) {
    auto hidden = fsdp::forward(embed_tokens, tokens);
    for (auto& layer : layers) hidden = fsdp::forward(layer, hidden);
    return fsdp::forward(lm_head, fsdp::forward(norm, hidden));
  }
  std::shared_ptr<torch::nn::Module> input_embeddings() override { return embed_tokens.ptr(); }
  std::shared_ptr<torch::nn::Module> output_embeddings() override { return lm_head.ptr(); }
  std::vector<std::string> no_split_modules() const override { return {"TransformerBlock"}; }
  void tie_weights() override { lm_head = replace_module("lm_head", TiedHead(embed_tokens->weight)); }

  torch::nn::Embedding embed_tokens;
  std::vector<TransformerBlock> layers;
  torch::nn::LayerNorm norm;
  TiedHead lm_head;
};
TORCH_MODULE(TinyTransformer);

/// Next-token pairs for TinyTransformer: `rows` sequences of 6 tokens from a vocabulary of 11, drawn
/// from `seed`; the inputs are tokens 0-4, the targets tokens 1-5. Each test file has its own seeds.
inline std::pair<torch::Tensor, torch::Tensor> token_batch(uint64_t seed, int64_t rows) {
  torch::manual_seed(seed);
  auto tokens = torch::randint(0, 11, {rows, 6});
  return {tokens.narrow(1, 0, 5), tokens.narrow(1, 1, 5)};
}

inline torch::Tensor next_token_loss(const torch::Tensor& logits, const torch::Tensor& targets) {
  return torch::nn::functional::cross_entropy(logits.reshape({-1, logits.size(-1)}), targets.reshape({-1}));
}

/// This rank's rows of a global batch (dim 0 divided evenly over the ranks).
inline torch::Tensor local_slice(const torch::Tensor& global, const DistributedContext& context) {
  const int64_t local = global.size(0) / context.world_size();
  return global.narrow(0, context.rank() * local, local);
}

/// The optimizer the engine and checkpoint tests train with.
inline torch::optim::AdamWOptions adamw_options() { return torch::optim::AdamWOptions(1e-2).weight_decay(0.1); }

}  // namespace fsdp::testing
