"""Accelerate's own collectives and training-loop calls (accelerate.utils.gather and reduce,
Accelerator.accumulate, backward, clip_grad_norm_ and its optimizer's step) on CPU processes (gloo),
for tests/accelerator/accelerator_side_by_side_test.cpp to compare with fsdp::Accelerator's on the
same tensors. Run on N processes with torchrun's variables and ACCELERATE_DEBUG_MODE=1 (Accelerate
then checks shapes across processes before a gather, where it otherwise returns garbage on one rank
and aborts another).

    accelerate_collectives.py DIR

DIR/case.json: steps, accumulation, lr, max_norm; DIR/initial.safetensors: the weights of
Sequential(Linear(3, 4), ReLU(), Linear(4, 2)); DIR/batches.safetensors: "x.<step>", "y.<step>"
global batches, each rank taking its equal slice of rows and splitting it into the micro-batches.
Rank 0 writes DIR/theirs.safetensors (every collective's result by name; "loss" the mean over ranks
of every micro-batch's loss, "norm" every optimizer step's gradient norm, "sync" sync_gradients of
every micro-batch, and the final weights as "weight.<name>") and DIR/theirs.json (the errors, by
name).
"""
import json
import os
import sys

import torch
from accelerate import Accelerator
from accelerate.utils import gather, reduce
from safetensors.torch import load_file, save_file


def main(directory):
    torch.set_num_threads(1)
    case = json.load(open(f"{directory}/case.json"))
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=case["accumulation"])
    rank, world = accelerator.process_index, accelerator.num_processes
    results, errors = {}, {}
    matrix = torch.arange(6, dtype=torch.float32).reshape(2, 3) + 10 * rank
    results["gather_2d"] = gather(matrix)
    results["gather_0d"] = gather(torch.tensor(rank + 0.5))
    results["gather_int"] = gather(torch.arange(4) + rank)
    results["reduce_sum"] = reduce(matrix, "sum")
    results["reduce_mean"] = reduce(matrix, "mean")
    results["reduce_sum_int"] = reduce(torch.arange(3) + rank, "sum")
    results["reduce_mean_0d"] = reduce(torch.tensor(rank + 1.0), "mean")
    for name, call in [("reduce_mean_int", lambda: reduce(torch.arange(3) + rank, "mean")),
                       ("gather_uneven", lambda: gather(torch.ones(rank + 1, 3)))]:
        try:
            call()
            errors[name] = None
        except Exception as error:  # what Accelerate raises, to compare with ours
            errors[name] = f"{type(error).__name__}: {error}"
    accelerator.wait_for_everyone()

    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    model.load_state_dict(load_file(f"{directory}/initial.safetensors"))
    optimizer = torch.optim.SGD(model.parameters(), lr=case["lr"])
    model, optimizer = accelerator.prepare(model, optimizer)
    batches = load_file(f"{directory}/batches.safetensors")
    k = case["accumulation"]
    losses, norms, syncs = [], [], []
    for step in range(case["steps"]):
        x, y = batches[f"x.{step}"], batches[f"y.{step}"]
        rows = x.shape[0] // world
        local_x, local_y = x[rank * rows:(rank + 1) * rows], y[rank * rows:(rank + 1) * rows]
        micro = rows // k
        for index in range(k):
            part = slice(index * micro, (index + 1) * micro)
            with accelerator.accumulate(model):
                loss = torch.nn.functional.mse_loss(model(local_x[part]), local_y[part])
                accelerator.backward(loss)
                syncs.append(float(accelerator.sync_gradients))
                if accelerator.sync_gradients:
                    norms.append(float(accelerator.clip_grad_norm_(model.parameters(), case["max_norm"])))
                optimizer.step()
                optimizer.zero_grad()
            losses.append(float(reduce(loss.detach(), "mean")))
    weights = {f"weight.{name}": tensor.detach().clone().contiguous()
               for name, tensor in accelerator.unwrap_model(model).state_dict().items()}
    if rank == 0:
        results = {name: tensor.contiguous() for name, tensor in results.items()}
        results.update(weights)
        results["loss"] = torch.tensor(losses, dtype=torch.float64)
        results["norm"] = torch.tensor(norms, dtype=torch.float64)
        results["sync"] = torch.tensor(syncs, dtype=torch.float64)
        save_file(results, f"{directory}/theirs.safetensors")
        with open(f"{directory}/theirs.json", "w") as file:
            json.dump(errors, file)
        print(f"accelerate: {world} processes, losses {losses}")
    accelerator.wait_for_everyone()
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit(__doc__)
    main(sys.argv[1])
