#include "harness/python_peer.h"

#include "launch/launcher.h"
#include "launch/process_set.h"

#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <sstream>
#include <unistd.h>

namespace fsdp::testing {
namespace {

std::string read_whole_file(const std::string& path) {
  std::ifstream file(path);
  std::stringstream text;
  text << file.rdbuf();
  return text.str();
}

}  // namespace

std::string venv_python() {
  const std::string python = FSDP_TEST_PYTHON;
  if (python.empty() || ::access(python.c_str(), X_OK) != 0) {
    throw std::runtime_error("the cross-checks need the project venv's Python, but this build has " +
                             (python.empty() ? std::string("none configured")
                                             : "FSDP_TEST_PYTHON=" + python + ", which is not executable") +
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
  const int port = detail::pick_free_port();
  const auto log_directory = std::filesystem::temp_directory_path() /
                             ("fsdp_python_" + std::to_string(::getpid()) + "_" + std::to_string(port));
  std::filesystem::create_directories(log_directory);

  std::vector<detail::ProcessSpec> specs;
  const auto base = current_process_environment();
  for (int rank = 0; rank < options.world_size; ++rank) {
    detail::ProcessSpec spec;
    spec.argv = {python};
    spec.argv.insert(spec.argv.end(), python_arguments.begin(), python_arguments.end());
    spec.environment = base;
    spec.environment["RANK"] = std::to_string(rank);
    spec.environment["WORLD_SIZE"] = std::to_string(options.world_size);
    spec.environment["LOCAL_RANK"] = std::to_string(rank);
    spec.environment["LOCAL_WORLD_SIZE"] = std::to_string(options.world_size);
    spec.environment["MASTER_ADDR"] = "127.0.0.1";
    spec.environment["MASTER_PORT"] = std::to_string(port);
    spec.environment["OMP_NUM_THREADS"] = "1";
    spec.environment["PYTHONDONTWRITEBYTECODE"] = "1";
    // Nothing may come from a hub at test time.
    spec.environment["HF_HUB_OFFLINE"] = "1";
    spec.environment["TRANSFORMERS_OFFLINE"] = "1";
    for (const auto& [name, value] : options.environment) spec.environment[name] = value;
    spec.label = "python rank " + std::to_string(rank);
    spec.output = detail::OutputMode::kFile;
    spec.output_path = (log_directory / ("rank" + std::to_string(rank) + ".log")).string();
    specs.push_back(std::move(spec));
  }
  detail::ProcessSetOptions set_options;
  set_options.timeout = options.timeout;
  set_options.forward_signals = false;
  const auto outcome = detail::run_process_set(specs, set_options);

  bool failed = outcome.timed_out;
  for (const auto& process : outcome.outcomes) {
    if (process.exit_code != 0 && !(outcome.timed_out && process.stopped_by_parent)) failed = true;
  }
  std::ostringstream report;
  if (outcome.timed_out) report << "watchdog: " << label << " ran longer than " << options.timeout.count() << " s\n";
  for (size_t rank = 0; rank < specs.size(); ++rank) {
    result.output.push_back(read_whole_file(specs[rank].output_path));
    const auto& process = outcome.outcomes[rank];
    report << "===== " << label << " rank " << rank << ": exit code " << process.exit_code
           << (process.stopped_by_parent ? (outcome.timed_out ? " (hung; killed by the watchdog)"
                                                              : " (stopped after another rank failed)")
                                         : "")
           << " =====\n"
           << result.output.back() << "\n";
  }
  if (failed) ADD_FAILURE() << report.str();
  result.ok = !failed;
  std::error_code ignored;
  std::filesystem::remove_all(log_directory, ignored);
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
