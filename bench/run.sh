#!/usr/bin/env bash
# Runs every benchmark side by side on this machine and rewrites the tables in bench/README.md
# (between the <!-- results --> markers) with the machine, the date, the command and the raw numbers.
#   bench/run.sh            full sizes, world sizes 2 and 4, 3 alternating rounds (BENCH_ROUNDS; medians reported)
#   bench/run.sh --smoke    tiny sizes, 2 ranks, one round, README untouched (CI runs this)
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/paths.sh"  # root, bin, python (the peers run in the venv's torch)
smoke=0
[[ "${1:-}" == "--smoke" ]] && smoke=1
results="$(mktemp -d)/results.jsonl"
if (( smoke )); then
  sizes=(--width 32 --hidden 64 --blocks 2 --batch 8 --steps 2); world_sizes=(2); rounds=1
  llama=(--model llama --width 32 --hidden 64 --blocks 2 --batch 4 --length 8 --vocab 64 --steps 2)
  big_sizes=(--width 32 --hidden 64 --blocks 4 --batch 8 --steps 1)
else
  sizes=(--width 512 --hidden 2048 --blocks 8 --batch 64 --steps 8); world_sizes=(2 4); rounds="${BENCH_ROUNDS:-3}"
  llama=(--model llama --width 512 --hidden 1376 --blocks 4 --batch 8 --length 16 --vocab 4096 --steps 4)
  big_sizes=(--width 512 --hidden 2048 --blocks 24 --batch 64 --steps 2)
fi
# In the smoke run a launch that hangs fails within 5 minutes, naming itself (a full run has no limit).
launch() {
  local limit=()
  (( smoke )) && limit=(timeout 300)
  "${limit[@]}" "$bin/fsdp" launch --nproc-per-node "$1" --master-port 0 -- "${@:2}" >> "$results" ||
    { echo "bench: failed or hung: fsdp launch --nproc-per-node $1 -- ${*:2}" >&2; return 1; }
}
for round in $(seq "$rounds"); do
  for n in "${world_sizes[@]}"; do
    # Peers alternate within a round so that machine noise hits them alike.
    for strategy in FULL_SHARD SHARD_GRAD_OP NO_SHARD; do
      launch "$n" "$bin/step_bench" --strategy "$strategy" "${sizes[@]}"
    done
    launch "$n" "$bin/step_bench" --strategy FULL_SHARD --prefetch off "${sizes[@]}"
    # HYBRID_SHARD on two simulated machines of n/2 ranks each: torchrun's variables set by hand, since
    # `fsdp launch` rightly refuses a loopback master for a job of two machines.
    port="$("$python" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')"
    for (( rank = n - 1; rank >= 0; rank-- )); do
      RANK=$rank WORLD_SIZE=$n LOCAL_RANK=$(( rank % (n / 2) )) LOCAL_WORLD_SIZE=$(( n / 2 )) GROUP_RANK=$(( rank / (n / 2) )) \
        MASTER_ADDR=127.0.0.1 MASTER_PORT=$port OMP_NUM_THREADS=1 \
        "$bin/step_bench" --strategy HYBRID_SHARD "${sizes[@]}" >> "$results" &
    done
    wait
    for peer in ddp fsdp2; do
      launch "$n" "$python" "$root/bench/torch_peer.py" --peer "$peer" "${sizes[@]}"
    done
    for strategy in FULL_SHARD NO_SHARD; do
      launch "$n" "$bin/step_bench" --strategy "$strategy" "${llama[@]}"
    done
    for peer in ddp fsdp2; do
      launch "$n" "$python" "$root/bench/torch_peer.py" --peer "$peer" "${llama[@]}"
    done
  done
  OMP_NUM_THREADS=1 "$bin/step_bench" --strategy SINGLE "${sizes[@]}" >> "$results"
done
# Memory cap: both peers on a model three times as deep, at the largest world size; FULL_SHARD also
# with limit_retained_host_memory (host_memory.h).
launch "${world_sizes[-1]}" "$bin/step_bench" --strategy FULL_SHARD "${big_sizes[@]}"
launch "${world_sizes[-1]}" "$python" "$root/bench/torch_peer.py" --peer ddp "${big_sizes[@]}"
for model_sizes in "${sizes[*]}" "${big_sizes[*]}"; do
  read -r -a model_sizes <<< "$model_sizes"
  launch "${world_sizes[-1]}" "$bin/step_bench" --strategy FULL_SHARD --host-memory limit "${model_sizes[@]}"
done
for n in "${world_sizes[@]}"; do
  "$bin/fsdp" launch --nproc-per-node "$n" --master-port 0 -- "$bin/collective_bench" --megabytes "$(( smoke ? 4 : 64 ))" >> "$results"
done
if (( smoke )); then
  "$bin/merge_bench" --bytes 64MB --rounds 1 >> "$results"
else
  "$bin/merge_bench" --bytes 1GB >> "$results"
fi
"$python" "$root/bench/report.py" "$results" "$root/bench/README.md" "$smoke" "bench/run.sh $*"
