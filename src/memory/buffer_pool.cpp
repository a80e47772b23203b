#include "memory/buffer_pool.h"

#include <ATen/ATen.h>
#include <c10/core/CPUAllocator.h>
#include <c10/core/DeviceGuard.h>

#include <deque>
#include <mutex>
#include <vector>

namespace fsdp::detail {
namespace {

struct FreeBlock {
  int64_t nbytes;
  at::DataPtr block;
};

struct BusyBlock {
  at::Tensor tensor;
  std::function<bool()> is_complete;
};

struct Pool {
  std::mutex mutex;
  std::deque<FreeBlock> free_blocks;   // oldest first
  std::vector<BusyBlock> busy_blocks;  // Note [a block returns after its last use]
};

Pool& pool() {
  static Pool instance;
  return instance;
}

void add_free_block(Pool& state, at::DataPtr block, int64_t nbytes) {
  // Device memory goes back to the device's caching allocator, which reuses it in stream order
  // (Note [streams of a unit], src/memory/device.h); the pool keeps host blocks only.
  if (block.device().type() != c10::kCPU) return;
  state.free_blocks.push_back(FreeBlock{nbytes, std::move(block)});
  if (state.free_blocks.size() > kMaxKeptBlocks) state.free_blocks.pop_front();  // freed here
}

// Moves the blocks whose work has completed to the free list. Called with the mutex held.
void poll_busy_blocks(Pool& state) {
  auto& busy = state.busy_blocks;
  for (size_t index = 0; index < busy.size();) {
    if (!busy[index].is_complete()) {
      ++index;
      continue;
    }
    int64_t nbytes = 0;
    auto block = take_storage_memory(busy[index].tensor, &nbytes);
    busy[index] = std::move(busy.back());
    busy.pop_back();
    if (block) add_free_block(state, std::move(block), nbytes);
  }
}

}  // namespace

at::DataPtr take_pooled_block(int64_t nbytes, c10::Device device) {
  if (!device.is_cpu()) {
    // From the device's caching allocator, on the current stream: the pool keeps no device blocks.
    const c10::DeviceGuard guard(device);
    return c10::GetAllocator(device.type())->allocate(static_cast<size_t>(nbytes));
  }
  {
    auto& state = pool();
    std::lock_guard<std::mutex> lock(state.mutex);
    poll_busy_blocks(state);
    for (auto it = state.free_blocks.rbegin(); it != state.free_blocks.rend(); ++it) {
      if (it->nbytes != nbytes) continue;
      auto block = std::move(it->block);
      state.free_blocks.erase(std::next(it).base());
      return block;
    }
  }
  return c10::GetCPUAllocator()->allocate(static_cast<size_t>(nbytes));
}

void return_pooled_block(at::DataPtr block, int64_t nbytes) {
  if (!block) return;
  auto& state = pool();
  std::lock_guard<std::mutex> lock(state.mutex);
  add_free_block(state, std::move(block), nbytes);
}

at::Tensor pooled_bytes(int64_t nbytes, c10::Device device) {
  c10::Storage storage(c10::Storage::use_byte_size_t(), static_cast<size_t>(nbytes), take_pooled_block(nbytes, device),
                       /*allocator=*/nullptr, /*resizable=*/false);
  return at::empty({0}, at::TensorOptions().dtype(at::kByte).device(device)).set_(storage, 0, {nbytes}, {1});
}

at::DataPtr take_storage_memory(const at::Tensor& tensor, int64_t* nbytes) {
  auto* storage = tensor.storage().unsafeGetStorageImpl();
  if (nbytes) *nbytes = static_cast<int64_t>(storage->nbytes());
  auto memory = storage->set_data_ptr(at::DataPtr(nullptr, tensor.device()));
  storage->set_nbytes(0);
  return memory;
}

void return_pooled_bytes(const at::Tensor& tensor) {
  if (!tensor.defined()) return;
  int64_t nbytes = 0;
  auto block = take_storage_memory(tensor, &nbytes);
  return_pooled_block(std::move(block), nbytes);
}

void return_pooled_bytes_after(const at::Tensor& tensor, std::function<bool()> is_complete) {
  if (!tensor.defined()) return;
  if (!is_complete || is_complete()) {
    return_pooled_bytes(tensor);
    return;
  }
  auto& state = pool();
  std::lock_guard<std::mutex> lock(state.mutex);
  state.busy_blocks.push_back(BusyBlock{tensor, std::move(is_complete)});
}

int64_t pooled_busy_bytes() {
  auto& state = pool();
  std::lock_guard<std::mutex> lock(state.mutex);
  poll_busy_blocks(state);
  int64_t total = 0;
  for (const auto& busy : state.busy_blocks) total += static_cast<int64_t>(busy.tensor.storage().nbytes());
  return total;
}

int64_t pooled_free_bytes() {
  auto& state = pool();
  std::lock_guard<std::mutex> lock(state.mutex);
  poll_busy_blocks(state);
  int64_t total = 0;
  for (const auto& free_block : state.free_blocks) total += free_block.nbytes;
  return total;
}

}  // namespace fsdp::detail
