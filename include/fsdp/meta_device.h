// Building a model on the meta device and giving it values later: PyTorch's
// `with torch.device("meta")`, `Module.to_empty` and `reset_parameters()` for libtorch modules.
//
// Note [building on the meta device]
// libtorch has no default device, so `torch::nn::Linear(4096, 4096)` always allocates its weight on
// CPU and initializes it. MetaDeviceGuard makes every tensor created on its thread a meta tensor
// (shape and dtype, no memory) by adding the Meta backend to the thread's included dispatch keys
// and excluding BackendSelect, the step that would otherwise pick CPU from a factory's options:
// factories then reach their meta kernels, and the in-place initializers a module runs in its
// constructor (uniform_, normal_, fill_) are no-ops on meta tensors. A whole model so built holds
// no parameter memory. Later, a meta tensor becomes a real one *in place*: its TensorImpl takes over
// a fresh CPU tensor's storage and metadata (what `Tensor::set_data` does, whose check refuses a
// meta-to-CPU swap), so the typed member (`linear->weight`), the module's parameter dict and every
// other handle see the same tensor, now with memory. `fully_shard` does this one unit at a time,
// the way FSDP1 does: it gives the unit's meta tensors memory, runs each module's initializer (or
// `param_init_fn`) in FSDP1's order, and then shards, so a rank never holds more than one unit in
// full (docs/engine.md, meta device).
#pragma once

#include <c10/core/Device.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/nn/module.h>

#include <functional>

namespace fsdp {

/// While alive, every tensor a factory creates on this thread is on the meta device (Note [building
/// on the meta device]). Build the model in its scope. A one-value `torch::tensor(1.5)` still comes
/// out a real CPU tensor (it keeps its value); copying real tensors inside the scope is not
/// supported.
class MetaDeviceGuard {
 public:
  MetaDeviceGuard();
  MetaDeviceGuard(const MetaDeviceGuard&) = delete;
  MetaDeviceGuard& operator=(const MetaDeviceGuard&) = delete;

 private:
  c10::impl::IncludeDispatchKeyGuard include_meta_;
  c10::impl::ExcludeDispatchKeyGuard exclude_backend_select_;
};

/// A module that can re-run the initialization of its own (direct) parameters and buffers, PyTorch's
/// `reset_parameters()` convention. Implement it on a module with parameters of its own so that a
/// model built on the meta device can be initialized without a `param_init_fn`.
class ResetParameters {
 public:
  virtual ~ResetParameters() = default;
  virtual void reset_parameters() = 0;
};

/// Initializes `module`'s direct parameters and buffers with its own initializer: ResetParameters,
/// or `reset_parameters()` of libtorch's Linear, Bilinear, Embedding, EmbeddingBag, LayerNorm,
/// GroupNorm, Conv/ConvTranspose 1-3d, BatchNorm/InstanceNorm 1-3d, RNN, LSTM, GRU and their cells.
/// Returns false (and changes nothing) when the module has none. Runs without grad.
bool reset_parameters(torch::nn::Module& module);

/// Whether any parameter or buffer of `module` (and, with `recurse`, of its descendants) is on the
/// meta device.
bool has_meta_tensors(const torch::nn::Module& module, bool recurse = true);

/// PyTorch's `Module.to_empty`: every meta parameter and buffer becomes, in place, a tensor of the
/// same shape and dtype on `device`, filled with zeros (PyTorch leaves it uninitialized; zeros make
/// a forgotten initialization reproducible). Tensors not on the meta device are left alone.
void to_empty(torch::nn::Module& module, c10::Device device = c10::kCPU, bool recurse = true);

/// Frees every parameter's memory while keeping its shape and dtype (a meta parameter becomes a CPU
/// tensor without memory; with `recurse` false, only `model`'s direct parameters): the form
/// `fully_shard` shards into zero-filled shards that a broadcast or a state-dict load from rank 0
/// fills (sync_module_states and cpu_ram_efficient_loading on the ranks other than 0).
void release_parameter_storage(torch::nn::Module& model, bool recurse = true);

}  // namespace fsdp
