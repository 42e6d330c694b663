//! The security service — ADR-022 §D3: the wildcard (`#`) audit subscriber writing
//! `audit_log`, and the DLQ consumer on `craig-security.dlq` writing `dead_letter_audit`
//! with #1181 per-occurrence idempotency and the #1156 exact-crossing threshold.
//!
//! [`record_dead_letter`] runs in ONE transaction per delivery:
//! 1. a transaction-level advisory lock per `event_type` serializes the crossing decision
//!    (two concurrent arrivals must not both see the count reach 11);
//! 2. `INSERT … ON CONFLICT (occurrence_token) WHERE occurrence_token IS NOT NULL DO NOTHING`
//!    — the #1181 arbiter;
//! 3. a suppressed insert is classified (R7): the canonical row's immutable facts (envelope
//!    id, queue, event type, envelope JSON) ALL match → a phantom, rolled back; otherwise
//!    the claim is re-inserted TOKENLESS as a `divergent` quarantine row, logged at error,
//!    and alert-inert on its own turn. It still counts in later arrivals' windows (it has
//!    an event type), so a divergent row that is itself the 11th crosses SILENTLY: the next
//!    arrival counts 12, not 11, and does not fire. That is R7's "alert-inert" as written
//!    (the metrics rule's honesty note names the same gap);
//! 4. for an arrival that is in the window — decided in SQL on the database clock, with the
//!    same expression as the count — the per-type count over the sliding hour, keyed on
//!    `LEAST(COALESCE(occurred_at, dlq_received_at), dlq_received_at)`, is read; exactly at
//!    the crossing (count = 11) `security.dlq.threshold_exceeded` is staged in the same
//!    transaction (compat `pre-1156`: on every arrival over 10).
//!
//! The caller acks only after this commits (#1197).

use craig_mq::dlq::{DeadLetterDelivery, OccurrenceToken};
use craig_mq::{EventEnvelope, publish_in_tx};
use serde_json::json;
use sqlx::PgPool;

/// The audit event of a burst (§D3, #1199: its only consumer is this service's own
/// wildcard subscriber, which writes it to `audit_log`).
pub const THRESHOLD_EXCEEDED: &str = "security.dlq.threshold_exceeded";

/// §D3: "count > 10 within a 1-hour window for any single event_type".
pub const THRESHOLD: i64 = 10;

/// The window key (#1181 R5/R8), identical to the expression index's.
const WINDOW_KEY: &str = "LEAST(COALESCE(occurred_at, dlq_received_at), dlq_received_at)";

/// What [`record_dead_letter`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Recorded {
    /// A new tokened occurrence.
    Recorded,
    /// A new row without a token (raw/foreign publish, or token material that could not be
    /// trusted): each such delivery records.
    Tokenless,
    /// The body is not an envelope: its raw bytes are the row.
    Malformed,
    /// The token was already recorded with identical facts: nothing written.
    Phantom,
    /// The token was already recorded with OTHER facts: re-inserted tokenless (quarantine).
    Divergent,
}

impl Recorded {
    /// The `dlq_outcomes_total{outcome}` label (#1199).
    pub fn outcome(self) -> &'static str {
        match self {
            Recorded::Recorded | Recorded::Tokenless => "recorded",
            Recorded::Phantom => "duplicate",
            Recorded::Malformed | Recorded::Divergent => "quarantined",
        }
    }
}

/// Behaviour switches for the compat twins.
#[derive(Debug, Clone, Copy, Default)]
pub struct RecorderMode {
    /// `pre-1156`: the threshold event re-emits on every arrival over the threshold.
    pub pre_1156: bool,
    /// `pre-1181`: no occurrence idempotency (each delivery is its own occurrence).
    pub pre_1181: bool,
}

/// The outcome and, when one was staged, the threshold event.
#[derive(Debug, Clone, PartialEq)]
pub struct RecordResult {
    pub recorded: Recorded,
    /// The in-window count for the event type after this arrival (when it was counted).
    pub window_count: Option<i64>,
    pub threshold_event: Option<uuid::Uuid>,
}

/// One `dead_letter_audit` row as it will be written.
struct Row<'a> {
    disposition: &'static str,
    path: &'static str,
    routing_key: String,
    original_queue: Option<String>,
    envelope_id: Option<uuid::Uuid>,
    event_type: Option<String>,
    source_service: Option<String>,
    reason: Option<String>,
    envelope: Option<&'a EventEnvelope>,
    raw: &'a [u8],
    token: Option<&'a OccurrenceToken>,
    occurred_at: Option<chrono::DateTime<chrono::Utc>>,
    note: Option<String>,
}

impl<'a> Row<'a> {
    /// The row of a delivery as read.
    fn parsed(d: &'a DeadLetterDelivery, token: Option<&'a OccurrenceToken>) -> Self {
        let disposition = match (&d.quarantine, token) {
            (Some(_), _) => "malformed",
            (None, Some(_)) => "recorded",
            (None, None) => "tokenless",
        };
        Row {
            disposition,
            path: d.path.as_str(),
            routing_key: d.routing_key.clone(),
            original_queue: d.original_queue.clone(),
            envelope_id: d.envelope.as_ref().map(|e| e.id),
            event_type: event_type_of(d),
            source_service: d.envelope.as_ref().map(|e| e.source_service.clone()),
            reason: d.reason.clone(),
            envelope: d.envelope.as_ref(),
            raw: &d.raw,
            token,
            occurred_at: d.occurred_at,
            note: d.quarantine.clone().or_else(|| d.token_note.clone()),
        }
    }

    /// The fallback when the database refused the parsed row as data (a NUL in a text
    /// field or in the JSON, say): a `malformed` quarantine that keeps the raw bytes and
    /// the typed facts PostgreSQL cannot refuse (envelope id, a NUL-free event type, so the
    /// #1156 window still counts it) and drops every free-text field that came off the wire
    /// (reason, original queue, the envelope JSON); the routing key is kept with any NUL
    /// replaced. Tokenless: each such delivery records.
    fn raw_only(d: &'a DeadLetterDelivery, why: String) -> Self {
        let clean = |s: &str| (!s.contains('\0')).then(|| s.to_owned());
        Row {
            disposition: "malformed",
            path: d.path.as_str(),
            routing_key: d.routing_key.replace('\0', "\u{fffd}"),
            original_queue: None,
            envelope_id: d.envelope.as_ref().map(|e| e.id),
            event_type: event_type_of(d).as_deref().and_then(clean),
            source_service: d.envelope.as_ref().and_then(|e| clean(&e.source_service)),
            reason: None,
            envelope: None,
            raw: &d.raw,
            token: None,
            occurred_at: d.occurred_at,
            note: Some(why),
        }
    }
}

/// The #1156 window's key of a delivery: the envelope's event type; for a body that is not
/// an envelope, the routing key it was first published with (`x-death`), else the one event
/// type the consumer queue it came from is bound to (issue 21.2). `None` only when neither
/// says (a raw publish to `craig.dlx`, or a wildcard queue).
fn event_type_of(d: &DeadLetterDelivery) -> Option<String> {
    d.event_type().map(str::to_owned).or_else(|| {
        let q = d.original_queue.as_deref()?;
        let service = crate::service::ALL.into_iter().find(|s| craig_mq::topology::consumer_queue(s.name()) == q)?;
        match service.queue_bindings() {
            [only] if !only.contains(['#', '*']) => Some((*only).to_owned()),
            _ => None,
        }
    })
}

/// Record one DLQ delivery (see the module doc). An `Err` is a database failure: nothing
/// was committed and the delivery must not be acked.
pub async fn record_dead_letter(pool: &PgPool, d: &DeadLetterDelivery, mode: RecorderMode) -> Result<RecordResult, sqlx::Error> {
    let token = if mode.pre_1181 { None } else { d.token.as_ref() };
    record_row(pool, d, Row::parsed(d, token), mode).await
}

async fn record_row(pool: &PgPool, d: &DeadLetterDelivery, row: Row<'_>, mode: RecorderMode) -> Result<RecordResult, sqlx::Error> {
    let kind = match (row.disposition, row.token) {
        ("malformed", _) => Recorded::Malformed,
        (_, Some(_)) => Recorded::Recorded,
        (_, None) => Recorded::Tokenless,
    };
    let (disposition, token) = (row.disposition, row.token);
    let event_type = row.event_type.clone();
    let event_type = event_type.as_deref();

    let mut tx = pool.begin().await?;
    if let Some(et) = event_type {
        sqlx::query("SELECT pg_advisory_xact_lock(hashtextextended('craig.dlq.threshold:' || $1, 0))")
            .bind(et)
            .execute(&mut *tx)
            .await?;
    }
    // Receipt time and the window's reference: read AFTER the lock, on the database's
    // clock, so an arrival that waited for the lock is not dated before the one it waited
    // for (now() is the transaction's start), and the gate and the count use one instant.
    let at: chrono::DateTime<chrono::Utc> = sqlx::query_scalar("SELECT clock_timestamp()").fetch_one(&mut *tx).await?;
    let inserted = insert_row(&row, at).fetch_optional(&mut *tx).await?;

    let (recorded, in_window) = match (inserted, token) {
        (Some((_, in_window)), _) => (kind, in_window),
        (None, None) => unreachable!("a tokenless insert cannot conflict"),
        (None, Some(t)) => {
            // Suppressed by the arbiter: classify against the canonical row (R7).
            let same: bool = sqlx::query_scalar(
                "SELECT envelope_id IS NOT DISTINCT FROM $2 AND original_queue IS NOT DISTINCT FROM $3 \
                   AND event_type IS NOT DISTINCT FROM $4 AND envelope IS NOT DISTINCT FROM $5 \
                 FROM dead_letter_audit WHERE occurrence_token = $1",
            )
            .bind(t.as_str())
            .bind(row.envelope_id)
            .bind(row.original_queue.as_deref())
            .bind(event_type)
            .bind(row.envelope.map(sqlx::types::Json))
            .fetch_one(&mut *tx)
            .await?;
            if same {
                tx.rollback().await?;
                tracing::info!(event = "security.dlq.duplicate_absorbed", token = %t,
                    "redelivered occurrence already recorded with identical facts (phantom)");
                return Ok(RecordResult { recorded: Recorded::Phantom, window_count: None, threshold_event: None });
            }
            let why = format!("token {t} already recorded with other immutable facts (divergent claim)");
            let divergent = Row { disposition: "divergent", token: None, note: Some(why), ..row };
            insert_row(&divergent, at).fetch_one(&mut *tx).await?;
            tx.commit().await?;
            tracing::error!(event = "security.dlq.divergent_token", token = %t, routing_key = %d.routing_key,
                "quarantined a divergent claim of a recorded occurrence token");
            return Ok(RecordResult { recorded: Recorded::Divergent, window_count: None, threshold_event: None });
        }
    };

    let mut result = RecordResult { recorded, window_count: None, threshold_event: None };
    if let (Some(et), true) = (event_type, in_window) {
        let count: i64 = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
            "SELECT count(*) FROM dead_letter_audit WHERE event_type = $1 AND {WINDOW_KEY} > $2 - interval '1 hour'"
        )))
        .bind(et)
        .bind(at)
        .fetch_one(&mut *tx)
        .await?;
        result.window_count = Some(count);
        let fire = if mode.pre_1156 { count > THRESHOLD } else { count == THRESHOLD + 1 };
        if fire {
            let ev = EventEnvelope::new(
                THRESHOLD_EXCEEDED,
                "security",
                None,
                json!({ "event_type": et, "count": count, "threshold": THRESHOLD, "window": "1h" }),
            )
            .expect("static event type and service are valid");
            publish_in_tx(&mut tx, &ev).await?;
            result.threshold_event = Some(ev.id);
        }
    }
    tx.commit().await?;
    tracing::warn!(event = "security.dlq.recorded", disposition, path = d.path.as_str(), routing_key = %d.routing_key,
        event_type = event_type.unwrap_or("-"), token = token.map_or("-", OccurrenceToken::as_str),
        window_count = result.window_count.unwrap_or(-1), "dead letter recorded");
    if recorded == Recorded::Malformed {
        tracing::error!(event = "security.dlq.quarantined", routing_key = %d.routing_key, bytes = d.raw.len(),
            reason = d.quarantine.as_deref().unwrap_or(""), "malformed dead letter quarantined with its raw bytes");
    }
    if let Some(id) = result.threshold_event {
        tracing::warn!(event = "security.dlq.threshold_exceeded", event_type = event_type.unwrap_or("-"),
            count = result.window_count.unwrap_or(-1), envelope_id = %id);
    }
    Ok(result)
}

/// The audit row's INSERT behind the #1181 arbiter, received `at`; returns the id and
/// whether the row is in the threshold window (decided in SQL, with the count's key and
/// reference instant).
fn insert_row<'a>(
    row: &'a Row<'a>,
    at: chrono::DateTime<chrono::Utc>,
) -> sqlx::query::QueryAs<'a, sqlx::Postgres, (uuid::Uuid, bool), sqlx::postgres::PgArguments> {
    sqlx::query_as::<_, (uuid::Uuid, bool)>(sqlx::AssertSqlSafe(format!(
        "INSERT INTO dead_letter_audit (disposition, path, routing_key, original_queue, envelope_id, event_type, \
         source_service, reason, envelope, raw_body, occurrence_token, occurred_at, note, dlq_received_at) \
         VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14) \
         ON CONFLICT (occurrence_token) WHERE occurrence_token IS NOT NULL DO NOTHING \
         RETURNING id, {WINDOW_KEY} > $14 - interval '1 hour'"
    )))
    .bind(row.disposition)
    .bind(row.path)
    .bind(&row.routing_key)
    .bind(row.original_queue.as_deref())
    .bind(row.envelope_id)
    .bind(row.event_type.as_deref())
    .bind(row.source_service.as_deref())
    .bind(row.reason.as_deref())
    .bind(row.envelope.map(sqlx::types::Json))
    .bind(row.raw)
    .bind(row.token.map(OccurrenceToken::as_str))
    .bind(row.occurred_at)
    .bind(row.note.clone())
    .bind(at)
}

/// The wildcard audit subscriber's effect: one `audit_log` row per envelope (behind the
/// §D2 inbox, so a redelivery adds none).
pub async fn record_audit(pool: &PgPool, env: &EventEnvelope) -> Result<(), sqlx::Error> {
    sqlx::query(
        "INSERT INTO audit_log (envelope_id, event_type, source_service, aggregate_id, occurred_at, envelope) \
         VALUES ($1, $2, $3, $4, $5, $6)",
    )
    .bind(env.id)
    .bind(&env.event_type)
    .bind(&env.source_service)
    .bind(env.aggregate_id)
    .bind(env.occurred_at)
    .bind(sqlx::types::Json(env))
    .execute(pool)
    .await?;
    Ok(())
}

/// The DLQ consumer's handler (#1197 classification): a database that is unreachable parks
/// the session; a row the database refuses as data (a parsed form it cannot store) is
/// recorded again as a malformed quarantine of the raw bytes; only when even that fails is
/// the delivery captured.
pub async fn on_dead_letter(
    pool: &PgPool,
    d: DeadLetterDelivery,
    mode: RecorderMode,
) -> Result<(), craig_mq::dlq::DlqError<sqlx::Error>> {
    use crate::db_error::{DbFailure, classify};
    use craig_mq::dlq::DlqError;
    let refused_as_data = |e: &sqlx::Error| classify(e) == DbFailure::Data;
    let outcome = match record_dead_letter(pool, &d, mode).await {
        Ok(r) => r,
        Err(e) if refused_as_data(&e) => {
            let why = format!("the database refused the parsed dead letter ({e}); recorded as raw bytes");
            match record_row(pool, &d, Row::raw_only(&d, why), mode).await {
                Ok(r) => r,
                Err(e) if refused_as_data(&e) => return Err(DlqError::Permanent(e)),
                Err(e) => return Err(transient(pool, e).await),
            }
        }
        Err(e) => return Err(transient(pool, e).await),
    };
    craig_mq::metrics::dlq_outcome(outcome.recorded.outcome());
    Ok(())
}

/// A connection that is gone parks the session; anything else is retried in the session
/// first, and counts toward the park cap only while the database ANSWERS: a failure the
/// classification cannot place is checked with a `SELECT 1` on the pool, and one that
/// finds the database unreachable is an outage, never this delivery's fault (issue 21.1).
async fn transient(pool: &PgPool, e: sqlx::Error) -> craig_mq::dlq::DlqError<sqlx::Error> {
    use crate::db_error::{DbFailure, classify};
    use craig_mq::dlq::DlqError;
    match classify(&e) {
        DbFailure::Unreachable => DlqError::TransientPark(e),
        DbFailure::Data | DbFailure::Other => {
            let probe = tokio::time::timeout(std::time::Duration::from_secs(5), sqlx::query("SELECT 1").execute(pool)).await;
            match probe {
                Ok(Ok(_)) => DlqError::TransientRetry(e),
                _ => DlqError::TransientPark(e),
            }
        }
    }
}

/// The wildcard audit subscriber's handler: [`record_audit`] behind the §D2 inbox.
pub async fn on_any_event(
    pool: &PgPool,
    queue: &str,
    use_inbox: bool,
    env: EventEnvelope,
) -> Result<(), craig_mq::subscriber::HandlerError> {
    let classify = crate::db_error::handler_error;
    if !use_inbox {
        return record_audit(pool, &env).await.map_err(classify);
    }
    match craig_mq::handle_idempotently(pool, &env, queue, |env| async move { record_audit(pool, &env).await }).await {
        Ok(_) => Ok(()),
        Err(craig_mq::InboxError::Db(e)) | Err(craig_mq::InboxError::Handler { source: e, .. }) => Err(classify(e)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Issue 21.2's last resort: a dead letter whose body is no envelope and whose headers
    /// name no routing key takes the one event type its consumer queue is bound to; a queue
    /// bound by a wildcard (security's `#`) names none. (A mutation test found nothing held
    /// the first half: with the guard always false, every such row lost its #1156 key.)
    #[test]
    fn an_unreadable_dead_letter_takes_its_queues_one_binding_and_never_a_wildcard() {
        let from = |queue: &str| event_type_of(&DeadLetterDelivery::read(b"{garbage", &format!("dlq.{queue}"), None));
        assert_eq!(from("craig-rules.events").as_deref(), Some("case.referral_created"));
        assert_eq!(from("craig-financial.events").as_deref(), Some("placement.activated"));
        assert_eq!(from("craig-security.events"), None);
        assert_eq!(from("craig-nobody.events"), None);
    }
}
