#!/usr/bin/python3
"""The images the real cluster runs, built here (no registry): pause from
the Kubernetes tree, busybox, the e2e tests' agnhost and a stand-in for
their nginx, under the names
Kubernetes 1.20 and its e2e tests ask for (`test/utils/image/manifest.go`),
so `imagePullPolicy: IfNotPresent` never pulls.

usage: images.py OUT-DIR K8S-BIN-DIR

Writes OUT-DIR/<short>.tar for each image (OCI archives that
`ctr -n k8s.io images import` reads).
"""
import os
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "deploy"))
import oci  # noqa: E402

PAUSE = "k8s.gcr.io/pause:3.2"
BUSYBOX = "docker.io/library/busybox:1.29"
AGNHOST = "k8s.gcr.io/e2e-test-images/agnhost:2.21"
NGINX = "docker.io/library/nginx:1.14-alpine"


WGET = """#!/bin/sh
# busybox wget without -T (Debian's busybox 1.35 segfaults on it), the
# timeout given to timeout(1); images.py writes this.
n=$#
seconds=
while [ "$n" -gt 0 ]; do
	arg=$1
	shift
	n=$((n - 1))
	case $arg in
	-T) seconds=$1; shift; n=$((n - 1)) ;;
	-T*) seconds=${arg#-T} ;;
	*) set -- "$@" "$arg" ;;
	esac
done
if [ -n "$seconds" ]; then
	exec timeout "$seconds" busybox wget "$@"
fi
exec busybox wget "$@"
"""


def pause(out, k8s_bin):
    layer = oci.Layer()
    with open(os.path.join(k8s_bin, "pause"), "rb") as f:
        layer.file("pause", f.read(), 0o755)
    oci.write_archive(out, PAUSE, layer, [], entrypoint=["/pause"])


def busybox(out):
    layer = oci.Layer()
    layer.busybox()
    oci.write_archive(out, BUSYBOX, layer, ["sh"])


def agnhost(out, k8s_bin):
    """agnhost as its Dockerfile makes it: the binary at /agnhost as the
    entrypoint, with a shell, curl, OpenBSD netcat and iproute2's ip, which
    the e2e tests run inside it, and busybox for the rest of a userland."""
    layer = oci.Layer()
    layer.busybox()
    with open(os.path.join(k8s_bin, "agnhost"), "rb") as f:
        layer.file("agnhost", f.read(), 0o755)
    layer.host_binary("/usr/bin/curl")
    layer.host_binary("/usr/sbin/ip")
    layer.host_binary("/usr/bin/nc.openbsd")
    layer.symlink("usr/bin/nc", "/usr/bin/nc.openbsd")
    layer.host_binary("/usr/bin/bash")
    layer.symlink("bin/bash", "/usr/bin/bash")
    # Debian's busybox 1.35 wget segfaults on -T (its timeout), which the
    # e2e specs' exec pods pass: the timeout by timeout(1) instead.
    layer.file("usr/bin/wget", WGET.encode(), 0o755)
    # Debian's busybox-static prefers its own applets over PATH, so its sh
    # would run busybox's nc (no -u) whatever PATH says: dash is the shell.
    layer.host_binary("/usr/bin/dash")
    layer.symlink("bin/sh", "/usr/bin/dash")
    for certs in ["/etc/ssl/certs/ca-certificates.crt"]:
        if os.path.exists(certs):
            layer.host_path(certs)
    # porter serves TLS with /localhost.crt and /localhost.key (its
    # Dockerfile adds a pair from the tree): a pair made here, as nothing
    # checks it (the API server's proxy to a pod does not verify).
    for name, data in localhost_tls_pair().items():
        layer.file(name, data)
    oci.write_archive(out, AGNHOST, layer, ["pause"], entrypoint=["/agnhost"])


def localhost_tls_pair():
    """{"localhost.crt": PEM, "localhost.key": PEM}, self-signed for localhost."""
    with tempfile.TemporaryDirectory() as tmp:
        crt, key = os.path.join(tmp, "localhost.crt"), os.path.join(tmp, "localhost.key")
        subprocess.run(
            ["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
             "-nodes", "-keyout", key, "-out", crt, "-days", "3650", "-subj", "/CN=localhost",
             "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1"],
            check=True, capture_output=True)
        pair = {}
        for path in (crt, key):
            with open(path, "rb") as f:
                pair[os.path.basename(path)] = f.read()
        return pair


def nginx(out):
    """A stand-in under nginx's name for the e2e specs that only need a pod
    serving HTTP on port 80 (EndpointSlice's): busybox's httpd."""
    layer = oci.Layer()
    layer.busybox()
    layer.file("usr/share/nginx/html/index.html", b"stand-in for nginx\n")
    oci.write_archive(out, NGINX, layer, ["httpd", "-f", "-p", "80", "-h", "/usr/share/nginx/html"])


def main():
    out_dir, k8s_bin = sys.argv[1], sys.argv[2]
    os.makedirs(out_dir, exist_ok=True)
    pause(os.path.join(out_dir, "pause.tar"), k8s_bin)
    busybox(os.path.join(out_dir, "busybox.tar"))
    agnhost(os.path.join(out_dir, "agnhost.tar"), k8s_bin)
    nginx(os.path.join(out_dir, "nginx.tar"))


if __name__ == "__main__":
    main()
