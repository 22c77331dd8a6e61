//! What applying the policy can meet: the kernel's refusals.

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error(transparent)]
    Nft(#[from] firewall::Error),
}

pub type Result<T, E = Error> = std::result::Result<T, E>;
