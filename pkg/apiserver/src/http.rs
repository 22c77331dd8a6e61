//! One HTTPS GET at a time: TLS against the cluster CA (with the client
//! certificate when there is one), HTTP/1.1 with `Connection: close`.

use std::io::{ErrorKind, Read, Write};
use std::net::TcpStream;
use std::sync::Arc;
use std::time::{Duration, Instant};

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use rustls::{ClientConfig, ClientConnection, RootCertStore, StreamOwned};

use crate::config::Credentials;
use crate::deadline::{is_timeout, left};
use crate::error::{Error, Result};
use crate::resolve;

/// Bodies larger than this are refused (a pod object is a few KiB).
const MAX_RESPONSE: u64 = 8 << 20;

#[derive(Debug, Clone)]
pub struct Server {
    url: String,
    host: String,
    port: u16,
    tls: Arc<ClientConfig>,
}

fn tls_error(e: impl std::fmt::Display) -> Error {
    Error::Tls(e.to_string())
}

impl Server {
    pub fn new(url: &str, ca_pem: &[u8], credentials: &Credentials) -> Result<Self> {
        let rest = url
            .strip_prefix("https://")
            .ok_or_else(|| Error::Connection(format!("{url}: only https:// servers are supported")))?;
        let authority = rest.split('/').next().unwrap_or_default();
        let (host, port) = match authority.rsplit_once(':') {
            Some((host, port)) if !host.ends_with(':') && port.parse::<u16>().is_ok() => {
                (host.to_owned(), port.parse().unwrap_or(443))
            }
            _ => (authority.to_owned(), 443),
        };
        let mut roots = RootCertStore::empty();
        for cert in CertificateDer::pem_slice_iter(ca_pem) {
            roots.add(cert.map_err(tls_error)?).map_err(tls_error)?;
        }
        if roots.is_empty() {
            return Err(Error::Tls(
                "the certificate authority holds no certificate".into(),
            ));
        }
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let builder = ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .map_err(tls_error)?
            .with_root_certificates(roots);
        let tls = match &credentials.client_cert {
            Some((cert_pem, key_pem)) => {
                let chain = CertificateDer::pem_slice_iter(cert_pem)
                    .collect::<Result<Vec<_>, _>>()
                    .map_err(tls_error)?;
                let key = PrivateKeyDer::from_pem_slice(key_pem).map_err(tls_error)?;
                builder.with_client_auth_cert(chain, key).map_err(tls_error)?
            }
            None => builder.with_no_client_auth(),
        };
        Ok(Server {
            url: url.to_owned(),
            host,
            port,
            tls: Arc::new(tls),
        })
    }

    pub fn url(&self) -> &str {
        &self.url
    }

    /// GETs `path`, returning the status and the (de-chunked) body, or
    /// [`Error::Timeout`] once `deadline` passes: every read and write,
    /// the TLS handshake's included, waits only for what is left of it, so
    /// a server that answers a byte at a time cannot stretch it.
    pub fn get(&self, path: &str, token: Option<&str>, deadline: Instant) -> Result<(u16, Vec<u8>)> {
        let bare = self.host.trim_start_matches('[').trim_end_matches(']').to_owned();
        let name = ServerName::try_from(bare).map_err(tls_error)?;
        let mut last = Error::Resolve(self.host.clone());
        let addresses = resolve::resolve(&self.host, self.port, deadline)?;
        for (tried, address) in addresses.iter().enumerate() {
            // Each address gets its share of what is left, so one that
            // drops SYNs does not keep the others from being tried.
            let share = left(deadline)? / u32::try_from(addresses.len() - tried).unwrap_or(1);
            let tcp = match TcpStream::connect_timeout(address, share) {
                Ok(tcp) => tcp,
                Err(e) => {
                    last = Error::Connection(format!("{address}: {e}"));
                    continue;
                }
            };
            let connection = ClientConnection::new(Arc::clone(&self.tls), name.clone()).map_err(tls_error)?;
            let mut stream = StreamOwned::new(connection, Bounded { tcp, deadline });
            let mut request = format!(
                "GET {path} HTTP/1.1\r\nHost: {}:{}\r\nAccept: application/json\r\nUser-Agent: istio-redirect\r\nConnection: close\r\n",
                self.host, self.port
            );
            if let Some(token) = token {
                request.push_str(&format!("Authorization: Bearer {token}\r\n"));
            }
            request.push_str("\r\n");
            stream.write_all(request.as_bytes()).map_err(|e| classify(&e))?;
            let mut response = Vec::new();
            match Read::by_ref(&mut stream)
                .take(MAX_RESPONSE)
                .read_to_end(&mut response)
            {
                Ok(_) => {}
                // Servers often close without close_notify after the body.
                Err(e) if e.kind() == ErrorKind::UnexpectedEof && !response.is_empty() => {}
                Err(e) => return Err(classify(&e)),
            }
            return parse_response(&response);
        }
        Err(last)
    }
}

/// A connection whose every read and write ends by the deadline.
struct Bounded {
    tcp: TcpStream,
    deadline: Instant,
}

impl Bounded {
    fn timeout(&self) -> std::io::Result<Duration> {
        left(self.deadline).map_err(|_| std::io::Error::from(ErrorKind::TimedOut))
    }
}

impl Read for Bounded {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        self.tcp.set_read_timeout(Some(self.timeout()?))?;
        self.tcp.read(buf)
    }
}

impl Write for Bounded {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.tcp.set_write_timeout(Some(self.timeout()?))?;
        self.tcp.write(buf)
    }

    fn flush(&mut self) -> std::io::Result<()> {
        self.tcp.flush()
    }
}

fn classify(e: &std::io::Error) -> Error {
    if is_timeout(e) {
        return Error::Timeout;
    }
    match e
        .get_ref()
        .and_then(|inner| inner.downcast_ref::<rustls::Error>())
    {
        Some(tls) => Error::Tls(tls.to_string()),
        None => Error::Connection(e.to_string()),
    }
}

pub fn parse_response(raw: &[u8]) -> Result<(u16, Vec<u8>)> {
    let split = raw
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .ok_or_else(|| Error::Protocol("no HTTP header".into()))?;
    let head = String::from_utf8_lossy(&raw[..split]);
    let body = &raw[split + 4..];
    let status: u16 = head
        .lines()
        .next()
        .and_then(|line| line.split_whitespace().nth(1))
        .and_then(|code| code.parse().ok())
        .ok_or_else(|| Error::Protocol(format!("bad status line in {head:?}")))?;
    let chunked = head.lines().any(|l| {
        let lower = l.to_ascii_lowercase();
        lower.starts_with("transfer-encoding:") && lower.contains("chunked")
    });
    Ok((status, if chunked { dechunk(body)? } else { body.to_vec() }))
}

fn dechunk(mut body: &[u8]) -> Result<Vec<u8>> {
    let mut out = Vec::new();
    loop {
        let line_end = body
            .windows(2)
            .position(|w| w == b"\r\n")
            .ok_or_else(|| Error::Protocol("truncated chunk".into()))?;
        let size_text = String::from_utf8_lossy(&body[..line_end]);
        let size = usize::from_str_radix(size_text.split(';').next().unwrap_or_default().trim(), 16)
            .map_err(|_| Error::Protocol(format!("bad chunk size {size_text:?}")))?;
        body = &body[line_end + 2..];
        if size == 0 {
            return Ok(out);
        }
        let chunk = body
            .get(..size)
            .ok_or_else(|| Error::Protocol("truncated chunk".into()))?;
        out.extend_from_slice(chunk);
        body = body.get(size + 2..).unwrap_or_default();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn responses_plain_and_chunked() {
        let (status, body) =
            parse_response(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n{}").expect("valid");
        assert_eq!((status, body.as_slice()), (200, &b"{}"[..]));
        let chunked = b"HTTP/1.1 404 Not Found\r\nTransfer-Encoding: chunked\r\n\r\n4\r\n{\"a\"\r\n3;x=y\r\n:1}\r\n0\r\n\r\n";
        let (status, body) = parse_response(chunked).expect("valid");
        assert_eq!((status, body.as_slice()), (404, &b"{\"a\":1}"[..]));
        assert!(parse_response(b"garbage").is_err());
    }

    #[test]
    fn servers_must_be_https_with_a_ca() {
        assert!(Server::new("http://10.0.0.1", b"", &Credentials::default()).is_err());
        let err =
            Server::new("https://10.0.0.1:6443", b"not pem", &Credentials::default()).expect_err("no CA");
        assert!(matches!(err, Error::Tls(_)));
    }
}
