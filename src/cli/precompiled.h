// Precompiled header for the command-line tool.
#pragma once
#include <torch/torch.h>

#include <CLI/CLI.hpp>
