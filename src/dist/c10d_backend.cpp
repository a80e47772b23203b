// The only file that talks to c10d: rendezvous store, Gloo process groups, NCCL process groups (a
// CUDA build: Note [The GPU path] in docs/design.md) and every collective.
//
// Note [Collectives on Gloo] in docs/design.md says what each collective is built from and why, and
// Note [Reaching Gloo from the torch wheel] how this file compiles against a libtorch that ships no
// Gloo headers.
#include "dist/c10d_backend.h"
#include "dist/activity.h"

#include <fsdp/collectives.h>

#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>
#ifdef FSDP_WITH_CUDA
#include <c10/core/DeviceGuard.h>
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>
#endif

#include <netdb.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <csignal>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <mutex>
#include <sstream>

#include "memory/buffer_pool.h"

namespace fsdp {
namespace detail {

struct BackendStore {
  c10::intrusive_ptr<c10d::Store> store;
  std::shared_ptr<::gloo::transport::Device> device;
};

struct BackendGroup {
  c10::intrusive_ptr<c10d::ProcessGroupGloo> group;
  // The group's store, for the NCCL group made on its first CUDA collective.
  c10::intrusive_ptr<c10d::Store> store;
#ifdef FSDP_WITH_CUDA
  // Note [The GPU path]: the same members over NCCL, for CUDA tensors. Made on the group's first
  // CUDA collective, which every member issues at the same point of its program (collectives are
  // issued in the same order everywhere), so every member makes it together.
  c10::intrusive_ptr<c10d::ProcessGroupNCCL> nccl;
#endif
};

struct CollectiveWorkState {
  // One Gloo collective, or the point-to-point sends and receives that make up one of ours.
  std::vector<c10::intrusive_ptr<c10d::Work>> works;
  // For point-to-point works: the global rank each one exchanges with, so that a failure names the
  // rank whose connection failed (Gloo names only its address). Empty for Gloo's collectives.
  std::vector<int64_t> peers;
  // The other members of the group, for Gloo's own collectives: one of them failed.
  std::vector<int64_t> others;
  std::function<void()> finish;
  std::string description;
  std::chrono::milliseconds timeout{0};
  bool done = false;
};

namespace {

bool is_loopback(const std::string& host) {
  return host == "localhost" || host.rfind("127.", 0) == 0 || host == "::1";
}

std::shared_ptr<::gloo::transport::Device> create_device(const DistributedEnvironment& environment) {
  if (const char* interface = std::getenv("GLOO_SOCKET_IFNAME"); interface != nullptr && *interface != '\0') {
    return c10d::ProcessGroupGloo::createDeviceForInterface(interface);
  }
  // All ranks on one machine talk over loopback, which needs no resolvable hostname.
  if (environment.num_nodes() == 1 || is_loopback(environment.master_addr)) {
    return c10d::ProcessGroupGloo::createDeviceForHostname("127.0.0.1");
  }
  return c10d::ProcessGroupGloo::createDefaultDevice();
}

// The store rank 0 hosts for the rendezvous has no authentication: it listens only where the
// others connect, MASTER_ADDR's own address (loopback for one machine), not on every interface as
// c10d's TCPStore does by itself. A listening socket is returned for TCPStoreOptions::masterListenFd
// (the store owns it from then on); nullopt, with the reason in `why`, where MASTER_ADDR is not an
// address of this machine.
std::optional<int> listen_on_master_address(const DistributedEnvironment& environment, std::string& why) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_NUMERICSERV;
  addrinfo* found = nullptr;
  const auto port = std::to_string(environment.master_port);
  const int resolved = ::getaddrinfo(environment.master_addr.c_str(), port.c_str(), &hints, &found);
  if (resolved != 0) {
    why = std::string("it does not resolve: ") + ::gai_strerror(resolved);
    return std::nullopt;
  }
  std::optional<int> result;
  for (auto* candidate = found; candidate && !result; candidate = candidate->ai_next) {
    const int descriptor = ::socket(candidate->ai_family, candidate->ai_socktype | SOCK_CLOEXEC, candidate->ai_protocol);
    if (descriptor < 0) continue;
    const int yes = 1;
    ::setsockopt(descriptor, SOL_SOCKET, SO_REUSEADDR, &yes, sizeof(yes));
    if (::bind(descriptor, candidate->ai_addr, candidate->ai_addrlen) == 0 &&
        ::listen(descriptor, static_cast<int>(std::min<int64_t>(environment.world_size + 16, SOMAXCONN))) == 0) {
      result = descriptor;
    } else {
      why = std::string("binding it failed: ") + std::strerror(errno);
      ::close(descriptor);
    }
  }
  ::freeaddrinfo(found);
  return result;
}

}  // namespace

std::shared_ptr<BackendStore> connect_rendezvous_store(const DistributedEnvironment& environment) {
  // A peer that dies closes its connections, and the next write to one raises SIGPIPE, whose default
  // action ends this process without a word (exit 141) before Gloo can report which peer failed.
  // Python, and so PyTorch, ignores SIGPIPE from the start; a C++ program has the default, so it is
  // ignored here, unless the program chose its own disposition.
  struct sigaction current {};
  if (::sigaction(SIGPIPE, nullptr, &current) == 0 && current.sa_handler == SIG_DFL &&
      (current.sa_flags & SA_SIGINFO) == 0) {
    ::signal(SIGPIPE, SIG_IGN);
  }
  auto backend = std::make_shared<BackendStore>();
  c10d::TCPStoreOptions options;
  options.port = static_cast<std::uint16_t>(environment.master_port);
  options.isServer = environment.rank == 0 && !environment.use_agent_store;
  options.numWorkers = static_cast<size_t>(environment.world_size);
  options.waitWorkers = true;
  options.timeout = environment.timeout;
  const double timeout_seconds = environment.timeout.count() / 1000.0;
  if (options.isServer) {
    std::string why;
    options.masterListenFd = listen_on_master_address(environment, why);
    // A port already taken is reported by TCPStore below, as before.
    if (!options.masterListenFd && why.find(std::strerror(EADDRINUSE)) == std::string::npos) {
      TORCH_WARN("[rank 0] rendezvous: the store cannot listen on MASTER_ADDR=", environment.master_addr, " (", why,
                 "), so it listens on every interface. The store has no authentication: keep MASTER_PORT on a "
                 "trusted network, or set MASTER_ADDR to an address of this machine");
    }
  }
  try {
    backend->store = c10::make_intrusive<c10d::TCPStore>(environment.master_addr, options);
  } catch (const std::exception& error) {
    if (options.isServer) {
      TORCH_CHECK(false, "[rank 0] rendezvous: could not host the store at ", environment.master_addr, ":",
                  environment.master_port, " for ", environment.world_size, " ranks within ", timeout_seconds,
                  " s: ", error.what(),
                  ". If the port is in use, pick another MASTER_PORT (`fsdp launch --master-port 0` picks a free "
                  "one); if ranks are missing, check that all ", environment.world_size,
                  " processes were started with the same MASTER_ADDR, MASTER_PORT and WORLD_SIZE.");
    }
    TORCH_CHECK(false, "[rank ", environment.rank, "] rendezvous: could not reach the master at ",
                environment.master_addr, ":", environment.master_port, " within ", timeout_seconds, " s: ",
                error.what(),
                ". Check that rank 0 is running, that MASTER_ADDR/MASTER_PORT point at it, and that the port is "
                "reachable from this machine (FSDP_COLLECTIVE_TIMEOUT sets the timeout).");
  }
  backend->device = create_device(environment);
  return backend;
}

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
    TORCH_CHECK(false, "[rank ", environment.rank, "] rendezvous: creating process group '", name, "' of ",
                state->size, " ranks failed: ", error.what(),
                ". Every member must start with the same WORLD_SIZE and LOCAL_WORLD_SIZE; check the other ranks' logs.");
  }
  backend->store = prefixed;
  state->backend = std::move(backend);
  return state;
}

}  // namespace detail

// ---------------------------------------------------------------------------------------------------
// Collectives.

namespace {

using detail::CollectiveWorkState;
using detail::ProcessGroupState;

std::string describe(const ProcessGroupState& group, const char* operation, const at::Tensor& tensor) {
  std::ostringstream text;
  text << "[rank " << group.global_rank << "] " << operation << " on group '" << group.name << "' (" << group.size
       << " ranks, " << tensor.numel() << " x " << tensor.scalar_type() << ")";
  return text.str();
}

void check_buffer(const ProcessGroupState& group, const char* operation, const char* role, const at::Tensor& tensor) {
  TORCH_CHECK(tensor.defined(), "[rank ", group.global_rank, "] ", operation, ": the ", role,
              " tensor is undefined; pass an allocated buffer.");
  if (!tensor.device().is_cpu()) {
#ifdef FSDP_WITH_CUDA
    TORCH_CHECK(tensor.is_cuda(), "[rank ", group.global_rank, "] ", operation, ": the ", role, " tensor is on ",
                tensor.device(), "; fsdp.cpp's groups move CPU tensors (Gloo) and CUDA tensors (NCCL).");
#else
    TORCH_CHECK(false, "[rank ", group.global_rank, "] ", operation, ": the ", role, " tensor is on ", tensor.device(),
                " but this build of fsdp.cpp has no GPU path: its groups move CPU tensors. Move it with .cpu(), or "
                "build fsdp.cpp against a CUDA libtorch (README, 'The GPU path').");
#endif
  }
  TORCH_CHECK(tensor.is_contiguous(), "[rank ", group.global_rank, "] ", operation, ": the ", role,
              " tensor must be contiguous (got strides ", tensor.strides(), "); call .contiguous() first.");
}

void check_divide_factor(const ProcessGroupState& group, const char* name, double factor, const at::Tensor& tensor) {
  if (factor == 1.0) return;
  TORCH_CHECK(std::isfinite(factor) && factor > 0, "[rank ", group.global_rank, "] reduce_scatter: ", name, "=",
              factor, " must be a positive finite number.");
  TORCH_CHECK(at::isFloatingType(tensor.scalar_type()), "[rank ", group.global_rank, "] reduce_scatter: ", name, "=",
              factor, " needs a floating dtype but the buffer is ", tensor.scalar_type(), "; use 1 for integers.");
}

at::Tensor as_bytes(const at::Tensor& tensor) { return tensor.reshape({-1}).view(at::kByte); }

CollectiveWork completed_work() {
  auto state = std::make_shared<CollectiveWorkState>();
  state->done = true;
  return CollectiveWork(state);
}

CollectiveWork pending_work(const ProcessGroupState& group, std::vector<c10::intrusive_ptr<c10d::Work>> works,
                            std::string description, std::function<void()> finish = nullptr,
                            std::vector<int64_t> peers = {}) {
  auto state = std::make_shared<CollectiveWorkState>();
  state->works = std::move(works);
  state->peers = std::move(peers);
  for (const auto rank : group.global_ranks) {
    if (rank != group.global_rank) state->others.push_back(rank);
  }
  state->finish = std::move(finish);
  state->description = std::move(description);
  // Recorded when issued: the wait may come later, inside another unit's work.
  if (!detail::current_activity().empty()) state->description += " (for " + detail::current_activity() + ")";
  state->timeout = group.timeout;
  return CollectiveWork(state);
}

CollectiveWork pending_work(const ProcessGroupState& group, c10::intrusive_ptr<c10d::Work> work, std::string description,
                            std::function<void()> finish = nullptr) {
  std::vector<c10::intrusive_ptr<c10d::Work>> works{std::move(work)};
  return pending_work(group, std::move(works), std::move(description), std::move(finish));
}

c10d::ProcessGroupGloo& gloo(const ProcessGroupState& group) {
  TORCH_INTERNAL_ASSERT(group.backend && group.backend->group, "group '", group.name, "' has no backend");
  return *group.backend->group;
}

// Both buffers of a collective on one device: NCCL moves device memory and Gloo host memory, and
// one collective cannot mix them.
void check_same_device(const ProcessGroupState& group, const char* operation, const at::Tensor& output,
                       const at::Tensor& input) {
  TORCH_CHECK(output.device() == input.device(), "[rank ", group.global_rank, "] ", operation, " on group '",
              group.name, "': the output is on ", output.device(), " but the input on ", input.device(),
              "; put both on the device the collective runs on.");
}

#ifdef FSDP_WITH_CUDA
// Note [The GPU path]: the NCCL group of `group` for a collective on `tensor`'s GPU, made on first
// use. The current device is set to the tensor's for the call, so NCCL binds this rank's
// communicator to its own GPU.
c10d::ProcessGroupNCCL& nccl(ProcessGroupState& group, const at::Tensor& tensor) {
  auto& backend = *group.backend;
  if (!backend.nccl) {
    auto options = c10d::ProcessGroupNCCL::Options::create();
    options->timeout = group.timeout;
    auto store = c10::make_intrusive<c10d::PrefixStore>("nccl", backend.store);
    try {
      backend.nccl = c10::make_intrusive<c10d::ProcessGroupNCCL>(store, static_cast<int>(group.rank),
                                                                 static_cast<int>(group.size), options);
    } catch (const std::exception& error) {
      TORCH_CHECK(false, "[rank ", group.global_rank, "] creating the NCCL group of '", group.name, "' (", group.size,
                  " ranks) for a collective on ", tensor.device(), " failed: ", error.what(),
                  ". Every rank needs a GPU of its own (one per LOCAL_RANK) and a working NCCL; NCCL_DEBUG=INFO "
                  "says more.");
    }
  }
  return *backend.nccl;
}

bool on_gpu(const at::Tensor& tensor) { return tensor.defined() && tensor.is_cuda(); }
#endif

// Posts, for every peer, a receive of its chunk into `received_chunk(peer)` and a send of
// `sent_chunk(peer)` to it. Point-to-point Gloo sends and receives move bytes straight between the
// caller's buffers on the transport's threads: no staging copy, no fresh flat buffer per call and all
// peers at once: Note [Collectives on Gloo].
std::vector<c10::intrusive_ptr<c10d::Work>> exchange_with_peers(ProcessGroupState& group,
                                                                const std::function<at::Tensor(int64_t)>& sent_chunk,
                                                                const std::function<at::Tensor(int64_t)>& received_chunk) {
  auto& backend = gloo(group);
  const int tag = static_cast<int>(group.next_exchange_tag.fetch_add(1) & 0x3fffffffU);
  std::vector<c10::intrusive_ptr<c10d::Work>> works;
  int64_t peer = -1;
  try {
    for (int64_t offset = 1; offset < group.size; ++offset) {
      const auto source = static_cast<int>((group.rank + group.size - offset) % group.size);
      peer = source;
      std::vector<at::Tensor> destination{received_chunk(source)};
      works.push_back(backend.recv(destination, source, tag));
    }
    for (int64_t offset = 1; offset < group.size; ++offset) {
      const auto target = static_cast<int>((group.rank + offset) % group.size);
      peer = target;
      std::vector<at::Tensor> payload{sent_chunk(target)};
      works.push_back(backend.send(payload, target, tag));
    }
  } catch (const c10::Error&) {
    throw;
  } catch (const std::exception& error) {
    // Gloo refuses to post on a connection that is already closed, with its own exception type.
    const auto global_peer = group.global_ranks[static_cast<size_t>(peer)];
    TORCH_CHECK(false, "[rank ", group.global_rank, "] group '", group.name, "': the connection to rank ", global_peer,
                " failed: ", error.what(), ". Rank ", global_peer, " probably exited; read its log");
  }
  return works;
}

// Works of a failed exchange whose receives may still complete: kept, with the buffers they write,
// for the life of the process.
void abandon(const std::vector<c10::intrusive_ptr<c10d::Work>>& works) {
  static std::mutex mutex;
  static auto* kept = new std::vector<c10::intrusive_ptr<c10d::Work>>();
  std::lock_guard<std::mutex> lock(mutex);
  kept->insert(kept->end(), works.begin(), works.end());
}

// The global rank of each work exchange_with_peers returns, in its order.
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

// Note [Collective frames]: before a collective moves data, every member sends every other one a
// frame of fixed size saying what it is about to do (the operation, element count, dtype, root and
// what it is for), and checks the frames it receives against its own. Ranks whose programs diverged
// (another model, another unit, one more step) then get an error on every rank naming what each
// issued, instead of Gloo aborting the process on a message longer than the receive it matched
// ("op.preamble.length <= op.nbytes") or, worse, two units of the same size exchanging each other's
// bytes. A frame is one small message per peer on the point-to-point path; the data follows on
// the next exchange slot. This is what PyTorch does only under TORCH_DISTRIBUTED_DEBUG=DETAIL.
enum class FrameKind : int64_t { kAllGather = 1, kReduceScatter, kAllReduce, kBroadcast, kBarrier };

const char* frame_kind_name(int64_t kind) {
  switch (static_cast<FrameKind>(kind)) {
    case FrameKind::kAllGather: return "all_gather";
    case FrameKind::kReduceScatter: return "reduce_scatter";
    case FrameKind::kAllReduce: return "all_reduce";
    case FrameKind::kBroadcast: return "broadcast";
    case FrameKind::kBarrier: return "barrier";
  }
  return "an unknown operation";
}

constexpr int64_t kFrameBytes = 256;
constexpr int64_t kFrameWords = 6;  // magic, kind, numel, dtype, root or op, reserved
constexpr int64_t kFrameMagic = 0x66736470'6672616dLL;  // "fsdpfram"
constexpr int64_t kFrameTextBytes = kFrameBytes - kFrameWords * 8;

struct Frame {
  int64_t kind = 0;
  int64_t numel = 0;
  int64_t dtype = 0;
  int64_t detail = 0;  // the root of a broadcast, the reduce op of a reduction
  std::string activity;  // what the collective is for (src/dist/activity.h), cut to fit the frame

  bool same_operation(const Frame& other) const {
    return kind == other.kind && numel == other.numel && dtype == other.dtype && detail == other.detail &&
           activity == other.activity;
  }
  std::string text() const {
    std::ostringstream out;
    out << frame_kind_name(kind) << " of " << numel << " x " << static_cast<at::ScalarType>(dtype);
    if (kind == static_cast<int64_t>(FrameKind::kBroadcast)) out << " from root " << detail;
    if (!activity.empty()) out << " (for " << activity << ")";
    return out.str();
  }
};

void encode_frame(const Frame& frame, uint8_t* bytes) {
  std::memset(bytes, 0, kFrameBytes);
  const int64_t words[kFrameWords] = {kFrameMagic, frame.kind, frame.numel, frame.dtype, frame.detail, 0};
  std::memcpy(bytes, words, sizeof(words));
  std::memcpy(bytes + sizeof(words), frame.activity.data(),
              std::min<size_t>(frame.activity.size(), static_cast<size_t>(kFrameTextBytes)));
}

std::optional<Frame> decode_frame(const uint8_t* bytes) {
  int64_t words[kFrameWords];
  std::memcpy(words, bytes, sizeof(words));
  if (words[0] != kFrameMagic) return std::nullopt;
  Frame frame{words[1], words[2], words[3], words[4], {}};
  const auto* text = reinterpret_cast<const char*>(bytes + sizeof(words));
  frame.activity.assign(text, strnlen(text, static_cast<size_t>(kFrameTextBytes)));
  return frame;
}

// Note [Collective frames]: returns once every member has said it issues the same collective.
void check_frames(ProcessGroupState& group, FrameKind kind, const at::Tensor& tensor, int64_t detail,
                  const std::string& description) {
  Frame own{static_cast<int64_t>(kind), tensor.defined() ? tensor.numel() : 0,
            tensor.defined() ? static_cast<int64_t>(tensor.scalar_type()) : 0, detail, detail::current_activity()};
  own.activity.resize(std::min<size_t>(own.activity.size(), static_cast<size_t>(kFrameTextBytes)));
  auto frames = at::empty({group.size, kFrameBytes}, at::TensorOptions().dtype(at::kByte));
  encode_frame(own, frames[group.rank].data_ptr<uint8_t>());
  const auto own_frame = frames[group.rank];
  auto works = exchange_with_peers(
      group, [&](int64_t) { return own_frame; }, [&](int64_t peer) { return frames[peer]; });
  // Which peers' frames arrived tells, when the exchange fails, which ranks never issued this one.
  const auto peers = exchange_peers(group);
  std::vector<c10::intrusive_ptr<c10d::Work>> receives(works.begin(), works.begin() + (group.size - 1));
  try {
    pending_work(group, works, description + ", exchanging what each rank issues", nullptr, peers).wait();
  } catch (const c10::Error& error) {
    // A frame may still arrive into `frames` after this: the works and their buffers stay alive.
    abandon(works);
    auto timed_out = [](const std::exception_ptr& failure) {
      try {
        std::rethrow_exception(failure);
      } catch (const std::exception& caught) {
        return std::string(caught.what()).find("imed out") != std::string::npos;
      } catch (...) {
      }
      return false;
    };
    std::string missing;
    for (size_t index = 0; index < receives.size(); ++index) {
      auto& receive = receives[index];
      bool absent = false;
      if (receive->isCompleted()) {
        absent = !receive->isSuccess() && timed_out(receive->exception());
      } else {
        try {
          receive->wait(std::chrono::milliseconds(1));  // Gloo marks a receive done only in wait()
        } catch (const std::exception&) {
          absent = timed_out(std::current_exception());
        }
      }
      if (absent) missing += (missing.empty() ? "" : ", ") + std::to_string(peers[index]);
    }
    if (missing.empty()) throw;
    TORCH_CHECK(false, error.what_without_backtrace(), " Ranks that never issued it: ", missing, ".");
  }
  std::string differences;
  for (int64_t peer = 0; peer < group.size; ++peer) {
    if (peer == group.rank) continue;
    const auto frame = decode_frame(frames[peer].data_ptr<uint8_t>());
    if (frame && frame->same_operation(own)) continue;
    differences += "; rank " + std::to_string(group.global_ranks[static_cast<size_t>(peer)]) + " issued " +
                   (frame ? frame->text() : std::string("something that is not an fsdp.cpp collective"));
  }
  TORCH_CHECK(differences.empty(), "[rank ", group.global_rank, "] the ranks of group '", group.name,
              "' issued different collectives: this rank issued ", own.text(), differences,
              ". Every rank must run the same units, in the same order, with the same shapes: a branch that "
              "only some ranks take, or ranks built from different models or settings, leads here");
}

// Reduces the N rows of `rows` (shape [N, s]) into `output` (s elements), in rank order. Pairwise
// adds stream through memory once per row; at::sum over dim 0 of the same rows is 3.5x slower here.
// bf16 and fp16 accumulate in fp32, which also makes a pre-divide unnecessary against overflow.
void reduce_rows_into(const at::Tensor& output, const at::Tensor& rows, ReduceOp op) {
  const auto dtype = rows.scalar_type();
  const int64_t count = rows.size(0);
  if (dtype == at::kBool) {
    output.copy_(op == ReduceOp::kMin ? rows.all(0) : rows.any(0));
    return;
  }
  const bool widen = op == ReduceOp::kSum && (dtype == at::kBFloat16 || dtype == at::kHalf);
  auto accumulator = widen ? rows[0].to(at::kFloat) : output;
  if (!widen) accumulator.copy_(rows[0]);
  for (int64_t row = 1; row < count; ++row) {
    switch (op) {
      case ReduceOp::kSum:
        accumulator.add_(rows[row]);
        break;
      case ReduceOp::kMax:
        at::maximum_out(accumulator, accumulator, rows[row]);
        break;
      case ReduceOp::kMin:
        at::minimum_out(accumulator, accumulator, rows[row]);
        break;
    }
  }
  if (widen) output.copy_(accumulator);
}

bool gloo_reduces_natively(at::ScalarType dtype) {
  switch (dtype) {
    case at::kFloat:
    case at::kDouble:
    case at::kHalf:
    case at::kBFloat16:
    case at::kBool:
    case at::kChar:
    case at::kByte:
    case at::kInt:
    case at::kLong:
      return true;
    default:
      return false;
  }
}

c10d::ReduceOp to_c10d(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum:
      return c10d::ReduceOp::SUM;
    case ReduceOp::kMax:
      return c10d::ReduceOp::MAX;
    case ReduceOp::kMin:
      return c10d::ReduceOp::MIN;
  }
  TORCH_INTERNAL_ASSERT(false, "unknown ReduceOp");
}

}  // namespace

const char* to_string(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum:
      return "sum";
    case ReduceOp::kMax:
      return "max";
    case ReduceOp::kMin:
      return "min";
  }
  return "unknown";
}

CollectiveWork::CollectiveWork(std::shared_ptr<detail::CollectiveWorkState> state) : state_(std::move(state)) {}

bool CollectiveWork::completed() const { return state_ == nullptr || state_->done; }

bool CollectiveWork::query() const {
  if (state_ == nullptr) return true;
  // A successful wait() clears the works; a failed one keeps them, and they are asked again.
  for (const auto& work : state_->works) {
    if (!work->isCompleted()) return false;
  }
  return true;
}

void CollectiveWork::wait() {
  if (state_ == nullptr || state_->done) return;
  state_->done = true;  // a failed collective is not retried by a second wait()
  for (size_t index = 0; index < state_->works.size(); ++index) {
    // On failure the remaining works stay referenced by state_, so buffers still in flight stay alive.
    try {
      state_->works[index]->wait();
    } catch (const std::exception& error) {
      std::string peer;
      if (index < state_->peers.size()) {
        peer = " in the exchange with rank " + std::to_string(state_->peers[index]);
      } else if (state_->others.size() == 1) {
        peer = " in the exchange with rank " + std::to_string(state_->others.front());
      } else if (!state_->others.empty()) {
        peer = " in an exchange with one of ranks ";
        for (size_t other = 0; other < state_->others.size() && other < 16; ++other) {
          peer += (other ? ", " : "") + std::to_string(state_->others[other]);
        }
        if (state_->others.size() > 16) peer += ", ...";
      }
      TORCH_CHECK(false, state_->description, " failed", peer, ": ", error.what(),
                  ". A peer rank probably exited or stopped calling collectives in the same order; read the other "
                  "ranks' logs. (Collective timeout: ", state_->timeout.count() / 1000.0,
                  " s, set with FSDP_COLLECTIVE_TIMEOUT.)");
    }
  }
  if (state_->finish) state_->finish();
  state_->works.clear();
  state_->finish = nullptr;
}

CollectiveWork all_gather_async(const ProcessGroup& group_handle, const at::Tensor& output, const at::Tensor& input) {
  auto& group = group_handle.state();
  check_buffer(group, "all_gather", "output", output);
  check_buffer(group, "all_gather", "input", input);
  check_same_device(group, "all_gather", output, input);
  TORCH_CHECK(output.scalar_type() == input.scalar_type(), "[rank ", group.global_rank,
              "] all_gather: output dtype ", output.scalar_type(), " differs from input dtype ", input.scalar_type(), ".");
  TORCH_CHECK(output.numel() == input.numel() * group.size, "[rank ", group.global_rank, "] all_gather on group '",
              group.name, "': output has ", output.numel(), " elements but expected ", group.size, " ranks x ",
              input.numel(), " = ", input.numel() * group.size, "; pad shards to equal size.");
  group.record("all_gather", input.numel() * input.element_size());
  if (group.size == 1) {
    if (!output.is_same(input)) output.reshape({-1}).copy_(input.reshape({-1}));
    return completed_work();
  }
  check_frames(group, FrameKind::kAllGather, input, 0, describe(group, "all_gather", output));
  if (input.numel() == 0) return completed_work();
#ifdef FSDP_WITH_CUDA
  if (on_gpu(input)) {
    const c10::DeviceGuard device_guard(input.device());
    at::Tensor output_handle = as_bytes(output);  // c10d takes non-const handles to the same memory
    at::Tensor input_handle = as_bytes(input);
    auto work = nccl(group, input)._allgather_base(output_handle, input_handle);
    group.bytes_all_gather += (group.size - 1) * input_handle.numel();
    return pending_work(group, std::move(work), describe(group, "all_gather", output));
  }
#endif
  auto input_bytes = as_bytes(input);
  auto output_bytes = as_bytes(output);
  const int64_t shard_bytes = input_bytes.numel();
  auto own_chunk = output_bytes.narrow(0, group.rank * shard_bytes, shard_bytes);
  if (own_chunk.data_ptr() != input_bytes.data_ptr()) own_chunk.copy_(input_bytes);
  auto works = exchange_with_peers(
      group, [&](int64_t) { return input_bytes; },
      [&](int64_t peer) { return output_bytes.narrow(0, peer * shard_bytes, shard_bytes); });
  group.bytes_all_gather += (group.size - 1) * shard_bytes;
  return pending_work(group, std::move(works), describe(group, "all_gather", output), nullptr, exchange_peers(group));
}

void all_gather(const ProcessGroup& group, const at::Tensor& output, const at::Tensor& input) {
  all_gather_async(group, output, input).wait();
}

CollectiveWork reduce_scatter_async(const ProcessGroup& group_handle, const at::Tensor& output, const at::Tensor& input,
                                    const ReduceScatterOptions& options) {
  auto& group = group_handle.state();
  check_buffer(group, "reduce_scatter", "output", output);
  check_buffer(group, "reduce_scatter", "input", input);
  check_same_device(group, "reduce_scatter", output, input);
  TORCH_CHECK(output.scalar_type() == input.scalar_type(), "[rank ", group.global_rank,
              "] reduce_scatter: output dtype ", output.scalar_type(), " differs from input dtype ",
              input.scalar_type(), ".");
  TORCH_CHECK(input.numel() == output.numel() * group.size, "[rank ", group.global_rank, "] reduce_scatter on group '",
              group.name, "': input has ", input.numel(), " elements but expected ", group.size, " ranks x ",
              output.numel(), " = ", output.numel() * group.size, "; pad the input to a multiple of the group size.");
  check_divide_factor(group, "pre_divide_factor", options.pre_divide_factor, input);
  check_divide_factor(group, "post_divide_factor", options.post_divide_factor, input);
  group.record("reduce_scatter", input.numel() * input.element_size());
  const int64_t shard_numel = output.numel();
  if (group.size > 1) {
    check_frames(group, FrameKind::kReduceScatter, input, static_cast<int64_t>(options.op),
                 describe(group, "reduce_scatter", input));
  }
  if (shard_numel == 0) return completed_work();

  auto send = options.pre_divide_factor == 1.0 ? input.reshape({-1}) : input.reshape({-1}) / options.pre_divide_factor;
  auto finish_rows = [output, options](const at::Tensor& rows) {
    auto destination = output.reshape({-1});
    reduce_rows_into(destination, rows, options.op);
    if (options.post_divide_factor != 1.0) destination.div_(options.post_divide_factor);
  };
  if (group.size == 1) {
    finish_rows(send.view({1, shard_numel}));
    return completed_work();
  }
#ifdef FSDP_WITH_CUDA
  if (on_gpu(input)) {
    // NCCL reduces in the buffer's dtype (bf16 sums in bf16, as PyTorch's FSDP2 does on GPUs); the
    // post-divide runs on the stream that waits for the result.
    TORCH_CHECK(input.scalar_type() != at::kBool, "[rank ", group.global_rank,
                "] reduce_scatter of bool on a GPU: NCCL has no bool; reduce a uint8 copy instead.");
    const c10::DeviceGuard device_guard(input.device());
    c10d::ReduceScatterOptions reduce_options;
    reduce_options.reduceOp = to_c10d(options.op);
    at::Tensor output_handle = output.reshape({-1});
    at::Tensor input_handle = send.contiguous();
    auto work = nccl(group, input)._reduce_scatter_base(output_handle, input_handle, reduce_options);
    group.bytes_reduce_scatter += (group.size - 1) * shard_numel * input.element_size();
    const double post_divide = options.post_divide_factor;
    return pending_work(group, std::move(work), describe(group, "reduce_scatter", input),
                        [output_handle, input_handle, post_divide] {
                          if (post_divide != 1.0) output_handle.div_(post_divide);
                        });
  }
#endif

  // Row r of `received` is rank r's chunk for this rank: (N-1)/N of the buffer crosses the wire.
  // From the pool of unit-sized blocks: a fresh buffer costs a page fault per 4 KiB (31 ms for 64 MB
  // here, more than the transfer), and the same sizes recur every step.
  const int64_t chunk_bytes = shard_numel * input.element_size();
  auto received_bytes = detail::pooled_bytes(group.size * chunk_bytes, input.device());
  auto received = received_bytes.view(input.scalar_type()).view({group.size, shard_numel});
  auto send_bytes = as_bytes(send);
  received_bytes.narrow(0, group.rank * chunk_bytes, chunk_bytes)
      .copy_(send_bytes.narrow(0, group.rank * chunk_bytes, chunk_bytes));
  auto works = exchange_with_peers(
      group, [&](int64_t peer) { return send_bytes.narrow(0, peer * chunk_bytes, chunk_bytes); },
      [&](int64_t peer) { return received_bytes.narrow(0, peer * chunk_bytes, chunk_bytes); });
  group.bytes_reduce_scatter += (group.size - 1) * chunk_bytes;
  return pending_work(
      group, std::move(works), describe(group, "reduce_scatter", input),
      [send, received, finish_rows] {
        finish_rows(received);
        detail::return_pooled_bytes(received);
      },
      exchange_peers(group));
}

void reduce_scatter(const ProcessGroup& group, const at::Tensor& output, const at::Tensor& input,
                    const ReduceScatterOptions& options) {
  reduce_scatter_async(group, output, input, options).wait();
}

CollectiveWork all_reduce_async(const ProcessGroup& group_handle, const at::Tensor& tensor, ReduceOp op) {
  auto& group = group_handle.state();
  check_buffer(group, "all_reduce", "input", tensor);
  group.record("all_reduce", tensor.numel() * tensor.element_size());
  if (group.size == 1) return completed_work();
  check_frames(group, FrameKind::kAllReduce, tensor, static_cast<int64_t>(op), describe(group, "all_reduce", tensor));
  if (tensor.numel() == 0) return completed_work();
  const int64_t bytes = tensor.numel() * tensor.element_size();
#ifdef FSDP_WITH_CUDA
  if (on_gpu(tensor)) {
    const c10::DeviceGuard device_guard(tensor.device());
    // NCCL has no bool: a uint8 copy, with max for "any" (sum, max) and min for "all".
    const bool as_uint8 = tensor.scalar_type() == at::kBool;
    std::vector<at::Tensor> tensors{as_uint8 ? tensor.to(at::kByte) : tensor};
    c10d::AllreduceOptions options;
    options.reduceOp = as_uint8 && op == ReduceOp::kSum ? c10d::ReduceOp(c10d::ReduceOp::MAX) : to_c10d(op);
    auto work = nccl(group, tensor).allreduce(tensors, options);
    group.bytes_all_reduce += 2 * (group.size - 1) * bytes / group.size;
    std::function<void()> finish;
    if (as_uint8) finish = [tensor, copy = tensors.front()] { tensor.copy_(copy); };
    return pending_work(group, std::move(work), describe(group, "all_reduce", tensor), std::move(finish));
  }
#endif
  if (gloo_reduces_natively(tensor.scalar_type())) {
    std::vector<at::Tensor> tensors{tensor};
    c10d::AllreduceOptions options;
    options.reduceOp = to_c10d(op);
    auto work = gloo(group).allreduce(tensors, options);
    // Gloo's ring all-reduce: a reduce-scatter then an all-gather, each (N-1)/N of the buffer.
    group.bytes_all_reduce += 2 * (group.size - 1) * bytes / group.size;
    return pending_work(group, std::move(work), describe(group, "all_reduce", tensor));
  }
  // int16 and the rest: reduce-scatter then all-gather through our byte path. Done synchronously so
  // that the two collectives cannot interleave with collectives the caller issues meanwhile.
  const int64_t shard_numel = (tensor.numel() + group.size - 1) / group.size;
  auto padded = at::zeros({shard_numel * group.size}, tensor.options());
  padded.narrow(0, 0, tensor.numel()).copy_(tensor.reshape({-1}));
  auto shard = at::empty({shard_numel}, tensor.options());
  ReduceScatterOptions options;
  options.op = op;
  reduce_scatter(group_handle, shard, padded, options);
  all_gather(group_handle, padded, shard);
  // Charge the traffic to all_reduce, where the caller asked for it.
  const int64_t moved = (group.size - 1) * shard_numel * tensor.element_size();
  group.bytes_reduce_scatter -= moved;
  group.bytes_all_gather -= moved;
  group.bytes_all_reduce += 2 * moved;
  tensor.reshape({-1}).copy_(padded.narrow(0, 0, tensor.numel()));
  return completed_work();
}

void all_reduce(const ProcessGroup& group, const at::Tensor& tensor, ReduceOp op) {
  all_reduce_async(group, tensor, op).wait();
}

CollectiveWork broadcast_async(const ProcessGroup& group_handle, const at::Tensor& tensor, int64_t root) {
  auto& group = group_handle.state();
  check_buffer(group, "broadcast", "input", tensor);
  TORCH_CHECK(root >= 0 && root < group.size, "[rank ", group.global_rank, "] broadcast on group '", group.name,
              "': root ", root, " is outside [0, ", group.size, ").");
  group.record("broadcast", tensor.numel() * tensor.element_size());
  if (group.size == 1) return completed_work();
  check_frames(group, FrameKind::kBroadcast, tensor, root, describe(group, "broadcast", tensor));
  if (tensor.numel() == 0) return completed_work();
  std::vector<at::Tensor> tensors{as_bytes(tensor)};
  c10d::BroadcastOptions options;
  options.rootRank = root;
#ifdef FSDP_WITH_CUDA
  std::optional<c10::DeviceGuard> device_guard;
  if (on_gpu(tensor)) device_guard.emplace(tensor.device());
  auto work = on_gpu(tensor) ? nccl(group, tensor).broadcast(tensors, options) : gloo(group).broadcast(tensors, options);
#else
  auto work = gloo(group).broadcast(tensors, options);
#endif
  if (group.rank == root) group.bytes_broadcast += (group.size - 1) * tensor.numel() * tensor.element_size();
  return pending_work(group, std::move(work), describe(group, "broadcast", tensor));
}

void broadcast(const ProcessGroup& group, const at::Tensor& tensor, int64_t root) {
  broadcast_async(group, tensor, root).wait();
}

void barrier(const ProcessGroup& group_handle) {
  auto& group = group_handle.state();
  group.record("barrier", 0);
  if (group.size == 1) return;
  check_frames(group, FrameKind::kBarrier, at::Tensor(), 0,
               "[rank " + std::to_string(group.global_rank) + "] barrier on group '" + group.name + "'");
  auto work = gloo(group).barrier();
  pending_work(group, std::move(work), "[rank " + std::to_string(group.global_rank) + "] barrier on group '" +
                                           group.name + "'")
      .wait();
}

namespace detail {

void native_all_gather(const ProcessGroup& group_handle, const at::Tensor& output, const at::Tensor& input) {
  auto& group = group_handle.state();
  if (group.size == 1) return;
  at::Tensor output_handle = output;  // c10d takes non-const handles to the same tensors
  at::Tensor input_handle = input;
  auto work = gloo(group)._allgather_base(output_handle, input_handle);
  pending_work(group, std::move(work), describe(group, "native all_gather", output)).wait();
}

void native_reduce_scatter(const ProcessGroup& group_handle, const at::Tensor& output, const at::Tensor& input) {
  auto& group = group_handle.state();
  if (group.size == 1) return;
  c10d::ReduceScatterOptions options;
  options.reduceOp = c10d::ReduceOp::SUM;
  at::Tensor output_handle = output;
  at::Tensor input_handle = input;
  auto work = gloo(group)._reduce_scatter_base(output_handle, input_handle, options);
  pending_work(group, std::move(work), describe(group, "native reduce_scatter", input)).wait();
}

}  // namespace detail
}  // namespace fsdp
