// Note [Collective check] (docs/design.md): every collective's header travels beside its data, and
// its data travels on a slot that carries a digest of the header.
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

// Slots (c10d's point-to-point tags, 31 bits): headers have bit 30 set and the collective's
// sequence number below it; data has bit 30 clear, 14 bits of the header's digest, then the low 16
// bits of the sequence number. Two collectives in flight at once are never 65536 apart.
constexpr uint32_t kHeaderSlot = 1U << 30;
int header_tag(uint32_t sequence) { return static_cast<int>(kHeaderSlot | (sequence & (kHeaderSlot - 1))); }
int data_tag(uint32_t sequence, uint64_t digest) {
  return static_cast<int>(((digest & 0x3fffU) << 16) | (sequence & 0xffffU));
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

void encode(const Header& header, uint8_t* bytes) {
  std::memset(bytes, 0, kHeaderBytes);
  const int64_t words[kHeaderWords] = {kHeaderMagic, header.kind, header.numel, header.dtype, header.detail, 0};
  std::memcpy(bytes, words, sizeof(words));
  std::memcpy(bytes + sizeof(words), header.activity.data(),
              std::min<size_t>(header.activity.size(), static_cast<size_t>(kHeaderTextBytes)));
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
uint64_t digest(const uint8_t* bytes) {
  uint64_t hash = 1469598103934665603ULL;
  for (int64_t index = 0; index < kHeaderBytes; ++index) {
    hash = (hash ^ bytes[index]) * 1099511628211ULL;
  }
  return hash ^ (hash >> 32);
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

}  // namespace

std::string with_activity(std::string description) {
  if (!current_activity().empty()) description += " (for " + current_activity() + ")";
  return description;
}

IssuedCollective issue_collective(ProcessGroupState& group, CollectiveKind kind, const at::Tensor& tensor,
                                  int64_t detail, const std::string& description, bool force_check) {
  Header own{static_cast<int64_t>(kind), tensor.defined() ? tensor.numel() : 0,
             tensor.defined() ? static_cast<int64_t>(tensor.scalar_type()) : 0, detail, current_activity()};
  uint8_t encoded[kHeaderBytes];
  encode(own, encoded);
  const uint32_t sequence = group.next_sequence.fetch_add(1);
  IssuedCollective issued;
  issued.data_tag = data_tag(sequence, digest(encoded));
  if (!group.check_collectives && !force_check) return issued;

  auto check = std::make_shared<CollectiveCheck>();
  check->headers = at::empty({group.size, kHeaderBytes}, at::TensorOptions().dtype(at::kByte));
  std::memcpy(check->headers[group.rank].data_ptr<uint8_t>(), encoded, kHeaderBytes);
  const auto own_row = check->headers[group.rank];
  auto works = exchange_with_peers(
      group, header_tag(sequence), [&](int64_t) { return own_row; },
      [&](int64_t peer) { return check->headers[peer]; });
  const auto receive_count = static_cast<size_t>(group.size - 1);
  check->receives.assign(works.begin(), works.begin() + static_cast<std::ptrdiff_t>(receive_count));
  check->sends.assign(works.begin() + static_cast<std::ptrdiff_t>(receive_count), works.end());
  check->peers = exchange_peers(group);
  check->rank = group.rank;
  check->global_ranks = group.global_ranks;
  check->group_name = group.name;
  check->description = with_activity(description);
  group.bytes_check += (group.size - 1) * kHeaderBytes;
  issued.check = std::move(check);
  return issued;
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
  TORCH_CHECK(differences.empty(), "[rank ", check.global_ranks[static_cast<size_t>(check.rank)],
              "] the ranks of group '", check.group_name, "' issued different collectives: this rank issued ",
              own->text(), differences,
              ". Every rank must run the same units, in the same order, with the same shapes: a branch that "
              "only some ranks take, or ranks built from different models or settings, leads here");
  check.verified = true;
}

}  // namespace fsdp::detail
