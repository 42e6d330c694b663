//! Admin event replay — ADR-022 §D4, with the #795 `event_type` scope and the retention rule
//! of § Retention policy (#965/#1129).
//!
//! `POST /v1/<service>/admin/events/replay?from=<rfc3339>&to=<rfc3339>&event_type=<str>&dry_run=<bool>`
//! with a bearer token whose audience names `craig-<service>` and whose scope carries
//! `<service>.admin`. ONE statement re-stages the window (`published_at`, `attempts`,
//! `last_error` cleared, and the #1128 claim and row backoff with them), narrowed by
//! `event_type` when given; it answers the matched and re-staged counts (re-staged is 0 on a
//! dry run) and echoes the window and scope; every call is audit-logged with the acting
//! admin's `sub` (`replay.requested` / `replay.refused`, a `tracing::warn!`).
//!
//! Refused: a window reaching past the outbox retention (422, [`craig_mq::retention::
//! replay_allowed`], the one rule), an inverted or malformed window (400), a missing or bad
//! token (401), a token without the audience or scope (403).
//!
//! The outbox worker re-publishes the re-staged rows on its next tick; inbox dedup absorbs
//! the redeliveries inside its window, best-effort at-least-once (#1180).

use axum::Json;
use axum::extract::{FromRef, Query, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use chrono::{DateTime, Utc};
use craig_mq::Retention;
use craig_mq::retention::{ReplayRefused, replay_allowed};
use serde::Deserialize;
use serde_json::json;
use sqlx::PgPool;

use crate::{Bearer, JwtKey, error_response};

/// What the replay route needs.
#[derive(Clone)]
pub struct ReplayState {
    pub pool: PgPool,
    pub key: JwtKey,
    /// `cases`, `financial`, …: the route's path segment, audience and scope.
    pub service: String,
    pub retention: Retention,
}

impl FromRef<ReplayState> for JwtKey {
    fn from_ref(s: &ReplayState) -> JwtKey {
        s.key.clone()
    }
}

/// The replay route of `state.service`, ready to merge into a service's router.
pub fn router(state: ReplayState) -> axum::Router {
    let path = format!("/v1/{}/admin/events/replay", state.service);
    axum::Router::new().route(&path, axum::routing::post(replay)).with_state(state)
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ReplayParams {
    pub from: String,
    pub to: String,
    #[serde(default)]
    pub event_type: Option<String>,
    #[serde(default)]
    pub dry_run: Option<String>,
}

/// An RFC 3339 timestamp from a query value (a `+` that form decoding turned into a space is
/// put back).
fn timestamp(name: &str, v: &str) -> Result<DateTime<Utc>, String> {
    use chrono::Datelike;
    let t = DateTime::parse_from_rfc3339(&v.replace(' ', "+"))
        .map(|t| t.with_timezone(&Utc))
        .map_err(|e| format!("{name}={v:?} is not an RFC 3339 timestamp: {e}"))?;
    // Issue 21.3: what PostgreSQL's timestamptz and the window arithmetic both hold.
    if !(1..=9999).contains(&t.year()) {
        return Err(format!("{name}={v:?} is outside the years 0001..=9999"));
    }
    Ok(t)
}

async fn replay(
    State(st): State<ReplayState>,
    bearer: Result<Bearer, crate::AuthError>,
    params: Result<Query<ReplayParams>, axum::extract::rejection::QueryRejection>,
) -> Response {
    let claims = match bearer {
        Ok(Bearer(c)) => c,
        Err(e) => return e.into_response(),
    };
    if let Err(e) = claims.require(&format!("craig-{}", st.service), Some(&format!("{}.admin", st.service))) {
        return e.into_response();
    }
    let p = match params {
        Ok(Query(p)) => p,
        Err(e) => return error_response(StatusCode::BAD_REQUEST, &format!("replay needs from and to (RFC 3339): {e}")),
    };
    let (from, to) = match (timestamp("from", &p.from), timestamp("to", &p.to)) {
        (Ok(f), Ok(t)) => (f, t),
        (Err(e), _) | (_, Err(e)) => return error_response(StatusCode::BAD_REQUEST, &e),
    };
    let dry_run = match p.dry_run.as_deref() {
        None | Some("false") => false,
        Some("true") => true,
        Some(other) => return error_response(StatusCode::BAD_REQUEST, &format!("dry_run={other:?} is not true or false")),
    };
    if let Some(et) = &p.event_type {
        if et.is_empty() || et.len() > 255 || et.contains('\0') {
            return error_response(StatusCode::BAD_REQUEST, "event_type must be 1..=255 bytes without NUL");
        }
    }
    if let Err(why) = replay_allowed(from, to, Utc::now(), &st.retention) {
        tracing::warn!(event = "replay.refused", sub = %claims.sub, service = %st.service, %from, %to, event_type = ?p.event_type, dry_run, reason = %why);
        let status = match why {
            ReplayRefused::Inverted { .. } => StatusCode::BAD_REQUEST,
            ReplayRefused::PastRetention { .. } => StatusCode::UNPROCESSABLE_ENTITY,
        };
        return error_response(status, &why.to_string());
    }
    let counted: Result<(i64, i64), sqlx::Error> = sqlx::query_as(
        "WITH matched AS (SELECT id FROM event_outbox WHERE created_at BETWEEN $1 AND $2 AND ($3::text IS NULL OR event_type = $3)), \
              restaged AS (UPDATE event_outbox SET published_at = NULL, attempts = 0, last_error = NULL, claimed_at = NULL, \
                                  next_attempt_at = NULL \
                           WHERE id IN (SELECT id FROM matched) AND NOT $4 RETURNING 1) \
         SELECT (SELECT count(*) FROM matched), (SELECT count(*) FROM restaged)",
    )
    .bind(from)
    .bind(to)
    .bind(p.event_type.as_deref())
    .bind(dry_run)
    .fetch_one(&st.pool)
    .await;
    match counted {
        Ok((matched, restaged)) => {
            tracing::warn!(event = "replay.requested", sub = %claims.sub, service = %st.service, %from, %to, event_type = ?p.event_type, dry_run, matched, restaged);
            (
                StatusCode::OK,
                Json(json!({ "matched": matched, "restaged": restaged, "from": from, "to": to, "event_type": p.event_type, "dry_run": dry_run })),
            )
                .into_response()
        }
        // A value the database refuses as data (SQLSTATE class 22) is the caller's error.
        Err(sqlx::Error::Database(db)) if db.code().is_some_and(|c| c.starts_with("22")) => {
            error_response(StatusCode::BAD_REQUEST, &format!("the replay window was refused as data: {db}"))
        }
        Err(e) => {
            tracing::error!(event = "replay.failed", sub = %claims.sub, service = %st.service, error = %e);
            error_response(StatusCode::SERVICE_UNAVAILABLE, "database unavailable; nothing was re-staged")
        }
    }
}
