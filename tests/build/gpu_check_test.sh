#!/usr/bin/env bash
# scripts/gpu-check.sh on a machine without a GPU: every step that can run here. Its argument
# parsing (usage errors exit 2 naming the argument), the detection step against the venv's torch
# (a CPU torch is named as CPU-only; a CUDA torch without a GPU as seeing none, after nccl.h and
# cuBLAS's headers were found) with the JSON it writes either way, and a --build-only run whose
# --deps folder is not a prepared one. With --prepare, also `--prepare DIR` itself (it downloads
# Debian packages) and what DIR then holds.
#
#   gpu_check_test.sh SOURCE_ROOT VENV_PYTHON [--prepare]
set -uo pipefail
root="$1"
python="$2"
check="$root/scripts/gpu-check.sh"
scratch="$(mktemp -d)"
trap 'rm -rf "$scratch"' EXIT
failures=0
fail() {
  echo "FAILED: $*"
  failures=$((failures + 1))
}
# expect NAME STATUS PATTERN -- COMMAND...: the command exits STATUS and its output matches PATTERN.
expect() {
  local name="$1" status="$2" pattern="$3"
  shift 4
  "$@" >"$scratch/out" 2>&1
  local actual=$?
  if [[ $actual -ne $status ]]; then
    fail "$name: exit $actual, expected $status; output:"
    cat "$scratch/out"
  elif ! grep -qE -- "$pattern" "$scratch/out"; then
    fail "$name: output does not match /$pattern/:"
    cat "$scratch/out"
  else
    echo "ok: $name"
  fi
}
# json_field FILE EXPRESSION: a Python expression over the document `d`.
json_field() { "$python" -c "import json,sys; d=json.load(open(sys.argv[1])); print($2)" "$1"; }

if [[ "${3:-}" == --prepare ]]; then
  expect "prepare" 0 "prepared .*; on the GPU machine run" -- "$check" --prepare "$scratch/deps"
  for file in root/usr/include/nlohmann/json.hpp root/usr/include/CLI/CLI.hpp root/usr/include/yaml-cpp/yaml.h \
    root/usr/include/gloo/rendezvous/store.h root/usr/include/gtest/gtest.h \
    root/usr/lib/x86_64-linux-gnu/libgtest.a root/usr/lib/x86_64-linux-gnu/cmake/GTest/GTestConfig.cmake \
    root/usr/lib/x86_64-linux-gnu/cmake/yaml-cpp/yaml-cpp-config.cmake manifest.json; do
    [[ -e "$scratch/deps/$file" ]] && echo "ok: prepared $file" || fail "prepare: $file is missing"
  done
  ls "$scratch"/deps/root/usr/lib/x86_64-linux-gnu/libyaml-cpp.so.0.7* >/dev/null 2>&1 && echo "ok: prepared libyaml-cpp.so.0.7" ||
    fail "prepare: the yaml-cpp runtime library is missing"
  [[ "$(json_field "$scratch/deps/manifest.json" 'sorted(d["packages"])')" == *libgloo-dev* ]] && echo "ok: manifest" ||
    fail "prepare: the manifest does not list libgloo-dev"
  size_kib="$(du -sk "$scratch/deps" | cut -f1)"
  ((size_kib < 32 * 1024)) && echo "ok: prepared folder is ${size_kib} KiB (a GPU machine receives at most 64 MiB)" ||
    fail "prepare: the folder is ${size_kib} KiB, too much to carry"
  exit $((failures > 0))
fi

expect "help" 0 "--prepare DIR" -- "$check" --help
expect "unknown argument" 2 "unknown argument '--bogus'" -- "$check" --bogus
expect "value missing" 2 "--output needs a value" -- "$check" --deps x --output
expect "not a number" 2 "--jobs must be a positive whole number, got 'many'" -- "$check" --deps x --jobs many
expect "deps required" 2 "--deps DIR is required" -- "$check"

# Detection against the venv's torch: it fails here either way (no GPU), and says why in the JSON.
cuda_torch="$("$python" -c 'import torch; print(int(torch.version.cuda is not None))')"
if ((cuda_torch)); then
  reason="sees no GPU"
else
  reason="is a CPU-only build"
fi
expect "detect" 1 "detect: fail .*$reason" -- "$check" --detect-only --python "$python" --output "$scratch/detect.json"
if [[ -f "$scratch/detect.json" ]]; then
  [[ "$(json_field "$scratch/detect.json" 'd["passed"], d["failed_steps"], d["mode"], d["schema"]')" == \
    "False ['detect'] detect fsdp.cpp/gpu-check/1" ]] && echo "ok: detect JSON" ||
    fail "detect JSON: $(cat "$scratch/detect.json")"
  [[ "$(json_field "$scratch/detect.json" 'd["machine"]["torch_version"] == __import__("torch").__version__')" == True ]] &&
    echo "ok: detect JSON names the torch" || fail "detect JSON does not name the venv's torch"
  if ((cuda_torch)); then
    [[ "$(json_field "$scratch/detect.json" 'bool(d["machine"]["nccl_include"]) and bool(d["machine"]["cuda_library_include"])')" == True ]] &&
      echo "ok: nccl.h and cuBLAS's headers found in the CUDA wheel" || fail "detection missed nccl.h or cublas_v2.h: $(cat "$scratch/detect.json")"
  fi
else
  fail "detect wrote no JSON"
fi
# A --deps folder that --prepare did not fill is named before CMake runs (the build step runs
# without a GPU, so a CUDA torch reaches it).
if ((cuda_torch)); then
  mkdir -p "$scratch/empty"
  expect "unprepared deps" 1 "configure: fail .*is not a folder that 'scripts/gpu-check.sh --prepare" -- \
    "$check" --build-only --deps "$scratch/empty" --python "$python" --output "$scratch/build.json"
fi
# A python that is not there.
expect "no python" 1 "no '/nonexistent/python3' on the PATH" -- "$check" --detect-only --python /nonexistent/python3 \
  --output "$scratch/none.json"

# The JSON writer on its own.
if "$python" "$root/tests/build/gpu_check_report_test.py" "$root/scripts/gpu_check_report.py" >"$scratch/out" 2>&1; then
  echo "ok: gpu_check_report_test.py"
else
  fail "gpu_check_report_test.py:"
  cat "$scratch/out"
fi
echo "$failures failed"
exit $((failures > 0))
