#!/usr/bin/env bash
# Installs what is missing, builds, and runs every test (ctest; failing tests' output is shown).
# Exits non-zero when anything fails.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
"$root/scripts/setup.sh"
build_dir="${FSDP_BUILD_DIR:-$root/build}"
cd "$build_dir"
ctest --output-on-failure -j "${FSDP_TEST_JOBS:-$(nproc)}" "$@"
