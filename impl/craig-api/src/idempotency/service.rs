//! The middleware's service: one request through the §D5 state machine.

use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::http::{HeaderMap, HeaderName, HeaderValue, Request, Response, StatusCode, header};
use axum::response::IntoResponse;
use http_body::Frame;
use http_body_util::BodyExt;
use tower::{Service, ServiceExt};

use super::store::{CachedBody, Claim, ClaimRequest, Finalized, Store, StoreError, StoredResponse};
use super::{
    BODY_TOO_LARGE_HEADER, Config, IDEMPOTENCY_KEY, IdempotencyContext, REPLAYED_HEADER, REQUEST_BODY_CAP, RESPONSE_BODY_CAP, body_fingerprint,
    cache_key,
};
use crate::error_response;

/// The service [`IdempotencyLayer`](super::IdempotencyLayer) wraps a route with.
#[derive(Clone)]
pub struct Idempotency<S> {
    inner: S,
    cfg: Arc<Config>,
    store: Store,
}

impl<S> Idempotency<S> {
    pub fn new(inner: S, cfg: Arc<Config>, store: Store) -> Self {
        Self { inner, cfg, store }
    }

    pub fn get_ref(&self) -> &S {
        &self.inner
    }

    pub fn into_inner(self) -> S {
        self.inner
    }
}

impl<S> Service<Request<Body>> for Idempotency<S>
where
    S: Service<Request<Body>, Response = Response<Body>, Error = Infallible> + Clone + Send + 'static,
    S::Future: Send + 'static,
{
    type Response = Response<Body>;
    type Error = Infallible;
    type Future = Pin<Box<dyn Future<Output = Result<Response<Body>, Infallible>> + Send>>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        // The inner service is cloned and driven with `oneshot` per request.
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: Request<Body>) -> Self::Future {
        let (inner, cfg, store) = (self.inner.clone(), self.cfg.clone(), self.store.clone());
        Box::pin(async move { Ok(handle(inner, cfg, store, req).await) })
    }
}

/// Every `outcome` label `idempotency_requests_total` can carry.
pub const OUTCOMES: &[&str] =
    &["unauthorized", "missing_key", "request_too_large", "request_unreadable", "replay", "in_flight", "mismatch", "store_error", "miss"];

/// Zero every `idempotency_requests_total` series, so a scrape shows each from start-up.
pub fn describe_metrics() {
    metrics::describe_counter!("idempotency_requests_total", "Requests on idempotent routes by outcome (ADR-022 §D5)");
    for outcome in OUTCOMES {
        metrics::counter!("idempotency_requests_total", "outcome" => *outcome).increment(0);
    }
}

fn count(outcome: &'static str) {
    debug_assert!(OUTCOMES.contains(&outcome), "unknown idempotency outcome {outcome}");
    metrics::counter!("idempotency_requests_total", "outcome" => outcome).increment(1);
}

/// The key the client sent: exactly one `Idempotency-Key`, 1..=255 visible ASCII
/// characters. Anything else is the client's error (400), never a lookup.
fn idempotency_key(headers: &HeaderMap) -> Result<String, &'static str> {
    let mut values = headers.get_all(IDEMPOTENCY_KEY).iter();
    let (Some(v), None) = (values.next(), values.next()) else {
        return Err(if headers.contains_key(IDEMPOTENCY_KEY) {
            "send exactly one Idempotency-Key header"
        } else {
            "this route is idempotent: send an Idempotency-Key header"
        });
    };
    let bytes = v.as_bytes();
    // No ':' — the cache key joins its parts with ':', and a key without it keeps the
    // last two parts (user, key) unambiguous.
    if bytes.is_empty() || bytes.len() > 255 || !bytes.iter().all(|b| b.is_ascii_graphic() && *b != b':') {
        return Err("Idempotency-Key must be 1..=255 visible ASCII characters other than ':'");
    }
    Ok(String::from_utf8(bytes.to_vec()).expect("visible ASCII is UTF-8"))
}

async fn handle<S>(inner: S, cfg: Arc<Config>, store: Store, req: Request<Body>) -> Response<Body>
where
    S: Service<Request<Body>, Response = Response<Body>, Error = Infallible> + Clone + Send + 'static,
    S::Future: Send + 'static,
{
    let (mut parts, body) = req.into_parts();
    // Who: the key space is per `sub`, so one user never receives another's response.
    let claims = match crate::auth::verify_parts(&parts.headers, &cfg.key).and_then(|c| c.require(&cfg.audience, None).map(|()| c)) {
        Ok(c) => c,
        Err(e) => {
            count("unauthorized");
            return e.into_response();
        }
    };
    let key = match idempotency_key(&parts.headers) {
        Ok(k) => k,
        Err(why) => {
            count("missing_key");
            return error_response(StatusCode::BAD_REQUEST, why);
        }
    };
    // 2 MiB hard: refused before the handler, by the declared length or while reading.
    let declared = parts.headers.get(header::CONTENT_LENGTH).and_then(|v| v.to_str().ok()).and_then(|v| v.parse::<u64>().ok());
    if declared.is_some_and(|n| n > REQUEST_BODY_CAP as u64) {
        count("request_too_large");
        return error_response(StatusCode::PAYLOAD_TOO_LARGE, "request body over 2 MiB");
    }
    let bytes = match http_body_util::Limited::new(body, REQUEST_BODY_CAP).collect().await {
        Ok(c) => c.to_bytes(),
        Err(e) if e.is::<http_body_util::LengthLimitError>() => {
            count("request_too_large");
            return error_response(StatusCode::PAYLOAD_TOO_LARGE, "request body over 2 MiB");
        }
        Err(e) => {
            count("request_unreadable");
            return error_response(StatusCode::BAD_REQUEST, &format!("request body unreadable: {e}"));
        }
    };
    let method = parts.method.as_str().to_owned();
    let path = parts.uri.path().to_owned();
    // #1184: the raw query, verbatim ("" when absent). Compat pre-1184 leaves it out.
    let query = if cfg.pre_1184 { "" } else { parts.uri.query().unwrap_or("") };
    let ck = cache_key(&method, &path, query, claims.sub, &key);
    let fingerprint = body_fingerprint(&bytes);
    let claim = store
        .claim(&ClaimRequest { cache_key: &ck, method: &method, path: &path, user_sub: claims.sub, body_fingerprint: &fingerprint, claim_ttl: cfg.claim_ttl, response_ttl: cfg.response_ttl })
        .await;
    let generation = match claim {
        Ok(Claim::Won { generation }) => generation,
        Ok(Claim::Replay(stored)) => {
            count("replay");
            return replay(stored);
        }
        Ok(Claim::InFlight { retry_after }) => {
            count("in_flight");
            let secs = retry_after_secs(retry_after);
            let mut r = error_response(StatusCode::CONFLICT, "a request with this Idempotency-Key is in flight; retry after the claim settles");
            r.headers_mut().insert(header::RETRY_AFTER, HeaderValue::from(secs));
            return r;
        }
        Ok(Claim::Mismatch) => {
            count("mismatch");
            return error_response(StatusCode::UNPROCESSABLE_ENTITY, "this Idempotency-Key was used with a different request body");
        }
        Err(e) => {
            count("store_error");
            tracing::error!(event = "idempotency.claim_failed", cache_key = %ck, error = %e);
            return error_response(StatusCode::SERVICE_UNAVAILABLE, "idempotency store unavailable; the request was not run");
        }
    };
    count("miss");
    parts.extensions.insert(IdempotencyContext { cache_key: ck.clone(), key, generation });
    let Ok(response) = inner.oneshot(Request::from_parts(parts, Body::from(bytes))).await;
    let (rparts, rbody) = response.into_parts();
    let status = rparts.status.as_u16();
    if !rparts.status.is_success() {
        // Non-2xx: untouched, unbuffered; the slot is freed for a retry, unless the handler
        // cannot vouch that nothing committed: then the claim is left to expire.
        if rparts.extensions.get::<super::OutcomeUnknown>().is_some() {
            tracing::warn!(event = "idempotency.outcome_unknown", cache_key = %ck, generation, status, "the handler's outcome is unknown: the claim stays processing until it expires");
            // The key answers 409 until then: the client is told when to come back.
            let mut rparts = rparts;
            if !rparts.headers.contains_key(header::RETRY_AFTER) {
                rparts.headers.insert(header::RETRY_AFTER, HeaderValue::from(retry_after_secs(cfg.claim_ttl)));
            }
            return Response::from_parts(rparts, rbody);
        }
        let outcome = store.finalize_failed(&ck, generation, status).await;
        log_finalize("failed", &ck, generation, outcome);
        return Response::from_parts(rparts, rbody);
    }
    let stored_headers = headers_to_store(&rparts.headers);
    if cfg.pre_1183 {
        return pre_1183(&store, &ck, generation, rparts, rbody, stored_headers).await;
    }
    // #1183: from here the handler's effects are committed; a cancellation finalizes the
    // sentinel through the guard, never `failed`.
    let mut guard = CancelGuard { store: Some(store.clone()), cache_key: ck.clone(), generation, status, headers: stored_headers.clone() };
    let mut frames: Vec<Frame<Bytes>> = Vec::new();
    let mut size = 0usize;
    let mut body = rbody;
    loop {
        match body.frame().await {
            None => {
                let full: Vec<u8> = frames.iter().filter_map(|f| f.data_ref()).flat_map(|d| d.iter().copied()).collect();
                let outcome = store.finalize_succeeded(&ck, generation, status, &stored_headers, CachedBody::Full(&full), RESPONSE_BODY_CAP).await;
                // Disarmed only once the finalize returned: a request dropped DURING it still
                // gets the guard's (fenced, status-guarded, so idempotent) sentinel finalize.
                guard.disarm();
                log_finalize("succeeded", &ck, generation, outcome);
                return Response::from_parts(rparts, Body::new(Relayed::new(frames, None, None)));
            }
            Some(Ok(frame)) => match frame.into_data() {
                Ok(mut data) => {
                    if size + data.len() > RESPONSE_BODY_CAP {
                        // Split zero-copy AT the cap: the prefix, then the remainder and the
                        // rest of the handler's body stream through to the live winner.
                        let head = data.split_to(RESPONSE_BODY_CAP - size);
                        tracing::info!(event = "idempotency.overflow", cache_key = %ck, generation, cap = RESPONSE_BODY_CAP, "response over the cache cap: storing the sentinel, streaming the full body live");
                        frames.push(Frame::data(head));
                        frames.push(Frame::data(data));
                        let outcome = store.finalize_succeeded(&ck, generation, status, &stored_headers, CachedBody::TooLarge, RESPONSE_BODY_CAP).await;
                        guard.disarm();
                        log_finalize("sentinel", &ck, generation, outcome);
                        return Response::from_parts(rparts, Body::new(Relayed::new(frames, Some(body), None)));
                    }
                    size += data.len();
                    frames.push(Frame::data(data));
                }
                // Trailers: kept for the live path, never cached.
                Err(trailers) => frames.push(trailers),
            },
            Some(Err(e)) => {
                tracing::warn!(event = "idempotency.body_stream_error", cache_key = %ck, generation, error = %e, "2xx body failed mid-stream: storing the sentinel, re-emitting the error after the prefix");
                let outcome = store.finalize_succeeded(&ck, generation, status, &stored_headers, CachedBody::TooLarge, RESPONSE_BODY_CAP).await;
                guard.disarm();
                log_finalize("sentinel", &ck, generation, outcome);
                return Response::from_parts(rparts, Body::new(Relayed::new(frames, None, Some(e))));
            }
        }
    }
}

/// Compat pre-1183: the capped `to_bytes` (limit cap + 1) that emptied an over-cap 2xx and
/// persisted the empty body as a canonical `succeeded` row (live and on every replay); the
/// documented sentinel materialized only for a body of exactly cap + 1 bytes.
async fn pre_1183(
    store: &Store,
    ck: &str,
    generation: i64,
    mut rparts: axum::http::response::Parts,
    rbody: Body,
    headers: Vec<(String, String)>,
) -> Response<Body> {
    let bytes = axum::body::to_bytes(rbody, RESPONSE_BODY_CAP + 1).await.unwrap_or_default();
    let cached = if bytes.len() > RESPONSE_BODY_CAP { CachedBody::TooLarge } else { CachedBody::Full(&bytes) };
    let outcome = store.finalize_succeeded(ck, generation, rparts.status.as_u16(), &headers, cached, RESPONSE_BODY_CAP).await;
    log_finalize("succeeded", ck, generation, outcome);
    rparts.headers.remove(header::CONTENT_LENGTH);
    Response::from_parts(rparts, Body::from(bytes))
}

/// A replay: the stored status and headers, `Idempotent-Replayed: true`; the sentinel
/// answers with an empty body and `Idempotency-Body-Too-Large: true`. Never the handler.
pub(super) fn replay(stored: StoredResponse) -> Response<Body> {
    let status = StatusCode::from_u16(stored.status_code).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    let mut r = Response::new(Body::from(stored.body.unwrap_or_default()));
    *r.status_mut() = status;
    let h = r.headers_mut();
    for (name, value) in &stored.headers {
        if let (Ok(n), Ok(v)) = (HeaderName::try_from(name.as_str()), HeaderValue::try_from(value.as_str())) {
            h.append(n, v);
        }
    }
    h.insert(REPLAYED_HEADER, HeaderValue::from_static("true"));
    if stored.body_too_large {
        h.insert(BODY_TOO_LARGE_HEADER, HeaderValue::from_static("true"));
    }
    r
}

/// The response headers a row keeps: everything but framing and hop-by-hop headers
/// (a replay frames its own body).
fn headers_to_store(headers: &HeaderMap) -> Vec<(String, String)> {
    const SKIP: [HeaderName; 4] = [header::CONTENT_LENGTH, header::TRANSFER_ENCODING, header::CONNECTION, header::TRAILER];
    headers
        .iter()
        .filter(|(n, _)| !SKIP.contains(n))
        .filter_map(|(n, v)| v.to_str().ok().map(|v| (n.as_str().to_owned(), v.to_owned())))
        .collect()
}

/// #1183's typed outcomes as events: Lost and unknown are logged; the caller serves its
/// own bytes whatever the database says.
fn log_finalize(to: &'static str, ck: &str, generation: i64, outcome: Result<Finalized, StoreError>) {
    match outcome {
        Ok(Finalized::Applied) => tracing::debug!(event = "idempotency.finalized", cache_key = %ck, generation, to),
        Ok(Finalized::Lost) => {
            tracing::warn!(event = "idempotency.finalize_lost", cache_key = %ck, generation, to, "the slot vanished or was re-claimed under a newer generation")
        }
        Err(e) => tracing::error!(event = "idempotency.finalize_unknown", cache_key = %ck, generation, to, error = %e, "finalize outcome unknown"),
    }
}

/// Armed once the handler answered 2xx: dropped before the finalize ran (the client went
/// away), it spawns the sentinel finalize (#1183), fenced like every finalize (#1182).
struct CancelGuard {
    store: Option<Store>,
    cache_key: String,
    generation: i64,
    status: u16,
    headers: Vec<(String, String)>,
}

impl CancelGuard {
    fn disarm(&mut self) {
        self.store = None;
    }
}

impl Drop for CancelGuard {
    fn drop(&mut self) {
        let Some(store) = self.store.take() else { return };
        let Ok(rt) = tokio::runtime::Handle::try_current() else { return };
        let (ck, generation, status, headers) = (std::mem::take(&mut self.cache_key), self.generation, self.status, std::mem::take(&mut self.headers));
        tracing::warn!(event = "idempotency.cancel_guard_fired", cache_key = %ck, generation, "request dropped after a 2xx: finalizing the sentinel");
        rt.spawn(async move {
            let outcome = store.finalize_succeeded(&ck, generation, status, &headers, CachedBody::TooLarge, RESPONSE_BODY_CAP).await;
            log_finalize("sentinel", &ck, generation, outcome);
        });
    }
}

/// The live body after capture: the buffered frames (prefix, split remainder, trailers),
/// then the rest of the handler's body, or the handler's own error re-emitted.
struct Relayed {
    frames: std::collections::VecDeque<Frame<Bytes>>,
    rest: Option<Body>,
    error: Option<axum::Error>,
}

impl Relayed {
    fn new(frames: Vec<Frame<Bytes>>, rest: Option<Body>, error: Option<axum::Error>) -> Self {
        Self { frames: frames.into(), rest, error }
    }
}

impl http_body::Body for Relayed {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, axum::Error>>> {
        if let Some(f) = self.frames.pop_front() {
            return Poll::Ready(Some(Ok(f)));
        }
        if let Some(e) = self.error.take() {
            return Poll::Ready(Some(Err(e)));
        }
        match self.rest.as_mut() {
            Some(rest) => Pin::new(rest).poll_frame(cx),
            None => Poll::Ready(None),
        }
    }

    fn is_end_stream(&self) -> bool {
        self.frames.is_empty() && self.error.is_none() && self.rest.as_ref().is_none_or(http_body::Body::is_end_stream)
    }

    fn size_hint(&self) -> http_body::SizeHint {
        let buffered: u64 = self.frames.iter().filter_map(|f| f.data_ref()).map(|d| d.len() as u64).sum();
        match (&self.rest, &self.error) {
            (_, Some(_)) => http_body::SizeHint::default(),
            (None, None) => http_body::SizeHint::with_exact(buffered),
            (Some(rest), None) => {
                let h = http_body::Body::size_hint(rest);
                let mut s = http_body::SizeHint::new();
                s.set_lower(h.lower() + buffered);
                if let Some(u) = h.upper() {
                    s.set_upper(u + buffered);
                }
                s
            }
        }
    }
}

/// How long a client should wait before retrying an in-flight key: the claim's remaining
/// life, at least one second.
pub fn retry_after_secs(left: Duration) -> u64 {
    left.as_secs_f64().ceil().max(1.0) as u64
}
