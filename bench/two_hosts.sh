#!/usr/bin/env bash
# Two machines on this one: network namespaces fsdp-host0 and fsdp-host1 joined by a veth pair, each
# end shaped to BENCH_LINK_RATE (default 1gbit) with tbf, and one `fsdp launch --nnodes 2` in each.
# The kernel here has no netem ("Specified qdisc kind is unknown"), so the link has a rate and no
# added delay. Gloo is told to use the veth (GLOO_SOCKET_IFNAME), so what the veth's counter shows
# on host 0 is what left that machine: the ranks of one machine reach each other over its own
# address, which the kernel routes without the veth. Both machines share this machine's cores:
# compare within a row.
# Runs, at BENCH_RANKS_PER_HOST ranks per machine (default "2 4"): step_bench FULL_SHARD,
# SHARD_GRAD_OP, HYBRID_SHARD and hpZ (FULL_SHARD with --reshard-after-forward <ranks per machine>),
# PyTorch DDP, FSDP2 and FSDP2 with the same int; BENCH_ROUNDS rounds (default 2), medians. Rewrites
# the table between the <!-- two-hosts --> markers of bench/README.md. Needs root (ip netns, tc).
#   sudo bench/two_hosts.sh
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bin="${FSDP_BUILD_DIR:-$root/build}/bin"
python="${FSDP_VENV:-$root/.venv}/bin/python"
[[ -x "$python" ]] || { echo "bench: no venv Python at $python; run scripts/setup.sh first" >&2; exit 1; }
[[ "$(id -u)" == 0 ]] || { echo "bench: two_hosts.sh makes network namespaces and shapes a link: run it as root" >&2; exit 1; }
read -r -a per_host <<< "${BENCH_RANKS_PER_HOST:-2 4}"
rounds="${BENCH_ROUNDS:-2}"
rate="${BENCH_LINK_RATE:-1gbit}"
sizes=(--width 512 --hidden 2048 --blocks 8 --batch 64 --steps 6)
results="$(mktemp -d)/two_hosts.jsonl"
hosts=(fsdp-host0 fsdp-host1)
links=(fsdp-veth0 fsdp-veth1)
addresses=(10.77.0.1 10.77.0.2)

cleanup() { for host in "${hosts[@]}"; do ip netns del "$host" 2>/dev/null || true; done; }
trap cleanup EXIT
cleanup
for index in 0 1; do ip netns add "${hosts[$index]}"; done
ip link add "${links[0]}" netns "${hosts[0]}" type veth peer name "${links[1]}" netns "${hosts[1]}"
for index in 0 1; do
  ip -n "${hosts[$index]}" link set lo up
  ip -n "${hosts[$index]}" addr add "${addresses[$index]}/24" dev "${links[$index]}"
  ip -n "${hosts[$index]}" link set "${links[$index]}" up
  tc -n "${hosts[$index]}" qdisc add dev "${links[$index]}" root tbf rate "$rate" burst 256kb latency 100ms
done

# One job on both machines: rank 0's JSON line (host 0) goes to the results.
launch() {
  local ranks="$1" port
  shift
  port=$((20000 + RANDOM % 20000))
  ip netns exec "${hosts[1]}" env GLOO_SOCKET_IFNAME="${links[1]}" "$bin/fsdp" launch --nnodes 2 --node-rank 1 \
    --nproc-per-node "$ranks" --master-addr "${addresses[0]}" --master-port "$port" -- "$@" > /dev/null &
  local other=$!
  ip netns exec "${hosts[0]}" env GLOO_SOCKET_IFNAME="${links[0]}" "$bin/fsdp" launch --nnodes 2 --node-rank 0 \
    --nproc-per-node "$ranks" --master-addr "${addresses[0]}" --master-port "$port" -- "$@" >> "$results" ||
    { echo "bench: failed on host 0: $*" >&2; wait "$other" || true; return 1; }
  wait "$other" || { echo "bench: failed on host 1: $*" >&2; return 1; }
}

for round in $(seq "$rounds"); do
  for ranks in "${per_host[@]}"; do
    for strategy in FULL_SHARD SHARD_GRAD_OP HYBRID_SHARD; do
      launch "$ranks" "$bin/step_bench" --strategy "$strategy" "${sizes[@]}"
    done
    launch "$ranks" "$bin/step_bench" --strategy FULL_SHARD --reshard-after-forward "$ranks" "${sizes[@]}"
    for peer in ddp fsdp2; do
      launch "$ranks" "$python" "$root/bench/torch_peer.py" --peer "$peer" "${sizes[@]}"
    done
    launch "$ranks" "$python" "$root/bench/torch_peer.py" --peer fsdp2 --reshard-after-forward "$ranks" "${sizes[@]}"
  done
  echo "bench: two-hosts round $round of $rounds done" >&2
done
"$python" "$root/bench/two_hosts_report.py" "$results" "$root/bench/README.md" \
  "bench/two_hosts.sh (ranks per machine ${per_host[*]}, link $rate, $rounds rounds)"
