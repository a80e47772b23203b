#include <ATen/ATen.h>
#include <fsdp/clip_grad_norm.h>
#include <fsdp/collectives.h>
#include <fsdp/fully_shard.h>

#include <cmath>
#include <unordered_set>

#include "engine/param_group.h"
#include "engine/registry.h"
#include "engine/root_state.h"

namespace fsdp {

double clip_grad_norm_(torch::nn::Module& model, double max_norm, double norm_type) {
  const auto units = fsdp_modules(model);
  // Errors say which rank raised them when the model is sharded (every rank checks the same values).
  const std::string rank = units.empty() ? std::string() : detail::group_of(units.front()).on_rank();
  TORCH_CHECK(norm_type > 0, rank, "clip_grad_norm_: norm_type must be positive (or infinity), got ", norm_type);
  TORCH_CHECK(max_norm >= 0, rank, "clip_grad_norm_: max_norm must be non-negative, got ", max_norm);
  const bool infinity_norm = std::isinf(norm_type);
  at::NoGradGuard no_grad;
  std::vector<at::Tensor> gradients;
  // Sharded contributions are reduced over the shard group; others (ignored parameters, modules
  // outside every unit) hold the full gradient on every rank and count once. The totals stay tensors
  // on the gradients' device until the end: one host read per call, not one per gradient (on a GPU
  // each would be a sync).
  const c10::Device device = units.empty() ? c10::Device(c10::kCPU) : detail::group_of(units.front()).storage_device();
  const auto scalar_options = at::TensorOptions().dtype(at::kDouble).device(device);
  at::Tensor sharded_total = at::zeros({1}, scalar_options);
  at::Tensor local_total = at::zeros({1}, scalar_options);
  auto accumulate = [&](const at::Tensor& gradient, at::Tensor& total) {
    if (gradient.numel() == 0) return;
    auto as_double = gradient.to(at::kDouble);
    if (infinity_norm) {
      total = at::maximum(total, as_double.abs().max().reshape({1}));
    } else {
      total += as_double.abs().pow(norm_type).sum();
    }
  };
  std::optional<ProcessGroup> shard_group;
  std::unordered_set<const c10::TensorImpl*> managed;
  for (const auto& unit : units) {
    auto& group = detail::group_of(unit);
    if (auto state = detail::root_state_of(group)) {
      TORCH_CHECK(!state->iteration_active(), group.on_rank(),
                  "clip_grad_norm_: a forward of this model has not been followed by its backward yet, so the "
                  "sharded gradients are not in place. Call it after loss.backward()");
    }
    if (group.shard_group()) shard_group = group.shard_group();
    for (const auto& parameter : group.parameters()) {
      managed.insert(parameter.parameter.unsafeGetTensorImpl());
      const auto& gradient = parameter.parameter.grad();
      if (!gradient.defined()) continue;
      accumulate(gradient, sharded_total);
      gradients.push_back(gradient);
    }
  }
  for (const auto& parameter : model.parameters()) {
    if (managed.count(parameter.unsafeGetTensorImpl()) || !parameter.grad().defined()) continue;
    managed.insert(parameter.unsafeGetTensorImpl());
    accumulate(parameter.grad(), local_total);
    gradients.push_back(parameter.grad());
  }
  if (shard_group) all_reduce(*shard_group, sharded_total, infinity_norm ? ReduceOp::kMax : ReduceOp::kSum);
  const auto total =
      infinity_norm ? at::maximum(sharded_total, local_total) : (sharded_total + local_total).pow(1.0 / norm_type);
  const double total_norm = total.item<double>();
  // torch's rule, epsilon included, so clipped values match single-process training.
  const double clip_coefficient = max_norm / (total_norm + 1e-6);
  if (clip_coefficient < 1.0) {
    for (auto& gradient : gradients) gradient.mul_(clip_coefficient);
  }
  return total_norm;
}

}  // namespace fsdp
