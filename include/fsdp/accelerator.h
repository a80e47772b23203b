// Accelerator: the object a training script holds (Accelerate's `Accelerator`, FSDP parts).
//
// It owns the process groups and the resolved plugin, and prepares a model and its optimizer
// together (FSDP2's `prepare`, spec §3.4): the model is sharded in place and the optimizer is
// switched to the sharded parameters, keeping its parameter groups and hyper-parameters.
#pragma once

#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>

#include <memory>
#include <optional>
#include <string>

#include <fsdp/checkpoint.h>
#include <fsdp/plugin.h>
#include <fsdp/process_group.h>

namespace fsdp {

struct AcceleratorOptions {
  /// "no", "fp16", "bf16" (Accelerate's mixed_precision). Unset: ACCELERATE_MIXED_PRECISION, else "no".
  std::optional<std::string> mixed_precision;
  /// The FSDP configuration. Unset: resolved from the FSDP_* environment variables.
  std::optional<FullyShardedDataParallelPlugin> fsdp_plugin;
};

class Accelerator {
 public:
  explicit Accelerator(DistributedContext context, AcceleratorOptions options = {},
                       const EnvironmentMap& environment = current_process_environment());

  const DistributedContext& context() const { return context_; }
  FullyShardedDataParallelPlugin& fsdp_plugin() { return plugin_; }
  const FullyShardedDataParallelPlugin& fsdp_plugin() const { return plugin_; }
  /// "no", "fp16" or "bf16".
  const std::string& mixed_precision() const { return mixed_precision_; }
  bool is_main_process() const { return context_.is_main_process(); }
  int64_t process_index() const { return context_.rank(); }
  int64_t num_processes() const { return context_.world_size(); }

  /// Shards `model` in place (fsdp2_prepare_model) and switches `optimizer`'s parameters to the
  /// sharded ones. The optimizer must not have stepped yet. Collective: every rank calls it.
  std::shared_ptr<torch::nn::Module> prepare(const std::shared_ptr<torch::nn::Module>& model,
                                             torch::optim::Optimizer& optimizer);
  template <typename ModuleHolder>
  ModuleHolder prepare(ModuleHolder model, torch::optim::Optimizer& optimizer) {
    prepare(std::shared_ptr<torch::nn::Module>(model.ptr()), optimizer);
    return model;
  }

  /// Saves the prepared model and optimizer with the plugin's state_dict_type, plus `progress`
  /// (Accelerate's save_state; layout in checkpoint.h). The optimizer passed to prepare must still
  /// exist. Collective.
  void save_state(const std::string& directory, const TrainingProgress& progress = {});
  /// Restores what save_state wrote and returns the progress. Collective.
  TrainingProgress load_state(const std::string& directory);

 private:
  DistributedContext context_;
  FullyShardedDataParallelPlugin plugin_;
  std::string mixed_precision_;
  std::shared_ptr<torch::nn::Module> model_;
  torch::optim::Optimizer* optimizer_ = nullptr;
};

}  // namespace fsdp
