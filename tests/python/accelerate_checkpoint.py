"""A checkpoint the way Accelerate's save_state writes it under FSDP2 with SHARDED_STATE_DICT (or
FULL_STATE_DICT), and the losses PyTorch gets continuing from it, for
tests/checkpoint/accelerate_states_test.cpp's resume test. Run on N processes with torchrun's
variables.

    accelerate_checkpoint.py DIR [SHARDED_STATE_DICT | FULL_STATE_DICT | LOCAL_STATE_DICT]

Every rank builds dcp_fixture.py's MODEL (seed 0, four Linears) with fully_shard, AdamW(lr 0.01,
betas (0.8, 0.9), weight decay 0.1) and a constant LambdaLR, and takes STEPS_BEFORE steps: step s
draws torch.manual_seed(100 + s); randn(6, 3), each rank takes its rows, the loss is the mean of
the output squared. Then Accelerate's own functions save what Accelerator.save_state saves, into
DIR/checkpoints/checkpoint_0 (its automatic naming): save_fsdp_model and save_fsdp_optimizer (DCP
pytorch_model_fsdp_0/ and optimizer_0/), then save_accelerator_state (scheduler.bin and
random_states_<rank>.pkl with Python's, NumPy's and torch's generators); under FULL_STATE_DICT the
model and optimizer are rank 0's pytorch_model_fsdp.bin (an OrderedDict) and optimizer.bin instead;
under LOCAL_STATE_DICT (FSDP1 only: the model is wrapped with FSDP1, build_fsdp1) every rank writes
pytorch_model_fsdp_rank<r>.bin (its flat parameters as ShardedTensor objects) and the optimizer is
DCP optimizer_0/.
Training continues for
STEPS_AFTER steps; rank 0 writes DIR/losses.json: {"resumed": [the mean loss over ranks of each]},
under LOCAL_STATE_DICT also "accelerate_load": what Accelerate's own load_fsdp_model made of the
checkpoint ("loaded", or the error it raised).
Accelerate's Accelerator itself does not run FSDP on CPU, so its functions are called directly with
the plugin it would hold.
"""
import json
import os
import sys
import types

import torch
import torch.distributed as dist
from accelerate import PartialState
from accelerate.checkpointing import save_accelerator_state
from accelerate.utils import FullyShardedDataParallelPlugin, save_fsdp_model, save_fsdp_optimizer

from dcp_fixture import build  # the same model, seeded 0, each Linear and the root sharded

STEPS_BEFORE = 2
STEPS_AFTER = 3


def step(model, optimizer, scheduler, index):
    torch.manual_seed(100 + index)
    batch = torch.randn(6, 3)
    local = 6 // dist.get_world_size()
    loss = model(batch[dist.get_rank() * local:(dist.get_rank() + 1) * local]).pow(2).mean()
    loss.backward()
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad()
    total = loss.detach().clone()
    dist.all_reduce(total)
    return total.item() / dist.get_world_size()


def build_fsdp1():
    """dcp_fixture.py's model (the same weights) under FSDP1 as Accelerate wraps it: each Linear a unit
    (ModuleWrapPolicy, Accelerate's transformer-layer policy for a model whose layers are Linears),
    use_orig_params=True (the plugin's default), so the flat parameters carry alignment padding."""
    from torch.distributed.fsdp import FullyShardedDataParallel
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 5), torch.nn.Linear(5, 7), torch.nn.Linear(7, 3),
                                torch.nn.Linear(3, 2, bias=False))
    return FullyShardedDataParallel(model, auto_wrap_policy=ModuleWrapPolicy({torch.nn.Linear}),
                                    device_id=torch.device("cpu"), use_orig_params=True)


def main(directory, state_dict_type):
    torch.set_num_threads(1)
    PartialState(cpu=True)  # Accelerate's process group (gloo) and the state its logging needs
    fsdp_version = 1 if state_dict_type == "LOCAL_STATE_DICT" else 2  # FSDP2 has no LOCAL_STATE_DICT
    model = build_fsdp1() if fsdp_version == 1 else build()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01, betas=(0.8, 0.9), weight_decay=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
    for index in range(STEPS_BEFORE):
        step(model, optimizer, scheduler, index)
    plugin = FullyShardedDataParallelPlugin(fsdp_version=fsdp_version, state_dict_type=state_dict_type)
    accelerator = types.SimpleNamespace(process_index=dist.get_rank(), num_processes=dist.get_world_size(),
                                        is_main_process=dist.get_rank() == 0, wait_for_everyone=dist.barrier)
    output = f"{directory}/checkpoints/checkpoint_0"
    save_fsdp_model(plugin, accelerator, model, output)
    save_fsdp_optimizer(plugin, accelerator, optimizer, model, output)
    dist.barrier()
    save_accelerator_state(output, [], [], [scheduler] if dist.get_rank() == 0 else [], [], dist.get_rank(),
                           step=STEPS_BEFORE)
    dist.barrier()
    result = {}
    if state_dict_type == "LOCAL_STATE_DICT":
        # Whether Accelerate's own load_fsdp_model reads back what it wrote (its torch.load with
        # weights_only=True meets the ShardedTensor class); the weights are the same either way.
        from accelerate.utils import load_fsdp_model
        try:
            load_fsdp_model(plugin, accelerator, model, output)
            result["accelerate_load"] = "loaded"
        except Exception as error:  # recorded, not raised: the test prints what Accelerate did
            result["accelerate_load"] = f"{type(error).__name__}: {str(error).splitlines()[0]}"
    result["resumed"] = [step(model, optimizer, scheduler, STEPS_BEFORE + index) for index in range(STEPS_AFTER)]
    if dist.get_rank() == 0:
        json.dump(result, open(f"{directory}/losses.json", "w"))
    dist.barrier()
    # PyTorch's Gloo sometimes aborts in its own teardown (tests/python/fsdp2_parity.py): every rank
    # is done and the result is written, so leave without tearing down.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    if len(sys.argv) not in (2, 3) or sys.argv[2:] not in ([], ["SHARDED_STATE_DICT"], ["FULL_STATE_DICT"],
                                                          ["LOCAL_STATE_DICT"]):
        raise SystemExit(__doc__)
    main(sys.argv[1], sys.argv[2] if len(sys.argv) == 3 else "SHARDED_STATE_DICT")
