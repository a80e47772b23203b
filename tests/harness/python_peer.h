// Run a Python script from the project venv as part of a test: the real PyTorch, safetensors,
// transformers and Accelerate that our behavior is compared against.
//
// The same rules as the multi-rank harness, through its run_loopback_job (multi_rank.h):
// `world_size` real processes with torchrun's variables and a free MASTER_PORT, so parallel tests
// never share a port, one thread each, and a watchdog: the first failing process stops the others, a
// hang is killed after `timeout`, and every process's output is attached to the failure. The Python is the venv's
// (FSDP_TEST_PYTHON, set by scripts/setup.sh); scripts live in tests/python/.
#pragma once

#include <chrono>
#include <map>
#include <string>
#include <vector>

namespace fsdp::testing {

struct PythonOptions {
  /// Processes to start (1: a plain script). Default: 1.
  int world_size = 1;
  /// Kill every process and fail when the script runs longer. Default: 120 s.
  std::chrono::seconds timeout{120};
  /// Extra environment variables for every process.
  std::map<std::string, std::string> environment;
};

struct PythonResult {
  /// True when every process exited 0 within the timeout.
  bool ok = false;
  /// Each process's combined stdout and stderr, by rank.
  std::vector<std::string> output;
};

/// The venv's Python interpreter; an error (with the fix) when the build was configured without one.
std::string venv_python();

/// Runs tests/python/<script> with `arguments`. A failure or a hang is a test failure (ADD_FAILURE)
/// with every process's output; the result says whether it happened.
PythonResult run_python(const std::string& script, const std::vector<std::string>& arguments,
                        const PythonOptions& options = {});

/// Runs `python -c code` the same way, for a check of a few lines.
PythonResult run_python_code(const std::string& code, const PythonOptions& options = {});

}  // namespace fsdp::testing
