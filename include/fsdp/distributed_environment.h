// Where this process sits in a distributed job, as told by its launcher's environment variables.
//
// Parsing is pure: it takes a map of variables, so tests and `fsdp env` can feed it anything. It
// understands torchrun (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK, MASTER_ADDR,
// MASTER_PORT, TORCHELASTIC_USE_AGENT_STORE), Open MPI (OMPI_COMM_WORLD_*), MPICH / Intel MPI
// (PMI_RANK, PMI_SIZE, MPI_LOCALRANKID, MPI_LOCALNRANKS), MVAPICH2 (MV2_COMM_WORLD_*) and Slurm
// (SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID, SLURM_NTASKS_PER_NODE / SLURM_TASKS_PER_NODE,
// SLURM_NODEID, SLURM_JOB_NODELIST). torchrun's variables win when present; the families are never
// mixed. With no variables at all the process is world size 1 and needs no network.
#pragma once

#include <chrono>
#include <cstdint>
#include <map>
#include <string>

namespace fsdp {

using EnvironmentMap = std::map<std::string, std::string>;

/// The variables of this process, as a map.
EnvironmentMap current_process_environment();

/// One process's place in the job. Fields are validated by `parse_distributed_environment`.
struct DistributedEnvironment {
  /// Global rank of this process, in [0, world_size). Default: 0.
  int64_t rank = 0;
  /// Number of processes in the job. Default: 1.
  int64_t world_size = 1;
  /// Rank of this process on its machine, in [0, local_world_size). Default: 0.
  int64_t local_rank = 0;
  /// Number of processes on this machine. Default: 1.
  int64_t local_world_size = 1;
  /// Index of this machine (torchrun's GROUP_RANK). Default: rank / local_world_size.
  int64_t node_rank = 0;
  /// Host of the rendezvous store (hosted by rank 0). Default: 127.0.0.1 on a single machine.
  std::string master_addr = "127.0.0.1";
  /// Port of the rendezvous store. Default: 29500, as torchrun.
  int master_port = 29500;
  /// torchrun's elastic agent already hosts the store: every rank connects as a client.
  bool use_agent_store = false;
  /// Which launcher's variables were read: "none", "torchrun", "openmpi", "mpich", "mvapich2", "slurm".
  std::string launcher = "none";
  /// Timeout for rendezvous and for every collective (FSDP_COLLECTIVE_TIMEOUT, seconds). Default: 300 s.
  std::chrono::milliseconds timeout = std::chrono::seconds(300);
  /// Whether every collective carries the header that names ranks which issued different
  /// collectives (FSDP_CHECK_COLLECTIVES: 1 or 0; Note [Collective check] in docs/design.md).
  /// Default: true. Off, a divergence is a timeout naming the collective, never an exchange of
  /// another collective's bytes; it exists to measure the check's cost.
  bool check_collectives = true;
  /// How many times the launcher has restarted the job's processes after a failure
  /// (TORCHELASTIC_RESTART_COUNT, as torchrun exports it; `fsdp launch --max-restarts`). A program
  /// that sees it above 0 resumes from its latest complete checkpoint (Accelerator::resume_after_restart).
  /// Default: 0.
  int64_t restart_count = 0;
  /// The most restarts the launcher will make (TORCHELASTIC_MAX_RESTARTS). Default: 0.
  int64_t max_restarts = 0;

  bool is_distributed() const { return world_size > 1; }
  int64_t num_nodes() const { return world_size / local_world_size; }
};

/// Default collective timeout: long enough for a slow checkpoint on rank 0, short enough that a
/// dead or missing peer is reported instead of hanging "forever" (PyTorch's default is 30 min).
inline constexpr std::chrono::seconds kDefaultCollectiveTimeout{300};

/// Reads the job layout from `variables`. Throws c10::Error naming the variable, its value, what was
/// expected and how to fix it when a variable is missing, malformed or inconsistent.
DistributedEnvironment parse_distributed_environment(const EnvironmentMap& variables);

/// The first host of a Slurm node list such as "node[01-04,07],gpu9" -> "node01".
std::string first_host_of_slurm_nodelist(const std::string& nodelist);

}  // namespace fsdp
