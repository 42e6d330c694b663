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
    type Applied = ();

    fn supported(backend: BackendKind, target: &FaultTarget) -> Result<(), &'static str> {
        server_supported(backend, target)
    }

    async fn apply(cx: &Cx, f: &Fault, target: &FaultTarget) -> anyhow::Result<()> {
        if let Some(t) = server(target) {
            let died = cx.backend.lock().await.kill(t).await?;
            cx.evidence(died);
            return Ok(());
        }
        let FaultTarget::Replica(name) = target else { return Err(not_supported(f)) };
        let r = cx.replica(name);
        let service = name.rsplit_once('-').map(|(s, _)| s).unwrap_or(name);
        let pid = r.lock().await.pid();
        let status = r.lock().await.kill().await?;
        cx.evidence(pid.map(|p| format!("pid {p} died ({})", describe(status))));
        cx.log.push(Event::Crash { replica: name.clone(), consumer: consumes(service), how: describe(status) });
        Ok(())
    }

    async fn heal(cx: &Cx, f: &Fault, target: &FaultTarget, (): ()) -> anyhow::Result<()> {
        if let Some(t) = server(target) {
            cx.backend.lock().await.restart(t).await?;
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
