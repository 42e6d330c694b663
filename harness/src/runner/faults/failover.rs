//! `failover` (issue 26): the database primary SIGKILLed, its streaming standby promoted
//! once it has applied all it received, and the run's database address moved to it, as an
//! operator's tooling (Patroni, a managed service) does it. Evidence: the old primary's
//! process group gone, the timeline moved on, the promoted server out of recovery. Nothing
//! heals: the old primary stays gone.

use super::{Cx, Room, not_supported};
use crate::backend::BackendKind;
use crate::history::Event;
use crate::scenario::{Fault, FaultTarget};

pub(super) struct FailoverRoom;

impl Room for FailoverRoom {
    type Applied = ();
    const HOLDS: bool = false;

    fn supported(backend: BackendKind, target: &FaultTarget) -> Result<(), &'static str> {
        super::kill::server_supported(backend, target)?;
        match (backend, target) {
            (BackendKind::Local, FaultTarget::Database) => Ok(()),
            (BackendKind::Local, _) => Err("a failover targets the database"),
            _ => Err("a database standby runs on the local backend only, so far (issue 26)"),
        }
    }

    async fn apply(cx: &Cx, f: &Fault, target: &FaultTarget) -> anyhow::Result<()> {
        if *target != FaultTarget::Database {
            return Err(not_supported(f));
        }
        let mut backend = cx.backend.lock().await;
        // What the standby lacks is lost at the kill: the record is put there.
        let killed_at = cx.log.now();
        let done = match backend.failover().await {
            Ok(done) => done,
            Err(e) => {
                cx.evidence(None);
                return Err(e.into());
            }
        };
        // The database address leads to the promoted standby once `failover` returned.
        let promoted_ms = Some(cx.log.now());
        let replayed_until_ms = done.replayed_until_db_ms.map(|ms| cx.log.rel_db(ms));
        let mode = if done.sync { "sync" } else { "async" };
        cx.evidence(Some(format!(
            "primary pid {} (and its process group) died; standby promoted: timeline {} → {}, out of recovery, the database address now leads to {}; it had applied commits up to {} ({mode} replication)",
            done.killed_pid,
            done.timeline_before,
            done.timeline_after,
            done.now_at,
            replayed_until_ms.map_or("none since it started".to_owned(), |t| format!("@{t}ms")),
        )));
        cx.log.push_at(killed_at, Event::Failover { replayed_until_ms, mode: mode.into(), promoted_ms });
        Ok(())
    }

    async fn heal(_: &Cx, _: &Fault, _: &FaultTarget, (): ()) -> anyhow::Result<()> {
        Ok(())
    }
}
