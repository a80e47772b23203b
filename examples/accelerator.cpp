// The path Accelerate users take, in C++: the FSDP configuration from an Accelerate YAML (through
// fsdp launch), Accelerator::prepare, backward, clip_grad_norm_ and step, the data split across the
// ranks as Accelerate's prepare(dataloader) splits it, save_state, a resume from the latest
// checkpoint, and the merged weights checked. On 2 ranks:
//
//   build/bin/fsdp launch --config-file examples/accelerate.yaml -- build/bin/example_accelerator /tmp/run
//
// It trains 2 epochs of a small model, saving after each; then it prepares a fresh model, resumes
// from the latest complete checkpoint but one, trains the last epoch again and checks that it gets
// the same losses, bit for bit; then it merges that checkpoint into one model.safetensors (what
// `fsdp merge-weights` does) and checks it against the model's full state dict. The exit code says
// whether all of that held.
#include <fsdp/fsdp.h>
#include <torch/torch.h>

#include <cstdio>
#include <cstdlib>
#include <map>
#include <memory>
#include <string>
#include <vector>

// A residual MLP block. The YAML's fsdp_transformer_layer_cls_to_wrap names it: each is a unit.
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
        blocks(register_module("blocks", torch::nn::ModuleList())),
        head(register_module("head", torch::nn::Linear(width, outputs))) {
    for (int64_t index = 0; index < depth; ++index) blocks->push_back(Block(width));
  }
  // The one rule: a module that may be a unit is called through fsdp::forward, which gathers its
  // parameters first (on a module that is not a unit it is a plain call). A ModuleList holds its
  // elements as torch::nn::Module, so forward_as names their class.
  torch::Tensor forward(const torch::Tensor& x) {
    auto hidden = embed(x);
    for (size_t index = 0; index < blocks->size(); ++index) hidden = fsdp::forward_as<BlockImpl>(blocks[index], hidden);
    return head(hidden);
  }
  torch::nn::Linear embed;
  torch::nn::ModuleList blocks;
  torch::nn::Linear head;
};
TORCH_MODULE(Model);

constexpr int64_t kRows = 200, kBatchSize = 8, kEpochs = 2, kDataSeed = 42;

struct Training {
  std::unique_ptr<fsdp::Accelerator> accelerator;
  Model model{16, 64, 4, 8};
  std::unique_ptr<torch::optim::AdamW> optimizer;
};

// A fresh model, sharded by the plugin the launcher's FSDP_* variables describe (the YAML's).
Training prepare(const fsdp::DistributedContext& context, const std::string& project_dir) {
  Training training;
  fsdp::AcceleratorOptions options;
  options.project_dir = project_dir;  // save_state() writes <project_dir>/checkpoints/checkpoint_<i>
  training.accelerator = std::make_unique<fsdp::Accelerator>(context, options);
  torch::manual_seed(0);  // every rank starts from the same weights
  training.model = Model(16, 64, 4, 8);
  training.optimizer =
      std::make_unique<torch::optim::AdamW>(training.model->parameters(), torch::optim::AdamWOptions(1e-3));
  training.accelerator->prepare(training.model, *training.optimizer);  // prints what it made, on rank 0
  return training;
}

// One epoch: the same shuffled order on every rank (the seed and the epoch), and this rank's batches
// of it; each rank's batch has kBatchSize rows. Returns this rank's losses.
std::vector<double> train_epoch(Training& training, const torch::Tensor& inputs, const torch::Tensor& targets,
                                int64_t epoch) {
  std::vector<double> losses;
  const auto order = fsdp::seeded_random_order(kRows, kDataSeed, epoch);
  for (const auto& rows : training.accelerator->prepare_batches(order, kBatchSize)) {
    const auto index = torch::tensor(rows);
    auto loss =
        torch::mse_loss(fsdp::forward(training.model, inputs.index_select(0, index)), targets.index_select(0, index));
    training.accelerator->backward(loss);  // gradients reduce-scattered to their shards
    training.accelerator->clip_grad_norm_(1.0);
    training.accelerator->step();
    training.optimizer->zero_grad();
    losses.push_back(loss.item<double>());
  }
  return losses;
}

int run(const std::string& project_dir) {
  const auto context = fsdp::DistributedContext::initialize_from_environment();
  torch::manual_seed(7);  // the dataset, the same on every rank
  const auto inputs = torch::randn({kRows, 16});
  const auto targets = torch::sin(inputs.matmul(torch::ones({16, 8}) / 4));

  auto training = prepare(context, project_dir);
  std::vector<double> last_epoch;
  for (int64_t epoch = 0; epoch < kEpochs; ++epoch) {
    last_epoch = train_epoch(training, inputs, targets, epoch);
    fsdp::TrainingProgress progress;
    progress.data_position = epoch + 1;  // epochs done
    const auto saved = training.accelerator->save_state(progress);
    training.accelerator->print("epoch " + std::to_string(epoch) + ": rank 0's last loss " +
                                std::to_string(last_epoch.back()) + ", saved " + saved);
  }

  // Resume where the checkpoint before the last one left off, and take the last epoch again.
  auto resumed = prepare(context, project_dir);
  const auto checkpoint = project_dir + "/checkpoints/checkpoint_" + std::to_string(kEpochs - 2);
  const auto progress = resumed.accelerator->load_state(checkpoint);
  bool same = train_epoch(resumed, inputs, targets, progress.data_position) == last_epoch;
  resumed.accelerator->print("resumed from " + checkpoint + ": epoch " + std::to_string(progress.data_position) +
                             (same ? " gave the same losses" : " gave OTHER losses"));

  // The latest checkpoint merged into one file, as `fsdp merge-weights CHECKPOINT/pytorch_model_fsdp_0 OUT`.
  const auto latest = resumed.accelerator->latest_checkpoint();
  fsdp::merge_fsdp_weights(latest + "/pytorch_model_fsdp_0", project_dir + "/merged", fsdp::MergeOptions{}, context);
  const auto expected = training.accelerator->get_state_dict();  // rank 0 only; collective
  if (context.is_main_process()) {
    const auto merged = fsdp::read_safetensors(project_dir + "/merged/model.safetensors");
    std::map<std::string, torch::Tensor> by_name(merged.begin(), merged.end());
    bool equal = merged.size() == expected.size();
    for (const auto& [name, tensor] : expected) {
      equal = equal && by_name.count(name) && torch::equal(by_name.at(name), tensor);
    }
    std::printf("merged %s: %zu tensors, %s\n", latest.c_str(), merged.size(),
                equal ? "equal to the trained model's" : "NOT the trained model's");
    same = same && equal;
  }
  return same ? 0 : 1;
}

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: fsdp launch --config-file examples/accelerate.yaml -- %s PROJECT_DIR\n", argv[0]);
    return 2;
  }
  // One line per rank with what went wrong, instead of libtorch's backtrace and an abort.
  const char* rank = std::getenv("RANK");
  try {
    return run(argv[1]);
  } catch (const c10::Error& error) {
    std::fprintf(stderr, "example_accelerator: rank %s: error: %s\n", rank ? rank : "0",
                 error.what_without_backtrace());
  } catch (const std::exception& error) {
    std::fprintf(stderr, "example_accelerator: rank %s: error: %s\n", rank ? rank : "0", error.what());
  }
  return 1;
}
