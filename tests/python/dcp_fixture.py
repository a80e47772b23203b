"""DCP checkpoints the way Accelerate saves them under FSDP2, and what PyTorch reads back from them,
for the tests of fsdp.cpp's DCP reader. Run on N processes with torchrun's variables.

    dcp_fixture.py DIR

Every rank seeds 0 and builds MODEL (below, first dimensions 5, 7 and 3 that do not divide evenly
over 2 or 3 ranks, a bf16 buffer-free layer, biases), shards each block and the root with
fully_shard, takes two AdamW steps, then saves like accelerate's save_fsdp_model/optimizer with
SHARDED_STATE_DICT:
    dcp.save({"model": get_model_state_dict(model)}, DIR/pytorch_model_fsdp_0)
    dcp.save({"optimizer": get_optimizer_state_dict(model, optimizer)}, DIR/optimizer_0)
The same optimizer state is saved once more into DIR/optimizer_one_item_groups with its param_groups
as one non-tensor value (a tuple, which DCP's flattening keeps whole), the layout older torch wrote
for the list. Rank 0 then writes DIR/expected.json: for both directories, PyTorch's own read_metadata() in plain
form (every key with its dtype, size and chunks, or "bytes", and every storage entry), and
DIR/full_model.safetensors, the full model state dict.
"""
import json
import os
import sys

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from safetensors.torch import save_file
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import BytesStorageMetadata
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     get_optimizer_state_dict)
from torch.distributed.fsdp import fully_shard


def build():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 5), torch.nn.Linear(5, 7), torch.nn.Linear(7, 3),
                                torch.nn.Linear(3, 2, bias=False))
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    return model


def plain(metadata):
    entries = {}
    for key, entry in metadata.state_dict_metadata.items():
        if isinstance(entry, BytesStorageMetadata):
            entries[key] = "bytes"
        else:
            entries[key] = {"dtype": str(entry.properties.dtype).replace("torch.", ""), "size": list(entry.size),
                            "chunks": [[list(chunk.offsets), list(chunk.sizes)] for chunk in entry.chunks]}
    storage = sorted([index.fqn, None if index.offset is None else list(index.offset), info.relative_path, info.offset,
                      info.length] for index, info in metadata.storage_data.items())
    paths = {key: [str(element) for element in path] for key, path in (metadata.planner_data or {}).items()}
    return {"keys": list(metadata.state_dict_metadata), "entries": entries, "storage": storage, "paths": paths,
            "version": getattr(metadata, "version", None) or ""}


def main(directory):
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    model = build()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(2):
        torch.manual_seed(100 + step)
        model(torch.randn(4, 3)).pow(2).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
    dcp.save({"model": get_model_state_dict(model)}, checkpoint_id=f"{directory}/pytorch_model_fsdp_0")
    optimizer_state = get_optimizer_state_dict(model, optimizer)
    dcp.save({"optimizer": optimizer_state}, checkpoint_id=f"{directory}/optimizer_0")
    dcp.save({"optimizer": {"state": optimizer_state["state"], "param_groups": tuple(optimizer_state["param_groups"])}},
             checkpoint_id=f"{directory}/optimizer_one_item_groups")
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if dist.get_rank() == 0:
        expected = {name: plain(FileSystemReader(f"{directory}/{name}").read_metadata())
                    for name in ("pytorch_model_fsdp_0", "optimizer_0")}
        json.dump(expected, open(f"{directory}/expected.json", "w"), indent=1)
        save_file({name: tensor.contiguous() for name, tensor in full.items()}, f"{directory}/full_model.safetensors")
    dist.barrier()
    # PyTorch's Gloo sometimes aborts in its own teardown (tests/python/fsdp2_parity.py): every rank
    # is done and the result is written, so leave without tearing down.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit(__doc__)
    main(sys.argv[1])
