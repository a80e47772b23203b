#!/usr/bin/env bash
# What a SHARDED save and its load cost each rank in coordination as the ranks grow, against
# PyTorch's dcp.save / dcp.load of the same model under FSDP2: N = 2, 4, 8, 16, 32 on this machine
# (a small MLP and its AdamW state, so that the files are nothing and the coordination is all).
# Per rank: the collectives it issued, the CPU seconds of its process (every thread: on 2 cores
# with 32 processes wall time grows with N whatever the work) and, for fsdp.cpp, the exact bytes
# and point-to-point messages it sent (the control channel and the world's collectives; Note
# [metadata pieces]); for both, what the loopback carried for all ranks (the kernel's counter, read
# by rank 0 around the save and the load). Rows append to BENCH_RESULTS (default a temporary file)
# under BENCH_LABEL (default "now"; PyTorch's rows only with it), so a build of another commit can
# add its rows to the same table; the tables between the <!-- checkpoint-scale --> markers of
# bench/README.md are rewritten from every row there. About 6 minutes.
#   bench/checkpoint_scale.sh
#   BENCH_LABEL=before BENCH_RESULTS=/tmp/rows.jsonl FSDP_BUILD_DIR=/tmp/old/build bench/checkpoint_scale.sh
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/paths.sh"
label="${BENCH_LABEL:-now}"
results="${BENCH_RESULTS:-$(mktemp)}"
read -r -a world_sizes <<< "${BENCH_WORLD_SIZES:-2 4 8 16 32}"
shape=(--width 64 --hidden 128 --blocks 4 --batch 64 --steps 1)
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
row() {  # row <peer label> <command...>: the command's checkpoint line, tagged
  local tag="$1"
  shift
  "$@" | grep '"benchmark": "checkpoint"' |
    sed "s/^{/{\"label\": \"$tag\", \"measured\": \"$(date '+%Y-%m-%d %H:%M')\", /" >> "$results"
}
for n in "${world_sizes[@]}"; do
  row "$label" "$bin/fsdp" launch --nproc-per-node "$n" --master-port 0 -- "$bin/step_bench" --strategy FULL_SHARD \
    --model mlp "${shape[@]}" --checkpoint "$work/checkpoint"
  if [[ "$label" == now ]]; then
    row pytorch "$bin/fsdp" launch --nproc-per-node "$n" --master-port 0 -- "$python" "$root/bench/torch_peer.py" \
      --peer fsdp2 "${shape[@]}" --checkpoint "$work/torch"
  fi
  echo "bench: checkpoint coordination at N = $n done" >&2
done
"$python" - "$results" "$root/bench/README.md" "bench/checkpoint_scale.sh" <<'PY'
import json, platform, re, sys, time
rows = [json.loads(line) for line in open(sys.argv[1])]
names = {"before": "fsdp.cpp, before", "now": "fsdp.cpp", "pytorch": "PyTorch DCP"}
order = {"before": 0, "now": 1, "pytorch": 2}
times = sorted(row.get("measured", time.strftime("%Y-%m-%d %H:%M")) for row in rows)
lines = [f"Measured {times[0]} to {times[-1][-5:]} on {platform.node()} ({platform.machine()}) with `{sys.argv[3]}`: "
         "a SHARDED save (model and AdamW state) of a small MLP (4 blocks, 66 K parameters) and its load, "
         "fsdp.cpp against PyTorch's dcp.save / dcp.load under FSDP2 (get_state_dict and set_state_dict "
         "included). Collectives and CPU seconds: rank 0, then the most of any other rank; bytes: what "
         "fsdp.cpp's rank 0 and the most of any other rank sent (its own counters), and what the "
         "loopback carried divided by N (the kernel's counter, for both)."]
for part in ("save", "load"):
    lines += ["", f"| {part} | ranks | collectives per rank | bytes sent per rank (messages) | loopback bytes / N | "
              "CPU s per rank | wall s |", "|---|---|---|---|---|---|---|"]
    for row in sorted(rows, key=lambda r: (order.get(r["label"], 3), r["world_size"])):
        counts, n = row[part], row["world_size"]
        def pair(values, form):
            return f"{form(values[0])} / {form(max(values[1:]))}"
        sent = "-"
        if "sent_bytes" in counts:
            sent = (f"{counts['sent_bytes'][0]:.0f} ({counts['sent_messages'][0]:.0f}) / "
                    f"{max(counts['sent_bytes'][1:]):.0f} ({max(counts['sent_messages'][1:]):.0f})")
        loopback = f"{counts['loopback_bytes'] / n:.0f}" if counts["loopback_bytes"] >= 0 else "-"
        lines.append(f"| {names.get(row['label'], row['label'])} | {n} | {pair(counts['collectives'], lambda v: f'{v:.0f}')} | "
                     f"{sent} | {loopback} | {pair(counts['cpu_s'], lambda v: f'{v:.3f}')} | {row[part + '_s']:.3f} |")
readme = open(sys.argv[2]).read()
assert "<!-- checkpoint-scale -->" in readme, "bench/README.md has no <!-- checkpoint-scale --> markers"
block = "<!-- checkpoint-scale -->\n\n" + "\n".join(lines) + "\n\n<!-- /checkpoint-scale -->"
readme = re.sub(r"<!-- checkpoint-scale -->.*?<!-- /checkpoint-scale -->", lambda m: block, readme, flags=re.S)
open(sys.argv[2], "w").write(readme)
print("\n".join(lines))
PY
