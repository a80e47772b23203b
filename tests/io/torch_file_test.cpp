#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>

#include <fsdp/torch_file.h>

#include "harness/error_message.h"

namespace fsdp {
namespace {

/// Runs Debian's python3 with python3-torch (a cross-check only; never a run-time dependency).
bool python_torch_available() {
  return std::system("/usr/bin/python3 -c 'import torch' >/dev/null 2>&1") == 0;
}

std::string run_python(const std::string& script) {
  std::string output;
  FILE* pipe = ::popen(("/usr/bin/python3 -c '" + script + "' 2>&1").c_str(), "r");
  if (!pipe) return "popen failed";
  char buffer[512];
  while (std::fgets(buffer, sizeof(buffer), pipe)) output += buffer;
  ::pclose(pipe);
  return output;
}

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

TEST_F(TorchFile, PythonTorchLoadReadsOurFilesAndWeReadTorchSave) {
  if (!python_torch_available()) GTEST_SKIP() << "Debian's python3-torch is not installed: cross-check skipped";
  save_torch_file(path("ours.bin"), tensor_dict({{"w", torch::arange(6, torch::kFloat).reshape({2, 3})},
                                                 {"b", torch::tensor({1.5, -2.0}).to(torch::kBFloat16)}}));
  auto output = run_python("import torch; d = torch.load(\"" + path("ours.bin") +
                           "\"); print(sorted(d), float(d[\"w\"].sum()), d[\"w\"].shape, d[\"b\"].dtype)");
  EXPECT_NE(output.find("['b', 'w'] 15.0 torch.Size([2, 3]) torch.bfloat16"), std::string::npos) << output;

  output = run_python("import torch; torch.save({\"x\": torch.arange(4).reshape(2, 2), \"y\": torch.ones(3)}, \"" +
                      path("theirs.bin") + "\"); print(\"saved\")");
  ASSERT_NE(output.find("saved"), std::string::npos) << output;
  auto loaded = tensor_dict_items(load_torch_file(path("theirs.bin")), "theirs.bin");
  ASSERT_EQ(loaded.size(), 2u);
  EXPECT_TRUE(torch::equal(loaded[0].second, torch::arange(4).reshape({2, 2})));
  EXPECT_TRUE(torch::equal(loaded[1].second, torch::ones(3)));
}

}  // namespace
}  // namespace fsdp
