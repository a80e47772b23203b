#include "memory/device.h"

#include <ATen/ATen.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <fsdp/device.h>

#ifdef FSDP_WITH_CUDA
#include <c10/cuda/CUDACachingAllocator.h>
#endif

#include <cstdlib>
#include <map>
#include <mutex>
#include <string>
#include <utility>

namespace fsdp {

bool built_with_cuda() {
#ifdef FSDP_WITH_CUDA
  return true;
#else
  return false;
#endif
}

int64_t cuda_device_count() {
  if (!built_with_cuda() || !c10::impl::hasDeviceGuardImpl(c10::kCUDA)) return 0;
  return static_cast<int64_t>(c10::impl::getDeviceGuardImpl(c10::kCUDA)->deviceCount());
}

c10::Device default_device(int64_t local_rank) {
  const char* requested = std::getenv("FSDP_DEVICE");
  const std::string choice = requested == nullptr ? "" : requested;
  TORCH_CHECK(choice.empty() || choice == "cpu" || choice == "cuda", "FSDP_DEVICE='", choice,
              "' is not a device fsdp.cpp computes on; expected 'cpu' or 'cuda' (or unset: a GPU when one is "
              "visible).");
  if (choice == "cpu") return c10::Device(c10::kCPU);
  const int64_t count = cuda_device_count();
  if (count == 0) {
    TORCH_CHECK(choice != "cuda", "[local rank ", local_rank, "] FSDP_DEVICE=cuda but ",
                built_with_cuda() ? "this process sees no GPU (check the driver, nvidia-smi and CUDA_VISIBLE_DEVICES)"
                                  : "this build of fsdp.cpp has no GPU path: build it against a CUDA libtorch "
                                    "(README, 'The GPU path')",
                ". Unset FSDP_DEVICE to compute on CPU.");
    return c10::Device(c10::kCPU);
  }
  TORCH_CHECK(local_rank >= 0 && local_rank < count, "[local rank ", local_rank, "] this machine's ranks get one GPU ",
              "each, but the process sees ", count, " GPU", count == 1 ? "" : "s", ", so local rank ", local_rank,
              " has none (NCCL refuses two ranks on one GPU). Start at most ", count,
              " ranks per machine (fsdp launch --nproc-per-node ", count,
              "), check CUDA_VISIBLE_DEVICES, or set FSDP_DEVICE=cpu.");
  return c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(local_rank));
}

namespace {
void check_gpu(c10::Device device, const char* function) {
  TORCH_CHECK(device.is_cuda() && built_with_cuda(), function, ": ", device,
              " is not a GPU of this build; the caching allocator's statistics are a CUDA build's, for CUDA devices");
}
}  // namespace

int64_t peak_device_memory_bytes(c10::Device device) {
  check_gpu(device, "peak_device_memory_bytes");
#ifdef FSDP_WITH_CUDA
  const auto stats = c10::cuda::CUDACachingAllocator::getDeviceStats(device.index());
  // Entry 0 is StatType::AGGREGATE (all pools), whose namespace moved between libtorch releases.
  return stats.allocated_bytes[0].peak;
#else
  return 0;
#endif
}

void reset_peak_device_memory(c10::Device device) {
  check_gpu(device, "reset_peak_device_memory");
#ifdef FSDP_WITH_CUDA
  c10::cuda::CUDACachingAllocator::resetPeakStats(device.index());
#endif
}

namespace detail {

bool has_streams(c10::Device device) { return !device.is_cpu() && !device.is_meta(); }

c10::Stream current_stream(c10::Device device) { return c10::impl::VirtualGuardImpl(device.type()).getStream(device); }

c10::Stream side_stream(c10::Device device, SideStream kind) {
  TORCH_INTERNAL_ASSERT(has_streams(device), "side streams are for GPUs, not ", device);
  static std::mutex mutex;
  static auto* streams = new std::map<std::pair<std::string, int>, c10::Stream>();
  std::lock_guard<std::mutex> lock(mutex);
  const auto key = std::make_pair(device.str(), static_cast<int>(kind));
  auto found = streams->find(key);
  if (found == streams->end()) {
    // A new stream, not one from the pool that other code may also be handed: the unit's ordering
    // assumes it is alone on it.
    const c10::impl::VirtualGuardImpl impl(device.type());
    found = streams->emplace(key, impl.getNewStream(device)).first;
  }
  return found->second;
}

void stream_wait_stream(const c10::Stream& waiter, const c10::Stream& producer) {
  if (waiter == producer) return;
  c10::Event event(producer.device_type());
  event.record(producer);
  event.block(waiter);
}

void record_stream(const at::Tensor& tensor, const c10::Stream& stream) {
  if (!tensor.defined() || !has_streams(tensor.device())) return;
  c10::impl::VirtualGuardImpl(tensor.device().type()).recordDataPtrOnStream(tensor.storage().data_ptr(), stream);
}

StreamScope::StreamScope(std::optional<c10::Stream> stream) {
  if (!stream || !has_streams(stream->device())) return;
  previous_ = c10::impl::VirtualGuardImpl(stream->device_type()).exchangeStream(*stream);
}

StreamScope::~StreamScope() {
  if (previous_) c10::impl::VirtualGuardImpl(previous_->device_type()).exchangeStream(*previous_);
}

at::Tensor empty_host(at::IntArrayRef sizes, c10::ScalarType dtype, bool pin_memory) {
  auto options = at::TensorOptions().dtype(dtype).device(c10::kCPU);
  if (pin_memory && cuda_device_count() > 0) options = options.pinned_memory(true);
  return at::empty(sizes, options);
}

}  // namespace detail
}  // namespace fsdp
