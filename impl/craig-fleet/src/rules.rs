//! The rules service's consumer: `case.referral_created` → one `rule_evaluations` row and a
//! staged `rule.evaluated`, in one transaction, behind the §D2 inbox.
//!
//! `rule_evaluations` has NO unique key on purpose: the inbox is the only thing between a
//! redelivery and a second row, which is what the harness's `effect_once` checker counts.
//! Under compat `pre-d2` the inbox is bypassed.

use craig_mq::subscriber::HandlerError;
use craig_mq::{EventEnvelope, publish_in_tx};
use serde_json::json;
use sqlx::PgPool;
use uuid::Uuid;

pub use crate::consumer::Consumer;
use crate::consumer::ConsumeError as EvalError;

pub const RULE_EVALUATED: &str = "rule.evaluated";

/// Handle one delivery behind the inbox, its retry cap and the app path
/// ([`Consumer::consume`]); `use_inbox = false` is compat `pre-d2`.
pub async fn on_referral_created(pool: &PgPool, c: &Consumer, envelope: EventEnvelope) -> Result<(), HandlerError> {
    let replica = c.replica.as_deref();
    c.consume(pool, envelope, |env| evaluate(pool, env, replica)).await
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
