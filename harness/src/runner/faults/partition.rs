//! `partition`: the broker or the database cut off from every replica for the hold
//! (`duration_ms`), at the network: nothing is refused, nothing arrives; a peer that stops
//! waiting (a heartbeat, a confirm or connect timeout) gives up on its own. What happens to
//! open connections depends on the backend (below): held on local and external, aborted on
//! containers.
//!
//! - containers: `docker network disconnect` of the server's container from the run's
//!   network, `connect` at the heal, then a wait until it serves (its address may change).
//!   Everything that reaches the server through that network is cut: the Toxiproxy
//!   container's links and the published ports (the harness's own connections too). Open
//!   connections hang and are aborted, not held (seen: the replicas' links end "connection
//!   aborted"), and a new link fails at once, its upstream's name no longer resolving.
//!   Evidence: the engine's word that it is off the network.
//! - local, external: the servers listen on the host's loopback, on no network to take them
//!   off. Every replica's link to the server is held in the fault proxy instead: a
//!   `latency` toxic longer than the hold on both streams, removed at the heal, which sends
//!   what it held at once (Toxiproxy's rule; new connections are accepted and then hear
//!   nothing, where a real partition lets their SYN go unanswered). The harness's own
//!   connections are not cut. Evidence: payload held, read from the toxics before removal
//!   (issue 22.9: not heartbeats alone).
//! - `broker-N`, a node of a broker cluster (issue 25, local backend): cut off from its
//!   peers at the distribution layer, clients untouched: packet-filter rules drop both
//!   directions of every connection between it and each other node
//!   (`LocalBackend::cut_node`). Evidence, read at the heal: the packets the rules dropped
//!   for each peer (a peer with none: no evidence), and where the quorum queues the node led
//!   have their leaders once it is back, as a peer lists them (another node: elected while
//!   it was cut off).

use super::kill::server;
use super::{Cx, Room, not_supported};
use crate::backend::BackendKind;
use crate::proxy::{Stream, Toxic, ToxicKind};
use crate::scenario::{Fault, FaultTarget};

pub(super) struct Partition;

/// What the heal undoes.
pub(super) enum Cut {
    /// The container is off the run's network.
    Container(crate::backend::Target),
    /// Held links: (proxy, toxic) pairs.
    Links(Vec<(String, String)>),
    /// A cluster node cut off from its peers: the cut's own words, and the queues it led
    /// when the cut began (name, leader), with every node's name.
    Node { target: crate::backend::Target, said: String, led: Vec<String>, names: Vec<String> },
}

/// The proxy toxic's latency: longer than any hold, so nothing passes until the heal
/// removes it.
const HELD_MS: u64 = 24 * 3_600_000;

impl Room for Partition {
    type Applied = Cut;

    /// Every backend: containers at the network, the others in the fault proxy.
    fn supported(backend: BackendKind, target: &FaultTarget) -> Result<(), &'static str> {
        match target {
            FaultTarget::Broker | FaultTarget::Database => Ok(()),
            // A cluster runs on the local backend only (refused elsewhere before anything
            // starts); external's servers are shared and never cut.
            FaultTarget::BrokerNode(_) if backend == BackendKind::Local => crate::backend::local::can_cut_nodes(),
            FaultTarget::BrokerNode(_) => super::kill::server_supported(backend, target),
            _ => Err("a partition cuts off the broker or the database"),
        }
    }

    async fn apply(cx: &Cx, f: &Fault, target: &FaultTarget) -> anyhow::Result<Cut> {
        let Some(t) = server(target) else { return Err(not_supported(f)) };
        let mut backend = cx.backend.lock().await;
        if let FaultTarget::BrokerNode(n) = target {
            let n = usize::from(*n);
            let (before, names) = backend.queue_placement(n, false).await?.unwrap_or_default();
            let said = backend.cut_node(t).await?;
            let led = names.get(n - 1).map(|me| super::led_by(&before, me)).unwrap_or_default();
            return Ok(Cut::Node { target: t, said, led, names });
        }
        if backend.kind() == BackendKind::Containers {
            match backend.partition(t, true).await {
                Ok(off) => {
                    cx.evidence(off);
                    return Ok(Cut::Container(t));
                }
                Err(e) => {
                    // A disconnect that failed half way must not leave the server off the
                    // network for the rest of the run.
                    let _ = backend.partition(t, false).await;
                    return Err(e.into());
                }
            }
        }
        drop(backend);
        let mut held = Vec::new();
        for name in cx.replicas.keys() {
            let proxy = format!("{name}->{t}");
            for stream in [Stream::Upstream, Stream::Downstream] {
                let toxic = Toxic {
                    name: format!("fault-{}-{}", cx.index, stream.as_str()),
                    stream,
                    toxicity: 1.0,
                    kind: ToxicKind::Latency { latency: HELD_MS, jitter: 0 },
                };
                if let Err(e) = cx.toxi.add_toxic(&proxy, &toxic).await {
                    // Nothing held past a failed apply: the heal never runs for it.
                    let _ = release(cx, &held).await;
                    return Err(e.into());
                }
                held.push((proxy.clone(), toxic.name));
            }
        }
        Ok(Cut::Links(held))
    }

    async fn heal(cx: &Cx, _: &Fault, _: &FaultTarget, cut: Cut) -> anyhow::Result<()> {
        match cut {
            Cut::Container(t) => {
                cx.backend.lock().await.partition(t, false).await?;
            }
            Cut::Node { target, said, led, names } => {
                let mut backend = cx.backend.lock().await;
                let n = target.broker_node().unwrap_or(1);
                let dropped = backend.heal_cut(target).await?;
                // Every pair's rules met traffic, or the cut is not shown: one connection
                // that escaped would hide in a sum.
                let all = !dropped.is_empty() && dropped.iter().all(|(_, p)| *p > 0);
                let counts: Vec<String> = dropped.iter().map(|(peer, p)| format!("{p} with node {peer}")).collect();
                // Where the leaders of the queues it led are once it is back, as a peer sees
                // them: a leader on another node was elected while it was cut off (a leader
                // does not move on its own). Bounded, and said when the peer does not answer.
                let peer = (1..=names.len()).find(|&k| k != n).unwrap_or(1);
                let mut leaders = String::new();
                if !led.is_empty() {
                    let me = names.get(n - 1).cloned().unwrap_or_default();
                    leaders = match tokio::time::timeout(std::time::Duration::from_secs(15), backend.queue_placement(peer, false)).await {
                        Ok(Ok(Some((now, _)))) => {
                            format!("; the leaders it held, as node {peer} saw them after the heal: {}", super::leaders_now(&led, &now, &me).join(", "))
                        }
                        _ => format!("; node {peer} did not list the queues within 15 s after the heal"),
                    };
                }
                cx.evidence(all.then(|| format!("{said}; packets dropped: {}{leaders}", counts.join(", "))));
            }
            Cut::Links(held) => {
                // Evidence before removal, best effort (a failed read must not leave a link
                // held): payload the links held (an idle link's heartbeats are not a
                // partition anyone noticed).
                // One read per proxy: both of its toxics' counters.
                let (mut bytes, mut conns, mut links) = (0, 0, 0);
                let mut proxies: Vec<&str> = held.iter().map(|(p, _)| p.as_str()).collect();
                proxies.dedup();
                for proxy in proxies {
                    let Ok(info) = cx.toxi.proxy(proxy).await else { continue };
                    for (_, name) in held.iter().filter(|(p, _)| p == proxy) {
                        if let Some(a) = info.affected.get(name).filter(|a| a.payload_bytes > 0) {
                            bytes += a.payload_bytes;
                            conns += a.connections;
                            links += 1;
                        }
                    }
                }
                cx.evidence((bytes > 0).then(|| format!("{bytes} bytes of payload held on {links} link directions over {conns} connections")));
                release(cx, &held).await?;
            }
        }
        Ok(())
    }
}

/// Removes every held link's toxic, each even when another fails; the first error.
async fn release(cx: &Cx, held: &[(String, String)]) -> anyhow::Result<()> {
    let mut first = None;
    for (proxy, name) in held {
        if let Err(e) = cx.toxi.remove_toxic(proxy, name).await {
            first.get_or_insert(e);
        }
    }
    first.map_or(Ok(()), |e| Err(e.into()))
}
