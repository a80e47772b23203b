#!/usr/bin/env bash
# Builds the libFuzzer targets in fuzz/ with clang (AddressSanitizer and UndefinedBehaviorSanitizer
# on) and runs each for a while on its corpus, after replaying every saved regression input.
#
#   scripts/fuzz.sh [--seconds N]     N seconds per target (default 60)
#   scripts/fuzz.sh --runs N          N inputs per target, from a fixed seed (CI: ctest's fuzz_briefly);
#                                     with --seconds as well, whichever comes first
#   scripts/fuzz.sh --build-only      build the targets and stop (.ci/run builds them at full width
#                                     before ctest, whose fuzz_briefly then finds them up to date)
#
# Installs clang and libFuzzer's runtime from Debian's packages when missing. The seed corpus in
# fuzz/corpus/<target>/ is copied to build-fuzz/corpus/<target>/, where new inputs accumulate between
# runs; the repository's copy is never changed. A crash, a sanitizer report, a timeout or an
# out-of-memory exits non-zero and leaves the input in build-fuzz/artifacts/<target>/: copy it into
# fuzz/regressions/<target>/ with the fix, so that every later run replays it.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
seconds=""
runs=""
build_only=0
while (($#)); do
  case "$1" in
    --seconds) seconds="${2:?--seconds needs a number}"; shift 2 ;;
    --runs) runs="${2:?--runs needs a number}"; shift 2 ;;
    --build-only) build_only=1; shift ;;
    -h | --help) sed -n '2,16p' "$0"; exit 0 ;;
    *) echo "fuzz.sh: unknown argument '$1' (see --help)" >&2; exit 2 ;;
  esac
done
[[ -z "$seconds" || ( "$seconds" =~ ^[0-9]+$ && "$seconds" -gt 0 ) ]] || { echo "fuzz.sh: --seconds wants a positive whole number, got '$seconds'" >&2; exit 2; }
[[ -z "$runs" || ( "$runs" =~ ^[0-9]+$ && "$runs" -gt 0 ) ]] || { echo "fuzz.sh: --runs wants a positive whole number, got '$runs'" >&2; exit 2; }
[[ -n "$seconds" || -n "$runs" ]] || seconds=60
limits=()
[[ -z "$seconds" ]] || limits+=("-max_total_time=$seconds")
[[ -z "$runs" ]] || limits+=("-runs=$runs" -seed=1)
budget="${runs:+$runs inputs}${runs:+${seconds:+ or }}${seconds:+$seconds s}"

# Debian's default LLVM: 14 in Debian 12, 19 in Debian 13.
llvm=14
[[ "$(cut -d. -f1 /etc/debian_version 2>/dev/null)" == 13 ]] && llvm=19
clang="${FSDP_FUZZ_CLANG:-clang++-$llvm}"
if [[ -z "${FSDP_FUZZ_CLANG:-}" ]] && { ! command -v "$clang" >/dev/null || ! compgen -G "/usr/lib/llvm-$llvm/lib/clang/*/lib/*/libclang_rt.fuzzer*.a" >/dev/null; }; then
  echo "fuzz.sh: installing clang-$llvm and libclang-rt-$llvm-dev (libFuzzer)"
  sudo_prefix=()
  ((EUID == 0)) || sudo_prefix=(sudo)
  DEBIAN_FRONTEND=noninteractive "${sudo_prefix[@]}" apt-get install -y -qq --no-install-recommends "clang-$llvm" "libclang-rt-$llvm-dev" >/dev/null ||
    { echo "fuzz.sh: could not install clang-$llvm and libclang-rt-$llvm-dev; install them, or set FSDP_FUZZ_CLANG to a clang++ with libFuzzer" >&2; exit 1; }
fi

venv="${FSDP_VENV:-$root/.venv}"
torch_prefix="${FSDP_TORCH_PREFIX:-}"
if [[ -z "$torch_prefix" ]]; then
  [[ -x "$venv/bin/python" ]] || { echo "fuzz.sh: no venv at $venv: run scripts/setup.sh first, or set FSDP_VENV / FSDP_TORCH_PREFIX" >&2; exit 1; }
  torch_prefix="$("$venv/bin/python" -c 'import torch.utils; print(torch.utils.cmake_prefix_path)')"
fi
build="${FSDP_FUZZ_BUILD_DIR:-$root/build-fuzz}"
generator=()
command -v ninja >/dev/null && generator=(-G Ninja)
mkdir -p "$build"
if ! { cmake -S "$root/fuzz" -B "$build" "${generator[@]}" -DCMAKE_BUILD_TYPE=RelWithDebInfo "-DCMAKE_CXX_COMPILER=$clang" \
         "-DCMAKE_PREFIX_PATH=$torch_prefix" && cmake --build "$build" -j "${FSDP_BUILD_JOBS:-$(nproc)}"; } >"$build/build.log" 2>&1; then
  echo "fuzz.sh: building the fuzz targets failed:" >&2
  tail -n 40 "$build/build.log" >&2
  exit 1
fi
((!build_only)) || { echo "fuzz.sh: the fuzz targets are built in $build"; exit 0; }

status=0
for target in restricted_unpickler dcp_metadata safetensors sharded_metadata torch_file plugin_config llama_config; do
  binary="$build/${target}_fuzz"
  corpus="$build/corpus/$target"
  artifacts="$build/artifacts/$target"
  mkdir -p "$corpus" "$artifacts"
  cp -n "$root/fuzz/corpus/$target/"* "$corpus/" 2>/dev/null || true
  [[ "$target" == restricted_unpickler ]] && cp -n "$root/fuzz/corpus/dcp_metadata/"* "$corpus/" 2>/dev/null || true
  regressions=("$root/fuzz/regressions/$target/"*)
  if [[ -e "${regressions[0]}" ]]; then
    echo "fuzz.sh: $target: replaying ${#regressions[@]} regression inputs"
    "$binary" -rss_limit_mb=2048 -timeout=10 "${regressions[@]}" >"$build/$target.regressions.log" 2>&1 ||
      { echo "fuzz.sh: $target fails on a regression input:" >&2; tail -n 30 "$build/$target.regressions.log" >&2; status=1; continue; }
  fi
  echo "fuzz.sh: $target: fuzzing for $budget"
  if "$binary" "${limits[@]}" -rss_limit_mb=2048 -timeout=10 -print_final_stats=1 \
      "-artifact_prefix=$artifacts/" "$corpus" >"$build/$target.log" 2>&1; then
    echo "fuzz.sh: $target: $(grep -m1 -o 'stat::number_of_executed_units: *[0-9]*' "$build/$target.log" | grep -o '[0-9]*$') inputs, no failure (corpus $(ls "$corpus" | wc -l) files)"
  else
    echo "fuzz.sh: $target FAILED; the input is in $artifacts/:" >&2
    tail -n 40 "$build/$target.log" >&2
    status=1
  fi
done
exit "$status"
