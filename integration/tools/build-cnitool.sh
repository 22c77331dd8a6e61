#!/bin/sh
# Builds Go's cnitool from the Debian source package of the installed
# libcni (golang-github-appc-cni-dev): no Debian binary package ships it, and
# its -dev package leaves cnitool/ out. Only Debian's archive is contacted:
# the source files are fetched from the pool directory the installed -dev
# package came from and checked against the .dsc; /etc/apt is not touched.
# The build is GOPATH mode against the installed -dev sources, offline.
#
# usage: build-cnitool.sh OUTPUT
set -eu
out=$1
dev=golang-github-appc-cni-dev
src=$(dpkg-query -W -f='${source:Package}' "$dev")
version=$(dpkg-query -W -f='${source:Version}' "$dev")
noepoch=${version#*:}

deb_uri=$(apt-get download --print-uris "$dev" | cut -d"'" -f2)
[ -n "$deb_uri" ] || { echo "build-cnitool: apt knows no download for $dev" >&2; exit 1; }
pool=${deb_uri%/*}

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
curl -fsS -o "$work/src.dsc" "$pool/${src}_${noepoch}.dsc"
# Checksums-Sha256 lines: " <sha256> <size> <file>"; take the orig tarball.
line=$(sed -n '/^Checksums-Sha256:/,/^[^ ]/p' "$work/src.dsc" | grep ' [^ ]*\.orig\.tar\.[a-z]*$' | head -1)
sum=$(echo "$line" | awk '{print $1}')
orig=$(echo "$line" | awk '{print $3}')
curl -fsS -o "$work/$orig" "$pool/$orig"
echo "$sum  $work/$orig" | sha256sum -c --quiet -

tar -xf "$work/$orig" -C "$work"
mkdir -p "$work/gopath/src/cnitool"
cp "$work"/*/cnitool/cnitool.go "$work/gopath/src/cnitool/"
mkdir -p "$(dirname "$out")"
cd "$work/gopath/src/cnitool"
GO111MODULE=off GOPROXY=off GOFLAGS= CGO_ENABLED=0 \
    GOPATH="$work/gopath:/usr/share/gocode" GOCACHE="$work/gocache" \
    go build -trimpath -o "$out.tmp" .
mv "$out.tmp" "$out"
echo "built $out from $src $version ($orig)"
