//! `upgrade` and `downgrade`: one step of a rollout. The replica drains and exits on
//! SIGTERM, then starts again with the other compat modes. Not held, nothing to heal.

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

    fn supported(_: BackendKind, _: &FaultTarget) -> Result<(), &'static str> {
        Ok(())
    }

    async fn apply(cx: &Cx, f: &Fault, target: &FaultTarget) -> anyhow::Result<()> {
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
