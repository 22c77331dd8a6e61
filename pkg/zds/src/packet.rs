//! One message per `SOCK_SEQPACKET` packet, as ztunnel reads them: no
//! length prefix, at most [`MAX_PACKET`] bytes (ztunnel's read buffer), a
//! pod's netns as `SCM_RIGHTS` beside an add and beside nothing else. A
//! packet or its ancillary data cut short is a protocol error, not a
//! message.

use std::io::{self, IoSlice, IoSliceMut};
use std::os::fd::{AsRawFd, BorrowedFd, RawFd};
use std::os::unix::fs::MetadataExt;

use nix::sys::socket::{ControlMessage, ControlMessageOwned, MsgFlags, recvmsg, sendmsg};
use prost::Message;

/// The most a packet may carry: ztunnel reads into 1024 bytes and refuses
/// a truncated packet.
pub const MAX_PACKET: usize = 1024;

#[derive(Debug, thiserror::Error)]
pub enum PacketError {
    #[error("the peer closed the connection")]
    Closed,
    #[error(transparent)]
    Io(#[from] io::Error),
    #[error("protocol error: {0}")]
    Protocol(String),
}

impl From<nix::Error> for PacketError {
    fn from(errno: nix::Error) -> Self {
        PacketError::Io(errno.into())
    }
}

/// A descriptor that came with a packet; closed when dropped.
#[derive(Debug)]
pub struct ReceivedFd(RawFd);

impl ReceivedFd {
    /// The inode of what it is open on (through the process's own
    /// `/proc/self/fd` link, which reaches the file itself): a network
    /// namespace's is that of every path it is mounted at, and of
    /// `/proc/<pid>/ns/net` of each process inside it.
    pub fn inode(&self) -> io::Result<u64> {
        std::fs::metadata(format!("/proc/self/fd/{}", self.0)).map(|meta| meta.ino())
    }
}

impl Drop for ReceivedFd {
    fn drop(&mut self) {
        let _ = nix::unistd::close(self.0);
    }
}

/// Sends `message` as one packet, with `netns` beside it when given.
pub fn send(
    socket: BorrowedFd<'_>,
    message: &impl Message,
    netns: Option<BorrowedFd<'_>>,
) -> Result<(), PacketError> {
    let bytes = message.encode_to_vec();
    if bytes.len() > MAX_PACKET {
        return Err(PacketError::Protocol(format!(
            "a message of {} bytes, above the {MAX_PACKET} a packet carries",
            bytes.len()
        )));
    }
    let fds: Vec<RawFd> = netns.iter().map(AsRawFd::as_raw_fd).collect();
    let rights = [ControlMessage::ScmRights(&fds)];
    let ancillary: &[ControlMessage] = if fds.is_empty() { &[] } else { &rights };
    let iov = [IoSlice::new(&bytes)];
    let sent = sendmsg::<()>(socket.as_raw_fd(), &iov, ancillary, MsgFlags::MSG_NOSIGNAL, None)?;
    if sent != bytes.len() {
        return Err(PacketError::Protocol(format!(
            "{sent} of {} bytes sent",
            bytes.len()
        )));
    }
    Ok(())
}

/// Reads one packet as an `M`, and the descriptors that came with it.
pub fn receive<M: Message + Default>(socket: BorrowedFd<'_>) -> Result<(M, Vec<ReceivedFd>), PacketError> {
    let mut buffer = [0u8; MAX_PACKET];
    let mut space = nix::cmsg_space!([RawFd; 2]);
    let mut iov = [IoSliceMut::new(&mut buffer)];
    let received = recvmsg::<()>(
        socket.as_raw_fd(),
        &mut iov,
        Some(&mut space),
        MsgFlags::MSG_CMSG_CLOEXEC,
    )?;
    // Owned first, so they are closed whatever is wrong with the packet.
    let mut fds = Vec::new();
    let mut cut_short = received.flags.contains(MsgFlags::MSG_CTRUNC);
    match received.cmsgs() {
        Ok(cmsgs) => {
            for cmsg in cmsgs {
                if let ControlMessageOwned::ScmRights(rights) = cmsg {
                    fds.extend(rights.into_iter().map(ReceivedFd));
                }
            }
        }
        Err(_) => cut_short = true,
    }
    let (length, flags) = (received.bytes, received.flags);
    if flags.contains(MsgFlags::MSG_TRUNC) || cut_short {
        return Err(PacketError::Protocol(
            "a packet or its descriptors cut short".to_owned(),
        ));
    }
    if length == 0 {
        return Err(PacketError::Closed);
    }
    let message = M::decode(&buffer[..length])
        .map_err(|e| PacketError::Protocol(format!("not a {}: {e}", std::any::type_name::<M>())))?;
    Ok((message, fds))
}

#[cfg(test)]
mod tests {
    use std::os::fd::AsFd;

    use nix::sys::socket::{AddressFamily, SockFlag, SockType, socketpair};

    use super::*;
    use crate::messages::{Request, WorkloadInfo, WorkloadRequest, WorkloadResponse};

    fn pair() -> (std::os::fd::OwnedFd, std::os::fd::OwnedFd) {
        socketpair(
            AddressFamily::Unix,
            SockType::SeqPacket,
            None,
            SockFlag::SOCK_CLOEXEC,
        )
        .expect("a seqpacket pair")
    }

    #[test]
    fn a_message_and_its_netns_arrive_together_and_one_per_packet() {
        let (agent, ztunnel) = pair();
        let netns = std::fs::File::open("/proc/self/ns/net").expect("our netns");
        let info = WorkloadInfo {
            name: "web-0".into(),
            namespace: "default".into(),
            service_account: "web".into(),
        };
        send(
            agent.as_fd(),
            &WorkloadRequest::add("uid-1", info),
            Some(netns.as_fd()),
        )
        .expect("sent");
        send(agent.as_fd(), &WorkloadRequest::snapshot_sent(), None).expect("sent");
        let (add, fds): (WorkloadRequest, _) = receive(ztunnel.as_fd()).expect("received");
        assert!(matches!(add.payload, Some(Request::Add(ref a)) if a.uid == "uid-1"));
        assert_eq!(fds.len(), 1);
        let ours = std::fs::metadata("/proc/self/ns/net").expect("our netns").ino();
        assert_eq!(fds[0].inode().expect("the fd's inode"), ours);
        let (snapshot, fds): (WorkloadRequest, _) = receive(ztunnel.as_fd()).expect("received");
        assert_eq!(snapshot, WorkloadRequest::snapshot_sent());
        assert!(fds.is_empty());
        send(ztunnel.as_fd(), &WorkloadResponse::ack(""), None).expect("sent");
        let (ack, _): (WorkloadResponse, _) = receive(agent.as_fd()).expect("an ack");
        assert_eq!(ack.outcome(), Ok(()));
        drop(ztunnel);
        assert!(matches!(
            receive::<WorkloadResponse>(agent.as_fd()),
            Err(PacketError::Closed)
        ));
    }

    #[test]
    fn what_is_not_the_protocol_is_an_error() {
        let (agent, ztunnel) = pair();
        // Bytes that are no message of this protocol, then a packet above
        // what ztunnel reads.
        nix::sys::socket::send(agent.as_raw_fd(), &[0xff, 0xff, 0xff], MsgFlags::empty()).expect("sent");
        let err = receive::<WorkloadRequest>(ztunnel.as_fd()).expect_err("garbage");
        assert!(matches!(err, PacketError::Protocol(_)), "{err}");
        nix::sys::socket::send(agent.as_raw_fd(), &[0u8; MAX_PACKET + 1], MsgFlags::empty()).expect("sent");
        let err = receive::<WorkloadRequest>(ztunnel.as_fd()).expect_err("too long");
        assert!(err.to_string().contains("cut short"), "{err}");
        let huge = WorkloadRequest::keep(&"u".repeat(MAX_PACKET));
        assert!(matches!(
            send(agent.as_fd(), &huge, None),
            Err(PacketError::Protocol(_))
        ));
    }
}
