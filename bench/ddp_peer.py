"""The peer of step_bench: the same MLP-block model and batch under PyTorch's DistributedDataParallel
(Gloo, CPU), with Debian's python3-torch. Run it under `fsdp launch` (torchrun's variables)."""
import argparse
import json
import resource
import time

import torch
import torch.distributed as dist


class Block(torch.nn.Module):
    def __init__(self, width, hidden):
        super().__init__()
        self.up = torch.nn.Linear(width, hidden)
        self.down = torch.nn.Linear(hidden, width)

    def forward(self, x):
        return x + self.down(torch.nn.functional.gelu(self.up(x)))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--blocks", type=int, default=8)
    parser.add_argument("--batch", type=int, default=64)
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    world, rank = dist.get_world_size(), dist.get_rank()
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[Block(args.width, args.hidden) for _ in range(args.blocks)])
    parameters = sum(p.numel() for p in model.parameters())
    model = torch.nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randn(args.batch // world, args.width)
    times = []
    for step in range(args.steps + 2):
        dist.barrier()
        start = time.perf_counter()
        model(x).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        dist.barrier()
        if step >= 2:
            times.append(time.perf_counter() - start)
    times.sort()
    state = sum(p.numel() * 4 * 4 for p in model.parameters())  # parameter, gradient, two moments
    if rank == 0:
        print(json.dumps({"benchmark": "step", "peer": "pytorch-ddp", "strategy": "DDP", "world_size": world,
                          "parameters": parameters, "median_step_s": round(times[len(times) // 2], 4),
                          "model_state_bytes_per_rank": state,
                          "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0, 1)}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
