// Private: what this thread is doing when it issues a collective ("FSDP unit model.layers.3
// (Block), iteration 12"), so that a collective that fails or times out names the unit and the
// iteration, not only the operation and the group (issue Reliability: a stuck rank's report).
#pragma once

#include <string>

namespace fsdp::detail {

/// Sets the thread's activity for its lifetime and restores the previous one after.
class ActivityScope {
 public:
  explicit ActivityScope(std::string activity);
  ~ActivityScope();
  ActivityScope(const ActivityScope&) = delete;
  ActivityScope& operator=(const ActivityScope&) = delete;

 private:
  std::string previous_;
};

/// The innermost activity of this thread, or "" outside any.
const std::string& current_activity();

}  // namespace fsdp::detail
