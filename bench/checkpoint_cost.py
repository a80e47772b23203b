#!/usr/bin/env python3
"""What checkpoints cost a training run, and what a lost rank costs (issue "Training that survives a
lost rank", item 5). train_llama on N ranks (default 2), --preset medium (25 M parameters), 41
steps, in rounds (each in another order) of three runs that differ only in their checkpoints: none but the
final one, a synchronous SHARDED checkpoint every 10 steps, and an asynchronous one
(--async-checkpoint, Note [asynchronous checkpoints]). The peer is the run without checkpoints in
the same round. Each run's time is from the line step 1 adds to metrics.jsonl to the line of step
41 (seen by polling the file every 5 ms), so it holds 40 step intervals and the saves after steps
10, 20, 30 and 40, and neither start-up nor the final save. The cost of a mode is the ratio of its
run to the run without checkpoints in the same round, the median of those paired ratios over the
rounds with their spread (the rounds rotate the order, since a run after another's deletes and
write-back is slower by itself). The blocking part of an asynchronous save is what rank 0 reports it
staged in ("staged ... in S s"), against the median step.
Then, once: `fsdp launch --max-restarts 1` with checkpoints every 10 steps, rank 1 killed (SIGKILL)
after step 25; the time from the kill to the first step logged after the restart (which resumes at
step 20), and the steps lost.
Rewrites the table between the <!-- checkpoint-cost --> markers of bench/README.md.
  .venv/bin/python bench/checkpoint_cost.py [--ranks 2] [--rounds 3] [--preset medium]   (about 15 minutes)
"""
import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS = 41
EVERY = 10


def lines(path):
    try:
        with open(path) as file:
            return [json.loads(line) for line in file if line.strip()]
    except (FileNotFoundError, json.JSONDecodeError):
        return []


def start(args, directory, flags, restarts=0):
    command = [os.path.join(args.bin, "fsdp"), "launch", "--nproc-per-node", str(args.ranks), "--master-port", "0"]
    if restarts:
        command += ["--max-restarts", str(restarts)]
    command += ["--", os.path.join(args.bin, "train_llama"), "--preset", args.preset, "--output-dir", directory,
                "--data", args.data, "--steps", str(STEPS), "--seq-len", "128", "--global-batch-size", "8",
                "--eval-every", "0", "--eval-tokens", "1024", "--sample-bytes", "4", "--total-limit", "2"] + flags
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def watch(path, process, until):
    """Polls metrics.jsonl; returns {line count: first time seen} once until(count) or the process ends."""
    seen = {}
    while process.poll() is None:
        count = len(lines(path))
        seen.setdefault(count, time.monotonic())
        if until(count):
            break
        time.sleep(0.005)
    return seen


def first_step_after_restart(metrics, process, killed_at_lines, every):
    """When the first step after a restart is logged, or None if `process` ends first. The restarted
    round rewrites metrics.jsonl up to its checkpoint's step (the last multiple of `every`) and then
    logs the next: a drop in the line count, then that step's line."""
    target = killed_at_lines // every * every + 1
    dropped = False
    while process.poll() is None:
        count = len(lines(metrics))
        dropped = dropped or count < killed_at_lines
        if dropped and count == target:
            return time.monotonic()
        time.sleep(0.005)
    return None


def timed_run(args, directory, flags):
    process = start(args, directory, flags)
    seen = watch(os.path.join(directory, "metrics.jsonl"), process, lambda count: count >= STEPS)
    output, _ = process.communicate()
    if process.returncode != 0 or 1 not in seen or STEPS not in seen:
        sys.exit(f"bench: train_llama {' '.join(flags)} failed ({process.returncode}):\n{output}")
    steps = [8 * 128 / record["tokens_per_s"] for record in lines(os.path.join(directory, "metrics.jsonl"))]
    staged = [float(value) for value in re.findall(r"staged [0-9.]+ MiB of this rank's state in ([0-9.]+) s", output)]
    mib = re.findall(r"staged ([0-9.]+) MiB", output)
    intervals = [seen[count + 1] - seen[count] for count in range(1, STEPS) if count in seen and count + 1 in seen]
    return {"seconds": seen[STEPS] - seen[1], "median_step": statistics.median(steps), "staging_seconds": staged,
            "staging_mib": float(mib[0]) if mib else None,
            "save_interval_excess": [intervals[step - 1] - statistics.median(intervals)
                                     for step in range(EVERY, STEPS, EVERY) if step - 1 < len(intervals)]}


def restart_run(args, directory):
    metrics = os.path.join(directory, "metrics.jsonl")
    process = start(args, directory, ["--checkpoint-every", str(EVERY)], restarts=1)
    watch(metrics, process, lambda count: count >= 25)
    victim = None
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/cmdline", "rb") as file:
                command = file.read()
            with open(f"/proc/{name}/environ", "rb") as file:
                environment = file.read().split(b"\0")
        except OSError:
            continue
        if b"train_llama" in command and directory.encode() in command and b"RANK=1" in environment:
            victim = int(name)
    if victim is None:
        sys.exit("bench: rank 1 of the restart run was not found")
    killed_at_lines = len(lines(metrics))
    os.kill(victim, signal.SIGKILL)
    killed = time.monotonic()
    first = first_step_after_restart(metrics, process, killed_at_lines, EVERY)
    output, _ = process.communicate()
    if process.returncode != 0 or first is None:
        sys.exit(f"bench: the restart run failed ({process.returncode}):\n{output}")
    resumed = re.search(r"resumed from \S+ at step (\d+)", output)
    return {"failure_to_first_step_seconds": first - killed, "killed_after_steps": killed_at_lines,
            "resumed_at_step": int(resumed.group(1)) if resumed else 0}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--preset", default="medium")
    parser.add_argument("--bin", default=os.path.join(os.environ.get("FSDP_BUILD_DIR", os.path.join(ROOT, "build")), "bin"))
    args = parser.parse_args()
    work = tempfile.mkdtemp(prefix="fsdp_checkpoint_cost_")
    args.data = os.path.join(work, "train.txt")
    with open(args.data, "w") as file:
        for index in range(3000):
            file.write(f"Line {index}: a checkpoint should cost the step as little as it can. ")
    modes = {"none": ["--checkpoint-every", "0"], "sync": ["--checkpoint-every", str(EVERY)],
             "async": ["--checkpoint-every", str(EVERY), "--async-checkpoint"]}
    runs = {mode: [] for mode in modes}
    names = list(modes)
    for round_index in range(args.rounds):
        # Each round in another order: a run after another's deletes and write-back is slower by
        # itself (the last of three ran 10-15% slower in every round of a fixed order here).
        for mode in names[round_index % 3:] + names[:round_index % 3]:
            flags = modes[mode]
            directory = os.path.join(work, f"{mode}_{round_index}")
            runs[mode].append(timed_run(args, directory, flags))
            subprocess.run(["rm", "-rf", directory], check=True)
            print(f"round {round_index + 1}: {mode}: {runs[mode][-1]['seconds']:.2f} s", file=sys.stderr)
    restart = restart_run(args, os.path.join(work, "restart"))
    subprocess.run(["rm", "-rf", work], check=True)

    median = {mode: statistics.median(run["seconds"] for run in runs[mode]) for mode in modes}
    # Paired: each round's run against the run without checkpoints of the same round.
    paired = {mode: [run["seconds"] / none["seconds"] for run, none in zip(runs[mode], runs["none"])]
              for mode in modes}
    step = statistics.median(run["median_step"] for run in runs["none"])
    staging = statistics.median(value for run in runs["async"] for value in run["staging_seconds"])
    saves = (STEPS - 1) // EVERY
    table = [
        f"Run of {time.strftime('%Y-%m-%d %H:%M')}: `train_llama --preset {args.preset}` on {args.ranks} ranks, "
        f"{STEPS - 1} step intervals with {saves} checkpoints (every {EVERY} steps), {args.rounds} rounds in "
        f"rotating order; the median step without checkpoints is {step:.3f} s.",
        "",
        "| checkpoints | seconds for the 40 intervals (median) | / the run without, paired: median | spread (min-max) "
        "| per round | the save's own interval, beyond the median |",
        "|---|---|---|---|---|---|",
    ]
    for mode in modes:
        excess = statistics.median(value for run in runs[mode] for value in run["save_interval_excess"])
        ratios = paired[mode]
        table.append(f"| {mode} | {median[mode]:.2f} | {statistics.median(ratios):.3f} | "
                     f"{min(ratios):.3f}-{max(ratios):.3f} | {', '.join(f'{ratio:.3f}' for ratio in ratios)} | "
                     f"{excess:+.3f} s |")
    table += ["", "Each ratio is a run's 40 intervals against those of the run without checkpoints in the same "
              "round; the cost is the median ratio less 1."]
    staged_mib = runs["async"][0]["staging_mib"]
    table += [
        "",
        f"Asynchronous save, its blocking part: staging {staged_mib} MiB per rank took {staging:.3f} s (median of "
        f"{sum(len(run['staging_seconds']) for run in runs['async'])} saves), {staging / step:.2f} of a step.",
        f"A lost rank: killed after step {restart['killed_after_steps']}, resumed at step {restart['resumed_at_step']} "
        f"({restart['killed_after_steps'] - restart['resumed_at_step']} steps lost); "
        f"{restart['failure_to_first_step_seconds']:.2f} s from the kill to the first step after the restart.",
    ]
    text = "\n".join(table)
    print(text)
    readme = os.path.join(ROOT, "bench", "README.md")
    with open(readme) as file:
        content = file.read()
    begin, end = "<!-- checkpoint-cost -->", "<!-- /checkpoint-cost -->"
    if begin in content and end in content:
        content = content[:content.index(begin) + len(begin)] + "\n" + text + "\n" + content[content.index(end):]
        with open(readme + ".tmp", "w") as file:
            file.write(content)
        os.replace(readme + ".tmp", readme)


if __name__ == "__main__":
    main()
