#include <ATen/Parallel.h>
#include <dlfcn.h>
#include <fsdp/version.h>
#include <torch/version.h>

namespace fsdp {

std::string version() { return FSDP_VERSION_STRING; }

std::string torch_version() { return TORCH_VERSION; }

bool torch_cxx11_abi() { return _GLIBCXX_USE_CXX11_ABI != 0; }

std::string torch_library_path() {
  // Any function defined in libtorch_cpu tells where the loader found it.
  Dl_info info{};
  if (::dladdr(reinterpret_cast<void*>(&at::get_num_threads), &info) == 0 || info.dli_fname == nullptr) return "";
  return info.dli_fname;
}

}  // namespace fsdp
