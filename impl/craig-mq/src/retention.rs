//! Retention — ADR-022 § Retention policy, corrected and ENFORCED by #965/#1129 (ADR-058, as
//! the ADR summarises it).
//!
//! Inside every outbox worker ([`crate::OutboxWorker::with_prune`]): an hourly, jittered
//! prune under a per-database advisory lock (one replica of a service prunes at a time),
//! batched and cycle-capped, with one window per table where 0 disables that table:
//! - `event_outbox`: PUBLISHED rows older than the outbox window (windowed on `created_at`).
//!   Pending rows are kept forever: they are the only durable evidence of an undelivered
//!   notification (there is no outbox retry cap and no outbox DLQ). Pending rows older than
//!   the grace are the operator signal `outbox_unpublished_beyond_grace` (gauge and a
//!   `retention.outbox_unpublished_beyond_grace` warning).
//! - `event_inbox`: older than the inbox window (31 d: strictly wider than the outbox's, so a
//!   replayed outbox row never arrives after its dedup record was pruned).
//! - `idempotency_responses`: by `expires_at`.
//!
//! The admin replay refuses a window reaching past the outbox window ([`replay_allowed`]:
//! the one rule, shared by every replay endpoint): a replay past the dedup horizon would
//! re-execute consumer side effects.
//!
//! Compat `pre-965` is the prune before the correction: it deletes pending rows too, and
//! windows the inbox like the outbox (the "matching/equal" wording the ADR retracts).

use std::time::Duration;

use chrono::{DateTime, Utc};
use sqlx::PgPool;
use tokio_util::sync::CancellationToken;

use crate::settings::Retention;

/// The advisory-lock key of the prune (one per database: each service has its own).
pub const PRUNE_LOCK_KEY: i64 = 0x0c4a_1965_1129;

/// How the prune runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PruneConfig {
    pub retention: Retention,
    /// Between cycles, jittered by ±10 % (`CRAIG_RETENTION_INTERVAL_SECS`, default 3600).
    pub interval: Duration,
    /// Rows one DELETE removes (`CRAIG_RETENTION_BATCH`, default 1000).
    pub batch: i64,
    /// Batches per table per cycle (`CRAIG_RETENTION_MAX_BATCHES`, default 100): a cycle
    /// never runs unbounded; what is left waits for the next one.
    pub max_batches: u32,
    /// Pending rows older than this count as `outbox_unpublished_beyond_grace`
    /// (`CRAIG_OUTBOX_UNPUBLISHED_GRACE_SECS`, default 3600).
    pub grace: Duration,
    /// Compat `pre-965`.
    pub pre_965: bool,
}

impl Default for PruneConfig {
    fn default() -> Self {
        Self {
            retention: Retention::default(),
            interval: Duration::from_secs(3600),
            batch: 1000,
            max_batches: 100,
            grace: Duration::from_secs(3600),
            pre_965: false,
        }
    }
}

/// What one cycle did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PruneReport {
    /// Another replica held the lock: nothing was done.
    pub skipped: bool,
    pub outbox: u64,
    pub inbox: u64,
    pub idempotency: u64,
    /// Pending outbox rows older than the grace, after the cycle.
    pub unpublished_beyond_grace: i64,
}

/// Delete in batches with `sql` (`$1` the batch size, `$2` the window in days when given)
/// until a batch comes back short or the cycle cap is reached.
async fn batched(conn: &mut sqlx::PgConnection, sql: &'static str, days: Option<u32>, cfg: &PruneConfig) -> Result<u64, sqlx::Error> {
    let mut total = 0;
    for _ in 0..cfg.max_batches {
        let mut q = sqlx::query(sql).bind(cfg.batch);
        if let Some(days) = days {
            q = q.bind(days as i32);
        }
        let n = q.execute(&mut *conn).await?.rows_affected();
        total += n;
        if n < cfg.batch as u64 {
            break;
        }
    }
    Ok(total)
}

/// One prune cycle under the advisory lock (skipped when another replica holds it).
pub async fn prune_once(pool: &PgPool, cfg: &PruneConfig) -> Result<PruneReport, sqlx::Error> {
    let mut conn = pool.acquire().await?;
    let locked: bool = sqlx::query_scalar("SELECT pg_try_advisory_lock($1)").bind(PRUNE_LOCK_KEY).fetch_one(&mut *conn).await?;
    let mut report = if locked {
        let result = prune_locked(&mut conn, cfg).await;
        // Released even when a statement failed; a lost connection releases it by itself.
        let _ = sqlx::query("SELECT pg_advisory_unlock($1)").bind(PRUNE_LOCK_KEY).execute(&mut *conn).await;
        result?
    } else {
        PruneReport { skipped: true, ..Default::default() }
    };
    // Every replica reads the operator signal, lock or not, so none exports a stale gauge.
    report.unpublished_beyond_grace = sqlx::query_scalar(
        "SELECT count(*) FROM event_outbox WHERE published_at IS NULL AND created_at < now() - make_interval(secs => $1)",
    )
    .bind(cfg.grace.as_secs_f64())
    .fetch_one(&mut *conn)
    .await?;
    Ok(report)
}

async fn prune_locked(conn: &mut sqlx::PgConnection, cfg: &PruneConfig) -> Result<PruneReport, sqlx::Error> {
    let r = cfg.retention;
    let mut report = PruneReport::default();
    if r.outbox_days > 0 {
        report.outbox = if cfg.pre_965 {
            // pre-#965: "both published and NULL rows" — pending rows deleted too.
            batched(conn, "DELETE FROM event_outbox WHERE id IN (SELECT id FROM event_outbox \
                 WHERE created_at < now() - make_interval(days => $2) LIMIT $1)", Some(r.outbox_days), cfg).await?
        } else {
            // Issue 21.5, the #1194 way: the predicate again on the outer DELETE. A row a
            // concurrent replay re-staged (its UPDATE held the row while this DELETE waited)
            // is re-checked as it is NOW, pending, and kept.
            batched(conn, "DELETE FROM event_outbox WHERE id IN (SELECT id FROM event_outbox \
                 WHERE published_at IS NOT NULL AND created_at < now() - make_interval(days => $2) LIMIT $1) \
                 AND published_at IS NOT NULL AND created_at < now() - make_interval(days => $2)", Some(r.outbox_days), cfg).await?
        };
    }
    // pre-#965 windows the inbox like the outbox: the dedup record can go before the row.
    let inbox_days = if cfg.pre_965 { r.outbox_days } else { r.inbox_days };
    if inbox_days > 0 {
        report.inbox = batched(conn, "DELETE FROM event_inbox WHERE envelope_id IN (SELECT envelope_id FROM event_inbox \
             WHERE received_at < now() - make_interval(days => $2) LIMIT $1) \
             AND received_at < now() - make_interval(days => $2)", Some(inbox_days), cfg).await?;
    }
    if r.idempotency_hours > 0 {
        // #1194: never a live claim (a re-claim restarts expires_at; this guards the rest).
        // The predicate again on the outer DELETE: a row re-claimed between the subquery's
        // snapshot and the delete's row lock is re-checked as it is NOW, and kept.
        report.idempotency = batched(conn, "DELETE FROM idempotency_responses WHERE cache_key IN (SELECT cache_key FROM idempotency_responses \
             WHERE expires_at < now() AND (status <> 'processing' OR claim_expires_at < now()) LIMIT $1) \
             AND expires_at < now() AND (status <> 'processing' OR claim_expires_at < now())", None, cfg).await?;
    }
    Ok(report)
}

/// The prune loop: a cycle every `interval` ±10 % (the first one too), until `shutdown`.
pub async fn run(pool: PgPool, cfg: PruneConfig, shutdown: CancellationToken) {
    let mut seed = u64::from(std::process::id()) ^ u64::from(Utc::now().timestamp_subsec_nanos());
    loop {
        // xorshift: jitter needs no cryptography, only that replicas drift apart.
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        let jitter = 0.9 + 0.2 * (seed % 1000) as f64 / 1000.0;
        tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = tokio::time::sleep(cfg.interval.mul_f64(jitter)) => {}
        }
        match prune_once(&pool, &cfg).await {
            Ok(r) if r.skipped => {
                metrics::gauge!(crate::metrics::OUTBOX_UNPUBLISHED_BEYOND_GRACE).set(r.unpublished_beyond_grace as f64);
                tracing::debug!(event = "retention.skipped", "another replica holds the prune lock");
            }
            Ok(r) => {
                metrics::gauge!(crate::metrics::OUTBOX_UNPUBLISHED_BEYOND_GRACE).set(r.unpublished_beyond_grace as f64);
                tracing::info!(
                    event = "retention.cycle",
                    outbox = r.outbox,
                    inbox = r.inbox,
                    idempotency = r.idempotency,
                    pre_965 = cfg.pre_965,
                );
                if r.unpublished_beyond_grace > 0 {
                    tracing::warn!(
                        event = "retention.outbox_unpublished_beyond_grace",
                        rows = r.unpublished_beyond_grace,
                        grace_secs = cfg.grace.as_secs(),
                        "pending outbox rows older than the grace: kept (the only evidence of an undelivered event), look at them"
                    );
                }
            }
            Err(e) => tracing::warn!(event = "retention.failed", error = %e),
        }
    }
}

/// Why a replay window is refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ReplayRefused {
    #[error("from ({from}) is after to ({to})")]
    Inverted { from: DateTime<Utc>, to: DateTime<Utc> },
    #[error(
        "the window starts {from}, before the outbox retention horizon {horizon} ({days} d): a replay past the dedup \
         horizon would re-execute consumer side effects (ADR-022 § Retention policy, #965/#1129)"
    )]
    PastRetention { from: DateTime<Utc>, horizon: DateTime<Utc>, days: u32 },
}

/// The one replay rule (§D4 with § Retention policy): a window may not start before
/// `now - outbox window` (with the outbox prune disabled, the inbox window bounds it; with
/// both disabled, nothing does), and may not be inverted.
pub fn replay_allowed(from: DateTime<Utc>, to: DateTime<Utc>, now: DateTime<Utc>, r: &Retention) -> Result<(), ReplayRefused> {
    if from > to {
        return Err(ReplayRefused::Inverted { from, to });
    }
    let days = if r.outbox_days > 0 { r.outbox_days } else { r.inbox_days };
    if days == 0 {
        return Ok(());
    }
    // Never a panic on a window past what chrono holds (settings bound it; the library API
    // does not): such a horizon is before every timestamp.
    let horizon = chrono::Duration::try_days(i64::from(days))
        .and_then(|d| now.checked_sub_signed(d))
        .unwrap_or(DateTime::<Utc>::MIN_UTC);
    if from < horizon {
        return Err(ReplayRefused::PastRetention { from, horizon, days });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_replay_may_reach_back_to_the_outbox_window_and_no_further() {
        let now: DateTime<Utc> = "2026-12-01T12:00:00Z".parse().unwrap();
        let r = Retention::default();
        let day = chrono::Duration::days(1);
        let second = chrono::Duration::seconds(1);
        assert_eq!(replay_allowed(now - day * 30, now, now, &r), Ok(()), "exactly at the horizon");
        assert!(matches!(replay_allowed(now - day * 30 - second, now, now, &r), Err(ReplayRefused::PastRetention { days: 30, .. })));
        assert!(matches!(replay_allowed(now, now - day, now, &r), Err(ReplayRefused::Inverted { .. })));
        let no_outbox_prune = Retention { outbox_days: 0, ..r };
        assert_eq!(replay_allowed(now - day * 31, now, now, &no_outbox_prune), Ok(()), "the inbox window bounds it then");
        assert!(replay_allowed(now - day * 32, now, now, &no_outbox_prune).is_err());
        let none = Retention { outbox_days: 0, inbox_days: 0, idempotency_hours: 0 };
        assert_eq!(replay_allowed(now - day * 400, now, now, &none), Ok(()));
    }
}
