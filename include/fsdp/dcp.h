// PyTorch distributed checkpoints (DCP), the format of SHARDED checkpoints (docs/checkpoint-format.md):
// what save_checkpoint writes as pytorch_model_fsdp_0/, for state dicts a program builds itself.
#pragma once

#include <fsdp/process_group.h>
#include <fsdp/state_dict.h>

#include <string>

namespace fsdp {

/// Writes `tensors` (this rank's rows) as the DCP directory of {"model": tensors}, as
/// torch.distributed.checkpoint.save with FileSystemWriter does: `__<rank>_0.distcp` on every rank,
/// then `.metadata` from rank 0 once every rank has finished. PyTorch's dcp.load and fsdp.cpp's
/// loaders and merge-weights read it on any number of ranks. Collective over `context.world()`.
void write_dcp_model_directory(const std::string& directory, const ShardedTensorList& tensors,
                               const DistributedContext& context);

}  // namespace fsdp
