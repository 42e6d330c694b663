//! Where claims and responses live (ADR-022 §D5): `idempotency_responses` in the service's
//! own database, shared by every replica on it; or, compat `pre-d5` only, a map in this
//! process (lost on restart, invisible to the other replicas: the context's item 5).
//!
//! Every write after the claim is fenced by the claim generation (#1182, past the ADR): a
//! finalize names the generation it won and applies only while the row still carries it.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use sqlx::PgPool;
use uuid::Uuid;

/// How long a cached response (or a failed slot) lives by default: `expires_at = now() +
/// 24 h`; a node sets [`ClaimRequest::response_ttl`] from `CRAIG_IDEMPOTENCY_TTL_HOURS`.
pub const RESPONSE_TTL: Duration = Duration::from_secs(24 * 3600);

/// What the middleware asks to claim.
#[derive(Debug, Clone)]
pub struct ClaimRequest<'a> {
    pub cache_key: &'a str,
    pub method: &'a str,
    /// The bare path: descriptive only, never part of a lookup.
    pub path: &'a str,
    pub user_sub: Uuid,
    pub body_fingerprint: &'a str,
    /// `claim_expires_at = now() + claim_ttl` (30 s in production).
    pub claim_ttl: Duration,
    /// `expires_at = now() + response_ttl`: the row's life, for a new key and a re-claimed
    /// one alike (`CRAIG_IDEMPOTENCY_TTL_HOURS`, default [`RESPONSE_TTL`]).
    pub response_ttl: Duration,
}

/// The answer to a claim.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Claim {
    /// This request owns the slot; its finalize must name `generation`.
    Won { generation: i64 },
    /// A finished response for this key and body.
    Replay(StoredResponse),
    /// Another request holds the slot; its claim expires in `retry_after`.
    InFlight { retry_after: Duration },
    /// The key was used with a different request body (422).
    Mismatch,
}

/// A `succeeded` row as a replay serves it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoredResponse {
    pub status_code: u16,
    pub headers: Vec<(String, String)>,
    /// `None` for the too-large sentinel.
    pub body: Option<Vec<u8>>,
    pub body_too_large: bool,
}

/// The body a `succeeded` finalize stores (#1183: borrowed; the caller keeps its bytes).
#[derive(Debug, Clone, Copy)]
pub enum CachedBody<'a> {
    Full(&'a [u8]),
    /// The sentinel: status and headers kept, body NULL, `body_too_large = true`.
    TooLarge,
}

/// What a finalize did (#1183's typed outcomes).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Finalized {
    Applied,
    /// Zero rows: the slot vanished or was re-claimed under a newer generation (#1182).
    Lost,
}

#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// Transport or database error: for a finalize, the outcome is UNKNOWN.
    #[error("idempotency store: {0}")]
    Database(#[from] sqlx::Error),
    #[error("idempotency row {cache_key} is unreadable: {reason}")]
    Corrupt { cache_key: String, reason: String },
}

/// The store a layer uses.
#[derive(Clone)]
pub enum Store {
    Postgres(PgPool),
    /// Compat `pre-d5`: in-memory, this process only.
    Memory(Arc<Mutex<HashMap<String, MemRow>>>),
}

#[derive(Debug, Clone)]
pub struct MemRow {
    fingerprint: String,
    status: RowStatus,
    claim_expires: Instant,
    expires: Instant,
    generation: i64,
    response: Option<StoredResponse>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum RowStatus {
    Processing,
    Succeeded,
    Failed,
}

/// The claim: ONE statement. A key never seen, a row past its `expires_at` (#1194: the
/// row's lifetime is its own, whenever the cleanup runs), a `failed` slot or an expired
/// `processing` claim with the same body fingerprint is (re)claimed with the next
/// generation and a fresh `expires_at`; anything else is read back below.
const CLAIM: &str = "INSERT INTO idempotency_responses \
       (cache_key, method, path, user_sub, body_fingerprint, status, claim_expires_at, claim_generation, expires_at) \
     VALUES ($1, $2, $3, $4, $5, 'processing', now() + make_interval(secs => $6), 1, now() + make_interval(secs => $7)) \
     ON CONFLICT (cache_key) DO UPDATE SET \
       method = EXCLUDED.method, path = EXCLUDED.path, user_sub = EXCLUDED.user_sub, \
       body_fingerprint = EXCLUDED.body_fingerprint, status = 'processing', status_code = NULL, \
       headers = NULL, body = NULL, body_too_large = false, started_at = now(), finished_at = NULL, \
       claim_expires_at = EXCLUDED.claim_expires_at, created_at = now(), \
       expires_at = EXCLUDED.expires_at, \
       claim_generation = idempotency_responses.claim_generation + 1 \
     WHERE idempotency_responses.expires_at <= now() \
        OR (idempotency_responses.body_fingerprint IS NOT DISTINCT FROM EXCLUDED.body_fingerprint \
            AND (idempotency_responses.status = 'failed' \
                 OR (idempotency_responses.status = 'processing' AND idempotency_responses.claim_expires_at <= now()))) \
     RETURNING claim_generation";

const READ: &str = "SELECT status, body_fingerprint, status_code, headers, body, body_too_large, \
       GREATEST(EXTRACT(EPOCH FROM (claim_expires_at - now())), 0)::float8 \
     FROM idempotency_responses WHERE cache_key = $1 AND expires_at > now()";

type Row = (String, Option<String>, Option<i16>, Option<serde_json::Value>, Option<Vec<u8>>, bool, f64);

impl Store {
    pub fn postgres(pool: PgPool) -> Self {
        Store::Postgres(pool)
    }

    /// Compat `pre-d5`: a map in this process.
    pub fn memory() -> Self {
        Store::Memory(Arc::new(Mutex::new(HashMap::new())))
    }

    /// Claim `req.cache_key`, or say why not.
    pub async fn claim(&self, req: &ClaimRequest<'_>) -> Result<Claim, StoreError> {
        match self {
            Store::Postgres(pool) => {
                // A row deleted or finished between the two statements is simply looked at
                // again; three rounds bound a pathological race.
                for _ in 0..3 {
                    let won: Option<i64> = sqlx::query_scalar(CLAIM)
                        .bind(req.cache_key)
                        .bind(req.method)
                        .bind(req.path)
                        .bind(req.user_sub)
                        .bind(req.body_fingerprint)
                        .bind(req.claim_ttl.as_secs_f64())
                        .bind(req.response_ttl.as_secs_f64())
                        .fetch_optional(pool)
                        .await?;
                    if let Some(generation) = won {
                        return Ok(Claim::Won { generation });
                    }
                    let row: Option<Row> = sqlx::query_as(READ).bind(req.cache_key).fetch_optional(pool).await?;
                    let Some((status, fingerprint, code, headers, body, too_large, left)) = row else { continue };
                    if fingerprint.as_deref() != Some(req.body_fingerprint) {
                        return Ok(Claim::Mismatch);
                    }
                    match status.as_str() {
                        "succeeded" => return Ok(Claim::Replay(stored(req.cache_key, code, headers, body, too_large)?)),
                        "processing" if left > 0.0 => {
                            return Ok(Claim::InFlight { retry_after: Duration::from_secs_f64(left) });
                        }
                        _ => continue,
                    }
                }
                Ok(Claim::InFlight { retry_after: Duration::from_secs(1) })
            }
            Store::Memory(map) => {
                let now = Instant::now();
                let mut map = map.lock().expect("idempotency map poisoned");
                let fresh = |generation| MemRow {
                    fingerprint: req.body_fingerprint.to_owned(),
                    status: RowStatus::Processing,
                    claim_expires: now + req.claim_ttl,
                    expires: now + req.response_ttl,
                    generation,
                    response: None,
                };
                let Some(row) = map.get_mut(req.cache_key) else {
                    map.insert(req.cache_key.to_owned(), fresh(1));
                    return Ok(Claim::Won { generation: 1 });
                };
                let reclaim = row.expires <= now
                    || (row.fingerprint == req.body_fingerprint
                        && (row.status == RowStatus::Failed || (row.status == RowStatus::Processing && row.claim_expires <= now)));
                if reclaim {
                    let generation = row.generation + 1;
                    *row = fresh(generation);
                    return Ok(Claim::Won { generation });
                }
                if row.fingerprint != req.body_fingerprint {
                    return Ok(Claim::Mismatch);
                }
                match (&row.status, &row.response) {
                    (RowStatus::Succeeded, Some(r)) => Ok(Claim::Replay(r.clone())),
                    _ => Ok(Claim::InFlight { retry_after: row.claim_expires.saturating_duration_since(now) }),
                }
            }
        }
    }

    /// `processing` → `succeeded`, fenced by `generation` (#1182). An over-cap `Full` body is
    /// stored fail-safe as the sentinel (#1183).
    pub async fn finalize_succeeded(
        &self,
        cache_key: &str,
        generation: i64,
        status_code: u16,
        headers: &[(String, String)],
        body: CachedBody<'_>,
        cap: usize,
    ) -> Result<Finalized, StoreError> {
        let body = match body {
            CachedBody::Full(b) if b.len() > cap => CachedBody::TooLarge,
            b => b,
        };
        let (bytes, too_large) = match body {
            CachedBody::Full(b) => (Some(b), false),
            CachedBody::TooLarge => (None, true),
        };
        match self {
            Store::Postgres(pool) => {
                let json = serde_json::to_value(headers).expect("header pairs serialize");
                let done = sqlx::query(
                    "UPDATE idempotency_responses SET status = 'succeeded', status_code = $3, headers = $4, body = $5, \
                       body_too_large = $6, finished_at = now() \
                     WHERE cache_key = $1 AND claim_generation = $2 AND status = 'processing'",
                )
                .bind(cache_key)
                .bind(generation)
                .bind(status_code as i16)
                .bind(json)
                .bind(bytes)
                .bind(too_large)
                .execute(pool)
                .await?;
                Ok(if done.rows_affected() == 1 { Finalized::Applied } else { Finalized::Lost })
            }
            Store::Memory(map) => Ok(finalize_in_memory(map, cache_key, generation, |row| {
                row.status = RowStatus::Succeeded;
                row.response = Some(StoredResponse {
                    status_code,
                    headers: headers.to_vec(),
                    body: bytes.map(<[u8]>::to_vec),
                    body_too_large: too_large,
                });
            })),
        }
    }

    /// `processing` → `failed` (a non-2xx answer frees the slot), fenced by `generation`.
    pub async fn finalize_failed(&self, cache_key: &str, generation: i64, status_code: u16) -> Result<Finalized, StoreError> {
        match self {
            Store::Postgres(pool) => {
                let done = sqlx::query(
                    "UPDATE idempotency_responses SET status = 'failed', status_code = $3, finished_at = now() \
                     WHERE cache_key = $1 AND claim_generation = $2 AND status = 'processing'",
                )
                .bind(cache_key)
                .bind(generation)
                .bind(status_code as i16)
                .execute(pool)
                .await?;
                Ok(if done.rows_affected() == 1 { Finalized::Applied } else { Finalized::Lost })
            }
            Store::Memory(map) => Ok(finalize_in_memory(map, cache_key, generation, |row| row.status = RowStatus::Failed)),
        }
    }
}

/// The in-memory finalize: `apply` only to a `processing` row still on `generation` (the
/// same fence as the UPDATEs' WHERE).
fn finalize_in_memory(map: &Mutex<HashMap<String, MemRow>>, cache_key: &str, generation: i64, apply: impl FnOnce(&mut MemRow)) -> Finalized {
    let mut map = map.lock().expect("idempotency map poisoned");
    match map.get_mut(cache_key) {
        Some(row) if row.generation == generation && row.status == RowStatus::Processing => {
            apply(row);
            Finalized::Applied
        }
        _ => Finalized::Lost,
    }
}

fn stored(
    cache_key: &str,
    code: Option<i16>,
    headers: Option<serde_json::Value>,
    body: Option<Vec<u8>>,
    too_large: bool,
) -> Result<StoredResponse, StoreError> {
    let corrupt = |reason: &str| StoreError::Corrupt { cache_key: cache_key.to_owned(), reason: reason.to_owned() };
    let status_code = code.and_then(|c| u16::try_from(c).ok()).filter(|c| (100..=599).contains(c)).ok_or_else(|| corrupt("no valid status_code"))?;
    let headers: Vec<(String, String)> = match headers {
        None => Vec::new(),
        Some(v) => serde_json::from_value(v).map_err(|_| corrupt("headers are not [name, value] pairs"))?,
    };
    if !too_large && body.is_none() {
        return Err(corrupt("a succeeded row without body and without the sentinel flag"));
    }
    Ok(StoredResponse { status_code, headers, body: if too_large { None } else { body }, body_too_large: too_large })
}
