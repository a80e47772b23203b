// Note [asynchronous checkpoints]
// A synchronous SHARDED save stalls every rank until its last byte is on disk. An asynchronous one
// (torchtitan's and dcp.async_save's idea) splits the save of sharded_save.h in three: on the
// training thread, collectively, begin (the directory stops being a checkpoint, the save's id, the
// progress files with the generator as it is now) and a copy of this rank's shards and optimizer
// state into a staging buffer kept between saves; on a thread of this rank's own, the `.distcp`
// files of that copy, written, fsynced and renamed, with no collective (a group's collectives are
// issued from one thread: include/fsdp/process_group.h); and later, on the training thread again,
// collectively, finish: one all-reduce says every rank wrote its files and its metadata pieces,
// then rank 0 joins both `.metadata` files and writes the marker (Note [metadata pieces]). So a
// checkpoint counts (for latest_checkpoint, resume_after_restart and rotation) only once every
// rank's files are durable, and a crash in between leaves the one before as the latest. finish runs
// when every rank is done (polled with one all-reduce of one flag after each optimizer step, by
// Accelerator::step or the program), when the next save starts (at most one is in flight: that one
// waits, and Accelerator says so), or when the program asks (before it exits). What training does
// meanwhile never reaches the files: the thread reads only the staged copy. Entries this rank does
// not write (another rank's replica, a replicated tensor off rank 0) are not copied. Differs from
// PyTorch's dcp.async_save, which finishes in the background on a process group of its own: here
// the metadata waits for the training thread's next poll, one step at most.
#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <fsdp/async_checkpoint.h>
#include <fsdp/collectives.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <array>
#include <atomic>
#include <chrono>
#include <optional>
#include <thread>

#include "checkpoint/sharded_save.h"
#include "dist/agreement.h"
#include "memory/device.h"

namespace fsdp {
namespace detail {

struct AsyncSaveState {
  std::vector<at::Tensor> staging;  // kept between saves, reused when the shapes stay
  std::optional<ShardedSave> save;  // the save in flight
  std::thread writer;
  std::atomic<bool> written{false};
  std::array<std::string, 2> reports;
  std::string directory;
  double staging_seconds = 0;
  double waited_seconds = 0;

  void join() {
    if (writer.joinable()) writer.join();
  }
};

namespace {

// The writer thread's nice value: CFS gives it about a tenth of a core that a training thread also
// wants (weight 110 against 1024), and any core left idle.
constexpr int kWriterNice = 10;

// Whether this rank writes the entry (save_checkpoint's writer skips the others).
bool written_here(const ShardedTensor& tensor, int64_t rank) {
  return !(tensor.replicated && rank != 0) && !tensor.duplicate;
}

// Points each entry this rank writes at its copy in `staging`; the others at an empty tensor of their
// dtype (finish needs only their shapes and dtypes, which the entry keeps).
void stage(std::vector<DcpTensorEntry>& entries, std::vector<at::Tensor>& staging, size_t& next, int64_t rank) {
  at::NoGradGuard no_grad;
  for (auto& entry : entries) {
    auto& local = entry.tensor.local;
    if (!written_here(entry.tensor, rank)) {
      local = at::empty({0}, local.options().device(at::kCPU));
      continue;
    }
    if (next == staging.size()) staging.emplace_back();
    auto& copy = staging[next++];
    if (!copy.defined() || copy.sizes() != local.sizes() || copy.scalar_type() != local.scalar_type()) {
      copy = empty_host(local.sizes(), local.scalar_type(), local.is_cuda());
    }
    copy.copy_(local);
    local = copy;
  }
}

}  // namespace
}  // namespace detail

AsyncCheckpointer::AsyncCheckpointer() : state_(std::make_unique<detail::AsyncSaveState>()) {}

AsyncCheckpointer::~AsyncCheckpointer() {
  if (!state_) return;
  state_->join();
  if (state_->save) {
    TORCH_WARN("the asynchronous checkpoint '", state_->directory,
               "' was not finished (no AsyncCheckpointer::finish "
               "after its files were written), so it has no completion marker and does not count; the latest complete "
               "checkpoint is the one before it. Call finish(context, true) (Accelerator::finish_checkpoint()) before "
               "the program ends");
  }
}

bool AsyncCheckpointer::in_flight() const { return state_->save.has_value(); }
const std::string& AsyncCheckpointer::directory() const { return state_->directory; }
double AsyncCheckpointer::staging_seconds() const { return state_->staging_seconds; }
double AsyncCheckpointer::waited_seconds() const { return state_->waited_seconds; }

int64_t AsyncCheckpointer::staging_bytes() const {
  int64_t bytes = 0;
  for (const auto& tensor : state_->staging) {
    if (tensor.defined()) bytes += static_cast<int64_t>(tensor.numel()) * static_cast<int64_t>(tensor.element_size());
  }
  return bytes;
}

bool AsyncCheckpointer::finish(const DistributedContext& context, bool wait) {
  auto& state = *state_;
  if (!state.save) return true;
  if (wait) {
    state.join();
  } else {
    // Every rank's answer, so that every rank finishes at the same point or none does.
    auto done = at::full({1}, state.written.load() ? 1 : 0, at::kLong);
    all_reduce(context.control(), done, ReduceOp::kMin);
    if (done.item<int64_t>() == 0) return false;
    state.join();
  }
  auto save = std::move(*state.save);
  state.save.reset();
  detail::finish_sharded_save(save, state.reports, context);
  return true;
}

void AsyncCheckpointer::start(const std::string& directory, torch::nn::Module& model,
                              torch::optim::Optimizer& optimizer, const DistributedContext& context,
                              const TrainingProgress& progress) {
  auto& state = *state_;
  state.waited_seconds = 0;
  if (state.save && !finish(context, false)) {
    const auto started = std::chrono::steady_clock::now();
    finish(context, true);
    state.waited_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
  }
  auto save = detail::begin_sharded_save(directory, model, optimizer, context, progress);
  state.directory = directory;
  const auto rank = context.rank();
  const auto world_size = context.world_size();
  // Staging and the thread's start can fail on one rank only (page-locked memory, a thread): every
  // rank raises then, and none keeps the save in flight, or the ranks would disagree on whether the
  // next finish() all-reduces.
  try {
    detail::run_on_every_rank(context, [&] {
      const auto copy_started = std::chrono::steady_clock::now();
      size_t next = 0;
      detail::stage(save.model, state.staging, next, rank);
      detail::stage(save.optimizer, state.staging, next, rank);
      state.staging.resize(next);  // a smaller state than last time keeps no stale copies
      state.staging_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - copy_started).count();
      state.save = std::move(save);
      state.reports = {};
      state.written = false;
      state.writer = std::thread([&state, rank, world_size] {
        // Training comes first: on a machine whose cores the ranks keep busy, the writer's serialization
        // and checksums run when a rank waits (Linux's nice value is per thread). Without the permission
        // to lower it the thread keeps the default: only slower for training, never wrong.
        (void)::setpriority(PRIO_PROCESS, static_cast<id_t>(::syscall(SYS_gettid)), detail::kWriterNice);
        try {
          state.reports = detail::write_sharded_save_files(*state.save, rank, world_size);
        } catch (const std::exception& error) {  // write_sharded_save_files reports; this is a last resort
          state.reports = {std::string("ERROR:") + error.what(), std::string("ERROR:") + error.what()};
        }
        state.written = true;
      });
    });
  } catch (...) {
    state.join();
    state.save.reset();
    throw;
  }
}

}  // namespace fsdp
