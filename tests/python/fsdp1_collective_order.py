"""The order of PyTorch FSDP1's collectives in a training step, for tests/engine/prefetch_test.cpp's
FSDP1 comparison. Run on N processes with torchrun's variables.

    fsdp1_collective_order.py OUTPUT

The model mirrors OrderModel in the test: input Linear(3, 8), four blocks (Linear(8, 8k), Linear(8k, 8)
for k = 1..4, so every unit has a different size), head Linear(8, 2). For each case (backward_prefetch
None / BACKWARD_PRE / BACKWARD_POST, forward_prefetch off or on) it is wrapped as Accelerate's
version 1 wraps it (ModuleWrapPolicy({Block}), FULL_SHARD, use_orig_params, limit_all_gathers), runs
two steps, and records on rank 0 every all-gather and reduce-scatter FSDP1 issues in the second step
as [kind, elements of this rank's shard]. Rank 0 writes {case: [[kind, elements], ...]} to OUTPUT.
"""
import json
import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.fsdp import BackwardPrefetch
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp.wrap import ModuleWrapPolicy


class Block(torch.nn.Module):
    def __init__(self, k):
        super().__init__()
        self.up = torch.nn.Linear(8, 8 * k)
        self.down = torch.nn.Linear(8 * k, 8)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(x)))


class OrderModel(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.input = torch.nn.Linear(3, 8)
        self.blocks = torch.nn.ModuleList(Block(k) for k in range(1, 5))
        self.head = torch.nn.Linear(8, 2)

    def forward(self, x):
        x = self.input(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


CASES = {"NO_PREFETCH": (None, False), "BACKWARD_PRE": (BackwardPrefetch.BACKWARD_PRE, False),
         "BACKWARD_POST_FORWARD_PREFETCH": (BackwardPrefetch.BACKWARD_POST, True)}

events = []
recording = [False]
all_gather, all_gather_single, reduce_scatter_single = dist.all_gather, dist.all_gather_single, dist.reduce_scatter_single


def traced_all_gather_list(tensor_list, input, *args, **kwargs):
    # FSDP1 all-gathers into a list of shards when the shard is on CPU.
    if recording[0]:
        events.append(["all_gather", input.numel()])
    return all_gather(tensor_list, input, *args, **kwargs)


def traced_all_gather(output, input, *args, **kwargs):
    if recording[0]:
        events.append(["all_gather", input.numel()])
    return all_gather_single(output, input, *args, **kwargs)


def traced_reduce_scatter(output, input, *args, **kwargs):
    if recording[0]:
        events.append(["reduce_scatter", output.numel()])
    return reduce_scatter_single(output, input, *args, **kwargs)


def main(output):
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    dist.all_gather, dist.all_gather_single = traced_all_gather_list, traced_all_gather
    dist.reduce_scatter_single = traced_reduce_scatter
    results = {}
    for name, (backward_prefetch, forward_prefetch) in CASES.items():
        torch.manual_seed(0)
        model = FSDP(OrderModel(), auto_wrap_policy=ModuleWrapPolicy({Block}), device_id=torch.device("cpu"),
                     use_orig_params=True, backward_prefetch=backward_prefetch, forward_prefetch=forward_prefetch,
                     limit_all_gathers=True)
        for step in range(2):
            recording[0] = step == 1 and dist.get_rank() == 0
            model(torch.randn(4, 3)).sum().backward()
            model.zero_grad()
        recording[0] = False
        results[name] = list(events)
        events.clear()
    if dist.get_rank() == 0:
        json.dump(results, open(output, "w"))
    dist.barrier()
    # FSDP1 on gloo sometimes aborts in its own teardown (fsdp1_meta_init.py): leave without it.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit(__doc__)
    main(sys.argv[1])
