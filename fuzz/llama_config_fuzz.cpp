// Any bytes as a Llama config.json: a LlamaConfig that passes validate() (positive sizes, heads that
// divide the hidden size into an even head_dim, key/value heads that divide the heads, positive
// finite eps and theta) and survives to_json() and from_json() unchanged, or a c10::Error; anything
// else (a crash, a sanitizer report, an exception of another type, a hang, runaway memory) is a bug.
#include <c10/util/Exception.h>
#include <fsdp/models/llama.h>

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>

// llama.cpp's modules call their submodules through fsdp::forward, which reaches into the engine;
// parsing a config never does. Defined here so that the target does not compile src/engine/.
namespace fsdp::detail {
std::shared_ptr<ParamGroup> find_param_group(const torch::nn::Module*) { std::abort(); }
void run_pre_forward(ParamGroup&) { std::abort(); }
at::Tensor prepare_forward_input(ParamGroup&, const at::Tensor&) { std::abort(); }
void run_post_forward(ParamGroup&, std::vector<at::Tensor*>&) { std::abort(); }
bool is_checkpointed(const torch::nn::Module*) { std::abort(); }
std::vector<at::Tensor> run_checkpointed(const std::string&, const std::vector<at::Tensor>&,
                                         std::function<std::vector<at::Tensor>(const std::vector<at::Tensor>&)>, bool) {
  std::abort();
}
}  // namespace fsdp::detail

namespace {

bool same(const fsdp::models::LlamaConfig& left, const fsdp::models::LlamaConfig& right) {
  return left.vocab_size == right.vocab_size && left.hidden_size == right.hidden_size &&
         left.intermediate_size == right.intermediate_size && left.num_hidden_layers == right.num_hidden_layers &&
         left.num_attention_heads == right.num_attention_heads &&
         left.num_key_value_heads == right.num_key_value_heads &&
         left.max_position_embeddings == right.max_position_embeddings && left.rms_norm_eps == right.rms_norm_eps &&
         left.rope_theta == right.rope_theta && left.tie_word_embeddings == right.tie_word_embeddings;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  fsdp::models::LlamaConfig config;
  try {
    config = fsdp::models::LlamaConfig::from_json(std::string(reinterpret_cast<const char*>(data), size), "fuzz input");
  } catch (const c10::Error&) {
    return 0;
  }
  if (config.vocab_size <= 0 || config.hidden_size <= 0 || config.intermediate_size <= 0 ||
      config.num_hidden_layers <= 0 || config.num_attention_heads <= 0 || config.num_key_value_heads <= 0 ||
      config.max_position_embeddings <= 0) {
    std::abort();
  }
  if (config.hidden_size % config.num_attention_heads != 0 || config.head_dim() % 2 != 0 ||
      config.num_attention_heads % config.num_key_value_heads != 0) {
    std::abort();
  }
  if (!(std::isfinite(config.rms_norm_eps) && config.rms_norm_eps > 0 && std::isfinite(config.rope_theta) &&
        config.rope_theta > 0)) {
    std::abort();
  }
  // The config.json fsdp.cpp writes next to a saved model must read back as the same model.
  try {
    if (!same(fsdp::models::LlamaConfig::from_json(config.to_json(), "round trip"), config)) std::abort();
  } catch (const c10::Error&) {
    std::abort();
  }
  return 0;
}
