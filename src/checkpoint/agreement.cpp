#include "checkpoint/agreement.h"

#include <ATen/ATen.h>

#include <cstring>

#include <fsdp/collectives.h>

namespace fsdp::detail {

std::vector<std::string> all_gather_strings(const ProcessGroup& group, const std::string& text) {
  const int64_t size = group.size();
  auto length = at::full({1}, static_cast<int64_t>(text.size()), at::kLong);
  auto lengths = at::empty({size}, at::kLong);
  all_gather(group, lengths, length);
  const int64_t longest = std::max<int64_t>(lengths.max().item<int64_t>(), 1);
  auto mine = at::zeros({longest}, at::kByte);
  if (!text.empty()) std::memcpy(mine.data_ptr(), text.data(), text.size());
  auto everyone = at::empty({size * longest}, at::kByte);
  all_gather(group, everyone, mine);
  std::vector<std::string> result;
  for (int64_t rank = 0; rank < size; ++rank) {
    const auto* bytes = static_cast<const char*>(everyone.data_ptr()) + rank * longest;
    result.emplace_back(bytes, static_cast<size_t>(lengths[rank].item<int64_t>()));
  }
  return result;
}

std::string broadcast_string(const ProcessGroup& group, const std::string& text, int64_t root) {
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

void agree_on_operation(const DistributedContext& context, const std::string& operation) {
  std::vector<std::string> operations;
  try {
    operations = all_gather_strings(context.world(), operation);
  } catch (const c10::Error& error) {
    TORCH_CHECK(false, operation, ": not every rank joined (", error.what_without_backtrace(),
                "). Every rank must call it, with the same directory; calling it only on the main process blocks "
                "the others");
  }
  for (size_t rank = 0; rank < operations.size(); ++rank) {
    TORCH_CHECK(operations[rank] == operation, "rank ", context.rank(), " called ", operation, " but rank ", rank,
                " called ", operations[rank], "; every rank must make the same checkpoint call");
  }
}

void raise_if_any_rank_failed(const DistributedContext& context, const std::string& local_error) {
  const auto errors = all_gather_strings(context.world(), local_error);
  for (size_t rank = 0; rank < errors.size(); ++rank) {
    if (errors[rank].empty()) continue;
    TORCH_CHECK(static_cast<int64_t>(rank) != context.rank(), errors[rank]);
    TORCH_CHECK(false, "rank ", rank, " failed: ", errors[rank]);
  }
}

std::string message_of(const std::exception& error) {
  const auto* c10_error = dynamic_cast<const c10::Error*>(&error);
  return c10_error ? c10_error->what_without_backtrace() : error.what();
}

void run_on_every_rank(const DistributedContext& context, const std::function<void()>& step) {
  std::string error;
  try {
    step();
  } catch (const std::exception& failure) {
    error = message_of(failure);
  }
  raise_if_any_rank_failed(context, error);
}

}  // namespace fsdp::detail
