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
    { "type": "bridge", "bridge": "cnidemo0", "isGateway": true, "ipMasq": true,
      "ipam": { "type": "host-local",
                "ranges": [[{ "subnet": "10.99.0.0/24" }], [{ "subnet": "fd99::/64" }]],
                "routes": [{ "dst": "0.0.0.0/0" }],
                "dataDir": "$work/ipam",
                "socket": "$work/host-local.sock" } },
    { "type": "loopback" },
    { "type": "istio-redirect",
      "redirect": { "interceptionMode": "REDIRECT", "excludeOutboundPorts": "15020,5432" } }
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

addr_of() { ip -n "$1" -4 -o addr show eth0 | awk '{print $4}' | cut -d/ -f1; }
addr6_of() { ip -n "$1" -6 -o addr show eth0 scope global | awk '{print $4}' | cut -d/ -f1; }
for pod in "${pods[@]}"; do
    step "cnictl add demo /run/netns/$pod: bridge, then host-local, loopback, istio-redirect"
    cnictl add demo "/run/netns/$pod"
    echo "$pod has eth0 $(addr_of "$pod") and $(addr6_of "$pod"), lo up, and Istio's capture rules"
done

step "the pods talk to each other over the bridge (IPv4 and IPv6) and to the gateway"
in_pod() { nsenter --net="/run/netns/$1" -- "${@:2}"; }
in_pod "${pods[0]}" busybox ping -c 2 -W 1 "$(addr_of "${pods[1]}")"
in_pod "${pods[1]}" busybox ping6 -c 2 -W 1 "$(addr6_of "${pods[0]}")"
in_pod "${pods[0]}" busybox ping -c 1 -W 1 10.99.0.1

step "inside ${pods[0]}: Istio's sidecar capture, programmed by istio-redirect (no istio-init)"
echo "outbound TCP goes to Envoy's 15001, inbound to 15006; uid 1337 (the proxy) and ports 15020, 5432 are left alone:"
in_pod "${pods[0]}" iptables-save -t nat | grep -E '^(:ISTIO|-A (OUTPUT|PREROUTING|ISTIO_OUTPUT|ISTIO_REDIRECT|ISTIO_IN_REDIRECT))'

step "cnictl ipam ls demo: the leases, served by the lease service"
ipam ls demo

step "masquerade: one chain for the subnet, made by the first pod and shared by the rest"
in_node iptables-save -t nat | grep -E -- '^(:CNI-|-A (POSTROUTING|CNI-))' || true

step "cnictl check and status"
cnictl check demo "/run/netns/${pods[0]}"
cnictl status demo

step "cnictl del: veths, leases and cache entries go (the capture rules go with the pods' namespaces)"
for pod in "${pods[@]}"; do cnictl del demo "/run/netns/$pod"; done
ip -n "$node" -o link show type veth | wc -l | xargs echo "veths left in the node:"
ipam ls demo
ls -A "$work/cache/results" | wc -l | xargs echo "cache entries left:"
in_node iptables-save -t nat | grep -c 'CNI-' | xargs echo "subnet masquerade rules, kept for the next pod:" || true

step "cnictl gc demo --all: no attachment is valid any more, so the subnet's masquerade goes too"
cnictl gc demo --all
in_node iptables-save -t nat | grep -c 'CNI-' | xargs echo "masquerade rules left:" || true
echo "demo finished; the service and the namespaces are removed on exit"
