// The state shared by the units of one tree (FSDP2's FSDPState context) and the hooks around a
// unit's forward: which unit is the root, the training iteration in progress, the end-of-backward
// callback.
//
// Note [one training iteration]
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
// Ranks that take different branches inside a unit therefore still issue the same collectives in
// the same order (tested). An earlier design reduced a unit when every parameter's AccumulateGrad
// hook had fired; that let one rank reduce a unit mid-backward while another deferred it, and it
// freed gathered weights that a frozen parameter's backward still needed.
//
// Note [prefetch]
// On CUDA, FSDP2 overlaps the next unit's all-gather with the current unit's compute because the CPU
// runs ahead of the GPU streams ("implicit prefetch"). On CPU nothing runs ahead, so the overlap is
// made explicit: a unit issues its own all-gather, then the next unit's (forward: the one that ran
// after it in the previous forward; backward: FSDP2's default, the unit before it in post-forward
// order), and only then waits for its own. Collectives must be issued in the same order on every
// rank; both choices depend only on the sequence of units run, which every rank shares anyway. A
// mistargeted prefetch costs one all-gather and is resharded at the end of the iteration.
// FSDP1's options change two things: BACKWARD_POST issues the backward target from the unit's
// post-backward (after its gradients, once it is resharded, before its reduce-scatter) rather than
// before its gradients, and max_all_gathers_in_flight (limit_all_gathers) drops a target that would
// exceed the limit, so that unit is gathered when it runs.
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
  bool iteration_active() const { return state_ != State::kIdle; }

  /// Starts an iteration unless one is running. An iteration whose backward started but never
  /// finished (it threw) is abandoned first, so one failed step cannot break the next.
  void begin_iteration();
  void record_post_forward(ParamGroup* group);
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

/// The tree state of `group`, deciding the root on first use (FSDP2's lazy init).
std::shared_ptr<RootState> ensure_root_state(ParamGroup& group);

}  // namespace fsdp::detail
