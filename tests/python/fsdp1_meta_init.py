"""PyTorch FSDP1 (torch.distributed.fsdp.FullyShardedDataParallel, CPU, gloo) initializing a model
built on the meta device, for tests/engine/fully_shard_test.cpp's MetaModel tests. Run on N processes
with torchrun's variables.

    fsdp1_meta_init.py OUTPUT SEED [param_init_fn]

The model mirrors MetaInitModel in the test: Sequential(Embedding(10, 8), Block, Block, Linear(8, 10))
with Block = fc1 Linear(8, 16), norm LayerNorm(16), fc2 Linear(16, 8). Every rank seeds SEED, builds it
under torch.device("meta") and wraps it with ModuleWrapPolicy({Block}), so FSDP1 materializes each
Block, then the root, with reset_parameters() (or, with "param_init_fn", a function that gives every
module's own tensors memory and fills each with 0.5 * (its position in the call order + 1)). Rank 0
writes the full state dict to OUTPUT (safetensors).
"""
import os
import sys

import torch
import torch.distributed as dist
from safetensors.torch import save_file
from torch.distributed.fsdp import FullStateDictConfig, StateDictType
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp.wrap import ModuleWrapPolicy


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(8, 16)
        self.norm = torch.nn.LayerNorm(16)
        self.fc2 = torch.nn.Linear(16, 8)


def main():
    output, seed = sys.argv[1], int(sys.argv[2])
    use_init_fn = len(sys.argv) > 3 and sys.argv[3] == "param_init_fn"
    dist.init_process_group("gloo")
    torch.manual_seed(seed)
    with torch.device("meta"):
        model = torch.nn.Sequential(torch.nn.Embedding(10, 8), Block(), Block(), torch.nn.Linear(8, 10))
    calls = []

    def init_fn(module):
        # FSDP1 passes every module it materializes; only those with tensors of their own get values.
        own = list(module.parameters(recurse=False)) + list(module.buffers(recurse=False))
        if not own:
            return
        module.to_empty(device=torch.device("cpu"), recurse=False)
        calls.append(module)
        with torch.no_grad():
            for tensor in list(module.parameters(recurse=False)) + list(module.buffers(recurse=False)):
                tensor.fill_(0.5 * len(calls))

    model = FSDP(model, auto_wrap_policy=ModuleWrapPolicy({Block}), device_id=torch.device("cpu"),
                 use_orig_params=True, param_init_fn=init_fn if use_init_fn else None)
    # offload_to_cpu=True crashes FSDP1 on CPU (a segmentation fault in torch 2.13); the tensors are
    # on CPU anyway.
    config = FullStateDictConfig(offload_to_cpu=False, rank0_only=False)
    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, config):
        state = model.state_dict()
    if dist.get_rank() == 0:
        save_file({name: tensor.contiguous() for name, tensor in state.items()}, output)
    dist.barrier()
    # FSDP1 on gloo sometimes aborts in its own teardown ("terminate called without an active
    # exception", exit 134, seen once in a full ctest run here) after everything above is done; the result is
    # written and every rank has finished, so leave without tearing down.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
