// MetaDeviceGuard, to_empty, reset_parameters and release_parameter_storage (include/fsdp/meta_device.h)
// in one process: a model built under the guard holds no memory, becomes real in place without
// losing its identity, and its modules' initializers give what their constructors give.
#include <fsdp/meta_device.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <string>

#include "harness/error_message.h"
#include "harness/resident_memory.h"

namespace fsdp {
namespace {

int64_t resident_bytes() { return testing::status_bytes("VmRSS"); }

TEST(MetaDevice, AModelBuiltUnderTheGuardHoldsNoMemory) {
  const int64_t before = resident_bytes();
  torch::nn::Sequential model{nullptr};
  {
    MetaDeviceGuard meta;
    // 1.2 GB of fp32 parameters if they were real.
    model = torch::nn::Sequential(torch::nn::Embedding(100000, 2048), torch::nn::Linear(2048, 4096),
                                  torch::nn::LayerNorm(torch::nn::LayerNormOptions({4096})),
                                  torch::nn::Conv2d(torch::nn::Conv2dOptions(3, 64, 3)));
    EXPECT_TRUE(torch::arange(10).is_meta());
  }
  int64_t count = 0;
  for (const auto& item : model->named_parameters()) {
    EXPECT_TRUE(item.value().is_meta()) << item.key();
    EXPECT_TRUE(item.value().requires_grad()) << item.key();
    ++count;
  }
  EXPECT_EQ(count, 7);
  EXPECT_TRUE(has_meta_tensors(*model));
  // Outside the guard, tensors are real again.
  EXPECT_TRUE(torch::ones({2}).device().is_cpu());
  if (before > 0) {
    EXPECT_LT(resident_bytes() - before, int64_t{100} << 20) << "the guard allocated parameter memory";
  }
}

TEST(MetaDevice, ToEmptyMakesTheSameTensorsRealWhereverTheyAreHeld) {
  torch::nn::Linear linear{nullptr};
  {
    MetaDeviceGuard meta;
    linear = torch::nn::Linear(4, 3);
  }
  const auto* weight_impl = linear->weight.unsafeGetTensorImpl();
  to_empty(*linear);
  EXPECT_FALSE(has_meta_tensors(*linear));
  // The typed member and the module's parameter dict still hold one tensor, now on CPU, zero-filled.
  EXPECT_EQ(linear->weight.unsafeGetTensorImpl(), weight_impl);
  EXPECT_EQ(linear->named_parameters()["weight"].unsafeGetTensorImpl(), weight_impl);
  EXPECT_TRUE(linear->weight.device().is_cpu());
  EXPECT_TRUE(torch::equal(linear->weight, torch::zeros({3, 4})));
  EXPECT_TRUE(linear->weight.requires_grad());
  ASSERT_TRUE(reset_parameters(*linear));
  EXPECT_GT(linear->weight.abs().sum().item<float>(), 0.0f);
  // It trains: autograd accumulates a gradient into the materialized tensor.
  linear->forward(torch::ones({2, 4})).sum().backward();
  ASSERT_TRUE(linear->weight.grad().defined());
  EXPECT_TRUE(torch::equal(linear->weight.grad(), torch::full({3, 4}, 2.0f)));
}

// The constructor's initialization of libtorch's modules is their reset_parameters(), so a meta
// module reset with the same seed equals one built for real.
TEST(MetaDevice, ResetParametersGivesWhatTheConstructorGives) {
  // One statement per module: the order of a constructor's arguments is unspecified.
  auto build = [] {
    torch::nn::ModuleList list;
    list->push_back(torch::nn::Embedding(torch::nn::EmbeddingOptions(7, 5).padding_idx(2)));
    list->push_back(torch::nn::Linear(5, 6));
    list->push_back(torch::nn::LayerNorm(torch::nn::LayerNormOptions({6})));
    list->push_back(torch::nn::Conv1d(torch::nn::Conv1dOptions(6, 4, 3)));
    list->push_back(torch::nn::BatchNorm1d(4));
    list->push_back(torch::nn::LSTM(torch::nn::LSTMOptions(4, 3)));
    list->push_back(torch::nn::GRUCell(3, 2));
    return list;
  };
  torch::manual_seed(11);
  auto expected = build();
  torch::manual_seed(11);
  torch::nn::ModuleList model{nullptr};
  {
    MetaDeviceGuard meta;
    model = build();
  }
  for (const auto& module : model->modules(/*include_self=*/false)) {
    to_empty(*module, c10::kCPU, /*recurse=*/false);
    EXPECT_TRUE(reset_parameters(*module)) << module->name();
  }
  const auto actual_parameters = model->named_parameters();
  for (const auto& item : expected->named_parameters()) {
    EXPECT_TRUE(torch::equal(actual_parameters[item.key()], item.value())) << item.key();
  }
  const auto actual_buffers = model->named_buffers();
  for (const auto& item : expected->named_buffers()) {
    EXPECT_TRUE(torch::equal(actual_buffers[item.key()], item.value())) << item.key();
  }
}

struct OwnInitImpl : torch::nn::Module, ResetParameters {
  OwnInitImpl()
      : scale(register_parameter("scale", torch::empty({3}))), offsets(register_buffer("offsets", torch::empty({2}))) {
    reset_parameters();
  }
  void reset_parameters() override {
    torch::NoGradGuard no_grad;
    scale.fill_(2.0);
    offsets.copy_(torch::arange(2, torch::kFloat));
  }
  torch::Tensor scale, offsets;
};
TORCH_MODULE(OwnInit);

struct NoInitImpl : torch::nn::Module {
  NoInitImpl() : weight(register_parameter("weight", torch::zeros({2}))) {}
  torch::Tensor weight;
};
TORCH_MODULE(NoInit);

TEST(MetaDevice, ResetParametersUsesTheModulesOwnInitializerAndSaysWhenThereIsNone) {
  OwnInit own{nullptr};
  {
    MetaDeviceGuard meta;
    own = OwnInit();
  }
  EXPECT_TRUE(own->offsets.is_meta());
  to_empty(*own);
  ASSERT_TRUE(reset_parameters(*own));
  EXPECT_TRUE(torch::equal(own->scale, torch::full({3}, 2.0f)));
  EXPECT_TRUE(torch::equal(own->offsets, torch::arange(2, torch::kFloat)));
  NoInit none;
  EXPECT_FALSE(reset_parameters(*none));
  EXPECT_FALSE(reset_parameters(*torch::nn::ModuleList()));
}

TEST(MetaDevice, ReleasedParametersKeepShapeAndIdentityWithoutMemory) {
  torch::nn::Linear meta_linear{nullptr};
  {
    MetaDeviceGuard meta;
    meta_linear = torch::nn::Linear(4, 3);
  }
  torch::nn::Linear real_linear(4, 3);
  for (auto* linear : {&meta_linear, &real_linear}) {
    const auto* impl = (*linear)->weight.unsafeGetTensorImpl();
    release_parameter_storage(**linear);
    EXPECT_EQ((*linear)->weight.unsafeGetTensorImpl(), impl);
    EXPECT_TRUE((*linear)->weight.device().is_cpu());
    EXPECT_EQ((*linear)->weight.sizes(), (c10::IntArrayRef{3, 4}));
    EXPECT_EQ((*linear)->weight.storage().nbytes(), 0u);
    EXPECT_FALSE(has_meta_tensors(**linear));
  }
}

// Why materializing replaces a tensor's TensorImpl contents in place rather than calling set_data:
// libtorch refuses set_data between the meta device and CPU, in both directions (Note [building on
// the meta device]). When this test fails, a libtorch allows the swap.
TEST(MetaDevice, LibtorchSetDataRefusesMetaToCpuSwaps) {
  auto parameter = torch::zeros({3});
  EXPECT_THROW(parameter.set_data(torch::empty({3}, torch::kMeta)), c10::Error);
  auto meta = torch::empty({3}, torch::kMeta);
  EXPECT_THROW(meta.set_data(torch::zeros({3})), c10::Error);
}

TEST(MetaDevice, MaterializingInsideTheGuardIsAnError) {
  torch::nn::Linear linear{nullptr};
  MetaDeviceGuard meta;
  linear = torch::nn::Linear(2, 2);
  const auto message = testing::error_message_of([&] { to_empty(*linear); });
  EXPECT_NE(message.find("fsdp::to_empty was called inside a MetaDeviceGuard"), std::string::npos) << message;
}

}  // namespace
}  // namespace fsdp
