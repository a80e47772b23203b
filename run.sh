#!/usr/bin/env bash
# The main job on its built-in default. Installs what is missing, builds, then runs it.
# Until the Llama training example lands this is a 2-rank collective selftest under `fsdp launch`.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
"$root/scripts/setup.sh"
bin="${FSDP_BUILD_DIR:-$root/build}/bin"
echo "run: 2 ranks of \`fsdp selftest\` under \`fsdp launch\`"
"$bin/fsdp" launch --nproc-per-node 2 --master-port 0 -- "$bin/fsdp" selftest
