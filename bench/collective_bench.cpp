// Benchmark: our all-gather and reduce-scatter against Gloo's own all-reduce of the same buffer (the
// ceiling on this loopback) and against Gloo's own all-gather and reduce-scatter of the same buffers
// (Note [Collectives on Gloo]), and a SHARDED checkpoint's save and load against cp of the same bytes.
// Run under `fsdp launch`; rank 0 prints one JSON line per measurement.
//
//   fsdp launch --nproc-per-node 2 -- build/bin/collective_bench [--megabytes 64] [--directory /tmp/x]
//
// `--sweep` instead times every algorithm the engine has for all-gather, reduce-scatter and
// all-reduce (Note [Algorithms by measurement]: direct, ring, and on several machines two_level_direct
// and two_level_ring), through the engine's own calls with the algorithm forced, at 64 KB to 64 MB
// (the full buffer), on the world group and, with three machines or more, on the group of one rank per
// machine. Two collectives are in flight at once (kInFlight), as the engine's prefetch keeps them, and
// the time is per collective. Rounds alternate the algorithms; each time is the slowest rank's, each
// figure the median over rounds with the fastest and slowest round. Rank 0 prints one JSON line per (collective, group,
// size, algorithm), and with `--table FILE` writes the fastest algorithm per size as rows of the
// table the engine reads (bench/collective_table.sh merges them into src/dist/collective_algorithms.tsv).
//   fsdp launch --nproc-per-node 8 -- build/bin/collective_bench --sweep [--rounds 5] [--table rows.tsv]
#include <fsdp/fsdp.h>
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iostream>

#include "dist/c10d/backend.h"

namespace {

using fsdp::detail::CollectiveAlgorithm;
using fsdp::detail::CollectiveOperation;

double median_seconds(const fsdp::DistributedContext& context, int repeats, const std::function<void()>& body) {
  std::vector<double> times;
  for (int index = 0; index < repeats + 1; ++index) {
    fsdp::barrier(context.world());
    const auto start = std::chrono::steady_clock::now();
    body();
    fsdp::barrier(context.world());
    if (index > 0) times.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
  }
  std::sort(times.begin(), times.end());
  return times[times.size() / 2];
}

// Collectives in flight at once while the sweep times one: FSDP issues the next unit's all-gather
// before it waits for the current one (prefetch), and a reduce-scatter while the next all-gather is
// in flight, so an algorithm is timed as the engine uses it, beside another, not alone (alone, the
// two levels of one collective wait for each other; beside another they overlap its levels).
constexpr int kInFlight = 2;

// kInFlight collectives of `operation` on `group`, issued back to back on their own buffers and then
// waited for: the time per collective, as the slowest rank saw it.
double time_once(const fsdp::DistributedContext& context, const fsdp::ProcessGroup& group,
                 CollectiveOperation operation, const std::vector<at::Tensor>& fulls,
                 const std::vector<at::Tensor>& shards) {
  fsdp::barrier(context.control());
  const auto start = std::chrono::steady_clock::now();
  std::vector<fsdp::CollectiveWork> works;
  for (size_t index = 0; index < fulls.size(); ++index) {
    switch (operation) {
      case CollectiveOperation::kAllGather:
        works.push_back(fsdp::all_gather_async(group, fulls[index], shards[index]));
        break;
      case CollectiveOperation::kReduceScatter:
        works.push_back(fsdp::reduce_scatter_async(group, shards[index], fulls[index]));
        break;
      case CollectiveOperation::kAllReduce:
        works.push_back(fsdp::all_reduce_async(group, fulls[index]));
        break;
    }
  }
  for (auto& work : works) work.wait();
  auto elapsed =
      torch::tensor({std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count()}, torch::kDouble);
  fsdp::all_reduce(context.control(), elapsed, fsdp::ReduceOp::kMax);
  return elapsed.item<double>() / static_cast<double>(fulls.size());
}

struct Measured {
  CollectiveOperation operation;
  int64_t bytes;
  CollectiveAlgorithm algorithm;
  double median, fastest, slowest;
};

// The rows of the engine's table for `shape` from the sweep: per operation and size, the layout's
// default (direct; two_level_direct across machines) unless another algorithm's median is at least
// 10 % faster, and a size whose choice differs from both neighbours' (which agree) takes theirs: on a
// shared machine the rounds vary more than close algorithms differ. One row per run of sizes with the
// same choice, each up to the geometric middle between its largest size and the next one measured.
std::vector<fsdp::detail::AlgorithmTableRow> table_rows(const std::vector<Measured>& measured,
                                                        const fsdp::detail::GroupShape& shape,
                                                        const std::vector<int64_t>& sizes) {
  const auto fallback = shape.two_level() ? CollectiveAlgorithm::kTwoLevelDirect : CollectiveAlgorithm::kDirect;
  std::vector<fsdp::detail::AlgorithmTableRow> rows;
  for (const auto operation :
       {CollectiveOperation::kAllGather, CollectiveOperation::kReduceScatter, CollectiveOperation::kAllReduce}) {
    std::vector<CollectiveAlgorithm> chosen;
    for (const auto bytes : sizes) {
      const Measured* best = nullptr;
      const Measured* incumbent = nullptr;
      for (const auto& entry : measured) {
        if (entry.operation != operation || entry.bytes != bytes) continue;
        if (!best || entry.median < best->median) best = &entry;
        if (entry.algorithm == fallback) incumbent = &entry;
      }
      chosen.push_back(incumbent && best->median > 0.9 * incumbent->median ? fallback : best->algorithm);
    }
    auto smoothed = chosen;
    for (size_t index = 1; index + 1 < chosen.size(); ++index) {
      if (chosen[index - 1] == chosen[index + 1] && chosen[index] != chosen[index - 1])
        smoothed[index] = chosen[index - 1];
    }
    for (size_t index = 0; index < sizes.size(); ++index) {
      if (index + 1 < sizes.size() && smoothed[index + 1] == smoothed[index]) continue;
      fsdp::detail::AlgorithmTableRow row;
      row.operation = operation;
      row.machines = shape.machines;
      row.ranks_per_machine = shape.ranks_per_machine;
      row.algorithm = smoothed[index];
      row.max_bytes = index + 1 < sizes.size()
                          ? static_cast<int64_t>(std::sqrt(static_cast<double>(sizes[index] * sizes[index + 1])))
                          : -1;
      rows.push_back(row);
    }
  }
  return rows;
}

std::vector<Measured> sweep_group(const fsdp::DistributedContext& context, const fsdp::ProcessGroup& group,
                                  const std::vector<int64_t>& sizes, int rounds) {
  auto& state = fsdp::detail::state_of(group);
  const auto shape = state.members->shape;
  const int64_t size = group.size();
  std::vector<CollectiveAlgorithm> algorithms;
  for (const auto algorithm : {CollectiveAlgorithm::kDirect, CollectiveAlgorithm::kRing,
                               CollectiveAlgorithm::kTwoLevelDirect, CollectiveAlgorithm::kTwoLevelRing}) {
    if (fsdp::detail::algorithm_applies(algorithm, shape)) algorithms.push_back(algorithm);
  }
  std::vector<Measured> measured;
  for (const auto operation :
       {CollectiveOperation::kAllGather, CollectiveOperation::kReduceScatter, CollectiveOperation::kAllReduce}) {
    for (const auto bytes : sizes) {
      const int64_t numel = bytes / 4 / size * size;
      std::vector<at::Tensor> fulls, shards;
      for (int index = 0; index < kInFlight; ++index) {
        fulls.push_back(torch::randn({numel}));
        shards.push_back(torch::randn({numel / size}));
      }
      std::vector<std::vector<double>> times(algorithms.size());
      // One warm-up each (first touch of the pool's blocks), then rounds that alternate the algorithms.
      for (int round = 0; round <= rounds; ++round) {
        for (size_t index = 0; index < algorithms.size(); ++index) {
          fsdp::detail::force_algorithm(group, operation, algorithms[index]);
          const double seconds = time_once(context, group, operation, fulls, shards);
          if (round > 0) times[index].push_back(seconds);
        }
      }
      fsdp::detail::force_algorithm(group, operation, std::nullopt);
      for (size_t index = 0; index < algorithms.size(); ++index) {
        auto& series = times[index];
        std::sort(series.begin(), series.end());
        Measured entry{operation,      numel * 4,    algorithms[index], series[series.size() / 2],
                       series.front(), series.back()};
        measured.push_back(entry);
        if (context.rank() != 0) continue;
        std::printf(
            "{\"benchmark\": \"collective_sweep\", \"collective\": \"%s\", \"group\": \"%s\", \"machines\": %lld, "
            "\"ranks_per_machine\": %lld, \"bytes\": %lld, \"algorithm\": \"%s\", \"median_s\": %.6f, "
            "\"fastest_s\": %.6f, \"slowest_s\": %.6f, \"rounds\": %d, \"in_flight\": %d}\n",
            fsdp::detail::to_string(operation), group.name().c_str(), static_cast<long long>(shape.machines),
            static_cast<long long>(shape.ranks_per_machine), static_cast<long long>(entry.bytes),
            fsdp::detail::to_string(entry.algorithm), entry.median, entry.fastest, entry.slowest, rounds, kInFlight);
        std::fflush(stdout);
      }
    }
  }
  return measured;
}

void run_sweep(const fsdp::DistributedContext& context, int rounds, const std::string& table_path) {
  const std::vector<int64_t> sizes = {int64_t{64} << 10, int64_t{256} << 10, int64_t{1} << 20,
                                      int64_t{4} << 20,  int64_t{16} << 20,  int64_t{64} << 20};
  {
    // Warm-up: the first collectives of a process pay for connections and first-touch pages.
    auto full = torch::randn({16384 / context.world_size() * context.world_size()});
    auto shard = torch::randn({16384 / context.world_size()});
    for (int index = 0; index < 10; ++index) {
      fsdp::all_gather(context.world(), full, shard);
      fsdp::reduce_scatter(context.world(), shard, full);
      fsdp::all_reduce(context.world(), full);
    }
  }
  std::vector<const fsdp::ProcessGroup*> groups = {&context.world()};
  // One rank per machine (HYBRID_SHARD's replicate group): direct and ring differ from 3 machines.
  if (context.cross_node().size() >= 3) groups.push_back(&context.cross_node());
  std::string text;
  for (const auto* group : groups) {
    const auto measured = sweep_group(context, *group, sizes, rounds);
    const auto shape = fsdp::detail::state_of(*group).members->shape;
    text += fsdp::detail::format_algorithm_table(table_rows(measured, shape, sizes), "");
  }
  if (context.rank() == 0 && !table_path.empty()) {
    std::ofstream(table_path) << text;
  }
}

}  // namespace

int main(int argc, char** argv) {
  int64_t megabytes = 64;
  std::string directory = "/tmp/fsdp_collective_bench";
  bool sweep = false;
  int rounds = 5;
  std::string table_path;
  for (int index = 1; index < argc; index += 2) {
    const std::string flag = argv[index];
    if (flag == "--sweep") {
      sweep = true;
      --index;
      continue;
    }
    if (index + 1 >= argc) {
      std::cerr << "collective_bench: " << flag << " needs a value\n";
      return 2;
    }
    if (flag == "--megabytes")
      megabytes = std::stoll(argv[index + 1]);
    else if (flag == "--directory")
      directory = argv[index + 1];
    else if (flag == "--rounds")
      rounds = std::stoi(argv[index + 1]);
    else if (flag == "--table")
      table_path = argv[index + 1];
    else {
      std::cerr << "usage: collective_bench [--megabytes N] [--directory DIR] | --sweep [--rounds R] [--table FILE]\n";
      return 2;
    }
  }
  try {
    auto context = fsdp::DistributedContext::initialize_from_environment();
    const int64_t world = context.world_size();
    if (sweep) {
      run_sweep(context, rounds, table_path);
      return 0;
    }
    const int64_t numel = megabytes * 1000000 / 4 / world * world;
    auto full = torch::randn({numel});
    auto shard = torch::randn({numel / world});
    const double gather = median_seconds(context, 5, [&] { fsdp::all_gather(context.world(), full, shard); });
    const double scatter = median_seconds(context, 5, [&] { fsdp::reduce_scatter(context.world(), shard, full); });
    const double reduce = median_seconds(context, 5, [&] { fsdp::all_reduce(context.world(), full); });
    const double native_gather =
        median_seconds(context, 5, [&] { fsdp::detail::native_all_gather(context.world(), full, shard); });
    const double native_scatter =
        median_seconds(context, 5, [&] { fsdp::detail::native_reduce_scatter(context.world(), shard, full); });
    if (context.rank() == 0) {
      std::printf(
          "{\"benchmark\": \"collectives\", \"world_size\": %lld, \"bytes\": %lld, \"all_gather_s\": %.4f, "
          "\"reduce_scatter_s\": %.4f, \"all_reduce_s\": %.4f, \"native_all_gather_s\": %.4f, "
          "\"native_reduce_scatter_s\": %.4f}\n",
          static_cast<long long>(world), static_cast<long long>(numel * 4), gather, scatter, reduce, native_gather,
          native_scatter);
    }
    // SHARDED checkpoint throughput: every rank writes its rows (fsynced), then reads them back.
    fsdp::ShardedTensorList tensors;
    const auto layout = fsdp::shard_layout({numel / 1000, 1000}, world, context.rank());
    fsdp::ShardedTensor piece;
    piece.local = torch::randn({layout.owned_rows, 1000});
    piece.global_shape = {numel / 1000, 1000};
    piece.row_offset = layout.row_offset;
    tensors.emplace_back("weight", piece);
    const auto target = directory + "/sharded";
    if (context.rank() == 0) std::filesystem::remove_all(directory);
    fsdp::barrier(context.world());
    const double save = median_seconds(context, 3, [&] { fsdp::write_sharded_directory(target, tensors, context); });
    const double load = median_seconds(context, 3, [&] {
      fsdp::ShardedDirectoryReader reader(target);
      auto rows = reader.rows("weight", layout.row_offset, layout.owned_rows);
    });
    double copy = 0;
    if (context.rank() == 0) {
      const auto start = std::chrono::steady_clock::now();
      const std::string command = "cp -r " + target + " " + directory + "/copy && sync " + directory + "/copy/*";
      if (std::system(command.c_str()) != 0) throw std::runtime_error("cp failed");
      copy = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      std::printf(
          "{\"benchmark\": \"sharded_checkpoint\", \"world_size\": %lld, \"bytes\": %lld, \"save_s\": %.4f, "
          "\"load_s\": %.4f, \"cp_fsync_s\": %.4f}\n",
          static_cast<long long>(world), static_cast<long long>(numel * 4), save, load, copy);
      std::filesystem::remove_all(directory);
    }
    fsdp::barrier(context.world());
  } catch (const std::exception& error) {
    std::cerr << "collective_bench: " << error.what() << "\n";
    return 1;
  }
  return 0;
}
