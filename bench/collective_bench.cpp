// Benchmark: our all-gather and reduce-scatter against Gloo's own all-reduce of the same buffer (the
// ceiling on this loopback) and against Gloo's own all-gather and reduce-scatter of the same buffers
// (Note [Collectives on Gloo]), and a SHARDED checkpoint's save and load against cp of the same bytes.
// Run under `fsdp launch`; rank 0 prints one JSON line per measurement.
//
//   fsdp launch --nproc-per-node 2 -- build/bin/collective_bench [--megabytes 64] [--directory /tmp/x]
//
// `--sweep` instead measures each collective at 64 KB to 64 MB (the full buffer; a quarter of the
// sizes between), ours against Gloo's own algorithm (a ring for all-gather): one JSON line per
// collective and size, for choosing an algorithm per (N, size). For all-reduce, "direct" is the
// reduce-scatter then all-gather of the same buffer, "gloo" Gloo's ring all-reduce, and "engine"
// what fsdp::all_reduce runs (Note [Algorithms by measurement]).
//   fsdp launch --nproc-per-node 8 -- build/bin/collective_bench --sweep
#include <fsdp/fsdp.h>
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <functional>
#include <iostream>

#include "dist/c10d/backend.h"

namespace {

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

void run_sweep(const fsdp::DistributedContext& context) {
  const auto& group = context.world();
  const int64_t world = context.world_size();
  {
    // Warm-up: the first collectives of a process pay for connections and first-touch pages.
    auto full = torch::randn({16384 / world * world});
    auto shard = torch::randn({16384 / world});
    for (int index = 0; index < 10; ++index) {
      fsdp::all_gather(group, full, shard);
      fsdp::detail::native_all_gather(group, full, shard);
      fsdp::reduce_scatter(group, shard, full);
      fsdp::detail::native_reduce_scatter(group, shard, full);
      fsdp::all_reduce(group, full);
    }
  }
  for (const int64_t bytes : {int64_t{64} << 10, int64_t{256} << 10, int64_t{1} << 20, int64_t{4} << 20,
                              int64_t{16} << 20, int64_t{64} << 20}) {
    const int64_t numel = bytes / 4 / world * world;
    auto full = torch::randn({numel});
    auto shard = torch::randn({numel / world});
    // Fewer repeats for the large sizes: each takes long, and their spread is small.
    const int repeats = bytes >= (int64_t{16} << 20) ? 5 : 15;
    const double gather = median_seconds(context, repeats, [&] { fsdp::all_gather(group, full, shard); });
    const double native_gather =
        median_seconds(context, repeats, [&] { fsdp::detail::native_all_gather(group, full, shard); });
    const double scatter = median_seconds(context, repeats, [&] { fsdp::reduce_scatter(group, shard, full); });
    const double native_scatter =
        median_seconds(context, repeats, [&] { fsdp::detail::native_reduce_scatter(group, shard, full); });
    const double direct_reduce = median_seconds(context, repeats, [&] {
      fsdp::reduce_scatter(group, shard, full);
      fsdp::all_gather(group, full, shard);
    });
    const double native_reduce =
        median_seconds(context, repeats, [&] { fsdp::detail::native_all_reduce(group, full); });
    const double engine_reduce = median_seconds(context, repeats, [&] { fsdp::all_reduce(group, full); });
    if (context.rank() != 0) continue;
    const char* names[] = {"all_gather", "reduce_scatter", "all_reduce"};
    const double ours[] = {gather, scatter, direct_reduce};
    const double native[] = {native_gather, native_scatter, native_reduce};
    for (int op = 0; op < 3; ++op) {
      // "engine": what fsdp::all_reduce runs (Note [Algorithms by measurement]); for the others, direct.
      std::printf(
          "{\"benchmark\": \"collective_sweep\", \"collective\": \"%s\", \"world_size\": %lld, \"bytes\": %lld, "
          "\"direct_s\": %.6f, \"gloo_s\": %.6f, \"engine_s\": %.6f}\n",
          names[op], static_cast<long long>(world), static_cast<long long>(numel * 4), ours[op], native[op],
          op == 2 ? engine_reduce : ours[op]);
    }
    std::fflush(stdout);
  }
}

}  // namespace

int main(int argc, char** argv) {
  int64_t megabytes = 64;
  std::string directory = "/tmp/fsdp_collective_bench";
  bool sweep = false;
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
    else {
      std::cerr << "usage: collective_bench [--megabytes N] [--directory DIR] | --sweep\n";
      return 2;
    }
  }
  try {
    auto context = fsdp::DistributedContext::initialize_from_environment();
    const int64_t world = context.world_size();
    if (sweep) {
      run_sweep(context);
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
