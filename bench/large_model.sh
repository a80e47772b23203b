#!/usr/bin/env bash
# A model that does not fit one process, on this machine: the 0.54 B Llama of `train_llama --preset
# large` (hidden 1536, 18 layers, 16 heads, 4 key/value heads, intermediate 4096, vocabulary 32000,
# untied) on 4 ranks, 4 sequences of 64 tokens per step, fp32, AdamW. One round, every figure from
# the same run:
#   1. fsdp.cpp FULL_SHARD (built on the meta device, one unit initialized at a time) and PyTorch
#      FSDP2 (meta device, to_empty, then its shards initialized) under the same per-process memory
#      cap, and PyTorch DDP of the same model under it, which cannot hold the model's training state
#      (16 bytes a parameter, 8.7 GB) in one process. The cap is RLIMIT_DATA (prlimit --data): this
#      machine has no cgroup v2 to set memory.max in. BENCH_CAP (default 6GiB) per process.
#   2. Checkpoints: our SHARDED save (DCP, model and AdamW state, fsynced) and load against cp -r +
#      sync and a parallel read of the same files, and against PyTorch's dcp.save / dcp.load of the
#      same FSDP2 state; a resume on 2 ranks from the 4-rank checkpoint; fsdp merge-weights of the
#      model against cp + sync of its directory. Loads and reads start with the files evicted from
#      the page cache (posix_fadvise), so they come from the disk.
#   3. fsdp estimate-memory for the same job, beside the measured figures.
#   4. The first run starts from a Hugging Face directory of this size (transformers' save_pretrained
#      of a random model, several safetensors files and an index): rank 0 streams it one tensor at a
#      time; each rank's peak RSS growth and bytes read from storage during the load.
# Rewrites the tables between the <!-- large-model --> markers of bench/README.md. About 15 minutes
# and 20 GB of memory, 20 GB of disk under BENCH_DIR (default a temporary directory).
#   bench/large_model.sh
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/paths.sh"
command -v prlimit >/dev/null || { echo "bench: prlimit (util-linux) is needed for the memory cap" >&2; exit 1; }
cap="${BENCH_CAP:-6GiB}"
cap_bytes="$("$python" -c "import sys; t=sys.argv[1]; u={'GiB':2**30,'GB':10**9,'MiB':2**20,'MB':10**6}; k=next((k for k in u if t.endswith(k)), None); print(int(float(t[:-len(k)])*u[k]) if k else int(t))" "$cap")"
work="${BENCH_DIR:-$(mktemp -d)}"
mkdir -p "$work"
results="$work/large_model.jsonl"
: > "$results"
shape=(--model llama --width 1536 --hidden 4096 --blocks 18 --vocab 32000 --heads 16 --kv-heads 4 --untied 1
       --batch 4 --length 64)
seconds_since() { "$python" -c "import sys, time; print(round(time.time() - float(sys.argv[1]), 3))" "$1"; }
launch() {  # launch LABEL RANKS CAP|none COMMAND...: the run's JSON lines, and one line of its status
  local label="$1" ranks="$2" limit="$3"
  shift 3
  local prefix=()
  [[ "$limit" == none ]] || prefix=(prlimit "--data=$limit")
  local log="$work/run_$(date +%s%N).log"
  local start seconds code=0
  start="$(date +%s.%N)"
  "${prefix[@]}" "$bin/fsdp" launch --nproc-per-node "$ranks" --master-port 0 -- "$@" > "$log" 2>&1 || code=$?
  seconds="$(seconds_since "$start")"
  grep '^{' "$log" >> "$results" || true
  # What stopped a failed run: its first error line.
  local reason=""
  ((code == 0)) || reason="$(grep -v '^{' "$log" | grep -m1 -iE 'error|memory|killed' | cut -c1-300 | tr '"\\' "'/" || true)"
  printf '{"benchmark": "run", "label": "%s", "ranks": %s, "cap_bytes": %s, "exit_code": %s, "seconds": %s, "reason": "%s"}\n' \
    "$label" "$ranks" "$([[ "$limit" == none ]] && echo 0 || echo "$cap_bytes")" "$code" "$seconds" "$reason" >> "$results"
  echo "bench: $label on $ranks ranks (cap $limit): exit $code after $seconds s" >&2
}

# 4: a pretrained model of this shape, as transformers' save_pretrained writes it (a random model,
# shards of at most 500 MB and an index), which the first run loads (rank 0 streams it).
"$python" - "$work/hf" <<'PY'
import sys
import torch
from transformers import LlamaConfig, LlamaForCausalLM
torch.manual_seed(0)
config = LlamaConfig(vocab_size=32000, hidden_size=1536, intermediate_size=4096, num_hidden_layers=18,
                     num_attention_heads=16, num_key_value_heads=4, max_position_embeddings=2048,
                     tie_word_embeddings=False, rms_norm_eps=1e-5)
LlamaForCausalLM(config).save_pretrained(sys.argv[1], max_shard_size="500MB")
PY
# 1 and 2: ours under the cap, from the pretrained directory, with the checkpoint; then the resume
# on 2 ranks (no cap: 2 ranks hold twice the state each) and the merge.
launch fsdp.cpp 4 "$cap_bytes" "$bin/step_bench" --strategy FULL_SHARD "${shape[@]}" --meta-init 1 --steps 3 \
  --init-from "$work/hf" --checkpoint "$work/ours"
rm -rf "$work/hf"
launch resume 2 none "$bin/step_bench" --strategy FULL_SHARD "${shape[@]}" --meta-init 1 --steps 2 --resume-from "$work/ours"
merge_log="$work/merge.log"
/usr/bin/time -v "$bin/fsdp" merge-weights "$work/ours/pytorch_model_fsdp_0" "$work/merged" > "$merge_log" 2>&1
merge_s="$(grep 'Elapsed (wall clock)' "$merge_log" | awk '{print $NF}' | awk -F: '{ if (NF == 3) print $1*3600+$2*60+$3; else print $1*60+$2 }')"
merge_rss="$(grep 'Maximum resident' "$merge_log" | awk '{print $NF}')"
sync
start="$(date +%s.%N)"; cp -r "$work/ours/pytorch_model_fsdp_0" "$work/model_copy" && sync; copy_s="$(seconds_since "$start")"
printf '{"benchmark": "merge", "bytes": %s, "merge_s": %s, "merge_peak_rss_kb": %s, "cp_sync_s": %s}\n' \
  "$(du -sb "$work/merged" | cut -f1)" "$merge_s" "$merge_rss" "$copy_s" >> "$results"
rm -rf "$work/model_copy" "$work/merged" "$work/ours"
# PyTorch's peers under the same cap: FSDP2 (with its checkpoint), then DDP on 2 ranks: each of its
# processes holds the whole training state whatever the ranks, and 4 of them filling the cap at once
# would be more than this machine's memory.
launch pytorch-fsdp2 4 "$cap_bytes" "$python" "$root/bench/torch_peer.py" --peer fsdp2 "${shape[@]}" --meta-init 1 --steps 3 --checkpoint "$work/torch"
launch pytorch-ddp 2 "$cap_bytes" "$python" "$root/bench/torch_peer.py" --peer ddp "${shape[@]}" --steps 3
# 3: the estimate of the same job.
"$bin/fsdp" estimate-memory --preset large --num-processes 4 --seq-len 64 --wrap layers --json |
  sed 's/^{/{"benchmark": "estimate", /' >> "$results"
"$python" "$root/bench/large_model_report.py" "$results" "$root/bench/README.md" "bench/large_model.sh (cap $cap)"
echo "bench: results in $results" >&2
