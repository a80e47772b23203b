#include "harness/python_peer.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <stdexcept>

#include "harness/multi_rank.h"

namespace fsdp::testing {

std::string venv_python() {
  const std::string python = FSDP_TEST_PYTHON;
  if (python.empty() || ::access(python.c_str(), X_OK) != 0) {
    throw std::runtime_error(
        "the cross-checks need the project venv's Python, but this build has " +
        (python.empty() ? std::string("none configured") : "FSDP_TEST_PYTHON=" + python + ", which is not executable") +
        ". Fix: run scripts/setup.sh (it creates .venv/ and configures "
        "-DFSDP_TEST_PYTHON=<venv>/bin/python).");
  }
  return python;
}

namespace {

PythonResult run_python_argv(const std::string& label, const std::vector<std::string>& python_arguments,
                             const PythonOptions& options) {
  PythonResult result;
  std::string python;
  try {
    python = venv_python();
  } catch (const std::exception& error) {
    ADD_FAILURE() << error.what();
    return result;
  }
  LoopbackJob job;
  job.label = label + " rank";
  job.timeout = options.timeout;
  job.argv = [&](int) {
    std::vector<std::string> argv{python};
    argv.insert(argv.end(), python_arguments.begin(), python_arguments.end());
    return argv;
  };
  job.environment = [&](int) {
    // Nothing may come from a hub at test time.
    std::map<std::string, std::string> environment = {
        {"PYTHONDONTWRITEBYTECODE", "1"}, {"HF_HUB_OFFLINE", "1"}, {"TRANSFORMERS_OFFLINE", "1"}};
    for (const auto& [name, value] : options.environment) environment[name] = value;
    return environment;
  };
  auto outcome = run_loopback_job(options.world_size, job);
  if (outcome.failed) ADD_FAILURE() << outcome.report;
  result.ok = !outcome.failed;
  result.output = std::move(outcome.output);
  return result;
}

}  // namespace

PythonResult run_python(const std::string& script, const std::vector<std::string>& arguments,
                        const PythonOptions& options) {
  std::vector<std::string> python_arguments{(std::filesystem::path(FSDP_PYTHON_TESTS_DIR) / script).string()};
  python_arguments.insert(python_arguments.end(), arguments.begin(), arguments.end());
  return run_python_argv(script, python_arguments, options);
}

PythonResult run_python_code(const std::string& code, const PythonOptions& options) {
  return run_python_argv("python -c", {"-c", code}, options);
}

}  // namespace fsdp::testing
