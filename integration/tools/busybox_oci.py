#!/usr/bin/python3
"""Writes a minimal OCI image layout tar from Debian's busybox-static, for
tests that need a container image where no registry exists.

usage: busybox_oci.py OUT.tar IMAGE-NAME [CMD...]

One gzip layer: /bin/busybox, a symlink per applet, a minimal /etc. The
output is byte-for-byte reproducible (fixed mtimes, owners, gzip header).
"""
import gzip
import hashlib
import io
import json
import os
import subprocess
import sys
import tarfile

BUSYBOX = "/bin/busybox"


def add(tar, name, data=None, mode=0o644, kind=tarfile.REGTYPE, target=""):
    info = tarfile.TarInfo(name)
    info.mtime, info.uid, info.gid, info.uname, info.gname = 0, 0, 0, "root", "root"
    info.type, info.mode = kind, mode
    if kind == tarfile.SYMTYPE:
        info.linkname = target
        tar.addfile(info)
    elif kind == tarfile.DIRTYPE:
        tar.addfile(info)
    else:
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))


def layer():
    applets = subprocess.run([BUSYBOX, "--list-full"], check=True, capture_output=True,
                             text=True).stdout.split()
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for d in ["bin", "sbin", "usr", "usr/bin", "usr/sbin", "etc", "proc", "sys", "dev", "tmp",
                  "root", "run", "var"]:
            add(tar, d, kind=tarfile.DIRTYPE, mode=0o1777 if d == "tmp" else 0o755)
        with open(BUSYBOX, "rb") as f:
            add(tar, "bin/busybox", f.read(), mode=0o755)
        for path in sorted(set(applets)):
            if path != "bin/busybox":
                add(tar, path, kind=tarfile.SYMTYPE, target="/bin/busybox")
        add(tar, "etc/passwd", b"root:x:0:0:root:/root:/bin/sh\nnobody:x:65534:65534::/:/bin/false\n")
        add(tar, "etc/group", b"root:x:0:\nnogroup:x:65534:\n")
        add(tar, "etc/hosts", b"127.0.0.1 localhost\n::1 localhost\n")
    uncompressed = raw.getvalue()
    compressed = io.BytesIO()
    with gzip.GzipFile(fileobj=compressed, mode="wb", mtime=0, filename="") as gz:
        gz.write(uncompressed)
    return uncompressed, compressed.getvalue()


def digest(data):
    return "sha256:" + hashlib.sha256(data).hexdigest()


def main():
    out, name, cmd = sys.argv[1], sys.argv[2], sys.argv[3:] or ["/bin/sh"]
    uncompressed, compressed = layer()
    config = json.dumps({
        "architecture": "amd64", "os": "linux",
        "config": {"Cmd": cmd, "Env": ["PATH=/usr/sbin:/usr/bin:/sbin:/bin"]},
        "rootfs": {"type": "layers", "diff_ids": [digest(uncompressed)]},
    }, sort_keys=True).encode()
    manifest = json.dumps({
        "schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": {"mediaType": "application/vnd.oci.image.config.v1+json",
                   "digest": digest(config), "size": len(config)},
        "layers": [{"mediaType": "application/vnd.oci.image.layer.v1.tar+gzip",
                    "digest": digest(compressed), "size": len(compressed)}],
    }, sort_keys=True).encode()
    index = json.dumps({
        "schemaVersion": 2,
        "manifests": [{"mediaType": "application/vnd.oci.image.manifest.v1+json",
                       "digest": digest(manifest), "size": len(manifest),
                       "annotations": {"io.containerd.image.name": name,
                                       "org.opencontainers.image.ref.name": name.rsplit(":", 1)[-1]}}],
    }, sort_keys=True).encode()
    with tarfile.open(out + ".tmp", mode="w", format=tarfile.PAX_FORMAT) as tar:
        add(tar, "oci-layout", b'{"imageLayoutVersion":"1.0.0"}')
        add(tar, "index.json", index)
        add(tar, "blobs", kind=tarfile.DIRTYPE, mode=0o755)
        add(tar, "blobs/sha256", kind=tarfile.DIRTYPE, mode=0o755)
        for blob in (config, manifest, compressed):
            add(tar, "blobs/sha256/" + digest(blob).split(":")[1], blob)
    os.replace(out + ".tmp", out)


if __name__ == "__main__":
    main()
