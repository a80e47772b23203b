"""The layers of fsdp.cpp, from the tree alone (docs/architecture.md): every file in src/ and
include/fsdp/ may include only headers of its own layer or of layers below it. Prints every
violation and exits 1 if there is one; also fails on a header or source directory the table does
not place, so a new file cannot bypass the check.

    layers_test.py SOURCE_ROOT
"""
import pathlib
import re
import sys

# Lowest first. A file may include its own layer and any layer below.
LAYERS = ["base", "dist", "engine", "checkpoint", "merge", "config", "accelerator", "models", "launch", "cli", "umbrella"]

# src/<directory> -> layer
SOURCE_DIRECTORIES = {
    "io": "base", "shard": "base", "memory": "base", "dist": "dist", "engine": "engine", "checkpoint": "checkpoint",
    "merge": "merge", "config": "config", "accelerator": "accelerator", "models": "models", "launch": "launch",
    "cli": "cli",
}

# include/fsdp/<header> -> layer
PUBLIC_HEADERS = {
    "version.h": "base", "shard_layout.h": "base", "safetensors.h": "base", "torch_file.h": "base",
    "host_memory.h": "base", "device.h": "base",
    "distributed_environment.h": "dist", "process_group.h": "dist", "collectives.h": "dist",
    "sharding_options.h": "engine", "fully_shard.h": "engine", "meta_device.h": "engine", "memory_estimate.h": "engine", "activation_checkpointing.h": "engine",
    "auto_wrap.h": "engine", "clip_grad_norm.h": "engine", "sharded_grad_scaler.h": "engine", "pretrained_model.h": "engine",
    "state_dict_options.h": "checkpoint", "state_dict.h": "checkpoint", "sharded_checkpoint.h": "checkpoint", "dcp.h": "checkpoint",
    "checkpoint.h": "checkpoint", "async_checkpoint.h": "checkpoint", "pretrained_weights.h": "checkpoint",
    "merge.h": "merge",
    "plugin.h": "config", "accelerate_config.h": "config",
    "accelerator.h": "accelerator", "fsdp2_prepare.h": "accelerator",
    "models/llama.h": "models",
    "fsdp.h": "umbrella",
}

# Private headers of these areas are theirs alone: the engine's internals (ParamGroup, the root
# state) are reached from outside only through include/fsdp/fully_shard.h.
PRIVATE_AREAS = {"engine"}

# Inside the engine the root state calls the unit, never the reverse (FSDP2's FSDPState and
# FSDPParamGroup): the unit's files include neither the root state nor the registry of trees.
UNIT_FILES = {"src/engine/param_group.h", "src/engine/param_group.cpp"}
ABOVE_THE_UNIT = {"engine/module_state.h", "engine/registry.h"}
# Below the unit, FSDP2's FSDPParam and the copy-in/copy-out around collectives know no unit at all.
PARAMETER_FILES = {"src/engine/fsdp_param.h", "src/engine/fsdp_param.cpp", "src/engine/fsdp_collectives.h",
                   "src/engine/fsdp_collectives.cpp"}
ABOVE_THE_PARAMETER = ABOVE_THE_UNIT | {"engine/param_group.h"}

INCLUDE = re.compile(r'^\s*#\s*include\s*([<"])([^>"]+)[>"]', re.MULTILINE)


def layer_of_file(root, path):
    relative = path.relative_to(root)
    if relative.parts[0] == "include":
        return PUBLIC_HEADERS.get("/".join(relative.parts[2:]))
    if relative.parts[0] == "src":
        if len(relative.parts) == 2:  # src/version.cpp
            return "base"
        return SOURCE_DIRECTORIES.get(relative.parts[1])
    return None


def layer_of_include(target):
    if target.startswith("fsdp/"):
        return PUBLIC_HEADERS.get(target[len("fsdp/"):], "unplaced public header")
    directory = target.split("/")[0]
    if "/" in target and directory in SOURCE_DIRECTORIES:
        return SOURCE_DIRECTORIES[directory]
    return None  # a system, torch or third-party header


def main(root):
    root = pathlib.Path(root)
    files = sorted(p for p in (root / "include" / "fsdp").rglob("*.h")) + sorted(
        p for p in (root / "src").rglob("*") if p.suffix in (".h", ".cpp"))
    problems = []
    for path in files:
        own = layer_of_file(root, path)
        if own is None:
            problems.append(f"{path.relative_to(root)}: not placed in a layer; add it to tests/build/layers_test.py "
                            "and docs/architecture.md")
            continue
        for quote, target in INCLUDE.findall(path.read_text()):
            layer = layer_of_include(target)
            if layer is None:
                continue
            if layer == "unplaced public header":
                problems.append(f"{path.relative_to(root)}: includes <{target}>, which no layer holds")
            elif LAYERS.index(layer) > LAYERS.index(own):
                problems.append(f"{path.relative_to(root)} ({own}) includes {target} ({layer}), a layer above it")
            elif str(path.relative_to(root)) in UNIT_FILES and target in ABOVE_THE_UNIT:
                problems.append(f"{path.relative_to(root)} includes {target}: the unit must not call its root state")
            elif str(path.relative_to(root)) in PARAMETER_FILES and target in ABOVE_THE_PARAMETER:
                problems.append(f"{path.relative_to(root)} includes {target}: a parameter and its copy-in/copy-out "
                                "must not know their unit")
            elif quote == '"' and target.split("/")[0] in PRIVATE_AREAS and path.parent.name != target.split("/")[0]:
                problems.append(f"{path.relative_to(root)} includes {target}, a private header of src/"
                                f"{target.split('/')[0]}; use the area's public header instead")
    for problem in problems:
        print(problem)
    print(f"layers: {len(files)} files checked, {len(problems)} problems")
    return 1 if problems else 0


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit(__doc__)
    sys.exit(main(sys.argv[1]))
