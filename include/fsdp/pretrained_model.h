// What FSDP's model preparation asks of a model beyond torch::nn::Module (the parts of Hugging Face's
// PreTrainedModel that Accelerate's fsdp2_prepare_model uses). Inherit it next to torch::nn::Module;
// every method has a default, so a model overrides only what it has.
#pragma once

#include <memory>
#include <string>
#include <vector>

namespace torch::nn {
class Module;
}

namespace fsdp {

class PretrainedModel {
 public:
  virtual ~PretrainedModel() = default;
  /// The token embedding (get_input_embeddings). Default: none.
  virtual std::shared_ptr<torch::nn::Module> input_embeddings() { return nullptr; }
  /// The output projection to the vocabulary (get_output_embeddings). Default: none.
  virtual std::shared_ptr<torch::nn::Module> output_embeddings() { return nullptr; }
  /// Name of the child holding the base model, whose last "Norm" child is the final norm
  /// (base_model_prefix). Default: "" (the model itself).
  virtual std::string base_model_prefix() const { return ""; }
  /// Class names of the blocks to wrap when transformer_cls_names_to_wrap is unset
  /// (_no_split_modules). Default: none.
  virtual std::vector<std::string> no_split_modules() const { return {}; }
  /// Makes the output embedding share the input embedding's weight again (tie_weights). Default:
  /// nothing.
  virtual void tie_weights() {}
  /// Buffers that are not part of the state dict, as torch's register_buffer(persistent=False)
  /// makes them (libtorch's register_buffer has no such flag): a rotary embedding's `inv_freq`, for
  /// instance, which Hugging Face checkpoints do not hold. Each entry names a buffer by its full name
  /// in the model or by its last components ("inv_freq" matches "layers.0.rotary.inv_freq"). State
  /// dicts neither save nor require them; they keep the values the model computed. Default: none.
  virtual std::vector<std::string> non_persistent_buffers() const { return {}; }
  /// Gives `module`'s own parameters and buffers the values the model's constructor would
  /// (transformers' _init_weights), for a model built on the meta device (meta_device.h); false for
  /// a module it does not know, which then gets its own initializer (fsdp::reset_parameters).
  /// fsdp2_prepare_model uses it when the plugin has no param_init_fn. Default: false.
  virtual bool init_weights(torch::nn::Module& module) {
    (void)module;
    return false;
  }
};

}  // namespace fsdp
