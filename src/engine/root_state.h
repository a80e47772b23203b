// Private: the state shared by the units of one tree (FSDP2's FSDPState context): which unit is
// the root, the training iteration in progress (Note [one training iteration]), the prefetch
// targets (Note [prefetch]) and the reductions in flight. A class of its own, apart from the hooks
// that drive it (module_state.h), so that the registry of trees (registry.h) can read a tree's
// state while the hooks register trees there: each of the three includes only what is below it.
#pragma once

#include <algorithm>
#include <deque>
#include <memory>
#include <vector>

#include "engine/param_group.h"

namespace fsdp::detail {

class RootState : public std::enable_shared_from_this<RootState> {
 public:
  RootState(std::shared_ptr<ParamGroup> root, std::vector<std::shared_ptr<ParamGroup>> groups);
  const std::shared_ptr<ParamGroup>& root() const { return root_; }
  /// Every unit of the tree, in creation order (children before parents).
  const std::vector<std::shared_ptr<ParamGroup>>& groups() const { return groups_; }
  bool iteration_active() const { return state_ != State::kIdle; }

  /// Starts an iteration unless one is running. An iteration whose backward started but never
  /// finished (it threw) is abandoned first, so one failed step cannot break the next.
  void begin_iteration();
  void record_post_forward(ParamGroup* group);
  /// Whether `group`'s forward has run (through fsdp::forward) in the forward in progress.
  bool ran_in_this_forward(const ParamGroup* group) const {
    return std::find(forward_order_.begin(), forward_order_.end(), group) != forward_order_.end();
  }
  /// Units to all-gather while `group` computes its forward: its explicit list, or else (implicit
  /// prefetch) the unit that followed it in the previous forward, if this forward has run the same
  /// units so far. Records `group` in this forward's order.
  std::vector<std::shared_ptr<ParamGroup>> forward_prefetch_targets(ParamGroup& group);
  /// Units to all-gather for the backward after `group`'s: its explicit list, or else the unit whose
  /// forward finished just before this one's (FSDP2's default backward prefetch), within the
  /// all-gather limit. Issued while `group` computes its gradients, or with `after_gradients`
  /// (BACKWARD_POST) once they are computed.
  std::vector<std::shared_ptr<ParamGroup>> backward_prefetch_targets(ParamGroup& group, bool after_gradients = false);
  /// The hook on a unit's outputs: the iteration's bookkeeping (on_backward_hook), then the unit's
  /// all-gather and, the first time in this backward, its prefetch targets.
  void pre_backward(ParamGroup& group);
  /// The backward of one of `group`'s wrapped inputs ran; when it was the last, `group` reduces.
  void on_input_gradient(ParamGroup& group);
  /// Reduces `group` and tracks its reduction in flight; with `prefetch` and BACKWARD_POST, first
  /// issues the all-gather of the unit whose backward comes next.
  void post_backward(ParamGroup& group, bool prefetch);
  /// Called by every pre-backward hook: starts the iteration if a second backward reuses a graph and
  /// queues the end-of-backward callback once.
  void on_backward_hook();
  /// The end-of-backward callback.
  void finish_backward();
  /// Reshards every unit and puts the sharded gradients back (see ParamGroup::end_iteration).
  void end_iteration(bool check = true);
  /// A unit issued its reduction; the oldest beyond two in flight is finished now.
  void track_reduction(std::shared_ptr<ParamGroup> group);
  /// Finishes reductions in flight, oldest first, until at most `keep_in_flight` remain.
  void finish_reductions(size_t keep_in_flight = 0);
  /// `targets` cut to what max_all_gathers_in_flight allows while `group` gathers too.
  std::vector<std::shared_ptr<ParamGroup>> within_all_gather_limit(
      const ParamGroup& group, std::vector<std::shared_ptr<ParamGroup>> targets) const;
  /// Whether backward prefetch waits for the unit's gradients (BACKWARD_POST).
  bool prefetches_after_gradients() const;

 private:
  std::shared_ptr<ParamGroup> root_;
  std::vector<std::shared_ptr<ParamGroup>> groups_;
  /// kIdle: no iteration; kForward: an iteration whose backward has not started (more forwards of
  /// it may follow); kBackward: its backward started (a new forward abandons it).
  enum class State { kIdle, kForward, kBackward };
  State state_ = State::kIdle;
  bool final_callback_queued_ = false;
  std::vector<ParamGroup*> post_forward_order_;
  /// Pre-forward order of the forward in progress and of the one before it (see forward_prefetch_targets).
  std::vector<ParamGroup*> forward_order_;
  std::vector<ParamGroup*> previous_forward_order_;
  std::deque<std::shared_ptr<ParamGroup>> reductions_in_flight_;
};

}  // namespace fsdp::detail
