//! Transactional outbox — ADR-022 §D1, as reworked by Amendment #1128 (claim-lease drain +
//! publisher confirms).
//!
//! **Staging.** [`publish_in_tx`] writes the envelope to `event_outbox` inside the caller's
//! transaction: if the domain write rolls back, the staged envelope rolls back with it.
//!
//! **Draining** ([`OutboxWorker`]), one pass:
//! 1. CLAIM up to `batch_size` pending rows in one short statement
//!    (`FOR UPDATE SKIP LOCKED` + `claimed_at = now()`); rows whose claim is older than the
//!    lease (60 s) are claimable again — that is how a crash between claim and stamp heals.
//! 2. PUBLISH them with no locks, no open transaction and no pooled connection held,
//!    pipelined, each awaited to its publisher confirm.
//! 3. STAMP `published_at` on the ACKed rows; RELEASE the rest at once (`claimed_at = NULL`,
//!    `attempts + 1`, `last_error`).
//!
//! The worker repeats passes until one comes back short (no throughput ceiling), then
//! sleeps the poll interval (1 s). A pass with any failure ends the drain and backs off
//! exponentially, capped at 60 s. At-least-once: a crash after the ACK and before the stamp
//! re-publishes after lease expiry; the inbox is the consumer-side boundary.

use std::time::Duration;

use sqlx::{PgPool, Postgres, Transaction};
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

use crate::crash;
use crate::envelope::EventEnvelope;
use crate::publisher::{PublishError, Publisher, PublisherConfig};

/// Stage `envelope` in the caller's transaction (§D1 `publish_in_tx`). The outbox row id
/// is the envelope id, so a row and its message correlate one to one.
pub async fn publish_in_tx(tx: &mut Transaction<'_, Postgres>, envelope: &EventEnvelope) -> Result<(), sqlx::Error> {
    sqlx::query(
        "INSERT INTO event_outbox (id, aggregate_id, event_type, envelope) VALUES ($1, $2, $3, $4)",
    )
    .bind(envelope.id)
    .bind(envelope.aggregate_id)
    .bind(&envelope.event_type)
    .bind(sqlx::types::Json(envelope))
    .execute(&mut **tx)
    .await?;
    tracing::debug!(event = "outbox.staged", envelope_id = %envelope.id, event_type = %envelope.event_type);
    Ok(())
}

impl Publisher {
    /// ADR-022 §D1's spelling: `Publisher::publish_in_tx(&mut Transaction, &EventEnvelope)`.
    pub async fn publish_in_tx(tx: &mut Transaction<'_, Postgres>, envelope: &EventEnvelope) -> Result<(), sqlx::Error> {
        publish_in_tx(tx, envelope).await
    }
}

/// Worker knobs (§D1, #1128). Tests shorten the lease and the backoff.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OutboxConfig {
    pub poll_interval: Duration,
    pub batch_size: u32,
    pub claim_lease: Duration,
    pub backoff_base: Duration,
    pub backoff_max: Duration,
}

impl Default for OutboxConfig {
    fn default() -> Self {
        Self {
            poll_interval: Duration::from_secs(1),
            batch_size: 100,
            claim_lease: Duration::from_secs(60),
            backoff_base: Duration::from_secs(1),
            backoff_max: Duration::from_secs(60),
        }
    }
}

/// Exponential backoff after `failures` consecutive failing passes: `base × 2^(n-1)`,
/// capped at `max`; zero failures means no backoff.
pub fn backoff(cfg: &OutboxConfig, failures: u32) -> Duration {
    if failures == 0 {
        return Duration::ZERO;
    }
    let factor = 1u32.checked_shl(failures - 1).unwrap_or(u32::MAX);
    cfg.backoff_base.saturating_mul(factor).min(cfg.backoff_max)
}

#[derive(Debug, thiserror::Error)]
pub enum OutboxError {
    #[error("outbox database error: {0}")]
    Db(#[from] sqlx::Error),
}

/// What one pass did.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct PassReport {
    pub claimed: usize,
    pub published: usize,
    pub failed: usize,
    /// Claimed rows whose previous claim had expired (a crashed or stalled worker's rows).
    pub reclaimed: usize,
}

/// What one drain (passes until a short or failing pass) did.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct DrainReport {
    pub passes: usize,
    pub published: usize,
    pub failed: usize,
}

struct Claimed {
    id: Uuid,
    envelope: Result<EventEnvelope, String>,
    reclaimed: bool,
}

/// The per-service outbox worker (§D1 `crates/craig-mq/src/outbox.rs`).
pub struct OutboxWorker {
    pool: PgPool,
    amqp_url: String,
    publisher_cfg: PublisherConfig,
    cfg: OutboxConfig,
    publisher: Option<Publisher>,
    failures: u32,
    mode: DrainMode,
}

/// Which drain the worker runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum DrainMode {
    /// Amendment #1128: claim-lease, publish outside any lock, confirms, drain until short.
    #[default]
    ClaimLease,
    /// Compat `pre-1128`: ONE transaction holds `FOR UPDATE` row locks across every publish
    /// of the batch, publishes WITHOUT confirms (`published_at` = "written to the socket"),
    /// and takes at most one batch per tick. Kept only to show what #1128 fixed.
    Pre1128,
}

impl OutboxWorker {
    pub fn new(pool: PgPool, amqp_url: impl Into<String>, publisher_cfg: PublisherConfig, cfg: OutboxConfig) -> Self {
        Self { pool, amqp_url: amqp_url.into(), publisher_cfg, cfg, publisher: None, failures: 0, mode: DrainMode::default() }
    }

    pub fn with_mode(mut self, mode: DrainMode) -> Self {
        self.mode = mode;
        self
    }

    /// Poll until `shutdown`, then run one last bounded drain so a SIGTERM leaves nothing
    /// behind that the broker could take.
    pub async fn run(mut self, shutdown: CancellationToken) {
        loop {
            let pause = match self.drain().await {
                Ok(r) if r.failed == 0 => {
                    self.failures = 0;
                    self.cfg.poll_interval
                }
                Ok(_) => {
                    self.failures = self.failures.saturating_add(1);
                    backoff(&self.cfg, self.failures)
                }
                Err(e) => {
                    self.failures = self.failures.saturating_add(1);
                    let pause = backoff(&self.cfg, self.failures);
                    tracing::warn!(event = "outbox.drain_failed", error = %e, backoff_ms = pause.as_millis() as u64);
                    pause
                }
            };
            tokio::select! {
                _ = shutdown.cancelled() => break,
                _ = tokio::time::sleep(pause) => {}
            }
        }
        let last = tokio::time::timeout(self.cfg.poll_interval.max(Duration::from_secs(5)), self.drain()).await;
        tracing::info!(event = "outbox.stopped", final_drain = ?last.ok().and_then(Result::ok));
        if let Some(p) = self.publisher.take() {
            p.close().await;
        }
    }

    /// Passes until one comes back short or has a failure (#1128: no throughput ceiling).
    pub async fn drain(&mut self) -> Result<DrainReport, OutboxError> {
        let mut report = DrainReport::default();
        if self.mode == DrainMode::Pre1128 {
            let pass = self.pass_pre1128().await?;
            return Ok(DrainReport { passes: 1, published: pass.published, failed: pass.failed });
        }
        loop {
            let pass = self.pass().await?;
            report.passes += 1;
            report.published += pass.published;
            report.failed += pass.failed;
            if pass.failed > 0 || pass.claimed < self.cfg.batch_size as usize {
                return Ok(report);
            }
        }
    }

    /// One claim → publish → stamp/release pass.
    pub async fn pass(&mut self) -> Result<PassReport, OutboxError> {
        let claimed = self.claim().await?;
        let mut report = PassReport {
            claimed: claimed.len(),
            reclaimed: claimed.iter().filter(|c| c.reclaimed).count(),
            ..Default::default()
        };
        if claimed.is_empty() {
            return Ok(report);
        }
        if report.reclaimed > 0 {
            tracing::warn!(event = "outbox.lease_expired", rows = report.reclaimed, "re-claiming rows whose lease expired");
        }
        crash::hit("outbox::after_claim");

        let mut failed: Vec<(Uuid, String)> = Vec::new();
        let mut sendable: Vec<(Uuid, EventEnvelope)> = Vec::with_capacity(claimed.len());
        for c in claimed {
            match c.envelope {
                Ok(env) => sendable.push((c.id, env)),
                Err(why) => failed.push((c.id, why)),
            }
        }

        let mut acked: Vec<Uuid> = Vec::with_capacity(sendable.len());
        if !sendable.is_empty() {
            match self.publisher().await {
                Ok(publisher) => {
                    let envs: Vec<EventEnvelope> = sendable.iter().map(|(_, e)| e.clone()).collect();
                    let results = publisher.publish_batch(&envs).await;
                    for ((id, _), res) in sendable.into_iter().zip(results) {
                        match res {
                            Ok(()) => acked.push(id),
                            Err(e) => failed.push((id, format!("{}: {e}", e.kind()))),
                        }
                    }
                }
                Err(e) => {
                    let msg = format!("{}: {e}", e.kind());
                    failed.extend(sendable.into_iter().map(|(id, _)| (id, msg.clone())));
                }
            }
            if self.publisher.as_ref().is_some_and(|p| !p.is_usable()) {
                if let Some(p) = self.publisher.take() {
                    p.close().await;
                }
            }
        }
        crash::hit("outbox::after_publish_before_stamp");

        if !acked.is_empty() {
            lease::stamp(&self.pool, &acked).await?;
            tracing::debug!(event = "outbox.published", rows = acked.len());
        }
        if !failed.is_empty() {
            lease::release(&self.pool, &failed).await?;
            tracing::warn!(event = "outbox.publish_failed", rows = failed.len(), first_error = %failed[0].1);
        }
        report.published = acked.len();
        report.failed = failed.len();
        Ok(report)
    }

    /// The pre-#1128 drain (compat only): locks held across unconfirmed publishes.
    async fn pass_pre1128(&mut self) -> Result<PassReport, OutboxError> {
        let mut tx = self.pool.begin().await?;
        let rows: Vec<(Uuid, serde_json::Value)> = sqlx::query_as(
            "SELECT id, envelope FROM event_outbox WHERE published_at IS NULL \
             ORDER BY created_at LIMIT $1 FOR UPDATE",
        )
        .bind(i64::from(self.cfg.batch_size))
        .fetch_all(&mut *tx)
        .await?;
        let mut report = PassReport { claimed: rows.len(), ..Default::default() };
        if rows.is_empty() {
            return Ok(report);
        }
        if self.publisher.as_ref().is_none_or(|p| !p.is_usable()) {
            self.publisher = Publisher::connect_unconfirmed(&self.amqp_url, self.publisher_cfg).await.ok();
        }
        for (id, json) in rows {
            let res = match (&self.publisher, EventEnvelope::from_value(json)) {
                (None, _) => Err("connection: broker unreachable".to_owned()),
                (_, Err(e)) => Err(format!("malformed_envelope: {e}")),
                (Some(p), Ok(env)) => p.publish(&env).await.map_err(|e| format!("{}: {e}", e.kind())),
            };
            match res {
                Ok(()) => {
                    sqlx::query("UPDATE event_outbox SET published_at = GREATEST(now(), created_at) WHERE id = $1")
                        .bind(id)
                        .execute(&mut *tx)
                        .await?;
                    report.published += 1;
                }
                Err(err) => {
                    sqlx::query("UPDATE event_outbox SET attempts = attempts + 1, last_error = $2 WHERE id = $1")
                        .bind(id)
                        .bind(err)
                        .execute(&mut *tx)
                        .await?;
                    report.failed += 1;
                }
            }
        }
        tx.commit().await?;
        Ok(report)
    }

    async fn claim(&self) -> Result<Vec<Claimed>, OutboxError> {
        let rows = lease::claim(&self.pool, self.cfg.claim_lease, self.cfg.batch_size).await?;
        let claimed: Vec<Claimed> = rows
            .into_iter()
            .map(|(id, json, prev)| Claimed {
                id,
                envelope: EventEnvelope::from_value(json).map_err(|e| format!("malformed_envelope: {e}")),
                reclaimed: prev.is_some(),
            })
            .collect();
        Ok(claimed)
    }

    async fn publisher(&mut self) -> Result<&Publisher, PublishError> {
        if self.publisher.is_none() {
            self.publisher = Some(Publisher::connect(&self.amqp_url, self.publisher_cfg).await?);
        }
        Ok(self.publisher.as_ref().expect("just set"))
    }
}

/// The three statements of the #1128 claim-lease protocol, each its own short
/// transaction. The worker composes them; tests drive them one by one against a model.
pub mod lease {
    use std::time::Duration;

    use chrono::{DateTime, Utc};
    use sqlx::PgPool;
    use uuid::Uuid;

    /// Claim up to `batch` pending rows, oldest first (`created_at`, then id): rows never
    /// claimed or whose claim is older than `lease`. Returns `(id, envelope, previous
    /// claimed_at)`, in that order; a previous claim means a lease expired.
    pub async fn claim(
        pool: &PgPool,
        lease: Duration,
        batch: u32,
    ) -> Result<Vec<(Uuid, serde_json::Value, Option<DateTime<Utc>>)>, sqlx::Error> {
        let mut rows: Vec<(Uuid, serde_json::Value, Option<DateTime<Utc>>, DateTime<Utc>)> = sqlx::query_as(
            "UPDATE event_outbox o SET claimed_at = now() \
             FROM (SELECT id, claimed_at AS prev FROM event_outbox \
                   WHERE published_at IS NULL \
                     AND (claimed_at IS NULL OR claimed_at < now() - make_interval(secs => $1)) \
                   ORDER BY created_at, id LIMIT $2 FOR UPDATE SKIP LOCKED) c \
             WHERE o.id = c.id \
             RETURNING o.id, o.envelope, c.prev, o.created_at",
        )
        .bind(lease.as_secs_f64())
        .bind(i64::from(batch))
        .fetch_all(pool)
        .await?;
        // RETURNING has no order of its own.
        rows.sort_by_key(|r| (r.3, r.0));
        Ok(rows.into_iter().map(|(id, env, prev, _)| (id, env, prev)).collect())
    }

    /// Stamp `published_at` (the broker ACKed). Unguarded by design (#1185: a double
    /// publish is inbox-deduped), so a stale worker's stamp still counts.
    pub async fn stamp(pool: &PgPool, ids: &[Uuid]) -> Result<u64, sqlx::Error> {
        Ok(sqlx::query(
            "UPDATE event_outbox SET published_at = GREATEST(now(), created_at), claimed_at = NULL WHERE id = ANY($1)",
        )
        .bind(ids)
        .execute(pool)
        .await?
        .rows_affected())
    }

    /// Release failed rows at once: `claimed_at = NULL`, `attempts + 1`, `last_error`.
    pub async fn release(pool: &PgPool, failed: &[(Uuid, String)]) -> Result<u64, sqlx::Error> {
        let (ids, errs): (Vec<Uuid>, Vec<String>) = failed.iter().cloned().unzip();
        Ok(sqlx::query(
            "UPDATE event_outbox o SET claimed_at = NULL, attempts = o.attempts + 1, last_error = f.err \
             FROM unnest($1::uuid[], $2::text[]) AS f(id, err) \
             WHERE o.id = f.id AND o.published_at IS NULL",
        )
        .bind(&ids)
        .bind(&errs)
        .execute(pool)
        .await?
        .rows_affected())
    }
}

/// Rows still waiting for a broker ACK.
pub async fn pending_count(pool: &PgPool) -> Result<i64, sqlx::Error> {
    sqlx::query_scalar("SELECT count(*) FROM event_outbox WHERE published_at IS NULL").fetch_one(pool).await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_doubles_and_caps_at_sixty_seconds() {
        let cfg = OutboxConfig::default();
        let got: Vec<u64> = (0..9).map(|n| backoff(&cfg, n).as_secs()).collect();
        assert_eq!(got, [0, 1, 2, 4, 8, 16, 32, 60, 60]);
        assert_eq!(backoff(&cfg, u32::MAX), Duration::from_secs(60));
    }

    proptest::proptest! {
        /// Backoff never shrinks as failures accumulate and never passes its cap.
        #[test]
        fn backoff_is_monotone_and_capped(base_ms in 1u64..5_000, max_ms in 1u64..120_000, n in 0u32..100) {
            let cfg = OutboxConfig {
                backoff_base: Duration::from_millis(base_ms),
                backoff_max: Duration::from_millis(max_ms),
                ..OutboxConfig::default()
            };
            proptest::prop_assert!(backoff(&cfg, n) <= backoff(&cfg, n + 1));
            proptest::prop_assert!(backoff(&cfg, n + 1) <= cfg.backoff_max);
            proptest::prop_assert!(backoff(&cfg, n + 1) >= cfg.backoff_base.min(cfg.backoff_max));
        }
    }
}
