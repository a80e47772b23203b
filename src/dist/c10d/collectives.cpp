// The collectives of include/fsdp/collectives.h: checks of their buffers, then a CPU collective's
// schedule (dist/c10d/schedules.cpp, Note [Algorithms by measurement] for which one) or an NCCL call.
// Note [Collectives on Gloo] (docs/design.md) says what each is built from, Note [Collective check]
// how ranks that issued different ones are named, and Note [The GPU path] how CUDA tensors take NCCL
// instead (dist/c10d/nccl.cpp).
#include <ATen/ATen.h>
#include <fsdp/collectives.h>

#include <cmath>
#include <sstream>

#include "dist/c10d/internal.h"

namespace fsdp {
namespace detail {

c10d::ReduceOp to_c10d(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum:
      return c10d::ReduceOp::SUM;
    case ReduceOp::kMax:
      return c10d::ReduceOp::MAX;
    case ReduceOp::kMin:
      return c10d::ReduceOp::MIN;
  }
  TORCH_INTERNAL_ASSERT(false, "unknown ReduceOp");
}

}  // namespace detail

namespace {

using detail::CollectiveKind;
using detail::CollectiveWorkState;
using detail::GroupMembers;
using detail::IssuedCollective;
using detail::ProcessGroupState;

std::string describe(const GroupMembers& members, const char* operation, const at::Tensor& tensor) {
  std::ostringstream text;
  text << "[rank " << members.global_rank << "] " << operation << " on group '" << members.name << "' (" << members.size
       << " ranks, " << tensor.numel() << " x " << tensor.scalar_type() << ")";
  return text.str();
}

void check_buffer(const GroupMembers& members, const char* operation, const char* role, const at::Tensor& tensor) {
  TORCH_CHECK(tensor.defined(), "[rank ", members.global_rank, "] ", operation, ": the ", role,
              " tensor is undefined; pass an allocated buffer.");
  if (!tensor.device().is_cpu()) {
    TORCH_CHECK(detail::gpu_path_built(), "[rank ", members.global_rank, "] ", operation, ": the ", role,
                " tensor is on ", tensor.device(),
                " but this build of fsdp.cpp has no GPU path: its groups move CPU tensors. Move it with .cpu(), or "
                "build fsdp.cpp against a CUDA libtorch (README, 'The GPU path').");
    TORCH_CHECK(tensor.is_cuda(), "[rank ", members.global_rank, "] ", operation, ": the ", role, " tensor is on ",
                tensor.device(), "; fsdp.cpp's groups move CPU tensors (Gloo) and CUDA tensors (NCCL).");
  }
  TORCH_CHECK(tensor.is_contiguous(), "[rank ", members.global_rank, "] ", operation, ": the ", role,
              " tensor must be contiguous (got strides ", tensor.strides(), "); call .contiguous() first.");
}

void check_divide_factor(const GroupMembers& members, const char* name, double factor, const at::Tensor& tensor) {
  if (factor == 1.0) return;
  TORCH_CHECK(std::isfinite(factor) && factor > 0, "[rank ", members.global_rank, "] reduce_scatter: ", name, "=",
              factor, " must be a positive finite number.");
  TORCH_CHECK(at::isFloatingType(tensor.scalar_type()), "[rank ", members.global_rank, "] reduce_scatter: ", name, "=",
              factor, " needs a floating dtype but the buffer is ", tensor.scalar_type(), "; use 1 for integers.");
}

void check_same_device(const GroupMembers& members, const char* operation, const at::Tensor& output,
                       const at::Tensor& input) {
  // NCCL moves device memory and Gloo host memory, and one collective cannot mix them.
  TORCH_CHECK(output.device() == input.device(), "[rank ", members.global_rank, "] ", operation, " on group '",
              members.name, "': the output is on ", output.device(), " but the input on ", input.device(),
              "; put both on the device the collective runs on.");
}

at::Tensor as_bytes(const at::Tensor& tensor) { return tensor.reshape({-1}).view(at::kByte); }

bool on_gpu(const at::Tensor& tensor) { return tensor.defined() && tensor.is_cuda(); }

CollectiveWork completed_work() {
  auto state = std::make_shared<CollectiveWorkState>();
  state->done = true;
  return CollectiveWork(state);
}

std::shared_ptr<CollectiveWorkState> work_state(const ProcessGroupState& group, IssuedCollective issued) {
  auto state = std::make_shared<CollectiveWorkState>();
  state->transport = detail::transport_of(group);
  state->issued = std::move(issued);
  return state;
}

// Note [The GPU path]: an NCCL collective, with its header beside it on Gloo when the check is on.
CollectiveWork nccl_work(ProcessGroupState& group, IssuedCollective issued, c10::intrusive_ptr<c10d::Work> work,
                         std::function<void()> finish = nullptr) {
  auto state = work_state(group, std::move(issued));
  if (state->issued.checked) state->check = detail::post_headers(group, state->issued);
  state->nccl_works.push_back(std::move(work));
  state->schedule.finish = std::move(finish);
  return CollectiveWork(state);
}

// A collective's error names it, as a failed wait does, unless it already did (a connection that
// closed names only the peer), and the peers that wait for this rank hear of it (Note [Collective
// check]). Called inside a catch block: it may rethrow the error being handled.
[[noreturn]] void report_failure(CollectiveWorkState& state, const std::exception& error) {
  const auto* torch_error = dynamic_cast<const c10::Error*>(&error);
  const std::string message = torch_error ? torch_error->what_without_backtrace() : error.what();
  detail::publish_failure(state.transport, state.issued, message);
  if (message.find(state.issued.description) != std::string::npos) throw;
  TORCH_CHECK(false, state.issued.description, " failed: ", message);
}

// A schedule's first messages are posted when it is made: a closed connection fails there.
void schedule_or_report(CollectiveWorkState& state, const std::function<detail::Schedule()>& make) {
  try {
    state.schedule = make();
  } catch (const std::exception& error) {
    report_failure(state, error);
  }
}

CollectiveWork all_reduce_of_kind(const ProcessGroup& group_handle, const at::Tensor& tensor, ReduceOp op,
                                  CollectiveKind kind, const char* name) {
  auto& group = detail::state_of(group_handle);
  const auto& members = *group.members;
  check_buffer(members, name, "input", tensor);
  group.record(name, kind == CollectiveKind::kBarrier ? 0 : tensor.numel() * tensor.element_size());
  if (members.size == 1) return completed_work();
  auto issued =
      detail::issue_collective(group, kind, tensor, static_cast<int64_t>(op), describe(members, name, tensor));
  if (tensor.numel() == 0) return CollectiveWork(work_state(group, std::move(issued)));
  const int64_t bytes = tensor.numel() * tensor.element_size();
  if (on_gpu(tensor)) {
    // NCCL has no bool: a uint8 copy, with max for "any" (sum, max) and min for "all".
    const bool as_uint8 = tensor.scalar_type() == at::kBool;
    std::vector<at::Tensor> tensors{as_uint8 ? tensor.to(at::kByte) : tensor};
    c10d::AllreduceOptions options;
    options.reduceOp = as_uint8 && op == ReduceOp::kSum ? c10d::ReduceOp(c10d::ReduceOp::MAX) : detail::to_c10d(op);
    auto work = detail::nccl_all_reduce(group, tensors, options);
    group.counters->all_reduce += 2 * (members.size - 1) * bytes / members.size;
    std::function<void()> finish;
    if (as_uint8) finish = [tensor, copy = tensors.front()] { tensor.copy_(copy); };
    return nccl_work(group, std::move(issued), std::move(work), std::move(finish));
  }
  auto state = work_state(group, std::move(issued));
  const auto algorithm = detail::algorithm_for(group, detail::CollectiveOperation::kAllReduce, bytes);
  schedule_or_report(*state, [&] { return detail::schedule_all_reduce(group, state->issued, algorithm, tensor, op); });
  return CollectiveWork(state);
}

}  // namespace

const char* to_string(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum:
      return "sum";
    case ReduceOp::kMax:
      return "max";
    case ReduceOp::kMin:
      return "min";
  }
  return "unknown";
}

CollectiveWork::CollectiveWork(std::shared_ptr<detail::CollectiveWorkState> state) : state_(std::move(state)) {}

bool CollectiveWork::completed() const { return state_ == nullptr || state_->done; }

bool CollectiveWork::query() const {
  if (state_ == nullptr) return true;
  // A successful wait() clears the works; a failed one keeps them, and they are asked again.
  if (state_->check && !state_->check->verified) {
    for (const auto& work : state_->check->receives) {
      if (!work->isCompleted()) return false;
    }
    for (const auto& work : state_->check->sends) {
      if (!work->isCompleted()) return false;
    }
  }
  const auto& schedule = state_->schedule;
  if (schedule.deferred.valid()) {
    if (schedule.deferred.wait_for(std::chrono::seconds(0)) != std::future_status::ready) return false;
    try {
      for (const auto& work : schedule.deferred.get().works) {
        if (!work->isCompleted()) return false;
      }
    } catch (const std::exception&) {
      // Failed: its abandoned transfers may still write the buffers, so it is never reported done.
      return false;
    }
  }
  for (const auto& work : schedule.posted.works) {
    if (!work->isCompleted()) return false;
  }
  for (const auto& work : state_->nccl_works) {
    if (!work->isCompleted()) return false;
  }
  return true;
}

void CollectiveWork::wait() {
  if (state_ == nullptr || state_->done) return;
  state_->done = true;  // a failed collective is not retried by a second wait()
  auto& state = *state_;
  auto& schedule = state.schedule;
  const auto& members = *state.transport.members;
  try {
    if (state.check) detail::verify_check(*state.check, members.timeout);
    if (!state.nccl_works.empty()) {
      // Makes the current stream wait for NCCL (the host goes on): Note [The GPU path].
      std::vector<int64_t> others;
      for (const auto rank : members.global_ranks) {
        if (rank != members.global_rank) others.push_back(rank);
      }
      detail::wait_works(state.nccl_works, {}, others, state.issued.description, members.timeout);
      state.nccl_works.clear();
    }
    // The queued steps first: they fail with the diagnosis of a stalled step (Note [Collective check]).
    detail::Exchange rest;
    if (schedule.deferred.valid()) rest = schedule.deferred.get();
    schedule.deferred = {};
    detail::wait_exchange(state.transport, state.issued, schedule.posted);
    detail::wait_exchange(state.transport, state.issued, rest);
  } catch (const std::exception& error) {
    // Transfers of a failed collective may still read or write its buffers: its works stay alive.
    detail::abandon(schedule.posted.works);
    detail::abandon(state.nccl_works);
    report_failure(state, error);
  }
  if (schedule.finish) {
    schedule.finish();
    schedule.finish = nullptr;
  }
}

CollectiveWork all_gather_async(const ProcessGroup& group_handle, const at::Tensor& output, const at::Tensor& input) {
  auto& group = detail::state_of(group_handle);
  const auto& members = *group.members;
  check_buffer(members, "all_gather", "output", output);
  check_buffer(members, "all_gather", "input", input);
  check_same_device(members, "all_gather", output, input);
  TORCH_CHECK(output.scalar_type() == input.scalar_type(), "[rank ", members.global_rank, "] all_gather: output dtype ",
              output.scalar_type(), " differs from input dtype ", input.scalar_type(), ".");
  TORCH_CHECK(output.numel() == input.numel() * members.size, "[rank ", members.global_rank, "] all_gather on group '",
              members.name, "': output has ", output.numel(), " elements but expected ", members.size, " ranks x ",
              input.numel(), " = ", input.numel() * members.size, "; pad shards to equal size.");
  group.record("all_gather", input.numel() * input.element_size());
  if (members.size == 1) {
    if (!output.is_same(input)) output.reshape({-1}).copy_(input.reshape({-1}));
    return completed_work();
  }
  auto issued =
      detail::issue_collective(group, CollectiveKind::kAllGather, input, 0, describe(members, "all_gather", output));
  if (input.numel() == 0) return CollectiveWork(work_state(group, std::move(issued)));
  auto input_bytes = as_bytes(input);
  auto output_bytes = as_bytes(output);
  if (on_gpu(input)) {
    auto work = detail::nccl_all_gather(group, output_bytes, input_bytes);
    group.counters->all_gather += (members.size - 1) * input_bytes.numel();
    return nccl_work(group, std::move(issued), std::move(work));
  }
  auto state = work_state(group, std::move(issued));
  const auto algorithm = detail::algorithm_for(group, detail::CollectiveOperation::kAllGather, output_bytes.numel());
  schedule_or_report(
      *state, [&] { return detail::schedule_all_gather(group, state->issued, algorithm, output_bytes, input_bytes); });
  return CollectiveWork(state);
}

void all_gather(const ProcessGroup& group, const at::Tensor& output, const at::Tensor& input) {
  all_gather_async(group, output, input).wait();
}

CollectiveWork reduce_scatter_async(const ProcessGroup& group_handle, const at::Tensor& output, const at::Tensor& input,
                                    const ReduceScatterOptions& options) {
  auto& group = detail::state_of(group_handle);
  const auto& members = *group.members;
  check_buffer(members, "reduce_scatter", "output", output);
  check_buffer(members, "reduce_scatter", "input", input);
  check_same_device(members, "reduce_scatter", output, input);
  TORCH_CHECK(output.scalar_type() == input.scalar_type(), "[rank ", members.global_rank,
              "] reduce_scatter: output dtype ", output.scalar_type(), " differs from input dtype ",
              input.scalar_type(), ".");
  TORCH_CHECK(input.numel() == output.numel() * members.size, "[rank ", members.global_rank,
              "] reduce_scatter on group '", members.name, "': input has ", input.numel(), " elements but expected ",
              members.size, " ranks x ", output.numel(), " = ", output.numel() * members.size,
              "; pad the input to a multiple of the group size.");
  check_divide_factor(members, "pre_divide_factor", options.pre_divide_factor, input);
  check_divide_factor(members, "post_divide_factor", options.post_divide_factor, input);
  group.record("reduce_scatter", input.numel() * input.element_size());
  const int64_t shard_numel = output.numel();
  auto send = options.pre_divide_factor == 1.0 ? input.reshape({-1}) : input.reshape({-1}) / options.pre_divide_factor;
  if (members.size == 1) {
    if (shard_numel == 0) return completed_work();
    auto destination = output.reshape({-1});
    detail::reduce_rows_into(destination, send.view({1, shard_numel}), options.op);
    if (options.post_divide_factor != 1.0) destination.div_(options.post_divide_factor);
    return completed_work();
  }
  auto issued = detail::issue_collective(group, CollectiveKind::kReduceScatter, input, static_cast<int64_t>(options.op),
                                         describe(members, "reduce_scatter", input));
  if (shard_numel == 0) return CollectiveWork(work_state(group, std::move(issued)));
  if (on_gpu(input)) {
    // NCCL reduces in the buffer's dtype (bf16 sums in bf16, as PyTorch's FSDP2 does on GPUs); the
    // post-divide runs on the stream that waits for the result.
    TORCH_CHECK(input.scalar_type() != at::kBool, "[rank ", members.global_rank,
                "] reduce_scatter of bool on a GPU: NCCL has no bool; reduce a uint8 copy instead.");
    c10d::ReduceScatterOptions reduce_options;
    reduce_options.reduceOp = detail::to_c10d(options.op);
    at::Tensor output_handle = output.reshape({-1});
    at::Tensor input_handle = send.contiguous();
    auto work = detail::nccl_reduce_scatter(group, output_handle, input_handle, reduce_options);
    group.counters->reduce_scatter += (members.size - 1) * shard_numel * input.element_size();
    const double post_divide = options.post_divide_factor;
    return nccl_work(group, std::move(issued), std::move(work), [output_handle, input_handle, post_divide] {
      if (post_divide != 1.0) output_handle.div_(post_divide);
    });
  }
  auto state = work_state(group, std::move(issued));
  const auto algorithm =
      detail::algorithm_for(group, detail::CollectiveOperation::kReduceScatter, input.numel() * input.element_size());
  schedule_or_report(*state, [&] {
    return detail::schedule_reduce_scatter(group, state->issued, algorithm, output, send.contiguous(), options.op,
                                           options.post_divide_factor);
  });
  return CollectiveWork(state);
}

void reduce_scatter(const ProcessGroup& group, const at::Tensor& output, const at::Tensor& input,
                    const ReduceScatterOptions& options) {
  reduce_scatter_async(group, output, input, options).wait();
}

CollectiveWork all_reduce_async(const ProcessGroup& group, const at::Tensor& tensor, ReduceOp op) {
  return all_reduce_of_kind(group, tensor, op, CollectiveKind::kAllReduce, "all_reduce");
}

void all_reduce(const ProcessGroup& group, const at::Tensor& tensor, ReduceOp op) {
  all_reduce_async(group, tensor, op).wait();
}

CollectiveWork broadcast_async(const ProcessGroup& group_handle, const at::Tensor& tensor, int64_t root) {
  auto& group = detail::state_of(group_handle);
  const auto& members = *group.members;
  check_buffer(members, "broadcast", "input", tensor);
  TORCH_CHECK(root >= 0 && root < members.size, "[rank ", members.global_rank, "] broadcast on group '", members.name,
              "': root ", root, " is outside [0, ", members.size, ").");
  group.record("broadcast", tensor.numel() * tensor.element_size());
  if (members.size == 1) return completed_work();
  auto issued =
      detail::issue_collective(group, CollectiveKind::kBroadcast, tensor, root, describe(members, "broadcast", tensor));
  if (tensor.numel() == 0) return CollectiveWork(work_state(group, std::move(issued)));
  if (on_gpu(tensor)) {
    std::vector<at::Tensor> tensors{as_bytes(tensor)};
    c10d::BroadcastOptions options;
    options.rootRank = root;
    auto work = detail::nccl_broadcast(group, tensors, options);
    if (members.rank == root) group.counters->broadcast += (members.size - 1) * tensor.numel() * tensor.element_size();
    return nccl_work(group, std::move(issued), std::move(work));
  }
  // The root sends the buffer to every member, point to point, on the collective's slot: the bytes of
  // Gloo's one-to-all broadcast, keyed as every collective's messages are (Note [Collective check]).
  auto state = work_state(group, std::move(issued));
  const auto& transport = state->transport;
  auto bytes = as_bytes(tensor);
  if (members.rank == root) {
    for (int64_t offset = 1; offset < members.size; ++offset) {
      const auto target = (members.rank + offset) % members.size;
      state->schedule.posted.add(
          detail::post_send(transport, bytes, target, state->issued.data_tag, detail::Traffic::kBroadcast), target);
    }
  } else {
    state->schedule.posted.add(detail::post_receive(transport, bytes, root, state->issued.data_tag), root);
  }
  return CollectiveWork(state);
}

void broadcast(const ProcessGroup& group, const at::Tensor& tensor, int64_t root) {
  broadcast_async(group, tensor, root).wait();
}

void barrier(const ProcessGroup& group) {
  // An all-reduce of one byte: no rank can finish it before every rank has contributed.
  all_reduce_of_kind(group, at::ones({1}, at::kByte), ReduceOp::kMax, CollectiveKind::kBarrier, "barrier").wait();
}

}  // namespace fsdp
