// State dicts of sharded models and their optimizers (PyTorch's get/set_model_state_dict and
// get/set_optimizer_state_dict with FSDP, FSDP1's LOCAL_STATE_DICT).
//
// Keys are the user's fully-qualified names (`model->named_parameters()` and `named_buffers()`), never
// engine-internal ones. A tied weight appears once, under its first name (as Hugging Face saves it);
// loading accepts it under any of its names. Optimizer state is keyed by parameter name, as FSDP's
// optim_state_dict: "state.<parameter>.<field>" tensors plus the parameter groups.
#pragma once

#include <ATen/core/Tensor.h>
#include <fsdp/meta_device.h>  // release_parameter_storage, the form a rank-0 load fills
#include <fsdp/process_group.h>
#include <fsdp/state_dict_options.h>
#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>

#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace fsdp {

using TensorList = std::vector<std::pair<std::string, at::Tensor>>;

/// This rank's rows (dim 0) of one tensor of a state dict.
struct ShardedTensor {
  /// The rows this rank holds (unpadded), or the whole tensor when `replicated`.
  at::Tensor local;
  std::vector<int64_t> global_shape;
  /// First row of `local` in the full tensor.
  int64_t row_offset = 0;
  /// Every rank holds the whole tensor (buffers, unmanaged and NO_SHARD parameters, optimizer steps).
  bool replicated = false;
  /// Another rank holds the same rows (a replica under HYBRID_SHARD); writers skip this copy.
  bool duplicate = false;
};
using ShardedTensorList = std::vector<std::pair<std::string, ShardedTensor>>;

/// Where a loader finds full tensors by name: a state dict in memory, a sharded checkpoint directory,
/// safetensors files. `rows` returns rows [row_begin, row_begin + row_count) of dim 0 (of a 0-dim
/// tensor: its one row).
class TensorSource {
 public:
  virtual ~TensorSource() = default;
  virtual bool contains(const std::string& name) const = 0;
  virtual std::vector<int64_t> shape(const std::string& name) const = 0;
  virtual at::Tensor rows(const std::string& name, int64_t row_begin, int64_t row_count) const = 0;
  virtual size_t size() const = 0;
  /// Names the source in errors ("state dict", "checkpoint directory 'x'").
  virtual std::string description() const = 0;
};

/// A TensorSource over tensors in memory.
class TensorListSource : public TensorSource {
 public:
  explicit TensorListSource(TensorList tensors, std::string description = "the state dict");
  bool contains(const std::string& name) const override;
  std::vector<int64_t> shape(const std::string& name) const override;
  at::Tensor rows(const std::string& name, int64_t row_begin, int64_t row_count) const override;
  size_t size() const override { return tensors_.size(); }
  std::string description() const override { return description_; }

 private:
  const at::Tensor& find(const std::string& name) const;
  TensorList tensors_;
  std::string description_;
};

// ---------------------------------------------------------------------------------------------
// Model

/// The full tensors of every parameter and buffer. Gathered unit by unit; with `config.rank0_only`
/// only rank 0 keeps them (other ranks get an empty list). CPU copies. Collective.
TensorList full_model_state_dict(torch::nn::Module& model, const StateDictConfig& config);
/// This rank's rows of every parameter and buffer (copies). No communication.
ShardedTensorList sharded_model_state_dict(torch::nn::Module& model);
/// FSDP1's LOCAL_STATE_DICT: per unit, "<unit>.flat_param" = its parameters' padded shards back to back
/// (original dtype; every dtype of the unit must agree), plus the buffers. Same world size to load.
TensorList local_model_state_dict(torch::nn::Module& model);

/// Loads full tensors into the sharded model: each rank copies its rows from `source`, which every
/// rank has. A name missing from the source, or a shape that differs, is an error naming it.
void load_model_state_dict(torch::nn::Module& model, const TensorSource& source);
/// The same when only rank 0 has the tensors (`source` is ignored elsewhere and may be null):
/// rank 0 broadcasts one tensor at a time in state-dict order and every rank keeps its rows, so
/// no rank holds more than one full tensor beyond its shards. Returns the largest number of bytes
/// this rank held for a broadcast. Collective over `context.world()`.
int64_t load_model_state_dict_from_rank0(torch::nn::Module& model, const DistributedContext& context,
                                         const TensorSource* source);
/// Loads what local_model_state_dict wrote, on the same world size and wrapping.
void load_local_model_state_dict(torch::nn::Module& model, const TensorList& state);

// ---------------------------------------------------------------------------------------------
// Optimizer

/// The key of `parameter` in torch::optim::Optimizer::state(): libtorch keys it by the parameter's
/// TensorImpl.
inline void* optimizer_state_key(const at::Tensor& parameter) { return parameter.unsafeGetTensorImpl(); }

/// An optimizer's state keyed by parameter name.
struct OptimizerStateDict {
  /// "AdamW", "Adam", "SGD", "Adagrad" or "RMSprop".
  std::string optimizer;
  /// "state.<parameter>.<field>" -> tensor (steps are 0-dim float tensors, as PyTorch stores them).
  ShardedTensorList tensors;
  /// The parameter groups as JSON: [{"lr": ..., <hyper-parameters>, "params": [names]}].
  std::string param_groups_json;
};

/// Full state tensors (gathered like the parameters; on rank 0 only with `config.rank0_only`, where
/// other ranks get tensors = {}). Collective.
OptimizerStateDict full_optimizer_state_dict(torch::nn::Module& model, torch::optim::Optimizer& optimizer,
                                             const StateDictConfig& config);
/// This rank's rows of every state tensor. No communication.
OptimizerStateDict sharded_optimizer_state_dict(torch::nn::Module& model, torch::optim::Optimizer& optimizer);
/// Restores state and hyper-parameters: every rank reads its rows from `tensors`. The optimizer's
/// parameters must be the model's, in groups of the same names.
void load_optimizer_state_dict(torch::nn::Module& model, torch::optim::Optimizer& optimizer,
                               const std::string& optimizer_type, const std::string& param_groups_json,
                               const TensorSource& tensors);

/// The same when only rank 0 holds the state dict (FULL with rank0_only; `state` is ignored elsewhere
/// and may be null): rank 0 broadcasts one tensor at a time and every rank keeps its rows, so no rank
/// but 0 reads the file or holds more than one full tensor beyond its rows. Collective over
/// `context.world()`.
void load_optimizer_state_dict_from_rank0(torch::nn::Module& model, torch::optim::Optimizer& optimizer,
                                          const DistributedContext& context, const OptimizerStateDict* state);

/// The optimizer state dict as PyTorch's optimizer.state_dict() format keyed by names
/// ({"state": {name: {field: tensor}}, "param_groups": [...]}), for torch.save files.
c10::IValue optimizer_state_dict_to_ivalue(const OptimizerStateDict& state);
/// The inverse; `source` names the file in errors.
OptimizerStateDict optimizer_state_dict_from_ivalue(const c10::IValue& value, const std::string& source);

}  // namespace fsdp
