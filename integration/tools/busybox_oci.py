#!/usr/bin/python3
"""Writes a minimal OCI image layout tar from Debian's busybox-static, for
tests that need a container image where no registry exists.

usage: busybox_oci.py OUT.tar IMAGE-NAME [CMD...]

One gzip layer: /bin/busybox, a symlink per applet, a minimal /etc. The
output is byte-for-byte reproducible (see deploy/oci.py).
"""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "deploy"))
import oci  # noqa: E402


def main():
    out, name, cmd = sys.argv[1], sys.argv[2], sys.argv[3:] or ["/bin/sh"]
    layer = oci.Layer()
    layer.busybox()
    oci.write_archive(out, name, layer, cmd)


if __name__ == "__main__":
    main()
