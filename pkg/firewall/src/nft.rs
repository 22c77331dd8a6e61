//! nftables as a mechanism: the names upstream's plugins give what they
//! write in nftables (hashes of a network and of an attachment), shared by
//! every feature's nft rules.

use sha2::{Digest, Sha512};

fn hash16(text: &str) -> String {
    Sha512::digest(text.as_bytes())
        .iter()
        .take(8)
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// `<16 hex of sha512(network)>`: the prefix of a network's comments.
pub fn network_hash(network: &str) -> String {
    hash16(network)
}

/// `<network hash>-<16 hex of sha512(ifname:containerID)>`.
pub fn instance_hash(network: &str, ifname: &str, container_id: &str) -> String {
    format!(
        "{}-{}",
        network_hash(network),
        hash16(&format!("{ifname}:{container_id}"))
    )
}
