# Sourced by setup.sh, test.sh and run.sh: which build of fsdp.cpp they work on.
#   FSDP_FLAVOR=cpu  (default) the CPU torch 2.13.0 wheel: requirements.txt, .venv/, build/
#   FSDP_FLAVOR=cuda the CUDA torch 2.14.1 wheel: requirements-cuda.txt, .venv-cuda/, build-cuda/;
#                    the GPU path (NCCL groups) is compiled in, and everything also runs on CPU.
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
fsdp_build_dir="${FSDP_BUILD_DIR:-$fsdp_default_build_dir}"
fsdp_venv="${FSDP_VENV:-$fsdp_default_venv}"
