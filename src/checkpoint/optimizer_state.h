// Private: torch::optim's per-parameter state and hyper-parameters as named fields, for the five
// optimizers libtorch ships with state (Adam, AdamW, SGD, Adagrad, RMSprop). LBFGS keeps history
// that cannot be sharded; it and user-defined optimizers are rejected with their names.
#pragma once

#include <ATen/core/Tensor.h>
#include <nlohmann/json.hpp>
#include <torch/optim/optimizer.h>

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
std::unique_ptr<torch::optim::OptimizerParamState> make_state(const std::string& type,
                                                              const std::vector<std::pair<std::string, at::Tensor>>& fields,
                                                              const std::string& parameter_name);

/// One group's hyper-parameters ("betas" is a two-element array).
nlohmann::json options_json(const std::string& type, torch::optim::OptimizerOptions& options);
/// Sets one group's hyper-parameters; unknown or missing keys are errors naming them.
void apply_options_json(const std::string& type, const nlohmann::json& values, torch::optim::OptimizerOptions& options);

}  // namespace fsdp::detail
