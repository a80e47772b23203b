// Private: the SHARDED state dicts as views of the shards instead of copies, for save_checkpoint,
// which writes them at once while nothing changes the parameters or the optimizer state (the
// public sharded_model_state_dict and sharded_optimizer_state_dict return copies a caller may
// keep). At the size of a model that does not fit one process the copies cost a second copy of
// the rank's whole training state in memory and a pass over it (bench/README.md, large model).
// Implemented in state_dict.cpp.
#pragma once

#include <fsdp/state_dict.h>

namespace fsdp::detail {

ShardedTensorList sharded_model_state_dict_views(torch::nn::Module& model);
OptimizerStateDict sharded_optimizer_state_dict_views(torch::nn::Module& model, torch::optim::Optimizer& optimizer);

}  // namespace fsdp::detail
