// Private to train_llama: its command line, the settings every rank must share, and what follows
// from them alone (the learning-rate schedule).
#pragma once

#include <CLI/CLI.hpp>
#include <cstdint>
#include <map>
#include <string>
#include <utility>
#include <vector>

namespace train_llama {

struct Settings {
  std::string preset = "tiny";
  int64_t steps = 300;
  uint64_t seed = 1234;
  int64_t global_batch_size = 12;
  int64_t micro_batch_size = 0;
  int64_t seq_len = 128;
  double lr = 3e-3;
  double min_lr = 3e-4;
  int64_t warmup_steps = 20;
  double weight_decay = 0.1;
  double max_grad_norm = 1.0;
  int64_t eval_every = 50;
  int64_t eval_tokens = 16384;
  std::string output_dir = "runs/llama";
  int64_t checkpoint_every = 0;
  int64_t total_limit = 2;
  std::string resume_from;
  std::string init_from;
  /// --init-from-rank0: rank 0 reads --init-from and sends each tensor (storage only rank 0 sees).
  bool init_from_rank0 = false;
  std::string data;
  std::string eval_data;
  bool eval_only = false;
  bool meta_init = false;
  int64_t stop_after = 0;
  int64_t sample_bytes = 300;
  bool skip_nonfinite_steps = false;
  bool async_checkpoint = false;
  bool limit_host_memory = false;
};

/// Adds train_llama's flags to `app`, each writing into `settings`.
void add_options(CLI::App& app, Settings& settings);

/// The flags every rank must share, as they were given.
std::vector<std::pair<std::string, std::string>> run_fields(const Settings& settings);

/// The settings a resumed run must share with the run that saved the checkpoint.
std::map<std::string, double> resume_settings(const Settings& settings);

/// Linear warmup, then cosine decay to min_lr at the last step.
double learning_rate(const Settings& settings, int64_t step);

}  // namespace train_llama
