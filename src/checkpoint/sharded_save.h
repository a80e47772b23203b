// The three phases of a SHARDED_STATE_DICT save: save_checkpoint runs them one after the other on
// the live state; AsyncCheckpointer (async_checkpoint.cpp) runs the middle one on a thread of its
// own, on a staged copy (Note [asynchronous checkpoints]).
#pragma once

#include <fsdp/checkpoint.h>
#include <fsdp/process_group.h>
#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>

#include <array>
#include <cstdint>
#include <string>
#include <vector>

#include "checkpoint/dcp_writer.h"

namespace fsdp::detail {

/// What one rank writes: its entries of the model's and the optimizer's DCP directories.
struct ShardedSave {
  std::string directory;
  std::string save_id;
  int64_t step = 0;
  std::vector<DcpTensorEntry> model;
  std::vector<DcpTensorEntry> optimizer;
  std::vector<DcpByteEntry> optimizer_bytes;
};

/// Collective: the directory stops counting as a checkpoint, every rank agrees on it, the save's id
/// is chosen, the progress files (step, scheduler, data position, this rank's generator as it is
/// now) are written, and the entries returned are views of the live model and optimizer state.
ShardedSave begin_sharded_save(const std::string& directory, torch::nn::Module& model,
                               torch::optim::Optimizer& optimizer, const DistributedContext& context,
                               const TrainingProgress& progress);
/// Local, no collective: this rank's two `.distcp` files, written and fsynced. Returns their reports
/// (write_dcp_rank_file's); never throws for a failed write, which the reports carry.
std::array<std::string, 2> write_sharded_save_files(const ShardedSave& save, int64_t rank, int64_t world_size);
/// Collective: rank 0 writes both `.metadata` files once every rank's files are written, then the
/// completion marker. A rank's failure is raised on every rank, and the directory stays incomplete.
void finish_sharded_save(const ShardedSave& save, const std::array<std::string, 2>& reports,
                         const DistributedContext& context);

}  // namespace fsdp::detail
