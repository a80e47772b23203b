// See elastic_rendezvous.h.
#include "launch/elastic_rendezvous.h"

#include <c10/util/Exception.h>
#include <unistd.h>

#include <algorithm>
#include <map>
#include <sstream>

namespace fsdp::detail {

namespace {

using Clock = std::chrono::steady_clock;
constexpr auto kPoll = std::chrono::milliseconds(100);
constexpr auto kWatchInterval = std::chrono::milliseconds(250);
// How long the host waits for a launcher's record after its arrival was counted (it writes it
// right after), and for the others to read an error before its store goes with it.
constexpr auto kRecordWait = std::chrono::seconds(10);
constexpr auto kErrorReadWait = std::chrono::seconds(5);
// After a failed round whose machines are all back, how long the host waits for machines that
// waited for this round (they look every kPoll) before it closes it.
constexpr auto kWaitingJoin = std::chrono::seconds(1);
const std::string kJobEnded = "/fsdp_launch/job_ended";

std::string this_hostname() {
  char name[256] = {};
  if (::gethostname(name, sizeof(name) - 1) != 0) return "?";
  return name;
}

std::string list(const std::vector<int64_t>& values) {
  std::string text;
  for (const auto value : values) text += (text.empty() ? "" : ", ") + std::to_string(value);
  return text;
}

double seconds(std::chrono::milliseconds duration) { return static_cast<double>(duration.count()) / 1000.0; }

// "2", "0.5": seconds as a user writes them.
std::string seconds_text(std::chrono::milliseconds duration) {
  std::ostringstream text;
  text << seconds(duration);
  return text.str();
}

}  // namespace

// Note [elastic rounds]
// With several machines and either --max-restarts or --nnodes MIN:MAX, the launchers run the job in
// rounds, as torchrun's elastic agents do with the c10d rendezvous backend. The launcher of
// --node-rank 0 hosts an agent store at --master-addr:--master-port for the whole job; the workers
// of every round use it too (TORCHELASTIC_USE_AGENT_STORE, their keys under torchrun's
// "/worker/attempt_<round>" prefix), so no worker hosts anything and a new round needs no new port.
// A round, whose number is the TORCHELASTIC_RESTART_COUNT its workers see:
//   1. Each launcher joins: one atomic add gives its arrival index, and it writes its record (node
//      rank, processes, MIN:MAX, --max-restarts and --termination-grace, which every launcher must
//      share, and hostname). The host joins first (the others wait for it, at most the join timeout
//      when they ran the last round), so it is a member of every round.
//   2. The host closes the round once MAX machines joined; or, after a failed round, once all of
//      that round's machines are back (and a second passed for machines waiting to join); or once at least MIN joined
//      and the last call passed (last_call_timeout from when MIN were there, plus --termination-grace after a failed
//      round, so that a machine still stopping its processes is not shut out). With fewer than MIN at the join timeout,
//      or launchers that disagree, it writes one error, which every waiting launcher raises (the host waits a few
//      seconds for them to read it). Otherwise it orders the first MAX arrivals by --node-rank (itself first; a
//      launcher killed while joining is left out) and writes the assignment. A machine not in it waits for the next
//      round: it joins at the next restart (running rounds are not stopped to admit it, unlike torchrun's agents), and
//      leaves with the job's exit code if the job ends first.
//   3. Each launcher starts its processes with the ranks of its place (GROUP_RANK, GROUP_WORLD_SIZE
//      and WORLD_SIZE of this round). A RoundWatch thread writes this machine's first failure the
//      moment a process fails (first writer wins), and looks for another machine's every 250 ms;
//      seeing one, the launcher stops its processes. The supervisor never waits on the store. A
//      machine lost whole writes nothing: the others' processes fail in their next collective, and
//      their launchers write it. A launcher stopped by a signal on a machine other than the host's
//      (a preemption) reports an ordinary failure and leaves: the others go on without it.
//   4. With a restart left, every launcher joins the next round; the lost machine's absence is then
//      the last call's to wait out, and the job goes on with fewer ranks if at least MIN remain.
//      Programs resume from their latest complete checkpoint (Note [restarting a failed job]) on the
//      new world size; train_llama keeps --global-batch-size, accumulating more per rank.
// Cost: a join is two requests per launcher and the host reads each record once, so a round costs
// O(machines) requests at the host; watching is one request per launcher every 250 ms, about 4,000
// requests a second at the host with 1,000 machines, within what a TCPStore serves. The limit
// torchrun's static and c10d rendezvous share: the store lives in one launcher, so losing the
// machine of --node-rank 0 ends the job (every other launcher stops its processes and says so);
// restart it by hand from the latest checkpoint.
ElasticRendezvous::ElasticRendezvous(const LaunchOptions& options) : options_(options) {
  // A fixed size (--nnodes N) is MIN = MAX = N: every round waits for all N machines.
  options_.min_nnodes = min_nodes(options);
  self_ = Member{options_.node_rank, options_.nproc_per_node, options_.min_nnodes,
                 options_.nnodes,    options_.max_restarts,   options_.termination_grace.count(),
                 this_hostname()};
  store_ = std::make_unique<AgentStore>(options.master_addr, options.master_port, options.node_rank == 0,
                                        options.join_timeout);
}

std::string ElasticRendezvous::encode(const Member& member) {
  std::ostringstream text;
  text << member.node_rank << ' ' << member.nproc_per_node << ' ' << member.min_nodes << ' ' << member.max_nodes << ' '
       << member.max_restarts << ' ' << member.termination_grace_ms << ' ' << member.hostname;
  return text.str();
}

ElasticRendezvous::Member ElasticRendezvous::decode(const std::string& record) {
  Member member;
  std::istringstream text(record);
  text >> member.node_rank >> member.nproc_per_node >> member.min_nodes >> member.max_nodes >> member.max_restarts >>
      member.termination_grace_ms;
  TORCH_CHECK(!text.fail(), "fsdp launch: a launcher's join record '", record, "' does not parse: is every machine's ",
              "fsdp the same version?");
  std::getline(text >> std::ws, member.hostname);
  return member;
}

std::string ElasticRendezvous::key(int64_t round, const std::string& name) const {
  return "/fsdp_launch/round_" + std::to_string(round) + "/" + name;
}

// The assignment of the first `count` arrivals: "ok <node ranks>" or "error <message>".
std::string ElasticRendezvous::assignment_of(int64_t round, int64_t count) {
  std::vector<Member> members;
  const auto deadline = Clock::now() + kRecordWait;
  for (int64_t index = 0; index < count; ++index) {
    std::optional<std::string> record;
    while (!(record = store_->try_get(key(round, "member_" + std::to_string(index)))) && Clock::now() < deadline) {
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    if (record) members.push_back(decode(*record));  // else killed while joining: left out
  }
  std::sort(members.begin(), members.end(), [](const Member& a, const Member& b) { return a.node_rank < b.node_rank; });
  std::string error;
  if (static_cast<int64_t>(members.size()) < options_.min_nnodes) {
    error = "only " + std::to_string(members.size()) + " of at least " + std::to_string(options_.min_nnodes) +
            " machines finished joining; one was stopped while it joined";
  }
  for (size_t index = 0; index < members.size() && error.empty(); ++index) {
    const auto& member = members[index];
    if (index > 0 && member.node_rank == members[index - 1].node_rank) {
      error = "two launchers have --node-rank " + std::to_string(member.node_rank) + " (on " +
              members[index - 1].hostname + " and " + member.hostname + "); give each machine its own --node-rank";
    } else if (member.nproc_per_node != self_.nproc_per_node || member.min_nodes != self_.min_nodes ||
               member.max_nodes != self_.max_nodes || member.max_restarts != self_.max_restarts ||
               member.termination_grace_ms != self_.termination_grace_ms) {
      auto settings = [](const Member& of) {
        return "--nproc-per-node " + std::to_string(of.nproc_per_node) + " --nnodes " + std::to_string(of.min_nodes) +
               ":" + std::to_string(of.max_nodes) + " --max-restarts " + std::to_string(of.max_restarts) +
               " --termination-grace " + seconds_text(std::chrono::milliseconds(of.termination_grace_ms));
      };
      error = "the launcher of --node-rank " + std::to_string(member.node_rank) + " (on " + member.hostname + ") has " +
              settings(member) + " but the host's are " + settings(self_) +
              "; every machine's launcher needs the same ones";
    }
  }
  if (!error.empty()) return "error " + error;
  std::string assignment = "ok";
  for (const auto& member : members) assignment += " " + std::to_string(member.node_rank);
  return assignment;
}

void ElasticRendezvous::close_round(int64_t round, const std::optional<RoundMembership>& previous) {
  const auto joined_at = Clock::now();
  std::optional<Clock::time_point> last_call;
  std::map<int64_t, int64_t> node_rank_of;  // arrival index -> node rank, read once each
  std::string assignment;
  int64_t count = 0;
  while (true) {
    const int64_t joined = store_->add(key(round, "joined"), 0);
    for (int64_t index = 0; index < joined; ++index) {
      if (node_rank_of.count(index)) continue;
      if (auto record = store_->try_get(key(round, "member_" + std::to_string(index)))) {
        node_rank_of[index] = decode(*record).node_rank;
      }
    }
    // After a failed round its machines are all back: no one else is waited for.
    bool all_back = previous.has_value();
    for (size_t position = 0; previous && position < previous->node_ranks.size(); ++position) {
      const auto wanted = previous->node_ranks[position];
      all_back = all_back && std::any_of(node_rank_of.begin(), node_rank_of.end(),
                                         [&](const auto& entry) { return entry.second == wanted; });
    }
    if (joined >= options_.min_nnodes && !last_call) {
      last_call = Clock::now() + options_.last_call_timeout;
      if (previous) *last_call += options_.termination_grace;
    }
    // A machine waiting for this round looks for it every 100 ms: it gets a moment to join too.
    const bool waiting_ones_joined = Clock::now() - joined_at >= kWaitingJoin;
    if (joined >= options_.nnodes || (all_back && waiting_ones_joined && joined >= options_.min_nnodes) ||
        (last_call && Clock::now() >= *last_call)) {
      // Members are the first `count` arrivals; one arriving from here on waits for the next round.
      count = std::min(store_->add(key(round, "joined"), 0), options_.nnodes);
      assignment = assignment_of(round, count);
      break;
    }
    if (Clock::now() - joined_at > options_.join_timeout) {
      std::string present;
      for (const auto& [index, node_rank] : node_rank_of)
        present += (present.empty() ? "" : ", ") + std::to_string(node_rank);
      std::ostringstream error;
      error << "error only " << joined << " of at least " << options_.min_nnodes << " machines (--nnodes "
            << options_.min_nnodes << ":" << options_.nnodes << ") joined within the join timeout of "
            << seconds(options_.join_timeout) << " s; present: node rank " << present
            << ". Start the missing machines' launchers with the same --master-addr and --master-port, or lower MIN";
      assignment = error.str();
      count = joined;
      break;
    }
    std::this_thread::sleep_for(kPoll);
  }
  store_->set(key(round, "assignment"), assignment);
  store_->set(key(round, "closed"), "1");
  if (assignment.rfind("error ", 0) == 0) {
    // The others raise the same error once they read it; the store must outlive that read.
    const auto deadline = Clock::now() + kErrorReadWait;
    while (store_->add(key(round, "read"), 0) < count - 1 && Clock::now() < deadline) {
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
  }
}

std::optional<RoundMembership> ElasticRendezvous::membership_of(int64_t round, const std::string& assignment) {
  TORCH_CHECK(assignment.rfind("error ", 0) != 0, "fsdp launch: round ", round, ": ", assignment.substr(6), ".");
  std::istringstream text(assignment);
  std::string ok;
  text >> ok;
  RoundMembership membership;
  membership.round = round;
  for (int64_t node_rank; text >> node_rank;) membership.node_ranks.push_back(node_rank);
  const auto place = std::find(membership.node_ranks.begin(), membership.node_ranks.end(), options_.node_rank);
  if (place == membership.node_ranks.end()) return std::nullopt;
  membership.group_rank = place - membership.node_ranks.begin();
  membership.world_size = static_cast<int64_t>(membership.node_ranks.size()) * options_.nproc_per_node;
  membership.first_rank = membership.group_rank * options_.nproc_per_node;
  return membership;
}

std::optional<RoundMembership> ElasticRendezvous::join(int64_t round, const std::optional<RoundMembership>& previous,
                                                       int& ended_with) {
  const bool host = options_.node_rank == 0;
  auto job_ended = [&] {
    auto ended = store_->try_get(kJobEnded);
    if (ended) ended_with = std::stoi(*ended);
    return ended.has_value();
  };
  for (bool admitted_before = previous.has_value();; ++round) {
    // The host joins each round first, so that it is always a member (arrival 0), whatever the
    // order the machines come in: the others wait for it.
    const auto waiting_since = Clock::now();
    while (!host && !store_->try_get(key(round, "host_joined"))) {
      if (job_ended()) return std::nullopt;
      TORCH_CHECK(!admitted_before || Clock::now() - waiting_since < options_.join_timeout, "fsdp launch: round ",
                  round, ": the launcher of --node-rank 0 did not open it within the join timeout (",
                  seconds(options_.join_timeout), " s) after round ", round - 1,
                  " failed. It opens the next round "
                  "once its own processes stopped: check that machine (processes that ignore SIGTERM are killed after "
                  "--termination-grace), or raise --rdzv-conf join_timeout.");
      std::this_thread::sleep_for(kPoll);
    }
    const int64_t index = store_->add(key(round, "joined"), 1) - 1;
    TORCH_INTERNAL_ASSERT(!host || index == 0, "the host joined round ", round, " as arrival ", index);
    store_->set(key(round, "member_" + std::to_string(index)), encode(self_));
    if (host) {
      store_->set(key(round, "host_joined"), "1");
      close_round(round, previous);
    } else {
      while (!store_->try_get(key(round, "closed"))) {
        if (job_ended()) return std::nullopt;
        std::this_thread::sleep_for(kPoll);
      }
    }
    const auto assignment = store_->try_get(key(round, "assignment"));
    TORCH_INTERNAL_ASSERT(assignment.has_value(), "round ", round, " closed without an assignment");
    if (!host) store_->add(key(round, "read"), 1);
    if (auto membership = membership_of(round, *assignment)) return membership;  // throws the round's error
    // The round closed before this machine arrived (or without its record): it waits for the next.
    admitted_before = false;
  }
}

std::optional<RoundFailure> ElasticRendezvous::failure(int64_t round) {
  auto value = store_->try_get(key(round, "failed"));
  if (!value) return std::nullopt;
  RoundFailure failure;
  std::istringstream text(*value);
  int interrupted = 0;
  text >> failure.exit_code >> interrupted;
  failure.interrupted = interrupted != 0;
  std::getline(text >> std::ws, failure.message);
  return failure;
}

RoundFailure ElasticRendezvous::report_failure(int64_t round, const RoundFailure& failure) {
  std::ostringstream text;
  text << failure.exit_code << ' ' << (failure.interrupted ? 1 : 0) << ' ' << failure.message;
  store_->set_if_absent(key(round, "failed"), text.str());
  return *this->failure(round);
}

bool ElasticRendezvous::finish_round(const RoundMembership& membership) {
  store_->add(key(membership.round, "succeeded"), 1);
  const auto deadline = Clock::now() + options_.join_timeout;
  while (true) {
    if (failure(membership.round)) return false;
    if (store_->add(key(membership.round, "succeeded"), 0) >= static_cast<int64_t>(membership.node_ranks.size())) {
      return true;
    }
    if (Clock::now() >= deadline) {
      if (options_.report_restart) {
        options_.report_restart("round " + std::to_string(membership.round) +
                                ": this machine's processes all exited "
                                "0, but not every other machine's had within the join timeout (" +
                                seconds_text(options_.join_timeout) +
                                " s) and none reported a failure; "
                                "leaving with exit code 0 (as torchrun's exit barrier). Check the launchers of node "
                                "ranks " +
                                list(membership.node_ranks) + ".");
      }
      return true;
    }
    std::this_thread::sleep_for(kPoll);
  }
}

void ElasticRendezvous::leave(const RoundMembership& membership, int exit_code) {
  const auto left = key(membership.round, "left");
  if (options_.node_rank != 0) {
    store_->add(left, 1);
    return;
  }
  // A machine lost in this round never says so: the wait is bounded by the time the others need to
  // stop their processes.
  const auto deadline = Clock::now() + options_.termination_grace + std::chrono::seconds(5);
  while (store_->add(left, 0) < static_cast<int64_t>(membership.node_ranks.size()) - 1 && Clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  store_->set(kJobEnded, std::to_string(exit_code));
  // A machine waiting for a later round looks every 100 ms: it should see the end, not the store go.
  std::this_thread::sleep_for(3 * kPoll);
}

RoundWatch::RoundWatch(ElasticRendezvous& rendezvous, int64_t round) : rendezvous_(rendezvous), round_(round) {
  thread_ = std::thread([this] { run(); });
}

RoundWatch::~RoundWatch() { stop(); }

void RoundWatch::report(const RoundFailure& failure) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (local_) return;
    local_ = failure;
  }
  wake_.notify_all();
}

std::optional<std::string> RoundWatch::stop_reason() {
  std::lock_guard<std::mutex> lock(mutex_);
  if (error_) return *error_;
  if (seen_ && !local_) return seen_->message;
  return std::nullopt;
}

void RoundWatch::stop() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    done_ = true;
  }
  wake_.notify_all();
  if (thread_.joinable()) thread_.join();
}

void RoundWatch::finish() {
  stop();
  std::lock_guard<std::mutex> lock(mutex_);
  TORCH_CHECK(!error_, *error_);
}

void RoundWatch::run() {
  std::unique_lock<std::mutex> lock(mutex_);
  while (true) {
    wake_.wait_for(lock, kWatchInterval, [&] { return done_ || (local_ && !written_); });
    const bool write = local_.has_value() && !written_;
    if (done_ && !write) return;
    const auto pending = local_;
    lock.unlock();
    std::optional<RoundFailure> seen;
    std::optional<std::string> error;
    try {
      seen = write ? rendezvous_.report_failure(round_, *pending) : rendezvous_.failure(round_);
    } catch (const c10::Error& failure) {
      error = failure.what_without_backtrace();
    }
    lock.lock();
    written_ = written_ || write;
    if (seen) seen_ = seen;
    if (error) {
      error_ = error;
      return;
    }
  }
}

}  // namespace fsdp::detail
