// Private: the small string helpers config parsing needs (case folding, trimming, truth values).
#pragma once

#include <cctype>
#include <optional>
#include <string>

namespace fsdp::detail {

inline std::string to_upper(std::string text) {
  for (auto& c : text) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
  return text;
}

inline std::string to_lower(std::string text) {
  for (auto& c : text) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return text;
}

inline std::string trim(const std::string& text) {
  const auto first = text.find_first_not_of(" \t\r\n");
  if (first == std::string::npos) return "";
  const auto last = text.find_last_not_of(" \t\r\n");
  return text.substr(first, last - first + 1);
}

/// Accelerate's str_to_bool words: y/yes/t/true/on/1 and n/no/f/false/off/0, case-insensitive,
/// around spaces; nullopt for anything else.
std::optional<bool> truth_value(const std::string& text);

/// truth_value, or an error naming `what` and listing the accepted words.
bool parse_bool(const std::string& value, const std::string& what);

}  // namespace fsdp::detail
