//! Transactional outbox — ADR-022 §D1, as reworked by Amendment #1128 (claim-lease drain +
//! publisher confirms).
//!
//! **Staging.** [`publish_in_tx`] validates the envelope and writes it to `event_outbox`
//! inside the caller's transaction: if the domain write rolls back, the staged envelope rolls
//! back with it; an envelope the worker could never publish is refused and nothing is staged.
//!
//! **Draining** ([`OutboxWorker`]), one pass:
//! 1. CLAIM up to `batch_size` pending rows in one short statement
//!    (`FOR UPDATE SKIP LOCKED` + `claimed_at = now()`); rows whose claim is older than the
//!    lease (60 s) are claimable again — that is how a crash between claim and stamp heals.
//!    The `claimed_at` a claim stamps is that worker's fence ([`lease::Held`]).
//! 2. PUBLISH them with no locks, no open transaction and no pooled connection held,
//!    pipelined, `mandatory`, each awaited to its publisher confirm.
//! 3. STAMP `published_at` on the ACKed rows; RELEASE the rest at once (`claimed_at = NULL`,
//!    `attempts + 1`, `last_error`). Both are fenced by the claim: a worker whose lease
//!    expired and was re-claimed changes nothing ([`lease::Fenced::stale`]).
//!
//! **Failures.** A row the broker refused on its own (Nack, returned as unroutable) or that is
//! not a valid envelope is a ROW-level failure: it backs off alone (`next_attempt_at`,
//! `base × 2^(attempts-1)` capped at the max) and the drain goes on past it. A connection
//! failure or a missing confirm is BROKER-level: it ends the drain and backs the worker off.
//! A row that can never be published stays pending with its reason, counted in
//! `outbox_depth` and logged with its id on every refusal — never stamped, never deleted.
//!
//! The worker repeats passes until one comes back short (#1128: no throughput ceiling), then
//! sleeps the poll interval (1 s). At-least-once: a crash after the ACK and before the stamp
//! re-publishes after lease expiry; the inbox is the consumer-side boundary.

use std::time::Duration;

use sqlx::{PgPool, Postgres, Transaction};
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

use crate::crash;
use crate::envelope::{EnvelopeError, EventEnvelope};
use crate::metrics as m;
use crate::publisher::{PublishError, Publisher, PublisherConfig};

/// Stage `envelope` in the caller's transaction (§D1 `publish_in_tx`). The outbox row id
/// is the envelope id, so a row and its message correlate one to one.
///
/// The envelope is validated first ([`EventEnvelope::validate_storable`]): one the worker
/// could never publish is refused with `sqlx::Error::Encode` carrying the typed
/// [`EnvelopeError`] (see [`refused_envelope`]) and nothing is staged. The ADR's signature
/// (`Result<(), sqlx::Error>`) is kept, so every caller's `?` still works.
pub async fn publish_in_tx(tx: &mut Transaction<'_, Postgres>, envelope: &EventEnvelope) -> Result<(), sqlx::Error> {
    envelope.validate_storable().map_err(|e| sqlx::Error::Encode(Box::new(e)))?;
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

/// The [`EnvelopeError`] for which [`publish_in_tx`] refused to stage, if that was the error.
pub fn refused_envelope(e: &sqlx::Error) -> Option<&EnvelopeError> {
    match e {
        sqlx::Error::Encode(inner) => inner.downcast_ref::<EnvelopeError>(),
        _ => None,
    }
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
    /// Claimed rows released unpublished (row-level and broker-level failures together).
    pub failed: usize,
    /// Of `failed`: broker-level failures (connection, confirm timeout), which end the drain.
    pub broker_failed: usize,
    /// Claimed rows whose previous claim had expired (a crashed or stalled worker's rows).
    pub reclaimed: usize,
    /// Stamps and releases the fence refused: another worker re-claimed the row meanwhile.
    pub stale: usize,
}

/// What one drain (passes until a short pass, a broker failure or no progress) did.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct DrainReport {
    pub passes: usize,
    pub published: usize,
    pub failed: usize,
    pub broker_failed: usize,
}

struct Claimed {
    held: lease::Held,
    envelope: Result<EventEnvelope, String>,
    reclaimed: bool,
    attempts: i32,
    created_at: chrono::DateTime<chrono::Utc>,
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
    /// The retention prune that runs inside this worker (#965/#1129), if any.
    prune: Option<crate::retention::PruneConfig>,
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
        Self { pool, amqp_url: amqp_url.into(), publisher_cfg, cfg, publisher: None, failures: 0, mode: DrainMode::default(), prune: None }
    }

    /// Run the retention prune (`crate::retention`) inside this worker, beside the drain.
    pub fn with_prune(mut self, prune: crate::retention::PruneConfig) -> Self {
        self.prune = Some(prune);
        self
    }

    pub fn with_mode(mut self, mode: DrainMode) -> Self {
        self.mode = mode;
        self
    }

    /// Poll until `shutdown`, then run one last BOUNDED drain so a SIGTERM leaves little
    /// behind that the broker could take: passes stop at a deadline (the poll interval, at
    /// least 5 s) even while other replicas keep the outbox full, and a pass is never cut
    /// in half, so no claim is abandoned to wait out its lease.
    pub async fn run(mut self, shutdown: CancellationToken) {
        let prune = self.prune.take().map(|cfg| tokio::spawn(crate::retention::run(self.pool.clone(), cfg, shutdown.clone())));
        loop {
            // A drain other replicas keep full must still notice the stop between passes.
            let pause = match self.drain_until(Stop { deadline: None, shutdown: Some(&shutdown) }).await {
                Ok(r) if r.broker_failed == 0 => {
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
            self.record_depth().await;
            tokio::select! {
                _ = shutdown.cancelled() => break,
                _ = tokio::time::sleep(pause) => {}
            }
        }
        let window = self.cfg.poll_interval.max(Duration::from_secs(5));
        let deadline = tokio::time::Instant::now() + window;
        // The hard stop only guards a pass that hangs past every timeout it has.
        let hard = window + self.publisher_cfg.worst_case_publish() + Duration::from_secs(10);
        let last = tokio::time::timeout(hard, self.drain_until(Stop { deadline: Some(deadline), shutdown: None })).await;
        if let Some(prune) = prune {
            let _ = prune.await;
        }
        tracing::info!(event = "outbox.stopped", final_drain = ?last.ok().and_then(Result::ok));
        if let Some(p) = self.publisher.take() {
            p.close().await;
        }
    }

    /// Passes until one comes back short or meets a broker-level failure (#1128: no
    /// throughput ceiling). Row-level refusals never stop it: each refused row leaves the
    /// claimable set for its own backoff (which doubles), so even a full batch of refused
    /// rows makes room for the healthy rows behind it in the next pass.
    pub async fn drain(&mut self) -> Result<DrainReport, OutboxError> {
        self.drain_until(Stop::default()).await
    }

    async fn drain_until(&mut self, stop: Stop<'_>) -> Result<DrainReport, OutboxError> {
        let mut report = DrainReport::default();
        if self.mode == DrainMode::Pre1128 {
            let pass = self.pass_pre1128().await?;
            return Ok(DrainReport { passes: 1, published: pass.published, failed: pass.failed, broker_failed: pass.failed });
        }
        loop {
            let pass = self.pass().await?;
            report.passes += 1;
            report.published += pass.published;
            report.failed += pass.failed;
            report.broker_failed += pass.broker_failed;
            let short = pass.claimed < self.cfg.batch_size as usize;
            // Nothing published, nothing refused: every stamp was stale (another worker won).
            let stuck = pass.published == 0 && pass.failed == 0;
            let late = stop.deadline.is_some_and(|d| tokio::time::Instant::now() >= d)
                || stop.shutdown.is_some_and(CancellationToken::is_cancelled);
            if short || stuck || pass.broker_failed > 0 || late {
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

        let mut failed: Vec<(lease::Failure, &'static str)> = Vec::new();
        let mut sendable: Vec<(&Claimed, EventEnvelope)> = Vec::with_capacity(claimed.len());
        for c in &claimed {
            match &c.envelope {
                Ok(env) => sendable.push((c, env.clone())),
                Err(why) => failed.push((self.row_failure(c, why.clone()), "malformed")),
            }
        }

        let mut acked: Vec<&Claimed> = Vec::with_capacity(sendable.len());
        if !sendable.is_empty() {
            match self.publisher().await {
                Ok(publisher) => {
                    let envs: Vec<EventEnvelope> = sendable.iter().map(|(_, e)| e.clone()).collect();
                    let results = publisher.publish_batch(&envs).await;
                    for ((c, _), res) in sendable.into_iter().zip(results) {
                        match res {
                            Ok(()) => acked.push(c),
                            Err(e) if e.is_row_level() => {
                                failed.push((self.row_failure(c, format!("{}: {e}", e.kind())), e.kind()));
                            }
                            Err(e) => failed.push((broker_failure(c, &e), e.kind())),
                        }
                    }
                }
                Err(e) => {
                    failed.extend(sendable.into_iter().map(|(c, _)| (broker_failure(c, &e), e.kind())));
                }
            }
            if self.publisher.as_ref().is_some_and(|p| !p.is_usable()) {
                if let Some(p) = self.publisher.take() {
                    // Off the claim's path: the stamp and release below must not wait on a
                    // dead peer's close.
                    tokio::spawn(p.close());
                }
            }
        }
        crash::hit("outbox::after_publish_before_stamp");

        if !acked.is_empty() {
            let held: Vec<lease::Held> = acked.iter().map(|c| c.held).collect();
            let fenced = lease::stamp(&self.pool, &held).await?;
            let now = chrono::Utc::now();
            for c in acked.iter().filter(|c| fenced.applied.contains(&c.held.id)) {
                m::publish_lag((now - c.created_at).to_std().unwrap_or_default());
            }
            m::published(fenced.applied.len());
            for id in &fenced.applied {
                // Per row, at debug: which replica stamped what (the harness attributes
                // each loss to the replica, and its compat mode, that stamped it).
                tracing::debug!(event = "outbox.stamped", envelope_id = %id);
            }
            report.published = fenced.applied.len();
            report.stale += fenced.stale.len();
            if !fenced.stale.is_empty() {
                tracing::warn!(event = "outbox.stamp_stale", rows = fenced.stale.len(), first = %fenced.stale[0],
                    "broker ACKed rows another worker has re-claimed; its claim stands (at-least-once)");
            }
            tracing::debug!(event = "outbox.published", rows = fenced.applied.len());
        }
        if !failed.is_empty() {
            for (f, kind) in &failed {
                m::publish_error(kind);
                if let Some(retry) = f.retry_in {
                    tracing::warn!(event = "outbox.row_refused", envelope_id = %f.held.id, kind, error = %f.error,
                        retry_in_ms = retry.as_millis() as u64, "row stays pending and backs off on its own");
                }
            }
            report.broker_failed = failed.iter().filter(|(f, _)| f.retry_in.is_none()).count();
            let rows: Vec<lease::Failure> = failed.into_iter().map(|(f, _)| f).collect();
            let fenced = lease::release(&self.pool, &rows).await?;
            report.stale += fenced.stale.len();
            if report.broker_failed > 0 {
                let first = rows.iter().find(|f| f.retry_in.is_none()).map(|f| f.error.as_str()).unwrap_or("");
                tracing::warn!(event = "outbox.publish_failed", rows = report.broker_failed, first_error = %first);
            }
            report.failed = rows.len();
        }
        Ok(report)
    }

    fn row_failure(&self, c: &Claimed, error: String) -> lease::Failure {
        let attempts = u32::try_from(c.attempts).unwrap_or(0).saturating_add(1);
        lease::Failure { held: c.held, error, retry_in: Some(backoff(&self.cfg, attempts)) }
    }

    /// Update the `outbox_depth` gauge (rows still waiting for a broker ACK).
    async fn record_depth(&self) {
        if let Ok(n) = pending_count(&self.pool).await {
            m::outbox_depth(n);
        }
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
        let mut stamped = Vec::new();
        for (id, json) in rows {
            let res = match (&self.publisher, EventEnvelope::from_value(json)) {
                (None, _) => Err("connection: broker unreachable".to_owned()),
                (_, Err(e)) => Err(format!("malformed: {e}")),
                (Some(p), Ok(env)) => p.publish(&env).await.map_err(|e| format!("{}: {e}", e.kind())),
            };
            match res {
                Ok(()) => {
                    sqlx::query("UPDATE event_outbox SET published_at = GREATEST(now(), created_at) WHERE id = $1")
                        .bind(id)
                        .execute(&mut *tx)
                        .await?;
                    stamped.push(id);
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
        m::published(report.published);
        if report.failed > 0 {
            tracing::warn!(event = "outbox.publish_failed", rows = report.failed, mode = "pre-1128");
        }
        for id in &stamped {
            tracing::debug!(event = "outbox.stamped", envelope_id = %id);
        }
        Ok(report)
    }

    async fn claim(&self) -> Result<Vec<Claimed>, OutboxError> {
        let rows = lease::claim(&self.pool, self.cfg.claim_lease, self.cfg.batch_size).await?;
        let claimed: Vec<Claimed> = rows
            .into_iter()
            .map(|r| Claimed {
                held: lease::Held { id: r.id, claim: r.claim },
                envelope: EventEnvelope::from_value(r.envelope).map_err(|e| format!("malformed: {e}")),
                reclaimed: r.previous_claim.is_some(),
                attempts: r.attempts,
                created_at: r.created_at,
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

/// When a drain stops early, checked between passes (a pass is never cut in half).
#[derive(Default, Clone, Copy)]
struct Stop<'a> {
    deadline: Option<tokio::time::Instant>,
    shutdown: Option<&'a CancellationToken>,
}

fn broker_failure(c: &Claimed, e: &PublishError) -> lease::Failure {
    lease::Failure { held: c.held, error: format!("{}: {e}", e.kind()), retry_in: None }
}

/// The three statements of the #1128 claim-lease protocol, each its own short
/// transaction. The worker composes them; tests drive them one by one against a model.
///
/// **Fencing.** A claim stamps `claimed_at = now()`, and that value is the claiming
/// worker's fence ([`Held`]). A row is re-claimable only once `claimed_at` is older than
/// the lease, so a re-claim always stamps a strictly later value. [`stamp`] and [`release`]
/// match the row AND the fence: a worker whose lease expired and whose row was re-claimed
/// changes nothing and is told so ([`Fenced::stale`]) — it can no longer clear a live claim
/// of another worker, which would let a third worker publish a row still in flight.
pub mod lease {
    use std::time::Duration;

    use chrono::{DateTime, Utc};
    use sqlx::PgPool;
    use uuid::Uuid;

    /// One row a claim returned.
    #[derive(Debug, Clone)]
    pub struct ClaimedRow {
        pub id: Uuid,
        pub envelope: serde_json::Value,
        /// The claim this one replaced: `Some` means a lease expired.
        pub previous_claim: Option<DateTime<Utc>>,
        /// The `claimed_at` this claim stamped: the fence for [`stamp`] and [`release`].
        pub claim: DateTime<Utc>,
        pub attempts: i32,
        pub created_at: DateTime<Utc>,
    }

    /// A claim a worker holds: the row and the `claimed_at` its claim stamped.
    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    pub struct Held {
        pub id: Uuid,
        pub claim: DateTime<Utc>,
    }

    /// What a fenced statement did, row by row: Applied, or Stale (the row is no longer
    /// under this claim — re-claimed by another worker, or already published).
    #[derive(Debug, Clone, Default, PartialEq, Eq)]
    pub struct Fenced {
        pub applied: Vec<Uuid>,
        pub stale: Vec<Uuid>,
    }

    /// A claimed row to release unpublished.
    #[derive(Debug, Clone)]
    pub struct Failure {
        pub held: Held,
        pub error: String,
        /// Row-level refusal: claimable again only after this long (`next_attempt_at`).
        /// `None`: a broker-level failure, claimable at once (the worker backs off instead).
        pub retry_in: Option<Duration>,
    }

    /// Claim up to `batch` pending rows, oldest first (`created_at`, then id): rows never
    /// claimed or whose claim is older than `lease`, and not backing off.
    pub async fn claim(pool: &PgPool, lease: Duration, batch: u32) -> Result<Vec<ClaimedRow>, sqlx::Error> {
        type Row = (Uuid, serde_json::Value, Option<DateTime<Utc>>, DateTime<Utc>, i32, DateTime<Utc>);
        let rows: Vec<Row> = sqlx::query_as(
            "UPDATE event_outbox o SET claimed_at = now() \
             FROM (SELECT id, claimed_at AS prev FROM event_outbox \
                   WHERE published_at IS NULL \
                     AND (claimed_at IS NULL OR claimed_at < now() - make_interval(secs => $1)) \
                     AND (next_attempt_at IS NULL OR next_attempt_at <= now()) \
                   ORDER BY created_at, id LIMIT $2 FOR UPDATE SKIP LOCKED) c \
             WHERE o.id = c.id \
             RETURNING o.id, o.envelope, c.prev, o.claimed_at, o.attempts, o.created_at",
        )
        .bind(lease.as_secs_f64())
        .bind(i64::from(batch))
        .fetch_all(pool)
        .await?;
        let mut rows: Vec<ClaimedRow> = rows
            .into_iter()
            .map(|(id, envelope, previous_claim, claim, attempts, created_at)| ClaimedRow {
                id,
                envelope,
                previous_claim,
                claim,
                attempts,
                created_at,
            })
            .collect();
        // RETURNING has no order of its own.
        rows.sort_by_key(|r| (r.created_at, r.id));
        Ok(rows)
    }

    /// Stamp `published_at` (the broker ACKed) on the rows still under these claims.
    pub async fn stamp(pool: &PgPool, held: &[Held]) -> Result<Fenced, sqlx::Error> {
        let (ids, claims): (Vec<Uuid>, Vec<DateTime<Utc>>) = held.iter().map(|h| (h.id, h.claim)).unzip();
        let applied: Vec<Uuid> = sqlx::query_scalar(
            "UPDATE event_outbox o SET published_at = GREATEST(now(), o.created_at), claimed_at = NULL, \
                    next_attempt_at = NULL \
             FROM unnest($1::uuid[], $2::timestamptz[]) AS h(id, claim) \
             WHERE o.id = h.id AND o.claimed_at = h.claim AND o.published_at IS NULL \
             RETURNING o.id",
        )
        .bind(&ids)
        .bind(&claims)
        .fetch_all(pool)
        .await?;
        Ok(split(&ids, applied))
    }

    /// Release failed rows still under these claims: `claimed_at = NULL`, `attempts + 1`,
    /// `last_error`, and for a row-level refusal `next_attempt_at = now() + retry_in`.
    pub async fn release(pool: &PgPool, failed: &[Failure]) -> Result<Fenced, sqlx::Error> {
        let ids: Vec<Uuid> = failed.iter().map(|f| f.held.id).collect();
        let claims: Vec<DateTime<Utc>> = failed.iter().map(|f| f.held.claim).collect();
        let errs: Vec<String> = failed.iter().map(|f| f.error.clone()).collect();
        // -1: no row backoff (a broker-level failure).
        let retry: Vec<f64> = failed.iter().map(|f| f.retry_in.map_or(-1.0, |d| d.as_secs_f64())).collect();
        let applied: Vec<Uuid> = sqlx::query_scalar(
            "UPDATE event_outbox o SET claimed_at = NULL, attempts = o.attempts + 1, last_error = f.err, \
                    next_attempt_at = CASE WHEN f.retry < 0 THEN NULL ELSE now() + make_interval(secs => f.retry) END \
             FROM unnest($1::uuid[], $2::timestamptz[], $3::text[], $4::float8[]) AS f(id, claim, err, retry) \
             WHERE o.id = f.id AND o.claimed_at = f.claim AND o.published_at IS NULL \
             RETURNING o.id",
        )
        .bind(&ids)
        .bind(&claims)
        .bind(&errs)
        .bind(&retry)
        .fetch_all(pool)
        .await?;
        Ok(split(&ids, applied))
    }

    fn split(asked: &[Uuid], applied: Vec<Uuid>) -> Fenced {
        let stale = asked.iter().filter(|id| !applied.contains(id)).copied().collect();
        Fenced { applied, stale }
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
