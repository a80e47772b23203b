// Note [The GPU path] (docs/design.md): the NCCL half of a group, for CUDA tensors. CMake compiles
// this file into a build against a CUDA libtorch and no_nccl.cpp into any other.
#include <c10/core/DeviceGuard.h>

#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>

#include "dist/c10d/internal.h"

namespace fsdp::detail {
namespace {

// The NCCL group of `group` for a collective on `tensor`'s GPU, made on first use, with that GPU
// current, so NCCL binds this rank's communicator to its own GPU.
c10d::ProcessGroupNCCL& nccl(ProcessGroupState& group, const at::Tensor& tensor) {
  auto& backend = *group.backend;
  const auto& members = *group.members;
  if (!backend.nccl) {
    auto options = c10d::ProcessGroupNCCL::Options::create();
    options->timeout = members.timeout;
    auto store = c10::make_intrusive<c10d::PrefixStore>("nccl", backend.store);
    try {
      backend.nccl = c10::make_intrusive<c10d::ProcessGroupNCCL>(store, static_cast<int>(members.rank),
                                                                 static_cast<int>(members.size), options);
    } catch (const std::exception& error) {
      TORCH_CHECK(false, "[rank ", members.global_rank, "] creating the NCCL group of '", members.name, "' (",
                  members.size, " ranks) for a collective on ", tensor.device(), " failed: ", error.what(),
                  ". Every rank needs a GPU of its own (one per LOCAL_RANK) and a working NCCL; NCCL_DEBUG=INFO "
                  "says more.");
    }
  }
  return static_cast<c10d::ProcessGroupNCCL&>(*backend.nccl);
}

}  // namespace

bool gpu_path_built() { return true; }

c10::intrusive_ptr<c10d::Work> nccl_all_gather(ProcessGroupState& group, at::Tensor output, at::Tensor input) {
  const c10::DeviceGuard device_guard(input.device());
  return nccl(group, input)._allgather_base(output, input);
}

c10::intrusive_ptr<c10d::Work> nccl_reduce_scatter(ProcessGroupState& group, at::Tensor output, at::Tensor input,
                                                   const c10d::ReduceScatterOptions& options) {
  const c10::DeviceGuard device_guard(input.device());
  return nccl(group, input)._reduce_scatter_base(output, input, options);
}

c10::intrusive_ptr<c10d::Work> nccl_all_reduce(ProcessGroupState& group, std::vector<at::Tensor>& tensors,
                                               const c10d::AllreduceOptions& options) {
  const c10::DeviceGuard device_guard(tensors.front().device());
  return nccl(group, tensors.front()).allreduce(tensors, options);
}

c10::intrusive_ptr<c10d::Work> nccl_broadcast(ProcessGroupState& group, std::vector<at::Tensor>& tensors,
                                              const c10d::BroadcastOptions& options) {
  const c10::DeviceGuard device_guard(tensors.front().device());
  return nccl(group, tensors.front()).broadcast(tensors, options);
}

}  // namespace fsdp::detail
