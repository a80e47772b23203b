# The paths every bench/ script uses, sourced first: root (the checkout), bin (the build's programs;
# FSDP_BUILD_DIR overrides build/), python (the venv's; FSDP_VENV overrides .venv/), which must exist.
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bin="${FSDP_BUILD_DIR:-$root/build}/bin"
python="${FSDP_VENV:-$root/.venv}/bin/python"
[[ -x "$python" ]] || { echo "bench: no venv Python at $python; run scripts/setup.sh first" >&2; exit 1; }
