//! The protocol's messages, written from the field numbers of Istio's
//! `zds.proto` (package `istio.workload.zds`).

use prost::{Enumeration, Message, Oneof};

/// The protocol's version, in [`ZdsHello`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Enumeration)]
#[repr(i32)]
pub enum Version {
    NotUsed = 0,
    V1 = 1,
}

/// ztunnel's first packet on a connection.
#[derive(Clone, PartialEq, Message)]
pub struct ZdsHello {
    #[prost(enumeration = "Version", tag = "1")]
    pub version: i32,
}

/// Who the pod is, as ztunnel matches it to its workloads. Field 4
/// (`trust_domain`) is reserved.
#[derive(Clone, PartialEq, Message)]
pub struct WorkloadInfo {
    #[prost(string, tag = "1")]
    pub name: String,
    #[prost(string, tag = "2")]
    pub namespace: String,
    #[prost(string, tag = "3")]
    pub service_account: String,
}

/// A pod to serve; its netns goes with the packet.
#[derive(Clone, PartialEq, Message)]
pub struct AddWorkload {
    /// The pod's UID.
    #[prost(string, tag = "1")]
    pub uid: String,
    #[prost(message, optional, tag = "2")]
    pub workload_info: Option<WorkloadInfo>,
}

/// A pod ztunnel already serves, whose netns the agent has not open
/// (only before the snapshot's end).
#[derive(Clone, PartialEq, Message)]
pub struct KeepWorkload {
    #[prost(string, tag = "1")]
    pub uid: String,
}

/// A pod to stop serving.
#[derive(Clone, PartialEq, Message)]
pub struct DelWorkload {
    #[prost(string, tag = "2")]
    pub uid: String,
}

/// The snapshot is whole: ztunnel drops every pod not named since the
/// connection began.
#[derive(Clone, PartialEq, Message)]
pub struct SnapshotSent {}

/// ztunnel's answer to each request: an empty error is success.
#[derive(Clone, PartialEq, Message)]
pub struct Ack {
    #[prost(string, tag = "1")]
    pub error: String,
}

/// What the agent sends, one per packet.
#[derive(Clone, PartialEq, Message)]
pub struct WorkloadRequest {
    #[prost(oneof = "Request", tags = "1, 5, 2, 3")]
    pub payload: Option<Request>,
}

#[derive(Clone, PartialEq, Oneof)]
pub enum Request {
    #[prost(message, tag = "1")]
    Add(AddWorkload),
    #[prost(message, tag = "5")]
    Keep(KeepWorkload),
    #[prost(message, tag = "2")]
    Del(DelWorkload),
    #[prost(message, tag = "3")]
    SnapshotSent(SnapshotSent),
}

/// What ztunnel answers, one per packet.
#[derive(Clone, PartialEq, Message)]
pub struct WorkloadResponse {
    #[prost(oneof = "Response", tags = "1")]
    pub payload: Option<Response>,
}

#[derive(Clone, PartialEq, Oneof)]
pub enum Response {
    #[prost(message, tag = "1")]
    Ack(Ack),
}

impl WorkloadRequest {
    pub fn add(uid: &str, info: WorkloadInfo) -> Self {
        WorkloadRequest {
            payload: Some(Request::Add(AddWorkload {
                uid: uid.to_owned(),
                workload_info: Some(info),
            })),
        }
    }

    pub fn keep(uid: &str) -> Self {
        WorkloadRequest {
            payload: Some(Request::Keep(KeepWorkload { uid: uid.to_owned() })),
        }
    }

    pub fn del(uid: &str) -> Self {
        WorkloadRequest {
            payload: Some(Request::Del(DelWorkload { uid: uid.to_owned() })),
        }
    }

    pub fn snapshot_sent() -> Self {
        WorkloadRequest {
            payload: Some(Request::SnapshotSent(SnapshotSent {})),
        }
    }
}

impl WorkloadResponse {
    /// An ack: success when `error` is empty.
    pub fn ack(error: &str) -> Self {
        WorkloadResponse {
            payload: Some(Response::Ack(Ack {
                error: error.to_owned(),
            })),
        }
    }

    /// What the ack says: Ok, or ztunnel's error; a response without an
    /// ack is an error too.
    pub fn outcome(&self) -> Result<(), String> {
        match &self.payload {
            Some(Response::Ack(ack)) if ack.error.is_empty() => Ok(()),
            Some(Response::Ack(ack)) => Err(ack.error.clone()),
            None => Err("a response without an ack".to_owned()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hex(bytes: &[u8]) -> String {
        bytes.iter().map(|b| format!("{b:02x}")).collect()
    }

    /// The bytes as protobuf lays them out for these field numbers (and as
    /// ztunnel was seen to send and accept them: hello `0801`, ack `0a00`).
    #[test]
    fn the_wire_bytes_follow_the_field_numbers() {
        let hello = ZdsHello {
            version: Version::V1 as i32,
        };
        assert_eq!(hex(&hello.encode_to_vec()), "0801");
        assert_eq!(hex(&WorkloadResponse::ack("").encode_to_vec()), "0a00");
        assert_eq!(hex(&WorkloadResponse::ack("x").encode_to_vec()), "0a030a0178");
        // keep is field 5, del 2 with its uid in field 2, snapshot 3.
        assert_eq!(hex(&WorkloadRequest::keep("u").encode_to_vec()), "2a030a0175");
        assert_eq!(hex(&WorkloadRequest::del("u").encode_to_vec()), "1203120175");
        assert_eq!(hex(&WorkloadRequest::snapshot_sent().encode_to_vec()), "1a00");
        let add = WorkloadRequest::add(
            "u",
            WorkloadInfo {
                name: "a".into(),
                namespace: "b".into(),
                service_account: "c".into(),
            },
        );
        // add{uid "u", workload_info{name "a", namespace "b", service_account "c"}}
        assert_eq!(hex(&add.encode_to_vec()), "0a0e0a017512090a01611201621a0163");
        let read = WorkloadRequest::decode(add.encode_to_vec().as_slice()).expect("decodes");
        assert_eq!(read, add);
        assert_eq!(WorkloadResponse::ack("").outcome(), Ok(()));
        assert_eq!(
            WorkloadResponse::ack("no netns").outcome(),
            Err("no netns".into())
        );
        assert!(WorkloadResponse::default().outcome().is_err());
    }
}
