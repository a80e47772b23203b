// Gradient clipping over sharded gradients.
#pragma once

#include <torch/nn/module.h>

#include <limits>

namespace fsdp {

/// Clips the gradients of every parameter of `model` so that their global norm is at most
/// `max_norm`, and returns the global norm before clipping, exactly as single-process
/// `torch::nn::utils::clip_grad_norm_` would on the unsharded gradients: shards are summed over the
/// shard group (each rank owns distinct rows), replicas are not counted twice, and parameters that
/// no unit manages contribute once. `norm_type` is any p > 0 or infinity. Call it on every rank,
/// after backward and before the optimizer step.
double clip_grad_norm_(torch::nn::Module& model, double max_norm, double norm_type = 2.0);

}  // namespace fsdp
