// Asynchronous SHARDED_STATE_DICT checkpoints: a save that costs training only the copy of each
// rank's state into a staging buffer, while a thread writes the files (Note [asynchronous
// checkpoints], src/checkpoint/async_checkpoint.cpp). The files are those save_checkpoint writes
// (the same DCP directories PyTorch's dcp.load reads); the checkpoint counts as complete only once
// every rank's files are durable and rank 0 has written the metadata and the marker, which happens
// in finish(), on the training thread. Accelerator::save_state(..., {async = true}) uses it.
#pragma once

#include <fsdp/checkpoint.h>
#include <fsdp/process_group.h>
#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>

#include <cstdint>
#include <memory>
#include <string>

namespace fsdp {

namespace detail {
struct AsyncSaveState;
}

class AsyncCheckpointer {
 public:
  AsyncCheckpointer();
  /// Waits for this rank's writing thread. A save not finished by then stays incomplete (no marker):
  /// the latest complete checkpoint is still the one before it. Call finish(context, true) first.
  ~AsyncCheckpointer();
  AsyncCheckpointer(const AsyncCheckpointer&) = delete;
  AsyncCheckpointer& operator=(const AsyncCheckpointer&) = delete;

  /// Starts a save of `model` and `optimizer` (SHARDED_STATE_DICT, the layout of checkpoint.h) into
  /// `directory`. One save at most is in flight: the one before is finished first, waiting for its
  /// files if they are not written yet. Then this rank's shards and optimizer state are copied into
  /// the staging buffer (kept for the next save; page-locked host memory for GPU tensors) and a
  /// thread writes them; training may change the model as soon as this returns. Collective.
  void start(const std::string& directory, torch::nn::Module& model, torch::optim::Optimizer& optimizer,
             const DistributedContext& context, const TrainingProgress& progress);
  /// Finishes the save in flight: with `wait` false only if every rank's files are written already
  /// (one all-reduce of one flag), with `wait` true after waiting for this rank's thread. Returns
  /// whether no save is in flight afterwards. A write that failed on any rank is raised here, on every
  /// rank, and that checkpoint stays incomplete. Collective (every rank at the same point: whether a
  /// save is in flight is the same everywhere, since start and finish are collective).
  bool finish(const DistributedContext& context, bool wait);
  bool in_flight() const;
  /// The directory of the save in flight, or of the last one.
  const std::string& directory() const;
  /// Bytes of this rank's staging buffer: one copy of the state it writes.
  int64_t staging_bytes() const;
  /// Of the last start(): seconds spent copying into the staging buffer, and waiting for the save
  /// before it (0 when it was finished already).
  double staging_seconds() const;
  double waited_seconds() const;

 private:
  std::unique_ptr<detail::AsyncSaveState> state_;
};

}  // namespace fsdp
