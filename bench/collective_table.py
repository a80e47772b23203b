"""bench/collective_table.sh's second half: merges the rows each sweep wrote (collective_bench --sweep
--table) into the engine's table, src/dist/collective_algorithms.tsv (Note [Algorithms by
measurement]), and writes the measurements between the <!-- collective-table --> markers of
bench/README.md: per group layout, collective and algorithm, the median time of each size in ms
with the fastest and slowest round, the fastest algorithm in bold.

    collective_table.py WORK_DIR RESULTS.jsonl TABLE.tsv README.md COMMAND
"""
import glob
import json
import os
import platform
import subprocess
import sys
import time

from report import replace_between_markers

COLUMNS = "operation\tmachines\tranks_per_machine\tmax_bytes\talgorithm"
OPERATIONS = ["all_gather", "reduce_scatter", "all_reduce"]


def merged_rows(work):
    """Every sweep's rows; a layout measured by two sweeps (the 4 x 1 group of one rank per machine is
    in the 4 x 2 and the 4 x 4 sweep) keeps the first file's rows."""
    rows, owner = [], {}
    for path in sorted(glob.glob(os.path.join(work, "rows_*.tsv"))):
        for line in open(path):
            line = line.strip()
            if not line or line.startswith("#") or "\t".join(line.split()) == COLUMNS:
                continue
            fields = line.split()
            if len(fields) != 5:
                raise SystemExit(f"{path}: not a table row: {line!r}")
            if owner.setdefault((fields[0], fields[1], fields[2]), path) == path:
                rows.append(fields)
    size = lambda value: float("inf") if value == "-" else int(value)
    rows.sort(key=lambda f: (OPERATIONS.index(f[0]), int(f[1]), int(f[2]), size(f[3])))
    return rows


def main():
    work, results_path, table_path, readme_path, command = sys.argv[1:6]
    rows = merged_rows(work)
    cores = subprocess.run(["nproc"], capture_output=True, text=True).stdout.strip()
    stamp = time.strftime("%Y-%m-%d %H:%M")
    with open(table_path + ".tmp", "w") as handle:
        handle.write(f"# Note [Algorithms by measurement] (src/dist/collective_algorithm.h): written by {command}\n"
                     f"# on {stamp}, {platform.node()} ({platform.machine()}, {cores} cores; the machines of a layout\n"
                     "# share them). Columns: operation, machines, ranks per machine, the largest buffer in bytes the\n"
                     "# row is for (\"-\": any larger), the algorithm that was fastest there. Measure your own cluster\n"
                     "# with `collective_bench --sweep --table FILE` and set FSDP_COLLECTIVE_TABLE=FILE.\n")
        handle.write(COLUMNS + "\n")
        for fields in rows:
            handle.write("\t".join(fields) + "\n")
    os.replace(table_path + ".tmp", table_path)

    measured = [json.loads(line) for line in open(results_path) if line.strip().startswith("{")]
    cells = {}
    sizes = sorted({row["bytes"] for row in measured})
    for row in measured:
        key = (row["machines"], row["ranks_per_machine"], row["link_rate"], row["collective"])
        cells.setdefault(key, {}).setdefault(row["algorithm"], {})[row["bytes"]] = row
    lines = ["<!-- collective-table -->", "",
             f"Measured {stamp} on {platform.node()} ({platform.machine()}, {cores} cores) with `{command}`: the "
             "time of each collective, the slowest rank's, with two in flight at once (per collective), in ms: "
             "median over rounds (fastest-slowest round); the fastest of each size in bold. "
             "src/dist/collective_algorithms.tsv takes it where it is at least 10 % faster than the layout's "
             "default (direct; two_level_direct across machines), and a size whose choice differs from both "
             "neighbours' takes theirs (collective_bench's table_rows). Sizes are the full buffer.", "",
             "| layout (machines x ranks) | link | collective | algorithm | "
             + " | ".join(f"{size / 2 ** 20:g} MB" for size in sizes) + " |",
             "|---|---|---|---|" + "---|" * len(sizes)]
    order = sorted(cells, key=lambda key: (key[0] > 1, key[0] * key[1], key[0], OPERATIONS.index(key[3])))
    for key in order:
        machines, per_machine, rate, collective = key
        algorithms = cells[key]
        best = {size: min((entry[size]["median_s"], name) for name, entry in algorithms.items() if size in entry)[1]
                for size in sizes if any(size in entry for entry in algorithms.values())}
        for name in sorted(algorithms):
            entry = algorithms[name]
            texts = []
            for size in sizes:
                if size not in entry:
                    texts.append("-")
                    continue
                row = entry[size]
                text = f"{row['median_s'] * 1e3:.1f} ({row['fastest_s'] * 1e3:.1f}-{row['slowest_s'] * 1e3:.1f})"
                texts.append(f"**{text}**" if best.get(size) == name else text)
            lines.append(f"| {machines} x {per_machine} | {rate} | {collective} | {name} | " + " | ".join(texts) + " |")
    lines += ["", "<!-- /collective-table -->"]
    replace_between_markers(readme_path, "collective-table", lines)


if __name__ == "__main__":
    main()
