// `fsdp launch`: thin CLI over launch/launcher.h.
#include <c10/util/Exception.h>
#include <fsdp/accelerate_config.h>

#include <algorithm>
#include <iostream>
#include <optional>

#include "cli/commands.h"
#include "launch/launcher.h"

namespace fsdp::cli {

namespace {

// Process counts and rendezvous from the file, unless the matching flag was given.
void apply_config_to_launch(const AccelerateConfig& config, const CLI::App& app, detail::LaunchOptions& options) {
  const bool nnodes_given = app.count("--nnodes") > 0;
  if (config.num_machines && !nnodes_given) {
    options.nnodes = *config.num_machines;
    options.min_nnodes = 0;
  }
  if (config.num_processes && app.count("--nproc-per-node") == 0) {
    TORCH_CHECK(*config.num_processes % options.nnodes == 0, "config file '", config.path, "': num_processes ",
                *config.num_processes, " is not a multiple of ", nnodes_given ? "--nnodes (its MAX) " : "num_machines ",
                options.nnodes, "; every machine runs the same number of processes.");
    options.nproc_per_node = *config.num_processes / options.nnodes;
  }
  if (config.machine_rank && app.count("--node-rank") == 0) options.node_rank = *config.machine_rank;
  if (config.main_process_ip && app.count("--master-addr") == 0) options.master_addr = *config.main_process_ip;
  if (config.main_process_port && app.count("--master-port") == 0)
    options.master_port = static_cast<int>(*config.main_process_port);
}

// torchrun's --nnodes: "N" or "MIN:MAX".
void parse_nnodes(const std::string& text, detail::LaunchOptions& options) {
  auto number = [&](const std::string& part) {
    size_t used = 0;
    int64_t value = -1;
    try {
      value = std::stoll(part, &used);
    } catch (const std::exception&) {
      used = 0;
    }
    TORCH_CHECK(used == part.size() && !part.empty(), "fsdp launch: --nnodes '", text,
                "' is not N or MIN:MAX (whole numbers), e.g. --nnodes 2 or --nnodes 1:4.");
    return value;
  };
  const auto colon = text.find(':');
  if (colon == std::string::npos) {
    options.nnodes = number(text);
    options.min_nnodes = 0;
  } else {
    options.min_nnodes = number(text.substr(0, colon));
    options.nnodes = number(text.substr(colon + 1));
    TORCH_CHECK(options.min_nnodes >= 1 && options.min_nnodes <= options.nnodes, "fsdp launch: --nnodes ", text,
                " is not MIN:MAX with 1 <= MIN <= MAX; e.g. --nnodes 1:4 runs on 1 to 4 machines.");
  }
}

// torchrun's --rdzv-conf keys that mean something here; any other is refused by name.
void parse_rdzv_conf(const std::string& text, detail::LaunchOptions& options) {
  size_t start = 0;
  while (start <= text.size()) {
    const auto comma = text.find(',', start);
    const auto item = text.substr(start, comma == std::string::npos ? std::string::npos : comma - start);
    start = comma == std::string::npos ? text.size() + 1 : comma + 1;
    if (item.empty()) continue;
    const auto equals = item.find('=');
    const auto name = item.substr(0, equals);
    TORCH_CHECK(equals != std::string::npos && (name == "join_timeout" || name == "last_call_timeout"),
                "fsdp launch: --rdzv-conf '", item,
                "' is not join_timeout=SECONDS or last_call_timeout=SECONDS, "
                "the torchrun settings fsdp launch has (torchrun's other keys, such as read_timeout, do not apply "
                "to its rendezvous).");
    double seconds = -1;
    size_t used = 0;
    try {
      seconds = std::stod(item.substr(equals + 1), &used);
    } catch (const std::exception&) {
      used = 0;
    }
    TORCH_CHECK(used > 0 && used == item.size() - equals - 1 && seconds >= 0 && seconds <= 86400,
                "fsdp launch: --rdzv-conf ", item, ": expected seconds in [0, 86400].");
    const auto duration = std::chrono::milliseconds(static_cast<int64_t>(seconds * 1000.0));
    (name == "join_timeout" ? options.join_timeout : options.last_call_timeout) = duration;
  }
}

// A flag's value that does not parse is a usage error (exit 2), as CLI11's own are.
template <typename Parse>
void as_usage_error(Parse parse) {
  try {
    parse();
  } catch (const c10::Error& error) {
    throw CLI::ValidationError(error.what_without_backtrace());
  }
}

}  // namespace

Command add_launch_command(CLI::App& parent, const std::vector<std::string>& command_after_separator) {
  auto options = std::make_shared<detail::LaunchOptions>();
  auto grace_seconds = std::make_shared<double>(3.0);
  CLI::App* app = parent.add_subcommand(
      "launch",
      "Start PROGRAM on --nproc-per-node local processes with torchrun's variables (RANK, WORLD_SIZE, LOCAL_RANK, "
      "LOCAL_WORLD_SIZE, GROUP_RANK, MASTER_ADDR, MASTER_PORT; OMP_NUM_THREADS=1 unless set). When one process "
      "fails the others get SIGTERM, then SIGKILL after the grace period, and the launcher exits with the failing "
      "process's exit code (or, with --max-restarts, starts them all again). Ctrl-C stops them all.\n\nUsage: fsdp "
      "launch [OPTIONS] -- PROGRAM [ARGS...]");
  app->add_option("--nproc-per-node,--nproc_per_node", options->nproc_per_node, "Processes on this machine")
      ->capture_default_str();
  app->add_option_function<std::string>(
         "--nnodes", [options](const std::string& text) { as_usage_error([&] { parse_nnodes(text, *options); }); },
         "Machines in the job: N, or MIN:MAX to go on with as few as MIN after a machine is lost "
         "(torchrun's; with --max-restarts)")
      ->default_str("1");
  app->add_option_function<std::string>(
      "--rdzv-conf,--rdzv_conf",
      [options](const std::string& text) { as_usage_error([&] { parse_rdzv_conf(text, *options); }); },
      "torchrun's rendezvous settings for a job of several machines: join_timeout=SECONDS (default 600), "
      "last_call_timeout=SECONDS (default 30), comma-separated");
  app->add_option("--node-rank,--node_rank", options->node_rank, "Index of this machine, in [0, nnodes)")
      ->capture_default_str();
  app->add_option("--master-addr,--master_addr", options->master_addr,
                  "Address of the machine with node rank 0 (rank 0 hosts the rendezvous store)")
      ->capture_default_str();
  app->add_option("--master-port,--master_port", options->master_port,
                  "Port of the rendezvous store; 0 picks a free port (single machine only)")
      ->capture_default_str();
  app->add_option("--max-restarts,--max_restarts", options->max_restarts,
                  "Times to start every process again after one fails (torchrun's flag): the processes see "
                  "TORCHELASTIC_RESTART_COUNT and resume from their latest complete checkpoint")
      ->capture_default_str();
  app->add_flag("--rank-prefix,--rank_prefix", options->rank_prefix, "Prefix every output line with \"[rank R]: \"");
  app->add_option("--termination-grace", *grace_seconds,
                  "Seconds between SIGTERM and SIGKILL when stopping the other processes")
      ->capture_default_str()
      ->check(CLI::Range(0.0, 60.0));
  auto config_file = std::make_shared<std::string>();
  auto use_fsdp = std::make_shared<bool>(false);
  auto mixed_precision = std::make_shared<std::string>();
  auto fsdp_flags = std::make_shared<std::map<std::string, std::string>>();
  app->add_option("--config-file,--config_file", *config_file,
                  "Accelerate YAML config (`accelerate config` output): process counts, rendezvous and fsdp_config, "
                  "exported to the processes as FSDP_* variables; flags given here override it");
  app->add_flag("--use-fsdp,--use_fsdp", *use_fsdp, "Export FSDP settings even without distributed_type: FSDP");
  app->add_option("--mixed-precision,--mixed_precision", *mixed_precision,
                  "no, fp16, bf16 or fp8 (ACCELERATE_MIXED_PRECISION)");
  for (const auto& key : known_fsdp_config_keys()) {
    std::string dashed = key;
    std::replace(dashed.begin(), dashed.end(), '_', '-');
    app->add_option_function<std::string>(
           "--" + dashed + ",--" + key, [fsdp_flags, key](const std::string& value) { (*fsdp_flags)[key] = value; },
           "Overrides fsdp_config." + key)
        ->group("FSDP (as accelerate launch)");
  }
  app->prefix_command();
  app->allow_extras();
  Command command;
  command.app = app;
  command.run = [app, options, grace_seconds, &command_after_separator, config_file, use_fsdp, mixed_precision,
                 fsdp_flags] {
    std::optional<AccelerateConfig> config;
    if (!config_file->empty()) {
      config = load_accelerate_config(*config_file);
      apply_config_to_launch(*config, *app, *options);
    }
    auto fsdp =
        fsdp_launch_environment(config ? &*config : nullptr, *fsdp_flags, *use_fsdp,
                                mixed_precision->empty() ? std::nullopt : std::optional<std::string>(*mixed_precision));
    options->extra_environment = fsdp.variables;
    options->command = app->remaining();
    TORCH_CHECK(options->command.empty() || command_after_separator.empty(),
                "fsdp launch: unexpected arguments before `--`: '", options->command.front(),
                "'; put the program and all its arguments after `--`.");
    if (options->command.empty()) options->command = command_after_separator;
    options->termination_grace = std::chrono::milliseconds(static_cast<int64_t>(*grace_seconds * 1000.0));
    options->report_restart = [](const std::string& line) { std::cerr << "fsdp launch: " << line << std::endl; };
    if (app->count("--rdzv-conf") > 0 && !detail::is_elastic(*options)) {
      std::cerr << "fsdp launch: warning: --rdzv-conf is ignored: it sets the rounds of a job of several machines "
                   "with --max-restarts or --nnodes MIN:MAX, and this one has a fixed rendezvous (--nnodes "
                << options->nnodes << ", --max-restarts " << options->max_restarts << ")." << std::endl;
    }
    auto result = detail::launch(*options, current_process_environment());
    if (!result.message.empty()) std::cerr << "fsdp launch: " << result.message << std::endl;
    return result.exit_code;
  };
  return command;
}

}  // namespace fsdp::cli
