//! The plugin skeleton: read the environment and stdin once, turn every
//! input problem into the right CNI error, dispatch one verb, print exactly
//! one JSON document on stdout.

use std::io::{self, Read, Write};
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use serde_json::Value;

use crate::conf::{NetConf, config_version, parse_document};
use crate::env::{Command, EnvSource, Environment, Invocation, ProcessEnv};
use crate::error::{Code, Error, Result};
use crate::keys::{self, Shape};
use crate::log::OpenSink;
use crate::result::CniResult;
use crate::version::Version;

/// The suite's release, printed in every plugin's about text.
pub const SUITE_VERSION: &str = env!("CARGO_PKG_VERSION");

/// One plugin's verbs. The skeleton has already checked the environment,
/// the version and the shared configuration keys when these are called.
pub trait Plugin {
    /// The binary's name, for the about text and logs.
    const NAME: &'static str;
    /// The structs the reference plugin decodes its configuration into:
    /// keys are matched to them as Go matches them (see [`keys`]) before
    /// anything reads the document. A plugin reads its own keys from
    /// [`Request::conf`].
    const KEYS: Shape;
    /// How the plugin opens the node agent's `logSocket` when its
    /// configuration names one (`agent_wire::log::open`); the skeleton
    /// reaches the socket only through it. None sends nothing there, as
    /// an IPAM plugin does: run by the plugin whose `ipam` names it and
    /// not by a runtime, it sends nothing to the agent's `logSocket`,
    /// whose records are one per plugin of the list. The plugin that ran
    /// it logs the outcome, with its addresses or its error, and the ADD
    /// costs one send less (each costs about 30 µs: a socket and a send).
    /// Its own `info` records (host-local's GC count) go nowhere, as
    /// without the key.
    const LOG_SOCKET: Option<OpenSink> = None;

    fn add(&self, req: &Request, attachment: &Attachment) -> Result<CniResult>;
    fn check(&self, req: &Request, attachment: &Attachment) -> Result<()>;
    fn del(&self, req: &Request, attachment: &Attachment) -> Result<()>;

    fn gc(&self, _req: &Request) -> Result<()> {
        Ok(())
    }

    fn status(&self, _req: &Request) -> Result<()> {
        Ok(())
    }
}

/// Everything one invocation received.
#[derive(Debug)]
pub struct Request {
    pub env: Environment,
    /// The configuration, its keys matched to the plugin's [`Plugin::KEYS`].
    pub conf: NetConf,
    /// stdin as received, for delegation to an IPAM plugin.
    pub stdin: Vec<u8>,
}

/// The (container, interface) an ADD, CHECK or DEL is about. The netns is
/// optional only for DEL, where runtimes may send it empty.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Attachment {
    pub container_id: String,
    pub ifname: String,
    pub netns: Option<PathBuf>,
}

/// What an invocation prints.
#[derive(Debug, Clone, PartialEq)]
pub enum Reply {
    /// No CNI_COMMAND: the about text, on stderr.
    About(String),
    /// A result or VERSION document.
    Document(Value),
    /// A verb that prints nothing on success.
    Done,
    Failed(Error, Version),
}

/// The plugin's `main`: runs one invocation against the process environment
/// and stdio. Returning (rather than exiting) lets destructors run, which
/// storage that flushes on drop relies on.
pub fn run<P: Plugin>(plugin: &P) -> ExitCode {
    crate::log::init(P::NAME);
    let reply = dispatch(plugin, &ProcessEnv, || {
        let mut buf = Vec::new();
        io::stdin().read_to_end(&mut buf).map(|_| buf)
    });
    let code = emit(&reply);
    log::logger().flush();
    code
}

/// Prints a reply the way a plugin must and gives the exit status; the
/// verb's outcome is logged first (see [`crate::log::outcome`]), so a
/// runtime that stops reading once the reply is printed cannot lose it.
pub fn emit(reply: &Reply) -> ExitCode {
    match reply {
        Reply::About(text) => {
            let _ = io::stderr().write_all(text.as_bytes());
            ExitCode::SUCCESS
        }
        Reply::Document(doc) => {
            crate::log::outcome(log::Level::Info, &succeeded(doc));
            print_document(doc);
            ExitCode::SUCCESS
        }
        Reply::Done => {
            crate::log::outcome(log::Level::Info, "ok");
            ExitCode::SUCCESS
        }
        Reply::Failed(err, version) => {
            if !crate::log::outcome(log::Level::Error, &format!("failed: {err}")) {
                log::error!("{err}");
            }
            print_document(&err.to_json(*version));
            ExitCode::FAILURE
        }
    }
}

/// `ok`, with the addresses of a result (an ADD's): `ok, 10.244.1.5/24,
/// fd00:10:244:1::5/64`. Results of every version: `ips` from 0.3.0 on,
/// `ip4` and `ip6` before.
fn succeeded(doc: &Value) -> String {
    let listed = doc["ips"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|ip| &ip["address"]);
    let legacy = [&doc["ip4"]["ip"], &doc["ip6"]["ip"]].into_iter();
    let addresses: Vec<&str> = listed.chain(legacy).filter_map(Value::as_str).collect();
    std::iter::once("ok")
        .chain(addresses)
        .collect::<Vec<_>>()
        .join(", ")
}

/// Writes one JSON document to stdout, indented as Go's `PrintResult` does.
pub fn print_document(doc: &Value) {
    let mut out = io::stdout().lock();
    // Nothing useful can be done if the runtime closed our stdout.
    let _ = out
        .write_all(to_pretty_json(doc).as_bytes())
        .and_then(|()| out.write_all(b"\n"))
        .and_then(|()| out.flush());
}

/// Go's `json.MarshalIndent(v, "", "    ")` layout.
pub fn to_pretty_json(doc: &Value) -> String {
    let mut buf = Vec::new();
    let formatter = serde_json::ser::PrettyFormatter::with_indent(b"    ");
    let mut ser = serde_json::Serializer::with_formatter(&mut buf, formatter);
    serde::Serialize::serialize(doc, &mut ser).ok();
    String::from_utf8(buf).unwrap_or_default()
}

pub fn about_text(name: &str) -> String {
    format!(
        "CNI {name} plugin v{SUITE_VERSION}\nCNI protocol versions supported: {}\n",
        Version::all_joined()
    )
}

/// The VERSION document: echoes the version the caller spoke if it is one
/// we support, else the newest.
fn version_document(stdin: &[u8]) -> Value {
    let spoken = serde_json::from_slice::<Value>(stdin)
        .ok()
        .and_then(|doc| doc.get("cniVersion")?.as_str()?.parse::<Version>().ok())
        .unwrap_or(Version::LATEST);
    serde_json::json!({
        "cniVersion": spoken.as_str(),
        "supportedVersions": Version::ALL.map(Version::as_str),
    })
}

/// Runs one invocation: every input error becomes one CNI error with the
/// code the spec gives it, and the verb's outcome becomes one reply.
pub fn dispatch<P: Plugin>(
    plugin: &P,
    source: &impl EnvSource,
    read_stdin: impl FnOnce() -> io::Result<Vec<u8>>,
) -> Reply {
    let env = match Environment::load(source) {
        Ok(Some(env)) => env,
        Ok(None) => return Reply::About(about_text(P::NAME)),
        // Like every other error, it speaks the configuration's version
        // whenever there is one to read.
        Err(e) => {
            let version = read_stdin()
                .ok()
                .and_then(|stdin| parse_as::<P>(&stdin).and_then(|doc| config_version(&doc)).ok())
                .unwrap_or(Version::LATEST);
            return Reply::Failed(e, version);
        }
    };
    let stdin = match read_stdin() {
        Ok(bytes) => bytes,
        Err(e) => {
            return Reply::Failed(
                Error::io(format!("error reading from stdin: {e}")),
                Version::LATEST,
            );
        }
    };
    if env.command == Command::Version {
        return Reply::Document(version_document(&stdin));
    }
    let doc = match parse_as::<P>(&stdin) {
        Ok(doc) => doc,
        Err(e) => return Reply::Failed(e, Version::LATEST),
    };
    // As soon as the socket can be known, so the outcome of a call refused
    // for its version or its shared keys reaches the agent too; a wrong
    // `logSocket` is refused with the other shared keys, below.
    let socket = P::LOG_SOCKET.and_then(|open| Some((crate::conf::log_socket(&doc).ok().flatten()?, open)));
    crate::log::begin(
        Invocation::of(&env),
        socket.as_ref().map(|(path, open)| (path.as_path(), *open)),
    );
    let version = match config_version(&doc) {
        Ok(version) => version,
        Err(e) => return Reply::Failed(e, Version::LATEST),
    };
    match invoke(plugin, env, doc, version, stdin) {
        Ok(Some(doc)) => Reply::Document(doc),
        Ok(None) => Reply::Done,
        Err(e) => Reply::Failed(e, version),
    }
}

/// stdin as a JSON object whose keys are matched to the plugin's.
pub fn parse_as<P: Plugin>(stdin: &[u8]) -> Result<Value> {
    let mut doc = parse_document(stdin)?;
    keys::fold(&mut doc, &P::KEYS);
    Ok(doc)
}

/// `doc` as the skeleton hands a plugin whose keys are `keys` its
/// configuration (keys folded, version read, parsed), with what `read`
/// reads of it, as one debug text: what a plugin's null-key test compares
/// ([`keys::assert_null_reads_as_absent`]).
pub fn read_configuration<T: std::fmt::Debug>(
    doc: &Value,
    keys: &Shape,
    read: impl FnOnce(&NetConf) -> T,
) -> String {
    let mut doc = doc.clone();
    keys::fold(&mut doc, keys);
    let conf = NetConf::read(doc);
    format!("{:?}", conf.map(|conf| (read(&conf), conf)))
}

fn invoke<P: Plugin>(
    plugin: &P,
    env: Environment,
    doc: Value,
    version: Version,
    stdin: Vec<u8>,
) -> Result<Option<Value>> {
    let command = env.command;
    let allowed = match command {
        Command::Check => version.has_check(),
        Command::Gc | Command::Status => version.has_gc_and_status(),
        _ => true,
    };
    if !allowed {
        return Err(Error::incompatible_version(format!(
            "config version does not allow {}",
            command.as_str()
        )));
    }
    let conf = NetConf::from_document(doc, version)?;
    crate::log::configure(conf.log_file.as_deref(), conf.log_level.as_deref())?;
    let attachment = command
        .acts_on_attachment()
        .then(|| attachment_of(&env))
        .transpose()?;
    let req = Request { env, conf, stdin };
    log::debug!(
        "{} container={} ifname={} netns={}",
        command.as_str(),
        req.env.container_id.as_deref().unwrap_or("-"),
        req.env.ifname.as_deref().unwrap_or("-"),
        req.env
            .netns
            .as_deref()
            .map(Path::display)
            .map(|d| d.to_string())
            .unwrap_or_else(|| "-".into()),
    );
    match (command, attachment) {
        (Command::Add, Some(att)) => plugin.add(&req, &att)?.to_value(version).map(Some),
        (Command::Check, Some(att)) => plugin.check(&req, &att).map(|()| None),
        (Command::Del, Some(att)) => plugin.del(&req, &att).map(|()| None),
        (Command::Gc, _) => plugin.gc(&req).map(|()| None),
        (Command::Status, _) => plugin.status(&req).map(|()| None),
        _ => Err(Error::internal(format!("no handler for {}", command.as_str()))),
    }
}

fn attachment_of(env: &Environment) -> Result<Attachment> {
    let (Some(container_id), Some(ifname)) = (env.container_id.clone(), env.ifname.clone()) else {
        return Err(Error::invalid_env("CNI_CONTAINERID and CNI_IFNAME are required"));
    };
    if let Some(netns) = &env.netns
        && !env.netns_override
        && is_own_netns(netns)
    {
        return Err(Error::new(
            Code::InvalidNetns,
            "plugin's netns and netns from CNI_NETNS should not be the same",
        )
        .with_details(netns.display().to_string()));
    }
    Ok(Attachment {
        container_id,
        ifname,
        netns: env.netns.clone(),
    })
}

/// Whether `path` is the namespace this thread runs in, so that a stale
/// `/proc/<pid>/ns/net` resolving to the host never gets the host's
/// interfaces changed (plugins#714). Checked before acting, unlike Go.
fn is_own_netns(path: &Path) -> bool {
    let (Ok(target), Ok(own)) = (
        std::fs::metadata(path),
        std::fs::metadata("/proc/thread-self/ns/net"),
    ) else {
        return false;
    };
    target.dev() == own.dev() && target.ino() == own.ino()
}

#[cfg(test)]
mod tests;
