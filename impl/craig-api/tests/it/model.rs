//! The §D5 state machine against a model: random sequences of requests (bodies, failures,
//! responses around the 1 MiB cap, requests around the 2 MiB cap), clients that go away
//! after the 2xx, winners that die after claiming, and claim expiries, through the real
//! layer on a real database.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Duration;

use axum::body::Body;
use axum::extract::Query;
use axum::http::{Request, StatusCode};
use axum::response::IntoResponse;
use axum::routing::post;
use craig_api::idempotency::{BODY_TOO_LARGE_HEADER, Claim, ClaimRequest, IdempotencyLayer, REPLAYED_HEADER, Store, body_fingerprint, cache_key};
use proptest::prelude::*;
use tower::ServiceExt;
use uuid::Uuid;

use crate::common::*;

/// Response sizes: around the cache cap, and a small one.
const SIZES: [usize; 4] = [MIB - 1, MIB, MIB + 1, 5];
const BODIES: [&[u8]; 2] = [b"{\"a\":1}", b"{\"a\":2}"];

#[derive(Debug, Clone)]
enum Op {
    /// A request for key `k` with body `b`; the handler answers 500 when `fail`.
    Send { k: usize, b: usize, fail: bool },
    /// A request body around the 2 MiB cap: 2 MiB − 1, 2 MiB (accepted), 2 MiB + 1 (413).
    Large { k: usize, delta: i64 },
    /// A request for key `k` whose client goes away after the 2xx while the middleware is
    /// still capturing (the handler's body stalls): the cancel guard's sentinel.
    Cancel { k: usize, b: usize },
    /// A winner claims `k` and dies before its handler answered.
    Die { k: usize, b: usize },
    /// Every claim of this case expires.
    Expire,
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        6 => (0..4usize, 0..2usize, proptest::bool::weighted(0.2)).prop_map(|(k, b, fail)| Op::Send { k, b, fail }),
        1 => (0..4usize, -1..=1i64).prop_map(|(k, delta)| Op::Large { k, delta }),
        1 => (0..4usize, 0..2usize).prop_map(|(k, b)| Op::Cancel { k, b }),
        1 => (0..4usize, 0..2usize).prop_map(|(k, b)| Op::Die { k, b }),
        1 => Just(Op::Expire),
    ]
}

#[derive(Debug, Clone, Copy, PartialEq)]
enum M {
    Absent,
    Processing { b: usize, expired: bool },
    Failed { b: usize },
    Done { b: usize, sentinel: bool },
}

impl M {
    /// Whether a request with body `b` claims the slot.
    fn claims(self, b: usize) -> bool {
        match self {
            M::Absent => true,
            M::Failed { b: was } | M::Processing { b: was, expired: true } => was == b,
            _ => false,
        }
    }
}

#[test]
fn the_middleware_follows_the_state_machine() {
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    let (sandbox, pool) = rt.block_on(database("model"));
    let fail = Arc::new(AtomicBool::new(false));
    let stall = Arc::new(AtomicBool::new(false));
    let runs = Arc::new(AtomicUsize::new(0));
    let (f, st, r) = (fail.clone(), stall.clone(), runs.clone());
    let store = Store::postgres(pool.clone());
    let mut cfg = config();
    cfg.claim_ttl = Duration::from_secs(30);
    let app = axum::Router::new()
        .route(
            "/m",
            post(move |Query(q): Query<Size>| async move {
                r.fetch_add(1, Ordering::SeqCst);
                if f.load(Ordering::SeqCst) {
                    return (StatusCode::INTERNAL_SERVER_ERROR, "failed").into_response();
                }
                if st.load(Ordering::SeqCst) {
                    let first = futures_util::stream::iter([Ok::<_, std::convert::Infallible>(axum::body::Bytes::from_static(b"first"))]);
                    return axum::response::Response::new(Body::from_stream(futures_util::StreamExt::chain(first, futures_util::stream::pending())));
                }
                pattern(q.size.unwrap_or(0)).into_response()
            }),
        )
        .route_layer(IdempotencyLayer::new(cfg, store.clone()));

    let mut runner = proptest::test_runner::TestRunner::new(ProptestConfig { cases: 24, ..ProptestConfig::default() });
    runner
        .run(&proptest::collection::vec(op(), 1..12), |ops| {
            rt.block_on(async {
                let sub = Uuid::now_v7();
                let tok = token_for(sub, "craig-cases");
                // Key `k`'s request (its size in the query) with body `b`.
                let request = |k: usize, b: usize| {
                    Request::post(format!("/m?size={}", SIZES[k]))
                        .header("authorization", format!("Bearer {tok}"))
                        .header("idempotency-key", format!("k{k}"))
                        .body(Body::from(BODIES[b]))
                        .unwrap()
                };
                let mut model = [M::Absent; 4];
                for op in ops {
                    match op {
                        Op::Send { k, b, fail: failing } => {
                            fail.store(failing, Ordering::SeqCst);
                            let before = runs.load(Ordering::SeqCst);
                            let req = request(k, b);
                            let resp = app.clone().oneshot(req).await.unwrap();
                            let status = resp.status();
                            let replayed = resp.headers().contains_key(REPLAYED_HEADER);
                            let too_large = resp.headers().contains_key(BODY_TOO_LARGE_HEADER);
                            let body = axum::body::to_bytes(resp.into_body(), usize::MAX).await.unwrap();
                            let ran = runs.load(Ordering::SeqCst) - before;
                            let state = model[k];
                            if state.claims(b) {
                                prop_assert_eq!(ran, 1, "{:?} claims: the handler runs once", state);
                                if failing {
                                    prop_assert_eq!(status, StatusCode::INTERNAL_SERVER_ERROR);
                                    model[k] = M::Failed { b };
                                } else {
                                    prop_assert_eq!(status, StatusCode::OK);
                                    prop_assert!(!replayed);
                                    prop_assert!(body.as_ref() == pattern(SIZES[k]).as_slice(), "the live winner's full body");
                                    model[k] = M::Done { b, sentinel: SIZES[k] > MIB };
                                }
                                continue;
                            }
                            prop_assert_eq!(ran, 0, "{:?}: nothing re-executes", state);
                            match state {
                                M::Processing { b: was, .. } | M::Failed { b: was } | M::Done { b: was, .. } if was != b => {
                                    prop_assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY)
                                }
                                M::Processing { .. } => prop_assert_eq!(status, StatusCode::CONFLICT),
                                M::Done { sentinel, .. } => {
                                    prop_assert_eq!(status, StatusCode::OK);
                                    prop_assert!(replayed);
                                    prop_assert_eq!(too_large, sentinel);
                                    if sentinel {
                                        prop_assert!(body.is_empty());
                                    } else {
                                        prop_assert!(body.as_ref() == pattern(SIZES[k]).as_slice(), "the replay's full body");
                                    }
                                }
                                other => prop_assert!(false, "unexpected model state {:?}", other),
                            }
                        }
                        Op::Cancel { k, b } => {
                            if !model[k].claims(b) {
                                continue; // answered at once (409, 422 or a replay): Send covers it
                            }
                            fail.store(false, Ordering::SeqCst);
                            stall.store(true, Ordering::SeqCst);
                            let before = runs.load(Ordering::SeqCst);
                            let req = request(k, b);
                            let dropped = tokio::time::timeout(Duration::from_millis(300), app.clone().oneshot(req)).await.is_err();
                            stall.store(false, Ordering::SeqCst);
                            prop_assert!(dropped, "the stalled capture never answers");
                            prop_assert_eq!(runs.load(Ordering::SeqCst) - before, 1);
                            // The guard's spawned finalize: the sentinel, never failed.
                            let ck = cache_key("POST", "/m", &format!("size={}", SIZES[k]), sub, &format!("k{k}"));
                            let mut settled = None;
                            for _ in 0..60 {
                                settled = row(&pool, &ck).await.filter(|r| r.0 != "processing");
                                if settled.is_some() {
                                    break;
                                }
                                tokio::time::sleep(Duration::from_millis(50)).await;
                            }
                            let (status, _, len, sentinel, _) = settled.expect("the cancel guard finalized the row");
                            prop_assert_eq!((status.as_str(), len, sentinel), ("succeeded", None, true));
                            model[k] = M::Done { b, sentinel: true };
                        }
                        Op::Large { k, delta } => {
                            let n = (2 * MIB as i64 + delta) as usize;
                            let exact = delta <= 0;
                            let before = runs.load(Ordering::SeqCst);
                            fail.store(false, Ordering::SeqCst);
                            let req = Request::post(format!("/m?size={}", SIZES[k]))
                                .header("authorization", format!("Bearer {tok}"))
                                .header("idempotency-key", format!("large{k}-{n}"))
                                .body(Body::from(vec![b'z'; n]))
                                .unwrap();
                            let status = app.clone().oneshot(req).await.unwrap().status();
                            let ran = runs.load(Ordering::SeqCst) - before;
                            if exact {
                                // A fresh key each time it is first seen; later a replay.
                                prop_assert!(status == StatusCode::OK, "{} bytes are accepted, got {}", n, status);
                                prop_assert!(ran <= 1);
                            } else {
                                prop_assert_eq!((status, ran), (StatusCode::PAYLOAD_TOO_LARGE, 0));
                            }
                        }
                        Op::Die { k, b } => {
                            let ck = cache_key("POST", "/m", &format!("size={}", SIZES[k]), sub, &format!("k{k}"));
                            let fp = body_fingerprint(BODIES[b]);
                            let req = ClaimRequest { cache_key: &ck, method: "POST", path: "/m", user_sub: sub, body_fingerprint: &fp, claim_ttl: Duration::from_secs(30), response_ttl: craig_api::idempotency::RESPONSE_TTL };
                            let claim = store.claim(&req).await.unwrap();
                            prop_assert_eq!(matches!(claim, Claim::Won { .. }), model[k].claims(b), "{:?} with body {}", model[k], b);
                            if model[k].claims(b) {
                                model[k] = M::Processing { b, expired: false };
                            }
                        }
                        Op::Expire => {
                            sqlx::query("UPDATE idempotency_responses SET claim_expires_at = now() - interval '1 second' WHERE user_sub = $1 AND status = 'processing'")
                                .bind(sub)
                                .execute(&pool)
                                .await
                                .unwrap();
                            for m in &mut model {
                                if let M::Processing { b, .. } = *m {
                                    *m = M::Processing { b, expired: true };
                                }
                            }
                        }
                    }
                }
                Ok(())
            })
        })
        .unwrap();
    rt.block_on(async {
        pool.close().await;
        sandbox.destroy().await.unwrap();
    });
}
