// `fsdp env`: what a user pastes into a bug report.
#include <ATen/Parallel.h>
#include <c10/util/Exception.h>
#include <fsdp/device.h>
#include <fsdp/distributed_environment.h>
#include <fsdp/version.h>

#include <iostream>
#include <thread>

#include "cli/commands.h"

namespace fsdp::cli {
namespace {

bool is_reported_variable(const std::string& name) {
  static const std::vector<std::string> prefixes = {"RANK",
                                                    "WORLD_SIZE",
                                                    "LOCAL_RANK",
                                                    "LOCAL_WORLD_SIZE",
                                                    "GROUP_RANK",
                                                    "ROLE_",
                                                    "MASTER_",
                                                    "TORCHELASTIC_",
                                                    "OMPI_COMM_WORLD_",
                                                    "PMI_",
                                                    "MPI_LOCAL",
                                                    "MV2_COMM_WORLD_",
                                                    "SLURM_PROCID",
                                                    "SLURM_NTASKS",
                                                    "SLURM_LOCALID",
                                                    "SLURM_NODEID",
                                                    "SLURM_TASKS_PER_NODE",
                                                    "SLURM_JOB_NODELIST",
                                                    "FSDP_",
                                                    "ACCELERATE_",
                                                    "GLOO_",
                                                    "OMP_NUM_THREADS"};
  for (const auto& prefix : prefixes) {
    if (name.rfind(prefix, 0) == 0) return true;
  }
  return false;
}

}  // namespace

Command add_env_command(CLI::App& parent) {
  CLI::App* app = parent.add_subcommand(
      "env", "Print versions, compiled-in backends, CPU count and the distributed variables this process sees.");
  Command command;
  command.app = app;
  command.run = [] {
    auto variables = current_process_environment();
    std::cout << "fsdp.cpp version:     " << version() << "\n"
              << "libtorch version:     " << torch_version() << "\n"
              << "libtorch CXX11 ABI:   " << (torch_cxx11_abi() ? "1" : "0") << "\n"
              << "libtorch library:     " << torch_library_path() << "\n"
              << "backends:             gloo (CPU); nccl: "
              << (built_with_cuda() ? "yes (CUDA tensors; a CUDA libtorch)" : "not in this build (a CPU-only libtorch)")
              << "; mpi: not in this build\n"
              << "GPUs visible:         " << cuda_device_count() << "\n"
              << "CPU cores:            " << std::thread::hardware_concurrency() << "\n"
              << "intra-op threads:     " << at::get_num_threads() << "\n"
              << "distributed variables:\n";
    bool any = false;
    for (const auto& [name, value] : variables) {
      if (!is_reported_variable(name)) continue;
      std::cout << "  " << name << "=" << value << "\n";
      any = true;
    }
    if (!any) std::cout << "  (none: a single process, world size 1)\n";
    try {
      auto environment = parse_distributed_environment(variables);
      std::cout << "parsed:               launcher=" << environment.launcher << " rank=" << environment.rank
                << " world_size=" << environment.world_size << " local_rank=" << environment.local_rank
                << " local_world_size=" << environment.local_world_size << " node_rank=" << environment.node_rank
                << " master=" << environment.master_addr << ":" << environment.master_port
                << " timeout=" << environment.timeout.count() / 1000.0 << "s\n";
    } catch (const c10::Error& error) {
      std::cout << "parsed:               ERROR: " << error.what_without_backtrace() << "\n";
      std::cout.flush();
      return 1;
    }
    std::cout.flush();
    return 0;
  };
  return command;
}

}  // namespace fsdp::cli
