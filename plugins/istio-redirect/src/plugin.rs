//! The verbs: decide whether and how a pod is captured, then program it.

use std::net::IpAddr;
use std::path::{Path, PathBuf};

use agent_wire::pod_event::{self, PodEvent};
use cni::conf::POD_ANNOTATIONS_KEY;
use cni::fault;
use cni::{Attachment, CniResult, Error, Plugin, Request, Result};
use firewall::Family;
use ipnetwork::IpNetwork;
use netlink::Netlink;
use netlink::route::FwmarkRule;
use netns::NetNs;
use podnet::{check_failed, firewall_error, netlink_error};

use crate::rules::apply::{IptablesCapture, IptablesFlavour};
use crate::rules::nft::NftablesCapture;
use crate::rules::{CaptureBackend, Mode, Outcome, Redirect, TPROXY_MARK, TPROXY_TABLE};

use crate::annotations;
use crate::config::IstioConfig;
use crate::pod::{PodInfo, labels_of};
use crate::pod_lookup::Lookup;

/// TPROXY's policy routing: marked packets are delivered locally.
const TPROXY_RULE: FwmarkRule = FwmarkRule::new(TPROXY_MARK, TPROXY_TABLE);

/// The CNI_ARGS kubelet and containerd send.
const K8S_ARGS: [&str; 4] = [
    "K8S_POD_NAMESPACE",
    "K8S_POD_NAME",
    "K8S_POD_INFRA_CONTAINER_ID",
    "K8S_POD_UID",
];

#[derive(Debug)]
pub struct IstioRedirect;

/// What to do with a pod.
#[derive(Debug)]
enum Decision {
    PassThrough(String),
    Capture(Redirect),
    /// Ambient mode: the node agent, listening at `socket`, puts the pod
    /// in the mesh.
    Enrol {
        socket: PathBuf,
        namespace: String,
        name: String,
    },
}

fn config_error(msg: impl Into<String>) -> Error {
    Error::invalid_config(msg)
}

/// Istio's order: its own pods, missing Kubernetes arguments (then the
/// static settings, or nothing), excluded namespaces, ambient enrolment
/// (when on), the pod's own skip rules, then its annotations.
fn decide(req: &Request, cfg: &IstioConfig) -> Result<Decision> {
    let args = req.env.args()?;
    args.expect_only(&K8S_ARGS)?;
    let arg = |key: &str| args.get(key).filter(|v| !v.is_empty());
    let (Some(namespace), Some(name)) = (arg("K8S_POD_NAMESPACE"), arg("K8S_POD_NAME")) else {
        return match &cfg.redirect {
            Some(settings) => {
                let annotations = annotations::from_static(settings)
                    .map_err(|e| config_error(format!("invalid redirect: {e}")))?;
                let redirect = annotations::redirect(&annotations, cfg.proxy)
                    .map_err(|e| config_error(format!("invalid redirect: {e}")))?;
                Ok(Decision::Capture(redirect))
            }
            None => Ok(Decision::PassThrough(
                "not a Kubernetes pod and no static redirect configured".into(),
            )),
        };
    };
    if name.starts_with("istio-cni-node-") && cfg.pod_namespace.as_deref() == Some(namespace) {
        return Ok(Decision::PassThrough("it is an istio-cni node pod".into()));
    }
    if cfg.exclude_namespaces.iter().any(|n| n == namespace) {
        return Ok(Decision::PassThrough(format!(
            "namespace {namespace} is excluded"
        )));
    }
    let pod = if let Some(ambient) = &cfg.ambient {
        // Ambient reads labels, which only the API has; a pod it does not
        // enrol may still have a sidecar to capture for.
        let lookup = Lookup::new(cfg)?;
        let pod = PodInfo::from_api(&lookup.pod(namespace, name)?);
        let namespace_labels = labels_of(&lookup.namespace(namespace)?);
        if ambient.enrolment.matches(pod.candidate(), &namespace_labels) {
            return Ok(Decision::Enrol {
                socket: ambient.pod_event_socket.clone(),
                namespace: namespace.to_owned(),
                name: name.to_owned(),
            });
        }
        pod
    } else {
        pod_info(req, cfg, namespace, name)?
    };
    if let Some(reason) = pod.skip_reason() {
        return Ok(Decision::PassThrough(format!("pod {namespace}/{name}: {reason}")));
    }
    pod.redirect(&cfg.proxy)
        .map(Decision::Capture)
        .map_err(config_error)
}

/// The pod's annotations from the runtime when the entry declares the
/// capability and the runtime sent them; otherwise the Kubernetes API.
fn pod_info(req: &Request, cfg: &IstioConfig, namespace: &str, name: &str) -> Result<PodInfo> {
    let conf = &req.conf;
    if conf.has_capability(POD_ANNOTATIONS_KEY) && conf.runtime_config.get(POD_ANNOTATIONS_KEY).is_some() {
        return PodInfo::from_annotations(conf.runtime_config.pod_annotations()?).map_err(config_error);
    }
    Lookup::new(cfg)?
        .pod(namespace, name)
        .map(|pod| PodInfo::from_api(&pod))
}

/// Ambient mode: the node agent puts the pod's redirection in and hands
/// it to ztunnel, and the ADD returns once it says so; when it cannot (no
/// agent, no ztunnel), the pod does not start, and the runtime retries.
fn enrol(att: &Attachment, socket: &Path, result: &CniResult, namespace: &str, name: &str) -> Result<()> {
    let netns = att
        .netns
        .as_ref()
        .ok_or_else(|| Error::invalid_config("ambient enrolment needs CNI_NETNS"))?;
    let event = PodEvent {
        netns: netns.display().to_string(),
        pod_name: name.to_owned(),
        pod_namespace: namespace.to_owned(),
        ips: result
            .ips
            .iter()
            .map(|ip| pod_event::IpConfig {
                interface: ip.interface,
                address: ip.address,
                gateway: ip.gateway,
            })
            .collect(),
    };
    pod_event::push(socket, &event, pod_event::WAIT).map_err(|e| {
        Error::try_again_later(format!(
            "pod {namespace}/{name} is enrolled in ambient mode and the node agent did not put it in the mesh: {e}; it is not started outside the mesh (the runtime retries)"
        ))
    })?;
    log::info!("pod {namespace}/{name}: in the mesh (ambient)");
    Ok(())
}

/// Istio's IPv6 decision, from inside the pod: with dual stack, any global
/// IPv6 address; otherwise the family of the first non-loopback,
/// non-link-local address.
fn ipv6_enabled(nl: &Netlink, dual_stack: bool) -> Result<bool> {
    let addresses: Vec<IpNetwork> = nl
        .all_addresses()
        .map_err(netlink_error)?
        .into_iter()
        .map(|(_, a)| a)
        .filter(|a| netlink::ops::is_global_unicast(a.ip()))
        .collect();
    Ok(if dual_stack {
        addresses.iter().any(IpNetwork::is_ipv6)
    } else {
        addresses.first().is_some_and(IpNetwork::is_ipv6)
    })
}

struct Target {
    ns: NetNs,
    families: Vec<Family>,
    backend: &'static dyn CaptureBackend,
}

/// Where the capture rules go: Istio's own `inet istio-proxy-*` tables
/// (`native_nftables`), or iptables tables in the operator's flavour or
/// the one found in the pod. The one place the configuration picks it.
fn capture_backend(cfg: &IstioConfig) -> &'static dyn CaptureBackend {
    match (cfg.native_nftables, cfg.iptables_flavour) {
        (true, _) => &NftablesCapture,
        (false, None) => &IptablesCapture { forced: None },
        (false, Some(IptablesFlavour::Default)) => &IptablesCapture {
            forced: Some(IptablesFlavour::Default),
        },
        (false, Some(IptablesFlavour::Nft)) => &IptablesCapture {
            forced: Some(IptablesFlavour::Nft),
        },
        (false, Some(IptablesFlavour::Legacy)) => &IptablesCapture {
            forced: Some(IptablesFlavour::Legacy),
        },
    }
}

fn target(att: &Attachment, cfg: &IstioConfig, redirect: &Redirect) -> Result<(Target, Netlink)> {
    let ns = podnet::open_pod_netns(att)?;
    let nl = Netlink::connect_in(&ns).map_err(netlink_error)?;
    let mut families = vec![Family::V4];
    if ipv6_enabled(&nl, redirect.dual_stack)? {
        families.push(Family::V6);
    }
    let backend = capture_backend(cfg);
    Ok((
        Target {
            ns,
            families,
            backend,
        },
        nl,
    ))
}

impl Target {
    fn ipv6(&self) -> bool {
        self.families.contains(&Family::V6)
    }

    /// Programs the rules: one nft transaction, or one restore per family.
    fn program(&self, redirect: &Redirect) -> Result<()> {
        let outcomes = self
            .backend
            .program(&self.ns, redirect, &self.families)
            .map_err(firewall_error)?;
        for (what, outcome) in outcomes {
            match outcome {
                Outcome::Applied => {}
                Outcome::Unchanged => log::info!("capture rules already in place ({what})"),
                Outcome::Replaced => log::warn!("replaced conflicting Istio rules in the pod ({what})"),
            }
        }
        Ok(())
    }

    /// The expected rules the pod lacks.
    fn missing(&self, redirect: &Redirect) -> Result<Vec<String>> {
        self.backend
            .missing(&self.ns, redirect, &self.families)
            .map_err(firewall_error)
    }
}

fn capture(att: &Attachment, cfg: &IstioConfig, redirect: &Redirect) -> Result<()> {
    let (target, nl) = target(att, cfg, redirect)?;
    fault::pause("istio-redirect:decided");
    target.program(redirect)?;
    fault::pause("istio-redirect:programmed");
    let lo = nl.require_link("lo").map_err(netlink_error)?;
    if target.ipv6() {
        // Envoy binds ::6 for inbound forwarding; IPv6 lo only has ::1.
        let inbound_source: IpAddr = "::6".parse().map_err(|_| Error::internal("::6"))?;
        nl.add_address(
            &lo,
            IpNetwork::new(inbound_source, 128).map_err(|e| Error::internal(e.to_string()))?,
        )
        .map_err(netlink_error)?;
    }
    // A rerun with another layout (TPROXY before, REDIRECT now) converges
    // to what a fresh ADD of this one makes: TPROXY's policy routing goes.
    let tproxy = redirect.mode == Mode::Tproxy && redirect.captures_inbound();
    for family in [Family::V4, Family::V6] {
        let v4 = family == Family::V4;
        if tproxy && target.families.contains(&family) {
            nl.add_fwmark_rule(v4, &TPROXY_RULE).map_err(netlink_error)?;
            nl.add_local_default_route(v4, &lo, TPROXY_TABLE)
                .map_err(netlink_error)?;
        } else {
            // What a family without policy routing (IPv6 disabled, or a
            // kernel without multiple tables) answers is "nothing there".
            nl.del_local_default_route(v4, &lo, TPROXY_TABLE)
                .map_err(netlink_error)?;
            nl.del_fwmark_rule(v4, &TPROXY_RULE).map_err(netlink_error)?;
        }
    }
    Ok(())
}

impl Plugin for IstioRedirect {
    const NAME: &'static str = "istio-redirect";
    const KEYS: cni::keys::Shape = crate::config::KEYS;
    const LOG_SOCKET: Option<cni::log::OpenSink> = Some(agent_wire::log::open);

    fn add(&self, req: &Request, att: &Attachment) -> Result<CniResult> {
        let cfg = IstioConfig::load(&req.conf)?;
        if let Some(level) = cfg.log_level() {
            cni::log::configure(None, Some(level))?;
        }
        let result = req.conf.prev_result()?.unwrap_or_default();
        match decide(req, &cfg)? {
            Decision::PassThrough(reason) => log::info!("not capturing: {reason}"),
            Decision::Capture(redirect) => capture(att, &cfg, &redirect)?,
            Decision::Enrol {
                socket,
                namespace,
                name,
            } => enrol(att, &socket, &result, &namespace, &name)?,
        }
        Ok(result)
    }

    fn check(&self, req: &Request, att: &Attachment) -> Result<()> {
        let cfg = IstioConfig::load(&req.conf)?;
        // An enrolled pod's rules are the agent's, which keeps them.
        let Decision::Capture(redirect) = decide(req, &cfg)? else {
            return Ok(());
        };
        let (target, _) = target(att, &cfg, &redirect)?;
        let missing = target.missing(&redirect)?;
        if missing.is_empty() {
            Ok(())
        } else {
            Err(check_failed(format!(
                "capture rules missing in the pod: {}",
                missing.join("; ")
            )))
        }
    }

    /// The rules live in the pod's namespace and go with it; DEL has
    /// nothing to undo, and must succeed with no netns and no prevResult.
    fn del(&self, _req: &Request, _att: &Attachment) -> Result<()> {
        Ok(())
    }
}
