#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <fsdp/collectives.h>
#include <fsdp/sharded_grad_scaler.h>

#include <cmath>
#include <vector>

namespace fsdp {

void validate(const ShardedGradScalerOptions& options) {
  TORCH_CHECK(std::isfinite(options.init_scale) && options.init_scale > 0,
              "ShardedGradScalerOptions.init_scale must be a positive finite number, got ", options.init_scale);
  TORCH_CHECK(std::isfinite(options.growth_factor) && options.growth_factor > 1.0,
              "ShardedGradScalerOptions.growth_factor must be greater than 1, got ", options.growth_factor);
  TORCH_CHECK(options.backoff_factor > 0.0 && options.backoff_factor < 1.0,
              "ShardedGradScalerOptions.backoff_factor must be between 0 and 1 (exclusive), got ",
              options.backoff_factor);
  TORCH_CHECK(options.growth_interval >= 1,
              "ShardedGradScalerOptions.growth_interval must be a positive whole number, got ",
              options.growth_interval);
}

ShardedGradScaler::ShardedGradScaler(ProcessGroup group, ShardedGradScalerOptions options)
    : group_(std::move(group)), options_(options) {
  TORCH_CHECK(group_, "ShardedGradScaler: the process group is empty; pass context.world()");
  validate(options_);
}

void ShardedGradScaler::lazy_init(c10::Device device) {
  if (scale_.defined()) return;
  scale_ = at::full({}, options_.init_scale, at::TensorOptions().dtype(at::kFloat).device(device));
  growth_tracker_ = at::zeros({}, at::TensorOptions().dtype(at::kInt).device(device));
}

ShardedGradScaler::OptimizerState& ShardedGradScaler::state_of(torch::optim::Optimizer& optimizer) {
  return per_optimizer_[&optimizer];
}

at::Tensor ShardedGradScaler::scale(const at::Tensor& outputs) {
  if (!options_.enabled) return outputs;
  TORCH_CHECK(outputs.defined(), "ShardedGradScaler::scale: the tensor is undefined");
  lazy_init(outputs.device());
  // As torch: the product in the outputs' dtype (an fp16 loss stays fp16).
  return (outputs * scale_.to(outputs.device(), /*non_blocking=*/true)).to(outputs.scalar_type());
}

void ShardedGradScaler::unscale_(torch::optim::Optimizer& optimizer) {
  if (!options_.enabled) return;
  TORCH_CHECK(scale_.defined(), "ShardedGradScaler::unscale_: no loss was scaled yet. Call scale(loss).backward() ",
              "before unscale_() or step()");
  auto& state = state_of(optimizer);
  TORCH_CHECK(state.stage != Stage::kUnscaled,
              "ShardedGradScaler::unscale_() has already been called on this optimizer since the last update()");
  TORCH_CHECK(state.stage != Stage::kStepped, "ShardedGradScaler::unscale_() is being called after step()");
  at::NoGradGuard no_grad;
  // The reciprocal in fp64, then fp32: torch's exact inverse scale.
  const auto inverse_scale = scale_.to(at::kDouble).reciprocal().to(at::kFloat);
  // Gradients grouped by device and dtype, each group checked and unscaled by one ATen call.
  std::map<std::string, std::map<at::ScalarType, std::vector<at::Tensor>>> groups;
  std::map<std::string, c10::Device> devices;
  for (auto& group : optimizer.param_groups()) {
    for (auto& parameter : group.params()) {
      const auto& gradient = parameter.grad();
      if (!gradient.defined()) continue;
      TORCH_CHECK(!gradient.is_sparse(), "ShardedGradScaler: sparse gradients are not supported");
      const auto key = gradient.device().str();
      devices.emplace(key, gradient.device());
      groups[key][gradient.scalar_type()].push_back(gradient);
    }
  }
  state.found_inf_per_device.clear();
  for (auto& [key, by_dtype] : groups) {
    const auto device = devices.at(key);
    auto found_inf = at::zeros({1}, at::TensorOptions().dtype(at::kFloat).device(device));
    const auto inverse_on_device = inverse_scale.to(device);
    for (auto& [dtype, gradients] : by_dtype) {
      at::_amp_foreach_non_finite_check_and_unscale_(gradients, found_inf, inverse_on_device);
    }
    state.found_inf_per_device.emplace(key, found_inf);
  }
  // Every rank skips the same steps: the counts are summed over the group (torch all-reduces each
  // device's count with SUM). A rank without gradients contributes zeros on the scale's device, so
  // every rank issues the same collectives.
  if (state.found_inf_per_device.empty()) {
    state.found_inf_per_device.emplace(scale_.device().str(), at::zeros({1}, scale_.options()));
  }
  for (auto& [key, found_inf] : state.found_inf_per_device) all_reduce(group_, found_inf);
  state.stage = Stage::kUnscaled;
}

bool ShardedGradScaler::step(torch::optim::Optimizer& optimizer) {
  if (!options_.enabled) {
    optimizer.step();
    return true;
  }
  auto& state = state_of(optimizer);
  TORCH_CHECK(state.stage != Stage::kStepped,
              "ShardedGradScaler::step() has already been called since the last update()");
  if (state.stage == Stage::kReady) unscale_(optimizer);
  double found = 0;
  for (const auto& [key, found_inf] : state.found_inf_per_device) found += found_inf.item<double>();
  const bool stepped = found == 0;
  if (stepped) optimizer.step();
  state.stage = Stage::kStepped;
  return stepped;
}

void ShardedGradScaler::update(std::optional<double> new_scale) {
  if (!options_.enabled) return;
  TORCH_CHECK(scale_.defined(), "ShardedGradScaler::update: no loss was scaled yet");
  if (new_scale) {
    TORCH_CHECK(std::isfinite(*new_scale) && *new_scale > 0, "ShardedGradScaler::update: new_scale must be a positive ",
                "finite number, got ", *new_scale);
    scale_.fill_(*new_scale);
  } else {
    std::vector<at::Tensor> found_infs;
    for (auto& [optimizer, state] : per_optimizer_) {
      for (auto& [key, found_inf] : state.found_inf_per_device) found_infs.push_back(found_inf.to(scale_.device()));
    }
    TORCH_CHECK(!found_infs.empty(), "ShardedGradScaler::update: no inf checks were recorded before update(); call ",
                "step(optimizer) (or unscale_) first");
    auto combined = found_infs.front().clone();
    for (size_t index = 1; index < found_infs.size(); ++index) combined += found_infs[index];
    at::_amp_update_scale_(scale_, growth_tracker_, combined, options_.growth_factor, options_.backoff_factor,
                           options_.growth_interval);
  }
  per_optimizer_.clear();
}

bool ShardedGradScaler::unscaled(const torch::optim::Optimizer& optimizer) const {
  const auto found = per_optimizer_.find(&optimizer);
  return found != per_optimizer_.end() && found->second.stage == Stage::kUnscaled;
}

double ShardedGradScaler::get_scale() const {
  if (!options_.enabled) return 1.0;
  return scale_.defined() ? scale_.item<double>() : options_.init_scale;
}

int64_t ShardedGradScaler::growth_tracker() const {
  return growth_tracker_.defined() ? growth_tracker_.item<int64_t>() : 0;
}

std::map<std::string, double> ShardedGradScaler::state_dict() const {
  if (!options_.enabled) return {};
  return {{"scale", get_scale()},
          {"growth_factor", options_.growth_factor},
          {"backoff_factor", options_.backoff_factor},
          {"growth_interval", static_cast<double>(options_.growth_interval)},
          {"_growth_tracker", static_cast<double>(growth_tracker())}};
}

void ShardedGradScaler::load_state_dict(const std::map<std::string, double>& state) {
  TORCH_CHECK(options_.enabled, "ShardedGradScaler::load_state_dict: the scaler is disabled");
  TORCH_CHECK(!state.empty(), "ShardedGradScaler::load_state_dict: the state is empty, which a disabled scaler saves");
  for (const char* key : {"scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker"}) {
    TORCH_CHECK(state.count(key), "ShardedGradScaler::load_state_dict: the state has no '", key, "'");
  }
  ShardedGradScalerOptions loaded = options_;
  loaded.init_scale = state.at("scale");
  loaded.growth_factor = state.at("growth_factor");
  loaded.backoff_factor = state.at("backoff_factor");
  loaded.growth_interval = static_cast<int64_t>(state.at("growth_interval"));
  validate(loaded);
  options_ = loaded;
  const auto device = scale_.defined() ? scale_.device() : c10::Device(c10::kCPU);
  scale_ = at::Tensor();
  lazy_init(device);  // the scale from options_.init_scale, which is now the loaded one
  growth_tracker_.fill_(static_cast<int64_t>(state.at("_growth_tracker")));
}

}  // namespace fsdp
