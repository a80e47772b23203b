#include "train_llama/training.h"

#include <fsdp/fsdp.h>
#include <fsdp/models/llama.h>
#include <torch/torch.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <optional>
#include <set>
#include <sstream>

#include "train_llama/corpus.h"
#include "train_llama/evaluation.h"
#include "train_llama/report.h"
#include "train_llama/weights.h"

namespace train_llama {
namespace {

namespace fs = std::filesystem;
using fsdp::models::LlamaConfig;
using fsdp::models::LlamaForCausalLM;

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

/// A text's size and FNV-1a hash: ranks that read different files differ here.
std::string text_fingerprint(const std::string& text) {
  uint64_t hash = 1469598103934665603ULL;
  for (const unsigned char byte : text) hash = (hash ^ byte) * 1099511628211ULL;
  char digest[24];
  std::snprintf(digest, sizeof(digest), "%016llx", static_cast<unsigned long long>(hash));
  return std::to_string(text.size()) + " bytes, FNV-1a " + digest;
}

/// The plugin for this job: the FSDP_* environment, with the job's defaults where it is silent.
fsdp::FullyShardedDataParallelPlugin job_plugin() {
  const auto environment = fsdp::current_process_environment();
  fsdp::FullyShardedDataParallelPluginArgs args;
  if (!environment.count("FSDP_VERSION")) args.fsdp_version = int64_t{2};
  if (!environment.count("FSDP_AUTO_WRAP_POLICY")) args.auto_wrap_policy = std::string("transformer_based_wrap");
  return fsdp::FullyShardedDataParallelPlugin(args, environment);
}

}  // namespace

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
  options.cpu = true;  // train_llama computes on the CPU (main.cpp)
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
  // With --init-from too: the weights fill the shards after fully_shard, each rank reading its own.
  const bool stream_weights = !settings.init_from.empty();
  const bool meta_init =
      settings.meta_init || stream_weights || settings.preset == "large" || settings.preset.rfind("llama3-", 0) == 0;
  auto model = build_model(config, /*from_weights=*/false, meta_init, context);
  fsdp::AcceleratorOptions options;
  options.fsdp_plugin = job_plugin();
  // The units stay zeros at fully_shard; the pretrained weights give them their values after it.
  if (stream_weights) options.fsdp_plugin->param_init_fn = [](torch::nn::Module&) {};
  options.cpu = true;  // train_llama computes on the CPU (main.cpp)
  options.gradient_accumulation_steps = accumulation;
  options.limit_retained_host_memory = settings.limit_host_memory;
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
  if (stream_weights) stream_pretrained_weights(model, settings.init_from, settings.init_from_rank0, context);

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
      fsdp::TrainingProgress progress;  // set field by field: not_restored is load_checkpoint's
      progress.step = step;
      progress.data_position = step * settings.global_batch_size;
      progress.scheduler = scheduler;
      const auto directory = accelerator.save_state(progress, save_options);
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

}  // namespace train_llama
