//! The financial service's consumer — ADR-022 Amendment #1179, the arbiter-backed idempotent
//! consumer (first instance): `placement.activated` → one per-diem payment, a staged
//! `payment.created` and its transmission to the partner (`crate::send_jobs`), behind the
//! §D2 inbox ([`Consumer::consume`]).
//!
//! The inbox is best-effort at-least-once (#1180: a crash between the handler's commit and
//! the `processed_at` stamp re-runs the handler), so this handler is idempotent on its own:
//! - **the arbiter:** `payments_one_perdiem_per_placement_period`, a unique key on
//!   (placement, period start) from the event's immutable payload, with lifetime semantics
//!   (it covers voided rows: voiding never frees the key);
//! - **the insert arbitrates first:** `ON CONFLICT … DO NOTHING` + `fetch_optional`, and
//!   every side effect — the same-transaction outbox stage of `payment.created` included —
//!   runs only on a real insert (staged-iff-inserted);
//! - **an early probe** on the immutable payload absorbs a replay before any dependency
//!   lookup (the rate table), so a post-success replay during an outage of that dependency
//!   resolves `Ok` instead of erroring into the retry ladder and the DLQ;
//! - **reload-and-compare** on the absorb path: a replay whose facts match the stored row is
//!   benign (`financial.payment_replay_absorbed`, info); one whose facts differ is derivation
//!   drift (`financial.payment_derivation_drift`, error, detection only).
//!
//! Compat `pre-1179` is the handler before the amendment: no probe, a plain INSERT, relying
//! on the inbox alone, on the schema without the arbiter (`craig-node migrate --compat
//! pre-1179`); a re-run inside the #1180 window pays twice. (On the current schema the old
//! handler's second insert is refused by the arbiter — SQLSTATE 23505, a permanent failure,
//! so it dead-letters instead of paying twice.)

use chrono::NaiveDate;
use craig_mq::subscriber::HandlerError;
use craig_mq::{EventEnvelope, publish_in_tx};
use serde_json::json;
use sqlx::PgPool;
use uuid::Uuid;

use crate::consumer::{ConsumeError, Consumer};

pub const PAYMENT_CREATED: &str = "payment.created";

/// The immutable facts of a `placement.activated` payload: the natural key (placement,
/// period start) and what the amount is derived from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PerDiem {
    pub placement_id: Uuid,
    pub period_start: NaiveDate,
    pub days: i32,
    pub care_level: String,
}

impl PerDiem {
    /// Read from the envelope's payload; a missing or malformed field is permanent.
    pub fn from_envelope(env: &EventEnvelope) -> Result<Self, ConsumeError> {
        let field = |name: &str| env.payload.get(name).and_then(|v| v.as_str());
        let bad = |what: &str| ConsumeError::Payload(format!("envelope {} has no valid {what}", env.id));
        let placement_id = field("placement_id").and_then(|s| s.parse::<Uuid>().ok()).ok_or_else(|| bad("placement_id"))?;
        let period_start =
            field("period_start").and_then(|s| s.parse::<NaiveDate>().ok()).ok_or_else(|| bad("period_start"))?;
        let days = env
            .payload
            .get("days")
            .and_then(|v| v.as_i64())
            .filter(|d| (1..=31).contains(d))
            .ok_or_else(|| bad("days (1..=31)"))? as i32;
        let care_level = field("care_level").filter(|s| !s.is_empty() && !s.contains('\0')).ok_or_else(|| bad("care_level"))?;
        Ok(Self { placement_id, period_start, days, care_level: care_level.to_owned() })
    }
}

/// What one run of the handler did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Paid {
    /// A real insert: the payment and its `payment.created` committed together.
    Created(Uuid),
    /// The arbiter's key was taken by a payment with the same facts: a benign replay.
    Replay,
    /// The key was taken by a payment whose facts differ: derivation drift (logged as an
    /// error; nothing written).
    Drift,
}

/// Handle one delivery: the inbox, its retry cap and the app path around [`pay`].
pub async fn on_placement_activated(pool: &PgPool, c: &Consumer, arbiter: bool, envelope: EventEnvelope) -> Result<(), HandlerError> {
    let replica = c.replica.as_deref();
    c.consume(pool, envelope, |env| async move { pay(pool, &env, replica, arbiter).await.map(|_| ()) }).await
}

/// The stored payment of a natural key.
struct Stored {
    id: Uuid,
    days: i32,
    care_level: String,
    amount_cents: i64,
    envelope_id: Uuid,
}

async fn stored(pool: &PgPool, f: &PerDiem) -> Result<Option<Stored>, sqlx::Error> {
    let row: Option<(Uuid, i32, String, i64, Uuid)> = sqlx::query_as(
        "SELECT id, days, care_level, amount_cents, envelope_id FROM payments WHERE placement_id = $1 AND period_start = $2 \
         ORDER BY created_at LIMIT 1",
    )
    .bind(f.placement_id)
    .bind(f.period_start)
    .fetch_optional(pool)
    .await?;
    Ok(row.map(|(id, days, care_level, amount_cents, envelope_id)| Stored { id, days, care_level, amount_cents, envelope_id }))
}

/// Reload-and-compare: the stored payment against this replay's facts (and, once the rate
/// was looked up, the amount it derives).
fn absorb(f: &PerDiem, amount: Option<i64>, s: &Stored, env: &EventEnvelope) -> Paid {
    let same = s.days == f.days && s.care_level == f.care_level && amount.is_none_or(|a| a == s.amount_cents);
    if same {
        tracing::info!(
            event = "financial.payment_replay_absorbed",
            envelope_id = %env.id,
            payment_id = %s.id,
            first_envelope = %s.envelope_id,
            placement_id = %f.placement_id,
            period_start = %f.period_start,
        );
        Paid::Replay
    } else {
        tracing::error!(
            event = "financial.payment_derivation_drift",
            envelope_id = %env.id,
            payment_id = %s.id,
            placement_id = %f.placement_id,
            period_start = %f.period_start,
            stored = %format!("days={} care_level={} amount_cents={}", s.days, s.care_level, s.amount_cents),
            derived = %format!("days={} care_level={} amount_cents={}", f.days, f.care_level, amount.map_or("-".into(), |a| a.to_string())),
            "a payment for this placement and period exists with other facts; nothing written (detection only)"
        );
        Paid::Drift
    }
}

/// The handler proper (§ module doc); `arbiter = false` is compat `pre-1179`.
pub async fn pay(pool: &PgPool, env: &EventEnvelope, replica: Option<&str>, arbiter: bool) -> Result<Paid, ConsumeError> {
    let f = PerDiem::from_envelope(env)?;
    if arbiter {
        // The early probe: immutable payload data only, before any dependency lookup.
        if let Some(s) = stored(pool, &f).await? {
            if craig_mq::crash::mutant("financial::absorb_fails") {
                return Err(ConsumeError::Db(sqlx::Error::PoolTimedOut));
            }
            return Ok(absorb(&f, None, &s, env));
        }
    }
    let daily: Option<i64> = sqlx::query_scalar("SELECT daily_cents FROM perdiem_rates WHERE care_level = $1")
        .bind(&f.care_level)
        .fetch_optional(pool)
        .await?;
    let daily = daily.ok_or_else(|| ConsumeError::Payload(format!("envelope {}: no per-diem rate for care level {:?}", env.id, f.care_level)))?;
    let amount = daily
        .checked_mul(i64::from(f.days))
        .ok_or_else(|| ConsumeError::Payload(format!("envelope {}: {daily} cents x {} days overflows", env.id, f.days)))?;
    let payment_id = Uuid::now_v7();
    let created = EventEnvelope::new(
        PAYMENT_CREATED,
        "financial",
        Some(f.placement_id),
        json!({
            "payment_id": payment_id,
            "placement_id": f.placement_id,
            "period_start": f.period_start,
            "days": f.days,
            "care_level": f.care_level,
            "amount_cents": amount,
            "source_envelope": env.id,
        }),
    )
    .expect("static event type and service name are valid");
    let insert = if arbiter {
        "INSERT INTO payments (id, placement_id, period_start, days, care_level, amount_cents, envelope_id, replica) \
         VALUES ($1, $2, $3, $4, $5, $6, $7, $8) \
         ON CONFLICT ON CONSTRAINT payments_one_perdiem_per_placement_period DO NOTHING RETURNING id"
    } else {
        "INSERT INTO payments (id, placement_id, period_start, days, care_level, amount_cents, envelope_id, replica) \
         VALUES ($1, $2, $3, $4, $5, $6, $7, $8) RETURNING id"
    };
    let mut tx = pool.begin().await?;
    let inserted: Option<Uuid> = sqlx::query_scalar(insert)
        .bind(payment_id)
        .bind(f.placement_id)
        .bind(f.period_start)
        .bind(f.days)
        .bind(&f.care_level)
        .bind(amount)
        .bind(env.id)
        .bind(replica)
        .fetch_optional(&mut *tx)
        .await?;
    match inserted {
        Some(id) => {
            // Staged only on a real insert, in the same transaction: the event and the
            // payment's transmission to the partner (#1185 send queue).
            publish_in_tx(&mut tx, &created).await?;
            crate::send_jobs::stage_in_tx(&mut tx, Some(id), &created.payload).await?;
            tx.commit().await?;
            tracing::info!(event = "financial.payment_created", envelope_id = %env.id, payment_id = %id, placement_id = %f.placement_id, amount_cents = amount);
            Ok(Paid::Created(id))
        }
        None => {
            // Lost the race to a concurrent run of the same key: nothing was written here.
            tx.rollback().await?;
            let s = stored(pool, &f).await?.ok_or(sqlx::Error::RowNotFound)?;
            Ok(absorb(&f, Some(amount), &s, env))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env(payload: serde_json::Value) -> EventEnvelope {
        EventEnvelope::new("placement.activated", "cases", None, payload).unwrap()
    }

    #[test]
    fn the_natural_key_comes_from_the_payload_and_a_bad_field_is_permanent() {
        let p = Uuid::now_v7();
        let f = PerDiem::from_envelope(&env(json!({ "placement_id": p, "period_start": "2026-12-01", "days": 31, "care_level": "standard" })))
            .unwrap();
        assert_eq!(f, PerDiem { placement_id: p, period_start: NaiveDate::from_ymd_opt(2026, 12, 1).unwrap(), days: 31, care_level: "standard".into() });
        for bad in [
            json!({ "period_start": "2026-12-01", "days": 31, "care_level": "standard" }),
            json!({ "placement_id": p, "period_start": "2026-13-01", "days": 31, "care_level": "standard" }),
            json!({ "placement_id": p, "period_start": "2026-12-01", "days": 0, "care_level": "standard" }),
            json!({ "placement_id": p, "period_start": "2026-12-01", "days": 31, "care_level": "" }),
        ] {
            let e = PerDiem::from_envelope(&env(bad.clone())).unwrap_err();
            assert!(matches!(HandlerError::from(e), HandlerError::Permanent(_)), "{bad}");
        }
    }
}
