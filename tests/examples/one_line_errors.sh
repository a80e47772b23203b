#!/bin/sh
# An example that fails prints one line per rank with the error's text, no libtorch backtrace, and
# exits 1 (not SIGABRT's 134): examples/accelerator.cpp with a plugin setting it refuses
# (FSDP_VERSION=3), on 2 ranks.   one_line_errors.sh FSDP_CLI EXAMPLE_ACCELERATOR WORK_DIR
cli="$1" example="$2" work="$3"
output="$(FSDP_VERSION=3 "$cli" launch --nproc-per-node 2 --master-port 0 -- "$example" "$work" 2>&1)"
code=$?
echo "$output"
fail() { echo "one_line_errors: $1" >&2; exit 1; }
[ "$code" -ne 0 ] || fail "the launch exited 0"
for rank in 0 1; do
  [ "$(echo "$output" | grep -c "^example_accelerator: rank $rank: error: .*fsdp_version")" -eq 1 ] ||
    fail "rank $rank did not print one line naming fsdp_version"
done
echo "$output" | grep -q "Exception raised from" && fail "a libtorch backtrace was printed"
echo "$output" | grep -qi "abort\|core dumped\|signal 6" && fail "a rank aborted"
exit 0
