#include "engine/param_group.h"

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>

#include <sstream>

#include <fsdp/collectives.h>

#include "engine/module_state.h"

namespace fsdp::detail {
namespace {

constexpr int64_t kAlignmentBytes = 16;

int64_t align_up(int64_t bytes) { return (bytes + kAlignmentBytes - 1) / kAlignmentBytes * kAlignmentBytes; }

int64_t element_size(c10::ScalarType dtype) { return static_cast<int64_t>(c10::elementSize(dtype)); }

void free_storage(const at::Tensor& tensor) {
  auto* storage = tensor.storage().unsafeGetStorageImpl();
  storage->set_data_ptr_noswap(at::DataPtr(nullptr, tensor.device()));
  storage->set_nbytes(0);
}

void allocate_storage(const at::Tensor& tensor, int64_t nbytes) {
  auto* storage = tensor.storage().unsafeGetStorageImpl();
  if (static_cast<int64_t>(storage->nbytes()) == nbytes) return;
  storage->set_data_ptr_noswap(storage->allocator()->allocate(nbytes));
  storage->set_nbytes(nbytes);
}

/// Runs after a parameter's AccumulateGrad node wrote `param.grad`.
class GradientReadyHook final : public torch::autograd::FunctionPostHook {
 public:
  GradientReadyHook(std::weak_ptr<ParamGroup> group, size_t parameter_index)
      : group_(std::move(group)), parameter_index_(parameter_index) {}
  torch::autograd::variable_list operator()(const torch::autograd::variable_list& outputs,
                                            const torch::autograd::variable_list& /*inputs*/) override {
    if (auto group = group_.lock()) group->on_gradient_ready(parameter_index_);
    return outputs;
  }

 private:
  std::weak_ptr<ParamGroup> group_;
  size_t parameter_index_;
};

std::string sizes_text(at::IntArrayRef sizes) {
  std::ostringstream text;
  text << sizes;
  return text.str();
}

}  // namespace

ParamGroup::ParamGroup(std::vector<std::shared_ptr<torch::nn::Module>> modules, const DistributedContext& context,
                       const FullyShardOptions& options, std::vector<ShardedParameter> parameters)
    : context_(context), options_(options), parameters_(std::move(parameters)) {
  for (const auto& module : modules) modules_.emplace_back(module);
}

std::string ParamGroup::description() const {
  std::ostringstream text;
  text << "FSDP unit over ";
  for (size_t i = 0; i < modules_.size(); ++i) {
    auto module = modules_[i].lock();
    text << (i ? ", " : "") << (module ? module->name() : std::string("<destroyed module>"));
  }
  return text.str();
}

bool ParamGroup::reshard_after_forward() const {
  if (reshard_after_forward_override_) return *reshard_after_forward_override_;
  if (options_.reshard_after_forward) return *options_.reshard_after_forward;
  // FSDP2's None: the root keeps its parameters because backward starts with it.
  return !is_root_ && reshards_after_forward(options_.sharding_strategy);
}

int64_t ParamGroup::unsharded_buffer_bytes() const {
  return unsharded_buffer_.defined() ? static_cast<int64_t>(unsharded_buffer_.storage().nbytes()) : 0;
}

void ParamGroup::initialize() {
  const auto& world = context_.world();
  switch (options_.sharding_strategy) {
    case ShardingStrategy::kFullShard:
    case ShardingStrategy::kShardGradOp:
      if (world.size() > 1) shard_group_ = world;
      break;
    case ShardingStrategy::kNoShard:
      if (world.size() > 1) replicate_group_ = world;
      break;
    case ShardingStrategy::kHybridShard:
    case ShardingStrategy::kHybridShardZero2:
      if (context_.intra_node().size() > 1) shard_group_ = context_.intra_node();
      if (context_.cross_node().size() > 1) replicate_group_ = context_.cross_node();
      break;
  }
  const int64_t shard_size = shard_world_size();
  const int64_t rank = shard_rank();
  at::NoGradGuard no_grad;

  if (options_.sync_module_states && world.size() > 1) {
    for (auto& parameter : parameters_) {
      auto data = parameter.parameter.detach();
      TORCH_CHECK(data.is_contiguous(), "fully_shard(sync_module_states): parameter '", parameter.name,
                  "' is not contiguous; call .contiguous() on it first");
      broadcast(world, data, 0);
    }
  }

  unshard_is_identity_ = shard_size == 1;
  int64_t all_gather_bytes = 0;
  int64_t unsharded_bytes = 0;
  for (auto& parameter : parameters_) {
    auto full = parameter.parameter.detach();
    parameter.original_dtype = full.scalar_type();
    parameter.compute_dtype = parameter.original_dtype;
    if (options_.mixed_precision.param_dtype && at::isFloatingType(parameter.original_dtype)) {
      parameter.compute_dtype = *options_.mixed_precision.param_dtype;
    }
    if (parameter.compute_dtype != parameter.original_dtype) unshard_is_identity_ = false;
    parameter.layout = shard_layout(full.sizes().vec(), shard_size, rank);
    const auto& layout = parameter.layout;
    parameter.sharded_padded = at::zeros({layout.numel_padded_shard}, full.options());
    if (layout.numel_owned > 0) {
      parameter.sharded_padded.narrow(0, 0, layout.numel_owned)
          .copy_(full.reshape({-1}).narrow(0, layout.element_offset(), layout.numel_owned));
    }
    parameter.sharded_data = parameter.sharded_padded.narrow(0, 0, layout.numel_owned).view(layout.sharded_sizes);
    parameter.all_gather_offset_bytes = all_gather_bytes;
    const int64_t shard_bytes = layout.numel_padded_shard * element_size(parameter.compute_dtype);
    all_gather_bytes = align_up(all_gather_bytes + shard_bytes);
    parameter.unsharded_offset_bytes = unsharded_bytes;
    unsharded_bytes = align_up(unsharded_bytes + shard_size * shard_bytes);
    // The full tensor is released here: the parameter now owns only its shard.
    parameter.parameter.set_data(parameter.sharded_data);
  }
  all_gather_row_bytes_ = all_gather_bytes;
  unsharded_buffer_bytes_ = unsharded_bytes;

  if (unshard_is_identity_) {
    for (auto& parameter : parameters_) {
      parameter.unsharded_data = parameter.sharded_padded.view(parameter.layout.unsharded_sizes);
    }
  } else {
    unsharded_buffer_ = at::empty({std::max<int64_t>(unsharded_buffer_bytes_, 1)}, at::TensorOptions().dtype(at::kByte));
    for (auto& parameter : parameters_) {
      const int64_t bytes = parameter.layout.numel_unsharded() * element_size(parameter.compute_dtype);
      parameter.unsharded_data = unsharded_buffer_.narrow(0, parameter.unsharded_offset_bytes, bytes)
                                     .view(parameter.compute_dtype)
                                     .view(parameter.layout.unsharded_sizes);
    }
    free_storage(unsharded_buffer_);
  }
  refresh_trainable_parameters();
}

void ParamGroup::refresh_trainable_parameters() {
  int64_t offset = 0;
  trainable_count_ = 0;
  std::optional<c10::ScalarType> gradient_dtype;
  const ShardedParameter* first_trainable = nullptr;
  for (auto& parameter : parameters_) {
    parameter.requires_grad = parameter.parameter.requires_grad();
    if (!parameter.requires_grad) continue;
    parameter.reduce_offset = offset;
    offset += parameter.layout.numel_padded_shard;
    ++trainable_count_;
    if (!first_trainable) {
      first_trainable = &parameter;
      gradient_dtype = parameter.compute_dtype;
    } else {
      TORCH_CHECK(options_.mixed_precision.reduce_dtype || parameter.compute_dtype == *gradient_dtype,
                  description(), ": trainable parameters '", first_trainable->name, "' (", *gradient_dtype, ") and '",
                  parameter.name, "' (", parameter.compute_dtype,
                  ") have different dtypes, so their gradients cannot be reduced together. Give every trainable "
                  "parameter of a unit the same dtype, set mixed_precision.reduce_dtype, or put them in different "
                  "units");
    }
  }
  reduce_dtype_ = options_.mixed_precision.reduce_dtype ? options_.mixed_precision.reduce_dtype : gradient_dtype;
  // One flag per trainable parameter follows the shards: whether any rank had a gradient for it.
  reduce_row_numel_ = offset + trainable_count_;
}

void ParamGroup::unshard() {
  if (sharded_state_ == ShardedState::kUnsharded) return;
  if (!unshard_is_identity_) {
    at::NoGradGuard no_grad;
    allocate_storage(unsharded_buffer_, std::max<int64_t>(unsharded_buffer_bytes_, 1));
    const int64_t shard_size = shard_world_size();
    if (shard_size == 1) {
      for (auto& parameter : parameters_) {
        parameter.unsharded_data.copy_(parameter.sharded_padded.view(parameter.layout.unsharded_sizes));
      }
    } else {
      auto all_gather_input = at::empty({all_gather_row_bytes_}, at::TensorOptions().dtype(at::kByte));
      for (const auto& parameter : parameters_) {
        const int64_t bytes = parameter.layout.numel_padded_shard * element_size(parameter.compute_dtype);
        all_gather_input.narrow(0, parameter.all_gather_offset_bytes, bytes)
            .view(parameter.compute_dtype)
            .copy_(parameter.sharded_padded);
      }
      auto all_gather_output = at::empty({shard_size * all_gather_row_bytes_}, all_gather_input.options());
      all_gather(*shard_group_, all_gather_output, all_gather_input);
      auto rows = all_gather_output.view({shard_size, all_gather_row_bytes_});
      for (const auto& parameter : parameters_) {
        const int64_t bytes = parameter.layout.numel_padded_shard * element_size(parameter.compute_dtype);
        if (bytes == 0) continue;
        // Row r holds rank r's padded shard, so the region becomes the dim-0-padded full tensor.
        unsharded_buffer_.narrow(0, parameter.unsharded_offset_bytes, shard_size * bytes)
            .view({shard_size, bytes})
            .copy_(rows.narrow(1, parameter.all_gather_offset_bytes, bytes));
      }
    }
    for (auto& parameter : parameters_) parameter.parameter.set_data(parameter.unsharded_data);
  }
  sharded_state_ = ShardedState::kUnsharded;
}

void ParamGroup::reshard() {
  if (sharded_state_ == ShardedState::kSharded) return;
  if (!unshard_is_identity_) {
    for (auto& parameter : parameters_) parameter.parameter.set_data(parameter.sharded_data);
    free_storage(unsharded_buffer_);
  }
  sharded_state_ = ShardedState::kSharded;
}

void ParamGroup::pre_forward(bool grad_enabled) {
  unshard();
  if (!grad_enabled) return;
  forwarded_this_iteration_ = true;
  register_gradient_hooks();
}

void ParamGroup::register_gradient_hooks() {
  for (size_t index = 0; index < parameters_.size(); ++index) {
    auto& parameter = parameters_[index];
    if (!parameter.parameter.requires_grad()) continue;
    // The node records the parameter's shape when created; one made while the parameter was a
    // shard (e.g. by code that used the sharded parameter) cannot take the full gradient.
    auto accumulator = torch::autograd::impl::grad_accumulator(parameter.parameter);
    if (!accumulator->input_metadata(0).is_same_shape(parameter.parameter)) {
      torch::autograd::impl::set_grad_accumulator(parameter.parameter, {});
      accumulator = torch::autograd::impl::grad_accumulator(parameter.parameter);
    }
    if (parameter.hooked_accumulator.lock() != accumulator) {
      accumulator->add_post_hook(std::make_unique<GradientReadyHook>(weak_from_this(), index));
      parameter.hooked_accumulator = accumulator;
    }
    // Nothing else holds the node until forward uses the parameter; keep it alive until then.
    parameter.accumulator_in_forward = accumulator;
  }
}

void ParamGroup::post_forward(bool grad_enabled) {
  for (auto& parameter : parameters_) parameter.accumulator_in_forward.reset();
  // Without grad mode no backward can follow, so even the root frees its parameters.
  if (!grad_enabled || reshard_after_forward()) reshard();
}

void ParamGroup::pre_backward() {
  if (auto state = root_state()) state->on_backward_hook();
  if (post_backward_done_) return;
  unshard();
}

void ParamGroup::on_gradient_ready(size_t parameter_index) {
  if (auto state = root_state()) state->queue_final_callback();
  auto& parameter = parameters_.at(parameter_index);
  if (parameter.gradient_ready || post_backward_done_) return;
  parameter.gradient_ready = true;
  if (++gradients_ready_ == trainable_count_) post_backward();
}

void ParamGroup::begin_iteration() {
  if (iteration_active_) return;
  refresh_trainable_parameters();
  for (auto& parameter : parameters_) {
    parameter.stashed_sharded_gradient = parameter.parameter.grad();
    parameter.gradient_stashed = true;
    if (parameter.stashed_sharded_gradient.defined()) parameter.parameter.mutable_grad() = at::Tensor();
    parameter.gradient_ready = false;
  }
  gradients_ready_ = 0;
  forwarded_this_iteration_ = false;
  post_backward_done_ = false;
  iteration_active_ = true;
}

void ParamGroup::end_iteration() {
  if (!iteration_active_) return;
  reshard();
  for (auto& parameter : parameters_) {
    TORCH_CHECK(!parameter.parameter.grad().defined(), "parameter '", parameter.name, "' of ", description(),
                " received a gradient of shape ", sizes_text(parameter.parameter.grad().sizes()),
                " outside its unit's forward: the unit's module was called as module->forward(...) while its "
                "parameters were sharded. Call it as fsdp::forward(module, ...) so FSDP can all-gather it first");
    if (parameter.gradient_stashed) parameter.parameter.mutable_grad() = parameter.stashed_sharded_gradient;
    parameter.stashed_sharded_gradient = at::Tensor();
    parameter.gradient_stashed = false;
    parameter.gradient_ready = false;
  }
  gradients_ready_ = 0;
  iteration_active_ = false;
}

void ParamGroup::post_backward() {
  if (post_backward_done_) return;
  post_backward_done_ = true;
  at::NoGradGuard no_grad;
  std::vector<at::Tensor> gradients(parameters_.size());
  std::vector<bool> has_gradient(parameters_.size(), false);
  for (size_t index = 0; index < parameters_.size(); ++index) {
    auto& parameter = parameters_[index];
    if (!parameter.requires_grad) continue;
    auto gradient = parameter.parameter.grad();
    if (!gradient.defined()) continue;
    TORCH_CHECK(gradient.sizes() == at::IntArrayRef(parameter.layout.unsharded_sizes), "parameter '", parameter.name,
                "' of ", description(), " received a gradient of shape ", sizes_text(gradient.sizes()),
                " but its full shape is ", sizes_text(parameter.layout.unsharded_sizes),
                ": the unit's module was called as module->forward(...) while its parameters were sharded. Call "
                "it as fsdp::forward(module, ...) so FSDP can all-gather it first");
    parameter.parameter.mutable_grad() = at::Tensor();
    gradients[index] = gradient;
    has_gradient[index] = true;
  }
  if (!requires_gradient_sync_) {
    for (size_t index = 0; index < parameters_.size(); ++index) {
      if (!has_gradient[index]) continue;
      auto& accumulated = parameters_[index].unsharded_accumulated_gradient;
      if (accumulated.defined()) {
        accumulated.add_(gradients[index]);
      } else {
        accumulated = gradients[index].to(*reduce_dtype_, /*non_blocking=*/false, /*copy=*/true);
      }
    }
    reshard();
    return;
  }
  for (size_t index = 0; index < parameters_.size(); ++index) {
    auto& accumulated = parameters_[index].unsharded_accumulated_gradient;
    if (!accumulated.defined()) continue;
    if (has_gradient[index]) accumulated.add_(gradients[index]);
    gradients[index] = accumulated;
    has_gradient[index] = true;
    accumulated = at::Tensor();
  }
  reduce_gradients(gradients, has_gradient);
  reshard();
}

void ParamGroup::reduce_gradients(const std::vector<at::Tensor>& unsharded_gradients,
                                  const std::vector<bool>& has_gradient) {
  if (trainable_count_ == 0) return;
  const int64_t shard_size = shard_world_size();
  const int64_t replicate_size = replicate_group_ ? replicate_group_->size() : 1;
  // Sum with a divide before and after (FSDP1's factors) so that low-precision sums over many ranks
  // neither overflow nor lose the small values; together they divide by the number of replicas.
  const int64_t data_parallel_size = shard_size * replicate_size;
  const double pre_divide = gradient_pre_divide_factor(data_parallel_size);
  const double post_divide = static_cast<double>(data_parallel_size) / pre_divide;
  const int64_t flags_offset = reduce_row_numel_ - trainable_count_;

  auto reduce_scatter_input = at::zeros({shard_size, reduce_row_numel_}, at::TensorOptions().dtype(*reduce_dtype_));
  int64_t trainable_index = 0;
  for (size_t index = 0; index < parameters_.size(); ++index) {
    const auto& parameter = parameters_[index];
    if (!parameter.requires_grad) continue;
    const int64_t flag_column = flags_offset + trainable_index++;
    if (!has_gradient[index]) continue;
    reduce_scatter_input.select(1, flag_column).fill_(1);
    auto flat = unsharded_gradients[index].reshape({-1});
    const auto& layout = parameter.layout;
    for (int64_t rank = 0; rank < shard_size; ++rank) {
      const int64_t row_offset = std::min(layout.rows, rank * layout.rows_per_shard);
      const int64_t owned_numel = std::min(layout.rows_per_shard, layout.rows - row_offset) * layout.row_numel;
      if (owned_numel == 0) continue;
      reduce_scatter_input.select(0, rank)
          .narrow(0, parameter.reduce_offset, owned_numel)
          .copy_(flat.narrow(0, row_offset * layout.row_numel, owned_numel));
    }
  }
  if (pre_divide != 1.0) reduce_scatter_input.div_(pre_divide);
  at::Tensor reduce_scatter_output;
  if (shard_size > 1) {
    reduce_scatter_output = at::empty({reduce_row_numel_}, reduce_scatter_input.options());
    reduce_scatter(*shard_group_, reduce_scatter_output, reduce_scatter_input.view({-1}));
  } else {
    reduce_scatter_output = reduce_scatter_input.view({-1});
  }
  if (replicate_group_) all_reduce(*replicate_group_, reduce_scatter_output);
  if (post_divide != 1.0) reduce_scatter_output.div_(post_divide);

  auto any_rank_had_gradient = reduce_scatter_output.narrow(0, flags_offset, trainable_count_).gt(0);
  auto flags = any_rank_had_gradient.accessor<bool, 1>();
  trainable_index = 0;
  for (auto& parameter : parameters_) {
    if (!parameter.requires_grad) continue;
    // An own tensor, not a view of the reduce buffer: optimizers detach_() and zero_() gradients.
    // Left undefined when no rank had a gradient, as in single-process training (optimizers skip it).
    if (!flags[trainable_index++]) continue;
    auto sharded_gradient = reduce_scatter_output.narrow(0, parameter.reduce_offset, parameter.layout.numel_owned)
                                .view(parameter.layout.sharded_sizes)
                                .to(parameter.original_dtype, /*non_blocking=*/false, /*copy=*/true);
    auto& stashed = parameter.stashed_sharded_gradient;
    if (stashed.defined()) {
      stashed.add_(sharded_gradient);
    } else {
      stashed = sharded_gradient;
    }
  }
}

}  // namespace fsdp::detail
