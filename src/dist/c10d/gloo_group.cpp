// Gloo process groups: their creation, the point-to-point sends and receives every CPU collective is
// made of (Note [Collectives on Gloo], docs/design.md), waiting for them (with the diagnosis of Note
// [Collective check]), and the queue that runs the steps that need an earlier step's result (Note
// [Algorithms by measurement]).
#include <algorithm>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>

#include "dist/c10d/internal.h"

namespace fsdp::detail {
namespace {

std::shared_ptr<const GroupMembers> members_with_machines(const GroupMembers& base,
                                                          const std::vector<int64_t>& machine_of_rank) {
  auto members = std::make_shared<GroupMembers>(base);
  members->machines.assign(base.global_ranks.size(), 0);
  if (!machine_of_rank.empty()) {
    for (size_t index = 0; index < base.global_ranks.size(); ++index) {
      const auto global = static_cast<size_t>(base.global_ranks[index]);
      TORCH_INTERNAL_ASSERT(global < machine_of_rank.size(), "group ", base.name, ": rank ", global,
                            " has no machine in the node layout");
      members->machines[index] = machine_of_rank[global];
    }
  }
  members->shape = group_shape(members->machines);
  return members;
}

}  // namespace

std::shared_ptr<ProcessGroupState> create_process_group(const std::shared_ptr<BackendStore>& store,
                                                        const DistributedEnvironment& environment,
                                                        const std::string& name,
                                                        const std::vector<int64_t>& global_ranks,
                                                        const std::vector<int64_t>& machine_of_rank) {
  auto state = std::make_shared<ProcessGroupState>();
  GroupMembers base;
  base.name = name;
  base.global_ranks = global_ranks;
  base.global_rank = environment.rank;
  base.size = static_cast<int64_t>(global_ranks.size());
  base.timeout = environment.timeout;
  base.check_collectives = environment.check_collectives;
  auto position = std::find(global_ranks.begin(), global_ranks.end(), environment.rank);
  TORCH_INTERNAL_ASSERT(position != global_ranks.end(), "rank ", environment.rank, " is not a member of group ", name);
  base.rank = position - global_ranks.begin();
  state->members = members_with_machines(base, machine_of_rank);
  if (base.size == 1) return state;

  TORCH_INTERNAL_ASSERT(store != nullptr, "group ", name, " of ", base.size, " ranks needs a rendezvous store");
  auto options = c10d::ProcessGroupGloo::Options::create(environment.timeout);
  options->devices.push_back(store->device);
  auto prefixed = c10::make_intrusive<c10d::PrefixStore>("fsdp/" + name, store->store);
  auto backend = std::make_shared<BackendGroup>();
  try {
    backend->group = c10::make_intrusive<c10d::ProcessGroupGloo>(prefixed, static_cast<int>(base.rank),
                                                                 static_cast<int>(base.size), options);
  } catch (const std::exception& error) {
    const auto* torch_error = dynamic_cast<const c10::Error*>(&error);
    TORCH_CHECK(false, "[rank ", environment.rank, "] rendezvous: creating process group '", name, "' of ", base.size,
                " ranks failed within ", environment.timeout.count() / 1000.0,
                " s: ", torch_error ? torch_error->what_without_backtrace() : error.what(),
                ". Every member must start within FSDP_COLLECTIVE_TIMEOUT of the others (a machine whose ranks start "
                "late, or never), with the same WORLD_SIZE and LOCAL_WORLD_SIZE; check the other ranks' logs.");
  }
  backend->store = prefixed;
  state->backend = std::move(backend);
  return state;
}

void set_group_machines(ProcessGroupState& group, const std::vector<int64_t>& machine_of_rank) {
  group.members = members_with_machines(*group.members, machine_of_rank);
}

c10d::ProcessGroupGloo& gloo(const ProcessGroupState& group) {
  TORCH_INTERNAL_ASSERT(group.backend && group.backend->group, "group '", group.members->name, "' has no backend");
  return *group.backend->group;
}

Transport transport_of(const ProcessGroupState& group) {
  Transport transport;
  transport.gloo = group.backend ? group.backend->group : nullptr;
  transport.store = group.backend ? group.backend->store : nullptr;
  transport.members = group.members;
  transport.counters = group.counters;
  return transport;
}

namespace {

// Gloo refuses to post on a connection that is already closed, with its own exception type.
[[noreturn]] void connection_failed(const GroupMembers& members, int64_t peer, const std::exception& error) {
  const auto global_peer = members.global_ranks[static_cast<size_t>(peer)];
  TORCH_CHECK(false, "[rank ", members.global_rank, "] group '", members.name, "': the connection to rank ",
              global_peer, " failed: ", error.what(), ". Rank ", global_peer, " probably exited; read its log");
}

std::atomic<int64_t>& counter_of(GroupCounters& counters, Traffic traffic) {
  switch (traffic) {
    case Traffic::kAllGather:
      return counters.all_gather;
    case Traffic::kReduceScatter:
      return counters.reduce_scatter;
    case Traffic::kAllReduce:
      return counters.all_reduce;
    case Traffic::kBroadcast:
      return counters.broadcast;
    case Traffic::kCheck:
      return counters.check;
  }
  TORCH_INTERNAL_ASSERT(false, "unknown traffic");
}

}  // namespace

// A barrier is an all-reduce of one byte: its bytes are the all-reduce's.
Traffic traffic_of(CollectiveKind kind) {
  switch (kind) {
    case CollectiveKind::kAllGather:
      return Traffic::kAllGather;
    case CollectiveKind::kReduceScatter:
      return Traffic::kReduceScatter;
    case CollectiveKind::kAllReduce:
    case CollectiveKind::kBarrier:
      return Traffic::kAllReduce;
    case CollectiveKind::kBroadcast:
      return Traffic::kBroadcast;
  }
  TORCH_INTERNAL_ASSERT(false, "unknown collective kind");
}

void Exchange::append(Exchange&& other) {
  works.insert(works.end(), std::make_move_iterator(other.works.begin()), std::make_move_iterator(other.works.end()));
  peers.insert(peers.end(), other.peers.begin(), other.peers.end());
  other.works.clear();
  other.peers.clear();
}

// Point-to-point Gloo sends and receives move bytes straight between the caller's buffers on the
// transport's threads: no staging copy and no fresh flat buffer per call (Note [Collectives on Gloo]).
c10::intrusive_ptr<c10d::Work> post_send(const Transport& transport, at::Tensor bytes, int64_t peer, int tag,
                                         Traffic traffic) {
  const int64_t count = bytes.numel();
  std::vector<at::Tensor> payload{std::move(bytes)};
  c10::intrusive_ptr<c10d::Work> work;
  try {
    work = transport.gloo->send(payload, static_cast<int>(peer), tag);
  } catch (const c10::Error&) {
    throw;
  } catch (const std::exception& error) {
    connection_failed(*transport.members, peer, error);
  }
  auto& counters = *transport.counters;
  counter_of(counters, traffic) += count;
  (transport.members->same_machine(peer) ? counters.inside_machine : counters.off_machine) += count;
  ++counters.messages;
  return work;
}

c10::intrusive_ptr<c10d::Work> post_receive(const Transport& transport, at::Tensor bytes, int64_t peer, int tag) {
  std::vector<at::Tensor> destination{std::move(bytes)};
  try {
    return transport.gloo->recv(destination, static_cast<int>(peer), tag);
  } catch (const c10::Error&) {
    throw;
  } catch (const std::exception& error) {
    connection_failed(*transport.members, peer, error);
  }
}

Exchange exchange_with(const Transport& transport, int tag, Traffic traffic, const std::vector<int64_t>& peers,
                       const std::function<at::Tensor(int64_t)>& sent,
                       const std::function<at::Tensor(int64_t)>& received) {
  Exchange exchange;
  try {
    for (const auto peer : peers) exchange.add(post_receive(transport, received(peer), peer, tag), peer);
    for (const auto peer : peers) exchange.add(post_send(transport, sent(peer), peer, tag, traffic), peer);
  } catch (...) {
    abandon(exchange.works);
    throw;
  }
  return exchange;
}

void abandon(const std::vector<c10::intrusive_ptr<c10d::Work>>& works) {
  static std::mutex mutex;
  static auto* kept = new std::vector<c10::intrusive_ptr<c10d::Work>>();
  std::lock_guard<std::mutex> lock(mutex);
  kept->insert(kept->end(), works.begin(), works.end());
}

void wait_exchange(const Transport& transport, const IssuedCollective& issued, Exchange& exchange) {
  if (exchange.empty()) return;
  const auto works = std::move(exchange.works);
  const auto peers = std::move(exchange.peers);
  exchange = Exchange();
  const auto& members = *transport.members;
  std::optional<StallRegistration> registration;
  if (issued.checked) registration.emplace(transport, issued, peers);
  for (size_t index = 0; index < works.size(); ++index) {
    bool completed = false;
    try {
      if (registration) registration->waiting_on(works[index], peers[index]);
      completed = works[index]->wait();
    } catch (const std::exception& error) {
      // On failure the works stay referenced (abandoned), so buffers a transfer may still write stay alive.
      abandon(works);
      if (registration) {
        if (auto verdict = registration->verdict()) TORCH_CHECK(false, *verdict);
      }
      const auto global_peer = members.global_ranks[static_cast<size_t>(peers[index])];
      const std::string what = error.what();
      const bool timeout = what.find("imed out") != std::string::npos;
      const std::string failure =
          issued.description + " failed in the exchange with rank " + std::to_string(global_peer) + ": " + what;
      const auto said = registration ? registration->report_failure(failure, peers[index], timeout) : std::string();
      TORCH_CHECK(false, failure, ".", said,
                  " A peer rank probably exited or stopped calling collectives in the same order; read the other "
                  "ranks' logs. (Collective timeout: ",
                  members.timeout.count() / 1000.0, " s, set with FSDP_COLLECTIVE_TIMEOUT.)");
    }
    if (!completed) {
      // Aborted by the stall watch, which found why (Note [Collective check]).
      abandon(works);
      const auto verdict = registration ? registration->verdict() : std::nullopt;
      TORCH_INTERNAL_ASSERT(verdict.has_value(), issued.description, ": a wait was aborted without a reason");
      TORCH_CHECK(false, *verdict);
    }
  }
}

void wait_works(const std::vector<c10::intrusive_ptr<c10d::Work>>& works, const std::vector<int64_t>& peers,
                const std::vector<int64_t>& others, const std::string& description, std::chrono::milliseconds timeout) {
  for (size_t index = 0; index < works.size(); ++index) {
    try {
      works[index]->wait();
    } catch (const std::exception& error) {
      std::string peer;
      if (index < peers.size()) {
        peer = " in the exchange with rank " + std::to_string(peers[index]);
      } else if (others.size() == 1) {
        peer = " in the exchange with rank " + std::to_string(others.front());
      } else if (!others.empty()) {
        peer = " in an exchange with one of ranks ";
        for (size_t other = 0; other < others.size() && other < 16; ++other) {
          peer += (other ? ", " : "") + std::to_string(others[other]);
        }
        if (others.size() > 16) peer += ", ...";
      }
      TORCH_CHECK(false, description, " failed", peer, ": ", error.what(),
                  ". A peer rank probably exited or stopped calling collectives in the same order; read the other "
                  "ranks' logs. (Collective timeout: ",
                  timeout.count() / 1000.0, " s, set with FSDP_COLLECTIVE_TIMEOUT.)");
    }
  }
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
    // Started on first use: most groups never need one.
    thread_ = std::thread([this] {
      for (;;) {
        std::function<void()> next;
        {
          std::unique_lock<std::mutex> lock(mutex_);
          changed_.wait(lock, [this] { return stopping_ || !tasks_.empty(); });
          if (tasks_.empty()) return;  // stopping, with nothing left to run
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
  if (group.members->size == 1) return;
  at::Tensor output_handle = output;  // c10d takes non-const handles to the same tensors
  at::Tensor input_handle = input;
  auto work = gloo(group)._allgather_base(output_handle, input_handle);
  wait_works({work}, {}, {}, "[rank " + std::to_string(group.members->global_rank) + "] native all_gather",
             group.members->timeout);
}

void native_reduce_scatter(const ProcessGroup& group_handle, const at::Tensor& output, const at::Tensor& input) {
  auto& group = detail::state_of(group_handle);
  if (group.members->size == 1) return;
  c10d::ReduceScatterOptions options;
  options.reduceOp = c10d::ReduceOp::SUM;
  at::Tensor output_handle = output;
  at::Tensor input_handle = input;
  auto work = gloo(group)._reduce_scatter_base(output_handle, input_handle, options);
  wait_works({work}, {}, {}, "[rank " + std::to_string(group.members->global_rank) + "] native reduce_scatter",
             group.members->timeout);
}

void native_all_reduce(const ProcessGroup& group_handle, const at::Tensor& tensor) {
  auto& group = detail::state_of(group_handle);
  if (group.members->size == 1) return;
  std::vector<at::Tensor> tensors{tensor};
  auto work = gloo(group).allreduce(tensors, c10d::AllreduceOptions());
  wait_works({work}, {}, {}, "[rank " + std::to_string(group.members->global_rank) + "] native all_reduce",
             group.members->timeout);
}

void force_algorithm(const ProcessGroup& group_handle, CollectiveOperation operation,
                     std::optional<CollectiveAlgorithm> algorithm) {
  auto& group = detail::state_of(group_handle);
  if (algorithm) {
    TORCH_CHECK(algorithm_applies(*algorithm, group.members->shape), "force_algorithm: ", to_string(*algorithm),
                " cannot run on group '", group.members->name, "' (", group.members->shape.machines, " machines x ",
                group.members->shape.ranks_per_machine, " ranks)");
  }
  group.forced_algorithm[static_cast<size_t>(operation)] = algorithm ? static_cast<int>(*algorithm) : -1;
}

}  // namespace fsdp::detail
