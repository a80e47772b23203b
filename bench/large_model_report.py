"""Turns bench/large_model.sh's JSON lines into the tables of bench/README.md between the
<!-- large-model --> markers: the large model under one memory cap (ours, PyTorch FSDP2, PyTorch
DDP), per-rank memory against estimate-memory, and the checkpoint table (save, load, resume on 2
ranks, merge) against cp + sync, a parallel read of the same bytes and PyTorch DCP."""
import json
import sys

from report import measured_on, replace_between_markers


def mb_list(values):
    return ", ".join(f"{value:.0f}" for value in values)


def main():
    results_path, readme_path, command = sys.argv[1], sys.argv[2], sys.argv[3]
    rows = [json.loads(line) for line in open(results_path) if line.strip().startswith("{")]

    def find(benchmark, **match):
        for row in rows:
            if row.get("benchmark") == benchmark and all(row.get(k) == v for k, v in match.items()):
                return row
        return None

    runs = {row["label"]: row for row in rows if row.get("benchmark") == "run"}
    ours = find("step", peer="fsdp.cpp")
    fsdp2 = find("step", peer="pytorch-fsdp2")
    estimate = find("estimate")
    ours_ckpt = find("checkpoint", peer="fsdp.cpp")
    torch_ckpt = find("checkpoint", peer="pytorch-dcp")
    resume = find("resume")
    resume_losses = find("resume_losses")
    merge = find("merge")
    init_from = find("init_from")
    cap_gib = runs["fsdp.cpp"]["cap_bytes"] / 2**30
    gb = lambda value: f"{value / 1e9:.2f} GB"

    lines = ["<!-- large-model -->", "",
             measured_on(command) + "; one round. The model: "
             f"{ours['parameters'] / 1e9:.3f} B parameters (`train_llama --preset large`), 4 sequences of 64 tokens a "
             "step, fp32, AdamW, CPU/Gloo; each decoder layer a unit, then the root, in both FSDPs.", "",
             f"**Under one cap of {cap_gib:.1f} GiB per process** (RLIMIT_DATA, `prlimit --data`: no cgroup v2 here):", "",
             "| peer | ranks | exit | what happened | median step (s) | / FSDP2 | rank 0 peak RSS (MB) | / FSDP2 |",
             "|---|---|---|---|---|---|---|---|"]
    for label, step in [("fsdp.cpp", ours), ("pytorch-fsdp2", fsdp2), ("pytorch-ddp", None)]:
        run = runs.get(label)
        if run is None:
            continue
        happened = "trained" if run["exit_code"] == 0 else f"failed: {run['reason'][:160]}"
        if step and fsdp2:
            lines.append(f"| {label} | {run['ranks']} | {run['exit_code']} | {happened} | {step['median_step_s']:.2f} | "
                         f"{step['median_step_s'] / fsdp2['median_step_s']:.2f} | {step['peak_rss_mb']:.0f} | "
                         f"{step['peak_rss_mb'] / fsdp2['peak_rss_mb']:.2f} |")
        else:
            lines.append(f"| {label} | {run['ranks']} | {run['exit_code']} | {happened} | - | - | - | - |")
    if ours and estimate:
        lines += ["", "**Per rank against `fsdp estimate-memory`** (the same job, `--wrap layers`):", "",
                  "| | measured | estimate-memory | measured / estimate |", "|---|---|---|---|",
                  f"| model state (parameters, gradients, AdamW) | {gb(ours['model_state_bytes_per_rank'])} | "
                  f"{gb(estimate['model_state_bytes'])} | {ours['model_state_bytes_per_rank'] / estimate['model_state_bytes']:.3f} |",
                  f"| bytes sent per step | {gb(ours['bytes_sent_per_step'])} | {gb(estimate['bytes_sent_per_step'])} | "
                  f"{ours['bytes_sent_per_step'] / estimate['bytes_sent_per_step']:.3f} |",
                  f"| peak RSS (rank 0) / estimate's peak (state, unsharded units, one unit's gradients, activations) | "
                  f"{ours['peak_rss_mb'] * 2**20 / 1e9:.2f} GB | {gb(estimate['peak_bytes_with_prefetch'])} | "
                  f"{ours['peak_rss_mb'] * 2**20 / estimate['peak_bytes_with_prefetch']:.2f} |",
                  f"| SHARDED checkpoint, all ranks | {gb(ours_ckpt['bytes']) if ours_ckpt else '-'} | "
                  f"{gb(4 * estimate['sharded_checkpoint_bytes_per_rank'])} | "
                  f"{ours_ckpt['bytes'] / (4 * estimate['sharded_checkpoint_bytes_per_rank']):.3f} |" if ours_ckpt else ""]
        lines.append("")
        lines.append("The formula: peak = 16 P / N (model state) + the unsharded units held at once (root and two "
                     "layers with prefetch) + one unit's gradients + activations (estimated); libtorch and the "
                     "allocator's slack come on top.")
    if ours_ckpt:
        lines += ["", f"**Checkpoints** ({gb(ours_ckpt['bytes'])}: model and AdamW state; page cache "
                  f"{ours_ckpt['page_cache']} for the loads and reads):", "",
                  "| what | seconds | / cp + sync | / parallel read | / PyTorch DCP | peak RSS growth per rank (MB) |",
                  "|---|---|---|---|---|---|"]
        save, load, cp, read = ours_ckpt["save_s"], ours_ckpt["load_s"], ours_ckpt["cp_sync_s"], ours_ckpt["read_s"]
        tsave = torch_ckpt["save_s"] if torch_ckpt else None
        tload = torch_ckpt["load_s"] if torch_ckpt else None
        lines.append(f"| SHARDED save, 4 ranks, fsynced | {save:.2f} | {save / cp:.2f} | - | "
                     f"{(save / tsave) if tsave else float('nan'):.2f} | {mb_list(ours_ckpt['save_peak_rss_delta_mb'])} |")
        lines.append(f"| SHARDED load, 4 ranks | {load:.2f} | - | {load / read:.2f} | "
                     f"{(load / tload) if tload else float('nan'):.2f} | {mb_list(ours_ckpt['load_peak_rss_delta_mb'])} |")
        if torch_ckpt:
            lines.append(f"| PyTorch dcp.save, 4 ranks (FSDP2 state) | {tsave:.2f} | {tsave / cp:.2f} | - | 1.00 | - |")
            lines.append(f"| PyTorch dcp.load, 4 ranks | {tload:.2f} | - | {tload / read:.2f} | 1.00 | - |")
        lines.append(f"| cp -r + sync of the same files | {cp:.2f} | 1.00 | - | - | - |")
        lines.append(f"| the same files read by 4 processes | {read:.2f} | - | 1.00 | - | - |")
        if resume:
            losses = resume_losses["losses"] if resume_losses else []
            lines.append(f"| resume on 2 ranks from the 4-rank checkpoint (load) | {resume['load_s']:.2f} | - | "
                         f"{resume['load_s'] / read:.2f} | - | {mb_list(resume['load_peak_rss_delta_mb'])} |")
            lines.append("")
            lines.append(f"The 4-rank run's losses: {', '.join(f'{v:.3f}' for v in ours_ckpt['losses'])}; the 2-rank "
                         f"resume's: {', '.join(f'{v:.3f}' for v in losses)} (its batch differs: 2 sequences a rank). "
                         "The resume's RSS growth is mostly the AdamW state the load creates (the run had taken no "
                         f"step yet): {2 * ours['parameters'] * 4 / 2 / 1e6:.0f} MB a rank on 2 ranks.")
        if merge:
            lines += ["", f"`fsdp merge-weights` of the model ({gb(merge['bytes'])} of safetensors): {merge['merge_s']:.2f} s "
                      f"against cp + sync of its DCP directory {merge['cp_sync_s']:.2f} s (ratio "
                      f"{merge['merge_s'] / merge['cp_sync_s']:.2f}); peak RSS {merge['merge_peak_rss_kb'] / 1024:.0f} MB."]
    if init_from:
        lines += ["", f"**Loading a pretrained model of this size** (`--init-from`: transformers' save_pretrained, "
                  f"{gb(init_from['bytes'])} in 500 MB shards with an index; page cache {init_from['page_cache']}): "
                  f"{init_from['load_s']:.2f} s on 4 ranks. Rank 0 reads the files and sends one tensor at a time; "
                  f"the others never open them.", "",
                  "| rank | peak RSS growth during the load (MB) | bytes read from storage (MB) |", "|---|---|---|"]
        for rank, (peak, read) in enumerate(zip(init_from["peak_rss_delta_mb"], init_from["storage_read_mb"])):
            lines.append(f"| {rank} | {peak:.0f} | {read:.0f} |")
        lines += ["", f"The largest tensor is {init_from['largest_shard_elements'] * 4 / 1e6:.0f} MB as a shard "
                  "(the embedding and the head: 32000 x 1536 fp32 = 197 MB whole); the shards themselves were "
                  "allocated before the load."]
    lines += ["", "Raw lines:", "", "```"] + [json.dumps(row) for row in rows] + ["```", "", "<!-- /large-model -->"]
    replace_between_markers(readme_path, "large-model", [line for line in lines if line is not None])


if __name__ == "__main__":
    main()
