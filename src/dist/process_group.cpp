// Process group handles: a group's members, its byte counters and its trace. The rendezvous that
// creates groups is rendezvous.cpp; c10d itself is behind dist/c10d/backend.h.
#include <fsdp/process_group.h>

#include "dist/c10d/backend.h"

namespace fsdp {

ProcessGroup::ProcessGroup(std::shared_ptr<detail::ProcessGroupState> state) : state_(std::move(state)) {}

detail::ProcessGroupState& ProcessGroup::state() const {
  TORCH_CHECK(state_ != nullptr, "ProcessGroup: this handle is empty; get groups from a DistributedContext.");
  return *state_;
}

detail::ProcessGroupState& detail::state_of(const ProcessGroup& group) { return group.state(); }

int64_t ProcessGroup::rank() const { return state().rank; }
int64_t ProcessGroup::size() const { return state().size; }
const std::string& ProcessGroup::name() const { return state().name; }
const std::vector<int64_t>& ProcessGroup::global_ranks() const { return state().global_ranks; }

CollectiveByteCounters ProcessGroup::bytes_sent() const {
  const auto& group = state();
  CollectiveByteCounters counters;
  counters.all_gather = group.bytes_all_gather.load();
  counters.reduce_scatter = group.bytes_reduce_scatter.load();
  counters.all_reduce = group.bytes_all_reduce.load();
  counters.broadcast = group.bytes_broadcast.load();
  counters.check = group.bytes_check.load();
  return counters;
}

void ProcessGroup::reset_bytes_sent() const {
  auto& group = state();
  group.bytes_all_gather = 0;
  group.bytes_reduce_scatter = 0;
  group.bytes_all_reduce = 0;
  group.bytes_broadcast = 0;
  group.bytes_check = 0;
}

void ProcessGroup::start_trace() const {
  auto& group = state();
  std::lock_guard<std::mutex> lock(group.trace_mutex);
  group.trace.clear();
  group.tracing = true;
}

std::vector<std::string> ProcessGroup::stop_trace() const {
  auto& group = state();
  std::lock_guard<std::mutex> lock(group.trace_mutex);
  group.tracing = false;
  return std::move(group.trace);
}

}  // namespace fsdp
