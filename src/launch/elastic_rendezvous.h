// Private: how the launchers of a job of several machines agree on each round (Note [elastic
// rounds]): who is in it, which ranks each machine runs, and whether it failed somewhere.
#pragma once

#include <condition_variable>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "dist/agent_store.h"
#include "launch/launch_options.h"

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
  /// after a round closed waits for the next). `previous` is the round this machine last ran in:
  /// the host then closes the new round as soon as all of that round's machines are back, and
  /// another machine waits at most the join timeout for the host to open it. Returns nullopt when
  /// the job ended meanwhile, with its exit code in `ended_with`. With fewer than MIN machines after
  /// the join timeout, or launchers that disagree, every waiting launcher throws the same error.
  std::optional<RoundMembership> join(int64_t round, const std::optional<RoundMembership>& previous, int& ended_with);

  /// The failure reported for `round`, if any (one request to the store).
  std::optional<RoundFailure> failure(int64_t round);
  /// Reports this machine's failure; the first report of a round is the one every launcher sees.
  RoundFailure report_failure(int64_t round, const RoundFailure& failure);
  /// Reports that this machine's processes all exited 0, then waits until every machine of the
  /// round did (true) or one reported a failure (false; `failure` then tells which). After the join
  /// timeout without either it says so and returns true, as torchrun's exit barrier does.
  bool finish_round(const RoundMembership& membership);
  /// Leaves the job after `membership`'s round: the others tell the host, which waits for them
  /// (a few seconds at most; its store ends with it) and then marks the job ended with
  /// `exit_code`, so that a machine waiting for a later round leaves too.
  void leave(const RoundMembership& membership, int exit_code);

 private:
  struct Member {
    int64_t node_rank = 0, nproc_per_node = 0, min_nodes = 0, max_nodes = 0, max_restarts = 0;
    int64_t termination_grace_ms = 0;
    std::string hostname;
  };
  static std::string encode(const Member& member);
  static Member decode(const std::string& record);

  std::string key(int64_t round, const std::string& name) const;
  /// The host's part of a round: waits for the machines, then writes the assignment (or an error).
  void close_round(int64_t round, const std::optional<RoundMembership>& previous);
  std::string assignment_of(int64_t round, int64_t count);
  std::optional<RoundMembership> membership_of(int64_t round, const std::string& assignment);

  LaunchOptions options_;
  Member self_;
  std::unique_ptr<AgentStore> store_;
};

/// Watches one round from a thread of its own while this machine's processes run, so that the
/// process supervisor never waits on the store: every 250 ms it looks for a failure another
/// launcher reported, and it writes this machine's first failure as soon as it is reported.
class RoundWatch {
 public:
  RoundWatch(ElasticRendezvous& rendezvous, int64_t round);
  ~RoundWatch();
  RoundWatch(const RoundWatch&) = delete;
  RoundWatch& operator=(const RoundWatch&) = delete;

  /// This machine's failure, to be written for the others (the first one only). Never blocks.
  void report(const RoundFailure& failure);
  /// Another machine's failure, or the store's error, once seen. Never blocks.
  std::optional<std::string> stop_reason();
  /// Stops the thread once a reported failure is written; throws the store's error if it failed.
  void finish();

 private:
  void run();
  void stop();

  ElasticRendezvous& rendezvous_;
  int64_t round_;
  std::mutex mutex_;
  std::condition_variable wake_;
  std::optional<RoundFailure> local_, seen_;
  std::optional<std::string> error_;
  bool written_ = false, done_ = false;
  std::thread thread_;
};

}  // namespace fsdp::detail
