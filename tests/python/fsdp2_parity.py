"""PyTorch FSDP2 (torch.distributed.fsdp.fully_shard, CPU, gloo) on the model and batches that
tests/engine/fsdp2_parity_test.cpp trains with fsdp.cpp. Run on N processes with torchrun's variables.

    fsdp2_parity.py DIR [OUTPUT [teacher]]

DIR/case.json says what to train:
    model          "mlp" (ParityMlp below) or "llama" (transformers' LlamaForCausalLM from DIR/config.json)
    reshard        reshard_after_forward of every unit: a bool, or an int (hpZ)
    mesh           [] (1-D over the world) or [replicate, shard] (HSDP on a 2-D device mesh)
    accumulation   micro-batches per step; the first k-1 run with set_requires_gradient_sync(False)
    bf16           MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32)
    fp16           (optional) MixedPrecisionPolicy(param_dtype=float16, reduce_dtype=float32)
    scaler         (optional) {"init_scale", "growth_interval"}: a ShardedGradScaler scales the loss,
                   unscales before clipping, steps and updates (FSDP2 only)
    fsdp1          (optional) PyTorch FSDP1 instead, as Accelerate's version 1 builds it from the plugin's
                   defaults: FullyShardedDataParallel with ModuleWrapPolicy({Block or LlamaDecoderLayer}),
                   FULL_SHARD (reshard) or SHARD_GRAD_OP, use_orig_params, no backward or forward
                   prefetch, limit_all_gathers, MixedPrecision(bf16, fp32, bf16) with bf16; no_sync()
                   for the first micro-batches and FSDP1's own clip_grad_norm_
    clip           max_norm of clip_grad_norm_ after every step's backward
    teacher_steps  (optional) with the argument `teacher`, the steps whose state rank 0 also writes,
                   for the teacher-forced check:
                   DIR/teacher_<step>.safetensors with "before.<name>" (the full weights before the step),
                   "state.<name>.<field>" (AdamW's full state before it: step, exp_avg, exp_avg_sq),
                   "after.<name>" (the weights after it), "loss" and "norm" (that step's), and
                   DIR/teacher_<step>.json with the optimizer's param_groups (parameters by name)
    device         (optional) "cuda": every rank on cuda:LOCAL_RANK over NCCL; default "cpu" over gloo
DIR/initial.safetensors: the initial weights; DIR/batches.safetensors: "x.<step>" and "y.<step>" global
batches (for llama "x" holds token ids of sequence length + 1 and there is no "y"). Every rank takes
its equal slice of rows and splits it into the micro-batches. Rank 0 writes DIR/OUTPUT (default fsdp2_result.safetensors):
"loss" (the global mean loss of every step, before the update), "norm" (the total gradient norm
clip_grad_norm_ returned at every step) and the final full weights.
"""
import json
import os
import sys

import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard


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


def build(directory, case):
    """The model and its units, in the order the C++ side creates them (children, then the root)."""
    if case["model"] == "mlp":
        model = ParityMlp()
        units = [model.input, *model.blocks]
    else:
        from transformers import AutoModelForCausalLM, LlamaConfig
        config = LlamaConfig.from_json_file(f"{directory}/config.json")
        # Eager attention is the arithmetic our Llama does (matmul, mask, softmax, matmul). Under the
        # default SDPA the fused kernel's backward rounds differently: measured on one rank, with no
        # communication at all, the two models' weights then drift 3.5e-5 apart over the 20 steps
        # (7e-7 with eager), which is the models' difference, not the engines'.
        model = AutoModelForCausalLM.from_config(config, attn_implementation="eager").float()
        units = list(model.model.layers)
    # Every parameter is in the file; non-persistent buffers (rotary inv_freq) are not state.
    model.load_state_dict(load_file(f"{directory}/initial.safetensors"), strict=True)
    return model, units


def micro_loss(model, case, x, y):
    if case["model"] == "mlp":
        return torch.nn.functional.mse_loss(model(x).float(), y)
    logits = model(input_ids=x[:, :-1]).logits.float()
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1))


def main(directory, output, teacher):
    torch.set_num_threads(1)
    case = json.load(open(f"{directory}/case.json"))
    if not teacher:
        case["teacher_steps"] = []
    device = torch.device("cpu")
    if case.get("device") == "cuda":
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    else:
        dist.init_process_group("gloo")
    case["torch_device"] = device
    model, units = build(directory, case)
    model.to(device)
    if case.get("fsdp1"):
        return train(directory, output, case, wrap_fsdp1(model, units, case))
    reshard = case["reshard"]
    if not isinstance(reshard, bool) and dist.get_world_size() % reshard:
        # The one-rank reference run (the spread) of an int case: FSDP2 refuses a group larger than
        # the world, and on one rank every choice computes the same.
        reshard = True
    arguments = {"reshard_after_forward": reshard}
    if case["mesh"]:
        # HSDP: shard over the inner dimension (ranks of one machine), replicate over the outer.
        arguments["mesh"] = init_device_mesh(device.type, tuple(case["mesh"]), mesh_dim_names=("replicate", "shard"))
    if case["bf16"]:
        arguments["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    if case.get("fp16"):
        arguments["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.float16, reduce_dtype=torch.float32)
    for unit in units:
        fully_shard(unit, **arguments)
    fully_shard(model, **arguments)
    train(directory, output, case, model)


def wrap_fsdp1(model, units, case):
    from torch.distributed.fsdp import FullyShardedDataParallel, MixedPrecision, ShardingStrategy
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy
    unit_type = Block if case["model"] == "mlp" else type(units[0])
    precision = None
    if case["bf16"]:
        precision = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32, buffer_dtype=torch.bfloat16)
    strategy = ShardingStrategy.FULL_SHARD if case["reshard"] else ShardingStrategy.SHARD_GRAD_OP
    return FullyShardedDataParallel(model, auto_wrap_policy=ModuleWrapPolicy({unit_type}), device_id=torch.device("cpu"),
                                    use_orig_params=True, sharding_strategy=strategy, mixed_precision=precision,
                                    backward_prefetch=None, forward_prefetch=False, limit_all_gathers=True)
    # Accelerate's default backward_prefetch is None (no prefetch), which FSDP1 receives as is.


def full_state(model, optimizer):
    """The full weights and AdamW state, keyed by parameter name, on every rank (collective)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict
    options = StateDictOptions(full_state_dict=True)
    weights = get_model_state_dict(model, options=options)
    # Copies: what the step then updates in place must not change what was captured before it.
    weights = {name: (tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor).detach().cpu().clone()
               for name, tensor in weights.items()}
    if not optimizer.state:
        # Before the first step: get_optimizer_state_dict would create the state with a step of lr 0
        # (its _init_optim_state), which counts as AdamW's first step and changes the run.
        names = [name.replace("_fsdp_wrapped_module.", "") for name, _ in model.named_parameters()]
        groups = [{**{key: value for key, value in group.items() if key != "params"}, "params": names}
                  for group in optimizer.param_groups]
        assert len(groups) == 1, "one parameter group expected"
        return weights, {"state": {}, "param_groups": groups}
    optimizer_state = get_optimizer_state_dict(model, optimizer, options=options)
    optimizer_state["state"] = {
        name: {field: (value.full_tensor() if hasattr(value, "full_tensor") else value).detach().cpu().clone()
               for field, value in fields.items()}
        for name, fields in optimizer_state["state"].items()}
    return weights, optimizer_state


def write_teacher(directory, step, before, optimizer_state, after, loss, norm, scaler_state):
    tensors = {f"before.{name}": tensor for name, tensor in before.items()}
    tensors.update({f"scaler.{key}": torch.tensor(float(value), dtype=torch.float64) for key, value in scaler_state.items()})
    tensors.update({f"after.{name}": tensor for name, tensor in after.items()})
    for name, fields in optimizer_state["state"].items():
        for field, value in fields.items():
            tensors[f"state.{name}.{field}"] = value.to(torch.float32) if field == "step" else value.contiguous()
    tensors["loss"] = torch.tensor([loss], dtype=torch.float64)
    tensors["norm"] = torch.tensor([norm], dtype=torch.float64)
    save_file(tensors, f"{directory}/teacher_{step}.safetensors")
    groups = [{key: value for key, value in group.items() if isinstance(value, (int, float, bool, str, list, tuple))}
              for group in optimizer_state["param_groups"]]
    with open(f"{directory}/teacher_{step}.json", "w") as file:
        json.dump(groups, file)


def train(directory, output, case, model):
    import contextlib
    rank, world = dist.get_rank(), dist.get_world_size()
    fsdp1 = bool(case.get("fsdp1"))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    device = case["torch_device"]
    batches = {name: tensor.to(device) for name, tensor in load_file(f"{directory}/batches.safetensors").items()}
    steps = len([name for name in batches if name.startswith("x.")])
    k = case["accumulation"]
    scaler = None
    if case.get("scaler"):
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
        scaler = ShardedGradScaler(device=device.type, init_scale=case["scaler"]["init_scale"],
                                   growth_interval=case["scaler"]["growth_interval"])
    losses, norms = [], []
    teacher_steps = set(case.get("teacher_steps", []))
    for step in range(steps):
        if step in teacher_steps:
            before, optimizer_state = full_state(model, optimizer)
            scaler_state = scaler.state_dict() if scaler else {}
        x = batches[f"x.{step}"]
        y = batches.get(f"y.{step}", x)
        rows = x.shape[0] // world
        local_x, local_y = x[rank * rows:(rank + 1) * rows], y[rank * rows:(rank + 1) * rows]
        micro = rows // k
        total = torch.zeros((), device=device)
        for index in range(k):
            part = slice(index * micro, (index + 1) * micro)
            if fsdp1:
                scope = model.no_sync() if index < k - 1 else contextlib.nullcontext()
            else:
                model.set_requires_gradient_sync(index == k - 1)
                scope = contextlib.nullcontext()
            with scope:
                loss = micro_loss(model, case, local_x[part], local_y[part]) / k
                (scaler.scale(loss) if scaler else loss).backward()
            total += loss.detach()
        if scaler:
            scaler.unscale_(optimizer)
        if fsdp1:
            norm = model.clip_grad_norm_(case["clip"])
        else:
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), case["clip"])
        norms.append(norm.full_tensor().item() if hasattr(norm, "full_tensor") else norm.item())
        if scaler:
            scaler.step(optimizer)
            scaler.update()
        else:
            optimizer.step()
        optimizer.zero_grad()
        dist.all_reduce(total)
        losses.append(total.item() / world)
        if step in teacher_steps:
            after, _ = full_state(model, optimizer)
            if rank == 0:
                write_teacher(directory, step, before, optimizer_state, after, losses[-1], norms[-1], scaler_state)
    if fsdp1:
        from torch.distributed.fsdp import FullStateDictConfig, StateDictType
        from torch.distributed.fsdp import FullyShardedDataParallel
        # offload_to_cpu=True crashes FSDP1 on CPU in torch 2.13 (tests/python/fsdp1_meta_init.py).
        config = FullStateDictConfig(offload_to_cpu=False, rank0_only=False)
        with FullyShardedDataParallel.state_dict_type(model, StateDictType.FULL_STATE_DICT, config):
            full = {name: tensor.detach().clone().contiguous() for name, tensor in model.state_dict().items()}
    else:
        full = {name: tensor.full_tensor().cpu().contiguous() for name, tensor in model.state_dict().items()}
    if rank == 0:
        full["loss"] = torch.tensor(losses, dtype=torch.float64)
        full["norm"] = torch.tensor(norms, dtype=torch.float64)
        save_file(full, f"{directory}/{output}")
        print(f"{'fsdp1' if fsdp1 else 'fsdp2'}: {case} on {world} ranks: {steps} steps, "
              f"loss {losses[0]:.6f} -> {losses[-1]:.6f}")
    # PyTorch's Gloo sometimes aborts in its own teardown ("terminate called without an active
    # exception", under FSDP1 (tests/python/fsdp1_meta_init.py) and, once in a loaded run, under
    # FSDP2): every rank is done and the result is written, so leave without tearing down.
    dist.barrier()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    if len(sys.argv) not in (2, 3, 4) or (len(sys.argv) == 4 and sys.argv[3] != "teacher"):
        raise SystemExit(__doc__)
    main(sys.argv[1], sys.argv[2] if len(sys.argv) >= 3 else "fsdp2_result.safetensors", len(sys.argv) == 4)
