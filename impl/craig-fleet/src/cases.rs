//! The cases service's HTTP routes. `POST /v1/cases/referrals` writes `referrals` and
//! stages `case.referral_created` in ONE transaction (ADR-022 §D1, Consequences:
//! `events::publish_X(&mut tx, …).await?; tx.commit().await?`).
//!
//! The §D5 idempotency layer wraps these routes in a later step; today a retry of the same
//! request with the same `id` is answered 409, never written twice.

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

pub fn router() -> Router<AppState> {
    Router::new().route("/v1/cases/referrals", post(create_referral))
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
    let mut tx = state.pool.begin().await?;
    sqlx::query("INSERT INTO referrals (id, subject, created_by) VALUES ($1, $2, $3)")
        .bind(id)
        .bind(subject)
        .bind(by)
        .execute(&mut *tx)
        .await?;
    if let Some(direct) = &state.direct {
        // Compat pre-d1: commit, then publish; a failed publish is only logged.
        tx.commit().await?;
        if let Err(e) = direct.publish(&envelope).await {
            tracing::warn!(event = "compat.pre_d1_publish_failed", error = %e, "failed to publish case.referral_created");
        }
        return Ok(envelope.id);
    }
    publish_in_tx(&mut tx, &envelope).await?;
    tx.commit().await?;
    Ok(envelope.id)
}
