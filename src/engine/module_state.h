// The state shared by the units of one tree (FSDP2's FSDPState context) and the hooks around a
// unit's forward: which unit is the root, the training iteration in progress, the end-of-backward
// callback.
//
// [Note: one training iteration]
// An iteration starts at the first forward with grad mode on: every unit moves its sharded gradients
// aside (param_group.h). Each unit all-gathers at its forward. Its floating inputs that require grad
// pass through an identity autograd function whose backward runs once the unit's whole backward for
// that input is done (FSDP2's RegisterPostBackwardFunction): when all of them have reported, the
// unit reduces its gradients and reshards. This trigger depends on the graph's structure only, not
// on which parameters happened to get gradients, so every rank reduces in the same order. Hooks on
// the unit's outputs all-gather it again before its backward and queue, once, a callback on the
// autograd engine; when backward finishes it reduces the units still pending (those whose inputs did
// not require grad, and units nobody forwarded) in reverse forward order and then in reverse creation
// order, reshards everything and puts the sharded gradients back. A forward without grad mode frees
// every unit of the tree, root included, when the root's forward returns.
#pragma once

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
  bool iteration_active() const { return iteration_active_; }

  /// Starts an iteration unless one is running. An iteration whose backward started but never
  /// finished (it threw) is abandoned first, so one failed step cannot break the next.
  void begin_iteration();
  void record_post_forward(ParamGroup* group);
  /// Called by every pre-backward hook: starts the iteration if a second backward reuses a graph and
  /// queues the end-of-backward callback once.
  void on_backward_hook();
  /// The end-of-backward callback.
  void finish_backward();
  /// Reshards every unit and puts the sharded gradients back (see ParamGroup::end_iteration).
  void end_iteration(bool check = true);
  /// A unit issued its reduction; the oldest beyond two in flight is finished now.
  void track_reduction(std::shared_ptr<ParamGroup> group);
  /// Finishes every reduction in flight, in issue order.
  void finish_reductions();

 private:
  std::shared_ptr<ParamGroup> root_;
  std::vector<std::shared_ptr<ParamGroup>> groups_;
  bool iteration_active_ = false;
  bool backward_started_ = false;
  bool final_callback_queued_ = false;
  std::vector<ParamGroup*> post_forward_order_;
  std::deque<std::shared_ptr<ParamGroup>> reductions_in_flight_;
};

/// The tree state of `group`, deciding the root on first use (FSDP2's lazy init).
std::shared_ptr<RootState> ensure_root_state(ParamGroup& group);

}  // namespace fsdp::detail
