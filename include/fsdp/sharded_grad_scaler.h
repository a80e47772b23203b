// Loss scaling for fp16 training under FSDP: the role of PyTorch's
// torch.distributed.fsdp.sharded_grad_scaler.ShardedGradScaler.
//
// fp16's range is narrow, so small gradients underflow to zero. The loss is multiplied by a scale
// before backward; the sharded gradients are divided by it before the optimizer step and checked
// for inf and NaN. Each rank holds only its shards, so the "found an inf" flag is summed over the
// group: every rank skips the same step. A skipped step multiplies the scale by backoff_factor; after
// growth_interval steps in a row without one the scale is multiplied by growth_factor. Same
// arithmetic as PyTorch (ATen's _amp_foreach_non_finite_check_and_unscale_ and _amp_update_scale_),
// on CPU and CUDA gradients alike. Accelerator uses one when mixed_precision is "fp16".
#pragma once

#include <ATen/core/Tensor.h>
#include <fsdp/process_group.h>
#include <torch/optim/optimizer.h>

#include <cstdint>
#include <map>
#include <optional>
#include <string>

namespace fsdp {

/// ShardedGradScaler's arguments, with torch's defaults. Check them with `validate`.
struct ShardedGradScalerOptions {
  /// The first scale. Default: 65536 (2^16).
  double init_scale = 65536.0;
  /// Multiplies the scale after growth_interval steps in a row without inf or NaN. Default: 2. > 1.
  double growth_factor = 2.0;
  /// Multiplies the scale after a step with inf or NaN. Default: 0.5. In (0, 1).
  double backoff_factor = 0.5;
  /// Steps without inf or NaN before the scale grows. Default: 2000. >= 1.
  int64_t growth_interval = 2000;
  /// When false every method passes through: scale() returns its input, step() steps. Default: true.
  bool enabled = true;
};

/// Throws c10::Error naming the field when the options cannot work.
void validate(const ShardedGradScalerOptions& options);

class ShardedGradScaler {
 public:
  /// `group`: the ranks whose gradients together make one step (the world, for FSDP and HSDP).
  explicit ShardedGradScaler(ProcessGroup group, ShardedGradScalerOptions options = {});

  /// `outputs` times the scale, in `outputs`' dtype (the scale lives on the device of the first
  /// tensor scaled).
  at::Tensor scale(const at::Tensor& outputs);
  /// Divides the optimizer's gradients by the scale in place and records, summed over the group,
  /// whether any was inf or NaN. Once per optimizer between update()s, before step(); call it
  /// explicitly to clip gradients at their true size. Collective over the group.
  void unscale_(torch::optim::Optimizer& optimizer);
  /// unscale_ (unless already done), then optimizer.step() unless a rank found inf or NaN. Returns
  /// whether the optimizer stepped (the same on every rank). Collective when it unscales.
  bool step(torch::optim::Optimizer& optimizer);
  /// Backs the scale off after a skipped step, or grows it after growth_interval clean ones; with
  /// `new_scale`, sets it instead. Call once per iteration, after step() for every optimizer.
  void update(std::optional<double> new_scale = std::nullopt);
  /// Whether unscale_ has run for `optimizer` since the last update() (its gradients are at their
  /// true size), so a caller that clips can unscale only once.
  bool unscaled(const torch::optim::Optimizer& optimizer) const;

  /// The current scale (1.0 when disabled; init_scale before the first scale()).
  double get_scale() const;
  /// Clean steps since the scale last changed.
  int64_t growth_tracker() const;
  bool is_enabled() const { return options_.enabled; }
  const ShardedGradScalerOptions& options() const { return options_; }

  /// torch's state_dict: scale, growth_factor, backoff_factor, growth_interval, _growth_tracker.
  std::map<std::string, double> state_dict() const;
  void load_state_dict(const std::map<std::string, double>& state);

 private:
  enum class Stage { kReady, kUnscaled, kStepped };
  struct OptimizerState {
    Stage stage = Stage::kReady;
    /// One "found inf" count per gradient device, summed over the group.
    std::map<std::string, at::Tensor> found_inf_per_device;
  };
  void lazy_init(c10::Device device);
  OptimizerState& state_of(torch::optim::Optimizer& optimizer);

  ProcessGroup group_;
  ShardedGradScalerOptions options_;
  at::Tensor scale_;           // float32, 0-dim
  at::Tensor growth_tracker_;  // int32, 0-dim
  std::map<const torch::optim::Optimizer*, OptimizerState> per_optimizer_;
};

}  // namespace fsdp
