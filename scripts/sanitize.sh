#!/usr/bin/env bash
# Builds fsdp.cpp with AddressSanitizer and UndefinedBehaviorSanitizer (g++; -DFSDP_SANITIZE=ON) into
# build-sanitize/ and runs the test suite on that build. Any sanitizer report fails the test it
# happens in (halt_on_error, and UBSan does not recover).
#
#   scripts/sanitize.sh            the whole suite (about 3x the normal build and run time)
#   scripts/sanitize.sh --unit     the unit-labelled tests only (what CI runs)
#   scripts/sanitize.sh -- ARGS    extra arguments for ctest (e.g. -- -R Checkpoint)
#
# Environment: FSDP_SANITIZE_BUILD_DIR (default build-sanitize/), FSDP_VENV (default .venv/; made
# by scripts/setup.sh when missing), FSDP_BUILD_JOBS, FSDP_TEST_JOBS.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# Not run here: bench_smoke (the benchmarks are not built in this configuration), consumer_project
# (a consumer built without the sanitizer cannot load an instrumented libfsdp: ASan's runtime must
# come first) and fuzz_briefly (the fuzz targets are clang builds under the same sanitizers already).
labels=(-E '^(bench_smoke|consumer_project|fuzz_briefly)$')
ctest_args=()
while (($#)); do
  case "$1" in
    --unit) labels=(-L unit -E '^linkage$'); shift ;;  # linkage checks the other binaries, not built here
    --) shift; ctest_args=("$@"); break ;;
    -h | --help) sed -n '2,12p' "$0"; exit 0 ;;
    *) echo "sanitize.sh: unknown argument '$1' (see --help)" >&2; exit 2 ;;
  esac
done
venv="${FSDP_VENV:-$root/.venv}"
[[ -x "$venv/bin/python" ]] || "$root/scripts/setup.sh"
torch_prefix="$("$venv/bin/python" -c 'import torch.utils; print(torch.utils.cmake_prefix_path)')"
build="${FSDP_SANITIZE_BUILD_DIR:-$root/build-sanitize}"
jobs="${FSDP_BUILD_JOBS:-$(nproc)}"
if [[ ! -f "$build/CMakeCache.txt" ]]; then
  # -O1 -g1: sanitizer reports with line numbers, compiling faster than -O2 -g.
  cmake -S "$root" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo "-DCMAKE_CXX_FLAGS_RELWITHDEBINFO=-O1 -g1" -DFSDP_SANITIZE=ON \
    -DFSDP_BUILD_BENCHMARKS=OFF "-DCMAKE_PREFIX_PATH=$torch_prefix" "-DFSDP_TEST_PYTHON=$venv/bin/python" >/dev/null
fi
if [[ "${labels[0]}" == -L ]]; then
  # The unit tests need only their binary (the static checks read the sources).
  cmake --build "$build" -j "$jobs" --target fsdp_unit_tests
else
  cmake --build "$build" -j "$jobs"
fi
# Leak checking is off: libtorch's registries live until exit by design and would be reported.
export ASAN_OPTIONS="${ASAN_OPTIONS:-halt_on_error=1:detect_leaks=0:abort_on_error=0}"
export UBSAN_OPTIONS="${UBSAN_OPTIONS:-halt_on_error=1:print_stacktrace=1}"
cd "$build"
ctest --output-on-failure -j "${FSDP_TEST_JOBS:-$(nproc)}" "${labels[@]}" "${ctest_args[@]}"
