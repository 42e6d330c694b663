//! `pause`: SIGSTOP (or `docker pause`) of the broker, the database or a replica, resumed
//! after the hold (`duration_ms`).

use super::kill::{server, server_supported};
use super::{Cx, Room, not_supported};
use crate::backend::BackendKind;
use crate::scenario::{Fault, FaultTarget};

pub(super) struct Pause;

impl Room for Pause {
    type Applied = ();

    fn supported(backend: BackendKind, target: &FaultTarget) -> Result<(), &'static str> {
        server_supported(backend, target)
    }

    async fn apply(cx: &Cx, f: &Fault, target: &FaultTarget) -> anyhow::Result<()> {
        if let Some(t) = server(target) {
            let stopped = cx.backend.lock().await.pause(t, true).await?;
            cx.evidence(stopped);
            return Ok(());
        }
        let FaultTarget::Replica(name) = target else { return Err(not_supported(f)) };
        let r = cx.replica(name);
        let pid = r.lock().await.pid();
        r.lock().await.pause()?;
        // Evidence: the kernel reports the process stopped (SIGSTOP lands asynchronously).
        let seen = match pid {
            Some(p) => crate::process::wait_stopped(p).await,
            None => false,
        };
        cx.evidence(pid.filter(|_| seen).map(|p| format!("pid {p} stopped")));
        Ok(())
    }

    async fn heal(cx: &Cx, f: &Fault, target: &FaultTarget, (): ()) -> anyhow::Result<()> {
        if let Some(t) = server(target) {
            cx.backend.lock().await.pause(t, false).await?;
            return Ok(());
        }
        let FaultTarget::Replica(name) = target else { return Err(not_supported(f)) };
        cx.replica(name).lock().await.resume()?;
        Ok(())
    }
}
