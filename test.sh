#!/usr/bin/env bash
# Installs what is missing, builds, and runs every test (ctest; failing tests' output is shown).
# Exits non-zero when anything fails. Arguments go to ctest (e.g. -L unit, -LE long).
# FSDP_FLAVOR=cuda does the same on the CUDA build (build-cuda/: the GPU path compiled in, the CPU
# suite run on it), FSDP_SANITIZE=1 on a build with the sanitizers (scripts/flavor.sh).
# FSDP_BUILD_TARGETS builds only those targets (scripts/setup.sh); the tests then select the ones
# whose binaries exist (e.g. -L unit needs fsdp_unit_tests, fsdp_cli and train_llama).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
"$root/scripts/setup.sh"
source "$root/scripts/flavor.sh"
# fuzz_briefly's clang build, when it is among the tests to run: here on every core, before ctest,
# where it would build on one core beside the other tests (scripts/fuzz.sh --build-only).
# (grep reads the whole listing: with -q it could leave before ctest finishes writing, and pipefail
# would then take ctest's SIGPIPE for "not listed".)
if ctest --test-dir "$fsdp_build_dir" -N "$@" | grep ' fuzz_briefly$' >/dev/null; then
  FSDP_FUZZ_BUILD_DIR="$fsdp_build_dir/tests/fuzz" FSDP_VENV="$fsdp_venv" "$root/scripts/fuzz.sh" --build-only
  fsdp_step_done "$fsdp_flavor_name: build the fuzz targets (clang)"
fi
# ctest ends with its "Label Time Summary": each label's test time, in seconds times processors.
status=0
# Without FSDP_PHASE_LOG: tests that run setup.sh (setup_errors, gpu_check) would add their steps.
env -u FSDP_PHASE_LOG ctest --test-dir "$fsdp_build_dir" --output-on-failure -j "${FSDP_TEST_JOBS:-$(nproc)}" "$@" || status=$?
fsdp_step_done "$fsdp_flavor_name: tests (ctest${*:+ $*})"
exit "$status"
