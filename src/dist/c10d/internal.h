// Private to src/dist/c10d/: the c10d objects behind a group and the pieces the collectives are
// built from. The only header that includes c10d's; nothing outside this directory includes it, so
// c10d is reached only from here (docs/architecture.md).
#pragma once

#include <fsdp/collectives.h>

#include <condition_variable>
#include <deque>
#include <functional>
#include <future>
#include <optional>
#include <thread>
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/Types.hpp>

#include "dist/c10d/backend.h"

namespace fsdp::detail {

struct BackendStore {
  c10::intrusive_ptr<c10d::Store> store;
  std::shared_ptr<::gloo::transport::Device> device;
};

/// Runs tasks one after another on a thread of its own, in the order they were queued: the steps of
/// a collective that need an earlier step's result (Note [Algorithms by measurement]: the rings, the
/// second level, the direct all-reduce's second half), so that the caller's `_async` returns at once
/// and every rank still runs them in the same order. A task holds a Transport, never the group,
/// which owns the queue.
class IssueQueue {
 public:
  ~IssueQueue();
  void push(std::function<void()> task);

 private:
  std::mutex mutex_;
  std::condition_variable changed_;
  std::deque<std::function<void()>> tasks_;
  bool stopping_ = false;
  std::thread thread_;
};

struct BackendGroup {
  c10::intrusive_ptr<c10d::ProcessGroupGloo> group;
  // The group's store: for the NCCL group made on its first CUDA collective, and for the diagnosis of
  // a stalled collective (Note [Collective check]).
  c10::intrusive_ptr<c10d::Store> store;
  // Note [The GPU path]: the same members over NCCL (a c10d::ProcessGroupNCCL, made by nccl.cpp on
  // the group's first CUDA collective, which every member issues at the same point of its program).
  c10::intrusive_ptr<c10d::Backend> nccl;
  IssueQueue issue_queue;
};

/// What posting and waiting messages of a group needs, by value: the collectives' queued tasks hold
/// one instead of the group.
struct Transport {
  c10::intrusive_ptr<c10d::ProcessGroupGloo> gloo;
  c10::intrusive_ptr<c10d::Store> store;
  std::shared_ptr<const GroupMembers> members;
  std::shared_ptr<GroupCounters> counters;
};

Transport transport_of(const ProcessGroupState& group);

// --- collective_check.cpp -----------------------------------------------------------------------------

/// FSDP_DEBUG=1: the collectives print what they chose and what they diagnosed, on stderr.
bool debug_enabled();

enum class CollectiveKind : int64_t { kAllGather = 1, kReduceScatter, kAllReduce, kBroadcast, kBarrier };

/// One collective as issued (Note [Collective check]): its sequence number, the slot its messages
/// travel on (the sequence number and a digest of what it is), and what it is, for errors.
struct IssuedCollective {
  CollectiveKind kind = CollectiveKind::kAllGather;
  uint32_t sequence = 0;
  int data_tag = 0;
  /// What this rank issued (operation, count, dtype, root or op, activity), encoded as the headers
  /// and the stall reports carry it.
  std::shared_ptr<const std::vector<uint8_t>> header;
  /// "[rank 3] all_gather on group 'world' (...) (for <activity>)".
  std::string description;
  /// The check is on: a stalled wait is diagnosed; on NCCL, headers travel beside the collective.
  bool checked = false;
  /// Whether this rank has told its peers, through the store, why the collective failed here.
  std::shared_ptr<std::atomic<bool>> reported = std::make_shared<std::atomic<bool>>(false);
};

/// Draws the group's next sequence number and makes the collective's slot and header.
IssuedCollective issue_collective(ProcessGroupState& group, CollectiveKind kind, const at::Tensor& tensor,
                                  int64_t detail, const std::string& description);

/// `description` with what the collective is for (src/dist/activity.h) when there is an activity:
/// recorded when issued, since the wait may come later, inside another unit's work.
std::string with_activity(std::string description);

/// Note [Collective check]: tells the peers that may wait for this rank in `issued` that it failed
/// here, and why (once; nothing with the check off). Never throws.
void publish_failure(const Transport& transport, const IssuedCollective& issued, const std::string& text);

/// Note [The GPU path]: the header exchange that travels on Gloo beside an NCCL collective.
struct CollectiveCheck {
  at::Tensor headers;  // [N, kHeaderBytes]: row r is group rank r's header; our own row is sent
  std::vector<c10::intrusive_ptr<c10d::Work>> receives;  // one per peer, exchange_peers order
  std::vector<c10::intrusive_ptr<c10d::Work>> sends;
  std::vector<int64_t> peers;  // global ranks of `receives` then `sends` (exchange_peers order)
  int64_t rank = 0;
  std::vector<int64_t> global_ranks;
  std::string group_name;
  std::string description;
  bool verified = false;
};

/// Posts `issued`'s header to every peer and a receive of theirs (an NCCL collective's check).
std::shared_ptr<CollectiveCheck> post_headers(ProcessGroupState& group, const IssuedCollective& issued);

/// Waits for every peer's header and throws the named error when they differ from ours or a peer
/// never sent one. Idempotent once it has passed.
void verify_check(CollectiveCheck& check, std::chrono::milliseconds timeout);

/// Note [Collective check]: while a wait of a checked collective is registered, the process's stall
/// watch diagnoses it once it has lasted past the grace period: it reports what this rank waits in
/// to the group's store, reads the report of the peer it waits for, and on a difference (or a peer
/// that failed) records the named error and aborts `current` so the wait returns.
class StallRegistration {
 public:
  StallRegistration(const Transport& transport, const IssuedCollective& issued, const std::vector<int64_t>& peers);
  ~StallRegistration();
  StallRegistration(const StallRegistration&) = delete;
  StallRegistration& operator=(const StallRegistration&) = delete;
  /// About to wait for `work`, an exchange with group rank `peer`; throws the error already found.
  void waiting_on(const c10::intrusive_ptr<c10d::Work>& work, int64_t peer);
  /// The named error found for this collective, if any.
  std::optional<std::string> verdict() const;
  /// After the wait failed on its own (a closed connection, a timeout): tells the peers that wait for
  /// this rank, and after a timeout returns what the reports say of `peer` ("Ranks that never issued
  /// it: 2.").
  std::string report_failure(const std::string& error, int64_t peer, bool timed_out);

  struct Entry;

 private:
  std::shared_ptr<Entry> entry_;
};

// --- gloo_group.cpp ---------------------------------------------------------------------------------

c10d::ProcessGroupGloo& gloo(const ProcessGroupState& group);

/// Point-to-point messages of one step and the group rank each exchanges with.
struct Exchange {
  std::vector<c10::intrusive_ptr<c10d::Work>> works;
  std::vector<int64_t> peers;
  void add(c10::intrusive_ptr<c10d::Work> work, int64_t peer) {
    works.push_back(std::move(work));
    peers.push_back(peer);
  }
  void append(Exchange&& other);
  bool empty() const { return works.empty(); }
};

/// Which byte counter a message adds to (Note [Byte counters]).
enum class Traffic { kAllGather, kReduceScatter, kAllReduce, kBroadcast, kCheck };
Traffic traffic_of(CollectiveKind kind);

/// A send of `bytes` (a contiguous CPU tensor) to group rank `peer` on `tag`, counted as `traffic`
/// (Note [Byte counters]); a closed connection is reported naming the peer.
c10::intrusive_ptr<c10d::Work> post_send(const Transport& transport, at::Tensor bytes, int64_t peer, int tag,
                                         Traffic traffic);
c10::intrusive_ptr<c10d::Work> post_receive(const Transport& transport, at::Tensor bytes, int64_t peer, int tag);

/// Posts, for each group rank in `peers`, a receive into `received(peer)` and then a send of
/// `sent(peer)`: receives first, then sends.
Exchange exchange_with(const Transport& transport, int tag, Traffic traffic, const std::vector<int64_t>& peers,
                       const std::function<at::Tensor(int64_t)>& sent,
                       const std::function<at::Tensor(int64_t)>& received);

/// Waits for the works of `exchange` in order, each once (the exchange is left empty), rethrowing a
/// failure with `issued`'s description and the peer; a checked collective's stall is diagnosed
/// (StallRegistration). On failure the works are abandoned, never destroyed.
void wait_exchange(const Transport& transport, const IssuedCollective& issued, Exchange& exchange);

/// The global ranks of `works` waited in order, for errors: Gloo's own collectives only.
void wait_works(const std::vector<c10::intrusive_ptr<c10d::Work>>& works, const std::vector<int64_t>& peers,
                const std::vector<int64_t>& others, const std::string& description, std::chrono::milliseconds timeout);

/// Works of a failed exchange whose transfers may still complete: kept, with the buffers they use,
/// for the life of the process.
void abandon(const std::vector<c10::intrusive_ptr<c10d::Work>>& works);

// --- schedules.cpp -------------------------------------------------------------------------------------

/// A CPU collective once issued: what CollectiveWork::wait() waits for and then runs.
struct Schedule {
  /// Posted when issued; wait() waits for them.
  Exchange posted;
  /// The steps that need an earlier step's result, run by the group's issue queue; they return the
  /// messages they posted last, which wait() then waits for.
  std::shared_future<Exchange> deferred;
  /// Runs on the caller's thread once everything arrived: the local reduction or copy-out.
  std::function<void()> finish;
};

/// One collective in flight (the state behind a CollectiveWork).
struct CollectiveWorkState {
  Transport transport;
  IssuedCollective issued;
  /// A CPU collective's messages and local steps.
  Schedule schedule;
  /// Note [The GPU path]: an NCCL collective, and its headers on Gloo (null with the check off).
  std::vector<c10::intrusive_ptr<c10d::Work>> nccl_works;
  std::shared_ptr<CollectiveCheck> check;
  bool done = false;
};

/// output (N * s bytes) <- every rank's input (s bytes).
Schedule schedule_all_gather(ProcessGroupState& group, const IssuedCollective& issued, CollectiveAlgorithm algorithm,
                             const at::Tensor& output_bytes, const at::Tensor& input_bytes);
/// output (s elements) <- reduction of chunk `rank` of every rank's `input` (N * s elements, already
/// pre-divided), then divided by `post_divide`.
Schedule schedule_reduce_scatter(ProcessGroupState& group, const IssuedCollective& issued,
                                 CollectiveAlgorithm algorithm, const at::Tensor& output, const at::Tensor& input,
                                 ReduceOp op, double post_divide);
/// tensor <- reduction of every rank's tensor, in place.
Schedule schedule_all_reduce(ProcessGroupState& group, const IssuedCollective& issued, CollectiveAlgorithm algorithm,
                             const at::Tensor& tensor, ReduceOp op);

/// Reduces the K rows of `rows` ([K, s]) into `output` (s elements), in row order; fp16 and bf16
/// sums accumulate in fp32.
void reduce_rows_into(const at::Tensor& output, const at::Tensor& rows, ReduceOp op);

// --- collectives.cpp ------------------------------------------------------------------------------

c10d::ReduceOp to_c10d(ReduceOp op);

/// A socket listening on address:port for a store to take (TCPStoreOptions::masterListenFd), or
/// nullopt with the reason in `why` where the address is not this machine's or cannot be bound.
std::optional<int> listen_on_address(const std::string& address, int port, int64_t backlog, std::string& why);

// --- nccl.cpp (a CUDA build) or no_nccl.cpp -----------------------------------------------------------

/// True in a build with the GPU path (CMake chooses nccl.cpp); false with no_nccl.cpp.
bool gpu_path_built();

/// Note [The GPU path]: NCCL collectives of `group` on the GPU of their tensors, each made with
/// that GPU current. The group's NCCL communicator is made on first use.
c10::intrusive_ptr<c10d::Work> nccl_all_gather(ProcessGroupState& group, at::Tensor output, at::Tensor input);
c10::intrusive_ptr<c10d::Work> nccl_reduce_scatter(ProcessGroupState& group, at::Tensor output, at::Tensor input,
                                                   const c10d::ReduceScatterOptions& options);
c10::intrusive_ptr<c10d::Work> nccl_all_reduce(ProcessGroupState& group, std::vector<at::Tensor>& tensors,
                                               const c10d::AllreduceOptions& options);
c10::intrusive_ptr<c10d::Work> nccl_broadcast(ProcessGroupState& group, std::vector<at::Tensor>& tensors,
                                              const c10d::BroadcastOptions& options);

}  // namespace fsdp::detail
