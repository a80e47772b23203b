// What Accelerate's save_state writes beside the model and the optimizer, read without Python:
// `random_states_<rank>.pkl` is torch.save of {"step", "random_state" (Python's random module),
// "numpy_random_seed", "torch_manual_seed", "torch_cuda_manual_seed", ...}
// (Accelerate's save_accelerator_state, accelerate/checkpointing.py). fsdp.cpp restores the step and the
// torch CPU generator, and names what it cannot restore (Python's and NumPy's generators, device
// generators), so that a resumed run says what differs instead of skipping it silently. The pickle
// is read with the restricted unpickler (Note [a restricted unpickler]): NumPy's classes are
// allowed as names only, never built.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <string>
#include <vector>

namespace fsdp::detail {

struct AccelerateRandomStates {
  /// Accelerator.step (its counter of gradient-accumulation micro-steps), -1 when absent.
  int64_t step = -1;
  /// torch.get_rng_state(): the CPU generator's state (uint8), undefined when absent.
  at::Tensor torch_cpu_state;
  /// The file holds NumPy's generator ("numpy_random_seed"), as Accelerate's do and fsdp.cpp's never.
  bool holds_numpy_generator = false;
  /// Entries held but not restorable here ("numpy_random_seed (NumPy's generator)", ...).
  std::vector<std::string> not_restored;
};

/// Reads `path` (a torch.save zip of at most 64 MiB); a damaged file or an unexpected structure is
/// an error naming the file and the entry.
AccelerateRandomStates read_accelerate_random_states(const std::string& path);

}  // namespace fsdp::detail
