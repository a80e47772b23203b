#include <fsdp/safetensors.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>

#include "harness/error_message.h"

namespace fsdp {
namespace {

std::string with_length(const std::string& header, const std::string& data = "") {
  std::string bytes(8, '\0');
  uint64_t length = header.size();
  for (int index = 0; index < 8; ++index) bytes[index] = static_cast<char>((length >> (8 * index)) & 0xFF);
  return bytes + header + data;
}

std::string parse_error(const std::string& bytes) {
  return testing::error_message_of(
      [&] { parse_safetensors(reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size(), "bad.safetensors"); });
}

std::string float_bytes(int count) {
  std::string bytes;
  for (int index = 0; index < count; ++index) {
    float value = static_cast<float>(index);
    bytes.append(reinterpret_cast<const char*>(&value), 4);
  }
  return bytes;
}

// Golden vectors from huggingface/safetensors' own tests (bindings/python/tests/test_simple.py).
TEST(Safetensors, MatchesTheReferenceWritersBytes) {
  auto tensor = torch::arange(6, torch::kFloat).reshape({1, 2, 3});
  const std::string header = R"({"attn.0":{"dtype":"F32","shape":[1,2,3],"data_offsets":[0,24]}})";
  ASSERT_EQ(header.size(), 64u);
  EXPECT_EQ(serialize_safetensors({{"attn.0", tensor}}, {}), with_length(header, float_bytes(6)));

  const std::string unaligned = R"({"attn0":{"dtype":"F32","shape":[1,1,2,3],"data_offsets":[0,24]}})";
  ASSERT_EQ(unaligned.size(), 65u);
  EXPECT_EQ(serialize_safetensors({{"attn0", tensor.reshape({1, 1, 2, 3})}}, {}),
            with_length(unaligned + std::string(7, ' '), float_bytes(6)));

  EXPECT_EQ(serialize_safetensors({}, {}), with_length("{}" + std::string(6, ' ')));
  const auto empty_with_metadata = serialize_safetensors({}, {{"framework", "pt"}});
  EXPECT_EQ(empty_with_metadata, with_length(R"({"__metadata__":{"framework":"pt"}})" + std::string(5, ' ')));
  EXPECT_EQ(empty_with_metadata.size(), 48u);
}

TEST(Safetensors, WriterSortsByAlignmentThenName) {
  const auto bytes = serialize_safetensors({{"b", torch::zeros({2}, torch::kBFloat16)},
                                            {"a", torch::zeros({1}, torch::kFloat)},
                                            {"z", torch::zeros({1}, torch::kDouble)},
                                            {"c", torch::zeros({3}, torch::kFloat)},
                                            {"m", torch::zeros({1}, torch::kBool)}},
                                           {});
  auto header = parse_safetensors(reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size(), "sorted");
  std::vector<std::string> order;
  for (const auto& info : header.tensors) order.push_back(info.name);
  EXPECT_EQ(order, (std::vector<std::string>{"z", "a", "c", "b", "m"}));
  EXPECT_EQ(header.data_offset % 8, 0);
}

TEST(Safetensors, RoundTripsEveryDtypeThroughAFile) {
  auto directory = std::filesystem::temp_directory_path() / ("fsdp_safetensors_" + std::to_string(::getpid()));
  std::filesystem::create_directories(directory);
  const auto path = (directory / "model.safetensors").string();
  std::vector<std::pair<std::string, torch::Tensor>> tensors;
  int index = 0;
  for (auto dtype : {torch::kDouble, torch::kFloat, torch::kHalf, torch::kBFloat16, torch::kLong, torch::kInt,
                     torch::kShort, torch::kChar, torch::kByte, torch::kBool}) {
    tensors.emplace_back("tensor." + std::to_string(index++), (torch::arange(12) % 5).reshape({3, 4}).to(dtype));
  }
  tensors.emplace_back("scalar", torch::tensor(2.5));
  tensors.emplace_back("empty", torch::zeros({0, 3}));
  write_safetensors(path, tensors, {{"note", "hello"}});
  SafetensorsReader reader(path);
  EXPECT_EQ(reader.header().metadata.at("format"), "pt");
  EXPECT_EQ(reader.header().metadata.at("note"), "hello");
  for (const auto& [name, tensor] : tensors) {
    auto loaded = reader.tensor(name);
    EXPECT_EQ(loaded.scalar_type(), tensor.scalar_type()) << name;
    EXPECT_TRUE(torch::equal(loaded, tensor)) << name;
  }
  EXPECT_TRUE(torch::equal(reader.rows("tensor.1", 1, 2), tensors[1].second.narrow(0, 1, 2)));
  auto message = testing::error_message_of([&] { reader.tensor("missing"); });
  EXPECT_NE(message.find("has no tensor named 'missing'"), std::string::npos) << message;
  message =
      testing::error_message_of([&] { write_safetensors(path, {{"a", tensors[0].second}, {"b", tensors[0].second}}); });
  EXPECT_NE(message.find("share memory"), std::string::npos) << message;
  std::filesystem::remove_all(directory);
}

TEST(Safetensors, RejectsMalformedFilesNamingTheProblem) {
  const std::string good_entry = R"("a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]})";
  struct Case {
    std::string bytes;
    std::string expected;
  };
  std::string huge_length(8, '\0');
  huge_length[4] = 1;  // 2^32 bytes
  const std::vector<Case> cases = {
      {"abc", "shorter than the 8-byte header length"},
      {huge_length, "the limit is 100000000 bytes"},
      {with_length("{}").substr(0, 9), "only 1 bytes follow"},
      {with_length("{\"\xff\":1}"), "not valid UTF-8"},
      {with_length("{not json}"), "not valid JSON"},
      {with_length("[1,2]"), "must be a JSON object"},
      {with_length(R"({"a":{"dtype":"F99","shape":[2],"data_offsets":[0,8]}})", std::string(8, '\0')),
       "unknown dtype 'F99'"},
      {with_length("{" + good_entry + "," + good_entry + "}", std::string(8, '\0')), "'a' appears twice"},
      {with_length(R"({"a":{"dtype":"F32","shape":[4611686018427387904,8],"data_offsets":[0,8]}})"), "overflows"},
      {with_length(
           R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})",
           std::string(12, '\0')),
       "overlap"},
      {with_length(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})", std::string(12, '\0')), "gap"},
      {with_length("{" + good_entry + "}", std::string(12, '\0')), "trailing bytes"},
      {with_length("{" + good_entry + "}", std::string(4, '\0')), "truncated"},
      {with_length(R"({"a":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}})", std::string(8, '\0')), "need 12 bytes"},
      {with_length(R"({"a":{"dtype":"F32","shape":[-1],"data_offsets":[0,8]}})", std::string(8, '\0')),
       "not a non-negative integer"},
      {with_length(R"({"a":{"dtype":"F32","shape":[2]}})"), "must be an object with dtype, shape and data_offsets"},
      {with_length(R"({"__metadata__":{"x":1}})"), "must be a string"},
  };
  for (const auto& [bytes, expected] : cases) {
    const auto message = parse_error(bytes);
    EXPECT_NE(message.find(expected), std::string::npos) << "expected '" << expected << "', got: " << message;
    EXPECT_NE(message.find("bad.safetensors"), std::string::npos) << message;
  }
}

TEST(Safetensors, ReadsSubByteNamesButExplainsTheyCannotBeLoaded) {
  const auto bytes = with_length(R"({"w":{"dtype":"F4","shape":[4],"data_offsets":[0,2]}})", "\x01\x02");
  auto header = parse_safetensors(reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size(), "f4");
  ASSERT_EQ(header.tensors.size(), 1u);
  EXPECT_EQ(header.tensors[0].dtype, "F4");
  auto message = testing::error_message_of([] { safetensors_scalar_type("F4"); });
  EXPECT_NE(message.find("'F4' packs values into fewer than 8 bits"), std::string::npos) << message;
  // Float8 loads now (libtorch 2.x has the dtypes): tests/io/tensor_files_crosscheck_test.cpp.
  EXPECT_EQ(safetensors_scalar_type("F8_E4M3"), c10::kFloat8_e4m3fn);
}

TEST(Safetensors, RandomCorruptionIsAnErrorNeverACrash) {
  const auto valid =
      serialize_safetensors({{"weight", torch::randn({4, 3})}, {"bias", torch::randn({4})}}, {{"format", "pt"}});
  std::mt19937 random(1234);
  int rejected = 0;
  for (int trial = 0; trial < 3000; ++trial) {
    auto bytes = valid;
    const int flips = 1 + static_cast<int>(random() % 4);
    for (int flip = 0; flip < flips; ++flip) {
      bytes[random() % bytes.size()] = static_cast<char>(random() % 256);
    }
    if (random() % 8 == 0) bytes.resize(random() % bytes.size());
    try {
      parse_safetensors(reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size(), "fuzz");
    } catch (const c10::Error&) {
      ++rejected;
    }
  }
  EXPECT_GT(rejected, 100);
}

}  // namespace
}  // namespace fsdp
