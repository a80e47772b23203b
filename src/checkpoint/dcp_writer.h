// Writing a PyTorch distributed checkpoint (DCP) directory the way torch.distributed.checkpoint's
// FileSystemWriter does (torch/distributed/checkpoint/filesystem.py; docs/checkpoint-format.md), so that dcp.load,
// dcp_to_torch_save and Accelerate read what fsdp.cpp saves: every rank writes `__<rank>_0.distcp`,
// a concatenation of one torch.save archive per item (its rows of each sharded tensor; replicated
// tensors and byte items from rank 0 only), then rank 0 writes `.metadata` (a pickle of Metadata
// with every chunk and where it lies) once every rank has finished its file. Until `.metadata` is
// there the directory is not a checkpoint; an earlier one in its place is removed first, so a save
// that stops half way never leaves old metadata describing new files.
#pragma once

#include <ATen/core/ivalue.h>
#include <fsdp/process_group.h>
#include <fsdp/state_dict.h>

#include <cstdint>
#include <string>
#include <vector>

namespace fsdp::detail {

/// One step of an item's path in the nested state dict: a dict key, or (index >= 0) a list position.
struct DcpPathElement {
  std::string key;
  int64_t index = -1;
};
using DcpPath = std::vector<DcpPathElement>;

/// DCP's flattened key: the path's elements joined with ".".
std::string dcp_flat_key(const DcpPath& path);

struct DcpTensorEntry {
  DcpPath path;
  ShardedTensor tensor;
};

/// A non-tensor value, stored as torch.save of it (BYTE_IO).
struct DcpByteEntry {
  DcpPath path;
  c10::IValue value;
};

/// Writes the entries into `directory` (created if needed). Every rank passes the same entries in
/// the same order with its own rows. Rank 0's `save_id` is recorded in the metadata's StorageMeta
/// and in every rank's file (Note [save identity]); the other ranks' is ignored.
/// Collective over `context.world()`; a failure on any rank is raised on every rank.
void write_dcp_directory(const std::string& directory, const std::vector<DcpTensorEntry>& tensors,
                         const std::vector<DcpByteEntry>& byte_items, const DistributedContext& context,
                         const std::string& save_id);

/// write_dcp_directory in its three parts: prepare (collective: creates the directory and removes
/// an earlier checkpoint's metadata there), this rank's file (local, no collective: writes it and its
/// metadata piece, and returns its report, "ERROR:<message>" when it failed; the asynchronous
/// checkpointer runs it on a thread of its own, Note [asynchronous checkpoints]), and finish
/// (collective: rank 0 joins the ranks' metadata pieces into `.metadata`, Note [metadata pieces];
/// a rank's failure is raised on every rank). `tensors` need only their shapes and dtypes in finish.
void prepare_dcp_directory(const std::string& directory, const DistributedContext& context);
/// prepare's two local halves, for a save that runs them inside its own collectives (a SHARDED
/// checkpoint, checkpoint.cpp): rank 0 clears the directory while every rank (rank 0 after
/// clearing) creates it; no rank writes there before every rank has done its part.
void clear_dcp_directory(const std::string& directory);
void create_dcp_directory(const std::string& directory);
std::string write_dcp_rank_file(const std::string& directory, const std::vector<DcpTensorEntry>& tensors,
                                const std::vector<DcpByteEntry>& byte_items, int64_t rank, int64_t world_size,
                                const std::string& save_id);
void finish_dcp_directory(const std::string& directory, const std::vector<DcpTensorEntry>& tensors,
                          const std::vector<DcpByteEntry>& byte_items, const DistributedContext& context,
                          const std::string& save_id, const std::string& report);
/// finish's two local halves: the error a rank's report carries ("" when its file was written), and
/// rank 0's join of every rank's piece into `.metadata` (a piece missing or from another save is an
/// error naming it), to run once every rank's report is known to be good.
std::string dcp_write_error(const std::string& directory, int64_t rank, const std::string& report);
void write_dcp_metadata(const std::string& directory, const std::vector<DcpTensorEntry>& tensors,
                        const std::vector<DcpByteEntry>& byte_items, int64_t world_size, const std::string& save_id);

/// {"model": state}: Accelerate's SHARDED model layout.
std::vector<DcpTensorEntry> model_dcp_entries(const ShardedTensorList& state);

}  // namespace fsdp::detail

namespace fsdp::detail {

/// {"optimizer": {"state": {param: {field: tensor}}, "param_groups": [{option: value, "params":
/// [names]}]}}: what get_optimizer_state_dict gives under FSDP2, with PyTorch's options for the
/// optimizer class (pytorch_param_group). Tensors go to `tensors`, options to `byte_items`.
void optimizer_dcp_entries(const OptimizerStateDict& state, std::vector<DcpTensorEntry>& tensors,
                           std::vector<DcpByteEntry>& byte_items);

}  // namespace fsdp::detail
