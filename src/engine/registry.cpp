#include "engine/registry.h"

#include <algorithm>
#include <mutex>
#include <unordered_map>

#include "engine/param_group.h"
#include "engine/root_state.h"

namespace fsdp::detail {
namespace {

struct RegistryEntry {
  std::weak_ptr<torch::nn::Module> module;
  std::shared_ptr<ParamGroup> group;
};

struct Registry {
  std::mutex mutex;
  std::unordered_map<const torch::nn::Module*, RegistryEntry> by_module;
  std::vector<std::weak_ptr<ParamGroup>> creation_order;
  std::vector<std::shared_ptr<RootState>> root_states;
  /// Which tree each unit belongs to, so that a unit itself holds no pointer to its root state.
  /// The weak unit pointer guards against a dead unit's address being reused.
  std::unordered_map<const ParamGroup*, std::pair<std::weak_ptr<ParamGroup>, std::weak_ptr<RootState>>> tree_of;

  // Called with the mutex held. Dropping the entries releases the shards of destroyed models.
  void drop_dead_entries() {
    for (auto it = by_module.begin(); it != by_module.end();) {
      it = it->second.module.expired() ? by_module.erase(it) : std::next(it);
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

}  // namespace

void register_param_group(const std::shared_ptr<ParamGroup>& group) {
  auto& state = registry();
  std::lock_guard<std::mutex> lock(state.mutex);
  state.drop_dead_entries();
  for (const auto& root_state : state.root_states) {
    TORCH_CHECK(!root_state->iteration_active(), group->on_rank(), "fully_shard: ", group->description(),
                " was created while a training iteration of ", root_state->root()->description(),
                " is in progress (after a forward, before its backward). Shard every module before training");
  }
  for (const auto& root_state : state.root_states) {
    for (const auto& member : root_state->groups()) member->set_root(false);
  }
  state.root_states.clear();
  state.tree_of.clear();
  for (const auto& weak_module : group->modules()) {
    auto module = weak_module.lock();
    state.by_module[module.get()] = RegistryEntry{module, group};
  }
  state.creation_order.push_back(group);
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

std::vector<std::shared_ptr<ParamGroup>> all_param_groups() {
  auto& state = registry();
  std::lock_guard<std::mutex> lock(state.mutex);
  state.drop_dead_entries();
  std::vector<std::shared_ptr<ParamGroup>> groups;
  for (const auto& weak_group : state.creation_order) {
    if (auto group = weak_group.lock()) groups.push_back(group);
  }
  return groups;
}

std::unordered_set<const c10::TensorImpl*> managed_parameters() {
  std::unordered_set<const c10::TensorImpl*> managed;
  for (const auto& group : all_param_groups()) {
    for (const auto& parameter : group->parameters()) managed.insert(parameter.parameter.unsafeGetTensorImpl());
  }
  return managed;
}

void register_root_state(const std::shared_ptr<RootState>& root_state) {
  auto& state = registry();
  std::lock_guard<std::mutex> lock(state.mutex);
  state.root_states.push_back(root_state);
  for (const auto& member : root_state->groups()) state.tree_of[member.get()] = {member, root_state};
}

std::shared_ptr<RootState> root_state_of(const ParamGroup& group) {
  auto& state = registry();
  std::lock_guard<std::mutex> lock(state.mutex);
  auto it = state.tree_of.find(&group);
  if (it == state.tree_of.end() || it->second.first.lock().get() != &group) return nullptr;
  return it->second.second.lock();
}

}  // namespace fsdp::detail
