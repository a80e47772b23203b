#include "train_llama/settings.h"

#include <c10/util/Exception.h>
#include <fsdp/models/llama.h>

#include <cmath>
#include <cstdio>

namespace train_llama {
namespace {

using fsdp::models::LlamaConfig;

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

}  // namespace

void add_options(CLI::App& app, Settings& settings) {
  app.add_option("--preset", settings.preset,
                 "Model size: tiny, small, medium or large (0.54 B parameters, built on the "
                 "meta device)")
      ->check(known_preset())
      ->capture_default_str();
  app.add_flag(
      "--meta-init", settings.meta_init,
      "Build the model on the meta device on every rank; fully_shard initializes one unit at a time (always on "
      "for --preset large, and with --init-from, whose weights fill the shards)");
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
  app.add_flag("--limit-host-memory", settings.limit_host_memory,
               "Return freed large blocks to the system (AcceleratorOptions::limit_retained_host_memory): the peak "
               "`fsdp estimate-memory` gives holds, for some step time (docs/memory.md)");
  app.add_option("--total-limit", settings.total_limit, "Checkpoints to keep (0: all)")
      ->check(non_negative_value())
      ->capture_default_str();
  app.add_option("--resume-from", settings.resume_from, "A checkpoint directory, or 'latest' in --output-dir");
  app.add_option("--init-from", settings.init_from,
                 "A Hugging Face directory (model.safetensors + config.json); every rank reads its own rows of it");
  app.add_flag("--init-from-rank0", settings.init_from_rank0,
               "Rank 0 alone reads --init-from and sends one tensor at a time (storage only rank 0 can see)");
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
}

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
          {"--init-from-rank0", settings.init_from_rank0 ? "true" : "false"},
          {"--meta-init", settings.meta_init ? "true" : "false"},
          {"--stop-after", std::to_string(settings.stop_after)},
          {"--sample-bytes", std::to_string(settings.sample_bytes)},
          {"--skip-nonfinite-steps", settings.skip_nonfinite_steps ? "true" : "false"},
          {"--async-checkpoint", settings.async_checkpoint ? "true" : "false"},
          {"--limit-host-memory", settings.limit_host_memory ? "true" : "false"}};
}

std::map<std::string, double> resume_settings(const Settings& settings) {
  return {{"steps", static_cast<double>(settings.steps)},
          {"warmup_steps", static_cast<double>(settings.warmup_steps)},
          {"lr", settings.lr},
          {"min_lr", settings.min_lr},
          {"seed", static_cast<double>(settings.seed)},
          {"global_batch_size", static_cast<double>(settings.global_batch_size)},
          {"seq_len", static_cast<double>(settings.seq_len)}};
}

double learning_rate(const Settings& settings, int64_t step) {
  if (step <= settings.warmup_steps) return settings.lr * step / std::max<int64_t>(1, settings.warmup_steps);
  const double progress =
      static_cast<double>(step - settings.warmup_steps) / std::max<int64_t>(1, settings.steps - settings.warmup_steps);
  return settings.min_lr + 0.5 * (settings.lr - settings.min_lr) * (1.0 + std::cos(M_PI * std::min(1.0, progress)));
}

}  // namespace train_llama
