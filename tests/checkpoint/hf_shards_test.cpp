// save_pretrained_files, the writer of save_model's files (Note [a full state dict one tensor at a
// time]): every rank asks for the same tensors in the same order whether it writes or not, in every
// layout; a writer that fails part way still takes every tensor and returns its error; and on 2
// ranks, rank 0 holds one full tensor at a time while Accelerator::save_model writes.
#include "checkpoint/hf_shards.h"

#include <fsdp/fsdp.h>
#include <gtest/gtest.h>
#include <torch/torch.h>
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <fstream>

#include "harness/error_message.h"
#include "harness/multi_rank.h"
#include "harness/resident_memory.h"

namespace fsdp {
namespace {

namespace fs = std::filesystem;

/// Tensors of four dtypes, a 0-dim one and an empty one, in an order that is not the safetensors
/// file's (wider dtypes first, then by name).
TensorList mixed_tensors() {
  torch::manual_seed(7);
  return {{"b.weight", torch::randn({3, 4})},
          {"a.steps", torch::arange(5, torch::kLong)},
          {"c.half", torch::randn({6}).to(torch::kBFloat16)},
          {"a.weight", torch::randn({2, 2})},
          {"d.flag", torch::tensor({true, false})},
          {"e.scale", torch::tensor(3.5)},
          {"f.empty", torch::zeros({0, 3})}};
}

std::vector<detail::FullModelTensors::Entry> entries_of(const TensorList& tensors) {
  std::vector<detail::FullModelTensors::Entry> entries;
  for (const auto& [name, tensor] : tensors) entries.push_back({name, tensor.scalar_type(), tensor.sizes().vec()});
  return entries;
}

/// The order in which a rank that does not write asks for the tensors.
std::vector<size_t> planned_order(const std::vector<detail::FullModelTensors::Entry>& entries,
                                  const TensorList& tensors, int64_t max_shard_size, bool safe_serialization) {
  std::vector<size_t> order;
  detail::save_pretrained_files("/nonexistent/never/written", entries, max_shard_size, safe_serialization,
                                /*writes=*/false, [&](size_t index) {
                                  order.push_back(index);
                                  return tensors[index].second;
                                });
  return order;
}

struct Layout {
  const char* name;
  int64_t max_shard_size;
  bool safe_serialization;
};

TEST(SavePretrainedFiles, EveryRankAsksForTheSameTensorsInTheSameOrderInEveryLayout) {
  const auto tensors = mixed_tensors();
  const auto entries = entries_of(tensors);
  const auto root = fs::temp_directory_path() / ("fsdp_hf_shards_" + std::to_string(::getpid()));
  const std::vector<size_t> state_dict_order{0, 1, 2, 3, 4, 5, 6};
  fs::remove_all(root);
  // One directory saved three times, each in another layout: each save removes the previous one's
  // files once its own are written.
  for (const Layout& layout : {Layout{"one safetensors file", 0, true}, Layout{"shards of 40 bytes", 40, true},
                               Layout{"pytorch_model.bin", 0, false}}) {
    SCOPED_TRACE(layout.name);
    std::vector<size_t> writer_order;
    const auto error = detail::save_pretrained_files(root.string(), entries, layout.max_shard_size,
                                                     layout.safe_serialization, /*writes=*/true, [&](size_t index) {
                                                       writer_order.push_back(index);
                                                       return tensors[index].second;
                                                     });
    EXPECT_EQ(error, "");
    EXPECT_EQ(writer_order, planned_order(entries, tensors, layout.max_shard_size, layout.safe_serialization));
    EXPECT_FALSE(fs::exists("/nonexistent/never/written")) << "a rank that does not write creates nothing";
    auto sorted = writer_order;
    std::sort(sorted.begin(), sorted.end());
    EXPECT_EQ(sorted, state_dict_order) << "each tensor once";
    size_t model_files = 0;
    for (const auto& item : fs::directory_iterator(root)) model_files += item.path().extension() != ".tmp";
    if (layout.safe_serialization) {
      // A safetensors file asks in its own order, not the state dict's.
      EXPECT_NE(writer_order, state_dict_order);
      const auto source = SafetensorsCheckpointSource(root.string());
      for (const auto& [name, tensor] : tensors) {
        EXPECT_TRUE(torch::equal(source.rows(name, 0, tensor.dim() == 0 ? 1 : tensor.size(0)), tensor)) << name;
      }
      const bool sharded = layout.max_shard_size > 0;
      EXPECT_EQ(fs::exists(root / "model.safetensors.index.json"), sharded);
      EXPECT_EQ(fs::exists(root / "model.safetensors"), !sharded) << "the one-file save's file is gone";
      if (sharded) {
        EXPECT_GT(model_files, 2u);
      }
    } else {
      EXPECT_EQ(writer_order, state_dict_order) << "a torch file asks in its dict's order";
      const auto loaded = load_torch_file((root / "pytorch_model.bin").string()).toGenericDict();
      ASSERT_EQ(loaded.size(), tensors.size());
      for (const auto& [name, tensor] : tensors) EXPECT_TRUE(torch::equal(loaded.at(name).toTensor(), tensor)) << name;
      EXPECT_EQ(model_files, 1u) << "the shards and their index are gone";
    }
  }

  // The writer fails part way, in the middle of a file (the third tensor it asks for has the wrong
  // size): it still takes every tensor, in the same order, and returns the error instead of raising
  // it, so the caller can agree on it across ranks.
  const auto expected_order = planned_order(entries, tensors, 40, true);
  std::vector<size_t> failed_order;
  auto error = detail::save_pretrained_files(root.string(), entries, 40, true, /*writes=*/true, [&](size_t index) {
    failed_order.push_back(index);
    return failed_order.size() == 3 ? torch::zeros({1000}) : tensors[index].second;
  });
  EXPECT_NE(error.find("bytes given for '" + entries[expected_order[2]].name + "'"), std::string::npos) << error;
  EXPECT_EQ(failed_order, expected_order);

  // The directory cannot be made (it is a file): the same, before any file.
  fs::remove_all(root);
  std::ofstream(root.string()) << "not a directory";
  failed_order.clear();
  error =
      detail::save_pretrained_files((root / "model").string(), entries, 40, true, /*writes=*/true, [&](size_t index) {
        failed_order.push_back(index);
        return tensors[index].second;
      });
  EXPECT_NE(error.find((root / "model").string()), std::string::npos) << error;
  EXPECT_EQ(failed_order, expected_order);
  fs::remove_all(root);

  // An error from the tensors themselves (a failed gather) is raised, not returned, on a rank that
  // writes and on one that does not.
  for (const bool writes : {true, false}) {
    const auto message = testing::error_message_of([&] {
      detail::save_pretrained_files(root.string(), entries, 0, true, writes,
                                    [&](size_t) -> at::Tensor { TORCH_CHECK(false, "the gather failed"); });
    });
    EXPECT_NE(message.find("the gather failed"), std::string::npos) << message;
  }
  fs::remove_all(root);

  // A dtype safetensors cannot hold is an error naming the tensor on every rank, before any tensor
  // is asked for; pytorch_model.bin holds it.
  const TensorList complex{{"z.complex", torch::randn({2}, torch::kComplexDouble)}};
  const auto message = testing::error_message_of([&] {
    detail::save_pretrained_files(root.string(), entries_of(complex), 0, true, /*writes=*/false,
                                  [&](size_t index) { return complex[index].second; });
  });
  EXPECT_NE(message.find("tensor 'z.complex' is ComplexDouble, which a safetensors file cannot hold"),
            std::string::npos)
      << message;
  EXPECT_EQ(detail::save_pretrained_files(root.string(), entries_of(complex), 0, false, /*writes=*/true,
                                          [&](size_t index) { return complex[index].second; }),
            "");
  EXPECT_TRUE(
      torch::equal(load_torch_file((root / "pytorch_model.bin").string()).toGenericDict().at("z.complex").toTensor(),
                   complex[0].second));
  fs::remove_all(root);
}

TEST(SavePretrainedFiles, SaveModelHoldsOneFullTensorAtATimeOnRank0) {
#if defined(__SANITIZE_ADDRESS__)
  GTEST_SKIP() << "skipped under AddressSanitizer: resident memory includes its shadow memory and quarantine, "
                  "and its allocator has no mallopt thresholds";
#endif
  const auto directory = testing::shared_temporary_directory();
  testing::run_on_ranks(2, [directory](const DistributedContext& context) {
    // 24 layers of 4 MB: 96 MB of model, each layer a unit.
    constexpr int64_t kLayers = 24, kWidth = 1024;
    torch::manual_seed(5);
    torch::nn::Sequential model;
    for (int64_t layer = 0; layer < kLayers; ++layer)
      model->push_back(torch::nn::Linear(torch::nn::LinearOptions(kWidth, kWidth).bias(false)));
    std::map<std::string, torch::Tensor> expected;
    if (context.rank() == 0) {
      for (const auto& item : model->named_parameters()) expected[item.key()] = item.value().detach().clone();
    }
    FullyShardedDataParallelPluginArgs args;
    args.fsdp_version = int64_t{2};
    args.auto_wrap_policy = std::string("size_based_wrap");
    args.min_num_params = int64_t{100000};
    AcceleratorOptions options;
    options.fsdp_plugin = FullyShardedDataParallelPlugin(args, EnvironmentMap{});
    // Freed blocks leave the process, so the peak is what the save holds, not malloc's retained heap.
    options.limit_retained_host_memory = true;
    Accelerator accelerator(context, options, EnvironmentMap{});
    torch::optim::SGD optimizer(model->parameters(), torch::optim::SGDOptions(0.1));
    accelerator.prepare(model, optimizer);

    const bool peak_reset = testing::reset_peak_resident();
    const double before = testing::status_bytes("VmRSS") / 1048576.0;
    accelerator.save_model(directory + "/model");
    const double growth = testing::status_bytes("VmHWM") / 1048576.0 - before;
    if (context.rank() != 0) return;
    const auto source = SafetensorsCheckpointSource(directory + "/model");
    ASSERT_EQ(source.size(), static_cast<size_t>(kLayers));
    for (const auto& [name, tensor] : expected) EXPECT_TRUE(torch::equal(source.rows(name, 0, kWidth), tensor)) << name;
    // The whole model is 96 MB (the save grew rank 0 by 109 MB when it gathered it first); one full
    // tensor is 4 MB, and its gather holds two (8.4 MB measured).
    if (!peak_reset || before <= 0)
      GTEST_SKIP() << "this kernel does not let a process reset its peak RSS (/proc/self/clear_refs)";
    EXPECT_LT(growth, 32.0) << "rank 0's peak RSS grew by " << growth << " MB while saving a 96 MB model";
  });
}

}  // namespace
}  // namespace fsdp
