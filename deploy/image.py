#!/usr/bin/python3
"""`make image`: the suite's image, for the DaemonSet in cni-suite.yaml.

usage: image.py OUT.tar IMAGE-NAME BIN-DIR

/opt/cni-suite/bin holds the static binaries from BIN-DIR (the agent,
the plugins it installs, cnictl); /opt/cni-suite/iptables/{nft,legacy}
each hold one iptables flavour's save and restore commands, Debian's
xtables multi-binaries with their libraries and extensions, of which the
agent puts the node's own first on PATH (node-agent/src/iptables_mode.rs);
busybox for a shell when someone needs to look inside.
"""
import glob
import os
import sys

import oci

SUITE = ["cni-node-agent", "bridge", "host-local", "loopback", "istio-redirect", "cnictl"]
COMMANDS = ["iptables-save", "iptables-restore", "ip6tables-save", "ip6tables-restore"]


def main():
    out, name, bin_dir = sys.argv[1], sys.argv[2], sys.argv[3]
    layer = oci.Layer()
    layer.busybox()
    for binary in SUITE:
        with open(os.path.join(bin_dir, binary), "rb") as f:
            layer.file("opt/cni-suite/bin/" + binary, f.read(), 0o755)
    for flavour in ["nft", "legacy"]:
        multi = "/usr/sbin/xtables-%s-multi" % flavour
        layer.host_binary(multi)
        for command in COMMANDS:
            layer.symlink("opt/cni-suite/iptables/%s/%s" % (flavour, command), multi)
    for extension in sorted(glob.glob("/usr/lib/x86_64-linux-gnu/xtables/*.so")):
        layer.host_binary(extension)
    oci.write_archive(out, name, layer, ["/opt/cni-suite/bin/cni-node-agent"])


if __name__ == "__main__":
    main()
