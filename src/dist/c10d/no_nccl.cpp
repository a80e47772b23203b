// A build without the GPU path (a CPU libtorch, or FSDP_CUDA=OFF): CMake compiles this file instead
// of nccl.cpp. The collectives refuse non-CPU tensors before they get here (check_buffer), so these
// are never reached.
#include "dist/c10d/internal.h"

namespace fsdp::detail {
namespace {

[[noreturn]] void unreachable(const char* operation) {
  TORCH_INTERNAL_ASSERT(false, operation, " reached the NCCL path of a build without one");
}

}  // namespace

bool gpu_path_built() { return false; }

c10::intrusive_ptr<c10d::Work> nccl_all_gather(ProcessGroupState&, at::Tensor, at::Tensor) {
  unreachable("all_gather");
}
c10::intrusive_ptr<c10d::Work> nccl_reduce_scatter(ProcessGroupState&, at::Tensor, at::Tensor,
                                                   const c10d::ReduceScatterOptions&) {
  unreachable("reduce_scatter");
}
c10::intrusive_ptr<c10d::Work> nccl_all_reduce(ProcessGroupState&, std::vector<at::Tensor>&,
                                               const c10d::AllreduceOptions&) {
  unreachable("all_reduce");
}
c10::intrusive_ptr<c10d::Work> nccl_broadcast(ProcessGroupState&, std::vector<at::Tensor>&,
                                              const c10d::BroadcastOptions&) {
  unreachable("broadcast");
}

}  // namespace fsdp::detail
