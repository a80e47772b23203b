// A Llama-architecture causal language model in libtorch whose parameter names, shapes and
// arithmetic are Hugging Face transformers' LlamaForCausalLM: RMSNorm, rotary embeddings with the
// rotate_half convention, SwiGLU MLP, grouped-query causal attention, no biases, tied or untied
// embeddings. Submodules are called through fsdp::forward, so any of them can be an FSDP unit.
#pragma once

#include <fsdp/fully_shard.h>
#include <fsdp/pretrained_model.h>
#include <torch/torch.h>

#include <memory>
#include <string>
#include <vector>

namespace fsdp::models {

/// Hugging Face's LlamaConfig fields (config.json).
struct LlamaConfig {
  int64_t vocab_size = 256;
  int64_t hidden_size = 64;
  int64_t intermediate_size = 172;
  int64_t num_hidden_layers = 2;
  int64_t num_attention_heads = 4;
  int64_t num_key_value_heads = 2;
  int64_t max_position_embeddings = 512;
  double rms_norm_eps = 1e-5;
  double rope_theta = 10000.0;
  bool tie_word_embeddings = true;
  double initializer_range = 0.02;

  int64_t head_dim() const { return hidden_size / num_attention_heads; }
  /// Throws naming the field when the shapes cannot work.
  void validate() const;
  /// config.json text as transformers writes it (architectures, model_type, hidden_act, torch_dtype...).
  std::string to_json() const;
  /// Parses config.json text; `source` names the file in errors.
  static LlamaConfig from_json(const std::string& text, const std::string& source);
  /// Named sizes: "tiny" (default, trains visibly in minutes on 2 CPU ranks), "small", "medium",
  /// "large" (0.54 B parameters: trains on four CPU ranks, never whole in one), and Meta's shapes
  /// "llama3-1b", "llama3-8b", "llama3-70b" (for estimates; their rope scaling is not modelled).
  static LlamaConfig preset(const std::string& name);
};

struct LlamaRMSNormImpl : torch::nn::Module {
  LlamaRMSNormImpl(int64_t hidden_size, double eps);
  torch::Tensor forward(const torch::Tensor& hidden);
  torch::Tensor weight;
  double eps;
};
TORCH_MODULE(LlamaRMSNorm);

struct LlamaAttentionImpl : torch::nn::Module {
  explicit LlamaAttentionImpl(const LlamaConfig& config);
  torch::Tensor forward(const torch::Tensor& hidden);
  LlamaConfig config;
  torch::nn::Linear q_proj{nullptr}, k_proj{nullptr}, v_proj{nullptr}, o_proj{nullptr};
};
TORCH_MODULE(LlamaAttention);

struct LlamaMLPImpl : torch::nn::Module {
  explicit LlamaMLPImpl(const LlamaConfig& config);
  torch::Tensor forward(const torch::Tensor& hidden);
  torch::nn::Linear gate_proj{nullptr}, up_proj{nullptr}, down_proj{nullptr};
};
TORCH_MODULE(LlamaMLP);

struct LlamaDecoderLayerImpl : torch::nn::Module {
  explicit LlamaDecoderLayerImpl(const LlamaConfig& config);
  torch::Tensor forward(const torch::Tensor& hidden);
  LlamaAttention self_attn{nullptr};
  LlamaMLP mlp{nullptr};
  LlamaRMSNorm input_layernorm{nullptr}, post_attention_layernorm{nullptr};
};
TORCH_MODULE(LlamaDecoderLayer);

struct LlamaModelImpl : torch::nn::Module {
  explicit LlamaModelImpl(const LlamaConfig& config);
  torch::Tensor forward(const torch::Tensor& input_ids);
  torch::nn::Embedding embed_tokens{nullptr};
  torch::nn::ModuleList layers{nullptr};
  std::vector<LlamaDecoderLayer> decoder_layers;
  LlamaRMSNorm norm{nullptr};
};
TORCH_MODULE(LlamaModel);

/// The output projection; with tied embeddings its weight is the embedding's.
struct LlamaLMHeadImpl : torch::nn::Module {
  explicit LlamaLMHeadImpl(const torch::Tensor& weight);
  torch::Tensor forward(const torch::Tensor& hidden);
  torch::Tensor weight;
};
TORCH_MODULE(LlamaLMHead);

struct LlamaForCausalLMImpl : torch::nn::Module, PretrainedModel {
  explicit LlamaForCausalLMImpl(const LlamaConfig& config);
  /// Logits [batch, length, vocab_size] for token ids [batch, length].
  torch::Tensor forward(const torch::Tensor& input_ids);
  std::shared_ptr<torch::nn::Module> input_embeddings() override { return model->embed_tokens.ptr(); }
  std::shared_ptr<torch::nn::Module> output_embeddings() override { return lm_head.ptr(); }
  std::string base_model_prefix() const override { return "model"; }
  std::vector<std::string> no_split_modules() const override { return {"LlamaDecoderLayer"}; }
  /// The constructor's initialization, one module at a time: normal(0, initializer_range) for the
  /// projections, the embedding and an untied head, ones for the norms.
  bool init_weights(torch::nn::Module& module) override;
  LlamaConfig config;
  LlamaModel model{nullptr};
  LlamaLMHead lm_head{nullptr};
};
TORCH_MODULE(LlamaForCausalLM);

/// Mean next-token cross entropy of `logits` [batch, length, vocab] against `targets` [batch, length].
torch::Tensor causal_lm_loss(const torch::Tensor& logits, const torch::Tensor& targets);

}  // namespace fsdp::models
