// Process groups: who talks to whom.
//
// A `ProcessGroup` is a cheap, copyable handle to a set of ranks that run collectives together (a
// c10d Gloo group underneath; see src/dist/c10d/, the only directory that touches c10d). A
// `DistributedContext` owns the rendezvous store and the three groups FSDP needs: the whole world,
// the ranks on this machine (the shard group of HYBRID_SHARD) and the ranks with the same local
// rank on every machine (its replicate group). All groups are created on every rank in the same
// order, after checking that every rank agrees on the layout.
//
// Thread-safety: collectives on one group must be issued in the same order on every rank; issue
// them from one thread.
#pragma once

#include <fsdp/distributed_environment.h>

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace fsdp {

/// Bytes this rank handed to the transport for other ranks since the group was created (or
/// reset_bytes_sent), per collective kind and, apart, by where they went (Note [Byte counters],
/// docs/design.md). All-gather and reduce-scatter each send (N-1)/N of the full buffer; across
/// machines the two-level algorithms send only (M-1)/M of it off each machine (Note [Algorithms by
/// measurement]).
struct CollectiveByteCounters {
  int64_t all_gather = 0;
  int64_t reduce_scatter = 0;
  int64_t all_reduce = 0;  // barriers included: an all-reduce of one byte
  int64_t broadcast = 0;
  /// The headers that travel beside an NCCL collective (Note [The GPU path]): 256 bytes to every
  /// peer per GPU collective while FSDP_CHECK_COLLECTIVES is on. A CPU collective's check sends
  /// nothing (Note [Collective check]): 0.
  int64_t check = 0;
  /// The same bytes by destination: to ranks on this rank's machine, and to other machines (the node
  /// layout every rank reported; a group made before it was known counts everything as inside).
  /// CPU collectives only: NCCL chooses its own paths.
  int64_t inside_machine = 0;
  int64_t off_machine = 0;
  /// Point-to-point messages this rank posted (CPU collectives).
  int64_t messages = 0;
  int64_t total() const { return all_gather + reduce_scatter + all_reduce + broadcast + check; }
};

class ProcessGroup;
namespace detail {
struct ProcessGroupState;
/// Not part of the API (detail): the state behind a handle, for src/dist/ (an error when empty).
ProcessGroupState& state_of(const ProcessGroup& group);
}  // namespace detail

class ProcessGroup {
 public:
  /// An empty handle; using it is an error.
  ProcessGroup() = default;
  explicit ProcessGroup(std::shared_ptr<detail::ProcessGroupState> state);

  /// This process's rank inside the group.
  int64_t rank() const;
  /// Number of ranks in the group.
  int64_t size() const;
  /// A human name used in errors ("world", "intra_node[1]", ...).
  const std::string& name() const;
  /// Global ranks of the members, in group-rank order.
  const std::vector<int64_t>& global_ranks() const;
  /// Bytes sent by this rank on this group so far.
  CollectiveByteCounters bytes_sent() const;
  void reset_bytes_sent() const;
  /// Starts recording (afresh) the collectives this rank issues on this group, for tests and
  /// debugging: one entry per collective in issue order, "<kind> <bytes>" with this rank's input
  /// bytes ("all_gather 160", "reduce_scatter 640", "all_reduce 8", "broadcast 4", "barrier 0").
  void start_trace() const;
  /// What was recorded since start_trace(); recording stops.
  std::vector<std::string> stop_trace() const;

  explicit operator bool() const { return state_ != nullptr; }

 private:
  friend detail::ProcessGroupState& detail::state_of(const ProcessGroup& group);
  detail::ProcessGroupState& state() const;
  std::shared_ptr<detail::ProcessGroupState> state_;
};

namespace detail {
struct RendezvousState;
}

/// The process groups of one job. Construct once per process; copies share the same groups.
class DistributedContext {
 public:
  /// Rendezvous with the other ranks described by `environment` and create the groups.
  /// World size 1 creates no store and opens no socket.
  static DistributedContext initialize(const DistributedEnvironment& environment);
  /// `initialize(parse_distributed_environment(current_process_environment()))`.
  static DistributedContext initialize_from_environment();

  const DistributedEnvironment& environment() const;
  int64_t rank() const { return environment().rank; }
  int64_t world_size() const { return environment().world_size; }
  bool is_main_process() const { return rank() == 0; }

  /// Every rank of the job.
  const ProcessGroup& world() const;
  /// The ranks on this machine (HYBRID_SHARD shards inside it).
  const ProcessGroup& intra_node() const;
  /// The ranks with this rank's local rank, one per machine (HYBRID_SHARD replicates across it).
  const ProcessGroup& cross_node() const;
  /// Every rank of the job, on a channel of its own for host-side control messages (agreement,
  /// layout exchange, rank 0's status): Note [the control channel] in src/dist/control_channel.h.
  /// Always CPU tensors; never used for parameters or gradients.
  const ProcessGroup& control() const;
  /// The group of `size` consecutive ranks of `parent` that holds this rank (the members
  /// parent.global_ranks()[i * size, (i + 1) * size) for the i that holds it): the post-forward
  /// group of an integer reshard_after_forward. Created on first use and kept; every rank of
  /// `parent` must ask for the same sizes in the same order (fully_shard does: it runs in the same
  /// order everywhere). `size` must divide parent.size(); `parent` itself when equal.
  const ProcessGroup& consecutive_subgroup(const ProcessGroup& parent, int64_t size) const;

 private:
  std::shared_ptr<detail::RendezvousState> state_;
};

/// Raises the same error on every rank when `fields` (names and their values' text, the same names
/// in the same order) differ across ranks: `what`, each field that differs with the ranks holding
/// each value ("'--seed' is 1234 on rank 0 and 1235 on rank 1"), then `fix`. Call it before the
/// first collective of a run, with everything that must agree. Collective over `context.world()`.
void require_same_on_every_rank(const DistributedContext& context, const std::string& what,
                                const std::vector<std::pair<std::string, std::string>>& fields, const std::string& fix);

}  // namespace fsdp
