"""PyTorch reads the SHARDED checkpoint fsdp.cpp saved, for tests/checkpoint/dcp_writer_test.cpp.
Run on M processes with torchrun's variables (M need not be the number of ranks that saved).

    dcp_load_ours.py DIR

DIR/checkpoint holds fsdp.cpp's save_checkpoint output (pytorch_model_fsdp_0/ and optimizer_0/ in
DCP) of dcp_fixture.py's MODEL trained with AdamW; DIR/expected_model.safetensors and
DIR/expected_optimizer.safetensors hold fsdp.cpp's full state dicts of the same moment (optimizer
keys "state.<parameter>.<field>"). Every rank builds MODEL with fully_shard, loads both directories
the way Accelerate's load_fsdp_model / load_fsdp_optimizer do (dcp.load into the state dicts of
get_model_state_dict / get_optimizer_state_dict, then set_*_state_dict), gathers the full state
dicts and rank 0 compares them with the expected files bitwise. Rank 0 then converts both
directories with dcp_to_torch_save and compares those too. Exits non-zero naming the first
difference; prints "loaded N model and K optimizer tensors bitwise on M ranks".
"""
import os
import sys

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     get_optimizer_state_dict, set_model_state_dict,
                                                     set_optimizer_state_dict)

from dcp_fixture import build  # the same model, each Linear and the root sharded


def same(name, ours, theirs):
    if ours.dtype != theirs.dtype or ours.shape != theirs.shape:
        raise SystemExit(f"{name}: PyTorch loaded {theirs.dtype} {tuple(theirs.shape)}, fsdp.cpp saved "
                         f"{ours.dtype} {tuple(ours.shape)}")
    if not torch.equal(ours, theirs):
        raise SystemExit(f"{name}: PyTorch loaded different values than fsdp.cpp saved "
                         f"(largest difference {(ours.double() - theirs.double()).abs().max().item()})")


def main(directory):
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    model = build()  # seed 0: other weights than the saved ones, so the load must replace every one
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.5)
    model_state = {"model": get_model_state_dict(model)}
    dcp.load(model_state, checkpoint_id=f"{directory}/checkpoint/pytorch_model_fsdp_0")
    set_model_state_dict(model, model_state["model"])
    optimizer_state = {"optimizer": get_optimizer_state_dict(model, optimizer)}
    dcp.load(optimizer_state, checkpoint_id=f"{directory}/checkpoint/optimizer_0")
    set_optimizer_state_dict(model, optimizer, optimizer_state["optimizer"])
    full = StateDictOptions(full_state_dict=True, cpu_offload=True)
    model_full = get_model_state_dict(model, options=full)
    optimizer_full = get_optimizer_state_dict(model, optimizer, options=full)
    if dist.get_rank() == 0:
        expected_model = load_file(f"{directory}/expected_model.safetensors")
        expected_optimizer = load_file(f"{directory}/expected_optimizer.safetensors")
        if sorted(model_full) != sorted(expected_model):
            raise SystemExit(f"model keys: PyTorch {sorted(model_full)}, fsdp.cpp {sorted(expected_model)}")
        for name, tensor in expected_model.items():
            same(name, tensor, model_full[name])
        loaded = {f"state.{parameter}.{field}": value for parameter, fields in optimizer_full["state"].items()
                  for field, value in fields.items()}
        if sorted(loaded) != sorted(expected_optimizer):
            raise SystemExit(f"optimizer keys: PyTorch {sorted(loaded)}, fsdp.cpp {sorted(expected_optimizer)}")
        for name, tensor in expected_optimizer.items():
            same(name, tensor, loaded[name])
        group = optimizer.param_groups[0]
        if group["lr"] != 0.01 or tuple(group["betas"]) != (0.8, 0.9) or group["weight_decay"] != 0.1:
            raise SystemExit(f"parameter group: PyTorch loaded {group}")
        # dcp_to_torch_save, the conversion PyTorch documents, on both directories.
        dcp_to_torch_save(f"{directory}/checkpoint/pytorch_model_fsdp_0", f"{directory}/model.pt")
        converted = torch.load(f"{directory}/model.pt", weights_only=True)["model"]
        for name, tensor in expected_model.items():
            same("dcp_to_torch_save " + name, tensor, converted[name])
        dcp_to_torch_save(f"{directory}/checkpoint/optimizer_0", f"{directory}/optimizer.pt")
        converted = torch.load(f"{directory}/optimizer.pt", weights_only=True)["optimizer"]
        for name, tensor in expected_optimizer.items():
            _, rest = name.split(".", 1)
            parameter, field = rest.rsplit(".", 1)
            same("dcp_to_torch_save " + name, tensor, converted["state"][parameter][field])
        print(f"loaded {len(expected_model)} model and {len(expected_optimizer)} optimizer tensors bitwise on "
              f"{dist.get_world_size()} ranks")
    dist.barrier()
    # PyTorch's Gloo sometimes aborts in its own teardown (tests/python/fsdp2_parity.py): every rank
    # is done and the result is written, so leave without tearing down.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit(__doc__)
    main(sys.argv[1])
