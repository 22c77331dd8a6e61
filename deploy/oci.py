"""OCI image archives written without Docker or a registry: one layer
built from files of this machine, an OCI image layout (what `ctr images
import` and `kind load image-archive` read) that also carries the tagged
`manifest.json` `docker load` reads. Byte-for-byte reproducible: fixed
mtimes, owners, order and gzip header.

Used by `deploy/image.py` (the suite's image) and the tests' busybox
images (`integration/tools/busybox_oci.py`).
"""
import gzip
import hashlib
import io
import json
import os
import subprocess
import tarfile


def digest(data):
    return "sha256:" + hashlib.sha256(data).hexdigest()


class Layer:
    """A layer's entries by path (no leading slash); parents are added as
    directories unless an entry says otherwise."""

    def __init__(self):
        self.entries = {}

    def _parents(self, name):
        parts = name.split("/")[:-1]
        for i in range(1, len(parts) + 1):
            self.entries.setdefault("/".join(parts[:i]), ("dir", None, 0o755))

    def dir(self, name, mode=0o755):
        self._parents(name)
        self.entries[name] = ("dir", None, mode)

    def file(self, name, data, mode=0o644):
        self._parents(name)
        self.entries[name] = ("file", data, mode)

    def symlink(self, name, target):
        self._parents(name)
        self.entries[name] = ("symlink", target, 0o777)

    def host_path(self, path):
        """Adds `path` of this machine as it resolves here: each symlink
        on the way (a merged-/usr `/lib`, a library's soname link) as a
        symlink, then what it points to, ending in the file itself."""
        path = os.path.abspath(path)
        parts = path.strip("/").split("/")
        for i in range(1, len(parts) + 1):
            here = "/" + "/".join(parts[:i])
            if os.path.islink(here):
                target = os.readlink(here)
                self.symlink(here.lstrip("/"), target)
                resolved = os.path.normpath(os.path.join(os.path.dirname(here), target))
                rest = parts[i:]
                return self.host_path(os.path.join(resolved, *rest) if rest else resolved)
        with open(path, "rb") as f:
            self.file(path.lstrip("/"), f.read(), os.stat(path).st_mode & 0o7777)

    def host_binary(self, path):
        """Adds a dynamically linked program with every library `ldd`
        names (and the loader)."""
        self.host_path(path)
        out = subprocess.run(["ldd", path], check=True, capture_output=True, text=True).stdout
        for line in out.splitlines():
            words = line.split()
            if "=>" in words and len(words) > words.index("=>") + 1 and words[words.index("=>") + 1].startswith("/"):
                self.host_path(words[words.index("=>") + 1])
            elif words and words[0].startswith("/"):
                self.host_path(words[0])

    def busybox(self, busybox="/bin/busybox"):
        """Debian's busybox-static with a link per applet and a minimal /etc."""
        applets = subprocess.run([busybox, "--list-full"], check=True, capture_output=True,
                                 text=True).stdout.split()
        for d in ["bin", "sbin", "usr/bin", "usr/sbin", "etc", "proc", "sys", "dev", "root", "run", "var"]:
            self.dir(d)
        self.dir("tmp", 0o1777)
        with open(busybox, "rb") as f:
            self.file("bin/busybox", f.read(), 0o755)
        for path in sorted(set(applets)):
            if path != "bin/busybox":
                self.symlink(path, "/bin/busybox")
        self.file("etc/passwd", b"root:x:0:0:root:/root:/bin/sh\nnobody:x:65534:65534::/:/bin/false\n")
        self.file("etc/group", b"root:x:0:\nnogroup:x:65534:\n")
        self.file("etc/hosts", b"127.0.0.1 localhost\n::1 localhost\n")

    def tar(self):
        """(uncompressed, gzip-compressed) layer tar."""
        raw = io.BytesIO()
        with tarfile.open(fileobj=raw, mode="w", format=tarfile.PAX_FORMAT) as tar:
            for name in sorted(self.entries):
                kind, data, mode = self.entries[name]
                add(tar, name, data, mode, kind)
        uncompressed = raw.getvalue()
        compressed = io.BytesIO()
        with gzip.GzipFile(fileobj=compressed, mode="wb", mtime=0, filename="") as gz:
            gz.write(uncompressed)
        return uncompressed, compressed.getvalue()


def add(tar, name, data=None, mode=0o644, kind="file"):
    info = tarfile.TarInfo(name)
    info.mtime, info.uid, info.gid, info.uname, info.gname = 0, 0, 0, "root", "root"
    info.mode = mode
    if kind == "symlink":
        info.type, info.linkname = tarfile.SYMTYPE, data
        tar.addfile(info)
    elif kind == "dir":
        info.type = tarfile.DIRTYPE
        tar.addfile(info)
    else:
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))


def write_archive(out, name, layer, cmd, env=("PATH=/usr/sbin:/usr/bin:/sbin:/bin",), architecture="amd64",
                  entrypoint=None):
    """Writes the image `name` (a full reference, `docker.io/...:tag`) to
    `out`, through a temporary file renamed into place. `entrypoint`, when
    given, is what `cmd` becomes the arguments of (as a Dockerfile's
    ENTRYPOINT)."""
    uncompressed, compressed = layer.tar()
    image_config = {"Cmd": list(cmd), "Env": list(env)}
    if entrypoint is not None:
        image_config["Entrypoint"] = list(entrypoint)
    config = json.dumps({
        "architecture": architecture, "os": "linux",
        "config": image_config,
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
    blob = lambda data: "blobs/sha256/" + digest(data).split(":")[1]
    # docker load reads this; its tag drops the default registry, as
    # `docker images` shows it.
    short = name[len("docker.io/"):] if name.startswith("docker.io/") else name
    docker = json.dumps([{"Config": blob(config), "RepoTags": [short], "Layers": [blob(compressed)]}]).encode()
    with tarfile.open(out + ".tmp", mode="w", format=tarfile.PAX_FORMAT) as tar:
        add(tar, "oci-layout", b'{"imageLayoutVersion":"1.0.0"}')
        add(tar, "index.json", index)
        add(tar, "manifest.json", docker)
        add(tar, "blobs", kind="dir", mode=0o755)
        add(tar, "blobs/sha256", kind="dir", mode=0o755)
        for data in (config, manifest, compressed):
            add(tar, blob(data), data)
    os.replace(out + ".tmp", out)
