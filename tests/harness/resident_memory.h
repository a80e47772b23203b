// This process's resident memory from /proc, for the tests that bound what a step holds: the
// current RSS, and the peak (VmHWM), which /proc/self/clear_refs resets to the current RSS so that
// a later reading is the peak of what ran in between.
#pragma once

#include <cstdint>
#include <fstream>
#include <string>

namespace fsdp::testing {

/// A /proc/self/status field given in kB ("VmRSS", "VmHWM"), in bytes; -1 where /proc does not say.
inline int64_t status_bytes(const std::string& field) {
  std::ifstream status("/proc/self/status");
  std::string line;
  while (std::getline(status, line)) {
    if (line.rfind(field + ":", 0) == 0) return std::stoll(line.substr(field.size() + 1)) * 1024;
  }
  return -1;
}

/// VmHWM := VmRSS. False where the kernel does not let the process write /proc/self/clear_refs.
inline bool reset_peak_resident() {
  std::ofstream clear("/proc/self/clear_refs");
  clear << "5";
  clear.flush();
  return static_cast<bool>(clear);
}

}  // namespace fsdp::testing
