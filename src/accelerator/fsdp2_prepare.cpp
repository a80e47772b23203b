#include <ATen/ATen.h>
#include <fsdp/activation_checkpointing.h>
#include <fsdp/auto_wrap.h>
#include <fsdp/fsdp2_prepare.h>
#include <fsdp/meta_device.h>
#include <fsdp/pretrained_model.h>
#include <fsdp/state_dict.h>

#include <regex>
#include <sstream>
#include <unordered_map>
#include <unordered_set>

namespace fsdp {
namespace {

const at::TensorImpl* weight_of(const std::shared_ptr<torch::nn::Module>& module) {
  if (!module) return nullptr;
  const auto parameters = module->named_parameters(/*recurse=*/false);
  const auto* weight = parameters.find("weight");
  return weight ? weight->unsafeGetTensorImpl() : nullptr;
}

/// Accelerate's _find_final_norm: the last child of the base model whose class name contains "Norm".
std::shared_ptr<torch::nn::Module> find_final_norm(const std::shared_ptr<torch::nn::Module>& model,
                                                   PretrainedModel* pretrained) {
  auto base = model;
  const std::string prefix = pretrained ? pretrained->base_model_prefix() : "";
  if (!prefix.empty()) {
    const auto children = model->named_children();
    const auto* child = children.find(prefix);
    TORCH_CHECK(child, "fsdp2_prepare_model: base_model_prefix() is '", prefix, "' but the model (", model->name(),
                ") has no child of that name; return the name of the child that holds the base model, or \"\"");
    base = *child;
  }
  std::shared_ptr<torch::nn::Module> final_norm;
  for (const auto& child : base->children()) {
    if (child->name().find("Norm") != std::string::npos) final_norm = child;
  }
  return final_norm;
}

std::vector<at::Tensor> ignored_parameters(const IgnoredModules& ignored,
                                           const std::shared_ptr<torch::nn::Module>& model) {
  std::vector<at::Tensor> parameters;
  auto add_module = [&](const torch::nn::Module& module) {
    for (const auto& parameter : module.parameters(/*recurse=*/true)) parameters.push_back(parameter);
  };
  if (ignored.name_regex) {
    std::regex pattern;
    try {
      pattern = std::regex(*ignored.name_regex);
    } catch (const std::regex_error& error) {
      TORCH_CHECK(false, "ignored_modules: '", *ignored.name_regex, "' is not a valid regular expression (",
                  error.what(), ")");
    }
    for (const auto& item : model->named_modules()) {
      if (std::regex_match(item.key(), pattern)) add_module(*item.value());
    }
  }
  for (const auto& module : ignored.modules) {
    TORCH_CHECK(module, "ignored_modules: a module handle is null");
    add_module(*module);
  }
  return parameters;
}

// Accelerate's fsdp2_apply_ac (accelerate/utils/fsdp_utils.py): the children of every module the
// wrap policy selects are checkpointed, e.g. self_attn, mlp and the norms of each decoder layer,
// not the layer itself. Under fsdp_version=1 the selected modules themselves are, as FSDP1 does
// (Accelerator.prepare_model's FSDP1 branch).
void fsdp2_apply_activation_checkpointing(const FullyShardedDataParallelPlugin& plugin,
                                          const std::shared_ptr<torch::nn::Module>& model) {
  auto policy = fsdp2_prepare_auto_wrap_policy(plugin, model);
  TORCH_CHECK(policy,
              "fsdp2_prepare_model: activation_checkpointing=true checkpoints the children of the modules "
              "the auto-wrap policy selects, but auto_wrap_policy is ",
              to_string(plugin.auto_wrap_policy),
              ". Set fsdp_auto_wrap_policy to TRANSFORMER_BASED_WRAP (or SIZE_BASED_WRAP), or mark modules yourself "
              "with fsdp::checkpoint_module (Accelerate fails here with a TypeError, its issue #3822)");
  if (plugin.fsdp_version == 1) {
    // FSDP1's apply_activation_checkpointing(auto_wrap_policy=...): the modules the policy selects
    // themselves (the decoder layers), which are also its units.
    for (const auto& [name, module] : modules_to_wrap(model, *policy)) {
      if (module != model) checkpoint_module(module);
    }
    return;
  }
  auto order = module_children_bottom_up(model);
  std::unordered_map<std::string, std::shared_ptr<torch::nn::Module>> by_name;
  for (const auto& [name, module] : order) by_name[name] = module;
  order.pop_back();  // the root has no parent
  for (const auto& [name, layer] : order) {
    const auto dot = name.rfind('.');
    const std::string parent_name = dot == std::string::npos ? "" : name.substr(0, dot);
    const auto& parent = by_name.at(parent_name);
    int64_t numel = 0;
    for (const auto& parameter : parent->parameters()) numel += parameter.numel();
    if ((*policy)(*parent, parent_name, numel)) checkpoint_module(layer);
  }
}

// Accelerate's fsdp2_prepare_model step for version 2: the input embedding (untied) and the tail (the
// final norm with the output embedding, or the tied embedding) as units of their own.
void shard_embeddings_and_tail(const std::shared_ptr<torch::nn::Module>& model, PretrainedModel* pretrained,
                               const DistributedContext& context, const FullyShardOptions& options);

}  // namespace

std::optional<AutoWrapCallable> fsdp2_prepare_auto_wrap_policy(const FullyShardedDataParallelPlugin& plugin,
                                                               const std::shared_ptr<torch::nn::Module>& model) {
  switch (plugin.auto_wrap_policy) {
    case AutoWrapKind::kNoWrap:
      return std::nullopt;
    case AutoWrapKind::kCallable:
      TORCH_CHECK(plugin.auto_wrap_callable, "auto_wrap_policy is a callable but the function is empty");
      return plugin.auto_wrap_callable;
    case AutoWrapKind::kSizeBasedWrap:
      return plugin.fsdp_version == 1 ? size_based_auto_wrap_policy_v1(plugin.min_num_params)
                                      : size_based_auto_wrap_policy(plugin.min_num_params);
    case AutoWrapKind::kTransformerBasedWrap: {
      std::vector<std::string> names;
      if (plugin.transformer_cls_names_to_wrap) {
        names = *plugin.transformer_cls_names_to_wrap;
      } else if (auto* pretrained = dynamic_cast<PretrainedModel*>(model.get())) {
        names = pretrained->no_split_modules();
      }
      if (names.empty())
        return AutoWrapCallable([](const torch::nn::Module&, const std::string&, int64_t) { return false; });
      return transformer_auto_wrap_policy(names, model);
    }
  }
  TORCH_INTERNAL_ASSERT(false, "unknown auto-wrap kind");
}

FullyShardOptions fully_shard_options_from_plugin(const FullyShardedDataParallelPlugin& plugin) {
  FullyShardOptions options;
  options.sharding_strategy = plugin.sharding_strategy;
  options.reshard_after_forward = plugin.reshard_after_forward;
  if (plugin.mixed_precision_policy) options.mp_policy = *plugin.mixed_precision_policy;
  options.offload_policy = plugin.cpu_offload;
  options.fsdp1.sync_module_states = plugin.sync_module_states;
  if (plugin.param_init_fn) options.fsdp1.param_init_fn = plugin.param_init_fn;
  if (plugin.fsdp_version == 1) {
    // FSDP1's prefetch options as it defines them; version 2 keeps FSDP2's implicit prefetch (the
    // defaults of FullyShardOptions).
    options.fsdp1.forward_prefetch = plugin.forward_prefetch;
    options.fsdp1.backward_prefetch = plugin.backward_prefetch;
    // FSDP1's rate limiter lets two all-gathers be in flight.
    if (plugin.limit_all_gathers) options.fsdp1.max_all_gathers_in_flight = 2;
  }
  return options;
}

std::shared_ptr<torch::nn::Module> fsdp2_prepare_model(const FullyShardedDataParallelPlugin& plugin,
                                                       const DistributedContext& context,
                                                       const std::string& mixed_precision,
                                                       const std::shared_ptr<torch::nn::Module>& model) {
  TORCH_CHECK(model, "fsdp2_prepare_model: the model is null");
  if (is_fsdp_module(*model)) return model;
  if (plugin.activation_checkpointing) fsdp2_apply_activation_checkpointing(plugin, model);
  auto options = fully_shard_options_from_plugin(plugin);
  options.ignored_params = ignored_parameters(plugin.ignored_modules, model);
  auto* pretrained = dynamic_cast<PretrainedModel*>(model.get());
  if (!options.fsdp1.param_init_fn && pretrained) {
    // A model built on the meta device gets the values its constructor would give (transformers'
    // _init_weights), and a module the model does not know gets its own initializer.
    options.fsdp1.param_init_fn = [pretrained](torch::nn::Module& module) {
      if (pretrained->init_weights(module)) return;
      TORCH_CHECK(reset_parameters(module), "fsdp2_prepare_model: module ", module.name(),
                  " has parameters or buffers on the meta device and no initializer: neither the model's "
                  "init_weights nor fsdp::reset_parameters knows it. Implement fsdp::ResetParameters on it, or give "
                  "the plugin a param_init_fn");
    };
  }

  // FSDP2 needs one dtype for the trainable parameters of a unit, and the sharded parameters are the
  // master weights: keep them in fp32 (fsdp2_prepare_model's upcast; Q10 in docs/plugin.md, kept on purpose).
  if (mixed_precision != "no") {
    at::NoGradGuard no_grad;
    for (auto& parameter : model->parameters()) {
      if (parameter.requires_grad() && parameter.scalar_type() != at::kFloat)
        parameter.set_data(parameter.to(at::kFloat));
    }
  }

  // cpu_ram_efficient_loading (fsdp2_prepare_model's meta-device path and
  // fsdp2_load_full_state_dict): rank 0's weights are the truth. It keeps them aside (the
  // parameters become shards); the other ranks drop theirs before sharding and get their rows from
  // rank 0 one tensor at a time.
  const bool efficient_loading = plugin.cpu_ram_efficient_loading && context.world_size() > 1;
  // The load from rank 0 below is the sync: broadcasting every value at fully_shard too (version 1
  // forces sync_module_states on with efficient loading, as Accelerate does) would move them twice.
  if (efficient_loading) options.fsdp1.sync_module_states = false;
  TensorList original_state;
  if (efficient_loading) {
    if (context.rank() == 0) {
      std::unordered_set<const c10::TensorImpl*> seen;
      for (const auto& item : model->named_parameters()) {
        if (seen.insert(item.value().unsafeGetTensorImpl()).second)
          original_state.emplace_back(item.key(), item.value().detach());
      }
      for (const auto& item : model->named_buffers()) original_state.emplace_back(item.key(), item.value().detach());
    } else {
      // A model built on the meta device (MetaDeviceGuard) is welcome here: nothing is allocated
      // until fully_shard gives each parameter its shard; meta buffers get zeros to receive into.
      release_parameter_storage(*model);
      to_empty(*model);
    }
  }

  // Version 1 prepares as FSDP1 does: units are what the policy wraps, plus the root, and only the
  // root casts its floating inputs to param_dtype (FSDP1's cast_root_forward_inputs; its
  // cast_forward_inputs, off by default, is every other unit's). Version 2 follows Accelerate's
  // fsdp2_prepare_model: the input embedding and the tail are units too, and every unit casts.
  const bool fsdp1 = plugin.fsdp_version == 1;
  const bool cast_root_inputs = options.mp_policy.cast_forward_inputs;
  if (fsdp1) options.mp_policy.cast_forward_inputs = false;
  if (auto policy = fsdp2_prepare_auto_wrap_policy(plugin, model)) {
    for (const auto& [name, module] : modules_to_wrap(model, *policy)) {
      if (!is_fsdp_module(*module)) fully_shard(module, context, options);
    }
  }
  if (!fsdp1) shard_embeddings_and_tail(model, pretrained, context, options);
  if (!is_fsdp_module(*model)) {
    auto root_options = options;
    root_options.reshard_after_forward.reset();
    root_options.mp_policy.cast_forward_inputs = cast_root_inputs;
    fully_shard(model, context, root_options);
  }
  if (efficient_loading) {
    std::unique_ptr<TensorListSource> source;
    if (context.rank() == 0) source = std::make_unique<TensorListSource>(std::move(original_state), "rank 0's weights");
    load_model_state_dict_from_rank0(*model, context, source.get());
  }
  return model;
}

namespace {
void shard_embeddings_and_tail(const std::shared_ptr<torch::nn::Module>& model, PretrainedModel* pretrained,
                               const DistributedContext& context, const FullyShardOptions& options) {
  auto input_embed = pretrained ? pretrained->input_embeddings() : nullptr;
  auto output_embed = pretrained ? pretrained->output_embeddings() : nullptr;
  const bool tied =
      input_embed && output_embed && weight_of(input_embed) && weight_of(input_embed) == weight_of(output_embed);
  if (!tied && input_embed && !is_fsdp_module(*input_embed)) fully_shard(input_embed, context, options);
  auto final_norm = find_final_norm(model, pretrained);
  auto tail_embed = tied ? input_embed : output_embed;
  std::vector<std::shared_ptr<torch::nn::Module>> tail;
  for (const auto& module : {final_norm, tail_embed}) {
    if (module && !is_fsdp_module(*module)) tail.push_back(module);
  }
  if (!tail.empty()) {
    // Used from its first forward to the end of the model's forward: keep it gathered.
    auto tail_options = options;
    tail_options.reshard_after_forward = false;
    fully_shard(tail, context, tail_options);
  }
}
}  // namespace

void fsdp2_switch_optimizer_parameters(torch::optim::Optimizer& optimizer,
                                       const std::unordered_map<const void*, at::Tensor>& mapping) {
  auto& groups = optimizer.param_groups();
  for (size_t group_index = 0; group_index < groups.size(); ++group_index) {
    auto& parameters = groups[group_index].params();
    for (size_t index = 0; index < parameters.size(); ++index) {
      auto found = mapping.find(parameters[index].data_ptr());
      TORCH_CHECK(found != mapping.end(),
                  "A parameter in the optimizer couldn't be switched to its sharded version (param group ", group_index,
                  ", parameter ", index,
                  "). This breaks the training: every optimizer parameter must be a parameter "
                  "of the prepared model. Build the optimizer from model->parameters()");
      parameters[index] = found->second;
    }
  }
}

std::shared_ptr<torch::nn::Module> fsdp2_load_full_state_dict(const DistributedContext& context,
                                                              const std::shared_ptr<torch::nn::Module>& model,
                                                              const TensorList& full_state_dict,
                                                              bool /*cpu_offload: see the header*/) {
  TORCH_CHECK(model, "fsdp2_load_full_state_dict: the model is null");
  std::unique_ptr<TensorListSource> source;
  if (context.rank() == 0) source = std::make_unique<TensorListSource>(full_state_dict, "the full state dict");
  load_model_state_dict_from_rank0(*model, context, source.get());
  return model;
}

}  // namespace fsdp
