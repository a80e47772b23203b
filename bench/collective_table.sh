#!/usr/bin/env bash
# Note [Algorithms by measurement]: measures every collective algorithm with `collective_bench
# --sweep` on one machine at N = BENCH_WORLD_SIZES (default "2 4 8 16") and on shaped machines at
# BENCH_LAYOUTS (default "2x2 2x4 4x2 4x4", links of BENCH_LINK_RATE, default 1gbit; bench/hosts.sh),
# BENCH_ROUNDS rounds each (default 3), with the check off (it sends nothing, so it costs every
# algorithm the same). Writes the fastest algorithm per (operation, layout, size) to
# src/dist/collective_algorithms.tsv, the table the library embeds (rebuild to use it), and the
# measurements between the <!-- collective-table --> markers of bench/README.md. Needs root for the
# namespaces; BENCH_LAYOUTS="" measures one machine only.
#   sudo bench/collective_table.sh
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/paths.sh"
source "$root/bench/hosts.sh"
read -r -a world_sizes <<< "${BENCH_WORLD_SIZES:-2 4 8 16}"
read -r -a layouts <<< "${BENCH_LAYOUTS-2x2 2x4 4x2 4x4}"
rate="${BENCH_LINK_RATE:-1gbit}"
rounds="${BENCH_ROUNDS:-3}"
work="$(mktemp -d)"
results="$work/sweep.jsonl"
export FSDP_CHECK_COLLECTIVES=0
for n in "${world_sizes[@]}"; do
  "$bin/fsdp" launch --nproc-per-node "$n" --master-port 0 -- "$bin/collective_bench" --sweep --rounds "$rounds" \
    --table "$work/rows_1x$n.tsv" | sed "s/^{/{\"link_rate\": \"loopback\", /" >> "$results"
  echo "bench: sweep on one machine at N = $n done" >&2
done
for layout in "${layouts[@]}"; do
  hosts_up "${layout%x*}" "$rate"
  lines="$work/lines"
  : > "$lines"
  # The table is written by rank 0, on host 0, into this machine's file system (namespaces share it).
  hosts_launch "${layout#*x}" "$lines" "$bin/collective_bench" --sweep --rounds "$rounds" \
    --table "$work/rows_$layout.tsv"
  sed "s/^{/{\"link_rate\": \"$rate\", /" "$lines" >> "$results"
  echo "bench: sweep on $layout machines at $rate done" >&2
done
hosts_down
"$python" "$root/bench/collective_table.py" "$work" "$results" "$root/src/dist/collective_algorithms.tsv" \
  "$root/bench/README.md" \
  "bench/collective_table.sh (one machine: N = ${world_sizes[*]}; machines: ${layouts[*]} at $rate; $rounds rounds)"
