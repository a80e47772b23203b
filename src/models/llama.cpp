#include <fsdp/models/llama.h>

#include <cmath>
#include <nlohmann/json.hpp>

namespace fsdp::models {
namespace {

/// transformers' rotate_half: the second half of the last dim, negated, then the first half.
torch::Tensor rotate_half(const torch::Tensor& x) {
  const int64_t half = x.size(-1) / 2;
  return torch::cat({-x.narrow(-1, half, half), x.narrow(-1, 0, half)}, -1);
}

/// cos and sin [length, head_dim] of the rotary embedding (LlamaRotaryEmbedding, default rope type).
std::pair<torch::Tensor, torch::Tensor> rotary(int64_t length, int64_t head_dim, double theta,
                                               const torch::TensorOptions& options) {
  auto inverse_frequency = 1.0 / torch::pow(theta, torch::arange(0, head_dim, 2, torch::kLong).to(torch::kFloat) /
                                                       static_cast<double>(head_dim));
  auto positions = torch::arange(length, torch::kFloat);
  auto frequencies = torch::outer(positions, inverse_frequency);
  auto embedding = torch::cat({frequencies, frequencies}, -1);
  // Computed on the host in fp32, as transformers computes inv_freq, then moved to the activations' device.
  return {embedding.cos().to(options.device(), options.dtype()), embedding.sin().to(options.device(), options.dtype())};
}

nlohmann::json required(const nlohmann::json& config, const char* key, const std::string& source) {
  TORCH_CHECK(config.contains(key), "Llama config '", source, "' lacks '", key, "'");
  return config[key];
}

// An integer field must be written as one: nlohmann would truncate 64.5 to 64 without a word.
int64_t integer_field(const nlohmann::json& value, const char* key, const std::string& source) {
  TORCH_CHECK(value.is_number_integer(), "Llama config '", source, "': '", key, "' must be an integer, got ",
              value.dump());
  return value.get<int64_t>();
}

int64_t optional_integer(const nlohmann::json& config, const char* key, int64_t fallback, const std::string& source) {
  return config.contains(key) ? integer_field(config[key], key, source) : fallback;
}

// A positive, finite number (rms_norm_eps, rope_theta).
double positive_number(const nlohmann::json& config, const char* key, double fallback, const std::string& source) {
  if (!config.contains(key)) return fallback;
  const auto& value = config[key];
  TORCH_CHECK(value.is_number() && std::isfinite(value.get<double>()) && value.get<double>() > 0, "Llama config '",
              source, "': '", key, "' must be a positive number, got ", value.dump());
  return value.get<double>();
}

}  // namespace

void LlamaConfig::validate() const {
  TORCH_CHECK(vocab_size > 0 && hidden_size > 0 && intermediate_size > 0 && num_hidden_layers > 0,
              "LlamaConfig: vocab_size, hidden_size, intermediate_size and num_hidden_layers must be positive, got ",
              vocab_size, ", ", hidden_size, ", ", intermediate_size, ", ", num_hidden_layers);
  TORCH_CHECK(num_attention_heads > 0 && hidden_size % num_attention_heads == 0, "LlamaConfig: hidden_size ",
              hidden_size, " is not divisible by num_attention_heads ", num_attention_heads);
  TORCH_CHECK(head_dim() % 2 == 0, "LlamaConfig: head_dim ", head_dim(), " must be even for rotary embeddings");
  TORCH_CHECK(num_key_value_heads > 0 && num_attention_heads % num_key_value_heads == 0,
              "LlamaConfig: num_attention_heads ", num_attention_heads, " is not a multiple of num_key_value_heads ",
              num_key_value_heads);
}

std::string LlamaConfig::to_json() const {
  nlohmann::json config;
  config["architectures"] = {"LlamaForCausalLM"};
  config["model_type"] = "llama";
  config["vocab_size"] = vocab_size;
  config["hidden_size"] = hidden_size;
  config["intermediate_size"] = intermediate_size;
  config["num_hidden_layers"] = num_hidden_layers;
  config["num_attention_heads"] = num_attention_heads;
  config["num_key_value_heads"] = num_key_value_heads;
  config["max_position_embeddings"] = max_position_embeddings;
  config["rms_norm_eps"] = rms_norm_eps;
  config["rope_theta"] = rope_theta;
  config["tie_word_embeddings"] = tie_word_embeddings;
  config["hidden_act"] = "silu";
  config["torch_dtype"] = "float32";
  config["initializer_range"] = initializer_range;
  config["attention_bias"] = false;
  config["mlp_bias"] = false;
  config["bos_token_id"] = nullptr;
  config["eos_token_id"] = nullptr;
  return config.dump(2);
}

LlamaConfig LlamaConfig::from_json(const std::string& text, const std::string& source) {
  nlohmann::json config;
  try {
    config = nlohmann::json::parse(text);
  } catch (const nlohmann::json::exception& error) {
    TORCH_CHECK(false, "Llama config '", source, "' is not valid JSON (", error.what(), ")");
  }
  LlamaConfig result;
  try {
    TORCH_CHECK(config.is_object(), "Llama config '", source, "' is not a JSON object");
    TORCH_CHECK(config.value("model_type", "llama") == "llama", "'", source, "' describes a ",
                config["model_type"].dump(), " model; this program builds Llama models");
    result.vocab_size = integer_field(required(config, "vocab_size", source), "vocab_size", source);
    result.hidden_size = integer_field(required(config, "hidden_size", source), "hidden_size", source);
    result.intermediate_size =
        integer_field(required(config, "intermediate_size", source), "intermediate_size", source);
    result.num_hidden_layers =
        integer_field(required(config, "num_hidden_layers", source), "num_hidden_layers", source);
    result.num_attention_heads =
        integer_field(required(config, "num_attention_heads", source), "num_attention_heads", source);
    // transformers' LlamaConfig defaults for fields a file leaves out.
    result.num_key_value_heads = config.contains("num_key_value_heads") && !config["num_key_value_heads"].is_null()
                                     ? integer_field(config["num_key_value_heads"], "num_key_value_heads", source)
                                     : result.num_attention_heads;
    result.max_position_embeddings = optional_integer(config, "max_position_embeddings", 2048, source);
    TORCH_CHECK(result.max_position_embeddings > 0, "Llama config '", source,
                "': 'max_position_embeddings' must be positive, got ", result.max_position_embeddings);
    result.rms_norm_eps = positive_number(config, "rms_norm_eps", 1e-6, source);
    result.rope_theta = positive_number(config, "rope_theta", 10000.0, source);
    if (config.contains("rope_parameters") && config["rope_parameters"].is_object()) {
      const auto& rope = config["rope_parameters"];
      TORCH_CHECK(rope.value("rope_type", std::string("default")) == "default", "'", source, "' uses rope_type ",
                  rope["rope_type"].dump(), "; only the default rotary embedding is implemented");
      result.rope_theta = positive_number(rope, "rope_theta", result.rope_theta, source + " rope_parameters");
    }
    result.tie_word_embeddings = config.value("tie_word_embeddings", false);
    // What this implementation does not compute is refused rather than silently ignored.
    TORCH_CHECK(!config.contains("rope_scaling") || config["rope_scaling"].is_null(), "'", source,
                "' sets rope_scaling ", config.contains("rope_scaling") ? config["rope_scaling"].dump() : "",
                "; scaled rotary embeddings (e.g. Llama 3.1's) are not implemented");
    TORCH_CHECK(!config.value("attention_bias", false) && !config.value("mlp_bias", false), "'", source,
                "' enables attention_bias or mlp_bias; this Llama has no biases");
    // integer_field, not get<int64_t>: a float beyond int64's range is undefined behavior in
    // nlohmann's conversion, and so is an overflowing product (found by fuzz/llama_config_fuzz.cpp).
    TORCH_CHECK(optional_integer(config, "pretraining_tp", 1, source) == 1, "'", source, "' sets pretraining_tp ",
                config["pretraining_tp"].dump(), "; only 1 is implemented");
    if (config.contains("head_dim") && !config["head_dim"].is_null()) {
      const int64_t head_dim = integer_field(config["head_dim"], "head_dim", source);
      int64_t heads_times_head_dim = 0;
      TORCH_CHECK(!__builtin_mul_overflow(head_dim, result.num_attention_heads, &heads_times_head_dim) &&
                      heads_times_head_dim == result.hidden_size,
                  "'", source, "' sets head_dim ", config["head_dim"].dump(),
                  ", but hidden_size / num_attention_heads is ",
                  result.hidden_size / std::max<int64_t>(1, result.num_attention_heads),
                  "; a separate head_dim is not implemented");
    }
    TORCH_CHECK(config.value("hidden_act", std::string("silu")) == "silu", "'", source, "' uses hidden_act ",
                config["hidden_act"].dump(), "; only silu (SwiGLU) is implemented");
    // transformers 5 writes attention_dropout (0.0 by default); this Llama has no dropout.
    TORCH_CHECK(config.value("attention_dropout", 0.0) == 0.0, "'", source, "' sets attention_dropout ",
                config.contains("attention_dropout") ? config["attention_dropout"].dump() : "",
                "; this Llama has no dropout, so only 0 is implemented");
  } catch (const nlohmann::json::exception& error) {
    TORCH_CHECK(false, "Llama config '", source, "' has a field of the wrong type (", error.what(), ")");
  }
  result.validate();
  return result;
}

LlamaConfig LlamaConfig::preset(const std::string& name) {
  LlamaConfig config;
  if (name == "tiny") return config;
  if (name == "small") {
    config.hidden_size = 256;
    config.intermediate_size = 688;
    config.num_hidden_layers = 4;
    config.num_attention_heads = 8;
    config.num_key_value_heads = 4;
    return config;
  }
  if (name == "medium") {
    config.hidden_size = 512;
    config.intermediate_size = 1376;
    config.num_hidden_layers = 8;
    config.num_attention_heads = 8;
    config.num_key_value_heads = 8;
    config.max_position_embeddings = 1024;
    return config;
  }
  if (name == "large") {
    // The largest shape whose FULL_SHARD training state (16 bytes a parameter) fits four CPU ranks
    // in about 12 GB: 0.54 B parameters (bench/README.md, "A model that does not fit one process").
    config.vocab_size = 32000;
    config.hidden_size = 1536;
    config.intermediate_size = 4096;
    config.num_hidden_layers = 18;
    config.num_attention_heads = 16;
    config.num_key_value_heads = 4;
    config.max_position_embeddings = 2048;
    config.tie_word_embeddings = false;
    return config;
  }
  // Meta's Llama 3 shapes (without Llama 3.1's rope scaling), for `fsdp estimate-memory`.
  auto llama3 = [&](int64_t hidden, int64_t intermediate, int64_t layers, int64_t heads, bool tied) {
    config.vocab_size = 128256;
    config.hidden_size = hidden;
    config.intermediate_size = intermediate;
    config.num_hidden_layers = layers;
    config.num_attention_heads = heads;
    config.num_key_value_heads = 8;
    config.max_position_embeddings = 8192;
    config.rope_theta = 500000.0;
    config.tie_word_embeddings = tied;
    return config;
  };
  if (name == "llama3-1b") return llama3(2048, 8192, 16, 32, true);
  if (name == "llama3-8b") return llama3(4096, 14336, 32, 32, false);
  if (name == "llama3-70b") return llama3(8192, 28672, 80, 64, false);
  TORCH_CHECK(false, "unknown model preset '", name,
              "'; choose tiny, small, medium, large, llama3-1b, llama3-8b or llama3-70b");
}

LlamaRMSNormImpl::LlamaRMSNormImpl(int64_t hidden_size, double eps)
    : weight(register_parameter("weight", torch::ones({hidden_size}))), eps(eps) {}

torch::Tensor LlamaRMSNormImpl::forward(const torch::Tensor& hidden) {
  auto as_float = hidden.to(torch::kFloat);
  auto variance = as_float.pow(2).mean(-1, /*keepdim=*/true);
  return weight * (as_float * torch::rsqrt(variance + eps)).to(hidden.scalar_type());
}

LlamaAttentionImpl::LlamaAttentionImpl(const LlamaConfig& config) : config(config) {
  const int64_t head_dim = config.head_dim();
  auto linear = [](int64_t in, int64_t out) {
    return torch::nn::Linear(torch::nn::LinearOptions(in, out).bias(false));
  };
  q_proj = register_module("q_proj", linear(config.hidden_size, config.num_attention_heads * head_dim));
  k_proj = register_module("k_proj", linear(config.hidden_size, config.num_key_value_heads * head_dim));
  v_proj = register_module("v_proj", linear(config.hidden_size, config.num_key_value_heads * head_dim));
  o_proj = register_module("o_proj", linear(config.num_attention_heads * head_dim, config.hidden_size));
}

torch::Tensor LlamaAttentionImpl::forward(const torch::Tensor& hidden) {
  const int64_t batch = hidden.size(0), length = hidden.size(1), head_dim = config.head_dim();
  const int64_t heads = config.num_attention_heads, kv_heads = config.num_key_value_heads;
  auto query = fsdp::forward(q_proj, hidden).view({batch, length, heads, head_dim}).transpose(1, 2);
  auto key = fsdp::forward(k_proj, hidden).view({batch, length, kv_heads, head_dim}).transpose(1, 2);
  auto value = fsdp::forward(v_proj, hidden).view({batch, length, kv_heads, head_dim}).transpose(1, 2);
  auto [cos, sin] = rotary(length, head_dim, config.rope_theta, hidden.options());
  query = query * cos + rotate_half(query) * sin;
  key = key * cos + rotate_half(key) * sin;
  // repeat_kv: query head h reads key/value head h / (heads / kv_heads).
  if (kv_heads != heads) {
    key = key.repeat_interleave(heads / kv_heads, 1);
    value = value.repeat_interleave(heads / kv_heads, 1);
  }
  auto scores = torch::matmul(query, key.transpose(2, 3)) / std::sqrt(static_cast<double>(head_dim));
  auto mask = torch::ones({length, length}, torch::TensorOptions().dtype(torch::kBool).device(scores.device())).triu(1);
  scores = scores.masked_fill(mask, -std::numeric_limits<float>::infinity());
  auto weights = torch::softmax(scores.to(torch::kFloat), -1).to(query.scalar_type());
  auto output = torch::matmul(weights, value).transpose(1, 2).reshape({batch, length, heads * head_dim});
  return fsdp::forward(o_proj, output);
}

LlamaMLPImpl::LlamaMLPImpl(const LlamaConfig& config) {
  auto linear = [](int64_t in, int64_t out) {
    return torch::nn::Linear(torch::nn::LinearOptions(in, out).bias(false));
  };
  gate_proj = register_module("gate_proj", linear(config.hidden_size, config.intermediate_size));
  up_proj = register_module("up_proj", linear(config.hidden_size, config.intermediate_size));
  down_proj = register_module("down_proj", linear(config.intermediate_size, config.hidden_size));
}

torch::Tensor LlamaMLPImpl::forward(const torch::Tensor& hidden) {
  return fsdp::forward(down_proj, torch::silu(fsdp::forward(gate_proj, hidden)) * fsdp::forward(up_proj, hidden));
}

LlamaDecoderLayerImpl::LlamaDecoderLayerImpl(const LlamaConfig& config) {
  self_attn = register_module("self_attn", LlamaAttention(config));
  mlp = register_module("mlp", LlamaMLP(config));
  input_layernorm = register_module("input_layernorm", LlamaRMSNorm(config.hidden_size, config.rms_norm_eps));
  post_attention_layernorm =
      register_module("post_attention_layernorm", LlamaRMSNorm(config.hidden_size, config.rms_norm_eps));
}

torch::Tensor LlamaDecoderLayerImpl::forward(const torch::Tensor& hidden) {
  auto attended = hidden + fsdp::forward(self_attn, fsdp::forward(input_layernorm, hidden));
  return attended + fsdp::forward(mlp, fsdp::forward(post_attention_layernorm, attended));
}

LlamaModelImpl::LlamaModelImpl(const LlamaConfig& config) {
  embed_tokens = register_module("embed_tokens", torch::nn::Embedding(config.vocab_size, config.hidden_size));
  layers = register_module("layers", torch::nn::ModuleList());
  for (int64_t index = 0; index < config.num_hidden_layers; ++index) {
    decoder_layers.emplace_back(config);
    layers->push_back(decoder_layers.back());
  }
  norm = register_module("norm", LlamaRMSNorm(config.hidden_size, config.rms_norm_eps));
}

torch::Tensor LlamaModelImpl::forward(const torch::Tensor& input_ids) {
  auto hidden = fsdp::forward(embed_tokens, input_ids);
  for (auto& layer : decoder_layers) hidden = fsdp::forward(layer, hidden);
  return fsdp::forward(norm, hidden);
}

LlamaLMHeadImpl::LlamaLMHeadImpl(const torch::Tensor& weight) : weight(register_parameter("weight", weight)) {}

torch::Tensor LlamaLMHeadImpl::forward(const torch::Tensor& hidden) {
  return torch::nn::functional::linear(hidden, weight);
}

LlamaForCausalLMImpl::LlamaForCausalLMImpl(const LlamaConfig& config) : config(config) {
  config.validate();
  model = register_module("model", LlamaModel(config));
  torch::Tensor head_weight =
      config.tie_word_embeddings ? model->embed_tokens->weight : torch::empty({config.vocab_size, config.hidden_size});
  lm_head = register_module("lm_head", LlamaLMHead(head_weight));
  // transformers' _init_weights: normal(0, initializer_range) for linear and embedding weights.
  torch::NoGradGuard no_grad;
  for (auto& item : named_parameters()) {
    if (item.key().find("norm") == std::string::npos) item.value().normal_(0.0, config.initializer_range);
  }
}

bool LlamaForCausalLMImpl::init_weights(torch::nn::Module& module) {
  torch::NoGradGuard no_grad;
  if (auto* norm = dynamic_cast<LlamaRMSNormImpl*>(&module)) {
    norm->weight.fill_(1.0);
    return true;
  }
  torch::Tensor weight;
  if (auto* linear = dynamic_cast<torch::nn::LinearImpl*>(&module)) weight = linear->weight;
  if (auto* embedding = dynamic_cast<torch::nn::EmbeddingImpl*>(&module)) weight = embedding->weight;
  if (auto* head = dynamic_cast<LlamaLMHeadImpl*>(&module)) weight = head->weight;
  if (!weight.defined()) return false;
  weight.normal_(0.0, config.initializer_range);
  return true;
}

torch::Tensor LlamaForCausalLMImpl::forward(const torch::Tensor& input_ids) {
  return fsdp::forward(lm_head, fsdp::forward(model, input_ids));
}

torch::Tensor causal_lm_loss(const torch::Tensor& logits, const torch::Tensor& targets) {
  return torch::nn::functional::cross_entropy(logits.reshape({-1, logits.size(-1)}).to(torch::kFloat),
                                              targets.reshape({-1}));
}

}  // namespace fsdp::models
