//! nftables as a mechanism: the names upstream's plugins give what they
//! write in nftables (hashes of a network and of an attachment), shared by
//! every feature's nft rules, and what nftables keeps of a comment.

use sha2::{Digest, Sha512};

/// nftables keeps comments up to this length.
pub const COMMENT_MAX: usize = 128;

/// `text` cut to what nftables keeps of a comment, on a character
/// boundary.
pub fn fit_comment(mut text: String) -> String {
    if text.len() > COMMENT_MAX {
        let mut cut = COMMENT_MAX;
        while !text.is_char_boundary(cut) {
            cut -= 1;
        }
        text.truncate(cut);
    }
    text
}

/// The first 8 bytes of sha512(`text`).
pub fn short_digest(text: &str) -> [u8; 8] {
    let mut short = [0u8; 8];
    short.copy_from_slice(&Sha512::digest(text.as_bytes())[..8]);
    short
}

/// 16 hex digits of sha512(`text`): names that stay short and stable.
pub fn short_hash(text: &str) -> String {
    short_digest(text).iter().map(|b| format!("{b:02x}")).collect()
}

/// `<16 hex of sha512(network)>`: the prefix of a network's comments.
pub fn network_hash(network: &str) -> String {
    short_hash(network)
}

/// `<network hash>-<16 hex of sha512(ifname:containerID)>`.
pub fn instance_hash(network: &str, ifname: &str, container_id: &str) -> String {
    format!(
        "{}-{}",
        network_hash(network),
        short_hash(&format!("{ifname}:{container_id}"))
    )
}
