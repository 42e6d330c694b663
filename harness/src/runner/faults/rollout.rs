//! `upgrade` and `downgrade`: one step of a rollout. The replica drains and exits on
//! SIGTERM, then starts again with the other compat modes. Not held, nothing to heal.
//!
//! `upgrade` of a broker cluster's node (`broker-N`, issue 25: the graceful rolling restart
//! operators do, on the same RabbitMQ version): the node is drained (`rabbitmq-upgrade
//! drain`: the quorum queues it leads hand their leadership over, its clients are
//! disconnected), stopped by SIGTERM, started on its data and revived. Evidence, taken after
//! the drain and before the stop: a peer reports it marked for maintenance and lists every
//! queue it led with another leader; then it shut down by itself (exit 0). Anything less
//! leaves none.

use std::time::Duration;

use tokio::sync::Mutex;

use super::{Cx, Room, mutants_only, not_supported};
use crate::backend::BackendKind;
use crate::history::Event;
use crate::process::describe;
use crate::scenario::{Fault, FaultTarget};

pub(super) struct Rollout;

/// Held by an upgrade or downgrade from its stop to its replica's restart.
static ROLLOUT: Mutex<()> = Mutex::const_new(());

impl Room for Rollout {
    type Applied = ();
    const HOLDS: bool = false;

    fn supported(backend: BackendKind, target: &FaultTarget) -> Result<(), &'static str> {
        // A cluster runs on the local backend only (refused elsewhere before anything
        // starts); external's servers are shared and never restarted.
        match target {
            FaultTarget::BrokerNode(_) => super::kill::server_supported(backend, target),
            _ => Ok(()),
        }
    }

    async fn apply(cx: &Cx, f: &Fault, target: &FaultTarget) -> anyhow::Result<()> {
        if let FaultTarget::BrokerNode(n) = target {
            let _one_at_a_time = ROLLOUT.lock().await;
            return restart_broker_node(cx, *n).await;
        }
        let FaultTarget::Replica(name) = target else { return Err(not_supported(f)) };
        // One replica at a time, as a rollout goes: an upgrade whose time comes while
        // another is still restarting waits for it.
        let _one_at_a_time = ROLLOUT.lock().await;
        // Graceful: SIGTERM, the node's bounded drain, exit; then the other behaviour.
        let r = cx.replica(name);
        let mut r = r.lock().await;
        let pid = r.pid();
        let stopped = match pid {
            Some(_) => Some(r.stop(Duration::from_secs(15)).await?),
            None => None,
        };
        // Evidence: the old process exited by itself on SIGTERM (a stop that had to
        // SIGKILL it was no graceful step of a rollout).
        cx.evidence(match (pid, stopped) {
            (Some(p), Some(st)) if st.success() => Some(format!("pid {p} drained and exited ({})", describe(st))),
            _ => None,
        });
        r.spec.compat = f.compat.clone().unwrap_or_default();
        r.spec.failpoints = mutants_only(r.spec.failpoints.take()); // the marker served its purpose
        cx.log.push(Event::Started { replica: name.clone(), compat: r.spec.compat.clone() });
        r.start().await?;
        Ok(())
    }

    async fn heal(_: &Cx, _: &Fault, _: &FaultTarget, (): ()) -> anyhow::Result<()> {
        Ok(())
    }
}

/// A graceful restart of broker node `n` (module doc). The backend is held throughout, so
/// no other broker fault overlaps it. Should a step fail (the drain included: it can fail
/// after it took effect), the node is revived where it can be (never left in maintenance
/// mode for the faults after it) and the run fails with the step's error.
async fn restart_broker_node(cx: &Cx, n: u8) -> anyhow::Result<()> {
    let t = crate::backend::Target::BrokerNode(n);
    let node = usize::from(n);
    let mut backend = cx.backend.lock().await;
    let (before, names) = backend.queue_placement(node, false).await?.ok_or_else(|| anyhow::anyhow!("{t}: no broker cluster here"))?;
    let me = names.get(node - 1).cloned().unwrap_or_default();
    let led = super::led_by(&before, &me);
    // The peer that witnesses the drain (a one-node broker never gets here).
    let peer = (1..=names.len()).find(|&k| k != node).unwrap_or(1);
    let steps = async {
        backend.drain(t).await?;
        // The drain's effect, while the node still runs (after its stop, Raft would move the
        // leaders anyway): a peer reports it under maintenance, and every queue it led is
        // led by another member, as that peer lists them. The drain returns once it has
        // asked for each transfer; a queue whose election has not finished lists no leader
        // yet (seen under CI load), so the peer is asked again until both show, for at most
        // 15 s. A peer that does not answer in time leaves the drain unshown.
        let deadline = tokio::time::Instant::now() + Duration::from_secs(15);
        let (mut drained, mut now) = (false, None);
        loop {
            let left = deadline.saturating_duration_since(tokio::time::Instant::now());
            drained = drained || matches!(tokio::time::timeout(left, backend.under_maintenance(peer, t)).await, Ok(Ok(true)));
            let left = deadline.saturating_duration_since(tokio::time::Instant::now());
            if let Ok(Ok(Some((listing, _)))) = tokio::time::timeout(left, backend.queue_placement(peer, false)).await {
                now = Some(listing);
            }
            let shown = drained && now.as_deref().is_some_and(|now| handed_over(&led, now, &me));
            if shown || tokio::time::Instant::now() + Duration::from_millis(250) >= deadline {
                break;
            }
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
        let status = backend.stop_gracefully(t).await?;
        backend.restart(t).await?;
        backend.revive(t).await?;
        // Back when its quorum queue members are, not when it takes logins (issue 25; the
        // kill's restart waits the same): the next node's drain and stop must leave every
        // queue a majority.
        backend.await_members_online(t, Duration::from_secs(60)).await?;
        anyhow::Ok((drained, now, status))
    };
    let done = steps.await;
    let (drained, now, status) = match done {
        Ok(done) => done,
        Err(e) => {
            // Best effort: the node may be down, and then there is nothing to revive.
            let _ = backend.revive(t).await;
            return Err(e);
        }
    };
    drop(backend);
    // Every led queue listed, led by another member (a queue the listing lacks, or one with
    // no leader, is not shown handed over).
    let handed = now.as_ref().filter(|_| drained).map(|now| {
        (handed_over(&led, now, &me), super::leaders_now(&led, now, &me))
    });
    cx.evidence(match (status, handed) {
        (Some(st), Some((true, to))) if st.success() => Some(format!(
            "{t} drained (under maintenance, as node {peer} reports it); leaders handed over before its stop: {}; shut down by itself ({}), started again and revived",
            if to.is_empty() { "it led none".to_owned() } else { to.join(", ") },
            describe(st),
        )),
        (status, _) => {
            // Why there is no evidence, in the run's log: the operator's first question.
            eprintln!(
                "chaos: {t}: the graceful restart is not shown (needs: under maintenance as a peer reports it, every queue it led led elsewhere before its stop, exit 0): \
                 under maintenance {drained}, led {led:?}, leaders before the stop {:?}, exit {:?}",
                now.as_ref().map(|now| super::leaders_now(&led, now, &me)),
                status.map(describe)
            );
            None
        }
    });
    Ok(())
}

/// Whether every queue in `led` is listed in `now` with a leader other than `me` (a queue
/// the listing lacks, or one with no leader yet, is not shown handed over).
fn handed_over(led: &[String], now: &[crate::backend::local::QueuePlacement], me: &str) -> bool {
    led.iter().all(|l| now.iter().any(|q| &q.name == l && !q.leader.is_empty() && q.leader != me))
}

#[cfg(test)]
mod tests {
    use super::handed_over;

    /// Issue 25: a queue mid-election after the drain (listed with no leader yet) is not
    /// shown handed over; one still led by the drained node neither.
    #[test]
    fn handed_over_needs_another_leader_for_every_led_queue() {
        let q = |name: &str, leader: &str| crate::backend::local::QueuePlacement {
            name: name.into(),
            kind: "quorum".into(),
            nodes: vec![],
            leader: leader.into(),
            messages: 0,
        };
        let led = vec!["a".to_owned(), "b".to_owned()];
        assert!(handed_over(&led, &[q("a", "n2"), q("b", "n3")], "n1"));
        assert!(!handed_over(&led, &[q("a", "n2"), q("b", "")], "n1"));
        assert!(!handed_over(&led, &[q("a", "n2"), q("b", "n1")], "n1"));
        assert!(!handed_over(&led, &[q("a", "n2")], "n1"));
        assert!(handed_over(&[], &[], "n1"));
    }
}
