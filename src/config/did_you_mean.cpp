#include "config/did_you_mean.h"

#include <algorithm>

namespace fsdp::detail {

namespace {

size_t edit_distance(const std::string& left, const std::string& right) {
  std::vector<size_t> previous(right.size() + 1), current(right.size() + 1);
  for (size_t j = 0; j <= right.size(); ++j) previous[j] = j;
  for (size_t i = 1; i <= left.size(); ++i) {
    current[0] = i;
    for (size_t j = 1; j <= right.size(); ++j) {
      current[j] = std::min({previous[j] + 1, current[j - 1] + 1, previous[j - 1] + (left[i - 1] != right[j - 1])});
    }
    std::swap(previous, current);
  }
  return previous[right.size()];
}

}  // namespace

std::string did_you_mean(const std::string& word, const std::vector<std::string>& candidates) {
  std::string best;
  size_t best_distance = std::string::npos;
  for (const auto& candidate : candidates) {
    size_t distance = edit_distance(word, candidate);
    // A candidate that is a prefix or extension of the word also counts (fsdp_backward_prefetch_policy).
    if (word.rfind(candidate, 0) == 0 || candidate.rfind(word, 0) == 0) distance = std::min(distance, size_t{2});
    if (distance < best_distance) {
      best_distance = distance;
      best = candidate;
    }
  }
  return best_distance <= std::max<size_t>(2, word.size() / 4) ? best : "";
}

}  // namespace fsdp::detail
