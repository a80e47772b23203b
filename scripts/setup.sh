#!/usr/bin/env bash
# Installs what fsdp.cpp needs, if anything is missing, then configures and builds into build/:
#   1. Debian packages: the compiler, CMake, Ninja, the header libraries, Gloo's headers, clang
#      with libFuzzer for the fuzz targets, and Open MPI's mpirun, a launcher the tests run under.
#   2. The project venv (.venv/, git-ignored) with requirements.txt: torch 2.13.0, whose libtorch
#      the build links, and the peers (accelerate, transformers, safetensors, numpy) that tests and
#      benchmarks compare against. The binaries never need Python: they find libtorch by RPATH.
#   3. CMake against that libtorch (or FSDP_TORCH_PREFIX), then an incremental build.
# Idempotent: with everything present it only runs an incremental build.
#
#   scripts/setup.sh            everything: the peers in the venv, every target (what ./test.sh needs)
#   scripts/setup.sh --for-run  what ./run.sh needs: torch alone in the venv (at requirements.txt's
#                               pins) and the two programs it runs, `fsdp` and `train_llama`; a later
#                               scripts/setup.sh adds the rest to the same venv and build
#   scripts/setup.sh --venv-only  the packages and the venv, no build (.ci/run installs the CUDA
#                               flavour's venv this way while the CPU flavour builds)
#
# Each step prints the seconds it took ("setup.sh: cpu venv took N s"); with FSDP_PHASE_LOG set it
# also appends them to that file (.ci/run's summary). FSDP_SANITIZE=1 (scripts/flavor.sh) builds the
# flavour with the sanitizers into its own folder.
# FSDP_FLAVOR=cuda (scripts/flavor.sh) does the same with requirements-cuda.txt (the CUDA torch
# 2.14.1 wheel) into .venv-cuda/ and build-cuda/, compiling the GPU path; it needs a CUDA toolkit
# (nvcc and its headers, /usr/local/cuda or CUDA_HOME), which Caffe2's CMake code looks for.
# Environment: FSDP_FLAVOR (cpu or cuda; default cpu), FSDP_BUILD_DIR (default build/ or build-cuda/),
# FSDP_VENV (default .venv/ or .venv-cuda/), FSDP_PYTHON (the Python
# that creates the venv; default python3.11, else python3), FSDP_TORCH_PREFIX (another libtorch:
# its directory holding share/cmake/Torch, e.g. an unpacked official libtorch archive),
# FSDP_BUILD_JOBS. Used by run.sh and test.sh; usable alone: scripts/setup.sh
# FSDP_BUILD_TARGETS: the targets to build, space-separated, instead of the mode's (e.g. .ci/run's
# CUDA flavour builds the library, the tools, the unit and GPU tests and the benchmarks only).
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$root/scripts/flavor.sh"
for_run=0
venv_only=0
while (($#)); do
  case "$1" in
    --for-run) for_run=1; shift ;;
    --venv-only) venv_only=1; shift ;;
    -h | --help) sed -n '2,30p' "$0"; exit 0 ;;
    *) echo "setup: unknown argument '$1'; expected --for-run, --venv-only or nothing (see --help)" >&2; exit 2 ;;
  esac
done
build_dir="$fsdp_build_dir"
venv="$fsdp_venv"
requirements="$fsdp_requirements"
min_torch=2.11

fail() {
  echo "setup: $*" >&2
  exit 1
}

# --- 1. Debian packages -------------------------------------------------------------------------
[[ -r /etc/debian_version ]] ||
  fail "no /etc/debian_version: this script installs Debian 12/13 packages. Elsewhere install a C++20 compiler, CMake >= 3.18, Ninja, nlohmann-json, yaml-cpp, CLI11, GoogleTest and Gloo's headers, then run cmake as the README says."
debian_major="$(cut -d. -f1 /etc/debian_version)"
case "$debian_major" in
  12 | 13) ;;
  *) echo "setup: warning: Debian '$(cat /etc/debian_version)' is untested (tested: 12 and 13); going on" >&2 ;;
esac

packages=(
  g++ cmake ninja-build
  nlohmann-json3-dev libyaml-cpp-dev libcli11-dev libgtest-dev
  libgloo-dev  # headers only, for the declarations c10d's ProcessGroupGloo.hpp includes; never linked
  zlib1g-dev   # the reference CRC-32 of the unit tests (tests/io/crc32_test.cpp), which CMake configures; never linked by the library
)
# The fuzz targets only (scripts/fuzz.sh): clang and libFuzzer's runtime, Debian's default LLVM
# (14 in Debian 12; 19 in Debian 13, which these scripts have not met yet).
if ((!for_run)); then
  case "$debian_major" in
    12) packages+=(clang-14 libclang-rt-14-dev) ;;
    13) packages+=(clang-19 libclang-rt-19-dev) ;;
  esac
  # The tests only: Open MPI's mpirun, a real launcher the programs run under
  # (tests/launch/real_launchers_test.cpp). The binaries never link MPI.
  packages+=(openmpi-bin)
fi

# The Python that creates the venv. The torch 2.13.0 wheel of these machines is for Python 3.11.
python="${FSDP_PYTHON:-}"
if [[ -z "$python" ]]; then
  if command -v python3.11 >/dev/null; then python=python3.11; else python=python3; fi
fi
python_path="$(command -v "$python" || true)"
if [[ -z "$python_path" ]]; then
  if [[ -n "${FSDP_PYTHON:-}" ]]; then fail "FSDP_PYTHON='$FSDP_PYTHON' is not an executable; point it at a Python 3.11 (or unset it)."; fi
  packages+=(python3 python3-venv)
elif [[ "$python_path" == /usr/bin/* ]] && ! "$python_path" -c 'import ensurepip, venv' 2>/dev/null; then
  # Debian splits venv (and the pip it bootstraps) out of its Python.
  packages+=("python$("$python_path" -c 'import sys; print("%d.%d" % sys.version_info[:2])')-venv")
fi

missing=()
for package in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$package" 2>/dev/null | grep -q "install ok installed" || missing+=("$package")
done
if ((${#missing[@]})); then
  echo "setup: installing missing Debian packages: ${missing[*]}"
  sudo_prefix=()
  if [[ $(id -u) -ne 0 ]]; then
    command -v sudo >/dev/null || fail "need root (or sudo) to install: ${missing[*]}"
    sudo_prefix=(sudo)
  fi
  "${sudo_prefix[@]}" apt-get update -qq
  DEBIAN_FRONTEND=noninteractive "${sudo_prefix[@]}" apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi
python_path="$(command -v "$python" || true)"
[[ -n "$python_path" ]] || fail "no '$python' on PATH after installing python3; set FSDP_PYTHON to a Python 3.11."
"$python_path" -c 'import venv, ensurepip' 2>/dev/null ||
  fail "$python_path has no venv/ensurepip module, which the project venv needs. Fix: apt-get install python3-venv (Debian's Python), or set FSDP_PYTHON to a Python that has venv."
fsdp_step_done "$fsdp_flavor_name: Debian packages"

# --- 2. The project venv ------------------------------------------------------------------------
venv_python="$venv/bin/python"
if [[ -e "$venv" ]] && ! "$venv_python" -c 'import sys' >/dev/null 2>&1; then
  echo "setup: $venv is broken (its python does not start, e.g. the Python it was made from is gone); recreating it"
  rm -rf "$venv"
fi
if [[ ! -e "$venv" ]]; then
  echo "setup: creating the project venv $venv with $python_path ($("$python_path" --version 2>&1))"
  "$python_path" -m venv "$venv" || fail "'$python_path -m venv $venv' failed (see above). Fix: apt-get install python3-venv, or set FSDP_PYTHON."
fi
# The stamp holds the hash of the requirements file installed: alone for all of it, after "torch-only "
# for --for-run's install of torch and its own dependencies at that file's pins (-c: as constraints).
stamp="$venv/.fsdp-requirements.sha256"
wanted="$(sha256sum "$requirements" | cut -d' ' -f1)"
installed="$(cat "$stamp" 2>/dev/null || true)"
satisfied=0
if ((for_run)); then
  [[ "$installed" == "$wanted" || "$installed" == "torch-only $wanted" ]] && satisfied=1
  pip_arguments=(-c "$requirements" "$(grep -m1 -E '^torch==' "$requirements")")
  what="torch (at $(basename "$requirements")'s pins)"
  new_stamp="torch-only $wanted"
else
  [[ "$installed" == "$wanted" ]] && satisfied=1
  pip_arguments=(-r "$requirements")
  what="$(basename "$requirements")"
  new_stamp="$wanted"
fi
if ((!satisfied)) || ! "$venv_python" -c 'import torch' >/dev/null 2>&1; then
  echo "setup: installing $what into $venv"
  mkdir -p "$build_dir"
  log="$build_dir/pip-install.log"
  if ! "$venv_python" -m pip install --no-input --disable-pip-version-check "${pip_arguments[@]}" >"$log" 2>&1; then
    tail -n 15 "$log" >&2
    fail "pip could not install $what into $venv (full log: $log). Its torch comes from the machine's wheel cache for Python 3.11 ($("$venv_python" --version 2>&1) here); set FSDP_PYTHON to a Python 3.11, or remove $venv and retry."
  fi
  echo "$new_stamp" >"$stamp"
fi
if ((for_run)); then
  "$venv_python" -c 'import torch' 2>/dev/null ||
    fail "$venv has no importable torch although it was installed. Fix: rm -rf $venv and run scripts/setup.sh again."
else
  "$venv_python" -c 'import torch, accelerate, transformers, safetensors, numpy' 2>/dev/null ||
    fail "$venv lacks one of torch, accelerate, transformers, safetensors, numpy although $(basename "$requirements") was installed. Fix: rm -rf $venv and run scripts/setup.sh again."
fi
fsdp_step_done "$fsdp_flavor_name: venv"
((!venv_only)) || exit 0

# --- 3. libtorch, CMake, build ------------------------------------------------------------------
if [[ -n "${FSDP_TORCH_PREFIX:-}" ]]; then
  torch_prefix="$FSDP_TORCH_PREFIX"
  [[ -d "$torch_prefix" ]] || fail "FSDP_TORCH_PREFIX='$torch_prefix' is not a directory; point it at a libtorch (the folder holding share/cmake/Torch)."
else
  torch_prefix="$("$venv_python" -c 'import torch.utils; print(torch.utils.cmake_prefix_path)' 2>/dev/null)" ||
    fail "the venv's torch does not say where its libtorch is (torch.utils.cmake_prefix_path). Fix: rm -rf $venv and run scripts/setup.sh again."
fi
torch_version_file="$(find "$torch_prefix" -maxdepth 4 -name TorchConfigVersion.cmake -path '*Torch*' 2>/dev/null | head -n 1)"
[[ -n "$torch_version_file" ]] || fail "no TorchConfigVersion.cmake under '$torch_prefix': that is not a libtorch. Fix: unset FSDP_TORCH_PREFIX or point it at a libtorch >= $min_torch."
torch_version="$(sed -n 's/^set(PACKAGE_VERSION "\([^"]*\)").*/\1/p' "$torch_version_file")"
if [[ "$(printf '%s\n%s\n' "$min_torch" "$torch_version" | sort -V | head -n 1)" != "$min_torch" ]]; then
  fail "libtorch $torch_version at $torch_prefix is too old: fsdp.cpp needs libtorch >= $min_torch. Fix: unset FSDP_TORCH_PREFIX (the venv's torch is used) or point it at a newer libtorch."
fi
cuda_arguments=()
if [[ "$fsdp_flavor" == cuda ]]; then
  # Caffe2's CMake code (FindCUDA) needs a toolkit: nvcc and cuda_runtime.h. The cuBLAS and NCCL
  # headers come from the venv's nvidia packages (CMakeLists.txt finds them).
  cuda_home="${CUDA_HOME:-/usr/local/cuda}"
  [[ -x "$cuda_home/bin/nvcc" && -r "$cuda_home/include/cuda_runtime.h" ]] ||
    fail "FSDP_FLAVOR=cuda needs a CUDA toolkit (bin/nvcc and include/cuda_runtime.h) at $cuda_home, which a CUDA libtorch's CMake code looks for; none is there. Fix: install the CUDA toolkit (13.x for the torch 2.14.1 wheel) or set CUDA_HOME to it; or build the CPU flavour (unset FSDP_FLAVOR)."
  cuda_arguments=(-DFSDP_CUDA=ON "-DCUDA_TOOLKIT_ROOT_DIR=$cuda_home")
fi

# Reconfigure from scratch when the cache points at another libtorch (say, a build made before the
# switch from Debian's libtorch 1.13): CMake cannot change a found package in place.
cache="$build_dir/CMakeCache.txt"
if [[ -f "$cache" ]] && ! grep -qx "CMAKE_PREFIX_PATH:[A-Z]*=$torch_prefix" "$cache"; then
  echo "setup: $build_dir was configured against another libtorch; configuring it again"
  rm -rf "$cache" "$build_dir/CMakeFiles"
fi
jobs="${FSDP_BUILD_JOBS:-$(nproc)}"
build_arguments=(-DCMAKE_BUILD_TYPE=Release)
if [[ "$fsdp_sanitize" == 1 ]]; then
  # -O1 -g1: sanitizer reports with line numbers, compiling faster than -O2 -g.
  build_arguments=(-DCMAKE_BUILD_TYPE=RelWithDebInfo "-DCMAKE_CXX_FLAGS_RELWITHDEBINFO=-O1 -g1" -DFSDP_SANITIZE=ON)
fi
if ((!for_run)); then
  # Warnings as errors in the tests' build, except under the sanitizers, whose -O1 gives GCC's flow
  # analysis false positives (-Wmaybe-uninitialized) that a user's build must not fail on.
  test_options=()
  [[ "$fsdp_sanitize" == 1 ]] || test_options+=(-DFSDP_WERROR=ON)
  build_arguments+=("${test_options[@]}")
  for option in "${test_options[@]}"; do
    setting="${option#-D}"
    if [[ -f "$cache" ]] && ! grep -qx "${setting%%=*}:BOOL=ON" "$cache"; then
      cmake -S "$root" -B "$build_dir" "$option" >/dev/null ||
        fail "CMake could not turn on ${setting%%=*} in $build_dir (its error is above)."
    fi
  done
fi
if [[ ! -f "$cache" ]]; then
  cmake -S "$root" -B "$build_dir" -G Ninja "${build_arguments[@]}" \
    "-DCMAKE_PREFIX_PATH=$torch_prefix" "-DFSDP_TEST_PYTHON=$venv_python" ${cuda_arguments[@]+"${cuda_arguments[@]}"} ||
    fail "CMake could not configure $build_dir (its error is above)."
fi
targets=()
if [[ -n "${FSDP_BUILD_TARGETS:-}" ]]; then
  read -r -a targets <<<"$FSDP_BUILD_TARGETS"
elif ((for_run)); then
  targets=(fsdp_cli train_llama)
fi
cmake --build "$build_dir" -j "$jobs" ${targets[@]+--target "${targets[@]}"}
if ((${#targets[@]} == 0)); then
  fsdp_step_done "$fsdp_flavor_name: build"
elif ((${#targets[@]} <= 3)); then
  fsdp_step_done "$fsdp_flavor_name: build (${targets[*]})"
else
  fsdp_step_done "$fsdp_flavor_name: build (${#targets[@]} targets: FSDP_BUILD_TARGETS)"
fi
