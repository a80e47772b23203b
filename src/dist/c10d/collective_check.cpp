// Note [Collective check] (docs/design.md): every collective's messages travel on a slot keyed by
// what it is; a collective that stalls is diagnosed through the group's store; an NCCL collective's
// header travels on Gloo beside it.
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <sstream>

#include "dist/activity.h"
#include "dist/c10d/internal.h"

namespace fsdp::detail {
namespace {

const char* kind_name(int64_t kind) {
  switch (static_cast<CollectiveKind>(kind)) {
    case CollectiveKind::kAllGather:
      return "all_gather";
    case CollectiveKind::kReduceScatter:
      return "reduce_scatter";
    case CollectiveKind::kAllReduce:
      return "all_reduce";
    case CollectiveKind::kBroadcast:
      return "broadcast";
    case CollectiveKind::kBarrier:
      return "barrier";
  }
  return "an unknown operation";
}

constexpr int64_t kHeaderBytes = 256;
constexpr int64_t kHeaderWords = 6;                      // magic, kind, numel, dtype, root or op, reserved
constexpr int64_t kHeaderMagic = 0x66736470'6672616dLL;  // "fsdpfram"
constexpr int64_t kHeaderTextBytes = kHeaderBytes - kHeaderWords * 8;

// Slots (c10d's point-to-point tags, 31 bits). Data: 16 bits of the header's digest, then the low
// 14 bits of the sequence number (two collectives of a group in flight at once are never 16384
// apart). An NCCL collective's header: bit 30 set and the sequence number below it.
constexpr uint32_t kHeaderSlot = 1U << 30;
constexpr uint32_t kSequenceBits = 14;
int header_tag(uint32_t sequence) { return static_cast<int>(kHeaderSlot | (sequence & (kHeaderSlot - 1))); }
int data_tag(uint32_t sequence, uint64_t digest) {
  return static_cast<int>(((digest & 0xffffU) << kSequenceBits) | (sequence & ((1U << kSequenceBits) - 1)));
}

struct Header {
  int64_t kind = 0;
  int64_t numel = 0;
  int64_t dtype = 0;
  int64_t detail = 0;    // the root of a broadcast, the reduce op of a reduction
  std::string activity;  // what the collective is for (src/dist/activity.h), cut to fit

  bool same_operation(const Header& other) const {
    return kind == other.kind && numel == other.numel && dtype == other.dtype && detail == other.detail &&
           activity == other.activity;
  }
  std::string text() const {
    std::ostringstream out;
    out << kind_name(kind);
    if (static_cast<CollectiveKind>(kind) != CollectiveKind::kBarrier) {
      out << " of " << numel << " x " << static_cast<at::ScalarType>(dtype);
    }
    if (kind == static_cast<int64_t>(CollectiveKind::kBroadcast)) out << " from root " << detail;
    if (!activity.empty()) out << " (for " << activity << ")";
    return out.str();
  }
};

std::vector<uint8_t> encode(const Header& header) {
  std::vector<uint8_t> bytes(kHeaderBytes, 0);
  const int64_t words[kHeaderWords] = {kHeaderMagic, header.kind, header.numel, header.dtype, header.detail, 0};
  std::memcpy(bytes.data(), words, sizeof(words));
  std::memcpy(bytes.data() + sizeof(words), header.activity.data(),
              std::min<size_t>(header.activity.size(), static_cast<size_t>(kHeaderTextBytes)));
  return bytes;
}

// The bytes come from another process: anything that is not a header is reported as such.
std::optional<Header> decode(const uint8_t* bytes) {
  int64_t words[kHeaderWords];
  std::memcpy(words, bytes, sizeof(words));
  if (words[0] != kHeaderMagic) return std::nullopt;
  Header header{words[1], words[2], words[3], words[4], {}};
  const auto* text = reinterpret_cast<const char*>(bytes + sizeof(words));
  header.activity.assign(text, strnlen(text, static_cast<size_t>(kHeaderTextBytes)));
  return header;
}

// FNV-1a over the encoded header: equal headers give equal data slots on every rank.
uint64_t digest(const std::vector<uint8_t>& bytes) {
  uint64_t hash = 1469598103934665603ULL;
  for (const auto byte : bytes) hash = (hash ^ byte) * 1099511628211ULL;
  return hash ^ (hash >> 32);
}

std::string header_text(const std::vector<uint8_t>& header) {
  const auto decoded = decode(header.data());
  return decoded ? decoded->text() : std::string("something that is not an fsdp.cpp collective");
}

std::string differences_message(int64_t global_rank, const std::string& group_name, const std::string& own_text,
                                const std::string& differences) {
  return "[rank " + std::to_string(global_rank) + "] the ranks of group '" + group_name +
         "' issued different collectives: this rank issued " + own_text + differences +
         ". Every rank must run the same units, in the same order, with the same shapes: a branch that only some "
         "ranks take, or ranks built from different models or settings, leads here";
}

bool timed_out(const std::exception_ptr& failure) {
  try {
    std::rethrow_exception(failure);
  } catch (const std::exception& caught) {
    return std::string(caught.what()).find("imed out") != std::string::npos;
  } catch (...) {
  }
  return false;
}

// --- the stall reports -----------------------------------------------------------------------------
//
// A rank whose wait stalls writes a report under "check/<group rank>" in the group's store (one key
// per rank, overwritten by the next stall): the sequence number and header of the collective it waits
// in, its state, and what it found. Reports are read from another process: decoded field by field.

constexpr uint64_t kReportMagic = 0x66736470'73746c6cULL;  // "fsdpstll"
constexpr size_t kLargestReportText = 2048;
constexpr size_t kLargestReportedDifferences = 16;

enum class ReportState : uint64_t {
  kWaiting = 1,   // waits in the collective
  kDiverged = 2,  // found peers that issued something else: `differences`
  kFailed = 3,    // its wait failed on its own (a closed connection, a timeout): `text`
};

struct Report {
  uint32_t sequence = 0;
  ReportState state = ReportState::kWaiting;
  std::vector<uint8_t> header;
  std::vector<std::pair<int64_t, std::vector<uint8_t>>> differences;  // group rank, its header
  std::string text;
};

void put_u64(std::vector<uint8_t>& out, uint64_t value) {
  const auto* bytes = reinterpret_cast<const uint8_t*>(&value);
  out.insert(out.end(), bytes, bytes + 8);
}

std::vector<uint8_t> encode_report(const Report& report) {
  std::vector<uint8_t> out;
  put_u64(out, kReportMagic);
  put_u64(out, report.sequence);
  put_u64(out, static_cast<uint64_t>(report.state));
  out.insert(out.end(), report.header.begin(), report.header.end());
  put_u64(out, report.differences.size());
  for (const auto& [rank, header] : report.differences) {
    put_u64(out, static_cast<uint64_t>(rank));
    out.insert(out.end(), header.begin(), header.end());
  }
  const auto text = report.text.substr(0, kLargestReportText);
  put_u64(out, text.size());
  out.insert(out.end(), text.begin(), text.end());
  return out;
}

class ReportReader {
 public:
  explicit ReportReader(const std::vector<uint8_t>& bytes) : bytes_(bytes) {}
  bool u64(uint64_t& value) {
    if (bytes_.size() - position_ < 8) return false;
    std::memcpy(&value, bytes_.data() + position_, 8);
    position_ += 8;
    return true;
  }
  bool take(size_t count, std::vector<uint8_t>& into) {
    if (bytes_.size() - position_ < count) return false;
    into.assign(bytes_.begin() + static_cast<std::ptrdiff_t>(position_),
                bytes_.begin() + static_cast<std::ptrdiff_t>(position_ + count));
    position_ += count;
    return true;
  }

 private:
  const std::vector<uint8_t>& bytes_;
  size_t position_ = 0;
};

std::optional<Report> decode_report(const std::vector<uint8_t>& bytes) {
  ReportReader reader(bytes);
  Report report;
  uint64_t magic = 0, sequence = 0, state = 0, count = 0;
  if (!reader.u64(magic) || magic != kReportMagic || !reader.u64(sequence) || !reader.u64(state)) return std::nullopt;
  if (state < 1 || state > 3 || !reader.take(kHeaderBytes, report.header) || !reader.u64(count)) return std::nullopt;
  if (count > kLargestReportedDifferences) return std::nullopt;
  report.sequence = static_cast<uint32_t>(sequence);
  report.state = static_cast<ReportState>(state);
  for (uint64_t index = 0; index < count; ++index) {
    uint64_t rank = 0;
    std::vector<uint8_t> header;
    if (!reader.u64(rank) || !reader.take(kHeaderBytes, header)) return std::nullopt;
    report.differences.emplace_back(static_cast<int64_t>(rank), std::move(header));
  }
  uint64_t length = 0;
  std::vector<uint8_t> text;
  if (!reader.u64(length) || length > kLargestReportText || !reader.take(length, text)) return std::nullopt;
  report.text.assign(text.begin(), text.end());
  return report;
}

std::string report_key(int64_t group_rank) { return "check/" + std::to_string(group_rank); }

// A peer's report, or nullopt when it never wrote one (or wrote something that is not one).
std::optional<Report> read_report(c10d::Store& store, int64_t group_rank) {
  const auto key = report_key(group_rank);
  if (!store.check({key})) return std::nullopt;
  return decode_report(store.get(key));
}

// How long a checked collective waits before its wait is diagnosed, and the longest pause between
// two reads of a peer's report.
std::chrono::milliseconds grace_of(std::chrono::milliseconds timeout) {
  return std::clamp<std::chrono::milliseconds>(timeout / 8, std::chrono::milliseconds(100),
                                               std::chrono::milliseconds(2000));
}
constexpr std::chrono::milliseconds kFirstPoll{50};
constexpr std::chrono::milliseconds kLongestPoll{1000};
// How often the stall watch looks at the waits registered.
constexpr std::chrono::milliseconds kLook{50};

}  // namespace

// --- issue ------------------------------------------------------------------------------------------

bool debug_enabled() {
  static const bool enabled = [] {
    const char* value = std::getenv("FSDP_DEBUG");
    return value != nullptr && std::string(value) == "1";
  }();
  return enabled;
}

std::string with_activity(std::string description) {
  if (!current_activity().empty()) description += " (for " + current_activity() + ")";
  return description;
}

IssuedCollective issue_collective(ProcessGroupState& group, CollectiveKind kind, const at::Tensor& tensor,
                                  int64_t detail, const std::string& description) {
  Header own{static_cast<int64_t>(kind), tensor.defined() ? tensor.numel() : 0,
             tensor.defined() ? static_cast<int64_t>(tensor.scalar_type()) : 0, detail, current_activity()};
  auto encoded = std::make_shared<std::vector<uint8_t>>(encode(own));
  IssuedCollective issued;
  issued.kind = kind;
  issued.sequence = group.next_sequence.fetch_add(1);
  issued.data_tag = data_tag(issued.sequence, digest(*encoded));
  issued.header = std::move(encoded);
  issued.description = with_activity(description);
  issued.checked = group.members->check_collectives;
  return issued;
}

// --- an NCCL collective's headers (Note [The GPU path]) ---------------------------------------------

std::shared_ptr<CollectiveCheck> post_headers(ProcessGroupState& group, const IssuedCollective& issued) {
  const auto& members = *group.members;
  auto check = std::make_shared<CollectiveCheck>();
  check->headers = at::empty({members.size, kHeaderBytes}, at::TensorOptions().dtype(at::kByte));
  std::memcpy(check->headers[members.rank].data_ptr<uint8_t>(), issued.header->data(), kHeaderBytes);
  const auto own_row = check->headers[members.rank];
  std::vector<int64_t> peers;
  for (int64_t offset = 1; offset < members.size; ++offset) peers.push_back((members.rank + offset) % members.size);
  // The headers are the check's own bytes, never a collective's: counted as `check`.
  auto exchange = exchange_with(
      transport_of(group), header_tag(issued.sequence), Traffic::kCheck, peers, [&](int64_t) { return own_row; },
      [&](int64_t peer) { return check->headers[peer]; });
  const auto receive_count = static_cast<std::ptrdiff_t>(peers.size());
  check->receives.assign(exchange.works.begin(), exchange.works.begin() + receive_count);
  check->sends.assign(exchange.works.begin() + receive_count, exchange.works.end());
  for (const auto peer : exchange.peers) check->peers.push_back(members.global_ranks[static_cast<size_t>(peer)]);
  check->rank = members.rank;
  check->global_ranks = members.global_ranks;
  check->group_name = members.name;
  check->description = issued.description;
  return check;
}

void verify_check(CollectiveCheck& check, std::chrono::milliseconds timeout) {
  if (check.verified) return;
  std::vector<c10::intrusive_ptr<c10d::Work>> works = check.receives;
  works.insert(works.end(), check.sends.begin(), check.sends.end());
  try {
    wait_works(works, check.peers, {}, check.description + ", exchanging what each rank issues", timeout);
  } catch (const c10::Error& error) {
    // A header may still arrive into `headers` after this: the works and their buffers stay alive.
    abandon(works);
    std::string missing;
    for (size_t index = 0; index < check.receives.size(); ++index) {
      auto& receive = check.receives[index];
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
      if (absent) missing += (missing.empty() ? "" : ", ") + std::to_string(check.peers[index]);
    }
    if (missing.empty()) throw;
    TORCH_CHECK(false, error.what_without_backtrace(), " Ranks that never issued it: ", missing, ".");
  }
  const auto own = decode(check.headers[check.rank].data_ptr<uint8_t>());
  TORCH_INTERNAL_ASSERT(own.has_value(), "the collective check lost its own header");
  std::string differences;
  const auto size = static_cast<int64_t>(check.global_ranks.size());
  for (int64_t peer = 0; peer < size; ++peer) {
    if (peer == check.rank) continue;
    const auto header = decode(check.headers[peer].data_ptr<uint8_t>());
    if (header && header->same_operation(*own)) continue;
    differences += "; rank " + std::to_string(check.global_ranks[static_cast<size_t>(peer)]) + " issued " +
                   (header ? header->text() : std::string("something that is not an fsdp.cpp collective"));
  }
  TORCH_CHECK(differences.empty(), differences_message(check.global_ranks[static_cast<size_t>(check.rank)],
                                                       check.group_name, own->text(), differences));
  check.verified = true;
}

// --- the stall watch ------------------------------------------------------------------------------

struct StallRegistration::Entry {
  // Constant after construction.
  Transport transport;
  IssuedCollective issued;
  std::vector<int64_t> peers;  // group ranks the wait exchanges with

  // Guarded by mutex.
  mutable std::mutex mutex;
  c10::intrusive_ptr<c10d::Work> current;
  int64_t current_peer = -1;
  std::optional<std::string> verdict;

  // The watch's thread only (`due` is set before the entry is added).
  std::chrono::steady_clock::time_point due;
  bool published = false;
  std::chrono::milliseconds interval = kFirstPoll;
  // When a difference was first seen while some peers had not reported yet.
  std::optional<std::chrono::steady_clock::time_point> first_difference;
};

namespace {

// One thread per process looks at the registered waits 20 times a second (from the first checked
// wait on), and diagnoses, with the store, only those past their grace period.
class StallWatch {
 public:
  static StallWatch& instance() {
    static auto* watch = new StallWatch();  // never destroyed: its thread outlives static destruction
    return *watch;
  }

  // No wake-up per registration: most waits end long before their grace period, and the thread looks
  // at the list a few times a second whatever it holds.
  void add(const std::shared_ptr<StallRegistration::Entry>& entry) {
    std::lock_guard<std::mutex> lock(mutex_);
    entries_.push_back(entry);
    if (!started_) {
      started_ = true;
      std::thread([this] { run(); }).detach();
    }
  }

  void remove(const std::shared_ptr<StallRegistration::Entry>& entry) {
    std::lock_guard<std::mutex> lock(mutex_);
    entries_.erase(std::remove(entries_.begin(), entries_.end(), entry), entries_.end());
  }

 private:
  void run() {
    for (;;) {
      std::this_thread::sleep_for(kLook);
      std::vector<std::shared_ptr<StallRegistration::Entry>> due;
      {
        std::lock_guard<std::mutex> lock(mutex_);
        const auto now = std::chrono::steady_clock::now();
        for (const auto& entry : entries_) {
          if (entry->due <= now) due.push_back(entry);
        }
      }
      for (const auto& entry : due) {
        try {
          diagnose(*entry);
        } catch (const std::exception&) {
          // The store is gone (its host exited): the wait itself reports the failure.
        }
        entry->due = std::chrono::steady_clock::now() + entry->interval;
        entry->interval = std::min(entry->interval * 2, kLongestPoll);
      }
    }
  }

  static void conclude(StallRegistration::Entry& entry, Report own, std::string verdict) {
    auto& store = *entry.transport.store;
    entry.issued.reported->store(true);
    store.set(report_key(entry.transport.members->rank), encode_report(own));
    std::lock_guard<std::mutex> lock(entry.mutex);
    if (entry.verdict) return;
    entry.verdict = std::move(verdict);
    if (entry.current) entry.current->abort();
  }

  static void diagnose(StallRegistration::Entry& entry) {
    const auto& members = *entry.transport.members;
    auto& store = *entry.transport.store;
    const auto& own_header = *entry.issued.header;
    Report own;
    own.sequence = entry.issued.sequence;
    own.header = own_header;
    if (!entry.published) {
      store.set(report_key(members.rank), encode_report(own));
      entry.published = true;
      if (debug_enabled()) {
        std::fprintf(stderr, "[rank %lld] fsdp: %s waits past its grace period; reported to the store\n",
                     static_cast<long long>(members.global_rank), entry.issued.description.c_str());
      }
    }
    int64_t peer = -1;
    {
      std::lock_guard<std::mutex> lock(entry.mutex);
      if (entry.verdict) return;
      peer = entry.current_peer;
    }
    if (peer < 0) return;
    const auto report = read_report(store, peer);
    if (!report || report->sequence != entry.issued.sequence) return;  // not in this collective (yet)
    const auto global = [&](int64_t group_rank) {
      return std::to_string(members.global_ranks[static_cast<size_t>(group_rank)]);
    };
    if (report->state == ReportState::kFailed) {
      own.state = ReportState::kFailed;
      own.text = "rank " + global(peer) + " failed in it: " + report->text;
      conclude(entry, own,
               entry.issued.description + " failed: rank " + global(peer) +
                   ", which this rank waits for, failed in it: " + report->text);
      return;
    }
    // Peers that issued something else: this one, or the ones it found, and the others this wait
    // exchanges with (a few; each is one read of the store, on this failure path only).
    std::vector<std::pair<int64_t, std::vector<uint8_t>>> differences;
    auto note = [&](int64_t rank, const std::vector<uint8_t>& header) {
      if (header == own_header || rank == members.rank) return;
      for (const auto& known : differences) {
        if (known.first == rank) return;
      }
      if (differences.size() < kLargestReportedDifferences) differences.emplace_back(rank, header);
    };
    note(peer, report->header);
    if (report->state == ReportState::kDiverged) {
      for (const auto& [rank, header] : report->differences) note(rank, header);
    }
    if (differences.empty()) return;  // it waits in the same collective, for someone else
    // The others to ask: the peers of this wait, then the group's other ranks in order after this one
    // (a ring or a second level never exchanges with most of them), at most 16 reads of the store.
    std::vector<int64_t> others;
    auto consider = [&](int64_t other) {
      if (other != peer && other != members.rank && others.size() < kLargestReportedDifferences &&
          std::find(others.begin(), others.end(), other) == others.end()) {
        others.push_back(other);
      }
    };
    for (const auto other : entry.peers) consider(other);
    for (int64_t offset = 1; offset < members.size; ++offset) consider((members.rank + offset) % members.size);
    bool all_reported = true;
    for (const auto other : others) {
      const auto other_report = read_report(store, other);
      if (other_report && other_report->sequence == entry.issued.sequence) {
        note(other, other_report->header);
      } else {
        all_reported = false;
      }
    }
    // Peers that stall at the same moment report at about the same time: give the others a moment,
    // so that the error names every rank that differs, then conclude with what is known.
    const auto now = std::chrono::steady_clock::now();
    if (!all_reported) {
      if (!entry.first_difference) entry.first_difference = now;
      if (now - *entry.first_difference < grace_of(members.timeout) / 2) return;
    }
    std::sort(differences.begin(), differences.end());
    std::string text;
    for (const auto& [rank, header] : differences) text += "; rank " + global(rank) + " issued " + header_text(header);
    own.state = ReportState::kDiverged;
    own.differences = differences;
    conclude(entry, own, differences_message(members.global_rank, members.name, header_text(own_header), text));
  }

  std::mutex mutex_;
  std::vector<std::shared_ptr<StallRegistration::Entry>> entries_;
  bool started_ = false;
};

}  // namespace

StallRegistration::StallRegistration(const Transport& transport, const IssuedCollective& issued,
                                     const std::vector<int64_t>& peers)
    : entry_(std::make_shared<Entry>()) {
  entry_->transport = transport;
  entry_->issued = issued;
  entry_->peers = peers;
  entry_->due = std::chrono::steady_clock::now() + grace_of(transport.members->timeout);
  StallWatch::instance().add(entry_);
}

StallRegistration::~StallRegistration() { StallWatch::instance().remove(entry_); }

void StallRegistration::waiting_on(const c10::intrusive_ptr<c10d::Work>& work, int64_t peer) {
  std::lock_guard<std::mutex> lock(entry_->mutex);
  TORCH_CHECK(!entry_->verdict, *entry_->verdict);
  entry_->current = work;
  entry_->current_peer = peer;
}

std::optional<std::string> StallRegistration::verdict() const {
  std::lock_guard<std::mutex> lock(entry_->mutex);
  return entry_->verdict;
}

void publish_failure(const Transport& transport, const IssuedCollective& issued, const std::string& text) {
  if (!issued.checked || !transport.store || issued.reported->exchange(true)) return;
  try {
    Report own;
    own.sequence = issued.sequence;
    own.header = *issued.header;
    own.state = ReportState::kFailed;
    own.text = text.substr(0, kLargestReportText);
    transport.store->set(report_key(transport.members->rank), encode_report(own));
  } catch (const std::exception&) {
    // No store to tell (its host exited): each peer's own wait fails instead.
  }
}

std::string StallRegistration::report_failure(const std::string& error, int64_t peer, bool timed_out) {
  const auto& members = *entry_->transport.members;
  std::string said;
  try {
    const auto report = read_report(*entry_->transport.store, peer);
    const auto global = std::to_string(members.global_ranks[static_cast<size_t>(peer)]);
    const bool here = report && report->sequence == entry_->issued.sequence;
    if (here && report->state == ReportState::kFailed) {
      // The peer failed in this collective first (and then exited, or timed out): its reason.
      said = " Rank " + global + " had failed in it: " + report->text;
    } else if (timed_out && (!report || static_cast<int32_t>(report->sequence - entry_->issued.sequence) < 0)) {
      // Sequence numbers wrap: "before" is a negative difference modulo 2^32.
      said = " Ranks that never issued it: " + global + ".";
    } else if (timed_out && here && report->state == ReportState::kWaiting) {
      said = " Rank " + global + " issued it too and was waiting for another rank.";
    }
  } catch (const std::exception&) {
    // No store to ask (its host exited): the error says enough.
  }
  // What the peers that wait for this rank will read: the failure with what it learned.
  publish_failure(entry_->transport, entry_->issued, error + "." + said);
  return said;
}

}  // namespace fsdp::detail
