#include "dist/control_channel.h"

#include <ATen/ATen.h>

#include <cstring>

#include <fsdp/collectives.h>

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
