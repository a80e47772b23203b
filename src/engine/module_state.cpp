#include "engine/module_state.h"

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <torch/csrc/autograd/engine.h>

#include <algorithm>
#include <mutex>
#include <unordered_map>
#include <unordered_set>

namespace fsdp::detail {
namespace {

struct RegistryEntry {
  std::weak_ptr<torch::nn::Module> module;
  std::shared_ptr<ParamGroup> group;
};

/// Module -> unit. Entries whose module died are dropped on the next registration or lookup of a
/// tree; a dead module's address may be reused, so every hit is checked against the weak pointer.
struct Registry {
  std::mutex mutex;
  std::unordered_map<const torch::nn::Module*, RegistryEntry> by_module;
  std::vector<std::weak_ptr<ParamGroup>> creation_order;
  std::vector<std::shared_ptr<RootState>> root_states;

  void drop_dead_entries() {
    for (auto it = by_module.begin(); it != by_module.end();) {
      if (it->second.module.expired()) {
        it = by_module.erase(it);
      } else {
        ++it;
      }
    }
    creation_order.erase(std::remove_if(creation_order.begin(), creation_order.end(),
                                        [](const std::weak_ptr<ParamGroup>& group) {
                                          auto locked = group.lock();
                                          return !locked || locked->modules().front().expired();
                                        }),
                         creation_order.end());
    root_states.erase(std::remove_if(root_states.begin(), root_states.end(),
                                     [](const std::shared_ptr<RootState>& state) {
                                       return state->root()->modules().front().expired();
                                     }),
                      root_states.end());
  }
};

Registry& registry() {
  static Registry instance;
  return instance;
}

std::unordered_set<const torch::nn::Module*> subtree_of(const ParamGroup& group) {
  std::unordered_set<const torch::nn::Module*> modules;
  for (const auto& weak_module : group.modules()) {
    auto module = weak_module.lock();
    if (!module) continue;
    for (const auto& descendant : module->modules(/*include_self=*/true)) modules.insert(descendant.get());
  }
  return modules;
}

}  // namespace

RootState::RootState(std::shared_ptr<ParamGroup> root, std::vector<std::shared_ptr<ParamGroup>> groups)
    : root_(std::move(root)), groups_(std::move(groups)) {}

void RootState::begin_iteration() {
  if (iteration_active_) return;
  for (const auto& group : groups_) group->begin_iteration();
  post_forward_order_.clear();
  iteration_active_ = true;
}

void RootState::record_post_forward(ParamGroup* group) { post_forward_order_.push_back(group); }

void RootState::on_backward_hook() {
  if (!iteration_active_) begin_iteration();
  queue_final_callback();
}

void RootState::queue_final_callback() {
  if (final_callback_queued_) return;
  final_callback_queued_ = true;
  auto self = shared_from_this();
  torch::autograd::Engine::get_default_engine().queue_callback([self] { self->finish_backward(); });
}

void RootState::finish_backward() {
  final_callback_queued_ = false;
  // A fixed order on every rank: reverse forward order, then the units nobody forwarded.
  for (auto it = post_forward_order_.rbegin(); it != post_forward_order_.rend(); ++it) {
    if (!(*it)->post_backward_done()) (*it)->post_backward();
  }
  for (auto it = groups_.rbegin(); it != groups_.rend(); ++it) {
    if (!(*it)->post_backward_done()) (*it)->post_backward();
  }
  end_iteration();
}

void RootState::end_iteration() {
  if (!iteration_active_) {
    for (const auto& group : groups_) group->reshard();
    return;
  }
  iteration_active_ = false;
  post_forward_order_.clear();
  for (const auto& group : groups_) group->end_iteration();
}

void register_param_group(const std::shared_ptr<ParamGroup>& group) {
  auto& state = registry();
  std::lock_guard<std::mutex> lock(state.mutex);
  state.drop_dead_entries();
  for (const auto& root_state : state.root_states) {
    TORCH_CHECK(!root_state->iteration_active(), "fully_shard: ", group->description(),
                " was created while a training iteration of ", root_state->root()->description(),
                " is in progress (after a forward, before its backward). Shard every module before training");
  }
  // A new unit changes which unit is the root of its tree: decide again at the next forward.
  for (const auto& root_state : state.root_states) {
    for (const auto& member : root_state->groups()) {
      member->set_root(false);
      member->set_root_state(nullptr);
    }
  }
  state.root_states.clear();
  for (const auto& weak_module : group->modules()) {
    auto module = weak_module.lock();
    state.by_module[module.get()] = RegistryEntry{module, group};
  }
  state.creation_order.push_back(group);
}

std::unordered_set<const c10::TensorImpl*> managed_parameters() {
  std::unordered_set<const c10::TensorImpl*> managed;
  for (const auto& group : all_param_groups()) {
    for (const auto& parameter : group->parameters()) managed.insert(parameter.parameter.unsafeGetTensorImpl());
  }
  return managed;
}

std::vector<std::shared_ptr<ParamGroup>> all_param_groups() {
  auto& state = registry();
  std::lock_guard<std::mutex> lock(state.mutex);
  std::vector<std::shared_ptr<ParamGroup>> groups;
  for (const auto& weak_group : state.creation_order) {
    auto group = weak_group.lock();
    if (group && !group->modules().front().expired()) groups.push_back(group);
  }
  return groups;
}

std::shared_ptr<ParamGroup> find_param_group(const torch::nn::Module* module) {
  auto& state = registry();
  std::lock_guard<std::mutex> lock(state.mutex);
  auto it = state.by_module.find(module);
  if (it == state.by_module.end()) return nullptr;
  auto live = it->second.module.lock();
  if (live.get() != module) return nullptr;
  return it->second.group;
}

std::shared_ptr<RootState> ensure_root_state(ParamGroup& group) {
  if (auto existing = group.root_state()) return existing;
  auto groups = all_param_groups();
  const torch::nn::Module* first_module = group.modules().front().lock().get();
  // The root is the outermost unit whose modules contain this one.
  std::shared_ptr<ParamGroup> root;
  std::unordered_set<const torch::nn::Module*> root_subtree;
  for (const auto& candidate : groups) {
    auto subtree = subtree_of(*candidate);
    if (!subtree.count(first_module)) continue;
    if (!root || subtree.size() > root_subtree.size()) {
      root = candidate;
      root_subtree = std::move(subtree);
    }
  }
  TORCH_INTERNAL_ASSERT(root, "a unit is not inside any unit, not even itself");
  std::vector<std::shared_ptr<ParamGroup>> tree;
  for (const auto& candidate : groups) {
    if (root_subtree.count(candidate->modules().front().lock().get())) tree.push_back(candidate);
  }
  for (const auto& member : tree) {
    TORCH_CHECK(member->options().sharding_strategy == root->options().sharding_strategy, "FSDP: ",
                member->description(), " uses ", to_string(member->options().sharding_strategy), " but the root ",
                root->description(), " uses ", to_string(root->options().sharding_strategy),
                "; every unit of one model must use the same sharding strategy");
  }
  auto root_state = std::make_shared<RootState>(root, tree);
  for (const auto& member : tree) {
    member->set_root(member == root);
    member->set_root_state(root_state);
  }
  auto& state = registry();
  std::lock_guard<std::mutex> lock(state.mutex);
  state.root_states.push_back(root_state);
  return root_state;
}

void run_pre_forward(ParamGroup& group) {
  auto root_state = ensure_root_state(group);
  const bool grad_enabled = c10::GradMode::is_enabled();
  if (grad_enabled) root_state->begin_iteration();
  group.pre_forward(grad_enabled);
}

at::Tensor cast_forward_input(const ParamGroup& group, const at::Tensor& input) {
  const auto& policy = group.options().mixed_precision;
  if (!policy.param_dtype || !policy.cast_forward_inputs || !input.defined()) return input;
  if (!at::isFloatingType(input.scalar_type()) || input.scalar_type() == *policy.param_dtype) return input;
  return input.to(*policy.param_dtype);
}

void run_post_forward(ParamGroup& group, std::vector<at::Tensor*>& outputs) {
  const bool grad_enabled = c10::GradMode::is_enabled();
  const auto& output_dtype = group.options().mixed_precision.output_dtype;
  if (output_dtype) {
    for (auto* output : outputs) {
      if (output->defined() && at::isFloatingType(output->scalar_type())) *output = output->to(*output_dtype);
    }
  }
  group.post_forward(grad_enabled);
  if (!grad_enabled) return;
  auto root_state = group.root_state();
  bool any_output_requires_grad = false;
  std::weak_ptr<ParamGroup> weak_group = group.shared_from_this();
  for (auto* output : outputs) {
    // A leaf output (a parameter returned as is) would keep the hook forever; skip it.
    if (!output->defined() || !output->requires_grad() || !output->grad_fn()) continue;
    any_output_requires_grad = true;
    output->register_hook([weak_group](const at::Tensor&) {
      if (auto locked = weak_group.lock()) locked->pre_backward();
    });
  }
  if (root_state) {
    root_state->record_post_forward(&group);
    // Nothing can be backpropagated through the root's outputs: the iteration is over.
    if (group.is_root() && !any_output_requires_grad) root_state->end_iteration();
  }
}

}  // namespace fsdp::detail
