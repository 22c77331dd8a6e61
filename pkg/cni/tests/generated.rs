//! Property tests over generated inputs for the three parsers every plugin
//! runs on untrusted input: CNI_ARGS, the configuration on stdin, and
//! results (prevResult, delegates' output) in every version. cargo-fuzz
//! needs a nightly toolchain, which this project does not use; proptest
//! gives the same kind of coverage in `make test` and shrinks a failure to
//! the smallest input that still fails.

use std::cell::Cell;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use cni::args::CniArgs;
use cni::conf::{self, NetConf};
use cni::result::{CniResult, Dns, Interface, IpConfig, Route};
use cni::version::Version;
use ipnetwork::IpNetwork;
use proptest::collection::vec;
use proptest::option;
use proptest::prelude::*;
use proptest::sample::{Index, select};
use proptest::test_runner::{RngAlgorithm, RngSeed, TestRunner};
use serde_json::{Value, json};

/// Inputs per property for the parsers of text and JSON.
const CASES: u32 = 20_000;
/// Results are bigger and each is printed and read in every version.
const RESULT_CASES: u32 = CASES / 4;

/// A fixed seed makes every run (CI's, a developer's) try the same inputs,
/// so a failure seen once is seen again; `PROPTEST_RNG_SEED` tries others.
fn config(cases: u32) -> ProptestConfig {
    let defaults = ProptestConfig::default();
    let rng_seed = match defaults.rng_seed {
        RngSeed::Random => RngSeed::Fixed(0x5eed_0001),
        chosen => chosen,
    };
    ProptestConfig {
        cases,
        rng_seed,
        // ChaCha, the default, took most of the time in an unoptimised
        // test build; these inputs need no cryptographic randomness.
        rng_algorithm: RngAlgorithm::XorShift,
        // The seed reproduces a failure and the report names its smallest
        // input; nothing needs to be written into the source tree.
        failure_persistence: None,
        ..defaults
    }
}

fn text(alphabet: &'static [char], max_len: usize) -> impl Strategy<Value = String> {
    vec(select(alphabet), 0..=max_len).prop_map(String::from_iter)
}

/// Characters the CNI_ARGS grammar gives a meaning to, a key it knows,
/// boolean words, and some that only need to pass through unharmed.
const ARGS_ALPHABET: &[char] = &[
    'a', 'b', '=', ';', 'I', 'g', 'n', 'o', 'r', 'e', 'U', 'n', 'k', 'n', 'o', 'w', 'n', '=', '1', 't', 'r',
    'u', 'e', '\u{e9}', ' ', '\t', '\0', '/', '.', ':',
];

proptest! {
    #![proptest_config(config(CASES))]

    #[test]
    fn cni_args_parse_without_panic_and_round_trip(raw in text(ARGS_ALPHABET, 40)) {
        match CniArgs::parse(&raw) {
            Ok(args) => {
                // What was understood prints back to the same pairs.
                let printed: Vec<String> = args.pairs().iter().map(|(k, v)| format!("{k}={v}")).collect();
                let again = CniArgs::parse(&printed.join(";"));
                prop_assert_eq!(again.as_ref().ok(), Some(&args), "{:?} printed as {:?}", raw, printed);
                prop_assert!(
                    args.pairs().iter().all(|(k, _)| !k.is_empty() && !k.contains(';')),
                    "{:?}: {:?}", raw, args
                );
            }
            Err(e) => prop_assert_eq!(e.code, 4, "{:?}: {:?}", raw, e),
        }
    }
}

/// `IgnoreUnknown` values and what Go's `UnmarshallableBool` makes of them.
const IGNORE_UNKNOWN_VALUES: &[(&str, Option<bool>)] = &[
    ("1", Some(true)),
    ("true", Some(true)),
    ("TRUE", Some(true)),
    ("True", Some(true)),
    ("0", Some(false)),
    ("false", Some(false)),
    ("fAlSe", Some(false)),
    ("", None),
    ("yes", None),
    ("2", None),
    (" true", None),
    ("true=1", None),
];

const ARGS_KEYS: &[&str] = &[
    "IP",
    "MAC",
    "K8S_POD_NAME",
    "ip",
    "ignoreunknown",
    "\u{e9}",
    "a b",
];
const ARGS_VALUE_ALPHABET: &[char] = &['a', '1', '=', '.', ':', ' ', '\u{e9}', '\t'];

/// One `key=value` pair as written, and for `IgnoreUnknown` the flag it
/// sets (None: not a boolean).
#[derive(Debug, Clone)]
struct WrittenPair {
    key: String,
    value: String,
    ignore_unknown: Option<Option<bool>>,
}

fn written_pair() -> impl Strategy<Value = WrittenPair> {
    prop_oneof![
        1 => select(IGNORE_UNKNOWN_VALUES).prop_map(|(value, meaning)| WrittenPair {
            key: "IgnoreUnknown".into(),
            value: value.into(),
            ignore_unknown: Some(meaning),
        }),
        3 => (select(ARGS_KEYS), text(ARGS_VALUE_ALPHABET, 8)).prop_map(|(key, value)| WrittenPair {
            key: key.into(),
            value,
            ignore_unknown: None,
        }),
    ]
}

proptest! {
    #![proptest_config(config(CASES))]

    /// Well-formed pairs, with empty segments between them, read back as
    /// written; `IgnoreUnknown` is set by its last pair and refused when
    /// that or an earlier one is not a Go boolean.
    #[test]
    fn cni_args_read_the_pairs_written(
        written in vec((written_pair(), 0..3usize), 0..6)
    ) {
        let raw: String = written
            .iter()
            .map(|(pair, empty_after)| format!("{}={}{}", pair.key, pair.value, ";".repeat(1 + empty_after)))
            .collect();
        let flags: Vec<Option<bool>> = written.iter().filter_map(|(pair, _)| pair.ignore_unknown).collect();
        match CniArgs::parse(&raw) {
            Ok(args) => {
                prop_assert!(flags.iter().all(Option::is_some), "{:?} was accepted", raw);
                let expected: Vec<(String, String)> =
                    written.iter().map(|(pair, _)| (pair.key.clone(), pair.value.clone())).collect();
                prop_assert_eq!(args.pairs(), expected.as_slice(), "{:?}", raw);
                let last_flag = flags.last().copied().flatten().unwrap_or(false);
                prop_assert_eq!(args.ignore_unknown(), last_flag, "{:?}", raw);
                for (pair, _) in &written {
                    let last = written.iter().rev().find(|(other, _)| other.key == pair.key);
                    prop_assert_eq!(args.get(&pair.key), last.map(|(other, _)| other.value.as_str()));
                }
            }
            Err(e) => {
                prop_assert!(flags.contains(&None), "{:?}: {:?}", raw, e);
                prop_assert_eq!(e.code, 4, "{:?}: {:?}", raw, e);
            }
        }
    }
}

const JSON_KEYS: &[&str] = &[
    "cniVersion",
    "name",
    "type",
    "ipam",
    "prevResult",
    "ips",
    "address",
    "dns",
    "args",
    "runtimeConfig",
    "capabilities",
    "cni",
    "routes",
    "dst",
];

fn scalars() -> Vec<Value> {
    vec![
        json!(null),
        json!(true),
        json!(0),
        json!(-1),
        json!(4_294_967_296_u64),
        json!(1.5),
        json!(""),
        json!("1.0.0"),
        json!("0.4.0"),
        json!("10.0.0.0/24"),
        json!("fd00::1/64"),
        json!("../etc"),
        json!("x".repeat(300)),
    ]
}

/// JSON at most `depth` levels deep, built from values and keys that the
/// parsers look for, so it wanders through their branches.
fn json_value(depth: u32) -> BoxedStrategy<Value> {
    let scalar = select(scalars()).boxed();
    if depth == 0 {
        return scalar;
    }
    let inner = json_value(depth - 1);
    prop_oneof![
        1 => scalar,
        1 => vec(inner.clone(), 0..4).prop_map(Value::Array),
        2 => vec((select(JSON_KEYS), inner), 0..5).prop_map(|members| {
            Value::Object(members.into_iter().map(|(key, value)| (key.to_owned(), value)).collect())
        }),
    ]
    .boxed()
}

const CONF_POINTERS: &[&str] = &[
    "/cniVersion",
    "/name",
    "/type",
    "/ipam",
    "/ipam/type",
    "/args",
    "/args/cni",
    "/runtimeConfig",
    "/runtimeConfig/ips",
    "/prevResult",
    "/prevResult/ips",
    "/prevResult/cniVersion",
];

/// A configuration a plugin would accept, then one to three members
/// replaced by generated JSON.
fn mutated_conf() -> impl Strategy<Value = Value> {
    vec((select(CONF_POINTERS), json_value(3)), 1..=3).prop_map(|replacements| {
        let mut doc = json!({"cniVersion": "1.0.0", "name": "gen", "type": "bridge",
            "ipam": {"type": "host-local", "ranges": [[{"subnet": "10.1.0.0/24"}]]},
            "args": {"cni": {"ips": ["10.1.0.5"]}},
            "runtimeConfig": {"portMappings": [], "ips": ["10.1.0.6/24"]},
            "prevResult": {"cniVersion": "1.0.0", "ips": [{"address": "10.1.0.5/24"}]}});
        for (pointer, replacement) in replacements {
            if let Some(slot) = doc.pointer_mut(pointer) {
                *slot = replacement;
            }
        }
        doc
    })
}

#[test]
fn configurations_parse_without_panic_to_a_value_or_a_config_error() {
    let mut runner = TestRunner::new(config(CASES));
    let accepted = Cell::new(0_u32);
    let outcome = runner.run(&mutated_conf(), |doc| {
        let text = doc.to_string();
        let parsed = conf::parse_document(text.as_bytes())
            .and_then(NetConf::read)
            .and_then(|conf| {
                // What plugins read next must fail cleanly too.
                conf.prev_result()?;
                conf.gc_valid_attachments()?;
                Ok(conf)
            });
        match parsed {
            Ok(_) => accepted.set(accepted.get() + 1),
            Err(e) => prop_assert!(matches!(e.code, 1 | 6 | 7), "{}: {:?}", text, e),
        }
        Ok(())
    });
    if let Err(failure) = outcome {
        panic!("{failure}");
    }
    // The generator must also produce valid documents, or it tests little.
    assert!(accepted.get() > CASES / 20, "only {} accepted", accepted.get());
}

fn network(v4: bool) -> BoxedStrategy<IpNetwork> {
    let network = |ip: IpAddr, prefix: u8| IpNetwork::new(ip, prefix).expect("prefix in range");
    if v4 {
        (any::<u32>(), 0..=32_u8)
            .prop_map(move |(bits, prefix)| network(Ipv4Addr::from(bits).into(), prefix))
            .boxed()
    } else {
        (any::<u128>(), 0..=128_u8)
            .prop_map(move |(bits, prefix)| network(Ipv6Addr::from(bits).into(), prefix))
            .boxed()
    }
}

fn gateway(v4: bool) -> impl Strategy<Value = Option<IpAddr>> {
    option::of(network(v4).prop_map(|net| net.ip()))
}

/// An address, a gateway of its family, and which interface it is on, as
/// a position to resolve once the interfaces are known.
fn ip_config(v4: bool) -> impl Strategy<Value = (IpNetwork, Option<IpAddr>, Option<Index>)> {
    (network(v4), gateway(v4), option::weighted(0.7, any::<Index>()))
}

/// Zero is a route's "unset" for these fields; both must survive.
fn route_number() -> impl Strategy<Value = u32> {
    prop_oneof![Just(0), Just(1400), any::<u32>()]
}

fn route(v4: bool) -> impl Strategy<Value = Route> {
    let newer_fields = (
        route_number(),
        route_number(),
        route_number(),
        option::of(any::<u32>()),
        option::of(any::<u8>()),
    );
    (network(v4), gateway(v4), option::weighted(0.3, newer_fields)).prop_map(|(dst, gw, newer)| {
        let mut route = Route::new(dst, gw);
        if let Some((mtu, advmss, priority, table, scope)) = newer {
            route.mtu = mtu;
            route.advmss = advmss;
            route.priority = priority;
            route.table = table;
            route.scope = scope;
        }
        route
    })
}

fn either_family<T: std::fmt::Debug>(of: impl Fn(bool) -> BoxedStrategy<T>) -> impl Strategy<Value = T> {
    prop_oneof![of(true), of(false)]
}

fn interface_text(choices: &'static [&'static str]) -> impl Strategy<Value = String> {
    select(choices).prop_map(str::to_owned)
}

/// An interface but for its name, which its position gives.
fn unnamed_interface() -> impl Strategy<Value = Interface> {
    (
        interface_text(&["", "02:00:00:00:00:01"]),
        prop_oneof![Just(0), any::<u32>()],
        interface_text(&["", "/run/netns/x"]),
        interface_text(&["", "/run/vhost-user.sock"]),
        interface_text(&["", "0000:00:1f.6"]),
    )
        .prop_map(|(mac, mtu, sandbox, socket_path, pci_id)| Interface {
            name: String::new(),
            mac,
            mtu,
            sandbox,
            socket_path,
            pci_id,
        })
}

fn dns() -> impl Strategy<Value = Dns> {
    let words = |choices: &'static [&'static str]| vec(interface_text(choices), 0..3);
    (
        words(&["10.0.0.10", "fd00::10"]),
        interface_text(&["", "cluster.local"]),
        words(&["svc.cluster.local", "example.org"]),
        words(&["ndots:5", "edns0"]),
    )
        .prop_map(|(nameservers, domain, search, options)| Dns {
            nameservers,
            domain,
            search,
            options,
        })
}

fn result() -> impl Strategy<Value = CniResult> {
    let interfaces = vec(unnamed_interface(), 0..3).prop_map(|mut interfaces| {
        for (position, interface) in interfaces.iter_mut().enumerate() {
            interface.name = format!("eth{position}");
        }
        interfaces
    });
    let ips = vec(either_family(|v4| ip_config(v4).boxed()), 0..4);
    let routes = vec(either_family(|v4| route(v4).boxed()), 0..3);
    let dns = prop_oneof![Just(Dns::default()), dns()];
    (interfaces, ips, routes, dns).prop_map(|(interfaces, ips, routes, dns)| {
        let ips = ips
            .into_iter()
            .map(|(address, gateway, on)| IpConfig {
                address,
                gateway,
                interface: on
                    .filter(|_| !interfaces.is_empty())
                    .map(|at| at.index(interfaces.len())),
            })
            .collect();
        CniResult {
            interfaces,
            ips,
            routes,
            dns,
        }
    })
}

proptest! {
    #![proptest_config(config(RESULT_CASES))]

    #[test]
    fn results_convert_between_versions_to_fixed_points(original in result()) {
        for version in Version::ALL {
            let Ok(printed) = original.to_value(version) else {
                // Only a result 0.1/0.2 cannot carry may fail to print.
                prop_assert!(original.ips.is_empty(), "{:?}: {:?}", version, original);
                continue;
            };
            prop_assert_eq!(printed["cniVersion"].as_str(), Some(version.as_str()));
            let read = CniResult::from_value(&printed);
            prop_assert!(read.is_ok(), "{:?} does not read back: {:?}", printed, read);
            let read = read.expect("checked");
            let again = read.to_value(version);
            prop_assert_eq!(again.as_ref().ok(), Some(&printed), "{:?} is not a fixed point", version);
            if version >= Version::V1_0_0 {
                // 1.x carries everything.
                prop_assert_eq!(&read, &original, "{:?}", version);
            }
        }
    }
}

proptest! {
    #![proptest_config(config(CASES))]

    #[test]
    fn results_from_generated_json_read_without_panic(doc in json_value(4)) {
        if let Err(e) = CniResult::from_value(&doc) {
            prop_assert_eq!(e.code, 6, "{}: {:?}", doc, e);
        }
    }
}
