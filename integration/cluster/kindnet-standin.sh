#!/usr/bin/env bash
# A stand-in for kindnetd on the real cluster (no registry here for its
# image): what kindnetd does to a node, done by the cluster tooling, so
# that Istio's CNI alone (deploy/istio-cni.yaml) can be tested beside a
# network that is not the suite's. Per node, from its Node object:
# /etc/cni/net.d/10-kindnet.conflist as kindnetd writes it (ptp with
# ipMasq off and host-local over the node's pod CIDRs, then portmap:
# Debian's reference plugins, which every node holds as kind's image
# does), and a route to every other node's pod CIDRs via its InternalIP
# of the same family (tagged with protocol 202, so that `down` removes
# every route it made even after a Node object is gone).
#
#   kindnet-standin.sh up                 every node's conflist and routes
#   kindnet-standin.sh rewrite NODE HOW   kindnetd writing its file again
#                                         (HOW: in-place | rename), as it
#                                         does on every restart
#   kindnet-standin.sh down               every conflist, route and lease
#                                         `up` made, gone
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
CLUSTER_DIR=${CNI_CLUSTER_DIR:-/tmp/cni-suite-cluster}
CONFLIST=/etc/cni/net.d/10-kindnet.conflist
LEASES=/run/cni-ipam-state
PROTO=202

kubectl() { "$CLUSTER_DIR/bin/kubectl" --kubeconfig "$CLUSTER_DIR/kubeconfig" "$@"; }
on_node() { "$HERE/cluster.sh" exec "$@"; }

NODES_JSON=$(kubectl get nodes -o json)
nodes() { jq -r '.items[].metadata.name' <<<"$NODES_JSON"; }
pod_cidrs() { jq -r --arg n "$1" '.items[] | select(.metadata.name == $n) | (.spec.podCIDRs // [.spec.podCIDR])[]' <<<"$NODES_JSON"; }
node_ip() { # NODE FAMILY(4|6)
	jq -r --arg n "$1" --arg f "$2" '.items[] | select(.metadata.name == $n) | .status.addresses[]
		| select(.type == "InternalIP") | .address | select((contains(":") | not) == ($f == "4"))' <<<"$NODES_JSON" | head -n1
}

# kindnetd's template (cni.go): cniVersion 0.3.1, network kindnet.
conflist() { # NODE
	local ranges routes
	ranges=$(pod_cidrs "$1" | jq -R '[{subnet: .}]' | jq -s -c .)
	routes=$(pod_cidrs "$1" | jq -R 'if contains(":") then {dst: "::/0"} else {dst: "0.0.0.0/0"} end' | jq -s -c .)
	jq -n --argjson ranges "$ranges" --argjson routes "$routes" --arg leases "$LEASES" '{
		cniVersion: "0.3.1", name: "kindnet", plugins: [
			{type: "ptp", ipMasq: false, mtu: 1500,
			 ipam: {type: "host-local", dataDir: $leases, routes: $routes, ranges: $ranges}},
			{type: "portmap", capabilities: {portMappings: true}}
		]}'
}

# A route on NODE to every other node's pod CIDRs.
routes() { # NODE
	local other cidr family via
	for other in $(nodes); do
		[ "$other" = "$1" ] && continue
		for cidr in $(pod_cidrs "$other"); do
			family=4
			[[ $cidr == *:* ]] && family=6
			via=$(node_ip "$other" $family)
			[ -n "$via" ] || continue
			on_node "$1" ip -$family route replace "$cidr" via "$via" proto $PROTO
		done
	done
}

# Through a temporary file renamed into place, as kindnetd writes it.
write_renamed() { # NODE
	conflist "$1" | on_node "$1" sh -c "cat >$CONFLIST.tmp && mv $CONFLIST.tmp $CONFLIST"
}

case "${1:-}" in
up)
	for node in $(nodes); do
		write_renamed "$node"
		routes "$node"
	done
	;;
rewrite)
	node=$2
	case "${3:-}" in
	in-place) conflist "$node" | on_node "$node" sh -c "cat >$CONFLIST" ;;
	rename) write_renamed "$node" ;;
	*) echo "rewrite NODE in-place|rename" >&2; exit 2 ;;
	esac
	;;
down)
	for node in $(nodes); do
		on_node "$node" rm -rf "$CONFLIST" "$CONFLIST.tmp" "$LEASES"
		on_node "$node" ip -4 route flush proto $PROTO
		on_node "$node" ip -6 route flush proto $PROTO
	done
	;;
*) sed -n '2,/^set -euo/p' "$0" | sed '$d' >&2; exit 2 ;;
esac
