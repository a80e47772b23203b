#!/usr/bin/env bash
# Several machines on this one (bench/hosts.sh: network namespaces, each with a link of
# BENCH_LINK_RATES to a switch, shaped with tbf; this kernel has no netem, so no added delay), and one
# job over all of them per configuration: step_bench FULL_SHARD, SHARD_GRAD_OP, HYBRID_SHARD and hpZ
# (FULL_SHARD with --reshard-after-forward <ranks per machine>), FULL_SHARD with two levels wherever
# they apply (bench/two_level_table.tsv instead of the built-in table), PyTorch DDP, FSDP2 and FSDP2
# with the same int, on the MLP of the scale run. Every machine shares this machine's cores: compare within a
# layout, not across. BENCH_ROUNDS rounds (default 1); the configurations alternate within a round.
# Then the collective check's cost (Note [Collective check]): FULL_SHARD with FSDP_CHECK_COLLECTIVES
# on and off, in BENCH_CHECK_ROUNDS (default 5) paired rounds whose order alternates, at the layouts
# of BENCH_CHECK_LAYOUTS (default "2x8") and on one machine at BENCH_CHECK_WORLD_SIZES (default "16"):
# the median of the paired ratios, with the smallest and largest. Rewrites the tables between the
# <!-- multi-hosts --> and <!-- check-cost --> markers of bench/README.md and bench/multi_hosts.svg.
#   sudo bench/multi_hosts.sh
#   BENCH_LAYOUTS="2x4" BENCH_LINK_RATES=1gbit BENCH_CHECK_ROUNDS=0 sudo -E bench/multi_hosts.sh
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/paths.sh"
source "$root/bench/hosts.sh"
read -r -a layouts <<< "${BENCH_LAYOUTS:-2x2 2x4 2x8 4x2 4x4}"
read -r -a rates <<< "${BENCH_LINK_RATES:-1gbit 10gbit}"
rounds="${BENCH_ROUNDS:-1}"
check_rounds="${BENCH_CHECK_ROUNDS:-5}"
read -r -a check_layouts <<< "${BENCH_CHECK_LAYOUTS:-2x8}"
read -r -a check_world_sizes <<< "${BENCH_CHECK_WORLD_SIZES:-16}"
sizes=(--width 512 --hidden 2048 --blocks 8 --batch 64 --steps 6)
results="${BENCH_RESULTS:-$(mktemp -d)/multi_hosts.jsonl}"
echo "bench: results in $results" >&2

# A JSON line's own fields, added to what the program printed: the layout and the link.
tagged() {
  local layout="$1" rate="$2" extra="$3"
  shift 3
  local lines
  lines="$(mktemp)"
  hosts_launch "${layout#*x}" "$lines" "$@"
  sed "s/^{/{\"layout\": \"$layout\", \"link_rate\": \"$rate\"$extra, /" "$lines" >> "$results"
  rm -f "$lines"
}

for rate in "${rates[@]}"; do
  for layout in "${layouts[@]}"; do
    machines="${layout%x*}" per_machine="${layout#*x}"
    hosts_up "$machines" "$rate"
    for round in $(seq "$rounds"); do
      for strategy in FULL_SHARD SHARD_GRAD_OP HYBRID_SHARD; do
        tagged "$layout" "$rate" "" "$bin/step_bench" --strategy "$strategy" "${sizes[@]}"
      done
      tagged "$layout" "$rate" "" "$bin/step_bench" --strategy FULL_SHARD --reshard-after-forward "$per_machine" \
        "${sizes[@]}"
      # FULL_SHARD with two levels wherever they apply, whatever the built-in table measured fastest here.
      export FSDP_COLLECTIVE_TABLE="$root/bench/two_level_table.tsv"
      tagged "$layout" "$rate" ", \"table\": \"two-level\"" "$bin/step_bench" --strategy FULL_SHARD "${sizes[@]}"
      unset FSDP_COLLECTIVE_TABLE
      for peer in ddp fsdp2; do
        tagged "$layout" "$rate" "" "$python" "$root/bench/torch_peer.py" --peer "$peer" "${sizes[@]}"
      done
      tagged "$layout" "$rate" "" "$python" "$root/bench/torch_peer.py" --peer fsdp2 \
        --reshard-after-forward "$per_machine" "${sizes[@]}"
    done
    echo "bench: $layout at $rate done" >&2
  done
done

# The check's cost: pairs of runs, on then off in odd rounds and off then on in even ones.
if ((check_rounds > 0)); then
  for layout in "${check_layouts[@]}"; do
    hosts_up "${layout%x*}" "${rates[0]}"
    for round in $(seq "$check_rounds"); do
      order=(1 0)
      ((round % 2 == 0)) && order=(0 1)
      for check in "${order[@]}"; do
        export FSDP_CHECK_COLLECTIVES=$check
        tagged "$layout" "${rates[0]}" ", \"check_round\": $round" "$bin/step_bench" --strategy FULL_SHARD "${sizes[@]}"
      done
      unset FSDP_CHECK_COLLECTIVES
    done
    echo "bench: check cost at $layout done" >&2
  done
  hosts_down
  for n in "${check_world_sizes[@]}"; do
    for round in $(seq "$check_rounds"); do
      order=(1 0)
      ((round % 2 == 0)) && order=(0 1)
      for check in "${order[@]}"; do
        FSDP_CHECK_COLLECTIVES=$check "$bin/fsdp" launch --nproc-per-node "$n" --master-port 0 -- \
          "$bin/step_bench" --strategy FULL_SHARD "${sizes[@]}" |
          sed "s/^{/{\"layout\": \"1x$n\", \"link_rate\": \"loopback\", \"check_round\": $round, /" >> "$results"
      done
    done
    echo "bench: check cost at N = $n on one machine done" >&2
  done
fi
"$python" "$root/bench/multi_hosts_report.py" "$results" "$root/bench/README.md" \
  "bench/multi_hosts.sh (layouts ${layouts[*]}, links ${rates[*]}, $rounds round(s); check cost: $check_rounds paired rounds at ${check_layouts[*]} and N = ${check_world_sizes[*]})"
