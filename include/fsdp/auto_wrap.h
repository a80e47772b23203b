// Auto-wrap policies: which modules of a model become their own FSDP unit.
//
// A policy is an AutoWrapCallable: it sees a module, its name in the model and the number
// of its parameters that no unit chosen so far holds. Modules are offered bottom-up (children before
// parents, the root last and never offered: it is always a unit).
#pragma once

#include <torch/nn/module.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace fsdp {

/// Decides whether `module` (named `name`, with `unwrapped_numel` parameters not yet in a unit)
/// becomes its own FSDP unit.
using AutoWrapCallable =
    std::function<bool(const torch::nn::Module& module, const std::string& name, int64_t unwrapped_numel)>;

/// Every descendant of `model` with its name, children before parents, `model` itself last under
/// the name "" (Accelerate's get_module_children_bottom_up).
std::vector<std::pair<std::string, std::shared_ptr<torch::nn::Module>>> module_children_bottom_up(
    const std::shared_ptr<torch::nn::Module>& model);

/// Whether `module`'s C++ class is `class_name`. Accepts the TORCH_MODULE name ("Block") and the
/// implementation's ("BlockImpl"), with or without namespaces.
bool module_class_matches(const torch::nn::Module& module, const std::string& class_name);

/// transformer_based_wrap: modules of the named classes. A name that matches no module of `model`
/// is an error naming it and the classes the model has.
AutoWrapCallable transformer_auto_wrap_policy(const std::vector<std::string>& class_names,
                                              const std::shared_ptr<torch::nn::Module>& model);

/// size_based_wrap as FSDP2 applies it: modules with more than `min_num_params` parameters,
/// counted recursively.
AutoWrapCallable size_based_auto_wrap_policy(int64_t min_num_params);

/// size_based_wrap as FSDP1 applies it: modules whose parameters not yet in a unit number at least
/// `min_num_params`, never a ModuleList or ModuleDict (containers have no forward).
AutoWrapCallable size_based_auto_wrap_policy_v1(int64_t min_num_params);

/// The modules `policy` selects, bottom-up, root excluded, with their names.
std::vector<std::pair<std::string, std::shared_ptr<torch::nn::Module>>> modules_to_wrap(
    const std::shared_ptr<torch::nn::Module>& model, const AutoWrapCallable& policy);

}  // namespace fsdp
