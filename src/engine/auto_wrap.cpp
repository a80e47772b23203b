#include <c10/util/Exception.h>
#include <fsdp/auto_wrap.h>
#include <torch/nn/modules/container/moduledict.h>
#include <torch/nn/modules/container/modulelist.h>

#include <algorithm>
#include <set>
#include <sstream>
#include <unordered_set>

namespace fsdp {
namespace {

std::string unqualified(const std::string& name) {
  const auto separator = name.rfind("::");
  return separator == std::string::npos ? name : name.substr(separator + 2);
}

std::string strip_impl(const std::string& name) {
  const std::string suffix = "Impl";
  if (name.size() > suffix.size() && name.compare(name.size() - suffix.size(), suffix.size(), suffix) == 0) {
    return name.substr(0, name.size() - suffix.size());
  }
  return name;
}

int64_t count_parameters(const torch::nn::Module& module, std::unordered_set<const c10::TensorImpl*>* exclude) {
  int64_t total = 0;
  std::unordered_set<const c10::TensorImpl*> seen;
  for (const auto& parameter : module.parameters(/*recurse=*/true)) {
    const auto* impl = parameter.unsafeGetTensorImpl();
    if (!seen.insert(impl).second || (exclude && exclude->count(impl))) continue;
    total += parameter.numel();
  }
  return total;
}

}  // namespace

std::vector<std::pair<std::string, std::shared_ptr<torch::nn::Module>>> module_children_bottom_up(
    const std::shared_ptr<torch::nn::Module>& model) {
  // Pre-order with children pushed in order, then reversed: every module follows its descendants.
  std::vector<std::pair<std::string, std::shared_ptr<torch::nn::Module>>> order;
  std::vector<std::pair<std::string, std::shared_ptr<torch::nn::Module>>> stack{{"", model}};
  std::unordered_set<const torch::nn::Module*> visited;
  while (!stack.empty()) {
    auto [name, module] = stack.back();
    stack.pop_back();
    if (!visited.insert(module.get()).second) continue;
    order.emplace_back(name, module);
    for (const auto& child : module->named_children()) {
      stack.emplace_back(name.empty() ? child.key() : name + "." + child.key(), child.value());
    }
  }
  std::reverse(order.begin(), order.end());
  return order;
}

bool module_class_matches(const torch::nn::Module& module, const std::string& class_name) {
  const std::string& full = module.name();
  if (full == class_name || strip_impl(full) == strip_impl(class_name)) return true;
  return strip_impl(unqualified(full)) == strip_impl(class_name);
}

AutoWrapCallable transformer_auto_wrap_policy(const std::vector<std::string>& class_names,
                                              const std::shared_ptr<torch::nn::Module>& model) {
  const auto modules = model->modules(/*include_self=*/true);
  for (const auto& class_name : class_names) {
    const bool found = std::any_of(modules.begin(), modules.end(), [&](const std::shared_ptr<torch::nn::Module>& m) {
      return module_class_matches(*m, class_name);
    });
    if (found) continue;
    std::set<std::string> available;
    for (const auto& module : modules) available.insert(strip_impl(unqualified(module->name())));
    std::ostringstream list;
    for (const auto& name : available) list << (list.tellp() > 0 ? ", " : "") << name;
    TORCH_CHECK(false, "Could not find the transformer layer class '", class_name,
                "' in the model (transformer_cls_names_to_wrap / FSDP_TRANSFORMER_CLS_TO_WRAP). The model's module "
                "classes are: ",
                list.str(), ". Name one of them (a TORCH_MODULE name like 'Block' or its 'BlockImpl')");
  }
  return [class_names](const torch::nn::Module& module, const std::string&, int64_t) {
    return std::any_of(class_names.begin(), class_names.end(),
                       [&](const std::string& name) { return module_class_matches(module, name); });
  };
}

AutoWrapCallable size_based_auto_wrap_policy(int64_t min_num_params) {
  return [min_num_params](const torch::nn::Module& module, const std::string&, int64_t) {
    return count_parameters(module, nullptr) > min_num_params;
  };
}

AutoWrapCallable size_based_auto_wrap_policy_v1(int64_t min_num_params) {
  return [min_num_params](const torch::nn::Module& module, const std::string&, int64_t unwrapped_numel) {
    if (dynamic_cast<const torch::nn::ModuleListImpl*>(&module) ||
        dynamic_cast<const torch::nn::ModuleDictImpl*>(&module)) {
      return false;
    }
    return unwrapped_numel > 0 && unwrapped_numel >= min_num_params;
  };
}

std::vector<std::pair<std::string, std::shared_ptr<torch::nn::Module>>> modules_to_wrap(
    const std::shared_ptr<torch::nn::Module>& model, const AutoWrapCallable& policy) {
  std::vector<std::pair<std::string, std::shared_ptr<torch::nn::Module>>> chosen;
  std::unordered_set<const c10::TensorImpl*> claimed;
  auto order = module_children_bottom_up(model);
  order.pop_back();  // the root is always a unit of its own
  for (const auto& [name, module] : order) {
    const int64_t unwrapped_numel = count_parameters(*module, &claimed);
    if (!policy(*module, name, unwrapped_numel)) continue;
    chosen.emplace_back(name, module);
    for (const auto& parameter : module->parameters(/*recurse=*/true)) claimed.insert(parameter.unsafeGetTensorImpl());
  }
  return chosen;
}

}  // namespace fsdp
