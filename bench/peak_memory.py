"""Memory per rank, `fsdp estimate-memory` against the measured peak: step_bench's largest rank's peak
RSS (the kernel's VmHWM) for untied Llamas of 18.8 M, 34.1 M and 0.544 B parameters (train_llama's
large preset, built on the meta device) on 2 and 4 ranks, FULL_SHARD, one unit per decoder layer,
8 sequences of 64 tokens a step (4 at 0.544 B), with retained host memory limited (what the
estimate assumes) and with glibc's defaults. Rewrites the table between the <!-- peak-memory -->
markers of bench/README.md.

    .venv/bin/python bench/peak_memory.py [--build build] [--skip-large]
"""
import argparse
import json
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from report import measured_on, replace_between_markers, run_logged  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# (label, width, intermediate, layers, heads, key/value heads, vocab, batch, ranks, step_bench extras)
SIZES = [
    ("18.8 M", 384, 1024, 4, 8, 4, 16000, 8, [2, 4], []),
    ("34.1 M", 512, 1408, 6, 8, 4, 16000, 8, [2, 4], []),
    ("0.544 B", 1536, 4096, 18, 16, 4, 32000, 4, [4], ["--meta-init", "1"]),
]


def json_lines(command, log):
    return [json.loads(line) for line in run_logged(command, log).splitlines() if line.startswith("{")]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--build", default=os.path.join(ROOT, "build"))
    parser.add_argument("--skip-large", action="store_true", help="leave out the 0.544 B model (5 minutes)")
    args = parser.parse_args()
    bin_dir = os.path.join(args.build, "bin")
    rows = []
    raw = []
    with tempfile.TemporaryDirectory() as work:
        for label, width, hidden, layers, heads, kv, vocab, batch, all_ranks, extra in SIZES:
            if args.skip_large and label == "0.544 B":
                continue
            config_dir = os.path.join(work, label.replace(" ", "_"))
            os.makedirs(config_dir)
            with open(os.path.join(config_dir, "config.json"), "w") as config:
                json.dump({"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": vocab,
                           "hidden_size": width, "intermediate_size": hidden, "num_hidden_layers": layers,
                           "num_attention_heads": heads, "num_key_value_heads": kv,
                           "max_position_embeddings": 64, "tie_word_embeddings": False}, config)
            for ranks in all_ranks:
                log = os.path.join(config_dir, f"{ranks}.log")
                estimate = json_lines([os.path.join(bin_dir, "fsdp"), "estimate-memory", "--config", config_dir,
                                     "--json", "--wrap", "layers", "--seq-len", "64", "--num-processes",
                                     str(ranks), "--micro-batch-size", str(batch // ranks)], log)[0]
                measured = {}
                for host_memory in ["limit", "default"]:
                    lines = json_lines([os.path.join(bin_dir, "fsdp"), "launch", "--nproc-per-node", str(ranks),
                                      "--master-port", "0", "--", os.path.join(bin_dir, "step_bench"),
                                      "--model", "llama", "--width", str(width), "--hidden", str(hidden),
                                      "--blocks", str(layers), "--heads", str(heads), "--kv-heads", str(kv),
                                      "--vocab", str(vocab), "--untied", "1", "--batch", str(batch),
                                      "--length", "64", "--steps", "2", "--strategy", "FULL_SHARD",
                                      "--host-memory", host_memory, "--memory-phases", "1"] + extra, log)
                    step = next(line for line in lines if line["benchmark"] == "step")
                    phases = next(line for line in lines if line["benchmark"] == "memory_phases")
                    measured[host_memory] = max(step["peak_rss_mb_per_rank"])
                    raw.append({"model": label, "world_size": ranks, "host_memory": host_memory,
                                "peak_rss_mb_per_rank": step["peak_rss_mb_per_rank"],
                                "forward_peak_mb": phases["forward_peak_mb"],
                                "backward_peak_mb": phases["backward_peak_mb"],
                                "optimizer_step_peak_mb": phases["optimizer_step_peak_mb"]})
                mib = 2 ** 20
                peak = estimate["peak_bytes_with_prefetch"] / mib
                rows.append(f"| {label} | {ranks} | {estimate['model_state_bytes'] / mib:.0f} | "
                            f"{estimate['training_step_bytes_with_prefetch'] / mib:.0f} | "
                            f"{estimate['optimizer_step_bytes'] / mib:.0f} | {estimate['runtime_bytes'] / mib:.0f} | "
                            f"{peak:.0f} | {measured['limit']:.0f} | {peak / measured['limit']:.2f} | "
                            f"{measured['default']:.0f} | {peak / measured['default']:.2f} |")
                raw.append({"model": label, "world_size": ranks, "estimate": estimate})
    lines = ["<!-- peak-memory -->", "",
             measured_on(".venv/bin/python bench/peak_memory.py") + ": FULL_SHARD, one unit per decoder layer and the root, "
             "fp32, AdamW, 64-token sequences, 8 a step (4 at 0.544 B); the largest rank's peak RSS over two "
             "steps. MiB per rank.", "",
             "| model | ranks | model state | training step | optimizer step | runtime | estimated peak | "
             "measured, limited | estimate / measured | measured, glibc's defaults | estimate / measured |",
             "|---|---|---|---|---|---|---|---|---|---|---|"] + rows
    lines += ["", "Raw lines:", "", "```"] + [json.dumps(row) for row in raw] + ["```", "", "<!-- /peak-memory -->"]
    replace_between_markers(os.path.join(ROOT, "bench", "README.md"), "peak-memory", lines)


if __name__ == "__main__":
    main()
