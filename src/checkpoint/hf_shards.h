// Hugging Face's sharded layout of a state dict: files `<stem>-00001-of-0000N.safetensors`, each
// holding whole tensors in state-dict order and at most `max_shard_size` bytes (a tensor larger
// than that gets a file of its own), and `<stem>.safetensors.index.json` mapping every tensor to
// its file. The one planner behind Accelerator::save_model and merge_fsdp_weights, and the writer of
// a full state dict in save_pretrained's layout, one tensor at a time.
#pragma once

#include <fsdp/safetensors.h>

#include <cstdint>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "checkpoint/state_dict_views.h"

namespace fsdp::detail {

struct ShardFile {
  std::string name;
  std::vector<std::string> tensors;
  int64_t bytes = 0;
};

/// Splits `tensors` (name, bytes), in order, into files of at most `max_shard_size` bytes (> 0).
std::vector<ShardFile> plan_shard_files(const std::vector<std::pair<std::string, int64_t>>& tensors,
                                        int64_t max_shard_size, const std::string& stem);

/// The index file's text: {"metadata": {"total_size": ...}, "weight_map": {tensor: file}}.
std::string shard_index_json(const std::vector<ShardFile>& files, int64_t total_size);

/// Note [a full state dict one tensor at a time]
/// Accelerator::save_model writes the full model from rank 0, but rank 0 need not hold it: the names,
/// dtypes and shapes are known on every rank before any data (FullModelTensors), so the files'
/// headers are planned first and each tensor is gathered when its file reaches it and dropped once
/// written. Rank 0 holds one full tensor at a time instead of the whole model (at 0.544 B
/// parameters on 4 ranks, the whole model was 2.18 GB more on rank 0 at the end of a run;
/// bench/README.md). The gathers are collective, so every rank asks for the same tensors in the
/// same order: the files' order, which each rank computes from the entries alone
/// (safetensors_write_order for a safetensors file, the state dict's order for a torch file). A
/// rank that does not write, and a writer that failed part way (a full disk), take the tensors left
/// without writing them, so no rank waits for a gather another rank never issues; the write's
/// error comes back to the caller to be agreed on, which it then is on every rank.

/// Writes a state dict into `directory` as transformers' save_pretrained lays it out (what
/// Accelerator::save_model writes): model.safetensors, or model-0000i-of-0000N.safetensors and
/// model.safetensors.index.json past `max_shard_size` (> 0; 0 for one file), or pytorch_model.bin
/// without `safe_serialization`. Each file is written atomically; a previous save's files of another
/// layout are removed once the new files are in place (transformers would load them instead: it
/// prefers model.safetensors to an index), a previous index before the new shards. `tensor(i)` gives entries[i], with
/// the dtype and shape it states, once per entry in the files' order (Note [a full state dict one tensor at a time]):
/// on the rank that `writes`, as its files reach it; on any other, one after the other. Returns the write's error, ""
/// when none, rather than raising it; an error from `tensor` is raised.
std::string save_pretrained_files(const std::string& directory, const std::vector<FullModelTensors::Entry>& entries,
                                  int64_t max_shard_size, bool safe_serialization, bool writes,
                                  const std::function<at::Tensor(size_t index)>& tensor);

}  // namespace fsdp::detail
