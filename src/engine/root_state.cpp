#include "engine/root_state.h"

#include <torch/csrc/autograd/engine.h>

namespace fsdp::detail {

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

}  // namespace fsdp::detail
