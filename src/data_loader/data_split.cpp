// Accelerate's BatchSamplerShard, over indices (include/fsdp/data_split.h). The loops follow its
// two iterations (_iter_with_no_split, _iter_with_split) step for step, so that even the cases it
// handles in its own way (a dataset shorter than one round, the copies of the first rows that
// complete the last round) give the same rows; tests/data_loader/data_split_side_by_side_test.cpp compares.
#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <c10/util/Exception.h>
#include <fsdp/data_split.h>

#include <algorithm>
#include <optional>

namespace fsdp {
namespace {

using Batch = std::vector<int64_t>;

// DataLoader's BatchSampler: consecutive runs of batch_size, the last one short unless drop_last.
std::vector<Batch> loader_batches(const std::vector<int64_t>& order, const BatchSplitOptions& options) {
  std::vector<Batch> batches;
  for (size_t first = 0; first < order.size(); first += static_cast<size_t>(options.batch_size)) {
    const size_t last = std::min(order.size(), first + static_cast<size_t>(options.batch_size));
    if (options.drop_last && last - first < static_cast<size_t>(options.batch_size)) break;
    batches.emplace_back(order.begin() + static_cast<std::ptrdiff_t>(first),
                         order.begin() + static_cast<std::ptrdiff_t>(last));
  }
  return batches;
}

// The rows [begin, end) of `batch`, clamped as a Python slice is.
Batch slice(const Batch& batch, int64_t begin, int64_t end) {
  const auto size = static_cast<int64_t>(batch.size());
  begin = std::min(begin, size);
  end = std::min(end, size);
  if (end <= begin) return {};
  return Batch(batch.begin() + begin, batch.begin() + end);
}

// Doubles `rows` until it holds at least `needed` (a dataset shorter than one round is cycled).
void repeat_until(Batch& rows, size_t needed) {
  while (!rows.empty() && rows.size() < needed) {
    const Batch copy = rows;
    rows.insert(rows.end(), copy.begin(), copy.end());
  }
}

std::vector<Batch> deal_whole_batches(const std::vector<Batch>& batches, const BatchSplitOptions& options,
                                      int64_t processes, int64_t rank) {
  const auto full = static_cast<size_t>(options.batch_size);
  std::vector<Batch> mine;
  Batch first_rows;  // the first round's rows, to complete the last round from
  std::optional<Batch> pending;
  for (size_t index = 0; index < batches.size(); ++index) {
    const auto i = static_cast<int64_t>(index);
    if (!options.drop_last && i < processes)
      first_rows.insert(first_rows.end(), batches[index].begin(), batches[index].end());
    if (i % processes == rank) pending = batches[index];
    // A round is given out once its last batch is full, so no rank gets a batch the others lack.
    if (i % processes == processes - 1 && batches[index].size() == full) {
      mine.push_back(*pending);
      pending.reset();
    }
  }
  if (options.drop_last || first_rows.empty()) return mine;
  if (!options.even_batches) {
    if (pending && !pending->empty()) mine.push_back(*pending);
    return mine;
  }
  if (pending && pending->size() == full) mine.push_back(*pending);
  repeat_until(first_rows, static_cast<size_t>(processes) * full);
  Batch batch = batches.back();
  auto index = static_cast<int64_t>(batches.size()) - 1;
  if (batch.size() == full) {  // given out already: the round goes on with the next batch
    batch.clear();
    ++index;
  }
  size_t cycle = 0;
  while (index % processes != 0 || !batch.empty()) {
    const size_t end = cycle + full - batch.size();
    batch.insert(batch.end(), first_rows.begin() + static_cast<std::ptrdiff_t>(cycle),
                 first_rows.begin() + static_cast<std::ptrdiff_t>(std::min(end, first_rows.size())));
    if (index % processes == rank) mine.push_back(batch);
    cycle = end;
    batch.clear();
    ++index;
  }
  return mine;
}

std::vector<Batch> cut_each_batch(const std::vector<Batch>& batches, const BatchSplitOptions& options,
                                  int64_t processes, int64_t rank) {
  const int64_t piece = options.batch_size / processes;
  std::vector<Batch> mine;
  for (const auto& batch : batches) {
    if (static_cast<int64_t>(batch.size()) == options.batch_size)
      mine.push_back(slice(batch, piece * rank, piece * (rank + 1)));
  }
  if (options.drop_last || batches.empty() || static_cast<int64_t>(batches.back().size()) == options.batch_size)
    return mine;
  const Batch& last = batches.back();
  if (!options.even_batches) {
    if (static_cast<int64_t>(last.size()) > piece * rank) mine.push_back(slice(last, piece * rank, piece * (rank + 1)));
    return mine;
  }
  Batch first_rows = batches.front();
  repeat_until(first_rows, static_cast<size_t>(options.batch_size));
  Batch completed = last;
  completed.insert(completed.end(), first_rows.begin(), first_rows.end());
  mine.push_back(slice(completed, piece * rank, piece * (rank + 1)));
  return mine;
}

// How many batches rank `rank` gets when even_batches is off (Accelerate's BatchSamplerShard.__len__).
int64_t uneven_count(const std::vector<Batch>& batches, const BatchSplitOptions& options, int64_t processes,
                     int64_t rank) {
  if (options.split_batches) {
    const bool short_last = !batches.empty() && static_cast<int64_t>(batches.back().size()) < options.batch_size;
    const int64_t piece = options.batch_size / processes;
    const auto full = static_cast<int64_t>(batches.size()) - (short_last ? 1 : 0);
    return full + (short_last && static_cast<int64_t>(batches.back().size()) > piece * rank ? 1 : 0);
  }
  const auto count = static_cast<int64_t>(batches.size());
  return count / processes + (rank < count % processes ? 1 : 0);
}

}  // namespace

void validate(const BatchSplitOptions& options, int64_t num_processes) {
  TORCH_CHECK(num_processes >= 1, "BatchSplitOptions: num_processes must be at least 1, got ", num_processes);
  TORCH_CHECK(options.batch_size >= 1, "BatchSplitOptions.batch_size must be at least 1, got ", options.batch_size,
              "; set it to the rows of one rank's batch (or of the global batch with split_batches)");
  TORCH_CHECK(!options.split_batches || options.batch_size % num_processes == 0,
              "BatchSplitOptions: with split_batches the batch_size (", options.batch_size,
              ", the global batch) must be a multiple of the number of processes (", num_processes, "), as in ",
              "Accelerate; use a batch_size of ", (options.batch_size / num_processes + 1) * num_processes,
              " or turn split_batches off so that batch_size is each rank's batch");
}

std::vector<int64_t> sequential_order(int64_t rows) {
  TORCH_CHECK(rows >= 0, "sequential_order: rows must not be negative, got ", rows);
  std::vector<int64_t> order(static_cast<size_t>(rows));
  for (int64_t row = 0; row < rows; ++row) order[static_cast<size_t>(row)] = row;
  return order;
}

std::vector<int64_t> seeded_random_order(int64_t rows, uint64_t seed, int64_t epoch) {
  // As torch's RandomSampler, which Accelerate's seeded one is: a shuffled empty dataset is an error.
  TORCH_CHECK(rows > 0, "seeded_random_order: rows must be positive (PyTorch's RandomSampler refuses ",
              "num_samples=", rows, " too); an empty dataset has no batches to shuffle");
  TORCH_CHECK(epoch >= 0, "seeded_random_order: epoch must not be negative, got ", epoch);
  auto generator = at::make_generator<at::CPUGeneratorImpl>(seed + static_cast<uint64_t>(epoch));
  const auto permutation = at::randperm(rows, generator, at::TensorOptions().dtype(at::kLong));
  const auto* values = permutation.data_ptr<int64_t>();
  return std::vector<int64_t>(values, values + rows);
}

std::vector<std::vector<int64_t>> split_batches_for_rank(const std::vector<int64_t>& order,
                                                         const BatchSplitOptions& options, int64_t num_processes,
                                                         int64_t process_index) {
  validate(options, num_processes);
  TORCH_CHECK(process_index >= 0 && process_index < num_processes, "split_batches_for_rank: process_index ",
              process_index, " is outside 0..", num_processes - 1);
  const auto batches = loader_batches(order, options);
  if (!options.even_batches && !options.drop_last) {
    const int64_t first = uneven_count(batches, options, num_processes, 0);
    const int64_t last = uneven_count(batches, options, num_processes, num_processes - 1);
    if (first != last) {
      TORCH_WARN_ONCE("split_batches_for_rank: with even_batches off, rank 0 gets ", first, " batches of ",
                      order.size(), " rows and rank ", num_processes - 1, " gets ", last,
                      ". Every FSDP step is collective: a rank that trains on a batch the others lack waits for "
                      "them in its next collective until the timeout. Keep even_batches on, set drop_last, or "
                      "stop every rank after ",
                      std::min(first, last), " batches");
    }
  }
  return options.split_batches ? cut_each_batch(batches, options, num_processes, process_index)
                               : deal_whole_batches(batches, options, num_processes, process_index);
}

}  // namespace fsdp
