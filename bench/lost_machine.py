#!/usr/bin/env python3
"""What a lost machine costs (issue "Training that survives a lost rank", items 2 and 5): two
machines on this one (network namespaces joined by a veth pair, as bench/hosts.sh makes them), each an
`fsdp launch --nnodes 1:2 --max-restarts 1 --nproc-per-node 2` of `train_llama --preset medium`
with a SHARDED checkpoint every 10 steps. After step 15 host 1's launcher and ranks are killed
(SIGKILL, the machine gone); host 0 goes on alone from the checkpoint of step 10 on 2 ranks, keeping
the global batch (Note [elastic rounds]). Measured, from the kill: when host 0's launcher reports the
failure (its ranks' collectives fail), when it reports round 1 (after the last call,
--rdzv-conf last_call_timeout, and --termination-grace, which wait for machines that may still
join) and when the first step
after the restart is logged. BENCH_ROUNDS trials (default 3), medians. Rewrites the table between the
<!-- lost-machine --> markers of bench/README.md. Needs root (ip netns).
  sudo .venv/bin/python bench/lost_machine.py [--rounds 3] [--last-call 5]   (about 5 minutes)
"""
import argparse
import os
import queue
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time

from checkpoint_cost import first_step_after_restart, lines
from report import replace_between_markers

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS = 30
EVERY = 10
KILL_AFTER = 15
HOSTS = ["fsdp-lost0", "fsdp-lost1"]
LINKS = ["fsdp-lveth0", "fsdp-lveth1"]
ADDRESSES = ["10.78.0.1", "10.78.0.2"]


def sh(command, check=True):
    return subprocess.run(command, shell=True, check=check, capture_output=True, text=True)


def make_hosts():
    remove_hosts()
    for host in HOSTS:
        sh(f"ip netns add {host}")
    sh(f"ip link add {LINKS[0]} netns {HOSTS[0]} type veth peer name {LINKS[1]} netns {HOSTS[1]}")
    for host, link, address in zip(HOSTS, LINKS, ADDRESSES):
        sh(f"ip -n {host} link set lo up && ip -n {host} addr add {address}/24 dev {link} && "
           f"ip -n {host} link set {link} up")


def remove_hosts():
    for host in HOSTS:
        sh(f"ip netns pids {host} 2>/dev/null | xargs -r kill -9; ip netns del {host}", check=False)


def launch(args, host, directory, data, port):
    command = ["ip", "netns", "exec", HOSTS[host], "env", f"GLOO_SOCKET_IFNAME={LINKS[host]}",
               os.path.join(args.bin, "fsdp"), "launch", "--nnodes", "1:2", "--node-rank", str(host),
               "--nproc-per-node", "2", "--master-addr", ADDRESSES[0], "--master-port", str(port),
               "--max-restarts", "1", "--rdzv-conf", f"last_call_timeout={args.last_call}",
               "--termination-grace", str(args.grace),
               "--", os.path.join(args.bin, "train_llama"), "--preset", args.preset, "--output-dir", directory,
               "--data", data, "--steps", str(STEPS), "--seq-len", "128", "--global-batch-size", "8",
               "--micro-batch-size", "2", "--eval-every", "0", "--eval-tokens", "1024", "--sample-bytes", "4",
               "--checkpoint-every", str(EVERY), "--total-limit", "2"]
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def timestamped_lines(process, sink):
    """Puts (time seen, line) of the process's output into `sink`, then None at its end."""
    for line in process.stdout:
        sink.put((time.monotonic(), line))
    sink.put(None)


def trial(args, work, data, index):
    directory = os.path.join(work, f"trial_{index}")
    metrics = os.path.join(directory, "metrics.jsonl")
    port = 21000 + (os.getpid() + index) % 20000
    other = launch(args, 1, directory, data, port)
    host0 = launch(args, 0, directory, data, port)
    printed = queue.Queue()
    reader = threading.Thread(target=timestamped_lines, args=(host0, printed), daemon=True)
    reader.start()
    while len(lines(metrics)) < KILL_AFTER and host0.poll() is None:
        time.sleep(0.005)
    killed_after = len(lines(metrics))
    sh(f"ip netns pids {HOSTS[1]} | xargs -r kill -9")
    killed = time.monotonic()
    other.wait()
    first = first_step_after_restart(metrics, host0, killed_after, EVERY)
    host0.wait()
    reader.join()
    output, reported, round_one = [], None, None
    while (item := printed.get()) is not None:
        seen, line = item
        output.append(line)
        if reported is None and "Restarting: this machine joins round 1" in line:
            reported = seen
        if round_one is None and line.startswith("fsdp launch: round 1:"):
            round_one = seen
    text = "".join(output)
    resumed = re.search(r"resumed from \S+ at step (\d+)", text)
    if host0.returncode != 0 or first is None or reported is None or round_one is None or not resumed:
        sys.exit(f"bench: trial {index} failed (host 0 exit {host0.returncode}):\n{text}")
    subprocess.run(["rm", "-rf", directory], check=True)
    return {"killed_after": killed_after, "resumed_at": int(resumed.group(1)), "detected": reported - killed,
            "round_one": round_one - killed, "first_step": first - killed}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=int(os.environ.get("BENCH_ROUNDS", "3")))
    parser.add_argument("--last-call", type=float, default=5.0, help="--rdzv-conf last_call_timeout, seconds")
    parser.add_argument("--grace", type=float, default=3.0, help="--termination-grace, seconds (its default)")
    parser.add_argument("--preset", default="medium")
    parser.add_argument("--bin", default=os.path.join(os.environ.get("FSDP_BUILD_DIR", os.path.join(ROOT, "build")), "bin"))
    args = parser.parse_args()
    if os.geteuid() != 0:
        sys.exit("bench: lost_machine.py makes network namespaces: run it as root")
    work = tempfile.mkdtemp(prefix="fsdp_lost_machine_")
    data = os.path.join(work, "train.txt")
    with open(data, "w") as file:
        for index in range(3000):
            file.write(f"Line {index}: a lost machine should cost the job as little as it can. ")
    make_hosts()
    try:
        trials = []
        for index in range(args.rounds):
            trials.append(trial(args, work, data, index))
            print(f"trial {index + 1}: {trials[-1]}", file=sys.stderr)
    finally:
        remove_hosts()
        subprocess.run(["rm", "-rf", work], check=False)

    def median(key):
        return statistics.median(item[key] for item in trials)

    lost = statistics.median(item["killed_after"] - item["resumed_at"] for item in trials)
    table = [
        "<!-- lost-machine -->",
        f"Run of {time.strftime('%Y-%m-%d %H:%M')}: `train_llama --preset {args.preset}` on 2 machines of 2 ranks "
        f"(`--nnodes 1:2 --max-restarts 1 --rdzv-conf last_call_timeout={args.last_call:g} --termination-grace "
        f"{args.grace:g}`), host 1 killed after "
        f"step {KILL_AFTER}, checkpoints every {EVERY} steps; medians of {args.rounds} trials, seconds from the kill.",
        "",
        "| host 0's launcher reports the failure | round 1 starts (2 ranks, after the last call) | first step after the restart | steps lost |",
        "|---|---|---|---|",
        f"| {median('detected'):.2f} | {median('round_one'):.2f} | {median('first_step'):.2f} | {lost:g} |",
        "",
        f"Of the time to the first step, {args.last_call + args.grace:g} s is the wait for machines that may still "
        f"join round 1: the last call ({args.last_call:g} s; torchrun's default and ours is 30 s) and, after a "
        f"failed round, the time a machine may take to stop its processes (--termination-grace, {args.grace:g} s). "
        "The rest is the failure seen by host 0's ranks, stopping them, and starting 2 ranks that load the "
        "checkpoint resharded from 4. When every machine of the failed round comes back (a rank failed, no "
        "machine lost), the round starts a second after the last of them instead.",
        "<!-- /lost-machine -->",
    ]
    print("\n".join(table[1:-1]))
    replace_between_markers(os.path.join(ROOT, "bench", "README.md"), "lost-machine", table)


if __name__ == "__main__":
    main()
