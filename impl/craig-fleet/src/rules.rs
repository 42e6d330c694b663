//! The rules service's consumer: `case.referral_created` → one `rule_evaluations` row and a
//! staged `rule.evaluated`, in one transaction, behind the §D2 inbox.
//!
//! `rule_evaluations` has NO unique key on purpose: the inbox is the only thing between a
//! redelivery and a second row, which is what the harness's `effect_once` checker counts.
//! Under compat `pre-d2` the inbox is bypassed.

use craig_mq::inbox::{RetryCap, Surface};
use craig_mq::subscriber::HandlerError;
use craig_mq::{EventEnvelope, InboxError, handle_idempotently, publish_in_tx};
use serde_json::json;
use sqlx::PgPool;
use uuid::Uuid;

pub const RULE_EVALUATED: &str = "rule.evaluated";

/// Who runs the handler: `replica` (from `CRAIG_REPLICA`) is recorded with each evaluation.
pub struct Consumer {
    pub queue: String,
    pub use_inbox: bool,
    pub replica: Option<String>,
    /// The inbox retry cap and the app dead-letter path (§D3, #1196); `None` without an
    /// inbox (compat `pre-d2`: nothing to derive a token from, so it requeues as before).
    pub app_path: Option<(RetryCap, Surface)>,
}

/// Handle one delivery; `use_inbox = false` is compat `pre-d2`.
///
/// A transient failure of the same envelope for the `cap`-th time surfaces it to
/// `craig.dlx` (`surface_to_dlx` with this consumer's queue, #1196) and returns `Ok`, so the
/// subscriber acks it only once the dead letter is confirmed on the broker; a surface that
/// fails leaves the failure transient (requeued, nothing lost).
pub async fn on_referral_created(pool: &PgPool, c: &Consumer, envelope: EventEnvelope) -> Result<(), HandlerError> {
    let replica = c.replica.as_deref();
    if !c.use_inbox {
        return evaluate(pool, envelope, replica).await.map_err(classify);
    }
    let id = envelope.id;
    let result = match handle_idempotently(pool, &envelope, &c.queue, |env| evaluate(pool, env, replica)).await {
        Ok(_) => Ok(()),
        Err(InboxError::Db(e)) | Err(InboxError::Handler { source: EvalError::Db(e), .. }) => Err(classify_db(e)),
        Err(InboxError::Handler { source: EvalError::Payload(why), .. }) => Err(HandlerError::Permanent(why)),
    };
    let Some((cap, surface)) = &c.app_path else { return result };
    match result {
        Err(HandlerError::Transient(why)) if cap.failed(id) => {
            let reason = format!("retry cap of {} reached: {why}", cap.cap());
            match surface.surface_to_dlx(pool, &envelope, &c.queue, &reason).await {
                Ok(_) => {
                    cap.settled(id);
                    Ok(())
                }
                Err(e) => Err(HandlerError::Transient(format!("{why}; surfacing to craig.dlx failed: {e}"))),
            }
        }
        Err(e) => Err(e),
        Ok(()) => {
            cap.settled(id);
            Ok(())
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum EvalError {
    #[error("database: {0}")]
    Db(#[from] sqlx::Error),
    #[error("payload: {0}")]
    Payload(String),
}

fn classify(e: EvalError) -> HandlerError {
    match e {
        EvalError::Db(e) => classify_db(e),
        EvalError::Payload(why) => HandlerError::Permanent(why),
    }
}

fn classify_db(e: sqlx::Error) -> HandlerError {
    crate::db_error::handler_error(e)
}

async fn evaluate(pool: &PgPool, envelope: EventEnvelope, replica: Option<&str>) -> Result<(), EvalError> {
    let referral_id = envelope
        .payload
        .get("referral_id")
        .and_then(|v| v.as_str())
        .and_then(|s| s.parse::<Uuid>().ok())
        .ok_or_else(|| EvalError::Payload(format!("envelope {} has no referral_id", envelope.id)))?;
    let subject_len = envelope.payload.get("subject").and_then(|v| v.as_str()).map_or(0, str::len);
    let outcome = if subject_len > 200 { "flag" } else { "pass" };
    let evaluated = EventEnvelope::new(
        RULE_EVALUATED,
        "rules",
        Some(referral_id),
        json!({ "referral_id": referral_id, "source_envelope": envelope.id, "rule": "referral-basic", "outcome": outcome }),
    )
    .expect("static event type and service name are valid");
    let mut tx = pool.begin().await?;
    sqlx::query("INSERT INTO rule_evaluations (envelope_id, referral_id, rule, outcome, replica) VALUES ($1, $2, $3, $4, $5)")
        .bind(envelope.id)
        .bind(referral_id)
        .bind("referral-basic")
        .bind(outcome)
        .bind(replica)
        .execute(&mut *tx)
        .await?;
    publish_in_tx(&mut tx, &evaluated).await?;
    tx.commit().await?;
    Ok(())
}
