#!/usr/bin/env bash
# A real Kubernetes v1.20.2 on this machine, shaped as kind shapes one: a
# control plane and worker nodes, each a network namespace on an underlay
# bridge plus mount, pid and uts namespaces of its own, with its own /run,
# /var, /etc/cni/net.d and /opt/cni/bin, containerd, kubelet and kube-proxy.
# Nothing of the machine's own network namespace, sysctls, /etc, /opt, /var
# or cgroups outside the cluster's own is changed (see
# ../../docs/decisions/016-real-cluster.md).
#
#   cluster.sh up [WORKERS]      the control plane and WORKERS (3) nodes;
#                                each imports the archives in
#                                $CNI_CLUSTER_IMAGES besides its own images
#   cluster.sh add-node NAME     one more node, its kubelet started now
#                                (registering with the taints in
#                                $CNI_CLUSTER_REGISTER_TAINTS, if set);
#   cluster.sh add-node NAME --no-kubelet   the machine only, for
#   cluster.sh start-kubelet NAME           to start its kubelet later
#   cluster.sh remove-node NAME  the machine gone (its Node object stays)
#   cluster.sh exec NAME CMD...  CMD inside a node (all its namespaces)
#   cluster.sh facts             the cluster's names and ranges as KEY=VALUE
#                                lines, for the tests and e2e.sh
#   cluster.sh down              every process, mount, cgroup, namespace and
#                                file `up` made; also after a killed run
#
# The kubeconfig for this machine is $CLUSTER_DIR/kubeconfig (the API server
# relayed to 127.0.0.1:$API_PORT); kubectl 1.20.2 is $CLUSTER_DIR/bin/kubectl.
set -euo pipefail

HERE=$(cd "$(dirname "$0")" && pwd)
CLUSTER_DIR=${CNI_CLUSTER_DIR:-/tmp/cni-suite-cluster}
K8S_BIN=${K8S_CACHE:-/var/cache/cni-suite/kubernetes-1.20.2}/bin
API_PORT=${CNI_CLUSTER_API_PORT:-16443}
# Names of everything made outside $CLUSTER_DIR start with this: network
# namespaces and cgroup roots.
PREFIX=cnik
UNDERLAY=$PREFIX-underlay
# kind's defaults: node network, pod ranges, service ranges.
NODE_NET4=172.18.0
NODE_NET6=fc00:f853:ccd:e793:
# kind's, unless `up` is given others (CNI_CLUSTER_POD_CIDRS: the scale
# bench needs room for 5000 node CIDRs); `up` keeps them for the commands
# after it.
POD_CIDRS_FILE=$CLUSTER_DIR/pod-cidrs
POD_CIDRS=$(cat "$POD_CIDRS_FILE" 2>/dev/null || echo "${CNI_CLUSTER_POD_CIDRS:-10.244.0.0/16,fd00:10:244::/56}")
SERVICE_CIDRS=10.96.0.0/16,fd00:10:96::/112
API_SERVICE_IPS="10.96.0.1 fd00:10:96::1"
CONTROL_PLANE_IP=$NODE_NET4.2
FEATURES=IPv6DualStack=true
# The kubelet writes these machine-wide tunables; each node gets files of its
# own bound over them.
GUARDED_SYSCTLS="vm/overcommit_memory vm/panic_on_oom kernel/panic kernel/panic_on_oops kernel/keys/root_maxkeys kernel/keys/root_maxbytes"
PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
# What build-kubernetes.sh leaves in the cache and the machines run.
BINARIES="kube-apiserver kubelet kube-controller-manager kube-scheduler kube-proxy kubectl pause e2e.test ginkgo agnhost"
# `up` leaves this in the directory; `down` removes no directory without it.
MARKER=.cni-suite-cluster

say() { echo "cluster: $*" >&2; }
die() { say "$*"; exit 1; }

# Machine names become paths, namespace names and `v-NAME` interfaces (15
# characters at most).
valid_name() { [[ "$1" =~ ^[a-z][a-z0-9-]{0,12}$ ]] || die "not a machine name: '$1'"; }

wait_for() { # SECONDS WHAT CMD...: polls CMD every 0.2 s
	local deadline=$((SECONDS + $1)) what=$2
	shift 2
	until "$@" >/dev/null 2>&1; do
		[ $SECONDS -lt $deadline ] || die "timed out waiting for $what"
		sleep 0.2
	done
}

# ---- certificates -----------------------------------------------------------

PKI=$CLUSTER_DIR/pki

# sign NAME SUBJECT EXTENSIONS: an EC key and a certificate from the cluster CA.
sign() {
	local name=$1 subject=$2 extensions=$3
	openssl ecparam -name prime256v1 -genkey -noout -out "$PKI/$name.key" 2>/dev/null
	openssl req -new -key "$PKI/$name.key" -subj "$subject" -out "$PKI/$name.csr" 2>/dev/null
	printf '%b\n' "$extensions" >"$PKI/$name.ext"
	openssl x509 -req -in "$PKI/$name.csr" -CA "$PKI/ca.crt" -CAkey "$PKI/ca.key" -CAcreateserial \
		-days 30 -extfile "$PKI/$name.ext" -out "$PKI/$name.crt" 2>/dev/null
	rm -f "$PKI/$name.csr" "$PKI/$name.ext"
}

client_cert() { sign "$1" "$2" "keyUsage=critical,digitalSignature\nextendedKeyUsage=clientAuth"; }

make_pki() {
	mkdir -p "$PKI"
	openssl ecparam -name prime256v1 -genkey -noout -out "$PKI/ca.key" 2>/dev/null
	openssl req -x509 -new -key "$PKI/ca.key" -subj /CN=cni-suite-cluster-ca -days 30 -out "$PKI/ca.crt" \
		-addext basicConstraints=critical,CA:TRUE -addext keyUsage=critical,keyCertSign,cRLSign 2>/dev/null
	local sans="DNS:kubernetes,DNS:kubernetes.default,DNS:kubernetes.default.svc,DNS:kubernetes.default.svc.cluster.local,DNS:localhost,IP:127.0.0.1,IP:$CONTROL_PLANE_IP"
	for ip in $API_SERVICE_IPS; do sans="$sans,IP:$ip"; done
	sign apiserver /CN=kube-apiserver \
		"keyUsage=critical,digitalSignature\nextendedKeyUsage=serverAuth\nsubjectAltName=$sans"
	client_cert admin "/O=system:masters/CN=kubernetes-admin"
	client_cert apiserver-kubelet-client "/O=system:masters/CN=kube-apiserver-kubelet-client"
	client_cert controller-manager /CN=system:kube-controller-manager
	client_cert scheduler /CN=system:kube-scheduler
	client_cert kube-proxy /CN=system:kube-proxy
	# Service-account tokens: ES256.
	openssl ecparam -name prime256v1 -genkey -noout -out "$PKI/sa.key" 2>/dev/null
	openssl ec -in "$PKI/sa.key" -pubout -out "$PKI/sa.pub" 2>/dev/null
}

# kubeconfig FILE SERVER CERT-NAME
kubeconfig() {
	local b64="base64 -w0"
	cat >"$1" <<EOF
apiVersion: v1
kind: Config
clusters:
- name: $PREFIX
  cluster:
    server: $2
    certificate-authority-data: $($b64 <"$PKI/ca.crt")
users:
- name: $3
  user:
    client-certificate-data: $($b64 <"$PKI/$3.crt")
    client-key-data: $($b64 <"$PKI/$3.key")
contexts:
- name: $PREFIX
  context:
    cluster: $PREFIX
    user: $3
current-context: $PREFIX
EOF
}

# ---- machines (namespaces) ----------------------------------------------------

machine_dir() { echo "$CLUSTER_DIR/machines/$1"; }
netns_of() { echo "$PREFIX-$1"; }
# The host pid of a machine's pid 1 (its namespaces' anchor).
init_pid() { cat "$(machine_dir "$1")/init.pid"; }

underlay_up() {
	ip netns add "$UNDERLAY"
	ip -n "$UNDERLAY" link set lo up
	ip -n "$UNDERLAY" link add br0 type bridge
	ip -n "$UNDERLAY" link set br0 up
	ip -n "$UNDERLAY" addr add "$NODE_NET4.1/16" dev br0
	ip -n "$UNDERLAY" addr add "$NODE_NET6:1/64" dev br0 nodad
}

# plug NAME INDEX: the machine's network namespace, on the underlay as
# $NODE_NET4.INDEX and $NODE_NET6:INDEX, default routes to the underlay.
plug() {
	local ns
	ns=$(netns_of "$1")
	ip netns add "$ns"
	ip -n "$UNDERLAY" link add "v-$1" type veth peer name eth0 netns "$ns"
	ip -n "$UNDERLAY" link set "v-$1" master br0 up
	ip -n "$ns" link set lo up
	ip -n "$ns" link set eth0 up
	ip -n "$ns" addr add "$NODE_NET4.$2/16" dev eth0
	ip -n "$ns" addr add "$NODE_NET6:$2/64" dev eth0 nodad
	ip -n "$ns" route add default via "$NODE_NET4.1"
	ip -n "$ns" -6 route add default via "$NODE_NET6:1"
}

# boot NAME ROLE INDEX: the machine's pid 1 (machine-init.sh) in new mount,
# pid and uts namespaces; its host pid is recorded, and killing it ends
# every process and mount of the machine.
boot() {
	local name=$1 role=$2 index=$3 dir
	dir=$(machine_dir "$name")
	mkdir -p "$dir/log"
	local netns=/run/netns/$(netns_of "$name")
	# The control plane starts in this machine's network namespace to open
	# the API relay on loopback; its components enter their own.
	local enter=(nsenter "--net=$netns")
	[ "$role" = control-plane ] && enter=()
	CNI_CLUSTER_MACHINE=$dir "${enter[@]}" unshare --mount --pid --uts --fork --kill-child --mount-proc --propagation private \
		env -i PATH="$PATH" MACHINE="$name" ROLE="$role" INDEX="$index" MACHINE_DIR="$dir" \
		CLUSTER_DIR="$CLUSTER_DIR" NETNS="$netns" API_PORT="$API_PORT" HERE="$HERE" \
		CONTROL_PLANE_IP="$CONTROL_PLANE_IP" POD_CIDRS="$POD_CIDRS" SERVICE_CIDRS="$SERVICE_CIDRS" \
		FEATURES="$FEATURES" GUARDED_SYSCTLS="$GUARDED_SYSCTLS" \
		bash "$HERE/machine-init.sh" >"$dir/log/init.log" 2>&1 </dev/null &
	local unshare=$!
	local child=""
	for _ in $(seq 100); do
		child=$(awk '{print $1}' "/proc/$unshare/task/$unshare/children" 2>/dev/null || true)
		[ -n "$child" ] && break
		sleep 0.05
	done
	[ -n "$child" ] || die "$name: no pid 1 ($(cat "$dir/log/init.log"))"
	echo "$child" >"$dir/init.pid"
}

in_machine() { # NAME CMD...: CMD in all the machine's namespaces
	local pid
	pid=$(init_pid "$1")
	shift
	nsenter -t "$pid" -m -u -n -p -- "$@"
}

machine_ready() { [ -e "$(machine_dir "$1")/ready" ]; }

# ---- cgroups ------------------------------------------------------------------

# Every cgroup hierarchy's mount point (v1 controllers and the unified one).
hierarchies() { awk '$3 == "cgroup" || $3 == "cgroup2" {print $2}' /proc/self/mounts; }

cgroup_root_up() {
	local root=/$PREFIX-$1 h
	for h in $(hierarchies); do
		mkdir -p "$h$root"
		if [ -e "$h$root/cpuset.cpus" ] && [ -z "$(cat "$h$root/cpuset.cpus")" ]; then
			cat "$h/cpuset.cpus" >"$h$root/cpuset.cpus"
			cat "$h/cpuset.mems" >"$h$root/cpuset.mems"
		fi
	done
}

# ---- components -----------------------------------------------------------------

write_node_config() { # NAME INDEX
	local name=$1 index=$2 dir
	dir=$(machine_dir "$name")
	mkdir -p "$dir"/{var,etc/upper,etc/work,opt/upper,opt/work,cni-conf,cni-bin,sysctl}
	# As a kind node image carries: the upstream plugins kindnetd uses.
	for plugin in host-local loopback portmap ptp; do
		cp /usr/lib/cni/$plugin "$dir/cni-bin/"
	done
	client_cert "node-$name" "/O=system:nodes/CN=system:node:$name"
	kubeconfig "$dir/kubelet.kubeconfig" "https://$CONTROL_PLANE_IP:6443" "node-$name"
	kubeconfig "$dir/kube-proxy.kubeconfig" "https://$CONTROL_PLANE_IP:6443" kube-proxy
	cat >"$dir/containerd.toml" <<EOF
version = 2
root = "/var/lib/containerd"
state = "/run/containerd"
[grpc]
  address = "/run/containerd/containerd.sock"
[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "k8s.gcr.io/pause:3.2"
  # No CAP_SYS_RESOURCE here: runc cannot lower oom_score_adj (as rootless kind).
  restrict_oom_score_adj = true
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "/opt/cni/bin"
    conf_dir = "/etc/cni/net.d"
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
        SystemdCgroup = false
EOF
	printf 'nameserver %s\n' "$NODE_NET4.1" >"$dir/resolv.conf"
	cat >"$dir/kubelet.yaml" <<EOF
apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
cgroupDriver: cgroupfs
# Several kubelets share this machine's cgroup hierarchy.
cgroupRoot: /$PREFIX-$name
failSwapOn: false
authentication:
  anonymous: {enabled: false}
  webhook: {enabled: true}
  x509: {clientCAFile: $PKI/ca.crt}
authorization: {mode: Webhook}
readOnlyPort: 0
healthzBindAddress: 127.0.0.1
clusterDomain: cluster.local
resolvConf: $dir/resolv.conf
# Several kubelets share one disk.
evictionHard: {memory.available: "100Mi", nodefs.available: "1%", imagefs.available: "1%", nodefs.inodesFree: "1%"}
imageGCHighThresholdPercent: 100
imageGCLowThresholdPercent: 99
serializeImagePulls: false
# A deleted pod's sandbox is stopped (its CNI DEL) at the pod worker's next
# periodic sync once its containers are gone: every minute by default,
# which made every namespace of the tests take a minute to go.
syncFrequency: 10s
featureGates: {IPv6DualStack: true}
EOF
	cat >"$dir/kube-proxy.yaml" <<EOF
apiVersion: kubeproxy.config.k8s.io/v1alpha1
kind: KubeProxyConfiguration
mode: iptables
clusterCIDR: $POD_CIDRS
hostnameOverride: $name
clientConnection: {kubeconfig: $dir/kube-proxy.kubeconfig}
# The machine's conntrack table is not the cluster's to size.
conntrack: {maxPerCore: 0, min: 0, tcpEstablishedTimeout: 0s, tcpCloseWaitTimeout: 0s}
metricsBindAddress: 127.0.0.1:10249
healthzBindAddress: 127.0.0.1:10256
featureGates: {IPv6DualStack: true}
EOF
	echo "$index" >"$dir/index"
}

start_kubelet() { # NAME
	local name=$1 dir index
	dir=$(machine_dir "$name")
	index=$(cat "$dir/index")
	# setsid -f: the daemons belong to the node's pid 1, not to this script.
	in_machine "$name" setsid -f bash "$HERE/keep.sh" "$dir/log/kubelet.log" "$CLUSTER_DIR/bin/kubelet" --config="$dir/kubelet.yaml" \
		--kubeconfig="$dir/kubelet.kubeconfig" --container-runtime=remote \
		--container-runtime-endpoint=unix:///run/containerd/containerd.sock \
		--hostname-override="$name" --node-ip="$NODE_NET4.$index,$NODE_NET6:$index" \
		${CNI_CLUSTER_REGISTER_TAINTS:+--register-with-taints="$CNI_CLUSTER_REGISTER_TAINTS"} \
		--volume-plugin-dir=/var/lib/kubelet/volume-plugins --v=1 </dev/null >/dev/null 2>&1
	in_machine "$name" setsid -f bash "$HERE/keep.sh" "$dir/log/kube-proxy.log" \
		"$CLUSTER_DIR/bin/kube-proxy" --config="$dir/kube-proxy.yaml" --v=1 </dev/null >/dev/null 2>&1
}

control_plane_up() {
	local dir
	dir=$(machine_dir control-plane)
	mkdir -p "$dir"
	kubeconfig "$dir/controller-manager.kubeconfig" "https://$CONTROL_PLANE_IP:6443" controller-manager
	kubeconfig "$dir/scheduler.kubeconfig" "https://$CONTROL_PLANE_IP:6443" scheduler
	plug control-plane 2
	boot control-plane control-plane 2
}

node_up() { # NAME INDEX [--no-kubelet]
	write_node_config "$1" "$2"
	cgroup_root_up "$1"
	plug "$1" "$2"
	boot "$1" node "$2"
}

# Binaries the machines run, linked (or copied) out of the cache: a node's
# /var is its own, so the cache under /var/cache is invisible inside it.
stage_binaries() {
	mkdir -p "$CLUSTER_DIR/bin"
	for b in $BINARIES; do
		ln -f "$K8S_BIN/$b" "$CLUSTER_DIR/bin/$b" 2>/dev/null || cp "$K8S_BIN/$b" "$CLUSTER_DIR/bin/$b"
	done
	python3 "$HERE/images.py" "$CLUSTER_DIR/images" "$K8S_BIN"
	# Further archives every node imports at boot (the suite's `make image`).
	for archive in ${CNI_CLUSTER_IMAGES:-}; do
		cp "$archive" "$CLUSTER_DIR/images/"
	done
}

kubectl() { "$CLUSTER_DIR/bin/kubectl" --kubeconfig "$CLUSTER_DIR/kubeconfig" "$@"; }

api_ready() { kubectl get --raw /readyz; }

node_registered() { kubectl get node "$1"; }

# "CIDR NEXTHOP" for each of node NAME's pod CIDRs, via its InternalIP of the
# same family; nothing until the controller-manager has given it both.
pod_routes_of() { # NAME
	kubectl get node "$1" -o json | jq -r '
		[.status.addresses[] | select(.type == "InternalIP") | .address] as $ips
		| (.spec.podCIDRs // []) as $cidrs | select($cidrs | length == 2)
		| $cidrs[] as $cidr
		| $ips[] | select(contains(":") == ($cidr | contains(":")))
		| "\($cidr) \(.)"'
}

has_pod_cidrs() { [ -n "$(pod_routes_of "$1")" ]; }

# The control plane is no Node here (kind's is one, with kindnetd on it), so
# nothing of the suite routes its traffic to pods; the API server needs
# that for its proxy to pods and Services' endpoints. Each node's pod CIDRs
# are routed to it here, as a cloud's route table does for clusters whose
# control plane runs no pods.
route_from_control_plane() { # NAME
	local routes
	wait_for 60 "$1's pod CIDRs" has_pod_cidrs "$1"
	routes=$(pod_routes_of "$1")
	while read -r cidr via; do
		ip -n "$(netns_of control-plane)" route replace "$cidr" via "$via"
	done <<<"$routes"
}

# What `kubeadm init` records for the tools that read it (kind and
# minikube clusters have it): the pod range given to the controller-manager.
record_cluster_configuration() {
	wait_for 60 "the kube-system namespace" kubectl get namespace kube-system
	kubectl -n kube-system create configmap kubeadm-config --from-literal=ClusterConfiguration="apiVersion: kubeadm.k8s.io/v1beta2
kind: ClusterConfiguration
kubernetesVersion: v1.20.2
controlPlaneEndpoint: $CONTROL_PLANE_IP:6443
networking:
  dnsDomain: cluster.local
  podSubnet: $POD_CIDRS
  serviceSubnet: $SERVICE_CIDRS
" >/dev/null
}

# ---- commands -------------------------------------------------------------------

next_index() { # the lowest machine index not in use
	local i=3
	while grep -qx "$i" "$CLUSTER_DIR"/machines/*/index 2>/dev/null; do i=$((i + 1)); done
	echo "$i"
}

worker_name() { [ "$1" = 1 ] && echo worker || echo "worker$1"; }

cmd_up() {
	local workers=${1:-3}
	# One cluster per machine (fixed names and port): whatever an earlier or
	# killed run left goes first.
	cmd_down
	# Every process this run starts carries it: `down` finds what a killed
	# run left running by it.
	export CNI_CLUSTER_UP=$CLUSTER_DIR/
	for b in $BINARIES; do
		[ -x "$K8S_BIN/$b" ] || die "$K8S_BIN/$b missing: run integration/cluster/build-kubernetes.sh"
	done
	local start=$SECONDS
	mkdir -p "$CLUSTER_DIR/machines"
	touch "$CLUSTER_DIR/$MARKER"
	POD_CIDRS=${CNI_CLUSTER_POD_CIDRS:-10.244.0.0/16,fd00:10:244::/56}
	echo "$POD_CIDRS" >"$POD_CIDRS_FILE"
	stage_binaries
	make_pki
	kubeconfig "$CLUSTER_DIR/kubeconfig" "https://127.0.0.1:$API_PORT" admin
	underlay_up
	control_plane_up
	local names=()
	for i in $(seq "$workers"); do
		names+=("$(worker_name "$i")")
		node_up "$(worker_name "$i")" $((i + 2))
	done
	wait_for 120 "the API server" api_ready
	record_cluster_configuration
	say "control plane ready after $((SECONDS - start)) s"
	for name in "${names[@]}"; do wait_for 120 "$name's containerd and images" machine_ready "$name"; done
	for name in "${names[@]}"; do start_kubelet "$name"; done
	for name in "${names[@]}"; do wait_for 120 "$name to register" node_registered "$name"; done
	for name in "${names[@]}"; do route_from_control_plane "$name"; done
	say "${#names[@]} nodes registered after $((SECONDS - start)) s (NotReady until a CNI configuration exists)"
	say "KUBECONFIG=$CLUSTER_DIR/kubeconfig $CLUSTER_DIR/bin/kubectl get nodes"
}

cmd_add_node() { # NAME [--no-kubelet]
	local name=$1
	valid_name "$name"
	node_up "$name" "$(next_index)"
	wait_for 120 "$name's containerd and images" machine_ready "$name"
	if [ "${2:-}" = --no-kubelet ]; then return; fi
	start_kubelet "$name"
	wait_for 120 "$name to register" node_registered "$name"
	route_from_control_plane "$name"
}

# A process neither gone nor a zombie waiting to be reaped.
running() { # PID
	local state
	state=$(sed 's/.*) //' "/proc/$1/stat" 2>/dev/null | cut -d' ' -f1)
	[ -n "$state" ] && [ "$state" != Z ]
}

# Kills every process whose environment has an entry GREP-ARGS match
# (`grep -z` arguments), each checked again just before its kill (a pid
# freed and reused meanwhile is someone else's), and waits until they are
# gone. Processes are found by their environment, not by pid files: a run
# killed between starting one and recording it leaves no file.
kill_by_env() { # GREP-ARGS...
	local pids pid
	pids=$(grep -lsz "$@" /proc/[0-9]*/environ | cut -d/ -f3 || true)
	for pid in $pids; do
		[ "$pid" != $$ ] || continue
		if grep -qsz "$@" "/proc/$pid/environ"; then kill -KILL "$pid" 2>/dev/null || true; fi
	done
	for pid in $pids; do
		for _ in $(seq 100); do running "$pid" || break; sleep 0.1; done
	done
}

# Ends one machine: its unshare (--kill-child ends pid 1) and pid 1 take
# every process and mount of the machine along; then its cgroups, network
# namespace, files and the control plane's routes to its pods go.
machine_down() { # NAME
	local name=$1 dir index
	dir=$(machine_dir "$name")
	kill_by_env -xF "CNI_CLUSTER_MACHINE=$dir"
	kill_by_env -xF "MACHINE_DIR=$dir"
	cgroups_down "$PREFIX-$name" || return 1
	ip netns del "$(netns_of "$name")" 2>/dev/null || true
	index=$(cat "$dir/index" 2>/dev/null || true)
	if [ -n "$index" ] && [ "$name" != control-plane ]; then
		ip -n "$(netns_of control-plane)" route flush via "$NODE_NET4.$index" 2>/dev/null || true
		ip -n "$(netns_of control-plane)" -6 route flush via "$NODE_NET6:$index" 2>/dev/null || true
	fi
	[ -d "$dir" ] && rm -rf --one-file-system "$dir"
	return 0
}

# Removes every cgroup under the roots matching PATTERN, depth first,
# waiting a moment for the kernel to finish reaping their processes. A
# cgroup left FROZEN (runc freezes a container's to kill all of it, and
# can itself be killed before it thaws) keeps its processes, SIGKILL
# pending, until thawed.
cgroups_down() { # PATTERN
	local h d
	for _ in $(seq 50); do
		local left=0
		for h in $(hierarchies); do
			for d in "$h"/$1; do
				[ -d "$d" ] || continue
				find "$d" -name freezer.state -exec sh -c 'for f; do echo THAWED >"$f"; done' _ {} + 2>/dev/null || true
				find "$d" -depth -type d -exec rmdir {} + 2>/dev/null || true
				[ -d "$d" ] && left=1
			done
		done
		[ $left = 0 ] && return 0
		sleep 0.1
	done
	say "cgroups $1 still in use"
	return 1
}

# Ends every machine, then removes what is left by name (a killed run's
# namespaces and cgroups) and the cluster's directory.
cmd_down() {
	local failed=0
	if [ -d "$CLUSTER_DIR" ] && [ ! -e "$CLUSTER_DIR/$MARKER" ]; then
		die "$CLUSTER_DIR is not a cluster directory (no $MARKER): not removing it"
	fi
	# Every entry ends with / so that no other directory's name matches.
	local tags=(-e "CNI_CLUSTER_UP=$CLUSTER_DIR/" -e "CNI_CLUSTER_MACHINE=$CLUSTER_DIR/machines/"
		-e "MACHINE_DIR=$CLUSTER_DIR/machines/")
	# What a killed `up` left running (images.py, openssl, a machine's
	# unshare), then every machine, its directory there or not.
	kill_by_env -F "${tags[@]}"
	cgroups_down "$PREFIX-*" || failed=1
	for ns in $(ip netns list | awk '{print $1}' | grep "^$PREFIX-" || true); do
		ip netns del "$ns" 2>/dev/null || true
	done
	[ $failed = 0 ] || die "not everything could be removed (above); nothing of $CLUSTER_DIR was deleted"
	if [ -d "$CLUSTER_DIR" ]; then
		# The marker last: a `down` killed meanwhile leaves a directory the
		# next one still knows as a cluster's.
		find "$CLUSTER_DIR" -mindepth 1 -maxdepth 1 ! -name "$MARKER" -exec rm -rf --one-file-system {} +
		rm -rf --one-file-system "$CLUSTER_DIR"
	fi
	# Checked, not assumed: what a killed run leaves must not outlive this.
	local left
	left=$({
		ip netns list | awk '{print $1}' | grep "^$PREFIX-"
		grep -lszF "${tags[@]}" /proc/[0-9]*/environ
		awk -v d="$CLUSTER_DIR" '$5 == d || index($5, d "/") == 1' /proc/self/mountinfo
	} || true)
	[ -z "$left" ] || die "left after down: $left"
	say "down"
}

# What the tests and e2e.sh need to know of the cluster's shape, said once:
# here.
cmd_facts() {
	cat <<-FACTS
	UNDERLAY_NETNS=$UNDERLAY
	OUTSIDE_ADDRESSES=$NODE_NET4.1,$NODE_NET6:1
	NODE_NETWORKS=$NODE_NET4.0/16,$NODE_NET6:/64
	POD_CIDRS=$POD_CIDRS
	SERVICE_CIDRS=$SERVICE_CIDRS
	CONTROL_PLANE_IP=$CONTROL_PLANE_IP
	FACTS
}

case "${1:-}" in
up) shift; cmd_up "$@" ;;
facts) cmd_facts ;;
down) cmd_down ;;
add-node) shift; cmd_add_node "$@" ;;
remove-node) shift; valid_name "$1"; machine_down "$1" ;;
start-kubelet) shift; start_kubelet "$1" ;;
exec) shift; name=$1; shift; in_machine "$name" "$@" ;;
*) sed -n '2,/^set -euo/p' "$0" | sed '$d' >&2; exit 2 ;;
esac
