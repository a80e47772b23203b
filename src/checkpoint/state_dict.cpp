#include <ATen/ATen.h>
#include <fsdp/collectives.h>
#include <fsdp/fully_shard.h>
#include <fsdp/pretrained_model.h>
#include <fsdp/state_dict.h>

#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <unordered_map>
#include <unordered_set>

#include "checkpoint/optimizer_state.h"
#include "checkpoint/state_dict_views.h"
#include "dist/agreement.h"
#include "dist/control_channel.h"

namespace fsdp {
namespace detail {

/// One tensor of the model's state dict and, when a unit shards it, where its shard lives.
struct StateDictTensor {
  std::string name;
  /// Every name the tensor has (tied weights have several); `name` is the first.
  std::vector<std::string> aliases;
  at::Tensor tensor;
  /// The unit that manages the tensor, and its shard there; unset for what no unit manages.
  struct Owner {
    FSDPModule unit;
    detail::ShardedParameterInfo shard;
  };
  std::optional<Owner> owner;
};

}  // namespace detail
namespace {

// Named outside this file's anonymous namespace: FullModelTensors keeps a list of them.
using ModelTensor = detail::StateDictTensor;

std::vector<ModelTensor> model_tensors(torch::nn::Module& model) {
  std::unordered_map<const c10::TensorImpl*, std::pair<FSDPModule, detail::ShardedParameterInfo>> managed;
  for (const auto& unit : fsdp_modules(model)) {
    // Loads and saves see the sharded parameters, never a gathered forward state.
    unit.reshard();
    for (auto& parameter : detail::sharded_parameters(unit)) {
      managed.emplace(parameter.parameter.unsafeGetTensorImpl(), std::make_pair(unit, parameter));
    }
  }
  std::vector<ModelTensor> tensors;
  std::unordered_map<const c10::TensorImpl*, size_t> index;
  auto add = [&](const std::string& name, const at::Tensor& tensor) {
    if (!tensor.defined()) return;
    auto [found, inserted] = index.emplace(tensor.unsafeGetTensorImpl(), tensors.size());
    if (!inserted) {
      tensors[found->second].aliases.push_back(name);
      return;
    }
    ModelTensor entry;
    entry.name = name;
    entry.aliases = {name};
    entry.tensor = tensor;
    auto owner = managed.find(tensor.unsafeGetTensorImpl());
    if (owner != managed.end()) {
      entry.owner = ModelTensor::Owner{owner->second.first, owner->second.second};
    }
    tensors.push_back(std::move(entry));
  };
  for (const auto& item : model.named_parameters()) add(item.key(), item.value());
  // Buffers the model declares non-persistent are not state (torch's persistent=False).
  std::vector<std::string> non_persistent;
  if (const auto* pretrained = dynamic_cast<const PretrainedModel*>(&model))
    non_persistent = pretrained->non_persistent_buffers();
  auto is_persistent = [&](const std::string& name) {
    for (const auto& entry : non_persistent) {
      if (name == entry) return false;
      if (name.size() > entry.size() && name.compare(name.size() - entry.size(), entry.size(), entry) == 0 &&
          name[name.size() - entry.size() - 1] == '.') {
        return false;
      }
    }
    return true;
  };
  for (const auto& item : model.named_buffers()) {
    if (is_persistent(item.key())) add(item.key(), item.value());
  }
  return tensors;
}

bool is_sharded(const ModelTensor& entry) { return entry.owner && entry.owner->unit.shard_group(); }

/// Under HYBRID_SHARD every machine holds the same shards; the first machine's copy is the one saved.
bool is_replica_copy(const ModelTensor& entry) {
  return entry.owner && entry.owner->unit.replicate_group() && entry.owner->unit.replicate_group()->rank() != 0;
}

/// The full tensor from this rank's padded shard: all-gathered over the unit's shard group.
at::Tensor gather_full(const FSDPModule& unit, const at::Tensor& padded_shard, const ShardLayout& layout) {
  const auto* group = unit.shard_group();
  const int64_t shard_size = group ? group->size() : 1;
  at::Tensor gathered = padded_shard.contiguous();
  if (shard_size > 1) {
    gathered = at::empty({shard_size * layout.numel_padded_shard}, padded_shard.options());
    all_gather(*group, gathered, padded_shard.contiguous());
  }
  return gathered.narrow(0, 0, layout.numel_unsharded()).view(layout.unsharded_sizes).clone();
}

at::Tensor padded(const at::Tensor& local, const ShardLayout& layout) {
  auto result = at::zeros({layout.numel_padded_shard}, local.options());
  if (layout.numel_owned > 0) result.narrow(0, 0, layout.numel_owned).copy_(local.reshape({-1}));
  return result;
}

std::string shape_text(at::IntArrayRef sizes) {
  std::ostringstream text;
  text << sizes;
  return text.str();
}

/// The name under which `source` has `entry` (any alias), or "".
std::string source_name(const ModelTensor& entry, const TensorSource& source) {
  for (const auto& alias : entry.aliases) {
    if (source.contains(alias)) return alias;
  }
  return "";
}

std::string missing_message(const ModelTensor& entry, const TensorSource& source, size_t model_count) {
  return "Parameter '" + entry.name + "' found in sharded model state dict but missing from full state dict (" +
         source.description() + "). Full state dict has " + std::to_string(source.size()) + " keys, sharded has " +
         std::to_string(model_count) + " keys.";
}

std::string shape_message(const ModelTensor& entry, const std::string& name, const TensorSource& source,
                          at::IntArrayRef expected) {
  return "'" + name + "' in " + source.description() + " has shape " + shape_text(source.shape(name)) +
         " but the model's '" + entry.name + "' has shape " + shape_text(expected) +
         "; the checkpoint belongs to a different model configuration";
}

at::IntArrayRef global_shape(const ModelTensor& entry) {
  return entry.owner ? at::IntArrayRef(entry.owner->shard.layout.unsharded_sizes) : entry.tensor.sizes();
}

/// This rank's rows of `name` from `source`, shaped as the local shard.
at::Tensor local_rows(const TensorSource& source, const std::string& name, const ShardLayout& layout,
                      const at::TensorOptions& options) {
  if (layout.numel_owned == 0) return at::empty(layout.sharded_sizes, options);
  return source.rows(name, layout.row_offset, layout.owned_rows).reshape(layout.sharded_sizes);
}

// Whether optimizer state `field` of `entry`, saved with `shape`, is read as this rank's rows of the
// shard (a sharded parameter's state of the parameter's full shape) rather than whole (steps,
// unsharded parameters).
bool state_takes_shard_rows(const ModelTensor& entry, const std::string& field, at::IntArrayRef shape) {
  return field != "step" && is_sharded(entry) && shape == at::IntArrayRef(entry.owner->shard.layout.unsharded_sizes);
}

void copy_into_model(const ModelTensor& entry, const at::Tensor& local) {
  at::NoGradGuard no_grad;
  if (entry.owner) {
    entry.owner->shard.sharded_data.copy_(local);
  } else {
    entry.tensor.copy_(local);
  }
}

std::unordered_map<const c10::TensorImpl*, const ModelTensor*> by_impl(const std::vector<ModelTensor>& tensors) {
  std::unordered_map<const c10::TensorImpl*, const ModelTensor*> map;
  for (const auto& entry : tensors) map[entry.tensor.unsafeGetTensorImpl()] = &entry;
  return map;
}

/// Whether a state tensor is laid out like its parameter's shard (so it is sharded the same way).
bool sharded_like_parameter(const ModelTensor& entry, const at::Tensor& state) {
  return is_sharded(entry) && state.dim() > 0 &&
         state.sizes() == at::IntArrayRef(entry.owner->shard.layout.sharded_sizes);
}

}  // namespace

TensorListSource::TensorListSource(TensorList tensors, std::string description)
    : tensors_(std::move(tensors)), description_(std::move(description)) {}

const at::Tensor& TensorListSource::find(const std::string& name) const {
  for (const auto& [key, tensor] : tensors_) {
    if (key == name) return tensor;
  }
  TORCH_CHECK(false, description_, " has no tensor named '", name, "'");
}

bool TensorListSource::contains(const std::string& name) const {
  for (const auto& entry : tensors_) {
    if (entry.first == name) return true;
  }
  return false;
}

std::vector<int64_t> TensorListSource::shape(const std::string& name) const { return find(name).sizes().vec(); }

at::Tensor TensorListSource::rows(const std::string& name, int64_t row_begin, int64_t row_count) const {
  const auto& tensor = find(name);
  if (tensor.dim() == 0) return tensor;
  return tensor.narrow(0, row_begin, row_count);
}

struct detail::FullModelTensors::Tensors {
  std::vector<ModelTensor> tensors;
};

detail::FullModelTensors::FullModelTensors(torch::nn::Module& model, const StateDictConfig& config)
    : tensors_(std::make_unique<Tensors>()), offload_(config.offload_to_cpu) {
  const auto units = fsdp_modules(model);
  const int64_t rank = units.empty() ? 0 : units.front().context().rank();
  keep_ = !config.rank0_only || rank == 0;
  tensors_->tensors = model_tensors(model);
  for (const auto& entry : tensors_->tensors) {
    entries_.push_back({entry.name, entry.tensor.scalar_type(), global_shape(entry).vec()});
  }
}

detail::FullModelTensors::~FullModelTensors() = default;

at::Tensor detail::FullModelTensors::gather(size_t index) {
  TORCH_INTERNAL_ASSERT(index < tensors_->tensors.size(), "FullModelTensors::gather: no entry ", index);
  const auto& entry = tensors_->tensors[index];
  // Every rank takes part in each gather, whether or not it keeps the result.
  if (entry.owner) {
    auto full = gather_full(entry.owner->unit, entry.owner->shard.sharded_padded, entry.owner->shard.layout);
    TORCH_INTERNAL_ASSERT(full.scalar_type() == entries_[index].dtype && full.sizes() == entries_[index].shape,
                          "FullModelTensors: '", entries_[index].name, "' gathered as ", full.scalar_type(), " ",
                          full.sizes(), ", planned as ", entries_[index].dtype, " ",
                          at::IntArrayRef(entries_[index].shape));
    if (!keep_) return {};
    return offload_ ? full.cpu() : full;
  }
  if (!keep_) return {};
  return offload_ ? entry.tensor.detach().cpu().clone() : entry.tensor.detach().clone();
}

TensorList full_model_state_dict(torch::nn::Module& model, const StateDictConfig& config) {
  detail::FullModelTensors tensors(model, config);
  TensorList result;
  for (size_t index = 0; index < tensors.entries().size(); ++index) {
    auto full = tensors.gather(index);
    if (full.defined()) result.emplace_back(tensors.entries()[index].name, std::move(full));
  }
  return result;
}

namespace {
// A copy, or (views) the tensor itself, detached.
at::Tensor taken(const at::Tensor& tensor, bool views) { return views ? tensor.detach() : tensor.detach().clone(); }

ShardedTensorList sharded_model_state_dict(torch::nn::Module& model, bool views) {
  ShardedTensorList result;
  for (const auto& entry : model_tensors(model)) {
    ShardedTensor sharded;
    if (is_sharded(entry)) {
      sharded.local = taken(entry.owner->shard.sharded_data, views);
      sharded.global_shape = entry.owner->shard.layout.unsharded_sizes;
      sharded.row_offset = entry.owner->shard.layout.row_offset;
      sharded.duplicate = is_replica_copy(entry);
    } else {
      sharded.local =
          entry.owner ? taken(entry.owner->shard.sharded_padded.view(entry.owner->shard.layout.unsharded_sizes), views)
                      : taken(entry.tensor, views);
      sharded.global_shape = sharded.local.sizes().vec();
      sharded.replicated = true;
    }
    result.emplace_back(entry.name, std::move(sharded));
  }
  return result;
}
}  // namespace

ShardedTensorList sharded_model_state_dict(torch::nn::Module& model) { return sharded_model_state_dict(model, false); }

ShardedTensorList detail::sharded_model_state_dict_views(torch::nn::Module& model) {
  return sharded_model_state_dict(model, true);
}

TensorList local_model_state_dict(torch::nn::Module& model) {
  TensorList result;
  std::unordered_map<const torch::nn::Module*, std::string> module_names;
  for (const auto& item : model.named_modules()) module_names[item.value().get()] = item.key();
  for (const auto& unit : fsdp_modules(model)) {
    unit.reshard();
    const auto parameters = detail::sharded_parameters(unit);
    if (parameters.empty()) continue;
    std::vector<at::Tensor> pieces;
    for (const auto& parameter : parameters) {
      TORCH_CHECK(parameter.original_dtype == parameters.front().original_dtype,
                  "LOCAL_STATE_DICT: ", unit.description(), " mixes ", parameters.front().original_dtype, " and ",
                  parameter.original_dtype, " parameters, which cannot share one flat tensor; use SHARDED_STATE_DICT");
      pieces.push_back(parameter.sharded_padded);
    }
    const auto& name = module_names.at(unit.module().get());
    result.emplace_back(name.empty() ? "flat_param" : name + ".flat_param", at::cat(pieces));
  }
  for (const auto& entry : model_tensors(model)) {
    if (!entry.owner) result.emplace_back(entry.name, entry.tensor.detach().clone());
  }
  return result;
}

void load_model_state_dict(torch::nn::Module& model, const TensorSource& source) {
  const auto tensors = model_tensors(model);
  for (const auto& entry : tensors) {
    const auto name = source_name(entry, source);
    TORCH_CHECK(!name.empty(), missing_message(entry, source, tensors.size()));
    const auto expected = global_shape(entry);
    TORCH_CHECK(at::IntArrayRef(source.shape(name)) == expected, shape_message(entry, name, source, expected));
  }
  for (const auto& entry : tensors) {
    const auto name = source_name(entry, source);
    if (is_sharded(entry)) {
      copy_into_model(entry, local_rows(source, name, entry.owner->shard.layout, entry.tensor.options()));
    } else {
      const auto shape = source.shape(name);
      copy_into_model(entry, source.rows(name, 0, shape.empty() ? 1 : shape[0]).reshape(global_shape(entry)));
    }
  }
}

int64_t load_model_state_dict_from_rank0(torch::nn::Module& model, const DistributedContext& context,
                                         const TensorSource* source) {
  const auto tensors = model_tensors(model);
  const bool is_source = context.rank() == 0;
  TORCH_CHECK(!is_source || source, "load_model_state_dict_from_rank0: rank 0 needs a source of tensors");
  // Rank 0 validates everything first and tells the others, so a bad file cannot leave them waiting.
  std::string problem;
  if (is_source) {
    try {
      for (const auto& entry : tensors) {
        const auto name = source_name(entry, *source);
        if (name.empty()) {
          problem = missing_message(entry, *source, tensors.size());
          break;
        }
        if (at::IntArrayRef(source->shape(name)) != global_shape(entry)) {
          problem = shape_message(entry, name, *source, global_shape(entry));
          break;
        }
        // A dtype libtorch cannot hold fails here, before any broadcast.
        if (source->rows(name, 0, 0).is_meta()) {
          problem = "'" + entry.name +
                    "' is on the meta device on rank 0, which has no values to send. Build (or "
                    "load) the model materialized on rank 0; only the other ranks may build it on the meta device";
          break;
        }
      }
    } catch (const std::exception& error) {
      problem = detail::message_of(error);
    }
  }
  const auto message = detail::broadcast_string(context, problem, 0);
  TORCH_CHECK(message.empty(), is_source ? message : "rank 0 could not load the state dict: " + message);
  int64_t peak_bytes = 0;
  for (const auto& entry : tensors) {
    const auto shape = global_shape(entry);
    at::Tensor full;
    // Rank 0 says whether it could read the tensor before the others wait for it.
    std::string read_error;
    if (is_source) {
      try {
        const auto name = source_name(entry, *source);
        full = source->rows(name, 0, shape.empty() ? 1 : shape[0])
                   .reshape(shape)
                   .to(entry.tensor.scalar_type())
                   .contiguous();
      } catch (const c10::Error& error) {
        read_error = error.what_without_backtrace();
        if (read_error.empty()) read_error = "reading '" + entry.name + "' failed";
      }
    }
    read_error = detail::broadcast_string(context, read_error, 0);
    TORCH_CHECK(read_error.empty(),
                is_source ? read_error : "rank 0 could not read '" + entry.name + "': " + read_error);
    if (!is_source) full = at::empty(shape, entry.tensor.options().requires_grad(false));
    peak_bytes = std::max<int64_t>(peak_bytes, full.numel() * full.element_size());
    broadcast(context.world(), full, 0);
    if (is_sharded(entry)) {
      const auto& layout = entry.owner->shard.layout;
      copy_into_model(entry, layout.numel_owned == 0 ? at::empty(layout.sharded_sizes, full.options())
                                                     : full.reshape({layout.rows, layout.row_numel})
                                                           .narrow(0, layout.row_offset, layout.owned_rows)
                                                           .reshape(layout.sharded_sizes));
    } else {
      copy_into_model(entry, full);
    }
  }
  return peak_bytes;
}

void load_local_model_state_dict(torch::nn::Module& model, const TensorList& state) {
  TensorListSource source(state, "the LOCAL state dict");
  std::unordered_map<const torch::nn::Module*, std::string> module_names;
  for (const auto& item : model.named_modules()) module_names[item.value().get()] = item.key();
  at::NoGradGuard no_grad;
  for (const auto& unit : fsdp_modules(model)) {
    unit.reshard();
    const auto parameters = detail::sharded_parameters(unit);
    if (parameters.empty()) continue;
    const auto& module_name = module_names.at(unit.module().get());
    const std::string name = module_name.empty() ? "flat_param" : module_name + ".flat_param";
    TORCH_CHECK(source.contains(name), "LOCAL state dict has no '", name, "' for ", unit.description(),
                "; it was saved from a model wrapped differently");
    int64_t total = 0;
    for (const auto& parameter : parameters) total += parameter.layout.numel_padded_shard;
    const auto shape = source.shape(name);
    TORCH_CHECK(shape.size() == 1 && shape[0] == total, "LOCAL state dict entry '", name, "' has shape ",
                shape_text(shape), " but this rank's shards of ", unit.description(), " hold ", total,
                " elements: LOCAL_STATE_DICT loads only on the world size and wrapping it was saved with");
    auto flat = source.rows(name, 0, total);
    int64_t offset = 0;
    for (const auto& parameter : parameters) {
      parameter.sharded_padded.copy_(flat.narrow(0, offset, parameter.layout.numel_padded_shard));
      offset += parameter.layout.numel_padded_shard;
    }
  }
  for (const auto& entry : model_tensors(model)) {
    if (entry.owner) continue;
    TORCH_CHECK(source.contains(entry.name), "LOCAL state dict lacks buffer or parameter '", entry.name, "'");
    TORCH_CHECK(at::IntArrayRef(source.shape(entry.name)) == entry.tensor.sizes(),
                shape_message(entry, entry.name, source, entry.tensor.sizes()));
    copy_into_model(entry, source.rows(entry.name, 0, entry.tensor.dim() == 0 ? 1 : entry.tensor.size(0)));
  }
}

namespace {

OptimizerStateDict optimizer_state_dict(torch::nn::Module& model, torch::optim::Optimizer& optimizer,
                                        const std::optional<StateDictConfig>& full_config, bool views = false) {
  const auto tensors = model_tensors(model);
  const auto owners = by_impl(tensors);
  OptimizerStateDict result;
  result.optimizer = detail::optimizer_type(optimizer);
  auto groups = nlohmann::json::array();
  const auto units = fsdp_modules(model);
  const int64_t rank = units.empty() ? 0 : units.front().context().rank();
  const bool keep = !full_config || !full_config->rank0_only || rank == 0;
  std::unordered_set<const c10::TensorImpl*> listed;
  for (auto& group : optimizer.param_groups()) {
    auto values = detail::options_json(result.optimizer, group.options());
    auto names = nlohmann::json::array();
    for (const auto& parameter : group.params()) {
      auto owner = owners.find(parameter.unsafeGetTensorImpl());
      TORCH_CHECK(owner != owners.end(), "optimizer state dict: the optimizer has a parameter of shape ",
                  shape_text(parameter.sizes()), " that is not a parameter of the model");
      const ModelTensor& entry = *owner->second;
      // Its state would be saved twice, a checkpoint no loader takes; its step also ran twice.
      TORCH_CHECK(listed.insert(parameter.unsafeGetTensorImpl()).second, "optimizer state dict: the optimizer holds '",
                  entry.name,
                  "' more than once (a tied weight taken from module->parameters(), which lists it once "
                  "for each module that holds it?); each step updated it twice, and PyTorch warns about such an "
                  "optimizer. Build the optimizer from each parameter once");
      names.push_back(entry.name);
      auto state = optimizer.state().find(optimizer_state_key(parameter));
      if (state == optimizer.state().end()) continue;
      for (const auto& [field, value] : detail::state_fields(result.optimizer, *state->second)) {
        ShardedTensor sharded;
        if (sharded_like_parameter(entry, value)) {
          const auto& layout = entry.owner->shard.layout;
          if (full_config) {
            sharded.local = gather_full(entry.owner->unit, padded(value, layout), layout);
            sharded.global_shape = layout.unsharded_sizes;
            sharded.replicated = true;
          } else {
            sharded.local = taken(value, views);
            sharded.global_shape = layout.unsharded_sizes;
            sharded.row_offset = layout.row_offset;
            sharded.duplicate = is_replica_copy(entry);
          }
        } else {
          sharded.local = taken(value, views);
          sharded.global_shape = value.sizes().vec();
          sharded.replicated = true;
        }
        result.tensors.emplace_back("state." + entry.name + "." + field, std::move(sharded));
      }
    }
    values["params"] = names;
    groups.push_back(values);
  }
  if (!keep) result.tensors.clear();
  result.param_groups_json = groups.dump();
  return result;
}

}  // namespace

OptimizerStateDict full_optimizer_state_dict(torch::nn::Module& model, torch::optim::Optimizer& optimizer,
                                             const StateDictConfig& config) {
  return optimizer_state_dict(model, optimizer, config);
}

OptimizerStateDict sharded_optimizer_state_dict(torch::nn::Module& model, torch::optim::Optimizer& optimizer) {
  return optimizer_state_dict(model, optimizer, std::nullopt);
}

OptimizerStateDict detail::sharded_optimizer_state_dict_views(torch::nn::Module& model,
                                                              torch::optim::Optimizer& optimizer) {
  return optimizer_state_dict(model, optimizer, std::nullopt, /*views=*/true);
}

namespace {
void load_optimizer_state_dict_unchecked(torch::nn::Module& model, torch::optim::Optimizer& optimizer,
                                         const std::string& optimizer_type, const std::string& param_groups_json,
                                         const TensorSource& tensors);
}

void load_optimizer_state_dict(torch::nn::Module& model, torch::optim::Optimizer& optimizer,
                               const std::string& optimizer_type, const std::string& param_groups_json,
                               const TensorSource& tensors) {
  try {
    load_optimizer_state_dict_unchecked(model, optimizer, optimizer_type, param_groups_json, tensors);
  } catch (const nlohmann::json::exception& error) {
    TORCH_CHECK(false, "optimizer state in ", tensors.description(), " has malformed parameter groups (", error.what(),
                ")");
  }
}

namespace {
void load_optimizer_state_dict_unchecked(torch::nn::Module& model, torch::optim::Optimizer& optimizer,
                                         const std::string& optimizer_type, const std::string& param_groups_json,
                                         const TensorSource& tensors) {
  const auto type = detail::optimizer_type(optimizer);
  TORCH_CHECK(type == optimizer_type, "the checkpoint holds ", optimizer_type, " state but the optimizer is ", type,
              "; create the same optimizer class the checkpoint was saved with");
  nlohmann::json groups;
  try {
    groups = nlohmann::json::parse(param_groups_json);
  } catch (const nlohmann::json::exception& error) {
    TORCH_CHECK(false, "optimizer checkpoint: the parameter groups are not valid JSON (", error.what(), ")");
  }
  auto& param_groups = optimizer.param_groups();
  TORCH_CHECK(groups.is_array() && groups.size() == param_groups.size(), "optimizer checkpoint has ",
              groups.is_array() ? groups.size() : 0, " parameter groups but the optimizer has ", param_groups.size());
  const auto model_entries = model_tensors(model);
  const auto owners = by_impl(model_entries);
  for (size_t group_index = 0; group_index < param_groups.size(); ++group_index) {
    auto& group = param_groups[group_index];
    const auto& values = groups[group_index];
    TORCH_CHECK(
        values.contains("params") && values["params"].is_array() && values["params"].size() == group.params().size(),
        "optimizer checkpoint group ", group_index, " lists ", values.contains("params") ? values["params"].size() : 0,
        " parameters but the optimizer's has ", group.params().size());
    for (size_t index = 0; index < group.params().size(); ++index) {
      const auto& parameter = group.params()[index];
      auto owner = owners.find(parameter.unsafeGetTensorImpl());
      TORCH_CHECK(owner != owners.end(), "the optimizer has a parameter that is not a parameter of the model");
      const ModelTensor& entry = *owner->second;
      const auto saved_name = values["params"][index].get<std::string>();
      TORCH_CHECK(std::find(entry.aliases.begin(), entry.aliases.end(), saved_name) != entry.aliases.end(),
                  "optimizer checkpoint group ", group_index, " position ", index, " is parameter '", saved_name,
                  "' but the optimizer has '", entry.name, "' there; build the optimizer the way it was saved");
      std::vector<std::pair<std::string, at::Tensor>> fields;
      const std::string prefix = "state." + saved_name + ".";
      for (const char* field :
           {"step", "exp_avg", "exp_avg_sq", "max_exp_avg_sq", "momentum_buffer", "sum", "square_avg", "grad_avg"}) {
        const std::string name = prefix + field;
        if (!tensors.contains(name)) continue;
        const auto shape = tensors.shape(name);
        at::Tensor local;
        if (state_takes_shard_rows(entry, field, shape)) {
          // Own memory: a view would keep the whole tensor of a FULL file alive on every rank.
          local = local_rows(tensors, name, entry.owner->shard.layout, parameter.options())
                      .to(parameter.scalar_type(), /*non_blocking=*/false, /*copy=*/true);
        } else {
          local = tensors.rows(name, 0, shape.empty() ? 1 : shape[0]).reshape(shape).clone();
        }
        TORCH_CHECK(std::string(field) == "step" || local.sizes() == parameter.sizes(), "optimizer state '", name,
                    "' in ", tensors.description(), " has shape ", shape_text(shape), " but parameter '", entry.name,
                    "' has shape ", shape_text(global_shape(entry)), "; the checkpoint belongs to another model");
        fields.emplace_back(field, local.contiguous());
      }
      const auto key = optimizer_state_key(parameter);
      if (fields.empty()) {
        optimizer.state().erase(key);
      } else {
        optimizer.state()[key] = detail::make_state(type, fields, saved_name);
      }
    }
    detail::apply_options_json(type, values, group.options());
  }
}
}  // namespace

namespace {

// The rows of each optimizer state tensor this rank kept from rank 0's broadcasts, served as the
// full tensors they came from: rows(name, begin, count) must fall inside what was kept.
class KeptRowsSource : public TensorSource {
 public:
  struct Kept {
    std::vector<int64_t> shape;
    int64_t first_row = 0;
    at::Tensor rows;
  };
  explicit KeptRowsSource(std::map<std::string, Kept> kept) : kept_(std::move(kept)) {}
  bool contains(const std::string& name) const override { return kept_.count(name) > 0; }
  std::vector<int64_t> shape(const std::string& name) const override { return kept_.at(name).shape; }
  at::Tensor rows(const std::string& name, int64_t row_begin, int64_t row_count) const override {
    const auto& kept = kept_.at(name);
    if (kept.rows.dim() == 0) return kept.rows;
    TORCH_INTERNAL_ASSERT(row_begin >= kept.first_row && row_begin + row_count <= kept.first_row + kept.rows.size(0),
                          "optimizer state '", name, "': rows ", row_begin, "+", row_count, " were not kept (kept ",
                          kept.first_row, "+", kept.rows.size(0), ")");
    return kept.rows.narrow(0, row_begin - kept.first_row, row_count);
  }
  size_t size() const override { return kept_.size(); }
  std::string description() const override { return "rank 0's optimizer state"; }

 private:
  std::map<std::string, Kept> kept_;
};

}  // namespace

void load_optimizer_state_dict_from_rank0(torch::nn::Module& model, torch::optim::Optimizer& optimizer,
                                          const DistributedContext& context, const OptimizerStateDict* state) {
  const bool is_source = context.rank() == 0;
  TORCH_CHECK(!is_source || state, "load_optimizer_state_dict_from_rank0: rank 0 needs the optimizer state dict");
  // Rank 0 describes what it will send (type, groups, each tensor's name, shape and dtype) before any
  // tensor moves, so every rank issues the same broadcasts.
  std::string header;
  if (is_source) {
    nlohmann::json description = {{"optimizer", state->optimizer},
                                  {"param_groups", state->param_groups_json},
                                  {"tensors", nlohmann::json::array()}};
    for (const auto& [name, tensor] : state->tensors) {
      description["tensors"].push_back(
          {name, tensor.local.sizes().vec(), static_cast<int>(tensor.local.scalar_type())});
    }
    header = description.dump();
  }
  const auto description = nlohmann::json::parse(detail::broadcast_string(context, header, 0));
  std::unordered_map<std::string, const ModelTensor*> by_name;
  const auto entries = model_tensors(model);
  for (const auto& entry : entries) {
    for (const auto& alias : entry.aliases) by_name[alias] = &entry;
  }
  std::map<std::string, KeptRowsSource::Kept> kept;
  const auto& listed = description["tensors"];
  for (size_t index = 0; index < listed.size(); ++index) {
    const auto name = listed[index][0].get<std::string>();
    const auto shape = listed[index][1].get<std::vector<int64_t>>();
    const auto dtype = static_cast<c10::ScalarType>(listed[index][2].get<int>());
    at::Tensor full = is_source ? state->tensors[index].second.local.contiguous()
                                : at::empty(shape, at::TensorOptions().dtype(dtype));
    broadcast(context.world(), full, 0);
    // "state.<parameter>.<field>": keep exactly what load_optimizer_state_dict will ask for, this
    // rank's rows or the whole tensor (state_takes_shard_rows).
    KeptRowsSource::Kept entry{shape, 0, full};
    const auto last_dot = name.rfind('.');
    if (name.rfind("state.", 0) == 0 && last_dot != std::string::npos && last_dot > 6) {
      auto found = by_name.find(name.substr(6, last_dot - 6));
      if (found != by_name.end() && state_takes_shard_rows(*found->second, name.substr(last_dot + 1), full.sizes())) {
        const auto& layout = found->second->owner->shard.layout;
        entry.first_row = layout.row_offset;
        entry.rows = full.reshape({layout.rows, -1}).narrow(0, layout.row_offset, layout.owned_rows).clone();
      }
    }
    kept.emplace(name, std::move(entry));
  }
  load_optimizer_state_dict(model, optimizer, description["optimizer"].get<std::string>(),
                            description["param_groups"].get<std::string>(), KeptRowsSource(std::move(kept)));
}

c10::IValue optimizer_state_dict_to_ivalue(const OptimizerStateDict& state) {
  const auto groups = nlohmann::json::parse(state.param_groups_json);
  c10::impl::GenericDict per_parameter(c10::StringType::get(), c10::AnyType::get());
  std::map<std::string, c10::Dict<std::string, at::Tensor>> fields;
  for (const auto& group : groups) {
    for (const auto& name : group["params"])
      fields.emplace(name.get<std::string>(), c10::Dict<std::string, at::Tensor>());
  }
  for (const auto& [key, tensor] : state.tensors) {
    // "state.<parameter>.<field>": the field is the last component; parameter names contain dots.
    const auto last_dot = key.rfind('.');
    const auto parameter = key.substr(6, last_dot - 6);
    fields[parameter].insert(key.substr(last_dot + 1), tensor.local);
  }
  for (const auto& [parameter, dict] : fields) {
    if (dict.size() > 0) per_parameter.insert(parameter, dict);
  }
  c10::impl::GenericList param_groups(c10::AnyType::get());
  for (const auto& group : groups) {
    c10::impl::GenericDict entry(c10::StringType::get(), c10::AnyType::get());
    for (const auto& [key, value] : group.items()) {
      if (key == "params") {
        c10::List<std::string> names;
        for (const auto& name : value) names.push_back(name.get<std::string>());
        entry.insert(key, names);
      } else if (key == "betas") {
        entry.insert(key, c10::ivalue::Tuple::create({value[0].get<double>(), value[1].get<double>()}));
      } else if (value.is_boolean()) {
        entry.insert(key, value.get<bool>());
      } else if (value.is_null()) {
        entry.insert(key, c10::IValue());  // PyTorch's foreach and fused: None
      } else {
        entry.insert(key, value.get<double>());
      }
    }
    param_groups.push_back(entry);
  }
  c10::impl::GenericDict result(c10::StringType::get(), c10::AnyType::get());
  result.insert("optimizer", state.optimizer);
  result.insert("state", per_parameter);
  result.insert("param_groups", param_groups);
  return result;
}

OptimizerStateDict optimizer_state_dict_from_ivalue(const c10::IValue& value, const std::string& source) {
  auto fail = [&](const std::string& what) {
    TORCH_CHECK(false, "optimizer file '", source, "': ", what,
                "; expected {\"optimizer\": str, \"state\": {name: {field: tensor}}, \"param_groups\": [...]}");
  };
  if (!value.isGenericDict()) fail(std::string("holds a ") + value.tagKind().c_str());
  const auto dict = value.toGenericDict();
  if (!dict.contains("state") || !dict.contains("param_groups")) fail("lacks 'state' or 'param_groups'");
  OptimizerStateDict result;
  // PyTorch's optimizer.state_dict() does not name its class (result.optimizer stays empty); fsdp.cpp's does.
  if (dict.contains("optimizer")) {
    if (!dict.at("optimizer").isString()) fail("'optimizer' is not a string");
    result.optimizer = dict.at("optimizer").toStringRef();
  }
  if (!dict.at("state").isGenericDict()) fail("'state' is not a dict");
  for (const auto& parameter : dict.at("state").toGenericDict()) {
    if (!parameter.key().isString() || !parameter.value().isGenericDict()) fail("'state' has a malformed entry");
    for (const auto& field : parameter.value().toGenericDict()) {
      if (!field.key().isString() || !field.value().isTensor())
        fail("state of '" + parameter.key().toStringRef() + "' has a non-tensor field");
      ShardedTensor tensor;
      tensor.local = field.value().toTensor();
      tensor.global_shape = tensor.local.sizes().vec();
      tensor.replicated = true;
      result.tensors.emplace_back("state." + parameter.key().toStringRef() + "." + field.key().toStringRef(), tensor);
    }
  }
  if (!dict.at("param_groups").isList()) fail("'param_groups' is not a list");
  auto groups = nlohmann::json::array();
  for (const auto& group : dict.at("param_groups").toList()) {
    const c10::IValue item = group;
    if (!item.isGenericDict()) fail("a parameter group is not a dict");
    nlohmann::json values;
    for (const auto& entry : item.toGenericDict()) {
      if (!entry.key().isString()) fail("a parameter group has a key that is not a string");
      const auto& key = entry.key().toStringRef();
      const auto& field = entry.value();
      if (field.isDouble())
        values[key] = field.toDouble();
      else if (field.isInt())
        values[key] = field.toInt();
      else if (field.isBool())
        values[key] = field.toBool();
      else if (field.isNone())
        values[key] = nullptr;  // PyTorch's foreach and fused
      else if (field.isTuple()) {
        const auto& elements = field.toTupleRef().elements();
        if (elements.size() != 2 || !elements[0].isDouble() || !elements[1].isDouble())
          fail("'" + key + "' is not a pair of numbers");
        values[key] = {elements[0].toDouble(), elements[1].toDouble()};
      } else if (field.isList()) {
        auto names = nlohmann::json::array();
        for (const auto& name : field.toList()) {
          const c10::IValue element = name;
          if (!element.isString()) fail("'" + key + "' lists something that is not a parameter name");
          names.push_back(element.toStringRef());
        }
        values[key] = names;
      } else {
        fail("parameter group entry '" + key + "' has an unsupported type");
      }
    }
    groups.push_back(values);
  }
  result.param_groups_json = groups.dump();
  return result;
}

}  // namespace fsdp
