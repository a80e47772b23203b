"""PyTorch's ShardedGradScaler (CPU, gloo) on the gradients that
tests/engine/sharded_grad_scaler_test.cpp feeds fsdp.cpp's. Run on N processes with torchrun's
variables.

    sharded_grad_scaler_peer.py DIR

DIR/inputs.safetensors: "<rank>.<parameter>.initial" (this rank's shard of each parameter) and
"<rank>.<parameter>.<step>" (the unscaled gradient of that step, absent on a step without one; inf
and NaN planted on some steps); DIR/case.json: init_scale, growth_interval, steps, lr, and
"explicit_unscale" (the steps that call unscale_ before step). Every step: scale(loss), gradients =
raw * scale, optional unscale_, step (SGD), update. Rank 0 writes DIR/theirs.safetensors:
"scaled_loss", "scale", "tracker" per step, and every rank's "<rank>.<parameter>.<step>" value after
the step and "<rank>.<parameter>.grad.<step>" gradient after unscaling (finite steps).
"""
import json
import os
import sys

import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler


def main(directory):
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    case = json.load(open(f"{directory}/case.json"))
    inputs = load_file(f"{directory}/inputs.safetensors")
    names = sorted({key.split(".")[1] for key in inputs if key.startswith(f"{rank}.") and key.endswith(".initial")})
    parameters = {name: inputs[f"{rank}.{name}.initial"].clone().requires_grad_(True) for name in names}
    optimizer = torch.optim.SGD(list(parameters.values()), lr=case["lr"])
    scaler = ShardedGradScaler(device="cpu", init_scale=case["init_scale"], growth_interval=case["growth_interval"],
                               process_group=dist.group.WORLD)
    record = {}
    scaled, scales, trackers = [], [], []
    for step in range(case["steps"]):
        loss = torch.tensor(1.5)
        scaled.append(scaler.scale(loss).item())
        scale = scaler._scale
        for name, parameter in parameters.items():
            raw = inputs.get(f"{rank}.{name}.{step}")
            parameter.grad = None if raw is None else (raw * scale).to(parameter.dtype)
        if step in case["explicit_unscale"]:
            scaler.unscale_(optimizer)
        scaler.step(optimizer)
        for name, parameter in parameters.items():
            record[f"{rank}.{name}.{step}"] = parameter.detach().clone()
            if parameter.grad is not None and torch.isfinite(parameter.grad).all():
                record[f"{rank}.{name}.grad.{step}"] = parameter.grad.detach().clone()
        scaler.update()
        optimizer.zero_grad()
        scales.append(scaler._scale.item())
        trackers.append(float(scaler._growth_tracker.item()))
    gathered = [None] * world
    dist.all_gather_object(gathered, record)
    if rank == 0:
        out = {}
        for part in gathered:
            out.update(part)
        out["scaled_loss"] = torch.tensor(scaled, dtype=torch.float64)
        out["scale"] = torch.tensor(scales, dtype=torch.float64)
        out["tracker"] = torch.tensor(trackers, dtype=torch.float64)
        save_file({key: value.contiguous() for key, value in out.items()}, f"{directory}/theirs.safetensors")
        print(f"ShardedGradScaler on {world} ranks: scales {scales}")
    dist.barrier()
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit(__doc__)
    main(sys.argv[1])
