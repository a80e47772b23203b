#!/usr/bin/env bash
# The main job on its built-in default: installs what is missing, builds, then trains a small
# Llama-architecture model on 2 local ranks with FSDP (FULL_SHARD, transformer-based wrap):
#   1. train to the middle, save a SHARDED checkpoint and stop;
#   2. resume from that checkpoint and finish (the losses continue exactly);
#   3. merge the final checkpoint into one model.safetensors with `fsdp merge-weights`;
#   4. evaluate the merged weights in a single process.
# Environment: RUN_DIR (default runs/llama), RUN_STEPS (default 300), and any FSDP_* setting.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
"$root/scripts/setup.sh" --for-run  # torch and the two programs below, nothing else (./test.sh adds the rest)
source "$root/scripts/flavor.sh"
bin="$fsdp_build_dir/bin"
run_dir="${RUN_DIR:-$root/runs/llama}"
steps="${RUN_STEPS:-300}"
half=$((steps / 2))
rm -rf "$run_dir"

echo "== 1/4 train steps 1-$half on 2 ranks, then checkpoint and stop"
"$bin/fsdp" launch --nproc-per-node 2 --master-port 0 -- \
  "$bin/train_llama" --output-dir "$run_dir" --steps "$steps" --stop-after "$half"

echo "== 2/4 resume from the checkpoint and finish"
"$bin/fsdp" launch --nproc-per-node 2 --master-port 0 -- \
  "$bin/train_llama" --output-dir "$run_dir" --steps "$steps" --resume-from latest | tee "$run_dir/train.log"

echo "== 3/4 merge the final sharded checkpoint"
latest="$(ls -d "$run_dir"/checkpoints/checkpoint_* | sort -V | tail -1)"
"$bin/fsdp" merge-weights "$latest/pytorch_model_fsdp_0" "$run_dir/merged"
cp "$run_dir/final/config.json" "$run_dir/merged/config.json"

echo "== 4/4 evaluate the merged model in one process (the training run reported: $(grep '^eval_loss=' "$run_dir/train.log"))"
"$bin/train_llama" --eval-only --init-from "$run_dir/merged" --data "$run_dir/eval.txt" --seq-len 128 --eval-tokens 16384

echo
echo "model (Hugging Face layout): $run_dir/final  (merged checkpoint: $run_dir/merged)"
echo "loss curve:                  $run_dir/loss.svg   metrics: $run_dir/metrics.jsonl"
echo "sample text:                 $run_dir/final/sample.txt"
head -c 300 "$run_dir/final/sample.txt"; echo
