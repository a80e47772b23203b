// Activation checkpointing: the same losses and gradients as without it, alone and inside FSDP units
// (Accelerate's children-of-blocks layout and FSDP1's whole-unit layout); the forward records one
// checkpoint node per module instead of the module's own graph.
#include <fsdp/fsdp.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "harness/error_message.h"
#include "harness/multi_rank.h"
#include "harness/parity.h"
#include "harness/test_models.h"

namespace fsdp {
namespace {

using testing::next_token_loss;
using testing::tensors_close;
using testing::token_batch;
using testing::unique_parameters;

/// Every parameter's gradient, by name (undefined ones included, as empty tensors).
std::map<std::string, torch::Tensor> gradients_of(const torch::nn::Module& model) {
  std::map<std::string, torch::Tensor> gradients;
  for (const auto& item : model.named_parameters())
    gradients[item.key()] = item.value().grad().defined() ? item.value().grad().clone() : torch::Tensor();
  return gradients;
}

TEST(ActivationCheckpointing, GradientsEqualThoseWithoutCheckpointingInOneProcess) {
  auto [reference, model] = testing::twin_models<testing::TinyTransformer>(31);
  // The embedding is fed token ids: no input of it requires grad, and its weight must still get one.
  const int64_t marked = apply_activation_checkpointing(model.ptr(), [](const torch::nn::Module& module) {
    return module.name() == "fsdp::testing::TransformerBlockImpl" || module.name() == "torch::nn::EmbeddingImpl";
  });
  EXPECT_EQ(marked, 3);
  auto [inputs, targets] = token_batch(700, 12);
  auto logits = fsdp::forward(model, inputs);
  next_token_loss(logits, targets).backward();
  next_token_loss(reference->forward(inputs), targets).backward();
  const auto expected = gradients_of(*reference);
  for (const auto& [name, gradient] : gradients_of(*model)) {
    ASSERT_TRUE(gradient.defined()) << name;
    EXPECT_TRUE(tensors_close(gradient, expected.at(name))) << name;
  }
  // The blocks' insides were not recorded: a block's output comes straight from the checkpoint node.
  {
    auto hidden = fsdp::forward(model->embed_tokens, inputs);
    EXPECT_NE(hidden.grad_fn()->name().find("CheckpointFunction"), std::string::npos) << hidden.grad_fn()->name();
    auto block_output = fsdp::forward(model->layers[0], hidden);
    EXPECT_NE(block_output.grad_fn()->name().find("CheckpointFunction"), std::string::npos);
  }
  // Without grad mode a checkpointed module runs plainly.
  torch::NoGradGuard no_grad;
  EXPECT_TRUE(tensors_close(fsdp::forward(model, inputs), reference->forward(inputs)));
}

/// Trains `model` under FULL_SHARD and the reference in one process for three AdamW steps.
void train_sharded_and_compare(const DistributedContext& context, testing::TinyTransformer& model,
                               testing::TinyTransformer& reference, const std::string& what) {
  torch::optim::AdamW optimizer(unique_parameters(*model), torch::optim::AdamWOptions(1e-2));
  torch::optim::AdamW reference_optimizer(unique_parameters(*reference), torch::optim::AdamWOptions(1e-2));
  const int64_t local = 12 / context.world_size();
  for (int step = 0; step < 3; ++step) {
    auto [inputs, targets] = token_batch(700 + step, 12);
    next_token_loss(fsdp::forward(model, inputs.narrow(0, context.rank() * local, local)),
                    targets.narrow(0, context.rank() * local, local))
        .backward();
    next_token_loss(reference->forward(inputs), targets).backward();
    testing::expect_sharded_gradients_match(*model, *reference, what);
    optimizer.step();
    optimizer.zero_grad();
    reference_optimizer.step();
    reference_optimizer.zero_grad();
  }
  auto actual = testing::full_parameters(*model);
  for (const auto& [name, expected] : testing::named_copies(*reference)) {
    EXPECT_TRUE(tensors_close(actual.at(name), expected)) << what << ": " << name;
  }
}

TEST(ActivationCheckpointing, InsideFullShardUnitsTrainsLikeSingleProcess) {
  testing::run_on_ranks(2, [](const DistributedContext& context) {
    for (const bool whole_unit : {false, true}) {
      auto [reference, model] = testing::twin_models<testing::TinyTransformer>(32);
      for (auto& layer : model->layers) {
        if (whole_unit) {
          checkpoint_module(layer.ptr());  // FSDP1's layout: the unit's own module
        } else {
          for (const auto& child : layer->children()) checkpoint_module(child);  // Accelerate's FSDP2 layout
        }
        fully_shard(layer.ptr(), context);
      }
      fully_shard(model.ptr(), context);
      train_sharded_and_compare(context, model, reference, whole_unit ? "whole units" : "children of units");
      for (const auto& unit : fsdp_modules(*model)) EXPECT_EQ(unit.unsharded_buffer_bytes(), 0);
    }
  });
}

TEST(ActivationCheckpointing, AUnitInsideACheckpointedModuleIsAnError) {
  testing::run_on_ranks(2, [](const DistributedContext& context) {
    torch::manual_seed(33);
    testing::TinyTransformer model;
    auto block = model->layers[0];
    fully_shard(block->up.ptr(), context);
    checkpoint_module(block.ptr());
    fully_shard(model.ptr(), context);
    auto [inputs, targets] = token_batch(700, 12);
    const auto message = testing::error_message_of([&] { fsdp::forward(model, inputs); });
    EXPECT_NE(message.find("runs inside an activation-checkpointed module"), std::string::npos) << message;
    EXPECT_NE(message.find("LinearImpl"), std::string::npos) << message;
  });
}

}  // namespace
}  // namespace fsdp
