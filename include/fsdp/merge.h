// merge_fsdp_weights: a sharded checkpoint directory into one full model file (Accelerate's
// merge_fsdp_weights and `accelerate merge-weights`), streaming, with bounded memory.
//
// The input is a sharded directory written by save_checkpoint (`pytorch_model_fsdp_0/`, or
// `optimizer_0/`), or a PyTorch distributed checkpoint (DCP) model directory as Accelerate saves
// it under FSDP2, merged as accelerate.utils.merge_fsdp_weights merges it. Tensors are read chunk by chunk from the
// rank files and written straight into the output, so memory stays bounded by a 64 MB read buffer for safetensors
// output (the largest single tensor for torch .bin output), whatever the model's size. Every output file is written
// into a temporary directory beside the output and moved into place only when all are complete; the input is removed
// (when asked) only after that.
#pragma once

#include <fsdp/process_group.h>

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

namespace fsdp {

struct MergeOptions {
  /// model.safetensors (true) or pytorch_model.bin that torch.load reads (false). Default: true.
  bool safe_serialization = true;
  /// Delete the input directory after the output is completely written. Default: false.
  bool remove_checkpoint_dir = false;
  /// Split safetensors output into Hugging Face shards of at most this many bytes
  /// (model-00001-of-0000N.safetensors + model.safetensors.index.json); 0 writes one file. Default: 0.
  int64_t max_shard_size = 0;
  /// Replace output files that already exist. Default: false (an error).
  bool overwrite = false;
  /// Called as bytes are written: (bytes written, bytes in total). Default: none.
  std::function<void(int64_t written, int64_t total)> progress;
};

struct MergeResult {
  /// The files written, in OUTPUT_PATH.
  std::vector<std::string> files;
  int64_t tensors = 0;
  int64_t bytes = 0;
};

/// The seed's signature. In a process that is not rank 0 of a distributed launch (RANK and
/// WORLD_SIZE say so) it is an error: every rank would write the same files. Pass the context
/// (below) for Accelerate's behavior, or call it on the main process only.
MergeResult merge_fsdp_weights(const std::string& checkpoint_dir, const std::string& output_path,
                               bool safe_serialization = true, bool remove_checkpoint_dir = false);
MergeResult merge_fsdp_weights(const std::string& checkpoint_dir, const std::string& output_path,
                               const MergeOptions& options);
/// As Accelerate does under a distributed launch: the main process merges while the others wait; a
/// failure there is raised on every rank, naming rank 0; every rank returns rank 0's result. The
/// merge may take long: the others wait up to the context's collective timeout. Collective.
MergeResult merge_fsdp_weights(const std::string& checkpoint_dir, const std::string& output_path,
                               const MergeOptions& options, const DistributedContext& context);

namespace detail {
/// Not part of the API (detail): the CLI's reader of byte sizes (--max-shard-size, --memory-per-rank),
/// shared with merge_bench. "5GB", "500MB", "1.5GB", "64KB", "1000" (bytes); decimal units as
/// Hugging Face uses them, and KiB/MiB/GiB. Throws naming the text otherwise.
int64_t parse_byte_size(const std::string& text);
}  // namespace detail

}  // namespace fsdp
