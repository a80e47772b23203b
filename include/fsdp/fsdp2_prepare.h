// The seed's FSDP2 preparation helpers (Accelerate's fsdp_utils.py), for libtorch modules.
#pragma once

#include <ATen/core/Tensor.h>
#include <fsdp/auto_wrap.h>
#include <fsdp/fully_shard.h>
#include <fsdp/plugin.h>
#include <fsdp/process_group.h>
#include <fsdp/state_dict.h>
#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>

#include <memory>
#include <optional>
#include <string>
#include <unordered_map>

namespace fsdp {

/// The fully_shard options the plugin describes (strategy, reshard_after_forward, mixed precision,
/// offload). The root's reshard_after_forward is left unset by fsdp2_prepare_model (FSDP2's None).
FullyShardOptions fully_shard_options_from_plugin(const FullyShardedDataParallelPlugin& plugin);

/// The plugin's policy for `model` (Accelerate's fsdp2_prepare_auto_wrap_policy): class names from
/// transformer_cls_names_to_wrap, else the model's no_split_modules (PretrainedModel); NO_WRAP gives
/// none. Unlike Accelerate, whose FSDP2 path silently ignores a callable (Q9 in docs/plugin.md), a callable
/// policy is applied.
std::optional<AutoWrapCallable> fsdp2_prepare_auto_wrap_policy(const FullyShardedDataParallelPlugin& plugin,
                                                               const std::shared_ptr<torch::nn::Module>& model);

/// Accelerate's fsdp2_prepare_model, in its order (accelerate/utils/fsdp_utils.py): auto-wrap bottom-up, the input
/// embedding and the tail (final norm + output embedding, or the tied embedding) as their own units,
/// then the root. Trainable parameters are upcast to fp32 first when the accelerator uses mixed
/// precision, so the sharded master weights are fp32. Tied weights stay tied. The model is sharded in
/// place and returned. Embeddings and the final norm are found through fsdp::PretrainedModel when the
/// model implements it. With cpu_ram_efficient_loading, rank 0's weights are kept aside and every
/// other rank drops its own before sharding and receives its rows from rank 0, one tensor at a time.
/// With fsdp_version=1 the units are FSDP1's instead: what the policy wraps, then the root, and
/// only the root casts its floating inputs to param_dtype (FSDP1's cast_root_forward_inputs).
/// It reads the accelerator's plugin, its process groups and its mixed_precision ("no", "bf16",
/// "fp16"), which are the arguments here; accelerator.h has Accelerate's form,
/// fsdp2_prepare_model(accelerator, model).
std::shared_ptr<torch::nn::Module> fsdp2_prepare_model(const FullyShardedDataParallelPlugin& plugin,
                                                       const DistributedContext& context,
                                                       const std::string& mixed_precision,
                                                       const std::shared_ptr<torch::nn::Module>& model);

/// Accelerate's fsdp2_load_full_state_dict: `model` is sharded and holds no parameter data yet
/// (see release_parameter_storage); `full_state_dict` matters on rank 0 only. Rank 0 broadcasts
/// the tensors one at a time in state-dict order; each rank keeps its rows, cast to the parameter's
/// dtype, where the engine keeps them (host memory under cpu_offload, else the model's device; the
/// argument is Accelerate's and changes nothing here). Collective. accelerator.h has Accelerate's
/// form, fsdp2_load_full_state_dict(accelerator, model, full_state_dict).
std::shared_ptr<torch::nn::Module> fsdp2_load_full_state_dict(const DistributedContext& context,
                                                              const std::shared_ptr<torch::nn::Module>& model,
                                                              const TensorList& full_state_dict,
                                                              bool cpu_offload = false);

/// Accelerate's fsdp2_switch_optimizer_parameters: replaces every optimizer parameter `p` by
/// `mapping.at(p.data_ptr())`, keeping parameter groups and hyper-parameters. In Accelerator::prepare
/// the optimizer's slots report the original parameters' data pointers. A slot with no entry is an
/// error naming its group and position.
void fsdp2_switch_optimizer_parameters(torch::optim::Optimizer& optimizer,
                                       const std::unordered_map<const void*, at::Tensor>& mapping);

}  // namespace fsdp
