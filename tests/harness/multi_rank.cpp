#include "harness/multi_rank.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <set>
#include <sstream>

#include "launch/launcher.h"
#include "launch/process_set.h"

namespace fsdp::testing {
namespace {

constexpr const char* kRankVariable = "FSDP_TEST_HARNESS_RANK";
constexpr const char* kCallVariable = "FSDP_TEST_HARNESS_CALL";
constexpr const char* kParentVariable = "FSDP_TEST_HARNESS_PARENT";

std::string current_test_filter() {
  const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
  return std::string(info->test_suite_name()) + "." + info->name();
}

std::string read_file(const std::string& path) {
  std::ifstream file(path);
  std::stringstream text;
  text << file.rdbuf();
  return text.str();
}

/// Which run_processes call of the current test this is: a rank process replays the whole test body
/// and runs only the call it was started for.
int next_call_index() {
  static std::string test;
  static int index = 0;
  const auto name = current_test_filter();
  if (name != test) {
    test = name;
    index = 0;
  }
  return index++;
}

}  // namespace

std::string shared_temporary_directory() {
  const char* parent = std::getenv(kParentVariable);
  const std::string owner = parent ? parent : std::to_string(::getpid());
  auto name = current_test_filter();
  std::replace(name.begin(), name.end(), '/', '_');
  auto path = std::filesystem::temp_directory_path() / ("fsdp_test_" + owner + "_" + name);
  static std::set<std::string> prepared;
  if (!parent && prepared.insert(path.string()).second) {
    std::filesystem::remove_all(path);
    std::filesystem::create_directories(path);
  }
  return path.string();
}

MultiRankOptions simulated_machines(int ranks_per_machine) {
  MultiRankOptions options;
  options.environment_for_rank = [ranks_per_machine](int rank) {
    return std::map<std::string, std::string>{{"LOCAL_WORLD_SIZE", std::to_string(ranks_per_machine)},
                                              {"LOCAL_RANK", std::to_string(rank % ranks_per_machine)},
                                              {"GROUP_RANK", std::to_string(rank / ranks_per_machine)}};
  };
  return options;
}

bool is_rank_process() { return std::getenv(kRankVariable) != nullptr; }

LoopbackJobResult run_loopback_job(int world_size, const LoopbackJob& job) {
  const int port = detail::pick_free_port();
  const auto log_directory =
      std::filesystem::temp_directory_path() / ("fsdp_test_" + std::to_string(::getpid()) + "_" + std::to_string(port));
  std::filesystem::create_directories(log_directory);

  std::vector<detail::ProcessSpec> specs;
  const auto base = current_process_environment();
  for (int rank = 0; rank < world_size; ++rank) {
    detail::ProcessSpec spec;
    spec.argv = job.argv(rank);
    spec.environment = base;
    spec.environment["RANK"] = std::to_string(rank);
    spec.environment["WORLD_SIZE"] = std::to_string(world_size);
    spec.environment["LOCAL_RANK"] = std::to_string(rank);
    spec.environment["LOCAL_WORLD_SIZE"] = std::to_string(world_size);
    spec.environment["MASTER_ADDR"] = "127.0.0.1";
    spec.environment["MASTER_PORT"] = std::to_string(port);
    spec.environment["OMP_NUM_THREADS"] = "1";
    if (job.environment) {
      for (const auto& [name, value] : job.environment(rank)) spec.environment[name] = value;
    }
    spec.label = job.label + " " + std::to_string(rank);
    spec.output = detail::OutputMode::kFile;
    spec.output_path = (log_directory / ("rank" + std::to_string(rank) + ".log")).string();
    specs.push_back(std::move(spec));
  }
  detail::ProcessSetOptions set_options;
  set_options.timeout = job.timeout;
  set_options.forward_signals = false;
  const auto outcome = detail::run_process_set(specs, set_options);

  LoopbackJobResult result;
  result.failed = outcome.timed_out;
  for (const auto& process : outcome.outcomes) {
    if (process.exit_code != 0 && !(outcome.timed_out && process.stopped_by_parent)) result.failed = true;
  }
  std::ostringstream report;
  if (outcome.timed_out) report << "watchdog: the job ran longer than " << job.timeout.count() << " s\n";
  for (size_t rank = 0; rank < specs.size(); ++rank) {
    result.output.push_back(read_file(specs[rank].output_path));
    const auto& process = outcome.outcomes[rank];
    report << "===== " << specs[rank].label << ": exit code " << process.exit_code
           << (process.stopped_by_parent
                   ? (outcome.timed_out ? " (hung; killed by the watchdog)" : " (stopped after another rank failed)")
                   : "")
           << " =====\n"
           << result.output.back() << "\n";
  }
  result.report = report.str();
  std::error_code ignored;
  std::filesystem::remove_all(log_directory, ignored);
  return result;
}

void run_processes(int world_size, const std::function<void(int rank)>& body, const MultiRankOptions& options) {
  const int call = next_call_index();
  if (const char* rank_text = std::getenv(kRankVariable)) {
    const char* call_text = std::getenv(kCallVariable);
    if (call_text && std::atoi(call_text) == call) body(std::atoi(rank_text));
    return;
  }
  LoopbackJob job;
  job.timeout = options.timeout;
  job.argv = [](int) {
    return std::vector<std::string>{"/proc/self/exe", "--gtest_filter=" + current_test_filter(), "--gtest_brief=1"};
  };
  job.environment = [&](int rank) {
    std::map<std::string, std::string> environment = {
        {"FSDP_COLLECTIVE_TIMEOUT", std::to_string(options.collective_timeout.count())},
        {kRankVariable, std::to_string(rank)},
        {kCallVariable, std::to_string(call)},
        {kParentVariable, std::to_string(::getpid())}};
    if (options.environment_for_rank) {
      for (const auto& [name, value] : options.environment_for_rank(rank)) environment[name] = value;
    }
    return environment;
  };
  const auto result = run_loopback_job(world_size, job);
  if (result.failed) ADD_FAILURE() << result.report;
}

void run_on_ranks(int world_size, const std::function<void(const DistributedContext&)>& body,
                  const MultiRankOptions& options) {
  run_processes(world_size, [&](int) { body(DistributedContext::initialize_from_environment()); }, options);
}

}  // namespace fsdp::testing
