#!/usr/bin/env bash
# How the binaries reach libtorch and Gloo, checked on the built files:
#  - every shared library of each binary resolves with LD_LIBRARY_PATH unset (RPATH alone), libtorch
#    from the libtorch the build was configured with, and none of them is libpython;
#  - libfsdp defines no symbol of Gloo's own: Gloo's headers are used for declarations only, so all Gloo
#    code that runs is libtorch's (Note [Reaching Gloo from the torch wheel], docs/design.md).
# Usage: linkage_test.sh TORCH_LIBRARY_DIR LIBFSDP BINARY...
set -euo pipefail
torch_lib_dir="$(realpath "$1")"
libfsdp="$2"
shift 2
status=0
for binary in "$libfsdp" "$@"; do
  listing="$(env -u LD_LIBRARY_PATH ldd "$binary")"
  before=$status
  if grep -q "not found" <<<"$listing"; then
    echo "FAIL $binary: libraries not found without LD_LIBRARY_PATH:"; grep "not found" <<<"$listing"; status=1
  fi
  if grep -qi "libpython" <<<"$listing"; then
    echo "FAIL $binary links libpython:"; grep -i libpython <<<"$listing"; status=1
  fi
  torch_path="$(awk '$1 == "libtorch_cpu.so" && $2 == "=>" {print $3; exit}' <<<"$listing")"
  if [[ -z "$torch_path" || ! -e "$torch_path" || "$(realpath "$(dirname "$torch_path")")" != "$torch_lib_dir" ]]; then
    echo "FAIL $binary: libtorch_cpu.so resolves to '${torch_path:-nothing}', expected it in $torch_lib_dir"; status=1
  fi
  ((status != before)) || echo "ok   $binary: libtorch_cpu.so from $torch_path, no libpython"
done
defined="$(nm -DC --defined-only "$libfsdp")"
grep -q "fsdp::all_gather" <<<"$defined" || { echo "FAIL nm listed no fsdp::all_gather in $libfsdp"; exit 1; }
gloo_symbols="$(grep -E ' (gloo::|vtable for gloo::|typeinfo (name )?for gloo::|VTT for gloo::)|GlooStore' <<<"$defined" || true)"
if [[ -n "$gloo_symbols" ]]; then
  echo "FAIL $libfsdp defines Gloo symbols, which could shadow libtorch's own Gloo:"; echo "$gloo_symbols" | head -20; status=1
else
  echo "ok   $libfsdp defines no Gloo symbol"
fi
exit $status
