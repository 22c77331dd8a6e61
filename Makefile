# The CNI plugin suite. `make test` and `make demo` work on a fresh Debian or
# Ubuntu machine as root: they install what they need first.

SHELL := /bin/bash
export PATH := $(HOME)/.cargo/bin:$(PATH)

PREFIX ?= /opt/cni/bin
BINDIR ?= /usr/local/bin
DESTDIR ?=

PLUGINS := loopback bridge host-local istio-redirect portmap firewall
TOOLS := cnictl
# The node agent runs from a DaemonSet, never installed here.
AGENT := cni-node-agent

# Static binaries run on any node image (kind, minikube, containerd hosts).
# relocation-model=static gives a plain static executable rather than a
# static-pie one, so `ldd` reports "not a dynamic executable".
STATIC_RUSTFLAGS := -C target-feature=+crt-static -C relocation-model=static
TARGET = $(shell rustc -vV | sed -n 's/^host: //p')
RELEASE_DIR = target/$(TARGET)/release

# Debian packages the build, the tests and the demo use.
APT_PACKAGES := gcc libc6-dev make iproute2 util-linux coreutils busybox-static ca-certificates curl \
	python3 containernetworking-plugins iptables nftables \
	golang-go golang-github-appc-cni-dev xz-utils containerd runc protobuf-compiler strace \
	python3-yaml python3-venv skopeo \
	rsync jq dpkg-dev etcd-server openssl netcat-openbsd conntrack ipset

.PHONY: kubernetes cluster cluster-down cluster-test conformance
.PHONY: all deps toolchain build fault-bin fuzz cnitool install install-service uninstall check-install bench bench-cluster bench-readme bench-smoke soak test unit integration lint demo demo-cluster image manifests validate-manifest clean

all: build

deps:
	@missing=""; for p in $(APT_PACKAGES); do dpkg -s $$p >/dev/null 2>&1 || missing="$$missing $$p"; done; \
	if [ -n "$$missing" ]; then \
		echo "installing:$$missing"; \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $$missing; \
	fi
	@$(MAKE) --no-print-directory toolchain

# Debian's own rustc is too old for this workspace (edition 2024); rustup's
# stable is used when no cargo is on PATH.
toolchain:
	@command -v cargo >/dev/null 2>&1 || { \
		echo "installing the stable Rust toolchain with rustup"; \
		curl -sSf https://sh.rustup.rs | sh -s -- -y --profile minimal --component clippy,rustfmt; }
	@cargo clippy --version >/dev/null 2>&1 || rustup component add clippy rustfmt

build: deps
	RUSTFLAGS="$(STATIC_RUSTFLAGS)" cargo build --release --locked --target $(TARGET) $(addprefix --bin ,$(PLUGINS) $(TOOLS) $(AGENT))

# host-local, bridge, istio-redirect and firewall with named pause points
# for the crash tests (cni::fault); debug builds in their own target
# directory, never installed.
FAULT_DIR := target/fault
fault-bin: deps
	cargo build --locked -p host-local -p bridge -p istio-redirect -p firewall-plugin \
		--features host-local/fault-injection,bridge/fault-injection,istio-redirect/fault-injection,firewall-plugin/fault-injection \
		--target-dir $(FAULT_DIR)

# Coverage-guided fuzzing with libFuzzer on the stable toolchain: the
# sanitizer-coverage instrumentation is plain -C flags (no -Z, no nightly,
# no RUSTC_BOOTSTRAP); safe Rust needs no AddressSanitizer. Each target runs
# FUZZ_SECONDS from the seeds and the corpus it grew before; a crash fails
# the run and leaves its input in target/fuzz-artifacts.
FUZZ_TARGETS := cni_args config result
FUZZ_SECONDS ?= 20
FUZZ_RUSTFLAGS := -Cpasses=sancov-module -Cllvm-args=-sanitizer-coverage-level=4 \
	-Cllvm-args=-sanitizer-coverage-inline-8bit-counters -Cllvm-args=-sanitizer-coverage-pc-table \
	-Cllvm-args=-sanitizer-coverage-trace-compares --cfg fuzzing -Cdebug-assertions -Coverflow-checks
fuzz: deps
	cd fuzz && RUSTFLAGS="$(FUZZ_RUSTFLAGS)" cargo build --locked --release --target $(TARGET) \
		--target-dir $(CURDIR)/target/fuzz-build
	@mkdir -p target/fuzz-artifacts
	@for t in $(FUZZ_TARGETS); do \
		corpus=target/fuzz-corpus/$$t; mkdir -p $$corpus; cp fuzz/seeds/$$t/* $$corpus/; \
		[ $$t = config ] && cp conf-examples/*.conf* $$corpus/; \
		echo "fuzz: $$t for $(FUZZ_SECONDS) s"; \
		target/fuzz-build/$(TARGET)/release/$$t $$corpus -max_total_time=$(FUZZ_SECONDS) \
			-artifact_prefix=target/fuzz-artifacts/$$t- -print_final_stats=1 2>&1 \
			| grep -E '^(stat::number_of_executed_units|stat::new_units_added|==|SUMMARY|Done)|panicked' ; \
		[ $${PIPESTATUS[0]} -eq 0 ] || { echo "fuzz: $$t found a failing input (target/fuzz-artifacts)"; exit 1; }; \
	done

# Go's cnitool, built from Debian's source package of the installed libcni
# (no binary package ships it), for the interop tests.
CNITOOL := target/tools/cnitool
cnitool: deps
	@[ -x $(CNITOOL) ] || integration/tools/build-cnitool.sh $(CURDIR)/$(CNITOOL)

# `make install [CONF=conf-examples/<file>]`: the plugins to $(PREFIX), cnictl
# to $(BINDIR), the chosen conflist to $(CONF_DIR). What it installed is
# listed in $(MANIFEST), and `make uninstall` removes exactly that.
CONF ?=
CONF_DIR ?= /etc/cni/net.d
MANIFEST ?= /var/lib/cni-suite/installed
# The node's own plugins of the same names (the reference's portmap and
# firewall, often), kept here by install and put back by uninstall.
KEPT_DIR ?= /var/lib/cni-suite/kept
install: build
	install -d $(DESTDIR)$(PREFIX) $(DESTDIR)$(BINDIR) $(dir $(DESTDIR)$(MANIFEST)) $(DESTDIR)$(KEPT_DIR)
	@for p in $(PLUGINS); do \
		if [ -e $(DESTDIR)$(PREFIX)/$$p ] && [ ! -e $(DESTDIR)$(KEPT_DIR)/$$p ] && \
			! grep -qx "$(PREFIX)/$$p" $(DESTDIR)$(MANIFEST) 2>/dev/null; then \
			cp -p $(DESTDIR)$(PREFIX)/$$p $(DESTDIR)$(KEPT_DIR)/$$p && echo "kept the node's $$p in $(KEPT_DIR)"; \
		fi; \
	done
	install -m 0755 $(addprefix $(RELEASE_DIR)/,$(PLUGINS)) $(DESTDIR)$(PREFIX)/
	install -m 0755 $(addprefix $(RELEASE_DIR)/,$(TOOLS)) $(DESTDIR)$(BINDIR)/
	@printf '%s\n' $(addprefix $(PREFIX)/,$(PLUGINS)) $(addprefix $(BINDIR)/,$(TOOLS)) > $(DESTDIR)$(MANIFEST)
	@if [ -n "$(CONF)" ]; then \
		install -d $(DESTDIR)$(CONF_DIR) && \
		install -m 0644 $(CONF) $(DESTDIR)$(CONF_DIR)/ && \
		echo $(CONF_DIR)/$(notdir $(CONF)) >> $(DESTDIR)$(MANIFEST); \
	fi
	@echo "installed:"; sed 's/^/  /' $(DESTDIR)$(MANIFEST)

# The lease service as systemd units (socket-activated).
SYSTEMD_DIR ?= /etc/systemd/system
install-service: install
	install -d $(DESTDIR)$(SYSTEMD_DIR)
	install -m 0644 conf-examples/systemd/host-local.socket conf-examples/systemd/host-local.service $(DESTDIR)$(SYSTEMD_DIR)/

uninstall:
	@[ -f $(DESTDIR)$(MANIFEST) ] || { echo "nothing installed (no $(DESTDIR)$(MANIFEST))"; exit 0; }; \
	while read -r file; do rm -f "$(DESTDIR)$$file" && echo "removed $$file"; done < $(DESTDIR)$(MANIFEST); \
	for kept in $(DESTDIR)$(KEPT_DIR)/*; do \
		[ -e "$$kept" ] || continue; \
		mv "$$kept" $(DESTDIR)$(PREFIX)/ && echo "put back the node's $$(basename "$$kept")"; \
	done; \
	rmdir $(DESTDIR)$(KEPT_DIR) 2>/dev/null; \
	rm -f $(DESTDIR)$(MANIFEST); rmdir $(dir $(DESTDIR)$(MANIFEST)) 2>/dev/null || true

lint: deps
	cargo fmt --all -- --check
	cargo clippy --workspace --all-targets --locked -- -D warnings

# The end-to-end tests, their kit and the bench are `make integration`'s.
unit: deps
	cargo test --workspace --locked --exclude integration --exclude test-kit --exclude cni-bench

# End-to-end tests run the static release binaries, as they ship.
integration: build fault-bin cnitool
	CNI_SUITE_BIN_DIR=$(CURDIR)/$(RELEASE_DIR) CNI_SUITE_FAULT_BIN=$(CURDIR)/$(FAULT_DIR)/debug/host-local \
		CNI_SUITE_CNITOOL=$(CURDIR)/$(CNITOOL) cargo test --locked -p integration -p test-kit -p cni-bench

# install and uninstall into a scratch DESTDIR, checked file by file.
check-install: build
	integration/tools/check-install.sh

# The suite and Debian's reference plugins side by side (see docs/bench/README.md):
# medians, ratios, a chart and a report under bench-results/. Fails on a
# failure, duplicate address or leak, never on a timing.
# perf is best effort: Debian calls it linux-perf; elsewhere it may not
# exist for the running kernel, and the report then says so.
BENCH_ARGS ?=
bench: build
	@dpkg -s linux-perf >/dev/null 2>&1 || command -v perf >/dev/null 2>&1 || \
		DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends linux-perf || \
		echo "bench: perf is not installable here; its profiles are skipped"
	cargo build --release --locked -p cni-bench --bin cni-bench
	CNI_SUITE_BIN_DIR=$(CURDIR)/$(RELEASE_DIR) target/release/cni-bench --out bench-results $(BENCH_ARGS)
	$(MAKE) bench-cluster

# The cluster half of `make bench`: the node agent at 5000 Nodes, the
# masquerade chain at 3 and 5000, and NetworkPolicy at 10 and 1000
# policies over 5000 pods, on a real cluster brought up for it (pod ranges
# holding 5000 node CIDRs) and taken down afterwards.
CLUSTER_BENCH_ARGS ?=
bench-cluster: image kubernetes
	cargo build --release --locked -p cni-bench --bin cluster-bench
	@trap '$(CLUSTER) down' EXIT; \
	export CNI_CLUSTER_IMAGES=$(CURDIR)/$(IMAGE_TAR) CNI_CLUSTER_POD_CIDRS=10.224.0.0/11,fd00:10:224::/48; \
	$(CLUSTER) up && \
	$(CLUSTER_KUBECTL) apply -f $(K8S_MANIFEST) && \
	$(CLUSTER_KUBECTL) wait --for=condition=Ready node --all --timeout=180s && \
	CNI_SUITE_BIN_DIR=$(CURDIR)/$(RELEASE_DIR) target/release/cluster-bench --out bench-results $(CLUSTER_BENCH_ARGS)

# docs/bench/README.md's bench tables, generated from the runs they show:
# `make bench`, then this, which keeps those runs' reports, chart and JSON
# in docs/bench (run from there, so the tables link their JSON beside them).
bench-readme:
	cargo build --release --locked -p cni-bench --bin cni-bench --bin cluster-bench
	install -d docs/bench
	cp bench-results/run.json bench-results/report.md bench-results/latency.svg docs/bench/
	cp bench-results/cluster.json bench-results/cluster.md docs/bench/
	cd docs/bench && ../../target/release/cni-bench --update-readme README.md --from run.json
	cd docs/bench && ../../target/release/cluster-bench --update-readme README.md --from cluster.json \
		$(if $(wildcard docs/bench/cluster-policy.json),--from cluster-policy.json)

# The same program, tiny, so the bench keeps working (no timing is judged).
bench-smoke: build
	cargo build --release --locked -p cni-bench --bin cni-bench
	CNI_SUITE_BIN_DIR=$(CURDIR)/$(RELEASE_DIR) target/release/cni-bench --pods 4 --repeats 1 --full-leases 300 \
		--out target/bench-smoke > /dev/null

# Long runs: the churn soak with 1000 pods, then the crash campaign
# (make test runs both, the soak with 300 pods).
SOAK_PODS ?= 1000
# Further seeds of the random crash campaign (each 100 kills of the chain).
SOAK_CRASH_SEEDS ?= 1 2 3 4 5
# (The faults tier's two modules, soak first, as when they were two binaries.)
SOAK_ENV = CNI_SUITE_BIN_DIR=$(CURDIR)/$(RELEASE_DIR) CNI_SUITE_FAULT_BIN=$(CURDIR)/$(FAULT_DIR)/debug/host-local CNI_SUITE_SOAK_PODS=$(SOAK_PODS)
soak: build fault-bin
	$(SOAK_ENV) cargo test --locked -p integration --test faults -- --nocapture soak::
	$(SOAK_ENV) cargo test --locked -p integration --test faults -- --nocapture crash::
	for seed in $(SOAK_CRASH_SEEDS); do \
		CNI_SUITE_BIN_DIR=$(CURDIR)/$(RELEASE_DIR) CNI_SUITE_CRASH_SEED=$$seed \
			cargo test --locked -p integration --test faults -- --nocapture crash::a_hundred_kills || exit 1; \
	done

test: lint unit integration validate-manifest image check-install bench-smoke fuzz cluster-test

# The real cluster (integration/cluster, README "On a cluster"): Kubernetes
# v1.20.2 built once from Debian 12's source package into K8S_CACHE (outside
# the checkout; later runs reuse it), then a control plane and three nodes
# in namespaces of this machine, each importing the suite's image.
export K8S_CACHE ?= /var/cache/cni-suite/kubernetes-1.20.2
export CNI_CLUSTER_DIR ?= /tmp/cni-suite-cluster
CLUSTER := integration/cluster/cluster.sh
CLUSTER_KUBECTL = $(CNI_CLUSTER_DIR)/bin/kubectl --kubeconfig $(CNI_CLUSTER_DIR)/kubeconfig
kubernetes: deps
	integration/cluster/build-kubernetes.sh

# Left running for a person: the suite applied, every node Ready.
cluster: image kubernetes
	CNI_CLUSTER_IMAGES=$(CURDIR)/$(IMAGE_TAR) $(CLUSTER) up
	$(CLUSTER_KUBECTL) apply -f $(K8S_MANIFEST)
	$(CLUSTER_KUBECTL) wait --for=condition=Ready node --all --timeout=180s
	@echo "export KUBECONFIG=$(CNI_CLUSTER_DIR)/kubeconfig; kubectl 1.20.2 is $(CNI_CLUSTER_DIR)/bin/kubectl"

cluster-down:
	$(CLUSTER) down

# The cluster tier of `make test`: an `up` killed at a random moment, then
# a fresh cluster without the suite (the tests apply it) made over what the
# killed one left, the tests, the sandbox bench tiny (it swaps the suite for
# the reference plugins and back; no timing is judged), Kubernetes' e2e
# subset, and the cluster gone afterwards whatever happened.
cluster-test: image kubernetes
	cargo build --release --locked -p cni-bench --bin cluster-bench
	@trap '$(CLUSTER) down' EXIT; \
	export CNI_CLUSTER_IMAGES=$(CURDIR)/$(IMAGE_TAR); \
	integration/cluster/interrupted-up.sh && \
	$(CLUSTER) up && \
	cargo test --locked -p integration --test cluster -- --ignored --nocapture real_ && \
	target/release/cluster-bench --only sandbox --burst-pods 6 --burst-rounds 1 --out target/cluster-bench-smoke > /dev/null && \
	integration/cluster/e2e.sh subset

# Every [sig-network] e2e spec this cluster can run (e2e.sh says which are
# left out and why) on a fresh cluster with the suite.
conformance: image kubernetes
	@trap '$(CLUSTER) down' EXIT; \
	CNI_CLUSTER_IMAGES=$(CURDIR)/$(IMAGE_TAR) $(CLUSTER) up && \
	$(CLUSTER_KUBECTL) apply -f $(K8S_MANIFEST) && \
	$(CLUSTER_KUBECTL) wait --for=condition=Ready node --all --timeout=180s && \
	integration/cluster/e2e.sh conformance

# The node agent's image (deploy/cni-suite.yaml runs it): an OCI archive
# that `kind load image-archive`, `ctr images import` and `docker load` read.
VERSION := $(shell sed -n 's/^version = "\(.*\)"/\1/p' Cargo.toml | head -1)
IMAGE_NAME := docker.io/cni-suite/node-agent:$(VERSION)
IMAGE_TAR := target/cni-suite-image.tar
image: build
	python3 deploy/image.py $(IMAGE_TAR) $(IMAGE_NAME) $(RELEASE_DIR)
	@echo "$(IMAGE_TAR): $(IMAGE_NAME)"

# The Istio manifests are generated from the base one, so they cannot
# drift apart by hand: the suite in Istio's mode, and Istio's CNI alone.
K8S_MANIFEST := deploy/cni-suite.yaml
K8S_ISTIO_MANIFEST := deploy/cni-suite-istio.yaml
K8S_ISTIO_ONLY_MANIFEST := deploy/istio-cni.yaml
manifests: deps
	python3 deploy/render.py $(K8S_ISTIO_MANIFEST) $(K8S_ISTIO_ONLY_MANIFEST)

# The manifests against the API's own schemas, offline (kubernetes-validate
# bundles them; Debian's kubectl cannot validate without a server), and the
# checked-in Istio manifest against a fresh render.
VALIDATE := target/tools/validate
validate-manifest: deps
	@[ -x $(VALIDATE)/bin/kubernetes-validate ] || { python3 -m venv $(VALIDATE) && \
		$(VALIDATE)/bin/pip install -q kubernetes-validate==1.33.1; }
	$(VALIDATE)/bin/kubernetes-validate -k 1.33.0 --strict $(K8S_MANIFEST) $(K8S_ISTIO_MANIFEST) $(K8S_ISTIO_ONLY_MANIFEST)
	@fresh=$$(mktemp -d) && trap 'rm -rf "$$fresh"' EXIT && python3 deploy/render.py "$$fresh/istio" "$$fresh/istio-only" && \
		cmp "$$fresh/istio" $(K8S_ISTIO_MANIFEST) && cmp "$$fresh/istio-only" $(K8S_ISTIO_ONLY_MANIFEST) || \
		{ echo "the Istio manifests are stale: run make manifests" >&2; exit 1; }

demo: build
	@BIN_DIR=$(CURDIR)/$(RELEASE_DIR) ./integration/demo.sh

# Three nodes in network namespaces on an underlay, each running the node
# agent against the API test server; pods on different nodes talk.
demo-cluster: build
	@CNI_SUITE_BIN_DIR=$(CURDIR)/$(RELEASE_DIR) LAB_SAY=1 cargo test --locked -q -p integration \
		--test cluster -- --nocapture cluster_lab::three_nodes

clean:
	cargo clean
