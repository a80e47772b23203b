"""Turns bench/scale.sh's JSON lines into the scale table of bench/README.md (medians over rounds,
between the <!-- scale --> markers) and the plot bench/scale.svg (step time against N per peer)."""
import json
import os
import statistics
import sys

from report import line_chart, measured_on, replace_between_markers

PEERS = (("FULL_SHARD", 1, "FULL_SHARD"), ("FULL_SHARD", 0, "FULL_SHARD, check off"), ("DDP", None, "DDP"),
         ("FSDP2", None, "FSDP2"))


def main():
    results_path, readme_path, command = sys.argv[1], sys.argv[2], sys.argv[3]
    rows = [json.loads(line) for line in open(results_path) if line.strip().startswith("{")]
    runs = {}
    for row in rows:
        if row.get("benchmark") != "step":
            continue
        check = row.get("check_collectives") if row["strategy"] not in ("DDP", "FSDP2") else None
        runs.setdefault((row["strategy"], check, row["world_size"]), []).append(row)

    def median(key, field):
        values = [row[field] for row in runs.get(key, []) if field in row]
        return statistics.median(values) if values else None

    worlds = sorted({world for (_, _, world) in runs})
    rounds = max((len(group) for group in runs.values()), default=0)
    lines = ["<!-- scale -->", "",
             measured_on(command) + f"; medians over {rounds} rounds. Every rank runs one thread; past 2 ranks the cores are oversubscribed, "
             "so compare within a row, not down the columns.", "",
             "| ranks | FULL_SHARD step (s) | check off (s) | check cost (paired) | / DDP | / FSDP2 | DDP (s) | FSDP2 (s) "
             f"| setup (s) | start to first step (s) | / N={worlds[0] if worlds else '-'} "
             "| control bytes by then, rank 0 | check off |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    first_at_two = median(("FULL_SHARD", 1, worlds[0]), "start_to_first_step_s") if worlds else None

    def cell(value, digits=3):
        return f"{value:.{digits}f}" if value is not None else "-"

    for world in worlds:
        on, off = median(("FULL_SHARD", 1, world), "median_step_s"), median(("FULL_SHARD", 0, world), "median_step_s")
        ddp, fsdp2 = median(("DDP", None, world), "median_step_s"), median(("FSDP2", None, world), "median_step_s")
        first = median(("FULL_SHARD", 1, world), "start_to_first_step_s")
        setup = median(("FULL_SHARD", 1, world), "setup_s")
        control = median(("FULL_SHARD", 1, world), "control_bytes")
        control_off = median(("FULL_SHARD", 0, world), "control_bytes")
        # The check's cost: the median of each round's ratio (its on and off runs are a pair), with the
        # smallest and largest.
        ons, offs = runs.get(("FULL_SHARD", 1, world), []), runs.get(("FULL_SHARD", 0, world), [])
        ratios = sorted(a["median_step_s"] / b["median_step_s"] - 1 for a, b in zip(ons, offs))
        cost = (f"{statistics.median(ratios) * 100:+.1f} % ({ratios[0] * 100:+.1f} to {ratios[-1] * 100:+.1f})"
                if ratios else "-")
        lines.append(f"| {world} | {cell(on)} | {cell(off)} | {cost} | {cell(on / ddp if on and ddp else None, 2)} "
                     f"| {cell(on / fsdp2 if on and fsdp2 else None, 2)} | {cell(ddp)} | {cell(fsdp2)} | {cell(setup, 2)} | {cell(first, 2)} "
                     f"| {cell(first / first_at_two if first and first_at_two else None, 2)} "
                     f"| {int(control) if control is not None else '-'} "
                     f"| {int(control_off) if control_off is not None else '-'} |")
    lines += ["", "![step time against ranks](scale.svg)", ""]
    lines.append("<!-- /scale -->")
    series = {}
    for strategy, check, name in PEERS:
        points = [(world, median((strategy, check, world), "median_step_s")) for world in worlds]
        points = [(x, y) for x, y in points if y is not None]
        if points:
            series[name] = points
    if series:
        line_chart(os.path.join(os.path.dirname(readme_path), "scale.svg"), "Step time against ranks (one machine)",
                   "ranks", "median step (s)", series)
    replace_between_markers(readme_path, "scale", lines)


if __name__ == "__main__":
    main()
