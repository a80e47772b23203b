// The collectives of include/fsdp/collectives.h: Note [Collectives on Gloo] (docs/design.md) says
// what each is built from, Note [Collective check] how ranks that issued different ones are named,
// and Note [The GPU path] how CUDA tensors take NCCL instead (dist/c10d/nccl.cpp).
#include <ATen/core/grad_mode.h>
#include <c10/core/InferenceMode.h>
#include <fsdp/collectives.h>

#include <cmath>
#include <sstream>

#include "dist/c10d/internal.h"
#include "dist/collective_algorithm.h"
#include "memory/buffer_pool.h"

namespace fsdp {
namespace detail {

void wait_works(const std::vector<c10::intrusive_ptr<c10d::Work>>& works, const std::vector<int64_t>& peers,
                const std::vector<int64_t>& others, const std::string& description, std::chrono::milliseconds timeout) {
  for (size_t index = 0; index < works.size(); ++index) {
    try {
      works[index]->wait();
    } catch (const std::exception& error) {
      std::string peer;
      if (index < peers.size()) {
        peer = " in the exchange with rank " + std::to_string(peers[index]);
      } else if (others.size() == 1) {
        peer = " in the exchange with rank " + std::to_string(others.front());
      } else if (!others.empty()) {
        peer = " in an exchange with one of ranks ";
        for (size_t other = 0; other < others.size() && other < 16; ++other) {
          peer += (other ? ", " : "") + std::to_string(others[other]);
        }
        if (others.size() > 16) peer += ", ...";
      }
      TORCH_CHECK(false, description, " failed", peer, ": ", error.what(),
                  ". A peer rank probably exited or stopped calling collectives in the same order; read the other "
                  "ranks' logs. (Collective timeout: ",
                  timeout.count() / 1000.0, " s, set with FSDP_COLLECTIVE_TIMEOUT.)");
    }
  }
}

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
using detail::IssuedCollective;
using detail::ProcessGroupState;

std::string describe(const ProcessGroupState& group, const char* operation, const at::Tensor& tensor) {
  std::ostringstream text;
  text << "[rank " << group.global_rank << "] " << operation << " on group '" << group.name << "' (" << group.size
       << " ranks, " << tensor.numel() << " x " << tensor.scalar_type() << ")";
  return text.str();
}

void check_buffer(const ProcessGroupState& group, const char* operation, const char* role, const at::Tensor& tensor) {
  TORCH_CHECK(tensor.defined(), "[rank ", group.global_rank, "] ", operation, ": the ", role,
              " tensor is undefined; pass an allocated buffer.");
  if (!tensor.device().is_cpu()) {
    TORCH_CHECK(detail::gpu_path_built(), "[rank ", group.global_rank, "] ", operation, ": the ", role,
                " tensor is on ", tensor.device(),
                " but this build of fsdp.cpp has no GPU path: its groups move CPU tensors. Move it with .cpu(), or "
                "build fsdp.cpp against a CUDA libtorch (README, 'The GPU path').");
    TORCH_CHECK(tensor.is_cuda(), "[rank ", group.global_rank, "] ", operation, ": the ", role, " tensor is on ",
                tensor.device(), "; fsdp.cpp's groups move CPU tensors (Gloo) and CUDA tensors (NCCL).");
  }
  TORCH_CHECK(tensor.is_contiguous(), "[rank ", group.global_rank, "] ", operation, ": the ", role,
              " tensor must be contiguous (got strides ", tensor.strides(), "); call .contiguous() first.");
}

void check_divide_factor(const ProcessGroupState& group, const char* name, double factor, const at::Tensor& tensor) {
  if (factor == 1.0) return;
  TORCH_CHECK(std::isfinite(factor) && factor > 0, "[rank ", group.global_rank, "] reduce_scatter: ", name, "=", factor,
              " must be a positive finite number.");
  TORCH_CHECK(at::isFloatingType(tensor.scalar_type()), "[rank ", group.global_rank, "] reduce_scatter: ", name, "=",
              factor, " needs a floating dtype but the buffer is ", tensor.scalar_type(), "; use 1 for integers.");
}

at::Tensor as_bytes(const at::Tensor& tensor) { return tensor.reshape({-1}).view(at::kByte); }

bool on_gpu(const at::Tensor& tensor) { return tensor.defined() && tensor.is_cuda(); }

CollectiveWork completed_work() {
  auto state = std::make_shared<CollectiveWorkState>();
  state->done = true;
  return CollectiveWork(state);
}

struct Pending {
  std::vector<c10::intrusive_ptr<c10d::Work>> works;
  std::vector<int64_t> peers;  // for point-to-point works, the global rank of each
  std::function<void()> finish;
  std::shared_future<c10::intrusive_ptr<c10d::Work>> deferred;
};

CollectiveWork pending_work(const ProcessGroupState& group, const IssuedCollective& issued, std::string description,
                            Pending pending = {}) {
  auto state = std::make_shared<CollectiveWorkState>();
  state->works = std::move(pending.works);
  state->peers = std::move(pending.peers);
  for (const auto rank : group.global_ranks) {
    if (rank != group.global_rank) state->others.push_back(rank);
  }
  // A deferred collective's check is verified by the queue that issues it, and fails through it.
  if (!pending.deferred.valid()) state->check = issued.check;
  state->deferred = std::move(pending.deferred);
  state->finish = std::move(pending.finish);
  state->description = detail::with_activity(std::move(description));
  state->timeout = group.timeout;
  return CollectiveWork(state);
}

void check_same_device(const ProcessGroupState& group, const char* operation, const at::Tensor& output,
                       const at::Tensor& input) {
  // NCCL moves device memory and Gloo host memory, and one collective cannot mix them.
  TORCH_CHECK(output.device() == input.device(), "[rank ", group.global_rank, "] ", operation, " on group '",
              group.name, "': the output is on ", output.device(), " but the input on ", input.device(),
              "; put both on the device the collective runs on.");
}

// Reduces the N rows of `rows` (shape [N, s]) into `output` (s elements), in rank order. Pairwise
// adds stream through memory once per row; at::sum over dim 0 of the same rows is 3.5x slower here.
// bf16 and fp16 accumulate in fp32, which also makes a pre-divide unnecessary against overflow.
void reduce_rows_into(const at::Tensor& output, const at::Tensor& rows, ReduceOp op) {
  const auto dtype = rows.scalar_type();
  const int64_t count = rows.size(0);
  if (dtype == at::kBool) {
    output.copy_(op == ReduceOp::kMin ? rows.all(0) : rows.any(0));
    return;
  }
  const bool widen = op == ReduceOp::kSum && (dtype == at::kBFloat16 || dtype == at::kHalf);
  auto accumulator = widen ? rows[0].to(at::kFloat) : output;
  if (!widen) accumulator.copy_(rows[0]);
  for (int64_t row = 1; row < count; ++row) {
    switch (op) {
      case ReduceOp::kSum:
        accumulator.add_(rows[row]);
        break;
      case ReduceOp::kMax:
        at::maximum_out(accumulator, accumulator, rows[row]);
        break;
      case ReduceOp::kMin:
        at::minimum_out(accumulator, accumulator, rows[row]);
        break;
    }
  }
  if (widen) output.copy_(accumulator);
}

bool gloo_reduces_natively(at::ScalarType dtype) {
  switch (dtype) {
    case at::kFloat:
    case at::kDouble:
    case at::kHalf:
    case at::kBFloat16:
    case at::kBool:
    case at::kChar:
    case at::kByte:
    case at::kInt:
    case at::kLong:
      return true;
    default:
      return false;
  }
}

// A work that is already done: what the issue queue hands back for a collective it ran itself.
class FinishedWork : public c10d::Work {
 public:
  FinishedWork() { finish(); }
};

// Note [Algorithms by measurement]: the direct all-reduce, a reduce-scatter then an all-gather of
// the same padded buffer, each an exchange with every peer at once on the collective's data slot.
// Runs on the group's issue queue (the second half needs the first's result, and a rank must not
// depend on its peers calling wait() to make progress), so it holds copies of what it needs from
// the group and never the group itself.
struct DirectAllReduce {
  c10::intrusive_ptr<c10d::ProcessGroupGloo> gloo;
  std::shared_ptr<detail::CollectiveCheck> check;  // null with the check off
  int64_t rank = 0;
  int64_t size = 1;
  std::vector<int64_t> peers;  // global ranks, exchange_peers order: receives, then sends
  int tag = 0;
  at::Tensor tensor;
  ReduceOp op = ReduceOp::kSum;
  std::string description;
  std::chrono::milliseconds timeout{0};
  // Taken from the pool by the caller's thread: taking a block polls the pool's busy blocks, whose
  // completion callbacks read other collectives' state, which only the caller's thread may touch.
  at::Tensor padded_bytes;    // undefined when the buffer divides evenly (reduced in place)
  at::Tensor received_bytes;  // the peers' rows for this rank
  // The caller's thread-local autograd mode, which the queue's thread does not inherit.
  bool inference_mode = false;
};

void run_direct_all_reduce(const DirectAllReduce& plan) {
  // The caller's mode: in-place updates of a tensor that requires grad (or of an inference tensor)
  // are what the caller's own all_reduce would do under its guards.
  c10::InferenceMode inference(plan.inference_mode);
  at::NoGradGuard no_grad;
  if (plan.check) detail::verify_check(*plan.check, plan.timeout);
  const int64_t numel = plan.tensor.numel();
  const int64_t chunk = (numel + plan.size - 1) / plan.size;
  const auto dtype = plan.tensor.scalar_type();
  // In place when the buffer divides evenly, else a padded copy; the received rows come from the
  // pool, as reduce_scatter's do (a fresh buffer costs a page fault per 4 KiB).
  const bool in_place = !plan.padded_bytes.defined();
  at::Tensor rows;
  if (in_place) {
    rows = plan.tensor.view({plan.size, chunk});
  } else {
    rows = plan.padded_bytes.view(dtype).view({plan.size, chunk});
    auto flat = rows.view({-1});
    flat.narrow(0, 0, numel).copy_(plan.tensor.reshape({-1}));
    flat.narrow(0, numel, plan.size * chunk - numel).zero_();
  }
  auto received = plan.received_bytes.view(dtype).view({plan.size, chunk});
  received[plan.rank].copy_(rows[plan.rank]);
  // Receives from rank - 1, rank - 2, ... and sends to rank + 1, rank + 2, ...: exchange_peers' order.
  // On failure the pooled buffers are not returned: abandoned transfers may still write them.
  auto exchange = [&](const std::function<at::Tensor(int64_t)>& sent, const std::function<at::Tensor(int64_t)>& into) {
    std::vector<c10::intrusive_ptr<c10d::Work>> works;
    try {
      for (int64_t offset = 1; offset < plan.size; ++offset) {
        const auto source = (plan.rank + plan.size - offset) % plan.size;
        std::vector<at::Tensor> destination{as_bytes(into(source))};
        works.push_back(plan.gloo->recv(destination, static_cast<int>(source), plan.tag));
      }
      for (int64_t offset = 1; offset < plan.size; ++offset) {
        const auto target = (plan.rank + offset) % plan.size;
        std::vector<at::Tensor> payload{as_bytes(sent(target))};
        works.push_back(plan.gloo->send(payload, static_cast<int>(target), plan.tag));
      }
    } catch (const c10::Error&) {
      detail::abandon(works);
      throw;
    } catch (const std::exception& error) {
      // Gloo refuses to post on a connection that is already closed, with its own exception type.
      detail::abandon(works);
      TORCH_CHECK(false, plan.description, " failed: ", error.what(), ". A peer rank probably exited; read its log");
    }
    try {
      detail::wait_works(works, plan.peers, {}, plan.description, plan.timeout);
    } catch (...) {
      detail::abandon(works);
      throw;
    }
  };
  exchange([&](int64_t peer) { return rows[peer]; }, [&](int64_t peer) { return received[peer]; });
  auto own = rows[plan.rank];
  reduce_rows_into(own, received, plan.op);
  detail::return_pooled_bytes(plan.received_bytes);
  exchange([&](int64_t) { return own; }, [&](int64_t peer) { return rows[peer]; });
  if (!in_place) {
    plan.tensor.view({-1}).copy_(rows.view({-1}).narrow(0, 0, numel));
    detail::return_pooled_bytes(plan.padded_bytes);
  }
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
  if (state_->deferred.valid()) {
    if (state_->deferred.wait_for(std::chrono::seconds(0)) != std::future_status::ready) return false;
    try {
      if (!state_->deferred.get()->isCompleted()) return false;
    } catch (const std::exception&) {
      // Failed: a direct all-reduce's abandoned transfers may still write the buffer, so it is
      // never reported done (a Gloo all-reduce that failed its check was never issued at all).
      return false;
    }
  }
  for (const auto& work : state_->works) {
    if (!work->isCompleted()) return false;
  }
  return true;
}

void CollectiveWork::wait() {
  if (state_ == nullptr || state_->done) return;
  state_->done = true;  // a failed collective is not retried by a second wait()
  // On failure the works stay referenced by state_ (or abandoned), so buffers in flight stay alive.
  if (state_->check) {
    try {
      detail::verify_check(*state_->check, state_->timeout);
    } catch (const std::exception&) {
      // Data of a diverged collective travels on a slot no peer receives from: it may never finish.
      detail::abandon(state_->works);
      throw;
    }
  }
  if (state_->deferred.valid()) state_->works.push_back(state_->deferred.get());
  detail::wait_works(state_->works, state_->peers, state_->others, state_->description, state_->timeout);
  if (state_->finish) state_->finish();
  state_->works.clear();
  state_->finish = nullptr;
}

CollectiveWork all_gather_async(const ProcessGroup& group_handle, const at::Tensor& output, const at::Tensor& input) {
  auto& group = detail::state_of(group_handle);
  check_buffer(group, "all_gather", "output", output);
  check_buffer(group, "all_gather", "input", input);
  check_same_device(group, "all_gather", output, input);
  TORCH_CHECK(output.scalar_type() == input.scalar_type(), "[rank ", group.global_rank, "] all_gather: output dtype ",
              output.scalar_type(), " differs from input dtype ", input.scalar_type(), ".");
  TORCH_CHECK(output.numel() == input.numel() * group.size, "[rank ", group.global_rank, "] all_gather on group '",
              group.name, "': output has ", output.numel(), " elements but expected ", group.size, " ranks x ",
              input.numel(), " = ", input.numel() * group.size, "; pad shards to equal size.");
  group.record("all_gather", input.numel() * input.element_size());
  if (group.size == 1) {
    if (!output.is_same(input)) output.reshape({-1}).copy_(input.reshape({-1}));
    return completed_work();
  }
  auto description = describe(group, "all_gather", output);
  const auto issued = detail::issue_collective(group, CollectiveKind::kAllGather, input, 0, description);
  if (input.numel() == 0) return pending_work(group, issued, std::move(description));
  auto input_bytes = as_bytes(input);
  auto output_bytes = as_bytes(output);
  const int64_t shard_bytes = input_bytes.numel();
  Pending pending;
  if (on_gpu(input)) {
    pending.works.push_back(detail::nccl_all_gather(group, output_bytes, input_bytes));
  } else {
    auto own_chunk = output_bytes.narrow(0, group.rank * shard_bytes, shard_bytes);
    if (own_chunk.data_ptr() != input_bytes.data_ptr()) own_chunk.copy_(input_bytes);
    pending.works = detail::exchange_with_peers(
        group, issued.data_tag, [&](int64_t) { return input_bytes; },
        [&](int64_t peer) { return output_bytes.narrow(0, peer * shard_bytes, shard_bytes); });
    pending.peers = detail::exchange_peers(group);
  }
  group.bytes_all_gather += (group.size - 1) * shard_bytes;
  return pending_work(group, issued, std::move(description), std::move(pending));
}

void all_gather(const ProcessGroup& group, const at::Tensor& output, const at::Tensor& input) {
  all_gather_async(group, output, input).wait();
}

CollectiveWork reduce_scatter_async(const ProcessGroup& group_handle, const at::Tensor& output, const at::Tensor& input,
                                    const ReduceScatterOptions& options) {
  auto& group = detail::state_of(group_handle);
  check_buffer(group, "reduce_scatter", "output", output);
  check_buffer(group, "reduce_scatter", "input", input);
  check_same_device(group, "reduce_scatter", output, input);
  TORCH_CHECK(output.scalar_type() == input.scalar_type(), "[rank ", group.global_rank,
              "] reduce_scatter: output dtype ", output.scalar_type(), " differs from input dtype ",
              input.scalar_type(), ".");
  TORCH_CHECK(input.numel() == output.numel() * group.size, "[rank ", group.global_rank, "] reduce_scatter on group '",
              group.name, "': input has ", input.numel(), " elements but expected ", group.size, " ranks x ",
              output.numel(), " = ", output.numel() * group.size, "; pad the input to a multiple of the group size.");
  check_divide_factor(group, "pre_divide_factor", options.pre_divide_factor, input);
  check_divide_factor(group, "post_divide_factor", options.post_divide_factor, input);
  group.record("reduce_scatter", input.numel() * input.element_size());
  const int64_t shard_numel = output.numel();
  auto description = describe(group, "reduce_scatter", input);
  IssuedCollective issued;
  if (group.size > 1) {
    issued = detail::issue_collective(group, CollectiveKind::kReduceScatter, input, static_cast<int64_t>(options.op),
                                      description);
  }
  if (shard_numel == 0) return group.size > 1 ? pending_work(group, issued, std::move(description)) : completed_work();

  auto send = options.pre_divide_factor == 1.0 ? input.reshape({-1}) : input.reshape({-1}) / options.pre_divide_factor;
  auto finish_rows = [output, options](const at::Tensor& rows) {
    auto destination = output.reshape({-1});
    reduce_rows_into(destination, rows, options.op);
    if (options.post_divide_factor != 1.0) destination.div_(options.post_divide_factor);
  };
  if (group.size == 1) {
    finish_rows(send.view({1, shard_numel}));
    return completed_work();
  }
  Pending pending;
  if (on_gpu(input)) {
    // NCCL reduces in the buffer's dtype (bf16 sums in bf16, as PyTorch's FSDP2 does on GPUs); the
    // post-divide runs on the stream that waits for the result.
    TORCH_CHECK(input.scalar_type() != at::kBool, "[rank ", group.global_rank,
                "] reduce_scatter of bool on a GPU: NCCL has no bool; reduce a uint8 copy instead.");
    c10d::ReduceScatterOptions reduce_options;
    reduce_options.reduceOp = detail::to_c10d(options.op);
    at::Tensor output_handle = output.reshape({-1});
    at::Tensor input_handle = send.contiguous();
    pending.works.push_back(detail::nccl_reduce_scatter(group, output_handle, input_handle, reduce_options));
    group.bytes_reduce_scatter += (group.size - 1) * shard_numel * input.element_size();
    const double post_divide = options.post_divide_factor;
    pending.finish = [output_handle, input_handle, post_divide] {
      if (post_divide != 1.0) output_handle.div_(post_divide);
    };
    return pending_work(group, issued, std::move(description), std::move(pending));
  }

  // Row r of `received` is rank r's chunk for this rank: (N-1)/N of the buffer crosses the wire.
  // From the pool of unit-sized blocks: a fresh buffer costs a page fault per 4 KiB (31 ms for 64 MB
  // here, more than the transfer), and the same sizes recur every step.
  const int64_t chunk_bytes = shard_numel * input.element_size();
  auto received_bytes = detail::pooled_bytes(group.size * chunk_bytes, input.device());
  auto received = received_bytes.view(input.scalar_type()).view({group.size, shard_numel});
  auto send_bytes = as_bytes(send);
  received_bytes.narrow(0, group.rank * chunk_bytes, chunk_bytes)
      .copy_(send_bytes.narrow(0, group.rank * chunk_bytes, chunk_bytes));
  pending.works = detail::exchange_with_peers(
      group, issued.data_tag, [&](int64_t peer) { return send_bytes.narrow(0, peer * chunk_bytes, chunk_bytes); },
      [&](int64_t peer) { return received_bytes.narrow(0, peer * chunk_bytes, chunk_bytes); });
  pending.peers = detail::exchange_peers(group);
  pending.finish = [send, received, finish_rows] {
    finish_rows(received);
    detail::return_pooled_bytes(received);
  };
  group.bytes_reduce_scatter += (group.size - 1) * chunk_bytes;
  return pending_work(group, issued, std::move(description), std::move(pending));
}

void reduce_scatter(const ProcessGroup& group, const at::Tensor& output, const at::Tensor& input,
                    const ReduceScatterOptions& options) {
  reduce_scatter_async(group, output, input, options).wait();
}

CollectiveWork all_reduce_async(const ProcessGroup& group_handle, const at::Tensor& tensor, ReduceOp op) {
  auto& group = detail::state_of(group_handle);
  check_buffer(group, "all_reduce", "input", tensor);
  group.record("all_reduce", tensor.numel() * tensor.element_size());
  if (group.size == 1) return completed_work();
  auto description = describe(group, "all_reduce", tensor);
  const auto issued =
      detail::issue_collective(group, CollectiveKind::kAllReduce, tensor, static_cast<int64_t>(op), description);
  if (tensor.numel() == 0) return pending_work(group, issued, std::move(description));
  const int64_t bytes = tensor.numel() * tensor.element_size();
  Pending pending;
  if (on_gpu(tensor)) {
    // NCCL has no bool: a uint8 copy, with max for "any" (sum, max) and min for "all".
    const bool as_uint8 = tensor.scalar_type() == at::kBool;
    std::vector<at::Tensor> tensors{as_uint8 ? tensor.to(at::kByte) : tensor};
    c10d::AllreduceOptions options;
    options.reduceOp = as_uint8 && op == ReduceOp::kSum ? c10d::ReduceOp(c10d::ReduceOp::MAX) : detail::to_c10d(op);
    pending.works.push_back(detail::nccl_all_reduce(group, tensors, options));
    group.bytes_all_reduce += 2 * (group.size - 1) * bytes / group.size;
    if (as_uint8) pending.finish = [tensor, copy = tensors.front()] { tensor.copy_(copy); };
    return pending_work(group, issued, std::move(description), std::move(pending));
  }
  const bool gloo_ring = detail::choose_all_reduce(group.size, bytes) == detail::AllReduceAlgorithm::kGlooRing;
  if (gloo_ring && gloo_reduces_natively(tensor.scalar_type())) {
    std::vector<at::Tensor> tensors{tensor};
    c10d::AllreduceOptions options;
    options.reduceOp = detail::to_c10d(op);
    if (issued.check) {
      // Note [Collective check]: Gloo's ring may start only once every header matched (a longer
      // buffer on one rank aborts inside Gloo), and this call returns at once: the group's queue
      // issues it, in issue order, when the headers have arrived.
      auto promise = std::make_shared<std::promise<c10::intrusive_ptr<c10d::Work>>>();
      pending.deferred = promise->get_future().share();
      group.backend->issue_queue.push([check = issued.check, promise, tensors, options, timeout = group.timeout,
                                       gloo_group = group.backend->group]() mutable {
        try {
          detail::verify_check(*check, timeout);
          promise->set_value(gloo_group->allreduce(tensors, options));
        } catch (...) {
          promise->set_exception(std::current_exception());
        }
      });
    } else {
      pending.works.push_back(detail::gloo(group).allreduce(tensors, options));
    }
    // Gloo's ring all-reduce: a reduce-scatter then an all-gather, each (N-1)/N of the buffer.
    group.bytes_all_reduce += 2 * (group.size - 1) * bytes / group.size;
    return pending_work(group, issued, std::move(description), std::move(pending));
  }
  // Note [Algorithms by measurement]: the direct exchange, from 8 ranks, and for the dtypes Gloo
  // does not reduce (int16 and the rest) at every size. The group's issue queue runs it, in issue
  // order with the group's other queued collectives, so this call returns at once.
  DirectAllReduce plan;
  plan.gloo = group.backend->group;
  plan.check = issued.check;
  plan.rank = group.rank;
  plan.size = group.size;
  plan.peers = detail::exchange_peers(group);
  plan.tag = issued.data_tag;
  plan.tensor = tensor;
  plan.op = op;
  plan.description = detail::with_activity(description);
  plan.timeout = group.timeout;
  const int64_t chunk_bytes = (tensor.numel() + group.size - 1) / group.size * tensor.element_size();
  if (tensor.numel() % group.size != 0) {
    plan.padded_bytes = detail::pooled_bytes(group.size * chunk_bytes, tensor.device());
  }
  plan.received_bytes = detail::pooled_bytes(group.size * chunk_bytes, tensor.device());
  plan.inference_mode = c10::InferenceMode::is_enabled();
  auto promise = std::make_shared<std::promise<c10::intrusive_ptr<c10d::Work>>>();
  pending.deferred = promise->get_future().share();
  group.backend->issue_queue.push([plan = std::move(plan), promise] {
    try {
      run_direct_all_reduce(plan);
      promise->set_value(c10::make_intrusive<FinishedWork>());
    } catch (...) {
      promise->set_exception(std::current_exception());
    }
  });
  group.bytes_all_reduce += 2 * (group.size - 1) * chunk_bytes;
  return pending_work(group, issued, std::move(description), std::move(pending));
}

void all_reduce(const ProcessGroup& group, const at::Tensor& tensor, ReduceOp op) {
  all_reduce_async(group, tensor, op).wait();
}

CollectiveWork broadcast_async(const ProcessGroup& group_handle, const at::Tensor& tensor, int64_t root) {
  auto& group = detail::state_of(group_handle);
  check_buffer(group, "broadcast", "input", tensor);
  TORCH_CHECK(root >= 0 && root < group.size, "[rank ", group.global_rank, "] broadcast on group '", group.name,
              "': root ", root, " is outside [0, ", group.size, ").");
  group.record("broadcast", tensor.numel() * tensor.element_size());
  if (group.size == 1) return completed_work();
  auto description = describe(group, "broadcast", tensor);
  const auto issued = detail::issue_collective(group, CollectiveKind::kBroadcast, tensor, root, description);
  if (tensor.numel() == 0) return pending_work(group, issued, std::move(description));
  Pending pending;
  if (on_gpu(tensor)) {
    std::vector<at::Tensor> tensors{as_bytes(tensor)};
    c10d::BroadcastOptions options;
    options.rootRank = root;
    pending.works.push_back(detail::nccl_broadcast(group, tensors, options));
  } else if (group.rank == root) {
    // The root sends the buffer to every member, point to point, on the collective's data slot:
    // the bytes of Gloo's one-to-all broadcast, with the check's slot keying (Note [Collective check]).
    auto bytes = as_bytes(tensor);
    for (int64_t offset = 1; offset < group.size; ++offset) {
      const auto target = (group.rank + offset) % group.size;
      pending.works.push_back(detail::post_send(group, bytes, target, issued.data_tag));
      pending.peers.push_back(group.global_ranks[static_cast<size_t>(target)]);
    }
  } else {
    pending.works.push_back(detail::post_receive(group, as_bytes(tensor), root, issued.data_tag));
    pending.peers.push_back(group.global_ranks[static_cast<size_t>(root)]);
  }
  if (group.rank == root) group.bytes_broadcast += (group.size - 1) * tensor.numel() * tensor.element_size();
  return pending_work(group, issued, std::move(description), std::move(pending));
}

void broadcast(const ProcessGroup& group, const at::Tensor& tensor, int64_t root) {
  broadcast_async(group, tensor, root).wait();
}

void barrier(const ProcessGroup& group_handle) {
  auto& group = detail::state_of(group_handle);
  group.record("barrier", 0);
  if (group.size == 1) return;
  // The exchange of headers is itself the barrier: every member hears from every other, check on or off.
  const auto description = "[rank " + std::to_string(group.global_rank) + "] barrier on group '" + group.name + "'";
  const auto issued = detail::issue_collective(group, CollectiveKind::kBarrier, at::Tensor(), 0, description, true);
  pending_work(group, issued, description).wait();
}

}  // namespace fsdp
