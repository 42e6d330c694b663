//! Idempotent inbox — ADR-022 §D2, with the #1180 correction and the #1196 consumer-queue
//! identity.
//!
//! [`handle_idempotently`]: an atomic `INSERT … ON CONFLICT DO NOTHING` records the
//! envelope; if the envelope was already recorded AND stamped `processed_at`, the handler
//! is skipped (a dedup hit). Otherwise the handler runs and, on success, `processed_at` is
//! stamped (a failed stamp is tried again for up to [`STAMP_RETRY_FOR`]).
//!
//! **The #1180 boundary, stated plainly:** this is best-effort at-least-once, NOT
//! exactly-once. The inbox opens no transaction around the handler: the handler's own
//! commit and the `processed_at` stamp are separate commits. A crash between them (crash
//! point `inbox::after_handler_before_stamp`) leaves the row unstamped, and the redelivery
//! re-runs a handler that already succeeded. Two concurrent deliveries of one envelope
//! (two replicas, before either stamps) can likewise both run it. A consumer session runs
//! up to `CRAIG_CONSUMER_CONCURRENCY` handlers at once (default: the prefetch, 32;
//! `subscriber`), so ONE crash of a replica can leave up to that many envelopes inside this
//! window at the same time; with concurrency 1, at most one. Handlers with
//! non-replayable side effects must carry their own arbiter (ADR-022 #1179).
//! Exactly-once is the #1178 redesign, not this module.
//!
//! **The retry cap and the app path (§D3, #1196, #1181).** A consumer counts transient
//! failures per envelope ([`RetryCap`]); at the cap it calls [`Surface::surface_to_dlx`]
//! with its own queue name, which publishes the `_dlx` wrapper to `craig.dlx` under
//! `dlq.<consumer-queue>` with a token derived from this inbox's `received_at`.

use std::future::Future;

use sqlx::PgPool;

use crate::crash;
use crate::envelope::EventEnvelope;

/// What [`handle_idempotently`] did with an envelope.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum InboxOutcome {
    /// First sighting; the handler ran and `processed_at` is stamped.
    Processed,
    /// Recorded before but never stamped (an earlier handler failure or a crash inside the
    /// #1180 window); the handler ran again and `processed_at` is now stamped.
    Reprocessed,
    /// Already processed: the handler was skipped.
    Duplicate,
}

#[derive(Debug, thiserror::Error)]
pub enum InboxError<E: std::error::Error + 'static> {
    #[error("inbox database error: {0}")]
    Db(#[from] sqlx::Error),
    /// The handler failed; the inbox row stays unstamped so a redelivery retries it.
    #[error("handler failed for envelope on {queue}: {source}")]
    Handler { queue: String, source: E },
}

/// Run `handler` for `envelope` at most once per successful stamp (see the module doc for
/// the exact, at-least-once boundary). `consumer_queue` is the queue the delivery came from
/// (#1196): it names the consumer in logs and errors; the dedup key is the envelope id.
pub async fn handle_idempotently<F, Fut, E>(
    db: &PgPool,
    envelope: &EventEnvelope,
    consumer_queue: &str,
    handler: F,
) -> Result<InboxOutcome, InboxError<E>>
where
    F: FnOnce(EventEnvelope) -> Fut,
    Fut: Future<Output = Result<(), E>>,
    E: std::error::Error + 'static,
{
    let inserted = sqlx::query(
        "INSERT INTO event_inbox (envelope_id, source_service, event_type) VALUES ($1, $2, $3) \
         ON CONFLICT (envelope_id) DO NOTHING",
    )
    .bind(envelope.id)
    .bind(&envelope.source_service)
    .bind(&envelope.event_type)
    .execute(db)
    .await?
    .rows_affected()
        == 1;

    if !inserted {
        let processed: Option<bool> =
            sqlx::query_scalar("SELECT processed_at IS NOT NULL FROM event_inbox WHERE envelope_id = $1")
                .bind(envelope.id)
                .fetch_optional(db)
                .await?;
        // None: pruned between the two statements — treat as unseen and run the handler.
        if processed == Some(true) {
            tracing::debug!(event = "inbox.dedup_hit", envelope_id = %envelope.id, queue = consumer_queue);
            crate::metrics::inbox(InboxOutcome::Duplicate);
            return Ok(InboxOutcome::Duplicate);
        }
    }

    handler(envelope.clone())
        .await
        .map_err(|source| InboxError::Handler { queue: consumer_queue.to_owned(), source })?;
    crash::hit("inbox::after_handler_before_stamp");

    stamp(db, envelope, consumer_queue).await?;
    let outcome = if inserted { InboxOutcome::Processed } else { InboxOutcome::Reprocessed };
    if outcome == InboxOutcome::Reprocessed {
        tracing::info!(event = "inbox.reprocessed", envelope_id = %envelope.id, queue = consumer_queue,
            "envelope seen before without processed_at; handler ran again (#1180 window)");
    }
    crate::metrics::inbox(outcome);
    Ok(outcome)
}

/// How long [`stamp`] keeps trying, attempts included, before it gives the delivery back:
/// well inside a stopping node's grace (the harness allows 15 s), so a drain never waits
/// longer on it.
pub const STAMP_RETRY_FOR: std::time::Duration = std::time::Duration::from_secs(8);

/// `processed_at` for a handler that succeeded. The UPDATE is idempotent, so a failed one is
/// tried again (backing off 50 ms to 1 s) until [`STAMP_RETRY_FOR`] has passed, each attempt
/// bounded by what is left of it: the #1180 window is a crash between the handler's commit
/// and this stamp, and a stamp that merely waited for a pooled connection (seen: a consumer's
/// pool timed out for seconds after a database pause, its backlog of 32 handlers competing,
/// and every such envelope ran twice) must not widen it. Each failed attempt is logged
/// (`inbox.stamp_retry`, the envelope's stamp still pending). Past that time (the database
/// really is gone) the error is returned, the delivery is retried, and the handler re-runs:
/// the ADR's residue. A closed pool (the node stopping) is returned at once.
async fn stamp(db: &PgPool, envelope: &EventEnvelope, consumer_queue: &str) -> Result<(), sqlx::Error> {
    let started = tokio::time::Instant::now();
    let mut backoff = std::time::Duration::from_millis(50);
    loop {
        let left = STAMP_RETRY_FOR.saturating_sub(started.elapsed());
        let attempt = sqlx::query("UPDATE event_inbox SET processed_at = now() WHERE envelope_id = $1 AND processed_at IS NULL")
            .bind(envelope.id)
            .execute(db);
        let error = match tokio::time::timeout(left, attempt).await {
            Ok(Ok(_)) => return Ok(()),
            Ok(Err(e)) => e,
            Err(_) => sqlx::Error::PoolTimedOut,
        };
        if matches!(error, sqlx::Error::PoolClosed) || started.elapsed() + backoff >= STAMP_RETRY_FOR {
            return Err(error);
        }
        tracing::warn!(event = "inbox.stamp_retry", envelope_id = %envelope.id, queue = consumer_queue, error = %error,
            backoff_ms = backoff.as_millis() as u64, "the handler succeeded; processed_at not stamped yet, trying again");
        tokio::time::sleep(backoff).await;
        backoff = (backoff * 2).min(std::time::Duration::from_secs(1));
    }
}

// ---------------------------------------------------------------------------------------
// The retry cap and the app dead-letter path (§D3 with #1196, #1181)
// ---------------------------------------------------------------------------------------

/// Transient failures per envelope, so a handler that keeps failing one envelope is
/// surfaced to `craig.dlx` after `cap` attempts instead of being requeued forever (§D3 app
/// path). Kept in memory per consumer: a restart starts the count again, so the cap is a
/// lower bound on attempts, never an upper one (nothing is surfaced early).
#[derive(Debug)]
pub struct RetryCap {
    cap: u32,
    failures: std::sync::Mutex<std::collections::HashMap<uuid::Uuid, u32>>,
}

impl RetryCap {
    /// Envelopes tracked at once; past it the counts start over (lower bound, see above).
    const MAX_TRACKED: usize = 100_000;

    pub fn new(cap: u32) -> Self {
        Self { cap: cap.max(1), failures: Default::default() }
    }

    pub fn cap(&self) -> u32 {
        self.cap
    }

    /// Count one more transient failure of `id`; `true` once it has failed `cap` times.
    pub fn failed(&self, id: uuid::Uuid) -> bool {
        let mut m = self.failures.lock().expect("retry-cap lock");
        if m.len() >= Self::MAX_TRACKED {
            m.clear();
        }
        let n = m.entry(id).or_default();
        *n += 1;
        *n >= self.cap
    }

    /// `id` succeeded or was surfaced: forget it.
    pub fn settled(&self, id: uuid::Uuid) {
        self.failures.lock().expect("retry-cap lock").remove(&id);
    }
}

/// The behaviours the compat twins bring back on the app path.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SurfaceMode {
    /// `pre-1196`: keyed by the PRODUCER (`craig-<source_service>`), not the consumer queue.
    pub producer_keyed: bool,
    /// `pre-1181`: the token is minted per call (now), so a retried surface of the same
    /// failure is a second occurrence.
    pub token_per_call: bool,
}

#[derive(Debug, thiserror::Error)]
pub enum SurfaceError {
    #[error("inbox database error: {0}")]
    Db(#[from] sqlx::Error),
    /// The token derives from the inbox row (#1181); without one there is nothing stable to
    /// name the occurrence by, so the envelope is not surfaced (it stays on its queue).
    #[error("envelope {0} has no inbox row to derive its occurrence token from")]
    NoInboxRow(uuid::Uuid),
    #[error("occurrence token: {0}")]
    Token(#[from] crate::dlq::TokenError),
    #[error("dead-letter publish: {0}")]
    Publish(#[from] crate::publisher::PublishError),
}

/// The app path's publisher to `craig.dlx`: connected on first use, replaced when a
/// timeout or connection error poisoned it.
pub struct Surface {
    amqp_url: String,
    cfg: crate::publisher::PublisherConfig,
    mode: SurfaceMode,
    publisher: tokio::sync::Mutex<Option<crate::publisher::Publisher>>,
}

impl Surface {
    pub fn new(amqp_url: &str, cfg: crate::publisher::PublisherConfig, mode: SurfaceMode) -> Self {
        Self { amqp_url: amqp_url.to_owned(), cfg, mode, publisher: tokio::sync::Mutex::new(None) }
    }

    /// `surface_to_dlx` (§D3, #1196, #1181): publish `envelope` in the versioned `_dlx`
    /// wrapper (`v: 1`) to `craig.dlx` under `dlq.<consumer_queue>`, with `original_queue` =
    /// the consumer queue and `source_service` as provenance only, and wait for the
    /// broker's confirm. Its token is `dlxcap:{envelope_id}:{consumer_queue}:{received_at}`
    /// from the inbox row, which exists before any publish: a retried surface (a lost
    /// confirm, an ack that failed after it) re-derives the same token and the DLQ consumer
    /// absorbs the duplicate. `Ok` means the dead letter is on `craig.dlx`; only then may
    /// the delivery be acked.
    pub async fn surface_to_dlx(
        &self,
        db: &PgPool,
        envelope: &EventEnvelope,
        consumer_queue: &str,
        reason: &str,
    ) -> Result<crate::dlq::OccurrenceToken, SurfaceError> {
        let key = if self.mode.producer_keyed { format!("craig-{}", envelope.source_service) } else { consumer_queue.to_owned() };
        let received_at: Option<chrono::DateTime<chrono::Utc>> =
            sqlx::query_scalar("SELECT received_at FROM event_inbox WHERE envelope_id = $1")
                .bind(envelope.id)
                .fetch_optional(db)
                .await?;
        let received_at = received_at.ok_or(SurfaceError::NoInboxRow(envelope.id))?;
        let at = if self.mode.token_per_call { chrono::Utc::now() } else { received_at };
        let token = crate::dlq::OccurrenceToken::dlxcap(envelope.id, &key, at)?;
        let body = crate::dlq::DlxWrapper::new(&token, &key, reason, envelope.clone()).to_vec();
        let routing_key = crate::topology::dlq_routing_key(&key);

        let mut slot = self.publisher.lock().await;
        if !slot.as_ref().is_some_and(crate::publisher::Publisher::is_usable) {
            if let Some(old) = slot.take() {
                old.close().await;
            }
            *slot = Some(crate::publisher::Publisher::connect(&self.amqp_url, self.cfg).await?);
        }
        let publisher = slot.as_ref().expect("connected above");
        publisher.publish_raw(crate::topology::DLX_EXCHANGE, &routing_key, &body, envelope.id).await?;
        tracing::warn!(event = "inbox.surfaced_to_dlx", envelope_id = %envelope.id, queue = consumer_queue,
            routing_key = %routing_key, token = %token, reason, "retry cap reached; dead letter published to craig.dlx");
        Ok(token)
    }
}
