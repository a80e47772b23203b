#include "dist/control_channel.h"

#include <ATen/ATen.h>
#include <fsdp/collectives.h>

#include <cstring>

namespace fsdp::detail {

std::vector<std::string> all_gather_strings(const DistributedContext& context, const std::string& text) {
  const auto& group = context.control();
  const int64_t size = group.size();
  auto length = at::full({1}, static_cast<int64_t>(text.size()), at::kLong);
  auto lengths = at::empty({size}, at::kLong);
  all_gather(group, lengths, length);
  const auto length_of = lengths.accessor<int64_t, 1>();
  int64_t longest = 1;
  for (int64_t rank = 0; rank < size; ++rank) longest = std::max(longest, length_of[rank]);
  auto mine = at::zeros({longest}, at::kByte);
  if (!text.empty()) std::memcpy(mine.data_ptr(), text.data(), text.size());
  auto everyone = at::empty({size * longest}, at::kByte);
  all_gather(group, everyone, mine);
  std::vector<std::string> result;
  for (int64_t rank = 0; rank < size; ++rank) {
    const auto* bytes = static_cast<const char*>(everyone.data_ptr()) + rank * longest;
    result.emplace_back(bytes, static_cast<size_t>(length_of[rank]));
  }
  return result;
}

namespace {

// FNV-1a from `basis`, folded to 62 bits so that its negation fits an int64 too.
int64_t hash62(const std::string& text, uint64_t basis) {
  uint64_t hash = basis;
  for (const char byte : text) hash = (hash ^ static_cast<uint8_t>(byte)) * 1099511628211ULL;
  return static_cast<int64_t>((hash ^ (hash >> 31)) & ((uint64_t{1} << 62) - 1));
}

}  // namespace

bool same_on_every_rank(const DistributedContext& context, const std::string& text) {
  const int64_t first = hash62(text, 1469598103934665603ULL);
  const int64_t second = hash62(text, 0x9e3779b97f4a7c15ULL);
  const auto length = static_cast<int64_t>(text.size());
  auto digest = at::tensor(std::vector<int64_t>{first, -first, second, -second, length, -length}, at::kLong);
  all_reduce(context.control(), digest, ReduceOp::kMax);
  const auto value = digest.accessor<int64_t, 1>();
  return value[0] == -value[1] && value[2] == -value[3] && value[4] == -value[5];
}

std::string broadcast_string(const DistributedContext& context, const std::string& text, int64_t root) {
  const auto& group = context.control();
  const bool is_root = group.rank() == root;
  auto length = at::full({1}, is_root ? static_cast<int64_t>(text.size()) : int64_t{0}, at::kLong);
  broadcast(group, length, root);
  const int64_t size = length.item<int64_t>();
  if (size == 0) return {};
  auto bytes = at::empty({size}, at::kByte);
  if (is_root) std::memcpy(bytes.data_ptr(), text.data(), text.size());
  broadcast(group, bytes, root);
  return std::string(static_cast<const char*>(bytes.data_ptr()), static_cast<size_t>(size));
}

}  // namespace fsdp::detail
