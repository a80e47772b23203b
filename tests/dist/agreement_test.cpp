// Ranks that disagree get one error naming each difference and each rank's value, on every rank,
// before any data collective (issue Reliability): require_same_on_every_rank itself, then
// Accelerator::prepare with another FSDP_* environment on one rank, and fully_shard of another
// model on one rank, which used to abort inside Gloo (op.preamble.length <= op.nbytes) or wait for
// the collective timeout.
#include <fsdp/fsdp.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <tuple>

#include "harness/error_message.h"
#include "harness/multi_rank.h"
#include "harness/test_models.h"

namespace fsdp {
namespace {

TEST(Agreement, FieldsThatDifferAreNamedWithEachRanksValue) {
  testing::run_on_ranks(3, [](const DistributedContext& context) {
    const std::string rank = std::to_string(context.rank());
    require_same_on_every_rank(context, "the same", {{"a", "1"}, {"b", "2"}}, "unused");
    const auto message = testing::error_message_of([&] {
      require_same_on_every_rank(
          context, "the run",
          {{"a", "1"}, {"b", context.rank() == 1 ? "x" : "y"}, {"c", context.rank() == 2 ? "p" : "q"}},
          "Start every rank alike.");
    });
    EXPECT_NE(message.find("the run: the ranks disagree: 'b' is x on rank 1 and y on ranks 0, 2; 'c' is p on rank 2 "
                           "and q on ranks 0, 1. Start every rank alike."),
              std::string::npos)
        << message;
    // A field only some ranks state.
    std::vector<std::pair<std::string, std::string>> fields = {{"a", "1"}};
    if (context.rank() == 0) fields.emplace_back("extra", "e");
    const auto missing =
        testing::error_message_of([&] { require_same_on_every_rank(context, "the run", fields, "Fix."); });
    EXPECT_NE(missing.find("'extra' is (not stated) on ranks 1, 2 and e on rank 0"), std::string::npos) << missing;
  });
}

// Note [Agreement by digest]: ranks that agree send the same bytes whether they agree on two fields
// or on ten thousand, and whether the text is short or long (gathering every rank's text, as before,
// would send each rank's whole list to every peer). Only a disagreement sends the details.
TEST(Agreement, RanksThatAgreeSendAFixedNumberOfBytesWhateverTheyAgreeOn) {
  testing::run_on_ranks(3, [](const DistributedContext& context) {
    const auto& control = context.control();
    auto bytes_to_agree_on = [&](int64_t count, const std::string& value) {
      std::vector<std::pair<std::string, std::string>> fields;
      for (int64_t index = 0; index < count; ++index) fields.emplace_back("parameter " + std::to_string(index), value);
      control.reset_bytes_sent();
      require_same_on_every_rank(context, "the model", fields, "unused");
      return control.bytes_sent().total();
    };
    const auto few = bytes_to_agree_on(2, "[4] Float");
    EXPECT_GT(few, 0);
    EXPECT_EQ(bytes_to_agree_on(10000, "[4096, 4096] Float"), few);
    control.reset_bytes_sent();
    testing::error_message_of(
        [&] { require_same_on_every_rank(context, "the model", {{"a", context.rank() == 1 ? "x" : "y"}}, "unused"); });
    EXPECT_GT(control.bytes_sent().total(), few) << "a disagreement gathers the details after the digest";
  });
}

TEST(Agreement, PrepareWithAnotherEnvironmentOnOneRankIsANamedError) {
  testing::run_on_ranks(2, [](const DistributedContext& context) {
    torch::manual_seed(1);
    testing::MlpStack model;
    torch::optim::AdamW optimizer(model->parameters());
    EnvironmentMap environment;
    if (context.rank() == 1) environment["FSDP_RESHARD_AFTER_FORWARD"] = "false";
    AcceleratorOptions options;
    Accelerator accelerator(context, options, environment);
    const auto message = testing::error_message_of([&] { accelerator.prepare(model, optimizer); });
    EXPECT_NE(message.find("Accelerator::prepare: the ranks disagree: 'reshard_after_forward' is"), std::string::npos)
        << message;
    EXPECT_NE(message.find("on rank 1"), std::string::npos) << message;
    EXPECT_NE(message.find("launch with the same FSDP_* and ACCELERATE_* environment"), std::string::npos) << message;
  });
}

// Another FSDP_VERSION on one rank (it used to abort in Gloo, and rank 0 printed an empty
// "train_llama: error: ") names the version first, not the fields derived from it.
TEST(Agreement, AnotherFsdpVersionOnOneRankNamesTheVersionFirst) {
  testing::run_on_ranks(2, [](const DistributedContext& context) {
    torch::manual_seed(1);
    testing::MlpStack model;
    torch::optim::AdamW optimizer(model->parameters());
    EnvironmentMap environment;
    if (context.rank() == 1) environment["FSDP_VERSION"] = "2";
    Accelerator accelerator(context, AcceleratorOptions{}, environment);
    const auto message = testing::error_message_of([&] { accelerator.prepare(model, optimizer); });
    EXPECT_NE(message.find("Accelerator::prepare: the ranks disagree: 'fsdp_version' is 1 on rank 0 and 2 on rank 1"),
              std::string::npos)
        << message;
    EXPECT_EQ(message.find("differences_from_accelerate"), std::string::npos) << message;
  });
}

// Each setting the issue found aborting, hanging or silently training wrong when one rank had
// another value: every one is named with both values.
TEST(Agreement, EverySettingOneRankHasOtherwiseIsNamed) {
  testing::run_on_ranks(2, [](const DistributedContext& context) {
    // (variables on rank 1, FSDP version, the field named)
    using Variables = std::vector<std::pair<std::string, std::string>>;
    for (const auto& [variables, version, field] : std::vector<std::tuple<Variables, std::string, std::string>>{
             {{{"FSDP_RESHARD_AFTER_FORWARD", "false"}}, "2", "reshard_after_forward"},
             {{{"FSDP_AUTO_WRAP_POLICY", "SIZE_BASED_WRAP"}, {"FSDP_MIN_NUM_PARAMS", "10"}}, "2", "auto_wrap_policy"},
             {{{"FSDP_SHARDING_STRATEGY", "NO_SHARD"}}, "1", "sharding_strategy"},
             {{{"FSDP_STATE_DICT_TYPE", "FULL_STATE_DICT"}}, "2", "state_dict_type"},
             {{{"ACCELERATE_MIXED_PRECISION", "bf16"}}, "2", "mixed_precision"},
             {{{"FSDP_CPU_RAM_EFFICIENT_LOADING", "true"}}, "2", "cpu_ram_efficient_loading"}}) {
      const auto variable = variables.front().first;
      torch::manual_seed(1);
      testing::MlpStack model;
      torch::optim::AdamW optimizer(model->parameters());
      EnvironmentMap environment{{"FSDP_VERSION", version}};
      if (context.rank() == 1) {
        for (const auto& [name, value] : variables) environment[name] = value;
      }
      Accelerator accelerator(context, AcceleratorOptions{}, environment);
      const auto message = testing::error_message_of([&] { accelerator.prepare(model, optimizer); });
      EXPECT_NE(message.find("Accelerator::prepare: the ranks disagree: "), std::string::npos)
          << variable << ": " << message;
      EXPECT_NE(message.find("'" + field + "' is"), std::string::npos) << variable << ": " << message;
      EXPECT_NE(message.find("on rank 1"), std::string::npos) << variable << ": " << message;
    }
  });
}

// What differs legitimately is not compared: a model sharded before prepare holds shards of other
// sizes on each rank (5 rows over 3 ranks: 2, 2, 1).
TEST(Agreement, PrepareOfAModelShardedBeforehandAgrees) {
  testing::run_on_ranks(3, [](const DistributedContext& context) {
    torch::manual_seed(1);
    testing::MlpStack model;
    for (auto& block : model->blocks) fully_shard(block.ptr(), context);
    torch::optim::AdamW optimizer(model->parameters());
    Accelerator accelerator(context, AcceleratorOptions{}, EnvironmentMap{});
    EXPECT_NO_THROW(accelerator.prepare(model, optimizer));
    fsdp::forward(model, torch::randn({2, 3})).sum().backward();
    optimizer.step();
  });
}

TEST(Agreement, FullyShardOfAnotherModelOnOneRankIsANamedError) {
  testing::run_on_ranks(2, [](const DistributedContext& context) {
    torch::nn::Sequential model(torch::nn::Linear(4, context.rank() == 1 ? 6 : 5), torch::nn::Linear(5, 2));
    const auto message = testing::error_message_of([&] { fully_shard(model.ptr(), context); });
    EXPECT_NE(
        message.find("the ranks disagree: 'parameter 0.weight' is [5, 4] Float on rank 0 and [6, 4] Float on rank 1"),
        std::string::npos)
        << message;
    // Other options for the same module.
    torch::nn::Linear layer(3, 3);
    FullyShardOptions options;
    if (context.rank() == 0) options.sharding_strategy = ShardingStrategy::kNoShard;
    const auto strategy = testing::error_message_of([&] { fully_shard(layer.ptr(), context, options); });
    EXPECT_NE(strategy.find("'sharding_strategy' is"), std::string::npos) << strategy;
  });
}

}  // namespace
}  // namespace fsdp
