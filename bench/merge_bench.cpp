// Benchmark: `fsdp merge-weights` on a sharded checkpoint of --bytes (default 1 GB) saved by 4 ranks,
// against `cp -r` of the same files in the same run. Reports wall-time ratio and the merge's peak
// resident memory (from wait4), which must not grow with the checkpoint's size. The checkpoint is a
// DCP directory, what save_checkpoint writes (--format rank-files: the format of earlier versions).
//
//   build/bin/merge_bench [--bytes 1GB] [--format dcp|rank-files] [--directory /tmp/fsdp_merge_bench]
#include <fsdp/fsdp.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <torch/torch.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <iostream>
#include <string>
#include <vector>

namespace fs = std::filesystem;

namespace {

struct Measured {
  double seconds = 0;
  long peak_rss_kb = 0;
};

Measured run(const std::vector<std::string>& argv) {
  const auto start = std::chrono::steady_clock::now();
  pid_t child = ::fork();
  if (child == 0) {
    std::vector<char*> arguments;
    for (const auto& word : argv) arguments.push_back(const_cast<char*>(word.c_str()));
    arguments.push_back(nullptr);
    ::execvp(arguments[0], arguments.data());
    std::perror("exec");
    ::_exit(127);
  }
  int status = 0;
  struct rusage usage{};
  ::wait4(child, &status, 0, &usage);
  if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
    std::cerr << "merge_bench: " << argv[0] << " failed\n";
    std::exit(1);
  }
  return {std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count(), usage.ru_maxrss};
}

/// Under `fsdp launch`: each rank writes its rows of a model of `bytes` bytes (fp32 matrices of 4096
/// columns, as a transformer's weights).
void generate(const std::string& directory, int64_t bytes, const std::string& format) {
  auto context = fsdp::DistributedContext::initialize_from_environment();
  const int64_t columns = 4096;
  const int64_t tensor_rows = 8192;  // 128 MiB per tensor
  const int64_t tensor_bytes = tensor_rows * columns * 4;
  const int64_t tensors = std::max<int64_t>(1, (bytes + tensor_bytes - 1) / tensor_bytes);
  fsdp::ShardedTensorList local;
  for (int64_t index = 0; index < tensors; ++index) {
    const auto layout = fsdp::shard_layout({tensor_rows, columns}, context.world_size(), context.rank());
    fsdp::ShardedTensor tensor;
    tensor.local = torch::full({layout.owned_rows, columns}, static_cast<float>(index));
    tensor.global_shape = {tensor_rows, columns};
    tensor.row_offset = layout.row_offset;
    local.emplace_back("layers." + std::to_string(index) + ".weight", tensor);
  }
  if (format == "dcp") {
    fsdp::write_dcp_model_directory(directory, local, context);
  } else {
    fsdp::write_sharded_directory(directory, local, context);
  }
}

}  // namespace

int main(int argc, char** argv) {
  std::string directory = "/tmp/fsdp_merge_bench";
  std::string size = "1GB";
  bool generating = false;
  std::string format = "dcp";
  for (int index = 1; index < argc; ++index) {
    const std::string word = argv[index];
    if (word == "--bytes" && index + 1 < argc)
      size = argv[++index];
    else if (word == "--directory" && index + 1 < argc)
      directory = argv[++index];
    else if (word == "--generate")
      generating = true;
    else if (word == "--format" && index + 1 < argc &&
             (std::string(argv[index + 1]) == "dcp" || std::string(argv[index + 1]) == "rank-files"))
      format = argv[++index];
    else {
      std::cerr << "usage: merge_bench [--bytes SIZE] [--format dcp|rank-files] [--directory DIR]\n";
      return 2;
    }
  }
  try {
    const int64_t bytes = fsdp::detail::parse_byte_size(size);
    const auto sharded = directory + "/pytorch_model_fsdp_0";
    if (generating) {
      generate(sharded, bytes, format);
      return 0;
    }
    const auto self = fs::canonical("/proc/self/exe");
    const auto cli = (self.parent_path() / "fsdp").string();
    fs::remove_all(directory);
    fs::create_directories(directory);
    run({cli, "launch", "--nproc-per-node", "4", "--", self.string(), "--generate", "--bytes", size, "--format", format,
         "--directory", directory});
    int64_t total = 0;
    for (const auto& item : fs::directory_iterator(sharded)) total += static_cast<int64_t>(item.file_size());
    // Warm the page cache for both contenders the same way.
    run({"sh", "-c", "cat " + sharded + "/* " + sharded + "/.metadata > /dev/null 2>&1; true"});
    // The merge fsyncs what it writes (a checkpoint tool must not lose data on a crash), so the fair
    // peer is cp followed by an fsync of the copies; plain cp is reported too.
    // Three alternating rounds, medians: the virtual disk's write-back makes single runs noisy, and
    // whoever writes first after the checkpoint was generated pays for its flush.
    std::vector<Measured> copies, synced_copies, merges;
    for (int round = 0; round < 3; ++round) {
      fs::remove_all(directory + "/copy");
      fs::remove_all(directory + "/copy_synced");
      fs::remove_all(directory + "/merged");
      run({"sync"});
      copies.push_back(run({"cp", "-r", sharded, directory + "/copy"}));
      // Flushed outside the timing: an fsync on ext4 (data=ordered) also waits for other files' dirty data.
      run({"sync"});
      synced_copies.push_back(run(
          {"sh", "-c", "cp -r " + sharded + " " + directory + "/copy_synced && sync " + directory + "/copy_synced/*"}));
      merges.push_back(run({cli, "merge-weights", sharded, directory + "/merged"}));
    }
    auto median = [](std::vector<Measured> values) {
      std::sort(values.begin(), values.end(),
                [](const Measured& a, const Measured& b) { return a.seconds < b.seconds; });
      return values[values.size() / 2];
    };
    const auto copy = median(copies);
    const auto copy_synced = median(synced_copies);
    const auto merge = median(merges);
    std::printf(
        "{\"benchmark\": \"merge\", \"format\": \"%s\", \"bytes\": %lld, \"cp_seconds\": %.3f, \"cp_fsync_seconds\": "
        "%.3f, "
        "\"merge_seconds\": %.3f, \"ratio_to_cp_fsync\": %.3f, \"ratio_to_cp\": %.3f, "
        "\"merge_peak_rss_mb\": %.1f, \"cp_peak_rss_mb\": %.1f}\n",
        format.c_str(), static_cast<long long>(total), copy.seconds, copy_synced.seconds, merge.seconds,
        merge.seconds / copy_synced.seconds, merge.seconds / copy.seconds, merge.peak_rss_kb / 1024.0,
        copy.peak_rss_kb / 1024.0);
    fs::remove_all(directory);
  } catch (const c10::Error& error) {
    std::cerr << "merge_bench: " << error.what_without_backtrace() << "\n";
    return 1;
  }
  return 0;
}
