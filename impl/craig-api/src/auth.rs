//! Bearer auth for the fleet's HTTP surface (CONTRACT § fleet; audience semantics per
//! ADR-021, which ADR-022 points to): HS256 JWTs with claims `sub` (UUID), `aud` (array, or
//! a single string), `scope` (space separated) and `exp`.
//!
//! A missing, malformed, badly signed or expired token is 401; a valid token without the
//! route's audience or scope is 403 ([`Claims::require`]).

use axum::extract::{FromRef, FromRequestParts};
use axum::http::StatusCode;
use axum::http::request::Parts;
use axum::response::{IntoResponse, Response};
use base64::Engine as _;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use hmac::{Hmac, Mac};
use serde::{Deserialize, Serialize};
use sha2::Sha256;
use uuid::Uuid;

/// The HS256 key (`CRAIG_JWT_SECRET`).
#[derive(Clone)]
pub struct JwtKey(std::sync::Arc<[u8]>);

impl JwtKey {
    pub fn new(secret: impl AsRef<[u8]>) -> Self {
        Self(secret.as_ref().into())
    }

    fn mac(&self) -> Hmac<Sha256> {
        Hmac::<Sha256>::new_from_slice(&self.0).expect("HMAC takes any key length")
    }

    /// Sign `claims` (the harness and tests mint tokens with this).
    pub fn sign(&self, claims: &Claims) -> String {
        let header = URL_SAFE_NO_PAD.encode(br#"{"alg":"HS256","typ":"JWT"}"#);
        let body = URL_SAFE_NO_PAD.encode(serde_json::to_vec(claims).expect("claims serialize"));
        let signing_input = format!("{header}.{body}");
        let mut mac = self.mac();
        mac.update(signing_input.as_bytes());
        let sig = URL_SAFE_NO_PAD.encode(mac.finalize().into_bytes());
        format!("{signing_input}.{sig}")
    }

    /// Verify signature, algorithm and expiry against `now` (Unix seconds).
    pub fn verify(&self, token: &str, now: i64) -> Result<Claims, AuthError> {
        let mut parts = token.split('.');
        let (Some(h), Some(b), Some(s), None) = (parts.next(), parts.next(), parts.next(), parts.next()) else {
            return Err(AuthError::Malformed);
        };
        let header: Header = decode_json(h)?;
        if header.alg != "HS256" {
            return Err(AuthError::Algorithm(header.alg));
        }
        let sig = URL_SAFE_NO_PAD.decode(s).map_err(|_| AuthError::Malformed)?;
        let mut mac = self.mac();
        mac.update(h.as_bytes());
        mac.update(b".");
        mac.update(b.as_bytes());
        mac.verify_slice(&sig).map_err(|_| AuthError::Signature)?;
        let claims: Claims = decode_json(b)?;
        if claims.exp <= now {
            return Err(AuthError::Expired);
        }
        Ok(claims)
    }
}

#[derive(Deserialize)]
struct Header {
    alg: String,
}

fn decode_json<T: serde::de::DeserializeOwned>(part: &str) -> Result<T, AuthError> {
    let bytes = URL_SAFE_NO_PAD.decode(part).map_err(|_| AuthError::Malformed)?;
    serde_json::from_slice(&bytes).map_err(|_| AuthError::Malformed)
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Claims {
    pub sub: Uuid,
    #[serde(deserialize_with = "one_or_many")]
    pub aud: Vec<String>,
    #[serde(default)]
    pub scope: String,
    pub exp: i64,
}

fn one_or_many<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Vec<String>, D::Error> {
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum OneOrMany {
        One(String),
        Many(Vec<String>),
    }
    Ok(match OneOrMany::deserialize(d)? {
        OneOrMany::One(s) => vec![s],
        OneOrMany::Many(v) => v,
    })
}

impl Claims {
    pub fn has_scope(&self, scope: &str) -> bool {
        self.scope.split_ascii_whitespace().any(|s| s == scope)
    }

    /// 403 unless the token names `audience` and, when given, carries `scope`.
    pub fn require(&self, audience: &str, scope: Option<&str>) -> Result<(), AuthError> {
        if !self.aud.iter().any(|a| a == audience) {
            return Err(AuthError::Audience(audience.to_owned()));
        }
        match scope {
            Some(s) if !self.has_scope(s) => Err(AuthError::Scope(s.to_owned())),
            _ => Ok(()),
        }
    }
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum AuthError {
    #[error("missing bearer token")]
    Missing,
    #[error("malformed bearer token")]
    Malformed,
    #[error("unsupported token algorithm {0:?}")]
    Algorithm(String),
    #[error("bad token signature")]
    Signature,
    #[error("token expired")]
    Expired,
    #[error("token audience lacks {0}")]
    Audience(String),
    #[error("token scope lacks {0}")]
    Scope(String),
}

impl AuthError {
    pub fn status(&self) -> StatusCode {
        match self {
            AuthError::Audience(_) | AuthError::Scope(_) => StatusCode::FORBIDDEN,
            _ => StatusCode::UNAUTHORIZED,
        }
    }
}

impl IntoResponse for AuthError {
    fn into_response(self) -> Response {
        crate::error_response(self.status(), &self.to_string())
    }
}

/// Extractor: a verified bearer token. Audience and scope are the handler's to require.
#[derive(Debug, Clone)]
pub struct Bearer(pub Claims);

impl<S> FromRequestParts<S> for Bearer
where
    JwtKey: FromRef<S>,
    S: Send + Sync,
{
    type Rejection = AuthError;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, Self::Rejection> {
        verify_parts(&parts.headers, &JwtKey::from_ref(state)).map(Bearer)
    }
}

/// The verified claims of a request's `Authorization` header (what [`Bearer`] extracts),
/// for middleware that runs before any extractor.
pub fn verify_parts(headers: &axum::http::HeaderMap, key: &JwtKey) -> Result<Claims, AuthError> {
    let header = headers.get(axum::http::header::AUTHORIZATION).ok_or(AuthError::Missing)?;
    let value = header.to_str().map_err(|_| AuthError::Malformed)?;
    let token = bearer_token(value).ok_or(AuthError::Malformed)?;
    key.verify(token.trim(), chrono::Utc::now().timestamp())
}

/// The token of an `Authorization` value: the auth scheme matched case-insensitively
/// (RFC 7235 §2.1: `BEARER`, `bearer` and `Bearer` are one scheme), then one or more spaces.
pub fn bearer_token(value: &str) -> Option<&str> {
    let (scheme, rest) = value.split_once(' ')?;
    if !scheme.eq_ignore_ascii_case("bearer") {
        return None;
    }
    let token = rest.trim_matches(' ');
    (!token.is_empty()).then_some(token)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_bearer_scheme_is_case_insensitive() {
        for v in ["Bearer t.k.n", "bearer t.k.n", "BEARER t.k.n", "bEaReR   t.k.n"] {
            assert_eq!(bearer_token(v), Some("t.k.n"), "{v}");
        }
        for v in ["Basic t.k.n", "Bearert.k.n", "Bearer ", "Bearer", "", "Token t.k.n"] {
            assert_eq!(bearer_token(v), None, "{v:?}");
        }
    }

    fn claims(exp: i64) -> Claims {
        Claims { sub: Uuid::now_v7(), aud: vec!["craig-cases".into()], scope: "cases.admin other".into(), exp }
    }

    #[test]
    fn sign_verify_round_trip() {
        let key = JwtKey::new("k");
        let c = claims(2_000);
        assert_eq!(key.verify(&key.sign(&c), 1_000).unwrap(), c);
    }

    #[test]
    fn rejects_tampering_expiry_wrong_key_and_garbage() {
        let key = JwtKey::new("k");
        let token = key.sign(&claims(2_000));
        assert_eq!(key.verify(&token, 2_000), Err(AuthError::Expired));
        assert_eq!(JwtKey::new("other").verify(&token, 1_000), Err(AuthError::Signature));
        let mut forged: Vec<&str> = token.split('.').collect();
        let body = URL_SAFE_NO_PAD.encode(serde_json::to_vec(&claims(9_999)).unwrap());
        forged[1] = &body;
        assert_eq!(key.verify(&forged.join("."), 1_000), Err(AuthError::Signature));
        assert_eq!(key.verify("a.b", 0), Err(AuthError::Malformed));
        let none_alg = format!("{}.{}.", URL_SAFE_NO_PAD.encode(br#"{"alg":"none"}"#), token.split('.').nth(1).unwrap());
        assert_eq!(key.verify(&none_alg, 0), Err(AuthError::Algorithm("none".into())));
    }

    #[test]
    fn audience_and_scope_are_403() {
        let c = claims(10);
        assert_eq!(c.require("craig-cases", Some("cases.admin")), Ok(()));
        assert_eq!(c.require("craig-rules", None).unwrap_err().status(), StatusCode::FORBIDDEN);
        assert_eq!(c.require("craig-cases", Some("cases.adm")).unwrap_err().status(), StatusCode::FORBIDDEN);
    }

    #[test]
    fn single_string_audience_is_accepted() {
        let json = format!(r#"{{"sub":"{}","aud":"craig-cases","exp":1}}"#, Uuid::now_v7());
        let c: Claims = serde_json::from_str(&json).unwrap();
        assert_eq!(c.aud, ["craig-cases"]);
        assert_eq!(c.scope, "");
    }
}
