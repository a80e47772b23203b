// Private: the seam between fsdp.cpp and c10d. Only the files of src/dist/c10d/ include c10d's
// headers (through dist/c10d/internal.h), so a new backend changes that directory alone.
#pragma once

#include <fsdp/distributed_environment.h>
#include <fsdp/process_group.h>

#include <atomic>
#include <chrono>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

namespace fsdp::detail {

/// The c10d objects behind a group (defined in dist/c10d/internal.h).
struct BackendGroup;
/// The rendezvous store (defined in dist/c10d/internal.h).
struct BackendStore;

struct ProcessGroupState {
  // Constant after construction.
  std::string name;
  int64_t rank = 0;
  int64_t size = 1;
  std::vector<int64_t> global_ranks;
  int64_t global_rank = 0;
  std::chrono::milliseconds timeout{0};
  /// Note [Collective check]: headers travel beside every collective (FSDP_CHECK_COLLECTIVES).
  bool check_collectives = true;
  /// Null for a group of one rank: its collectives are local copies.
  std::shared_ptr<BackendGroup> backend;
  /// Sequence number of the next collective; every member issues collectives in the same order, so
  /// the counters agree without communication. It names the collective's point-to-point slots (Note
  /// [Collective check]); Gloo's own collectives use prefixed slots, never these.
  std::atomic<uint32_t> next_sequence{0};

  // Bytes this rank handed to the transport, per collective kind.
  std::atomic<int64_t> bytes_all_gather{0};
  std::atomic<int64_t> bytes_reduce_scatter{0};
  std::atomic<int64_t> bytes_all_reduce{0};
  std::atomic<int64_t> bytes_broadcast{0};
  std::atomic<int64_t> bytes_check{0};

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

/// Creates the group `name` of `global_ranks` (which must contain environment.rank). Every member
/// must call this with the same name and ranks, in the same order relative to other groups.
std::shared_ptr<ProcessGroupState> create_process_group(const std::shared_ptr<BackendStore>& store,
                                                        const DistributedEnvironment& environment,
                                                        const std::string& name,
                                                        const std::vector<int64_t>& global_ranks);

/// Gloo's own all-gather (`_allgather_base`) and reduce-scatter (`_reduce_scatter_base`, sum) on the
/// same buffers as fsdp::all_gather and fsdp::reduce_scatter: the measurement behind Note
/// [Collectives on Gloo], for bench/collective_bench only. Synchronous; not in the byte counters.
void native_all_gather(const ProcessGroup& group, const at::Tensor& output, const at::Tensor& input);
void native_reduce_scatter(const ProcessGroup& group, const at::Tensor& output, const at::Tensor& input);
/// Gloo's own ring all-reduce (sum), whatever Note [Algorithms by measurement] would choose.
void native_all_reduce(const ProcessGroup& group, const at::Tensor& tensor);

}  // namespace fsdp::detail
