// Private: the "did you mean" of an unknown name (a config key, an environment variable, a flag),
// shared by the plugin's and the Accelerate config's readers.
#pragma once

#include <string>
#include <vector>

namespace fsdp::detail {

/// The closest of `candidates` to `word` when it is close enough to be a typo (an edit distance of
/// at most 2, or a quarter of the word; a candidate that is a prefix or an extension of the word
/// counts as 2), else empty.
std::string did_you_mean(const std::string& word, const std::vector<std::string>& candidates);

}  // namespace fsdp::detail
