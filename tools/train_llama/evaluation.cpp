#include "train_llama/evaluation.h"

#include <ATen/CPUGeneratorImpl.h>
#include <fsdp/fsdp.h>

#include <algorithm>
#include <vector>

#include "train_llama/corpus.h"

namespace train_llama {

using fsdp::models::LlamaForCausalLM;

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

}  // namespace train_llama
