//! `failover` (issue 26): the database primary SIGKILLed, its streaming standby promoted
//! once it has applied all it received, and the run's database address moved to it, as an
//! operator's tooling (Patroni, a managed service) does it. Evidence: the old primary gone
//! (its process group on the local backend, its container on the containers backend, by the
//! engine's word), the timeline moved on, the promoted server out of recovery. Nothing
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
            (BackendKind::Local | BackendKind::Containers, FaultTarget::Database) => Ok(()),
            (BackendKind::Local | BackendKind::Containers, _) => Err("a failover targets the database"),
            _ => Err("a database standby runs on the local and containers backends only (issue 26)"),
        }
    }

    async fn apply(cx: &Cx, f: &Fault, target: &FaultTarget) -> anyhow::Result<()> {
        if *target != FaultTarget::Database {
            return Err(not_supported(f));
        }
        let mut backend = cx.backend.lock().await;
        // What the standby lacks is lost at the kill: the record is put where the old primary
        // died by its backend's word (the SIGKILL of its process group; a container's exit as
        // the engine recorded it), for until then it could still commit what it was sent.
        let kind = backend.kind();
        let began = cx.log.now();
        let done = match backend.failover().await {
            Ok(done) => done,
            Err(e) => {
                cx.evidence(None);
                return Err(e.into());
            }
        };
        let seen_dead = began.saturating_add(u64::try_from(done.dead_after.as_millis()).unwrap_or(u64::MAX));
        let killed_at = cx.log.rel(done.died_at_epoch_ms).clamp(began, seen_dead);
        // The database address leads to the promoted standby once `failover` returned.
        let promoted_ms = Some(cx.log.now());
        let replayed_until_ms = done.replayed_until_db_ms.map(|ms| cx.log.rel_db(ms));
        let mode = if done.sync { "sync" } else { "async" };
        cx.evidence(Some(format!(
            "{} (dead {} ms after the kill was sent, by {}); standby promoted: timeline {} → {}, out of recovery, the database address now leads to {}; it had applied commits up to {} ({mode} replication)",
            done.killed,
            killed_at - began,
            if kind == BackendKind::Containers { "the engine's record of its exit" } else { "the signal" },
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
