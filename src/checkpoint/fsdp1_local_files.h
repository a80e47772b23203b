// Accelerate's LOCAL_STATE_DICT model files (FSDP1 only): pytorch_model_fsdp_rank<r>.bin, one per
// rank, each the torch.save of model.state_dict() under FSDP1's LOCAL_STATE_DICT, whose values are
// one 1-D ShardedTensor per FSDP1 unit (`<unit path>._flat_param`, this rank's chunk of the unit's
// flat parameter) and the buffers (and, with use_orig_params, each parameter's local piece, which
// the flat parameters make redundant).
//
// Note [FSDP1 flat parameters]
// FSDP1 (torch/distributed/fsdp/_flat_param.py, FlatParamHandle._init_flat_param_and_metadata)
// concatenates a unit's parameters, flattened, in the order of module.named_modules() and each
// module's own parameters (a shared parameter once, at its first place), excluding the parameters of
// nested units. With use_orig_params=True it aligns each parameter's start to 16 bytes of the
// forward dtype (aligned_numel = 16 / element size: 4 elements for fp32, 8 for bf16/fp16 mixed
// precision) with padding, and pads the end to a multiple of the world size; without, there is no
// padding inside. The files do not say which: the layout is the one whose total equals the
// ShardedTensor's size, tried for no alignment and for alignments of 2, 4, 8 and 16 elements; two
// different layouts with that total are an error. Under use_orig_params each rank's file also holds
// every parameter's piece of its chunk under the parameter's name, and the cut must agree with each:
// a model that registers its parameters in another order than the saved one is an error, not wrong
// weights. A flat parameter larger than its unit's parameters can make with any padding is refused
// before it is allocated. Not read: FSDP1's ignored modules and a parameter tied across two units
// (their sizes disagree with the flat parameter's: a named error). PyTorch loads these files only into the same
// wrapping on the same number of ranks; here every rank reads every rank's file and rebuilds the
// whole parameters, so they load into any sharding and any number of ranks (at the memory of one
// full copy of the model per rank while loading).
#pragma once

#include <fsdp/state_dict.h>

#include <cstdint>
#include <string>
#include <vector>

namespace fsdp::detail {

struct ParameterShape {
  std::string name;  ///< the parameter's path in the model, e.g. "layers.0.mlp.up_proj.weight"
  std::vector<int64_t> shape;
};

/// The whole state dict in `files` (rank 0's first, one per rank that saved): every parameter of
/// `parameters` (in the model's registration order) cut out of its unit's flat parameter, then the
/// other plain tensors of rank 0's file (the buffers). Errors name the file, the unit and what
/// does not fit.
TensorList full_state_dict_from_fsdp1_local_files(const std::vector<std::string>& files,
                                                  const std::vector<ParameterShape>& parameters);

}  // namespace fsdp::detail
