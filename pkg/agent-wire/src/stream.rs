//! What the plugin-side clients share: a connect and every read bounded
//! by one deadline, so an agent that accepts nothing, answers nothing or
//! answers a byte at a time costs the wait and no more.

use std::io::{self, Read};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::{Duration, Instant};

/// When the whole exchange must be over.
#[derive(Debug, Clone, Copy)]
pub struct Deadline(Instant);

impl Deadline {
    pub fn after(wait: Duration) -> Deadline {
        Deadline(Instant::now() + wait)
    }

    /// What is left of it; none left is a timeout.
    pub fn left(&self) -> io::Result<Duration> {
        let left = self.0.saturating_duration_since(Instant::now());
        if left.is_zero() {
            Err(io::Error::new(io::ErrorKind::TimedOut, "no answer in time"))
        } else {
            Ok(left)
        }
    }
}

/// A connection to `socket` made within `wait`: a Unix stream connect
/// blocks while the listener's queue is full (an agent frozen or stuck
/// before it accepts), and only a send timeout bounds it.
pub fn connect_within(socket: &Path, wait: Duration) -> io::Result<UnixStream> {
    use nix::sys::socket::{self as sock, AddressFamily, SockFlag, SockType, UnixAddr, sockopt};
    let fd = sock::socket(
        AddressFamily::Unix,
        SockType::Stream,
        SockFlag::SOCK_CLOEXEC,
        None,
    )?;
    let timeout = nix::sys::time::TimeVal::new(
        wait.as_secs().try_into().unwrap_or(i64::MAX),
        wait.subsec_micros().into(),
    );
    sock::setsockopt(&fd, sockopt::SendTimeout, &timeout)?;
    sock::connect(std::os::fd::AsRawFd::as_raw_fd(&fd), &UnixAddr::new(socket)?)?;
    Ok(UnixStream::from(fd))
}

/// Reads until `done` says the answer is whole, the peer closes, or `most`
/// bytes came, every read within `deadline`.
pub fn read_until(
    stream: &mut UnixStream,
    deadline: Deadline,
    most: usize,
    done: impl Fn(&[u8]) -> bool,
) -> io::Result<Vec<u8>> {
    let mut answer = Vec::new();
    let mut chunk = [0u8; 512];
    while !done(&answer) && answer.len() < most {
        stream.set_read_timeout(Some(deadline.left()?))?;
        let read = stream.read(&mut chunk)?;
        if read == 0 {
            break;
        }
        answer.extend_from_slice(&chunk[..read]);
    }
    answer.truncate(most);
    Ok(answer)
}

/// For the clients' tests: an agent at `socket` that takes one connection
/// and reads until the client leaves, answering nothing.
#[cfg(test)]
pub fn silent_agent(socket: &Path) -> std::thread::JoinHandle<()> {
    let listener = std::os::unix::net::UnixListener::bind(socket).expect("bind");
    std::thread::spawn(move || {
        let (mut stream, _) = listener.accept().expect("accept");
        let mut sink = Vec::new();
        let _ = stream.read_to_end(&mut sink);
    })
}
