//! The lease store and the verbs against real sled databases in temporary
//! directories.

use std::fs;
use std::net::IpAddr;
use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::sync::Arc;

use cni::conf::GcAttachment;
use ipam::pool;
use ipam::store::Stores;
use ipam_config::range::{RangeConf, RangeSet};

fn ip(s: &str) -> IpAddr {
    s.parse().expect("ip")
}

fn set(subnet: &str) -> RangeSet {
    RangeSet::from_conf(&[RangeConf {
        subnet: subnet.into(),
        ..RangeConf::default()
    }])
    .expect("valid set")
}

struct Net {
    dir: tempfile::TempDir,
    stores: Stores,
    sets: Vec<RangeSet>,
}

impl Net {
    fn new(subnets: &[&str]) -> Self {
        Net {
            dir: tempfile::tempdir().expect("tempdir"),
            stores: Stores::direct(),
            sets: subnets.iter().map(|s| set(s)).collect(),
        }
    }

    fn data_dir(&self) -> &Path {
        self.dir.path()
    }

    /// `<dataDir>/net`, where the reference plugin keeps its files.
    fn reference_dir(&self) -> std::path::PathBuf {
        self.data_dir().join("net")
    }

    /// Writes a file as the reference plugin would.
    fn write_reference(&self, name: &str, content: &str) {
        fs::create_dir_all(self.reference_dir()).expect("mkdir");
        fs::write(self.reference_dir().join(name), content).expect("write");
    }

    fn add(&self, id: &str, requested: &[&str]) -> Result<Vec<IpAddr>, ipam::Error> {
        self.add_in(id, requested, None)
    }

    fn add_in(&self, id: &str, requested: &[&str], netns: Option<&str>) -> Result<Vec<IpAddr>, ipam::Error> {
        let requested: Vec<IpAddr> = requested.iter().map(|s| ip(s)).collect();
        pool::with_network(&self.stores, self.data_dir(), "net", |n| {
            pool::allocate(n, &self.sets, &requested, id, "eth0", netns.map(Path::new))
        })
        .map(|a| a.into_iter().map(|a| a.ip).collect())
    }

    fn del(&self, id: &str) -> usize {
        self.del_in(id, None)
    }

    fn del_in(&self, id: &str, netns: Option<&str>) -> usize {
        pool::with_network(&self.stores, self.data_dir(), "net", |n| {
            pool::release(n, id, "eth0", netns.map(Path::new))
        })
        .expect("release")
        .len()
    }

    fn leases(&self) -> Vec<(String, String, String)> {
        pool::with_network(&self.stores, self.data_dir(), "net", |n| n.leases())
            .expect("list")
            .into_iter()
            .map(|l| (l.ip.to_string(), l.container_id, l.ifname))
            .collect()
    }

    fn exhausted(&self) -> Option<usize> {
        pool::with_network(&self.stores, self.data_dir(), "net", |n| {
            pool::exhausted_set(n, &self.sets)
        })
        .expect("status")
    }
}

#[test]
fn round_robin_across_add_and_del() {
    let net = Net::new(&["10.0.0.0/29"]);
    assert_eq!(net.add("a", &[]).expect("add"), [ip("10.0.0.2")]);
    assert_eq!(net.del("a"), 1);
    assert_eq!(
        net.add("b", &[]).expect("add"),
        [ip("10.0.0.3")],
        "a crash-looping pod does not get .2 back"
    );
    assert_eq!(net.add("c", &[]).expect("add"), [ip("10.0.0.4")]);
}

#[test]
fn a_repeated_add_returns_the_same_lease() {
    let net = Net::new(&["10.0.0.0/24", "fd00::/64"]);
    let first = net.add("a", &[]).expect("add");
    assert_eq!(first.len(), 2);
    assert_eq!(net.add("a", &[]).expect("again"), first);
    assert_eq!(net.leases().len(), 2);
    let err = net.add("a", &["10.0.0.77"]).expect_err("holds another");
    assert!(err.to_string().contains("already holds 10.0.0.2"), "{err}");
}

#[test]
fn exhaustion_has_the_reference_message_and_status_follows() {
    let net = Net::new(&["10.0.0.0/29"]);
    for id in ["a", "b", "c", "d", "e"] {
        net.add(id, &[]).expect("fits");
    }
    assert_eq!(net.exhausted(), Some(0));
    let err = net.add("f", &[]).expect_err("full");
    assert_eq!(
        err.to_string(),
        "failed to allocate for range 0: no IP addresses available in range set: 10.0.0.1-10.0.0.6"
    );
    assert_eq!(net.del("c"), 1);
    assert_eq!(net.exhausted(), None);
    assert_eq!(net.add("f", &[]).expect("room again"), [ip("10.0.0.4")]);
}

#[test]
fn requested_addresses() {
    let net = Net::new(&["10.0.0.0/24", "fd00::/64"]);
    assert_eq!(
        net.add("a", &["fd00::9", "10.0.0.9"]).expect("both"),
        [ip("10.0.0.9"), ip("fd00::9")]
    );
    let cases = [
        (
            vec!["10.0.0.9"],
            "failed to allocate for range 0: requested IP address 10.0.0.9 is not available in range set 10.0.0.1-10.0.0.254",
        ),
        (
            vec!["10.0.0.1"],
            "failed to allocate for range 0: requested ip 10.0.0.1 is subnet's gateway",
        ),
        (
            vec!["192.168.1.1"],
            "failed to allocate all requested IPs: 192.168.1.1",
        ),
        (
            vec!["10.0.0.20", "10.0.0.21"],
            "failed to allocate all requested IPs: 10.0.0.21",
        ),
    ];
    for (requested, msg) in cases {
        let err = net.add("b", &requested).expect_err(msg);
        assert_eq!(err.to_string(), msg);
        assert!(
            !net.leases().iter().any(|l| l.1 == "b"),
            "a failed ADD leaves no lease: {msg}"
        );
    }
}

#[test]
fn release_falls_back_to_id_only_leases_and_unknown_is_fine() {
    let net = Net::new(&["10.0.0.0/24"]);
    let ref_dir = net.data_dir().join("net");
    fs::create_dir_all(&ref_dir).expect("mkdir");
    fs::write(ref_dir.join("10.0.0.50"), "old-id").expect("write");
    assert_eq!(
        net.leases(),
        [("10.0.0.50".into(), "old-id".into(), String::new())]
    );
    assert_eq!(net.del("unknown"), 0);
    assert_eq!(net.del("old-id"), 1);
    assert!(net.leases().is_empty());
    assert!(
        !ref_dir.join("10.0.0.50").exists(),
        "the reference file goes with its lease"
    );
}

#[test]
fn check_compares_leases_with_the_reported_addresses() {
    let net = Net::new(&["10.0.0.0/24"]);
    let check = |reported: Option<&[IpAddr]>| {
        pool::with_network(&net.stores, net.data_dir(), "net", |n| {
            pool::check(n, &net.sets, "a", "eth0", reported)
        })
    };
    let err = check(None).expect_err("nothing leased");
    assert_eq!(
        err.to_string(),
        "host-local: Failed to find address added by container a"
    );
    net.add("a", &[]).expect("add");
    check(None).expect("a lease exists");
    check(Some(&[ip("10.0.0.2"), ip("192.168.0.9")])).expect("foreign addresses are not ours to judge");
    let err = check(Some(&[ip("10.0.0.3")])).expect_err("wrong address");
    assert!(
        err.to_string()
            .contains("10.0.0.2 leased to a/eth0 is missing from prevResult"),
        "{err}"
    );
    let err = check(Some(&[ip("10.0.0.2"), ip("10.0.0.3")])).expect_err("extra address");
    assert!(
        err.to_string()
            .contains("10.0.0.3 in prevResult is not leased to a/eth0"),
        "{err}"
    );
}

#[test]
fn gc_keeps_only_valid_attachments() {
    let net = Net::new(&["10.0.0.0/24"]);
    for id in ["a", "b", "c"] {
        net.add(id, &[]).expect("add");
    }
    let valid = [GcAttachment {
        container_id: "b".into(),
        ifname: "eth0".into(),
    }];
    let report = pool::with_network(&net.stores, net.data_dir(), "net", |n| pool::gc(n, &valid)).expect("gc");
    assert_eq!(report.released.len(), 2);
    assert_eq!(net.leases(), [("10.0.0.3".into(), "b".into(), "eth0".into())]);
    let report = pool::with_network(&net.stores, net.data_dir(), "net", |n| pool::gc(n, &[])).expect("gc");
    assert_eq!(report.released.len(), 1, "an empty list releases everything");
    assert!(net.leases().is_empty());
}

#[test]
fn reference_leases_are_imported_once_and_never_resurrected() {
    let net = Net::new(&["10.0.0.0/29"]);
    let ref_dir = net.reference_dir();
    net.write_reference("10.0.0.2", "ref-a\r\neth0");
    net.write_reference("10.0.0.3", "ref-b\r\neth0");
    net.write_reference("last_reserved_ip.0", "10.0.0.3");
    assert_eq!(
        net.add("new", &[]).expect("add"),
        [ip("10.0.0.4")],
        "after the imported round-robin position"
    );
    assert_eq!(
        net.add("ref-a", &[]).expect("repeat"),
        [ip("10.0.0.2")],
        "imported leases answer repeated ADDs"
    );
    assert_eq!(net.del("ref-b"), 1);
    assert!(!ref_dir.join("10.0.0.3").exists());
    // The reference plugin runs again and writes a new file: imported too,
    // and the released one does not come back.
    net.write_reference("10.0.0.6", "ref-c\r\neth0");
    let owners: Vec<String> = net.leases().into_iter().map(|l| l.1).collect();
    assert_eq!(owners, ["ref-a", "new", "ref-c"]);
    for id in ["x", "y"] {
        let got = net.add(id, &[]).expect("add");
        assert!(
            !got.contains(&ip("10.0.0.2")) && !got.contains(&ip("10.0.0.6")),
            "{got:?}"
        );
    }
}

#[test]
fn the_import_reads_only_small_regular_files_and_never_through_a_symlink() {
    let net = Net::new(&["10.0.0.0/28"]);
    let ref_dir = net.data_dir().join("net");
    fs::create_dir_all(&ref_dir).expect("mkdir");
    let elsewhere = net.data_dir().join("elsewhere");
    fs::write(&elsewhere, "linked\r\neth0").expect("write");
    nix::unistd::mkfifo(
        &ref_dir.join("10.0.0.2"),
        nix::sys::stat::Mode::from_bits_truncate(0o600),
    )
    .expect("mkfifo");
    std::os::unix::fs::symlink("/dev/zero", ref_dir.join("10.0.0.3")).expect("symlink");
    std::os::unix::fs::symlink(&elsewhere, ref_dir.join("10.0.0.4")).expect("symlink");
    fs::write(
        ref_dir.join("10.0.0.5"),
        format!("big\r\neth0{}", " ".repeat(1 << 20)),
    )
    .expect("write");
    std::os::unix::fs::symlink("/dev/zero", ref_dir.join("last_reserved_ip.0")).expect("symlink");
    fs::write(ref_dir.join("10.0.0.6"), "real\r\neth0").expect("write");
    // Run where a hang fails the test instead of stalling it.
    let (done, finished) = std::sync::mpsc::channel();
    let data_dir = net.data_dir().to_owned();
    let sets = net.sets.clone();
    std::thread::spawn(move || {
        let added = pool::with_network(&Stores::direct(), &data_dir, "net", |n| {
            pool::allocate(n, &sets, &[], "new", "eth0", None)
        });
        let _ = done.send(added.map(|a| a.into_iter().map(|a| a.ip).collect::<Vec<_>>()));
    });
    let added = finished
        .recv_timeout(std::time::Duration::from_secs(20))
        .expect("the import finishes")
        .expect("add");
    let owners: std::collections::BTreeSet<(String, String)> =
        net.leases().into_iter().map(|l| (l.0, l.1)).collect();
    let expected = [
        ("10.0.0.6".to_owned(), "real".to_owned()),
        (added[0].to_string(), "new".to_owned()),
    ];
    assert_eq!(owners, expected.into_iter().collect());
    assert_eq!(fs::read_to_string(&elsewhere).expect("read"), "linked\r\neth0");
}

/// How often `name` in `dir` is opened while `during` runs.
fn opens_of(dir: &Path, name: &str, during: impl FnOnce()) -> usize {
    use nix::sys::inotify::{AddWatchFlags, InitFlags, Inotify};
    let inotify = Inotify::init(InitFlags::IN_NONBLOCK | InitFlags::IN_CLOEXEC).expect("inotify");
    // Closes are watched too: inotify merges identical events in a row,
    // and an open, a close and an open are not.
    inotify
        .add_watch(dir, AddWatchFlags::IN_OPEN | AddWatchFlags::IN_CLOSE)
        .expect("watch");
    during();
    let mut opens = 0;
    loop {
        match inotify.read_events() {
            Ok(events) => {
                opens += events
                    .iter()
                    .filter(|e| {
                        e.mask.contains(AddWatchFlags::IN_OPEN)
                            && e.name.as_deref() == Some(std::ffi::OsStr::new(name))
                    })
                    .count()
            }
            Err(nix::errno::Errno::EAGAIN) => return opens,
            Err(e) => panic!("inotify: {e}"),
        }
    }
}

/// A DEL and a GC each look for an imported lease's reference file once
/// (the store used to look again inside its transaction, after GC had).
/// The files name other owners by then, as when the reference plugin has
/// handed the addresses on, so they stay and every look opens them.
#[test]
fn a_del_and_a_gc_look_for_each_reference_file_once() {
    let net = Net::new(&["10.0.0.0/29"]);
    let ref_dir = net.reference_dir();
    net.write_reference("10.0.0.2", "ref-a\r\neth0");
    net.write_reference("10.0.0.3", "ref-b\r\neth0");
    assert_eq!(net.leases().len(), 2);
    // Rewritten in place: the directory does not change, nothing is imported.
    net.write_reference("10.0.0.2", "other-a\r\neth0");
    net.write_reference("10.0.0.3", "other-b\r\neth0");
    let del = opens_of(&ref_dir, "10.0.0.2", || assert_eq!(net.del("ref-a"), 1));
    let gc = opens_of(&ref_dir, "10.0.0.3", || {
        let report =
            pool::with_network(&net.stores, net.data_dir(), "net", |n| pool::gc(n, &[])).expect("gc");
        assert_eq!(report.released.len(), 1);
    });
    assert_eq!(
        (del, gc),
        (1, 1),
        "opens of the reference file by a DEL and by a GC"
    );
    assert!(net.leases().is_empty());
    for (file, owner) in [("10.0.0.2", "other-a\r\neth0"), ("10.0.0.3", "other-b\r\neth0")] {
        assert_eq!(
            fs::read_to_string(ref_dir.join(file)).expect("read"),
            owner,
            "a file naming another owner is not ours to remove"
        );
    }
}

/// A DEL of an imported lease killed after its transaction and before the
/// flush (where sled may keep the release or lose it): the reference file
/// is already gone, since it is removed before the release commits, so no
/// later import brings the lease back and the runtime's repeated DEL
/// converges.
#[test]
fn a_del_killed_before_its_flush_leaves_no_reference_file_to_import_again() {
    const CHILD: &str = "IPAM_TEST_DEL_TO_KILL_IN";
    if let Some(data_dir) = std::env::var_os(CHILD) {
        let _: Result<(), ipam::Error> =
            pool::with_network(&Stores::direct(), Path::new(&data_dir), "net", |n| {
                pool::release(n, "ref-a", "eth0", None)?;
                nix::sys::signal::raise(nix::sys::signal::Signal::SIGKILL).expect("kill");
                Ok(())
            });
        return;
    }
    let net = Net::new(&["10.0.0.0/29"]);
    let ref_dir = net.reference_dir();
    net.write_reference("10.0.0.2", "ref-a\r\neth0");
    net.write_reference("10.0.0.3", "ref-b\r\neth0");
    let ref_a = ("10.0.0.2".to_owned(), "ref-a".to_owned(), "eth0".to_owned());
    let ref_b = ("10.0.0.3".to_owned(), "ref-b".to_owned(), "eth0".to_owned());
    assert_eq!(net.leases(), [ref_a.clone(), ref_b.clone()]);

    let status = std::process::Command::new(std::env::current_exe().expect("this test binary"))
        .args([
            "--exact",
            "a_del_killed_before_its_flush_leaves_no_reference_file_to_import_again",
            "--test-threads=1",
        ])
        .env(CHILD, net.data_dir())
        .stdout(std::process::Stdio::null())
        .status()
        .expect("run the DEL to kill");
    assert_eq!(
        std::os::unix::process::ExitStatusExt::signal(&status),
        Some(nix::sys::signal::Signal::SIGKILL as i32),
        "the DEL was killed: {status:?}"
    );
    assert!(
        !ref_dir.join("10.0.0.2").exists(),
        "the file goes before its release commits"
    );
    // The file's removal changed the directory: this call imports again.
    let left = net.leases();
    assert!(
        left == [ref_a.clone(), ref_b.clone()] || left == [ref_b.clone()],
        "held without its file, or released: {left:?}"
    );
    // The runtime repeats the DEL.
    assert_eq!(net.del("ref-a"), left.len() - 1);
    // The reference plugin writes again: imported, and ref-a stays gone.
    net.write_reference("10.0.0.4", "ref-c\r\neth0");
    let ref_c = ("10.0.0.4".to_owned(), "ref-c".to_owned(), "eth0".to_owned());
    assert_eq!(net.leases(), [ref_b, ref_c]);
}

#[test]
fn files_are_private() {
    let net = Net::new(&["10.0.0.0/24"]);
    net.add("a", &[]).expect("add");
    let mode = |p: &Path| fs::metadata(p).expect("stat").permissions().mode() & 0o777;
    let mut dirs = vec![
        net.data_dir().join("net"),
        net.data_dir().join(".sled"),
        net.data_dir().join(".sled/net"),
    ];
    let mut files = vec![net.data_dir().join("net/lock")];
    for entry in walk(&net.data_dir().join(".sled/net")) {
        if entry.is_dir() {
            dirs.push(entry)
        } else {
            files.push(entry)
        }
    }
    for d in dirs {
        assert_eq!(mode(&d), 0o700, "{}", d.display());
    }
    for f in files {
        assert_eq!(mode(&f), 0o600, "{}", f.display());
    }
}

fn walk(dir: &Path) -> Vec<std::path::PathBuf> {
    let mut out = Vec::new();
    for entry in fs::read_dir(dir).expect("read dir").flatten() {
        let path = entry.path();
        if path.is_dir() {
            out.extend(walk(&path));
        }
        out.push(path);
    }
    out
}

#[test]
fn network_names_are_checked_before_they_become_paths() {
    let dir = tempfile::tempdir().expect("tempdir");
    for bad in ["../x", ".sled", "a/b", ""] {
        let err = pool::with_network(&Stores::direct(), dir.path(), bad, |n| n.leases()).expect_err(bad);
        assert!(matches!(err, ipam::Error::Cni(_)), "{bad}: {err}");
    }
}

/// Every path under `dir`, with what it is.
fn tree(dir: &Path) -> Vec<(std::path::PathBuf, bool)> {
    let mut out: Vec<_> = walk(dir).into_iter().map(|p| (p.clone(), p.is_dir())).collect();
    out.sort();
    out
}

/// A call the store refuses for its name or its place makes none of its
/// directories (as opening them and failing halfway did), with the error
/// making them would give.
#[test]
fn a_refused_place_makes_nothing() {
    let root = tempfile::tempdir().expect("tempdir");
    let root = root.path();
    fs::write(root.join("file"), "").expect("write");
    fs::create_dir(root.join("taken")).expect("mkdir");
    fs::write(root.join("taken/net"), "").expect("write");
    fs::create_dir(root.join("linked")).expect("mkdir");
    std::os::unix::fs::symlink(root, root.join("linked/net")).expect("symlink");
    fs::create_dir(root.join("open")).expect("mkdir");
    fs::set_permissions(root.join("open"), fs::Permissions::from_mode(0o777)).expect("chmod");
    let deep = root.join("d".repeat(250)).join("e".repeat(250));
    // Room for its own directories, not for sled's files in them.
    let mut long_dir = root.join("long");
    while long_dir.as_os_str().len() < 4070 - 251 {
        long_dir.push("x".repeat(250));
    }
    long_dir.push("y".repeat(4070 - long_dir.as_os_str().len() - 1));
    let name_256 = "n".repeat(256);
    let cases: [(&Path, &str, &str); 7] = [
        (&deep, &name_256, "File name too long (os error 36)"),
        (&long_dir, "net", "File name too long (os error 36)"),
        (&root.join("file/data"), "net", "Not a directory (os error 20)"),
        (&root.join("file"), "net", "Not a directory (os error 20)"),
        (&root.join("taken"), "net", "File exists (os error 17)"),
        (&root.join("linked"), "net", "is not a directory (a symlink?)"),
        (&root.join("open/data"), "net", "is writable by other users"),
    ];
    let before = tree(root);
    for (data_dir, network, msg) in cases {
        let err = pool::with_network(&Stores::direct(), data_dir, network, |n| n.leases())
            .expect_err(msg)
            .to_string();
        assert!(err.contains(msg), "{}: {err}", data_dir.display());
        assert_eq!(tree(root), before, "{}: {err}", data_dir.display());
    }
    let name_255 = "n".repeat(255);
    pool::with_network(&Stores::direct(), &deep, &name_255, |n| n.leases()).expect("255 bytes is a name");
}

#[test]
fn a_resident_store_serialises_threads_on_one_network() {
    let dir = tempfile::tempdir().expect("tempdir");
    let stores = Arc::new(Stores::resident(None));
    let sets = Arc::new(vec![set("10.0.0.0/24")]);
    let got: Vec<IpAddr> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..40)
            .map(|i| {
                let (stores, sets, data_dir) = (Arc::clone(&stores), Arc::clone(&sets), dir.path());
                s.spawn(move || {
                    pool::with_network(&stores, data_dir, "net", |n| {
                        pool::allocate(n, &sets, &[], &format!("c{i}"), "eth0", None)
                    })
                    .expect("allocate")[0]
                        .ip
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().expect("thread")).collect()
    });
    let distinct: std::collections::BTreeSet<_> = got.iter().collect();
    assert_eq!(distinct.len(), 40);
}

/// Damages sled's files, as a bad disk or a careless hand would: its
/// snapshot gone and its log truncated (sled reads that as nothing written
/// yet and opens an empty database, silently), or its log overwritten with
/// a pattern while the snapshot stays (sled notices).
fn damage(data_dir: &Path, network: &str, truncate: bool) {
    let db = data_dir.join(".sled").join(network).join("db");
    if truncate {
        for entry in fs::read_dir(data_dir.join(".sled").join(network))
            .expect("sled's directory")
            .flatten()
        {
            if entry.file_name().to_string_lossy().starts_with("snap.") {
                fs::remove_file(entry.path()).expect("rm snapshot");
            }
        }
        fs::File::options()
            .write(true)
            .open(&db)
            .and_then(|f| f.set_len(0))
            .expect("truncate");
    } else {
        let size = fs::metadata(&db).expect("sled's db file").len();
        let garbage: Vec<u8> = (0..size).map(|i| (i * 7919 % 251) as u8).collect();
        fs::write(&db, garbage).expect("overwrite");
    }
}

#[test]
fn a_damaged_database_is_refused_with_the_way_out_never_reset() {
    for truncate in [true, false] {
        let net = Net::new(&["10.9.0.0/29"]);
        assert_eq!(net.add("a", &[]).expect("add"), [ip("10.9.0.2")]);
        assert_eq!(net.add("b", &[]).expect("add"), [ip("10.9.0.3")]);
        damage(net.data_dir(), "net", truncate);
        let err = net.add("c", &[]).expect_err("refused").to_string();
        let db = net.data_dir().join(".sled/net");
        assert!(err.contains(&format!("{} is damaged", db.display())), "{err}");
        let aside = net.data_dir().join(".sled/.damaged");
        assert!(
            err.contains(&format!("mkdir -p {} && mv {} ", aside.display(), db.display())),
            "{err}"
        );
        // A truncated file passes sled's own checks: only the witness tells.
        let noticed_by = if truncate {
            "committed changes"
        } else {
            "corrupted"
        };
        assert!(err.contains(noticed_by), "{err}");
        // Refused again, not repaired by the first attempt.
        net.add("d", &[]).expect_err("still refused");
        // The way out the message gives.
        fs::create_dir_all(&aside).expect("mkdir");
        fs::rename(&db, aside.join("1")).expect("mv");
        fs::remove_file(witness_path(&net)).expect("rm");
        assert_eq!(net.add("e", &[]).expect("a fresh start"), [ip("10.9.0.2")]);
    }
}

/// A process killed while sled wrote its closing snapshot leaves a partial
/// `snap.<lsn>.generating`, which sled 0.34 would read as the newest
/// snapshot and refuse as corrupt; the store discards it and the leases are
/// all there.
#[test]
fn a_snapshot_left_half_written_by_a_killed_process_is_not_damage() {
    let net = Net::new(&["10.8.0.0/29"]);
    assert_eq!(net.add("a", &[]).expect("add"), [ip("10.8.0.2")]);
    assert_eq!(net.add("b", &[]).expect("add"), [ip("10.8.0.3")]);
    let sled_dir = net.data_dir().join(".sled/net");
    let complete = fs::read_dir(&sled_dir)
        .expect("sled's directory")
        .flatten()
        .map(|e| e.path())
        .find(|p| {
            p.file_name()
                .is_some_and(|n| n.to_string_lossy().starts_with("snap."))
        })
        .expect("sled wrote a snapshot on close");
    let bytes = fs::read(&complete).expect("read the snapshot");
    // Newer than the complete one, and cut short as a kill leaves it.
    fs::write(
        sled_dir.join("snap.FFFFFFFFFFFFFFF0.generating"),
        &bytes[..bytes.len() / 2],
    )
    .expect("write");
    assert_eq!(net.add("c", &[]).expect("opens"), [ip("10.8.0.4")]);
    assert_eq!(net.leases().len(), 3, "{:?}", net.leases());
    assert!(
        !sled_dir.join("snap.FFFFFFFFFFFFFFF0.generating").exists(),
        "the unfinished snapshot is gone"
    );
}

fn witness_path(net: &Net) -> std::path::PathBuf {
    net.data_dir().join(".sled/.generations/net")
}

fn witness(net: &Net) -> u64 {
    fs::read_to_string(witness_path(net))
        .expect("witness")
        .trim()
        .parse()
        .expect("a number")
}

#[test]
fn the_generation_witness_only_lags_never_leads() {
    let net = Net::new(&["10.9.0.0/29"]);
    net.add("a", &[]).expect("add");
    // A crash after sled's flush and before the witness leaves it behind:
    // that database is good and is used.
    fs::remove_file(witness_path(&net)).expect("rm");
    assert_eq!(net.add("b", &[]).expect("add"), [ip("10.9.0.3")]);
    let after_b = witness(&net);
    // Reads do not move it; a release does.
    assert_eq!(net.add("b", &[]).expect("same lease"), [ip("10.9.0.3")]);
    assert_eq!(witness(&net), after_b);
    assert_eq!(net.del("a"), 1);
    assert_eq!(witness(&net), after_b + 1);
    // Overwritten in place: a shorter or unreadable witness (an older
    // release's, a torn sector) lags and is replaced whole by the next
    // change, never read as a bigger number.
    let path = witness_path(&net);
    for stale in ["1\n", "\0\0\0", ""] {
        fs::write(&path, stale).expect("write");
        let before = fs::read_to_string(&path).expect("read");
        net.add("c", &[]).expect("a lagging witness is not damage");
        let now = fs::read_to_string(&path).expect("read");
        assert_ne!(now, before);
        assert_eq!(now.len(), 21, "{now:?}");
        net.del("c");
    }
    assert_eq!(witness(&net), after_b + 7);
}

/// In the lease service a release is answered once committed and made
/// durable after the answer; an ADD is durable before it is answered, and
/// its flush covers a release still owed. The witness shows which changes
/// are on disk. The process-wide count of owed releases (what a stopping
/// service waits on) follows; no other test of this binary owes any.
#[test]
fn a_resident_store_makes_releases_durable_after_the_answer_and_adds_before() {
    let mut net = Net::new(&["10.9.0.0/29"]);
    net.stores = Stores::resident(None);
    net.add("a", &[]).expect("add");
    let after_a = witness(&net);
    assert!(!net.stores.owes_durability(), "an ADD is on disk when it returns");
    assert_eq!(net.del("a"), 1);
    assert!(net.stores.owes_durability());
    assert_eq!(ipam::store::releases_owed(), 1);
    std::thread::scope(|s| {
        s.spawn(|| assert_eq!(ipam::store::releases_owed(), 1, "seen from another thread"));
    });
    assert_eq!(
        witness(&net),
        after_a,
        "the release is not flushed before the answer"
    );
    net.stores.make_releases_durable();
    assert!(!net.stores.owes_durability());
    assert_eq!(ipam::store::releases_owed(), 0);
    assert_eq!(witness(&net), after_a + 1);

    net.add("b", &[]).expect("add");
    assert_eq!(net.del("b"), 1);
    net.add("c", &[]).expect("add");
    assert_eq!(
        witness(&net),
        after_a + 4,
        "the ADD's flush covers the release before it"
    );
    net.stores.make_releases_durable();
    assert_eq!(witness(&net), after_a + 4);
    assert_eq!(ipam::store::releases_owed(), 0);

    assert_eq!(net.del("nobody"), 0);
    assert!(
        !net.stores.owes_durability(),
        "a DEL that changes nothing owes nothing"
    );
    // A plugin process flushes before it answers, releases too.
    let mut direct = Net::new(&["10.9.0.0/29"]);
    direct.stores = Stores::direct();
    direct.add("a", &[]).expect("add");
    let before = witness(&direct);
    assert_eq!(direct.del("a"), 1);
    assert!(!direct.stores.owes_durability());
    assert_eq!(witness(&direct), before + 1);
}

fn add_on(stores: &Stores, data_dir: &Path, network: &str, id: &str) -> Result<IpAddr, ipam::Error> {
    pool::with_network(stores, data_dir, network, |n| {
        pool::allocate(n, &[set("10.7.0.0/29")], &[], id, "eth0", None)
    })
    .map(|a| a[0].ip)
}

/// The witness of `N` once lived at `.sled/N.generation`: the database of
/// the network `N.generation`, and past a file name's 255 bytes for names
/// of 245 characters and more. Both networks now keep their own damage
/// detection, and so does a long name.
#[test]
fn no_file_of_the_store_shares_a_name_with_a_network() {
    let dir = tempfile::tempdir().expect("tempdir");
    let stores = Stores::direct();
    let long = "n".repeat(250);
    for network in ["net", "net.generation", long.as_str()] {
        assert_eq!(
            add_on(&stores, dir.path(), network, "a").expect("add"),
            ip("10.7.0.2")
        );
        assert_eq!(
            add_on(&stores, dir.path(), network, "b").expect("add"),
            ip("10.7.0.3")
        );
    }
    for network in ["net", "net.generation", long.as_str()] {
        damage(dir.path(), network, true);
        let err = add_on(&stores, dir.path(), network, "c").expect_err("damage noticed");
        assert!(err.to_string().contains("is damaged"), "{network}: {err}");
    }
}

/// A store written by a version that kept the witness at
/// `.sled/<network>.generation` keeps its damage detection: the old witness
/// is moved to its new place on first use.
#[test]
fn an_old_witness_is_adopted_and_still_detects_damage() {
    let net = Net::new(&["10.9.0.0/29"]);
    net.add("a", &[]).expect("add");
    net.add("b", &[]).expect("add");
    let witnessed = witness(&net);
    let old = net.data_dir().join(".sled/net.generation");
    fs::rename(witness_path(&net), &old).expect("as the old version left it");
    damage(net.data_dir(), "net", true);
    let err = net.add("c", &[]).expect_err("damage noticed");
    assert!(err.to_string().contains("is damaged"), "{err}");
    assert!(!old.exists(), "the old witness is moved");
    assert_eq!(witness(&net), witnessed);
}

/// Damage detection is not silently off: a witness that cannot be written
/// fails the call.
#[test]
fn a_witness_that_cannot_be_recorded_fails_the_call() {
    let net = Net::new(&["10.9.0.0/29"]);
    net.add("a", &[]).expect("add");
    fs::remove_file(witness_path(&net)).expect("rm");
    fs::create_dir(witness_path(&net)).expect("a directory in its way");
    let err = net.add("b", &[]).expect_err("witness not recorded");
    assert!(err.is_storage_failure(), "{err}");
}

/// Symlinks in place of the lock file, the witness or a database directory
/// are refused: nothing of the store is opened through one.
#[test]
fn no_file_of_the_store_is_opened_through_a_symlink() {
    let elsewhere = tempfile::tempdir().expect("tempdir");
    let target = elsewhere.path().join("target");
    fs::write(&target, "").expect("write");
    for (what, relative) in [
        ("lock", "net/lock"),
        ("witness", ".sled/.generations/net"),
        ("database", ".sled/net"),
    ] {
        let net = Net::new(&["10.9.0.0/29"]);
        net.add("a", &[]).expect("add");
        let path = net.data_dir().join(relative);
        if path.is_dir() {
            fs::rename(&path, elsewhere.path().join(what)).expect("move aside");
            std::os::unix::fs::symlink(elsewhere.path().join(what), &path).expect("symlink");
        } else {
            fs::remove_file(&path).expect("rm");
            std::os::unix::fs::symlink(&target, &path).expect("symlink");
        }
        let err = net.add("b", &[]).expect_err(what);
        assert!(err.is_storage_failure(), "{what}: {err}");
        assert_eq!(fs::read(&target).expect("read"), b"", "{what}: written through");
    }
}

/// A repeated ADD of an attachment from the namespace it was handed its
/// address in gets that address again; from another namespace it is
/// refused as the reference refuses any duplicate allocation, and a lease
/// recorded without a namespace (before it was kept) is answered as it
/// always was.
#[test]
fn a_lease_is_answered_again_only_in_its_own_namespace() {
    let net = Net::new(&["10.9.0.0/29"]);
    let first = net.add_in("a", &[], Some("/run/netns/pod-a")).expect("add");
    assert_eq!(
        net.add_in("a", &[], Some("/run/netns/pod-a")).expect("again"),
        first
    );
    let err = net
        .add_in("a", &[], Some("/run/netns/pod-b"))
        .expect_err("another namespace")
        .to_string();
    assert_eq!(
        err,
        "failed to allocate for range 0: 10.9.0.2 has been allocated to a, duplicate allocation is not allowed"
    );
    // Recorded without one: answered from anywhere.
    let old = net.add("b", &[]).expect("add");
    assert_eq!(
        net.add_in("b", &[], Some("/run/netns/pod-x")).expect("again"),
        old
    );
    // A DEL naming another namespace releases a lease whose own namespace
    // is gone (neither exists here).
    assert_eq!(net.del_in("a", Some("/run/netns/pod-b")), 1);
    assert_eq!(net.leases().len(), 1);
}

/// A database a lease service keeps open holds sled's lock: another
/// opener is answered busy (code 11, asked again), as the kernel's flock
/// says, and served once the service lets it go.
#[test]
fn a_database_held_open_elsewhere_is_busy() {
    use std::time::{Duration, Instant};
    let mut net = Net::new(&["10.9.0.0/24"]);
    net.stores = Stores::resident(None);
    net.add("c1", &[]).expect("the resident store opens it");
    let direct = Stores::direct();
    let held = pool::with_network(&direct, net.data_dir(), "net", |n| n.leases());
    assert!(matches!(held, Err(ipam::Error::Busy(_))), "{held:?}");
    net.stores = Stores::direct();
    // sled's lock goes with the last of its threads' handles, a moment
    // after the store drops the database (on a loaded machine, after the
    // next open): until then the answer is busy, as a client asking again
    // sees it.
    let letting_go = Instant::now();
    let leases = loop {
        match pool::with_network(&direct, net.data_dir(), "net", |n| n.leases()) {
            Err(ipam::Error::Busy(_)) if letting_go.elapsed() < Duration::from_secs(10) => {
                std::thread::sleep(Duration::from_millis(5))
            }
            other => break other.expect("let go"),
        }
    };
    assert_eq!(leases.len(), 1);
}
