// Checkpoints: every layout round-trips model, optimizer and progress; SHARDED checkpoints load on
// another number of ranks; a resumed run continues bit for bit; broken directories are named errors.
#include <fsdp/fsdp.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "checkpoint/dcp_metadata.h"
#include "harness/error_message.h"
#include "harness/multi_rank.h"
#include "harness/parity.h"
#include "harness/python_peer.h"
#include "harness/test_models.h"

namespace fsdp {
namespace {

// Progress after two steps of 12 samples (field by field: not_restored is load_checkpoint's).
TrainingProgress two_steps() {
  TrainingProgress progress;
  progress.step = 2;
  progress.data_position = 24;
  return progress;
}

namespace fs = std::filesystem;
using testing::adamw_options;
using testing::expect_bitwise_equal;
using testing::local_slice;
using testing::next_token_loss;
using testing::token_batch;
using testing::unique_parameters;

constexpr int64_t kBatch = 12;

/// A sharded tiny transformer (tied embeddings, layer norms) with its optimizer.
struct Trainer {
  testing::TinyTransformer model{nullptr};
  std::unique_ptr<torch::optim::AdamW> optimizer;

  Trainer(const DistributedContext& context, uint64_t seed, int64_t vocabulary = 11) {
    torch::manual_seed(seed);
    model = testing::TinyTransformer(true, vocabulary);
    for (auto& layer : model->layers) fully_shard(layer.ptr(), context);
    FullyShardOptions tail;
    tail.reshard_after_forward = false;
    fully_shard({model->norm.ptr(), model->embed_tokens.ptr()}, context, tail);
    fully_shard(model.ptr(), context);
    optimizer = std::make_unique<torch::optim::AdamW>(unique_parameters(*model), adamw_options());
  }
  void train(const DistributedContext& context, int first_step, int steps) {
    for (int step = first_step; step < first_step + steps; ++step) {
      auto [inputs, targets] = token_batch(4000 + step, kBatch);
      next_token_loss(fsdp::forward(model, local_slice(inputs, context)), local_slice(targets, context)).backward();
      optimizer->step();
      optimizer->zero_grad();
    }
  }
};

/// Single-process training of the same model for `steps` steps.
std::map<std::string, torch::Tensor> reference_after(uint64_t seed, int steps) {
  torch::manual_seed(seed);
  testing::TinyTransformer model;
  torch::optim::AdamW optimizer(unique_parameters(*model), adamw_options());
  for (int step = 0; step < steps; ++step) {
    auto [inputs, targets] = token_batch(4000 + step, kBatch);
    next_token_loss(model->forward(inputs), targets).backward();
    optimizer.step();
    optimizer.zero_grad();
  }
  return testing::named_copies(*model);
}

struct RoundTripCase {
  StateDictType type;
  int world_size;
};

class CheckpointRoundTrip : public ::testing::TestWithParam<RoundTripCase> {};

TEST_P(CheckpointRoundTrip, ResumedTrainingContinuesBitForBit) {
  const auto type = GetParam().type;
  const auto directory = testing::shared_temporary_directory();
  testing::run_on_ranks(GetParam().world_size, [type, directory](const DistributedContext& context) {
    Trainer original(context, 11);
    original.train(context, 0, 2);
    TrainingProgress progress;
    progress.step = 2;
    progress.data_position = 24;
    progress.scheduler = {{"last_epoch", 2}, {"base_lr", 0.01}};
    CheckpointOptions options;
    options.state_dict_type = type;
    save_checkpoint(directory, *original.model, *original.optimizer, context, progress, options);
    ASSERT_TRUE(is_complete_checkpoint(directory));

    Trainer resumed(context, 99);  // other initial weights: everything must come from the files
    resumed.train(context, 0, 1);  // and other optimizer state
    const auto loaded = load_checkpoint(directory, *resumed.model, *resumed.optimizer, context);
    EXPECT_EQ(loaded.step, 2);
    EXPECT_EQ(loaded.data_position, 24);
    EXPECT_EQ(loaded.scheduler, progress.scheduler);
    expect_bitwise_equal(*resumed.model, *original.model, "after loading");
    original.train(context, 2, 2);
    resumed.train(context, 2, 2);
    expect_bitwise_equal(*resumed.model, *original.model, "two steps after loading");
  });
}

// FULL_STATE_DICT saved with rank0_only (Accelerate's FULL default: only rank 0 gathers) and
// without it (every rank gathers): the same files, byte for byte.
TEST(Checkpoint, FullCheckpointsSavedWithAndWithoutRank0OnlyAreTheSameFiles) {
  const auto directory = testing::shared_temporary_directory();
  testing::run_on_ranks(2, [directory](const DistributedContext& context) {
    Trainer original(context, 11);
    original.train(context, 0, 2);
    for (const bool rank0_only : {true, false}) {
      CheckpointOptions options;
      options.state_dict_type = StateDictType::kFullStateDict;
      options.state_dict_config.rank0_only = rank0_only;
      options.optim_state_dict_config.rank0_only = rank0_only;
      save_checkpoint(directory + (rank0_only ? "/rank0_only" : "/every_rank"), *original.model, *original.optimizer,
                      context, TrainingProgress{}, options);
    }
    if (context.rank() != 0) return;
    for (const auto* file : {"pytorch_model_fsdp.bin", "optimizer.bin"}) {
      const auto read = [&](const std::string& path) {
        std::ifstream stream(path, std::ios::binary);
        return std::string(std::istreambuf_iterator<char>(stream), {});
      };
      const auto one = read(directory + "/rank0_only/" + file), every = read(directory + "/every_rank/" + file);
      EXPECT_FALSE(one.empty()) << file;
      EXPECT_EQ(one, every) << file << " differs with and without rank0_only";
    }
  });
}

INSTANTIATE_TEST_SUITE_P(Layouts, CheckpointRoundTrip,
                         ::testing::Values(RoundTripCase{StateDictType::kShardedStateDict, 1},
                                           RoundTripCase{StateDictType::kShardedStateDict, 2},
                                           RoundTripCase{StateDictType::kShardedStateDict, 3},
                                           RoundTripCase{StateDictType::kShardedStateDict, 4},
                                           RoundTripCase{StateDictType::kFullStateDict, 1},
                                           RoundTripCase{StateDictType::kFullStateDict, 2},
                                           RoundTripCase{StateDictType::kFullStateDict, 3},
                                           RoundTripCase{StateDictType::kFullStateDict, 4},
                                           RoundTripCase{StateDictType::kLocalStateDict, 2},
                                           RoundTripCase{StateDictType::kLocalStateDict, 3}),
                         [](const ::testing::TestParamInfo<RoundTripCase>& info) {
                           std::string name = to_string(info.param.type);
                           name.erase(std::remove(name.begin(), name.end(), '_'), name.end());
                           return name + "_" + std::to_string(info.param.world_size) + "ranks";
                         });

struct ReshardCase {
  int saved_on;
  int loaded_on;
};

class CheckpointReshard : public ::testing::TestWithParam<ReshardCase> {};

TEST_P(CheckpointReshard, ShardedCheckpointContinuesOnAnotherNumberOfRanks) {
  const auto directory = testing::shared_temporary_directory();
  testing::run_on_ranks(GetParam().saved_on, [directory](const DistributedContext& context) {
    Trainer trainer(context, 12);
    trainer.train(context, 0, 2);
    save_checkpoint(directory, *trainer.model, *trainer.optimizer, context, two_steps());
  });
  testing::run_on_ranks(GetParam().loaded_on, [directory](const DistributedContext& context) {
    Trainer trainer(context, 77);
    const auto progress = load_checkpoint(directory, *trainer.model, *trainer.optimizer, context);
    EXPECT_EQ(progress.step, 2);
    trainer.train(context, 2, 2);
    // Two steps on the saved ranks and two on these equal four single-process steps.
    const auto expected = reference_after(12, 4);
    const auto actual = testing::full_parameters(*trainer.model);
    for (const auto& [name, tensor] : expected) {
      EXPECT_TRUE(testing::tensors_close(actual.at(name), tensor)) << name;
    }
  });
}

INSTANTIATE_TEST_SUITE_P(WorldSizes, CheckpointReshard,
                         ::testing::Values(ReshardCase{2, 3}, ReshardCase{3, 2}, ReshardCase{4, 1}, ReshardCase{1, 4}),
                         [](const ::testing::TestParamInfo<ReshardCase>& info) {
                           return "From" + std::to_string(info.param.saved_on) + "To" +
                                  std::to_string(info.param.loaded_on);
                         });

TEST(Checkpoint, HybridShardCheckpointsSaveOneCopyAndLoadBack) {
  const auto directory = testing::shared_temporary_directory();
  const auto options = testing::simulated_machines(2);
  testing::run_on_ranks(
      4,
      [directory](const DistributedContext& context) {
        auto make = [&](uint64_t seed) {
          torch::manual_seed(seed);
          auto model = testing::MlpStack();
          FullyShardOptions hybrid;
          hybrid.sharding_strategy = ShardingStrategy::kHybridShard;
          for (auto& block : model->blocks) fully_shard(block.ptr(), context, hybrid);
          fully_shard(model.ptr(), context, hybrid);
          return model;
        };
        auto original = make(21);
        torch::optim::AdamW optimizer(unique_parameters(*original), adamw_options());
        auto train = [&](testing::MlpStack& model, torch::optim::AdamW& opt, int step) {
          torch::manual_seed(5000 + step);
          auto inputs = torch::randn({kBatch, 3}), targets = torch::randn({kBatch, 2});
          torch::mse_loss(fsdp::forward(model, local_slice(inputs, context)), local_slice(targets, context)).backward();
          opt.step();
          opt.zero_grad();
        };
        train(original, optimizer, 0);
        save_checkpoint(directory, *original, optimizer, context, {});
        // One copy: the second machine's ranks (2, 3) hold the shards the first machine's hold and
        // write none of them; each tensor's chunks cover its rows exactly once.
        if (context.rank() == 0) {
          for (const auto* part : {"pytorch_model_fsdp_0", "optimizer_0"}) {
            const auto metadata = detail::read_dcp_metadata(directory + "/" + part);
            EXPECT_FALSE(metadata.tensors.empty()) << part;
            for (const auto& [key, tensor] : metadata.tensors) {
              int64_t rows = 0;
              for (const auto& chunk : tensor.chunks) {
                const auto& file = chunk.storage.relative_path;
                EXPECT_TRUE(file != "__2_0.distcp" && file != "__3_0.distcp") << part << " " << key << " in " << file;
                if (!tensor.size.empty()) rows += chunk.sizes.at(0);
              }
              if (!tensor.size.empty()) {
                EXPECT_EQ(rows, tensor.size[0]) << part << " " << key;
              }
            }
          }
        }
        auto resumed = make(22);
        torch::optim::AdamW resumed_optimizer(unique_parameters(*resumed), adamw_options());
        load_checkpoint(directory, *resumed, resumed_optimizer, context);
        train(original, optimizer, 1);
        train(resumed, resumed_optimizer, 1);
        expect_bitwise_equal(*resumed, *original, "hybrid shard");
      },
      options);
}

TEST(Checkpoint, ScalarParametersKeepTheirOptimizerStateAcrossWorldSizes) {
  const auto directory = testing::shared_temporary_directory();
  auto step = [](testing::MlpStack& model, torch::optim::AdamW& optimizer, const DistributedContext& context,
                 int index) {
    torch::manual_seed(6000 + index);
    auto inputs = torch::randn({kBatch, 3}), targets = torch::randn({kBatch, 2});
    torch::mse_loss(fsdp::forward(model, local_slice(inputs, context)), local_slice(targets, context)).backward();
    optimizer.step();
    optimizer.zero_grad();
  };
  testing::run_on_ranks(3, [directory, step](const DistributedContext& context) {
    torch::manual_seed(23);
    testing::MlpStack model;  // has a 0-dim temperature, sharded as one row owned by rank 0
    for (auto& block : model->blocks) fully_shard(block.ptr(), context);
    fully_shard(model.ptr(), context);
    torch::optim::AdamW optimizer(unique_parameters(*model), adamw_options());
    step(model, optimizer, context, 0);
    save_checkpoint(directory, *model, optimizer, context, {});
  });
  testing::run_on_ranks(2, [directory, step](const DistributedContext& context) {
    torch::manual_seed(24);
    testing::MlpStack model;
    for (auto& block : model->blocks) fully_shard(block.ptr(), context);
    fully_shard(model.ptr(), context);
    torch::optim::AdamW optimizer(unique_parameters(*model), adamw_options());
    load_checkpoint(directory, *model, optimizer, context);
    auto& state =
        static_cast<torch::optim::AdamWParamState&>(*optimizer.state().at(optimizer_state_key(model->temperature)));
    EXPECT_EQ(state.exp_avg().sizes(), model->temperature.sizes());
    step(model, optimizer, context, 1);  // a wrong state shape fails here
  });
}

// libtorch's module->parameters() lists a tied weight once for each module holding it; an
// optimizer built from that steps it twice and would save its state twice, a checkpoint no loader
// takes ("chunks covering 2 of its 1 elements", found by step_bench). The save refuses it, naming
// the weight, and writes no checkpoint.
TEST(Checkpoint, AnOptimizerHoldingATiedWeightTwiceIsRefusedNamingIt) {
  const auto directory = testing::shared_temporary_directory();
  testing::run_on_ranks(2, [directory](const DistributedContext& context) {
    Trainer trainer(context, 13);
    ASSERT_GT(trainer.model->parameters().size(), unique_parameters(*trainer.model).size()) << "the model must be tied";
    trainer.optimizer = std::make_unique<torch::optim::AdamW>(trainer.model->parameters(), adamw_options());
    trainer.train(context, 0, 1);
    const auto message =
        testing::error_message_of([&] { save_checkpoint(directory, *trainer.model, *trainer.optimizer, context, {}); });
    EXPECT_NE(message.find("the optimizer holds 'embed_tokens.weight' more than once"), std::string::npos) << message;
    EXPECT_NE(message.find("Build the optimizer from each parameter once"), std::string::npos) << message;
    EXPECT_FALSE(is_complete_checkpoint(directory));
  });
}

// What a user resuming gets wrong first: no checkpoint yet (latest_checkpoint() is ""), a directory
// that is not there, one whose save did not finish. Each error says what was found and offers the
// complete checkpoints beside it.
TEST(Checkpoint, NoCheckpointYetAMissingOneAndAnIncompleteOneOfferTheCompleteOnes) {
  const auto project = testing::shared_temporary_directory();
  testing::run_on_ranks(2, [project](const DistributedContext& context) {
    Trainer trainer(context, 13);
    trainer.train(context, 0, 1);
    auto load_error = [&](const std::string& directory) {
      return testing::error_message_of(
          [&] { load_checkpoint(directory, *trainer.model, *trainer.optimizer, context); });
    };
    auto message = load_error("");
    EXPECT_NE(message.find("the checkpoint directory is \"\""), std::string::npos) << message;
    EXPECT_NE(message.find("latest_checkpoint() returns that when no complete checkpoint exists yet"),
              std::string::npos)
        << message;
    const auto checkpoints = fs::path(project) / "checkpoints";
    const auto complete = (checkpoints / "checkpoint_0").string(), incomplete = (checkpoints / "checkpoint_1").string();
    message = load_error((checkpoints / "checkpoint_7").string());
    EXPECT_NE(message.find("checkpoint_7' does not exist. '" + checkpoints.string() + "' does not exist either."),
              std::string::npos)
        << message;
    save_checkpoint(complete, *trainer.model, *trainer.optimizer, context, {});
    save_checkpoint(incomplete, *trainer.model, *trainer.optimizer, context, {});
    barrier(context.world());
    if (context.rank() == 0) fs::remove(fs::path(incomplete) / "checkpoint_complete.json");
    barrier(context.world());
    message = load_error((checkpoints / "checkpoint_7").string());
    EXPECT_NE(message.find("checkpoint_7' does not exist. Complete checkpoints beside it: '" + complete + "' ("),
              std::string::npos)
        << message;
    EXPECT_EQ(message.find(incomplete), std::string::npos) << "an incomplete one is not offered: " << message;
    message = load_error(incomplete);
    EXPECT_NE(message.find("is incomplete: checkpoint_complete.json is missing"), std::string::npos) << message;
    EXPECT_NE(message.find("Complete checkpoints beside it: '" + complete + "'"), std::string::npos) << message;
  });
}

TEST(Checkpoint, BrokenDirectoriesAreNamedErrors) {
  const auto directory = testing::shared_temporary_directory();
  testing::run_on_ranks(2, [directory](const DistributedContext& context) {
    Trainer trainer(context, 13);
    trainer.train(context, 0, 1);
    save_checkpoint(directory, *trainer.model, *trainer.optimizer, context, {});
    auto expect_load_error = [&](const std::string& expected) {
      const auto message =
          testing::error_message_of([&] { load_checkpoint(directory, *trainer.model, *trainer.optimizer, context); });
      EXPECT_NE(message.find(expected), std::string::npos) << "expected '" << expected << "' in: " << message;
    };
    const auto marker = (fs::path(directory) / "checkpoint_complete.json").string();
    const auto rank_file = (fs::path(directory) / "pytorch_model_fsdp_0" / "__1_0.distcp").string();
    barrier(context.world());
    if (context.rank() == 0) fs::rename(marker, marker + ".away");
    barrier(context.world());
    expect_load_error("is incomplete: checkpoint_complete.json is missing");
    barrier(context.world());
    if (context.rank() == 0) {
      fs::rename(marker + ".away", marker);
      fs::rename(rank_file, rank_file + ".away");
    }
    barrier(context.world());
    expect_load_error("lacks '__1_0.distcp', which its .metadata names for 'model.");
    barrier(context.world());
    if (context.rank() == 0) fs::rename(rank_file + ".away", rank_file);
    barrier(context.world());
    // A damaged marker: a negative step (issue Reliability: it used to resume at step -5).
    std::string saved_marker;
    {
      std::ifstream file(marker);
      saved_marker.assign(std::istreambuf_iterator<char>(file), std::istreambuf_iterator<char>());
    }
    barrier(context.world());
    if (context.rank() == 0) {
      auto changed = nlohmann::json::parse(saved_marker);
      changed["step"] = -5;
      std::ofstream(marker) << changed.dump();
    }
    barrier(context.world());
    expect_load_error("says step -5 and world_size 2; a checkpoint has a step of 0 or more");
    barrier(context.world());
    if (context.rank() == 0) std::ofstream(marker) << saved_marker;
    barrier(context.world());

    Trainer bigger_vocabulary(context, 13, 13);
    const auto message = testing::error_message_of(
        [&] { load_checkpoint(directory, *bigger_vocabulary.model, *bigger_vocabulary.optimizer, context); });
    EXPECT_NE(message.find("has shape [11, 6] but the model's 'embed_tokens.weight' has shape [13, 6]"),
              std::string::npos)
        << message;
  });
}

// Note [save identity]: files of another save, or of another rank, are named errors instead of
// loading with other numbers (issue Reliability: swapped rank files and a rank file taken from
// another save with the same shapes resumed and merged with exit 0).
TEST(Checkpoint, FilesOfAnotherSaveOrAnotherRankAreNamedErrors) {
  const auto root = testing::shared_temporary_directory();
  const auto earlier = (fs::path(root) / "earlier").string();
  const auto directory = (fs::path(root) / "later").string();
  testing::run_on_ranks(2, [root, earlier, directory](const DistributedContext& context) {
    Trainer trainer(context, 17);
    trainer.train(context, 0, 1);
    save_checkpoint(earlier, *trainer.model, *trainer.optimizer, context, {});
    trainer.train(context, 1, 1);
    save_checkpoint(directory, *trainer.model, *trainer.optimizer, context, {});
    const auto expected_weights = testing::full_parameters(*trainer.model);
    auto load_error = [&] {
      return testing::error_message_of(
          [&] { load_checkpoint(directory, *trainer.model, *trainer.optimizer, context); });
    };
    auto in = [](const std::string& root, const std::string& name) { return (fs::path(root) / name).string(); };
    const auto model_0 = in(directory, "pytorch_model_fsdp_0/__0_0.distcp");
    const auto model_1 = in(directory, "pytorch_model_fsdp_0/__1_0.distcp");
    // Each case changes the directory on rank 0, expects the error on every rank, and puts it back.
    auto expect = [&](const std::function<void()>& change, const std::function<void()>& restore,
                      const std::vector<std::string>& expected, bool model_files = true) {
      barrier(context.world());
      if (context.rank() == 0) change();
      barrier(context.world());
      const auto message = load_error();
      for (const auto& part : expected)
        EXPECT_NE(message.find(part), std::string::npos) << part << " not in: " << message;
      if (context.rank() == 0) {
        // merge-weights reads the same files and refuses them the same way, writing nothing.
        const auto merged = in(root, "merged");
        const auto merge_message =
            testing::error_message_of([&] { merge_fsdp_weights(in(directory, "pytorch_model_fsdp_0"), merged); });
        if (model_files) {
          EXPECT_NE(merge_message.find(expected.back()), std::string::npos) << merge_message;
          EXPECT_FALSE(fs::exists(fs::path(merged) / "model.safetensors"));
        }
        fs::remove_all(merged);
      }
      barrier(context.world());
      if (context.rank() == 0) restore();
      barrier(context.world());
    };
    auto swap = [](const std::string& a, const std::string& b) {
      fs::rename(a, a + ".swap");
      fs::rename(b, a);
      fs::rename(a + ".swap", b);
    };
    auto keep = [](const std::string& path) {
      fs::copy_file(path, path + ".kept", fs::copy_options::overwrite_existing);
    };
    auto put_back = [](const std::string& path) { fs::rename(path + ".kept", path); };

    expect(
        [&] { swap(model_0, model_1); }, [&] { swap(model_0, model_1); },
        {"pytorch_model_fsdp_0/__0_0.distcp' was written by rank 1 of 2 as '__1_0.distcp': rank files were swapped"});
    expect(
        [&] {
          keep(model_1);
          fs::copy_file(in(earlier, "pytorch_model_fsdp_0/__1_0.distcp"), model_1,
                        fs::copy_options::overwrite_existing);
        },
        [&] { put_back(model_1); }, {"__1_0.distcp' belongs to save ", "copied from another checkpoint"});
    const auto optimizer_metadata = in(directory, "optimizer_0/.metadata");
    expect(
        [&] {
          keep(optimizer_metadata);
          fs::copy_file(in(earlier, "optimizer_0/.metadata"), optimizer_metadata, fs::copy_options::overwrite_existing);
        },
        [&] { put_back(optimizer_metadata); },
        {"optimizer_0/.metadata' describes save ", "copied from another checkpoint"}, false);
    expect(
        [&] {
          fs::rename(in(directory, "optimizer_0"), in(directory, "optimizer_0.kept"));
          fs::copy(in(earlier, "optimizer_0"), in(directory, "optimizer_0"));
        },
        [&] {
          fs::remove_all(in(directory, "optimizer_0"));
          fs::rename(in(directory, "optimizer_0.kept"), in(directory, "optimizer_0"));
        },
        {"optimizer_0' belongs to save ", "checkpoint_complete.json' records save ",
         "the directory was copied from another checkpoint"},
        false);
    // A file without the footer (as PyTorch writes them) among fsdp.cpp's.
    expect(
        [&] {
          keep(model_1);
          std::ifstream file(model_1, std::ios::binary);
          std::string bytes((std::istreambuf_iterator<char>(file)), std::istreambuf_iterator<char>());
          const auto footer = bytes.rfind('{');
          ASSERT_NE(footer, std::string::npos);
          std::ofstream(model_1, std::ios::binary | std::ios::trunc) << bytes.substr(0, footer);
        },
        [&] { put_back(model_1); }, {"__1_0.distcp' carries no save identity, but"});
    // A .metadata of this save that lists fewer entries than the save wrote (the marker counts them).
    const auto marker = in(directory, "checkpoint_complete.json");
    expect(
        [&] {
          keep(marker);
          nlohmann::json changed;
          std::ifstream(marker) >> changed;
          changed["entries"]["optimizer_0"] = changed["entries"]["optimizer_0"].get<int64_t>() + 1;
          std::ofstream(marker) << changed.dump();
        },
        [&] { put_back(marker); }, {"optimizer_0' lists ", "entries in its .metadata, but the save wrote "}, false);
    const auto states_0 = in(directory, "random_states_0.pkl");
    const auto states_1 = in(directory, "random_states_1.pkl");
    expect([&] { swap(states_0, states_1); }, [&] { swap(states_0, states_1); },
           {"random-state files were swapped or renamed"}, false);

    // Put back, the checkpoint loads again and holds the later weights.
    Trainer fresh(context, 99);
    load_checkpoint(directory, *fresh.model, *fresh.optimizer, context);
    const auto loaded = testing::full_parameters(*fresh.model);
    ASSERT_EQ(loaded.size(), expected_weights.size());
    for (const auto& [name, tensor] : expected_weights) EXPECT_TRUE(torch::equal(loaded.at(name), tensor)) << name;
  });
}

TEST(Checkpoint, ARankThatDoesNotSaveIsReportedNotAHang) {
  const auto directory = testing::shared_temporary_directory();
  testing::MultiRankOptions options;
  options.collective_timeout = std::chrono::seconds(5);
  testing::run_on_ranks(
      2,
      [directory](const DistributedContext& context) {
        Trainer trainer(context, 14);
        if (context.rank() == 1) return;  // "if (is_main_process) save" — the classic mistake
        const auto message = testing::error_message_of(
            [&] { save_checkpoint(directory, *trainer.model, *trainer.optimizer, context, {}); });
        EXPECT_NE(message.find("not every rank joined"), std::string::npos) << message;
        EXPECT_FALSE(is_complete_checkpoint(directory));
      },
      options);
}

// Note [metadata pieces]: a SHARDED save issues five collectives and a load three, on 2 ranks as on
// 4 (bench/checkpoint_scale.sh measures them to 32), and the save leaves no metadata pieces behind.
TEST(Checkpoint, AShardedSaveAndLoadIssueTheSameCollectivesWhateverTheRanks) {
  for (const int world_size : {2, 4}) {
    const auto directory = testing::shared_temporary_directory();
    testing::run_on_ranks(world_size, [directory, world_size](const DistributedContext& context) {
      Trainer trainer(context, 15);
      trainer.train(context, 0, 1);
      auto counted = [&](const std::function<void()>& work) {
        context.world().start_trace();
        context.control().start_trace();
        work();
        return context.world().stop_trace().size() + context.control().stop_trace().size();
      };
      // Twice into the same directory: the second clears what the first left while the ranks
      // create the directories again.
      for (int time = 0; time < 2; ++time) {
        const auto save = counted([&] { save_checkpoint(directory, *trainer.model, *trainer.optimizer, context, {}); });
        EXPECT_EQ(save, 5u) << "a save on " << world_size << " ranks";
        EXPECT_TRUE(is_complete_checkpoint(directory));
        for (const auto* name : {"pytorch_model_fsdp_0", "optimizer_0"}) {
          EXPECT_FALSE(fs::exists(directory + "/" + name + "/.metadata.pieces")) << name;
        }
        barrier(context.world());  // the next save's rank 0 removes the marker first
      }
      const auto load = counted([&] { load_checkpoint(directory, *trainer.model, *trainer.optimizer, context); });
      EXPECT_EQ(load, 3u) << "a load on " << world_size << " ranks";
    });
  }
}

// FULL loads follow the state dict configs: with rank0_only (Accelerate's FULL default) rank 0 alone
// reads pytorch_model_fsdp.bin and optimizer.bin and every tensor reaches the others by broadcast on
// the world group; without it every rank reads both files and nothing crosses the world group. Both
// resume bit for bit.
TEST(Checkpoint, FullLoadReadsTheFilesOnRankZeroOnlyWithRank0Only) {
  const auto directory = testing::shared_temporary_directory();
  testing::run_on_ranks(3, [directory](const DistributedContext& context) {
    Trainer original(context, 11);
    original.train(context, 0, 2);
    CheckpointOptions options;
    options.state_dict_type = StateDictType::kFullStateDict;
    save_checkpoint(directory, *original.model, *original.optimizer, context, TrainingProgress{}, options);
    int64_t state_bytes = 0;
    for (const auto& [name, tensor] : testing::full_parameters(*original.model)) state_bytes += 3 * tensor.numel() * 4;
    for (const bool rank0_only : {true, false}) {
      Trainer resumed(context, 99);
      resumed.train(context, 0, 1);
      options.state_dict_config.rank0_only = rank0_only;
      options.optim_state_dict_config.rank0_only = rank0_only;
      context.world().reset_bytes_sent();
      load_checkpoint(directory, *resumed.model, *resumed.optimizer, context, options);
      const int64_t broadcast = context.world().bytes_sent().broadcast;
      if (rank0_only) {
        // Rank 0 sent the weights, exp_avg and exp_avg_sq of every parameter (and the steps); the
        // others only receive, which the counter of bytes sent does not count.
        if (context.rank() == 0) {
          EXPECT_GE(broadcast, state_bytes);
        } else {
          EXPECT_EQ(broadcast, 0);
        }
      } else {
        EXPECT_EQ(broadcast, 0);
      }
      expect_bitwise_equal(*resumed.model, *original.model, rank0_only ? "rank0_only" : "every rank reads");
      Trainer continued(context, 11);
      continued.train(context, 0, 2);
      continued.train(context, 2, 2);
      resumed.train(context, 2, 2);
      expect_bitwise_equal(*resumed.model, *continued.model,
                           rank0_only ? "rank0_only, trained on" : "every rank, trained on");
    }
  });
}

TEST(Checkpoint, FullStateDictLoadsIntoAModelWithoutParameterMemory) {
  testing::run_on_ranks(3, [](const DistributedContext& context) {
    torch::manual_seed(15);
    testing::TinyTransformer source_model;
    const auto expected = testing::named_copies(*source_model);
    TensorList full_state;
    if (context.rank() == 0) {
      for (const auto& item : source_model->named_parameters())
        full_state.emplace_back(item.key(), item.value().detach());
    }
    torch::manual_seed(16);
    testing::TinyTransformer model;
    release_parameter_storage(*model);
    for (const auto& parameter : model->parameters()) ASSERT_EQ(parameter.storage().nbytes(), 0u);
    for (auto& layer : model->layers) fully_shard(layer.ptr(), context);
    fully_shard(model.ptr(), context);
    int64_t largest = 0;
    for (const auto& [name, tensor] : expected) largest = std::max<int64_t>(largest, tensor.numel() * 4);
    std::unique_ptr<TensorListSource> source;
    if (context.rank() == 0) source = std::make_unique<TensorListSource>(full_state);
    const int64_t peak = load_model_state_dict_from_rank0(*model, context, source.get());
    // Beyond its shards a rank held one full tensor at a time, never more.
    EXPECT_EQ(peak, largest);
    for (const auto& unit : fsdp_modules(*model)) {
      for (const auto& info : detail::sharded_parameters(unit)) {
        EXPECT_EQ(static_cast<int64_t>(info.parameter.storage().nbytes()), info.layout.numel_padded_shard * 4);
      }
    }
    const auto actual = testing::full_parameters(*model);
    for (const auto& [name, tensor] : expected) EXPECT_TRUE(torch::equal(actual.at(name), tensor)) << name;

    // The seed's entry point, and its error for a key the full state dict lacks.
    AcceleratorOptions accelerator_options;
    accelerator_options.fsdp_plugin = FullyShardedDataParallelPlugin();
    Accelerator accelerator(context, accelerator_options, EnvironmentMap{});
    TensorList partial(full_state.begin(), full_state.end());
    if (!partial.empty()) partial.pop_back();
    const auto message =
        testing::error_message_of([&] { fsdp2_load_full_state_dict(accelerator, model.ptr(), partial); });
    EXPECT_NE(message.find("missing from full state dict"), std::string::npos) << message;
    EXPECT_NE(message.find("Full state dict has " + std::to_string(expected.size() - 1) + " keys"), std::string::npos)
        << message;
  });
}

TEST(Checkpoint, FullModelFileIsReadableByPythonTorch) {
  const auto directory = testing::shared_temporary_directory();
  testing::run_on_ranks(2, [directory](const DistributedContext& context) {
    Trainer trainer(context, 17);
    save_checkpoint(directory, *trainer.model, *trainer.optimizer, context, {},
                    CheckpointOptions{StateDictType::kFullStateDict, false});
  });
  if (testing::is_rank_process()) return;
  const auto path = (fs::path(directory) / "pytorch_model_fsdp.bin").string();
  const auto python =
      testing::run_python_code("import torch; d = torch.load('" + path +
                               "', weights_only=True); print(len(d), tuple(d['embed_tokens.weight'].shape))");
  ASSERT_TRUE(python.ok);
  const auto& output = python.output.at(0);
  torch::manual_seed(17);
  testing::TinyTransformer model;
  // Tied weights are saved once: every distinct tensor, under its first name.
  EXPECT_NE(output.find(std::to_string(unique_parameters(*model).size() + model->buffers().size()) + " (11, 6)"),
            std::string::npos)
      << output;
}

}  // namespace
}  // namespace fsdp

namespace fsdp {
namespace {

// A rotary embedding's inv_freq, registered as torch registers it with persistent=False: Hugging Face
// checkpoints do not hold it, so a state dict must neither save nor require it.
struct RotaryImpl : torch::nn::Module {
  RotaryImpl() : inv_freq(register_buffer("inv_freq", torch::arange(0, 4, 2).to(torch::kFloat).mul(-0.5).exp())) {}
  torch::Tensor inv_freq;
};
TORCH_MODULE(Rotary);

struct RotaryModelImpl : torch::nn::Module, PretrainedModel {
  explicit RotaryModelImpl(bool declare) : declare(declare) {
    proj = register_module("proj", torch::nn::Linear(4, 3));
    rotary = register_module("rotary", Rotary());
  }
  std::vector<std::string> non_persistent_buffers() const override {
    return declare ? std::vector<std::string>{"inv_freq"} : std::vector<std::string>{};
  }
  bool declare;
  torch::nn::Linear proj{nullptr};
  Rotary rotary{nullptr};
};
TORCH_MODULE(RotaryModel);

TEST(StateDict, NonPersistentBuffersAreNeitherSavedNorRequired) {
  auto context = DistributedContext::initialize(DistributedEnvironment{});
  torch::manual_seed(3);
  RotaryModel model(true);
  fully_shard(model.ptr(), context);
  const auto saved = full_model_state_dict(*model, StateDictConfig{true, true});
  std::vector<std::string> names;
  for (const auto& [name, tensor] : saved) names.push_back(name);
  EXPECT_EQ(names, (std::vector<std::string>{"proj.weight", "proj.bias"}));

  // A checkpoint without inv_freq loads, and the buffer keeps the value the model computed.
  const auto inv_freq = model->rotary->inv_freq.clone();
  TensorList weights = {{"proj.weight", torch::ones({3, 4})}, {"proj.bias", torch::zeros({3})}};
  load_model_state_dict(*model, TensorListSource(weights));
  EXPECT_TRUE(
      torch::equal(full_model_state_dict(*model, StateDictConfig{true, true}).front().second, torch::ones({3, 4})));
  EXPECT_TRUE(torch::equal(model->rotary->inv_freq, inv_freq));

  // Undeclared, the buffer is state like any other, and its absence is named.
  RotaryModel undeclared(false);
  fully_shard(undeclared.ptr(), context);
  const auto message =
      testing::error_message_of([&] { load_model_state_dict(*undeclared, TensorListSource(weights)); });
  EXPECT_NE(message.find("rotary.inv_freq"), std::string::npos) << message;
}

}  // namespace
}  // namespace fsdp
