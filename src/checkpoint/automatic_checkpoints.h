// Private: Accelerate's automatic checkpoints, <project_dir>/checkpoints/checkpoint_<i> (its
// ProjectConfiguration with automatic_checkpoint_naming): the next name, the newest complete one,
// and the rotation that keeps total_limit of them. Not collective: Accelerator runs them on rank 0
// (rotation) or on every rank (names), and says what every rank sees.
#pragma once

#include <cstdint>
#include <filesystem>
#include <string>
#include <utility>
#include <vector>

namespace fsdp::detail {

/// The checkpoint_<i> directories under <project_dir>/checkpoints, by number, oldest first.
std::vector<std::pair<int64_t, std::filesystem::path>> automatic_checkpoints(const std::string& project_dir);

/// The directory the next automatic save writes: checkpoint_<newest + 1> (checkpoint_0 first).
std::string next_automatic_checkpoint(const std::string& project_dir);

/// The newest complete automatic checkpoint (is_complete_checkpoint), "" when there is none.
std::string latest_complete_checkpoint(const std::string& project_dir);

/// Keeps the `total_limit` newest complete checkpoints and removes every checkpoint older than the
/// oldest of them; 0 keeps all. An incomplete one (a save that crashed) does not count, so it never
/// pushes out the last complete checkpoint before it; it goes only once it is older than every
/// checkpoint kept.
void remove_old_checkpoints(const std::string& project_dir, int64_t total_limit);

}  // namespace fsdp::detail
