// Gloo process groups: their creation, the point-to-point sends and receives our collectives are
// made of (Note [Collectives on Gloo], docs/design.md), and the queue that issues Gloo's own
// collectives once the collective check has passed (Note [Collective check]) and runs the direct
// all-reduce (Note [Algorithms by measurement]).
#include <algorithm>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>

#include "dist/c10d/internal.h"

namespace fsdp::detail {

std::shared_ptr<ProcessGroupState> create_process_group(const std::shared_ptr<BackendStore>& store,
                                                        const DistributedEnvironment& environment,
                                                        const std::string& name,
                                                        const std::vector<int64_t>& global_ranks) {
  auto state = std::make_shared<ProcessGroupState>();
  state->name = name;
  state->global_ranks = global_ranks;
  state->global_rank = environment.rank;
  state->size = static_cast<int64_t>(global_ranks.size());
  state->timeout = environment.timeout;
  state->check_collectives = environment.check_collectives;
  auto position = std::find(global_ranks.begin(), global_ranks.end(), environment.rank);
  TORCH_INTERNAL_ASSERT(position != global_ranks.end(), "rank ", environment.rank, " is not a member of group ", name);
  state->rank = position - global_ranks.begin();
  if (state->size == 1) return state;

  TORCH_INTERNAL_ASSERT(store != nullptr, "group ", name, " of ", state->size, " ranks needs a rendezvous store");
  auto options = c10d::ProcessGroupGloo::Options::create(environment.timeout);
  options->devices.push_back(store->device);
  auto prefixed = c10::make_intrusive<c10d::PrefixStore>("fsdp/" + name, store->store);
  auto backend = std::make_shared<BackendGroup>();
  try {
    backend->group = c10::make_intrusive<c10d::ProcessGroupGloo>(prefixed, static_cast<int>(state->rank),
                                                                 static_cast<int>(state->size), options);
  } catch (const std::exception& error) {
    TORCH_CHECK(
        false, "[rank ", environment.rank, "] rendezvous: creating process group '", name, "' of ", state->size,
        " ranks failed: ", error.what(),
        ". Every member must start with the same WORLD_SIZE and LOCAL_WORLD_SIZE; check the other ranks' logs.");
  }
  backend->store = prefixed;
  state->backend = std::move(backend);
  return state;
}

c10d::ProcessGroupGloo& gloo(const ProcessGroupState& group) {
  TORCH_INTERNAL_ASSERT(group.backend && group.backend->group, "group '", group.name, "' has no backend");
  return *group.backend->group;
}

namespace {

// Gloo refuses to post on a connection that is already closed, with its own exception type.
[[noreturn]] void connection_failed(const ProcessGroupState& group, int64_t peer, const std::exception& error) {
  const auto global_peer = group.global_ranks[static_cast<size_t>(peer)];
  TORCH_CHECK(false, "[rank ", group.global_rank, "] group '", group.name, "': the connection to rank ", global_peer,
              " failed: ", error.what(), ". Rank ", global_peer, " probably exited; read its log");
}

}  // namespace

// Point-to-point Gloo sends and receives move bytes straight between the caller's buffers on the
// transport's threads: no staging copy and no fresh flat buffer per call (Note [Collectives on Gloo]).
c10::intrusive_ptr<c10d::Work> post_send(ProcessGroupState& group, at::Tensor bytes, int64_t peer, int tag) {
  std::vector<at::Tensor> payload{std::move(bytes)};
  try {
    return gloo(group).send(payload, static_cast<int>(peer), tag);
  } catch (const c10::Error&) {
    throw;
  } catch (const std::exception& error) {
    connection_failed(group, peer, error);
  }
}

c10::intrusive_ptr<c10d::Work> post_receive(ProcessGroupState& group, at::Tensor bytes, int64_t peer, int tag) {
  std::vector<at::Tensor> destination{std::move(bytes)};
  try {
    return gloo(group).recv(destination, static_cast<int>(peer), tag);
  } catch (const c10::Error&) {
    throw;
  } catch (const std::exception& error) {
    connection_failed(group, peer, error);
  }
}

std::vector<c10::intrusive_ptr<c10d::Work>> exchange_with_peers(
    ProcessGroupState& group, int tag, const std::function<at::Tensor(int64_t)>& sent_chunk,
    const std::function<at::Tensor(int64_t)>& received_chunk) {
  std::vector<c10::intrusive_ptr<c10d::Work>> works;
  works.reserve(static_cast<size_t>(2 * (group.size - 1)));
  for (int64_t offset = 1; offset < group.size; ++offset) {
    const auto source = (group.rank + group.size - offset) % group.size;
    works.push_back(post_receive(group, received_chunk(source), source, tag));
  }
  for (int64_t offset = 1; offset < group.size; ++offset) {
    const auto target = (group.rank + offset) % group.size;
    works.push_back(post_send(group, sent_chunk(target), target, tag));
  }
  return works;
}

void abandon(const std::vector<c10::intrusive_ptr<c10d::Work>>& works) {
  static std::mutex mutex;
  static auto* kept = new std::vector<c10::intrusive_ptr<c10d::Work>>();
  std::lock_guard<std::mutex> lock(mutex);
  kept->insert(kept->end(), works.begin(), works.end());
}

std::vector<int64_t> exchange_peers(const ProcessGroupState& group) {
  std::vector<int64_t> peers;
  for (int64_t offset = 1; offset < group.size; ++offset) {
    peers.push_back(group.global_ranks[static_cast<size_t>((group.rank + group.size - offset) % group.size)]);
  }
  for (int64_t offset = 1; offset < group.size; ++offset) {
    peers.push_back(group.global_ranks[static_cast<size_t>((group.rank + offset) % group.size)]);
  }
  return peers;
}

IssueQueue::~IssueQueue() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stopping_ = true;
  }
  changed_.notify_all();
  if (thread_.joinable()) thread_.join();
}

void IssueQueue::push(std::function<void()> task) {
  std::lock_guard<std::mutex> lock(mutex_);
  tasks_.push_back(std::move(task));
  if (!thread_.joinable()) {
    // Started on first use: most groups never issue a Gloo collective.
    thread_ = std::thread([this] {
      for (;;) {
        std::function<void()> next;
        {
          std::unique_lock<std::mutex> lock(mutex_);
          changed_.wait(lock, [this] { return stopping_ || !tasks_.empty(); });
          if (tasks_.empty()) return;  // stopping, with nothing left to issue
          next = std::move(tasks_.front());
          tasks_.pop_front();
        }
        next();  // a task reports its own failure through its promise
      }
    });
  }
  changed_.notify_one();
}

void native_all_gather(const ProcessGroup& group_handle, const at::Tensor& output, const at::Tensor& input) {
  auto& group = detail::state_of(group_handle);
  if (group.size == 1) return;
  at::Tensor output_handle = output;  // c10d takes non-const handles to the same tensors
  at::Tensor input_handle = input;
  auto work = gloo(group)._allgather_base(output_handle, input_handle);
  wait_works({work}, {}, {}, "[rank " + std::to_string(group.global_rank) + "] native all_gather", group.timeout);
}

void native_reduce_scatter(const ProcessGroup& group_handle, const at::Tensor& output, const at::Tensor& input) {
  auto& group = detail::state_of(group_handle);
  if (group.size == 1) return;
  c10d::ReduceScatterOptions options;
  options.reduceOp = c10d::ReduceOp::SUM;
  at::Tensor output_handle = output;
  at::Tensor input_handle = input;
  auto work = gloo(group)._reduce_scatter_base(output_handle, input_handle, options);
  wait_works({work}, {}, {}, "[rank " + std::to_string(group.global_rank) + "] native reduce_scatter", group.timeout);
}

void native_all_reduce(const ProcessGroup& group_handle, const at::Tensor& tensor) {
  auto& group = detail::state_of(group_handle);
  if (group.size == 1) return;
  std::vector<at::Tensor> tensors{tensor};
  auto work = gloo(group).allreduce(tensors, c10d::AllreduceOptions());
  wait_works({work}, {}, {}, "[rank " + std::to_string(group.global_rank) + "] native all_reduce", group.timeout);
}

}  // namespace fsdp::detail
