"""The PyTorch FSDP2 side of bench/gpu_bench.cpp: the same 1.1B Llama (transformers' LlamaForCausalLM
with eager attention, the arithmetic of fsdp.cpp's Llama), fully_shard on every decoder layer and the
root, MixedPrecisionPolicy(bf16 parameters, fp32 reduction), AdamW with foreach=False (libtorch's
AdamW is the per-parameter loop), the same batch and sequence. Run on N processes with torchrun's
variables (`fsdp launch` sets them); rank 0 prints one JSON line with gpu_bench's fields and writes
it to --json.

    gpu_peer.py [--steps 10] [--warmup 3] [--batch 8] [--sequence 1024] [--layers 22] [--json F]
"""
import argparse
import json
import os
import statistics
import time

import torch
import torch.distributed as dist
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--sequence", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=22)
    parser.add_argument("--peak-tflops", type=float, default=989.5)
    parser.add_argument("--json")
    arguments = parser.parse_args()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", device_id=device)
    rank, world = dist.get_rank(), dist.get_world_size()
    from transformers import AutoModelForCausalLM, LlamaConfig
    config = LlamaConfig(vocab_size=32000, hidden_size=2048, intermediate_size=5632,
                         num_hidden_layers=arguments.layers, num_attention_heads=32, num_key_value_heads=4,
                         max_position_embeddings=max(2048, arguments.sequence), tie_word_embeddings=False)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager").to(device)
    parameters = sum(parameter.numel() for parameter in model.parameters())
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in model.model.layers:
        fully_shard(layer, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=False)
    torch.manual_seed(1 + rank)
    seconds, losses = [], []
    torch.cuda.reset_peak_memory_stats(device)
    for step in range(arguments.warmup + arguments.steps):
        tokens = torch.randint(0, config.vocab_size, (arguments.batch, arguments.sequence + 1)).to(device)
        torch.cuda.synchronize(device)
        start = time.perf_counter()
        logits = model(input_ids=tokens[:, :-1]).logits.float()
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        torch.cuda.synchronize(device)
        if step >= arguments.warmup:
            seconds.append(time.perf_counter() - start)
        losses.append(loss.item())
    median = torch.tensor([statistics.median(seconds)], dtype=torch.float64, device=device)
    dist.all_reduce(median, op=dist.ReduceOp.MAX)
    step_time = median.item()
    tokens_per_step = arguments.batch * arguments.sequence * world
    tokens_per_second = tokens_per_step / step_time
    flops_per_token = 6 * parameters + 12 * arguments.layers * config.hidden_size * arguments.sequence
    result = {
        "side": "pytorch_fsdp2", "gpus": world, "parameters": parameters, "tokens_per_step": tokens_per_step,
        "step_seconds": step_time, "tokens_per_second": tokens_per_second,
        "peak_memory_bytes": torch.cuda.max_memory_allocated(device),
        "mfu": tokens_per_second * flops_per_token / (world * arguments.peak_tflops * 1e12),
        "loss_first": losses[0], "loss_last": losses[-1], "batch": arguments.batch,
        "sequence": arguments.sequence, "layers": arguments.layers, "torch": torch.__version__,
    }
    if rank == 0:
        line = json.dumps(result)
        print(line, flush=True)
        if arguments.json:
            with open(arguments.json, "w") as handle:
                handle.write(line + "\n")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
