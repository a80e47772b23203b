// The smallest whole fsdp.cpp program: a libtorch model of your own, sharded with fully_shard,
// trained on every rank, saved with save_checkpoint, and resumed from it. Run it on 2 ranks:
//
//   build/bin/fsdp launch --nproc-per-node 2 -- build/bin/example_custom_model /tmp/example
//
// It trains 6 steps, saving a SHARDED checkpoint after step 3; then it builds the model again,
// loads that checkpoint, takes steps 4 to 6 once more and checks that it gets the same losses,
// bit for bit (the exit code says whether it did).
#include <fsdp/fsdp.h>
#include <torch/torch.h>

#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

// A residual MLP block. Inside a unit, submodules are called as usual.
struct BlockImpl : torch::nn::Module {
  explicit BlockImpl(int64_t width)
      : norm(register_module("norm", torch::nn::LayerNorm(torch::nn::LayerNormOptions({width})))),
        up(register_module("up", torch::nn::Linear(width, 4 * width))),
        down(register_module("down", torch::nn::Linear(4 * width, width))) {}
  torch::Tensor forward(const torch::Tensor& x) { return x + down(torch::gelu(up(norm(x)))); }
  torch::nn::LayerNorm norm;
  torch::nn::Linear up, down;
};
TORCH_MODULE(Block);

struct ModelImpl : torch::nn::Module {
  ModelImpl(int64_t inputs, int64_t width, int64_t depth, int64_t outputs)
      : embed(register_module("embed", torch::nn::Linear(inputs, width))),
        head(register_module("head", torch::nn::Linear(width, outputs))) {
    for (int64_t index = 0; index < depth; ++index)
      blocks.push_back(register_module("blocks_" + std::to_string(index), Block(width)));
  }
  // A unit is called through fsdp::forward, which gathers its parameters for its forward and frees
  // them after; embed and head belong to the root unit, gathered when main calls fsdp::forward(model).
  torch::Tensor forward(const torch::Tensor& x) {
    auto hidden = embed(x);
    for (auto& block : blocks) hidden = fsdp::forward(block, hidden);
    return head(hidden);
  }
  torch::nn::Linear embed, head;
  std::vector<Block> blocks;
};
TORCH_MODULE(Model);

// The model, sharded: one unit per block, then the root (FSDP2's order: inner units first).
std::pair<Model, std::unique_ptr<torch::optim::AdamW>> build(const fsdp::DistributedContext& context) {
  torch::manual_seed(0);  // every rank starts from the same weights
  Model model(/*inputs=*/16, /*width=*/64, /*depth=*/4, /*outputs=*/8);
  for (auto& block : model->blocks) fsdp::fully_shard(block.ptr(), context);
  fsdp::fully_shard(model.ptr(), context);
  // The optimizer sees each rank's shards: its state is sharded too.
  auto optimizer = std::make_unique<torch::optim::AdamW>(model->parameters(), torch::optim::AdamWOptions(1e-3));
  return {model, std::move(optimizer)};
}

// One step on this rank's rows of a global batch of 32 (the same on every rank for step s); returns
// the loss of this rank's rows.
double train_step(Model& model, torch::optim::Optimizer& optimizer, const fsdp::DistributedContext& context,
                  int64_t step) {
  torch::manual_seed(1000 + step);
  const auto inputs = torch::randn({32, 16});
  const auto targets = torch::sin(inputs.matmul(torch::ones({16, 8}) / 4));
  const int64_t rows = 32 / context.world_size(), first = context.rank() * rows;
  auto loss = torch::mse_loss(fsdp::forward(model, inputs.narrow(0, first, rows)), targets.narrow(0, first, rows));
  loss.backward();  // gradients are reduce-scattered to their shards, averaged over the ranks
  optimizer.step();
  optimizer.zero_grad();
  return loss.item<double>();
}

int run(const std::string& checkpoint_dir) {
  const std::string directory = checkpoint_dir + "/checkpoint_3";
  // Rank, world size and the rendezvous from the launcher's variables (fsdp launch, torchrun, mpirun).
  const auto context = fsdp::DistributedContext::initialize_from_environment();
  TORCH_CHECK(32 % context.world_size() == 0, "the global batch of 32 rows must split evenly over the ",
              context.world_size(), " ranks; run on 1, 2, 4, 8, 16 or 32");
  auto [model, optimizer] = build(context);
  std::vector<double> losses;
  for (int64_t step = 1; step <= 6; ++step) {
    losses.push_back(train_step(model, *optimizer, context, step));
    if (context.is_main_process()) {
      std::printf("step %lld, loss of rank 0's rows %.6f\n", static_cast<long long>(step), losses.back());
    }
    if (step == 3) {
      // Collective: every rank writes its shards (a PyTorch DCP directory), rank 0 the marker last.
      fsdp::TrainingProgress progress;
      progress.step = step;
      fsdp::save_checkpoint(directory, *model, *optimizer, context, progress);
    }
  }

  // Resume: a fresh model (its own initial weights), then the checkpoint's weights, AdamW state and step.
  auto [resumed, resumed_optimizer] = build(context);
  const auto progress = fsdp::load_checkpoint(directory, *resumed, *resumed_optimizer, context);
  bool same = progress.step == 3;
  for (int64_t step = progress.step + 1; step <= 6; ++step) {
    same = same && train_step(resumed, *resumed_optimizer, context, step) == losses[static_cast<size_t>(step - 1)];
  }
  if (context.is_main_process()) {
    std::printf("resumed from step %lld: steps %lld to 6 %s\n", static_cast<long long>(progress.step),
                static_cast<long long>(progress.step + 1), same ? "gave the same losses" : "gave OTHER losses");
  }
  return same ? 0 : 1;
}

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: fsdp launch --nproc-per-node N -- %s CHECKPOINT_DIR\n", argv[0]);
    return 2;
  }
  // One line per rank with what went wrong, instead of libtorch's backtrace and an abort.
  const char* rank = std::getenv("RANK");
  try {
    return run(argv[1]);
  } catch (const c10::Error& error) {
    std::fprintf(stderr, "example_custom_model: rank %s: error: %s\n", rank ? rank : "0",
                 error.what_without_backtrace());
  } catch (const std::exception& error) {
    std::fprintf(stderr, "example_custom_model: rank %s: error: %s\n", rank ? rank : "0", error.what());
  }
  return 1;
}
