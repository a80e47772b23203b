#include "config/text.h"

#include <c10/util/Exception.h>

namespace fsdp::detail {

std::optional<bool> truth_value(const std::string& text) {
  const std::string key = to_lower(trim(text));
  for (const char* word : {"y", "yes", "t", "true", "on", "1"}) {
    if (key == word) return true;
  }
  for (const char* word : {"n", "no", "f", "false", "off", "0"}) {
    if (key == word) return false;
  }
  return std::nullopt;
}

bool parse_bool(const std::string& value, const std::string& what) {
  if (auto truth = truth_value(value)) return *truth;
  TORCH_CHECK(false, what, ": '", value,
              "' is not a truth value; expected one of y, yes, t, true, on, 1 or n, no, f, "
              "false, off, 0 (case-insensitive).");
}

}  // namespace fsdp::detail
