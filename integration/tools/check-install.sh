#!/bin/sh
# `make install` and `make uninstall` into a scratch DESTDIR: every file in
# place and runnable, the conflist installed, and uninstall removing exactly
# what install listed (a file that was there before stays, or comes back:
# the node's own portmap, replaced by ours, is put back).
set -eu
cd "$(dirname "$0")/../.."
dest=$(mktemp -d)
trap 'rm -rf "$dest"' EXIT
fail() { echo "check-install: $*" >&2; exit 1; }

mkdir -p "$dest/opt/cni/bin" "$dest/etc/cni/net.d"
echo keep > "$dest/opt/cni/bin/portmap"
echo keep > "$dest/opt/cni/bin/tuning"
echo keep > "$dest/etc/cni/net.d/05-other.conflist"

make --no-print-directory install DESTDIR="$dest" CONF=conf-examples/10-istio.conflist >/dev/null
for plugin in loopback bridge host-local istio-redirect portmap firewall; do
    [ -x "$dest/opt/cni/bin/$plugin" ] || fail "$plugin not installed"
    version=$(CNI_COMMAND=VERSION "$dest/opt/cni/bin/$plugin" </dev/null)
    case $version in *'"1.1.0"'*) ;; *) fail "$plugin VERSION: $version" ;; esac
done
[ -x "$dest/usr/local/bin/cnictl" ] || fail "cnictl not installed"
cmp -s conf-examples/10-istio.conflist "$dest/etc/cni/net.d/10-istio.conflist" || fail "conflist not installed"
[ "$(wc -l < "$dest/var/lib/cni-suite/installed")" = 8 ] || fail "manifest: $(cat "$dest/var/lib/cni-suite/installed")"

make --no-print-directory uninstall DESTDIR="$dest" >/dev/null
left=$(cd "$dest" && find . -type f | sort | tr '\n' ' ')
[ "$left" = "./etc/cni/net.d/05-other.conflist ./opt/cni/bin/portmap ./opt/cni/bin/tuning " ] || fail "after uninstall: $left"
[ "$(cat "$dest/opt/cni/bin/portmap")" = keep ] || fail "the node's own portmap was not put back"
echo "check-install: install and uninstall are exact"
