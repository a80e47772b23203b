// Checkpoints of a sharded model, its optimizer and the training progress, in Accelerate's layout
// (accelerate/utils/constants.py's names, save_fsdp_model's directories), so that a resumed run
// continues exactly where the saved one stopped.
//
//   FULL     pytorch_model_fsdp.bin (or .safetensors) and optimizer.bin, written by rank 0
//   SHARDED  pytorch_model_fsdp_0/ and optimizer_0/: PyTorch distributed checkpoints (DCP), one
//            __<r>_0.distcp per rank and .metadata (docs/checkpoint-format.md); load on any number
//            of ranks, in fsdp.cpp or in PyTorch
//   LOCAL    pytorch_model_fsdp_rank<r>.bin per rank (same world size to load) and optimizer_0/
//   always   random_states_<r>.pkl per rank (step and CPU generator state), scheduler.bin,
//            dl_state_dict.bin (data position), and checkpoint_complete.json, written by rank 0 once
//            every rank has finished: a directory without it is an incomplete checkpoint.
//
// Every file is written to a temporary name, fsynced and renamed. Saving and loading are collective:
// every rank calls them with the same directory; a rank that calls something else, or nothing, is
// reported instead of leaving the others waiting forever.
#pragma once

#include <fsdp/process_group.h>
#include <fsdp/state_dict_options.h>
#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>

#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace fsdp {

/// What besides model and optimizer a resumed run needs.
struct TrainingProgress {
  /// Optimizer steps taken. Default: 0.
  int64_t step = 0;
  /// Where the data loader is (samples or batches consumed, as the training loop counts). Default: 0.
  int64_t data_position = 0;
  /// The learning-rate scheduler's state. Default: empty.
  std::map<std::string, double> scheduler;
  /// Set by load_checkpoint: what the checkpoint holds that could not be restored (in a checkpoint
  /// Accelerate wrote: NumPy's and Python's generators, a PyTorch scheduler, ...), also named in one
  /// warning. Default: empty.
  std::vector<std::string> not_restored;
};

struct CheckpointOptions {
  /// Layout of model and optimizer. Default: SHARDED_STATE_DICT.
  StateDictType state_dict_type = StateDictType::kShardedStateDict;
  /// FULL only: write the model as pytorch_model_fsdp.safetensors instead of the torch .bin.
  /// Default: false.
  bool full_model_safetensors = false;
  /// FULL only: how the model's and the optimizer's full state dicts are gathered. With rank0_only
  /// only rank 0 holds them while rank 0 writes the files; without it every rank does (more memory,
  /// the same files). Default: Accelerate's FULL configs, {offload_to_cpu true, rank0_only true}.
  StateDictConfig state_dict_config{true, true};
  StateDictConfig optim_state_dict_config{true, true};
};

/// Saves into `directory` (created if needed). Collective.
void save_checkpoint(const std::string& directory, torch::nn::Module& model, torch::optim::Optimizer& optimizer,
                     const DistributedContext& context, const TrainingProgress& progress,
                     const CheckpointOptions& options = {});

/// Loads a checkpoint written by save_checkpoint (its layout is recognized from the files), restores
/// this rank's generator state and returns the progress. SHARDED checkpoints load on any world size.
/// A directory Accelerate's save_state wrote under FSDP2 with SHARDED_STATE_DICT (DCP model and
/// optimizer, random_states_<r>.pkl, no marker) or FULL_STATE_DICT (rank 0's pytorch_model_fsdp.bin
/// and optimizer.bin, the same random states), or under FSDP1 with LOCAL_STATE_DICT (each rank's
/// pytorch_model_fsdp_rank<r>.bin of flat parameters and the DCP optimizer_0/; on any number of
/// ranks: Note [FSDP1 flat parameters]) loads too: step is the optimizer's step count, this
/// rank's CPU generator is restored, and the rest is listed in `not_restored` and one warning.
/// FULL: with `options.state_dict_config.rank0_only` (and `optim_state_dict_config.rank0_only` for
/// optimizer.bin) only rank 0 reads the file and every other rank receives its rows, one tensor at a
/// time; without it every rank reads the file and keeps its rows. Collective.
TrainingProgress load_checkpoint(const std::string& directory, torch::nn::Module& model,
                                 torch::optim::Optimizer& optimizer, const DistributedContext& context,
                                 const CheckpointOptions& options = {});

/// Whether `directory` holds a finished checkpoint: its completion marker exists, or Accelerate wrote it
/// and rank 0's random states (written last) are there beside both DCP directories (SHARDED),
/// pytorch_model_fsdp.bin and optimizer.bin (FULL), or rank 0's pytorch_model_fsdp_rank0.bin and
/// the DCP optimizer_0/ (LOCAL).
bool is_complete_checkpoint(const std::string& directory);

}  // namespace fsdp
