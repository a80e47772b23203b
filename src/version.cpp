#include <fsdp/version.h>

#include <torch/version.h>

namespace fsdp {

std::string version() { return FSDP_VERSION_STRING; }

std::string torch_version() { return TORCH_VERSION; }

}  // namespace fsdp
