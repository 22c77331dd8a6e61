#!/usr/bin/env bash
# Wires pods with the suite's plugins through cnictl, the way a runtime
# would, inside namespaces it creates and removes again. The machine's own
# network namespace is not touched.
set -euo pipefail

BIN_DIR=${BIN_DIR:?set BIN_DIR to the directory of the built binaries}
[ "$(id -u)" = 0 ] || { echo "demo: run as root (it creates network namespaces)" >&2; exit 1; }

tag="cnidemo-$$"
work=$(mktemp -d)
node="$tag-node"
pods=("$tag-pod1" "$tag-pod2")
service_pid=""

cleanup() {
    [ -n "$service_pid" ] && kill "$service_pid" 2>/dev/null || true
    for ns in "${pods[@]}" "$node"; do ip netns del "$ns" 2>/dev/null || true; done
    rm -rf "$work"
}
trap cleanup EXIT

mkdir -p "$work/net.d" "$work/cache"
cat > "$work/net.d/10-demo.conflist" <<JSON
{
  "cniVersion": "1.1.0",
  "name": "demo",
  "plugins": [
    { "type": "loopback" },
    { "type": "host-local",
      "ipam": { "type": "host-local",
                "ranges": [[{ "subnet": "10.99.0.0/24" }], [{ "subnet": "fd99::/64" }]],
                "dataDir": "$work/ipam",
                "socket": "$work/host-local.sock" } }
  ]
}
JSON

in_node() { nsenter --net="/run/netns/$node" -- "$@"; }
cnictl() {
    in_node env NETCONFPATH="$work/net.d" CNI_PATH="$BIN_DIR" \
        "$BIN_DIR/cnictl" --cache-dir "$work/cache" "$@"
}
ipam() { cnictl ipam --data-dir "$work/ipam" --socket "$work/host-local.sock" "$@"; }

step() { printf '\n\033[1m== %s\033[0m\n' "$*"; }

ip netns add "$node"
for pod in "${pods[@]}"; do ip netns add "$pod"; done

step "the node runs host-local's lease service (a systemd socket unit in production)"
"$BIN_DIR/host-local" serve --socket "$work/host-local.sock" &
service_pid=$!
for _ in $(seq 100); do [ -S "$work/host-local.sock" ] && break; sleep 0.05; done

step "network configuration: $work/net.d/10-demo.conflist"
cat "$work/net.d/10-demo.conflist"

for pod in "${pods[@]}"; do
    step "cnictl add demo /run/netns/$pod"
    cnictl add demo "/run/netns/$pod"
    ip -n "$pod" -o addr show lo
done

step "cnictl ipam ls demo: the leases, served by the lease service"
ipam ls demo

step "cnictl check and status"
cnictl check demo "/run/netns/${pods[0]}"
cnictl status demo

step "traffic inside ${pods[0]} over its loopback"
nsenter --net="/run/netns/${pods[0]}" -- busybox ping -c 2 -W 1 127.0.0.1

step "cnictl del; lo goes down, the leases and the cache entries go away"
for pod in "${pods[@]}"; do cnictl del demo "/run/netns/$pod"; done
ip -n "${pods[0]}" -o link show lo
ipam ls demo
ls -A "$work/cache/results"
echo "demo finished; the service and the namespaces are removed on exit"
