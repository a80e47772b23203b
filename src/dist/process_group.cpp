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

int64_t ProcessGroup::rank() const { return state().members->rank; }
int64_t ProcessGroup::size() const { return state().members->size; }
const std::string& ProcessGroup::name() const { return state().members->name; }
const std::vector<int64_t>& ProcessGroup::global_ranks() const { return state().members->global_ranks; }

CollectiveByteCounters ProcessGroup::bytes_sent() const {
  const auto& sent = *state().counters;
  CollectiveByteCounters counters;
  counters.all_gather = sent.all_gather.load();
  counters.reduce_scatter = sent.reduce_scatter.load();
  counters.all_reduce = sent.all_reduce.load();
  counters.broadcast = sent.broadcast.load();
  counters.check = sent.check.load();
  counters.inside_machine = sent.inside_machine.load();
  counters.off_machine = sent.off_machine.load();
  counters.messages = sent.messages.load();
  return counters;
}

void ProcessGroup::reset_bytes_sent() const {
  auto& sent = *state().counters;
  for (auto* counter : {&sent.all_gather, &sent.reduce_scatter, &sent.all_reduce, &sent.broadcast, &sent.check,
                        &sent.inside_machine, &sent.off_machine, &sent.messages}) {
    *counter = 0;
  }
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
