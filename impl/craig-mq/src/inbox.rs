//! Idempotent inbox — ADR-022 §D2, with the #1180 correction and the #1196 consumer-queue
//! identity.
//!
//! [`handle_idempotently`]: an atomic `INSERT … ON CONFLICT DO NOTHING` records the
//! envelope; if the envelope was already recorded AND stamped `processed_at`, the handler
//! is skipped (a dedup hit). Otherwise the handler runs and, on success, `processed_at` is
//! stamped.
//!
//! **The #1180 boundary, stated plainly:** this is best-effort at-least-once, NOT
//! exactly-once. The inbox opens no transaction around the handler: the handler's own
//! commit and the `processed_at` stamp are separate commits. A crash between them (crash
//! point `inbox::after_handler_before_stamp`) leaves the row unstamped, and the redelivery
//! re-runs a handler that already succeeded. Two concurrent deliveries of one envelope
//! (two replicas, before either stamps) can likewise both run it. Handlers with
//! non-replayable side effects must carry their own arbiter (ADR-022 #1179).
//! Exactly-once is the #1178 redesign, not this module.

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

    sqlx::query("UPDATE event_inbox SET processed_at = now() WHERE envelope_id = $1 AND processed_at IS NULL")
        .bind(envelope.id)
        .execute(db)
        .await?;
    let outcome = if inserted { InboxOutcome::Processed } else { InboxOutcome::Reprocessed };
    if outcome == InboxOutcome::Reprocessed {
        tracing::info!(event = "inbox.reprocessed", envelope_id = %envelope.id, queue = consumer_queue,
            "envelope seen before without processed_at; handler ran again (#1180 window)");
    }
    crate::metrics::inbox(outcome);
    Ok(outcome)
}
