// Benchmark: our all-gather and reduce-scatter against Gloo's own all-reduce of the same buffer (the
// ceiling on this loopback) and against Gloo's own all-gather and reduce-scatter of the same buffers
// (Note [Collectives on Gloo]), and a SHARDED checkpoint's save and load against cp of the same bytes.
// Run under `fsdp launch`; rank 0 prints one JSON line per measurement.
//
//   fsdp launch --nproc-per-node 2 -- build/bin/collective_bench [--megabytes 64] [--directory /tmp/x]
#include <fsdp/fsdp.h>

#include "dist/c10d/backend.h"

#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <functional>
#include <iostream>

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

}  // namespace

int main(int argc, char** argv) {
  int64_t megabytes = 64;
  std::string directory = "/tmp/fsdp_collective_bench";
  for (int index = 1; index + 1 < argc; index += 2) {
    const std::string flag = argv[index];
    if (flag == "--megabytes") megabytes = std::stoll(argv[index + 1]);
    else if (flag == "--directory") directory = argv[index + 1];
    else {
      std::cerr << "usage: collective_bench [--megabytes N] [--directory DIR]\n";
      return 2;
    }
  }
  try {
    auto context = fsdp::DistributedContext::initialize_from_environment();
    const int64_t world = context.world_size();
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
      std::printf("{\"benchmark\": \"collectives\", \"world_size\": %lld, \"bytes\": %lld, \"all_gather_s\": %.4f, "
                  "\"reduce_scatter_s\": %.4f, \"all_reduce_s\": %.4f, \"native_all_gather_s\": %.4f, "
                  "\"native_reduce_scatter_s\": %.4f}\n",
                  static_cast<long long>(world), static_cast<long long>(numel * 4), gather, scatter, reduce,
                  native_gather, native_scatter);
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
      std::printf("{\"benchmark\": \"sharded_checkpoint\", \"world_size\": %lld, \"bytes\": %lld, \"save_s\": %.4f, "
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
