#!/usr/bin/env bash
# Kubernetes v1.20.2 for the real-cluster tier, built from Debian 12's
# `kubernetes` source package, plus kubectl from Debian's kubernetes-client
# .deb and the pause binary of the same tree. Everything lands in
# $K8S_CACHE/bin, outside any checkout, and a second run with every binary
# there does nothing. The machine's apt configuration is never touched: a
# private configuration (own sources list, lists and archives) fetches the
# source and the .deb.
set -euo pipefail

CACHE=${K8S_CACHE:-/var/cache/cni-suite/kubernetes-1.20.2}
BIN=$CACHE/bin
WANT="kube-apiserver kubelet kube-controller-manager kube-scheduler kube-proxy e2e.test ginkgo agnhost pause kubectl"

# The tree vendors github.com/modern-go/reflect2 v1.0.1, which mirrors the
# Go runtime's map iterator as it was before Go 1.18: built with Debian 12's
# Go 1.19, JSON-encoding any map (a Node's labels in a LIST) can write past
# it, and the API server dies of `unexpected fault address` in
# mapiterinit (seen listing 200 Nodes with curl). v1.0.2 (Debian's
# golang-github-modern-go-reflect2-dev) is the fix. Binaries built before
# the fix carry no stamp and are built again.
FIXED=$BIN/.reflect2-v1.0.2
GO_BUILT="kube-apiserver kubelet kube-controller-manager kube-scheduler kube-proxy e2e.test ginkgo agnhost"
if [ ! -e "$FIXED" ]; then for b in $GO_BUILT; do rm -f "$BIN/$b"; done; fi
missing() { for b in $WANT; do [ -x "$BIN/$b" ] || echo "$b"; done; }
# A binary lands under its name whole or not at all: a run killed while
# writing one must not leave a file the next run takes as built.
place() { # SOURCE NAME
	install -m 0755 "$1" "$BIN/$2.partial"
	mv -f "$BIN/$2.partial" "$BIN/$2"
}
[ -z "$(missing)" ] && { echo "kubernetes: cached in $BIN"; exit 0; }
mkdir -p "$BIN"

# The private apt configuration: Debian's deb.debian.org (what a stock
# Debian 12 uses), its archive keyring read, nothing under /etc/apt or
# /var/lib/apt written.
APT=$CACHE/apt
mkdir -p "$APT/lists/partial" "$APT/archives/partial" "$APT/parts"
KEYRING=/usr/share/keyrings/debian-archive-keyring.gpg
cat > "$APT/sources.list" <<LIST
deb [signed-by=$KEYRING] http://deb.debian.org/debian bookworm main
deb-src [signed-by=$KEYRING] http://deb.debian.org/debian bookworm main
deb [signed-by=$KEYRING] http://deb.debian.org/debian-security bookworm-security main
deb-src [signed-by=$KEYRING] http://deb.debian.org/debian-security bookworm-security main
LIST
apt_private() {
	apt-get -q -o Dir::Etc::SourceList="$APT/sources.list" -o Dir::Etc::SourceParts="$APT/parts" \
		-o Dir::State::Lists="$APT/lists" -o Dir::Cache::Archives="$APT/archives" \
		-o Dir::Cache::pkgcache="" -o Dir::Cache::srcpkgcache="" "$@"
}
[ -n "$(ls "$APT/lists" | grep -v partial || true)" ] || apt_private update >/dev/null

SRC=$CACHE/src
if [ ! -x "$BIN/kubectl" ]; then
	(cd "$CACHE" && apt_private download kubernetes-client >/dev/null) ||
		{ apt_private update >/dev/null && (cd "$CACHE" && apt_private download kubernetes-client >/dev/null); }
	rm -rf "$CACHE/client" && dpkg-deb -x "$(ls "$CACHE"/kubernetes-client_*.deb | tail -1)" "$CACHE/client"
	place "$CACHE/client/usr/bin/kubectl" kubectl
fi

if [ ! -d "$SRC/tree" ]; then
	rm -rf "$SRC" && mkdir -p "$SRC"
	# Lists cached by an earlier run may name a version the archive has
	# since replaced (a security update): refresh once and retry.
	(cd "$SRC" && apt_private source --download-only kubernetes >/dev/null) ||
		{ apt_private update >/dev/null && (cd "$SRC" && apt_private source --download-only kubernetes >/dev/null); }
	dpkg-source --no-check -x "$(ls "$SRC"/kubernetes_*.dsc | tail -1)" "$SRC/tree.partial" >/dev/null
	mv "$SRC/tree.partial" "$SRC/tree"
fi

if [ ! -x "$BIN/pause" ]; then
	gcc -Os -static -o "$CACHE/pause" "$SRC/tree/build/pause/linux/pause.c"
	strip "$CACHE/pause"
	place "$CACHE/pause" pause
fi

if [ ! -e "$SRC/tree/.reflect2-v1.0.2" ]; then
	(cd "$CACHE" && apt_private download golang-github-modern-go-reflect2-dev >/dev/null) ||
		{ apt_private update >/dev/null && (cd "$CACHE" && apt_private download golang-github-modern-go-reflect2-dev >/dev/null); }
	rm -rf "$CACHE/reflect2" && dpkg-deb -x "$(ls "$CACHE"/golang-github-modern-go-reflect2-dev_1.0.2*.deb | tail -1)" "$CACHE/reflect2"
	vendored=$SRC/tree/vendor/github.com/modern-go/reflect2
	rm -f "$vendored"/*.go "$vendored"/*.s
	cp "$CACHE"/reflect2/usr/share/gocode/src/github.com/modern-go/reflect2/*.go "$vendored/"
	cp "$CACHE"/reflect2/usr/share/gocode/src/github.com/modern-go/reflect2/*.s "$vendored/" 2>/dev/null || true
	sed -i 's|^\(\s*github.com/modern-go/reflect2 => github.com/modern-go/reflect2\) v1.0.1$|\1 v1.0.2|' "$SRC/tree/go.mod"
	sed -i 's|^\(# github.com/modern-go/reflect2\) v1.0.1 => \(github.com/modern-go/reflect2\) v1.0.1$|\1 v1.0.2 => \2 v1.0.2|; s|^\(# github.com/modern-go/reflect2 => github.com/modern-go/reflect2\) v1.0.1$|\1 v1.0.2|' \
		"$SRC/tree/vendor/modules.txt"
	grep -q 'modern-go/reflect2 v1.0.2' "$SRC/tree/go.mod" || { echo "kubernetes: reflect2 not replaced in go.mod" >&2; exit 1; }
	grep -q '^# github.com/modern-go/reflect2 v1.0.2 => ' "$SRC/tree/vendor/modules.txt" ||
		{ echo "kubernetes: reflect2 not replaced in vendor/modules.txt" >&2; exit 1; }
	touch "$SRC/tree/.reflect2-v1.0.2"
fi

# The tree's own Makefile (a plain `go build` wants go.mod updates); its
# GOPATH layout and a Go build cache inside the cache directory.
cd "$SRC/tree"
mkdir -p .go/src/k8s.io
ln -sfn "$SRC/tree" .go/src/k8s.io/kubernetes
export GOPATH=$SRC/tree/.go GOCACHE=$CACHE/go-build GOFLAGS=-mod=vendor CGO_ENABLED=0 \
	KUBE_GIT_VERSION=v1.20.2 KUBE_GIT_TREE_STATE=clean
need() { for b in "$@"; do [ -x "$BIN/$b" ] || return 0; done; return 1; }
if need kube-apiserver kubelet kube-controller-manager kube-scheduler kube-proxy; then
	nice make WHAT="cmd/kube-apiserver cmd/kubelet cmd/kube-controller-manager cmd/kube-scheduler cmd/kube-proxy"
fi
if need e2e.test ginkgo; then
	nice make WHAT="test/e2e/e2e.test vendor/github.com/onsi/ginkgo/ginkgo"
fi
if need agnhost; then
	nice make WHAT=test/images/agnhost
fi
for b in kube-apiserver kubelet kube-controller-manager kube-scheduler kube-proxy e2e.test ginkgo agnhost; do
	[ -x "$BIN/$b" ] || place "_output/bin/$b" "$b"
done
left=$(missing)
[ -z "$left" ] || { echo "kubernetes: not built: $left" >&2; exit 1; }
touch "$FIXED"
echo "kubernetes: built into $BIN"
