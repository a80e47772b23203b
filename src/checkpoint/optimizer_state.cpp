#include "checkpoint/optimizer_state.h"

#include <ATen/ATen.h>
#include <torch/optim.h>

#include <cmath>

namespace fsdp::detail {
namespace {

at::Tensor step_tensor(int64_t step) { return at::scalar_tensor(static_cast<double>(step), at::kFloat); }

const at::Tensor* field(const std::vector<std::pair<std::string, at::Tensor>>& fields, const std::string& name) {
  for (const auto& [key, tensor] : fields) {
    if (key == name) return &tensor;
  }
  return nullptr;
}

at::Tensor required(const std::vector<std::pair<std::string, at::Tensor>>& fields, const std::string& name,
                    const std::string& type, const std::string& parameter_name) {
  const auto* found = field(fields, name);
  TORCH_CHECK(found && found->defined(), type, " state of parameter '", parameter_name, "' lacks its '", name,
              "' field; the checkpoint was written for another optimizer or is damaged");
  return *found;
}

int64_t step_of(const std::vector<std::pair<std::string, at::Tensor>>& fields, const std::string& type,
                const std::string& parameter_name) {
  const double step = required(fields, "step", type, parameter_name).item<double>();
  TORCH_CHECK(std::isfinite(step) && step >= 0 && step < 9.0e15, type, " state of parameter '", parameter_name,
              "' has step ", step, "; expected a non-negative whole number");
  return static_cast<int64_t>(step);
}

void push_if_defined(std::vector<std::pair<std::string, at::Tensor>>& fields, const char* name,
                     const at::Tensor& tensor) {
  if (tensor.defined()) fields.emplace_back(name, tensor);
}

double number(const nlohmann::json& values, const char* key, const std::string& type) {
  TORCH_CHECK(values.contains(key) && values[key].is_number(), type, " parameter group lacks the number '", key,
              "' (found ", values.dump(), ")");
  return values[key].get<double>();
}

bool flag(const nlohmann::json& values, const char* key, const std::string& type) {
  TORCH_CHECK(values.contains(key) && values[key].is_boolean(), type, " parameter group lacks the bool '", key,
              "' (found ", values.dump(), ")");
  return values[key].get<bool>();
}

std::tuple<double, double> betas(const nlohmann::json& values, const std::string& type) {
  TORCH_CHECK(values.contains("betas") && values["betas"].is_array() && values["betas"].size() == 2, type,
              " parameter group lacks 'betas' as two numbers (found ", values.dump(), ")");
  TORCH_CHECK(values["betas"][0].is_number() && values["betas"][1].is_number(), type,
              " parameter group has non-numeric 'betas' (found ", values["betas"].dump(), ")");
  return {values["betas"][0].get<double>(), values["betas"][1].get<double>()};
}

}  // namespace

std::string optimizer_type(torch::optim::Optimizer& optimizer) {
  if (dynamic_cast<torch::optim::AdamW*>(&optimizer)) return "AdamW";
  if (dynamic_cast<torch::optim::Adam*>(&optimizer)) return "Adam";
  if (dynamic_cast<torch::optim::SGD*>(&optimizer)) return "SGD";
  if (dynamic_cast<torch::optim::Adagrad*>(&optimizer)) return "Adagrad";
  if (dynamic_cast<torch::optim::RMSprop*>(&optimizer)) return "RMSprop";
  TORCH_CHECK(false,
              "optimizer state dicts support torch::optim AdamW, Adam, SGD, Adagrad and RMSprop; this "
              "optimizer is none of them (LBFGS keeps a history that cannot be sharded)");
}

std::vector<std::pair<std::string, at::Tensor>> state_fields(const std::string& type,
                                                             torch::optim::OptimizerParamState& state) {
  std::vector<std::pair<std::string, at::Tensor>> fields;
  if (type == "AdamW") {
    auto& typed = static_cast<torch::optim::AdamWParamState&>(state);
    fields.emplace_back("step", step_tensor(typed.step()));
    push_if_defined(fields, "exp_avg", typed.exp_avg());
    push_if_defined(fields, "exp_avg_sq", typed.exp_avg_sq());
    push_if_defined(fields, "max_exp_avg_sq", typed.max_exp_avg_sq());
  } else if (type == "Adam") {
    auto& typed = static_cast<torch::optim::AdamParamState&>(state);
    fields.emplace_back("step", step_tensor(typed.step()));
    push_if_defined(fields, "exp_avg", typed.exp_avg());
    push_if_defined(fields, "exp_avg_sq", typed.exp_avg_sq());
    push_if_defined(fields, "max_exp_avg_sq", typed.max_exp_avg_sq());
  } else if (type == "SGD") {
    push_if_defined(fields, "momentum_buffer", static_cast<torch::optim::SGDParamState&>(state).momentum_buffer());
  } else if (type == "Adagrad") {
    auto& typed = static_cast<torch::optim::AdagradParamState&>(state);
    fields.emplace_back("step", step_tensor(typed.step()));
    push_if_defined(fields, "sum", typed.sum());
  } else if (type == "RMSprop") {
    auto& typed = static_cast<torch::optim::RMSpropParamState&>(state);
    fields.emplace_back("step", step_tensor(typed.step()));
    push_if_defined(fields, "square_avg", typed.square_avg());
    push_if_defined(fields, "momentum_buffer", typed.momentum_buffer());
    push_if_defined(fields, "grad_avg", typed.grad_avg());
  } else {
    TORCH_INTERNAL_ASSERT(false, "unknown optimizer type ", type);
  }
  return fields;
}

std::unique_ptr<torch::optim::OptimizerParamState> make_state(
    const std::string& type, const std::vector<std::pair<std::string, at::Tensor>>& fields,
    const std::string& parameter_name) {
  auto optional = [&](const char* name) {
    const auto* found = field(fields, name);
    return found ? *found : at::Tensor();
  };
  if (type == "AdamW" || type == "Adam") {
    auto fill = [&](auto state) {
      state->step(step_of(fields, type, parameter_name));
      state->exp_avg(required(fields, "exp_avg", type, parameter_name));
      state->exp_avg_sq(required(fields, "exp_avg_sq", type, parameter_name));
      state->max_exp_avg_sq(optional("max_exp_avg_sq"));
      return std::unique_ptr<torch::optim::OptimizerParamState>(std::move(state));
    };
    if (type == "AdamW") return fill(std::make_unique<torch::optim::AdamWParamState>());
    return fill(std::make_unique<torch::optim::AdamParamState>());
  }
  if (type == "SGD") {
    auto state = std::make_unique<torch::optim::SGDParamState>();
    state->momentum_buffer(optional("momentum_buffer"));
    return state;
  }
  if (type == "Adagrad") {
    auto state = std::make_unique<torch::optim::AdagradParamState>();
    state->step(step_of(fields, type, parameter_name));
    state->sum(required(fields, "sum", type, parameter_name));
    return state;
  }
  if (type == "RMSprop") {
    auto state = std::make_unique<torch::optim::RMSpropParamState>();
    state->step(step_of(fields, type, parameter_name));
    state->square_avg(required(fields, "square_avg", type, parameter_name));
    state->momentum_buffer(optional("momentum_buffer"));
    state->grad_avg(optional("grad_avg"));
    return state;
  }
  TORCH_INTERNAL_ASSERT(false, "unknown optimizer type ", type);
}

nlohmann::json options_json(const std::string& type, torch::optim::OptimizerOptions& options) {
  nlohmann::json values;
  if (type == "AdamW" || type == "Adam") {
    auto write = [&](auto& typed) {
      values["lr"] = typed.lr();
      values["betas"] = {std::get<0>(typed.betas()), std::get<1>(typed.betas())};
      values["eps"] = typed.eps();
      values["weight_decay"] = typed.weight_decay();
      values["amsgrad"] = typed.amsgrad();
    };
    if (type == "AdamW")
      write(static_cast<torch::optim::AdamWOptions&>(options));
    else
      write(static_cast<torch::optim::AdamOptions&>(options));
  } else if (type == "SGD") {
    auto& typed = static_cast<torch::optim::SGDOptions&>(options);
    values = {{"lr", typed.lr()},
              {"momentum", typed.momentum()},
              {"dampening", typed.dampening()},
              {"weight_decay", typed.weight_decay()},
              {"nesterov", typed.nesterov()}};
  } else if (type == "Adagrad") {
    auto& typed = static_cast<torch::optim::AdagradOptions&>(options);
    values = {{"lr", typed.lr()},
              {"lr_decay", typed.lr_decay()},
              {"weight_decay", typed.weight_decay()},
              {"initial_accumulator_value", typed.initial_accumulator_value()},
              {"eps", typed.eps()}};
  } else if (type == "RMSprop") {
    auto& typed = static_cast<torch::optim::RMSpropOptions&>(options);
    values = {{"lr", typed.lr()},
              {"alpha", typed.alpha()},
              {"eps", typed.eps()},
              {"weight_decay", typed.weight_decay()},
              {"momentum", typed.momentum()},
              {"centered", typed.centered()}};
  }
  return values;
}

void apply_options_json(const std::string& type, const nlohmann::json& values,
                        torch::optim::OptimizerOptions& options) {
  if (type == "AdamW" || type == "Adam") {
    auto read = [&](auto& typed) {
      typed.lr(number(values, "lr", type));
      typed.betas(betas(values, type));
      typed.eps(number(values, "eps", type));
      typed.weight_decay(number(values, "weight_decay", type));
      typed.amsgrad(flag(values, "amsgrad", type));
    };
    if (type == "AdamW")
      read(static_cast<torch::optim::AdamWOptions&>(options));
    else
      read(static_cast<torch::optim::AdamOptions&>(options));
  } else if (type == "SGD") {
    auto& typed = static_cast<torch::optim::SGDOptions&>(options);
    typed.lr(number(values, "lr", type));
    typed.momentum(number(values, "momentum", type));
    typed.dampening(number(values, "dampening", type));
    typed.weight_decay(number(values, "weight_decay", type));
    typed.nesterov(flag(values, "nesterov", type));
  } else if (type == "Adagrad") {
    auto& typed = static_cast<torch::optim::AdagradOptions&>(options);
    typed.lr(number(values, "lr", type));
    typed.lr_decay(number(values, "lr_decay", type));
    typed.weight_decay(number(values, "weight_decay", type));
    typed.initial_accumulator_value(number(values, "initial_accumulator_value", type));
    typed.eps(number(values, "eps", type));
  } else if (type == "RMSprop") {
    auto& typed = static_cast<torch::optim::RMSpropOptions&>(options);
    typed.lr(number(values, "lr", type));
    typed.alpha(number(values, "alpha", type));
    typed.eps(number(values, "eps", type));
    typed.weight_decay(number(values, "weight_decay", type));
    typed.momentum(number(values, "momentum", type));
    typed.centered(flag(values, "centered", type));
  }
}

namespace {

// torch 2.13's parameter-group keys of each optimizer, in its order, with the defaults of the ones
// libtorch's optimizers do not have (null: the key is one libtorch has).
struct PyTorchKey {
  const char* key;
  c10::IValue (*extra)();
};

c10::IValue none() { return c10::IValue(); }
c10::IValue no() { return c10::IValue(false); }
c10::IValue yes() { return c10::IValue(true); }

const std::vector<PyTorchKey>& pytorch_keys(const std::string& type) {
  static const std::vector<PyTorchKey> adamw = {{"lr", nullptr},
                                                {"betas", nullptr},
                                                {"eps", nullptr},
                                                {"weight_decay", nullptr},
                                                {"amsgrad", nullptr},
                                                {"maximize", no},
                                                {"foreach", none},
                                                {"capturable", no},
                                                {"differentiable", no},
                                                {"fused", none},
                                                {"decoupled_weight_decay", yes}};
  static const std::vector<PyTorchKey> adam = {{"lr", nullptr},
                                               {"betas", nullptr},
                                               {"eps", nullptr},
                                               {"weight_decay", nullptr},
                                               {"amsgrad", nullptr},
                                               {"maximize", no},
                                               {"foreach", none},
                                               {"capturable", no},
                                               {"differentiable", no},
                                               {"fused", none},
                                               {"decoupled_weight_decay", no}};
  static const std::vector<PyTorchKey> sgd = {{"lr", nullptr},           {"momentum", nullptr},  {"dampening", nullptr},
                                              {"weight_decay", nullptr}, {"nesterov", nullptr},  {"maximize", no},
                                              {"foreach", none},         {"differentiable", no}, {"fused", none}};
  static const std::vector<PyTorchKey> adagrad = {{"lr", nullptr},
                                                  {"lr_decay", nullptr},
                                                  {"eps", nullptr},
                                                  {"weight_decay", nullptr},
                                                  {"initial_accumulator_value", nullptr},
                                                  {"foreach", none},
                                                  {"maximize", no},
                                                  {"differentiable", no},
                                                  {"fused", none}};
  static const std::vector<PyTorchKey> rmsprop = {
      {"lr", nullptr},           {"momentum", nullptr}, {"alpha", nullptr}, {"eps", nullptr}, {"centered", nullptr},
      {"weight_decay", nullptr}, {"capturable", no},    {"foreach", none},  {"maximize", no}, {"differentiable", no}};
  if (type == "AdamW") return adamw;
  if (type == "Adam") return adam;
  if (type == "SGD") return sgd;
  if (type == "Adagrad") return adagrad;
  TORCH_INTERNAL_ASSERT(type == "RMSprop", "unknown optimizer type ", type);
  return rmsprop;
}

c10::IValue json_to_ivalue(const nlohmann::json& value) {
  if (value.is_boolean()) return value.get<bool>();
  if (value.is_number_integer()) return value.get<int64_t>();
  if (value.is_number()) return value.get<double>();
  if (value.is_array() && value.size() == 2 && value[0].is_number()) {
    return c10::ivalue::Tuple::create({value[0].get<double>(), value[1].get<double>()});
  }
  if (value.is_null()) return c10::IValue();
  TORCH_INTERNAL_ASSERT(false, "parameter group value ", value.dump(), " has no PyTorch form");
}

}  // namespace

std::vector<std::pair<std::string, c10::IValue>> pytorch_param_group(const std::string& type,
                                                                     const nlohmann::json& values) {
  std::vector<std::pair<std::string, c10::IValue>> group;
  for (const auto& key : pytorch_keys(type)) {
    if (key.extra) {
      group.emplace_back(key.key, key.extra());
    } else {
      TORCH_INTERNAL_ASSERT(values.contains(key.key), type, " parameter group lacks '", key.key, "'");
      group.emplace_back(key.key, json_to_ivalue(values[key.key]));
    }
  }
  return group;
}

std::string optimizer_type_of_param_group(const nlohmann::json& group) {
  auto has = [&](const char* key) { return group.contains(key); };
  if (has("betas")) {
    // Before torch 2.9 neither class had the key; AdamW is then the guess its weight decay cannot tell apart.
    if (has("decoupled_weight_decay") && group["decoupled_weight_decay"].is_boolean()) {
      return group["decoupled_weight_decay"].get<bool>() ? "AdamW" : "Adam";
    }
    return "AdamW";
  }
  if (has("lr_decay") && has("initial_accumulator_value")) return "Adagrad";
  if (has("alpha") && has("centered")) return "RMSprop";
  if (has("momentum") && has("dampening") && has("nesterov")) return "SGD";
  return "";
}

void check_pytorch_only_options(const std::string& type, const nlohmann::json& group, const std::string& source) {
  if (group.contains("maximize") && group["maximize"].is_boolean()) {
    TORCH_CHECK(!group["maximize"].get<bool>(), source, ": the ", type,
                " parameter group has maximize=True, which libtorch's optimizers do not have; resume it in PyTorch, "
                "or save it with maximize=False");
  }
}

nlohmann::json param_group_value_json(const c10::IValue& value, const std::string& where) {
  if (value.isDouble()) return value.toDouble();
  if (value.isInt()) return value.toInt();
  if (value.isBool()) return value.toBool();
  if (value.isNone()) return nullptr;
  if (value.isTuple()) {
    auto numbers = nlohmann::json::array();
    for (const auto& element : value.toTupleRef().elements()) {
      TORCH_CHECK(element.isDouble() || element.isInt(), where, " is a tuple holding a ", element.tagKind(),
                  "; expected numbers");
      numbers.push_back(element.isDouble() ? element.toDouble() : static_cast<double>(element.toInt()));
    }
    return numbers;
  }
  if (value.isList()) {
    auto names = nlohmann::json::array();
    for (const auto& name : value.toList()) {
      const c10::IValue element = name;
      TORCH_CHECK(element.isString(), where, " lists a ", element.tagKind(), "; expected parameter names");
      names.push_back(element.toStringRef());
    }
    return names;
  }
  TORCH_CHECK(false, where, " is a ", value.tagKind(),
              "; expected a number, bool, None, a tuple of numbers or a list of names");
}

}  // namespace fsdp::detail
