// The rendezvous store that every group of a job is made from: c10d's TCPStore, hosted by rank 0
// (or by torchrun's agent), and the Gloo transport device the groups share.
#include <netdb.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <csignal>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include "dist/c10d/internal.h"

namespace fsdp::detail {
namespace {

bool is_loopback(const std::string& host) { return host == "localhost" || host.rfind("127.", 0) == 0 || host == "::1"; }

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

}  // namespace

// The stores fsdp.cpp hosts (rank 0's for the rendezvous, the launchers' agent store) have no
// authentication: they listen only where the others connect, the given address (loopback for one
// machine), not on every interface as c10d's TCPStore does by itself.
std::optional<int> listen_on_address(const std::string& address, int port, int64_t backlog, std::string& why) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_NUMERICSERV;
  addrinfo* found = nullptr;
  const auto port_text = std::to_string(port);
  const int resolved = ::getaddrinfo(address.c_str(), port_text.c_str(), &hints, &found);
  if (resolved != 0) {
    why = std::string("it does not resolve: ") + ::gai_strerror(resolved);
    return std::nullopt;
  }
  std::optional<int> result;
  for (auto* candidate = found; candidate && !result; candidate = candidate->ai_next) {
    const int descriptor =
        ::socket(candidate->ai_family, candidate->ai_socktype | SOCK_CLOEXEC, candidate->ai_protocol);
    if (descriptor < 0) continue;
    const int yes = 1;
    ::setsockopt(descriptor, SOL_SOCKET, SO_REUSEADDR, &yes, sizeof(yes));
    if (::bind(descriptor, candidate->ai_addr, candidate->ai_addrlen) == 0 &&
        ::listen(descriptor, static_cast<int>(std::min<int64_t>(backlog, SOMAXCONN))) == 0) {
      result = descriptor;
    } else {
      why = std::string("binding it failed: ") + std::strerror(errno);
      ::close(descriptor);
    }
  }
  ::freeaddrinfo(found);
  return result;
}

std::shared_ptr<BackendStore> connect_rendezvous_store(const DistributedEnvironment& environment) {
  // A peer that dies closes its connections, and the next write to one raises SIGPIPE, whose default
  // action ends this process without a word (exit 141) before Gloo can report which peer failed.
  // Python, and so PyTorch, ignores SIGPIPE from the start; a C++ program has the default, so it is
  // ignored here, unless the program chose its own disposition.
  struct sigaction current{};
  if (::sigaction(SIGPIPE, nullptr, &current) == 0 && current.sa_handler == SIG_DFL &&
      (current.sa_flags & SA_SIGINFO) == 0) {
    ::signal(SIGPIPE, SIG_IGN);
  }
  auto backend = std::make_shared<BackendStore>();
  c10d::TCPStoreOptions options;
  options.port = static_cast<std::uint16_t>(environment.master_port);
  options.isServer = environment.rank == 0 && !environment.use_agent_store;
  options.numWorkers = static_cast<size_t>(environment.world_size);
  options.waitWorkers = !environment.use_agent_store;
  options.timeout = environment.timeout;
  const double timeout_seconds = environment.timeout.count() / 1000.0;
  if (options.isServer) {
    std::string why;
    options.masterListenFd =
        listen_on_address(environment.master_addr, environment.master_port, environment.world_size + 16, why);
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
                  "one); if ranks are missing, check that all ",
                  environment.world_size,
                  " processes were started with the same MASTER_ADDR, MASTER_PORT and WORLD_SIZE.");
    }
    TORCH_CHECK(false, "[rank ", environment.rank, "] rendezvous: could not reach the master at ",
                environment.master_addr, ":", environment.master_port, " within ", timeout_seconds,
                " s: ", error.what(),
                ". Check that rank 0 is running, that MASTER_ADDR/MASTER_PORT point at it, and that the port is "
                "reachable from this machine (FSDP_COLLECTIVE_TIMEOUT sets the timeout).");
  }
  if (environment.use_agent_store) {
    // The agent's store outlives the rounds of a restarted job, so each round's keys are its own,
    // under torchrun's prefix (torch.distributed.rendezvous does the same for its workers).
    backend->store = c10::make_intrusive<c10d::PrefixStore>(
        "/worker/attempt_" + std::to_string(environment.restart_count), backend->store);
  }
  backend->device = create_device(environment);
  return backend;
}

}  // namespace fsdp::detail
