//! ADR-022 §D5, persistent idempotency middleware, as amended by #1183 (body integrity, the
//! post-2xx terminal rule) and #1184 (the raw query in the cache key), and past the ADR
//! where it names its own open defects (#1182, #1194).
//!
//! A request on an idempotent route goes through one state machine, shared by every replica
//! on the service's database (`idempotency_responses`):
//!
//! | step | answer |
//! |---|---|
//! | no valid bearer token / wrong audience | 401 / 403 (the key space is per `sub`) |
//! | no `Idempotency-Key` (or not 1..=255 visible ASCII without `:`; or two) | 400 |
//! | request body over 2 MiB | 413, the handler never runs |
//! | same key, different body (`sha256(body)`) | 422 |
//! | same key while the first is in flight | 409 with `Retry-After` (the claim's remaining life) |
//! | same key, finished | the stored response, `Idempotent-Replayed: true` |
//! | the too-large sentinel | its status and headers, empty body, `Idempotency-Body-Too-Large: true` |
//! | otherwise | the claim is won (`processing`, 30 s claim, 24 h row) and the handler runs |
//!
//! `cache_key = sha256(method:path:query:user_sub:idempotency_key)`, the query raw and
//! verbatim, `""` when absent (#1184); the `path` column is descriptive only.
//!
//! After the handler: a non-2xx passes through untouched and unbuffered and frees the slot
//! (`failed`), unless the handler marked it [`OutcomeUnknown`] (its own commit's
//! acknowledgement was lost, so its effects may be committed): then the row stays
//! `processing` and only the claim's expiry re-admits the key (`idempotency.outcome_unknown`;
//! the #1183 residue, never a re-run before the claim expires). A 2xx is captured frame by frame up to 1 MiB: a body that ends inside the
//! cap is stored and served; the frame that crosses the cap is split zero-copy AT the cap,
//! the sentinel (`succeeded`, `body_too_large`, body NULL) commits, and the live winner
//! receives prefix + remainder + the rest of the stream (`idempotency.overflow`). A
//! mid-stream body error stores the sentinel and re-emits the error after the prefix
//! (`idempotency.body_stream_error`): never a truncated "complete" body. A request dropped
//! after its 2xx (the client went away) fires a guard that spawns the sentinel finalize
//! (`idempotency.cancel_guard_fired`). A 2xx never finalizes `failed`: its effects are
//! committed, and a re-claimable slot would run them again (#1183's terminal rule).
//! Trailers survive the live path and are never cached. Finalizes return
//! [`Finalized::Applied`] or [`Finalized::Lost`] (`idempotency.finalize_lost`); a transport
//! error is outcome-unknown (`idempotency.finalize_unknown`). The live answer is served from
//! the caller's own bytes whatever the database said.
//!
//! **#1182, the claim generation (past the ADR).** Every claim and re-claim increments
//! `claim_generation`; every finalize (the live path's and the cancel guard's) applies only
//! `WHERE claim_generation = <the generation it won> AND status = 'processing'`. A stale
//! winner whose claim expired and was re-claimed gets `Lost`, so it can never overwrite the
//! new owner's slot, with a success or with the sentinel. What remains is the ADR's residue:
//! a winner that dies (or whose finalize fails) after its handler committed leaves its claim
//! to expire, and the retry after the claim's 30 s runs the handler again (the
//! re-claim shows as generation 2).
//!
//! A client that goes away BEFORE its handler answered drops the handler's future with it:
//! what the handler committed by then stays committed, the claim stays `processing` and
//! expires, and the retry runs the handler again (generation 2). That is the same residue,
//! outside the #1183 guard (which is armed only by a 2xx); handlers that must never run
//! twice keep a natural-key arbiter of their own (#1179's shape).
//!
//! //! **#1194, the expiry window (past the ADR).** A row's life is its own `expires_at`, not the
//! hourly cleanup's timing: the claim statement treats a row past `expires_at` as absent and
//! re-claims it in the same statement (so a replay never serves a row older than 24 h, and a
//! cleanup that runs late changes nothing a client can see); a re-claim restarts
//! `expires_at`, and the cleanup (in `craig_mq::retention`) never deletes a `processing` row
//! whose claim is live, so it cannot make a winner's finalize `Lost`.
//!
//! Compat: `pre-d5` ([`Store::memory`]: per process, lost on restart), `pre-1183` (the
//! capped `to_bytes` that stored an over-cap 2xx with an empty body and served it empty),
//! `pre-1184` (the query left out of the cache key).
//!
//! ```no_run
//! # async fn demo(pool: sqlx::PgPool) {
//! use axum::{Router, routing::post};
//! use craig_api::idempotency::{Config, IdempotencyLayer, Store};
//! let cfg = Config::new(craig_api::JwtKey::new("secret"), "craig-cases");
//! let app: Router = Router::new()
//!     .route("/v1/cases/exports", post(|| async { "done" }))
//!     .route_layer(IdempotencyLayer::new(cfg, Store::postgres(pool)));
//! # }
//! ```

mod layer;
mod service;
pub mod store;

use std::time::Duration;

use sha2::{Digest, Sha256};
use uuid::Uuid;

pub use layer::IdempotencyLayer;
pub use service::{Idempotency, describe_metrics, retry_after_secs};
pub use store::{CachedBody, Claim, ClaimRequest, Finalized, Store, StoreError, StoredResponse, RESPONSE_TTL};

use crate::JwtKey;

/// Request body cap: 2 MiB hard (413 above).
pub const REQUEST_BODY_CAP: usize = 2 * 1024 * 1024;
/// Cached response body cap: 1 MiB (the sentinel above).
pub const RESPONSE_BODY_CAP: usize = 1024 * 1024;
/// The client's key header.
pub const IDEMPOTENCY_KEY: &str = "idempotency-key";
/// On every replay.
pub const REPLAYED_HEADER: &str = "idempotent-replayed";
/// On a replay of the too-large sentinel.
pub const BODY_TOO_LARGE_HEADER: &str = "idempotency-body-too-large";
/// `claim_expires_at = now() + 30 s` in production.
pub const CLAIM_TTL: Duration = Duration::from_secs(30);

/// What a layer needs besides its store.
#[derive(Clone)]
pub struct Config {
    pub key: JwtKey,
    /// The audience a token must carry (`craig-<service>`).
    pub audience: String,
    pub claim_ttl: Duration,
    /// A row's life (`expires_at`), default [`store::RESPONSE_TTL`] (24 h).
    pub response_ttl: Duration,
    /// Compat pre-1183: over-cap 2xx stored and served empty.
    pub pre_1183: bool,
    /// Compat pre-1184: the query left out of the cache key.
    pub pre_1184: bool,
}

impl Config {
    pub fn new(key: JwtKey, audience: impl Into<String>) -> Self {
        Self { key, audience: audience.into(), claim_ttl: CLAIM_TTL, response_ttl: store::RESPONSE_TTL, pre_1183: false, pre_1184: false }
    }
}

/// What the handler behind the layer may read from the request's extensions: the key it
/// runs under, and the claim it won.
#[derive(Debug, Clone)]
pub struct IdempotencyContext {
    pub cache_key: String,
    pub key: String,
    pub generation: i64,
}

/// A handler's mark on a non-2xx response whose effects may have committed (a commit
/// whose acknowledgement the connection lost). The middleware then leaves the claim
/// `processing` instead of freeing the slot (`failed`): a `failed` slot is re-claimed at
/// once, and committed work would run again at once (#1183's terminal rule, read for the
/// non-2xx a handler cannot vouch for). Insert it into the response's extensions.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OutcomeUnknown;

fn hex(digest: impl AsRef<[u8]>) -> String {
    digest.as_ref().iter().map(|b| format!("{b:02x}")).collect()
}

/// `sha256(method ":" path ":" query ":" user_sub ":" idempotency_key)`, hex (#1184: the
/// query raw, `""` when absent).
pub fn cache_key(method: &str, path: &str, query: &str, user_sub: Uuid, key: &str) -> String {
    hex(Sha256::digest(format!("{method}:{path}:{query}:{user_sub}:{key}")))
}

/// `sha256(request body)`, hex.
pub fn body_fingerprint(body: &[u8]) -> String {
    hex(Sha256::digest(body))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_query_is_part_of_the_key_verbatim() {
        let sub = Uuid::nil();
        let a = cache_key("POST", "/v1/cases/exports", "size=1", sub, "k");
        assert_ne!(a, cache_key("POST", "/v1/cases/exports", "size=2", sub, "k"));
        assert_ne!(a, cache_key("POST", "/v1/cases/exports", "", sub, "k"));
        // Reordered queries are different keys: the documented simplicity choice.
        assert_ne!(cache_key("POST", "/p", "a=1&b=2", sub, "k"), cache_key("POST", "/p", "b=2&a=1", sub, "k"));
        assert_ne!(a, cache_key("POST", "/v1/cases/exports", "size=1", Uuid::max(), "k"), "per user");
        assert_eq!(a.len(), 64);
    }

    #[test]
    fn retry_after_is_the_claims_remaining_life_at_least_a_second() {
        assert_eq!(retry_after_secs(Duration::ZERO), 1);
        assert_eq!(retry_after_secs(Duration::from_millis(1500)), 2);
        assert_eq!(retry_after_secs(Duration::from_secs(30)), 30);
    }
}
