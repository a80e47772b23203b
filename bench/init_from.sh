#!/usr/bin/env bash
# Loading a pretrained model of 0.54 B parameters (the Llama of bench/large_model.sh, transformers'
# save_pretrained of a random model: 2.2 GB in 500 MB safetensors files with an index) into
# FULL_SHARD on 4 ranks built on the meta device, two ways in paired, alternating rounds: every rank
# reading the rows of its own shards (fsdp::load_pretrained_weights, train_llama --init-from), and
# rank 0 reading every tensor and sending it (PretrainedWeightsOptions::rank0_only, --init-from-rank0).
# Each load starts with the files evicted from the page cache (posix_fadvise), so they come from the
# disk. Per run: the time to the last rank's end, each rank's peak RSS growth and the bytes it read
# from storage (/proc/self/io). Rewrites the table between the <!-- init-from --> markers of
# bench/README.md. About 5 minutes and 12 GB of memory; 2.2 GB of disk under BENCH_DIR.
#   bench/init_from.sh              BENCH_ROUNDS rounds (default 3)
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/paths.sh"
rounds="${BENCH_ROUNDS:-3}"
work="${BENCH_DIR:-$(mktemp -d)}"
mkdir -p "$work"
results="$work/init_from.jsonl"
: > "$results"
shape=(--model llama --width 1536 --hidden 4096 --blocks 18 --vocab 32000 --heads 16 --kv-heads 4 --untied 1
       --batch 4 --length 64)
[[ -f "$work/hf/model.safetensors.index.json" ]] || "$python" - "$work/hf" <<'PY'
import sys
import torch
from transformers import LlamaConfig, LlamaForCausalLM
torch.manual_seed(0)
config = LlamaConfig(vocab_size=32000, hidden_size=1536, intermediate_size=4096, num_hidden_layers=18,
                     num_attention_heads=16, num_key_value_heads=4, max_position_embeddings=2048,
                     tie_word_embeddings=False, rms_norm_eps=1e-5)
LlamaForCausalLM(config).save_pretrained(sys.argv[1], max_shard_size="500MB")
PY
for round in $(seq "$rounds"); do
  order=(0 1)
  ((round % 2 == 0)) && order=(1 0)
  for rank0 in "${order[@]}"; do
    "$bin/fsdp" launch --nproc-per-node 4 --master-port 0 -- "$bin/step_bench" --strategy FULL_SHARD "${shape[@]}" \
      --meta-init 1 --steps 0 --init-from "$work/hf" --init-from-rank0 "$rank0" | grep '^{' | sed "s/^{/{\"round\": $round, /" >> "$results"
  done
  echo "bench: init-from round $round of $rounds done" >&2
done
"$python" - "$results" "$root/bench/README.md" "bench/init_from.sh ($rounds rounds)" <<'PY'
import json, platform, re, statistics, sys, time
rows = [json.loads(line) for line in open(sys.argv[1]) if '"init_from"' in line]
paths = {"every_rank": "every rank reads its rows", "rank0": "rank 0 reads and sends (`rank0_only`)"}
by = {p: {r["round"]: r for r in rows if r["path"] == p} for p in paths}
ratios = [by["rank0"][k]["load_s"] / by["every_rank"][k]["load_s"] for k in by["every_rank"] if k in by["rank0"]]
first = rows[0]
lines = [f"Measured {time.strftime('%Y-%m-%d %H:%M')} on {platform.node()} ({platform.machine()}) with `{sys.argv[3]}`: "
         f"{first['parameters'] / 1e9:.3f} B parameters, {first['bytes'] / 1e9:.2f} GB of safetensors, 4 ranks, "
         f"page cache {first['page_cache']}; medians over the rounds, each rank's figures from the median run.", "",
         "| path | load (s) | peak RSS growth per rank (MB) | read from storage per rank (MB) |", "|---|---|---|---|"]
for path, words in paths.items():
    runs = sorted(by[path].values(), key=lambda r: r["load_s"])
    median = runs[len(runs) // 2]
    lines.append(f"| {words} | {statistics.median(r['load_s'] for r in runs):.2f} | "
                 f"{' / '.join(f'{v:.0f}' for v in median['peak_rss_delta_mb'])} | "
                 f"{' / '.join(f'{v:.0f}' for v in median['storage_read_mb'])} |")
lines += ["", f"Rank 0 reading and sending takes {statistics.median(ratios):.2f}x the time of every rank reading its "
          f"own rows (median of {len(ratios)} paired ratios, {min(ratios):.2f} to {max(ratios):.2f}). The largest "
          f"shard is {first['largest_shard_elements'] * 4 / 1e6:.0f} MB."]
readme = open(sys.argv[2]).read()
block = "<!-- init-from -->\n\n" + "\n".join(lines) + "\n\n<!-- /init-from -->"
assert "<!-- init-from -->" in readme, "bench/README.md has no <!-- init-from --> markers"
readme = re.sub(r"<!-- init-from -->.*?<!-- /init-from -->", lambda m: block, readme, flags=re.S)
open(sys.argv[2], "w").write(readme)
print("\n".join(lines))
PY
