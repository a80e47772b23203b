// DistributedContext (fsdp/process_group.h): the rendezvous that connects the ranks and creates the
// world, node and control groups, and the subgroups made on request. A file of its own because it
// all-gathers the ranks' reports with the public collectives (fsdp/collectives.h), which take the
// process groups that process_group.cpp implements: kept apart, neither includes the other.
#include <ATen/ATen.h>
#include <fsdp/collectives.h>
#include <fsdp/process_group.h>

#include <map>
#include <mutex>
#include <string>

#include "dist/c10d/backend.h"
#include "dist/node_layout.h"

namespace fsdp {

namespace detail {

struct RendezvousState {
  DistributedEnvironment environment;
  std::shared_ptr<BackendStore> store;
  ProcessGroup world;
  ProcessGroup intra_node;
  ProcessGroup cross_node;
  ProcessGroup control;
  /// The machine (node rank) of each global rank, from the layout every rank reported.
  std::vector<int64_t> machine_of_rank;
  /// DistributedContext::consecutive_subgroup's groups by name.
  std::mutex subgroups_mutex;
  std::map<std::string, ProcessGroup> subgroups;
};

}  // namespace detail

const DistributedEnvironment& DistributedContext::environment() const { return state_->environment; }
const ProcessGroup& DistributedContext::world() const { return state_->world; }
const ProcessGroup& DistributedContext::intra_node() const { return state_->intra_node; }
const ProcessGroup& DistributedContext::cross_node() const { return state_->cross_node; }
const ProcessGroup& DistributedContext::control() const { return state_->control; }

const ProcessGroup& DistributedContext::consecutive_subgroup(const ProcessGroup& parent, int64_t size) const {
  TORCH_CHECK(size >= 1 && parent.size() % size == 0, "[rank ", rank(), "] a group of ", size,
              " consecutive ranks cannot split '", parent.name(), "' of ", parent.size(),
              " ranks; the size must divide it");
  if (size == parent.size()) return parent;
  const int64_t first = parent.rank() / size * size;
  const auto& ranks = parent.global_ranks();
  const std::vector<int64_t> members(ranks.begin() + first, ranks.begin() + first + size);
  const std::string name =
      parent.name() + "[ranks " + std::to_string(members.front()) + "-" + std::to_string(members.back()) + "]";
  std::lock_guard<std::mutex> lock(state_->subgroups_mutex);
  auto found = state_->subgroups.find(name);
  if (found != state_->subgroups.end()) return found->second;
  auto group = ProcessGroup(detail::create_process_group(size == 1 ? nullptr : state_->store, environment(), name,
                                                         members, state_->machine_of_rank));
  return state_->subgroups.emplace(name, std::move(group)).first->second;
}

DistributedContext DistributedContext::initialize_from_environment() {
  return initialize(parse_distributed_environment(current_process_environment()));
}

DistributedContext DistributedContext::initialize(const DistributedEnvironment& environment) {
  DistributedContext context;
  context.state_ = std::make_shared<detail::RendezvousState>();
  auto& state = *context.state_;
  state.environment = environment;
  if (!environment.is_distributed()) {
    auto single = ProcessGroup(detail::create_process_group(nullptr, environment, "world", {environment.rank}));
    state.world = single;
    state.intra_node = single;
    state.cross_node =
        ProcessGroup(detail::create_process_group(nullptr, environment, "cross_node[0]", {environment.rank}));
    state.control = ProcessGroup(detail::create_process_group(nullptr, environment, "control", {environment.rank}));
    return context;
  }

  state.store = detail::connect_rendezvous_store(environment);
  std::vector<int64_t> everyone(environment.world_size);
  for (int64_t rank = 0; rank < environment.world_size; ++rank) everyone[rank] = rank;
  state.control = ProcessGroup(detail::create_process_group(state.store, environment, "control", everyone));

  // Every rank states where it thinks it is; the groups are planned from what all of them said, so
  // a rank with a stale variable is named here instead of deadlocking a hybrid collective later.
  auto mine = at::tensor(
      {environment.rank, environment.local_rank, environment.local_world_size, environment.node_rank}, at::kLong);
  auto all = at::empty({environment.world_size * 4}, at::kLong);
  all_gather(state.control, all, mine);
  std::vector<detail::RankReport> reports(environment.world_size);
  auto values = all.accessor<int64_t, 1>();
  for (int64_t rank = 0; rank < environment.world_size; ++rank) {
    reports[rank] =
        detail::RankReport{values[rank * 4], values[rank * 4 + 1], values[rank * 4 + 2], values[rank * 4 + 3]};
  }
  auto layout = detail::plan_node_layout(reports);
  state.machine_of_rank.resize(static_cast<size_t>(environment.world_size));
  for (const auto& report : reports) state.machine_of_rank[static_cast<size_t>(report.rank)] = report.node_rank;
  // The control channel was made before anyone knew the layout (it carried the reports); every other
  // group knows where its members run from the start (Note [Algorithms by measurement]).
  detail::set_group_machines(detail::state_of(state.control), state.machine_of_rank);
  state.world =
      ProcessGroup(detail::create_process_group(state.store, environment, "world", everyone, state.machine_of_rank));

  if (layout.num_nodes == 1) {
    state.intra_node = state.world;
  } else {
    state.intra_node = ProcessGroup(detail::create_process_group(
        state.store, environment, "intra_node[" + std::to_string(environment.node_rank) + "]",
        layout.intra_node_groups[environment.node_rank], state.machine_of_rank));
  }
  state.cross_node = ProcessGroup(detail::create_process_group(
      state.store, environment, "cross_node[" + std::to_string(environment.local_rank) + "]",
      layout.cross_node_groups[environment.local_rank], state.machine_of_rank));
  return context;
}

}  // namespace fsdp
