//! The cases service's HTTP routes. `POST /v1/cases/referrals` writes `referrals` and
//! stages `case.referral_created` in ONE transaction (ADR-022 §D1, Consequences:
//! `events::publish_X(&mut tx, …).await?; tx.commit().await?`).
//!
//! `POST /v1/cases/placements/{id}/activate` activates a placement and stages
//! `placement.activated` in the same transaction; its payload carries the immutable facts
//! (placement, care level, period, days) the financial service derives its per-diem
//! payment's natural key from (#1179).
//!
//! `POST /v1/cases/exports?size=N` answers a deterministic body of N bytes ([`export_body`])
//! and writes one `exports` row per execution, with the key it ran under: the route that
//! exercises the §D5 response cap and its sentinel (#1183).
//!
//! All three sit behind the §D5 idempotency layer ([`craig_api::idempotency`]): a retry with
//! the same `Idempotency-Key` replays the first answer; a new key for an existing referral
//! `id` is still answered 409, never written twice.

use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::{Json, Router};
use craig_api::{Bearer, error_response};
use craig_mq::{EventEnvelope, publish_in_tx};
use serde::Deserialize;
use serde_json::json;
use uuid::Uuid;

use crate::node::AppState;

pub const REFERRAL_CREATED: &str = "case.referral_created";
pub const PLACEMENT_ACTIVATED: &str = "placement.activated";

/// The idempotent routes, behind `idempotency` (§D5).
pub fn router(idempotency: craig_api::idempotency::IdempotencyLayer) -> Router<AppState> {
    Router::new()
        .route("/v1/cases/referrals", post(create_referral))
        .route("/v1/cases/placements/{id}/activate", post(activate_placement))
        .route("/v1/cases/exports", post(create_export))
        .route_layer(idempotency)
}

/// The largest export: far past both §D5 caps, still a bounded allocation.
pub const EXPORT_MAX: u64 = 16 * 1024 * 1024;
/// Exports stream in frames of this size, so the 1 MiB cap falls inside a frame.
const EXPORT_FRAME: usize = 64 * 1000;

/// The body of an export of `n` bytes: a fixed 36-symbol cycle, deterministic in `n`.
pub fn export_body(n: usize) -> Vec<u8> {
    const SYMBOLS: &[u8; 36] = b"0123456789abcdefghijklmnopqrstuvwxyz";
    (0..n).map(|i| SYMBOLS[i % 36]).collect()
}

#[derive(Debug, Deserialize)]
pub struct ExportParams {
    pub size: Option<String>,
}

/// `POST /v1/cases/exports?size=N`: one `exports` row (committed before the answer), then
/// 200 with N bytes of [`export_body`] and an explicit `Content-Length`, streamed in frames.
async fn create_export(
    State(state): State<AppState>,
    Bearer(claims): Bearer,
    axum::extract::Query(params): axum::extract::Query<ExportParams>,
    ctx: Option<axum::Extension<craig_api::idempotency::IdempotencyContext>>,
) -> Response {
    if let Err(e) = claims.require(&state.service.audience(), None) {
        return e.into_response();
    }
    let size = match params.size.as_deref().map(str::parse::<u64>) {
        Some(Ok(n)) if n <= EXPORT_MAX => n as usize,
        _ => return error_response(StatusCode::BAD_REQUEST, &format!("size must be a whole number of bytes, 0..={EXPORT_MAX}")),
    };
    let body = export_body(size);
    let digest = craig_api::idempotency::body_fingerprint(&body);
    let (key, cache_key, generation) = match ctx {
        Some(axum::Extension(c)) => (Some(c.key), Some(c.cache_key), Some(c.generation)),
        None => (None, None, None),
    };
    // The row's id is ours: a write whose acknowledgement the connection lost is read back
    // by it, never sent again (a second row would be a second export).
    let id = Uuid::now_v7();
    // A connection first: a pool that gives none sent nothing, and the export was not made.
    let mut conn = match state.pool.acquire().await {
        Ok(c) => c,
        Err(e) => {
            tracing::error!(event = "cases.export_failed", error = %e);
            return error_response(StatusCode::SERVICE_UNAVAILABLE, "database unavailable; the export was not made");
        }
    };
    let mut written = lost_ack(
        sqlx::query(
            "INSERT INTO exports (id, size_bytes, idempotency_key, cache_key, generation, body_sha256, created_by, replica) \
             VALUES ($1, $2, $3, $4, $5, $6, $7, $8)",
        )
        .bind(id)
        .bind(size as i64)
        .bind(&key)
        .bind(&cache_key)
        .bind(generation)
        .bind(&digest)
        .bind(claims.sub)
        .bind(std::env::var("CRAIG_REPLICA").ok())
        .execute(&mut *conn)
        .await
        .map(drop),
    );
    drop(conn);
    // The statement may have committed: the connection broke after it was sent. Read it
    // back (the pool waits out a short cut): found, the export was made and is answered.
    // Not found, an INSERT still in flight on the old connection may yet commit, so the
    // outcome stays unknown.
    if let Err(e) = &written
        && outcome_unknown(e)
    {
        tracing::warn!(event = "cases.export_outcome_unknown", export_id = %id, error = %e, "the export's write lost its acknowledgement: reading it back");
        let server_closed = matches!(e, sqlx::Error::Database(_));
        let found = lost_ack(sqlx::query_scalar::<_, i64>("SELECT count(*) FROM exports WHERE id = $1").bind(id).fetch_one(&state.pool).await);
        match found {
            Ok(1) => written = Ok(()),
            // The server closed that connection itself (it said so): no INSERT of it is still
            // in flight, so not found is final, and the export was not made.
            Ok(_) if server_closed => {
                tracing::error!(event = "cases.export_failed", export_id = %id, "the server closed the connection and the export is not there");
                return error_response(StatusCode::SERVICE_UNAVAILABLE, "database unavailable; the export was not made");
            }
            _ => {}
        }
    }
    if let Err(e) = written {
        tracing::error!(event = "cases.export_failed", error = %e);
        if outcome_unknown(&e) {
            // The slot is kept (§D5: only the claim's expiry re-admits the key).
            let mut r = error_response(
                StatusCode::SERVICE_UNAVAILABLE,
                "database unavailable; whether the export was made is unknown (the key is held until its claim expires)",
            );
            r.extensions_mut().insert(craig_api::idempotency::OutcomeUnknown);
            return r;
        }
        return error_response(StatusCode::SERVICE_UNAVAILABLE, "database unavailable; the export was not made");
    }
    craig_mq::crash::hit("exports::after_commit_before_answer");
    let body = axum::body::Bytes::from(body);
    let frames: Vec<Result<axum::body::Bytes, std::convert::Infallible>> =
        (0..size).step_by(EXPORT_FRAME).map(|at| Ok(body.slice(at..(at + EXPORT_FRAME).min(size)))).collect();
    let mut r = axum::body::Body::from_stream(futures_util::stream::iter(frames)).into_response();
    let h = r.headers_mut();
    h.insert(axum::http::header::CONTENT_TYPE, axum::http::HeaderValue::from_static("application/octet-stream"));
    h.insert(axum::http::header::CONTENT_LENGTH, axum::http::HeaderValue::from(size));
    r
}

/// Test-only fault `exports::commit_ack_lost` (`craig_mq::crash::FAULTS`): the statement
/// ran, and its answer is lost on the way back.
fn lost_ack<T>(r: Result<T, sqlx::Error>) -> Result<T, sqlx::Error> {
    match r {
        Ok(_) if craig_mq::crash::fault("exports::commit_ack_lost") => {
            Err(sqlx::Error::Io(std::io::Error::other("test-only fault: the statement's answer was lost")))
        }
        r => r,
    }
}

/// Whether a statement sent on a connection the pool gave may have committed: the
/// connection broke with it sent (I/O, TLS, a protocol error, the connection's worker gone),
/// or the server said it is going away or the connection failed (SQLSTATE class 08, 57P01,
/// 57P02: such a notice can follow a commit whose answer never came; the read-back then
/// decides, the server having closed that connection itself). A value that could not
/// be encoded was never sent, and any other database error is the server's answer to the
/// statement (it rolled back).
fn outcome_unknown(e: &sqlx::Error) -> bool {
    match e {
        sqlx::Error::Io(_) | sqlx::Error::Tls(_) | sqlx::Error::Protocol(_) | sqlx::Error::WorkerCrashed => true,
        sqlx::Error::Database(db) => db.code().is_some_and(|c| c.starts_with("08") || matches!(c.as_ref(), "57P01" | "57P02")),
        _ => false,
    }
}

/// Request body. `id` is optional: a client (the harness) that names the referral can
/// match a write whose response it never saw to the event that later arrives.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NewReferral {
    pub id: Option<Uuid>,
    pub subject: String,
}

async fn create_referral(State(state): State<AppState>, Bearer(claims): Bearer, body: axum::body::Bytes) -> Response {
    if let Err(e) = claims.require(&state.service.audience(), None) {
        return e.into_response();
    }
    let req: NewReferral = match serde_json::from_slice(&body) {
        Ok(r) => r,
        Err(e) => return error_response(StatusCode::BAD_REQUEST, &format!("invalid referral body: {e}")),
    };
    if req.subject.trim().is_empty() || req.subject.len() > 1024 {
        return error_response(StatusCode::BAD_REQUEST, "subject must be 1..=1024 bytes and not blank");
    }
    // PostgreSQL text cannot hold U+0000: the client's error, never a 503.
    if req.subject.contains('\0') {
        return error_response(StatusCode::BAD_REQUEST, "subject must not contain a NUL character (U+0000)");
    }
    let id = req.id.unwrap_or_else(Uuid::now_v7);
    match write_referral(&state, id, &req.subject, claims.sub).await {
        Ok(envelope_id) => (StatusCode::CREATED, Json(json!({ "id": id, "envelope_id": envelope_id }))).into_response(),
        Err(sqlx::Error::Database(db)) if db.is_unique_violation() => {
            error_response(StatusCode::CONFLICT, &format!("referral {id} already exists"))
        }
        Err(e) if craig_mq::refused_envelope(&e).is_some() => {
            error_response(StatusCode::BAD_REQUEST, &format!("the referral's event cannot be staged: {e}"))
        }
        Err(e) => {
            tracing::error!(event = "cases.referral_failed", referral_id = %id, error = %e);
            error_response(StatusCode::SERVICE_UNAVAILABLE, "database unavailable; the referral was not written")
        }
    }
}

async fn write_referral(state: &AppState, id: Uuid, subject: &str, by: Uuid) -> Result<Uuid, sqlx::Error> {
    let envelope = EventEnvelope::new(REFERRAL_CREATED, "cases", Some(id), json!({ "referral_id": id, "subject": subject }))
        .expect("static event type and service name are valid");
    // Test-only (issue 22): the event commits in a transaction of its own BEFORE the
    // referral's; a referral that then fails to commit leaves its event out (a phantom).
    let staged_before = craig_mq::crash::mutant("cases::stage_before_write");
    if staged_before {
        let mut first = state.pool.begin().await?;
        publish_in_tx(&mut first, &envelope).await?;
        first.commit().await?;
    }
    let mut tx = state.pool.begin().await?;
    sqlx::query("INSERT INTO referrals (id, subject, created_by) VALUES ($1, $2, $3)")
        .bind(id)
        .bind(subject)
        .bind(by)
        .execute(&mut *tx)
        .await?;
    if staged_before {
        tx.commit().await?;
        return Ok(envelope.id);
    }
    if let Some(direct) = &state.direct {
        // Compat pre-d1: commit, then publish; a failed publish is only logged.
        tx.commit().await?;
        if let Err(e) = direct.publish(&envelope).await {
            tracing::warn!(event = "compat.pre_d1_publish_failed", error = %e, "failed to publish case.referral_created");
        }
        return Ok(envelope.id);
    }
    if craig_mq::crash::mutant("cases::stage_after_commit") {
        // Test-only (issue 22.2): the referral commits alone, its event in a second transaction.
        tx.commit().await?;
        let mut second = state.pool.begin().await?;
        publish_in_tx(&mut second, &envelope).await?;
        second.commit().await?;
        return Ok(envelope.id);
    }
    publish_in_tx(&mut tx, &envelope).await?;
    tx.commit().await?;
    Ok(envelope.id)
}

/// `POST /v1/cases/placements/{id}/activate` body: the care level and the first day of care
/// (default: today, UTC). The per-diem period is that day's month, from that day on.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Activation {
    pub care_level: String,
    #[serde(default)]
    pub start: Option<chrono::NaiveDate>,
    #[serde(default)]
    pub referral_id: Option<Uuid>,
}

/// The first and last day a placement may start on (issue 21.3): what `chrono`, PostgreSQL's
/// `date` and a per-diem period (which reaches into the next month) all hold. Anything else
/// is the client's error, answered 400 with this range.
pub const START_RANGE: (chrono::NaiveDate, chrono::NaiveDate) = (
    chrono::NaiveDate::from_ymd_opt(1, 1, 1).expect("0001-01-01 exists"),
    chrono::NaiveDate::from_ymd_opt(9999, 12, 31).expect("9999-12-31 exists"),
);

/// The per-diem period a placement starting on `start` is paid for first: the first of its
/// month and the days from `start` to the month's end, inclusive. `None` for a date whose
/// month has no successor `chrono` can name (never reached inside [`START_RANGE`]).
pub fn perdiem_period(start: chrono::NaiveDate) -> Option<(chrono::NaiveDate, i32)> {
    use chrono::Datelike;
    let first = start.with_day(1)?;
    let next = if start.month() == 12 {
        chrono::NaiveDate::from_ymd_opt(start.year().checked_add(1)?, 1, 1)
    } else {
        chrono::NaiveDate::from_ymd_opt(start.year(), start.month() + 1, 1)
    }?;
    Some((first, i32::try_from((next - start).num_days()).ok()?))
}

async fn activate_placement(
    State(state): State<AppState>,
    Bearer(claims): Bearer,
    axum::extract::Path(id): axum::extract::Path<Uuid>,
    body: axum::body::Bytes,
) -> Response {
    if let Err(e) = claims.require(&state.service.audience(), None) {
        return e.into_response();
    }
    let req: Activation = match serde_json::from_slice(&body) {
        Ok(r) => r,
        Err(e) => return error_response(StatusCode::BAD_REQUEST, &format!("invalid activation body: {e}")),
    };
    let level = req.care_level.as_str();
    if level.is_empty() || level.len() > 64 || !level.bytes().all(|b| b.is_ascii_graphic()) {
        return error_response(StatusCode::BAD_REQUEST, "care_level must be 1..=64 printable ASCII characters");
    }
    let start = req.start.unwrap_or_else(|| chrono::Utc::now().date_naive());
    let (lo, hi) = START_RANGE;
    let Some((period_start, days)) = perdiem_period(start).filter(|_| (lo..=hi).contains(&start)) else {
        return error_response(StatusCode::BAD_REQUEST, &format!("start {start} is outside {lo}..={hi}"));
    };
    let payload = json!({
        "placement_id": id,
        "referral_id": req.referral_id,
        "care_level": level,
        "period_start": period_start,
        "days": days,
    });
    let envelope = EventEnvelope::new(PLACEMENT_ACTIVATED, "cases", Some(id), payload)
        .expect("static event type and service name are valid");
    let written = async {
        // Test-only (issue 22): placement.activated commits in a transaction of its own
        // BEFORE the activation's; an activation that then fails to commit leaves its event
        // published (a payment for a placement that is not active).
        let staged_before = craig_mq::crash::mutant("cases::activation_stage_before_write");
        if staged_before {
            let mut first = state.pool.begin().await?;
            publish_in_tx(&mut first, &envelope).await?;
            first.commit().await?;
        }
        let mut tx = state.pool.begin().await?;
        let activated: Option<Uuid> = sqlx::query_scalar(
            "INSERT INTO placements (id, referral_id, status, activated_at, care_level, period_start, days) \
             VALUES ($1, $2, 'active', now(), $3, $4, $5) \
             ON CONFLICT (id) DO UPDATE SET status = 'active', activated_at = now(), care_level = $3, period_start = $4, days = $5 \
             WHERE placements.status = 'pending' RETURNING id",
        )
        .bind(id)
        .bind(req.referral_id)
        .bind(level)
        .bind(period_start)
        .bind(days)
        .fetch_optional(&mut *tx)
        .await?;
        if activated.is_none() {
            return Ok(None);
        }
        if staged_before {
            tx.commit().await?;
            return Ok(Some(envelope.id));
        }
        if craig_mq::crash::mutant("cases::activation_stage_after_commit") {
            // Test-only (issue 22): the activation commits alone, its event in a second transaction.
            tx.commit().await?;
            let mut second = state.pool.begin().await?;
            publish_in_tx(&mut second, &envelope).await?;
            second.commit().await?;
            return Ok(Some(envelope.id));
        }
        publish_in_tx(&mut tx, &envelope).await?;
        tx.commit().await?;
        Ok::<_, sqlx::Error>(Some(envelope.id))
    };
    match written.await {
        Ok(Some(envelope_id)) => (
            StatusCode::OK,
            Json(json!({ "id": id, "envelope_id": envelope_id, "period_start": period_start, "days": days })),
        )
            .into_response(),
        Ok(None) => error_response(StatusCode::CONFLICT, &format!("placement {id} is already active")),
        Err(sqlx::Error::Database(db)) if db.is_foreign_key_violation() => {
            error_response(StatusCode::UNPROCESSABLE_ENTITY, "referral_id names no referral")
        }
        // A value the database refuses as data is the client's, never "unavailable".
        Err(e) if crate::db_error::classify(&e) == crate::db_error::DbFailure::Data => {
            error_response(StatusCode::BAD_REQUEST, &format!("the activation was refused as data: {e}"))
        }
        Err(e) => {
            tracing::error!(event = "cases.activation_failed", placement_id = %id, error = %e);
            error_response(StatusCode::SERVICE_UNAVAILABLE, "database unavailable; the placement was not activated")
        }
    }
}

#[cfg(test)]
mod tests {
    use super::perdiem_period;
    use chrono::{Datelike, NaiveDate};

    #[test]
    fn the_first_period_runs_from_the_start_to_the_end_of_its_month() {
        let d = |y, m, d| NaiveDate::from_ymd_opt(y, m, d).unwrap();
        assert_eq!(perdiem_period(d(2026, 12, 1)), Some((d(2026, 12, 1), 31)));
        assert_eq!(perdiem_period(d(2026, 12, 31)), Some((d(2026, 12, 1), 1)));
        assert_eq!(perdiem_period(d(2028, 2, 10)), Some((d(2028, 2, 1), 20)));
        assert_eq!(perdiem_period(super::START_RANGE.1), Some((d(9999, 12, 1), 1)));
        // Issue 21.3: the last December chrono holds has no next month: no period, no panic.
        assert_eq!(perdiem_period(NaiveDate::from_ymd_opt(NaiveDate::MAX.year(), 12, 1).unwrap()), None);
    }
}
