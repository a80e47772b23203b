// Broken DCP directories (issue "DCP", item 5): each is a named error from merge-weights (and the
// reader under load_checkpoint), nothing is written and nothing is deleted, even with
// --remove-checkpoint-dir. The directory starts as one fsdp.cpp wrote on 2 ranks; the metadata
// pickles that cannot come from a writer (recursion and memo bombs) are built with the pickle writer.
#include <fsdp/fsdp.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <filesystem>
#include <fstream>
#include <set>

#include "checkpoint/dcp_metadata.h"
#include "checkpoint/dcp_writer.h"
#include "harness/error_message.h"
#include "harness/multi_rank.h"
#include "io/pickle_writer.h"

namespace fsdp {
namespace {

namespace fs = std::filesystem;

std::string read_bytes(const std::string& path) {
  std::ifstream file(path, std::ios::binary);
  return std::string((std::istreambuf_iterator<char>(file)), std::istreambuf_iterator<char>());
}

void write_bytes(const std::string& path, const std::string& bytes) { std::ofstream(path, std::ios::binary) << bytes; }

std::string little_endian(uint32_t value) {
  std::string bytes;
  for (int shift = 0; shift < 32; shift += 8) bytes += static_cast<char>((value >> shift) & 0xff);
  return bytes;
}

// The pickle writer's torch.Size((a, b)).
std::string size_bytes(uint32_t a, uint32_t b) {
  return "ctorch\nSize\n((J" + little_endian(a) + "J" + little_endian(b) + "ttR";
}

size_t replace_all(std::string& text, const std::string& from, const std::string& to) {
  size_t count = 0;
  for (auto at = text.find(from); at != std::string::npos; at = text.find(from, at + to.size())) {
    text.replace(at, from.size(), to);
    ++count;
  }
  return count;
}

std::set<std::string> listing(const std::string& directory) {
  std::set<std::string> names;
  for (const auto& item : fs::directory_iterator(directory)) {
    names.insert(item.path().filename().string() + ":" +
                 std::to_string(item.is_regular_file() ? fs::file_size(item) : 0));
  }
  return names;
}

// Python could never write these: 200000 lists nested in each other, and one 20000-chunk tensor
// named under 20000 keys through the memo.
std::string recursion_bomb() {
  detail::PickleWriter out;
  out.empty_list();
  for (int depth = 1; depth < 200000; ++depth) {
    out.mark();
    out.empty_list();
  }
  // Each APPENDS puts the innermost list into the one below its mark.
  for (int depth = 1; depth < 200000; ++depth) out.appends_from_mark();
  return out.finish();
}

std::string memo_bomb() {
  const std::string module = "torch.distributed.checkpoint.metadata";
  detail::PickleWriter out;
  auto size = [&](int64_t value) {
    out.global("torch", "Size");
    out.mark();
    out.mark();
    out.integer(value);
    out.tuple_from_mark();
    out.tuple_from_mark();
    out.reduce();
  };
  auto dataclass = [&](const std::string& name) {
    out.global(module, name);
    out.empty_tuple();
    out.new_object();
    out.empty_dict();
    out.mark();
  };
  auto end = [&] {
    out.set_items_from_mark();
    out.build();
  };
  const int count = 20000;
  dataclass("Metadata");
  out.string("state_dict_metadata");
  out.empty_dict();
  out.mark();
  out.string("k0");
  dataclass("TensorStorageMetadata");
  out.string("properties");
  out.global(module, "TensorProperties");
  out.empty_tuple();
  out.new_object();
  out.mark();
  out.global("torch", "float32");
  out.tuple_from_mark();
  out.build();
  out.string("size");
  size(count);
  out.string("chunks");
  out.empty_list();
  out.mark();
  for (int index = 0; index < count; ++index) {
    dataclass("ChunkStorageMetadata");
    out.string("offsets");
    size(index);
    out.string("sizes");
    size(1);
    end();
  }
  out.appends_from_mark();
  end();
  out.put(0);
  for (int index = 1; index < count; ++index) {
    out.string("k" + std::to_string(index));
    out.get(0);
  }
  out.set_items_from_mark();
  out.string("storage_data");
  out.empty_dict();
  end();
  return out.finish();
}

TEST(DcpDamaged, EveryBrokenDirectoryIsANamedErrorAndNothingIsWrittenOrDeleted) {
  const auto root = testing::shared_temporary_directory();
  testing::run_on_ranks(2, [root](const DistributedContext& context) {
    torch::manual_seed(3);
    ShardedTensorList state;
    const auto weight = torch::randn({7, 5});
    const int64_t first = context.rank() == 0 ? 0 : 4;
    const int64_t rows = context.rank() == 0 ? 4 : 3;
    state.push_back({"w", ShardedTensor{weight.narrow(0, first, rows).clone(), {7, 5}, first, false, false}});
    state.push_back({"scale", ShardedTensor{torch::ones({}), {}, 0, true, false}});
    detail::write_dcp_directory(root + "/good", detail::model_dcp_entries(state), {}, context, "test-save");
  });
  if (testing::is_rank_process()) return;
  const auto good = root + "/good";
  ASSERT_EQ(merge_fsdp_weights(good, root + "/merged_good").tensors, 2) << "the undamaged directory merges";

  struct Case {
    std::string name;
    std::function<void(const std::string& directory)> damage;
    std::string expected;
  };
  const std::vector<Case> cases = {
      {"truncated pickle",
       [](const std::string& directory) {
         const auto bytes = read_bytes(directory + "/.metadata");
         write_bytes(directory + "/.metadata", bytes.substr(0, bytes.size() / 2));
       },
       "the pickle is truncated at byte"},
      {"disallowed class",
       [](const std::string& directory) {
         auto bytes = read_bytes(directory + "/.metadata");
         ASSERT_GT(replace_all(bytes, "ctorch\nSize\n", "cposix\nkill\n"), 0u);
         write_bytes(directory + "/.metadata", bytes);
       },
       "references 'posix.kill', which this file type does not hold"},
      {"recursion bomb", [](const std::string& directory) { write_bytes(directory + "/.metadata", recursion_bomb()); },
       "is a list, expected torch.distributed.checkpoint.metadata.Metadata"},
      {"memo bomb", [](const std::string& directory) { write_bytes(directory + "/.metadata", memo_bomb()); },
       "refers to the same lists again and again (a memo bomb)"},
      {"offsets past the end of a .distcp",
       [](const std::string& directory) {
         fs::resize_file(directory + "/__1_0.distcp", fs::file_size(directory + "/__1_0.distcp") / 2);
       },
       "runs past the end of the file"},
      {"a chunk that does not tile the tensor",
       [](const std::string& directory) {
         // Rank 1's rows 4..7 claimed as 3..6: as many elements, one row twice and one never.
         auto bytes = read_bytes(directory + "/.metadata");
         ASSERT_EQ(replace_all(bytes, size_bytes(4, 0), size_bytes(3, 0)), 2u);  // the chunk and its storage key
         write_bytes(directory + "/.metadata", bytes);
       },
       "has overlapping chunks at offsets [0, 0] of sizes [4, 5] and [3, 0] of sizes [3, 5]"},
      {"a missing rank file", [](const std::string& directory) { fs::remove(directory + "/__1_0.distcp"); },
       "lacks '__1_0.distcp', which its .metadata names for 'model.w'"},
      {"a relative path escaping the directory",
       [](const std::string& directory) {
         auto bytes = read_bytes(directory + "/.metadata");
         ASSERT_GT(replace_all(bytes, "__1_0.distcp", "../x_0.distc"), 0u);
         write_bytes(directory + "/.metadata", bytes);
       },
       "names file '../x_0.distc', which is not a plain file name in the checkpoint directory"},
  };
  for (const auto& test : cases) {
    SCOPED_TRACE(test.name);
    const auto directory = root + "/" + std::to_string(&test - cases.data());
    fs::copy(good, directory);
    test.damage(directory);
    const auto before = listing(directory);
    MergeOptions options;
    options.remove_checkpoint_dir = true;
    const auto output = directory + "_merged";
    const auto message = testing::error_message_of([&] { merge_fsdp_weights(directory, output, options); });
    EXPECT_NE(message.find(test.expected), std::string::npos) << message;
    ASSERT_TRUE(fs::is_directory(directory)) << "the input was deleted";
    EXPECT_EQ(listing(directory), before) << "the input changed";
    EXPECT_TRUE(!fs::exists(output) || fs::is_empty(output)) << "something was written";
  }
}

}  // namespace
}  // namespace fsdp
