// Helpers for comparing FSDP training with single-process training of the same model.
#pragma once

#include <fsdp/fsdp.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <string>
#include <unordered_set>
#include <vector>

namespace fsdp::testing {

/// Two models built from the same seed: one to shard and one to train in a single process.
template <typename Model, typename... Args>
std::pair<Model, Model> twin_models(uint64_t seed, const Args&... args) {
  torch::manual_seed(seed);
  Model reference(args...);
  torch::manual_seed(seed);
  Model sharded(args...);
  return {reference, sharded};
}

/// The model's parameters without repeats (tied weights appear once), as Python's parameters().
inline std::vector<torch::Tensor> unique_parameters(const torch::nn::Module& model) {
  std::vector<torch::Tensor> parameters;
  std::unordered_set<const c10::TensorImpl*> seen;
  for (const auto& parameter : model.parameters()) {
    if (seen.insert(parameter.unsafeGetTensorImpl()).second) parameters.push_back(parameter);
  }
  return parameters;
}

/// Name -> full tensor (a copy), all-gathering every unit of `model`. Collective.
inline std::map<std::string, torch::Tensor> full_parameters(torch::nn::Module& model) {
  auto units = fsdp::fsdp_modules(model);
  for (const auto& unit : units) unit.unshard();
  std::map<std::string, torch::Tensor> full;
  for (const auto& item : model.named_parameters()) full[item.key()] = item.value().detach().clone();
  for (const auto& unit : units) unit.reshard();
  return full;
}

/// Every full parameter of `actual` equals `expected`'s bitwise (full_parameters of both). Collective.
inline void expect_bitwise_equal(torch::nn::Module& actual, torch::nn::Module& expected, const std::string& what) {
  const auto left = full_parameters(actual);
  const auto right = full_parameters(expected);
  ASSERT_EQ(left.size(), right.size()) << what;
  for (const auto& [name, tensor] : right) EXPECT_TRUE(torch::equal(left.at(name), tensor)) << what << ": " << name;
}

inline std::map<std::string, torch::Tensor> named_copies(const torch::nn::Module& model) {
  std::map<std::string, torch::Tensor> copies;
  for (const auto& item : model.named_parameters()) copies[item.key()] = item.value().detach().clone();
  return copies;
}

/// |a - b| <= relative * |b| + absolute, elementwise; reports the worst element.
inline ::testing::AssertionResult tensors_close(const torch::Tensor& actual, const torch::Tensor& expected,
                                                double relative = 1e-5, double absolute = 1e-6) {
  if (actual.sizes() != expected.sizes()) {
    return ::testing::AssertionFailure() << "shape " << actual.sizes() << " != " << expected.sizes();
  }
  auto difference = (actual.to(torch::kDouble) - expected.to(torch::kDouble)).abs();
  auto bound = expected.to(torch::kDouble).abs() * relative + absolute;
  if ((difference <= bound).all().item<bool>()) return ::testing::AssertionSuccess();
  auto excess = (difference - bound).flatten().argmax().item<int64_t>();
  return ::testing::AssertionFailure() << "worst element " << excess << ": " << actual.flatten()[excess].item<double>()
                                       << " vs " << expected.flatten()[excess].item<double>();
}

/// Every rank's sharded gradients equal its rows of the single-process gradients of `reference`.
inline void expect_sharded_gradients_match(torch::nn::Module& sharded, const torch::nn::Module& reference,
                                           const std::string& what) {
  std::map<const c10::TensorImpl*, std::string> names;
  for (const auto& item : sharded.named_parameters()) names.emplace(item.value().unsafeGetTensorImpl(), item.key());
  const auto reference_parameters = reference.named_parameters();
  for (const auto& unit : fsdp::fsdp_modules(sharded)) {
    for (const auto& info : detail::sharded_parameters(unit)) {
      const auto& name = names.at(info.parameter.unsafeGetTensorImpl());
      const auto expected_full = reference_parameters[name].grad();
      const auto& actual = info.parameter.grad();
      ASSERT_EQ(actual.defined(), expected_full.defined()) << what << ": gradient of " << name;
      if (!actual.defined()) continue;
      const auto& layout = info.layout;
      auto expected = expected_full.reshape({layout.rows, layout.row_numel})
                          .narrow(0, layout.row_offset, layout.owned_rows)
                          .reshape(layout.sharded_sizes);
      EXPECT_TRUE(tensors_close(actual, expected, 1e-5, 1e-7)) << what << ": gradient of " << name;
    }
  }
}

}  // namespace fsdp::testing
