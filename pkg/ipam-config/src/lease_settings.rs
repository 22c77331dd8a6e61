//! What a configuration says about the lease path: which service an
//! operator named (`ipam.socket`) and which data directory the leases are
//! in (`ipam.dataDir`, whose own service is asked in any case). A checked
//! [`IpamConfig`](crate::config::IpamConfig) carries both; [`LeaseSettings`]
//! reads them from the raw configuration for a caller that sends a request
//! before it is parsed properly (host-local's process, a lease service
//! passing a call on), as Go's decoder matches keys (case-insensitively,
//! the last one winning, `null` as absent).

use std::path::{Path, PathBuf};

use cni::keys;
use serde_json::Value;

/// host-local's default `dataDir`, the reference's.
pub const DEFAULT_DATA_DIR: &str = "/var/lib/cni/networks";

/// `<dataDir>/.sled/.service.sock`: where the service in charge of a data
/// directory listens (beside the databases it keeps open), whoever started
/// it: a plugin, the node agent or systemd. One data directory, one
/// service, one socket.
pub fn data_dir_socket(data_dir: &Path) -> PathBuf {
    data_dir.join(".sled").join(".service.sock")
}

/// What a configuration says about the lease service besides the data
/// directory's own.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SocketSetting {
    /// No `socket` key: the data directory's own service, started on
    /// demand when none runs.
    Unset,
    /// `"socket": ""`: the data directory's own service if one runs, but
    /// none started for this call.
    Off,
    /// `"socket": "<path>"`: the operator named a service, asked first.
    Named(PathBuf),
}

impl SocketSetting {
    /// The one reading of `ipam.socket` and of `cnictl ipam --socket`.
    pub fn parse(configured: Option<&str>) -> Self {
        match configured {
            None => SocketSetting::Unset,
            Some("") => SocketSetting::Off,
            Some(path) => SocketSetting::Named(PathBuf::from(path)),
        }
    }

    /// The socket the operator named, if any.
    pub fn path(&self) -> Option<PathBuf> {
        match self {
            SocketSetting::Unset | SocketSetting::Off => None,
            SocketSetting::Named(path) => Some(path.clone()),
        }
    }
}

/// The keys that route a request to the leases. None when stdin is not a
/// JSON object.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LeaseSettings {
    pub socket: SocketSetting,
    pub data_dir: PathBuf,
}

impl LeaseSettings {
    pub fn read(stdin: &[u8]) -> Option<Self> {
        let doc: Value = serde_json::from_slice(stdin).ok()?;
        let ipam = keys::get(doc.as_object()?, "ipam").and_then(Value::as_object);
        // A value of another type counts as empty here; the configuration's
        // own check refuses it with the reference's message.
        let text = |key: &str| {
            ipam.and_then(|section| keys::get(section, key))
                .map(|v| v.as_str().unwrap_or_default())
        };
        Some(LeaseSettings {
            socket: SocketSetting::parse(text("socket")),
            data_dir: PathBuf::from(
                text("dataDir")
                    .filter(|d| !d.is_empty())
                    .unwrap_or(DEFAULT_DATA_DIR),
            ),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lease_settings_are_read_from_raw_stdin() {
        let read = |text: &[u8]| LeaseSettings::read(text).expect("an object");
        assert_eq!(
            read(br#"{"ipam":{"socket":"/tmp/s","dataDir":"/d"}}"#),
            LeaseSettings {
                socket: SocketSetting::Named("/tmp/s".into()),
                data_dir: "/d".into()
            }
        );
        assert_eq!(read(br#"{"ipam":{"socket":""}}"#).socket.path(), None);
        let defaults = read(br#"{"ipam":{"dataDir":""}}"#);
        assert_eq!(defaults.socket, SocketSetting::Unset);
        assert_eq!(defaults.socket.path(), None);
        assert_eq!(defaults.data_dir, PathBuf::from(DEFAULT_DATA_DIR));
        assert_eq!(read(b"{}").socket, SocketSetting::Unset);
        assert_eq!(LeaseSettings::read(b"junk"), None);
        assert_eq!(LeaseSettings::read(b"[1]"), None);
        // Go's matching: any case, the last one, null as absent.
        assert_eq!(
            read(br#"{"IPAM":{"DataDir":"/a","datadir":"/b","SOCKET":null}}"#),
            LeaseSettings {
                socket: SocketSetting::Unset,
                data_dir: "/b".into()
            }
        );
    }

    #[test]
    fn the_data_directorys_service_listens_beside_its_databases() {
        assert_eq!(
            data_dir_socket(Path::new("/d")),
            PathBuf::from("/d/.sled/.service.sock")
        );
    }
}
