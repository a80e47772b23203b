"""The main job on a model that does not fit one process: `train_llama --preset large` (0.544 B
parameters) on 4 ranks for 4 steps, once with glibc's default thresholds and once with
--limit-host-memory, against `fsdp estimate-memory` for the same job. Rewrites the table between the
<!-- main-job --> markers of bench/README.md (about 6 minutes on 2 cores; 16 GB of memory).

    .venv/bin/python bench/main_job.py [--build build]
"""
import argparse
import json
import os
import re
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from report import measured_on, replace_between_markers, run_logged  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRAIN = ["--preset", "large", "--steps", "4", "--seq-len", "64", "--global-batch-size", "4", "--warmup-steps", "1",
         "--lr", "3e-4", "--min-lr", "1e-4", "--eval-every", "0", "--eval-tokens", "520", "--sample-bytes", "0"]
ESTIMATE = ["--preset", "large", "--num-processes", "4", "--seq-len", "64", "--json"]


def train(bin_dir, work, name, extra):
    output = os.path.join(work, name)
    text = run_logged(["/usr/bin/time", "-v", os.path.join(bin_dir, "fsdp"), "launch", "--nproc-per-node", "4",
                "--master-port", "0", "--", os.path.join(bin_dir, "train_llama"), *TRAIN, "--output-dir", output,
                *extra], os.path.join(work, name + ".log"))
    metrics = [json.loads(line) for line in open(os.path.join(output, "metrics.jsonl")) if line.strip()]
    evaluation = re.search(r"eval_loss=([0-9.]+)", text)
    largest = re.search(r"Maximum resident set size \(kbytes\): (\d+)", text)
    checkpoint = os.path.join(output, "checkpoints")
    on_disk = sum(os.path.getsize(os.path.join(path, file)) for path, _, files in os.walk(checkpoint) for file in files)
    return {"losses": [record["loss"] for record in metrics], "peak_rss_mb": [record["peak_rss_mb"] for record in metrics],
            "tokens_per_s": [record["tokens_per_s"] for record in metrics],
            "eval_loss": float(evaluation.group(1)) if evaluation else None,
            "largest_process_mib": int(largest.group(1)) / 1024 if largest else None, "checkpoint_bytes": on_disk}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--build", default=os.path.join(ROOT, "build"))
    args = parser.parse_args()
    bin_dir = os.path.join(args.build, "bin")
    mib, gb = 2 ** 20, 1e9
    with tempfile.TemporaryDirectory() as work:
        estimate = json.loads(run_logged([os.path.join(bin_dir, "fsdp"), "estimate-memory", *ESTIMATE],
                                         os.path.join(work, "estimate.log")))
        runs = {"default": train(bin_dir, work, "default", []),
                "limit": train(bin_dir, work, "limit", ["--limit-host-memory"])}
    peak = estimate["peak_bytes_with_prefetch"]

    def measured(name):
        result = runs[name]
        peaks = result["peak_rss_mb"]
        return (f"{', '.join(f'{value:.0f}' for value in peaks)} MiB after steps 1-{len(peaks)}; largest process "
                f"over the whole run {result['largest_process_mib']:.0f} MiB (GNU time); the run's peak "
                f"{max(max(peaks), result['largest_process_mib']) * mib / peak:.2f}x the estimate")

    def losses(name):
        result = runs[name]
        return f"{', '.join(f'{loss:.2f}' for loss in result['losses'])} (eval {result['eval_loss']:.2f})"

    def speeds(name):
        values = runs[name]["tokens_per_s"]
        return f"{min(values):.1f}-{max(values):.1f}"

    lines = ["<!-- main-job -->", "",
             measured_on(".venv/bin/python bench/main_job.py") + ": the two commands above, the first twice "
             "(glibc's default thresholds, then `--limit-host-memory`).", "",
             "| | per rank |", "|---|---|",
             f"| loss, steps 1-4, glibc's defaults | {losses('default')} |",
             f"| the same with `--limit-host-memory` | {losses('limit')} |",
             f"| tokens/s, the 4 ranks together, steps 1-4 | {speeds('default')} (glibc's defaults), "
             f"{speeds('limit')} (`--limit-host-memory`) |",
             f"| model state, estimate-memory (16P/N) | {estimate['model_state_bytes'] / gb:.2f} GB |",
             f"| the peak's three moments (estimate, Note [estimating memory per rank]) | end of forward "
             f"{estimate['model_state_bytes'] / gb:.2f} + {estimate['unsharded_peak_bytes_with_prefetch'] / gb:.2f} + "
             f"{estimate['activation_bytes_estimate'] / gb:.2f} GB; largest unit's reduction "
             f"{estimate['model_state_bytes'] / gb:.2f} + {estimate['reduction_bytes'] / gb:.2f} GB; optimizer step "
             f"{estimate['optimizer_step_bytes'] / gb:.2f} GB; plus {estimate['runtime_bytes'] / mib:.0f} MiB of "
             "runtime |",
             f"| estimate-memory's peak | {peak / gb:.2f} GB ({peak / mib:.0f} MiB) |",
             f"| measured peak RSS, mean of the 4 ranks (metrics.jsonl), glibc's defaults | {measured('default')} |",
             f"| the same with `--limit-host-memory` | {measured('limit')} |",
             f"| SHARDED checkpoint at the end, 4 ranks | {runs['limit']['checkpoint_bytes'] / 2 ** 30:.2f} GiB on "
             f"disk; estimate {estimate['sharded_checkpoint_bytes_per_rank'] / gb:.2f} GB a rank, "
             f"{4 * estimate['sharded_checkpoint_bytes_per_rank'] / 2 ** 30:.2f} GiB in all |",
             "", "Raw lines:", "", "```",
             json.dumps({"estimate": {key: estimate[key] for key in (
                 "model_state_bytes", "unsharded_peak_bytes_with_prefetch", "activation_bytes_estimate",
                 "reduction_bytes", "optimizer_step_bytes", "runtime_bytes", "peak_bytes_with_prefetch",
                 "sharded_checkpoint_bytes_per_rank")}}),
             json.dumps({"default": runs["default"]}), json.dumps({"limit": runs["limit"]}),
             "```", "", "<!-- /main-job -->"]
    replace_between_markers(os.path.join(ROOT, "bench", "README.md"), "main-job", lines)


if __name__ == "__main__":
    main()
