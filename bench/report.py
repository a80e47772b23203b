"""Turns bench/run.sh's JSON lines into the tables of bench/README.md (medians over rounds)."""
import json
import platform
import statistics
import subprocess
import sys
import time


def main():
    results_path, readme_path, smoke, command = sys.argv[1], sys.argv[2], sys.argv[3] == "1", sys.argv[4]
    rows = [json.loads(line) for line in open(results_path) if line.strip().startswith("{")]
    steps = {}
    for row in rows:
        if row["benchmark"] == "step":
            steps.setdefault((row["strategy"], row["world_size"]), []).append(row)
    merge = [row for row in rows if row["benchmark"] == "merge"]

    def median(key, strategy, world):
        return statistics.median(row[key] for row in steps[(strategy, world)])

    lines = ["<!-- results -->", "",
             f"Measured {time.strftime('%Y-%m-%d %H:%M')} on {platform.node()} ({platform.machine()}, "
             f"{subprocess.run(['nproc'], capture_output=True, text=True).stdout.strip()} cores) with `{command}`; "
             f"medians over {max(len(v) for v in steps.values())} rounds.", "",
             "| ranks | strategy | step (s) | / DDP | bytes sent per step | / theory | model state per rank | / formula | peak RSS (MB) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for world in sorted({w for (_, w) in steps if w > 1}):
        ddp = median("median_step_s", "DDP", world) if ("DDP", world) in steps else None
        for strategy in ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "DDP"):
            if (strategy, world) not in steps:
                continue
            step = median("median_step_s", strategy, world)
            sent = median("bytes_sent_per_step", strategy, world) if strategy != "DDP" else None
            theory = median("bytes_theory", strategy, world) if strategy != "DDP" else None
            state = median("model_state_bytes_per_rank", strategy, world)
            formula = median("model_state_formula", strategy, world) if strategy != "DDP" else None
            lines.append(
                f"| {world} | {strategy} | {step:.3f} | {step / ddp:.2f} | "
                + (f"{sent / 1e6:.1f} MB | {sent / theory:.4f} | " if sent else "(Gloo's own) | - | ")
                + f"{state / 1e6:.1f} MB | " + (f"{state / formula:.3f} | " if formula else "- | ")
                + f"{median('peak_rss_mb', strategy, world):.0f} |")
    if ("SINGLE", 1) in steps:
        lines.append(f"| 1 | single process, whole batch (compute floor) | {median('median_step_s', 'SINGLE', 1):.3f} | | | | "
                     f"{median('model_state_bytes_per_rank', 'SINGLE', 1) / 1e6:.1f} MB | | "
                     f"{median('peak_rss_mb', 'SINGLE', 1):.0f} |")
    collectives = [row for row in rows if row["benchmark"] == "collectives"]
    if collectives:
        lines += ["", "| ranks | buffer | our all-gather (s) | our reduce-scatter (s) | Gloo all-reduce (s) | all-gather / all-reduce |",
                  "|---|---|---|---|---|---|"]
        for row in collectives:
            lines.append(f"| {row['world_size']} | {row['bytes'] / 1e6:.0f} MB | {row['all_gather_s']:.4f} | "
                         f"{row['reduce_scatter_s']:.4f} | {row['all_reduce_s']:.4f} | "
                         f"{row['all_gather_s'] / row['all_reduce_s']:.2f} |")
    checkpoints = [row for row in rows if row["benchmark"] == "sharded_checkpoint"]
    if checkpoints:
        lines += ["", "| ranks | checkpoint | SHARDED save, fsynced (s) | load of own rows (s) | cp + sync (s) | save / cp |",
                  "|---|---|---|---|---|---|"]
        for row in checkpoints:
            lines.append(f"| {row['world_size']} | {row['bytes'] / 1e6:.0f} MB | {row['save_s']:.4f} | {row['load_s']:.4f} | "
                         f"{row['cp_fsync_s']:.4f} | {row['save_s'] / row['cp_fsync_s']:.2f} |")
    for row in merge:
        lines += ["", f"merge of {row['bytes'] / 1e9:.2f} GB: {row['merge_seconds']:.2f} s; cp {row['cp_seconds']:.2f} s, "
                      f"cp + sync {row['cp_fsync_seconds']:.2f} s (ratio {row['ratio_to_cp_fsync']:.2f}); "
                      f"peak RSS {row['merge_peak_rss_mb']:.0f} MB"]
    lines += ["", "Raw lines:", "", "```"] + [json.dumps(row) for row in rows] + ["```", "", "<!-- /results -->"]
    print("\n".join(lines))
    if smoke:
        return
    text = open(readme_path).read()
    start, end = text.index("<!-- results -->"), text.index("<!-- /results -->") + len("<!-- /results -->")
    open(readme_path, "w").write(text[:start] + "\n".join(lines) + text[end:])


if __name__ == "__main__":
    main()
