#include "checkpoint/agreement.h"

#include <c10/util/Exception.h>

#include "dist/control_channel.h"

namespace fsdp::detail {

void agree_on_operation(const DistributedContext& context, const std::string& operation) {
  std::vector<std::string> operations;
  try {
    operations = all_gather_strings(context, operation);
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
  const auto errors = all_gather_strings(context, local_error);
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
