//! The CNI specification versions this suite speaks, and what each allows.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// A CNI specification version. Ordered oldest first, so comparisons read
/// like the spec ("0.4.0 and later").
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Version {
    V0_1_0,
    V0_2_0,
    V0_3_0,
    V0_3_1,
    V0_4_0,
    V1_0_0,
    V1_1_0,
}

/// How a result is laid out on the wire for a given version.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ResultShape {
    /// 0.1.0 and 0.2.0: `ip4`/`ip6` objects, one address per family.
    Legacy,
    /// 0.3.0, 0.3.1 and 0.4.0: `interfaces`/`ips`/`routes`, `ips[].version`.
    Versioned,
    /// 1.0.0 and 1.1.0: no `ips[].version`; routes and interfaces carry the
    /// newer optional fields.
    Current,
}

impl Version {
    /// Every version a plugin of this suite accepts, oldest first.
    pub const ALL: [Version; 7] = [
        Version::V0_1_0,
        Version::V0_2_0,
        Version::V0_3_0,
        Version::V0_3_1,
        Version::V0_4_0,
        Version::V1_0_0,
        Version::V1_1_0,
    ];

    /// The newest version, used where no configuration names one (VERSION
    /// with empty stdin, errors before the configuration could be read).
    pub const LATEST: Version = Version::V1_1_0;

    /// What a configuration without `cniVersion` means, as libcni decides.
    pub const IMPLIED: Version = Version::V0_1_0;

    pub fn as_str(self) -> &'static str {
        match self {
            Version::V0_1_0 => "0.1.0",
            Version::V0_2_0 => "0.2.0",
            Version::V0_3_0 => "0.3.0",
            Version::V0_3_1 => "0.3.1",
            Version::V0_4_0 => "0.4.0",
            Version::V1_0_0 => "1.0.0",
            Version::V1_1_0 => "1.1.0",
        }
    }

    pub fn result_shape(self) -> ResultShape {
        match self {
            Version::V0_1_0 | Version::V0_2_0 => ResultShape::Legacy,
            Version::V0_3_0 | Version::V0_3_1 | Version::V0_4_0 => ResultShape::Versioned,
            Version::V1_0_0 | Version::V1_1_0 => ResultShape::Current,
        }
    }

    /// CHECK, `disableCheck` and `prevResult` on DEL arrived with 0.4.0.
    pub fn has_check(self) -> bool {
        self >= Version::V0_4_0
    }

    /// GC and STATUS arrived with 1.1.0.
    pub fn has_gc_and_status(self) -> bool {
        self >= Version::V1_1_0
    }

    /// Chaining (`prevResult`) arrived with 0.3.0.
    pub fn has_chaining(self) -> bool {
        self >= Version::V0_3_0
    }

    /// The comma-separated list printed in messages and the about text.
    pub fn all_joined() -> String {
        Version::ALL.map(Version::as_str).join(", ")
    }
}

impl fmt::Display for Version {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A version string that is not one of [`Version::ALL`]. Matching is exact,
/// as in libcni: "1.0" is not "1.0.0".
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unsupported CNI version {0:?}")]
pub struct UnknownVersion(pub String);

impl FromStr for Version {
    type Err = UnknownVersion;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Version::ALL
            .into_iter()
            .find(|v| v.as_str() == s)
            .ok_or_else(|| UnknownVersion(s.to_owned()))
    }
}

impl Serialize for Version {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_str(self.as_str())
    }
}

impl<'de> Deserialize<'de> for Version {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let s = String::deserialize(deserializer)?;
        s.parse().map_err(serde::de::Error::custom)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_every_supported_version_exactly() {
        for v in Version::ALL {
            assert_eq!(v.as_str().parse::<Version>(), Ok(v));
        }
        for bad in ["1.0", "0.3", "v1.0.0", "1.2.0", "", " 1.0.0"] {
            assert!(bad.parse::<Version>().is_err(), "{bad} must be rejected");
        }
    }

    #[test]
    fn feature_gates_follow_the_spec() {
        assert!(!Version::V0_3_1.has_check());
        assert!(Version::V0_4_0.has_check());
        assert!(!Version::V1_0_0.has_gc_and_status());
        assert!(Version::V1_1_0.has_gc_and_status());
        assert!(!Version::V0_2_0.has_chaining());
        assert!(Version::V0_3_0.has_chaining());
        assert_eq!(Version::V0_2_0.result_shape(), ResultShape::Legacy);
        assert_eq!(Version::V0_4_0.result_shape(), ResultShape::Versioned);
        assert_eq!(Version::V1_0_0.result_shape(), ResultShape::Current);
    }
}
