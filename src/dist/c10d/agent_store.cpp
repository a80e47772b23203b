// See dist/agent_store.h.
#include "dist/agent_store.h"

#include <cerrno>
#include <cstring>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include "dist/c10d/internal.h"

namespace fsdp::detail {

struct AgentStore::Impl {
  c10::intrusive_ptr<c10d::TCPStore> store;
};

namespace {

std::vector<uint8_t> bytes_of(const std::string& text) { return {text.begin(), text.end()}; }
std::string text_of(const std::vector<uint8_t>& bytes) { return {bytes.begin(), bytes.end()}; }

}  // namespace

AgentStore::AgentStore(const std::string& address, int port, bool host, std::chrono::milliseconds timeout)
    : impl_(std::make_unique<Impl>()), endpoint_(address + ":" + std::to_string(port)) {
  c10d::TCPStoreOptions options;
  options.port = static_cast<std::uint16_t>(port);
  options.isServer = host;
  options.waitWorkers = false;  // launchers come and go between rounds; none is waited for here
  options.timeout = timeout;
  if (host) {
    std::string why;
    options.masterListenFd = listen_on_address(address, port, 1024, why);
    TORCH_CHECK(options.masterListenFd.has_value(), "fsdp launch: the launchers' rendezvous store cannot listen on ",
                endpoint_, ": ", why,
                ". The launcher with --node-rank 0 hosts it: give it --master-addr with an "
                "address of its own machine and a --master-port that is free there.");
  }
  try {
    impl_->store = c10::make_intrusive<c10d::TCPStore>(address, options);
  } catch (const std::exception& error) {
    TORCH_CHECK(false, "fsdp launch: ", host ? "could not host" : "could not reach",
                " the launchers' rendezvous store at ", endpoint_, " within ", timeout.count() / 1000.0,
                " s: ", error.what(),
                host ? ". Pick another --master-port."
                     : ". The launcher with --node-rank 0 hosts it: check that it is running, that --master-addr and "
                       "--master-port point at it, and that the port is reachable from this machine.");
  }
}

AgentStore::~AgentStore() = default;

namespace {

// Every operation names the store when it fails: the one way it fails in practice is the loss of
// the machine hosting it, which ends the job (Note [elastic rounds]).
template <typename Operation>
auto guarded(const std::string& endpoint, const std::string& what, Operation operation) {
  try {
    return operation();
  } catch (const std::exception& error) {
    TORCH_CHECK(false, "fsdp launch: the launchers' rendezvous store at ", endpoint, " failed (", what,
                "): ", error.what(),
                ". It lives in the launcher with --node-rank 0; without it the job cannot go on (as "
                "with torchrun's c10d rendezvous). Restart the job once that machine is back (train_llama "
                "--resume-from latest continues from the last complete checkpoint).");
  }
}

}  // namespace

void AgentStore::set(const std::string& key, const std::string& value) {
  guarded(endpoint_, "set " + key, [&] { impl_->store->set(key, bytes_of(value)); });
}

std::optional<std::string> AgentStore::try_get(const std::string& key) {
  return guarded(endpoint_, "get " + key, [&]() -> std::optional<std::string> {
    if (!impl_->store->check({key})) return std::nullopt;
    return text_of(impl_->store->get(key));
  });
}

int64_t AgentStore::add(const std::string& key, int64_t delta) {
  return guarded(endpoint_, "add " + key, [&] { return impl_->store->add(key, delta); });
}

std::string AgentStore::set_if_absent(const std::string& key, const std::string& value) {
  TORCH_INTERNAL_ASSERT(!value.empty(),
                        "set_if_absent needs a non-empty value (c10d's compareSet reads an empty "
                        "expected value as 'absent')");
  return guarded(endpoint_, "compare-set " + key,
                 [&] { return text_of(impl_->store->compareSet(key, {}, bytes_of(value))); });
}

}  // namespace fsdp::detail
