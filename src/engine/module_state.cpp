#include "engine/module_state.h"

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <fsdp/activation_checkpointing.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/csrc/autograd/engine.h>

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

RootState::RootState(std::shared_ptr<ParamGroup> root, std::vector<std::shared_ptr<ParamGroup>> groups)
    : root_(std::move(root)), groups_(std::move(groups)) {}

void RootState::begin_iteration() {
  if (state_ == State::kForward) return;                           // another forward of the same iteration
  if (state_ == State::kBackward) end_iteration(/*check=*/false);  // its backward threw: abandon it
  for (const auto& group : groups_) group->begin_iteration();
  post_forward_order_.clear();
  final_callback_queued_ = false;
  state_ = State::kForward;
}

void RootState::record_post_forward(ParamGroup* group) {
  group->post_forward_indices().push_back(post_forward_order_.size());
  post_forward_order_.push_back(group);
}

namespace {

std::vector<std::shared_ptr<ParamGroup>> lock_all(const std::vector<std::weak_ptr<ParamGroup>>& targets) {
  std::vector<std::shared_ptr<ParamGroup>> locked;
  for (const auto& target : targets) {
    if (auto group = target.lock()) locked.push_back(std::move(group));
  }
  return locked;
}

}  // namespace

std::vector<std::shared_ptr<ParamGroup>> RootState::forward_prefetch_targets(ParamGroup& group) {
  if (group.is_root()) {
    previous_forward_order_ = std::move(forward_order_);
    forward_order_.clear();
  }
  const size_t position = forward_order_.size();
  forward_order_.push_back(&group);
  if (group.forward_prefetch()) return within_all_gather_limit(group, lock_all(*group.forward_prefetch()));
  if (!root_->options().fsdp1.forward_prefetch) return {};
  if (position + 1 >= previous_forward_order_.size() || previous_forward_order_[position] != &group) return {};
  ParamGroup* next = previous_forward_order_[position + 1];
  if (next == &group) return {};
  return within_all_gather_limit(group, {next->shared_from_this()});
}

std::vector<std::shared_ptr<ParamGroup>> RootState::within_all_gather_limit(
    const ParamGroup& group, std::vector<std::shared_ptr<ParamGroup>> targets) const {
  const auto& limit = root_->options().fsdp1.max_all_gathers_in_flight;
  if (!limit) return targets;
  // FSDP1's rate limiter, without blocking: what is in flight now, plus `group`'s own all-gather
  // (issued first), plus each target that needs one, may not exceed the limit.
  int64_t in_flight = group.needs_all_gather() ? 1 : 0;
  for (const auto& member : groups_) in_flight += member->has_unshard_in_flight() ? 1 : 0;
  std::vector<std::shared_ptr<ParamGroup>> kept;
  for (auto& target : targets) {
    if (!target->needs_all_gather()) continue;  // nothing to issue
    if (in_flight >= *limit) break;
    ++in_flight;
    kept.push_back(std::move(target));
  }
  return kept;
}

std::vector<std::shared_ptr<ParamGroup>> RootState::backward_prefetch_targets(ParamGroup& group, bool after_gradients) {
  auto& indices = group.post_forward_indices();
  const bool has_index = !indices.empty();
  // Before the gradients, one call per use of the unit, latest forward first. After them, one call
  // for all uses (its reduction waits for every use's backward), which ends at its earliest forward.
  const size_t index = has_index ? (after_gradients ? indices.front() : indices.back()) : 0;
  if (has_index && after_gradients) indices.clear();
  if (has_index && !after_gradients) indices.pop_back();
  if (group.backward_prefetch()) return within_all_gather_limit(group, lock_all(*group.backward_prefetch()));
  if (!root_->options().fsdp1.backward_prefetch || !has_index || index == 0) return {};
  ParamGroup* previous = post_forward_order_[index - 1];
  if (previous == &group) return {};
  return within_all_gather_limit(group, {previous->shared_from_this()});
}

bool RootState::prefetches_after_gradients() const {
  return root_->options().fsdp1.backward_prefetch == BackwardPrefetch::kBackwardPost;
}

void RootState::on_backward_hook() {
  if (state_ == State::kIdle) begin_iteration();
  state_ = State::kBackward;
  if (final_callback_queued_) return;
  final_callback_queued_ = true;
  auto self = shared_from_this();
  torch::autograd::Engine::get_default_engine().queue_callback([self] { self->finish_backward(); });
}

void RootState::pre_backward(ParamGroup& group) {
  on_backward_hook();
  // BACKWARD_POST prefetches from post_backward instead, once the unit's gradients exist.
  const bool prefetch_now = group.backward_prefetch_pending() && !prefetches_after_gradients();
  group.pre_backward(prefetch_now ? backward_prefetch_targets(group) : std::vector<std::shared_ptr<ParamGroup>>{});
}

void RootState::on_input_gradient(ParamGroup& group) {
  if (group.on_input_gradient()) post_backward(group, /*prefetch=*/true);
}

void RootState::post_backward(ParamGroup& group, bool prefetch) {
  // BACKWARD_POST: the next unit's all-gather goes out once this unit's gradients are computed and
  // its parameters freed, before its reduce-scatter, as FSDP1 orders them.
  group.post_backward(prefetch && prefetches_after_gradients()
                          ? backward_prefetch_targets(group, /*after_gradients=*/true)
                          : std::vector<std::shared_ptr<ParamGroup>>{});
  if (group.has_reduction_in_flight()) track_reduction(group.shared_from_this());
}

void RootState::finish_backward() {
  final_callback_queued_ = false;
  // A fixed order on every rank: reverse forward order, then the units nobody forwarded.
  // No prefetch from here: backward is over, nothing would use the parameters.
  for (auto it = post_forward_order_.rbegin(); it != post_forward_order_.rend(); ++it) {
    if ((*it)->needs_post_backward()) post_backward(**it, /*prefetch=*/false);
  }
  for (auto it = groups_.rbegin(); it != groups_.rend(); ++it) {
    if ((*it)->needs_post_backward()) post_backward(**it, /*prefetch=*/false);
  }
  finish_reductions();
  end_iteration();
}

void RootState::track_reduction(std::shared_ptr<ParamGroup> group) {
  constexpr size_t kMaxInFlight = 2;
  reductions_in_flight_.push_back(std::move(group));
  finish_reductions(kMaxInFlight);
}

void RootState::finish_reductions(size_t keep_in_flight) {
  while (reductions_in_flight_.size() > keep_in_flight) {
    auto oldest = reductions_in_flight_.front();
    reductions_in_flight_.pop_front();
    oldest->finish_reduction();
  }
}

void RootState::end_iteration(bool check) {
  if (state_ == State::kIdle) {
    for (const auto& group : groups_) group->reshard();
    return;
  }
  state_ = State::kIdle;
  post_forward_order_.clear();
  // Every unit is restored before any error is raised, so a failed check leaves no unit behind.
  std::exception_ptr first_error;
  try {
    finish_reductions();
  } catch (...) {
    reductions_in_flight_.clear();
    if (check) first_error = std::current_exception();  // an abandoned iteration's failure was already raised
  }
  // Note [gradient flags]: one host read for every unit's flags.
  std::vector<at::Tensor> flags;
  for (const auto& group : groups_) {
    if (group->gradient_flags().defined()) flags.push_back(group->gradient_flags());
  }
  at::Tensor host_flags;
  if (!flags.empty()) host_flags = at::cat(flags).to(at::kCPU).contiguous();
  const bool* next_flags = host_flags.defined() ? host_flags.data_ptr<bool>() : nullptr;
  for (const auto& group : groups_) {
    const bool* had_gradient = nullptr;
    if (group->gradient_flags().defined()) {
      had_gradient = next_flags;
      next_flags += group->gradient_flags().numel();
    }
    try {
      group->end_iteration(had_gradient, check);
    } catch (...) {
      if (!first_error) first_error = std::current_exception();
    }
  }
  if (first_error) std::rethrow_exception(first_error);
}

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
