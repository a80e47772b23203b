// Private: the launchers' own store, torchrun's "agent store". The launcher of node rank 0 hosts it
// for the whole job, outliving every round of workers; the launchers agree on each round's membership
// through it (Note [elastic rounds]), and the workers of a round use it too, under the key prefix
// torchrun gives them (TORCHELASTIC_USE_AGENT_STORE). Implemented in dist/c10d/agent_store.cpp, on
// c10d's TCPStore.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>

namespace fsdp::detail {

class AgentStore {
 public:
  /// Hosts the store at address:port (listening on that address only) when `host`, else connects
  /// to it, retrying for up to `timeout`. Throws a c10::Error naming the address and the fix.
  AgentStore(const std::string& address, int port, bool host, std::chrono::milliseconds timeout);
  ~AgentStore();
  AgentStore(const AgentStore&) = delete;
  AgentStore& operator=(const AgentStore&) = delete;

  void set(const std::string& key, const std::string& value);
  /// The value, or nullopt when the key does not exist yet (no wait).
  std::optional<std::string> try_get(const std::string& key);
  /// Adds `delta` to the integer at `key` (0 when absent) and returns the sum, atomically.
  int64_t add(const std::string& key, int64_t delta);
  /// Sets `key` to `value` unless it exists; returns what `key` holds afterwards (the first writer's).
  std::string set_if_absent(const std::string& key, const std::string& value);

  /// "10.0.0.1:29500", for messages.
  const std::string& endpoint() const { return endpoint_; }

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
  std::string endpoint_;
};

}  // namespace fsdp::detail
