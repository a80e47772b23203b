// Version of fsdp.cpp and of the libtorch it was built against.
#pragma once

#include <string>

namespace fsdp {

/// fsdp.cpp's own version, "MAJOR.MINOR.PATCH".
std::string version();

/// The libtorch version this library was compiled against (TORCH_VERSION).
std::string torch_version();

}  // namespace fsdp
