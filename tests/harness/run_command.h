// Run a shell command and capture what it prints (stdout and stderr together), for the tests that
// drive the command-line programs as a user would.
#pragma once

#include <sys/wait.h>

#include <cstdio>
#include <string>

namespace fsdp::testing {

struct CommandResult {
  int exit_code = 0;
  std::string output;
};

inline CommandResult run_command(const std::string& command) {
  CommandResult result;
  FILE* pipe = ::popen((command + " 2>&1").c_str(), "r");
  if (pipe == nullptr) return {127, "popen failed for: " + command};
  char buffer[1024];
  while (std::fgets(buffer, sizeof(buffer), pipe)) result.output += buffer;
  result.exit_code = WEXITSTATUS(::pclose(pipe));
  return result;
}

}  // namespace fsdp::testing
