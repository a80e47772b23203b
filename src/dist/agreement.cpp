#include "dist/agreement.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <fsdp/collectives.h>

#include <map>
#include <nlohmann/json.hpp>

#include "dist/control_channel.h"

namespace fsdp::detail {

void agree_on_operation(const DistributedContext& context, const std::string& operation) {
  std::vector<std::string> operations;
  try {
    if (same_on_every_rank(context, operation)) return;
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
  // The usual case, no rank failed, is one all-reduce of one number: the longest error.
  auto longest = at::full({1}, static_cast<int64_t>(local_error.size()), at::kLong);
  all_reduce(context.control(), longest, ReduceOp::kMax);
  if (longest.item<int64_t>() == 0) return;
  const auto errors = all_gather_strings(context, local_error);
  for (size_t rank = 0; rank < errors.size(); ++rank) {
    if (errors[rank].empty()) continue;
    TORCH_CHECK(static_cast<int64_t>(rank) != context.rank(), errors[rank]);
    TORCH_CHECK(false, "rank ", rank, " failed: ", errors[rank]);
  }
}

void agree_on_fields(const DistributedContext& context, const std::string& what,
                     const std::vector<std::pair<std::string, std::string>>& fields, const std::string& fix) {
  auto mine = nlohmann::json::array();
  for (const auto& [name, value] : fields) mine.push_back({name, value});
  // Note [Agreement by digest]: the details travel only when the digests differ.
  const auto text = mine.dump();
  if (same_on_every_rank(context, text)) return;
  // Equal texts give equal digests, so some rank's text differs from here on.
  const auto all = all_gather_strings(context, text);
  // name -> value -> ranks, in the order the names first appear.
  std::vector<std::string> order;
  std::map<std::string, std::map<std::string, std::vector<size_t>>> values;
  for (size_t rank = 0; rank < all.size(); ++rank) {
    for (const auto& pair : nlohmann::json::parse(all[rank])) {
      const auto name = pair[0].get<std::string>();
      if (!values.count(name)) order.push_back(name);
      auto& holders = values[name][pair[1].get<std::string>()];
      if (holders.empty() || holders.back() != rank) holders.push_back(rank);
    }
  }
  for (auto& [name, by_value] : values) {
    std::vector<bool> stated(all.size(), false);
    for (const auto& [value, holders] : by_value) {
      for (const auto rank : holders) stated[rank] = true;
    }
    for (size_t rank = 0; rank < all.size(); ++rank) {
      if (!stated[rank]) by_value["(not stated)"].push_back(rank);  // a field some rank does not have
    }
  }
  auto ranks_text = [](const std::vector<size_t>& ranks) {
    std::string text = ranks.size() == 1 ? "rank " : "ranks ";
    for (size_t index = 0; index < ranks.size() && index < 8; ++index)
      text += (index ? ", " : "") + std::to_string(ranks[index]);
    if (ranks.size() > 8) text += " and " + std::to_string(ranks.size() - 8) + " more";
    return text;
  };
  std::string message = what + ": the ranks disagree:";
  size_t listed = 0;
  for (const auto& name : order) {
    const auto& by_value = values[name];
    if (by_value.size() < 2) continue;
    if (++listed > 6) {
      message += " (and more)";
      break;
    }
    message += (listed > 1 ? ";" : "") + std::string(" '") + name + "' is";
    size_t index = 0;
    for (const auto& [value, holders] : by_value) {
      message += (index++ ? " and " : " ") + (value.empty() ? std::string("''") : value) + " on " + ranks_text(holders);
    }
  }
  if (listed == 0) {
    // Every field has one value, so the lists differ in order or in a repeated name.
    for (size_t rank = 1; rank < all.size(); ++rank) {
      if (all[rank] == all[0]) continue;
      message += " rank " + std::to_string(rank) +
                 " states its fields in another order or repeats one (rank 0: " + all[0].substr(0, 200) + "; rank " +
                 std::to_string(rank) + ": " + all[rank].substr(0, 200) + ")";
      break;
    }
  }
  TORCH_CHECK(false, message, ". ", fix);
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

namespace fsdp {

void require_same_on_every_rank(const DistributedContext& context, const std::string& what,
                                const std::vector<std::pair<std::string, std::string>>& fields,
                                const std::string& fix) {
  detail::agree_on_fields(context, what, fields, fix);
}

}  // namespace fsdp
