// The rows each rank trains on: Accelerate's prepare(dataloader) for a map-style dataset, as
// indices (Accelerate's BatchSamplerShard over a BatchSampler, and its SeedableRandomSampler).
//
// The loader yields batches of `batch_size` rows in `order`; each rank then takes its part:
//   - split_batches false (Accelerate's default): whole batches, in turn (batch i goes to rank
//     i % N), so `batch_size` is the batch of one rank and the global batch is N times it;
//   - split_batches true: every batch is cut into N equal pieces, rank r taking piece r, so
//     `batch_size` is the global batch and must be a multiple of N.
// even_batches (default true) completes the last round by starting again at the first rows, so
// every rank gets as many batches, all full; without it the last ranks may get one batch fewer or a
// short one. drop_last leaves out the batches that would not be full on every rank.
//
// Every rank must compute the same order (the same seed and epoch) for the parts to partition it:
// tests/data_loader/data_split_side_by_side_test.cpp runs Accelerate's prepare_data_loader on the same
// rows and compares, rank by rank.
#pragma once

#include <cstdint>
#include <vector>

namespace fsdp {

struct BatchSplitOptions {
  /// Rows per batch the loader yields: one rank's batch, or the global batch with split_batches.
  /// Default: 1 (torch.utils.data.DataLoader's).
  int64_t batch_size = 1;
  /// Leave out the last batches instead of completing them. Default: false (DataLoader's).
  bool drop_last = false;
  /// Cut each batch into one piece per rank instead of dealing whole batches (Accelerate's
  /// DataLoaderConfiguration.split_batches). Default: false.
  bool split_batches = false;
  /// Complete the last round from the first rows so every rank gets the same number of full
  /// batches (Accelerate's DataLoaderConfiguration.even_batches). Default: true.
  bool even_batches = true;
};

/// Checks `options` for `num_processes` ranks: an error naming the field, its value and the fix
/// (batch_size below 1; split_batches with a batch_size that is not a multiple of num_processes).
void validate(const BatchSplitOptions& options, int64_t num_processes);

/// 0, 1, ..., rows - 1 (DataLoader's shuffle=False).
std::vector<int64_t> sequential_order(int64_t rows);

/// The order of Accelerate's SeedableRandomSampler (use_seedable_sampler=True, data_seed=seed) in
/// epoch `epoch`: torch.randperm(rows) from a CPU generator seeded with seed + epoch, the same on
/// every rank and in PyTorch. rows must be positive, as torch's RandomSampler requires.
std::vector<int64_t> seeded_random_order(int64_t rows, uint64_t seed, int64_t epoch = 0);

/// The batches of rank `process_index` out of `num_processes`, each a list of indices into the
/// dataset, in the order the rank trains on them (Accelerate's BatchSamplerShard).
std::vector<std::vector<int64_t>> split_batches_for_rank(const std::vector<int64_t>& order,
                                                         const BatchSplitOptions& options, int64_t num_processes,
                                                         int64_t process_index);

}  // namespace fsdp
