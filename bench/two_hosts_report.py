"""Turns bench/two_hosts.sh's JSON lines into the two-machine table of bench/README.md (medians over
rounds, between the <!-- two-hosts --> markers): step time per configuration against PyTorch DDP and
FSDP2, and the bytes that left host 0 per step (its veth's counter, all of its ranks) against
theory (step_bench's cross_host_theory_per_rank times the ranks per machine)."""
import json
import platform
import statistics
import subprocess
import sys
import time

from report import replace_between_markers


def name_of(row):
    group = row.get("reshard_after_forward", 0)
    if row["strategy"] in ("DDP", "FSDP2"):
        return "PyTorch " + row["strategy"] + (f", reshard_after_forward={group}" if group else "")
    return row["strategy"] + (f", reshard_after_forward={group} (hpZ)" if group else "")


def main():
    results_path, readme_path, command = sys.argv[1], sys.argv[2], sys.argv[3]
    rows = [json.loads(line) for line in open(results_path) if line.strip().startswith("{")]
    runs = {}
    for row in rows:
        if row.get("benchmark") == "step":
            runs.setdefault((row["world_size"], name_of(row)), []).append(row)

    def median(key, field):
        values = [row[field] for row in runs.get(key, []) if row.get(field, -1) is not None and row.get(field, -1) >= 0]
        return statistics.median(values) if values else None

    rounds = max((len(group) for group in runs.values()), default=0)
    lines = ["<!-- two-hosts -->", "",
             f"Measured {time.strftime('%Y-%m-%d %H:%M')} on {platform.node()} ({platform.machine()}, "
             f"{subprocess.run(['nproc'], capture_output=True, text=True).stdout.strip()} cores shared by both "
             f"machines) with `{command}`; medians over {rounds} rounds. Off host 0: the bytes its veth sent per "
             "step (its ranks' payload plus TCP/IP headers); theory: what the algorithm must send off the machine.",
             "", "| ranks (machines x ranks) | configuration | step (s) | / DDP | / FSDP2 | off host 0 per step (MB) "
             "| theory (MB) | measured / theory |", "|---|---|---|---|---|---|---|---|"]
    worlds = sorted({world for (world, _) in runs})
    order = ["FULL_SHARD", "SHARD_GRAD_OP", "HYBRID_SHARD"]
    for world in worlds:
        names = sorted({name for (w, name) in runs if w == world},
                       key=lambda name: (name.startswith("PyTorch"), order.index(name) if name in order else 9, name))
        ddp, fsdp2 = median((world, "PyTorch DDP"), "median_step_s"), median((world, "PyTorch FSDP2"), "median_step_s")
        for name in names:
            step = median((world, name), "median_step_s")
            sent = median((world, name), "link_tx_bytes_per_step")
            per_rank = median((world, name), "cross_host_theory_per_rank")
            machine = runs[(world, name)][0].get("ranks_per_machine", world // 2)
            theory = per_rank * machine if per_rank is not None else None

            def ratio(a, b):
                return f"{a / b:.2f}" if a and b else "-"

            def mb(value):
                return f"{value / 1e6:.1f}" if value is not None else "-"

            lines.append(f"| {world} (2 x {world // 2}) | {name} | {step:.3f} | {ratio(step, ddp)} | {ratio(step, fsdp2)} "
                         f"| {mb(sent)} | {mb(theory)} | {ratio(sent, theory) if theory else '-'} |")
    lines += ["", "<!-- /two-hosts -->"]
    replace_between_markers(readme_path, "two-hosts", lines)


if __name__ == "__main__":
    main()
