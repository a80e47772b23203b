"""Accelerate's prepare_data_loader on the cases of tests/data_loader/data_split_side_by_side_test.cpp.

    accelerate_data_split.py CASES OUTPUT

CASES is a JSON list of {"rows", "batch_size", "drop_last", "split_batches", "even_batches",
"processes", "shuffle", "seed", "epoch"}. For each case a DataLoader over the dataset of row indices
0..rows-1 (shuffle through Accelerate's SeedableRandomSampler with data_seed=seed, at epoch `epoch`)
is prepared once per process index, as each process of a job would, and OUTPUT receives per case
either {"error": message} or {"ranks": [[batch, ...] per process]}, each batch the row indices that
process trains on.
"""
import json
import sys

import torch
from accelerate.data_loader import prepare_data_loader
from torch.utils.data import DataLoader


def rows_of_each_process(case):
    ranks = []
    for process_index in range(case["processes"]):
        loader = DataLoader(list(range(case["rows"])), batch_size=case["batch_size"], shuffle=case["shuffle"],
                            drop_last=case["drop_last"])
        prepared = prepare_data_loader(loader, num_processes=case["processes"], process_index=process_index,
                                       split_batches=case["split_batches"], even_batches=case["even_batches"],
                                       put_on_device=False, use_seedable_sampler=case["shuffle"],
                                       data_seed=case["seed"])
        prepared.set_epoch(case["epoch"])
        ranks.append([batch.tolist() for batch in prepared])
    return ranks


def main():
    cases = json.load(open(sys.argv[1]))
    results = []
    for case in cases:
        try:
            results.append({"ranks": rows_of_each_process(case)})
        except ValueError as error:
            results.append({"error": str(error)})
    json.dump(results, open(sys.argv[2], "w"))


if __name__ == "__main__":
    torch.manual_seed(0)
    main()
