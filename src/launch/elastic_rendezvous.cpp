// See elastic_rendezvous.h.
#include "launch/elastic_rendezvous.h"

#include <c10/util/Exception.h>

#include <unistd.h>

#include <algorithm>
#include <sstream>
#include <thread>

namespace fsdp::detail {

namespace {

using Clock = std::chrono::steady_clock;
constexpr auto kPoll = std::chrono::milliseconds(100);

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

// One machine's join record: what it is and the settings every launcher of the job must share.
struct Member {
  int64_t node_rank = 0, nproc_per_node = 0, min_nodes = 0, max_nodes = 0, max_restarts = 0;
  std::string hostname;
};

std::string encode(const Member& member) {
  std::ostringstream text;
  text << member.node_rank << ' ' << member.nproc_per_node << ' ' << member.min_nodes << ' ' << member.max_nodes << ' '
       << member.max_restarts << ' ' << member.hostname;
  return text.str();
}

Member decode(const std::string& record) {
  Member member;
  std::istringstream text(record);
  text >> member.node_rank >> member.nproc_per_node >> member.min_nodes >> member.max_nodes >> member.max_restarts;
  std::getline(text >> std::ws, member.hostname);
  TORCH_INTERNAL_ASSERT(!text.bad(), "a launcher's join record '", record, "' does not parse");
  return member;
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
//      rank, processes, MIN:MAX and --max-restarts, which every launcher must share, and hostname).
//      The host joins first (the others wait for it), so it is a member of every round.
//   2. The host closes the round once MAX machines joined, or at least MIN and the last call
//      (last_call_timeout, counted from when MIN were there) passed; with fewer than MIN at the join
//      timeout it writes the error every launcher then raises. It orders the members by --node-rank
//      (itself first), checks their records agree, and writes one assignment; a machine whose
//      arrival index is past the closed count waits for the next round (it joins at the next restart;
//      running rounds are not stopped to admit it, unlike torchrun's agents).
//   3. Each launcher starts its processes with the ranks of its place, then watches the round's
//      failure key every 250 ms while they run. The first launcher whose process fails writes it
//      (first writer wins); every other stops its processes on seeing it. A machine that is lost
//      whole writes nothing: the others' processes fail in their next collective, and their
//      launchers write it.
//   4. With a restart left, every launcher joins the next round; the lost machine's absence is then
//      the last call's to wait out, and the job goes on with fewer ranks if at least MIN remain.
//      Programs resume from their latest complete checkpoint (Note [restarting a failed job]) on the
//      new world size; train_llama keeps --global-batch-size, accumulating more per rank.
// Cost: a join is two requests per launcher and the host reads one record per member, so a round
// costs O(machines) requests at the host; watching is one request per launcher every 250 ms, about
// 4,000 requests a second at the host with 1,000 machines, within what a TCPStore serves. The limit
// torchrun's static and c10d rendezvous share: the store lives in one launcher, so losing the
// machine of --node-rank 0 ends the job (every other launcher stops its processes and says so);
// restart it by hand from the latest checkpoint.
ElasticRendezvous::ElasticRendezvous(const LaunchOptions& options) : options_(options), hostname_(this_hostname()) {
  // A fixed size (--nnodes N) is MIN = MAX = N: every round waits for all N machines.
  options_.min_nnodes = min_nodes(options);
  store_ = std::make_unique<AgentStore>(options.master_addr, options.master_port, options.node_rank == 0,
                                        options.join_timeout);
}

std::string ElasticRendezvous::key(int64_t round, const std::string& name) const {
  return "/fsdp_launch/round_" + std::to_string(round) + "/" + name;
}

void ElasticRendezvous::close_round(int64_t round, int64_t joined) {
  std::vector<Member> members;
  for (int64_t index = 0; index < joined; ++index) {
    // A launcher writes its record right after its add: wait for it briefly.
    std::optional<std::string> record;
    const auto deadline = Clock::now() + options_.join_timeout;
    while (!(record = store_->try_get(key(round, "member_" + std::to_string(index)))) && Clock::now() < deadline) {
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    TORCH_CHECK(record.has_value(), "fsdp launch: round ", round, ": the launcher that joined ", index + 1,
                "th never wrote its record; was it stopped while joining?");
    members.push_back(decode(*record));
  }
  std::sort(members.begin(), members.end(), [](const Member& a, const Member& b) { return a.node_rank < b.node_rank; });
  std::string error;
  const Member self{options_.node_rank, options_.nproc_per_node, options_.min_nnodes, options_.nnodes,
                    options_.max_restarts, hostname_};
  for (size_t index = 0; index < members.size() && error.empty(); ++index) {
    const auto& member = members[index];
    if (index > 0 && member.node_rank == members[index - 1].node_rank) {
      error = "two launchers have --node-rank " + std::to_string(member.node_rank) + " (on " +
              members[index - 1].hostname + " and " + member.hostname + "); give each machine its own --node-rank";
    } else if (member.nproc_per_node != self.nproc_per_node || member.min_nodes != self.min_nodes ||
               member.max_nodes != self.max_nodes || member.max_restarts != self.max_restarts) {
      error = "the launcher of --node-rank " + std::to_string(member.node_rank) + " (on " + member.hostname +
              ") has --nproc-per-node " + std::to_string(member.nproc_per_node) + " --nnodes " +
              std::to_string(member.min_nodes) + ":" + std::to_string(member.max_nodes) + " --max-restarts " +
              std::to_string(member.max_restarts) + " but the host's are " + std::to_string(self.nproc_per_node) +
              " " + std::to_string(self.min_nodes) + ":" + std::to_string(self.max_nodes) + " " +
              std::to_string(self.max_restarts) + "; every machine's launcher needs the same ones";
    }
  }
  std::ostringstream assignment;
  if (!error.empty()) {
    assignment << "error " << error;
  } else {
    assignment << "ok";
    for (const auto& member : members) assignment << ' ' << member.node_rank;
  }
  store_->set(key(round, "assignment"), assignment.str());
}

RoundMembership ElasticRendezvous::read_membership(int64_t round, const std::string& assignment) {
  TORCH_CHECK(assignment.rfind("error ", 0) != 0, "fsdp launch: round ", round, ": ", assignment.substr(6), ".");
  std::istringstream text(assignment);
  std::string ok;
  text >> ok;
  RoundMembership membership;
  membership.round = round;
  for (int64_t node_rank; text >> node_rank;) membership.node_ranks.push_back(node_rank);
  const auto place = std::find(membership.node_ranks.begin(), membership.node_ranks.end(), options_.node_rank);
  TORCH_INTERNAL_ASSERT(place != membership.node_ranks.end(), "round ", round, "'s assignment '", assignment,
                        "' lacks node rank ", options_.node_rank, ", which joined it");
  membership.group_rank = place - membership.node_ranks.begin();
  membership.world_size = static_cast<int64_t>(membership.node_ranks.size()) * options_.nproc_per_node;
  membership.first_rank = membership.group_rank * options_.nproc_per_node;
  return membership;
}

std::optional<RoundMembership> ElasticRendezvous::join(int64_t round) {
  const bool host = options_.node_rank == 0;
  const Member self{options_.node_rank, options_.nproc_per_node, options_.min_nnodes, options_.nnodes,
                    options_.max_restarts, hostname_};
  for (;; ++round) {
    // The host joins each round first, so that it is always a member (arrival 0), whatever the
    // order the machines come in: the others wait for it.
    while (!host && !store_->try_get(key(round, "host_joined"))) {
      if (store_->try_get("/fsdp_launch/job_ended")) return std::nullopt;
      std::this_thread::sleep_for(kPoll);
    }
    const int64_t index = store_->add(key(round, "joined"), 1) - 1;
    TORCH_INTERNAL_ASSERT(!host || index == 0, "the host joined round ", round, " as arrival ", index);
    store_->set(key(round, "member_" + std::to_string(index)), encode(self));
    if (host) store_->set(key(round, "host_joined"), "1");
    const auto joined_at = Clock::now();
    std::optional<Clock::time_point> last_call;
    std::optional<std::string> closed;
    while (!(closed = store_->try_get(key(round, "closed")))) {
      if (!host && store_->try_get("/fsdp_launch/job_ended")) return std::nullopt;
      if (host) {
        const int64_t joined = store_->add(key(round, "joined"), 0);
        if (joined >= options_.min_nnodes && !last_call) last_call = Clock::now() + options_.last_call_timeout;
        const bool full = joined >= options_.nnodes;
        if (full || (last_call && Clock::now() >= *last_call)) {
          // Members are the first `count` arrivals; one arriving from here on waits for the next round.
          const int64_t count = std::min(store_->add(key(round, "joined"), 0), options_.nnodes);
          close_round(round, count);
          store_->set(key(round, "closed"), std::to_string(count));
          continue;
        }
        if (Clock::now() - joined_at > options_.join_timeout) {
          std::string present;
          for (int64_t other = 0; other < joined; ++other) {
            if (auto record = store_->try_get(key(round, "member_" + std::to_string(other)))) {
              const auto member = decode(*record);
              present += (present.empty() ? "" : ", ") + std::to_string(member.node_rank) + " (" + member.hostname + ")";
            }
          }
          std::ostringstream error;
          error << "only " << joined << " of at least " << options_.min_nnodes << " machines (--nnodes "
                << options_.min_nnodes << ":" << options_.nnodes << ") joined within the join timeout of "
                << options_.join_timeout.count() / 1000.0 << " s; present: node rank " << present
                << ". Start the missing machines' launchers with the same --master-addr and --master-port, or "
                   "lower MIN";
          store_->set(key(round, "assignment"), "error " + error.str());
          store_->set(key(round, "closed"), "0");
          continue;
        }
      }
      std::this_thread::sleep_for(kPoll);
    }
    const auto assignment = store_->try_get(key(round, "assignment"));
    TORCH_INTERNAL_ASSERT(assignment.has_value(), "round ", round, " closed without an assignment");
    if (assignment->rfind("error ", 0) == 0) read_membership(round, *assignment);  // throws its error
    if (index < std::stoll(*closed)) return read_membership(round, *assignment);
    // Closed before this machine arrived: it waits in the next round.
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
    TORCH_CHECK(Clock::now() < deadline, "fsdp launch: round ", membership.round, ": this machine's processes all "
                "exited 0, but not every other machine's did within the join timeout (",
                options_.join_timeout.count() / 1000.0, " s), and none reported a failure; check the other machines' "
                "launchers (node ranks ", list(membership.node_ranks), ").");
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
  store_->set("/fsdp_launch/job_ended", std::to_string(exit_code));
  // A machine waiting for a later round looks every 100 ms: it should see the end, not the store go.
  std::this_thread::sleep_for(3 * kPoll);
}

}  // namespace fsdp::detail
