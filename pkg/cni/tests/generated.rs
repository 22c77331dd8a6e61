//! Property tests over generated inputs for the three parsers every plugin
//! runs on untrusted input: CNI_ARGS, the configuration on stdin, and
//! results (prevResult, delegates' output) in every version. cargo-fuzz
//! needs a nightly toolchain, which this project does not use; a seeded
//! generator gives the same kind of coverage, reproducibly, in `make test`.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use cni::args::CniArgs;
use cni::conf::{self, NetConf};
use cni::result::{CniResult, Interface, IpConfig, Route};
use cni::version::Version;
use ipnetwork::IpNetwork;
use serde_json::{Value, json};

/// xorshift64*: small, seeded, good enough to wander through input shapes.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }

    fn chance(&mut self, percent: usize) -> bool {
        self.below(100) < percent
    }

    fn pick<'a, T>(&mut self, items: &'a [T]) -> &'a T {
        &items[self.below(items.len())]
    }

    fn string(&mut self, alphabet: &[char], max: usize) -> String {
        let len = self.below(max + 1);
        (0..len).map(|_| *self.pick(alphabet)).collect()
    }
}

const CASES: usize = 20_000;

#[test]
fn cni_args_parse_without_panic_and_round_trip() {
    let mut rng = Rng(0x5eed_0001);
    let alphabet: Vec<char> = "ab=;IgnoreUnknown=1true\u{e9} \t\0/.:".chars().collect();
    for _ in 0..CASES {
        let raw = rng.string(&alphabet, 40);
        match CniArgs::parse(&raw) {
            Ok(args) => {
                // What was understood prints back to the same pairs.
                let printed: Vec<String> = args.pairs().iter().map(|(k, v)| format!("{k}={v}")).collect();
                let again = CniArgs::parse(&printed.join(";")).expect("printed pairs parse");
                assert_eq!(again, args, "{raw:?}");
                assert!(
                    args.pairs()
                        .iter()
                        .all(|(k, _)| !k.is_empty() && !k.contains(';'))
                );
            }
            Err(e) => assert_eq!(e.code, 4, "{raw:?}: {e:?}"),
        }
    }
}

fn value(rng: &mut Rng, depth: usize) -> Value {
    let scalars = [
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
    ];
    match rng.below(if depth == 0 { 1 } else { 4 }) {
        0 => rng.pick(&scalars).clone(),
        1 => Value::Array((0..rng.below(4)).map(|_| value(rng, depth - 1)).collect()),
        _ => {
            let keys = [
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
            Value::Object(
                (0..rng.below(5))
                    .map(|_| ((*rng.pick(&keys)).to_owned(), value(rng, depth - 1)))
                    .collect(),
            )
        }
    }
}

/// A configuration a plugin would accept, then one to three members
/// replaced by generated JSON.
fn mutated_conf(rng: &mut Rng) -> Value {
    let mut doc = json!({"cniVersion": "1.0.0", "name": "gen", "type": "bridge",
        "ipam": {"type": "host-local", "ranges": [[{"subnet": "10.1.0.0/24"}]]},
        "args": {"cni": {"ips": ["10.1.0.5"]}},
        "runtimeConfig": {"portMappings": [], "ips": ["10.1.0.6/24"]},
        "prevResult": {"cniVersion": "1.0.0", "ips": [{"address": "10.1.0.5/24"}]}});
    let pointers = [
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
    for _ in 0..=rng.below(3) {
        let pointer = *rng.pick(&pointers);
        let replacement = value(rng, 3);
        if let Some(slot) = doc.pointer_mut(pointer) {
            *slot = replacement;
        }
    }
    doc
}

#[test]
fn configurations_parse_without_panic_to_a_value_or_a_config_error() {
    let mut rng = Rng(0x5eed_0002);
    let mut accepted = 0;
    for _ in 0..CASES {
        let doc = mutated_conf(&mut rng);
        let text = doc.to_string();
        let outcome = conf::parse_document(text.as_bytes())
            .and_then(|doc| {
                let version = conf::config_version(&doc)?;
                NetConf::from_document(doc, version)
            })
            .and_then(|conf| {
                // What plugins read next must fail cleanly too.
                conf.prev_result()?;
                conf.gc_valid_attachments()?;
                Ok(conf)
            });
        match outcome {
            Ok(_) => accepted += 1,
            Err(e) => assert!(matches!(e.code, 1 | 6 | 7), "{text}: {e:?}"),
        }
    }
    // The generator must also produce valid documents, or it tests little.
    assert!(accepted > CASES / 20, "only {accepted} accepted");
}

fn address(rng: &mut Rng, v4: bool) -> IpNetwork {
    let ip = if v4 {
        IpAddr::V4(Ipv4Addr::from(rng.next() as u32))
    } else {
        IpAddr::V6(Ipv6Addr::from(
            u128::from(rng.next()) << 64 | u128::from(rng.next()),
        ))
    };
    let prefix = if v4 { rng.below(33) } else { rng.below(129) } as u8;
    IpNetwork::new(ip, prefix).expect("prefix in range")
}

fn result(rng: &mut Rng) -> CniResult {
    let interfaces: Vec<Interface> = (0..rng.below(3))
        .map(|i| Interface {
            name: format!("eth{i}"),
            mac: if rng.chance(50) {
                "02:00:00:00:00:01".into()
            } else {
                String::new()
            },
            sandbox: if rng.chance(50) {
                "/run/netns/x".into()
            } else {
                String::new()
            },
            ..Interface::default()
        })
        .collect();
    let ips = (0..rng.below(4))
        .map(|_| {
            let v4 = rng.chance(50);
            IpConfig {
                address: address(rng, v4),
                gateway: rng.chance(50).then(|| address(rng, v4).ip()),
                interface: (!interfaces.is_empty() && rng.chance(70)).then(|| rng.below(interfaces.len())),
            }
        })
        .collect();
    let routes = (0..rng.below(3))
        .map(|_| {
            let v4 = rng.chance(50);
            let mut route = Route::new(address(rng, v4), rng.chance(50).then(|| address(rng, v4).ip()));
            if rng.chance(30) {
                route.mtu = 1400;
                route.priority = 5;
                route.table = Some(100);
            }
            route
        })
        .collect();
    CniResult {
        interfaces,
        ips,
        routes,
        ..CniResult::default()
    }
}

#[test]
fn results_convert_between_versions_to_fixed_points() {
    let mut rng = Rng(0x5eed_0003);
    for _ in 0..CASES / 4 {
        let original = result(&mut rng);
        for version in Version::ALL {
            let Ok(printed) = original.to_value(version) else {
                // Only a result 0.1/0.2 cannot carry may fail to print.
                assert!(original.ips.is_empty(), "{version:?}: {original:?}");
                continue;
            };
            assert_eq!(printed["cniVersion"], version.as_str());
            let read = CniResult::from_value(&printed).expect("a printed result reads back");
            let again = read.to_value(version).expect("prints again");
            assert_eq!(again, printed, "{version:?} is not a fixed point");
            if version >= Version::ALL[5] {
                // 1.x carries everything.
                assert_eq!(read.ips, original.ips, "{version:?}");
                assert_eq!(read.routes, original.routes, "{version:?}");
            }
        }
    }
}

#[test]
fn results_from_generated_json_read_without_panic() {
    let mut rng = Rng(0x5eed_0004);
    for _ in 0..CASES {
        let doc = value(&mut rng, 4);
        if let Err(e) = CniResult::from_value(&doc) {
            assert_eq!(e.code, 6, "{doc}: {e:?}");
        }
    }
}
