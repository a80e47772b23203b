# Several machines on this one, for the benchmarks that need a network (sourced by
# bench/multi_hosts.sh and bench/collective_table.sh; needs root: ip netns, tc).
#
# hosts_up M RATE: network namespaces fsdp-host0 .. fsdp-host{M-1}, each with one link to a switch
# (a bridge in the namespace fsdp-switch), the link shaped to RATE each way with tbf (on the host's
# end for what it sends, on the switch's end for what it receives), so every machine has a NIC of
# RATE and the switch is never the bottleneck. This kernel has no netem ("Specified qdisc kind is
# unknown"): the links have a rate and no added delay. Host i is 10.77.0.(i+1); Gloo is told to use
# the link (GLOO_SOCKET_IFNAME), so the link's counter on host 0 is what left that machine: the
# ranks of one machine reach each other over its own address, which the kernel routes without the link.
#
# hosts_launch L OUTPUT COMMAND...: one job over every host, L ranks each (`fsdp launch --nnodes M`
# in each namespace); rank 0's output (on host 0) is appended to OUTPUT, the others' discarded.
# hosts_down: removes the namespaces (hosts_up sets a trap for it).
hosts_bin="${FSDP_BUILD_DIR:-$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)/build}/bin"
hosts_count=0

hosts_down() {
  for ((index = 0; index < 64; ++index)); do ip netns del "fsdp-host$index" 2>/dev/null || true; done
  ip netns del fsdp-switch 2>/dev/null || true
}

hosts_up() {
  local count="$1" rate="$2" burst index
  [[ "$(id -u)" == 0 ]] || { echo "bench: network namespaces and shaped links need root" >&2; return 1; }
  # tbf's bucket must hold at least one timer tick of the rate (about 4 ms), or it caps below the rate.
  case "$rate" in
    *gbit) burst="$((${rate%gbit} * 1000000000 / 8 / 250 + 65536))" ;;
    *mbit) burst="$((${rate%mbit} * 1000000 / 8 / 250 + 65536))" ;;
    *) echo "bench: link rate '$rate' is not NNmbit or NNgbit" >&2; return 1 ;;
  esac
  hosts_down
  trap hosts_down EXIT
  ip netns add fsdp-switch
  ip -n fsdp-switch link add fsdp-bridge type bridge
  ip -n fsdp-switch link set fsdp-bridge up
  for ((index = 0; index < count; ++index)); do
    ip netns add "fsdp-host$index"
    ip link add "fsdp-h$index" netns "fsdp-host$index" type veth peer name "fsdp-s$index" netns fsdp-switch
    ip -n "fsdp-host$index" link set lo up
    ip -n "fsdp-host$index" addr add "10.77.0.$((index + 1))/24" dev "fsdp-h$index"
    ip -n "fsdp-host$index" link set "fsdp-h$index" up
    ip -n fsdp-switch link set "fsdp-s$index" master fsdp-bridge
    ip -n fsdp-switch link set "fsdp-s$index" up
    tc -n "fsdp-host$index" qdisc add dev "fsdp-h$index" root tbf rate "$rate" burst "$burst" latency 100ms
    tc -n fsdp-switch qdisc add dev "fsdp-s$index" root tbf rate "$rate" burst "$burst" latency 100ms
  done
  hosts_count="$count"
}

hosts_launch() {
  local ranks="$1" output="$2" port index status=0
  shift 2
  port=$((20000 + RANDOM % 20000))
  local others=()
  for ((index = 1; index < hosts_count; ++index)); do
    ip netns exec "fsdp-host$index" env GLOO_SOCKET_IFNAME="fsdp-h$index" "$hosts_bin/fsdp" launch \
      --nnodes "$hosts_count" --node-rank "$index" --nproc-per-node "$ranks" --master-addr 10.77.0.1 \
      --master-port "$port" -- "$@" > /dev/null &
    others+=($!)
  done
  ip netns exec fsdp-host0 env GLOO_SOCKET_IFNAME=fsdp-h0 "$hosts_bin/fsdp" launch --nnodes "$hosts_count" \
    --node-rank 0 --nproc-per-node "$ranks" --master-addr 10.77.0.1 --master-port "$port" -- "$@" >> "$output" ||
    { echo "bench: failed on host 0: $*" >&2; status=1; }
  for index in "${!others[@]}"; do
    wait "${others[$index]}" || { echo "bench: failed on host $((index + 1)): $*" >&2; status=1; }
  done
  return "$status"
}
