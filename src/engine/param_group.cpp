#include "engine/param_group.h"

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <fsdp/collectives.h>
#include <fsdp/device.h>

#include <sstream>

#include "dist/activity.h"
#include "dist/control_channel.h"
#include "engine/fsdp_collectives.h"
#include "memory/buffer_pool.h"
#include "memory/device.h"

namespace fsdp::detail {
namespace {

constexpr int64_t kAlignmentBytes = 16;

// Why a parameter can carry a full-shape gradient outside its unit's backward, and the fix.
constexpr const char* kCalledWithoutFsdpForward =
    ": the unit's module was called as module->forward(...) while its parameters were sharded. Call it as "
    "fsdp::forward(module, ...) so FSDP can all-gather it first";

int64_t align_up(int64_t bytes) { return (bytes + kAlignmentBytes - 1) / kAlignmentBytes * kAlignmentBytes; }

int64_t element_size(c10::ScalarType dtype) { return static_cast<int64_t>(c10::elementSize(dtype)); }

// The unsharded buffer's memory comes from, and goes back to (return_pooled_bytes), the pool of
// unit-sized blocks.
void allocate_storage(const at::Tensor& tensor, int64_t nbytes, c10::Device device) {
  auto* storage = tensor.storage().unsafeGetStorageImpl();
  if (static_cast<int64_t>(storage->nbytes()) == nbytes) return;
  storage->set_data_ptr_noswap(take_pooled_block(nbytes, device));
  storage->set_nbytes(nbytes);
}

std::string sizes_text(at::IntArrayRef sizes) {
  std::ostringstream text;
  text << sizes;
  return text.str();
}

}  // namespace

ParamGroup::ParamGroup(std::vector<std::shared_ptr<torch::nn::Module>> modules, const DistributedContext& context,
                       const FullyShardOptions& options, std::vector<FSDPParam> parameters)
    : context_(context), options_(options), parameters_(std::move(parameters)) {
  for (const auto& module : modules) modules_.emplace_back(module);
}

std::string ParamGroup::description() const {
  std::ostringstream classes;
  for (size_t i = 0; i < modules_.size(); ++i) {
    auto module = modules_[i].lock();
    classes << (i ? ", " : "") << (module ? module->name() : std::string("<destroyed module>"));
  }
  if (!module_path_) return "FSDP unit over " + classes.str();
  return "FSDP unit " + (module_path_->empty() ? std::string("<root>") : *module_path_) + " (" + classes.str() + ")";
}

const char* to_string(TrainingState state) {
  switch (state) {
    case TrainingState::kIdle:
      return "IDLE";
    case TrainingState::kForward:
      return "FORWARD";
    case TrainingState::kPreBackward:
      return "PRE_BACKWARD";
    case TrainingState::kPostBackward:
      return "POST_BACKWARD";
  }
  return "?";
}

std::string on_rank(const DistributedContext& context) { return "[rank " + std::to_string(context.rank()) + "] "; }

bool ParamGroup::reshard_after_forward() const {
  if (reshard_after_forward_override_) return *reshard_after_forward_override_;
  if (options_.reshard_after_forward) return static_cast<bool>(*options_.reshard_after_forward);
  // FSDP2's None: the root keeps its parameters because backward starts with it.
  return !is_root_ && reshards_after_forward(options_.sharding_strategy);
}

const ProcessGroup* ParamGroup::post_forward_group() const {
  return post_forward_group_ && !reshard_after_forward_override_ ? &*post_forward_group_ : nullptr;
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
  // Checked before anything is sharded, so a bad size leaves the module as it was. Every rank creates
  // the post-forward group here, in fully_shard's order.
  if (options_.reshard_after_forward && options_.reshard_after_forward->is_group_size()) {
    const int64_t group_size =
        options_.reshard_after_forward->post_forward_group_size(shard_size, on_rank() + description());
    if (group_size > 1 && group_size < shard_size) {
      post_forward_group_ = context_.consecutive_subgroup(*shard_group_, group_size);
    }
  }
  at::NoGradGuard no_grad;

  if (options_.fsdp1.sync_module_states && world.size() > 1) {
    // Rank 0's values are the truth (FSDP1's sync_module_states). Every rank must issue the same
    // broadcasts, so nothing here may depend on what this rank holds: a parameter whose storage was
    // released (cpu_ram_efficient_loading on ranks other than 0) receives into a fresh tensor, and a
    // non-contiguous one through a contiguous copy. Only rank 0 must hold every value, which it says
    // on the control channel before any broadcast.
    std::string missing_on_source;
    if (context_.rank() == 0) {
      for (const auto& parameter : parameters_) {
        const auto& data = parameter.parameter;
        if (data.numel() > 0 && data.storage().nbytes() == 0) {
          missing_on_source = "parameter '" + parameter.name + "' of " + description() +
                              " holds no values on rank 0, the source of sync_module_states. Materialize the "
                              "model on rank 0 (it is the one whose weights every rank receives)";
          break;
        }
      }
    }
    missing_on_source = broadcast_string(context_, missing_on_source, 0);
    TORCH_CHECK(missing_on_source.empty(), on_rank(), "fully_shard(sync_module_states): ", missing_on_source);
    for (auto& parameter : parameters_) {
      auto data = parameter.parameter.detach();
      const bool released = data.numel() > 0 && data.storage().nbytes() == 0;
      auto received = released ? at::empty(data.sizes(), data.options()) : data.contiguous();
      broadcast(world, received, 0);
      if (released) {
        parameter.parameter.set_data(received);
      } else if (!received.is_same(data)) {
        data.copy_(received);
      }
    }
  }

  const c10::Device parameter_device =
      parameters_.empty() ? c10::Device(c10::kCPU) : parameters_.front().parameter.device();
  for (const auto& parameter : parameters_) {
    TORCH_INTERNAL_ASSERT(parameter.parameter.device() == parameter_device, description(), ": parameter '",
                          parameter.name, "' is on ", parameter.parameter.device(), " but the unit on ",
                          parameter_device, " (fully_shard checks one device per unit)");
  }
  // A unit computes on its parameters' device. Under cpu_offload its shards live in host memory and
  // it computes on the GPU its parameters came from, or this rank's default device (FSDP2 moves an
  // offloaded model's shards to the CPU and computes on the mesh's device); with no GPU at all, the
  // shards are in host memory already and offload holds by construction.
  device_ = parameter_device;
  storage_device_ = parameter_device;
  if (options_.offload_policy.offload_params) {
    if (!device_.is_cuda()) device_ = default_device(context_.environment().local_rank);
    storage_device_ = c10::Device(c10::kCPU);
  }
  offloaded_ = device_ != storage_device_;
  unshard_is_identity_ = shard_size == 1 && !offloaded_;
  int64_t all_gather_bytes = 0;
  int64_t unsharded_bytes = 0;
  // The post-forward row holds shard_size / k padded shards of each parameter (Note [resharding
  // after forward to a smaller group]).
  const int64_t post_forward_factor = post_forward_group_ ? shard_size / post_forward_group_->size() : 0;
  int64_t post_forward_bytes = 0;
  for (auto& parameter : parameters_) {
    TORCH_CHECK(!parameter.parameter.grad().defined(), on_rank(), "fully_shard: parameter '", parameter.name,
                "' already has a gradient of the full shape, which the sharded parameter cannot keep. Reset it first "
                "(parameter.mutable_grad() = torch::Tensor(), or build the optimizer after sharding)");
    parameter.init_sharded(shard_size, rank, options_.mp_policy.param_dtype,
                           offloaded_ ? std::optional<bool>(options_.offload_policy.pin_memory) : std::nullopt);
    if (parameter.compute_dtype != parameter.original_dtype) unshard_is_identity_ = false;
    // Every parameter's shard at an aligned offset of one all-gather row, and its N shards at an
    // aligned offset of the unsharded buffer.
    parameter.all_gather_offset_bytes = all_gather_bytes;
    const int64_t shard_bytes = parameter.padded_shard_bytes();
    all_gather_bytes = align_up(all_gather_bytes + shard_bytes);
    parameter.unsharded_offset_bytes = unsharded_bytes;
    unsharded_bytes = align_up(unsharded_bytes + shard_size * shard_bytes);
    if (post_forward_factor > 0) {
      parameter.post_forward_offset_bytes = post_forward_bytes;
      post_forward_bytes = align_up(post_forward_bytes + post_forward_factor * shard_bytes);
    }
  }
  all_gather_row_bytes_ = all_gather_bytes;
  unsharded_buffer_bytes_ = unsharded_bytes;
  post_forward_row_bytes_ = post_forward_bytes;

  if (unshard_is_identity_) {
    for (auto& parameter : parameters_) {
      parameter.unsharded_data = parameter.sharded_padded.view(parameter.layout.unsharded_sizes);
    }
  } else {
    unsharded_buffer_ = at::empty({std::max<int64_t>(unsharded_buffer_bytes_, 1)},
                                  at::TensorOptions().dtype(at::kByte).device(device_));
    for (auto& parameter : parameters_) {
      const int64_t bytes = parameter.layout.numel_unsharded() * element_size(parameter.compute_dtype);
      parameter.unsharded_data = unsharded_buffer_.narrow(0, parameter.unsharded_offset_bytes, bytes)
                                     .view(parameter.compute_dtype)
                                     .view(parameter.layout.unsharded_sizes);
    }
    return_pooled_bytes(unsharded_buffer_);
  }
  refresh_trainable_parameters();
}

void ParamGroup::refresh_trainable_parameters() {
  std::vector<ShardLayout> trainable_layouts;
  std::vector<FSDPParam*> trainable;
  for (auto& parameter : parameters_) {
    parameter.requires_grad = parameter.parameter.requires_grad();
    if (!parameter.requires_grad) continue;
    if (!trainable.empty()) {
      const auto* first = trainable.front();
      TORCH_CHECK(options_.mp_policy.reduce_dtype || parameter.compute_dtype == first->compute_dtype, on_rank(),
                  description(), ": trainable parameters '", first->name, "' (", first->compute_dtype, ") and '",
                  parameter.name, "' (", parameter.compute_dtype,
                  ") have different dtypes, so their gradients cannot be reduced together. Give every trainable "
                  "parameter of a unit the same dtype, set mixed_precision.reduce_dtype, or put them in different "
                  "units");
    }
    trainable.push_back(&parameter);
    trainable_layouts.push_back(parameter.layout);
  }
  const auto flat = flat_shard_layout(trainable_layouts);
  for (size_t index = 0; index < trainable.size(); ++index) trainable[index]->reduce_offset = flat.offsets[index];
  trainable_count_ = static_cast<int64_t>(trainable.size());
  reduce_dtype_ = options_.mp_policy.reduce_dtype;
  if (!reduce_dtype_ && !trainable.empty()) reduce_dtype_ = trainable.front()->compute_dtype;
  // One flag per trainable parameter follows the shards: whether any rank had a gradient for it.
  reduce_row_numel_ = flat.numel + trainable_count_;
}

void ParamGroup::unshard(bool async_op) {
  if (sharded_state_ == ShardedState::kUnsharded) return;
  if (unshard_in_flight_) {
    if (!async_op) wait_for_unshard();
    return;
  }
  if (unshard_is_identity_) {
    sharded_state_ = ShardedState::kUnsharded;
    return;
  }
  at::NoGradGuard no_grad;
  allocate_storage(unsharded_buffer_, std::max<int64_t>(unsharded_buffer_bytes_, 1), device_);
  const int64_t shard_size = shard_world_size();
  // After an integer reshard_after_forward the unit gathers its post-forward row over the smaller
  // group instead: Note [resharding after forward to a smaller group].
  const bool from_post_forward = sharded_state_ == ShardedState::kShardedPostForward;
  if (shard_size == 1 && !from_post_forward) {
    // A cast only (mixed precision without sharding): nothing to overlap.
    for (auto& parameter : parameters_) {
      parameter.unsharded_data.copy_(parameter.sharded_padded.view(parameter.layout.unsharded_sizes));
      parameter.to_unsharded();
    }
    sharded_state_ = ShardedState::kUnsharded;
    return;
  }
  // On a GPU the copy-in and the issue run on the all-gather stream, which first waits for the
  // compute stream's work so far (the optimizer step wrote the shards; forward's end filled a
  // post-forward row): Note [streams of a unit], src/memory/device.h. The rows are allocated there,
  // a post-forward row is recorded on it. On CPU there are no streams.
  std::optional<c10::Stream> all_gather_stream;
  if (has_streams(device_)) {
    all_gather_stream = side_stream(device_, SideStream::kAllGather);
    stream_wait_stream(*all_gather_stream, current_stream(device_));
    if (from_post_forward) record_stream(post_forward_row_, *all_gather_stream);
  }
  const ProcessGroup& group = from_post_forward ? *post_forward_group_ : *shard_group_;
  PendingUnshard pending;
  pending.post_forward = from_post_forward;
  {
    const StreamScope on_all_gather_stream(all_gather_stream);
    at::Tensor input;
    if (from_post_forward) {
      input = post_forward_row_;
      post_forward_row_ = at::Tensor();
    } else {
      input = pooled_bytes(all_gather_row_bytes_, device_);
      all_gather_copy_in(parameters_, input);
    }
    const ActivityScope activity(activity_text());
    pending.output = pooled_bytes(group.size() * input.numel(), device_);
    pending.work = all_gather_async(group, pending.output, input);
    // Nothing here reads the row again; the pool hands it out once the transport is done with it.
    auto work = pending.work;
    return_pooled_bytes_after(input, [work] { return work.query(); });
  }
  unshard_in_flight_ = std::move(pending);
  if (!async_op) wait_for_unshard();
}

void ParamGroup::wait_for_unshard() {
  if (!unshard_in_flight_) return;
  auto pending = std::move(*unshard_in_flight_);
  unshard_in_flight_.reset();
  at::NoGradGuard no_grad;
  try {
    pending.work.wait();
  } catch (...) {
    return_pooled_bytes(unsharded_buffer_);
    // The post-forward row went with the all-gather; the shards are intact, so a later unshard
    // gathers from them.
    if (pending.post_forward) sharded_state_ = ShardedState::kSharded;
    throw;
  }
  // The wait made the compute stream wait for the all-gather; the copy-out runs there, so the rows
  // (allocated on the all-gather stream) are recorded on it before they go back.
  if (pending.post_forward) {
    const int64_t group_size = post_forward_group_->size();
    post_forward_copy_out(pending.output, group_size, shard_world_size() / group_size, parameters_, unsharded_buffer_);
  } else {
    all_gather_copy_out(pending.output, shard_world_size(), parameters_, unsharded_buffer_);
  }
  if (has_streams(device_)) record_stream(pending.output, current_stream(device_));
  return_pooled_bytes(pending.output);
  for (auto& parameter : parameters_) parameter.to_unsharded();
  sharded_state_ = ShardedState::kUnsharded;
}

void ParamGroup::reshard() {
  wait_for_unshard();
  if (sharded_state_ == ShardedState::kSharded) return;
  if (sharded_state_ == ShardedState::kShardedPostForward) {
    return_pooled_bytes(post_forward_row_);  // none after a failed all-gather took it
    post_forward_row_ = at::Tensor();
    sharded_state_ = ShardedState::kSharded;
    return;
  }
  if (!unshard_is_identity_) {
    for (auto& parameter : parameters_) parameter.to_sharded();
    return_pooled_bytes(unsharded_buffer_);
  }
  sharded_state_ = ShardedState::kSharded;
}

void ParamGroup::pre_forward(bool grad_enabled, const std::vector<std::shared_ptr<ParamGroup>>& prefetch_targets) {
  unshard(/*async_op=*/true);
  for (const auto& target : prefetch_targets) target->unshard(/*async_op=*/true);
  wait_for_unshard();
  if (grad_enabled) {
    TORCH_INTERNAL_ASSERT(training_state_ != TrainingState::kIdle, description(),
                          ": a forward with grad ran outside a training iteration");
    if (training_state_ == TrainingState::kPostBackward) training_state_ = TrainingState::kForward;
  }
}

void ParamGroup::post_forward() {
  // Without grad mode the units keep their usual policy (a tied output head may still need the
  // embedding's unit); the root frees every unit of the tree once the whole forward is done.
  if (!reshard_after_forward()) return;
  if (post_forward_group() != nullptr) {
    reshard_to_post_forward();
  } else {
    reshard();
  }
}

void ParamGroup::reshard_to_post_forward() {
  wait_for_unshard();
  if (sharded_state_ != ShardedState::kUnsharded) return;
  at::NoGradGuard no_grad;
  const int64_t factor = shard_world_size() / post_forward_group_->size();
  const int64_t first_shard = post_forward_group_->rank() * factor;
  post_forward_row_ = pooled_bytes(post_forward_row_bytes_, device_);
  post_forward_copy_in(parameters_, unsharded_buffer_, first_shard, factor, post_forward_row_);
  for (auto& parameter : parameters_) parameter.to_sharded();
  return_pooled_bytes(unsharded_buffer_);
  sharded_state_ = ShardedState::kShardedPostForward;
}

void ParamGroup::pre_backward(const std::vector<std::shared_ptr<ParamGroup>>& prefetch_targets) {
  TORCH_INTERNAL_ASSERT(training_state_ != TrainingState::kIdle, description(),
                        ": its backward started outside a training iteration");
  unshard(/*async_op=*/true);
  // Outputs each carry a hook; only the first of them since the last reduction prefetches.
  if (training_state_ != TrainingState::kPreBackward) {
    for (const auto& target : prefetch_targets) target->unshard(/*async_op=*/true);
  }
  training_state_ = TrainingState::kPreBackward;
  wait_for_unshard();
}

bool ParamGroup::on_input_gradient() { return pending_input_gradients_ > 0 && --pending_input_gradients_ == 0; }

std::string ParamGroup::activity_text() const {
  return description() + ", iteration " + std::to_string(iterations_) + ", " + to_string(training_state_);
}

void ParamGroup::begin_iteration() {
  if (training_state_ != TrainingState::kIdle) return;
  ++iterations_;
  refresh_trainable_parameters();
  for (auto& parameter : parameters_) {
    parameter.stashed_sharded_gradient = parameter.parameter.grad();
    // Under cpu_offload the gradient of an earlier micro-batch (no_sync) is in host memory; this
    // iteration's reductions add to it on the device, and end_iteration brings it back.
    if (offloaded_ && parameter.stashed_sharded_gradient.defined()) {
      parameter.stashed_sharded_gradient = parameter.stashed_sharded_gradient.to(device_);
    }
    parameter.had_gradient_before_iteration = parameter.stashed_sharded_gradient.defined();
    parameter.gradient_stashed = true;
    if (parameter.stashed_sharded_gradient.defined()) parameter.parameter.mutable_grad() = at::Tensor();
  }
  pending_input_gradients_ = 0;
  post_forward_indices_.clear();
  training_state_ = TrainingState::kForward;
}

void ParamGroup::end_iteration(const bool* had_gradient, bool check) {
  if (training_state_ == TrainingState::kIdle) return;
  training_state_ = TrainingState::kIdle;
  pending_input_gradients_ = 0;
  reshard();
  std::string stray_gradient;
  int64_t trainable_index = 0;
  for (auto& parameter : parameters_) {
    auto gradient = parameter.parameter.grad();
    if (gradient.defined() && stray_gradient.empty()) {
      stray_gradient = "parameter '" + parameter.name + "' of " + description() + " received a gradient of shape " +
                       sizes_text(gradient.sizes()) + " outside its unit's forward";
    }
    // A parameter no rank had a gradient for keeps the gradient it had before the iteration
    // (undefined after zero_grad), as in single-process training: optimizers skip it.
    const bool reduced = parameter.requires_grad && had_gradient != nullptr && had_gradient[trainable_index];
    if (parameter.requires_grad) ++trainable_index;
    if (!reduced && !parameter.had_gradient_before_iteration) parameter.stashed_sharded_gradient = at::Tensor();
    // cpu_offload: the optimizer steps the shards in host memory, so their gradients go there
    // (a synchronous copy: the step on the host reads them next).
    if (offloaded_ && parameter.stashed_sharded_gradient.defined()) {
      parameter.stashed_sharded_gradient = parameter.stashed_sharded_gradient.to(storage_device_);
    }
    parameter.parameter.mutable_grad() = parameter.gradient_stashed ? parameter.stashed_sharded_gradient : at::Tensor();
    parameter.stashed_sharded_gradient = at::Tensor();
    parameter.gradient_stashed = false;
  }
  gradient_flags_ = at::Tensor();
  TORCH_CHECK(!check || stray_gradient.empty(), on_rank(), stray_gradient, kCalledWithoutFsdpForward);
}

void ParamGroup::post_backward(const std::vector<std::shared_ptr<ParamGroup>>& prefetch_targets) {
  TORCH_INTERNAL_ASSERT(training_state_ != TrainingState::kIdle, description(),
                        ": its gradients were reduced outside a training iteration");
  training_state_ = TrainingState::kPostBackward;
  pending_input_gradients_ = 0;
  at::NoGradGuard no_grad;
  // One full gradient per parameter, undefined where this rank has none.
  std::vector<at::Tensor> gradients(parameters_.size());
  for (size_t index = 0; index < parameters_.size(); ++index) {
    auto& parameter = parameters_[index];
    if (!parameter.requires_grad) continue;
    auto gradient = parameter.parameter.grad();
    if (!gradient.defined()) continue;
    TORCH_CHECK(gradient.sizes() == at::IntArrayRef(parameter.layout.unsharded_sizes), on_rank(), "parameter '",
                parameter.name, "' of ", description(), " received a gradient of shape ", sizes_text(gradient.sizes()),
                " but its full shape is ", sizes_text(parameter.layout.unsharded_sizes), kCalledWithoutFsdpForward);
    parameter.parameter.mutable_grad() = at::Tensor();
    gradients[index] = gradient;
  }
  // FSDP1's order: free this unit's parameters (the gradients are tensors of their own), then issue
  // the next unit's all-gather, then this unit's reduction, so at most one unit is gathered here.
  reshard();
  for (const auto& target : prefetch_targets) target->unshard(/*async_op=*/true);
  if (!requires_gradient_sync_) {
    for (size_t index = 0; index < parameters_.size(); ++index) {
      if (!gradients[index].defined()) continue;
      auto& accumulated = parameters_[index].unsharded_accumulated_gradient;
      if (accumulated.defined()) {
        accumulated.add_(gradients[index]);
      } else {
        accumulated = gradients[index].to(*reduce_dtype_, /*non_blocking=*/false, /*copy=*/true);
      }
    }
    return;
  }
  for (size_t index = 0; index < parameters_.size(); ++index) {
    auto& accumulated = parameters_[index].unsharded_accumulated_gradient;
    if (!accumulated.defined()) continue;
    if (gradients[index].defined()) accumulated.add_(gradients[index]);
    gradients[index] = accumulated;
    accumulated = at::Tensor();
  }
  reduce_gradients(gradients);
}

void ParamGroup::reduce_gradients(const std::vector<at::Tensor>& unsharded_gradients) {
  if (trainable_count_ == 0) return;
  // A second reduction of this unit in one backward (a unit used twice) adds to the first.
  finish_reduction();
  const int64_t shard_size = shard_world_size();
  const int64_t replicate_size = replicate_group_ ? replicate_group_->size() : 1;
  // Sum with a divide before and after (FSDP1's factors) so that low-precision sums over many ranks
  // neither overflow nor lose the small values; together they divide by the number of replicas.
  const int64_t data_parallel_size = shard_size * replicate_size;
  const double pre_divide = gradient_pre_divide_factor(data_parallel_size);
  const double post_divide = static_cast<double>(data_parallel_size) / pre_divide;
  const int64_t flags_offset = reduce_row_numel_ - trainable_count_;

  // On a GPU the copy-in and the reduction run on the reduce-scatter stream, after the compute
  // stream's work so far (which produced the gradients), so they overlap the next unit's backward.
  // The gradients, made on the compute stream, are recorded on it: Note [streams of a unit]. Only
  // when a collective follows: its wait is what orders the compute stream after the copy-in (one
  // shard and no replicas is a cast in place, which stays on the compute stream).
  std::optional<c10::Stream> reduce_scatter_stream;
  if (has_streams(device_) && (shard_size > 1 || replicate_group_)) {
    reduce_scatter_stream = side_stream(device_, SideStream::kReduceScatter);
    stream_wait_stream(*reduce_scatter_stream, current_stream(device_));
    for (const auto& gradient : unsharded_gradients) record_stream(gradient, *reduce_scatter_stream);
  }
  const StreamScope on_reduce_scatter_stream(reduce_scatter_stream);
  auto reduce_scatter_input = pooled_bytes(shard_size * reduce_row_numel_ * element_size(*reduce_dtype_), device_)
                                  .view(*reduce_dtype_)
                                  .view({shard_size, reduce_row_numel_})
                                  .zero_();
  reduce_scatter_copy_in(parameters_, unsharded_gradients, flags_offset, reduce_scatter_input);
  if (pre_divide != 1.0) reduce_scatter_input.div_(pre_divide);
  const ActivityScope activity(activity_text());
  PendingReduction pending;
  pending.post_divide = post_divide;
  if (shard_size > 1) {
    pending.output = at::empty({reduce_row_numel_}, reduce_scatter_input.options());
    if (replicate_group_) {
      reduce_scatter(*shard_group_, pending.output, reduce_scatter_input.view({-1}));
      return_pooled_bytes(reduce_scatter_input);
      pending.work = all_reduce_async(*replicate_group_, pending.output);
    } else {
      pending.work = reduce_scatter_async(*shard_group_, pending.output, reduce_scatter_input.view({-1}));
      // The input is only sent: the pool takes it back once the transport is done with it.
      auto work = *pending.work;
      return_pooled_bytes_after(reduce_scatter_input, [work] { return work.query(); });
    }
  } else {
    // One shard: the input is the output, reduced in place over the replicas.
    pending.output = reduce_scatter_input.view({-1});
    pending.pooled_output = true;
    if (replicate_group_) pending.work = all_reduce_async(*replicate_group_, pending.output);
  }
  reduction_in_flight_ = std::move(pending);
}

void ParamGroup::finish_reduction() {
  if (!reduction_in_flight_) return;
  auto pending = std::move(*reduction_in_flight_);
  reduction_in_flight_.reset();
  at::NoGradGuard no_grad;
  if (pending.work) pending.work->wait();
  auto& reduce_scatter_output = pending.output;
  // Made on the reduce-scatter stream, read from here on on the compute stream (the wait made it
  // wait for the reduction).
  if (has_streams(device_)) record_stream(reduce_scatter_output, current_stream(device_));
  if (pending.post_divide != 1.0) reduce_scatter_output.div_(pending.post_divide);
  // Whether any rank had a gradient, per trainable parameter, kept on the device: the host reads
  // every unit's flags once, at the end of the iteration (Note [gradient flags]).
  const int64_t flags_offset = reduce_row_numel_ - trainable_count_;
  auto any_rank_had_gradient = reduce_scatter_output.narrow(0, flags_offset, trainable_count_).gt(0);
  gradient_flags_ =
      gradient_flags_.defined() ? gradient_flags_.logical_or(any_rank_had_gradient) : any_rank_had_gradient;
  auto sharded_gradients = reduce_scatter_copy_out(parameters_, reduce_scatter_output);
  int64_t trainable_index = 0;
  for (auto& parameter : parameters_) {
    if (!parameter.requires_grad) continue;
    // 0-dim, so that a scalar parameter's gradient keeps its shape through where().
    const auto had_gradient = any_rank_had_gradient.select(0, trainable_index);
    auto& sharded_gradient = sharded_gradients[trainable_index++];
    auto& stashed = parameter.stashed_sharded_gradient;
    if (!stashed.defined()) {
      stashed = sharded_gradient;
    } else {
      // Where no rank had a gradient the reduced values are zeros; leaving the stashed gradient as it
      // was (rather than adding +0) keeps it bitwise unchanged, without asking the host.
      stashed.copy_(at::where(had_gradient, stashed + sharded_gradient, stashed));
    }
  }
  // Nothing reads the reduction's buffers any more (the gradients above are copies).
  if (pending.pooled_output) return_pooled_bytes(reduce_scatter_output);
}

}  // namespace fsdp::detail
