// fully_shard on a model built on the meta device (Note [building on the meta device],
// include/fsdp/meta_device.h): each unit's modules get their values as FSDP1 gives them (checked
// against PyTorch FSDP1 itself, tests/python/fsdp1_meta_init.py), sync_module_states sends rank 0's
// initialization to ranks that never allocated a full model, and a rank's peak resident memory stays
// near its shards.
#include <fsdp/fsdp.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <fstream>
#include <map>
#include <string>

#include "harness/error_message.h"
#include "harness/multi_rank.h"
#include "harness/parity.h"
#include "harness/python_peer.h"
#include "harness/resident_memory.h"

namespace fsdp {
namespace {

// Mirrors Block and the Sequential in fsdp1_meta_init.py, with the same parameter names.
struct MetaBlockImpl : torch::nn::Module {
  MetaBlockImpl()
      : fc1(register_module("fc1", torch::nn::Linear(8, 16))),
        norm(register_module("norm", torch::nn::LayerNorm(torch::nn::LayerNormOptions({16})))),
        fc2(register_module("fc2", torch::nn::Linear(16, 8))) {}
  torch::nn::Linear fc1;
  torch::nn::LayerNorm norm;
  torch::nn::Linear fc2;
};
TORCH_MODULE(MetaBlock);

torch::nn::ModuleList build_on_meta() {
  MetaDeviceGuard meta;
  return torch::nn::ModuleList(torch::nn::Embedding(10, 8), MetaBlock(), MetaBlock(), torch::nn::Linear(8, 10));
}

// FSDP1's auto-wrap order for ModuleWrapPolicy({Block}): each Block, then the root.
void shard_like_fsdp1(torch::nn::ModuleList& model, const DistributedContext& context,
                      const FullyShardOptions& options) {
  fully_shard(model[1], context, options);
  fully_shard(model[2], context, options);
  fully_shard(model.ptr(), context, options);
}

// fsdp1_meta_init.py's param_init_fn: the n-th module it is given with tensors of its own gets 0.5 * n.
std::function<void(torch::nn::Module&)> counting_init_fn(std::shared_ptr<int> calls) {
  return [calls](torch::nn::Module& module) {
    ++*calls;
    torch::NoGradGuard no_grad;
    for (auto& tensor : module.parameters(/*recurse=*/false)) tensor.fill_(0.5 * *calls);
    for (auto& tensor : module.buffers(/*recurse=*/false)) tensor.fill_(0.5 * *calls);
  };
}

std::map<std::string, torch::Tensor> read_tensors(const std::string& path) {
  std::map<std::string, torch::Tensor> tensors;
  for (auto& [name, tensor] : read_safetensors(path)) tensors[name] = tensor;
  return tensors;
}

// The default initialization (each module's reset_parameters) and a param_init_fn, on 2 ranks
// (uneven shards: 10 rows of the embedding on 2 ranks are even, 8 and 16 too, so 3 ranks as well):
// the full state dict equals PyTorch FSDP1's on the same meta model and seed, bitwise.
class MetaInitLikeFsdp1 : public ::testing::TestWithParam<std::tuple<int, bool>> {};

TEST_P(MetaInitLikeFsdp1, FullStateDictEqualsPyTorchFsdp1) {
  const auto [ranks, with_init_fn] = GetParam();
  const std::string directory = testing::shared_temporary_directory();
  const std::string theirs = directory + "/fsdp1.safetensors", ours = directory + "/ours.safetensors";
  if (!testing::is_rank_process()) {
    std::vector<std::string> arguments{theirs, "7"};
    if (with_init_fn) arguments.push_back("param_init_fn");
    testing::PythonOptions options;
    options.world_size = ranks;
    ASSERT_TRUE(testing::run_python("fsdp1_meta_init.py", arguments, options).ok);
  }
  testing::run_on_ranks(ranks, [&, with_init_fn = with_init_fn](const DistributedContext& context) {
    torch::manual_seed(7);
    auto model = build_on_meta();
    ASSERT_TRUE(has_meta_tensors(*model));
    FullyShardOptions options;
    auto calls = std::make_shared<int>(0);
    if (with_init_fn) options.fsdp1.param_init_fn = counting_init_fn(calls);
    shard_like_fsdp1(model, context, options);
    EXPECT_FALSE(has_meta_tensors(*model));
    if (with_init_fn) {
      EXPECT_EQ(*calls, 8) << "every module with tensors of its own, once";
    }
    const auto state = full_model_state_dict(*model, StateDictConfig{/*offload_to_cpu=*/false, /*rank0_only=*/true});
    if (context.rank() == 0) write_safetensors(ours, state);
  });
  if (testing::is_rank_process()) return;
  const auto expected = read_tensors(theirs);
  const auto actual = read_tensors(ours);
  ASSERT_EQ(actual.size(), expected.size());
  for (const auto& [name, tensor] : expected) {
    ASSERT_TRUE(actual.count(name)) << name;
    EXPECT_TRUE(torch::equal(actual.at(name), tensor)) << name;
  }
}

INSTANTIATE_TEST_SUITE_P(Meta, MetaInitLikeFsdp1,
                         ::testing::Values(std::make_tuple(2, false), std::make_tuple(2, true),
                                           std::make_tuple(3, false)),
                         [](const ::testing::TestParamInfo<std::tuple<int, bool>>& info) {
                           return std::to_string(std::get<0>(info.param)) + "ranks" +
                                  (std::get<1>(info.param) ? "_ParamInitFn" : "_ResetParameters");
                         });

// Under sync_module_states only rank 0 initializes; the others, built on the meta device with
// other seeds, never hold more than their shards and receive rank 0's values.
TEST(MetaInit, SyncModuleStatesGivesEveryRankRankZerosInitialization) {
  testing::run_on_ranks(3, [](const DistributedContext& context) {
    torch::manual_seed(7);
    auto reference = build_on_meta();
    shard_like_fsdp1(reference, context, FullyShardOptions{});
    const auto expected = testing::full_parameters(*reference);
    torch::manual_seed(context.rank() == 0 ? 7 : 50 + context.rank());
    auto model = build_on_meta();
    FullyShardOptions options;
    options.fsdp1.sync_module_states = true;
    shard_like_fsdp1(model, context, options);
    const auto actual = testing::full_parameters(*model);
    ASSERT_EQ(actual.size(), expected.size());
    for (const auto& [name, tensor] : expected) EXPECT_TRUE(torch::equal(actual.at(name), tensor)) << name;
  });
}

struct NoInitializerImpl : torch::nn::Module {
  NoInitializerImpl()
      : inner(register_module("inner", torch::nn::Linear(2, 2))),
        scale(register_parameter("scale", torch::ones({2}))) {}
  torch::nn::Linear inner;
  torch::Tensor scale;
};
TORCH_MODULE(NoInitializer);

TEST(MetaInit, AModuleWithoutInitializerIsAnErrorNamingIt) {
  testing::run_on_ranks(2, [](const DistributedContext& context) {
    torch::nn::ModuleList model{nullptr};
    {
      MetaDeviceGuard meta;
      model = torch::nn::ModuleList(NoInitializer());
    }
    const auto message = testing::error_message_of([&] { fully_shard(model.ptr(), context); });
    EXPECT_EQ(message.rfind("[rank " + std::to_string(context.rank()) + "] fully_shard: module '0' (", 0), 0u)
        << message;
    EXPECT_NE(
        message.find("NoInitializerImpl) of the unit on torch::nn::ModuleListImpl has parameters or buffers on the "
                     "meta device and no initializer of its own. Implement fsdp::ResetParameters"),
        std::string::npos)
        << message;
  });
}

// Peak resident memory per rank (VmHWM, reset through /proc/self/clear_refs just before the model
// is built) on 4 ranks for a model of 16 blocks of two 1024 x 2048 Linear layers (256 MiB of fp32
// parameters, 64 MiB a shard). Built on the meta device and sharded with the default initialization,
// a rank's peak grows by its shards plus one block in full at a time; built for real, by the whole
// model. Measured (bench/README.md): 80 MiB (64 MiB of shards + one 16 MiB block) on the meta device
// against 258 MiB built for real, on every rank. The bounds below leave room for the allocator.
struct WideBlockImpl : torch::nn::Module {
  WideBlockImpl()
      : up(register_module("up", torch::nn::Linear(1024, 2048))),
        down(register_module("down", torch::nn::Linear(2048, 1024))) {}
  torch::nn::Linear up, down;
};
TORCH_MODULE(WideBlock);

torch::nn::ModuleList wide_model() {
  torch::nn::ModuleList model;
  for (int index = 0; index < 16; ++index) model->push_back(WideBlock());
  return model;
}

// The growth of peak resident memory while `build_and_shard` runs.
int64_t peak_growth(const std::function<void()>& build_and_shard) {
  testing::reset_peak_resident();
  const int64_t before = testing::status_bytes("VmRSS");
  build_and_shard();
  return testing::status_bytes("VmHWM") - before;
}

TEST(MetaInit, PeakResidentMemoryPerRankStaysNearItsShards) {
#if defined(__SANITIZE_ADDRESS__)
  GTEST_SKIP() << "skipped under AddressSanitizer: resident memory includes its shadow memory and quarantine, "
                  "and its allocator has no mallopt thresholds";
#endif
  const std::string directory = testing::shared_temporary_directory();
  testing::run_on_ranks(4, [&](const DistributedContext& context) {
    // Freed blocks leave malloc's heap instead of fragmenting it (host_memory.h), as the Accelerator's
    // limit_retained_host_memory does; without it the meta build peaked at 120-140 MiB here.
    limit_retained_host_memory();
    constexpr int64_t kMiB = int64_t{1} << 20;
    constexpr int64_t kFullBytes = 16 * 2 * 1024 * 2048 * 4;
    torch::nn::ModuleList meta_model{nullptr};
    const int64_t meta_growth = peak_growth([&] {
      {
        MetaDeviceGuard meta;
        meta_model = wide_model();
      }
      for (size_t index = 0; index < meta_model->size(); ++index) fully_shard(meta_model[index], context);
      fully_shard(meta_model.ptr(), context);
    });
    torch::nn::ModuleList real_model{nullptr};
    const int64_t real_growth = peak_growth([&] {
      real_model = wide_model();
      for (size_t index = 0; index < real_model->size(); ++index) fully_shard(real_model[index], context);
      fully_shard(real_model.ptr(), context);
    });
    std::ofstream(directory + "/rank" + std::to_string(context.rank()) + ".txt")
        << "[rank " << context.rank() << "] peak resident growth: meta " << meta_growth / kMiB << " MiB, real "
        << real_growth / kMiB << " MiB (full model " << kFullBytes / kMiB << " MiB, shard " << kFullBytes / 4 / kMiB
        << " MiB)\n";
    EXPECT_LT(meta_growth, kFullBytes / 2) << "the meta-device build held more than half the model";
    // Less than the full model when it reuses memory the meta build freed.
    EXPECT_GE(real_growth, kFullBytes * 3 / 4) << "the real build should hold the whole model at once";
    EXPECT_FALSE(has_meta_tensors(*meta_model));
  });
  if (testing::is_rank_process()) return;
  for (int rank = 0; rank < 4; ++rank) {
    std::ifstream figures(directory + "/rank" + std::to_string(rank) + ".txt");
    std::cout << figures.rdbuf();
  }
}

}  // namespace
}  // namespace fsdp
