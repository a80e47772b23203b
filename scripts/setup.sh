#!/usr/bin/env bash
# Installs the Debian packages fsdp.cpp needs, if any are missing, then configures and builds into
# build/. Idempotent: with everything present it only runs an incremental build.
# Sourced by run.sh and test.sh; usable alone: scripts/setup.sh
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
build_dir="${FSDP_BUILD_DIR:-$root/build}"

packages=(
  g++ cmake ninja-build
  libtorch-dev libgloo-dev
  nlohmann-json3-dev libyaml-cpp-dev libcli11-dev libspdlog-dev
  libgtest-dev libbenchmark-dev
  python3-torch  # a peer for tests and benchmarks only; never needed at run time
)

missing=()
for package in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$package" 2>/dev/null | grep -q "install ok installed" || missing+=("$package")
done
if ((${#missing[@]})); then
  echo "setup: installing missing Debian packages: ${missing[*]}"
  sudo_prefix=()
  if [[ $(id -u) -ne 0 ]]; then
    command -v sudo >/dev/null || { echo "setup: need root (or sudo) to install: ${missing[*]}" >&2; exit 1; }
    sudo_prefix=(sudo)
  fi
  "${sudo_prefix[@]}" apt-get update -qq
  DEBIAN_FRONTEND=noninteractive "${sudo_prefix[@]}" apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi

jobs="${FSDP_BUILD_JOBS:-$(nproc)}"
if [[ ! -f "$build_dir/CMakeCache.txt" ]]; then
  cmake -S "$root" -B "$build_dir" -G Ninja -DCMAKE_BUILD_TYPE=Release
fi
cmake --build "$build_dir" -j "$jobs"
