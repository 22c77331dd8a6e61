//! `cni::log` with the agent's socket as a plugin's process has it: the
//! logger is the process's one, so this test is alone in its binary.

use std::os::unix::net::UnixDatagram;

use agent_wire::log::{MAX_DATAGRAM, Record};
use cni::env::Invocation;
use log::{Level, LevelFilter};

fn invocation(verb: &str) -> Invocation {
    Invocation {
        verb: verb.into(),
        container_id: "c1".into(),
        pod_namespace: "default".into(),
        pod_name: "web-1".into(),
    }
}

#[test]
fn the_socket_takes_info_and_what_it_does_not_take_goes_to_the_file() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (socket, file) = (dir.path().join("log.sock"), dir.path().join("plugin.log"));
    let listener = UnixDatagram::bind(&socket).expect("bind");
    listener.set_nonblocking(true).expect("nonblocking");
    // A process's logging state as a plugin's is after `begin`, writing
    // its lines into a file.
    cni::log::init("bridge");
    cni::log::configure(Some(&file), None).expect("configured");
    cni::log::begin(invocation("ADD"), Some((&socket, agent_wire::log::open)));
    assert_eq!(log::max_level(), LevelFilter::Info);
    assert!(cni::log::outcome(Level::Info, "ok, 10.0.0.2/24"));
    log::warn!("odd");
    log::debug!("chatter");
    let mut buf = vec![0; MAX_DATAGRAM];
    let mut received = Vec::new();
    while let Ok(n) = listener.recv(&mut buf) {
        let record = Record::decode(&buf[..n]).expect("a record");
        received.push(format!(
            "{} {} {}/{}",
            record.level, record.msg, record.pod_namespace, record.pod_name
        ));
    }
    assert_eq!(
        received,
        ["info ok, 10.0.0.2/24 default/web-1", "warn odd default/web-1"]
    );
    let lines = std::fs::read_to_string(&file).expect("read");
    assert!(
        !lines.contains("ADD ok") && lines.contains("WARN  bridge["),
        "{lines}"
    );

    // The listener gone: the file gets the record the socket was for.
    drop(listener);
    cni::log::begin(invocation("DEL"), Some((&socket, agent_wire::log::open)));
    assert!(cni::log::outcome(Level::Info, "ok"));
    let lines = std::fs::read_to_string(&file).expect("read");
    assert!(
        lines.contains("INFO  bridge[") && lines.contains("]: DEL ok"),
        "{lines}"
    );
    assert!(!lines.contains("chatter"), "{lines}");
}
