// Tensor files across the language boundary: what fsdp.cpp writes, the venv's safetensors and
// torch.load read bit for bit, and what they write, fsdp.cpp reads bit for bit, for every dtype both
// sides support (tests/python/tensor_files.py is the Python half).
#include <fsdp/safetensors.h>
#include <fsdp/torch_file.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <filesystem>
#include <set>

#include "harness/error_message.h"
#include "harness/python_peer.h"

namespace fsdp {
namespace {

// The dtypes of tensor_files.py's SAFETENSORS_DTYPES, by safetensors name.
const std::vector<std::pair<std::string, c10::ScalarType>>& shared_dtypes() {
  static const std::vector<std::pair<std::string, c10::ScalarType>> dtypes = {
      {"F64", c10::kDouble},
      {"F32", c10::kFloat},
      {"F16", c10::kHalf},
      {"BF16", c10::kBFloat16},
      {"I64", c10::kLong},
      {"I32", c10::kInt},
      {"I16", c10::kShort},
      {"I8", c10::kChar},
      {"U64", c10::kUInt64},
      {"U32", c10::kUInt32},
      {"U16", c10::kUInt16},
      {"U8", c10::kByte},
      {"BOOL", c10::kBool},
      {"C64", c10::kComplexFloat},
      {"F8_E4M3", c10::kFloat8_e4m3fn},
      {"F8_E5M2", c10::kFloat8_e5m2},
      {"F8_E4M3FNUZ", c10::kFloat8_e4m3fnuz},
      {"F8_E5M2FNUZ", c10::kFloat8_e5m2fnuz},
  };
  return dtypes;
}

// Mirrors sample() in tensor_files.py.
at::Tensor sample(c10::ScalarType dtype) {
  auto base = torch::arange(60, torch::kDouble).reshape({3, 4, 5});
  if (dtype == c10::kBool) return base.to(torch::kLong).remainder(3).eq(0);
  if (dtype == c10::kComplexFloat) return torch::complex(base * 0.5 - 3.0, base * -0.25).to(dtype);
  if (c10::isFloatingType(dtype)) return (base * 0.37 - 7.3).to(dtype);
  return (base.to(torch::kLong) * 7919 - 200000).to(dtype);
}

// tensor_files.py's TORCH_FILE_DTYPES: what torch.save writes with a legacy storage class.
const std::set<std::string> kTorchFileDtypes = {"F64", "F32", "F16", "BF16", "I64", "I32",
                                                "I16", "I8",  "U8",  "BOOL", "C64"};

std::vector<std::pair<std::string, at::Tensor>> expected_tensors(bool torch_file_dtypes_only = false) {
  std::vector<std::pair<std::string, at::Tensor>> tensors;
  for (const auto& [name, dtype] : shared_dtypes()) {
    if (!torch_file_dtypes_only || kTorchFileDtypes.count(name)) tensors.emplace_back("t." + name, sample(dtype));
  }
  tensors.emplace_back("scalar", torch::tensor(2.5f));
  tensors.emplace_back("empty", torch::zeros({0, 3}));
  return tensors;
}

bool same_bits(const at::Tensor& a, const at::Tensor& b) {
  if (a.scalar_type() != b.scalar_type() || a.sizes() != b.sizes()) return false;
  return torch::equal(a.contiguous().reshape({-1}).view(torch::kByte), b.contiguous().reshape({-1}).view(torch::kByte));
}

void expect_expected(const std::string& label, const std::vector<std::pair<std::string, at::Tensor>>& found,
                     bool torch_file_dtypes_only = false) {
  const auto expected = expected_tensors(torch_file_dtypes_only);
  std::map<std::string, at::Tensor> by_name(found.begin(), found.end());
  EXPECT_EQ(by_name.size(), expected.size()) << label;
  for (const auto& [name, tensor] : expected) {
    auto match = by_name.find(name);
    if (match == by_name.end()) {
      ADD_FAILURE() << label << ": no tensor '" << name << "'";
      continue;
    }
    EXPECT_TRUE(same_bits(match->second, tensor))
        << label << ": '" << name << "' is " << match->second.scalar_type() << " " << match->second.sizes()
        << ", expected " << tensor.scalar_type() << " " << tensor.sizes() << " with the same bits";
  }
}

class TensorFilesCrossCheck : public ::testing::Test {
 protected:
  void SetUp() override {
    directory_ = std::filesystem::temp_directory_path() / ("fsdp_tensor_files_" + std::to_string(::getpid()));
    std::filesystem::remove_all(directory_);
    std::filesystem::create_directories(directory_);
  }
  void TearDown() override { std::filesystem::remove_all(directory_); }
  std::string path(const std::string& name) const { return (directory_ / name).string(); }
  std::filesystem::path directory_;
};

TEST_F(TensorFilesCrossCheck, SafetensorsAndTorchLoadReadOurFiles) {
  const auto tensors = expected_tensors();
  const auto torch_file_tensors = expected_tensors(/*torch_file_dtypes_only=*/true);
  write_safetensors(path("ours.safetensors"), tensors, {{"writer", "fsdp.cpp"}});
  save_torch_file(path("ours.bin"), tensor_dict(torch_file_tensors));
  const auto python = testing::run_python("tensor_files.py", {"check", directory_.string()});
  ASSERT_TRUE(python.ok);
  EXPECT_NE(python.output[0].find("load_file(ours.safetensors): " + std::to_string(tensors.size()) + " tensors equal"),
            std::string::npos)
      << python.output[0];
  EXPECT_NE(
      python.output[0].find("weights_only=True): " + std::to_string(torch_file_tensors.size()) + " tensors equal"),
      std::string::npos)
      << python.output[0];
}

TEST_F(TensorFilesCrossCheck, WeReadSafetensorsAndTorchSaveFiles) {
  ASSERT_TRUE(testing::run_python("tensor_files.py", {"write", directory_.string()}).ok);

  SafetensorsReader reader(path("theirs.safetensors"));
  EXPECT_EQ(reader.header().metadata.at("writer"), "safetensors");
  expect_expected("theirs.safetensors", read_safetensors(path("theirs.safetensors")));
  // Each name on disk is the dtype our table maps it to.
  for (const auto& [name, dtype] : shared_dtypes()) {
    EXPECT_EQ(reader.header().find("t." + name)->dtype, name);
    EXPECT_EQ(safetensors_scalar_type(name), dtype) << name;
    EXPECT_EQ(safetensors_dtype_name(dtype), name);
  }

  expect_expected("theirs.bin", tensor_dict_items(load_torch_file(path("theirs.bin")), "theirs.bin"), true);
  // model.state_dict() is an OrderedDict, which libtorch 2.13's unpickler cannot build, and float8
  // and uint16/32/64 come through _rebuild_tensor_v3, which it does not know: both are read through
  // the restricted unpickler (Note [torch files through the restricted unpickler]), bit for bit.
  expect_expected("theirs_ordered.bin",
                  tensor_dict_items(load_torch_file(path("theirs_ordered.bin")), "theirs_ordered.bin"));
  expect_expected("theirs_all_dtypes.bin",
                  tensor_dict_items(load_torch_file(path("theirs_all_dtypes.bin")), "theirs_all_dtypes.bin"));
  // Writing those dtypes in torch.save's format stays a named error: libtorch's pickler has no v3.
  auto message = testing::error_message_of(
      [&] { save_torch_file(path("float8.bin"), tensor_dict({{"w", sample(c10::kFloat8_e4m3fn)}})); });
  EXPECT_NE(message.find("a tensor of dtype Float8_e4m3fn cannot be written in torch.save's format"), std::string::npos)
      << message;
  EXPECT_FALSE(std::filesystem::exists(path("float8.bin")));
}

}  // namespace
}  // namespace fsdp
