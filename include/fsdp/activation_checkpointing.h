// Activation checkpointing: a module's forward keeps no activations for backward; backward runs the
// forward again (with grad) and backpropagates through that. Memory for compute, as PyTorch's
// checkpoint_wrapper, which Accelerate applies when activation_checkpointing is set.
//
// libtorch has no module wrappers that keep call sites working, so a module is *marked* instead and
// every `fsdp::forward(module, ...)` call of it is checkpointed. Parameter names do not change (in
// PyTorch the wrapper's `_checkpoint_wrapped_module.` prefix is stripped from state dicts anyway).
//
// Behaviour, matching Accelerate's choice for FSDP2 (checkpoint_wrapper with preserve_rng_state=False):
// the random state is not restored for the recomputation, so a module with dropout draws different
// masks in backward. Under torch::NoGradGuard a checkpointed module runs plainly.
//
// Composition with FSDP: checkpoint the unit's module itself (FSDP1 style) or modules inside a unit
// (Accelerate's FSDP2 style: the children of each transformer block). The recomputation runs inside
// the unit's backward, when the unit is gathered. An FSDP unit *inside* a checkpointed module is an
// error at its forward: its gradients would be reduced inside the recomputation.
//
// Example:
//   for (auto& layer : model->layers) fsdp::checkpoint_module(layer.ptr());
//   // or, as Accelerate does for transformer blocks:
//   fsdp::apply_activation_checkpointing(model.ptr(), [](const torch::nn::Module& m) { return m.name() == "Block"; });
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/GradMode.h>
#include <c10/util/Exception.h>
#include <torch/nn/module.h>

#include <functional>
#include <memory>
#include <string>
#include <tuple>
#include <type_traits>
#include <vector>

namespace fsdp {

/// Marks `module`: its forward, when called through fsdp::forward with grad mode on, is checkpointed.
void checkpoint_module(const std::shared_ptr<torch::nn::Module>& module);
bool is_checkpointed(const torch::nn::Module& module);

/// PyTorch's apply_activation_checkpointing(model, check_fn=...): marks every module below `model`
/// (never `model` itself) for which `check_fn` is true. Returns how many it marked.
int64_t apply_activation_checkpointing(const std::shared_ptr<torch::nn::Module>& model,
                                       const std::function<bool(const torch::nn::Module&)>& check_fn);

namespace detail {

bool is_checkpointed(const torch::nn::Module* module);
/// Whether a checkpointed module's forward or recomputation is running on this thread.
bool inside_checkpointed_forward();

/// Runs `function(inputs)` without keeping activations; backward calls it again on detached copies of
/// `inputs` and backpropagates through the result. The outputs are `function`'s.
/// `parameters_require_grad`: whether the module has trainable parameters (so its outputs must
/// require grad even when no input does).
std::vector<at::Tensor> run_checkpointed(
    const std::string& module_name, const std::vector<at::Tensor>& inputs,
    std::function<std::vector<at::Tensor>(const std::vector<at::Tensor>&)> function, bool parameters_require_grad);

template <typename T>
void collect_tensor_argument(const T& value, std::vector<at::Tensor>& tensors) {
  if constexpr (std::is_same_v<T, at::Tensor>) tensors.push_back(value);
}

template <typename T>
void replace_tensor_argument(T& value, const std::vector<at::Tensor>& replacements, size_t& index) {
  if constexpr (std::is_same_v<T, at::Tensor>) value = replacements.at(index++);
}

/// `module->forward(args...)`, checkpointed when the module is marked and grad mode is on. The
/// arguments are kept (tensors as saved inputs) for the recomputation.
template <typename Holder, typename... Args>
auto call_forward(Holder& module, Args&&... args) {
  using Output = decltype(module->forward(std::forward<Args>(args)...));
  if (!is_checkpointed(module.get()) || !c10::GradMode::is_enabled())
    return module->forward(std::forward<Args>(args)...);
  if constexpr (std::is_same_v<std::decay_t<Output>, at::Tensor>) {
    auto arguments = std::make_shared<std::tuple<std::decay_t<Args>...>>(std::forward<Args>(args)...);
    std::vector<at::Tensor> inputs;
    std::apply([&](const auto&... value) { (collect_tensor_argument(value, inputs), ...); }, *arguments);
    auto holder = module;
    auto function = [holder, arguments](const std::vector<at::Tensor>& replacements) mutable {
      auto call_arguments = *arguments;
      size_t index = 0;
      std::apply([&](auto&... value) { (replace_tensor_argument(value, replacements, index), ...); }, call_arguments);
      return std::vector<at::Tensor>{
          std::apply([&](auto&... value) { return holder->forward(value...); }, call_arguments)};
    };
    bool parameters_require_grad = false;
    for (const auto& parameter : module->parameters())
      parameters_require_grad = parameters_require_grad || parameter.requires_grad();
    return Output(run_checkpointed(module->name(), inputs, std::move(function), parameters_require_grad).at(0));
  } else {
    TORCH_CHECK(false, "activation checkpointing of ", module->name(),
                ": only modules whose forward returns one Tensor can be checkpointed; unmark it or checkpoint its "
                "submodules instead");
    return module->forward(std::forward<Args>(args)...);
  }
}

}  // namespace detail
}  // namespace fsdp
