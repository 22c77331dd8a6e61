//! The in-pod redirection in Istio's native nftables layout (ambient,
//! Istio 1.28+): the same decisions as [`super::render_in_pod`], in
//! Istio's `inet istio-ambient-{nat,mangle,raw}` tables, both families in
//! one table, every chain declared and the rules in the order Istio emits
//! them, applied like the sidecar's tables ([`crate::rules::nft`]).

use firewall::{Result, nfnl};
use netns::NetNs;

use super::{
    INPOD_MARK, INPOD_MASK, INPOD_TPROXY_MARK, InPod, ZTUNNEL_DNS_PORT, ZTUNNEL_INBOUND_PLAINTEXT_PORT,
    ZTUNNEL_INBOUND_PORT, ZTUNNEL_OUTBOUND_PORT,
};
use crate::rules::nft::{ChainDecl, NftCapture, Table, remove_nft};

pub const NAT: &str = "istio-ambient-nat";
pub const MANGLE: &str = "istio-ambient-mangle";
pub const RAW: &str = "istio-ambient-raw";

const PRERT: &str = "istio-prerouting";
const OUTPUT: &str = "istio-output";

const NAT_CHAINS: &[ChainDecl] = &[
    ("prerouting", Some("type nat hook prerouting priority -100 ;")),
    ("output", Some("type nat hook output priority -100 ;")),
    (PRERT, None),
    (OUTPUT, None),
];
const MANGLE_CHAINS: &[ChainDecl] = &[
    ("prerouting", Some("type filter hook prerouting priority -150 ;")),
    // A route chain: the mark restored on output re-routes the answer
    // through table 100.
    ("output", Some("type route hook output priority -150 ;")),
    (PRERT, None),
    (OUTPUT, None),
];
const RAW_CHAINS: &[ChainDecl] = &[
    ("prerouting", Some("type filter hook prerouting priority -300 ;")),
    ("output", Some("type filter hook output priority -300 ;")),
    (PRERT, None),
    (OUTPUT, None),
];

/// The in-pod tables for `in_pod`; `ipv6` adds the IPv6 rules to them.
pub fn render_in_pod_nft(in_pod: &InPod, ipv6: bool) -> NftCapture {
    let v4_probe = in_pod.probe_snat_v4.to_string();
    let v6_probe = in_pod.probe_snat_v6.to_string();
    // (matcher, loopback, probe source) per family rendered.
    let mut families = vec![("ip", "127.0.0.1/32", v4_probe.as_str())];
    if ipv6 {
        families.push(("ip6", "::1/128", v6_probe.as_str()));
    }
    let not_ztunnel = format!("mark and {INPOD_MASK:#x} != {INPOD_MARK:#x}");

    let mut nat = Table::with_all_chains(NAT, NAT_CHAINS);
    nat.append("output", format!("jump {OUTPUT}"));
    nat.append("prerouting", format!("jump {PRERT}"));
    for iface in &in_pod.virtual_interfaces {
        nat.append(
            PRERT,
            format!("iifname {iface} meta l4proto tcp counter redirect to :{ZTUNNEL_OUTBOUND_PORT}"),
        );
        nat.append(PRERT, format!("iifname {iface} meta l4proto tcp counter return"));
    }
    if !in_pod.bypass_inbound {
        for (ip, _, probe) in &families {
            nat.append(
                PRERT,
                format!("meta l4proto tcp {ip} saddr {probe} counter accept"),
            );
        }
    }
    // The probe's answers leave the pod as they came in.
    for (ip, _, probe) in &families {
        nat.append(
            OUTPUT,
            format!("meta l4proto tcp {ip} daddr {probe} counter accept"),
        );
    }
    if !in_pod.bypass_inbound {
        for (ip, loopback, _) in &families {
            nat.append(
                PRERT,
                format!(
                    "{ip} daddr != {loopback} tcp dport != {ZTUNNEL_INBOUND_PORT} {not_ztunnel} \
                     counter redirect to :{ZTUNNEL_INBOUND_PLAINTEXT_PORT}"
                ),
            );
        }
    }
    if in_pod.redirect_dns {
        nat.append(
            OUTPUT,
            format!("oifname != lo {not_ztunnel} udp dport 53 counter redirect to :{ZTUNNEL_DNS_PORT}"),
        );
        for (ip, loopback, _) in &families {
            nat.append(
                OUTPUT,
                format!(
                    "{ip} daddr != {loopback} tcp dport 53 {not_ztunnel} counter redirect to :{ZTUNNEL_DNS_PORT}"
                ),
            );
        }
    }
    nat.append(
        OUTPUT,
        format!("meta l4proto tcp mark and {INPOD_MASK:#x} == {INPOD_TPROXY_MARK:#x} counter accept"),
    );
    // The pod reaching itself over lo by its own address stays local.
    for (ip, loopback, _) in &families {
        nat.append(
            OUTPUT,
            format!("oifname lo {ip} daddr != {loopback} counter accept"),
        );
    }
    for (ip, loopback, _) in &families {
        nat.append(
            OUTPUT,
            format!(
                "meta l4proto tcp {ip} daddr != {loopback} {not_ztunnel} counter redirect to :{ZTUNNEL_OUTBOUND_PORT}"
            ),
        );
    }

    let mut mangle = Table::with_all_chains(MANGLE, MANGLE_CHAINS);
    mangle.append("prerouting", format!("jump {PRERT}"));
    mangle.append("output", format!("jump {OUTPUT}"));
    mangle.append(
        PRERT,
        format!(
            "meta mark & {INPOD_MASK:#x} == {INPOD_MARK:#x} counter ct mark set ct mark & {:#x} | {INPOD_TPROXY_MARK:#x}",
            !INPOD_MASK
        ),
    );
    mangle.append(
        OUTPUT,
        format!("ct mark and {INPOD_MASK:#x} == {INPOD_TPROXY_MARK:#x} counter meta mark set ct mark"),
    );

    let mut raw = Table::with_all_chains(RAW, RAW_CHAINS);
    if in_pod.redirect_dns {
        // ztunnel's own queries and their answers in a conntrack zone of
        // their own (istio#33469).
        raw.append("prerouting", format!("jump {PRERT}"));
        raw.append("output", format!("jump {OUTPUT}"));
        raw.append(
            OUTPUT,
            format!("udp dport 53 meta mark and {INPOD_MASK:#x} == {INPOD_MARK:#x} counter ct zone set 1"),
        );
        raw.append(
            PRERT,
            format!("udp sport 53 meta {not_ztunnel} counter ct zone set 1"),
        );
    }
    NftCapture::new(vec![nat, mangle, raw])
}

/// Whether `ns` holds any of the in-pod tables, asked over netlink (no
/// `nft` needed to find there is nothing to remove).
pub fn has_in_pod_tables(ns: &NetNs) -> Result<bool> {
    ns.run(|| {
        for table in [NAT, MANGLE, RAW] {
            if nfnl::table_exists(nfnl::TableFamily::Inet, table)? {
                return Ok(true);
            }
        }
        Ok(false)
    })
    .map_err(|e| firewall::Error::Invalid(e.to_string()))?
}

/// Takes the in-pod tables out of `ns`; whether any was there.
pub fn remove_in_pod_tables(ns: &NetNs) -> Result<bool> {
    if !has_in_pod_tables(ns)? {
        return Ok(false);
    }
    let every_table = render_in_pod_nft(&InPod::new(true, &Default::default()), true);
    remove_nft(ns, &every_table)
}

#[cfg(test)]
mod golden;
