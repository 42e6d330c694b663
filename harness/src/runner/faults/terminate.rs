//! `terminate`: `pg_terminate_backend` of every backend of the run's databases with one
//! `application_name`, every 250 ms for the hold (`duration_ms`). Evidence: the server's own
//! word, the pids it terminated.

use std::time::Duration;

use anyhow::Context as _;
use tokio::time::Instant;

use super::{Cx, Room, not_supported};
use crate::backend::BackendKind;
use crate::scenario::{Fault, FaultTarget};

pub(super) struct Terminate;

impl Room for Terminate {
    /// The application name, and the task terminating its backends until the hold ends
    /// (aborted with the fault's own task: a failed run tears it down).
    type Applied = (String, AbortOnDrop);

    fn supported(_: BackendKind, _: &FaultTarget) -> Result<(), &'static str> {
        Ok(())
    }

    async fn apply(cx: &Cx, f: &Fault, target: &FaultTarget) -> anyhow::Result<Self::Applied> {
        if *target != FaultTarget::Database {
            return Err(not_supported(f));
        }
        let name = f.application_name.clone().unwrap_or_else(|| craig_mq::outbox::notify::APPLICATION_NAME.to_owned());
        let databases = cx.backend.lock().await.endpoints().databases;
        let url = databases.first().map(|(_, u)| u.clone()).context("no database")?;
        // This run's databases only: on a shared server (`external`) another run's
        // backends are neither ours to cut nor our evidence.
        let names: Vec<String> = databases
            .iter()
            .filter_map(|(_, u)| u.rsplit_once('/').map(|(_, db)| db.split('?').next().unwrap_or(db).to_owned()))
            .collect();
        let pool = sqlx::postgres::PgPoolOptions::new().max_connections(1).connect(&url).await?;
        let until = Instant::now() + super::hold(f);
        let application = name.clone();
        let task = tokio::spawn(async move {
            let mut pids: Vec<i32> = Vec::new();
            loop {
                // The server's own word: the pids it terminated.
                // In the target list, so it runs only on the rows the WHERE kept.
                let cut: Vec<(i32, bool)> = sqlx::query_as(
                    "SELECT pid, pg_terminate_backend(pid) FROM pg_stat_activity \
                     WHERE application_name = $1 AND datname = ANY($2) AND pid <> pg_backend_pid()",
                )
                .bind(&application)
                .bind(&names)
                .fetch_all(&pool)
                .await
                .unwrap_or_default();
                pids.extend(cut.into_iter().filter(|(_, done)| *done).map(|(pid, _)| pid));
                if Instant::now() >= until {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(250)).await;
            }
            pool.close().await;
            pids
        });
        Ok((name, AbortOnDrop(Some(task))))
    }

    async fn heal(cx: &Cx, _: &Fault, _: &FaultTarget, (name, mut task): Self::Applied) -> anyhow::Result<()> {
        let pids = task.0.take().expect("held until healed").await.context("the terminating task panicked")?;
        cx.evidence((!pids.is_empty()).then(|| format!("{} backend(s) named {name} terminated (pids {pids:?})", pids.len())));
        Ok(())
    }
}

/// The terminating loop, aborted when dropped before it was awaited (the fault's task
/// aborted mid-hold): it must not go on cutting connections of a run being torn down.
pub(super) struct AbortOnDrop(Option<tokio::task::JoinHandle<Vec<i32>>>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        if let Some(t) = self.0.take() {
            t.abort();
        }
    }
}
