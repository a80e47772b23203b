// Parsing of launcher environment variables. See include/fsdp/distributed_environment.h.
#include <c10/util/Exception.h>
#include <fsdp/distributed_environment.h>

#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <optional>
#include <vector>

extern char** environ;

namespace fsdp {
namespace {

// The variables one launcher family sets. Families are tried in order and never mixed: half a
// torchrun environment plus half a Slurm one is almost always a stale variable, not a job.
struct LauncherFamily {
  const char* name;
  const char* rank;
  const char* world_size;
  const char* local_rank;
  const char* local_world_size;
};

const std::vector<LauncherFamily>& launcher_families() {
  static const std::vector<LauncherFamily> families = {
      {"torchrun", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"},
      {"openmpi", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
       "OMPI_COMM_WORLD_LOCAL_SIZE"},
      {"mpich", "PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"},
      {"mvapich2", "MV2_COMM_WORLD_RANK", "MV2_COMM_WORLD_SIZE", "MV2_COMM_WORLD_LOCAL_RANK",
       "MV2_COMM_WORLD_LOCAL_SIZE"},
      {"slurm", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "SLURM_NTASKS_PER_NODE"},
  };
  return families;
}

std::optional<std::string> lookup(const EnvironmentMap& variables, const std::string& name) {
  auto it = variables.find(name);
  if (it == variables.end() || it->second.empty()) return std::nullopt;
  return it->second;
}

int64_t parse_integer(const std::string& name, const std::string& value, const std::string& expected) {
  errno = 0;
  char* end = nullptr;
  long long parsed = std::strtoll(value.c_str(), &end, 10);
  TORCH_CHECK(errno == 0 && end != value.c_str() && *end == '\0', "distributed environment: variable ", name, "='",
              value, "' is not an integer; expected ", expected, ". Fix the launcher command or unset the variable.");
  return parsed;
}

// Slurm writes tasks per node as "4(x2),3": counts with repeat factors, one entry per node.
std::optional<int64_t> tasks_on_node(const std::string& tasks_per_node, int64_t node_id) {
  int64_t node = 0;
  size_t position = 0;
  while (position < tasks_per_node.size()) {
    size_t comma = tasks_per_node.find(',', position);
    std::string entry =
        tasks_per_node.substr(position, comma == std::string::npos ? std::string::npos : comma - position);
    int64_t repeat = 1;
    size_t paren = entry.find("(x");
    std::string count_text = entry.substr(0, paren);
    if (paren != std::string::npos) {
      std::string repeat_text = entry.substr(paren + 2);
      if (!repeat_text.empty() && repeat_text.back() == ')') repeat_text.pop_back();
      repeat = parse_integer("SLURM_TASKS_PER_NODE", repeat_text, "a list such as '4(x2),3'");
    }
    int64_t count = parse_integer("SLURM_TASKS_PER_NODE", count_text, "a list such as '4(x2),3'");
    if (node_id < node + repeat) return count;
    node += repeat;
    if (comma == std::string::npos) break;
    position = comma + 1;
  }
  return std::nullopt;
}

bool is_true(const std::string& value) {
  std::string lower;
  for (char c : value) lower += static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return lower == "1" || lower == "true" || lower == "yes" || lower == "y" || lower == "on" || lower == "t";
}

}  // namespace

EnvironmentMap current_process_environment() {
  EnvironmentMap variables;
  for (char** entry = environ; entry != nullptr && *entry != nullptr; ++entry) {
    std::string text(*entry);
    size_t equals = text.find('=');
    if (equals == std::string::npos) continue;
    variables.emplace(text.substr(0, equals), text.substr(equals + 1));
  }
  return variables;
}

std::string first_host_of_slurm_nodelist(const std::string& nodelist) {
  // The first host ends at the first comma outside brackets; a bracket holds ranges like 01-04.
  std::string host;
  size_t position = 0;
  while (position < nodelist.size() && nodelist[position] != ',') {
    char c = nodelist[position];
    if (c == '[') {
      size_t close = nodelist.find(']', position);
      TORCH_CHECK(close != std::string::npos, "distributed environment: SLURM_JOB_NODELIST='", nodelist,
                  "' has an unclosed '['; set MASTER_ADDR to the host of rank 0 instead.");
      std::string ranges = nodelist.substr(position + 1, close - position - 1);
      size_t stop = ranges.find_first_of(",-");
      host += ranges.substr(0, stop);
      position = close + 1;
      continue;
    }
    host += c;
    ++position;
  }
  TORCH_CHECK(!host.empty(), "distributed environment: SLURM_JOB_NODELIST='", nodelist,
              "' names no host; set MASTER_ADDR to the host of rank 0.");
  return host;
}

DistributedEnvironment parse_distributed_environment(const EnvironmentMap& variables) {
  DistributedEnvironment environment;

  if (auto timeout = lookup(variables, "FSDP_COLLECTIVE_TIMEOUT")) {
    char* end = nullptr;
    double seconds = std::strtod(timeout->c_str(), &end);
    TORCH_CHECK(end != timeout->c_str() && *end == '\0' && std::isfinite(seconds) && seconds > 0,
                "distributed environment: FSDP_COLLECTIVE_TIMEOUT='", *timeout,
                "' is not a positive number of seconds; set it to e.g. 300, or unset it for the default of ",
                kDefaultCollectiveTimeout.count(), " s.");
    environment.timeout = std::chrono::milliseconds(static_cast<int64_t>(std::ceil(seconds * 1000.0)));
  } else {
    environment.timeout = kDefaultCollectiveTimeout;
  }
  if (auto check = lookup(variables, "FSDP_CHECK_COLLECTIVES")) {
    TORCH_CHECK(*check == "0" || *check == "1", "distributed environment: FSDP_CHECK_COLLECTIVES='", *check,
                "' is neither 1 (check that every rank issues the same collectives, the default) nor 0 (no check, "
                "for measuring its cost); set it to 1 or 0, or unset it.");
    environment.check_collectives = *check == "1";
  }
  // torchrun's restart round; read for every launch (a one-process job restarts too).
  for (auto [name, field] :
       {std::pair<const char*, int64_t*>{"TORCHELASTIC_RESTART_COUNT", &environment.restart_count},
        std::pair<const char*, int64_t*>{"TORCHELASTIC_MAX_RESTARTS", &environment.max_restarts}}) {
    if (auto text = lookup(variables, name)) {
      *field = parse_integer(name, *text, "an integer >= 0");
      TORCH_CHECK(*field >= 0, "distributed environment: ", name, "=", *field,
                  " is negative; the launcher counts restarts from 0. Unset it outside a launcher.");
    }
  }

  const LauncherFamily* family = nullptr;
  for (const auto& candidate : launcher_families()) {
    if (lookup(variables, candidate.rank) || lookup(variables, candidate.world_size)) {
      family = &candidate;
      break;
    }
  }
  if (family == nullptr) return environment;  // a single process: world size 1, no network

  environment.launcher = family->name;
  auto rank_text = lookup(variables, family->rank);
  auto world_text = lookup(variables, family->world_size);
  TORCH_CHECK(rank_text && world_text, "distributed environment: ", rank_text ? family->world_size : family->rank,
              " is not set but ", rank_text ? family->rank : family->world_size, " is; a ", family->name,
              " launch sets both. Start the program with `fsdp launch` (or torchrun), or set ", "both variables.");
  environment.rank = parse_integer(family->rank, *rank_text, "an integer rank >= 0");
  environment.world_size = parse_integer(family->world_size, *world_text, "an integer world size >= 1");
  TORCH_CHECK(environment.world_size >= 1, "distributed environment: ", family->world_size, "=", environment.world_size,
              " but the world size must be at least 1.");
  TORCH_CHECK(environment.rank >= 0 && environment.rank < environment.world_size,
              "distributed environment: ", family->rank, "=", environment.rank, " is outside [0, ",
              environment.world_size, ") given ", family->world_size, "=", environment.world_size,
              ". Every rank must be below the world size.");

  auto local_rank_text = lookup(variables, family->local_rank);
  auto local_world_text = lookup(variables, family->local_world_size);
  if (std::string(family->name) == "slurm" && !local_world_text) {
    if (auto tasks = lookup(variables, "SLURM_TASKS_PER_NODE")) {
      int64_t node_id = 0;
      if (auto node_text = lookup(variables, "SLURM_NODEID"))
        node_id = parse_integer("SLURM_NODEID", *node_text, "an integer >= 0");
      if (auto count = tasks_on_node(*tasks, node_id)) local_world_text = std::to_string(*count);
    }
  }
  if (local_rank_text || local_world_text) {
    TORCH_CHECK(local_rank_text && local_world_text,
                "distributed environment: ", local_rank_text ? family->local_world_size : family->local_rank,
                " is not set but ", local_rank_text ? family->local_rank : family->local_world_size,
                " is; set both, or neither for a single-machine job.");
    environment.local_rank = parse_integer(family->local_rank, *local_rank_text, "an integer >= 0");
    environment.local_world_size = parse_integer(family->local_world_size, *local_world_text, "an integer >= 1");
  } else {
    // No per-machine variables: a single machine holding every rank.
    environment.local_rank = environment.rank;
    environment.local_world_size = environment.world_size;
  }
  TORCH_CHECK(environment.local_world_size >= 1 && environment.local_world_size <= environment.world_size,
              "distributed environment: ", family->local_world_size, "=", environment.local_world_size,
              " must be in [1, ", family->world_size, "=", environment.world_size, "].");
  TORCH_CHECK(environment.local_rank >= 0 && environment.local_rank < environment.local_world_size,
              "distributed environment: ", family->local_rank, "=", environment.local_rank, " is outside [0, ",
              environment.local_world_size, ") given ", family->local_world_size, "=", environment.local_world_size,
              ".");
  TORCH_CHECK(environment.world_size % environment.local_world_size == 0,
              "distributed environment: ", family->world_size, "=", environment.world_size, " is not a multiple of ",
              family->local_world_size, "=", environment.local_world_size,
              "; fsdp.cpp needs the same number of processes on every machine (torchrun's --nproc-per-node).");

  environment.node_rank = environment.rank / environment.local_world_size;
  const char* node_variable = std::string(family->name) == "slurm" ? "SLURM_NODEID" : "GROUP_RANK";
  if (std::string(family->name) == "torchrun" || std::string(family->name) == "slurm") {
    if (auto node_text = lookup(variables, node_variable)) {
      environment.node_rank = parse_integer(node_variable, *node_text, "an integer machine index >= 0");
      TORCH_CHECK(environment.node_rank >= 0 && environment.node_rank < environment.num_nodes(),
                  "distributed environment: ", node_variable, "=", environment.node_rank, " is outside [0, ",
                  environment.num_nodes(), ") machines (world size ", environment.world_size, " / local world size ",
                  environment.local_world_size, ").");
    }
  }

  if (auto address = lookup(variables, "MASTER_ADDR")) {
    environment.master_addr = *address;
  } else if (auto nodelist = lookup(variables, "SLURM_JOB_NODELIST");
             nodelist && family->name == std::string("slurm")) {
    environment.master_addr = first_host_of_slurm_nodelist(*nodelist);
  } else {
    TORCH_CHECK(environment.num_nodes() == 1, "distributed environment: MASTER_ADDR is not set, but the job spans ",
                environment.num_nodes(), " machines (", family->world_size, "=", environment.world_size, ", ",
                family->local_world_size, "=", environment.local_world_size,
                "). Set MASTER_ADDR to the address of the machine running rank 0 (`fsdp launch --master-addr`).");
  }
  if (auto port_text = lookup(variables, "MASTER_PORT")) {
    int64_t port = parse_integer("MASTER_PORT", *port_text, "a TCP port in [1, 65535]");
    TORCH_CHECK(port >= 1 && port <= 65535, "distributed environment: MASTER_PORT=", port,
                " is not a TCP port; expected [1, 65535]. `fsdp launch --master-port 0` picks a free one.");
    environment.master_port = static_cast<int>(port);
  }
  if (auto agent = lookup(variables, "TORCHELASTIC_USE_AGENT_STORE")) environment.use_agent_store = is_true(*agent);
  return environment;
}

}  // namespace fsdp
