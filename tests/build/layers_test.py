"""The layers of fsdp.cpp, from the tree alone (docs/architecture.md): every file in src/ and
include/fsdp/ may include only headers of its own layer or of layers below it, and no two .h/.cpp
pairs may include each other's headers (KNOWN_LOOPS lists the two that remain). Prints every
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
    "sharding_options.h": "engine", "fully_shard_options.h": "engine", "fully_shard.h": "engine", "meta_device.h": "engine", "memory_estimate.h": "engine", "activation_checkpointing.h": "engine",
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

# Two concepts (a .h/.cpp pair; a public include/fsdp/X.h pairs with its src/<area>/X.cpp) must not
# include each other's headers: one of them is then not a layer below the other, and neither can be
# read, built or replaced alone. The loops that remain, each to be removed (the test fails when one
# is gone, so that this list only shrinks):
KNOWN_LOOPS = {
    # registry.cpp reads a tree's RootState (its root, its units, whether an iteration runs) to keep
    # the table consistent; module_state.cpp registers trees in it.
    ("module_state", "registry"),
    # process_group.cpp all-gathers the members' layouts on the control channel when it creates a
    # subgroup; collectives.h takes ProcessGroup arguments.
    ("collectives", "process_group"),
}


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


def two_file_loops(root, files):
    stems_with = {".h": set(), ".cpp": set()}
    for path in files:
        stems_with[path.suffix].add(path.stem)
    pairs = stems_with[".h"] & stems_with[".cpp"]
    uses, where = {}, {}
    for path in files:
        if path.stem not in pairs:
            continue
        for _, target in INCLUDE.findall(path.read_text()):
            if layer_of_include(target) in (None, "unplaced public header"):
                continue
            other = pathlib.PurePosixPath(target).stem
            if other != path.stem and other in pairs:
                uses.setdefault(path.stem, set()).add(other)
                where.setdefault((path.stem, other), f"{path.relative_to(root)} includes {target}")
    found = {(a, b) for a in uses for b in uses[a] if a < b and a in uses.get(b, ())}
    problems = [f"{where[(a, b)]} and {where[(b, a)]}: {a} and {b} include each other's headers; move what both "
                "need into a header of its own, or let one of them stop needing the other" for a, b in sorted(found - KNOWN_LOOPS)]
    problems += [f"the loop between {a} and {b} is gone: remove it from KNOWN_LOOPS in tests/build/layers_test.py"
                 for a, b in sorted(KNOWN_LOOPS - found)]
    return problems


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
    problems += two_file_loops(root, files)
    for problem in problems:
        print(problem)
    print(f"layers: {len(files)} files checked, {len(problems)} problems")
    return 1 if problems else 0


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit(__doc__)
    sys.exit(main(sys.argv[1]))
