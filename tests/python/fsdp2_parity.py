"""PyTorch FSDP2 (torch.distributed.fsdp.fully_shard, CPU, gloo) on the model and batches that
tests/engine/fsdp2_parity_test.cpp trains with fsdp.cpp. Run on N processes with torchrun's variables.

    fsdp2_parity.py DIR RESHARD_AFTER_FORWARD

DIR/initial.safetensors: the initial weights; DIR/batches.safetensors: "x.<step>" and "y.<step>" global
batches. Rank 0 writes DIR/fsdp2_result.safetensors: "loss" (the global mean loss of every step, before
the update) and the final full weights under their names.
"""
import os
import sys

import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file
from torch.distributed.fsdp import fully_shard

# Mirrors ParityMlp in fsdp2_parity_test.cpp: uneven first dimensions (5, 7, 2 rows) on 2-4 ranks.
class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(5, 7)
        self.fc2 = torch.nn.Linear(7, 5)

    def forward(self, x):
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(x)))


class ParityMlp(torch.nn.Module):
    def __init__(self, depth=3):
        super().__init__()
        self.input = torch.nn.Linear(3, 5)
        self.blocks = torch.nn.ModuleList(Block() for _ in range(depth))
        self.head = torch.nn.Linear(5, 2)

    def forward(self, x):
        x = self.input(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def main(directory, reshard_after_forward):
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    model = ParityMlp()
    missing, unexpected = model.load_state_dict(load_file(f"{directory}/initial.safetensors"), strict=True)
    fully_shard(model.input, reshard_after_forward=reshard_after_forward)
    for block in model.blocks:
        fully_shard(block, reshard_after_forward=reshard_after_forward)
    fully_shard(model, reshard_after_forward=reshard_after_forward)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    batches = load_file(f"{directory}/batches.safetensors")
    steps = len([name for name in batches if name.startswith("x.")])
    losses = []
    for step in range(steps):
        x, y = batches[f"x.{step}"], batches[f"y.{step}"]
        rows = x.shape[0] // world
        local_x, local_y = x[rank * rows:(rank + 1) * rows], y[rank * rows:(rank + 1) * rows]
        loss = torch.nn.functional.mse_loss(model(local_x), local_y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)  # below every step's norm: clipping acts (the C++ side checks)
        optimizer.step()
        optimizer.zero_grad()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(total.item() / world)
    full = {name: tensor.full_tensor().contiguous() for name, tensor in model.state_dict().items()}
    if rank == 0:
        full["loss"] = torch.tensor(losses, dtype=torch.float64)
        save_file(full, f"{directory}/fsdp2_result.safetensors")
        print(f"fsdp2: {steps} steps on {world} ranks, reshard_after_forward={reshard_after_forward}, "
              f"loss {losses[0]:.6f} -> {losses[-1]:.6f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    if len(sys.argv) != 3:
        raise SystemExit(__doc__)
    main(sys.argv[1], sys.argv[2] == "1")
