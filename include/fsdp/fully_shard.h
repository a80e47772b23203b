// fully_shard: make a libtorch module an FSDP unit (PyTorch FSDP2's `fully_shard`).
//
// After `fully_shard(module, context)` each rank keeps only its dim-0 rows of every parameter the
// unit manages (torch.chunk semantics, see shard_layout.h), and the registered parameters *are*
// those shards: an optimizer built on `module->parameters()` steps the shards, so its state is 1/N
// per rank too. Apply it bottom-up (blocks first, the root last); each call manages the parameters
// of `module` that no earlier call claimed.
//
// libtorch modules have no forward hooks, so a unit's forward must be called through
// `fsdp::forward(module, args...)` instead of `module->forward(args...)`: it all-gathers the unit
// before forward, reshards after it (per reshard_after_forward) and installs the backward hooks
// that all-gather again and reduce-scatter the gradients. For a module that is not a unit it is
// exactly `module->forward(args...)`, so model code can call every submodule that way. A parameter
// that receives a gradient while sharded (its unit's forward was called directly) is reported at
// the end of backward.
//
// Example:
//   for (auto& block : model->blocks) fsdp::fully_shard(block.ptr(), context);
//   fsdp::fully_shard(model.ptr(), context);
//   torch::optim::AdamW optimizer(model->parameters());
//   auto loss = fsdp::forward(model, batch).mean();
//   loss.backward();      // sharded gradients, averaged over ranks
//   optimizer.step();     // steps the shards
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Type.h>
#include <fsdp/activation_checkpointing.h>
#include <fsdp/fully_shard_options.h>
#include <fsdp/process_group.h>
#include <fsdp/shard_layout.h>
#include <fsdp/sharding_options.h>
#include <torch/nn/module.h>

#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

namespace fsdp {

class FSDPModule;

namespace detail {
class ParamGroup;
/// The unit behind a handle, for the engine's own files (src/engine/); code outside the engine uses
/// FSDPModule's methods.
ParamGroup& group_of(const FSDPModule& module);
}  // namespace detail

/// A handle to one FSDP unit (FSDP2's FSDPModule methods). Cheap to copy.
class FSDPModule {
 public:
  explicit FSDPModule(std::shared_ptr<detail::ParamGroup> group);
  /// The module the unit was created for (the first one when several were given).
  std::shared_ptr<torch::nn::Module> module() const;
  /// All-gather the parameters now (e.g. for evaluation code that bypasses fsdp::forward). With
  /// `async_op` the all-gather is only issued; wait_for_unshard (or the unit's next use) completes it.
  void unshard(bool async_op = false) const;
  void wait_for_unshard() const;
  /// Free the unsharded parameters; the parameters become the local shards again.
  void reshard() const;
  /// Gradient accumulation: while false, backward keeps unsharded gradients locally and the first
  /// backward after it is set to true reduces their sum once. `recurse` applies it to every unit
  /// inside this one too.
  void set_requires_gradient_sync(bool requires_sync, bool recurse = true) const;
  /// Overrides reshard_after_forward with a bool (FSDP2's accepts bools only).
  void set_reshard_after_forward(bool reshard_after_forward, bool recurse = true) const;
  /// A group size would silently convert to true: set it in FullyShardOptions::reshard_after_forward.
  void set_reshard_after_forward(int group_size, bool recurse = true) const = delete;
  /// FSDP2's explicit prefetching: these units are all-gathered, in this order, right after this
  /// unit's own all-gather is issued in forward (resp. backward). Every rank must set the same lists.
  /// An empty list turns prefetching off for this unit.
  void set_modules_to_forward_prefetch(const std::vector<FSDPModule>& modules) const;
  void set_modules_to_backward_prefetch(const std::vector<FSDPModule>& modules) const;
  /// Whether this unit is the root of its tree (known after the first forward or `lazy_init`).
  bool is_root() const;
  /// Decides the root of this unit's tree now instead of at the first forward.
  void lazy_init() const;
  ShardingStrategy sharding_strategy() const;
  /// Bytes held by the unsharded parameter buffer right now (0 while sharded).
  int64_t unsharded_buffer_bytes() const;
  /// How errors name this unit.
  std::string description() const;
  const DistributedContext& context() const;
  /// The ranks this unit's parameters are sharded over; null when they are whole on every rank
  /// (NO_SHARD, or one rank).
  const ProcessGroup* shard_group() const;
  /// The ranks holding the same shards (HYBRID_SHARD's other machines, NO_SHARD's world); null when
  /// none.
  const ProcessGroup* replicate_group() const;

 private:
  friend detail::ParamGroup& detail::group_of(const FSDPModule& module);
  std::shared_ptr<detail::ParamGroup> group_;
};

/// Makes `module` one FSDP unit and shards its parameters in place. Collective: every rank calls it
/// with the same module structure, in the same order.
FSDPModule fully_shard(const std::shared_ptr<torch::nn::Module>& module, const DistributedContext& context,
                       const FullyShardOptions& options = {});
/// One unit over several modules (FSDP2's `fully_shard([a, b])`), e.g. a final norm and the output
/// head; its forward starts at the first of them to run.
FSDPModule fully_shard(const std::vector<std::shared_ptr<torch::nn::Module>>& modules,
                       const DistributedContext& context, const FullyShardOptions& options = {});

namespace detail {
// Not part of the API (detail): the engine's storage of a unit's shards, for the checkpoint layer
// (state dicts load into it) and the tests. A program writing into it while the unit is unsharded
// would corrupt it; state_dict.h is the supported way in and out.
/// One managed parameter as state dicts and tests see it: the engine's interface for checkpoints,
/// which never see the unit's internals.
struct ShardedParameterInfo {
  /// Name relative to the unit's first module.
  std::string name;
  /// The registered parameter (its data is the local shard between steps).
  at::Tensor parameter;
  ShardLayout layout;
  /// The parameter's dtype as stored (mixed precision computes in another).
  c10::ScalarType original_dtype = c10::kFloat;
  /// This rank's padded shard (1-D, layout.numel_padded_shard elements). The engine's own storage:
  /// copying into it while the unit is resharded loads this rank's shard, padding included.
  at::Tensor sharded_padded;
  /// This rank's rows (layout.sharded_sizes), a view of sharded_padded: copying into it while the
  /// unit is resharded loads them.
  at::Tensor sharded_data;
};

/// The unit's managed parameters, in its order.
std::vector<ShardedParameterInfo> sharded_parameters(const FSDPModule& unit);
}  // namespace detail

/// The unit `module` belongs to as one of its modules, if any.
std::optional<FSDPModule> fsdp_module_of(const torch::nn::Module& module);
bool is_fsdp_module(const torch::nn::Module& module);
/// Every unit whose module is `root` or inside it, children before parents (creation order).
std::vector<FSDPModule> fsdp_modules(const torch::nn::Module& root);

namespace detail {
std::shared_ptr<ParamGroup> find_param_group(const torch::nn::Module* module);
/// Called by fsdp::forward around the module's own forward.
void run_pre_forward(ParamGroup& group);
/// Casts a floating input to param_dtype and, when it requires grad, routes it through the function
/// whose backward tells the unit that its backward is done.
at::Tensor prepare_forward_input(ParamGroup& group, const at::Tensor& input);
void run_post_forward(ParamGroup& group, std::vector<at::Tensor*>& outputs);
/// For an error raised inside `module`'s forward: the units nested in it that hold only their
/// shards right now ("unit blocks.0 (BlockImpl), ..."), "" when there are none. A unit whose forward
/// was called directly, not through fsdp::forward, is one of them: ATen then sees its shard.
std::string units_holding_shards_inside(const torch::nn::Module& module);
/// For an error from inside `module`'s forward: its text with the units that held only their
/// shards named, or "" to let it pass unchanged (none were; fsdp.cpp's own errors, which name their
/// rank, and the distributed errors, whose cause is elsewhere; an error explained further in).
std::string explain_forward_error(const torch::nn::Module& module, const c10::Error& error);

/// Runs `call`; an error from inside it names the units it found sharded (explain_forward_error).
template <typename Call>
auto explain_forward_errors(const torch::nn::Module& module, Call&& call) {
  try {
    return call();
  } catch (const c10::Error& error) {
    const auto explained = explain_forward_error(module, error);
    if (explained.empty()) throw;  // unchanged, its type (DistBackendError, ...) kept
    TORCH_CHECK(false, explained);
  }
}

template <typename T>
inline constexpr bool kAlwaysFalse = false;

/// Outputs of other types cannot carry the backward hooks FSDP needs.
template <typename T>
void collect_outputs(T&, std::vector<at::Tensor*>&) {
  static_assert(kAlwaysFalse<T>,
                "fsdp::forward: a unit's forward must return a Tensor or a std::vector, std::tuple, std::pair "
                "or std::optional of Tensors, so that FSDP can attach its backward hooks to the outputs");
}
inline void collect_outputs(at::Tensor& tensor, std::vector<at::Tensor*>& out) { out.push_back(&tensor); }
template <typename T>
void collect_outputs(std::vector<T>& values, std::vector<at::Tensor*>& out) {
  for (auto& value : values) collect_outputs(value, out);
}
template <typename T>
void collect_outputs(std::optional<T>& value, std::vector<at::Tensor*>& out) {
  if (value) collect_outputs(*value, out);
}
template <typename A, typename B>
void collect_outputs(std::pair<A, B>& value, std::vector<at::Tensor*>& out) {
  collect_outputs(value.first, out);
  collect_outputs(value.second, out);
}
template <typename... T>
void collect_outputs(std::tuple<T...>& value, std::vector<at::Tensor*>& out) {
  std::apply([&](auto&... element) { (collect_outputs(element, out), ...); }, value);
}

template <typename T>
decltype(auto) prepare_input(ParamGroup& group, T&& value) {
  if constexpr (std::is_same_v<std::decay_t<T>, at::Tensor>) {
    return prepare_forward_input(group, value);
  } else {
    return std::forward<T>(value);
  }
}

}  // namespace detail

/// Calls `module->forward(args...)` with FSDP's pre- and post-forward around it when `module` is a
/// unit (see the top of this file). `module` is what users hold: a ModuleHolder (torch::nn::Linear,
/// a TORCH_MODULE of their own) or a std::shared_ptr to a module class, named or temporary
/// (`list->ptr<BlockImpl>(i)`; for a ModuleList element, `fsdp::forward_as<BlockImpl>(list[i], x)`).
/// The output may be a Tensor or a vector, tuple, pair or optional of them: those are what backward
/// hooks can be attached to. A module marked with checkpoint_module is activation-checkpointed
/// (activation_checkpointing.h). Calling it on a module that is no unit just calls its forward, so
/// the one rule is: call every module that may be a unit (with auto-wrap, any the policy matches)
/// through fsdp::forward. An error raised inside names the units that held only their shards then.
template <typename Holder, typename... Args>
auto forward(Holder&& module, Args&&... args) {
  static_assert(!std::is_same_v<std::decay_t<Holder>, std::shared_ptr<torch::nn::Module>>,
                "fsdp::forward: a std::shared_ptr<torch::nn::Module> (a ModuleList element) has no forward of its "
                "own; name its class: fsdp::forward_as<BlockImpl>(list[i], x), or list->ptr<BlockImpl>(i)");
  auto group = detail::find_param_group(module.get());
  if (!group) {
    return detail::explain_forward_errors(*module,
                                          [&] { return detail::call_forward(module, std::forward<Args>(args)...); });
  }
  detail::run_pre_forward(*group);
  auto output = detail::explain_forward_errors(*module, [&] {
    return detail::call_forward(module, detail::prepare_input(*group, std::forward<Args>(args))...);
  });
  std::vector<at::Tensor*> outputs;
  detail::collect_outputs(output, outputs);
  detail::run_post_forward(*group, outputs);
  return output;
}

/// fsdp::forward on a module known by its base class (a ModuleList element, a child looked up by
/// name): `fsdp::forward_as<BlockImpl>(blocks[i], x)`. A module of another class is an error naming
/// both classes.
template <typename ModuleType, typename... Args>
auto forward_as(const std::shared_ptr<torch::nn::Module>& module, Args&&... args) {
  TORCH_CHECK(module, "fsdp::forward_as: the module is null");
  auto typed = std::dynamic_pointer_cast<ModuleType>(module);
  TORCH_CHECK(typed, "fsdp::forward_as: the module is a ", module->name(), ", not a ",
              c10::demangle(typeid(ModuleType).name()));
  return forward(typed, std::forward<Args>(args)...);
}

}  // namespace fsdp
