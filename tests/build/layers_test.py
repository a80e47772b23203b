"""The layers of fsdp.cpp, from the tree alone (docs/architecture.md): every file in src/ and
include/fsdp/ may include only headers of its own layer or of layers below it, and no concepts
(.h/.cpp pairs, and files of their own) may form an include loop. Prints every
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
    "io": "base", "shard": "base", "data_loader": "base", "memory": "base", "dist": "dist", "engine": "engine", "checkpoint": "checkpoint",
    "merge": "merge", "config": "config", "accelerator": "accelerator", "models": "models", "launch": "launch",
    "cli": "cli",
}

# include/fsdp/<header> -> layer
PUBLIC_HEADERS = {
    "version.h": "base", "shard_layout.h": "base", "safetensors.h": "base", "torch_file.h": "base",
    "host_memory.h": "base", "device.h": "base", "data_split.h": "base",
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
ABOVE_THE_UNIT = {"engine/module_state.h", "engine/root_state.h", "engine/registry.h"}
# Below the unit, FSDP2's FSDPParam and the copy-in/copy-out around collectives know no unit at all.
PARAMETER_FILES = {"src/engine/fsdp_param.h", "src/engine/fsdp_param.cpp", "src/engine/fsdp_collectives.h",
                   "src/engine/fsdp_collectives.cpp"}
ABOVE_THE_PARAMETER = ABOVE_THE_UNIT | {"engine/param_group.h"}

INCLUDE = re.compile(r'^\s*#\s*include\s*([<"])([^>"]+)[>"]', re.MULTILINE)

# Concepts must not form include loops, of two concepts or more: one of them is then not below the
# others, and none of them can be read, built or replaced alone. A concept is a file stem: X.h with
# its X.cpp (a public include/fsdp/X.h pairs with src/<area>/X.cpp), a header with no source of its
# own, or a source with no header. A header H with no source of its own that includes X's header,
# while X's source includes H, is X's private half (state_dict_views.h beside state_dict.h) and counts
# as X; a public header, or any other header-only file, is a concept of its own, so a loop through
# it is found too.


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


def concept_loops(root, files):
    stems, private = {}, set()
    for path in files:
        stems.setdefault(path.stem, set()).add(path.suffix)
        if path.relative_to(root).parts[0] == "src":
            private.add(path.stem)
    includes = {}  # (stem, suffix) -> {included stem: the include, as written, for the message}
    for path in files:
        for _, target in INCLUDE.findall(path.read_text()):
            if layer_of_include(target) in (None, "unplaced public header"):
                continue
            other = pathlib.PurePosixPath(target).stem
            if other != path.stem and other in stems:
                includes.setdefault((path.stem, path.suffix), {})[other] = f"{path.relative_to(root)} includes {target}"
    concept = {stem: stem for stem in stems}
    for stem, suffixes in stems.items():
        if suffixes != {".h"} or stem not in private:
            continue
        for owner in includes.get((stem, ".h"), {}):
            if ".cpp" in stems[owner] and stem in includes.get((owner, ".cpp"), {}):
                concept[stem] = owner
                break
    edges, where = {}, {}
    for (stem, _), targets in includes.items():
        for other, how in targets.items():
            a, b = concept[stem], concept[other]
            if a != b:
                edges.setdefault(a, set()).add(b)
                where.setdefault((a, b), how)
    # Tarjan's strongly connected components, iteratively (the graph has a few hundred concepts).
    index, low, on_stack, stack, loops, counter = {}, {}, set(), [], [], 0
    for start in sorted(set(concept.values())):
        if start in index:
            continue
        work = [(start, iter(sorted(edges.get(start, ()))))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.add(member)
                    if member == node:
                        break
                if len(component) > 1:
                    loops.append(sorted(component))
    problems = []
    for component in sorted(loops):
        links = [where[(a, b)] for a in component for b in sorted(edges.get(a, ())) if b in component]
        problems.append(f"the concepts {', '.join(component)} include each other's headers ({'; '.join(links)}); "
                        "move what they share into a header of its own, or let one of them stop needing the other")
    return problems


def self_test():
    """The loop check on small trees written for it: each must find what it was built to show."""
    import tempfile

    def loops_in(tree):
        with tempfile.TemporaryDirectory() as directory:
            root = pathlib.Path(directory)
            for name, text in tree.items():
                (root / name).parent.mkdir(parents=True, exist_ok=True)
                (root / name).write_text(text)
            files = sorted((root / "include" / "fsdp").rglob("*.h")) + sorted(
                p for p in (root / "src").rglob("*") if p.suffix in (".h", ".cpp"))
            return concept_loops(root, files)

    pair = lambda area, stem, includes: {f"src/{area}/{stem}.h": "", f"src/{area}/{stem}.cpp": "".join(
        f'#include "{target}"\n' for target in includes)}
    cases = {
        "two concepts": ({**pair("engine", "a", ["engine/b.h"]), **pair("engine", "b", ["engine/a.h"])}, ["a, b"]),
        "three concepts": ({**pair("engine", "a", ["engine/b.h"]), **pair("engine", "b", ["engine/c.h"]),
                            **pair("engine", "c", ["engine/a.h"])}, ["a, b, c"]),
        "through a header of its own": ({**pair("engine", "a", ["engine/h.h"]), **pair("engine", "b", ["engine/a.h"]),
                                         "src/engine/h.h": '#include "engine/b.h"\n'}, ["a, b, h"]),
        "public headers": ({"include/fsdp/collectives.h": "#include <fsdp/process_group.h>\n",
                            "include/fsdp/process_group.h": "", "src/dist/c10d/collectives.cpp": "",
                            "src/dist/process_group.cpp": "#include <fsdp/collectives.h>\n"},
                           ["collectives, process_group"]),
        "a private half is its concept": ({**pair("checkpoint", "a", ["checkpoint/a_views.h"]),
                                           "src/checkpoint/a_views.h": '#include "checkpoint/a.h"\n'}, []),
        "no loop": ({**pair("engine", "a", ["engine/b.h"]), **pair("engine", "b", [])}, []),
    }
    failures = []
    for name, (tree, expected) in cases.items():
        found = [problem.split(" include each other")[0][len("the concepts "):] for problem in loops_in(tree)]
        if found != expected:
            failures.append(f"layers self-test '{name}': expected loops {expected}, found {found}")
    return failures


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
    problems += concept_loops(root, files)
    problems += self_test()
    for problem in problems:
        print(problem)
    print(f"layers: {len(files)} files checked, {len(problems)} problems")
    return 1 if problems else 0


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit(__doc__)
    sys.exit(main(sys.argv[1]))
