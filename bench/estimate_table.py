"""The per-rank table of docs/memory.md: `fsdp estimate-memory --json` for Meta's Llama 3 shapes
(1B, 8B, 70B) at N = 8 to 1024 ranks, 8 ranks a machine, bf16 compute and reduction, AdamW, one
4096-token sequence per rank with activation checkpointing. Rewrites the text between the
<!-- estimates --> markers.

    python3 bench/estimate_table.py [--fsdp build/bin/fsdp]
"""
import argparse
import json
import os
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from report import replace_between_markers  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def gb(value):
    return f"{value / 1e9:.2f}"


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--fsdp", default=os.path.join(ROOT, "build", "bin", "fsdp"))
    args = parser.parse_args()
    lines = ["<!-- estimates -->", "",
             "| model | parameters | ranks | strategy | model state / rank (GB) | unsharded, prefetch (GB) | "
             "activations, estimate (GB) | peak / rank (GB) | sent / rank / step (GB) | off the machine (GB) | "
             "SHARDED checkpoint / rank (GB) |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for preset in ["llama3-1b", "llama3-8b", "llama3-70b"]:
        for ranks in [8, 64, 256, 1024]:
            for strategy, extra in [("FULL_SHARD", []), ("HYBRID_SHARD", []),
                                    ("FULL_SHARD, hpZ 8", ["--reshard-after-forward", "8"])]:
                if ranks == 8 and strategy != "FULL_SHARD":
                    continue  # one machine: HYBRID_SHARD and hpZ 8 are FULL_SHARD there
                command = [args.fsdp, "estimate-memory", "--preset", preset, "--num-processes", str(ranks),
                           "--ranks-per-machine", "8", "--sharding-strategy", strategy.split(",")[0],
                           "--mixed-precision", "bf16", "--seq-len", "4096", "--activation-checkpointing",
                           "--json"] + extra
                out = json.loads(subprocess.run(command, check=True, capture_output=True, text=True).stdout)
                lines.append(f"| {preset} | {out['parameters'] / 1e9:.2f} B | {ranks} | {strategy} | "
                             f"{gb(out['model_state_bytes'])} | {gb(out['unsharded_peak_bytes_with_prefetch'])} | "
                             f"{gb(out['activation_bytes_estimate'])} | {gb(out['peak_bytes_with_prefetch'])} | "
                             f"{gb(out['bytes_sent_per_step'])} | {gb(out['bytes_sent_off_machine_per_step'])} | "
                             f"{gb(out['sharded_checkpoint_bytes_per_rank'])} |")
    lines += ["", "<!-- /estimates -->"]
    replace_between_markers(os.path.join(ROOT, "docs", "memory.md"), "estimates", lines)


if __name__ == "__main__":
    main()
