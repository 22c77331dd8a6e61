//! The plugin's pod event (Istio's ambient mode): the chained plugin tells
//! the node agent which pod started, in which network namespace and with
//! which addresses, and waits until the agent answers that the pod's
//! redirection is in and ztunnel holds the pod. Only then does the ADD
//! return, so the pod is in the mesh from its first packet; an agent that
//! is not there, or says no (no ztunnel connected), fails the ADD and the
//! runtime retries the sandbox: never a pod started outside the mesh.
//!
//! Istio's own wire, so that either end may be Istio's: one HTTP/1.1
//! `POST /cmdadd` with Istio's `CNIPluginAddEvent` JSON (Go's field names:
//! `Netns`, `PodName`, `PodNamespace`, `IPs` of `{Interface, Address:
//! {IP, Mask}, Gateway}`, the mask in base64 as Go writes a `net.IPMask`)
//! over the Unix stream socket [`SOCKET_NAME`] in the agent's run
//! directory. 200 is yes; any other status is no, its body the reason.

use std::io::{self, Write};
use std::net::IpAddr;
use std::path::Path;
use std::time::Duration;

use base64::Engine;
use base64::engine::general_purpose::STANDARD;
use ipnetwork::IpNetwork;
use serde::de::Error as _;
use serde::{Deserialize, Deserializer, Serialize, Serializer};

use crate::stream::{Deadline, connect_within, read_until};

/// The socket's name in the agent's run directory (`cni_agent_run_dir`).
pub const SOCKET_NAME: &str = "pluginevent.sock";

/// The request's path.
pub const ADD_PATH: &str = "/cmdadd";

/// The most an ADD waits for the agent, as Istio's plugin's client.
pub const WAIT: Duration = Duration::from_secs(5);

/// The most of an answer read: its head and the reason a refusal gives.
pub const MAX_ANSWER: usize = 64 * 1024;

/// A pod the plugin set up, as Istio's `CNIPluginAddEvent`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "PascalCase")]
pub struct PodEvent {
    pub netns: String,
    pub pod_name: String,
    pub pod_namespace: String,
    /// The addresses the chain's earlier plugins gave (`prevResult.ips`).
    #[serde(rename = "IPs", default, deserialize_with = "null_as_empty")]
    pub ips: Vec<IpConfig>,
}

/// One of the pod's addresses, as Istio's `IPConfig`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "PascalCase")]
pub struct IpConfig {
    /// Index into the result's interfaces.
    #[serde(default)]
    pub interface: Option<usize>,
    #[serde(with = "go_ipnet")]
    pub address: IpNetwork,
    #[serde(default, with = "go_ip")]
    pub gateway: Option<IpAddr>,
}

impl PodEvent {
    /// The pod's addresses, without their prefixes (what the agent keeps).
    pub fn addresses(&self) -> Vec<IpAddr> {
        self.ips.iter().map(|config| config.address.ip()).collect()
    }
}

fn null_as_empty<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<IpConfig>, D::Error> {
    Ok(Option::<Vec<IpConfig>>::deserialize(d)?.unwrap_or_default())
}

/// Go's `net.IPNet` in JSON: `{"IP": "10.0.0.5", "Mask": "<base64>"}`.
mod go_ipnet {
    use super::*;

    #[derive(Serialize, Deserialize)]
    struct GoIpNet {
        #[serde(rename = "IP")]
        ip: String,
        #[serde(rename = "Mask", default)]
        mask: Option<String>,
    }

    pub fn serialize<S: Serializer>(net: &IpNetwork, s: S) -> Result<S::Ok, S::Error> {
        let width = if net.is_ipv4() { 32 } else { 128 };
        let ones = u128::MAX
            .checked_shl(width - u32::from(net.prefix()))
            .unwrap_or(0);
        let mask = ones.to_be_bytes();
        let bytes = &mask[16 - width as usize / 8..];
        GoIpNet {
            ip: net.ip().to_string(),
            mask: Some(STANDARD.encode(bytes)),
        }
        .serialize(s)
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<IpNetwork, D::Error> {
        let go = GoIpNet::deserialize(d)?;
        let ip: IpAddr = go
            .ip
            .parse()
            .map_err(|e| D::Error::custom(format!("IP {:?}: {e}", go.ip)))?;
        let mask = match go.mask {
            Some(text) => STANDARD
                .decode(&text)
                .map_err(|e| D::Error::custom(format!("Mask {text:?}: {e}")))?,
            None => Vec::new(),
        };
        let ones: u32 = mask.iter().map(|b| b.count_ones()).sum();
        // Go may write an IPv4 mask in its 16-byte form.
        let prefix = match (ip, mask.len()) {
            (_, 0) if ip.is_ipv4() => 32,
            (_, 0) => 128,
            (IpAddr::V4(_), 16) => ones.saturating_sub(96),
            _ => ones,
        };
        IpNetwork::new(ip, u8::try_from(prefix).unwrap_or(u8::MAX))
            .map_err(|e| D::Error::custom(format!("{ip} with a mask of {prefix} bits: {e}")))
    }
}

/// Go's `net.IP` in JSON: its text, `""` for none.
mod go_ip {
    use super::*;

    pub fn serialize<S: Serializer>(ip: &Option<IpAddr>, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&ip.map(|ip| ip.to_string()).unwrap_or_default())
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Option<IpAddr>, D::Error> {
        match Option::<String>::deserialize(d)?.as_deref() {
            None | Some("") => Ok(None),
            Some(text) => text
                .parse()
                .map(Some)
                .map_err(|e| D::Error::custom(format!("Gateway {text:?}: {e}"))),
        }
    }
}

/// Why the agent did not take the pod.
#[derive(Debug, thiserror::Error)]
pub enum PushError {
    /// Nothing listens (no agent on the node, or it is restarting).
    #[error("failed to send event request to {socket}: {source}")]
    Unreachable { socket: String, source: io::Error },
    /// The agent said no (Istio's words, so a user's search finds both).
    #[error("unable to push CNI event (status code {status}): {reason}")]
    Refused { status: u16, reason: String },
    /// It took the request and did not answer in time, or answered what
    /// is not HTTP.
    #[error("no answer from the node agent at {socket}: {source}")]
    NoAnswer { socket: String, source: io::Error },
}

/// Sends `event` to the agent at `socket` and waits, at most `wait` in
/// all, for its answer.
pub fn push(socket: &Path, event: &PodEvent, wait: Duration) -> Result<(), PushError> {
    let name = || socket.display().to_string();
    let deadline = Deadline::after(wait);
    let mut stream = connect_within(socket, wait).map_err(|source| PushError::Unreachable {
        socket: name(),
        source,
    })?;
    let no_answer = |source| PushError::NoAnswer {
        socket: name(),
        source,
    };
    let body = serde_json::to_vec(event).map_err(|e| no_answer(io::Error::other(e)))?;
    let mut request = format!(
        "POST {ADD_PATH} HTTP/1.1\r\nHost: unix\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    )
    .into_bytes();
    request.extend_from_slice(&body);
    let answer = deadline
        .left()
        .and_then(|left| stream.set_write_timeout(Some(left)))
        .and_then(|()| stream.write_all(&request))
        .and_then(|()| {
            read_until(&mut stream, deadline, MAX_ANSWER, |read| {
                Answer::parse(read).is_some()
            })
        })
        .map_err(no_answer)?;
    let answer = Answer::parse(&answer).ok_or_else(|| {
        no_answer(io::Error::new(
            io::ErrorKind::InvalidData,
            format!(
                "not an HTTP answer: {:?}",
                String::from_utf8_lossy(&answer[..answer.len().min(200)])
            ),
        ))
    })?;
    if answer.status == 200 {
        return Ok(());
    }
    Err(PushError::Refused {
        status: answer.status,
        reason: answer.body.trim().to_owned(),
    })
}

/// An HTTP answer, once its head and its `Content-Length` of body came.
struct Answer {
    status: u16,
    body: String,
}

impl Answer {
    fn parse(raw: &[u8]) -> Option<Answer> {
        let end = raw.windows(4).position(|w| w == b"\r\n\r\n")?;
        let head = std::str::from_utf8(&raw[..end]).ok()?;
        let mut lines = head.split("\r\n");
        let status = lines.next()?.split(' ').nth(1)?.parse().ok()?;
        let length = lines
            .filter_map(|line| line.split_once(':'))
            .find(|(name, _)| name.trim().eq_ignore_ascii_case("content-length"))
            .and_then(|(_, value)| value.trim().parse::<usize>().ok())
            .unwrap_or(0);
        let body = raw.get(end + 4..end + 4 + length)?;
        Some(Answer {
            status,
            body: String::from_utf8_lossy(body).into_owned(),
        })
    }
}

#[cfg(test)]
mod tests {
    use std::io::Read;
    use std::os::unix::net::UnixListener;
    use std::time::Instant;

    use super::*;

    fn event() -> PodEvent {
        PodEvent {
            netns: "/var/run/netns/cni-1234".into(),
            pod_name: "web-0".into(),
            pod_namespace: "default".into(),
            ips: vec![
                IpConfig {
                    interface: Some(2),
                    address: "10.244.1.5/24".parse().expect("net"),
                    gateway: Some("10.244.1.1".parse().expect("ip")),
                },
                IpConfig {
                    interface: None,
                    address: "fd00:10:244:1::5/64".parse().expect("net"),
                    gateway: None,
                },
            ],
        }
    }

    /// What Go's `json.Marshal` writes for the event above: Istio's plugin
    /// sends these bytes, Istio's agent reads ours.
    const GO_JSON: &str = r#"{"Netns":"/var/run/netns/cni-1234","PodName":"web-0","PodNamespace":"default","IPs":[{"Interface":2,"Address":{"IP":"10.244.1.5","Mask":"////AA=="},"Gateway":"10.244.1.1"},{"Interface":null,"Address":{"IP":"fd00:10:244:1::5","Mask":"//////////8AAAAAAAAAAA=="},"Gateway":""}]}"#;

    #[test]
    fn the_event_is_istios_json() {
        assert_eq!(serde_json::to_string(&event()).expect("JSON"), GO_JSON);
        let read: PodEvent = serde_json::from_str(GO_JSON).expect("Istio's event");
        assert_eq!(read, event());
        assert_eq!(
            read.addresses(),
            [
                "10.244.1.5".parse::<IpAddr>().expect("ip"),
                "fd00:10:244:1::5".parse().expect("ip")
            ]
        );
        // Go writes an IPv4 mask parsed from text in 16 bytes at times, and
        // an event without addresses as null.
        let sixteen: PodEvent = serde_json::from_str(
            r#"{"Netns":"/n","PodName":"a","PodNamespace":"b","IPs":[{"Address":{"IP":"10.0.0.9","Mask":"/////////////////wAAAA=="}}]}"#,
        )
        .expect("a 16-byte IPv4 mask");
        assert_eq!(
            sixteen.ips[0].address,
            "10.0.0.9/8".parse::<IpNetwork>().expect("net")
        );
        let none: PodEvent =
            serde_json::from_str(r#"{"Netns":"/n","PodName":"a","PodNamespace":"b","IPs":null}"#)
                .expect("null");
        assert!(none.ips.is_empty());
        assert!(
            serde_json::from_str::<PodEvent>(
                r#"{"Netns":"/n","PodName":"a","PodNamespace":"b","IPs":[{"Address":{"IP":"x"}}]}"#
            )
            .is_err()
        );
    }

    /// An agent that reads one request and answers `answer`.
    fn agent(path: &Path, answer: &'static str) -> std::thread::JoinHandle<String> {
        let listener = UnixListener::bind(path).expect("bind");
        std::thread::spawn(move || {
            let (mut stream, _) = listener.accept().expect("accept");
            let mut request = Vec::new();
            let mut chunk = [0u8; 4096];
            while !request.windows(4).any(|w| w == b"\r\n\r\n") || !request.ends_with(b"}") {
                let read = stream.read(&mut chunk).expect("read");
                if read == 0 {
                    break;
                }
                request.extend_from_slice(&chunk[..read]);
            }
            stream.write_all(answer.as_bytes()).expect("answer");
            String::from_utf8(request).expect("UTF-8")
        })
    }

    #[test]
    fn yes_is_200_and_no_carries_the_agents_reason() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join(SOCKET_NAME);
        let yes = agent(&path, "HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n");
        push(&path, &event(), WAIT).expect("taken");
        let request = yes.join().expect("agent");
        assert!(request.starts_with("POST /cmdadd HTTP/1.1\r\n"), "{request}");
        assert!(request.ends_with(&format!("\r\n\r\n{GO_JSON}")), "{request}");

        std::fs::remove_file(&path).expect("rm");
        let no = agent(
            &path,
            "HTTP/1.1 500 Internal Server Error\r\nContent-Type: text/plain; charset=utf-8\r\nContent-Length: 21\r\n\r\nno ztunnel connection\n",
        );
        let err = push(&path, &event(), WAIT).expect_err("refused");
        no.join().expect("agent");
        assert_eq!(
            err.to_string(),
            "unable to push CNI event (status code 500): no ztunnel connection"
        );
    }

    #[test]
    fn no_agent_is_refused_at_once_and_a_silent_one_is_left_in_time() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join(SOCKET_NAME);
        let started = Instant::now();
        let err = push(&path, &event(), WAIT).expect_err("nothing listens");
        assert!(matches!(err, PushError::Unreachable { .. }), "{err}");
        assert!(started.elapsed() < Duration::from_millis(500));

        let silent = crate::stream::silent_agent(&path);
        let started = Instant::now();
        let err = push(&path, &event(), Duration::from_millis(300)).expect_err("no answer");
        let waited = started.elapsed();
        assert!(matches!(err, PushError::NoAnswer { .. }), "{err}");
        assert!(
            waited >= Duration::from_millis(300) && waited < Duration::from_secs(2),
            "{waited:?}: {err}"
        );
        silent.join().expect("silent agent");
    }
}
