#include <gtest/gtest.h>
#include <torch/torch.h>

#include <filesystem>

#include <fsdp/torch_file.h>

#include "harness/error_message.h"

namespace fsdp {
namespace {

class TorchFile : public ::testing::Test {
 protected:
  void SetUp() override {
    directory_ = std::filesystem::temp_directory_path() / ("fsdp_torch_file_" + std::to_string(::getpid()));
    std::filesystem::create_directories(directory_);
  }
  void TearDown() override { std::filesystem::remove_all(directory_); }
  std::string path(const std::string& name) const { return (directory_ / name).string(); }
  std::filesystem::path directory_;
};

TEST_F(TorchFile, RoundTripsADictOfTensors) {
  std::vector<std::pair<std::string, torch::Tensor>> tensors = {
      {"layer.weight", torch::randn({3, 4})}, {"layer.bias", torch::arange(3)}, {"flag", torch::tensor(true)}};
  save_torch_file(path("model.bin"), tensor_dict(tensors));
  auto loaded = tensor_dict_items(load_torch_file(path("model.bin")), "model.bin");
  ASSERT_EQ(loaded.size(), tensors.size());
  for (size_t index = 0; index < tensors.size(); ++index) {
    EXPECT_EQ(loaded[index].first, tensors[index].first);
    EXPECT_TRUE(torch::equal(loaded[index].second, tensors[index].second));
  }
  auto message = testing::error_message_of([&] { load_torch_file(path("missing.bin")); });
  EXPECT_NE(message.find("cannot open torch file"), std::string::npos) << message;
}

}  // namespace
}  // namespace fsdp
