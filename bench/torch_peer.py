"""The peers of step_bench: the same model (MLP blocks, or the Llama of src/models/llama.cpp written
out in PyTorch) and batch under PyTorch's DistributedDataParallel (`--peer ddp`) or FSDP2
(`--peer fsdp2`: torch.distributed.fsdp.fully_shard on every block, then the root, as step_bench
does with ours), Gloo, CPU, the project venv's torch. Run it under `fsdp launch` (torchrun's
variables). Prints one JSON line: the median step, the bytes the loopback interface carried per step
(the kernel's counter, read by rank 0 around the timed steps, the same way step_bench reads it) and
rank 0's peak RSS."""
import argparse
import json
import sys
import os
import math
import resource
import time

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard

def interface_bytes(name="lo"):
    """Bytes the interface has sent since it came up, or -1 where the counter is not readable."""
    try:
        with open(f"/sys/class/net/{name}/statistics/tx_bytes") as handle:
            return int(handle.read())
    except (OSError, ValueError):
        return -1


class Block(torch.nn.Module):
    def __init__(self, width, hidden):
        super().__init__()
        self.up = torch.nn.Linear(width, hidden)
        self.down = torch.nn.Linear(hidden, width)

    def forward(self, x):
        return x + self.down(torch.nn.functional.gelu(self.up(x)))


class RMSNorm(torch.nn.Module):
    def __init__(self, width, eps=1e-5):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(width))
        self.eps = eps

    def forward(self, x):
        as_float = x.float()
        return self.weight * (as_float * torch.rsqrt(as_float.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)


def rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class LlamaLayer(torch.nn.Module):
    """LlamaDecoderLayer as in src/models/llama.cpp: pre-norm GQA attention with RoPE, then SwiGLU."""

    def __init__(self, width, hidden, heads, kv_heads):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, width // heads
        self.q_proj = torch.nn.Linear(width, heads * self.head_dim, bias=False)
        self.k_proj = torch.nn.Linear(width, kv_heads * self.head_dim, bias=False)
        self.v_proj = torch.nn.Linear(width, kv_heads * self.head_dim, bias=False)
        self.o_proj = torch.nn.Linear(heads * self.head_dim, width, bias=False)
        self.gate_proj = torch.nn.Linear(width, hidden, bias=False)
        self.up_proj = torch.nn.Linear(width, hidden, bias=False)
        self.down_proj = torch.nn.Linear(hidden, width, bias=False)
        self.input_layernorm = RMSNorm(width)
        self.post_attention_layernorm = RMSNorm(width)

    def attention(self, x):
        batch, length, _ = x.shape
        query = self.q_proj(x).view(batch, length, self.heads, self.head_dim).transpose(1, 2)
        key = self.k_proj(x).view(batch, length, self.kv_heads, self.head_dim).transpose(1, 2)
        value = self.v_proj(x).view(batch, length, self.kv_heads, self.head_dim).transpose(1, 2)
        inverse = 1.0 / torch.pow(10000.0, torch.arange(0, self.head_dim, 2).float() / self.head_dim)
        frequencies = torch.outer(torch.arange(length).float(), inverse)
        embedding = torch.cat((frequencies, frequencies), dim=-1)
        cos, sin = embedding.cos(), embedding.sin()
        query = query * cos + rotate_half(query) * sin
        key = key * cos + rotate_half(key) * sin
        key = key.repeat_interleave(self.heads // self.kv_heads, 1)
        value = value.repeat_interleave(self.heads // self.kv_heads, 1)
        scores = torch.matmul(query, key.transpose(2, 3)) / math.sqrt(self.head_dim)
        mask = torch.ones(length, length, dtype=torch.bool).triu(1)
        weights = torch.softmax(scores.masked_fill(mask, float("-inf")).float(), -1)
        output = torch.matmul(weights, value).transpose(1, 2).reshape(batch, length, -1)
        return self.o_proj(output)

    def forward(self, x):
        x = x + self.attention(self.input_layernorm(x))
        h = self.post_attention_layernorm(x)
        return x + self.down_proj(torch.nn.functional.silu(self.gate_proj(h)) * self.up_proj(h))


class Llama(torch.nn.Module):
    def __init__(self, vocab, width, hidden, layers, heads=8, kv_heads=4, tied=True):
        super().__init__()
        self.embed_tokens = torch.nn.Embedding(vocab, width)
        self.layers = torch.nn.ModuleList([LlamaLayer(width, hidden, heads, kv_heads) for _ in range(layers)])
        self.norm = RMSNorm(width)
        self.lm_head = None if tied else torch.nn.Linear(width, vocab, bias=False)

    def forward(self, tokens):
        x = self.embed_tokens(tokens)
        for layer in self.layers:
            x = layer(x)
        if self.lm_head is None:
            return torch.nn.functional.linear(self.norm(x), self.embed_tokens.weight)  # tied head
        return self.lm_head(self.norm(x))


class Coordination:
    """What one rank's part of a dcp.save or dcp.load costs in coordination, as step_bench counts its
    own: the collectives it calls (torch.distributed's functions, each counted once where one calls
    another: gather_object's own all_gather of sizes is part of it), the CPU seconds of the process
    (every thread), and on rank 0 what the loopback carried for every rank (read after a barrier)."""

    NAMES = ("all_gather_object", "gather_object", "scatter_object_list", "broadcast_object_list", "barrier",
             "all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter", "reduce_scatter_tensor",
             "broadcast", "gather", "scatter", "all_to_all", "all_to_all_single", "send", "recv")

    def __init__(self, rank):
        self.rank, self.collectives, self.depth, self.saved = rank, 0, 0, []

    def _counting(self, function):
        def counted(*args, **kwargs):
            self.collectives += self.depth == 0
            self.depth += 1
            try:
                return function(*args, **kwargs)
            finally:
                self.depth -= 1
        return counted

    def __enter__(self):
        import torch.distributed.distributed_c10d as c10d
        for module in (dist, c10d):
            for name in self.NAMES:
                if hasattr(module, name):
                    self.saved.append((module, name, getattr(module, name)))
                    setattr(module, name, self._counting(getattr(module, name)))
        self.loopback = interface_bytes() if self.rank == 0 else -1
        self.cpu = time.process_time()
        return self

    def __exit__(self, *error):
        self.cpu = time.process_time() - self.cpu
        for module, name, function in reversed(self.saved):
            setattr(module, name, function)
        dist.barrier()  # every rank's part on the loopback
        if self.loopback >= 0:
            self.loopback = interface_bytes() - self.loopback
        return False

    def gathered(self, world):
        """Every rank's counts on every rank (after the counted part: these bytes are not in it)."""
        rows = torch.zeros(world, 2, dtype=torch.float64)
        rows[self.rank] = torch.tensor([self.collectives, self.cpu], dtype=torch.float64)
        dist.all_reduce(rows)
        return {"collectives": rows[:, 0].tolist(), "cpu_s": rows[:, 1].tolist(), "loopback_bytes": self.loopback}


def checkpoint(model, optimizer, directory, world, rank, parameters):
    """dcp.save of model and optimizer (FileSystemWriter fsyncs its files), then dcp.load of them
    into the same model and optimizer with the files evicted from the page cache."""
    import shutil
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    if rank == 0:
        shutil.rmtree(directory, ignore_errors=True)
    dist.barrier()
    start = time.perf_counter()
    with Coordination(rank) as save_counts:
        model_state, optimizer_state = get_state_dict(model, optimizer)
        dcp.save({"model": model_state, "optim": optimizer_state}, checkpoint_id=directory)
    dist.barrier()
    save = time.perf_counter() - start
    # The files out of the page cache, as step_bench evicts its own (posix_fadvise after fsync).
    cold = True
    if rank == 0:
        for root, _, names in os.walk(directory):
            for name in names:
                fd = os.open(os.path.join(root, name), os.O_RDONLY)
                try:
                    os.fsync(fd)
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                except OSError:
                    cold = False
                finally:
                    os.close(fd)
    dist.barrier()
    start = time.perf_counter()
    with Coordination(rank) as load_counts:
        model_state, optimizer_state = get_state_dict(model, optimizer)
        state = {"model": model_state, "optim": optimizer_state}
        dcp.load(state, checkpoint_id=directory)
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    dist.barrier()
    load = time.perf_counter() - start
    save_counts, load_counts = save_counts.gathered(world), load_counts.gathered(world)
    if rank == 0:
        size = sum(os.path.getsize(os.path.join(root, name)) for root, _, names in os.walk(directory) for name in names)
        print(json.dumps({"benchmark": "checkpoint", "peer": "pytorch-dcp", "world_size": world,
                          "parameters": parameters, "bytes": size, "save_s": round(save, 3),
                          "load_s": round(load, 3), "page_cache": "cold" if cold else "warm",
                          "save": save_counts, "load": load_counts}))
        shutil.rmtree(directory, ignore_errors=True)
    dist.barrier()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--blocks", type=int, default=8)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--model", choices=["mlp", "llama"], default="mlp")
    parser.add_argument("--length", type=int, default=16)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--peer", choices=["ddp", "fsdp2"], default="ddp")
    # FSDP2's int reshard_after_forward (hpZ) for the blocks; unset: True.
    parser.add_argument("--reshard-after-forward", type=int, default=None)
    # The large model (bench/large_model.sh): its shape, built on the meta device and given values
    # after fully_shard (PyTorch's recipe for a model that does not fit one process), and a timed
    # dcp.save / dcp.load of model and optimizer after the steps.
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--untied", type=int, default=0)
    parser.add_argument("--meta-init", type=int, default=0)
    parser.add_argument("--checkpoint", default="")
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    world, rank = dist.get_world_size(), dist.get_rank()
    torch.manual_seed(0)
    if args.model == "mlp":
        model = torch.nn.Sequential(*[Block(args.width, args.hidden) for _ in range(args.blocks)])
        x = torch.randn(args.batch // world, args.width)

        def loss_of(output):
            return output.pow(2).mean()
    else:
        with torch.device("meta" if args.meta_init else "cpu"):
            model = Llama(args.vocab, args.width, args.hidden, args.blocks, args.heads, args.kv_heads, not args.untied)
        tokens = torch.randint(0, args.vocab, (args.batch // world, args.length + 1))
        x, targets = tokens[:, :-1], tokens[:, 1:]

        def loss_of(logits):
            return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))
    parameters = sum(p.numel() for p in model.parameters())
    if args.peer == "ddp":
        assert not args.meta_init, "DDP holds the whole model on every rank: --meta-init is for fsdp2"
        model = torch.nn.parallel.DistributedDataParallel(model)
    else:
        for unit in (model if args.model == "mlp" else model.layers):
            fully_shard(unit, reshard_after_forward=args.reshard_after_forward or True)  # True: FULL_SHARD
        fully_shard(model)
        if args.meta_init:
            # Every rank allocates its shards only, then initializes them (transformers' normal(0,
            # 0.02) for the projections and embeddings, ones for the norms).
            model.to_empty(device="cpu")
            with torch.no_grad():
                for name, parameter in model.named_parameters():
                    local = parameter.to_local()
                    local.fill_(1.0) if "norm" in name else local.normal_(0.0, 0.02)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    times = []
    state = 0
    # The link between machines in bench/multi_hosts.sh (what left this machine), as step_bench reads it.
    link = os.environ.get("GLOO_SOCKET_IFNAME", "")
    for step in range(args.steps + 2):
        dist.barrier()
        if step == 2 and rank == 0:
            lo_before = interface_bytes()
            link_before = interface_bytes(link) if link else -1
        start = time.perf_counter()
        loss_of(model(x)).backward()
        optimizer.step()
        if step == args.steps + 1:
            # What this rank holds at the optimizer step: parameters (FSDP2: local shards), gradients
            # and AdamW's two moments, as step_bench measures it.
            def local(tensor):
                tensor = tensor.to_local() if hasattr(tensor, "to_local") else tensor
                return tensor.numel() * tensor.element_size()
            for p in model.parameters():
                state += local(p) + (local(p.grad) if p.grad is not None else 0)
                for moment in optimizer.state[p].values():
                    if torch.is_tensor(moment) and moment.dim() > 0:
                        state += local(moment)
        optimizer.zero_grad()
        dist.barrier()
        if step >= 2:
            times.append(time.perf_counter() - start)
    lo_after = interface_bytes() if rank == 0 else -1
    link_after = interface_bytes(link) if rank == 0 and link else -1
    times.sort()
    if rank == 0:
        lo_per_step = (lo_after - lo_before) // args.steps if lo_before >= 0 and lo_after >= 0 else -1
        print(json.dumps({"benchmark": "step", "peer": f"pytorch-{args.peer}", "model": args.model,
                          "strategy": "DDP" if args.peer == "ddp" else "FSDP2",
                          "prefetch": "-", "world_size": world,
                          "parameters": parameters, "median_step_s": round(times[len(times) // 2], 4),
                          "loopback_bytes_per_step": lo_per_step,
                          "reshard_after_forward": args.reshard_after_forward or 0, "link": link,
                          "link_tx_bytes_per_step": (link_after - link_before) // args.steps
                          if link and link_before >= 0 and link_after >= 0 else -1,
                          "model_state_bytes_per_rank": state,
                          "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0, 1)}))
    if args.checkpoint:
        checkpoint(model, optimizer, args.checkpoint, world, rank, parameters)
    # PyTorch's Gloo sometimes aborts or stalls in its own teardown (tests/python/fsdp2_parity.py):
    # every rank is done and rank 0 has printed, so leave without tearing down.
    dist.barrier()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
