#include <ATen/ATen.h>
#include <fsdp/activation_checkpointing.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/custom_function.h>

#include <mutex>
#include <unordered_map>

namespace fsdp {
namespace {

// Marked modules, keyed by address; the weak pointer tells a live module from a new one that reuses
// a dead module's address.
struct CheckpointRegistry {
  std::mutex mutex;
  std::unordered_map<const torch::nn::Module*, std::weak_ptr<torch::nn::Module>> marked;
};

CheckpointRegistry& checkpoint_registry() {
  static CheckpointRegistry instance;
  return instance;
}

thread_local int checkpointed_forward_depth = 0;

struct DepthScope {
  DepthScope() { ++checkpointed_forward_depth; }
  ~DepthScope() { --checkpointed_forward_depth; }
  DepthScope(const DepthScope&) = delete;
  DepthScope& operator=(const DepthScope&) = delete;
};

using RecomputeFunction = std::function<std::vector<at::Tensor>(const std::vector<at::Tensor>&)>;

struct RecomputeHolder : torch::CustomClassHolder {
  RecomputeHolder(std::string module_name, RecomputeFunction function, bool has_anchor)
      : module_name(std::move(module_name)), function(std::move(function)), has_anchor(has_anchor) {}
  std::string module_name;
  RecomputeFunction function;
  /// The last input is an empty tensor that requires grad, not an argument of the module (see
  /// run_checkpointed).
  bool has_anchor;

  std::vector<at::Tensor> call(const std::vector<at::Tensor>& inputs) const {
    if (!has_anchor) return function(inputs);
    return function(std::vector<at::Tensor>(inputs.begin(), inputs.end() - 1));
  }
};

/// The forward runs without grad; backward recomputes with grad and backpropagates through the
/// recomputed graph (a nested backward, as torch.utils.checkpoint's reentrant variant), which
/// accumulates the parameters' gradients and yields the inputs'.
struct CheckpointFunction : public torch::autograd::Function<CheckpointFunction> {
  // `inputs` must be a TensorList: autograd counts a std::vector argument as one non-tensor.
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* context, at::TensorList input_list,
                                                c10::intrusive_ptr<RecomputeHolder> holder) {
    std::vector<at::Tensor> inputs(input_list.begin(), input_list.end());
    context->save_for_backward(inputs);
    std::vector<at::Tensor> outputs;
    {
      at::NoGradGuard no_grad;
      DepthScope depth;
      outputs = holder->call(inputs);
    }
    context->saved_data["recompute"] = c10::IValue::make_capsule(std::move(holder));
    return outputs;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* context,
                                                 torch::autograd::variable_list output_gradients) {
    auto holder = c10::static_intrusive_pointer_cast<RecomputeHolder>(context->saved_data["recompute"].toCapsule());
    auto saved = context->get_saved_variables();
    std::vector<at::Tensor> detached;
    for (const auto& input : saved) {
      auto copy = input.detach();
      if (input.requires_grad()) copy.requires_grad_(true);
      detached.push_back(copy);
    }
    std::vector<at::Tensor> outputs;
    {
      at::AutoGradMode grad_mode(true);
      DepthScope depth;
      outputs = holder->call(detached);
    }
    TORCH_INTERNAL_ASSERT(outputs.size() == output_gradients.size(), "the recomputation of ", holder->module_name,
                          " returned ", outputs.size(), " outputs, the forward ", output_gradients.size());
    std::vector<at::Tensor> roots, gradients;
    for (size_t index = 0; index < outputs.size(); ++index) {
      if (outputs[index].requires_grad() && output_gradients[index].defined()) {
        roots.push_back(outputs[index]);
        gradients.push_back(output_gradients[index]);
      }
    }
    if (!roots.empty()) torch::autograd::backward(roots, gradients);
    torch::autograd::variable_list input_gradients;
    for (const auto& copy : detached) input_gradients.push_back(copy.requires_grad() ? copy.grad() : at::Tensor());
    input_gradients.emplace_back();  // the holder
    return input_gradients;
  }
};

}  // namespace

void checkpoint_module(const std::shared_ptr<torch::nn::Module>& module) {
  TORCH_CHECK(module, "checkpoint_module: the module is null");
  auto& registry = checkpoint_registry();
  std::lock_guard<std::mutex> lock(registry.mutex);
  for (auto it = registry.marked.begin(); it != registry.marked.end();) {
    it = it->second.expired() ? registry.marked.erase(it) : std::next(it);
  }
  registry.marked[module.get()] = module;
}

bool is_checkpointed(const torch::nn::Module& module) { return detail::is_checkpointed(&module); }

int64_t apply_activation_checkpointing(const std::shared_ptr<torch::nn::Module>& model,
                                       const std::function<bool(const torch::nn::Module&)>& check_fn) {
  TORCH_CHECK(model, "apply_activation_checkpointing: the model is null");
  TORCH_CHECK(check_fn, "apply_activation_checkpointing: check_fn is empty; pass a function that selects modules");
  int64_t marked = 0;
  for (const auto& module : model->modules(/*include_self=*/false)) {
    if (!check_fn(*module)) continue;
    checkpoint_module(module);
    ++marked;
  }
  return marked;
}

namespace detail {

bool is_checkpointed(const torch::nn::Module* module) {
  auto& registry = checkpoint_registry();
  std::lock_guard<std::mutex> lock(registry.mutex);
  auto found = registry.marked.find(module);
  if (found == registry.marked.end()) return false;
  auto live = found->second.lock();
  return live && live.get() == module;
}

bool inside_checkpointed_forward() { return checkpointed_forward_depth > 0; }

std::vector<at::Tensor> run_checkpointed(const std::string& module_name, const std::vector<at::Tensor>& inputs,
                                         RecomputeFunction function, bool parameters_require_grad) {
  // Autograd makes a function's outputs require grad only when an input does. Parameters are not
  // inputs here (the forward runs without grad), so a module fed token ids, or any input that needs
  // no gradient, would silently lose its parameters' gradients. An empty anchor input that requires
  // grad keeps the function in the graph (what the non-reentrant checkpoint achieves with hooks).
  bool any_input_requires_grad = false;
  for (const auto& input : inputs)
    any_input_requires_grad = any_input_requires_grad || (input.defined() && input.requires_grad());
  const bool add_anchor = parameters_require_grad && !any_input_requires_grad;
  auto holder = c10::make_intrusive<RecomputeHolder>(module_name, std::move(function), add_anchor);
  torch::autograd::variable_list function_inputs(inputs);
  if (add_anchor) function_inputs.push_back(at::empty({0}).requires_grad_(true));
  return CheckpointFunction::apply(at::TensorList(function_inputs), holder);
}

}  // namespace detail
}  // namespace fsdp
