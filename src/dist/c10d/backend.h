// Private: the seam between fsdp.cpp and c10d. Only the files of src/dist/c10d/ include c10d's
// headers (through dist/c10d/internal.h), so a new backend changes that directory alone.
#pragma once

#include <ATen/core/Tensor.h>
#include <fsdp/distributed_environment.h>
#include <fsdp/process_group.h>

#include <array>
#include <atomic>
#include <chrono>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "dist/collective_algorithm.h"

namespace fsdp::detail {

/// The c10d objects behind a group (defined in dist/c10d/internal.h).
struct BackendGroup;
/// The rendezvous store (defined in dist/c10d/internal.h).
struct BackendStore;

/// Who is in a group and where they run. Constant once the group is in use; shared with the tasks
/// its collectives leave on the group's issue queue (dist/c10d/internal.h).
struct GroupMembers {
  std::string name;
  /// This rank's place in the group, the group's size and this process's global rank.
  int64_t rank = 0;
  int64_t size = 1;
  int64_t global_rank = 0;
  /// Global rank of each group rank.
  std::vector<int64_t> global_ranks;
  /// The machine (node rank) of each group rank: Note [Algorithms by measurement].
  std::vector<int64_t> machines;
  GroupShape shape;
  std::chrono::milliseconds timeout{0};
  /// Note [Collective check]: a stalled collective is diagnosed (FSDP_CHECK_COLLECTIVES).
  bool check_collectives = true;

  bool same_machine(int64_t group_rank) const {
    return machines[static_cast<size_t>(group_rank)] == machines[static_cast<size_t>(rank)];
  }
};

/// Note [Byte counters]: what this rank handed to the transport for other ranks, counted where each
/// message is posted. Shared with the tasks of the group's issue queue, which post messages too.
struct GroupCounters {
  std::atomic<int64_t> all_gather{0};
  std::atomic<int64_t> reduce_scatter{0};
  std::atomic<int64_t> all_reduce{0};
  std::atomic<int64_t> broadcast{0};
  std::atomic<int64_t> check{0};
  std::atomic<int64_t> inside_machine{0};
  std::atomic<int64_t> off_machine{0};
  std::atomic<int64_t> messages{0};
};

struct ProcessGroupState {
  /// Constant once the group is in use (set_group_machines replaces it before then).
  std::shared_ptr<const GroupMembers> members;
  /// Null for a group of one rank: its collectives are local copies.
  std::shared_ptr<BackendGroup> backend;
  /// Sequence number of the next collective; every member issues collectives in the same order, so
  /// the counters agree without communication. It keys the collective's slot (Note [Collective check]).
  std::atomic<uint32_t> next_sequence{0};
  std::shared_ptr<GroupCounters> counters = std::make_shared<GroupCounters>();
  /// force_algorithm's choice per CollectiveOperation (-1: the table's).
  std::array<std::atomic<int>, 3> forced_algorithm{-1, -1, -1};
  /// FSDP_DEBUG: the (operation, table line) choices already printed for this group.
  std::mutex choices_mutex;
  std::set<std::pair<int, int64_t>> printed_choices;

  // ProcessGroup::start_trace / stop_trace.
  std::mutex trace_mutex;
  bool tracing = false;
  std::vector<std::string> trace;
  void record(const char* kind, int64_t bytes) {
    std::lock_guard<std::mutex> lock(trace_mutex);
    if (tracing) trace.push_back(std::string(kind) + " " + std::to_string(bytes));
  }
};

/// Connects to (rank 0: hosts) the TCP store at MASTER_ADDR:MASTER_PORT. Throws with the address,
/// port and timeout when the master cannot be reached or its port cannot be bound.
std::shared_ptr<BackendStore> connect_rendezvous_store(const DistributedEnvironment& environment);

/// Creates the group `name` of `global_ranks` (which must contain environment.rank), whose member
/// global rank r runs on machine `machine_of_rank[r]` (empty: not known yet, all on one machine).
/// Every member must call this with the same name and ranks, in the same order relative to other
/// groups.
std::shared_ptr<ProcessGroupState> create_process_group(const std::shared_ptr<BackendStore>& store,
                                                        const DistributedEnvironment& environment,
                                                        const std::string& name,
                                                        const std::vector<int64_t>& global_ranks,
                                                        const std::vector<int64_t>& machine_of_rank = {});

/// Tells a group made before the node layout was known (the control channel) where its members run.
/// Call before its next collective, from the thread that issues them.
void set_group_machines(ProcessGroupState& group, const std::vector<int64_t>& machine_of_rank);

/// Gloo's own all-gather (`_allgather_base`) and reduce-scatter (`_reduce_scatter_base`, sum) on the
/// same buffers as fsdp::all_gather and fsdp::reduce_scatter: the measurement behind Note
/// [Collectives on Gloo], for bench/collective_bench only. Synchronous; not in the byte counters.
void native_all_gather(const ProcessGroup& group, const at::Tensor& output, const at::Tensor& input);
void native_reduce_scatter(const ProcessGroup& group, const at::Tensor& output, const at::Tensor& input);
/// Gloo's own ring all-reduce (sum), whatever Note [Algorithms by measurement] would choose.
void native_all_reduce(const ProcessGroup& group, const at::Tensor& tensor);

/// Note [Algorithms by measurement]: the algorithm a CPU collective of `operation` moving `bytes` runs
/// on `group` (forced, or from the table; FSDP_DEBUG=1 prints each choice once).
CollectiveAlgorithm algorithm_for(ProcessGroupState& group, CollectiveOperation operation, int64_t bytes);

/// Note [Algorithms by measurement]: makes the group's CPU collectives of `operation` run
/// `algorithm` whatever the table says (for collective_bench --sweep, which times each one through
/// the engine's own calls). Every member must force the same. nullopt goes back to the table.
void force_algorithm(const ProcessGroup& group, CollectiveOperation operation,
                     std::optional<CollectiveAlgorithm> algorithm);

}  // namespace fsdp::detail
