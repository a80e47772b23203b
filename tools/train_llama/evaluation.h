// Private to train_llama: what it measures and writes with the sharded model, the same on every rank.
#pragma once

#include <fsdp/models/llama.h>
#include <fsdp/process_group.h>
#include <torch/torch.h>

#include <cstdint>
#include <string>

namespace train_llama {

/// Mean next-token cross entropy over the first `eval_tokens` bytes of `tokens`, cut into windows of
/// seq_len + 1 (a partial last window is dropped). Ranks split the windows; all run the same number
/// of forwards, so the sharded model's collectives line up.
double evaluate(fsdp::models::LlamaForCausalLM& model, const torch::Tensor& tokens, int64_t seq_len,
                int64_t eval_tokens, const fsdp::DistributedContext& context);

/// Text sampled from the model (temperature 0.8), the same on every rank.
std::string generate(fsdp::models::LlamaForCausalLM& model, const std::string& prompt, int64_t bytes, uint64_t seed);

}  // namespace train_llama
