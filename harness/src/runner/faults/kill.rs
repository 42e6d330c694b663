//! `kill`: SIGKILL (or `docker kill`) of the broker, the database or a replica, and its
//! restart on the same data after the hold (`restart_after_ms`).

use super::{Cx, Room, not_supported};
use crate::backend::{BackendKind, Target};
use crate::history::Event;
use crate::process::describe;
use crate::runner::consumes;
use crate::scenario::{Fault, FaultTarget};

pub(super) struct Kill;

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
            let died = backend.kill(t).await?;
            if f.wipe && died.is_some() {
                // Disk loss while it is down (issue 25): what its queues held there is gone.
                let wiped = backend.wipe(t)?;
                cx.evidence(died.map(|d| format!("{d}; {wiped}")));
                cx.log.push(Event::BrokerDataLost { node: t.to_string(), queue_type: cx.queue_type.as_str().into() });
                return Ok(true);
            }
            cx.evidence(died);
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
                // The operator who replaced the node runs the deploy step again
                // (docs/operations.md): queues whose only home was the lost node (classic)
                // were forgotten with it, and a queue no node of the fleet declares (the
                // audit queue without a security replica) exists again.
                craig_fleet::node::declare_topology(&cx.amqp_url, true, cx.queue_type).await?;
            } else {
                backend.restart(t).await?;
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
