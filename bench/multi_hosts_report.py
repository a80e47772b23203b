"""Turns bench/multi_hosts.sh's JSON lines into bench/README.md's tables (between the
<!-- multi-hosts --> and <!-- check-cost --> markers) and one plot per link rate
(bench/multi_hosts_<rate>.svg): step time per layout and configuration against PyTorch DDP and
FSDP2 (medians over rounds); the bytes that left host 0 per step (its link's counter, all of its
ranks, TCP/IP headers included) against theory (step_bench's cross_host_theory_per_rank times the
ranks per machine: what the strategy must send off a machine) and against FSDP2's; and the collective
check's cost as the median of paired ratios (on / off of the same round) with the smallest and
largest."""
import json
import os
import platform
import statistics
import subprocess
import sys
import time

from report import line_chart, replace_between_markers

ORDER = ["FULL_SHARD", "SHARD_GRAD_OP", "HYBRID_SHARD"]


def name_of(row):
    group = row.get("reshard_after_forward", 0)
    if row["strategy"] in ("DDP", "FSDP2"):
        return "PyTorch " + row["strategy"] + (f", reshard_after_forward={group}" if group else "")
    if row.get("table") == "two-level":
        return row["strategy"] + ", two levels everywhere"
    return row["strategy"] + (f", reshard_after_forward={group} (hpZ)" if group else "")


def layout_key(layout):
    machines, per_machine = layout.split("x")
    return int(machines) * int(per_machine), int(machines)


def machine_line():
    cores = subprocess.run(["nproc"], capture_output=True, text=True).stdout.strip()
    return f"{platform.node()} ({platform.machine()}, {cores} cores shared by every machine)"


def main():
    results_path, readme_path, command = sys.argv[1], sys.argv[2], sys.argv[3]
    rows = [json.loads(line) for line in open(results_path) if line.strip().startswith("{")]
    steps = [row for row in rows if row.get("benchmark") == "step" and "check_round" not in row]
    pairs = [row for row in rows if row.get("benchmark") == "step" and "check_round" in row]
    runs = {}
    for row in steps:
        runs.setdefault((row["link_rate"], row["layout"], name_of(row)), []).append(row)

    def median(key, field):
        values = [row[field] for row in runs.get(key, []) if row.get(field) is not None and row.get(field, -1) >= 0]
        return statistics.median(values) if values else None

    def ratio(a, b):
        return f"{a / b:.2f}" if a and b else "-"

    def mb(value):
        return f"{value / 1e6:.1f}" if value is not None else "-"

    rounds = max((len(group) for group in runs.values()), default=0)
    lines = ["<!-- multi-hosts -->", "",
             f"Measured {time.strftime('%Y-%m-%d %H:%M')} on {machine_line()} with `{command}`; medians over "
             f"{rounds} round(s). Off host 0: the bytes its link sent per step (its ranks' payload plus TCP/IP "
             "headers); theory: what the strategy must send off a machine; / FSDP2: against FSDP2's bytes.", ""]
    rates = sorted({rate for (rate, _, _) in runs}, key=lambda rate: (len(rate), rate))
    for rate in rates:
        lines += [f"Links of {rate}:", "",
                  "| layout (machines x ranks) | configuration | step (s) | / DDP | / FSDP2 | off host 0 per step (MB) "
                  "| theory (MB) | measured / theory | bytes / FSDP2's |",
                  "|---|---|---|---|---|---|---|---|---|"]
        layouts = sorted({layout for (r, layout, _) in runs if r == rate}, key=layout_key)
        series = {}
        for layout in layouts:
            names = sorted({name for (r, l, name) in runs if r == rate and l == layout},
                           key=lambda name: (name.startswith("PyTorch"), ORDER.index(name) if name in ORDER else 9, name))
            ddp = median((rate, layout, "PyTorch DDP"), "median_step_s")
            fsdp2 = median((rate, layout, "PyTorch FSDP2"), "median_step_s")
            fsdp2_sent = median((rate, layout, "PyTorch FSDP2"), "link_tx_bytes_per_step")
            for name in names:
                key = (rate, layout, name)
                step = median(key, "median_step_s")
                sent = median(key, "link_tx_bytes_per_step")
                per_rank = median(key, "cross_host_theory_per_rank")
                per_machine = runs[key][0].get("ranks_per_machine") or int(layout.split("x")[1])
                theory = per_rank * per_machine if per_rank is not None else None
                lines.append(f"| {layout.replace('x', ' x ')} | {name} | {step:.3f} | {ratio(step, ddp)} "
                             f"| {ratio(step, fsdp2)} | {mb(sent)} | {mb(theory)} "
                             f"| {ratio(sent, theory) if theory else '-'} | {ratio(sent, fsdp2_sent)} |")
                if "hpZ" not in name and "reshard" not in name and "everywhere" not in name:
                    series.setdefault(name.replace("PyTorch ", ""), []).append((layout, step))
        lines.append("")
        plot = f"multi_hosts_{rate}.svg"
        if series:
            line_chart(os.path.join(os.path.dirname(readme_path), plot),
                       f"Step time per layout, links of {rate} (machines x ranks)", "layout", "step (s)", series)
            lines += [f"![step time per layout at {rate}]({plot})", ""]
    lines.append("<!-- /multi-hosts -->")
    replace_between_markers(readme_path, "multi-hosts", lines)

    # The check's cost: per layout, the ratio on/off of each round's pair.
    by_round = {}
    for row in pairs:
        by_round.setdefault((row["layout"], row["link_rate"]), {}).setdefault(row["check_round"], {})[
            row["check_collectives"]] = row["median_step_s"]
    cost = ["<!-- check-cost -->", "",
            f"Measured {time.strftime('%Y-%m-%d %H:%M')} on {machine_line()} with `{command}`: FULL_SHARD with "
            "FSDP_CHECK_COLLECTIVES=1 and =0 in paired rounds (on then off in odd rounds, off then on in even ones); "
            "each round's ratio is its two median step times.", "",
            "| layout (machines x ranks) | link | pairs | step, check on (s, median) | check off (s, median) "
            "| cost: median of paired ratios | smallest | largest |",
            "|---|---|---|---|---|---|---|---|"]
    for (layout, rate), rounds_of in sorted(by_round.items(), key=lambda item: (item[0][1] != "loopback",
                                                                                 layout_key(item[0][0]))):
        complete = [pair for pair in rounds_of.values() if 0 in pair and 1 in pair]
        if not complete:
            continue
        ratios = sorted(pair[1] / pair[0] - 1 for pair in complete)
        on = statistics.median(pair[1] for pair in complete)
        off = statistics.median(pair[0] for pair in complete)
        cost.append(f"| {layout.replace('x', ' x ')} | {rate} | {len(complete)} | {on:.3f} | {off:.3f} "
                    f"| {statistics.median(ratios) * 100:+.1f} % | {ratios[0] * 100:+.1f} % "
                    f"| {ratios[-1] * 100:+.1f} % |")
    cost += ["", "<!-- /check-cost -->"]
    replace_between_markers(readme_path, "check-cost", cost)


if __name__ == "__main__":
    main()
