#!/usr/bin/env bash
# Builds fsdp.cpp with AddressSanitizer and UndefinedBehaviorSanitizer (g++; -DFSDP_SANITIZE=ON) into
# build-sanitize/ and runs the test suite on that build. Any sanitizer report fails the test it
# happens in (halt_on_error, and UBSan does not recover). This is ./test.sh with FSDP_SANITIZE=1
# (scripts/flavor.sh), which FSDP_FLAVOR=cuda also takes (build-cuda-sanitize/: what .ci/run does).
#
#   scripts/sanitize.sh            the whole suite (about 3x the normal build and run time)
#   scripts/sanitize.sh --unit     the unit-labelled tests only
#   scripts/sanitize.sh -- ARGS    extra arguments for ctest (e.g. -- -R Checkpoint)
#
# Environment: FSDP_SANITIZE_BUILD_DIR (default build-sanitize/), FSDP_FLAVOR, FSDP_VENV,
# FSDP_BUILD_JOBS, FSDP_TEST_JOBS.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# Not run here: bench_smoke (the benchmarks measure, which instrumented code does not), consumer_project
# (a consumer built without the sanitizer cannot load an instrumented libfsdp: ASan's runtime must
# come first) and fuzz_briefly (the fuzz targets are clang builds under the same sanitizers already).
labels=(-E '^(bench_smoke|consumer_project|fuzz_briefly)$')
ctest_args=()
while (($#)); do
  case "$1" in
    --unit)
      # The unit tests need only their binary (the static checks read the sources); linkage checks the
      # other binaries, not built then.
      labels=(-L unit -E '^linkage$')
      export FSDP_BUILD_TARGETS="${FSDP_BUILD_TARGETS:-fsdp_unit_tests}"
      shift
      ;;
    --) shift; ctest_args=("$@"); break ;;
    -h | --help) sed -n '2,13p' "$0"; exit 0 ;;
    *) echo "sanitize.sh: unknown argument '$1' (see --help)" >&2; exit 2 ;;
  esac
done
export FSDP_SANITIZE=1
[[ -z "${FSDP_SANITIZE_BUILD_DIR:-}" ]] || export FSDP_BUILD_DIR="$FSDP_SANITIZE_BUILD_DIR"
exec "$root/test.sh" "${labels[@]}" ${ctest_args[@]+"${ctest_args[@]}"}
