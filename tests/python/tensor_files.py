"""The venv's safetensors and torch.load/torch.save on the same tensors as fsdp.cpp's C++ side.

    tensor_files.py check DIR    reads DIR/ours.safetensors and DIR/ours.bin (written by fsdp.cpp)
                                 and compares every tensor, bit for bit, with expected_tensors()
    tensor_files.py write DIR    writes DIR/theirs.safetensors (safetensors.torch.save_file),
                                 DIR/theirs.bin (torch.save of a dict of the dtypes libtorch reads),
                                 DIR/theirs_ordered.bin (torch.save of an OrderedDict with _metadata,
                                 as model.state_dict() gives, of every dtype) and
                                 DIR/theirs_all_dtypes.bin (a dict of every dtype: float8 and
                                 uint16/32/64 through _rebuild_tensor_v3)

expected_tensors() mirrors expected_tensors() in tests/io/tensor_files_crosscheck_test.cpp: both sides
build the same values from arange and the same dtype conversions.
"""
import collections
import sys

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

# safetensors name -> torch dtype, for every dtype both safetensors and fsdp.cpp read and write.
SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U64": torch.uint64, "U32": torch.uint32, "U16": torch.uint16, "U8": torch.uint8,
    "BOOL": torch.bool, "C64": torch.complex64,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
    "F8_E4M3FNUZ": torch.float8_e4m3fnuz, "F8_E5M2FNUZ": torch.float8_e5m2fnuz,
}


def sample(dtype):
    base = torch.arange(60, dtype=torch.float64).reshape(3, 4, 5)
    if dtype == torch.bool:
        return (base.to(torch.int64) % 3) == 0
    if dtype == torch.complex64:
        return torch.complex(base * 0.5 - 3.0, base * -0.25).to(torch.complex64)
    if dtype.is_floating_point:
        return (base * 0.37 - 7.3).to(dtype)
    return (base.to(torch.int64) * 7919 - 200000).to(dtype)


# Of those, the dtypes torch.save writes with a legacy storage class and _rebuild_tensor_v2, the only
# ones libtorch writes and reads in that format (float8 and uint16/32/64 need _rebuild_tensor_v3).
TORCH_FILE_DTYPES = ["F64", "F32", "F16", "BF16", "I64", "I32", "I16", "I8", "U8", "BOOL", "C64"]


def expected_tensors(names=None):
    names = list(SAFETENSORS_DTYPES) if names is None else names
    tensors = {f"t.{name}": sample(SAFETENSORS_DTYPES[name]) for name in names}
    tensors["scalar"] = torch.tensor(2.5, dtype=torch.float32)
    tensors["empty"] = torch.zeros(0, 3, dtype=torch.float32)
    return tensors


def same_bits(a, b):
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8))


def compare(label, found, expected):
    problems = []
    for name in sorted(set(found) | set(expected)):
        if name not in found:
            problems.append(f"{name}: missing")
        elif name not in expected:
            problems.append(f"{name}: unexpected")
        elif not same_bits(found[name], expected[name]):
            problems.append(f"{name}: {found[name].dtype} {tuple(found[name].shape)} differs from "
                            f"{expected[name].dtype} {tuple(expected[name].shape)}")
    if problems:
        raise SystemExit(f"{label}: " + "; ".join(problems))
    print(f"{label}: {len(found)} tensors equal bit for bit")


def check(directory):
    expected = expected_tensors()
    path = f"{directory}/ours.safetensors"
    compare("safetensors.torch.load_file(ours.safetensors)", load_file(path), expected)
    with safe_open(path, framework="pt") as handle:
        metadata = handle.metadata()
    if metadata.get("format") != "pt" or metadata.get("writer") != "fsdp.cpp":
        raise SystemExit(f"ours.safetensors metadata is {metadata}, expected format=pt and writer=fsdp.cpp")
    # weights_only=True: loading must not need (or run) arbitrary pickled code.
    compare("torch.load(ours.bin, weights_only=True)",
            torch.load(f"{directory}/ours.bin", weights_only=True), expected_tensors(TORCH_FILE_DTYPES))


def write(directory):
    expected = expected_tensors()
    save_file(expected, f"{directory}/theirs.safetensors", metadata={"format": "pt", "writer": "safetensors"})
    legacy = expected_tensors(TORCH_FILE_DTYPES)
    torch.save(legacy, f"{directory}/theirs.bin")
    # What model.state_dict() is: an OrderedDict with a _metadata attribute; every dtype, the newer
    # ones through _rebuild_tensor_v3.
    ordered = collections.OrderedDict(expected)
    ordered._metadata = collections.OrderedDict({"": {"version": 1}})
    torch.save(ordered, f"{directory}/theirs_ordered.bin")
    torch.save(dict(expected), f"{directory}/theirs_all_dtypes.bin")
    print(f"wrote {len(expected)} tensors with safetensors {sys.modules['safetensors'].__version__} "
          f"and torch {torch.__version__}")


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] not in ("check", "write"):
        raise SystemExit(__doc__)
    {"check": check, "write": write}[sys.argv[1]](sys.argv[2])
