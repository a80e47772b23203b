#include <ATen/ATen.h>
#include <fsdp/meta_device.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/batchnorm.h>
#include <torch/nn/modules/conv.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/instancenorm.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/normalization.h>
#include <torch/nn/modules/rnn.h>

#include <mutex>

#include "memory/buffer_pool.h"

namespace fsdp {
namespace {

// `tensor` takes over `value`'s storage and metadata in place (Note [building on the meta device]):
// VariableHooks::set_data without its same-backend check. As set_data does, a gradient accumulator
// made for the old tensor is dropped, and so is a gradient of the old shape.
void replace_in_place(const at::Tensor& tensor, const at::Tensor& value) {
  if (auto* autograd = torch::autograd::impl::get_autograd_meta(tensor)) {
    std::lock_guard<std::mutex> lock(autograd->mutex_);
    autograd->grad_accumulator_.reset();
  }
  if (tensor.grad().defined()) const_cast<at::Tensor&>(tensor).mutable_grad() = at::Tensor();
  tensor.unsafeGetTensorImpl()->shallow_copy_from(value.getIntrusivePtr());
}

// A CPU tensor of `like`'s shape and dtype whose storage holds no memory.
at::Tensor without_memory(const at::Tensor& like) {
  auto value = at::empty({0}, at::TensorOptions().dtype(like.scalar_type()).device(c10::kCPU));
  value.unsafeGetTensorImpl()->set_sizes_contiguous(like.sizes());
  return value;
}

void check_outside_guard(const char* function) {
  TORCH_CHECK(!c10::impl::tls_is_dispatch_key_included(c10::DispatchKey::Meta), function,
              " was called inside a MetaDeviceGuard, where every new tensor is a meta tensor; call it after the "
              "guard's scope ends");
}

template <typename Impl>
bool reset_as(torch::nn::Module& module) {
  auto* typed = dynamic_cast<Impl*>(&module);
  if (!typed) return false;
  typed->reset_parameters();
  return true;
}

}  // namespace

MetaDeviceGuard::MetaDeviceGuard()
    : include_meta_(c10::DispatchKeySet(c10::DispatchKey::Meta)),
      exclude_backend_select_(c10::DispatchKeySet(c10::DispatchKey::BackendSelect)) {}

bool reset_parameters(torch::nn::Module& module) {
  check_outside_guard("fsdp::reset_parameters");
  at::NoGradGuard no_grad;
  if (auto* own = dynamic_cast<ResetParameters*>(&module)) {
    own->reset_parameters();
    return true;
  }
  if (auto* attention = dynamic_cast<torch::nn::MultiheadAttentionImpl*>(&module)) {
    attention->_reset_parameters();
    return true;
  }
  namespace nn = torch::nn;
  return reset_as<nn::LinearImpl>(module) || reset_as<nn::BilinearImpl>(module) ||
         reset_as<nn::EmbeddingImpl>(module) || reset_as<nn::EmbeddingBagImpl>(module) ||
         reset_as<nn::LayerNormImpl>(module) || reset_as<nn::GroupNormImpl>(module) ||
         reset_as<nn::Conv1dImpl>(module) || reset_as<nn::Conv2dImpl>(module) || reset_as<nn::Conv3dImpl>(module) ||
         reset_as<nn::ConvTranspose1dImpl>(module) || reset_as<nn::ConvTranspose2dImpl>(module) ||
         reset_as<nn::ConvTranspose3dImpl>(module) || reset_as<nn::BatchNorm1dImpl>(module) ||
         reset_as<nn::BatchNorm2dImpl>(module) || reset_as<nn::BatchNorm3dImpl>(module) ||
         reset_as<nn::InstanceNorm1dImpl>(module) || reset_as<nn::InstanceNorm2dImpl>(module) ||
         reset_as<nn::InstanceNorm3dImpl>(module) || reset_as<nn::RNNImpl>(module) || reset_as<nn::LSTMImpl>(module) ||
         reset_as<nn::GRUImpl>(module) || reset_as<nn::RNNCellImpl>(module) || reset_as<nn::LSTMCellImpl>(module) ||
         reset_as<nn::GRUCellImpl>(module);
}

bool has_meta_tensors(const torch::nn::Module& module, bool recurse) {
  for (const auto& parameter : module.parameters(recurse)) {
    if (parameter.defined() && parameter.is_meta()) return true;
  }
  for (const auto& buffer : module.buffers(recurse)) {
    if (buffer.defined() && buffer.is_meta()) return true;
  }
  return false;
}

void to_empty(torch::nn::Module& module, c10::Device device, bool recurse) {
  check_outside_guard("fsdp::to_empty");
  TORCH_CHECK(!device.is_meta(),
              "fsdp::to_empty: the target device is meta; give the device the tensors should move to");
  auto materialize = [&](const at::Tensor& tensor) {
    if (tensor.defined() && tensor.is_meta()) {
      replace_in_place(tensor,
                       at::zeros(tensor.sizes(), at::TensorOptions().dtype(tensor.scalar_type()).device(device)));
    }
  };
  for (const auto& parameter : module.parameters(recurse)) materialize(parameter);
  for (const auto& buffer : module.buffers(recurse)) materialize(buffer);
}

void release_parameter_storage(torch::nn::Module& model, bool recurse) {
  check_outside_guard("fsdp::release_parameter_storage");
  for (auto& parameter : model.parameters(recurse)) {
    if (parameter.is_meta()) {
      replace_in_place(parameter, without_memory(parameter));
    } else {
      detail::take_storage_memory(parameter);  // dropped: freed
    }
  }
}

}  // namespace fsdp
