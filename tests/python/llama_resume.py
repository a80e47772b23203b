"""train_llama's training loop in PyTorch FSDP2 on transformers' Llama, saved the way Accelerate's
save_state saves it, for tests/examples/train_llama_test.cpp's resume-from-Accelerate test. Run on N
processes with torchrun's variables.

    llama_resume.py DIR STEPS_BEFORE STEPS_AFTER

Rank 0 saves a tiny LlamaForCausalLM (seed 1234) to DIR/init (save_pretrained). Every rank builds the
same model with fully_shard on each decoder layer and the root, and trains steps 1..STEPS_BEFORE +
STEPS_AFTER exactly as `train_llama --init-from DIR/init --data DIR/train.txt --eval-data ...` does
with the settings in SETTINGS: each step's global batch is train_llama's (windows of seq_len + 1
bytes at offsets drawn by std::mt19937_64 seeded with seed * 1000003 + step, reimplemented below),
each rank takes its rows in micro-batches with the loss divided by the accumulation steps, the
learning rate follows train_llama's warmup and cosine schedule, gradients are clipped to
max_grad_norm, AdamW steps with betas (0.9, 0.95). After STEPS_BEFORE steps Accelerate's own
save_fsdp_model, save_fsdp_optimizer and save_accelerator_state write DIR/run/checkpoints/
checkpoint_0. Rank 0 writes DIR/losses.json: {"resumed": {step: loss}} for the steps after, each
the mean over ranks as train_llama reports it.
"""
import json
import math
import os
import sys
import types

import torch
import torch.distributed as dist
from accelerate import PartialState
from accelerate.checkpointing import save_accelerator_state
from accelerate.utils import FullyShardedDataParallelPlugin, save_fsdp_model, save_fsdp_optimizer
from torch.distributed.fsdp import fully_shard
from transformers import LlamaConfig, LlamaForCausalLM

SETTINGS = {"seed": 1234, "seq_len": 32, "global_batch_size": 4, "micro_batch_size": 1, "lr": 3e-3, "min_lr": 3e-4,
            "warmup_steps": 2, "weight_decay": 0.1, "max_grad_norm": 1.0}
MASK64 = (1 << 64) - 1


class MT19937_64:
    """std::mt19937_64 (C++11's parameters), which train_llama's global_batch draws offsets from."""

    def __init__(self, seed):
        self.state = [seed & MASK64]
        for index in range(1, 312):
            previous = self.state[-1]
            self.state.append((6364136223846793005 * (previous ^ (previous >> 62)) + index) & MASK64)
        self.index = 312

    def __call__(self):
        if self.index >= 312:
            for i in range(312):
                x = (self.state[i] & 0xFFFFFFFF80000000) | (self.state[(i + 1) % 312] & 0x7FFFFFFF)
                shifted = x >> 1
                if x & 1:
                    shifted ^= 0xB5026F5AA96619E9
                self.state[i] = self.state[(i + 156) % 312] ^ shifted
            self.index = 0
        y = self.state[self.index]
        self.index += 1
        y ^= (y >> 29) & 0x5555555555555555
        y ^= (y << 17) & 0x71D67FFFEDA60000
        y ^= (y << 37) & 0xFFF7EEE000000000
        y ^= y >> 43
        return y & MASK64


def global_batch(tokens, step):
    generator = MT19937_64((SETTINGS["seed"] * 1000003 + step) & MASK64)
    length = SETTINGS["seq_len"]
    positions = tokens.numel() - length
    offsets = [generator() % positions for _ in range(SETTINGS["global_batch_size"])]
    return torch.stack([tokens[offset:offset + length + 1] for offset in offsets])


def learning_rate(step, steps):
    warmup, lr, min_lr = SETTINGS["warmup_steps"], SETTINGS["lr"], SETTINGS["min_lr"]
    if step <= warmup:
        return lr * step / max(1, warmup)
    progress = (step - warmup) / max(1, steps - warmup)
    return min_lr + 0.5 * (lr - min_lr) * (1.0 + math.cos(math.pi * min(1.0, progress)))


def main(directory, steps_before, steps_after):
    torch.set_num_threads(1)
    PartialState(cpu=True)  # Accelerate's process group (gloo) and the state its logging needs
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(1234)
    config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                         tie_word_embeddings=False)
    model = LlamaForCausalLM(config)
    if rank == 0:
        model.save_pretrained(f"{directory}/init")
    dist.barrier()
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=SETTINGS["lr"], betas=(0.9, 0.95),
                                  weight_decay=SETTINGS["weight_decay"])
    tokens = torch.tensor(list(open(f"{directory}/train.txt", "rb").read()), dtype=torch.long)
    micro = SETTINGS["micro_batch_size"]
    accumulation = SETTINGS["global_batch_size"] // (world * micro)
    steps = steps_before + steps_after
    losses = {}
    for step in range(1, steps + 1):
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(step, steps)
        batch = global_batch(tokens, step)
        local = batch[rank * accumulation * micro:(rank + 1) * accumulation * micro]
        loss_sum = 0.0
        for index in range(accumulation):
            rows = local[index * micro:(index + 1) * micro]
            logits = model(input_ids=rows[:, :SETTINGS["seq_len"]]).logits
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), rows[:, 1:].reshape(-1))
            (loss / accumulation if accumulation > 1 else loss).backward()
            loss_sum += loss.item()
        torch.nn.utils.clip_grad_norm_(model.parameters(), SETTINGS["max_grad_norm"])
        optimizer.step()
        optimizer.zero_grad()
        total = torch.tensor(loss_sum / accumulation, dtype=torch.double)
        dist.all_reduce(total)
        losses[step] = total.item() / world
        if step == steps_before:
            plugin = FullyShardedDataParallelPlugin(fsdp_version=2, state_dict_type="SHARDED_STATE_DICT")
            accelerator = types.SimpleNamespace(process_index=rank, num_processes=world, is_main_process=rank == 0)
            output = f"{directory}/run/checkpoints/checkpoint_0"
            save_fsdp_model(plugin, accelerator, model, output)
            save_fsdp_optimizer(plugin, accelerator, optimizer, model, output)
            dist.barrier()
            save_accelerator_state(output, [], [], [], [], rank, step=step)
            dist.barrier()
    if rank == 0:
        json.dump({"resumed": {str(step): losses[step] for step in range(steps_before + 1, steps + 1)},
                   "before": {str(step): losses[step] for step in range(1, steps_before + 1)}},
                  open(f"{directory}/losses.json", "w"), indent=1)
    dist.barrier()
    # PyTorch's Gloo sometimes aborts in its own teardown (tests/python/fsdp2_parity.py): every rank
    # is done and the result is written, so leave without tearing down.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    if len(sys.argv) != 4:
        raise SystemExit(__doc__)
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))
