#include <fsdp/fsdp.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "harness/error_message.h"
#include "harness/test_models.h"

namespace fsdp {
namespace {

std::vector<std::string> names_of(
    const std::vector<std::pair<std::string, std::shared_ptr<torch::nn::Module>>>& modules) {
  std::vector<std::string> names;
  for (const auto& item : modules) names.push_back(item.first);
  return names;
}

TEST(AutoWrap, ChildrenComeBeforeParentsAndTheRootIsLast) {
  testing::TinyTransformer model;
  auto order = names_of(module_children_bottom_up(model.ptr()));
  ASSERT_EQ(order.back(), "");
  auto position = [&](const std::string& name) { return std::find(order.begin(), order.end(), name) - order.begin(); };
  EXPECT_LT(position("layers_0.qkv"), position("layers_0"));
  EXPECT_LT(position("layers_1.down"), position("layers_1"));
  EXPECT_EQ(order.size(), model->modules().size());
}

TEST(AutoWrap, ClassNamesMatchWithOrWithoutImplAndNamespaces) {
  testing::TransformerBlock block(6);
  EXPECT_TRUE(module_class_matches(*block, "TransformerBlock"));
  EXPECT_TRUE(module_class_matches(*block, "TransformerBlockImpl"));
  EXPECT_TRUE(module_class_matches(*block, "fsdp::testing::TransformerBlockImpl"));
  EXPECT_FALSE(module_class_matches(*block, "Transformer"));
  EXPECT_FALSE(module_class_matches(*block, "Block"));
}

TEST(AutoWrap, TransformerPolicyWrapsTheBlocksAndNamesAnUnknownClass) {
  testing::TinyTransformer model;
  auto policy = transformer_auto_wrap_policy({"TransformerBlock"}, model.ptr());
  EXPECT_EQ(names_of(modules_to_wrap(model.ptr(), policy)), (std::vector<std::string>{"layers_0", "layers_1"}));
  auto message = testing::error_message_of([&] { transformer_auto_wrap_policy({"LlamaDecoderLayer"}, model.ptr()); });
  EXPECT_NE(message.find("Could not find the transformer layer class 'LlamaDecoderLayer'"), std::string::npos)
      << message;
  EXPECT_NE(message.find("TransformerBlock"), std::string::npos) << message;
}

TEST(AutoWrap, SizePolicyCountsParametersRecursively) {
  testing::TinyTransformer model;
  // Per block: qkv 108 (no bias), projection 42, up 70, down 66, two norms of 12: 310 in all.
  auto wrapped = names_of(modules_to_wrap(model.ptr(), size_based_auto_wrap_policy(100)));
  EXPECT_EQ(wrapped, (std::vector<std::string>{"layers_0.qkv", "layers_0", "layers_1.qkv", "layers_1"}));
  EXPECT_TRUE(modules_to_wrap(model.ptr(), size_based_auto_wrap_policy(310)).empty());
}

TEST(AutoWrap, CallableSeesParametersNotYetWrapped) {
  testing::TinyTransformer model;
  std::map<std::string, int64_t> seen;
  AutoWrapCallable policy = [&](const torch::nn::Module&, const std::string& name, int64_t unwrapped_numel) {
    seen[name] = unwrapped_numel;
    return name.size() > 4 && name.substr(name.size() - 4) == ".qkv";
  };
  modules_to_wrap(model.ptr(), policy);
  EXPECT_EQ(seen.at("layers_0.qkv"), 108);
  EXPECT_EQ(seen.at("layers_0"), 310 - 108);
  EXPECT_EQ(seen.count(""), 0u) << "the root is never offered";
}

}  // namespace
}  // namespace fsdp
