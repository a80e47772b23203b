// merge_fsdp_weights and `fsdp merge-weights`: merged files equal the FULL state dict, for checkpoints
// from 1 to 4 ranks; inputs that cannot be merged are named; a failed merge leaves nothing behind.
#include <fsdp/accelerate_config.h>
#include <fsdp/fsdp.h>
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <torch/torch.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "harness/error_message.h"
#include "harness/multi_rank.h"
#include "harness/parity.h"
#include "harness/python_peer.h"
#include "harness/test_models.h"

namespace fsdp {
namespace {

namespace fs = std::filesystem;

/// How the sharded directories of the checkpoint are written: DCP (what save_checkpoint writes) or
/// the rank-file format of earlier fsdp.cpp versions, which merge still reads.
enum class Layout { kDcp, kRankFiles };

/// Trains a sharded tiny transformer one step on `world_size` ranks and saves a SHARDED checkpoint
/// into `directory`/checkpoint and rank 0's FULL state dict into `directory`/full.safetensors.
void save_sharded_checkpoint(const std::string& directory, int world_size, Layout layout = Layout::kDcp) {
  testing::run_on_ranks(world_size, [directory, layout](const DistributedContext& context) {
    torch::manual_seed(51);
    testing::TinyTransformer model;
    for (auto& layer : model->layers) fully_shard(layer.ptr(), context);
    fully_shard(model.ptr(), context);
    torch::optim::AdamW optimizer(testing::unique_parameters(*model));
    torch::manual_seed(52);
    auto tokens = torch::randint(0, 11, {12, 6});
    const int64_t local = 12 / context.world_size();
    auto logits = fsdp::forward(model, tokens.narrow(0, context.rank() * local, local).narrow(1, 0, 5));
    torch::nn::functional::cross_entropy(logits.reshape({-1, 11}),
                                         tokens.narrow(0, context.rank() * local, local).narrow(1, 1, 5).reshape({-1}))
        .backward();
    optimizer.step();
    save_checkpoint(directory + "/checkpoint", *model, optimizer, context, {});
    if (layout == Layout::kRankFiles) {
      const auto model_dir = directory + "/checkpoint/pytorch_model_fsdp_0";
      const auto optimizer_dir = directory + "/checkpoint/optimizer_0";
      barrier(context.world());
      if (context.rank() == 0) {
        fs::remove_all(model_dir);
        fs::remove_all(optimizer_dir);
      }
      barrier(context.world());
      write_sharded_directory(model_dir, sharded_model_state_dict(*model), context);
      const auto state = sharded_optimizer_state_dict(*model, optimizer);
      const nlohmann::json extra = {{"optimizer", state.optimizer},
                                    {"param_groups", nlohmann::json::parse(state.param_groups_json)}};
      write_sharded_directory(optimizer_dir, state.tensors, context, extra.dump());
    }
    const auto full = full_model_state_dict(*model, StateDictConfig{true, true});
    if (context.rank() == 0) write_safetensors(directory + "/full.safetensors", full);
  });
}

void expect_same_tensors(const TensorSource& actual, const std::string& expected_path) {
  SafetensorsReader expected(expected_path);
  EXPECT_EQ(actual.size(), expected.header().tensors.size());
  for (const auto& info : expected.header().tensors) {
    ASSERT_TRUE(actual.contains(info.name)) << info.name;
    const auto shape = actual.shape(info.name);
    EXPECT_TRUE(torch::equal(actual.rows(info.name, 0, shape.empty() ? 1 : shape[0]).reshape(shape),
                             expected.tensor(info.name)))
        << info.name;
  }
}

TEST(Merge, MergedModelEqualsTheFullStateDictForOneToFourRanks) {
  const auto root = testing::shared_temporary_directory();
  for (int world_size = 1; world_size <= 4; ++world_size) {
    save_sharded_checkpoint(root + "/w" + std::to_string(world_size), world_size);
  }
  if (testing::is_rank_process()) return;
  for (int world_size = 1; world_size <= 4; ++world_size) {
    const auto directory = root + "/w" + std::to_string(world_size);
    const auto result = merge_fsdp_weights(directory + "/checkpoint/pytorch_model_fsdp_0", directory + "/out/nested");
    ASSERT_EQ(result.files.size(), 1u);
    EXPECT_EQ(fs::path(result.files[0]).filename(), "model.safetensors");
    SafetensorsReader merged(result.files[0]);
    EXPECT_EQ(merged.header().metadata.at("format"), "pt");
    SafetensorsCheckpointSource source(result.files[0]);
    expect_same_tensors(source, directory + "/full.safetensors");
  }
}

TEST(Merge, ShardedOutputTorchBinAndOptimizerDirectories) {
  const auto root = testing::shared_temporary_directory();
  save_sharded_checkpoint(root, 3);
  if (testing::is_rank_process()) return;
  const auto model_dir = root + "/checkpoint/pytorch_model_fsdp_0";

  MergeOptions sharded;
  sharded.max_shard_size = 600;  // bytes: several shards for this tiny model
  const auto result = merge_fsdp_weights(model_dir, root + "/sharded", sharded);
  ASSERT_GT(result.files.size(), 2u);
  EXPECT_EQ(fs::path(result.files.back()).filename(), "model.safetensors.index.json");
  EXPECT_EQ(fs::path(result.files.front()).filename(),
            "model-00001-of-0000" + std::to_string(result.files.size() - 1) + ".safetensors");
  SafetensorsCheckpointSource from_index(root + "/sharded");
  expect_same_tensors(from_index, root + "/full.safetensors");

  MergeOptions unsafe;
  unsafe.safe_serialization = false;
  const auto bin = merge_fsdp_weights(model_dir, root + "/bin", unsafe);
  ASSERT_EQ(bin.files.size(), 1u);
  EXPECT_EQ(fs::path(bin.files[0]).filename(), "pytorch_model.bin");
  TensorListSource from_bin(tensor_dict_items(load_torch_file(bin.files[0]), bin.files[0]));
  expect_same_tensors(from_bin, root + "/full.safetensors");
  const auto python =
      testing::run_python_code("import torch; d = torch.load('" + bin.files[0] +
                               "', weights_only=True); print('keys', len(d), float(d['norm.weight'].sum()))");
  ASSERT_TRUE(python.ok);
  EXPECT_NE(python.output.at(0).find("keys " + std::to_string(from_bin.size())), std::string::npos)
      << python.output.at(0);

  // The optimizer: safetensors with "state.<parameter>.<field>" keys and the groups in the metadata,
  // or the nested optimizer.bin of a FULL checkpoint.
  const auto optimizer = merge_fsdp_weights(root + "/checkpoint/optimizer_0", root + "/optimizer");
  SafetensorsReader optimizer_file(optimizer.files.at(0));
  EXPECT_EQ(fs::path(optimizer.files[0]).filename(), "optimizer.safetensors");
  EXPECT_EQ(optimizer_file.header().metadata.at("optimizer"), "AdamW");
  EXPECT_NE(optimizer_file.header().metadata.at("param_groups").find("\"lr\""), std::string::npos);
  EXPECT_TRUE(optimizer_file.contains("state.norm.weight.exp_avg"));
  const auto optimizer_bin = merge_fsdp_weights(root + "/checkpoint/optimizer_0", root + "/optimizer_bin", unsafe);
  const auto state = optimizer_state_dict_from_ivalue(load_torch_file(optimizer_bin.files.at(0)), "optimizer.bin");
  EXPECT_EQ(state.optimizer, "AdamW");
  EXPECT_EQ(state.tensors.size(), optimizer_file.header().tensors.size());
}

TEST(Merge, InputsThatCannotBeMergedAreNamedAndAFailedMergeLeavesNothing) {
  const auto root = testing::shared_temporary_directory();
  save_sharded_checkpoint(root, 2, Layout::kRankFiles);
  if (testing::is_rank_process()) return;
  const auto checkpoint = root + "/checkpoint";
  const auto model_dir = checkpoint + "/pytorch_model_fsdp_0";
  auto expect_error = [](const std::function<void()>& body, const std::string& expected) {
    const auto message = testing::error_message_of(body);
    EXPECT_NE(message.find(expected), std::string::npos) << "expected '" << expected << "' in: " << message;
  };
  expect_error([&] { merge_fsdp_weights(checkpoint, root + "/out"); },
               "is a checkpoint, not a sharded directory; merge one of its sharded directories: optimizer_0, "
               "pytorch_model_fsdp_0");

  // A PyTorch DCP directory whose .metadata is not a pickle: read as DCP, and refused by name.
  fs::create_directories(root + "/dcp/pytorch_model_fsdp_0");
  std::ofstream(root + "/dcp/pytorch_model_fsdp_0/.metadata") << "pickle";
  std::ofstream(root + "/dcp/pytorch_model_fsdp_0/__0_0.distcp") << "tensor bytes";
  expect_error([&] { merge_fsdp_weights(root + "/dcp/pytorch_model_fsdp_0", root + "/out"); },
               "pytorch_model_fsdp_0/.metadata': pickle byte 0: opcode 0x70 is not one the restricted reader knows");
  expect_error([&] { merge_fsdp_weights(root + "/dcp", root + "/out"); },
               "is a checkpoint, not a sharded directory; merge one of its sharded directories: pytorch_model_fsdp_0");

  fs::rename(checkpoint + "/checkpoint_complete.json", checkpoint + "/marker.away");
  expect_error([&] { merge_fsdp_weights(model_dir, root + "/out"); }, "is incomplete");
  expect_error([&] { merge_fsdp_weights(model_dir + "/", root + "/out"); }, "is incomplete");
  fs::rename(checkpoint + "/marker.away", checkpoint + "/checkpoint_complete.json");

  fs::rename(model_dir + "/rank_00001.safetensors", model_dir + "/away");
  expect_error([&] { merge_fsdp_weights(model_dir, root + "/out"); }, "lacks 'rank_00001.safetensors'");
  fs::rename(model_dir + "/away", model_dir + "/rank_00001.safetensors");

  {
    std::ifstream in(model_dir + "/metadata.json");
    std::stringstream text;
    text << in.rdbuf();
    auto broken = text.str();
    const auto position = broken.find("\"row_offset\": 6");
    ASSERT_NE(position, std::string::npos) << broken;
    broken.replace(position, 15, "\"row_offset\": 5");
    fs::rename(model_dir + "/metadata.json", model_dir + "/metadata.good");
    std::ofstream(model_dir + "/metadata.json") << broken;
    expect_error([&] { merge_fsdp_weights(model_dir, root + "/out"); }, "in two files");
    fs::remove(model_dir + "/metadata.json");
    fs::rename(model_dir + "/metadata.good", model_dir + "/metadata.json");
  }

  merge_fsdp_weights(model_dir, root + "/out");
  expect_error([&] { merge_fsdp_weights(model_dir, root + "/out"); },
               "already holds model.safetensors; choose another output directory or pass --overwrite");
  // Another layout's files count too: transformers would load model.safetensors before an index.
  MergeOptions sharded_overwrite;
  sharded_overwrite.max_shard_size = 600;
  expect_error([&] { merge_fsdp_weights(model_dir, root + "/out", sharded_overwrite); },
               "already holds model.safetensors");
  sharded_overwrite.overwrite = true;
  merge_fsdp_weights(model_dir, root + "/out", sharded_overwrite);
  EXPECT_FALSE(fs::exists(root + "/out/model.safetensors")) << "the replaced layout must be gone";
  EXPECT_TRUE(fs::exists(root + "/out/model.safetensors.index.json"));

  MergeOptions remove_into_input;
  remove_into_input.remove_checkpoint_dir = true;
  expect_error([&] { merge_fsdp_weights(model_dir, model_dir + "/merged", remove_into_input); },
               "is inside the checkpoint directory");

  // A failure half-way (a full disk, here an injected error) leaves no output and keeps the input,
  // even when asked to remove it.
  MergeOptions failing;
  failing.max_shard_size = 600;
  failing.remove_checkpoint_dir = true;
  failing.progress = [](int64_t written, int64_t total) {
    if (written * 2 > total) throw std::runtime_error("disk full (injected)");
  };
  EXPECT_THROW(merge_fsdp_weights(model_dir, root + "/failed", failing), std::runtime_error);
  EXPECT_TRUE(fs::exists(model_dir + "/metadata.json"));
  EXPECT_TRUE(fs::is_empty(root + "/failed")) << "partial output left behind";

  MergeOptions removing;
  removing.remove_checkpoint_dir = true;
  merge_fsdp_weights(model_dir, root + "/removed", removing);
  EXPECT_FALSE(fs::exists(model_dir));
  EXPECT_TRUE(fs::exists(root + "/removed/model.safetensors"));
}

// Accelerate's merge_fsdp_weights under a distributed launch: every rank calls it, the main process
// writes, the others wait; a failure on the main process is an error on every rank.
TEST(Merge, EveryRankCallsItRankZeroWritesAndItsFailureIsEveryRanks) {
  const auto root = testing::shared_temporary_directory();
  save_sharded_checkpoint(root, 2);
  const std::string model_dir = root + "/checkpoint/pytorch_model_fsdp_0";
  testing::run_on_ranks(2, [root, model_dir](const DistributedContext& context) {
    const auto result = merge_fsdp_weights(model_dir, root + "/merged", MergeOptions{}, context);
    ASSERT_EQ(result.files, (std::vector<std::string>{root + "/merged/model.safetensors"}));
    EXPECT_GT(result.tensors, 0);
    EXPECT_TRUE(fs::exists(root + "/merged/model.safetensors"));
    // The output exists now: rank 0 refuses to overwrite it, and every rank hears why.
    auto message =
        testing::error_message_of([&] { merge_fsdp_weights(model_dir, root + "/merged", MergeOptions{}, context); });
    EXPECT_NE(message.find("already holds model.safetensors"), std::string::npos) << message;
    if (context.rank() == 1) {
      EXPECT_NE(message.find("rank 0 failed"), std::string::npos) << message;
    }
    // Without the context, a rank other than 0 would write the same files: an error there.
    if (context.rank() == 1) {
      message = testing::error_message_of([&] { merge_fsdp_weights(model_dir, root + "/other", MergeOptions{}); });
      EXPECT_NE(message.find("merge_fsdp_weights: called on rank 1 of 2 without a DistributedContext"),
                std::string::npos)
          << message;
      EXPECT_FALSE(fs::exists(root + "/other"));
    }
  });
  if (testing::is_rank_process()) return;
  expect_same_tensors(SafetensorsCheckpointSource(root + "/merged/model.safetensors"), root + "/full.safetensors");
}

// --remove-checkpoint-dir removes the directory given, as Accelerate does, and nothing beside it: the
// optimizer directory of the same checkpoint still merges.
TEST(Merge, RemovingTheModelDirectoryKeepsTheOptimizerMergeable) {
  const auto root = testing::shared_temporary_directory();
  save_sharded_checkpoint(root, 2);
  if (testing::is_rank_process()) return;
  MergeOptions removing;
  removing.remove_checkpoint_dir = true;
  merge_fsdp_weights(root + "/checkpoint/pytorch_model_fsdp_0", root + "/model", removing);
  EXPECT_FALSE(fs::exists(root + "/checkpoint/pytorch_model_fsdp_0"));
  EXPECT_TRUE(fs::exists(root + "/checkpoint/checkpoint_complete.json"));
  const auto result = merge_fsdp_weights(root + "/checkpoint/optimizer_0", root + "/optimizer", MergeOptions{});
  EXPECT_GT(result.tensors, 0);
}

TEST(Merge, CommandLineMergesAndReportsErrors) {
  const auto root = testing::shared_temporary_directory();
  save_sharded_checkpoint(root, 2);
  if (testing::is_rank_process()) return;
  auto run = [](const std::string& arguments, std::string& output) {
    FILE* pipe = ::popen((std::string(FSDP_CLI_PATH) + " " + arguments + " 2>&1").c_str(), "r");
    char buffer[512];
    output.clear();
    while (std::fgets(buffer, sizeof(buffer), pipe)) output += buffer;
    return WEXITSTATUS(::pclose(pipe));
  };
  std::string output;
  EXPECT_EQ(
      run("merge-weights " + root + "/checkpoint/pytorch_model_fsdp_0 " + root + "/cli --max_shard_size 1KB", output),
      0)
      << output;
  EXPECT_NE(output.find("model.safetensors.index.json"), std::string::npos) << output;
  EXPECT_EQ(run("merge-weights " + root + "/checkpoint " + root + "/cli2", output), 1) << output;
  EXPECT_NE(output.find("fsdp: error: merge: '"), std::string::npos) << output;
  EXPECT_EQ(
      run("merge-weights " + root + "/checkpoint/pytorch_model_fsdp_0 " + root + "/cli3 --max-shard-size lots", output),
      2)
      << output;
  EXPECT_NE(output.find("'lots' is not a size"), std::string::npos) << output;
  // A file is not a directory that "does not exist".
  EXPECT_EQ(run("merge-weights " + root + "/checkpoint/pytorch_model_fsdp_0/.metadata " + root + "/cli5", output), 1);
  EXPECT_NE(output.find(".metadata' is a file, not a checkpoint directory"), std::string::npos) << output;
  // An empty size is not "no limit" (it used to merge into one file with exit 0).
  EXPECT_EQ(
      run("merge-weights " + root + "/checkpoint/pytorch_model_fsdp_0 " + root + "/cli4 --max-shard-size ''", output),
      2)
      << output;
  EXPECT_NE(output.find("'' is not a size"), std::string::npos) << output;
  EXPECT_EQ(run("merge-weights --help", output), 0);
  EXPECT_EQ(run("merge-weights only_one_argument", output), 2) << output;
}

TEST(Merge, ParsesByteSizes) {
  EXPECT_EQ(detail::parse_byte_size("5GB"), 5000000000);
  EXPECT_EQ(detail::parse_byte_size("500MB"), 500000000);
  EXPECT_EQ(detail::parse_byte_size("1.5GB"), 1500000000);
  EXPECT_EQ(detail::parse_byte_size("2GiB"), 2147483648);
  EXPECT_EQ(detail::parse_byte_size("64kb"), 64000);
  EXPECT_EQ(detail::parse_byte_size("1000"), 1000);
  EXPECT_NE(testing::error_message_of([] { detail::parse_byte_size("-5GB"); }).find("is not a size"),
            std::string::npos);
  EXPECT_NE(testing::error_message_of([] { detail::parse_byte_size("GB"); }).find("is not a size"), std::string::npos);
}

// Issue "Reliability": a metadata.json that lists fewer tensors than the rank files hold (or none)
// once merged "0 tensors" and then removed the directory. Every byte of the rank files must be
// accounted for, or nothing is merged and nothing is removed.
TEST(Merge, MetadataThatDoesNotListEveryTensorOfTheRankFilesIsRefusedAndNothingIsRemoved) {
  const auto root = testing::shared_temporary_directory();
  save_sharded_checkpoint(root, 2, Layout::kRankFiles);
  if (testing::is_rank_process()) return;
  const auto model_dir = root + "/checkpoint/pytorch_model_fsdp_0";
  const auto metadata_path = model_dir + "/metadata.json";
  nlohmann::json original;
  std::ifstream(metadata_path) >> original;
  ASSERT_GT(original["tensors"].size(), 1u);
  MergeOptions remove;
  remove.remove_checkpoint_dir = true;
  for (const bool none : {false, true}) {
    auto changed = original;
    if (none) {
      changed["tensors"] = nlohmann::json::array();
    } else {
      changed["tensors"].erase(changed["tensors"].begin());
    }
    std::ofstream(metadata_path) << changed.dump();
    const auto message = testing::error_message_of([&] { merge_fsdp_weights(model_dir, root + "/out", remove); });
    EXPECT_NE(message.find("which metadata.json does not list (it lists " + std::to_string(changed["tensors"].size()) +
                           " tensors): the metadata and the rank files disagree"),
              std::string::npos)
        << message;
    EXPECT_TRUE(fs::exists(model_dir + "/rank_00000.safetensors")) << "the input must stay";
    EXPECT_FALSE(fs::exists(root + "/out/model.safetensors"));
  }
  std::ofstream(metadata_path) << original.dump();
  EXPECT_EQ(merge_fsdp_weights(model_dir, root + "/out").tensors, static_cast<int64_t>(original["tensors"].size()));
}

// A dtype no writer produces in metadata.json used to be reported as the rank file holding "F32 of
// another shape" (issue Reliability); it is named as the dtype it is, and a real mismatch names both.
TEST(Merge, AnUnknownDtypeInTheMetadataIsNamedAsSuch) {
  const auto root = testing::shared_temporary_directory();
  save_sharded_checkpoint(root, 2, Layout::kRankFiles);
  if (testing::is_rank_process()) return;
  const auto model_dir = root + "/checkpoint/pytorch_model_fsdp_0";
  const auto metadata_path = model_dir + "/metadata.json";
  nlohmann::json original;
  std::ifstream(metadata_path) >> original;
  auto changed = original;
  const auto name = changed["tensors"][0]["name"].get<std::string>();
  changed["tensors"][0]["dtype"] = "Q4";
  std::ofstream(metadata_path) << changed.dump();
  auto message = testing::error_message_of([&] { merge_fsdp_weights(model_dir, root + "/out"); });
  EXPECT_NE(message.find("tensor '" + name + "' has dtype 'Q4', which is not a dtype fsdp.cpp writes"),
            std::string::npos)
      << message;
  EXPECT_EQ(message.find("of another shape"), std::string::npos) << message;
  changed["tensors"][0]["dtype"] = "F16";
  std::ofstream(metadata_path) << changed.dump();
  message = testing::error_message_of([&] { merge_fsdp_weights(model_dir, root + "/out"); });
  EXPECT_NE(message.find("holds '" + name + "' as F32 ["), std::string::npos) << message;
  EXPECT_NE(message.find("but metadata.json says F16 ["), std::string::npos) << message;
  std::ofstream(metadata_path) << original.dump();
  EXPECT_EQ(merge_fsdp_weights(model_dir, root + "/out").tensors, static_cast<int64_t>(original["tensors"].size()));
}

// A FIFO in place of a rank file or a config file used to block the reader forever (issue
// Reliability): only regular files are read.
TEST(Merge, AFifoInPlaceOfAFileIsAnErrorNotAHang) {
  const auto root = testing::shared_temporary_directory();
  save_sharded_checkpoint(root, 2, Layout::kRankFiles);
  save_sharded_checkpoint(root + "/dcp", 2);
  if (testing::is_rank_process()) return;
  const auto model_dir = root + "/checkpoint/pytorch_model_fsdp_0";
  const auto rank_file = model_dir + "/rank_00001.safetensors";
  fs::rename(rank_file, rank_file + ".away");
  ASSERT_EQ(::mkfifo(rank_file.c_str(), 0600), 0);
  auto message = testing::error_message_of([&] { merge_fsdp_weights(model_dir, root + "/out"); });
  EXPECT_NE(message.find("rank_00001.safetensors' is not a regular file"), std::string::npos) << message;
  fs::remove(rank_file);
  fs::rename(rank_file + ".away", rank_file);
  // The same in a DCP directory.
  const auto dcp_dir = root + "/dcp/checkpoint/pytorch_model_fsdp_0";
  const auto dcp_file = dcp_dir + "/__1_0.distcp";
  fs::remove(dcp_file);
  ASSERT_EQ(::mkfifo(dcp_file.c_str(), 0600), 0);
  message = testing::error_message_of([&] { merge_fsdp_weights(dcp_dir, root + "/out_dcp"); });
  EXPECT_NE(message.find("lacks '__1_0.distcp', which its .metadata names for"), std::string::npos) << message;
  EXPECT_NE(message.find("(or it is not a regular file)"), std::string::npos) << message;
  fs::remove(dcp_file);
  const auto config = root + "/accelerate.yaml";
  ASSERT_EQ(::mkfifo(config.c_str(), 0600), 0);
  message = testing::error_message_of([&] { load_accelerate_config(config); });
  EXPECT_NE(message.find("accelerate.yaml' is not a regular file"), std::string::npos) << message;
  fs::remove(config);
}

// Accelerate's checkpoints under FSDP2 are DCP directories (tests/python/dcp_fixture.py saves them as
// Accelerate does, on 2 and 3 ranks, uneven shards and an empty chunk included): merge_fsdp_weights
// writes what accelerate.utils.merge_fsdp_weights writes from the same directory, compared in
// Python (tests/python/accelerate_merge.py): the same keys with the single top-level "model" key
// stripped, bitwise the same tensors, {"format": "pt"}, for both serializations (and for
// safetensors, the same file byte for byte).
class MergeDcp : public ::testing::TestWithParam<int> {};

TEST_P(MergeDcp, OutputEqualsAcceleratesMergeFsdpWeights) {
  const auto root = testing::shared_temporary_directory();
  testing::PythonOptions options;
  options.world_size = GetParam();
  ASSERT_TRUE(testing::run_python("dcp_fixture.py", {root}, options).ok);
  const auto model_dir = root + "/pytorch_model_fsdp_0";
  ASSERT_TRUE(testing::run_python("accelerate_merge.py", {"merge", model_dir, root + "/theirs"}).ok);
  const auto safe = merge_fsdp_weights(model_dir, root + "/ours_safe");
  EXPECT_EQ(safe.tensors, 7);
  MergeOptions unsafe;
  unsafe.safe_serialization = false;
  merge_fsdp_weights(model_dir, root + "/ours_bin", unsafe);
  auto compared = testing::run_python("accelerate_merge.py", {"compare", root + "/ours_safe/model.safetensors",
                                                              root + "/theirs/safe/model.safetensors"});
  ASSERT_TRUE(compared.ok);
  EXPECT_NE(compared.output[0].find("7 tensors equal; files byte for byte the same"), std::string::npos)
      << compared.output[0];
  ASSERT_TRUE(testing::run_python("accelerate_merge.py", {"compare", root + "/ours_bin/pytorch_model.bin",
                                                          root + "/theirs/bin/pytorch_model.bin"})
                  .ok);
  // And both equal PyTorch's own full state dict of the trained model.
  SafetensorsReader merged(root + "/ours_safe/model.safetensors");
  for (const auto& [name, tensor] : read_safetensors(root + "/full_model.safetensors")) {
    EXPECT_TRUE(torch::equal(merged.tensor(name), tensor)) << name;
  }
  // The optimizer directory merges into the full optimizer state: the same tensors and parameter
  // groups as Accelerate's merge of it (torch.save output), read back by torch.
  merge_fsdp_weights(root + "/optimizer_0", root + "/ours_optimizer", unsafe);
  ASSERT_TRUE(testing::run_python("accelerate_merge.py",
                                  {"merge", root + "/optimizer_0", root + "/theirs_optimizer", "--unsafe-only"})
                  .ok);
  const auto optimizer = testing::run_python_code(
      "import torch\n"
      "ours = torch.load('" +
      root +
      "/ours_optimizer/optimizer.bin', weights_only=True)\n"
      "theirs = torch.load('" +
      root +
      "/theirs_optimizer/bin/pytorch_model.bin', weights_only=True)\n"
      "assert ours['optimizer'] == 'AdamW', ours['optimizer']\n"
      "assert ours['state'].keys() == theirs['state'].keys(), (ours['state'].keys(), theirs['state'].keys())\n"
      "count = 0\n"
      "for name, fields in theirs['state'].items():\n"
      "    assert fields.keys() == ours['state'][name].keys(), name\n"
      "    for field, tensor in fields.items():\n"
      "        assert torch.equal(tensor, ours['state'][name][field]), (name, field)\n"
      "        count += 1\n"
      "assert ours['param_groups'] == theirs['param_groups'], (ours['param_groups'], theirs['param_groups'])\n"
      "print('optimizer', count, 'tensors equal')\n");
  ASSERT_TRUE(optimizer.ok);
  EXPECT_NE(optimizer.output.at(0).find("optimizer 21 tensors equal"), std::string::npos) << optimizer.output.at(0);
}

INSTANTIATE_TEST_SUITE_P(Ranks, MergeDcp, ::testing::Values(2, 3), [](const ::testing::TestParamInfo<int>& info) {
  return std::to_string(info.param) + "ranks";
});

// A DCP directory whose data file was cut short or replaced: a named error, and nothing removed.
TEST(MergeDcpDamaged, ATruncatedOrMissingDataFileIsNamedAndTheInputStays) {
  const auto root = testing::shared_temporary_directory();
  testing::PythonOptions options;
  options.world_size = 2;
  ASSERT_TRUE(testing::run_python("dcp_fixture.py", {root}, options).ok);
  const auto model_dir = root + "/pytorch_model_fsdp_0";
  const auto data = model_dir + "/__1_0.distcp";
  const auto size = fs::file_size(data);
  fs::resize_file(data, size / 2);
  MergeOptions remove;
  remove.remove_checkpoint_dir = true;
  auto message = testing::error_message_of([&] { merge_fsdp_weights(model_dir, root + "/out", remove); });
  EXPECT_NE(message.find("__1_0.distcp' bytes "), std::string::npos) << message;
  EXPECT_NE(message.find("runs past the end of the file"), std::string::npos) << message;
  EXPECT_TRUE(fs::exists(model_dir + "/.metadata")) << "a failed merge never deletes its input";
  EXPECT_FALSE(fs::exists(root + "/out/model.safetensors"));
  fs::remove(data);
  fs::create_directory(data);  // a directory where the data file should be
  message = testing::error_message_of([&] { merge_fsdp_weights(model_dir, root + "/out", remove); });
  EXPECT_NE(message.find("lacks '__1_0.distcp', which its .metadata names for 'model."), std::string::npos) << message;
  EXPECT_NE(message.find("(or it is not a regular file)"), std::string::npos) << message;
  EXPECT_TRUE(fs::exists(model_dir));
}

}  // namespace
}  // namespace fsdp
