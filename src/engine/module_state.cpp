#include "engine/module_state.h"

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <fsdp/activation_checkpointing.h>
#include <torch/csrc/autograd/custom_function.h>

#include <unordered_map>
#include <unordered_set>

#include "engine/registry.h"

namespace fsdp::detail {
namespace {

std::unordered_set<const torch::nn::Module*> subtree_of(const ParamGroup& group) {
  std::unordered_set<const torch::nn::Module*> modules;
  for (const auto& weak_module : group.modules()) {
    auto module = weak_module.lock();
    if (!module) continue;
    for (const auto& descendant : module->modules(/*include_self=*/true)) modules.insert(descendant.get());
  }
  return modules;
}

struct GroupHolder : torch::CustomClassHolder {
  GroupHolder(std::weak_ptr<RootState> root_state, std::weak_ptr<ParamGroup> group)
      : root_state(std::move(root_state)), group(std::move(group)) {}
  std::weak_ptr<RootState> root_state;
  std::weak_ptr<ParamGroup> group;
};

/// Identity on a unit's input; its backward runs after the unit's backward for that input.
struct PostBackwardFunction : public torch::autograd::Function<PostBackwardFunction> {
  static at::Tensor forward(torch::autograd::AutogradContext* context, const at::Tensor& input,
                            c10::intrusive_ptr<GroupHolder> holder) {
    context->saved_data["group"] = c10::IValue::make_capsule(std::move(holder));
    return input.view_as(input);
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* context,
                                                 torch::autograd::variable_list gradients) {
    auto holder = c10::static_intrusive_pointer_cast<GroupHolder>(context->saved_data["group"].toCapsule());
    auto root_state = holder->root_state.lock();
    auto group = holder->group.lock();
    if (root_state && group) root_state->on_input_gradient(*group);
    return {gradients[0], at::Tensor()};
  }
};

}  // namespace

std::shared_ptr<RootState> ensure_root_state(ParamGroup& group) {
  if (auto existing = root_state_of(group)) return existing;
  auto groups = all_param_groups();
  auto first_module = group.modules().front().lock();
  TORCH_CHECK(first_module, group.on_rank(), "FSDP: the module of ", group.description(), " was destroyed");
  // The root is the outermost unit whose modules contain this one.
  std::shared_ptr<ParamGroup> root;
  std::unordered_set<const torch::nn::Module*> root_subtree;
  for (const auto& candidate : groups) {
    auto subtree = subtree_of(*candidate);
    if (!subtree.count(first_module.get())) continue;
    if (!root || subtree.size() > root_subtree.size()) {
      root = candidate;
      root_subtree = std::move(subtree);
    }
  }
  TORCH_INTERNAL_ASSERT(root, "a live unit is not inside any unit, not even itself");
  std::vector<std::shared_ptr<ParamGroup>> tree;
  for (const auto& candidate : groups) {
    if (root_subtree.count(candidate->modules().front().lock().get())) tree.push_back(candidate);
  }
  // Units are named by their module path in the root's module, as FSDP2 names them.
  if (auto root_module = root->modules().front().lock()) {
    std::unordered_map<const torch::nn::Module*, std::string> paths;
    for (const auto& item : root_module->named_modules()) paths.emplace(item.value().get(), item.key());
    for (const auto& member : tree) {
      std::string path;
      for (size_t index = 0; index < member->modules().size(); ++index) {
        auto live = member->modules()[index].lock();
        auto found = live ? paths.find(live.get()) : paths.end();
        const std::string name = found == paths.end() ? "?" : found->second.empty() ? "<root>" : found->second;
        path += (index ? " + " : "") + name;
      }
      member->set_module_path(path == "<root>" ? "" : path);
    }
  }
  for (const auto& member : tree) {
    TORCH_CHECK(member->options().sharding_strategy == root->options().sharding_strategy, root->on_rank(),
                "FSDP: ", member->description(), " uses ", to_string(member->options().sharding_strategy),
                " but the root ", root->description(), " uses ", to_string(root->options().sharding_strategy),
                "; every unit of one model must use the same sharding strategy");
  }
  auto root_state = std::make_shared<RootState>(root, tree);
  for (const auto& member : tree) member->set_root(member == root);
  register_root_state(root_state);
  return root_state;
}

void run_pre_forward(ParamGroup& group) {
  TORCH_CHECK(!inside_checkpointed_forward(), group.on_rank(), group.description(),
              " runs inside an activation-checkpointed module, so its gradients would be reduced during the "
              "recomputation. Checkpoint the unit's own module or modules inside it instead (e.g. the children of "
              "each transformer block, as Accelerate does with TRANSFORMER_BASED_WRAP)");
  auto root_state = ensure_root_state(group);
  const bool grad_enabled = c10::GradMode::is_enabled();
  if (grad_enabled) root_state->begin_iteration();
  group.pre_forward(grad_enabled, root_state->forward_prefetch_targets(group));
}

std::string units_holding_shards_inside(const torch::nn::Module& module) {
  std::string units;
  for (const auto& item : module.named_modules("", /*include_self=*/false)) {
    auto group = find_param_group(item.value().get());
    if (!group || group->sharded_state() != ShardedState::kSharded) continue;
    // A unit that ran through fsdp::forward and resharded after it is not the one called directly.
    const auto root = root_state_of(*group);
    if (root && root->ran_in_this_forward(group.get())) continue;
    units += (units.empty() ? "" : ", ") + group->description();
  }
  return units;
}

std::string explain_forward_error(const torch::nn::Module& module, const c10::Error& error) {
  const std::string message = error.what_without_backtrace();
  // The innermost fsdp::forward explains; the ones around it pass its error on unchanged.
  static const std::string kExplained = "hold only their shards";
  if (message.find(kExplained) != std::string::npos || message.rfind("[rank ", 0) == 0 ||
      dynamic_cast<const c10::DistError*>(&error) != nullptr) {
    return "";
  }
  const auto units = units_holding_shards_inside(module);
  if (units.empty()) return "";
  return message + "\n(fsdp: raised inside the forward of " + module.name() + ", where these units " + kExplained +
         ": " + units +
         ". A unit called directly (block(x) or block->forward(x)) computes with its shards, not its parameters: "
         "call each unit through fsdp::forward(block, x), which gathers them first)";
}

at::Tensor prepare_forward_input(ParamGroup& group, const at::Tensor& input) {
  if (!input.defined()) return input;
  at::Tensor result = input;
  const auto& policy = group.options().mp_policy;
  if (policy.param_dtype && policy.cast_forward_inputs && at::isFloatingType(input.scalar_type()) &&
      input.scalar_type() != *policy.param_dtype) {
    result = input.to(*policy.param_dtype);
  }
  if (c10::GradMode::is_enabled() && result.requires_grad()) {
    group.expect_input_gradient();
    result = PostBackwardFunction::apply(
        result, c10::make_intrusive<GroupHolder>(ensure_root_state(group), group.weak_from_this()));
  }
  return result;
}

void run_post_forward(ParamGroup& group, std::vector<at::Tensor*>& outputs) {
  const bool grad_enabled = c10::GradMode::is_enabled();
  const auto& output_dtype = group.options().mp_policy.output_dtype;
  if (output_dtype) {
    for (auto* output : outputs) {
      if (output->defined() && at::isFloatingType(output->scalar_type())) *output = output->to(*output_dtype);
    }
  }
  group.post_forward();
  auto root_state = root_state_of(group);
  if (!grad_enabled) {
    // No backward can follow: once the root's forward is over, nothing needs gathered parameters.
    if (root_state && group.is_root()) root_state->end_iteration();
    return;
  }
  bool any_output_requires_grad = false;
  std::weak_ptr<ParamGroup> weak_group = group.shared_from_this();
  std::weak_ptr<RootState> weak_root_state = root_state;
  for (auto* output : outputs) {
    // A leaf output (a parameter returned as is) would keep the hook forever; skip it.
    if (!output->defined() || !output->requires_grad() || !output->grad_fn()) continue;
    any_output_requires_grad = true;
    output->register_hook([weak_root_state, weak_group](const at::Tensor&) {
      auto state = weak_root_state.lock();
      auto locked = weak_group.lock();
      if (state && locked) state->pre_backward(*locked);
    });
  }
  if (root_state) {
    root_state->record_post_forward(&group);
    // Nothing can be backpropagated through the root's outputs: the iteration is over.
    if (group.is_root() && !any_output_requires_grad) root_state->end_iteration();
  }
}

}  // namespace fsdp::detail
