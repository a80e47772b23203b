#!/usr/bin/env bash
# The scale run: FULL_SHARD with the collective check on and off (Note [Collective check]; on then off
# in odd rounds, off then on in even ones, so each round's pair is a paired ratio), PyTorch's DDP and
# FSDP2 on the same model, global batch and one thread per rank, at N = 2, 4, 8, 16 ranks on this
# machine. Oversubscribed past its cores: compare peers within an N, not across. Peers alternate
# within a round so that machine noise hits them alike; medians over rounds. Also the time from main()
# to the end of the first step (rendezvous, model, fully_shard's agreements, one step) and the bytes
# rank 0 sent on the control channel by then (Note [Agreement by digest]). The collectives' own sweep
# is bench/collective_table.sh. Rewrites the table in bench/README.md between the <!-- scale -->
# markers.
#   bench/scale.sh                 N = 2 4 8 16, BENCH_ROUNDS rounds (default 3)
#   BENCH_WORLD_SIZES="2 4" bench/scale.sh
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/paths.sh"
read -r -a world_sizes <<< "${BENCH_WORLD_SIZES:-2 4 8 16}"
rounds="${BENCH_ROUNDS:-3}"
sizes=(--width 512 --hidden 2048 --blocks 8 --batch 64 --steps 6)
results="$(mktemp -d)/scale.jsonl"
launch() {
  "$bin/fsdp" launch --nproc-per-node "$1" --master-port 0 -- "${@:2}" >> "$results" ||
    { echo "bench: failed: fsdp launch --nproc-per-node $1 -- ${*:2}" >&2; return 1; }
}
for round in $(seq "$rounds"); do
  order=(1 0)
  ((round % 2 == 0)) && order=(0 1)
  for n in "${world_sizes[@]}"; do
    for check in "${order[@]}"; do
      FSDP_CHECK_COLLECTIVES=$check launch "$n" "$bin/step_bench" --strategy FULL_SHARD "${sizes[@]}"
    done
    for peer in ddp fsdp2; do
      launch "$n" "$python" "$root/bench/torch_peer.py" --peer "$peer" "${sizes[@]}"
    done
  done
  echo "bench: scale round $round of $rounds done" >&2
done
"$python" "$root/bench/scale_report.py" "$results" "$root/bench/README.md" "bench/scale.sh (N = ${world_sizes[*]}, $rounds rounds)"
