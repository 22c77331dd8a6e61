#!/usr/bin/env bash
# Kubernetes' own network e2e tests (e2e.test of the same v1.20.2 tree)
# against the running real cluster, and their outcome spec by spec.
#
#   e2e.sh subset        what `make test` runs: Granular Checks: Pods (the 4
#                        [Conformance] specs), the pod- and node-to-Service
#                        http/udp specs of Granular Checks: Services, and 5
#                        NetworkPolicy specs (default deny, pod and
#                        namespace selectors, ports, a named port with
#                        egress, ipBlock with except)
#   e2e.sh conformance   every [sig-network] spec that needs no cloud
#                        provider, cluster DNS or SCTP sockets and is not
#                        [Disruptive] or [Serial] ([Slow] ones included,
#                        and the NetworkPolicy specs; the list below says
#                        what is left out and why)
#   e2e.sh netpol        the [Feature:NetworkPolicy] specs alone, the SCTP
#                        ones left out
#
# Writes $E2E_REPORT_DIR (default target/e2e/MODE) with the run's log,
# ginkgo's JUnit files and summary.txt: every spec the focus names, passed,
# failed, or skipped and why.
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
CLUSTER_DIR=${CNI_CLUSTER_DIR:-/tmp/cni-suite-cluster}
MODE=${1:-}
REPORT=${E2E_REPORT_DIR:-$HERE/../../target/e2e/$MODE}
# Two ginkgo processes (this machine has two cores).
NODES=${E2E_PARALLEL:-2}

case "$MODE" in
subset)
	FOCUS='\[sig-network\] (Networking Granular Checks: (Pods should function for (intra|node)-pod communication: (http|udp)|Services should function for (pod|node)-Service: (http|udp))|NetworkPolicy \[LinuxOnly\] NetworkPolicy between server and client should (support a .default-deny-all. policy|enforce policy based on PodSelector and NamespaceSelector|enforce policy based on Ports|allow egress access on one named port|enforce except clause while egress access to server in CIDR block))'
	;;
conformance)
	FOCUS='\[sig-network\]'
	;;
netpol)
	FOCUS='\[Feature:NetworkPolicy\]'
	;;
*)
	sed -n '2,17p' "$0" >&2
	exit 2
	;;
esac
# What this cluster cannot run, each with its reason: the subset and the
# full set leave these out, and the summary names the reason per spec.
EXCLUDED="$REPORT.excluded"
mkdir -p "$(dirname "$REPORT")"
cat >"$EXCLUDED" <<'LIST'
SCTP	no SCTP sockets in this kernel (CONFIG_IP_SCTP unset)
\[Disruptive\]|\[Serial\]	[Disruptive] or [Serial]: left out by the issue (one shared cluster)
DNS|ExternalName|externalname|should create endpoints for unready pods|Services should (have|be able to switch) session affinity|listening on same port number but different protocols|be rejected when no endpoints exist|create a functioning NodePort service|hairpin back to themselves through services	needs cluster DNS (Debian has no CoreDNS package): dials the Service by name
KubeProxy should set TCP CLOSE_WAIT timeout	kube-proxy here leaves the machine's conntrack timeouts alone (tcpCloseWaitTimeout 0)
resolve connection reset issue #74839	its regression-issue-74839 image is not built here
[Ll]oad ?[Bb]alancer|change the type and ports of a service|ESIPP|\[Feature:NEG\]|\[Feature:kubemci\]|\[Feature:Ingress\]|Loadbalancing: L7|Firewall rule|\[Provider:	needs a cloud provider
\[Feature:Networking-IPv[46]\]	needs the internet from pods (this machine has none)
\[Feature:Networking-Performance\]	an iperf throughput measurement, not pass/fail (make bench measures the suite)
\[Feature:Example\]	the guestbook example's images are not built here
LIST
SKIP=$(cut -f1 "$EXCLUDED" | paste -sd'|')

rm -rf "$REPORT"
mkdir -p "$REPORT"
# The runner's own internet check (internet_standin.py says why).
python3 "$HERE/internet_standin.py" "$REPORT/standin.port" &
standin=$!
trap 'kill $standin 2>/dev/null' EXIT
for _ in $(seq 50); do [ -s "$REPORT/standin.port" ] && break; sleep 0.1; done
# The cluster's node, pod and Service ranges never go through it.
facts=$("$HERE/cluster.sh" facts)
eval "$facts"
export HTTP_PROXY=http://127.0.0.1:$(cat "$REPORT/standin.port") \
	NO_PROXY=127.0.0.1,localhost,$NODE_NETWORKS,$POD_CIDRS,$SERVICE_CIDRS
unset HTTPS_PROXY https_proxy http_proxy
# Only ginkgo's first process counts the nodes when --num-nodes is not
# given; the others then skip every spec that needs two nodes (the
# Services granular checks, after setting up for 20 s).
WORKERS=$("$CLUSTER_DIR/bin/kubectl" --kubeconfig "$CLUSTER_DIR/kubeconfig" get nodes --no-headers | wc -l)
rc=0
"$CLUSTER_DIR/bin/ginkgo" -nodes="$NODES" -noColor -succinct "$CLUSTER_DIR/bin/e2e.test" -- \
	--kubeconfig="$CLUSTER_DIR/kubeconfig" --kubectl-path="$CLUSTER_DIR/bin/kubectl" \
	--provider=skeleton --num-nodes="$WORKERS" --report-dir="$REPORT" --disable-log-dump --dump-logs-on-failure=false \
	--ginkgo.focus="$FOCUS" --ginkgo.skip="$SKIP" --ginkgo.noColor \
	>"$REPORT/e2e.log" 2>&1 || rc=$?
python3 "$HERE/junit_summary.py" "$REPORT" "$FOCUS" "$EXCLUDED" | tee "$REPORT/summary.txt"
[ $rc = 0 ] || { tail -60 "$REPORT/e2e.log"; echo "e2e: failed (exit $rc); log in $REPORT/e2e.log" >&2; }
exit $rc
