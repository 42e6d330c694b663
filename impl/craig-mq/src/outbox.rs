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
//!
//! **Pipelined drain.** Inside a drain the passes overlap: two lanes (two confirm channels,
//! each on its own connection) each publish one batch, so one batch's frames go out while the
//! other's confirms come back, and a batch is alone on its channel (returns still match their
//! batch); meanwhile finished batches are stamped/released and the next batch is claimed, each
//! statement on its own pooled connection. Every rule above
//! holds per batch: each statement is its own short transaction, nothing is locked across a
//! publish, and stamps and releases stay fenced by their claim. A drain that stops early
//! (a broker-level failure, the shutdown deadline) hands its pre-claimed batch back at once
//! ([`lease::unclaim`]) instead of leaving it to the lease, and so does a drain whose batch
//! claimed ahead waited longer than `lease - worst-case publish` for a free lane (then it is
//! claimed afresh): a claim's publish always ends inside its lease, as without the pipeline.
//! The crash point `outbox::after_claim` fires only on a drain's first claim, when nothing
//! else is in flight.
//!
//! **LISTEN/NOTIFY (opt-in, `CRAIG_OUTBOX_NOTIFY=1`; the ADR's upgrade path).** Staging
//! sends `pg_notify('craig_outbox', '')` in the staging transaction and a listener connection
//! wakes the worker at once; the poll interval stays the fallback, and a lost listener
//! connection wakes the worker once and reconnects ([`notify`]).

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
    // The LISTEN/NOTIFY upgrade path (see [`notify`]): in the same statement, so the wake-up
    // is delivered exactly when (and only if) the staging transaction commits.
    let sql = if notify::staging_notifies() {
        "WITH staged AS (INSERT INTO event_outbox (id, aggregate_id, event_type, envelope) VALUES ($1, $2, $3, $4) RETURNING 1) \
         SELECT pg_notify('craig_outbox', '') FROM staged"
    } else {
        "INSERT INTO event_outbox (id, aggregate_id, event_type, envelope) VALUES ($1, $2, $3, $4)"
    };
    sqlx::query(sql)
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
    /// Lane 0 (and the pre-1128 drain's unconfirmed publisher): one confirm channel on its
    /// own connection.
    publisher: Option<Publisher>,
    /// Lane 1: the second channel a pipelined drain publishes on, so one batch's frames go out
    /// while the other's confirms come back (returns are matched per channel).
    second: Option<Publisher>,
    failures: u32,
    mode: DrainMode,
    /// The retention prune that runs inside this worker (#965/#1129), if any.
    prune: Option<crate::retention::PruneConfig>,
    /// Wake on `NOTIFY craig_outbox` as well as on the poll interval ([`notify`]).
    notify: bool,
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
        Self { pool, amqp_url: amqp_url.into(), publisher_cfg, cfg, publisher: None, second: None, failures: 0, mode: DrainMode::default(), prune: None, notify: false }
    }

    /// Run the retention prune (`crate::retention`) inside this worker, beside the drain.
    pub fn with_prune(mut self, prune: crate::retention::PruneConfig) -> Self {
        self.prune = Some(prune);
        self
    }

    /// The LISTEN/NOTIFY upgrade path ([`notify`]): a listener connection wakes the worker
    /// as soon as a staging transaction commits; the poll interval stays the fallback. The
    /// producers of this database must stage with [`notify::set_staging_notifies`] on.
    pub fn with_notify(mut self, on: bool) -> Self {
        self.notify = on;
        self
    }

    pub fn with_mode(mut self, mode: DrainMode) -> Self {
        self.mode = mode;
        self
    }

    /// Poll until `shutdown`, then run one last BOUNDED drain so a SIGTERM leaves little
    /// behind that the broker could take: passes stop at a deadline (the poll interval, at
    /// least 5 s) even while other replicas keep the outbox full, and a pass is never cut
    /// in half, so no claim is abandoned to wait out its lease — unless the database or the
    /// broker hangs past the hard stop (`outbox.final_drain_cut`; then claims heal by lease).
    pub async fn run(mut self, shutdown: CancellationToken) {
        let prune = self.prune.take().map(|cfg| tokio::spawn(crate::retention::run(self.pool.clone(), cfg, shutdown.clone())));
        let wake = std::sync::Arc::new(tokio::sync::Notify::new());
        // pre-1128 keeps its tick ("100 a tick"): no wake-ups.
        let notify_on = self.notify && self.mode == DrainMode::ClaimLease;
        let listener = notify_on.then(|| tokio::spawn(notify::listen(self.pool.clone(), wake.clone(), shutdown.clone())));
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
            // A wake-up cuts only the poll short, never a backoff.
            let woken = async {
                if self.failures == 0 { wake.notified().await } else { std::future::pending().await }
            };
            tokio::select! {
                _ = shutdown.cancelled() => break,
                _ = tokio::time::sleep(pause) => {}
                _ = woken => {}
            }
        }
        if let Some(l) = listener {
            let _ = l.await;
        }
        let window = self.cfg.poll_interval.max(Duration::from_secs(5));
        let deadline = tokio::time::Instant::now() + window;
        // The hard stop only guards a pass that hangs past every timeout it has.
        let hard = window + self.publisher_cfg.worst_case_publish() + Duration::from_secs(10);
        let last = tokio::time::timeout(hard, self.drain_until(Stop { deadline: Some(deadline), shutdown: None })).await;
        if last.is_err() {
            // Only a database or broker hanging past every bound gets here: whatever the cut
            // drain held heals by its lease (at-least-once), as after a crash.
            tracing::warn!(event = "outbox.final_drain_cut", after_ms = hard.as_millis() as u64,
                "the final drain hung past its hard stop; its claims heal by lease expiry");
        }
        if let Some(prune) = prune {
            let _ = prune.await;
        }
        tracing::info!(event = "outbox.stopped", final_drain = ?last.ok().and_then(Result::ok));
        for p in [self.publisher.take(), self.second.take()].into_iter().flatten() {
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
        use futures_util::stream::{FuturesUnordered, StreamExt as _};
        let mut report = DrainReport::default();
        if self.mode == DrainMode::Pre1128 {
            let pass = self.pass_pre1128().await?;
            return Ok(DrainReport { passes: 1, published: pass.published, failed: pass.failed, broker_failed: pass.failed });
        }
        let (pool, cfg, pcfg) = (self.pool.clone(), self.cfg, self.publisher_cfg);
        let url = self.amqp_url.clone();
        let batch = cfg.batch_size as usize;
        // The longest a claim may wait before its publish starts: its publish must still end
        // inside the lease, which the settings size for ONE worst-case publish
        // (`settings::check_protocol`). A batch claimed ahead that waited longer (the
        // publishes before it ran long) goes back untried and is claimed afresh.
        let fresh_for = cfg.claim_lease.saturating_sub(pcfg.worst_case_publish());
        // Claim ahead while both lanes are busy only where a batch can afford to wait a whole
        // publish for one (a lease of at least two worst-case publishes, as production's 60 s
        // against 15 s); with a tighter lease a batch is claimed only when a lane is free.
        let can_wait = fresh_for >= pcfg.worst_case_publish();
        // Only the drain's first claim has nothing in flight beside it: the crash point
        // `outbox::after_claim` means "claimed, nothing published" (crate::crash).
        if stop.late() {
            return Ok(report);
        }
        let asked = tokio::time::Instant::now();
        let first = claim(&pool, &cfg).await?;
        if first.is_empty() {
            return Ok(report);
        }
        crash::hit("outbox::after_claim");

        // The pipeline (module doc): two lanes publish (each batch alone on its channel), one
        // batch waits claimed for a free lane, and finished batches settle, all at once.
        let mut lanes: Vec<Option<Publisher>> = vec![self.second.take(), self.publisher.take()];
        let lane_count = lanes.len();
        // The batch claimed and not yet published: its claim time, and whether it had to wait
        // for a lane.
        // Its claim time is when the claim was ASKED for: the lease runs from the database's
        // `now()` inside the statement, never later.
        let mut ready: Option<(Vec<Claimed>, tokio::time::Instant, bool)> = Some((first, asked, false));
        let mut claiming = FuturesUnordered::new();
        // Hand-backs run beside the publishes, never holding them up.
        let mut handing = FuturesUnordered::new();
        let mut publishing = FuturesUnordered::new();
        let mut settling = FuturesUnordered::new();
        // `more`: the last claim came back full. `stopping`: claim nothing more (a broker
        // failure, a stale-only pass, a database error, the deadline or the stop).
        let (mut more, mut stopping) = (true, false);
        let mut error: Option<OutboxError> = None;
        loop {
            stopping |= stop.late();
            if let Some((b, at, waited)) = ready.take() {
                if stopping {
                    handing.push(hand_back(&pool, b));
                } else if lanes.is_empty() {
                    ready = Some((b, at, true));
                } else if waited && at.elapsed() > fresh_for {
                    tracing::warn!(event = "outbox.claim_aged", rows = b.len(), waited_ms = at.elapsed().as_millis() as u64,
                        "a batch claimed ahead waited too long for a free lane; handed back and claimed afresh");
                    more = b.len() >= batch;
                    handing.push(hand_back(&pool, b));
                } else if let Some(lane) = lanes.pop() {
                    more = b.len() >= batch;
                    publishing.push(publish_on(lane, &url, pcfg, &cfg, b));
                }
            }
            if ready.is_none() && claiming.is_empty() && more && !stopping && (can_wait || !lanes.is_empty()) {
                claiming.push(async {
                    let asked = tokio::time::Instant::now();
                    claim(&pool, &cfg).await.map(|b| (b, asked))
                });
            }
            if ready.is_none() && claiming.is_empty() && publishing.is_empty() && settling.is_empty() && handing.is_empty() {
                break;
            }
            tokio::select! {
                Some(()) = handing.next(), if !handing.is_empty() => {}
                Some(claimed) = claiming.next(), if !claiming.is_empty() => match claimed {
                    Ok((b, _)) if b.is_empty() => more = false,
                    Ok((b, at)) => ready = Some((b, at, false)),
                    Err(e) => {
                        error.get_or_insert(e);
                        stopping = true;
                    }
                },
                Some((lane, published)) = publishing.next(), if !publishing.is_empty() => {
                    crash::hit("outbox::after_publish_before_stamp");
                    lanes.push(lane);
                    stopping |= published.broker_failed;
                    settling.push(settle(&pool, published));
                }
                Some(settled) = settling.next(), if !settling.is_empty() => match settled {
                    Ok(p) => {
                        report.add(&p);
                        // Nothing published, nothing refused: every stamp was stale (another
                        // worker won).
                        stopping |= p.published == 0 && p.failed == 0;
                    }
                    Err(e) => {
                        error.get_or_insert(e);
                        stopping = true;
                    }
                },
            }
        }
        debug_assert_eq!(lanes.len(), lane_count, "every lane came back");
        self.publisher = lanes.pop().flatten();
        self.second = lanes.pop().flatten();
        match error {
            Some(e) => Err(e),
            None => Ok(report),
        }
    }

    /// One claim → publish → stamp/release pass, unpipelined (tests drive it step by step).
    pub async fn pass(&mut self) -> Result<PassReport, OutboxError> {
        let claimed = claim(&self.pool, &self.cfg).await?;
        if claimed.is_empty() {
            return Ok(PassReport::default());
        }
        crash::hit("outbox::after_claim");
        let (lane, published) = publish_on(self.publisher.take(), &self.amqp_url, self.publisher_cfg, &self.cfg, claimed).await;
        self.publisher = lane;
        crash::hit("outbox::after_publish_before_stamp");
        settle(&self.pool, published).await
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

}

/// When a drain stops early, checked between passes (a pass is never cut in half).
#[derive(Default, Clone, Copy)]
struct Stop<'a> {
    deadline: Option<tokio::time::Instant>,
    shutdown: Option<&'a CancellationToken>,
}

impl Stop<'_> {
    fn late(&self) -> bool {
        self.deadline.is_some_and(|d| tokio::time::Instant::now() >= d) || self.shutdown.is_some_and(CancellationToken::is_cancelled)
    }
}

impl DrainReport {
    fn add(&mut self, pass: &PassReport) {
        self.passes += 1;
        self.published += pass.published;
        self.failed += pass.failed;
        self.broker_failed += pass.broker_failed;
    }
}

fn row_failure(cfg: &OutboxConfig, c: &Claimed, error: String) -> lease::Failure {
    let attempts = u32::try_from(c.attempts).unwrap_or(0).saturating_add(1);
    lease::Failure { held: c.held, error, retry_in: Some(backoff(cfg, attempts)) }
}

/// Publish one claimed batch on `lane` (connecting it if needed) and sort its rows into
/// ACKed and failed; the lane comes back (None once unusable: the next use reconnects). The
/// batch is the only one on that channel, so returns are matched within it. No database work.
async fn publish_on(
    mut lane: Option<Publisher>,
    amqp_url: &str,
    pcfg: PublisherConfig,
    cfg: &OutboxConfig,
    claimed: Vec<Claimed>,
) -> (Option<Publisher>, Published) {
    let reclaimed = claimed.iter().filter(|c| c.reclaimed).count();
    if reclaimed > 0 {
        tracing::warn!(event = "outbox.lease_expired", rows = reclaimed, "re-claiming rows whose lease expired");
    }
    let mut out = Published { claimed: claimed.len(), reclaimed, ..Default::default() };
    let mut sendable: Vec<Claimed> = Vec::with_capacity(claimed.len());
    for c in claimed {
        match &c.envelope {
            Ok(_) => sendable.push(c),
            Err(why) => {
                let f = row_failure(cfg, &c, why.clone());
                out.failed.push((f, "malformed"));
            }
        }
    }
    if sendable.is_empty() {
        return (lane, out);
    }
    if lane.is_none() {
        match Publisher::connect(amqp_url, pcfg).await {
            Ok(p) => lane = Some(p),
            Err(e) => {
                out.broker_failed = true;
                out.failed.extend(sendable.iter().map(|c| (broker_failure(c, &e), e.kind())));
                return (None, out);
            }
        }
    }
    let publisher = lane.as_ref().expect("connected above");
    let envs: Vec<EventEnvelope> = sendable.iter().filter_map(|c| c.envelope.as_ref().ok().cloned()).collect();
    let results = publisher.publish_batch(&envs).await;
    for (c, res) in sendable.into_iter().zip(results) {
        match res {
            Ok(()) => out.acked.push(c),
            Err(e) if e.is_row_level() => {
                let f = row_failure(cfg, &c, format!("{}: {e}", e.kind()));
                out.failed.push((f, e.kind()));
            }
            Err(e) => {
                out.broker_failed = true;
                out.failed.push((broker_failure(&c, &e), e.kind()));
            }
        }
    }
    if !publisher.is_usable() {
        if let Some(p) = lane.take() {
            // Off the claim's path: the stamp and release must not wait on a dead peer's close.
            tokio::spawn(p.close());
        }
    }
    (lane, out)
}

/// A published batch waiting for its stamp and release.
#[derive(Default)]
struct Published {
    claimed: usize,
    reclaimed: usize,
    acked: Vec<Claimed>,
    failed: Vec<(lease::Failure, &'static str)>,
    /// A broker-level failure (connection, confirm timeout): the drain ends after this batch.
    broker_failed: bool,
}

/// Claim one batch.
async fn claim(pool: &PgPool, cfg: &OutboxConfig) -> Result<Vec<Claimed>, OutboxError> {
    let rows = lease::claim(pool, cfg.claim_lease, cfg.batch_size).await?;
    for r in &rows {
        // Per row, at debug: the claim found the row committed in this outbox (the harness
        // bounds a commit a database failover forgot by it when the stamp never came).
        tracing::debug!(event = "outbox.claimed", envelope_id = %r.id);
    }
    Ok(rows
        .into_iter()
        .map(|r| Claimed {
            held: lease::Held { id: r.id, claim: r.claim },
            envelope: EventEnvelope::from_slice(r.envelope.as_bytes()).map_err(|e| format!("malformed: {e}")),
            reclaimed: r.previous_claim.is_some(),
            attempts: r.attempts,
            created_at: r.created_at,
        })
        .collect())
}

/// A batch claimed ahead that the drain will not publish: released at once, without an
/// attempt counted (it was never tried). Best effort: a row this misses heals by its lease.
async fn hand_back(pool: &PgPool, claimed: Vec<Claimed>) {
    if claimed.is_empty() {
        return;
    }
    let held: Vec<lease::Held> = claimed.iter().map(|c| c.held).collect();
    if let Err(e) = lease::unclaim(pool, &held).await {
        tracing::warn!(event = "outbox.hand_back_failed", rows = held.len(), error = %e, "rows heal by lease expiry");
    }
}

/// Stamp the ACKed rows of one batch and release its failed ones, both fenced by the claim.
async fn settle(pool: &PgPool, batch: Published) -> Result<PassReport, OutboxError> {
    let mut report = PassReport { claimed: batch.claimed, reclaimed: batch.reclaimed, ..Default::default() };
    // Both statements run whatever the other did (a failed stamp must not keep the failed
    // rows claimed: #1128 releases a failed publish at once); the first error is returned.
    let mut first_error: Option<OutboxError> = None;
    if !batch.acked.is_empty() {
        let held: Vec<lease::Held> = batch.acked.iter().map(|c| c.held).collect();
        match lease::stamp(pool, &held).await {
            Err(e) => {
                first_error = Some(e.into());
            }
            Ok(fenced) => stamped(&mut report, &batch, fenced),
        }
    }
    if !batch.failed.is_empty() {
        for (f, kind) in &batch.failed {
            m::publish_error(kind);
            if let Some(retry) = f.retry_in {
                tracing::warn!(event = "outbox.row_refused", envelope_id = %f.held.id, kind, error = %f.error,
                    retry_in_ms = retry.as_millis() as u64, "row stays pending and backs off on its own");
            }
        }
        report.broker_failed = batch.failed.iter().filter(|(f, _)| f.retry_in.is_none()).count();
        let rows: Vec<lease::Failure> = batch.failed.into_iter().map(|(f, _)| f).collect();
        match lease::release(pool, &rows).await {
            Err(e) => {
                first_error.get_or_insert(e.into());
            }
            Ok(fenced) => report.stale += fenced.stale.len(),
        }
        if report.broker_failed > 0 {
            let first = rows.iter().find(|f| f.retry_in.is_none()).map(|f| f.error.as_str()).unwrap_or("");
            tracing::warn!(event = "outbox.publish_failed", rows = report.broker_failed, first_error = %first);
        }
        report.failed = rows.len();
    }
    match first_error {
        Some(e) => Err(e),
        None => Ok(report),
    }
}

/// Account for a stamp: metrics, the per-row `outbox.stamped` lines, stale stamps.
fn stamped(report: &mut PassReport, batch: &Published, fenced: lease::Fenced) {
    let now = chrono::Utc::now();
    for c in batch.acked.iter().filter(|c| fenced.applied.contains(&c.held.id)) {
        m::publish_lag((now - c.created_at).to_std().unwrap_or_default());
    }
    m::published(fenced.applied.len());
    for id in &fenced.applied {
        // Per row, at debug: which replica stamped what (the harness attributes each loss to
        // the replica, and its compat mode, that stamped it).
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
        /// The `envelope` JSONB as text: parsed once, straight into the envelope type.
        pub envelope: String,
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

    /// The claim statement ($1 the lease in seconds, $2 the batch): the partial index
    /// `idx_event_outbox_pending` (`WHERE published_at IS NULL`) serves its scan
    /// (`chaos bench` EXPLAINs it).
    pub const CLAIM_SQL: &str = "UPDATE event_outbox o SET claimed_at = now() \
             FROM (SELECT id, claimed_at AS prev FROM event_outbox \
                   WHERE published_at IS NULL \
                     AND (claimed_at IS NULL OR claimed_at < now() - make_interval(secs => $1)) \
                     AND (next_attempt_at IS NULL OR next_attempt_at <= now()) \
                   ORDER BY created_at, id LIMIT $2 FOR UPDATE SKIP LOCKED) c \
             WHERE o.id = c.id \
             RETURNING o.id, o.envelope::text, c.prev, o.claimed_at, o.attempts, o.created_at";

    /// Claim up to `batch` pending rows, oldest first (`created_at`, then id): rows never
    /// claimed or whose claim is older than `lease`, and not backing off.
    pub async fn claim(pool: &PgPool, lease: Duration, batch: u32) -> Result<Vec<ClaimedRow>, sqlx::Error> {
        type Row = (Uuid, String, Option<DateTime<Utc>>, DateTime<Utc>, i32, DateTime<Utc>);
        let rows: Vec<Row> = sqlx::query_as(CLAIM_SQL)
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
        fenced_set(pool, held, "published_at = GREATEST(now(), o.created_at), claimed_at = NULL, next_attempt_at = NULL").await
    }

    /// `UPDATE … SET <set>` on the rows still under these claims (row AND fence), one
    /// statement; `set` is one of this module's constants, never input.
    async fn fenced_set(pool: &PgPool, held: &[Held], set: &'static str) -> Result<Fenced, sqlx::Error> {
        let (ids, claims): (Vec<Uuid>, Vec<DateTime<Utc>>) = held.iter().map(|h| (h.id, h.claim)).unzip();
        let sql = format!(
            "UPDATE event_outbox o SET {set} \
             FROM unnest($1::uuid[], $2::timestamptz[]) AS h(id, claim) \
             WHERE o.id = h.id AND o.claimed_at = h.claim AND o.published_at IS NULL \
             RETURNING o.id"
        );
        let applied: Vec<Uuid> = sqlx::query_scalar(sqlx::AssertSqlSafe(sql)).bind(&ids).bind(&claims).fetch_all(pool).await?;
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

    /// Hand claims back untried (a drain that claimed ahead and stopped): `claimed_at = NULL`
    /// on the rows still under these claims, no attempt counted.
    pub async fn unclaim(pool: &PgPool, held: &[Held]) -> Result<Fenced, sqlx::Error> {
        fenced_set(pool, held, "claimed_at = NULL").await
    }

    fn split(asked: &[Uuid], applied: Vec<Uuid>) -> Fenced {
        let stale = asked.iter().filter(|id| !applied.contains(id)).copied().collect();
        Fenced { applied, stale }
    }
}

/// The LISTEN/NOTIFY wake-up — the upgrade path ADR-022 names ("Polling-vs-LISTEN/NOTIFY":
/// upgrade when `outbox.depth` p95 > 500 or publish lag p95 > 5 s; keep the polling worker
/// as the fallback). Opt-in with `CRAIG_OUTBOX_NOTIFY=1`.
///
/// - **Producer side.** With [`set_staging_notifies`] on, [`publish_in_tx`] stages the row
///   and `pg_notify('craig_outbox', '')` in one statement of the caller's transaction:
///   PostgreSQL delivers the notification only if that transaction commits, and only after.
/// - **Worker side.** [`listen`] holds ONE dedicated connection (its own one-connection pool,
///   `application_name = craig-outbox-listener`, not the worker's pool) and wakes the worker
///   on every notification. A notification is only a hint: the claim decides what is
///   pending, so a lost, duplicated or early one changes nothing but latency.
/// - **Losing the listener.** A lost connection (`outbox.listener_lost`) wakes the worker
///   once (a notification may have been missed), then the listener reconnects with a 1 s
///   pause between attempts; meanwhile the poll interval drains as before. Nothing is lost,
///   because nothing but the claim ever decides what to publish.
pub mod notify {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::time::Duration;

    use sqlx::PgPool;
    use sqlx::postgres::{PgListener, PgPoolOptions};
    use tokio::sync::Notify;
    use tokio_util::sync::CancellationToken;

    /// The channel staging notifies and the listener listens on (one per database).
    pub const CHANNEL: &str = "craig_outbox";
    /// The listener connection's `application_name` (an operator can find, or kill, it).
    pub const APPLICATION_NAME: &str = "craig-outbox-listener";

    static STAGING_NOTIFIES: AtomicBool = AtomicBool::new(false);

    /// Make every [`super::publish_in_tx`] of this process also `NOTIFY` (process-wide: a
    /// node serves one service database).
    pub fn set_staging_notifies(on: bool) {
        STAGING_NOTIFIES.store(on, Ordering::Relaxed);
    }

    pub fn staging_notifies() -> bool {
        STAGING_NOTIFIES.load(Ordering::Relaxed)
    }

    /// Wake `wake` on every notification until `shutdown` (see the module doc).
    pub async fn listen(pool: PgPool, wake: Arc<Notify>, shutdown: CancellationToken) {
        let opts = (*pool.connect_options()).clone().application_name(APPLICATION_NAME);
        let own = PgPoolOptions::new()
            .max_connections(1)
            .min_connections(0)
            .max_lifetime(None)
            .idle_timeout(None)
            .acquire_timeout(Duration::from_secs(5))
            .connect_lazy_with(opts);
        loop {
            let started = async {
                let mut l = PgListener::connect_with(&own).await?;
                l.ignore_pool_close_event(true);
                l.listen(CHANNEL).await?;
                Ok::<_, sqlx::Error>(l)
            };
            let l = tokio::select! {
                _ = shutdown.cancelled() => return,
                l = started => l,
            };
            match l {
                Ok(l) => {
                    tracing::info!(event = "outbox.listener_started", channel = CHANNEL);
                    // Anything staged while no one listened is drained now.
                    wake.notify_one();
                    if !serve(l, &wake, &shutdown).await {
                        return;
                    }
                    // Lost: a notification may have been missed.
                    wake.notify_one();
                }
                Err(e) => tracing::warn!(event = "outbox.listener_failed", error = %e, "polling carries on; retrying in 1 s"),
            }
            tokio::select! {
                _ = shutdown.cancelled() => return,
                _ = tokio::time::sleep(Duration::from_secs(1)) => {}
            }
        }
    }

    /// Relay notifications until the connection is lost (`true`) or `shutdown` (`false`).
    async fn serve(mut l: PgListener, wake: &Notify, shutdown: &CancellationToken) -> bool {
        l.eager_reconnect(false);
        loop {
            let got = tokio::select! {
                _ = shutdown.cancelled() => return false,
                got = l.try_recv() => got,
            };
            match got {
                Ok(Some(_)) => wake.notify_one(),
                Ok(None) => {
                    tracing::warn!(event = "outbox.listener_lost", "listener connection lost; polling until it is back");
                    return true;
                }
                Err(e) => {
                    tracing::warn!(event = "outbox.listener_lost", error = %e, "listener connection failed; polling until it is back");
                    return true;
                }
            }
        }
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
