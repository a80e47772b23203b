#include <ATen/ATen.h>
#include <fsdp/accelerator.h>
#include <fsdp/clip_grad_norm.h>
#include <fsdp/collectives.h>
#include <fsdp/device.h>
#include <fsdp/fsdp2_prepare.h>
#include <fsdp/fully_shard.h>
#include <fsdp/host_memory.h>
#include <fsdp/meta_device.h>
#include <fsdp/safetensors.h>
#include <fsdp/torch_file.h>

#include <algorithm>
#include <filesystem>
#include <iostream>
#include <map>
#include <nlohmann/json.hpp>
#include <sstream>
#include <unordered_map>
#include <unordered_set>

#include "checkpoint/automatic_checkpoints.h"
#include "checkpoint/hf_shards.h"
#include "checkpoint/state_dict_views.h"
#include "config/text.h"
#include "dist/agreement.h"
#include "dist/control_channel.h"
#include "io/atomic_file.h"

namespace fsdp {

Accelerator::Accelerator(DistributedContext context, AcceleratorOptions options, const EnvironmentMap& environment)
    : context_(std::move(context)),
      gradient_accumulation_steps_(options.gradient_accumulation_steps),
      project_dir_(options.project_dir),
      total_limit_(options.total_limit),
      cpu_(options.cpu) {
  batch_split_.split_batches = options.split_batches;
  batch_split_.even_batches = options.even_batches;
  TORCH_CHECK(gradient_accumulation_steps_ >= 1, "Accelerator: gradient_accumulation_steps must be at least 1, got ",
              gradient_accumulation_steps_);
  TORCH_CHECK(total_limit_ >= 0, "Accelerator: total_limit must be 0 (keep all) or positive, got ", total_limit_);
  if (options.limit_retained_host_memory) limit_retained_host_memory();
  if (options.mixed_precision) {
    mixed_precision_ = detail::to_lower(*options.mixed_precision);
  } else {
    auto found = environment.find("ACCELERATE_MIXED_PRECISION");
    mixed_precision_ = found == environment.end() ? "no" : detail::to_lower(found->second);
  }
  TORCH_CHECK(mixed_precision_ == "no" || mixed_precision_ == "bf16" || mixed_precision_ == "fp16",
              "Accelerator: mixed_precision is '", mixed_precision_, "'; expected 'no', 'bf16' or 'fp16'");
  // fp16 on CPU runs without a gradient scaler, as Accelerate does there (it makes a GradScaler on
  // accelerators only): docs/engine.md, mixed precision.
  plugin_ = options.fsdp_plugin ? *options.fsdp_plugin
                                : FullyShardedDataParallelPlugin(FullyShardedDataParallelPluginArgs{}, environment);
  TORCH_CHECK(!cpu_ || !plugin_.cpu_offload.offload_params || cuda_device_count() == 0,
              "Accelerator: cpu=true keeps the job on the CPU, but the plugin's cpu_offload (",
              plugin_.sources.count("cpu_offload") ? plugin_.sources.at("cpu_offload") : std::string("argument"),
              ") computes offloaded units on a GPU, and this machine has ", cuda_device_count(),
              ". Turn one of them off");
  // As AcceleratorState does: the accelerator's precision fills a plugin that has no policy.
  if (mixed_precision_ != "no") plugin_.set_mixed_precision(mixed_precision_);
  // Accelerate's fp16 on an accelerator: a ShardedGradScaler over the whole job under FSDP.
  if (mixed_precision_ == "fp16" && device().is_cuda()) scaler_.emplace(context_.world());
}

std::vector<std::vector<int64_t>> Accelerator::prepare_batches(const std::vector<int64_t>& order, int64_t batch_size,
                                                               bool drop_last) const {
  BatchSplitOptions options = batch_split_;
  options.batch_size = batch_size;
  options.drop_last = drop_last;
  return split_batches_for_rank(order, options, context_.world_size(), context_.rank());
}

c10::Device Accelerator::device() const {
  return cpu_ ? c10::Device(c10::kCPU) : default_device(context_.environment().local_rank);
}

std::shared_ptr<torch::nn::Module> Accelerator::prepare(const std::shared_ptr<torch::nn::Module>& model,
                                                        torch::optim::Optimizer& optimizer) {
  TORCH_CHECK(model, "Accelerator::prepare: the model is null");
  TORCH_CHECK(optimizer.state().empty(),
              "Accelerator::prepare: the optimizer has already stepped, so its state has the shapes of the full "
              "parameters. Create the optimizer, then prepare it with the model before the first step");
  agree_on_preparation(*model, optimizer);
  // Accelerate places the model on accelerator.device before FSDP2 shards it. The move keeps each
  // parameter's identity (Module::to sets the data in place), so the optimizer's slots, which share
  // the parameters, see the new addresses below. Under cpu_offload the shards go to host memory
  // whatever the model's device, and a model on the meta device is materialized by fully_shard.
  const auto target = device();
  if (!target.is_cpu() && !plugin_.cpu_offload.offload_params && !has_meta_tensors(*model)) model->to(target);
  // As Accelerator._prepare_fsdp2 (accelerate/accelerator.py): remember each optimizer slot's
  // parameter by its data pointer, let the slots point at nothing so sharding can free the full
  // tensors, shard, then map back by name. A parameter without memory (built on the meta device, or
  // empty) has no data pointer of its own: it is known by its TensorImpl instead, which no live
  // data pointer can equal.
  auto address_of = [](const at::Tensor& parameter) -> void* {
    void* pointer = parameter.data_ptr();
    return pointer ? pointer : static_cast<void*>(parameter.unsafeGetTensorImpl());
  };
  std::unordered_map<std::string, const void*> old_pointers;
  for (const auto& item : model->named_parameters()) old_pointers.emplace(item.key(), address_of(item.value()));
  for (auto& group : optimizer.param_groups()) {
    for (auto& parameter : group.params()) {
      // A one-element view of the old address that owns nothing; it is only ever compared.
      parameter = at::from_blob(
          address_of(parameter), {1}, [](void*) {},
          at::TensorOptions().dtype(parameter.scalar_type()).requires_grad(false));
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
  report_preparation(*model);
  return model;
}

std::string preparation_summary(const FullyShardedDataParallelPlugin& plugin, const std::string& mixed_precision,
                                torch::nn::Module& model) {
  std::vector<std::string> units;
  for (const auto& item : model.named_modules("", /*include_self=*/true)) {
    if (is_fsdp_module(*item.value())) units.push_back(item.key());
  }
  // Inner units first, the root last (fully_shard's order); at most 3 named.
  std::string listed;
  size_t named = 0;
  for (const auto& unit : units) {
    if (unit.empty() || named == 3) continue;
    listed += (named++ == 0 ? "" : ", ") + unit;
  }
  const bool has_root = std::find(units.begin(), units.end(), "") != units.end();
  const size_t inner = units.size() - (has_root ? 1 : 0);
  if (inner > named) listed += ", ... " + std::to_string(inner - named) + " more";
  if (has_root) listed += listed.empty() ? "the root alone" : " and the root";
  std::string strategy = plugin.fsdp_version == 1
                             ? std::string("sharding_strategy ") + to_string(plugin.sharding_strategy)
                             : "reshard_after_forward " + plugin.reshard_after_forward.to_string();
  return "fsdp: prepared with FSDP version " + std::to_string(plugin.fsdp_version) + ", " + strategy +
         ", auto_wrap_policy " + to_string(plugin.auto_wrap_policy) + ": " + std::to_string(units.size()) +
         (units.size() == 1 ? " unit (" : " units (") + listed + "), state_dict_type " +
         to_string(plugin.state_dict_type) + ", mixed precision " + mixed_precision +
         (plugin.cpu_offload.offload_params ? ", parameters offloaded to the CPU" : "");
}

void Accelerator::report_preparation(torch::nn::Module& model) const {
  if (!is_main_process()) return;
  print(preparation_summary(plugin_, mixed_precision_, model));
  // Configured: a field given as an argument, by an FSDP_* variable (fsdp launch exports the YAML's
  // keys as those), not only defaults and values derived from them.
  const bool configured = std::any_of(plugin_.sources.begin(), plugin_.sources.end(), [](const auto& entry) {
    return entry.second == "argument" || entry.second.rfind("environment variable", 0) == 0;
  });
  if (!configured) {
    TORCH_WARN(
        "Accelerator::prepare: no FSDP configuration was given (no plugin argument, no FSDP_* variable, no "
        "Accelerate YAML through `fsdp launch --config_file`), so Accelerate's defaults apply: FSDP version 1, "
        "no auto-wrap (the whole model is one unit, gathered whole for every forward), FULL_STATE_DICT "
        "checkpoints. Set fsdp_config in an Accelerate YAML (examples/accelerate.yaml; keys in docs/plugin.md) "
        "or AcceleratorOptions::fsdp_plugin");
  }
}

void Accelerator::agree_on_preparation(torch::nn::Module& model, torch::optim::Optimizer& optimizer) const {
  if (context_.world_size() <= 1) return;
  // What must be the same on every rank before the first collective: the resolved plugin (from each
  // rank's own environment), the precision, accumulation, and the model the plugin will shard.
  std::vector<std::pair<std::string, std::string>> fields;
  const auto plugin = nlohmann::json::parse(plugin_.to_json());
  for (const auto& [name, entry] : plugin.items()) {
    // Derived from the fields themselves: listing it would only repeat their difference, first.
    if (name == "differences_from_accelerate") continue;
    fields.emplace_back(name, entry.is_object() && entry.contains("value") ? entry["value"].dump() : entry.dump());
  }
  fields.emplace_back("mixed_precision", mixed_precision_);
  fields.emplace_back("gradient_accumulation_steps", std::to_string(gradient_accumulation_steps_));
  int64_t count = 0;
  // A parameter a unit already manages (the model, or part of it, was sharded before prepare) holds
  // this rank's shard, whose size differs by rank: its unit agreed on it when it was made.
  std::unordered_set<const c10::TensorImpl*> managed;
  for (const auto& unit : fsdp_modules(model)) {
    for (const auto& info : detail::sharded_parameters(unit)) managed.insert(info.parameter.unsafeGetTensorImpl());
  }
  for (const auto& item : model.named_parameters()) {
    ++count;
    if (managed.count(item.value().unsafeGetTensorImpl())) continue;
    fields.emplace_back("parameter " + item.key(), c10::str(item.value().sizes(), " ", item.value().scalar_type()));
  }
  for (const auto& item : model.named_buffers()) {
    fields.emplace_back("buffer " + item.key(), c10::str(item.value().sizes(), " ", item.value().scalar_type()));
  }
  fields.emplace_back("parameter count", std::to_string(count));
  size_t slots = 0;
  for (const auto& group : optimizer.param_groups()) slots += group.params().size();
  fields.emplace_back("optimizer parameters", std::to_string(slots));
  detail::agree_on_fields(context_, "Accelerator::prepare", fields,
                          "Every rank must build the same model and optimizer, and launch with the same FSDP_* and "
                          "ACCELERATE_* environment and config file (fsdp launch gives every rank the same)");
}

CheckpointOptions checkpoint_options_from_plugin(const FullyShardedDataParallelPlugin& plugin) {
  CheckpointOptions options;
  options.state_dict_type = plugin.state_dict_type;
  options.state_dict_config = plugin.state_dict_config;
  options.optim_state_dict_config = plugin.optim_state_dict_config;
  return options;
}

void Accelerator::save_state(const std::string& directory, const TrainingProgress& progress,
                             const SaveStateOptions& options) {
  TORCH_CHECK(model_ && optimizer_, "Accelerator::save_state: prepare(model, optimizer) first");
  if (scaler_) {
    TORCH_WARN_ONCE(
        "Accelerator::save_state: the fp16 gradient scaler's state (Accelerate's scaler.pt) is not saved "
        "yet; a run resumed from this checkpoint starts again from the initial scale ",
        scaler_->options().init_scale);
  }
  const auto checkpoint_options = checkpoint_options_from_plugin(plugin_);
  if (!options.async) {
    finish_checkpoint(true);  // an asynchronous save before this one is finished first
    save_checkpoint(directory, *model_, *optimizer_, context_, progress, checkpoint_options);
    return;
  }
  TORCH_CHECK(checkpoint_options.state_dict_type == StateDictType::kShardedStateDict,
              "Accelerator::save_state: an asynchronous save writes SHARDED_STATE_DICT checkpoints only, but the "
              "plugin's state_dict_type is ",
              to_string(checkpoint_options.state_dict_type),
              ". Set FSDP_STATE_DICT_TYPE=SHARDED_STATE_DICT (or the plugin's state_dict_type), or save without async");
  if (!async_checkpointer_) async_checkpointer_ = std::make_unique<AsyncCheckpointer>();
  auto& writer = *async_checkpointer_;
  // At most one in flight: start() finishes the save before this one first, waiting for its files
  // when they are not all written yet; an automatic one is rotated after it.
  const bool rotate_previous = writer.in_flight() && rotate_after_finish_;
  rotate_after_finish_ = false;
  writer.start(directory, *model_, *optimizer_, context_, progress);
  if (rotate_previous) rotate_checkpoints();
  std::ostringstream line;
  line.setf(std::ios::fixed);
  line.precision(2);
  line << "asynchronous checkpoint " << directory << ": staged " << writer.staging_bytes() / 1048576.0
       << " MiB of this rank's state in " << writer.staging_seconds() << " s; the files are written in the background";
  if (writer.waited_seconds() > 0) {
    line << " (waited " << writer.waited_seconds() << " s for the save before it to be written)";
  }
  print(line.str());
}

bool Accelerator::finish_checkpoint(bool wait) {
  if (!async_checkpointer_ || !async_checkpointer_->in_flight()) return true;
  if (!async_checkpointer_->finish(context_, wait)) return false;
  if (rotate_after_finish_) {
    rotate_after_finish_ = false;
    rotate_checkpoints();
  }
  return true;
}

TrainingProgress Accelerator::load_state(const std::string& directory) {
  TORCH_CHECK(model_ && optimizer_, "Accelerator::load_state: prepare(model, optimizer) first");
  TORCH_CHECK(!directory.empty(),
              "Accelerator::load_state: the directory is \"\", which latest_checkpoint() returns "
              "when '",
              (std::filesystem::path(project_dir_) / "checkpoints").string(),
              "' holds no complete checkpoint yet. Load only when there is one: if (auto latest = "
              "accelerator.latest_checkpoint(); !latest.empty()) accelerator.load_state(latest);");
  finish_checkpoint(true);
  return load_checkpoint(directory, *model_, *optimizer_, context_, checkpoint_options_from_plugin(plugin_));
}

}  // namespace fsdp

namespace fsdp {
namespace {

namespace fs = std::filesystem;

}  // namespace

Accelerator::AccumulateScope::AccumulateScope(Accelerator& accelerator) : accelerator_(accelerator) {
  ++accelerator_.micro_step_;
  accelerator_.sync_gradients_ = accelerator_.micro_step_ % accelerator_.gradient_accumulation_steps_ == 0;
  TORCH_CHECK(accelerator_.model_, "Accelerator::accumulate: prepare(model, optimizer) first");
  if (auto unit = fsdp_module_of(*accelerator_.model_)) unit->set_requires_gradient_sync(accelerator_.sync_gradients_);
}

Accelerator::AccumulateScope::~AccumulateScope() {
  if (!accelerator_.model_) return;
  if (auto unit = fsdp_module_of(*accelerator_.model_)) unit->set_requires_gradient_sync(true);
}

void Accelerator::backward(const torch::Tensor& loss) {
  auto divided = gradient_accumulation_steps_ > 1 ? loss / static_cast<double>(gradient_accumulation_steps_) : loss;
  (scaler_ ? scaler_->scale(divided) : divided).backward();
}

double Accelerator::clip_grad_norm_(double max_norm, double norm_type) {
  TORCH_CHECK(model_, "Accelerator::clip_grad_norm_: prepare(model, optimizer) first");
  if (scaler_ && optimizer_ && !scaler_->unscaled(*optimizer_)) scaler_->unscale_(*optimizer_);
  return fsdp::clip_grad_norm_(*model_, max_norm, norm_type);
}

bool Accelerator::step() {
  TORCH_CHECK(optimizer_, "Accelerator::step: prepare(model, optimizer) first");
  step_was_skipped_ = false;
  bool stepped = true;
  if (!scaler_) {
    optimizer_->step();
  } else {
    stepped = scaler_->step(*optimizer_);
    scaler_->update();
    step_was_skipped_ = !stepped;
  }
  finish_checkpoint(false);  // an asynchronous save counts as soon as every rank has written it
  return stepped;
}

at::Tensor Accelerator::gather(const at::Tensor& tensor) const {
  auto input = tensor.detach().contiguous().reshape({-1});
  auto output = at::empty({input.numel() * context_.world_size()}, input.options());
  all_gather(context_.world(), output, input);
  std::vector<int64_t> shape = tensor.sizes().vec();
  if (shape.empty()) return output;
  shape[0] *= context_.world_size();
  return output.view(shape);
}

at::Tensor Accelerator::reduce(const at::Tensor& tensor, const std::string& reduction) const {
  TORCH_CHECK(reduction == "sum" || reduction == "mean",
              "Accelerator::reduce: reduction must be 'sum' or 'mean', got '", reduction, "'");
  // Accelerate raises here too, with torch's "result type Float can't be cast to the desired output type Long".
  TORCH_CHECK(reduction == "sum" || at::isFloatingType(tensor.scalar_type()) || at::isComplexType(tensor.scalar_type()),
              "Accelerator::reduce: the mean of an integer tensor (", tensor.scalar_type(),
              ") is not an integer; reduce with 'sum', or pass a floating-point tensor");
  auto result = tensor.detach().clone().contiguous();
  all_reduce(context_.world(), result);
  if (reduction == "mean") result.div_(static_cast<double>(context_.world_size()));
  return result;
}

void Accelerator::print(const std::string& line) const {
  if (is_main_process()) std::cout << line << std::endl;
}

void Accelerator::wait_for_everyone() const { barrier(context_.control()); }

TensorList Accelerator::get_state_dict() {
  TORCH_CHECK(model_, "Accelerator::get_state_dict: prepare(model, optimizer) first");
  return full_model_state_dict(*model_, StateDictConfig{true, true});
}

void Accelerator::save_model(const std::string& directory, int64_t max_shard_size, bool safe_serialization) {
  TORCH_CHECK(model_, "Accelerator::save_model: prepare(model, optimizer) first");
  // Rank 0 writes while the tensors are gathered, one at a time (Note [a full state dict one tensor
  // at a time]); every rank learns whether it managed to.
  detail::FullModelTensors tensors(*model_, StateDictConfig{true, true});
  const auto error =
      detail::save_pretrained_files(directory, tensors.entries(), max_shard_size, safe_serialization, is_main_process(),
                                    [&](size_t index) { return tensors.gather(index); });
  detail::raise_if_any_rank_failed(context_, error);
}

std::string Accelerator::save_state(const TrainingProgress& progress, const SaveStateOptions& options) {
  const auto directory = detail::next_automatic_checkpoint(project_dir_);
  save_state(directory, progress, options);
  if (options.async) {
    rotate_after_finish_ = true;
    return directory;
  }
  rotate_checkpoints();
  return directory;
}

void Accelerator::rotate_checkpoints() {
  // Rank 0 deletes; a failure there (a file it may not remove) is every rank's error, not a hang.
  detail::run_on_every_rank(context_, [&] {
    if (is_main_process()) detail::remove_old_checkpoints(project_dir_, total_limit_);
  });
}

std::string Accelerator::latest_checkpoint() const { return detail::latest_complete_checkpoint(project_dir_); }

std::optional<TrainingProgress> Accelerator::resume_after_restart() {
  const int64_t restart = restart_count();
  if (restart == 0) return std::nullopt;
  // Rank 0's answer for every rank: a checkpoint one rank saw complete and another not yet would
  // otherwise split the job between two starting steps.
  const auto directory = detail::broadcast_string(context_, is_main_process() ? latest_checkpoint() : "", 0);
  const auto round =
      "restart " + std::to_string(restart) + " of " + std::to_string(context_.environment().max_restarts) + ": ";
  if (directory.empty()) {
    print(round + "no complete checkpoint in " + (fs::path(project_dir_) / "checkpoints").string() +
          "; starting from step 0");
    return std::nullopt;
  }
  auto progress = load_state(directory);
  print(round + "resumed from " + directory + " at step " + std::to_string(progress.step));
  return progress;
}

std::shared_ptr<torch::nn::Module> fsdp2_prepare_model(Accelerator& accelerator,
                                                       const std::shared_ptr<torch::nn::Module>& model) {
  return fsdp2_prepare_model(accelerator.fsdp_plugin(), accelerator.context(), accelerator.mixed_precision(), model);
}

std::shared_ptr<torch::nn::Module> fsdp2_load_full_state_dict(Accelerator& accelerator,
                                                              const std::shared_ptr<torch::nn::Module>& model,
                                                              const TensorList& full_state_dict, bool cpu_offload) {
  return fsdp2_load_full_state_dict(accelerator.context(), model, full_state_dict, cpu_offload);
}

}  // namespace fsdp
