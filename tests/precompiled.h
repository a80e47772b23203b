// Precompiled header for the test binary.
#pragma once
#include <gtest/gtest.h>
#include <torch/torch.h>
