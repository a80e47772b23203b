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

/// Runs tasks one after another on a thread of its own, in the order they were queued: the Gloo
/// collectives that may be issued only once the collective check has passed (Note [Collective
/// check]), and the direct all-reduce, whose second half needs its first's result (Note
/// [Algorithms by measurement]; with the check off too), so that the caller's `_async` returns at
/// once and every rank still runs them in the same order.
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
  // The group's store, for the NCCL group made on its first CUDA collective.
  c10::intrusive_ptr<c10d::Store> store;
  // Note [The GPU path]: the same members over NCCL (a c10d::ProcessGroupNCCL, made by nccl.cpp on
  // the group's first CUDA collective, which every member issues at the same point of its program).
  c10::intrusive_ptr<c10d::Backend> nccl;
  IssueQueue issue_queue;
};

/// Note [Collective check]: the header exchange of one collective, posted when it is issued and
/// verified when it is waited on.
struct CollectiveCheck {
  at::Tensor headers;  // [N, kHeaderBytes]: row r is group rank r's header; our own row is sent
  std::vector<c10::intrusive_ptr<c10d::Work>> receives;  // one per peer, exchange_peers order
  std::vector<c10::intrusive_ptr<c10d::Work>> sends;
  std::vector<int64_t> peers;  // global ranks of `receives` then `sends` (exchange_peers order)
  // Of the group, copied: a check verified on the IssueQueue's thread needs no group.
  int64_t rank = 0;
  std::vector<int64_t> global_ranks;
  std::string group_name;
  std::string description;
  bool verified = false;
};

struct CollectiveWorkState {
  // One Gloo or NCCL collective, or the point-to-point sends and receives that make up one of ours.
  std::vector<c10::intrusive_ptr<c10d::Work>> works;
  // For point-to-point works: the global rank each one exchanges with, so that a failure names the
  // rank whose connection failed (Gloo names only its address). Empty for Gloo's collectives.
  std::vector<int64_t> peers;
  // The other members of the group, for Gloo's own collectives: one of them failed.
  std::vector<int64_t> others;
  // Note [Collective check]: verified before the data works are waited on; null when the check is off.
  std::shared_ptr<CollectiveCheck> check;
  // A Gloo collective that the group's IssueQueue issues once the check has passed.
  std::shared_future<c10::intrusive_ptr<c10d::Work>> deferred;
  std::function<void()> finish;
  std::string description;
  std::chrono::milliseconds timeout{0};
  bool done = false;
};

// --- gloo_group.cpp ---------------------------------------------------------------------------------

c10d::ProcessGroupGloo& gloo(const ProcessGroupState& group);

/// A point-to-point send or receive of `bytes` (a contiguous CPU tensor) with group rank `peer` on
/// `tag`; a closed connection is reported naming the peer.
c10::intrusive_ptr<c10d::Work> post_send(ProcessGroupState& group, at::Tensor bytes, int64_t peer, int tag);
c10::intrusive_ptr<c10d::Work> post_receive(ProcessGroupState& group, at::Tensor bytes, int64_t peer, int tag);

/// Posts, for every peer, a receive into `received_chunk(peer)` and then, for every peer, a send of
/// `sent_chunk(peer)`, all on `tag`: receives first, in exchange_peers() order, then sends.
std::vector<c10::intrusive_ptr<c10d::Work>> exchange_with_peers(
    ProcessGroupState& group, int tag, const std::function<at::Tensor(int64_t)>& sent_chunk,
    const std::function<at::Tensor(int64_t)>& received_chunk);

/// The global rank of each work exchange_with_peers returns, in its order.
std::vector<int64_t> exchange_peers(const ProcessGroupState& group);

/// Works of a failed exchange whose transfers may still complete: kept, with the buffers they use,
/// for the life of the process.
void abandon(const std::vector<c10::intrusive_ptr<c10d::Work>>& works);

// --- collective_check.cpp -----------------------------------------------------------------------------

enum class CollectiveKind : int64_t { kAllGather = 1, kReduceScatter, kAllReduce, kBroadcast, kBarrier };

/// What one collective is: the tag its data travels on and, with the check on, its posted headers.
struct IssuedCollective {
  int data_tag = 0;
  std::shared_ptr<CollectiveCheck> check;
};

/// `description` with what the collective is for (src/dist/activity.h) when there is an activity:
/// recorded when issued, since the wait may come later, inside another unit's work.
std::string with_activity(std::string description);

/// Note [Collective check]: draws the collective's slot, posts its header to every peer and a
/// receive of theirs (with the check on; `force_check` posts them regardless, for barrier), and
/// returns the data tag, which also carries a digest of the header.
IssuedCollective issue_collective(ProcessGroupState& group, CollectiveKind kind, const at::Tensor& tensor,
                                  int64_t detail, const std::string& description, bool force_check = false);

/// Waits for every peer's header and throws the named error when they differ from ours or a peer
/// never sent one. Idempotent once it has passed.
void verify_check(CollectiveCheck& check, std::chrono::milliseconds timeout);

// --- collectives.cpp ------------------------------------------------------------------------------

/// Waits for `works` in order, rethrowing a failure with the description and the peer (the error
/// of CollectiveWork::wait()).
void wait_works(const std::vector<c10::intrusive_ptr<c10d::Work>>& works, const std::vector<int64_t>& peers,
                const std::vector<int64_t>& others, const std::string& description, std::chrono::milliseconds timeout);

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
