// Private: how the launchers of a job of several machines agree on each round (Note [elastic
// rounds]): who is in it, which ranks each machine runs, and whether it failed somewhere.
#pragma once

#include "launch/launcher.h"

#include "dist/agent_store.h"

#include <memory>
#include <optional>
#include <string>

namespace fsdp::detail {

/// One round's place for this machine.
struct RoundMembership {
  /// The round, which is also the restart count the workers see.
  int64_t round = 0;
  /// This machine's index among the round's machines, ordered by --node-rank (GROUP_RANK).
  int64_t group_rank = 0;
  /// Machines in the round, and their --node-rank values in order.
  std::vector<int64_t> node_ranks;
  /// Ranks in the round (machines x --nproc-per-node) and this machine's first.
  int64_t world_size = 0;
  int64_t first_rank = 0;
};

/// A failure one launcher reported for its round, for the others to stop on.
struct RoundFailure {
  int exit_code = 1;
  std::string message;
  /// Ctrl-C or SIGTERM on that machine: the job ends, with no restart.
  bool interrupted = false;
};

class ElasticRendezvous {
 public:
  /// Hosts (--node-rank 0) or reaches the agent store at --master-addr:--master-port.
  explicit ElasticRendezvous(const LaunchOptions& options);

  /// Joins round `round`, or the first later one that admits this machine (a machine that arrives
  /// after a round closed waits for the next). Returns nullopt when the job ended meanwhile. The
  /// host closes a round once --nnodes MAX machines joined, or MIN and the last call passed; with
  /// fewer than MIN after the join timeout every waiting launcher throws, naming who is there.
  std::optional<RoundMembership> join(int64_t round);

  /// The failure reported for `round`, if any (one request to the store).
  std::optional<RoundFailure> failure(int64_t round);
  /// Reports this machine's failure; the first report of a round is the one every launcher sees.
  RoundFailure report_failure(int64_t round, const RoundFailure& failure);
  /// Reports that this machine's processes all exited 0, then waits until every machine of the
  /// round did (true) or one reported a failure (false; `failure` then tells which).
  bool finish_round(const RoundMembership& membership);
  /// Leaves the job after `membership`'s round: the others tell the host, which waits for them
  /// (a few seconds at most; its store ends with it) and then marks the job ended, so that a
  /// machine waiting for a later round leaves too.
  void leave(const RoundMembership& membership, int exit_code);

  AgentStore& store() { return *store_; }

 private:
  std::string key(int64_t round, const std::string& name) const;
  RoundMembership read_membership(int64_t round, const std::string& assignment);
  void close_round(int64_t round, int64_t joined);

  LaunchOptions options_;
  std::string hostname_;
  std::unique_ptr<AgentStore> store_;
};

}  // namespace fsdp::detail
