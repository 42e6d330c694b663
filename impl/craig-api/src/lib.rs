//! `craig-api`: the HTTP half of ADR-022.
//!
//! | module | what |
//! |---|---|
//! | [`auth`] | bearer tokens (ADR-021 audiences, referenced by ADR-022 §D4) |
//! | [`replay`] | §D4 admin event replay (#795 scope, the #965/#1129 retention rule) |
//! | [`idempotency`] | §D5 persistent idempotency middleware (#1183, #1184; #1182, #1194 past the ADR) |
//!
//! Every error leaves as a JSON response `{"error": "..."}` with a typed status: the
//! connection is never dropped unanswered.

pub mod auth;
pub mod idempotency;
pub mod replay;

use axum::Json;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};

pub use auth::{AuthError, Bearer, Claims, JwtKey};

/// `{"error": message}` with `status`.
pub fn error_response(status: StatusCode, message: &str) -> Response {
    (status, Json(serde_json::json!({ "error": message }))).into_response()
}
