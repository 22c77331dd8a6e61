#!/usr/bin/python3
"""`make image`: the suite's image, for the DaemonSet in cni-suite.yaml.

usage: image.py OUT.tar IMAGE-NAME BIN-DIR

/opt/cni-suite/bin holds the static binaries from BIN-DIR (the agent,
the plugins it installs, cnictl); /opt/cni-suite/iptables/{nft,legacy}
each hold one iptables flavour's save and restore commands, Debian's
xtables multi-binaries with their libraries and extensions, of which the
agent puts the node's own first on PATH (node-agent/src/iptables_mode.rs);
nft to look at the NetworkPolicy table (the agent writes it over
netlink) and for ambient mode's native nftables; ipset for ambient mode's
probe sets; busybox for a shell when someone needs to look inside. Built on Debian
or Ubuntu, for the machine's own architecture (the nodes' must match).
"""
import glob
import os
import subprocess
import sys
import sysconfig

import oci

SUITE = ["cni-node-agent", "bridge", "host-local", "loopback", "istio-redirect", "portmap",
         "firewall", "cnictl"]
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
    # For an operator's `nft list table inet cni-suite-netpol` from the
    # agent's container (the agent writes that over netlink), and for
    # ambient mode's native nftables (in-pod tables, the node's probe rule).
    layer.host_binary("/usr/sbin/nft")
    # Ambient mode's probe sets beside iptables (Istio's ipsets).
    layer.host_binary("/usr/sbin/ipset")
    # This machine's architecture is the image's: its iptables, and the
    # static binaries built here.
    architecture = subprocess.run(["dpkg", "--print-architecture"], check=True,
                                  capture_output=True, text=True).stdout.strip()
    multiarch = sysconfig.get_config_var("MULTIARCH") or "%s-linux-gnu" % os.uname().machine
    extensions = sorted(glob.glob("/usr/lib/%s/xtables/*.so" % multiarch))
    if not extensions:
        sys.exit("image.py: no iptables extensions found (is iptables installed?)")
    for extension in extensions:
        layer.host_binary(extension)
    oci.write_archive(out, name, layer, ["/opt/cni-suite/bin/cni-node-agent"],
                      architecture=architecture)


if __name__ == "__main__":
    main()
