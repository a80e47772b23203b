// Precompiled header for the library target: the heavy libtorch headers, parsed once.
#pragma once
#include <torch/torch.h>

#include <chrono>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>
