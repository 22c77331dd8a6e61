//! One netfilter socket for a whole conversation: a batch and its
//! answers, or the dumps that read a table back.

use std::collections::{BTreeMap, BTreeSet};
use std::os::fd::AsFd;
use std::time::Duration;

use netlink_packet_core::{NLM_F_ACK, NLM_F_DUMP, NetlinkMessage, NetlinkPayload};
use netlink_packet_netfilter::nftables::{
    ChainMessage, NfTablesMessage, RuleAttribute, RuleMessage, SetAttribute, SetElementList,
    SetElementMessage, SetMessage, TableAttribute, TableMessage,
};

use netlink_packet_netfilter::{NetfilterMessage, NetfilterMessageInner};
use netlink_sys::{Socket, SocketAddr, protocols::NETLINK_NETFILTER};

use super::decode::{self, DumpedSet};
use super::encode::Batch;
use super::{ReadSet, Table, TableFamily, invalid};
use crate::nfnl::{ENOENT, serialize};
use crate::{Error, Result};

/// How long an answer may take once the kernel has the request: it
/// handles a batch within the send, so its answers are queued by then.
const ANSWER_WAIT: Duration = Duration::from_secs(10);

/// How many times a set whose dump missed elements is read.
const DUMP_ATTEMPTS: usize = 5;

/// Room for the batch beyond its bytes (the kernel counts its own
/// overhead against the send buffer).
const SEND_SLACK: usize = 1 << 16;

/// `struct nlmsghdr`, then nf_tables' `struct nfgenmsg`.
const HEADER_LEN: usize = 16;
const NFGENMSG_LEN: usize = 4;
const NLMSG_ERROR: u16 = 2;
const NLMSG_DONE: u16 = 3;

/// One message as received.
struct Raw {
    kind: u16,
    sequence: u32,
    /// The whole message, header included.
    bytes: Vec<u8>,
}

enum Reply {
    /// An ACK (0) or the kernel's errno.
    Answer(i32),
    /// The end of a dump.
    Done,
    /// An object of a dump or a lookup.
    Object,
}

impl Raw {
    fn reply(&self) -> Reply {
        match self.kind {
            NLMSG_ERROR => {
                let code = self
                    .bytes
                    .get(HEADER_LEN..HEADER_LEN + 4)
                    .map_or(-EIO, |b| i32::from_ne_bytes([b[0], b[1], b[2], b[3]]));
                Reply::Answer(-code)
            }
            NLMSG_DONE => Reply::Done,
            _ => Reply::Object,
        }
    }

    /// An nf_tables message's attributes.
    fn attributes(&self) -> &[u8] {
        self.bytes.get(HEADER_LEN + NFGENMSG_LEN..).unwrap_or_default()
    }
}

/// For an error message too short to carry its code.
const EIO: i32 = 5;

pub(super) struct Conversation {
    socket: Socket,
    buffer: Vec<u8>,
}

fn io(what: &str, e: std::io::Error) -> Error {
    Error::Invalid(format!("nf_tables {what}: {e}"))
}

fn errno(what: &str, errno: i32) -> Error {
    io(what, std::io::Error::from_raw_os_error(errno))
}

impl Conversation {
    pub fn open() -> Result<Conversation> {
        let mut socket = Socket::new(NETLINK_NETFILTER).map_err(|e| io("socket", e))?;
        socket.bind_auto().map_err(|e| io("bind", e))?;
        socket
            .connect(&SocketAddr::new(0, 0))
            .map_err(|e| io("connect", e))?;
        // An error names the request by its header only, not a copy of it.
        socket.set_cap_ack(true).map_err(|e| io("NETLINK_CAP_ACK", e))?;
        nix::sys::socket::setsockopt(
            &socket.as_fd(),
            nix::sys::socket::sockopt::ReceiveTimeout,
            &nix::sys::time::TimeVal::new(i64::try_from(ANSWER_WAIT.as_secs()).unwrap_or(i64::MAX), 0),
        )
        .map_err(|e| io("SO_RCVTIMEO", e.into()))?;
        Ok(Conversation {
            socket,
            buffer: vec![0; 1 << 20],
        })
    }

    /// Sends the batch and reads its answers: Ok once the last message is
    /// acknowledged with no error before it; else the first error, with
    /// the op it came from.
    pub fn transact(&mut self, batch: &Batch) -> Result<()> {
        let size = batch.bytes.len() + SEND_SLACK;
        // Past the default send buffer (212992 bytes) a batch is refused
        // (EMSGSIZE); the kernel handles one batch as one message.
        nix::sys::socket::setsockopt(
            &self.socket.as_fd(),
            nix::sys::socket::sockopt::SndBufForce,
            &size,
        )
        .map_err(|e| io("SO_SNDBUFFORCE", e.into()))?;
        self.socket
            .send(&batch.bytes, 0)
            .map_err(|e| io("send of a batch", e))?;
        let last = u32::try_from(batch.ops_by_sequence.len()).unwrap_or(u32::MAX);
        let mut first_error: Option<(u32, i32)> = None;
        'answers: loop {
            let answers = match self.receive() {
                Ok(answers) => answers,
                // The kernel stopped answering after an error.
                Err(_) if first_error.is_some() => break,
                Err(e) => return Err(e),
            };
            for answer in answers {
                if let Reply::Answer(code) = answer.reply() {
                    if code != 0 && first_error.is_none() {
                        first_error = Some((answer.sequence, code));
                    }
                    if answer.sequence == last {
                        break 'answers;
                    }
                }
            }
        }
        match first_error {
            None => Ok(()),
            Some((sequence, code)) => {
                let op = usize::try_from(sequence)
                    .ok()
                    .and_then(|s| s.checked_sub(1))
                    .and_then(|s| batch.ops_by_sequence.get(s))
                    .and_then(|op| batch.descriptions.get(*op));
                let what = op.map_or_else(|| "the batch".to_owned(), |op| format!("`{op}`"));
                Err(Error::Refused { what, errno: code })
            }
        }
    }

    /// The messages of one receive.
    fn receive(&mut self) -> Result<Vec<Raw>> {
        let n = self
            .socket
            .recv(&mut &mut self.buffer[..], 0)
            .map_err(|e| io("receive", e))?;
        let mut messages = Vec::new();
        let mut at = 0;
        while at + HEADER_LEN <= n {
            let header = &self.buffer[at..at + HEADER_LEN];
            let len = u32::from_ne_bytes([header[0], header[1], header[2], header[3]]) as usize;
            if len < HEADER_LEN || at + len > n {
                return Err(invalid("a reply cut short"));
            }
            messages.push(Raw {
                kind: u16::from_ne_bytes([header[4], header[5]]),
                sequence: u32::from_ne_bytes([header[8], header[9], header[10], header[11]]),
                bytes: self.buffer[at..at + len].to_vec(),
            });
            // Netlink aligns each message to 4 bytes.
            at += len.div_ceil(4) * 4;
        }
        Ok(messages)
    }

    /// Sends a request and hands each nf_tables message of its answer to
    /// `each` until the kernel is done; the kernel's errno when it refuses.
    fn ask(
        &mut self,
        family: TableFamily,
        request: NfTablesMessage,
        flags: u16,
        mut each: impl FnMut(&Raw) -> Result<()>,
    ) -> Result<std::result::Result<(), i32>> {
        let bytes = serialize(request, family.proto_family(), 0, flags, 1);
        self.socket.send(&bytes, 0).map_err(|e| io("send", e))?;
        loop {
            for raw in self.receive()? {
                match raw.reply() {
                    Reply::Answer(0) | Reply::Done => return Ok(Ok(())),
                    Reply::Answer(code) => return Ok(Err(code)),
                    Reply::Object => each(&raw)?,
                }
            }
        }
    }

    /// Like [`Self::ask`], each object parsed by the netfilter crate.
    fn ask_parsed(
        &mut self,
        family: TableFamily,
        request: NfTablesMessage,
        flags: u16,
        mut each: impl FnMut(NfTablesMessage),
    ) -> Result<std::result::Result<(), i32>> {
        self.ask(family, request, flags, |raw| {
            let message = NetlinkMessage::<NetfilterMessage>::deserialize(&raw.bytes)
                .map_err(|e| invalid(format!("a reply: {e}")))?;
            if let NetlinkPayload::InnerMessage(NetfilterMessage {
                inner: NetfilterMessageInner::NfTables(message),
                ..
            }) = message.payload
            {
                each(message);
            }
            Ok(())
        })
    }

    fn dump(
        &mut self,
        family: TableFamily,
        what: &str,
        request: NfTablesMessage,
        each: impl FnMut(NfTablesMessage),
    ) -> Result<bool> {
        match self.ask_parsed(family, request, NLM_F_DUMP, each)? {
            Ok(()) => Ok(true),
            Err(ENOENT) => Ok(false),
            Err(code) => Err(errno(what, code)),
        }
    }

    fn table_exists(&mut self, family: TableFamily, table: &str) -> Result<bool> {
        let request = NfTablesMessage::GetTable(TableMessage {
            attributes: vec![TableAttribute::Name(table.to_owned())],
        });
        match self.ask(family, request, NLM_F_ACK, |_| Ok(()))? {
            Ok(()) => Ok(true),
            Err(ENOENT) => Ok(false),
            Err(code) => Err(errno("table lookup", code)),
        }
    }

    /// The table's sets, anonymous ones included; None without the table.
    pub fn sets(&mut self, family: TableFamily, table: &str) -> Result<Option<Vec<DumpedSet>>> {
        if !self.table_exists(family, table)? {
            return Ok(None);
        }
        let mut sets = Vec::new();
        let request = NfTablesMessage::GetSet(SetMessage {
            attributes: vec![SetAttribute::Table(table.to_owned())],
        });
        let found = self.dump(family, "set listing", request, |message| {
            if let NfTablesMessage::NewSet(set) = message
                && let Some(set) = decode::set(&set, table)
            {
                sets.push(set);
            }
        })?;
        Ok(found.then_some(sets))
    }

    /// One named set of the table; None when it or the table is absent.
    pub fn set(&mut self, family: TableFamily, table: &str, name: &str) -> Result<Option<DumpedSet>> {
        let request = NfTablesMessage::GetSet(SetMessage {
            attributes: vec![
                SetAttribute::Table(table.to_owned()),
                SetAttribute::Name(name.to_owned()),
            ],
        });
        let mut found = None;
        match self.ask_parsed(family, request, NLM_F_ACK, |message| {
            if let NfTablesMessage::NewSet(set) = message {
                found = decode::set(&set, table);
            }
        })? {
            Ok(()) => Ok(found),
            Err(ENOENT) => Ok(None),
            Err(code) => Err(errno("set lookup", code)),
        }
    }

    /// A set's elements, read from the dump's attributes by hand: the
    /// netfilter crate takes seconds for a few thousand elements. A hash
    /// the kernel resizes between two parts of a dump (it does so right
    /// after many elements came) can repeat some elements and miss others:
    /// where the kernel says how many it holds, a dump that got another
    /// count is read again.
    pub fn elements_of(
        &mut self,
        family: TableFamily,
        table: &str,
        set: &DumpedSet,
    ) -> Result<BTreeSet<super::Element>> {
        let mut attempts = 0;
        loop {
            attempts += 1;
            let listed = self.dump_elements(family, table, set)?;
            // The kernel counts an rbtree's intervals, not their ends.
            let distinct: BTreeSet<&super::Value> =
                listed.iter().filter(|e| !e.end_marker).map(|e| &e.key).collect();
            let counted = u32::try_from(distinct.len()).ok();
            if set.count.is_none() || set.count == counted || attempts == DUMP_ATTEMPTS {
                return decode::elements(set, listed);
            }
            // Let the kernel's resize finish.
            std::thread::sleep(Duration::from_millis(10));
            if let Some(fresh) = self.set(family, table, &set.name)?
                && fresh.count == counted
            {
                return decode::elements(set, listed);
            }
        }
    }

    fn dump_elements(
        &mut self,
        family: TableFamily,
        table: &str,
        set: &DumpedSet,
    ) -> Result<Vec<decode::DumpedElement>> {
        let mut listed = Vec::new();
        let request = NfTablesMessage::GetSetElement(SetElementMessage {
            attributes: vec![
                SetElementList::Table(table.to_owned()),
                SetElementList::Set(set.name.clone()),
            ],
        });
        let outcome = self.ask(family, request, NLM_F_DUMP, |raw| {
            listed.extend(decode::element_attributes(raw.attributes())?);
            Ok(())
        })?;
        match outcome {
            Ok(()) | Err(ENOENT) => Ok(listed),
            Err(code) => Err(errno("element listing", code)),
        }
    }

    pub fn read_table(&mut self, family: TableFamily, table: &str) -> Result<Option<Table>> {
        let Some(sets) = self.sets(family, table)? else {
            return Ok(None);
        };
        let mut named = BTreeMap::new();
        let mut anonymous = BTreeMap::new();
        for set in &sets {
            let elements = self.elements_of(family, table, set)?;
            match set.as_named() {
                Some(named_set) => {
                    named.insert(
                        set.name.clone(),
                        ReadSet {
                            set: named_set,
                            elements,
                        },
                    );
                }
                None => {
                    anonymous.insert(set.name.clone(), set.anonymous(elements));
                }
            }
        }
        // The kernel dumps every chain of the family; the table is picked here.
        let mut chains = BTreeMap::new();
        self.dump(
            family,
            "chain listing",
            NfTablesMessage::GetChain(ChainMessage { attributes: vec![] }),
            |message| {
                if let NfTablesMessage::NewChain(chain) = message
                    && let Some((name, chain)) = decode::chain(&chain, table)
                {
                    chains.insert(name, chain);
                }
            },
        )?;
        let request = NfTablesMessage::GetRule(RuleMessage {
            attributes: vec![RuleAttribute::Table(table.to_owned())],
        });
        let outcome = self.ask(family, request, NLM_F_DUMP, |raw| {
            if let Some((chain, rule)) = decode::rule(raw.attributes(), table, &anonymous)
                && let Some(chain) = chains.get_mut(&chain)
            {
                chain.rules.push(rule);
            }
            Ok(())
        })?;
        if let Err(code) = outcome
            && code != ENOENT
        {
            return Err(errno("rule listing", code));
        }
        Ok(Some(Table { chains, sets: named }))
    }
}
