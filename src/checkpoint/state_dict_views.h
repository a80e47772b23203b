// Private: the SHARDED state dicts as views of the shards instead of copies, for save_checkpoint,
// which writes them at once while nothing changes the parameters or the optimizer state (the
// public sharded_model_state_dict and sharded_optimizer_state_dict return copies a caller may
// keep). At the size of a model that does not fit one process the copies cost a second copy of
// the rank's whole training state in memory and a pass over it (bench/README.md, large model).
// And the full state dict a tensor at a time, for a writer that never holds all of it.
// Implemented in state_dict.cpp.
#pragma once

#include <fsdp/state_dict.h>

#include <memory>
#include <string>
#include <vector>

namespace fsdp::detail {

ShardedTensorList sharded_model_state_dict_views(torch::nn::Module& model);
OptimizerStateDict sharded_optimizer_state_dict_views(torch::nn::Module& model, torch::optim::Optimizer& optimizer);

/// full_model_state_dict one tensor at a time, for writers that stream it into a file
/// (Accelerator::save_model): the names, dtypes and shapes are known on every rank without
/// communication, and gather(i) all-gathers entry i, so the rank that writes holds one full tensor
/// at a time instead of the whole model (Note [a full state dict one tensor at a time]).
class FullModelTensors {
 public:
  struct Entry {
    std::string name;
    c10::ScalarType dtype;
    std::vector<int64_t> shape;
  };
  /// Reshards every unit (as full_model_state_dict). No communication.
  FullModelTensors(torch::nn::Module& model, const StateDictConfig& config);
  ~FullModelTensors();
  /// In full_model_state_dict's order, a tied weight once under its first name.
  const std::vector<Entry>& entries() const { return entries_; }
  /// Entry `index`, full. Collective over the unit's shard group: every rank calls it for the same
  /// indices in the same order. Undefined on the ranks that do not keep it (config.rank0_only).
  at::Tensor gather(size_t index);

 private:
  struct Tensors;
  std::unique_ptr<Tensors> tensors_;
  std::vector<Entry> entries_;
  bool keep_ = true;
  bool offload_ = false;
};

}  // namespace fsdp::detail
