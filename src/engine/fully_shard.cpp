#include <ATen/ATen.h>
#include <fsdp/collectives.h>
#include <fsdp/device.h>
#include <fsdp/fully_shard.h>
#include <fsdp/meta_device.h>
#include <torch/nn/module.h>

#include <deque>
#include <functional>
#include <unordered_set>

#include "dist/agreement.h"
#include "engine/module_state.h"
#include "engine/param_group.h"
#include "engine/registry.h"

namespace fsdp {
namespace {

/// The modules a new unit manages: `module` and its descendants, without descending into modules
/// that are already units (FSDP2's _get_managed_modules), with names relative to `module`.
void collect_managed_modules(const std::shared_ptr<torch::nn::Module>& module, const std::string& prefix,
                             std::vector<std::pair<std::string, std::shared_ptr<torch::nn::Module>>>& out) {
  out.emplace_back(prefix, module);
  for (const auto& child : module->named_children()) {
    if (detail::find_param_group(child.value().get())) continue;
    collect_managed_modules(child.value(), prefix + child.key() + ".", out);
  }
}

// FSDP1's _materialize_meta_module for a new unit (Note [building on the meta device],
// meta_device.h): the modules breadth-first from the unit's modules, not entering other units (its
// _get_modules_to_materialize), and each one with meta tensors of its own given memory and values.
// On a rank that receives rank 0's values (sync_module_states), parameters get no memory at all
// (the broadcast fills their shards) and buffers get zeros (the broadcast fills them).
void materialize_meta_modules(const std::vector<std::shared_ptr<torch::nn::Module>>& modules,
                              const DistributedContext& context, const FullyShardOptions& options) {
  std::vector<std::pair<std::string, std::shared_ptr<torch::nn::Module>>> order;
  std::deque<std::pair<std::string, std::shared_ptr<torch::nn::Module>>> queue;
  std::unordered_set<const torch::nn::Module*> visited;
  for (const auto& module : modules) {
    if (visited.insert(module.get()).second)
      queue.emplace_back(modules.size() == 1 ? "" : module->name() + ".", module);
  }
  while (!queue.empty()) {
    auto [prefix, module] = std::move(queue.front());
    queue.pop_front();
    for (const auto& child : module->named_children()) {
      if (detail::find_param_group(child.value().get()) || !visited.insert(child.value().get()).second) continue;
      queue.emplace_back(prefix + child.key() + ".", child.value());
    }
    order.emplace_back(std::move(prefix), std::move(module));
  }
  const bool receives = options.fsdp1.sync_module_states && context.world_size() > 1 && context.rank() != 0;
  for (const auto& [prefix, module] : order) {
    if (!has_meta_tensors(*module, /*recurse=*/false)) continue;
    // prefix is "" or a path with a trailing '.', which becomes the closing quote.
    std::string path = "the unit's module";
    if (!prefix.empty()) {
      path = "'" + prefix;
      path.back() = '\'';
    }
    if (receives) {
      release_parameter_storage(*module, /*recurse=*/false);
      to_empty(*module, c10::kCPU, /*recurse=*/false);
      continue;
    }
    to_empty(*module, c10::kCPU, /*recurse=*/false);
    at::NoGradGuard no_grad;
    if (options.fsdp1.param_init_fn) {
      options.fsdp1.param_init_fn(*module);
    } else {
      TORCH_CHECK(reset_parameters(*module), detail::on_rank(context), "fully_shard: module ", path, " (",
                  module->name(), ") of the unit on ", modules.front()->name(),
                  " has parameters or buffers on the meta device and no initializer of its own. Implement "
                  "fsdp::ResetParameters on it, give FullyShardOptions::param_init_fn (the plugin's param_init_fn), "
                  "or build the model outside MetaDeviceGuard");
    }
    TORCH_CHECK(!has_meta_tensors(*module, /*recurse=*/false), detail::on_rank(context), "fully_shard: module ", path,
                " (", module->name(),
                ") still has tensors on the meta device after param_init_fn; the function must give "
                "the module's own parameters and buffers their values in place");
  }
}

}  // namespace

FSDPModule::FSDPModule(std::shared_ptr<detail::ParamGroup> group) : group_(std::move(group)) {
  TORCH_INTERNAL_ASSERT(group_, "FSDPModule without a unit");
}

std::shared_ptr<torch::nn::Module> FSDPModule::module() const {
  auto module = group_->modules().front().lock();
  TORCH_CHECK(module, group_->on_rank(), "FSDPModule: the module of ", group_->description(), " was destroyed");
  return module;
}

void FSDPModule::unshard(bool async_op) const { group_->unshard(async_op); }

void FSDPModule::wait_for_unshard() const { group_->wait_for_unshard(); }

namespace {

std::vector<std::weak_ptr<detail::ParamGroup>> prefetch_list(const std::vector<FSDPModule>& modules) {
  std::vector<std::weak_ptr<detail::ParamGroup>> targets;
  for (const auto& module : modules) targets.push_back(detail::group_of(module).shared_from_this());
  return targets;
}

}  // namespace

void FSDPModule::set_modules_to_forward_prefetch(const std::vector<FSDPModule>& modules) const {
  group_->set_forward_prefetch(prefetch_list(modules));
}

void FSDPModule::set_modules_to_backward_prefetch(const std::vector<FSDPModule>& modules) const {
  group_->set_backward_prefetch(prefetch_list(modules));
}

void FSDPModule::reshard() const {
  auto state = detail::root_state_of(*group_);
  if (state && group_->is_root()) {
    state->end_iteration();
  } else {
    group_->reshard();
  }
}

void FSDPModule::set_requires_gradient_sync(bool requires_sync, bool recurse) const {
  if (!recurse) {
    group_->set_requires_gradient_sync(requires_sync);
    return;
  }
  for (const auto& unit : fsdp_modules(*module())) detail::group_of(unit).set_requires_gradient_sync(requires_sync);
}

void FSDPModule::set_reshard_after_forward(bool reshard_after_forward, bool recurse) const {
  if (!recurse) {
    group_->set_reshard_after_forward(reshard_after_forward);
    return;
  }
  for (const auto& unit : fsdp_modules(*module()))
    detail::group_of(unit).set_reshard_after_forward(reshard_after_forward);
}

bool FSDPModule::is_root() const { return group_->is_root(); }

void FSDPModule::lazy_init() const { detail::ensure_root_state(*group_); }

ShardingStrategy FSDPModule::sharding_strategy() const { return group_->options().sharding_strategy; }

std::string FSDPModule::description() const { return group_->description(); }
const DistributedContext& FSDPModule::context() const { return group_->context(); }
const ProcessGroup* FSDPModule::shard_group() const {
  return group_->shard_group() ? &*group_->shard_group() : nullptr;
}
const ProcessGroup* FSDPModule::replicate_group() const {
  return group_->replicate_group() ? &*group_->replicate_group() : nullptr;
}

namespace detail {
ParamGroup& group_of(const FSDPModule& module) { return *module.group_; }

std::vector<ShardedParameterInfo> sharded_parameters(const FSDPModule& unit) {
  std::vector<ShardedParameterInfo> infos;
  for (const auto& parameter : group_of(unit).parameters()) {
    infos.push_back(ShardedParameterInfo{parameter.name, parameter.parameter, parameter.layout,
                                         parameter.original_dtype, parameter.sharded_padded, parameter.sharded_data});
  }
  return infos;
}
}  // namespace detail

int64_t FSDPModule::unsharded_buffer_bytes() const { return group_->unsharded_buffer_bytes(); }

namespace {

std::string dtype_text(const std::optional<c10::ScalarType>& dtype) { return dtype ? c10::toString(*dtype) : "none"; }

void agree_on_unit(const std::vector<std::shared_ptr<torch::nn::Module>>& modules, const DistributedContext& context,
                   const FullyShardOptions& options) {
  std::vector<std::pair<std::string, std::string>> fields;
  std::string names;
  for (const auto& module : modules) names += (names.empty() ? "" : ", ") + module->name();
  fields.emplace_back("modules", names);
  fields.emplace_back("sharding_strategy", to_string(options.sharding_strategy));
  fields.emplace_back("reshard_after_forward",
                      options.reshard_after_forward ? options.reshard_after_forward->to_string() : "default");
  fields.emplace_back("mp_policy", "param " + dtype_text(options.mp_policy.param_dtype) + ", reduce " +
                                       dtype_text(options.mp_policy.reduce_dtype) + ", buffer " +
                                       dtype_text(options.mp_policy.buffer_dtype) + ", output " +
                                       dtype_text(options.mp_policy.output_dtype));
  fields.emplace_back("offload_policy.offload_params", options.offload_policy.offload_params ? "true" : "false");
  fields.emplace_back("fsdp1.sync_module_states", options.fsdp1.sync_module_states ? "true" : "false");
  fields.emplace_back("ignored_params", std::to_string(options.ignored_params.size()));
  int64_t count = 0;
  // Parameters an inner unit already manages hold this rank's shard (its size differs by rank);
  // they were agreed on when that unit was made.
  const auto already_managed = detail::managed_parameters();
  for (size_t index = 0; index < modules.size(); ++index) {
    const std::string prefix = modules.size() == 1 ? "" : modules[index]->name() + ".";
    for (const auto& item : modules[index]->named_parameters()) {
      const auto& tensor = item.value();
      if (tensor.defined() && already_managed.count(tensor.unsafeGetTensorImpl())) continue;
      fields.emplace_back("parameter " + prefix + item.key(),
                          tensor.defined() ? c10::str(tensor.sizes(), " ", tensor.scalar_type()) : "undefined");
      ++count;
    }
  }
  fields.emplace_back("parameter count", std::to_string(count));
  detail::agree_on_fields(context, "fully_shard(" + names + ")", fields,
                          "Every rank must build the same model and call fully_shard on the same modules, in the "
                          "same order, with the same options");
}

}  // namespace

FSDPModule fully_shard(const std::shared_ptr<torch::nn::Module>& module, const DistributedContext& context,
                       const FullyShardOptions& options) {
  return fully_shard(std::vector<std::shared_ptr<torch::nn::Module>>{module}, context, options);
}

FSDPModule fully_shard(const std::vector<std::shared_ptr<torch::nn::Module>>& modules,
                       const DistributedContext& context, const FullyShardOptions& options) {
  try {
    validate(options);
  } catch (const c10::Error& error) {
    TORCH_CHECK(false, detail::on_rank(context), "fully_shard: ", error.what_without_backtrace());
  }
  TORCH_CHECK(!modules.empty(), detail::on_rank(context), "fully_shard: no modules given");
  for (size_t index = 0; index < modules.size(); ++index) {
    TORCH_CHECK(modules[index], detail::on_rank(context), "fully_shard: module ", index, " is null");
    TORCH_CHECK(!detail::find_param_group(modules[index].get()), detail::on_rank(context),
                "fully_shard: ", modules[index]->name(), " is already an FSDP unit; apply fully_shard once per module");
  }
  std::unordered_set<const c10::TensorImpl*> ignored;
  for (const auto& tensor : options.ignored_params) ignored.insert(tensor.unsafeGetTensorImpl());

  // Before any collective: ranks that shard different modules, or the same with other options,
  // would otherwise abort inside Gloo or wait for each other until the timeout.
  if (context.world_size() > 1) agree_on_unit(modules, context, options);
  materialize_meta_modules(modules, context, options);
  std::vector<std::pair<std::string, std::shared_ptr<torch::nn::Module>>> managed_modules;
  for (size_t index = 0; index < modules.size(); ++index) {
    const std::string prefix = modules.size() == 1 ? "" : modules[index]->name() + ".";
    collect_managed_modules(modules[index], prefix, managed_modules);
  }
  std::vector<detail::FSDPParam> parameters;
  std::unordered_set<const c10::TensorImpl*> seen;
  const auto already_managed = detail::managed_parameters();
  for (const auto& [prefix, managed] : managed_modules) {
    for (const auto& item : managed->named_parameters(/*recurse=*/false)) {
      const auto& tensor = item.value();
      if (!tensor.defined()) continue;
      const auto* impl = tensor.unsafeGetTensorImpl();
      if (ignored.count(impl) || !seen.insert(impl).second || already_managed.count(impl)) continue;
      TORCH_CHECK(tensor.device().is_cpu() || (tensor.is_cuda() && built_with_cuda()), detail::on_rank(context),
                  "fully_shard: parameter '", prefix + item.key(), "' is on ", tensor.device(), "; ",
                  built_with_cuda()
                      ? "fsdp.cpp computes on CPU and CUDA devices"
                      : "this build of fsdp.cpp computes on CPU (build it against a CUDA libtorch for GPUs)",
                  ". Move the model to ", built_with_cuda() ? "fsdp::default_device(local_rank)" : "CPU", " first");
      TORCH_CHECK(parameters.empty() || parameters.front().parameter.device() == tensor.device(),
                  detail::on_rank(context), "fully_shard: parameter '", prefix + item.key(), "' is on ",
                  tensor.device(), " but '", parameters.empty() ? std::string() : parameters.front().name,
                  "' of the same unit is on ",
                  parameters.empty() ? tensor.device() : parameters.front().parameter.device(),
                  "; a unit computes on one device. Move the whole model there first");
      detail::FSDPParam parameter;
      parameter.name = prefix + item.key();
      parameter.parameter = tensor;
      parameters.push_back(std::move(parameter));
    }
  }
  if (options.mp_policy.buffer_dtype || options.fsdp1.sync_module_states) {
    at::NoGradGuard no_grad;
    for (const auto& [prefix, managed] : managed_modules) {
      for (const auto& item : managed->named_buffers(/*recurse=*/false)) {
        auto buffer = item.value();
        if (!buffer.defined()) continue;
        if (options.mp_policy.buffer_dtype && at::isFloatingType(buffer.scalar_type())) {
          buffer.set_data(buffer.to(*options.mp_policy.buffer_dtype));
        }
        if (options.fsdp1.sync_module_states && context.world_size() > 1) {
          // The same broadcast on every rank whatever its layout (see ParamGroup::initialize).
          auto received = buffer.contiguous();
          broadcast(context.world(), received, 0);
          if (!received.is_same(buffer)) buffer.copy_(received);
        }
      }
    }
  }
  auto group = std::make_shared<detail::ParamGroup>(modules, context, options, std::move(parameters));
  group->initialize();
  detail::register_param_group(group);
  return FSDPModule(group);
}

std::optional<FSDPModule> fsdp_module_of(const torch::nn::Module& module) {
  auto group = detail::find_param_group(&module);
  if (!group) return std::nullopt;
  return FSDPModule(group);
}

bool is_fsdp_module(const torch::nn::Module& module) { return detail::find_param_group(&module) != nullptr; }

std::vector<FSDPModule> fsdp_modules(const torch::nn::Module& root) {
  std::unordered_set<const torch::nn::Module*> subtree;
  // modules() needs a shared_ptr owner; walk the children by hand to accept any reference.
  std::function<void(const torch::nn::Module&)> visit = [&](const torch::nn::Module& module) {
    subtree.insert(&module);
    for (const auto& child : module.children()) visit(*child);
  };
  visit(root);
  std::vector<FSDPModule> units;
  for (const auto& group : detail::all_param_groups()) {
    if (subtree.count(group->modules().front().lock().get())) units.emplace_back(group);
  }
  return units;
}

}  // namespace fsdp
