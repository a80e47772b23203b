// Private: torch::optim's per-parameter state and hyper-parameters as named fields, for the five
// optimizers libtorch ships with state (Adam, AdamW, SGD, Adagrad, RMSprop). LBFGS keeps history
// that cannot be sharded; it and user-defined optimizers are rejected with their names.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/core/ivalue.h>
#include <torch/optim/optimizer.h>

#include <nlohmann/json.hpp>
#include <string>
#include <utility>
#include <vector>

namespace fsdp::detail {

/// "AdamW", "Adam", "SGD", "Adagrad" or "RMSprop"; throws for anything else.
std::string optimizer_type(torch::optim::Optimizer& optimizer);

/// The state of one parameter as fields; "step" is a 0-dim float tensor.
std::vector<std::pair<std::string, at::Tensor>> state_fields(const std::string& type,
                                                             torch::optim::OptimizerParamState& state);
/// A state object of `type` built from fields (missing optional fields stay undefined).
std::unique_ptr<torch::optim::OptimizerParamState> make_state(
    const std::string& type, const std::vector<std::pair<std::string, at::Tensor>>& fields,
    const std::string& parameter_name);

/// One group's hyper-parameters ("betas" is a two-element array).
nlohmann::json options_json(const std::string& type, torch::optim::OptimizerOptions& options);
/// Sets one group's hyper-parameters; unknown or missing keys are errors naming them.
void apply_options_json(const std::string& type, const nlohmann::json& values, torch::optim::OptimizerOptions& options);

/// One group's hyper-parameters as PyTorch's optimizer.state_dict() holds them for `type`: torch
/// 2.13's keys in its order, those libtorch lacks (maximize, foreach, ...) at PyTorch's defaults,
/// without "params". `values` is what options_json gives.
std::vector<std::pair<std::string, c10::IValue>> pytorch_param_group(const std::string& type,
                                                                     const nlohmann::json& values);

/// The optimizer class a parameter group saved by PyTorch belongs to, told by its keys
/// ("decoupled_weight_decay" tells AdamW from Adam, which torch 2.13 both give "betas"); "" when
/// the keys fit none of the five.
std::string optimizer_type_of_param_group(const nlohmann::json& group);

/// Refuses a group saved by PyTorch whose options that libtorch's optimizer lacks would change
/// the update (maximize true, for instance): the error names the option and `source`. Options that
/// only choose an implementation (foreach, fused, capturable, differentiable) are accepted.
void check_pytorch_only_options(const std::string& type, const nlohmann::json& group, const std::string& source);

/// A parameter group's value from a torch.save pickle (a number, bool, None, a tuple of numbers or a
/// list of names) as JSON; anything else is an error naming `where`.
nlohmann::json param_group_value_json(const c10::IValue& value, const std::string& where);

}  // namespace fsdp::detail
