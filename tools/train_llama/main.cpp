// train_llama: train a Llama-architecture byte-level language model with FSDP, save checkpoints that
// resume exactly, and leave a Hugging Face directory (model.safetensors + config.json) behind.
//
//   fsdp launch --nproc-per-node 2 -- build/bin/train_llama --output-dir runs/llama
//   build/bin/train_llama --eval-only --init-from runs/llama/final --data FILE --seq-len 128 --eval-tokens 65536
//
// FSDP settings come from the plugin (FSDP_* variables, or `fsdp launch --config-file`); without them
// the job uses FSDP version 2, FULL_SHARD and transformer-based wrapping of LlamaDecoderLayer.
#include <ATen/CPUGeneratorImpl.h>
#include <fsdp/fsdp.h>
#include <fsdp/models/llama.h>
#include <torch/torch.h>

#include <CLI/CLI.hpp>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iostream>
#include <map>
#include <memory>
#include <set>
#include <sstream>

#include "train_llama/corpus.h"
#include "train_llama/report.h"

namespace {

namespace fs = std::filesystem;
using fsdp::models::LlamaConfig;
using fsdp::models::LlamaForCausalLM;

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
  std::string data;
  std::string eval_data;
  bool eval_only = false;
  bool meta_init = false;
  int64_t stop_after = 0;
  int64_t sample_bytes = 300;
  bool skip_nonfinite_steps = false;
  bool async_checkpoint = false;
};

std::string read_text(const std::string& path) {
  std::ifstream file(path);
  TORCH_CHECK(file, "cannot read '", path, "': ", std::strerror(errno));
  std::stringstream text;
  text << file.rdbuf();
  return text.str();
}

void write_text(const std::string& path, const std::string& text) {
  std::ofstream file(path);
  TORCH_CHECK(file, "cannot write '", path, "': ", std::strerror(errno), "; check --output-dir");
  file << text;
}

std::vector<torch::Tensor> unique_parameters(const torch::nn::Module& model) {
  std::vector<torch::Tensor> parameters;
  std::set<const c10::TensorImpl*> seen;
  for (const auto& parameter : model.parameters()) {
    if (seen.insert(parameter.unsafeGetTensorImpl()).second) parameters.push_back(parameter);
  }
  return parameters;
}

/// The flags every rank must share, as they were given.
std::vector<std::pair<std::string, std::string>> run_fields(const Settings& settings) {
  auto number = [](double value) {
    char text[32];
    std::snprintf(text, sizeof(text), "%.17g", value);
    return std::string(text);
  };
  return {{"--preset", settings.preset},
          {"--steps", std::to_string(settings.steps)},
          {"--seed", std::to_string(settings.seed)},
          {"--global-batch-size", std::to_string(settings.global_batch_size)},
          {"--micro-batch-size", std::to_string(settings.micro_batch_size)},
          {"--seq-len", std::to_string(settings.seq_len)},
          {"--lr", number(settings.lr)},
          {"--min-lr", number(settings.min_lr)},
          {"--warmup-steps", std::to_string(settings.warmup_steps)},
          {"--weight-decay", number(settings.weight_decay)},
          {"--max-grad-norm", number(settings.max_grad_norm)},
          {"--eval-every", std::to_string(settings.eval_every)},
          {"--eval-tokens", std::to_string(settings.eval_tokens)},
          {"--output-dir", settings.output_dir},
          {"--checkpoint-every", std::to_string(settings.checkpoint_every)},
          {"--total-limit", std::to_string(settings.total_limit)},
          {"--resume-from", settings.resume_from},
          {"--init-from", settings.init_from},
          {"--meta-init", settings.meta_init ? "true" : "false"},
          {"--stop-after", std::to_string(settings.stop_after)},
          {"--sample-bytes", std::to_string(settings.sample_bytes)},
          {"--skip-nonfinite-steps", settings.skip_nonfinite_steps ? "true" : "false"},
          {"--async-checkpoint", settings.async_checkpoint ? "true" : "false"}};
}

/// A text's size and FNV-1a hash: ranks that read different files differ here.
std::string text_fingerprint(const std::string& text) {
  uint64_t hash = 1469598103934665603ULL;
  for (const unsigned char byte : text) hash = (hash ^ byte) * 1099511628211ULL;
  char digest[24];
  std::snprintf(digest, sizeof(digest), "%016llx", static_cast<unsigned long long>(hash));
  return std::to_string(text.size()) + " bytes, FNV-1a " + digest;
}

/// Linear warmup, then cosine decay to min_lr at the last step.
double learning_rate(const Settings& settings, int64_t step) {
  if (step <= settings.warmup_steps) return settings.lr * step / std::max<int64_t>(1, settings.warmup_steps);
  const double progress =
      static_cast<double>(step - settings.warmup_steps) / std::max<int64_t>(1, settings.steps - settings.warmup_steps);
  return settings.min_lr + 0.5 * (settings.lr - settings.min_lr) * (1.0 + std::cos(M_PI * std::min(1.0, progress)));
}

/// The model's tensors, counting the tied lm_head once.
size_t unique_parameter_count(LlamaForCausalLM& model) {
  std::set<const c10::TensorImpl*> unique;
  for (const auto& parameter : model->parameters()) unique.insert(parameter.unsafeGetTensorImpl());
  return unique.size();
}

/// Refuses a checkpoint that holds more tensors than the model takes (transformers would drop them
/// with a warning; here they mean another configuration).
void check_tensor_count(const fsdp::SafetensorsCheckpointSource& source, size_t model_tensors,
                        const std::string& directory) {
  TORCH_CHECK(source.size() == model_tensors, "'", directory, "' has ", source.size(), " tensors but the model takes ",
              model_tensors,
              " (an untied lm_head with tie_word_embeddings true, or biases?); it is not a checkpoint "
              "of this configuration");
}

/// Copies a Hugging Face directory's weights into the (not yet sharded) model, on rank 0.
void load_weights_into(LlamaForCausalLM& model, const std::string& directory) {
  fsdp::SafetensorsCheckpointSource source(directory);
  torch::NoGradGuard no_grad;
  std::set<const c10::TensorImpl*> loaded;
  for (auto& item : model->named_parameters()) {
    if (loaded.count(item.value().unsafeGetTensorImpl())) continue;  // the tied lm_head
    TORCH_CHECK(source.contains(item.key()), "'", directory, "' has no weight '", item.key(), "' (it has ",
                source.size(), " tensors); is it a Llama checkpoint of this configuration?");
    const auto shape = source.shape(item.key());
    TORCH_CHECK(at::IntArrayRef(shape) == item.value().sizes(), "'", directory, "': weight '", item.key(),
                "' has shape ", at::IntArrayRef(shape), " but config.json describes ", item.value().sizes());
    item.value().copy_(source.rows(item.key(), 0, shape.empty() ? 1 : shape[0]).reshape(shape));
    loaded.insert(item.value().unsafeGetTensorImpl());
  }
  check_tensor_count(source, loaded.size(), directory);
}

/// Runs `step` on rank 0 only; every rank learns whether it failed before the next collective, so a
/// bad directory is an error on every rank instead of a hang (rank 0's message there, a pointer to
/// rank 0 elsewhere).
void on_rank0_or_fail_everywhere(const fsdp::DistributedContext& context, const std::string& directory,
                                 const std::function<void()>& step) {
  std::string error;
  if (context.rank() == 0) {
    try {
      step();
    } catch (const c10::Error& failure) {
      error = failure.what_without_backtrace();
    }
  }
  auto failed = torch::full({1}, error.empty() ? 0 : 1, torch::kLong);
  fsdp::broadcast(context.world(), failed, 0);
  TORCH_CHECK(failed.item<int64_t>() == 0, context.rank() == 0 ? error : "rank 0 could not load '" + directory + "'");
}

/// Command-line checks whose message names the value: "--steps: must be positive, got 0".
CLI::Validator numeric_check(bool allow_zero) {
  return CLI::Validator(
      [allow_zero](std::string& text) -> std::string {
        double value = 0;
        try {
          size_t used = 0;
          value = std::stod(text, &used);
          if (used != text.size()) return "expected a number, got '" + text + "'";
        } catch (const std::exception&) {
          return "expected a number, got '" + text + "'";
        }
        if (!std::isfinite(value) || value < 0 || (!allow_zero && value == 0)) {
          return std::string(allow_zero ? "must be 0 or positive" : "must be positive") + ", got " + text;
        }
        return "";
      },
      allow_zero ? "NON-NEGATIVE" : "POSITIVE");
}
CLI::Validator positive_value() { return numeric_check(false); }
CLI::Validator non_negative_value() { return numeric_check(true); }

/// --preset names a model LlamaConfig knows: a usage error (exit 2) otherwise, with its message.
CLI::Validator known_preset() {
  return CLI::Validator(
      [](std::string& name) -> std::string {
        try {
          LlamaConfig::preset(name);
        } catch (const c10::Error& error) {
          return error.what_without_backtrace();
        }
        return "";
      },
      "PRESET");
}

/// The model to train or evaluate. With weights to load (`from_weights`), only rank 0 reads them; the
/// other ranks build the model on the meta device, allocating nothing, and receive their shards from
/// rank 0 (cpu_ram_efficient_loading), as transformers' non-main processes do under Accelerate.
/// With `meta_init` every rank builds it on the meta device: fully_shard gives each unit its initial
/// values one unit at a time (Note [building on the meta device]), or, with weights, zeros that
/// stream_pretrained_weights then fills: no rank ever holds the whole model.
LlamaForCausalLM build_model(const LlamaConfig& config, bool from_weights, bool meta_init,
                             const fsdp::DistributedContext& context) {
  if (meta_init) {
    fsdp::MetaDeviceGuard meta;
    return LlamaForCausalLM(config);
  }
  if (!from_weights || context.rank() == 0) return LlamaForCausalLM(config);
  fsdp::MetaDeviceGuard meta;
  return LlamaForCausalLM(config);
}

void load_weights_on_rank0(LlamaForCausalLM& model, const std::string& directory,
                           const fsdp::DistributedContext& context) {
  on_rank0_or_fail_everywhere(context, directory, [&] { load_weights_into(model, directory); });
}

/// Fills the sharded model from a Hugging Face directory: rank 0 opens its files and sends one
/// tensor at a time, every rank keeps its rows (fsdp::load_model_state_dict_from_rank0); rank 0 holds one
/// full tensor beyond its shards, the other ranks never open the files. Extra tensors in the files
/// (an untied head for a tied config) are refused as load_weights_into refuses them. The files are
/// opened once.
void stream_pretrained_weights(LlamaForCausalLM& model, const std::string& directory,
                               const fsdp::DistributedContext& context) {
  std::unique_ptr<fsdp::SafetensorsCheckpointSource> source;  // rank 0's only
  on_rank0_or_fail_everywhere(context, directory, [&] {
    source = std::make_unique<fsdp::SafetensorsCheckpointSource>(directory);
    check_tensor_count(*source, unique_parameter_count(model), directory);
  });
  fsdp::load_model_state_dict_from_rank0(*model, context, source.get());
}

/// The settings a resumed run must share with the run that saved the checkpoint.
std::map<std::string, double> resume_settings(const Settings& settings) {
  return {{"steps", static_cast<double>(settings.steps)},
          {"warmup_steps", static_cast<double>(settings.warmup_steps)},
          {"lr", settings.lr},
          {"min_lr", settings.min_lr},
          {"seed", static_cast<double>(settings.seed)},
          {"global_batch_size", static_cast<double>(settings.global_batch_size)},
          {"seq_len", static_cast<double>(settings.seq_len)}};
}

/// The plugin for this job: the FSDP_* environment, with the job's defaults where it is silent.
fsdp::FullyShardedDataParallelPlugin job_plugin() {
  const auto environment = fsdp::current_process_environment();
  fsdp::FullyShardedDataParallelPluginArgs args;
  if (!environment.count("FSDP_VERSION")) args.fsdp_version = int64_t{2};
  if (!environment.count("FSDP_AUTO_WRAP_POLICY")) args.auto_wrap_policy = std::string("transformer_based_wrap");
  return fsdp::FullyShardedDataParallelPlugin(args, environment);
}

/// Mean next-token cross entropy over the first `eval_tokens` bytes of `tokens`, cut into windows of
/// seq_len + 1 (a partial last window is dropped). Ranks split the windows; all run the same number
/// of forwards, so the sharded model's collectives line up.
double evaluate(LlamaForCausalLM& model, const torch::Tensor& tokens, int64_t seq_len, int64_t eval_tokens,
                const fsdp::DistributedContext& context) {
  torch::NoGradGuard no_grad;
  const int64_t available = std::min<int64_t>(eval_tokens, tokens.size(0));
  const int64_t windows = available / (seq_len + 1);
  TORCH_CHECK(windows > 0, "evaluation needs at least ", seq_len + 1, " bytes of data, got ", available);
  const int64_t world = context.world_size(), rank = context.rank();
  const int64_t per_rank = (windows + world - 1) / world;
  const int64_t batch = 8;
  double loss_sum = 0, token_count = 0;
  for (int64_t first = 0; first < per_rank; first += batch) {
    std::vector<torch::Tensor> rows;
    std::vector<bool> real;
    for (int64_t index = first; index < std::min(per_rank, first + batch); ++index) {
      const int64_t window = index * world + rank;
      real.push_back(window < windows);
      rows.push_back(tokens.narrow(0, std::min(window, windows - 1) * (seq_len + 1), seq_len + 1));
    }
    auto windows_tensor = torch::stack(rows);
    auto logits = fsdp::forward(model, windows_tensor.narrow(1, 0, seq_len)).to(torch::kFloat);
    auto losses = torch::nn::functional::cross_entropy(
        logits.reshape({-1, logits.size(-1)}), windows_tensor.narrow(1, 1, seq_len).reshape({-1}),
        torch::nn::functional::CrossEntropyFuncOptions().reduction(torch::kNone));
    losses = losses.view({static_cast<int64_t>(rows.size()), seq_len}).to(torch::kDouble);
    for (size_t row = 0; row < rows.size(); ++row) {
      if (!real[row]) continue;
      loss_sum += losses[row].sum().item<double>();
      token_count += seq_len;
    }
  }
  auto totals = torch::tensor({loss_sum, token_count}, torch::kDouble);
  fsdp::all_reduce(context.world(), totals);
  return totals[0].item<double>() / totals[1].item<double>();
}

/// Text sampled from the model (temperature 0.8), the same on every rank.
std::string generate(LlamaForCausalLM& model, const std::string& prompt, int64_t bytes, uint64_t seed) {
  torch::NoGradGuard no_grad;
  auto generator = at::make_generator<at::CPUGeneratorImpl>(seed);
  std::string text = prompt;
  for (int64_t index = 0; index < bytes; ++index) {
    const int64_t context_bytes = std::min<int64_t>(text.size(), model->config.max_position_embeddings);
    auto tokens = train_llama::bytes_to_tokens(text.substr(text.size() - context_bytes)).unsqueeze(0);
    auto logits = fsdp::forward(model, tokens)[0][-1].to(torch::kFloat) / 0.8;
    auto next = at::multinomial(torch::softmax(logits, -1), 1, false, generator).item<int64_t>();
    text.push_back(static_cast<char>(next));
  }
  return text;
}

int evaluate_only(const Settings& settings, const fsdp::DistributedContext& context) {
  TORCH_CHECK(!settings.init_from.empty(), "--eval-only needs --init-from DIR (model.safetensors + config.json)");
  const auto config = LlamaConfig::from_json(read_text((fs::path(settings.init_from) / "config.json").string()),
                                             (fs::path(settings.init_from) / "config.json").string());
  torch::manual_seed(settings.seed);
  auto model = build_model(config, /*from_weights=*/true, /*meta_init=*/false, context);
  load_weights_on_rank0(model, settings.init_from, context);
  fsdp::AcceleratorOptions options;
  options.fsdp_plugin = job_plugin();
  options.fsdp_plugin->cpu_ram_efficient_loading = true;
  fsdp::Accelerator accelerator(context, options);
  fsdp::fsdp2_prepare_model(accelerator, model.ptr());
  const auto tokens = train_llama::bytes_to_tokens(train_llama::load_corpus(settings.data, settings.seq_len + 1));
  const double loss = evaluate(model, tokens, settings.seq_len, settings.eval_tokens, context);
  if (context.is_main_process()) std::printf("eval_loss=%.6f\n", loss);
  return 0;
}

int train(const Settings& settings, const fsdp::DistributedContext& context) {
  const int64_t world = context.world_size();
  const int64_t micro = settings.micro_batch_size > 0 ? settings.micro_batch_size : settings.global_batch_size / world;
  int64_t accumulation = 1;
  LlamaConfig config;
  std::string corpus;
  std::string eval_text;
  // A rank whose flags or files fail here must not leave the others waiting in the agreement below:
  // its error travels with its fields, and every rank raises it.
  std::string setup_error;
  try {
    TORCH_CHECK(micro > 0 && settings.global_batch_size % (world * micro) == 0, "--global-batch-size ",
                settings.global_batch_size, " must be a multiple of ranks (", world, ") x --micro-batch-size (", micro,
                "); a job that may go on with fewer machines (fsdp launch --nnodes MIN:MAX) needs one that every "
                "world size from MIN to MAX machines divides");
    accumulation = settings.global_batch_size / (world * micro);
    config = settings.init_from.empty()
                 ? LlamaConfig::preset(settings.preset)
                 : LlamaConfig::from_json(read_text((fs::path(settings.init_from) / "config.json").string()),
                                          (fs::path(settings.init_from) / "config.json").string());
    TORCH_CHECK(settings.seq_len <= config.max_position_embeddings, "--seq-len ", settings.seq_len,
                " exceeds the model's max_position_embeddings ", config.max_position_embeddings);
    // Data: the corpus; evaluation on --eval-data, or on the last tenth of the corpus held out.
    corpus = train_llama::load_corpus(settings.data, 2 * (settings.seq_len + 1));
    if (settings.eval_data.empty()) {
      const size_t split = corpus.size() * 9 / 10;
      eval_text = corpus.substr(split);
      corpus.resize(split);
    } else {
      eval_text = train_llama::load_corpus(settings.eval_data, settings.seq_len + 1);
    }
    TORCH_CHECK(static_cast<int64_t>(eval_text.size()) >= settings.seq_len + 1, "the evaluation text has ",
                eval_text.size(), " bytes, fewer than --seq-len + 1 = ", settings.seq_len + 1,
                "; give a longer --data (its last tenth is held out) or an --eval-data file");
  } catch (const c10::Error& error) {
    setup_error = error.what_without_backtrace();
  }
  // Before any collective: ranks started with other flags or other data would abort inside Gloo,
  // wait for each other until the timeout, or train to a wrong result with exit 0.
  auto fields = run_fields(settings);
  if (setup_error.empty()) {
    fields.emplace_back("model config", config.to_json());
    fields.emplace_back("training text", text_fingerprint(corpus));
    fields.emplace_back("evaluation text", text_fingerprint(eval_text));
  }
  fields.emplace_back("setup", setup_error.empty() ? "ok" : setup_error);
  fsdp::require_same_on_every_rank(context, "train_llama's settings", fields,
                                   "Start every rank with the same flags and the same --data and --eval-data files "
                                   "(fsdp launch gives every rank the same command line)");
  TORCH_CHECK(setup_error.empty(), setup_error);
  const auto train_tokens = train_llama::bytes_to_tokens(corpus);
  const auto eval_tokens = train_llama::bytes_to_tokens(eval_text);

  torch::manual_seed(settings.seed);
  // The large shapes never exist whole in one process.
  const bool meta_init = settings.meta_init || settings.preset == "large" || settings.preset.rfind("llama3-", 0) == 0;
  auto model = build_model(config, /*from_weights=*/!settings.init_from.empty(), meta_init, context);
  fsdp::AcceleratorOptions options;
  options.fsdp_plugin = job_plugin();
  const bool stream_weights = meta_init && !settings.init_from.empty();
  if (stream_weights) {
    // The units stay zeros at fully_shard; the checkpoint gives them their values after it.
    options.fsdp_plugin->param_init_fn = [](torch::nn::Module&) {};
  } else if (!settings.init_from.empty()) {
    load_weights_on_rank0(model, settings.init_from, context);
    options.fsdp_plugin->cpu_ram_efficient_loading = true;
  }
  options.gradient_accumulation_steps = accumulation;
  options.project_dir = settings.output_dir;
  options.total_limit = settings.total_limit;
  fsdp::Accelerator accelerator(context, options);
  TORCH_CHECK(
      !settings.async_checkpoint || accelerator.fsdp_plugin().state_dict_type == fsdp::StateDictType::kShardedStateDict,
      "--async-checkpoint writes SHARDED_STATE_DICT checkpoints only, but FSDP_STATE_DICT_TYPE is ",
      fsdp::to_string(accelerator.fsdp_plugin().state_dict_type),
      ". Set FSDP_STATE_DICT_TYPE=SHARDED_STATE_DICT, or leave out --async-checkpoint");
  torch::optim::AdamW optimizer(
      unique_parameters(*model),
      torch::optim::AdamWOptions(settings.lr).betas({0.9, 0.95}).weight_decay(settings.weight_decay));
  accelerator.prepare(model, optimizer);
  if (stream_weights) stream_pretrained_weights(model, settings.init_from, context);

  int64_t start_step = 0;
  double last_eval = std::nan("");
  // After `fsdp launch --max-restarts` restarted the job, the latest complete checkpoint in
  // --output-dir is where it continues (Note [restarting a failed job]); --resume-from, which
  // names where the first start began, counts only while there is none.
  std::optional<fsdp::TrainingProgress> resumed = accelerator.resume_after_restart();
  std::string resumed_from = resumed ? "the latest checkpoint in " + settings.output_dir : "";
  if (!resumed && !settings.resume_from.empty()) {
    resumed_from = settings.resume_from == "latest" ? accelerator.latest_checkpoint() : settings.resume_from;
    TORCH_CHECK(!resumed_from.empty(), "--resume-from latest: no complete checkpoint in '", settings.output_dir,
                "/checkpoints'");
    resumed = accelerator.load_state(resumed_from);
    accelerator.print("resumed from " + resumed_from + " at step " + std::to_string(resumed->step));
  }
  if (resumed) {
    start_step = resumed->step;
    for (const auto& [name, value] : resume_settings(settings)) {
      auto saved = resumed->scheduler.find(name);
      TORCH_CHECK(saved == resumed->scheduler.end() || saved->second == value, "resuming from ", resumed_from,
                  ": the checkpoint was saved with --", name, " ", saved->second, " but this run has ", value,
                  "; resume with the same settings so that data and schedule continue exactly");
    }
    if (resumed->scheduler.count("eval_loss")) last_eval = resumed->scheduler.at("eval_loss");
    // A job restarted on fewer machines (`fsdp launch --nnodes MIN:MAX`), or resumed by hand on
    // another number of ranks, keeps --global-batch-size: the same sequences per step, split over
    // the ranks there are now, each accumulating more micro-batches.
    auto saved_world = resumed->scheduler.find("world_size");
    if (saved_world != resumed->scheduler.end() && saved_world->second != static_cast<double>(world)) {
      const auto saved_micro = resumed->scheduler.find("micro_batch_size");
      const int64_t saved = static_cast<int64_t>(saved_world->second);
      const int64_t was_micro = saved_micro == resumed->scheduler.end()
                                    ? settings.global_batch_size / std::max<int64_t>(saved, 1)
                                    : static_cast<int64_t>(saved_micro->second);
      const int64_t was_accumulation = settings.global_batch_size / std::max<int64_t>(saved * was_micro, 1);
      accelerator.print("the checkpoint was saved by " + std::to_string(saved) + " ranks and this run has " +
                        std::to_string(world) + ": --global-batch-size " + std::to_string(settings.global_batch_size) +
                        " is kept, each rank accumulating " + std::to_string(accumulation) + " micro-batch(es) of " +
                        std::to_string(micro) + " per step (was " + std::to_string(was_accumulation) + " of " +
                        std::to_string(was_micro) + ")");
    }
  }
  const bool main = context.is_main_process();
  std::optional<train_llama::MetricsLog> metrics;
  if (main) {
    fs::create_directories(settings.output_dir);
    write_text((fs::path(settings.output_dir) / "config.json").string(), config.to_json());
    // The evaluation text, so that `--eval-only --data eval.txt` reproduces the reported eval_loss.
    write_text((fs::path(settings.output_dir) / "eval.txt").string(), eval_text);
    metrics.emplace((fs::path(settings.output_dir) / "metrics.jsonl").string(), start_step);
  }
  const auto run_start = std::chrono::steady_clock::now();
  for (int64_t step = start_step + 1; step <= settings.steps; ++step) {
    const auto step_start = std::chrono::steady_clock::now();
    const double lr = learning_rate(settings, step);
    for (auto& group : optimizer.param_groups()) static_cast<torch::optim::AdamWOptions&>(group.options()).lr(lr);
    const auto batch =
        train_llama::global_batch(train_tokens, step, settings.seed, settings.global_batch_size, settings.seq_len);
    const auto local = batch.narrow(0, context.rank() * accumulation * micro, accumulation * micro);
    double loss_sum = 0;
    for (int64_t index = 0; index < accumulation; ++index) {
      auto scope = accelerator.accumulate();
      const auto rows = local.narrow(0, index * micro, micro);
      auto loss = fsdp::models::causal_lm_loss(fsdp::forward(model, rows.narrow(1, 0, settings.seq_len)),
                                               rows.narrow(1, 1, settings.seq_len));
      accelerator.backward(loss);
      loss_sum += loss.item<double>();
    }
    const double grad_norm = accelerator.clip_grad_norm_(settings.max_grad_norm);
    // Every rank sees the same reduced loss and norm, so every rank takes the same branch.
    const double loss = accelerator.reduce(torch::tensor(loss_sum / accumulation, torch::kDouble)).item<double>();
    if (!std::isfinite(loss) || !std::isfinite(grad_norm)) {
      // A step on a NaN or infinite gradient would make every weight NaN; stop before it, so the
      // weights (and the last checkpoint) are those of the previous step.
      const auto what = "step " + std::to_string(step) + ": the training loss is " + c10::str(loss) +
                        " and the gradient norm " + c10::str(grad_norm);
      TORCH_CHECK(settings.skip_nonfinite_steps, what,
                  "; training stopped before this optimizer step, so the weights are those of step ", step - 1,
                  ". Lower --lr (now ", settings.lr,
                  "), resume from the last checkpoint, or pass "
                  "--skip-nonfinite-steps to skip such steps");
      accelerator.print("train_llama: warning: " + what + "; the optimizer step is skipped (--skip-nonfinite-steps)");
      optimizer.zero_grad();
    } else {
      optimizer.step();
      optimizer.zero_grad();
    }
    // An asynchronous checkpoint counts as soon as every rank has written it (Note [asynchronous
    // checkpoints]); the step's time includes this poll, as a user's would.
    if (settings.async_checkpoint) accelerator.finish_checkpoint(false);
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - step_start).count();

    train_llama::StepMetrics record;
    record.step = step;
    record.loss = loss;
    record.lr = lr;
    record.grad_norm = grad_norm;
    record.tokens_per_s = settings.global_batch_size * settings.seq_len / std::max(seconds, 1e-9);
    record.peak_rss_mb =
        accelerator.reduce(torch::tensor(train_llama::peak_rss_mb(), torch::kDouble), "sum").item<double>() /
        static_cast<double>(world);
    if ((settings.eval_every > 0 && step % settings.eval_every == 0) || step == settings.steps) {
      last_eval = evaluate(model, eval_tokens, settings.seq_len, settings.eval_tokens, context);
      record.eval_loss = last_eval;
    }
    if (main) {
      metrics->append(record);
      const double elapsed = std::chrono::duration<double>(std::chrono::steady_clock::now() - run_start).count();
      train_llama::print_progress(step, settings.steps, loss, record.tokens_per_s,
                                  elapsed / (step - start_step) * (settings.steps - step));
      if (record.eval_loss && !::isatty(STDERR_FILENO)) {
        std::printf("step %lld loss %.4f eval_loss %.4f lr %.2e\n", static_cast<long long>(step), loss, last_eval, lr);
        std::fflush(stdout);
      }
    }
    const bool checkpoint_now = (settings.checkpoint_every > 0 && step % settings.checkpoint_every == 0) ||
                                step == settings.steps || step == settings.stop_after;
    if (checkpoint_now) {
      auto scheduler = resume_settings(settings);
      if (!std::isnan(last_eval)) scheduler["eval_loss"] = last_eval;
      // Not a setting a resumed run must share: one on fewer ranks accumulates more (below).
      scheduler["world_size"] = static_cast<double>(world);
      scheduler["micro_batch_size"] = static_cast<double>(micro);
      fsdp::SaveStateOptions save_options;
      save_options.async = settings.async_checkpoint;
      const auto directory = accelerator.save_state(
          fsdp::TrainingProgress{step, step * settings.global_batch_size, scheduler}, save_options);
      if (!settings.async_checkpoint) accelerator.print("saved checkpoint " + directory);
    }
    if (step == settings.stop_after || step == settings.steps) {
      // The last asynchronous checkpoint is complete before the run ends.
      accelerator.finish_checkpoint(true);
    }
    if (step == settings.stop_after) {
      accelerator.print("stopped after step " + std::to_string(step) + "; resume with --resume-from latest");
      if (main) train_llama::write_loss_curve((fs::path(settings.output_dir) / "loss.svg").string(), metrics->all());
      return 0;
    }
  }
  // The trained model in Hugging Face's layout, and what it writes.
  const auto final_dir = (fs::path(settings.output_dir) / "final").string();
  accelerator.save_model(final_dir);
  const auto sample = generate(model, "The ", settings.sample_bytes, settings.seed);
  if (main) {
    write_text((fs::path(final_dir) / "config.json").string(), config.to_json());
    write_text((fs::path(final_dir) / "sample.txt").string(), sample + "\n");
    train_llama::write_loss_curve((fs::path(settings.output_dir) / "loss.svg").string(), metrics->all());
    std::printf("eval_loss=%.6f\n", last_eval);
    std::printf("model:   %s (model.safetensors, config.json)\nplot:    %s\nsample:  %s\n", final_dir.c_str(),
                (fs::path(settings.output_dir) / "loss.svg").c_str(), (fs::path(final_dir) / "sample.txt").c_str());
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  Settings settings;
  CLI::App app{
      "train_llama: train a Llama-architecture byte-level language model with FSDP.\n"
      "Run it under `fsdp launch --nproc-per-node N --`; FSDP settings come from FSDP_* variables or "
      "`fsdp launch --config-file`."};
  app.add_option("--preset", settings.preset,
                 "Model size: tiny, small, medium or large (0.54 B parameters, built on the "
                 "meta device)")
      ->check(known_preset())
      ->capture_default_str();
  app.add_flag("--meta-init", settings.meta_init,
               "Build the model on the meta device on every rank; fully_shard initializes one unit at a time, or, with "
               "--init-from, rank 0 streams the weights one tensor at a time (always on for --preset large)");
  app.add_option("--steps", settings.steps, "Optimizer steps")->check(positive_value())->capture_default_str();
  app.add_option("--seed", settings.seed, "Seed of weights, data order and sampling")->capture_default_str();
  app.add_option("--global-batch-size", settings.global_batch_size, "Sequences per optimizer step, all ranks together")
      ->check(positive_value())
      ->capture_default_str();
  app.add_option("--micro-batch-size", settings.micro_batch_size,
                 "Sequences per rank per forward; fewer than global/ranks accumulates gradients (0: global/ranks)")
      ->check(non_negative_value())
      ->capture_default_str();
  app.add_option("--seq-len", settings.seq_len, "Tokens (bytes) per sequence")
      ->check(positive_value())
      ->capture_default_str();
  app.add_option("--lr", settings.lr, "Peak learning rate")->check(positive_value())->capture_default_str();
  app.add_option("--min-lr", settings.min_lr, "Learning rate at the end of the cosine decay")
      ->check(non_negative_value())
      ->capture_default_str();
  app.add_option("--warmup-steps", settings.warmup_steps, "Linear warmup steps")
      ->check(non_negative_value())
      ->capture_default_str();
  app.add_option("--weight-decay", settings.weight_decay, "AdamW weight decay")
      ->check(non_negative_value())
      ->capture_default_str();
  app.add_option("--max-grad-norm", settings.max_grad_norm, "Gradient clipping norm")
      ->check(positive_value())
      ->capture_default_str();
  app.add_option("--eval-every", settings.eval_every, "Evaluate every K steps (and at the end)")
      ->check(non_negative_value())
      ->capture_default_str();
  app.add_option("--eval-tokens", settings.eval_tokens, "Bytes of evaluation text")
      ->check(positive_value())
      ->capture_default_str();
  app.add_option("--output-dir", settings.output_dir, "Metrics, plot, checkpoints and final model")
      ->capture_default_str();
  app.add_option("--checkpoint-every", settings.checkpoint_every,
                 "Save a checkpoint every K steps (0: only at the end)")
      ->check(non_negative_value())
      ->capture_default_str();
  app.add_flag("--async-checkpoint", settings.async_checkpoint,
               "Write checkpoints on a background thread while training continues (SHARDED_STATE_DICT only); each "
               "counts once every rank's files are written, and the last is finished before the run ends");
  app.add_option("--total-limit", settings.total_limit, "Checkpoints to keep (0: all)")
      ->check(non_negative_value())
      ->capture_default_str();
  app.add_option("--resume-from", settings.resume_from, "A checkpoint directory, or 'latest' in --output-dir");
  app.add_option("--init-from", settings.init_from, "A Hugging Face directory (model.safetensors + config.json)");
  app.add_option("--data", settings.data, "Training text (default: the license texts in /usr/share/common-licenses)");
  app.add_option("--eval-data", settings.eval_data, "Evaluation text (default: the last tenth of the training text)");
  app.add_flag("--eval-only", settings.eval_only,
               "Print eval_loss=<float> for --init-from on the first --eval-tokens bytes of --data, and exit");
  app.add_option("--stop-after", settings.stop_after, "Save a checkpoint and stop after this step (to resume later)")
      ->check(non_negative_value());
  app.add_flag(
      "--skip-nonfinite-steps", settings.skip_nonfinite_steps,
      "Skip an optimizer step whose loss or gradient norm is NaN or infinite, instead of stopping with an error");
  app.add_option("--sample-bytes", settings.sample_bytes, "Bytes of text to sample at the end")
      ->check(non_negative_value())
      ->capture_default_str();
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& error) {
    return app.exit(error) == 0 ? 0 : 2;
  }
  try {
    auto context = fsdp::DistributedContext::initialize_from_environment();
    // train_llama computes on the CPU: its data, evaluation and sampling are not moved to a GPU yet.
    // On a machine with GPUs the Accelerator would otherwise place the model on one, so say so and
    // keep every rank on the CPU (FSDP_DEVICE=cpu); FSDP_DEVICE=cuda is refused rather than ignored.
    const char* requested_device = std::getenv("FSDP_DEVICE");
    TORCH_CHECK(requested_device == nullptr || std::string(requested_device) != "cuda",
                "train_llama computes on the CPU only; FSDP_DEVICE=cuda is not supported by it yet (the engine and "
                "bench/gpu_bench run on GPUs). Unset FSDP_DEVICE");
    if (requested_device == nullptr && fsdp::cuda_device_count() > 0) {
      if (context.is_main_process())
        std::cerr << "train_llama: note: computing on the CPU (GPUs are visible, but "
                     "train_llama does not use them yet)"
                  << std::endl;
      ::setenv("FSDP_DEVICE", "cpu", 1);
    }
    return settings.eval_only ? evaluate_only(settings, context) : train(settings, context);
  } catch (const c10::Error& error) {
    std::cerr << "train_llama: error: " << error.what_without_backtrace() << std::endl;
    return 1;
  } catch (const std::exception& error) {
    std::cerr << "train_llama: error: " << error.what() << std::endl;
    return 1;
  }
}
