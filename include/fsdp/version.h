// Version of fsdp.cpp and of the libtorch it was built against.
#pragma once

#include <string>

namespace fsdp {

/// fsdp.cpp's own version, "MAJOR.MINOR.PATCH".
std::string version();

/// The libtorch version this library was compiled against (TORCH_VERSION).
std::string torch_version();

/// Whether this library was compiled with the CXX11 ABI of std::string (_GLIBCXX_USE_CXX11_ABI=1), as
/// libtorch 2.7 and newer are: a program linking both must use the same ABI.
bool torch_cxx11_abi();

/// The libtorch_cpu shared library this process loaded ("" when the loader does not say).
std::string torch_library_path();

}  // namespace fsdp
