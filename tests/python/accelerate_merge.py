"""Accelerate's own merge_fsdp_weights, and a comparison of two merged files, for
tests/merge/merge_test.cpp's DCP tests.

    accelerate_merge.py merge CHECKPOINT_DIR OUTPUT_DIR [--unsafe-only]
        accelerate.utils.merge_fsdp_weights into OUTPUT_DIR/safe (model.safetensors) and
        OUTPUT_DIR/bin (pytorch_model.bin); with --unsafe-only the second only (an optimizer's
        nested state cannot be a safetensors file).
    accelerate_merge.py compare OURS THEIRS
        Loads both files (safetensors, or torch.load(weights_only=True)) and exits 1 naming the first
        difference: the set of keys, a dtype, a shape, a value (bitwise), or the safetensors metadata.
        Prints whether the two files are byte for byte the same.
"""
import sys

import torch
from safetensors import safe_open


def load(path):
    if path.endswith(".safetensors"):
        with safe_open(path, framework="pt") as handle:
            return {key: handle.get_tensor(key) for key in handle.keys()}, handle.metadata()
    return torch.load(path, map_location="cpu", weights_only=True), None


def compare(ours_path, theirs_path):
    ours, our_metadata = load(ours_path)
    theirs, their_metadata = load(theirs_path)
    if sorted(ours) != sorted(theirs):
        raise SystemExit(f"keys differ: ours {sorted(ours)}, Accelerate's {sorted(theirs)}")
    for key in theirs:
        a, b = ours[key], theirs[key]
        if a.dtype != b.dtype or a.shape != b.shape:
            raise SystemExit(f"{key}: ours {a.dtype} {tuple(a.shape)}, Accelerate's {b.dtype} {tuple(b.shape)}")
        if not torch.equal(a.view(torch.uint8) if a.numel() else a, b.view(torch.uint8) if b.numel() else b):
            raise SystemExit(f"{key}: the values differ")
    if our_metadata != their_metadata:
        raise SystemExit(f"metadata differs: ours {our_metadata}, Accelerate's {their_metadata}")
    same = open(ours_path, "rb").read() == open(theirs_path, "rb").read()
    print(f"{len(theirs)} tensors equal; files byte for byte {'the same' if same else 'different'}")


def main():
    if len(sys.argv) in (4, 5) and sys.argv[1] == "merge":
        import os
        from accelerate.utils import merge_fsdp_weights
        os.makedirs(sys.argv[3], exist_ok=True)  # Accelerate creates only the last directory
        if sys.argv[4:] != ["--unsafe-only"]:
            merge_fsdp_weights(sys.argv[2], f"{sys.argv[3]}/safe", safe_serialization=True)
        merge_fsdp_weights(sys.argv[2], f"{sys.argv[3]}/bin", safe_serialization=False)
    elif len(sys.argv) == 4 and sys.argv[1] == "compare":
        compare(sys.argv[2], sys.argv[3])
    else:
        raise SystemExit(__doc__)


if __name__ == "__main__":
    main()
