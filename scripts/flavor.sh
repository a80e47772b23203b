# Sourced by setup.sh, test.sh and run.sh: which build of fsdp.cpp they work on.
#   FSDP_FLAVOR=cpu  (default) the CPU torch 2.13.0 wheel: requirements.txt, .venv/, build/
#   FSDP_FLAVOR=cuda the CUDA torch 2.14.1 wheel: requirements-cuda.txt, .venv-cuda/, build-cuda/;
#                    the GPU path (NCCL groups) is compiled in, and everything also runs on CPU.
#   FSDP_SANITIZE=1  the flavour built with AddressSanitizer and UndefinedBehaviorSanitizer (-O1 -g1,
#                    -DFSDP_SANITIZE=ON) into build-sanitize/ or build-cuda-sanitize/; its tests run
#                    with the options below (a report fails the test; leaks are not checked, since
#                    libtorch's registries live until exit by design). scripts/sanitize.sh uses it.
# FSDP_VENV and FSDP_BUILD_DIR override the folders.
fsdp_flavor="${FSDP_FLAVOR:-cpu}"
case "$fsdp_flavor" in
  cpu)
    fsdp_default_venv="$root/.venv"
    fsdp_default_build_dir="$root/build"
    fsdp_requirements="$root/requirements.txt"
    ;;
  cuda)
    fsdp_default_venv="$root/.venv-cuda"
    fsdp_default_build_dir="$root/build-cuda"
    fsdp_requirements="$root/requirements-cuda.txt"
    ;;
  *)
    echo "setup: FSDP_FLAVOR='$fsdp_flavor' is not a flavour of fsdp.cpp; expected 'cpu' (default) or 'cuda'." >&2
    exit 1
    ;;
esac
fsdp_sanitize="${FSDP_SANITIZE:-0}"
case "$fsdp_sanitize" in
  0) ;;
  1)
    fsdp_default_build_dir="$fsdp_default_build_dir-sanitize"
    export ASAN_OPTIONS="${ASAN_OPTIONS:-halt_on_error=1:detect_leaks=0:abort_on_error=0}"
    export UBSAN_OPTIONS="${UBSAN_OPTIONS:-halt_on_error=1:print_stacktrace=1}"
    ;;
  *)
    echo "setup: FSDP_SANITIZE='$fsdp_sanitize' is neither 0 (default) nor 1 (build with the sanitizers)." >&2
    exit 1
    ;;
esac
# The flavour's name in messages and timings: cpu, cuda, cpu+sanitize, cuda+sanitize.
fsdp_flavor_name="$fsdp_flavor"
[[ "$fsdp_sanitize" == 0 ]] || fsdp_flavor_name="$fsdp_flavor+sanitize"
fsdp_build_dir="${FSDP_BUILD_DIR:-$fsdp_default_build_dir}"
fsdp_venv="${FSDP_VENV:-$fsdp_default_venv}"

# fsdp_step_done NAME: prints how long the step since the previous call (or since sourcing) took,
# and appends "NAME<TAB>seconds" to FSDP_PHASE_LOG when that is set (.ci/run's summary).
fsdp_step_started=$SECONDS
fsdp_step_done() {
  local seconds=$((SECONDS - fsdp_step_started))
  echo "$(basename "$0"): $1 took $seconds s"
  [[ -z "${FSDP_PHASE_LOG:-}" ]] || printf '%s\t%s\n' "$1" "$seconds" >>"$FSDP_PHASE_LOG"
  fsdp_step_started=$SECONDS
}
