// `fsdp merge-weights`: a sharded checkpoint directory into one model file (accelerate merge-weights).
#include <fsdp/distributed_environment.h>
#include <fsdp/merge.h>
#include <fsdp/process_group.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <iostream>
#include <optional>

#include "cli/commands.h"
#include "cli/human_bytes.h"

namespace fsdp::cli {
namespace {

/// A one-line progress bar on a terminal (bytes, rate, ETA), redrawn at most five times a second.
std::function<void(int64_t, int64_t)> terminal_progress() {
  if (!::isatty(STDERR_FILENO)) return nullptr;
  const auto start = std::chrono::steady_clock::now();
  auto last = start - std::chrono::seconds(1);
  return [start, last](int64_t written, int64_t total) mutable {
    const auto now = std::chrono::steady_clock::now();
    if (written < total && now - last < std::chrono::milliseconds(200)) return;
    last = now;
    const double seconds = std::chrono::duration<double>(now - start).count();
    const double rate = seconds > 0 ? written / seconds : 0;
    const double eta = rate > 0 ? (total - written) / rate : 0;
    const int width = 30;
    const int filled = total > 0 ? static_cast<int>(width * written / total) : width;
    std::fprintf(stderr, "\rmerging [%s%s] %s / %s  %s/s  ETA %.0f s   ", std::string(filled, '#').c_str(),
                 std::string(width - filled, ' ').c_str(), human_bytes(written, 1).c_str(),
                 human_bytes(total, 1).c_str(), human_bytes(rate, 1).c_str(), eta);
    if (written >= total) std::fprintf(stderr, "\n");
    std::fflush(stderr);
  };
}

}  // namespace

Command add_merge_command(CLI::App& parent) {
  CLI::App* app = parent.add_subcommand(
      "merge-weights",
      "Merge a sharded checkpoint directory (e.g. CHECKPOINT/pytorch_model_fsdp_0) into OUTPUT_PATH/model.safetensors "
      "(or pytorch_model.bin). Streams tensor by tensor: memory stays bounded whatever the model's size.");
  auto checkpoint_dir = std::make_shared<std::string>();
  auto output_path = std::make_shared<std::string>();
  auto options = std::make_shared<MergeOptions>();
  auto unsafe = std::make_shared<bool>(false);
  auto max_shard_size = std::make_shared<std::string>();
  app->add_option(
         "checkpoint_dir", *checkpoint_dir,
         "The sharded directory (fsdp.cpp's, or a PyTorch DCP model directory), e.g. CHECKPOINT/pytorch_model_fsdp_0")
      ->required();
  app->add_option("output_path", *output_path, "Directory for the merged files (created with its parents)")->required();
  app->add_flag("--unsafe-serialization,--unsafe_serialization", *unsafe,
                "Write pytorch_model.bin (torch.save format) instead of model.safetensors");
  app->add_flag("--remove-checkpoint-dir,--remove_checkpoint_dir", options->remove_checkpoint_dir,
                "Delete CHECKPOINT_DIR after the output is completely written (never after a failure)");
  // Given, even empty, it must be a size ('' is not "no limit"); a usage error (exit 2) otherwise.
  auto* shard_option =
      app->add_option(
             "--max-shard-size,--max_shard_size", *max_shard_size,
             "Split into Hugging Face shards of at most SIZE (e.g. 5GB, 500MB) with model.safetensors.index.json")
          ->check(CLI::Validator(
              [](std::string& text) -> std::string {
                try {
                  detail::parse_byte_size(text);
                } catch (const c10::Error& error) {
                  return error.what_without_backtrace();
                }
                return "";
              },
              "SIZE"));
  app->add_flag("--overwrite", options->overwrite, "Replace output files that already exist");
  Command command;
  command.app = app;
  command.run = [=] {
    options->safe_serialization = !*unsafe;
    if (shard_option->count() > 0) options->max_shard_size = detail::parse_byte_size(*max_shard_size);
    // Under `fsdp launch` rank 0 merges and the others wait for it; a merge may take long.
    auto environment = parse_distributed_environment(current_process_environment());
    std::optional<DistributedContext> context;
    if (environment.world_size > 1) {
      environment.timeout = std::chrono::hours(24);
      context = DistributedContext::initialize(environment);
    }
    if (environment.rank == 0) options->progress = terminal_progress();
    const auto result = context ? merge_fsdp_weights(*checkpoint_dir, *output_path, *options, *context)
                                : merge_fsdp_weights(*checkpoint_dir, *output_path, *options);
    if (environment.rank == 0) {
      for (const auto& file : result.files) std::cout << file << "\n";
      std::cout << "merged " << result.tensors << " tensors, " << human_bytes(static_cast<double>(result.bytes), 1)
                << (options->remove_checkpoint_dir ? "; removed " + *checkpoint_dir : std::string()) << std::endl;
    }
    return 0;
  };
  return command;
}

}  // namespace fsdp::cli
