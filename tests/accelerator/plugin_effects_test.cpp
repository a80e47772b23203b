// Every field of the plugin has an effect, under each fsdp_version: setting it away from its default
// changes what prepare builds (options, units, activation checkpointing, the weights a rank ends
// with, checkpoint options), or it is a warning or an error that names it. The field list comes from
// the plugin itself (to_json(), the list `fsdp config show` prints), so a field added later without
// a case here fails this test, and a case whose field stopped doing anything fails too.
#include <fsdp/fsdp.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <map>
#include <nlohmann/json.hpp>
#include <sstream>

#include "harness/error_message.h"
#include "harness/multi_rank.h"
#include "harness/parity.h"
#include "harness/test_models.h"

namespace fsdp {
namespace {

using Args = FullyShardedDataParallelPluginArgs;

std::string dtype_text(const std::optional<c10::ScalarType>& dtype) {
  return dtype ? std::string(c10::toString(*dtype)) : std::string("-");
}

std::string describe(const FullyShardOptions& options) {
  std::ostringstream text;
  text << "strategy=" << to_string(options.sharding_strategy)
       << " reshard=" << (options.reshard_after_forward ? options.reshard_after_forward->to_string() : "-")
       << " mp=" << dtype_text(options.mp_policy.param_dtype) << "/" << dtype_text(options.mp_policy.reduce_dtype)
       << "/" << dtype_text(options.mp_policy.buffer_dtype) << "/" << dtype_text(options.mp_policy.output_dtype)
       << " offload=" << options.offload_policy.offload_params << " sync=" << options.fsdp1.sync_module_states
       << " forward_prefetch=" << options.fsdp1.forward_prefetch << " backward_prefetch="
       << (options.fsdp1.backward_prefetch ? static_cast<int>(*options.fsdp1.backward_prefetch) : 0)
       << " max_all_gathers=" << options.fsdp1.max_all_gathers_in_flight.value_or(0);
  return text.str();
}

std::string describe(const CheckpointOptions& options) {
  std::ostringstream text;
  text << "type=" << to_string(options.state_dict_type) << " model=" << options.state_dict_config.offload_to_cpu
       << options.state_dict_config.rank0_only << " optim=" << options.optim_state_dict_config.offload_to_cpu
       << options.optim_state_dict_config.rank0_only;
  return text.str();
}

/// What prepare did on this rank, and everything the plugin said.
struct Outcome {
  std::string effect;
  std::string messages;
  bool failed = false;
};

/// With `on_meta`, every rank builds the model on the meta device (tied, so that each module has an
/// initializer of its own) and prepare initializes it.
Outcome prepare_with(const DistributedContext& context, const Args& args, const EnvironmentMap& environment,
                     bool on_meta = false) {
  Outcome outcome;
  std::optional<FullyShardedDataParallelPlugin> plugin;
  try {
    plugin = FullyShardedDataParallelPlugin(args, environment);
  } catch (const c10::Error& error) {
    outcome.messages = std::string("error: ") + error.what_without_backtrace();
    outcome.failed = true;
    return outcome;
  }
  for (const auto& warning : plugin->warnings) outcome.messages += warning + "\n";
  // Rank 0 and the others start from different weights: what a rank ends with shows syncing.
  torch::manual_seed(context.rank() == 0 ? 11 : 12);
  testing::TinyTransformer model{nullptr};
  if (on_meta) {
    MetaDeviceGuard meta;
    model = testing::TinyTransformer(/*tied=*/true, 11, 6, 2);
  } else {
    model = testing::TinyTransformer(/*tied=*/false, 11, 6, 2);
  }
  torch::optim::AdamW optimizer(testing::unique_parameters(*model));
  AcceleratorOptions options;
  options.fsdp_plugin = *plugin;
  std::ostringstream effect;
  effect << describe(fully_shard_options_from_plugin(*plugin)) << "\n"
         << describe(checkpoint_options_from_plugin(*plugin)) << "\n";
  try {
    Accelerator accelerator(context, options, EnvironmentMap{});
    accelerator.prepare(model, optimizer);
  } catch (const c10::Error& error) {
    outcome.messages += std::string("error: ") + error.what_without_backtrace();
    outcome.failed = true;
    outcome.effect = effect.str();
    return outcome;
  }
  for (const auto& unit : fsdp_modules(*model)) {
    effect << "unit " << unit.description() << " parameters " << detail::sharded_parameters(unit).size() << "\n";
  }
  for (const auto& item : model->named_modules()) {
    if (is_checkpointed(*item.value())) effect << "checkpointed " << item.key() << "\n";
  }
  for (const auto& [name, tensor] : testing::full_parameters(*model)) {
    effect << name << " " << tensor.scalar_type() << " sum " << tensor.sum().item<double>() << "\n";
  }
  outcome.effect = effect.str();
  return outcome;
}

/// Whether `text` names `field` as a word ("state_dict_config" is not named by
/// "optim_state_dict_config").
bool names_field(const std::string& text, const std::string& field) {
  auto is_word = [](char c) { return std::isalnum(static_cast<unsigned char>(c)) || c == '_'; };
  for (size_t at = text.find(field); at != std::string::npos; at = text.find(field, at + 1)) {
    const bool starts = at == 0 || !is_word(text[at - 1]);
    const bool ends = at + field.size() == text.size() || !is_word(text[at + field.size()]);
    if (starts && ends) return true;
  }
  return false;
}

struct FieldCase {
  /// Set on top of the baseline: the field away from its default.
  std::function<void(Args&, EnvironmentMap&)> change;
  /// Set on both the baseline and the case: what the field needs to matter (e.g. its wrap policy).
  std::function<void(Args&, EnvironmentMap&)> prerequisite;
  /// Both build the model on the meta device.
  bool on_meta = false;
};

std::map<std::string, FieldCase> field_cases(int64_t version) {
  auto nothing = [](Args&, EnvironmentMap&) {};
  auto transformer_wrap = [](Args& args, EnvironmentMap&) {
    args.auto_wrap_policy = std::string("transformer_based_wrap");
  };
  std::map<std::string, FieldCase> cases;
  cases["fsdp_version"] = {[version](Args& args, EnvironmentMap&) { args.fsdp_version = int64_t{3 - version}; },
                           nothing};
  cases["sharding_strategy"] = {
      [](Args& args, EnvironmentMap&) { args.sharding_strategy = std::string("SHARD_GRAD_OP"); }, nothing};
  cases["reshard_after_forward"] = {[version](Args& args, EnvironmentMap&) {
                                      if (version == 2)
                                        args.reshard_after_forward = false;
                                      else
                                        args.reshard_after_forward = std::string("NO_SHARD");
                                    },
                                    nothing};
  cases["backward_prefetch"] = {
      [](Args& args, EnvironmentMap&) { args.backward_prefetch = std::string("BACKWARD_POST"); }, nothing};
  cases["mixed_precision_policy"] = {
      [](Args& args, EnvironmentMap&) { args.mixed_precision_policy = std::string("bf16"); }, nothing};
  cases["auto_wrap_policy"] = {transformer_wrap, nothing};
  cases["cpu_offload"] = {[](Args& args, EnvironmentMap&) { args.cpu_offload = true; }, nothing};
  cases["ignored_modules"] = {[](Args& args, EnvironmentMap&) { args.ignored_modules = std::string("layers_0"); },
                              transformer_wrap};
  cases["state_dict_type"] = {[version](Args& args, EnvironmentMap&) {
                                args.state_dict_type =
                                    std::string(version == 1 ? "SHARDED_STATE_DICT" : "FULL_STATE_DICT");
                              },
                              nothing};
  cases["state_dict_config"] = {
      [](Args& args, EnvironmentMap&) { args.state_dict_config = StateDictConfig{false, false}; },
      [](Args& args, EnvironmentMap&) { args.state_dict_type = std::string("FULL_STATE_DICT"); }};
  cases["optim_state_dict_config"] = {
      [](Args& args, EnvironmentMap&) { args.optim_state_dict_config = StateDictConfig{false, false}; },
      [](Args& args, EnvironmentMap&) { args.state_dict_type = std::string("FULL_STATE_DICT"); }};
  cases["limit_all_gathers"] = {[](Args& args, EnvironmentMap&) { args.limit_all_gathers = false; }, nothing};
  cases["use_orig_params"] = {[version](Args& args, EnvironmentMap&) { args.use_orig_params = version == 2; }, nothing};
  cases["param_init_fn"] = {[](Args& args, EnvironmentMap&) {
                              args.param_init_fn = ParamInitFn([](torch::nn::Module& module) {
                                torch::NoGradGuard no_grad;
                                for (auto& parameter : module.parameters(/*recurse=*/false)) parameter.fill_(0.5);
                              });
                            },
                            nothing, /*on_meta=*/true};
  cases["sync_module_states"] = {[](Args& args, EnvironmentMap&) { args.sync_module_states = true; }, nothing};
  cases["forward_prefetch"] = {[](Args& args, EnvironmentMap&) { args.forward_prefetch = true; }, nothing};
  cases["activation_checkpointing"] = {[](Args& args, EnvironmentMap&) { args.activation_checkpointing = true; },
                                       transformer_wrap};
  cases["activation_checkpointing_offload"] = {
      [](Args& args, EnvironmentMap&) { args.activation_checkpointing_offload = true; },
      [](Args& args, EnvironmentMap&) {
        args.auto_wrap_policy = std::string("transformer_based_wrap");
        args.activation_checkpointing = true;
      }};
  cases["cpu_ram_efficient_loading"] = {[](Args& args, EnvironmentMap&) { args.cpu_ram_efficient_loading = true; },
                                        nothing};
  cases["transformer_cls_names_to_wrap"] = {
      [](Args& args, EnvironmentMap&) { args.transformer_cls_names_to_wrap = std::vector<std::string>{"LayerNorm"}; },
      transformer_wrap};
  cases["min_num_params"] = {[](Args& args, EnvironmentMap&) { args.min_num_params = int64_t{100000}; },
                             [](Args& args, EnvironmentMap&) {
                               args.auto_wrap_policy = std::string("size_based_wrap");
                               args.min_num_params = int64_t{1};
                             }};
  return cases;
}

TEST(PluginEffects, EveryFieldChangesWhatPrepareDoesOrIsNamedInAWarningOrError) {
  testing::run_on_ranks(2, [](const DistributedContext& context) {
    const auto listed = nlohmann::json::parse(FullyShardedDataParallelPlugin().to_json());
    for (const int64_t version : {1, 2}) {
      const auto cases = field_cases(version);
      for (const auto& item : listed.items()) {
        if (item.key() == "warnings" || item.key() == "differences_from_accelerate") continue;
        const auto found = cases.find(item.key());
        ASSERT_NE(found, cases.end()) << "plugin field '" << item.key()
                                      << "' has no case here: give it an effect (or a warning) and a case";
        const std::string what = "version " + std::to_string(version) + ", field " + item.key();
        Args baseline_args;
        baseline_args.fsdp_version = version;
        EnvironmentMap baseline_environment;
        found->second.prerequisite(baseline_args, baseline_environment);
        Args changed_args = baseline_args;
        EnvironmentMap changed_environment = baseline_environment;
        found->second.change(changed_args, changed_environment);
        const bool on_meta = found->second.on_meta;
        const auto baseline = prepare_with(context, baseline_args, baseline_environment, on_meta);
        ASSERT_FALSE(baseline.failed) << what << ": " << baseline.messages;
        const auto changed = prepare_with(context, changed_args, changed_environment, on_meta);
        // The rank that is not 0 sees every effect, syncing from rank 0 included.
        if (context.rank() != 1) continue;
        // A message counts only if the change brought it: the baseline must not say it already.
        const bool named = names_field(changed.messages, item.key()) && !names_field(baseline.messages, item.key());
        EXPECT_TRUE(changed.effect != baseline.effect || named)
            << what << " changed nothing and nothing named it.\nbaseline:\n"
            << baseline.effect << "\nchanged:\n"
            << changed.effect << "\nmessages: " << changed.messages;
      }
    }
  });
}

}  // namespace
}  // namespace fsdp
