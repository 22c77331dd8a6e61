#!/usr/bin/env bash
# pid 1 of one machine of the real cluster (cluster.sh boots it in new
# mount, pid and uts namespaces): gives the machine its own filesystems,
# starts its daemons, then becomes `pause`, which reaps orphans until the
# machine is killed. Environment (from cluster.sh): MACHINE, ROLE
# (control-plane | node), MACHINE_DIR, CLUSTER_DIR, NETNS, API_PORT, HERE,
# CONTROL_PLANE_IP, POD_CIDRS, SERVICE_CIDRS, FEATURES, GUARDED_SYSCTLS.
set -euo pipefail
BIN=$CLUSTER_DIR/bin
PKI=$CLUSTER_DIR/pki
hostname "$MACHINE"

# Node-private files over the machine-wide tunables the kubelet writes.
guard_sysctls() {
	mkdir -p "$MACHINE_DIR/sysctl"
	for f in $GUARDED_SYSCTLS; do
		local copy=$MACHINE_DIR/sysctl/${f//\//.}
		cat "/proc/sys/$f" >"$copy"
		mount --bind "$copy" "/proc/sys/$f"
	done
}

# /run and /var of its own, /etc and /opt as overlays (writes stay in the
# machine), its own CNI directories, a sysfs of its network namespace with
# the machine's cgroup tree bound back (kubelet and runc need it).
own_filesystems() {
	mount -t tmpfs -o mode=0755 tmpfs /run
	mount --bind "$MACHINE_DIR/var" /var
	mount -t overlay overlay -o "lowerdir=/etc,upperdir=$MACHINE_DIR/etc/upper,workdir=$MACHINE_DIR/etc/work" /etc
	mount -t overlay overlay -o "lowerdir=/opt,upperdir=$MACHINE_DIR/opt/upper,workdir=$MACHINE_DIR/opt/work" /opt
	mkdir -p /etc/cni/net.d /opt/cni/bin
	mount --bind "$MACHINE_DIR/cni-conf" /etc/cni/net.d
	mount --bind "$MACHINE_DIR/cni-bin" /opt/cni/bin
	mkdir -p "$MACHINE_DIR/sys"
	mount -t sysfs sysfs "$MACHINE_DIR/sys"
	mount --rbind /sys/fs/cgroup "$MACHINE_DIR/sys/fs/cgroup"
	mount --move "$MACHINE_DIR/sys" /sys
	guard_sysctls
}

# keep NAME CMD...: CMD in the background, restarted whenever it exits.
keep() {
	local name=$1
	shift
	setsid bash "$HERE/keep.sh" "$MACHINE_DIR/log/$name.log" "$@" &
}

wait_for() { # SECONDS CMD...
	local deadline=$((SECONDS + $1))
	shift
	until "$@" >/dev/null 2>&1; do
		[ $SECONDS -lt $deadline ] || { echo "timed out: $*" >&2; exit 1; }
		sleep 0.1
	done
}

node() {
	own_filesystems
	keep "containerd" containerd --config "$MACHINE_DIR/containerd.toml"
	wait_for 60 ctr version
	for archive in "$CLUSTER_DIR"/images/*.tar; do
		ctr -n k8s.io images import "$archive" >/dev/null
	done
	touch "$MACHINE_DIR/ready"
}

control_plane() {
	# Its network namespace held where the tmpfs over /run cannot hide it.
	touch "$MACHINE_DIR/netns"
	mount --bind "$NETNS" "$MACHINE_DIR/netns"
	NETNS=$MACHINE_DIR/netns
	# /run and /var of its own, so that no component's default path lands on
	# this machine's.
	mount -t tmpfs -o mode=0755 tmpfs /run
	mkdir -p "$MACHINE_DIR/var"
	mount --bind "$MACHINE_DIR/var" /var
	# The API server on this machine's loopback, relayed into the control
	# plane's network namespace.
	keep "forward" python3 "$HERE/forward.py" 127.0.0.1 "$API_PORT" "$NETNS" 127.0.0.1 6443
	local in_net=(nsenter "--net=$NETNS")
	mkdir -p "$MACHINE_DIR/etcd"
	mount -t tmpfs -o mode=0700 tmpfs "$MACHINE_DIR/etcd"
	keep "etcd" "${in_net[@]}" etcd --name control-plane --data-dir "$MACHINE_DIR/etcd" \
		--listen-client-urls http://127.0.0.1:2379 --advertise-client-urls http://127.0.0.1:2379 \
		--listen-peer-urls http://127.0.0.1:2380 --initial-advertise-peer-urls http://127.0.0.1:2380 \
		--initial-cluster control-plane=http://127.0.0.1:2380
	keep "kube-apiserver" "${in_net[@]}" "$BIN/kube-apiserver" --etcd-servers=http://127.0.0.1:2379 \
		--advertise-address="$CONTROL_PLANE_IP" --bind-address=0.0.0.0 --secure-port=6443 --insecure-port=0 \
		--tls-cert-file="$PKI/apiserver.crt" --tls-private-key-file="$PKI/apiserver.key" \
		--client-ca-file="$PKI/ca.crt" --authorization-mode=Node,RBAC \
		--enable-admission-plugins=NodeRestriction --allow-privileged=true \
		--service-account-key-file="$PKI/sa.pub" --service-account-signing-key-file="$PKI/sa.key" \
		--service-account-issuer=https://kubernetes.default.svc.cluster.local \
		--service-cluster-ip-range="$SERVICE_CIDRS" --feature-gates="$FEATURES" \
		--kubelet-client-certificate="$PKI/apiserver-kubelet-client.crt" \
		--kubelet-client-key="$PKI/apiserver-kubelet-client.key" \
		--kubelet-preferred-address-types=InternalIP
	keep "kube-controller-manager" "${in_net[@]}" "$BIN/kube-controller-manager" --kubeconfig="$MACHINE_DIR/controller-manager.kubeconfig" \
		--authentication-kubeconfig="$MACHINE_DIR/controller-manager.kubeconfig" \
		--authorization-kubeconfig="$MACHINE_DIR/controller-manager.kubeconfig" \
		--allocate-node-cidrs=true --cluster-cidr="$POD_CIDRS" \
		--node-cidr-mask-size-ipv4=24 --node-cidr-mask-size-ipv6=64 \
		--service-cluster-ip-range="$SERVICE_CIDRS" --feature-gates="$FEATURES" \
		--use-service-account-credentials=true --service-account-private-key-file="$PKI/sa.key" \
		--root-ca-file="$PKI/ca.crt" --cluster-signing-cert-file="$PKI/ca.crt" \
		--cluster-signing-key-file="$PKI/ca.key" --leader-elect=false --configure-cloud-routes=false \
		--bind-address=127.0.0.1 --port=0
	keep "kube-scheduler" "${in_net[@]}" "$BIN/kube-scheduler" --kubeconfig="$MACHINE_DIR/scheduler.kubeconfig" \
		--authentication-kubeconfig="$MACHINE_DIR/scheduler.kubeconfig" \
		--authorization-kubeconfig="$MACHINE_DIR/scheduler.kubeconfig" \
		--leader-elect=false --bind-address=127.0.0.1 --port=0
}

case "$ROLE" in
node) node ;;
control-plane) control_plane ;;
esac
exec "$BIN/pause"
