#!/usr/bin/env bash
# scripts/setup.sh on bad input: each case ends with exit 1 and one line on stderr that names what is
# missing and the fix, before any CMake run; and CMake's own refusal of an old libtorch. Nothing here
# touches the real build directory.
# Usage: setup_errors_test.sh REPOSITORY_ROOT VENV_DIR
set -uo pipefail
root="$1"
venv="$2"
scratch="$(mktemp -d)"
trap 'rm -rf "$scratch"' EXIT
failures=0

expect_error() {  # NAME EXPECTED_TEXT ENVIRONMENT...
  local name="$1" expected="$2"
  shift 2
  env FSDP_BUILD_DIR="$scratch/build" "$@" "$root/scripts/setup.sh" >"$scratch/out" 2>"$scratch/err"
  local status=$?
  local lines
  lines="$(grep -c '' "$scratch/err")"
  if [[ $status -ne 1 || $lines -ne 1 ]] || ! grep -qF -- "$expected" "$scratch/err"; then
    echo "FAIL $name: exit $status, $lines stderr line(s); expected exit 1 and one line with: $expected"
    sed 's/^/  stderr: /' "$scratch/err"
    failures=$((failures + 1))
  else
    echo "ok   $name: $(cat "$scratch/err")"
  fi
  [[ ! -e "$scratch/build/CMakeCache.txt" ]] || { echo "FAIL $name: CMake ran"; failures=$((failures + 1)); }
}

expect_error "missing python" "FSDP_PYTHON='/nonexistent/python3.11' is not an executable" \
  FSDP_PYTHON=/nonexistent/python3.11 FSDP_VENV="$scratch/venv"

printf '#!/bin/sh\nexit 1\n' >"$scratch/python-without-venv"
chmod +x "$scratch/python-without-venv"
expect_error "python without venv" "has no venv/ensurepip module" \
  FSDP_PYTHON="$scratch/python-without-venv" FSDP_VENV="$scratch/venv"

mkdir -p "$scratch/old-libtorch/share/cmake/Torch"
echo 'set(PACKAGE_VERSION "1.13.1")' >"$scratch/old-libtorch/share/cmake/Torch/TorchConfigVersion.cmake"
expect_error "libtorch too old" "libtorch 1.13.1 at $scratch/old-libtorch is too old: fsdp.cpp needs libtorch >= 2.11" \
  FSDP_VENV="$venv" FSDP_TORCH_PREFIX="$scratch/old-libtorch"

expect_error "unknown flavour" "FSDP_FLAVOR='gpu' is not a flavour of fsdp.cpp; expected 'cpu' (default) or 'cuda'" \
  FSDP_FLAVOR=gpu FSDP_VENV="$venv"

mkdir -p "$scratch/not-libtorch"
expect_error "not a libtorch" "no TorchConfigVersion.cmake under '$scratch/not-libtorch'" \
  FSDP_VENV="$venv" FSDP_TORCH_PREFIX="$scratch/not-libtorch"

# CMake itself, configured by hand against an old libtorch: the same refusal, naming the version.
mkdir -p "$scratch/old-libtorch-cmake/share/cmake/Torch"
echo 'set(PACKAGE_VERSION "1.13.1")
set(PACKAGE_VERSION_COMPATIBLE TRUE)' >"$scratch/old-libtorch-cmake/share/cmake/Torch/TorchConfigVersion.cmake"
echo 'set(Torch_FOUND TRUE)' >"$scratch/old-libtorch-cmake/share/cmake/Torch/TorchConfig.cmake"
cmake -S "$root" -B "$scratch/cmake-build" "-DCMAKE_PREFIX_PATH=$scratch/old-libtorch-cmake" >"$scratch/out" 2>&1
status=$?
# CMake wraps long messages: compare with the lines joined.
if [[ $status -ne 0 ]] && tr -s '\n ' '  ' <"$scratch/out" | grep -q "libtorch 1.13.1 at [^ ]* is too old: fsdp.cpp needs libtorch >= 2.11"; then
  echo "ok   cmake with libtorch 1.13.1: refused by name"
else
  echo "FAIL cmake with libtorch 1.13.1: exit $status"; cat "$scratch/out"; failures=$((failures + 1))
fi

# FSDP_CUDA=ON against a CPU-only libtorch is refused by name (where the venv's torch is CPU-only).
if [[ "$("$venv/bin/python" -c 'import torch; print(torch.version.cuda is None)')" == True ]]; then
  torch_prefix="$("$venv/bin/python" -c 'import torch.utils; print(torch.utils.cmake_prefix_path)')"
  cmake -S "$root" -B "$scratch/cuda-on" "-DCMAKE_PREFIX_PATH=$torch_prefix" -DFSDP_CUDA=ON -DFSDP_BUILD_TESTS=OFF \
    -DFSDP_BUILD_BENCHMARKS=OFF >"$scratch/out" 2>&1
  status=$?
  if [[ $status -ne 0 ]] && tr -s '\n ' '  ' <"$scratch/out" | grep -q "FSDP_CUDA=ON but libtorch [^ ]* at [^ ]* is a CPU-only build"; then
    echo "ok   cmake -DFSDP_CUDA=ON with a CPU-only libtorch: refused by name"
  else
    echo "FAIL cmake -DFSDP_CUDA=ON with a CPU-only libtorch: exit $status"; cat "$scratch/out"; failures=$((failures + 1))
  fi
fi

echo "$failures failure(s)"
((failures == 0))
