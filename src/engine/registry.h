// Private: which unit a module belongs to. libtorch modules have no slot for FSDP's state, so units
// are found through this process-wide table. Entries hold the unit and a weak pointer to the module;
// a module's address may be reused after it dies, so every hit is checked against the weak pointer,
// and entries of dead modules are dropped whenever the table is listed.
#pragma once

#include <torch/nn/module.h>

#include <memory>
#include <unordered_set>
#include <vector>

namespace fsdp::detail {

class ParamGroup;
class RootState;

/// Adds a unit (one entry per module of the unit) and forgets every tree's root: a new unit may
/// change which unit is the root, decided again at the next forward.
void register_param_group(const std::shared_ptr<ParamGroup>& group);
std::shared_ptr<ParamGroup> find_param_group(const torch::nn::Module* module);
/// Every live unit, in creation order.
std::vector<std::shared_ptr<ParamGroup>> all_param_groups();
/// The parameters existing units manage (tied weights are managed once, by the first unit).
std::unordered_set<const c10::TensorImpl*> managed_parameters();
/// Keeps a tree's state alive while its root module lives, and records it as the tree of each of
/// its units.
void register_root_state(const std::shared_ptr<RootState>& root_state);
/// The state of the tree `group` belongs to; null until the root is decided (again, after a new
/// unit was created).
std::shared_ptr<RootState> root_state_of(const ParamGroup& group);

}  // namespace fsdp::detail
