// The DCP `.metadata` reader (src/checkpoint/dcp_metadata.h) against PyTorch's own read_metadata()
// on checkpoints the venv's torch writes the way Accelerate saves FSDP2 models and optimizers
// (tests/python/dcp_fixture.py: 2 and 3 ranks, uneven shards, an empty chunk, optimizer steps and
// hyper-parameters as byte items): the same keys in the same order, dtypes, sizes, chunks, storage
// entries, planner paths and version. Then the same files with bytes changed.
#include "checkpoint/dcp_metadata.h"

#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "checkpoint/dcp_reader.h"
#include "harness/error_message.h"
#include "harness/multi_rank.h"
#include "harness/python_peer.h"

namespace fsdp::detail {
namespace {

std::string python_dtype(c10::ScalarType dtype) {
  switch (dtype) {
    case c10::kFloat:
      return "float32";
    case c10::kDouble:
      return "float64";
    case c10::kHalf:
      return "float16";
    case c10::kBFloat16:
      return "bfloat16";
    case c10::kLong:
      return "int64";
    case c10::kInt:
      return "int32";
    case c10::kBool:
      return "bool";
    case c10::kByte:
      return "uint8";
    default:
      return c10::toString(dtype);
  }
}

// The plain form dcp_fixture.py writes for PyTorch's reading.
nlohmann::json plain(const DcpMetadata& metadata) {
  nlohmann::json result;
  result["keys"] = metadata.keys;
  std::vector<std::tuple<std::string, std::vector<int64_t>, bool, DcpStorage>> storage;
  for (const auto& key : metadata.keys) {
    if (metadata.byte_items.count(key)) {
      result["entries"][key] = "bytes";
      storage.emplace_back(key, std::vector<int64_t>{}, true, metadata.byte_items.at(key));
      continue;
    }
    const auto& tensor = metadata.tensors.at(key);
    nlohmann::json chunks = nlohmann::json::array();
    for (const auto& chunk : tensor.chunks) {
      chunks.push_back({chunk.offsets, chunk.sizes});
      if (chunk.storage.length >= 0) storage.emplace_back(key, chunk.offsets, false, chunk.storage);
    }
    result["entries"][key] = {{"dtype", python_dtype(tensor.dtype)}, {"size", tensor.size}, {"chunks", chunks}};
  }
  std::sort(storage.begin(), storage.end(), [](const auto& a, const auto& b) {
    return std::tie(std::get<0>(a), std::get<1>(a)) < std::tie(std::get<0>(b), std::get<1>(b));
  });
  result["storage"] = nlohmann::json::array();
  for (const auto& [key, offsets, is_bytes, where] : storage) {
    result["storage"].push_back({key, is_bytes ? nlohmann::json(nullptr) : nlohmann::json(offsets), where.relative_path,
                                 where.offset, where.length});
  }
  result["paths"] = nlohmann::json::object();
  for (const auto& [key, path] : metadata.paths) result["paths"][key] = path;
  result["version"] = metadata.version;
  return result;
}

class DcpMetadataLikePyTorch : public ::testing::TestWithParam<int> {};

TEST_P(DcpMetadataLikePyTorch, ReadsWhatPyTorchReads) {
  const auto directory = testing::shared_temporary_directory();
  testing::PythonOptions options;
  options.world_size = GetParam();
  ASSERT_TRUE(testing::run_python("dcp_fixture.py", {directory}, options).ok);
  nlohmann::json expected;
  std::ifstream(directory + "/expected.json") >> expected;
  for (const std::string name : {"pytorch_model_fsdp_0", "optimizer_0"}) {
    SCOPED_TRACE(name);
    ASSERT_TRUE(is_dcp_directory(directory + "/" + name));
    const auto metadata = read_dcp_metadata(directory + "/" + name);
    const auto ours = plain(metadata);
    for (const std::string part : {"keys", "entries", "storage", "paths", "version"}) {
      EXPECT_EQ(ours[part], expected[name][part])
          << part << "\nours:   " << ours[part].dump() << "\nPyTorch: " << expected[name][part].dump();
    }
  }
  EXPECT_FALSE(is_dcp_directory(directory));
}

INSTANTIATE_TEST_SUITE_P(Ranks, DcpMetadataLikePyTorch, ::testing::Values(2, 3),
                         [](const ::testing::TestParamInfo<int>& info) {
                           return std::to_string(info.param) + "ranks";
                         });

// A real .metadata with one byte changed or cut short: always an error naming the file, never a
// crash (the fuzz target in the DCP issue covers this wider).
// The parameter groups read the same from one item per option (torch 2.13) and from the whole list
// in one item (older writers): PyTorch's own values, AdamW's class told by decoupled_weight_decay.
TEST(DcpMetadata, ParameterGroupsInOneItemReadAsOneItemPerOption) {
  const auto directory = testing::shared_temporary_directory();
  testing::PythonOptions options;
  options.world_size = 2;
  ASSERT_TRUE(testing::run_python("dcp_fixture.py", {directory}, options).ok);
  const auto per_option = dcp_param_groups(DcpDirectoryReader(directory + "/optimizer_0"), "AdamW");
  const auto one_item = dcp_param_groups(DcpDirectoryReader(directory + "/optimizer_one_item_groups"), "AdamW");
  EXPECT_EQ(per_option.optimizer, "AdamW");
  EXPECT_EQ(one_item.optimizer, "AdamW");
  EXPECT_EQ(nlohmann::json::parse(per_option.json), nlohmann::json::parse(one_item.json));
  const auto groups = nlohmann::json::parse(per_option.json);
  ASSERT_EQ(groups.size(), 1u);
  EXPECT_EQ(groups[0]["lr"], 0.01);
  EXPECT_EQ(groups[0]["betas"], nlohmann::json::array({0.9, 0.999}));
  EXPECT_EQ(groups[0]["params"].size(), 7u);
  EXPECT_EQ(groups[0]["params"][0], "0.weight");
}

TEST(DcpMetadata, DamagedFilesAreNamedErrors) {
  const auto directory = testing::shared_temporary_directory();
  testing::PythonOptions options;
  options.world_size = 2;
  ASSERT_TRUE(testing::run_python("dcp_fixture.py", {directory}, options).ok);
  const auto path = directory + "/pytorch_model_fsdp_0/.metadata";
  std::ifstream file(path, std::ios::binary);
  const std::vector<uint8_t> original((std::istreambuf_iterator<char>(file)), std::istreambuf_iterator<char>());
  ASSERT_GT(original.size(), 100u);
  size_t errors = 0;
  for (size_t cut = 0; cut < original.size(); cut += 7) {
    const auto message = testing::error_message_of([&] { parse_dcp_metadata(original.data(), cut, "m"); });
    EXPECT_FALSE(message.empty()) << "cut at " << cut;
    errors += !message.empty();
  }
  for (size_t at = 0; at < original.size(); at += 3) {
    for (const uint8_t value : {uint8_t{0}, uint8_t{0xff}, uint8_t{'R'}}) {
      auto damaged = original;
      damaged[at] = value;
      try {
        parse_dcp_metadata(damaged.data(), damaged.size(), "m");
      } catch (const c10::Error& error) {
        EXPECT_EQ(std::string(error.what_without_backtrace()).rfind("'m'", 0), 0u) << error.what_without_backtrace();
      } catch (const std::exception& error) {
        ADD_FAILURE() << "byte " << at << " = " << int{value} << ": not a named error: " << error.what();
      }
    }
  }
  EXPECT_GT(errors, 0u);
  // A relative path that leaves the directory, an unknown class.
  const std::string relative = "__0_0.distcp";
  auto escaped = original;
  const auto found = std::search(escaped.begin(), escaped.end(), relative.begin(), relative.end());
  ASSERT_NE(found, escaped.end());
  std::copy_n("../_0.distcp", relative.size(), found);
  auto message = testing::error_message_of([&] { parse_dcp_metadata(escaped.data(), escaped.size(), "m"); });
  EXPECT_NE(message.find("names file '../_0.distcp', which is not a plain file name in the checkpoint directory"),
            std::string::npos)
      << message;
  const std::string size_class = "Size";
  auto foreign = original;
  const auto size_at = std::search(foreign.begin(), foreign.end(), size_class.begin(), size_class.end());
  ASSERT_NE(size_at, foreign.end());
  std::copy_n("Sise", 4, size_at);
  message = testing::error_message_of([&] { parse_dcp_metadata(foreign.data(), foreign.size(), "m"); });
  EXPECT_NE(message.find("references 'torch.Sise', which this file type does not hold"), std::string::npos) << message;
}

}  // namespace
}  // namespace fsdp::detail
