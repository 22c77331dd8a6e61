//! Typed rtnetlink operations against one network namespace.
//!
//! rtnetlink is async; plugins are short-lived and single-purpose, so each
//! [`Netlink`] owns a current-thread tokio runtime (no worker threads) and
//! exposes blocking calls. The socket is created while the thread is inside
//! the target namespace and stays bound to it afterwards, so no call needs
//! to switch namespaces again.

#![forbid(unsafe_code)]

use std::net::IpAddr;

use futures::TryStreamExt;
use ipnetwork::IpNetwork;
use netns::NetNs;
use rtnetlink::packet_route::AddressFamily;
use rtnetlink::packet_route::address::{AddressAttribute, AddressMessage};
use rtnetlink::packet_route::link::{LinkAttribute, LinkFlags, LinkMessage};

pub mod ops;
pub mod route;
pub mod sysctl;

pub use route::RouteInfo;
use rtnetlink::{Handle, LinkUnspec};
use tokio::runtime::Runtime;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("failed to open a netlink socket: {0}")]
    Socket(#[source] std::io::Error),
    #[error(transparent)]
    Netns(#[from] netns::Error),
    #[error("{op}: {source}")]
    Netlink {
        op: String,
        #[source]
        source: rtnetlink::Error,
    },
    #[error("link {0:?} not found")]
    LinkNotFound(String),
    #[error("{0}")]
    InvalidRoute(String),
}

impl Error {
    /// The kernel's errno for a failed request, if that is what failed.
    pub fn errno(&self) -> Option<i32> {
        match self {
            Error::Netlink {
                source: rtnetlink::Error::NetlinkError(msg),
                ..
            } => msg.code.map(|c| -c.get()),
            _ => None,
        }
    }
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

/// A link as the plugins need to see it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Link {
    pub index: u32,
    pub name: String,
    pub up: bool,
    pub mtu: u32,
    /// `aa:bb:cc:dd:ee:ff`, or empty for links without a hardware address.
    pub mac: String,
    /// `bridge`, `veth`, ... (empty for links without IFLA_LINKINFO).
    pub kind: String,
    /// The bridge (or bond) this link is enslaved to.
    pub master: Option<u32>,
    /// For a veth: its peer's index (in the peer's namespace).
    pub peer_index: Option<u32>,
    pub promisc: bool,
    /// The operational state as `ip link` prints it (`UP`, `DOWN`, ...).
    pub oper_state: String,
}

/// A netlink connection bound to one namespace.
#[derive(Debug)]
pub struct Netlink {
    pub(crate) runtime: Runtime,
    pub(crate) handle: Handle,
}

pub const ENODEV: i32 = 19;
pub const EEXIST: i32 = 17;
pub const ESRCH: i32 = 3;
pub const ENOENT: i32 = 2;
pub const EAFNOSUPPORT: i32 = 97;
pub const EOPNOTSUPP: i32 = 95;
pub const EADDRNOTAVAIL: i32 = 99;
pub const ENETUNREACH: i32 = 101;
pub const EHOSTUNREACH: i32 = 113;
pub const EINVAL: i32 = 22;
pub const EACCES: i32 = 13;
pub const EAGAIN: i32 = 11;

pub(crate) fn netlink_err(op: impl Into<String>) -> impl FnOnce(rtnetlink::Error) -> Error {
    let op = op.into();
    move |source| Error::Netlink { op, source }
}

impl Netlink {
    /// Connects to the namespace the calling thread is in.
    pub fn connect() -> Result<Self> {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_io()
            .build()
            .map_err(Error::Socket)?;
        let handle = {
            let _context = runtime.enter();
            let (connection, handle, _) = rtnetlink::new_connection().map_err(Error::Socket)?;
            runtime.spawn(connection);
            handle
        };
        Ok(Netlink { runtime, handle })
    }

    /// Connects to `ns`: the socket is opened inside it, then the thread
    /// returns to its own namespace.
    pub fn connect_in(ns: &NetNs) -> Result<Self> {
        let _inside = ns.enter()?;
        Netlink::connect()
    }

    /// The link called `name`, or `None` if there is none.
    pub fn link_by_name(&self, name: &str) -> Result<Option<Link>> {
        let mut request = std::pin::pin!(self.handle.link().get().match_name(name).execute());
        match self.runtime.block_on(request.try_next()) {
            Ok(message) => Ok(message.map(|m| link_from(&m))),
            Err(e) => {
                let err = netlink_err(format!("get link {name:?}"))(e);
                if err.errno() == Some(ENODEV) {
                    Ok(None)
                } else {
                    Err(err)
                }
            }
        }
    }

    /// Like [`Netlink::link_by_name`], but a missing link is an error.
    pub fn require_link(&self, name: &str) -> Result<Link> {
        self.link_by_name(name)?
            .ok_or_else(|| Error::LinkNotFound(name.to_owned()))
    }

    pub fn set_up(&self, link: &Link) -> Result<()> {
        let message = LinkUnspec::new_with_index(link.index).up().build();
        self.runtime
            .block_on(self.handle.link().set(message).execute())
            .map_err(netlink_err(format!("set link {:?} up", link.name)))
    }

    pub fn set_down(&self, link: &Link) -> Result<()> {
        let message = LinkUnspec::new_with_index(link.index).down().build();
        self.runtime
            .block_on(self.handle.link().set(message).execute())
            .map_err(netlink_err(format!("set link {:?} down", link.name)))
    }

    /// Every address in the namespace with its link index, IPv4 first, then
    /// IPv6, each by link.
    pub fn all_addresses(&self) -> Result<Vec<(u32, IpNetwork)>> {
        self.dump_every_family(None)
    }

    /// Addresses of `link`, IPv4 first.
    pub fn addresses(&self, link: &Link) -> Result<Vec<IpNetwork>> {
        Ok(without_index(self.dump_every_family(Some(link))?))
    }

    /// [`Netlink::addresses`] of one family. The kernel dumps only that
    /// family: a node's IPv4 addresses stay few however many pods it runs,
    /// where every host veth adds an IPv6 link-local one.
    pub fn addresses_of_family(&self, link: &Link, v4: bool) -> Result<Vec<IpNetwork>> {
        let family = if v4 {
            AddressFamily::Inet
        } else {
            AddressFamily::Inet6
        };
        Ok(without_index(self.dump_addresses(Some(link), family)?))
    }

    /// Every family's addresses: one dump per family where those skip RTNL.
    fn dump_every_family(&self, link: Option<&Link>) -> Result<Vec<(u32, IpNetwork)>> {
        if !family_dumps_skip_rtnl() {
            return self.dump_addresses(link, AddressFamily::Unspec);
        }
        let mut addresses = self.dump_addresses(link, AddressFamily::Inet)?;
        addresses.extend(self.dump_addresses(link, AddressFamily::Inet6)?);
        Ok(addresses)
    }

    /// One address dump of `family` (`Unspec`: all), of `link` or of all.
    fn dump_addresses(&self, link: Option<&Link>, family: AddressFamily) -> Result<Vec<(u32, IpNetwork)>> {
        let mut request = self.handle.address().get();
        if let Some(link) = link {
            request = request.set_link_index_filter(link.index);
        }
        request.message_mut().header.family = family;
        let op = link.map_or_else(
            || "list addresses".to_owned(),
            |link| format!("list addresses of {:?}", link.name),
        );
        let messages: Vec<AddressMessage> = self
            .runtime
            .block_on(request.execute().try_collect())
            .map_err(netlink_err(op))?;
        Ok(messages
            .iter()
            // The link filter is advisory without strict checking.
            .filter(|m| link.is_none_or(|link| m.header.index == link.index))
            .filter_map(|m| Some((m.header.index, address_from(m)?)))
            // Without IPv6 the kernel answers an IPv6 dump with every family.
            .filter(|(_, address)| match family {
                AddressFamily::Inet => address.is_ipv4(),
                AddressFamily::Inet6 => address.is_ipv6(),
                _ => true,
            })
            .collect())
    }
}

/// Whether this kernel dumps one family's addresses without the RTNL lock
/// (Linux 6.9 on: `RTNL_FLAG_DUMP_UNLOCKED`). An `AF_UNSPEC` dump goes
/// through `rtnl_dump_all`, which takes RTNL on every kernel, so there two
/// lock-free dumps beat one locked one: every RTNL request of a node making
/// many pods at once queues behind all the others (measured in a 100-pod
/// burst: 0.5–0.9 s per request). Before 6.9 each family dump locks too,
/// and one dump is cheaper than two.
fn family_dumps_skip_rtnl() -> bool {
    static SKIPS: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *SKIPS.get_or_init(|| {
        sysctl::read("kernel/osrelease").is_ok_and(|release| kernel_version(&release) >= Some((6, 9)))
    })
}

fn without_index(addresses: Vec<(u32, IpNetwork)>) -> Vec<IpNetwork> {
    addresses.into_iter().map(|(_, address)| address).collect()
}

/// `(major, minor)` of a kernel release string such as `6.18.44-generic`.
fn kernel_version(release: &str) -> Option<(u32, u32)> {
    let mut numbers = release
        .split(|c: char| !c.is_ascii_digit())
        .map(str::parse::<u32>);
    Some((numbers.next()?.ok()?, numbers.next()?.ok()?))
}

pub(crate) fn link_from(message: &LinkMessage) -> Link {
    use rtnetlink::packet_route::link::LinkInfo;
    let mut link = Link {
        index: message.header.index,
        up: message.header.flags.contains(LinkFlags::Up),
        promisc: message.header.flags.contains(LinkFlags::Promisc),
        ..Link::default()
    };
    for attribute in &message.attributes {
        match attribute {
            LinkAttribute::IfName(name) => link.name.clone_from(name),
            LinkAttribute::Mtu(mtu) => link.mtu = *mtu,
            LinkAttribute::Address(bytes) => link.mac = format_mac(bytes),
            LinkAttribute::Controller(index) => link.master = Some(*index),
            LinkAttribute::Link(index) => link.peer_index = Some(*index),
            LinkAttribute::OperState(state) => link.oper_state = format!("{state:?}").to_uppercase(),
            LinkAttribute::LinkInfo(infos) => {
                for info in infos {
                    if let LinkInfo::Kind(kind) = info {
                        link.kind = kind.to_string();
                    }
                }
            }
            _ => {}
        }
    }
    link
}

/// Lower-case colon-separated hex, as Go's `net.HardwareAddr` prints it.
pub fn format_mac(bytes: &[u8]) -> String {
    bytes
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect::<Vec<_>>()
        .join(":")
}

pub(crate) fn address_from(message: &AddressMessage) -> Option<IpNetwork> {
    // IFA_LOCAL is the interface's own address; IFA_ADDRESS is the peer's on
    // point-to-point links and the same as IFA_LOCAL elsewhere.
    let pick = |want_local: bool| {
        message.attributes.iter().find_map(|a| match a {
            AddressAttribute::Local(ip) if want_local => Some(*ip),
            AddressAttribute::Address(ip) if !want_local => Some(*ip),
            _ => None,
        })
    };
    let ip: IpAddr = pick(true).or_else(|| pick(false))?;
    IpNetwork::new(ip, message.header.prefix_len).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Runs `ip ARGS` in the calling thread's namespace.
    fn ip(args: &str) {
        let status = std::process::Command::new("ip")
            .args(args.split_whitespace())
            .status()
            .expect("ip runs");
        assert!(status.success(), "ip {args}");
    }

    #[test]
    fn the_main_route_to_a_prefix_is_found_whatever_its_metric() {
        in_private_netns(|| {
            ip("link add cnit-d0 type veth peer name cnit-d1");
            ip("link set cnit-d1 up");
            ip("link set cnit-d0 up");
            ip("addr add 10.9.0.1/24 dev cnit-d0");
            ip("addr add fd00:9::1/64 dev cnit-d0 nodad");
            ip("route add 10.77.0.0/16 via 10.9.0.2 metric 100 proto static");
            ip("route add 10.79.0.0/24 via 10.9.0.2");
            ip("route add fd00:77::/48 via fd00:9::2 metric 32 proto bird");
            ip("route add 10.80.0.0/16 via 10.9.0.2 table 100");
            ip("rule add to 10.80.0.0/16 table 100");
            ip("route add blackhole 10.81.0.0/16");
            ip("route add prohibit 10.82.0.0/16");
            ip("route add unreachable fd00:83::/48");
            let nl = Netlink::connect().expect("netlink");
            let found = |dst: &str| {
                nl.main_route_to(dst.parse().expect("cidr"))
                    .expect("lookup")
                    .map(|(route, protocol)| (route.dst.to_string(), route.priority, protocol))
            };
            assert_eq!(found("10.77.0.0/16"), Some(("10.77.0.0/16".into(), Some(100), 4)));
            assert_eq!(
                found("10.77.5.0/16"),
                found("10.77.0.0/16"),
                "host bits are ignored"
            );
            assert_eq!(found("fd00:77::/48"), Some(("fd00:77::/48".into(), Some(32), 12)));
            assert_eq!(found("10.78.0.0/16"), None, "no route toward it");
            assert_eq!(found("10.79.0.0/16"), None, "only a more specific one");
            assert_eq!(
                found("10.9.0.0/24"),
                Some(("10.9.0.0/24".into(), None, 2)),
                "connected"
            );
            assert_eq!(found("10.80.0.0/16"), None, "in another table");
            // Inside routes that are not unicast, as a routing daemon
            // leaves them: no unicast route there, not a failure.
            assert_eq!(found("10.81.1.0/24"), None, "blackhole");
            assert_eq!(found("10.81.0.0/16"), None, "blackhole itself");
            assert_eq!(found("10.82.1.0/24"), None, "prohibit");
            assert_eq!(found("fd00:83:0:1::/64"), None, "unreachable");
        });
    }

    #[test]
    fn kernel_versions_read_from_release_strings() {
        assert_eq!(kernel_version("6.18.44-fc-v669"), Some((6, 18)));
        assert_eq!(kernel_version("6.9.0"), Some((6, 9)));
        assert_eq!(kernel_version("5.10.0-28-amd64"), Some((5, 10)));
        assert!(kernel_version("6.8.12") < Some((6, 9)));
        assert_eq!(kernel_version("6"), None);
        assert_eq!(kernel_version(""), None);
    }

    /// Runs `f` on a new thread inside a new, private network namespace
    /// (needs root); the namespace disappears with the thread.
    fn in_private_netns<T: Send>(f: impl FnOnce() -> T + Send) -> T {
        std::thread::scope(|s| {
            s.spawn(|| {
                nix::sched::unshare(nix::sched::CloneFlags::CLONE_NEWNET)
                    .expect("unshare(CLONE_NEWNET) needs root; run the tests as root");
                f()
            })
            .join()
            .expect("test thread")
        })
    }

    #[test]
    fn links_go_up_and_down_and_show_their_addresses() {
        in_private_netns(|| {
            let nl = Netlink::connect().expect("netlink");
            assert_eq!(nl.link_by_name("cnit-absent0").expect("lookup"), None);
            assert!(matches!(
                nl.require_link("cnit-absent0"),
                Err(Error::LinkNotFound(_))
            ));
            let lo = nl.require_link("lo").expect("lo exists in every namespace");
            assert!(!lo.up, "lo starts down in a new namespace");
            assert_eq!(lo.mac, "00:00:00:00:00:00");
            nl.set_up(&lo).expect("up");
            let lo = nl.require_link("lo").expect("lo");
            assert!(lo.up);
            let addrs: Vec<String> = nl
                .addresses(&lo)
                .expect("addresses")
                .iter()
                .map(ToString::to_string)
                .collect();
            assert!(addrs.contains(&"127.0.0.1/8".to_owned()), "{addrs:?}");
            nl.set_down(&lo).expect("down");
            assert!(!nl.require_link("lo").expect("lo").up);
        });
    }

    #[test]
    fn a_connection_stays_in_the_namespace_it_was_opened_in() {
        in_private_netns(|| {
            let pod = NetNs::current().expect("this thread's netns");
            let host_side = std::thread::scope(|s| {
                s.spawn(|| {
                    nix::sched::unshare(nix::sched::CloneFlags::CLONE_NEWNET).expect("unshare");
                    let here = NetNs::current().expect("netns");
                    let nl = Netlink::connect_in(&pod).expect("connect into the pod");
                    assert!(
                        NetNs::current().expect("netns").same_as(&here),
                        "the thread came back"
                    );
                    let lo = nl.require_link("lo").expect("lo");
                    nl.set_up(&lo).expect("up");
                    here
                })
                .join()
                .expect("thread")
            });
            let nl = Netlink::connect().expect("netlink");
            assert!(
                nl.require_link("lo").expect("lo").up,
                "the change landed in the pod namespace"
            );
            assert!(!host_side.same_as(&pod));
        });
    }

    #[test]
    fn macs_print_like_go() {
        assert_eq!(format_mac(&[0x0a, 0x58, 0, 0xff, 1, 2]), "0a:58:00:ff:01:02");
        assert_eq!(format_mac(&[0; 6]), "00:00:00:00:00:00");
        assert_eq!(format_mac(&[]), "");
    }
}
