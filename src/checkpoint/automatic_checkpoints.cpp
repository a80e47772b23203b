#include "checkpoint/automatic_checkpoints.h"

#include <fsdp/checkpoint.h>

#include <algorithm>
#include <cctype>

namespace fsdp::detail {
namespace {

namespace fs = std::filesystem;

/// The number at the end of a checkpoint directory's name (checkpoint_12 -> 12), or -1.
int64_t checkpoint_number(const std::string& name) {
  const std::string prefix = "checkpoint_";
  if (name.rfind(prefix, 0) != 0 || name.size() == prefix.size() || name.size() > prefix.size() + 18) return -1;
  for (size_t index = prefix.size(); index < name.size(); ++index) {
    if (!std::isdigit(static_cast<unsigned char>(name[index]))) return -1;
  }
  return std::stoll(name.substr(prefix.size()));
}

}  // namespace

std::vector<std::pair<int64_t, fs::path>> automatic_checkpoints(const std::string& project_dir) {
  std::vector<std::pair<int64_t, fs::path>> found;
  const auto root = fs::path(project_dir) / "checkpoints";
  if (!fs::is_directory(root)) return found;
  for (const auto& item : fs::directory_iterator(root)) {
    const auto number = checkpoint_number(item.path().filename().string());
    if (item.is_directory() && number >= 0) found.emplace_back(number, item.path());
  }
  std::sort(found.begin(), found.end());
  return found;
}

std::string next_automatic_checkpoint(const std::string& project_dir) {
  const auto existing = automatic_checkpoints(project_dir);
  const int64_t number = existing.empty() ? 0 : existing.back().first + 1;
  return (fs::path(project_dir) / "checkpoints" / ("checkpoint_" + std::to_string(number))).string();
}

std::string latest_complete_checkpoint(const std::string& project_dir) {
  const auto all = automatic_checkpoints(project_dir);
  for (auto it = all.rbegin(); it != all.rend(); ++it) {
    if (is_complete_checkpoint(it->second.string())) return it->second.string();
  }
  return "";
}

void remove_old_checkpoints(const std::string& project_dir, int64_t total_limit) {
  if (total_limit <= 0) return;
  const auto all = automatic_checkpoints(project_dir);
  std::vector<int64_t> complete;
  for (const auto& [number, path] : all) {
    if (is_complete_checkpoint(path.string())) complete.push_back(number);
  }
  if (static_cast<int64_t>(complete.size()) <= total_limit) return;
  const int64_t oldest_kept = complete[complete.size() - static_cast<size_t>(total_limit)];
  for (const auto& [number, path] : all) {
    if (number < oldest_kept) fs::remove_all(path);
  }
}

}  // namespace fsdp::detail
