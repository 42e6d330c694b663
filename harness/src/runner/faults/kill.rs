//! `kill`: SIGKILL (or `docker kill`) of the broker, the database or a replica, and its
//! restart on the same data after the hold (`restart_after_ms`).

use super::{Cx, Room, not_supported};
use crate::backend::{BackendKind, Target};
use crate::history::Event;
use crate::process::describe;
use crate::runner::consumes;
use crate::scenario::{Fault, FaultTarget};

pub(super) struct Kill;

/// How long a restarted broker node's quorum queue members may take to be back online
/// (issue 25), after it takes logins again.
const MEMBERS_BACK_S: u64 = 60;

/// How long after a broker node's kill the survivors may take to report another leader of
/// every quorum queue it led (the kill's evidence). Generous: each report is a CLI call
/// bounded by 10 s, and a loaded CI machine answers slowly.
const LEADERS_MOVED_S: u64 = 60;

/// The backend's target for a server fault.
pub(super) fn server(target: &FaultTarget) -> Option<Target> {
    match target {
        FaultTarget::Broker => Some(Target::Broker),
        FaultTarget::BrokerNode(n) => Some(Target::BrokerNode(*n)),
        FaultTarget::Database => Some(Target::Database),
        _ => None,
    }
}

/// A server fault: the backend must own the server's process (or container); `external`'s
/// servers are shared.
pub(super) fn server_supported(backend: BackendKind, target: &FaultTarget) -> Result<(), &'static str> {
    match (server(target), backend) {
        (Some(_), BackendKind::External) => Err("the servers are shared; use CHAOS_BACKEND=local (or containers) for destructive faults"),
        _ => Ok(()),
    }
}

impl Room for Kill {
    /// Whether the server's data was wiped (a broker node's, `wipe = true`).
    type Applied = bool;

    fn supported(backend: BackendKind, target: &FaultTarget) -> Result<(), &'static str> {
        server_supported(backend, target)
    }

    async fn apply(cx: &Cx, f: &Fault, target: &FaultTarget) -> anyhow::Result<bool> {
        if let Some(t) = server(target) {
            let mut backend = cx.backend.lock().await;
            // A node of a broker cluster (issue 25): where the queues were before it died.
            let node = t.broker_node().filter(|_| matches!(target, FaultTarget::BrokerNode(_)));
            let before = match node {
                Some(n) => backend.queue_placement(n, f.wipe).await?,
                None => None,
            };
            // A data loss happens at the kill: what is stamped after it never reached the data.
            let killed_at = cx.log.now();
            let died = backend.kill(t).await?;
            let Some((before, names)) = before.filter(|_| died.is_some()) else {
                cx.evidence(died);
                return Ok(false);
            };
            let n = node.expect("a cluster node");
            let name = &names[n - 1];
            // The leaders it held must move to the survivors: the broker's own word that
            // the fault reached the queues (without it the run is inconclusive).
            let led = super::led_by(&before, name);
            // Asked of each survivor in turn: one slow to answer (a loaded machine: each CLI
            // call is bounded by 10 s) does not starve the evidence.
            let survivors: Vec<usize> = (1..=names.len()).filter(|&k| k != n).collect();
            let mut moved = String::new();
            if !led.is_empty() {
                let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(LEADERS_MOVED_S);
                for ask in (0..).map(|i| survivors[i % survivors.len()]) {
                    let now = backend.queue_placement(ask, false).await.ok().flatten().map(|(q, _)| q).unwrap_or_default();
                    let gone = led.iter().all(|l| now.iter().any(|q| &q.name == l && !q.leader.is_empty() && &q.leader != name));
                    if gone {
                        moved.push_str(&format!("; leaders moved off it: {}", super::leaders_now(&led, &now, name).join(", ")));
                        break;
                    }
                    if tokio::time::Instant::now() > deadline {
                        cx.evidence(None);
                        anyhow::bail!("{t} was killed but the quorum queues it led ({}) elected no other leader within {LEADERS_MOVED_S} s", led.join(", "));
                    }
                    tokio::time::sleep(std::time::Duration::from_millis(250)).await;
                }
            }
            if f.wipe {
                // Disk loss while it is down: what only it held is gone — classic queues
                // homed there, quorum queues with no other member — with their ready
                // messages as the broker counted them before the kill.
                let only_there: Vec<(String, u64)> =
                    before.iter().filter(|q| q.nodes.len() == 1 && &q.nodes[0] == name).map(|q| (q.name.clone(), q.messages)).collect();
                let wiped = backend.wipe(t)?;
                let held: Vec<String> = only_there.iter().map(|(q, m)| format!("{q} ({m} ready)")).collect();
                cx.evidence(died.map(|d| format!("{d}{moved}; {wiped}; held only there: {}", if held.is_empty() { "no queue".into() } else { held.join(", ") })));
                cx.log.push_at(killed_at, Event::BrokerDataLost { node: t.to_string(), queue_type: cx.queue_type.as_str().into(), queues: only_there });
                return Ok(true);
            }
            cx.evidence(died.map(|d| format!("{d}{moved}")));
            return Ok(false);
        }
        let FaultTarget::Replica(name) = target else { return Err(not_supported(f)) };
        let r = cx.replica(name);
        let service = name.rsplit_once('-').map(|(s, _)| s).unwrap_or(name);
        let pid = r.lock().await.pid();
        let status = r.lock().await.kill().await?;
        cx.evidence(pid.map(|p| format!("pid {p} died ({})", describe(status))));
        cx.log.push(Event::Crash { replica: name.clone(), consumer: consumes(service), how: describe(status) });
        Ok(false)
    }

    async fn heal(cx: &Cx, f: &Fault, target: &FaultTarget, wiped: bool) -> anyhow::Result<()> {
        if let Some(t) = server(target) {
            let mut backend = cx.backend.lock().await;
            if wiped {
                backend.rejoin(t).await?;
                drop(backend);
                // The operator who replaced the node runs the deploy step again, where the
                // scenario has one (docs/operations.md): queues whose only home was the lost
                // node (classic) were forgotten with it, and a queue no node of the fleet
                // declares (the audit queue without a security replica) exists again.
                if cx.redeploy {
                    craig_fleet::node::declare_topology(&cx.amqp_url, true, cx.queue_type).await?;
                }
            } else {
                backend.restart(t).await?;
                // A node of a cluster is back when its quorum queue members are, not when it
                // takes logins: until then a queue it is a member of has one member fewer
                // online, and a kill of another node can leave it without a majority (a
                // loaded CI machine had quorum-rolling-restart's third kill find five queues
                // with no leader for 20 s). An operator's rolling restart waits for this too.
                backend.await_members_online(t, std::time::Duration::from_secs(MEMBERS_BACK_S)).await?;
            }
            return Ok(());
        }
        let FaultTarget::Replica(name) = target else { return Err(not_supported(f)) };
        let r = cx.replica(name);
        let mut r = r.lock().await;
        cx.log.push(Event::Started { replica: name.clone(), compat: r.spec.compat.clone() });
        r.start().await?;
        Ok(())
    }
}
