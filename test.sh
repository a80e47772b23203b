#!/usr/bin/env bash
# Installs what is missing, builds, and runs every test (ctest; failing tests' output is shown).
# Exits non-zero when anything fails. FSDP_FLAVOR=cuda does the same on the CUDA build (build-cuda/:
# the GPU path compiled in, the CPU suite run on it; scripts/flavor.sh).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
"$root/scripts/setup.sh"
source "$root/scripts/flavor.sh"
cd "$fsdp_build_dir"
ctest --output-on-failure -j "${FSDP_TEST_JOBS:-$(nproc)}" "$@"
