#include "train_llama/weights.h"

#include <fsdp/fsdp.h>
#include <torch/torch.h>

#include <functional>
#include <memory>
#include <set>

namespace train_llama {
namespace {

using fsdp::models::LlamaConfig;
using fsdp::models::LlamaForCausalLM;

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

/// Runs `step` on every rank; every rank learns whether it failed anywhere before the next
/// collective (its own message, or which ranks failed).
void on_every_rank_or_fail_everywhere(const fsdp::DistributedContext& context, const std::string& directory,
                                      const std::function<void()>& step) {
  std::string error;
  try {
    step();
  } catch (const c10::Error& failure) {
    error = "[rank " + std::to_string(context.rank()) + "] " + failure.what_without_backtrace();
  }
  auto failed = torch::zeros({context.world_size()}, torch::kLong);
  failed[context.rank()] = error.empty() ? 0 : 1;
  fsdp::all_reduce(context.world(), failed);
  if (!error.empty()) TORCH_CHECK(false, error);
  std::string ranks;
  for (int64_t rank = 0; rank < context.world_size(); ++rank) {
    if (failed[rank].item<int64_t>() != 0) ranks += (ranks.empty() ? "" : ", ") + std::to_string(rank);
  }
  TORCH_CHECK(ranks.empty(), "rank(s) ", ranks, " could not load '", directory, "' (their errors say why)");
}

}  // namespace

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

void stream_pretrained_weights(LlamaForCausalLM& model, const std::string& directory, bool rank0_only,
                               const fsdp::DistributedContext& context) {
  if (rank0_only) {
    std::unique_ptr<fsdp::SafetensorsCheckpointSource> source;  // rank 0's only
    on_rank0_or_fail_everywhere(context, directory, [&] {
      source = std::make_unique<fsdp::SafetensorsCheckpointSource>(directory);
      check_tensor_count(*source, unique_parameter_count(model), directory);
    });
    fsdp::load_model_state_dict_from_rank0(*model, context, source.get());
    return;
  }
  // Every rank opens the files and reads the rows of its own shards; nothing is sent.
  std::unique_ptr<fsdp::SafetensorsCheckpointSource> source;
  on_every_rank_or_fail_everywhere(context, directory, [&] {
    source = std::make_unique<fsdp::SafetensorsCheckpointSource>(directory);
    check_tensor_count(*source, unique_parameter_count(model), directory);
  });
  on_every_rank_or_fail_everywhere(context, directory, [&] { fsdp::load_model_state_dict(*model, *source); });
}

}  // namespace train_llama
