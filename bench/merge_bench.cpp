// Benchmark: a SHARDED save by 4 ranks of --bytes (default 1 GB), and `fsdp merge-weights` of it,
// against `cp -r` + `sync` of the same files, in --rounds paired rounds (default 3). Each round saves
// anew, then runs cp + sync and the merge in alternating order; the ratios are per round (save / cp +
// sync, merge / cp + sync), reported each and as their median with the spread. Also the merge's peak
// resident memory (from wait4), which must not grow with the checkpoint's size. The checkpoint is a
// DCP directory, what save_checkpoint writes (--format rank-files: the format of earlier versions).
// The save is timed inside the ranks, from a barrier to the return of the save (its final agreement
// included), so launching the ranks does not count.
//
//   build/bin/merge_bench [--bytes 1GB] [--rounds 3] [--format dcp|rank-files] [--directory /tmp/fsdp_merge_bench]
#include <fsdp/fsdp.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <torch/torch.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <sstream>
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
  fsdp::barrier(context.world());
  const auto start = std::chrono::steady_clock::now();
  if (format == "dcp") {
    fsdp::write_dcp_model_directory(directory, local, context);
  } else {
    fsdp::write_sharded_directory(directory, local, context);
  }
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  if (context.rank() == 0) std::ofstream(fs::path(directory).parent_path() / "save_seconds") << seconds << "\n";
}

}  // namespace

int main(int argc, char** argv) {
  std::string directory = "/tmp/fsdp_merge_bench";
  std::string size = "1GB";
  bool generating = false;
  std::string format = "dcp";
  int rounds = 3;
  for (int index = 1; index < argc; ++index) {
    const std::string word = argv[index];
    if (word == "--bytes" && index + 1 < argc)
      size = argv[++index];
    else if (word == "--directory" && index + 1 < argc)
      directory = argv[++index];
    else if (word == "--rounds" && index + 1 < argc)
      rounds = std::max(1, std::atoi(argv[++index]));
    else if (word == "--generate")
      generating = true;
    else if (word == "--format" && index + 1 < argc &&
             (std::string(argv[index + 1]) == "dcp" || std::string(argv[index + 1]) == "rank-files"))
      format = argv[++index];
    else {
      std::cerr << "usage: merge_bench [--bytes SIZE] [--rounds N] [--format dcp|rank-files] [--directory DIR]\n";
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
    std::vector<Measured> saves, synced_copies, merges;
    std::vector<double> save_ratios, merge_ratios;
    int64_t total = 0;
    for (int round = 0; round < rounds; ++round) {
      fs::remove_all(directory);
      fs::create_directories(directory);
      run({"sync"});
      run({cli, "launch", "--nproc-per-node", "4", "--", self.string(), "--generate", "--bytes", size, "--format",
           format, "--directory", directory});
      Measured save;
      if (!(std::ifstream(directory + "/save_seconds") >> save.seconds) || save.seconds <= 0) {
        std::cerr << "merge_bench: the ranks did not record the save's time in " << directory << "/save_seconds\n";
        return 1;
      }
      saves.push_back(save);
      total = 0;
      for (const auto& item : fs::directory_iterator(sharded)) total += static_cast<int64_t>(item.file_size());
      // Alternating order: a peer that always ran second would inherit the first one's write-back.
      Measured copy_synced, merge;
      for (int step = 0; step < 2; ++step) {
        run({"sync"});
        if ((step + round) % 2 == 0) {
          copy_synced =
              run({"sh", "-c",
                   "cp -r " + sharded + " " + directory + "/copy_synced && sync " + directory + "/copy_synced/*"});
        } else {
          merge = run({cli, "merge-weights", sharded, directory + "/merged"});
        }
      }
      synced_copies.push_back(copy_synced);
      merges.push_back(merge);
      save_ratios.push_back(save.seconds / copy_synced.seconds);
      merge_ratios.push_back(merge.seconds / copy_synced.seconds);
    }
    auto median = [](std::vector<double> values) {
      std::sort(values.begin(), values.end());
      const size_t middle = values.size() / 2;
      return values.size() % 2 ? values[middle] : (values[middle - 1] + values[middle]) / 2;
    };
    auto seconds_of = [](const std::vector<Measured>& values) {
      std::vector<double> result;
      for (const auto& value : values) result.push_back(value.seconds);
      return result;
    };
    auto json_list = [](const std::vector<double>& values) {
      std::ostringstream text;
      text.precision(4);
      text << "[";
      for (size_t index = 0; index < values.size(); ++index) text << (index ? ", " : "") << values[index];
      return text.str() + "]";
    };
    long merge_peak_kb = 0;
    for (const auto& merge : merges) merge_peak_kb = std::max(merge_peak_kb, merge.peak_rss_kb);
    std::printf(
        "{\"benchmark\": \"merge\", \"format\": \"%s\", \"bytes\": %lld, \"rounds\": %d, \"save_seconds\": %s, "
        "\"cp_fsync_seconds\": %s, \"merge_seconds\": %s, \"save_to_cp_fsync\": %s, \"merge_to_cp_fsync\": %s, "
        "\"median_save_to_cp_fsync\": %.3f, \"median_merge_to_cp_fsync\": %.3f, \"merge_peak_rss_mb\": %.1f}\n",
        format.c_str(), static_cast<long long>(total), rounds, json_list(seconds_of(saves)).c_str(),
        json_list(seconds_of(synced_copies)).c_str(), json_list(seconds_of(merges)).c_str(),
        json_list(save_ratios).c_str(), json_list(merge_ratios).c_str(), median(save_ratios), median(merge_ratios),
        merge_peak_kb / 1024.0);
    fs::remove_all(directory);
  } catch (const c10::Error& error) {
    std::cerr << "merge_bench: " << error.what_without_backtrace() << "\n";
    return 1;
  }
  return 0;
}
