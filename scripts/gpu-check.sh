#!/usr/bin/env bash
# The GPU check: one command for a machine with NVIDIA GPUs and a CUDA PyTorch, which builds the CUDA
# configuration of fsdp.cpp, runs the GPU tests and the GPU benchmark, and writes one JSON of results.
#
#   scripts/gpu-check.sh --prepare DIR     on a Debian machine with its package archive (here): gathers
#                                          what the build needs beyond a GPU machine's own PyTorch
#                                          (Debian's header libraries, yaml-cpp, GoogleTest, Gloo's
#                                          headers) into DIR, unpacked; a few MB
#   scripts/gpu-check.sh --deps DIR [--output FILE] [--python PY] [--build-dir B] [--jobs N]
#                        [--no-bench] [--bench-steps N] [--detect-only] [--build-only]
#                                          on the GPU machine: detect, build, test, benchmark
#
# The GPU machine needs: python3 with a CUDA PyTorch >= 2.11 (and its nvidia-nccl and cuBLAS
# headers, which the CUDA wheels ship), accelerate and transformers for the peers, CMake >= 3.18,
# ninja, a C++20 g++, and nvcc with its headers (CUDA_HOME, else /usr/local/cuda). No network, no
# Debian -dev packages: everything else comes from DIR. It exits 0 only when every step passed;
# the JSON (default gpu-check.json) says what each step did, with the tests' and benchmarks' figures.
#
#   --deps DIR       the folder --prepare filled (required, except with --detect-only)
#   --output FILE    the JSON of results (default: gpu-check.json in the current directory)
#   --python PY      the Python holding the CUDA PyTorch (default: python3)
#   --build-dir B    where the CUDA configuration is built (default: build-gpu/ in the checkout)
#   --jobs N         build jobs (default: nproc)
#   --no-bench       skip the benchmark
#   --bench-steps N  timed steps per benchmark run (default 10)
#   --detect-only    only the detection step (what would be built against), then the JSON
#   --build-only     detection, configure and build; no tests or benchmark (runs without a GPU)
#   --time-limit S   stop starting new steps after S seconds (default 480: the 8-minute budget)
set -uo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
report_tool="$root/scripts/gpu_check_report.py"
# The JSON writer needs only the standard library: any python3 (the one given with --python, below,
# may be the one that is missing).
report_python="$(command -v python3 || command -v python || true)"

usage() { sed -n '2,33p' "$0" | sed 's/^# \{0,1\}//'; }
die_usage() {
  echo "gpu-check: $*" >&2
  echo "gpu-check: see 'scripts/gpu-check.sh --help'" >&2
  exit 2
}

prepare_dir=""
deps=""
output="$PWD/gpu-check.json"
python="python3"
build_dir="$root/build-gpu"
jobs="$(nproc 2>/dev/null || echo 4)"
bench=1
bench_steps=10
mode=full
time_limit=480
need_value() { [[ $# -ge 2 && -n "$2" && "$2" != --* ]] || die_usage "$1 needs a value"; }
while (($#)); do
  case "$1" in
    --prepare) need_value "$@"; prepare_dir="$2"; shift 2 ;;
    --deps) need_value "$@"; deps="$2"; shift 2 ;;
    --output) need_value "$@"; output="$2"; shift 2 ;;
    --python) need_value "$@"; python="$2"; shift 2 ;;
    --build-dir) need_value "$@"; build_dir="$2"; shift 2 ;;
    --jobs) need_value "$@"; jobs="$2"; shift 2 ;;
    --bench-steps) need_value "$@"; bench_steps="$2"; shift 2 ;;
    --time-limit) need_value "$@"; time_limit="$2"; shift 2 ;;
    --no-bench) bench=0; shift ;;
    --detect-only) mode=detect; shift ;;
    --build-only) mode=build; shift ;;
    -h | --help) usage; exit 0 ;;
    *) die_usage "unknown argument '$1'" ;;
  esac
done
for number in jobs bench_steps time_limit; do
  [[ "${!number}" =~ ^[1-9][0-9]*$ ]] || die_usage "--${number//_/-} must be a positive whole number, got '${!number}'"
done

# --- --prepare: on a Debian machine that reaches its package archive ------------------------------
# The packages whose files the build uses, and what it uses of each.
prepare_packages=(
  nlohmann-json3-dev  # header-only JSON
  libcli11-dev        # header-only command lines
  libyaml-cpp-dev     # yaml-cpp's headers, CMake package, libyaml-cpp.so link
  libyaml-cpp0.7      # libyaml-cpp.so.0.7, loaded at run time (the binaries' RPATH points here)
  libgtest-dev        # GoogleTest's headers, libgtest.a, CMake package
  libgloo-dev         # Gloo's headers: declarations for c10d's ProcessGroupGloo.hpp, never linked
)
if [[ -n "$prepare_dir" ]]; then
  [[ -r /etc/debian_version ]] || { echo "gpu-check: --prepare downloads Debian packages, and this is not Debian (no /etc/debian_version). Run it on a Debian 12 machine." >&2; exit 1; }
  mkdir -p "$prepare_dir/debs" "$prepare_dir/root" || exit 1
  prepare_dir="$(cd "$prepare_dir" && pwd)"
  echo "gpu-check: downloading ${prepare_packages[*]} into $prepare_dir/debs"
  if ! (cd "$prepare_dir/debs" && apt-get download "${prepare_packages[@]}" >"$prepare_dir/apt.log" 2>&1); then
    # A fresh machine's package lists may be missing; fetch them once and try again.
    apt-get update -qq >>"$prepare_dir/apt.log" 2>&1 || true
    (cd "$prepare_dir/debs" && apt-get download "${prepare_packages[@]}" >>"$prepare_dir/apt.log" 2>&1) || {
      tail -n 5 "$prepare_dir/apt.log" >&2
      echo "gpu-check: apt-get download failed (log: $prepare_dir/apt.log). This step needs Debian's package archive; the GPU machine itself has none." >&2
      exit 1
    }
  fi
  rm -rf "$prepare_dir/root" && mkdir -p "$prepare_dir/root"
  for deb in "$prepare_dir"/debs/*.deb; do
    dpkg-deb -x "$deb" "$prepare_dir/root" || { echo "gpu-check: could not unpack $deb" >&2; exit 1; }
  done
  # What is in it, for the check's JSON and for a person.
  {
    echo "{\"debian\": \"$(cat /etc/debian_version)\", \"packages\": {"
    first=1
    for deb in "$prepare_dir"/debs/*.deb; do
      ((first)) || echo ","
      first=0
      printf '  "%s": "%s"' "$(dpkg-deb -f "$deb" Package)" "$(dpkg-deb -f "$deb" Version)"
    done
    echo "}}"
  } >"$prepare_dir/manifest.json"
  rm -rf "$prepare_dir/debs"
  echo "gpu-check: prepared $prepare_dir ($(du -sh "$prepare_dir" | cut -f1)); on the GPU machine run scripts/gpu-check.sh --deps $prepare_dir"
  exit 0
fi

# --- the check ------------------------------------------------------------------------------------
[[ -n "$report_python" ]] || { echo "gpu-check: no python3 on the PATH, which writes the JSON of results" >&2; exit 1; }
[[ -n "$deps" || "$mode" == detect ]] || die_usage "--deps DIR is required (the folder 'scripts/gpu-check.sh --prepare DIR' filled on a Debian machine)"
output_dir="$(dirname "$output")"
mkdir -p "$output_dir" || { echo "gpu-check: cannot create $output_dir for --output" >&2; exit 1; }
work="$(mktemp -d "${TMPDIR:-/tmp}/gpu-check.XXXXXX")"
steps="$work/steps.jsonl"
: >"$steps"
started=$SECONDS
failed=0

# record NAME STATUS SECONDS DETAIL [LOG]: one step of the JSON (scripts/gpu_check_report.py).
record() {
  local log_args=()
  [[ $# -ge 5 && -f "$5" ]] && log_args=(--log "$5")
  "$report_python" "$report_tool" step --file "$steps" --name "$1" --status "$2" --seconds "$3" --detail "$4" "${log_args[@]}" ||
    echo "gpu-check: could not record step $1" >&2
  [[ "$2" == fail ]] && failed=1
  echo "gpu-check: $1: $2 ($3 s) $4"
}
finish() {
  local extra=()
  [[ -f "$work/detect.json" ]] && extra+=(--detect "$work/detect.json")
  [[ -f "$work/gpu-tests.json" ]] && extra+=(--gtest "$work/gpu-tests.json")
  for result in "$work"/bench-*.json; do [[ -f "$result" ]] && extra+=(--bench "$result"); done
  [[ -n "$deps" && -f "$deps/manifest.json" ]] && extra+=(--deps-manifest "$deps/manifest.json")
  "$report_python" "$report_tool" finish --file "$steps" --output "$output" --mode "$mode" "${extra[@]}"
  local status=$?
  echo "gpu-check: results in $output"
  if ((status != 0 || failed)); then
    echo "gpu-check: FAILED (see the steps above and $output; logs in $work)" >&2
    exit 1
  fi
  rm -rf "$work"
  exit 0
}
out_of_time() {
  if ((SECONDS - started > time_limit)); then
    record "$1" fail 0 "not started: the check has run $((SECONDS - started)) s, past --time-limit $time_limit s"
    return 0
  fi
  return 1
}

# 1. Detection: what the build will use, from the machine itself.
t0=$SECONDS
detect_log="$work/detect.log"
if ! command -v "$python" >/dev/null 2>&1; then
  record detect fail 0 "no '$python' on the PATH; pass --python with the Python that holds the CUDA PyTorch"
  finish
fi
"$python" - "$work/detect.json" >"$detect_log" 2>&1 <<'PY'
import json, os, pathlib, shutil, subprocess, sys
found = {"python": sys.executable, "python_version": sys.version.split()[0]}
problems = []
try:
    import torch, torch.utils
    found["torch_version"] = torch.__version__
    found["torch_cuda"] = torch.version.cuda
    found["torch_cmake_prefix"] = torch.utils.cmake_prefix_path
    found["cuda_available"] = bool(torch.cuda.is_available())
    found["gpu_count"] = torch.cuda.device_count() if torch.cuda.is_available() else 0
    found["gpus"] = [torch.cuda.get_device_name(i) for i in range(found["gpu_count"])]
    if torch.version.cuda is None:
        problems.append(f"torch {torch.__version__} is a CPU-only build; the GPU check needs a CUDA PyTorch")
    version = tuple(int(part) for part in torch.__version__.split("+")[0].split(".")[:2])
    if version < (2, 11):
        problems.append(f"torch {torch.__version__} is older than 2.11, the oldest libtorch fsdp.cpp builds on")
    site = pathlib.Path(torch.__file__).resolve().parent.parent
    for name, header, candidates in [
        ("nccl_include", "nccl.h", [site / "nvidia/nccl/include"]),
        ("cuda_library_include", "cublas_v2.h", [site / "nvidia/cu13/include", site / "nvidia/cublas/include"]),
    ]:
        hit = next((str(path) for path in candidates if (path / header).is_file()), None)
        found[name] = hit
        if hit is None and name == "nccl_include":
            problems.append(f"no {header} in {', '.join(map(str, candidates))}: the CUDA wheel's nvidia-nccl package is missing")
except Exception as error:  # noqa: BLE001 - any failure to import is the finding
    problems.append(f"importing torch failed: {error!r}")
for module in ("accelerate", "transformers"):
    try:
        found[module + "_version"] = __import__(module).__version__
    except Exception as error:  # noqa: BLE001
        found[module + "_version"] = None
        problems.append(f"{module} is not importable ({error!r}); the peers need it")
cuda_home = os.environ.get("CUDA_HOME") or "/usr/local/cuda"
nvcc = pathlib.Path(cuda_home) / "bin/nvcc"
found["cuda_home"] = cuda_home if nvcc.exists() else None
if not nvcc.exists():
    problems.append(f"no nvcc in {cuda_home}/bin: set CUDA_HOME to the CUDA toolkit (a CUDA libtorch's CMake code needs it)")
for tool in ("cmake", "ninja", "c++"):
    path = shutil.which(tool)
    found[tool] = path
    if path is None:
        problems.append(f"no {tool} on the PATH")
if shutil.which("nvidia-smi"):
    try:
        found["nvidia_smi"] = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total",
                                              "--format=csv,noheader"], capture_output=True, text=True,
                                             timeout=30).stdout.strip().splitlines()
    except Exception as error:  # noqa: BLE001
        found["nvidia_smi"] = repr(error)
found["problems"] = problems
pathlib.Path(sys.argv[1]).write_text(json.dumps(found, indent=1))
print(json.dumps(found, indent=1))
sys.exit(1 if problems else 0)
PY
detect_status=$?
if [[ ! -f "$work/detect.json" ]]; then
  record detect fail $((SECONDS - t0)) "the detection script did not run: $(tail -n 3 "$detect_log" | tr '\n' ' ')" "$detect_log"
  finish
fi
field() { "$python" -c 'import json,sys; value = json.load(open(sys.argv[1])).get(sys.argv[2]); print("" if value is None else value)' "$work/detect.json" "$1"; }
gpu_count="$(field gpu_count)"
if ((detect_status != 0)); then
  record detect fail $((SECONDS - t0)) "$("$python" -c 'import json,sys; print("; ".join(json.load(open(sys.argv[1]))["problems"]))' "$work/detect.json")" "$detect_log"
  finish
fi
if [[ "$mode" != build && "${gpu_count:-0}" == 0 ]]; then
  record detect fail $((SECONDS - t0)) "torch $(field torch_version) sees no GPU (torch.cuda.is_available() is False): check nvidia-smi and CUDA_VISIBLE_DEVICES" "$detect_log"
  finish
fi
record detect pass $((SECONDS - t0)) "torch $(field torch_version) (CUDA $(field torch_cuda)), ${gpu_count:-0} GPU(s), nccl.h in $(field nccl_include)" "$detect_log"
[[ "$mode" == detect ]] && finish

# 2. Configure and build the CUDA configuration against the machine's PyTorch and the prepared folder.
if [[ ! -f "$deps/manifest.json" || ! -d "$deps/root/usr/include" ]]; then
  record configure fail 0 "$deps is not a folder that 'scripts/gpu-check.sh --prepare $deps' filled (no manifest.json or root/usr/include)"
  finish
fi
deps="$(cd "$deps" && pwd)"
sysroot="$deps/root/usr"
out_of_time configure && finish
t0=$SECONDS
configure_log="$work/configure.log"
cmake_arguments=(
  -S "$root" -B "$build_dir" -G Ninja -DCMAKE_BUILD_TYPE=Release -DFSDP_CUDA=ON
  "-DCMAKE_PREFIX_PATH=$(field torch_cmake_prefix);$sysroot;$sysroot/lib/x86_64-linux-gnu/cmake;$sysroot/share/cmake"
  "-DFSDP_GLOO_INCLUDE_DIR=$sysroot/include" "-DFSDP_NCCL_INCLUDE_DIR=$(field nccl_include)"
  "-DCUDA_TOOLKIT_ROOT_DIR=$(field cuda_home)" "-DFSDP_TEST_PYTHON=$(field python)"
  "-DCMAKE_INCLUDE_PATH=$sysroot/include" "-DCMAKE_LIBRARY_PATH=$sysroot/lib/x86_64-linux-gnu"
)
[[ -n "$(field cuda_library_include)" ]] && cmake_arguments+=("-DFSDP_CUDA_LIBRARY_INCLUDE_DIR=$(field cuda_library_include)")
if cmake "${cmake_arguments[@]}" >"$configure_log" 2>&1; then
  record configure pass $((SECONDS - t0)) "$(grep -m1 'fsdp.cpp: GPU path' "$configure_log" | sed 's/^-- //')" "$configure_log"
else
  record configure fail $((SECONDS - t0)) "CMake failed: $(grep -m1 -A2 'Error' "$configure_log" | tr '\n' ' ' | cut -c1-400)" "$configure_log"
  finish
fi
out_of_time build && finish
t0=$SECONDS
build_log="$work/build.log"
if cmake --build "$build_dir" -j "$jobs" --target fsdp_gpu_tests gpu_bench fsdp_cli >"$build_log" 2>&1; then
  record build pass $((SECONDS - t0)) "fsdp_gpu_tests, gpu_bench and fsdp built with $jobs jobs" "$build_log"
else
  record build fail $((SECONDS - t0)) "the build failed: $(grep -m1 -B1 -A3 'error' "$build_log" | tr '\n' ' ' | cut -c1-600)" "$build_log"
  finish
fi
[[ "$mode" == build ]] && finish

# 3. The GPU tests (tests/gpu/gpu_test.cpp): gtest's own JSON goes into the report.
out_of_time tests && finish
t0=$SECONDS
tests_log="$work/gpu-tests.log"
# Only the GPU tests: the binary also holds the CPU cases of the parity test, which CI runs.
timeout 300 "$build_dir/bin/fsdp_gpu_tests" "--gtest_filter=Gpu*:GpuCases/*" "--gtest_output=json:$work/gpu-tests.json" \
  >"$tests_log" 2>&1
tests_status=$?
if ((tests_status == 0)); then
  record tests pass $((SECONDS - t0)) "$(grep -E '^\[  (PASSED|SKIPPED) ' "$tests_log" | tr '\n' ' ')" "$tests_log"
else
  record tests fail $((SECONDS - t0)) "exit $tests_status$( ((tests_status == 124)) && echo ' (timed out after 300 s)'): $(grep -E '^\[  FAILED  \]|^\[  PASSED  \]' "$tests_log" | head -n 8 | tr '\n' ' ')" "$tests_log"
fi

# 4. The benchmark: a Llama of about 1B parameters, ours against PyTorch FSDP2 in the same run, on
# one GPU and on all of them.
if ((bench)); then
  counts=(1)
  ((gpu_count > 1)) && counts+=("$gpu_count")
  for count in "${counts[@]}"; do
    for side in fsdp_cpp pytorch_fsdp2; do
      out_of_time "bench_${side}_${count}gpu" && continue
      t0=$SECONDS
      bench_log="$work/bench-$side-$count.log"
      if [[ "$side" == fsdp_cpp ]]; then
        command=("$build_dir/bin/gpu_bench" --steps "$bench_steps" --json "$work/bench-$side-$count.json")
      else
        command=("$(field python)" "$root/bench/gpu_peer.py" --steps "$bench_steps" --json "$work/bench-$side-$count.json")
      fi
      if timeout 240 "$build_dir/bin/fsdp" launch --nproc-per-node "$count" --master-port 0 -- "${command[@]}" >"$bench_log" 2>&1 &&
        [[ -f "$work/bench-$side-$count.json" ]]; then
        record "bench_${side}_${count}gpu" pass $((SECONDS - t0)) "$(tail -n 1 "$work/bench-$side-$count.json" | cut -c1-300)" "$bench_log"
      else
        record "bench_${side}_${count}gpu" fail $((SECONDS - t0)) "$(tail -n 3 "$bench_log" | tr '\n' ' ' | cut -c1-400)" "$bench_log"
      fi
    done
  done
fi
finish
