#include <fsdp/accelerator.h>

#include <ATen/ATen.h>

#include <map>
#include <unordered_map>

#include <fsdp/fsdp2_prepare.h>

#include "config/text.h"

namespace fsdp {

Accelerator::Accelerator(DistributedContext context, AcceleratorOptions options, const EnvironmentMap& environment)
    : context_(std::move(context)) {
  if (options.mixed_precision) {
    mixed_precision_ = detail::to_lower(*options.mixed_precision);
  } else {
    auto found = environment.find("ACCELERATE_MIXED_PRECISION");
    mixed_precision_ = found == environment.end() ? "no" : detail::to_lower(found->second);
  }
  TORCH_CHECK(mixed_precision_ == "no" || mixed_precision_ == "bf16" || mixed_precision_ == "fp16",
              "Accelerator: mixed_precision is '", mixed_precision_, "'; expected 'no', 'bf16' or 'fp16'");
  TORCH_CHECK(mixed_precision_ != "fp16",
              "Accelerator: mixed_precision 'fp16' needs half-precision matrix multiplication, which libtorch's CPU "
              "kernels do not implement (addmm for Half); use 'bf16' on CPU");
  plugin_ = options.fsdp_plugin ? *options.fsdp_plugin
                                : FullyShardedDataParallelPlugin(FullyShardedDataParallelPluginArgs{}, environment);
  // As AcceleratorState does: the accelerator's precision fills a plugin that has no policy.
  if (mixed_precision_ != "no") plugin_.set_mixed_precision(mixed_precision_);
}

std::shared_ptr<torch::nn::Module> Accelerator::prepare(const std::shared_ptr<torch::nn::Module>& model,
                                                        torch::optim::Optimizer& optimizer) {
  TORCH_CHECK(model, "Accelerator::prepare: the model is null");
  TORCH_CHECK(optimizer.state().empty(),
              "Accelerator::prepare: the optimizer has already stepped, so its state has the shapes of the full "
              "parameters. Create the optimizer, then prepare it with the model before the first step");
  // Spec §3.4 steps 6-11: remember each optimizer slot's parameter by its data pointer, let the
  // slots point at nothing so sharding can free the full tensors, shard, then map back by name.
  std::unordered_map<std::string, const void*> old_pointers;
  for (const auto& item : model->named_parameters()) old_pointers.emplace(item.key(), item.value().data_ptr());
  for (auto& group : optimizer.param_groups()) {
    for (auto& parameter : group.params()) {
      // A one-element view of the old address that owns nothing; it is only ever compared.
      parameter = at::from_blob(parameter.data_ptr(), {1}, [](void*) {}, parameter.options().requires_grad(false));
    }
  }
  fsdp2_prepare_model(*this, model);
  std::unordered_map<std::string, at::Tensor> new_parameters;
  for (const auto& item : model->named_parameters()) new_parameters.emplace(item.key(), item.value());
  std::unordered_map<const void*, at::Tensor> mapping;
  std::vector<std::string> missing;
  for (const auto& [name, pointer] : old_pointers) {
    auto found = new_parameters.find(name);
    if (found == new_parameters.end()) {
      missing.push_back(name);
    } else {
      mapping.emplace(pointer, found->second);
    }
  }
  if (!missing.empty()) {
    std::string names;
    bool embedding = false;
    for (const auto& name : missing) {
      names += (names.empty() ? "" : ", ") + name;
      embedding |= name == "lm_head.weight" || name == "model.embed_tokens.weight" || name == "transformer.wte.weight";
    }
    TORCH_CHECK(!embedding, "FSDP2 mapping failed (missing: ", names,
                "). This is likely due to tied embeddings (the model ties them but the weights differ). Untie them "
                "in the model, or tie them before prepare");
    TORCH_CHECK(false, "Parameters missing after FSDP2 wrapping: [", names, "]");
  }
  fsdp2_switch_optimizer_parameters(optimizer, mapping);
  model_ = model;
  optimizer_ = &optimizer;
  return model;
}

void Accelerator::save_state(const std::string& directory, const TrainingProgress& progress) {
  TORCH_CHECK(model_ && optimizer_, "Accelerator::save_state: prepare(model, optimizer) first");
  CheckpointOptions options;
  options.state_dict_type = plugin_.state_dict_type;
  save_checkpoint(directory, *model_, *optimizer_, context_, progress, options);
}

TrainingProgress Accelerator::load_state(const std::string& directory) {
  TORCH_CHECK(model_ && optimizer_, "Accelerator::load_state: prepare(model, optimizer) first");
  return load_checkpoint(directory, *model_, *optimizer_, context_);
}

}  // namespace fsdp
