"""Turns bench/run.sh's JSON lines into the tables of bench/README.md (medians over rounds) and the
plots bench/step_time.svg and bench/memory.svg."""
import json
import os
import platform
import statistics
import subprocess
import sys
import time

STRATEGIES = ("FULL_SHARD", "SHARD_GRAD_OP", "HYBRID_SHARD", "NO_SHARD", "DDP", "FSDP2")
PEERS = ("DDP", "FSDP2")
COLORS = {"FULL_SHARD": "#1f77b4", "SHARD_GRAD_OP": "#2ca02c", "HYBRID_SHARD": "#ff7f0e", "NO_SHARD": "#9467bd", "DDP": "#d62728", "FSDP2": "#8c564b",
          "FULL_SHARD, prefetch off": "#7fb3d5", "16 B/param / N": "#7f7f7f"}


def replace_between_markers(readme_path, marker, lines):
    """Writes `lines` (which begin and end with the markers) over the text between <!-- marker -->
    and <!-- /marker --> of readme_path, through a temporary file."""
    text = open(readme_path).read()
    opening, closing = f"<!-- {marker} -->", f"<!-- /{marker} -->"
    if opening not in text or closing not in text:
        raise SystemExit(f"{readme_path} has no {opening} ... {closing} markers to write between")
    start, end = text.index(opening), text.index(closing) + len(closing)
    with open(readme_path + ".tmp", "w") as handle:
        handle.write(text[:start] + "\n".join(lines) + text[end:])
    os.replace(readme_path + ".tmp", readme_path)


def measured_on(command):
    """The first line of a table a script writes: when, on which machine, with which command."""
    return (f"Measured {time.strftime('%Y-%m-%d %H:%M')} on {platform.node()} ({platform.machine()}, "
            f"{len(os.sched_getaffinity(0))} cores) with `{command}`")


def run_logged(command, log):
    """Runs `command` with its output in the file `log` and returns that output; exits naming the
    command, its status and the output's end when it fails."""
    with open(log, "w") as out:
        code = subprocess.run(command, stdout=out, stderr=subprocess.STDOUT).returncode
    with open(log) as out:
        text = out.read()
    if code != 0:
        sys.exit(f"bench: {' '.join(command)} failed ({code}):\n{text[-4000:]}")
    return text


def line_chart(path, title, x_label, y_label, series):
    """A small SVG line chart: `series` maps a name to [(x, y), ...]; x values are placed evenly."""
    width, height, left, right, top, bottom = 640, 380, 70, 190, 40, 50
    xs = sorted({x for points in series.values() for x, _ in points})
    y_max = max(y for points in series.values() for _, y in points) * 1.1
    plot_width, plot_height = width - left - right, height - top - bottom

    def px(x):
        return left + (xs.index(x) + 0.5) * plot_width / len(xs)

    def py(y):
        return top + plot_height * (1 - y / y_max)

    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" font-family="sans-serif" font-size="12">',
           f'<rect width="{width}" height="{height}" fill="white"/>',
           f'<text x="{left}" y="22" font-size="14">{title}</text>',
           f'<line x1="{left}" y1="{top + plot_height}" x2="{left + plot_width}" y2="{top + plot_height}" stroke="black"/>',
           f'<line x1="{left}" y1="{top}" x2="{left}" y2="{top + plot_height}" stroke="black"/>',
           f'<text x="{left + plot_width / 2}" y="{height - 12}" text-anchor="middle">{x_label}</text>',
           f'<text transform="translate(16 {top + plot_height / 2}) rotate(-90)" text-anchor="middle">{y_label}</text>']
    for tick in range(6):
        value = y_max * tick / 5
        out.append(f'<line x1="{left - 4}" y1="{py(value):.1f}" x2="{left + plot_width}" y2="{py(value):.1f}" stroke="#eee"/>')
        out.append(f'<text x="{left - 8}" y="{py(value) + 4:.1f}" text-anchor="end">{value:.3g}</text>')
    for x in xs:
        out.append(f'<text x="{px(x):.1f}" y="{top + plot_height + 18}" text-anchor="middle">{x}</text>')
    for index, (name, points) in enumerate(series.items()):
        color = COLORS.get(name, "#333")
        points = sorted(points)
        dash = ' stroke-dasharray="5 4"' if name.startswith("16 B") or "off" in name else ""
        out.append(f'<polyline fill="none" stroke="{color}" stroke-width="2"{dash} points="'
                   + " ".join(f"{px(x):.1f},{py(y):.1f}" for x, y in points) + '"/>')
        for x, y in points:
            out.append(f'<circle cx="{px(x):.1f}" cy="{py(y):.1f}" r="3" fill="{color}"/>')
        legend_y = top + 10 + index * 20
        out.append(f'<line x1="{width - right + 15}" y1="{legend_y}" x2="{width - right + 40}" y2="{legend_y}" '
                   f'stroke="{color}" stroke-width="2"{dash}/>')
        out.append(f'<text x="{width - right + 46}" y="{legend_y + 4}">{name}</text>')
    out.append("</svg>")
    with open(path + ".tmp", "w") as handle:
        handle.write("\n".join(out) + "\n")
    os.replace(path + ".tmp", path)


def main():
    results_path, readme_path, smoke, command = sys.argv[1], sys.argv[2], sys.argv[3] == "1", sys.argv[4]
    rows = [json.loads(line) for line in open(results_path) if line.strip().startswith("{")]
    steps = {}
    for row in rows:
        if row["benchmark"] == "step":
            strategy = row["strategy"] + (", retained memory limited" if row.get("host_memory") == "limit" else "")
            key = (row.get("model", "mlp"), row["parameters"], strategy, row.get("prefetch", "on"), row["world_size"])
            steps.setdefault(key, []).append(row)

    def median(key, group):
        values = [row[key] for row in steps[group]]
        return statistics.median(values)

    rounds = max(len(v) for v in steps.values()) if steps else 0
    lines = ["<!-- results -->", "",
             measured_on(command) + f"; medians over {rounds} rounds.", ""]

    # The benchmark model of each kind is the one DDP ran at several world sizes; other sizes are the
    # memory-cap demonstration.
    main_sizes = {}
    for (model, parameters, strategy, _, world) in steps:
        if strategy == "DDP":
            main_sizes.setdefault(model, {}).setdefault(parameters, set()).add(world)
    main_sizes = {model: max(sizes, key=lambda p: (len(sizes[p]), -p)) for model, sizes in main_sizes.items()}

    for model in sorted(main_sizes):
        parameters = main_sizes[model]
        worlds = sorted({w for (m, p, _, _, w) in steps if m == model and p == parameters and w > 1})
        lines += [f"**{model}** ({parameters / 1e6:.1f} M parameters)", "",
                  "| ranks | strategy | prefetch | step (s) | / DDP | / FSDP2 | bytes sent per step per rank (counters) "
                  "| / theory | loopback bytes per step, all ranks | / FSDP2 | loopback / counters | model state per rank "
                  "| / formula | unsharded peak / two largest units | peak RSS (MB) | / FSDP2 |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for world in worlds:
            peer = {}
            for name in PEERS:
                key = (model, parameters, name, "-", world)
                if key in steps:
                    peer[name] = {field: median(field, key) for field in ("median_step_s", "loopback_bytes_per_step", "peak_rss_mb")
                                  if all(field in row for row in steps[key])}

            def ratio(value, name, field, digits=2):
                other = peer.get(name, {}).get(field)
                return f"{value / other:.{digits}f}" if value is not None and value >= 0 and other and other > 0 else "-"
            for strategy in STRATEGIES:
                for prefetch in ("on", "off", "-"):
                    key = (model, parameters, strategy, prefetch, world)
                    if key not in steps:
                        continue
                    step = median("median_step_s", key)
                    ours = strategy not in PEERS
                    sent = median("bytes_sent_per_step", key) if ours else None
                    theory = median("bytes_theory", key) if ours else None
                    wire = median("loopback_bytes_per_step", key) if all("loopback_bytes_per_step" in row for row in steps[key]) else -1
                    state = median("model_state_bytes_per_rank", key)
                    formula = median("model_state_formula", key) if ours else None
                    working = median("unsharded_peak_bytes", key) if ours else -1
                    units = median("two_largest_units_bytes", key) if ours else 0
                    rss = median("peak_rss_mb", key)
                    lines.append(
                        f"| {world} | {strategy} | {prefetch} | {step:.3f} | {ratio(step, 'DDP', 'median_step_s')} | "
                        f"{ratio(step, 'FSDP2', 'median_step_s')} | "
                        + (f"{sent / 1e6:.1f} MB | {sent / theory:.4f} | " if ours else "(Gloo's own) | - | ")
                        + (f"{wire / 1e6:.1f} MB | {ratio(wire, 'FSDP2', 'loopback_bytes_per_step')} | " if wire >= 0 else "- | - | ")
                        + (f"{wire / (sent * world):.4f} | " if ours and wire >= 0 and sent else "- | ")
                        + f"{state / 1e6:.1f} MB | " + (f"{state / formula:.3f} | " if ours else "- | ")
                        + (f"{working / units:.3f} | " if working >= 0 and units > 0 and strategy != "NO_SHARD" else "- | ")
                        + f"{rss:.0f} | {ratio(rss, 'FSDP2', 'peak_rss_mb')} |")
        single = (model, parameters, "SINGLE", "on", 1)
        if single in steps:
            lines.append(f"| 1 | single process, whole batch (compute floor) | | {median('median_step_s', single):.3f} | | | | | | | | "
                         f"{median('model_state_bytes_per_rank', single) / 1e6:.1f} MB | | | "
                         f"{median('peak_rss_mb', single):.0f} | |")
        lines.append("")

    # Memory cap: DDP's own peak on the benchmark model is the cap; a straight line through each
    # peer's two measured sizes at N = 4 gives the largest model that fits under it.
    demo = sorted({p for (m, p, s, _, w) in steps if m == "mlp" and w == 4 and p != main_sizes.get("mlp")})
    base = main_sizes.get("mlp")
    peers = [(s, pf) for s, pf in (("FULL_SHARD", "on"), ("FULL_SHARD, retained memory limited", "on"), ("DDP", "-"))
             if demo and base and all(("mlp", p, s, pf, 4) in steps for p in (base, demo[-1]))]
    if any(s == "DDP" for s, _ in peers):
        big = demo[-1]
        cap = median("peak_rss_mb", ("mlp", base, "DDP", "-", 4))
        lines += [f"**Memory cap at 4 ranks.** Cap = DDP's own peak RSS per rank on the {base / 1e6:.1f} M model: "
                  f"{cap:.0f} MB. Both peers were also run on a {big / 1e6:.1f} M model.", "",
                  "| peer | peak RSS at " + f"{base / 1e6:.1f} M (MB) | peak RSS at {big / 1e6:.1f} M (MB) | "
                  "MB per M parameters | largest model under the cap (M parameters) |", "|---|---|---|---|---|"]
        for strategy, prefetch in peers:
            small_rss = median("peak_rss_mb", ("mlp", base, strategy, prefetch, 4))
            big_rss = median("peak_rss_mb", ("mlp", big, strategy, prefetch, 4))
            slope = (big_rss - small_rss) / ((big - base) / 1e6)
            largest = base / 1e6 + (cap - small_rss) / slope
            lines.append(f"| {strategy} | {small_rss:.0f} | {big_rss:.0f} | {slope:.2f} | {largest:.1f} |")
        lines += ["", "The largest sizes are arithmetic (a straight line through the two measured peaks of each "
                  "peer); the two runs per peer are real. \"retained memory limited\" adds "
                  "limit_retained_host_memory() (host_memory.h), which returns freed large blocks to the system "
                  "at the cost of page faults (compare its step time in the raw lines). DDP runs as PyTorch ships it.", ""]

    collectives = [row for row in rows if row["benchmark"] == "collectives"]
    if collectives:
        lines += ["| ranks | buffer | our all-gather (s) | our reduce-scatter (s) | Gloo all-reduce (s) | all-gather / all-reduce "
                  "| reduce-scatter / all-reduce | Gloo all-gather (s) | Gloo reduce-scatter (s) | ours / Gloo all-gather "
                  "| ours / Gloo reduce-scatter |", "|---|---|---|---|---|---|---|---|---|---|---|"]
        for row in collectives:
            native = "native_all_gather_s" in row
            lines.append(f"| {row['world_size']} | {row['bytes'] / 1e6:.0f} MB | {row['all_gather_s']:.4f} | "
                         f"{row['reduce_scatter_s']:.4f} | {row['all_reduce_s']:.4f} | "
                         f"{row['all_gather_s'] / row['all_reduce_s']:.2f} | {row['reduce_scatter_s'] / row['all_reduce_s']:.2f} | "
                         + (f"{row['native_all_gather_s']:.4f} | {row['native_reduce_scatter_s']:.4f} | "
                            f"{row['all_gather_s'] / row['native_all_gather_s']:.2f} | "
                            f"{row['reduce_scatter_s'] / row['native_reduce_scatter_s']:.2f} |" if native else "- | - | - | - |"))
        lines.append("")
    checkpoints = [row for row in rows if row["benchmark"] == "sharded_checkpoint"]
    if checkpoints:
        lines += ["| ranks | checkpoint | SHARDED save, fsynced (s) | load of own rows (s) | cp + sync (s) | save / cp |",
                  "|---|---|---|---|---|---|"]
        for row in checkpoints:
            lines.append(f"| {row['world_size']} | {row['bytes'] / 1e6:.0f} MB | {row['save_s']:.4f} | {row['load_s']:.4f} | "
                         f"{row['cp_fsync_s']:.4f} | {row['save_s'] / row['cp_fsync_s']:.2f} |")
        lines.append("")
    for row in rows:
        if row["benchmark"] == "merge":
            def rounds(key):
                return ", ".join(f"{value:.2f}" for value in row[key])
            lines += [f"{row['bytes'] / 1e9:.2f} GB saved by 4 ranks and merged, {row['rounds']} paired rounds: "
                      f"save / (cp + sync) {rounds('save_to_cp_fsync')} (median {row['median_save_to_cp_fsync']:.2f}), "
                      f"merge / (cp + sync) {rounds('merge_to_cp_fsync')} (median {row['median_merge_to_cp_fsync']:.2f}); "
                      f"merge peak RSS {row['merge_peak_rss_mb']:.0f} MB", ""]
    if "mlp" in main_sizes:
        lines += ["![step time against ranks](step_time.svg) ![memory per rank against ranks](memory.svg)", ""]
    lines += ["Raw lines:", "", "```"] + [json.dumps(row) for row in rows] + ["```", "", "<!-- /results -->"]
    print("\n".join(lines))
    if smoke:
        return
    if "mlp" in main_sizes:
        write_plots(steps, main_sizes["mlp"], os.path.dirname(readme_path), median)
    text = open(readme_path).read()
    start, end = text.index("<!-- results -->"), text.index("<!-- /results -->") + len("<!-- /results -->")
    open(readme_path, "w").write(text[:start] + "\n".join(lines) + text[end:])


def write_plots(steps, parameters, directory, median):
    single = ("mlp", parameters, "SINGLE", "on", 1)
    timing, memory = {}, {}
    for (model, size, strategy, prefetch, world), _ in steps.items():
        if model != "mlp" or size != parameters or strategy not in STRATEGIES:
            continue
        name = strategy if prefetch in ("on", "-") else f"{strategy}, prefetch off"
        timing.setdefault(name, []).append((world, median("median_step_s", (model, size, strategy, prefetch, world))))
        if prefetch in ("on", "-"):
            memory.setdefault(strategy, []).append(
                (world, median("model_state_bytes_per_rank", (model, size, strategy, prefetch, world)) / 1e6))
    if single in steps:
        for name in timing:
            timing[name].append((1, median("median_step_s", single)))
        for name in memory:
            memory[name].append((1, median("model_state_bytes_per_rank", single) / 1e6))
    worlds = sorted({w for points in memory.values() for w, _ in points})
    memory["16 B/param / N"] = [(w, 16 * parameters / w / 1e6) for w in worlds]
    line_chart(os.path.join(directory, "step_time.svg"), f"Training step, MLP model ({parameters / 1e6:.1f} M parameters)",
               "ranks (N = 1: single process)", "median step time (s)", timing)
    line_chart(os.path.join(directory, "memory.svg"), "Model state per rank (parameters, gradients, AdamW)",
               "ranks", "MB per rank", memory)


if __name__ == "__main__":
    main()
