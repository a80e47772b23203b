// The state shared by the units of one tree (FSDP2's FSDPState context): which unit is the root,
// the training iteration in progress, and the end-of-backward callback. Also the registry that maps
// a module to its unit, since libtorch modules have no slot for it.
//
// [Note: one training iteration]
// An iteration starts at the first forward with grad mode on. Every unit then moves its sharded
// gradients aside (param_group.h) and the root all-gathers at its own forward like every unit. The
// first backward hook queues a callback on the autograd engine; when backward finishes it reduces
// the units whose gradients never all arrived (unused parameters, inputs that did not require
// grad) in reverse forward order, then the units nobody forwarded, so every rank issues the same
// collectives; then it reshards everything and puts the sharded gradients back. A forward without
// grad mode frees every unit, root included, right after it.
#pragma once

#include <memory>
#include <unordered_set>
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

  void begin_iteration();
  void record_post_forward(ParamGroup* group);
  /// Called by every backward hook: starts the iteration if a second backward reuses a graph and
  /// queues the end-of-backward callback once.
  void on_backward_hook();
  /// Queues the end-of-backward callback once per backward (from a gradient hook, which must not
  /// start an iteration: its gradient is already written).
  void queue_final_callback();
  /// The end-of-backward callback.
  void finish_backward();
  /// Reshards every unit and puts the sharded gradients back.
  void end_iteration();

 private:
  std::shared_ptr<ParamGroup> root_;
  std::vector<std::shared_ptr<ParamGroup>> groups_;
  bool iteration_active_ = false;
  bool final_callback_queued_ = false;
  std::vector<ParamGroup*> post_forward_order_;
};

/// Adds a unit to the registry (one entry per module of the unit).
void register_param_group(const std::shared_ptr<ParamGroup>& group);
/// The parameters existing units manage (tied weights are managed once, by the first unit).
std::unordered_set<const c10::TensorImpl*> managed_parameters();
/// Every live unit, in creation order.
std::vector<std::shared_ptr<ParamGroup>> all_param_groups();
/// The tree state of `group`, deciding the root on first use (FSDP2's lazy init).
std::shared_ptr<RootState> ensure_root_state(ParamGroup& group);

}  // namespace fsdp::detail
