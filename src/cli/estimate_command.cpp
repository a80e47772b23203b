// `fsdp estimate-memory`: what a Llama costs each rank under FSDP, before the job runs (Note
// [estimating memory per rank], include/fsdp/memory_estimate.h). Accelerate's `accelerate
// estimate-memory` answers for one process; this one divides by the ranks as the engine does.
#include <c10/util/Exception.h>
#include <fsdp/memory_estimate.h>
#include <fsdp/merge.h>
#include <fsdp/meta_device.h>
#include <fsdp/models/llama.h>
#include <fsdp/plugin.h>

#include <cstdio>
#include <filesystem>
#include <iostream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "cli/commands.h"
#include "cli/human_bytes.h"
#include "io/read_only_file.h"

namespace fsdp::cli {
namespace {

namespace fs = std::filesystem;

/// config.json (a file, or a directory holding one) as a LlamaConfig. Fields that change what the
/// model computes but not its shapes (rope scaling) do not change memory: they are dropped, and said.
models::LlamaConfig read_llama_config(const std::string& path, std::vector<std::string>& notes) {
  fs::path file = path;
  if (fs::is_directory(file)) file /= "config.json";
  const std::string fix = "give --config a config.json (or the directory of a Hugging Face model), or --preset NAME";
  const auto opened = detail::ReadOnlyFile::open_if_exists(file.string(), uint64_t{16} << 20, "model config", fix);
  TORCH_CHECK(opened, "estimate-memory: cannot read the model config '", file.string(), "': it does not exist; ", fix);
  const auto text = opened->read_text();
  nlohmann::json config;
  try {
    config = nlohmann::json::parse(text);
  } catch (const nlohmann::json::exception& error) {
    TORCH_CHECK(false, "Llama config '", file.string(), "' is not valid JSON (", error.what(), ")");
  }
  if (config.is_object()) {
    for (const char* key : {"rope_scaling", "attention_dropout"}) {
      if (config.contains(key) && !config[key].is_null()) {
        notes.push_back(std::string(key) + " " + config[key].dump() + " does not change memory; not modelled");
        config.erase(key);
      }
    }
    if (config.contains("rope_parameters") && config["rope_parameters"].is_object()) {
      notes.push_back("rope_parameters " + config["rope_parameters"].dump() + " do not change memory; not modelled");
      config.erase("rope_parameters");
    }
  }
  return models::LlamaConfig::from_json(config.dump(), file.string());
}

/// Bytes of the activations autograd keeps for one micro batch, counted from src/models/llama.cpp's
/// forward: per token and layer about 19 hidden-size tensors, 6 of the key/value size, 4 of the
/// intermediate size and 3 rows of attention scores; then the logits about 3 times. With activation
/// checkpointing a layer keeps only its input, and one layer at a time recomputes the rest. An
/// estimate: the allocator's reuse and libtorch's own temporaries are not modelled.
int64_t llama_activation_bytes(const models::LlamaConfig& config, int64_t micro_batch, int64_t seq_len,
                               int64_t dtype_bytes, bool checkpointing) {
  const double tokens = static_cast<double>(micro_batch) * static_cast<double>(seq_len);
  const double kv = static_cast<double>(config.num_key_value_heads * config.head_dim());
  const double per_layer = 19.0 * config.hidden_size + 6.0 * kv + 4.0 * config.intermediate_size +
                           3.0 * config.num_attention_heads * static_cast<double>(seq_len);
  const double layers = static_cast<double>(config.num_hidden_layers);
  const double kept = checkpointing ? layers * config.hidden_size + per_layer : layers * per_layer;
  const double logits = 3.0 * config.vocab_size;
  return static_cast<int64_t>(tokens * (kept + logits + config.hidden_size) * dtype_bytes);
}

struct EstimateSettings {
  std::string config;
  std::string preset;
  int64_t num_processes = 0;
  int64_t ranks_per_machine = 0;
  std::string sharding_strategy = "FULL_SHARD";
  std::string reshard_after_forward;
  std::string mixed_precision = "no";
  std::string optimizer = "adamw";
  std::string wrap = "accelerate";
  int64_t micro_batch_size = 1;
  int64_t seq_len = 0;
  bool activation_checkpointing = false;
  std::string memory_per_rank;
  bool json = false;
};

int run_estimate(const EstimateSettings& settings) {
  TORCH_CHECK(settings.config.empty() != settings.preset.empty(),
              "estimate-memory: give the model as --config config.json or as --preset NAME (one of them)");
  std::vector<std::string> notes;
  const models::LlamaConfig config = settings.preset.empty() ? read_llama_config(settings.config, notes)
                                                             : models::LlamaConfig::preset(settings.preset);

  MemoryEstimateOptions options;
  options.world_size = settings.num_processes;
  options.ranks_per_machine = settings.ranks_per_machine;
  options.sharding_strategy =
      parse_sharding_strategy(settings.sharding_strategy, "--sharding-strategy", "the command line");
  if (!settings.reshard_after_forward.empty()) {
    const std::string& text = settings.reshard_after_forward;
    if (text == "true" || text == "false") {
      options.reshard_after_forward = ReshardAfterForward(text == "true");
    } else {
      TORCH_CHECK(!text.empty() && text.find_first_not_of("0123456789") == std::string::npos && text.size() < 10,
                  "estimate-memory: --reshard-after-forward takes true, false or a group size, got '", text, "'");
      options.reshard_after_forward = ReshardAfterForward(static_cast<int64_t>(std::stoll(text)));
    }
  }
  if (settings.mixed_precision != "no") {
    const auto dtype = mixed_precision_dtype(settings.mixed_precision, "--mixed-precision");
    options.mixed_precision.param_dtype = dtype;
    options.mixed_precision.reduce_dtype = dtype;
  }
  options.optimizer = parse_optimizer_kind(settings.optimizer, "--optimizer");
  TORCH_CHECK(settings.wrap == "accelerate" || settings.wrap == "layers",
              "estimate-memory: --wrap takes accelerate or "
              "layers, got '",
              settings.wrap, "'");
  options.validate();

  // The model on the meta device: its real shapes, no memory, whatever its size.
  std::shared_ptr<models::LlamaForCausalLMImpl> model;
  {
    MetaDeviceGuard meta;
    model = models::LlamaForCausalLM(config).ptr();
  }
  std::vector<UnitModules> units;
  if (settings.wrap == "accelerate" && !config.tie_word_embeddings)
    units.push_back({{model->model->embed_tokens.ptr()}});
  for (auto& layer : model->model->decoder_layers) units.push_back({{layer.ptr()}});
  if (settings.wrap == "accelerate") {
    // fsdp2_prepare_model's tail: the final norm with the output embedding, kept after forward.
    UnitModules tail{{model->model->norm.ptr()}, /*reshard_after_forward=*/false};
    tail.modules.push_back(config.tie_word_embeddings
                               ? std::shared_ptr<torch::nn::Module>(model->model->embed_tokens.ptr())
                               : std::shared_ptr<torch::nn::Module>(model->lm_head.ptr()));
    units.push_back(tail);
  }
  const auto estimate = estimate_memory(unit_shapes(*model, units), options);

  const int64_t seq_len =
      settings.seq_len > 0 ? settings.seq_len : std::min<int64_t>(2048, config.max_position_embeddings);
  TORCH_CHECK(settings.micro_batch_size > 0, "estimate-memory: --micro-batch-size must be positive");
  const auto compute_dtype = options.mixed_precision.param_dtype.value_or(options.storage_dtype);
  const int64_t activations =
      llama_activation_bytes(config, settings.micro_batch_size, seq_len,
                             static_cast<int64_t>(c10::elementSize(compute_dtype)), settings.activation_checkpointing);
  // Note [estimating memory per rank]: the runtime plus the larger of the training and optimizer steps.
  const int64_t peak_with = estimate.resident_peak_bytes(true, activations);
  const int64_t peak_without = estimate.resident_peak_bytes(false, activations);
  std::optional<int64_t> memory;
  if (!settings.memory_per_rank.empty()) memory = detail::parse_byte_size(settings.memory_per_rank);
  const bool fits = !memory || peak_with <= *memory;

  const std::string strategy = to_string(options.sharding_strategy);
  const std::string reshard = options.reshard_after_forward ? options.reshard_after_forward->to_string() : "";
  if (settings.json) {
    nlohmann::json out = {
        {"model", settings.preset.empty() ? settings.config : "preset " + settings.preset},
        {"parameters", estimate.parameters},
        {"units", estimate.units},
        {"world_size", options.world_size},
        {"ranks_per_machine", options.ranks_per_machine == 0 ? options.world_size : options.ranks_per_machine},
        {"sharding_strategy", strategy},
        {"reshard_after_forward", reshard.empty() ? nlohmann::json(nullptr) : nlohmann::json(reshard)},
        {"mixed_precision", settings.mixed_precision},
        {"optimizer", to_string(options.optimizer)},
        {"wrap", settings.wrap},
        {"shard_group_size", estimate.shard_group_size},
        {"replicate_group_size", estimate.replicate_group_size},
        {"parameter_bytes", estimate.parameter_bytes},
        {"gradient_bytes", estimate.gradient_bytes},
        {"optimizer_bytes", estimate.optimizer_bytes},
        {"model_state_bytes", estimate.model_state_bytes()},
        {"largest_unit_bytes", estimate.largest_unit_bytes},
        {"kept_unit_bytes", estimate.kept_unit_bytes},
        {"unsharded_peak_bytes_with_prefetch", estimate.unsharded_peak_bytes_with_prefetch},
        {"unsharded_peak_bytes_without_prefetch", estimate.unsharded_peak_bytes_without_prefetch},
        {"unsharded_gradient_bytes", estimate.unsharded_gradient_bytes},
        {"activation_bytes_estimate", activations},
        {"micro_batch_size", settings.micro_batch_size},
        {"seq_len", seq_len},
        {"activation_checkpointing", settings.activation_checkpointing},
        {"pooled_bytes_in_reduction", estimate.pooled_bytes_in_reduction},
        {"reduction_bytes", estimate.reduction_bytes},
        {"training_step_bytes_with_prefetch", estimate.training_step_bytes(true, activations)},
        {"optimizer_step_temporary_bytes", estimate.optimizer_step_temporary_bytes},
        {"pooled_bytes_in_optimizer_step", estimate.pooled_bytes_in_optimizer_step},
        {"optimizer_step_bytes", estimate.optimizer_step_bytes()},
        {"runtime_bytes", estimate.runtime_bytes},
        {"host_memory", "limit_retained_host_memory"},
        {"peak_bytes_with_prefetch", peak_with},
        {"peak_bytes_without_prefetch", peak_without},
        {"bytes_sent_per_step", estimate.bytes_sent_per_step},
        {"bytes_sent_off_machine_per_step", estimate.bytes_sent_off_machine_per_step},
        {"sharded_checkpoint_bytes_per_rank", estimate.sharded_checkpoint_bytes},
        {"full_checkpoint_bytes_rank0", estimate.full_checkpoint_bytes},
        {"notes", notes},
    };
    if (memory) {
      out["memory_per_rank"] = *memory;
      out["fits"] = fits;
    }
    std::cout << out.dump() << std::endl;
  } else {
    std::printf(
        "Llama, %.1f M parameters, %lld units (%s wrap); %lld ranks, %lld per machine; %s%s%s; shard group %lld, "
        "%lld replicas\n",
        estimate.parameters / 1e6, static_cast<long long>(estimate.units), settings.wrap.c_str(),
        static_cast<long long>(options.world_size),
        static_cast<long long>(options.ranks_per_machine == 0 ? options.world_size : options.ranks_per_machine),
        strategy.c_str(), reshard.empty() ? "" : ", reshard_after_forward ", reshard.c_str(),
        static_cast<long long>(estimate.shard_group_size), static_cast<long long>(estimate.replicate_group_size));
    std::printf("parameters stored fp32, compute %s, %s\n\n",
                settings.mixed_precision == "no" ? "fp32" : settings.mixed_precision.c_str(),
                to_string(options.optimizer));
    auto row = [](const std::string& what, int64_t bytes) {
      std::printf("  %-58s %12s\n", what.c_str(), human_bytes(bytes, 2).c_str());
    };
    std::printf("per rank\n");
    row("parameters (this rank's shards)", estimate.parameter_bytes);
    row("gradients", estimate.gradient_bytes);
    row(std::string("optimizer state (") + to_string(options.optimizer) + ")", estimate.optimizer_bytes);
    row("model state", estimate.model_state_bytes());
    row("unsharded parameters held at once, with prefetch", estimate.unsharded_peak_bytes_with_prefetch);
    row("unsharded parameters held at once, without prefetch", estimate.unsharded_peak_bytes_without_prefetch);
    row("largest unit's gradients, reduce-scatter input and rows", estimate.unsharded_gradient_bytes);
    row("pooled blocks of the unit reduced before it", estimate.pooled_bytes_in_reduction);
    row("its reduction, with the unsharded units held then", estimate.reduction_bytes);
    row("activations (an estimate: " + std::to_string(settings.micro_batch_size) + " x " + std::to_string(seq_len) +
            " tokens" + (settings.activation_checkpointing ? ", checkpointed)" : ")"),
        activations);
    row("training step (state + larger of forward, reduction)", estimate.training_step_bytes(true, activations));
    row("optimizer step's temporaries", estimate.optimizer_step_temporary_bytes);
    row("pooled blocks kept from the last reduction", estimate.pooled_bytes_in_optimizer_step);
    row("optimizer step (model state and the two above)", estimate.optimizer_step_bytes());
    row("libtorch and the process (CPU)", estimate.runtime_bytes);
    row("peak resident, with prefetch", peak_with);
    row("peak resident, without prefetch", peak_without);
    std::printf("per step\n");
    row("bytes sent by each rank", estimate.bytes_sent_per_step);
    row("of which to other machines", estimate.bytes_sent_off_machine_per_step);
    std::printf("checkpoint (model and optimizer)\n");
    row("SHARDED_STATE_DICT, written by each rank", estimate.sharded_checkpoint_bytes);
    row("FULL_STATE_DICT, written by rank 0", estimate.full_checkpoint_bytes);
    for (const auto& note : notes) std::printf("note: %s\n", note.c_str());
    std::printf(
        "the peak is the runtime plus the larger of the two steps, for host memory with "
        "limit_retained_host_memory(); with glibc's default thresholds freed blocks stay resident in the heap, "
        "measured up to 1.3x more (docs/memory.md).\n");
    if (memory) {
      std::printf("%s: peak %s per rank, %s given (--memory-per-rank)\n", fits ? "fits" : "does not fit",
                  human_bytes(peak_with, 2).c_str(), human_bytes(*memory, 2).c_str());
    }
  }
  return fits ? 0 : 3;
}

}  // namespace

Command add_estimate_command(CLI::App& parent) {
  CLI::App* app = parent.add_subcommand(
      "estimate-memory",
      "What a Llama costs each rank under FSDP: parameters, gradients, optimizer state, unsharded units, bytes sent "
      "per step and checkpoint bytes, from a Hugging Face config.json or a train_llama preset. Exit 3 when the peak "
      "exceeds --memory-per-rank.");
  auto settings = std::make_shared<EstimateSettings>();
  app->add_option("--config", settings->config, "A Llama config.json, or a Hugging Face model directory");
  app->add_option("--preset", settings->preset,
                  "A train_llama preset (tiny, small, medium, large, llama3-1b, llama3-8b, llama3-70b)");
  app->add_option("--num-processes", settings->num_processes, "Ranks in the job")
      ->required()
      ->check(CLI::PositiveNumber);
  app->add_option("--ranks-per-machine", settings->ranks_per_machine,
                  "Ranks on one machine (HYBRID_SHARD shards over them); default: all on one")
      ->check(CLI::NonNegativeNumber);
  app->add_option("--sharding-strategy", settings->sharding_strategy,
                  "FULL_SHARD, SHARD_GRAD_OP, NO_SHARD, HYBRID_SHARD, "
                  "HYBRID_SHARD_ZERO2")
      ->capture_default_str();
  app->add_option("--reshard-after-forward", settings->reshard_after_forward,
                  "true, false or a group size (hpZ); default: the strategy's");
  app->add_option("--mixed-precision", settings->mixed_precision, "no, bf16, fp16 (compute and reduction dtype)")
      ->capture_default_str();
  app->add_option("--optimizer", settings->optimizer, "adamw (or adam), sgd-momentum, sgd")->capture_default_str();
  app->add_option("--wrap", settings->wrap,
                  "accelerate (Accelerator / train_llama: embedding, layers, tail) or layers "
                  "(each decoder layer and the root)")
      ->capture_default_str();
  app->add_option("--micro-batch-size", settings->micro_batch_size, "Sequences per rank per forward (activations)")
      ->capture_default_str();
  app->add_option("--seq-len", settings->seq_len,
                  "Tokens per sequence (activations); default: 2048 or the model's maximum");
  app->add_flag("--activation-checkpointing", settings->activation_checkpointing,
                "Each decoder layer recomputes its activations in backward (activations)");
  app->add_option("--memory-per-rank", settings->memory_per_rank,
                  "Memory each rank has, e.g. 16GB: says whether it fits");
  app->add_flag("--json", settings->json, "One JSON object instead of the table");
  return {app, [settings] { return run_estimate(*settings); }};
}

}  // namespace fsdp::cli
