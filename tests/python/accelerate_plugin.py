"""Accelerate's own FullyShardedDataParallelPlugin on the cases of tests/config/plugin_side_by_side_test.cpp.

    accelerate_plugin.py CASES OUTPUT

CASES is a JSON list of {"name", "environment": {FSDP_*: value}, "arguments": {field: value}}. For each
case the plugin is built with exactly that environment (every FSDP_* and ACCELERATE_* variable of the
process removed first) and those keyword arguments, and OUTPUT receives, per case, either
{"error": message} or {"values": {field: value}} with every dataclass field in a plain form: enums by
name, state dict configs as [offload_to_cpu, rank0_only], mixed precision as its dtypes, the CPU
offload as a bool, the wrap policy by name.
"""
import dataclasses
import json
import os
import sys
import warnings

import accelerate.utils.dataclasses as accelerate_dataclasses
import torch
from accelerate.utils import FullyShardedDataParallelPlugin


def dtype_name(dtype):
    return None if dtype is None else str(dtype).replace("torch.", "")


def plain(name, value):
    if value is None:
        return None
    if name in ("state_dict_config", "optim_state_dict_config"):
        return [bool(value.offload_to_cpu), bool(getattr(value, "rank0_only", False))]
    if name == "mixed_precision_policy":
        return {field: dtype_name(getattr(value, field, None))
                for field in ("param_dtype", "reduce_dtype", "buffer_dtype", "output_dtype")}
    if name == "cpu_offload":
        # FSDP1's CPUOffload(offload_params=...), FSDP2's OffloadPolicy (none) or CPUOffloadPolicy.
        if hasattr(value, "offload_params"):
            return bool(value.offload_params)
        return type(value).__name__ == "CPUOffloadPolicy"
    if name == "param_init_fn":
        return "set"
    if name == "auto_wrap_policy":
        if isinstance(value, str):
            return value.lower()
        inner = getattr(value, "func", value)
        return {"transformer_auto_wrap_policy": "transformer_based_wrap",
                "size_based_auto_wrap_policy": "size_based_wrap"}.get(getattr(inner, "__name__", ""), repr(value))
    if hasattr(value, "name") and not isinstance(value, (str, bool, int)):
        return value.name
    if isinstance(value, (list, tuple, set)):
        return list(value)
    if isinstance(value, (str, bool, int, float)):
        return value
    return repr(value)


def resolve(arguments):
    try:
        return FullyShardedDataParallelPlugin(**arguments)
    except RuntimeError as error:
        if "no available devices found" not in str(error):
            raise
    # Accelerate resolves sync_module_states=True only where an accelerator is (the device goes into
    # the param_init_fn it substitutes): resolve it as on a CUDA machine, which is what its users get.
    is_cuda_available, current_device = accelerate_dataclasses.is_cuda_available, torch.cuda.current_device
    accelerate_dataclasses.is_cuda_available, torch.cuda.current_device = (lambda: True), (lambda: 0)
    try:
        return FullyShardedDataParallelPlugin(**arguments)
    finally:
        accelerate_dataclasses.is_cuda_available, torch.cuda.current_device = is_cuda_available, current_device


def main(cases_path, output_path):
    cases = json.load(open(cases_path))
    results = {}
    for case in cases:
        for variable in list(os.environ):
            if variable.startswith("FSDP_") or variable.startswith("ACCELERATE_"):
                del os.environ[variable]
        os.environ.update(case.get("environment", {}))
        arguments = dict(case.get("arguments", {}))
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                plugin = resolve(arguments)
        except Exception as error:  # the C++ side compares whether both refuse
            results[case["name"]] = {"error": f"{type(error).__name__}: {error}"}
            continue
        results[case["name"]] = {
            "values": {field.name: plain(field.name, getattr(plugin, field.name)) for field in dataclasses.fields(plugin)}
        }
    json.dump(results, open(output_path, "w"), indent=1, sort_keys=True)


if __name__ == "__main__":
    if len(sys.argv) != 3:
        raise SystemExit(__doc__)
    main(sys.argv[1], sys.argv[2])
