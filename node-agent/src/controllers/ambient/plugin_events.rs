//! The socket istio-redirect's pod events come to in ambient mode
//! (`agent_wire::pod_event`, Istio's wire: `POST /cmdadd` of Istio's
//! `CNIPluginAddEvent` on `pluginevent.sock`, so Istio's own plugin may
//! send them too). Each connection carries one request; this side reads
//! it within [`READ_WAIT`], hands the event to the controller and writes
//! its answer back: 200 once the pod is in the mesh, 400 for what is not
//! an event, 500 with the reason otherwise, as Istio's agent answers.

use std::path::PathBuf;
use std::time::Duration;

use agent_wire::pod_event::{ADD_PATH, PodEvent, WAIT};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::UnixStream;
use tokio::sync::{mpsc, oneshot};

use crate::metrics::Metrics;
use crate::run_socket::Kept;

/// The most a plugin may take to send its request once connected.
const READ_WAIT: Duration = Duration::from_secs(1);

/// The most of a request read: Istio's event is well under a kilobyte.
const MAX_REQUEST: usize = 64 * 1024;

/// A pod event and where the answer goes: Ok once the pod is in the mesh,
/// else why not.
#[derive(Debug)]
pub struct Event {
    pub event: PodEvent,
    pub answer: oneshot::Sender<Result<(), String>>,
}

/// The pod event socket, listened on while the controller runs.
#[derive(Debug)]
pub struct PluginEvents {
    socket: Kept,
}

impl PluginEvents {
    /// Binds `path` now (see `run_socket::Kept`); while it cannot listen,
    /// an enrolled pod's ADD finds no agent and fails.
    pub fn new(path: PathBuf) -> PluginEvents {
        let said = (
            "ambient",
            "enrolled pods' ADDs send their events to",
            "enrolled pods do not start",
        );
        PluginEvents {
            socket: Kept::new(path, said, |_| {}),
        }
    }

    /// The next connection, answered on a task of its own.
    pub async fn accept(&mut self, events: &mpsc::Sender<Event>, metrics: &Metrics) {
        if let Some(stream) = self.socket.accept().await {
            tokio::spawn(answer(stream, events.clone(), metrics.clone()));
        }
    }
}

/// Reads one request, hands its event over, writes the answer.
async fn answer(mut stream: UnixStream, events: mpsc::Sender<Event>, metrics: Metrics) {
    let request = match tokio::time::timeout(READ_WAIT, read_request(&mut stream)).await {
        Ok(Ok(request)) => request,
        Ok(Err(e)) => {
            log::warn!("ambient: a plugin's request: {e}");
            return;
        }
        Err(_) => {
            log::warn!("ambient: a plugin connected and sent no request in {READ_WAIT:?}");
            return;
        }
    };
    let (status, reason) = match request {
        Request::Event(event) => {
            let (tx, rx) = oneshot::channel();
            let decided = async {
                events.send(Event { event, answer: tx }).await.ok()?;
                rx.await.ok()
            };
            // The controller answers within the plugin's wait; this bounds
            // a task whose pod never got an answer (a rule tool that hung).
            match tokio::time::timeout(WAIT, decided).await {
                Ok(Some(Ok(()))) => (200, String::new()),
                Ok(Some(Err(reason))) => (500, reason),
                Ok(None) => (500, "the agent's ambient controller is stopping".to_owned()),
                Err(_) => (500, format!("no decision in {WAIT:?}")),
            }
        }
        Request::Bad(status, reason) => (status, reason),
    };
    metrics.plugin_request(status);
    let _ = tokio::time::timeout(READ_WAIT, stream.write_all(&response(status, &reason))).await;
}

/// What a connection asked.
#[derive(Debug, PartialEq)]
enum Request {
    Event(PodEvent),
    /// Answered at once with this status and reason.
    Bad(u16, String),
}

/// One HTTP/1.1 request: its head, then `Content-Length` bytes of body.
async fn read_request(stream: &mut UnixStream) -> std::io::Result<Request> {
    let mut raw = Vec::new();
    let mut chunk = [0u8; 4096];
    loop {
        if let Some(request) = parse(&raw) {
            return Ok(request);
        }
        if raw.len() >= MAX_REQUEST {
            return Ok(Request::Bad(413, "the request is too large".into()));
        }
        let read = stream.read(&mut chunk).await?;
        if read == 0 {
            return Err(std::io::Error::new(
                std::io::ErrorKind::UnexpectedEof,
                "the plugin hung up before its request was whole",
            ));
        }
        raw.extend_from_slice(&chunk[..read]);
    }
}

/// The request in `raw`, once it is whole.
fn parse(raw: &[u8]) -> Option<Request> {
    let end = raw.windows(4).position(|w| w == b"\r\n\r\n")?;
    let head = String::from_utf8_lossy(&raw[..end]);
    let mut lines = head.split("\r\n");
    let mut first = lines.next()?.split(' ');
    let (method, path) = (first.next()?, first.next()?);
    let length = lines
        .filter_map(|line| line.split_once(':'))
        .find(|(name, _)| name.trim().eq_ignore_ascii_case("content-length"))
        .and_then(|(_, value)| value.trim().parse::<usize>().ok())
        .unwrap_or(0);
    if method != "POST" || path != ADD_PATH {
        return Some(Request::Bad(404, format!("{method} {path}: not found")));
    }
    if length > MAX_REQUEST {
        return Some(Request::Bad(413, "the request is too large".into()));
    }
    let body = raw.get(end + 4..end + 4 + length)?;
    Some(match serde_json::from_slice(body) {
        Ok(event) => Request::Event(event),
        Err(e) => Request::Bad(400, format!("not a CNI plugin event: {e}")),
    })
}

/// The answer, as Go's `http.Error` writes it.
fn response(status: u16, reason: &str) -> Vec<u8> {
    let text = match status {
        200 => "OK",
        400 => "Bad Request",
        404 => "Not Found",
        413 => "Payload Too Large",
        _ => "Internal Server Error",
    };
    let body = if reason.is_empty() {
        String::new()
    } else {
        format!("{reason}\n")
    };
    format!(
        "HTTP/1.1 {status} {text}\r\nContent-Type: text/plain; charset=utf-8\r\nX-Content-Type-Options: nosniff\r\n\
         Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )
    .into_bytes()
}

#[cfg(test)]
mod tests {
    use agent_wire::pod_event::{PushError, push};

    use super::*;

    fn event() -> PodEvent {
        serde_json::from_value(
            serde_json::json!({"Netns": "/var/run/netns/cni-1", "PodName": "web-0",
            "PodNamespace": "mesh", "IPs": [{"Address": {"IP": "10.0.0.5", "Mask": "////AA=="}}]}),
        )
        .expect("Istio's event")
    }

    #[test]
    fn a_request_is_read_once_whole_and_only_an_add_is_an_event() {
        let body = serde_json::to_vec(&event()).expect("JSON");
        let mut raw = format!(
            "POST /cmdadd HTTP/1.1\r\nHost: unix\r\ncontent-length: {}\r\n\r\n",
            body.len()
        )
        .into_bytes();
        assert_eq!(parse(&raw), None, "no body yet");
        raw.extend_from_slice(&body);
        assert_eq!(parse(&raw), Some(Request::Event(event())));
        let Some(Request::Bad(404, _)) = parse(b"GET /cmdadd HTTP/1.1\r\n\r\n") else {
            panic!("a GET is no add");
        };
        let Some(Request::Bad(400, said)) = parse(b"POST /cmdadd HTTP/1.1\r\nContent-Length: 2\r\n\r\n{]")
        else {
            panic!("no event");
        };
        assert!(said.contains("not a CNI plugin event"), "{said}");
        let huge = format!("POST /cmdadd HTTP/1.1\r\nContent-Length: {}\r\n\r\n", usize::MAX);
        let Some(Request::Bad(413, _)) = parse(huge.as_bytes()) else {
            panic!("a length past any request");
        };
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn the_plugins_push_gets_the_controllers_answer() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("pluginevent.sock");
        let mut server = PluginEvents::new(path.clone());
        let (events, mut taken) = mpsc::channel(1);
        let metrics = Metrics::new(None);
        let serving = metrics.clone();
        tokio::spawn(async move {
            loop {
                server.accept(&events, &serving).await;
            }
        });
        tokio::spawn(async move {
            while let Some(Event { event, answer }) = taken.recv().await {
                let _ = answer.send(match event.pod_name.as_str() {
                    "web-0" => Ok(()),
                    _ => Err("no ztunnel connection".to_owned()),
                });
            }
        });
        let pushed = {
            let path = path.clone();
            move |event: PodEvent| {
                let path = path.clone();
                std::thread::spawn(move || push(&path, &event, Duration::from_secs(5)))
                    .join()
                    .expect("pushed")
            }
        };
        pushed(event()).expect("in the mesh");
        let mut other = event();
        other.pod_name = "web-1".into();
        match pushed(other) {
            Err(PushError::Refused { status, reason }) => {
                assert_eq!((status, reason.as_str()), (500, "no ztunnel connection"));
            }
            unexpected => panic!("{unexpected:?}"),
        }
        let scraped = metrics.scrape(true);
        for code in ["200", "500"] {
            let line = format!("istio_cni_plugin_requests_total{{response_code=\"{code}\"}} 1");
            assert!(scraped.contains(&line), "{scraped}");
        }
    }
}
