//! A test server: routes behind the §D5 layer on 127.0.0.1:0, over a sandboxed database.
#![allow(dead_code)]

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::Query;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use craig_api::idempotency::{Config, IdempotencyLayer, Store};
use craig_api::{Claims, JwtKey};
use craig_sandbox::Sandbox;
use sqlx::PgPool;
use uuid::Uuid;

pub const SECRET: &str = "idempotency-test-secret";
pub const MIB: usize = 1024 * 1024;

/// cases' migrations, read from the checkout (runtime resolve: no sqlx macro crates).
pub async fn migrator() -> sqlx::migrate::Migrator {
    sqlx::migrate::Migrator::new(std::path::Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/../../migrations/cases"))).await.expect("migrations/cases")
}

/// How many times each test route's handler ran.
#[derive(Clone, Default)]
pub struct Runs(Arc<AtomicUsize>);

impl Runs {
    pub fn get(&self) -> usize {
        self.0.load(Ordering::SeqCst)
    }
    fn bump(&self) {
        self.0.fetch_add(1, Ordering::SeqCst);
    }
}

#[derive(serde::Deserialize)]
pub struct Size {
    pub size: Option<usize>,
    pub ms: Option<u64>,
}

/// `n` bytes of a fixed pattern, in frames of 64 000 bytes (so the 1 MiB cap falls inside one).
pub fn pattern(n: usize) -> Vec<u8> {
    (0..n).map(|i| b"abcdefghijklmnopqrstuvwxyz0123456789"[i % 36]).collect()
}

fn framed(bytes: Vec<u8>) -> Body {
    let frames: Vec<Result<Bytes, std::convert::Infallible>> = bytes.chunks(64_000).map(|c| Ok(Bytes::copy_from_slice(c))).collect();
    Body::from_stream(futures_util::stream::iter(frames))
}

/// The routes: `/ok?size=N[&ms=M]` (200, N bytes, after M ms), `/fail?size=N` (500 with N
/// bytes), `/broken?size=N` (200, N bytes then a body error), `/stall` (200, one frame,
/// then never ends), `/unknown` (503 marked `OutcomeUnknown`: a commit whose
/// acknowledgement was lost).
pub fn routes(runs: Runs) -> Router {
    let r1 = runs.clone();
    let r2 = runs.clone();
    let r3 = runs.clone();
    let r4 = runs.clone();
    let r5 = runs;
    Router::new()
        .route(
            "/unknown",
            post(move || async move {
                r5.bump();
                let mut r = (StatusCode::SERVICE_UNAVAILABLE, "whether it was made is unknown").into_response();
                r.extensions_mut().insert(craig_api::idempotency::OutcomeUnknown);
                r
            }),
        )
        .route(
            "/ok",
            post(move |Query(q): Query<Size>| async move {
                r1.bump();
                if let Some(ms) = q.ms {
                    tokio::time::sleep(Duration::from_millis(ms)).await;
                }
                let n = q.size.unwrap_or(0);
                let mut r = framed(pattern(n)).into_response();
                r.headers_mut().insert("content-type", "application/octet-stream".parse().unwrap());
                r.headers_mut().insert("x-handler", "ok".parse().unwrap());
                r
            }),
        )
        .route(
            "/fail",
            post(move |Query(q): Query<Size>| async move {
                r2.bump();
                (StatusCode::INTERNAL_SERVER_ERROR, framed(pattern(q.size.unwrap_or(0)))).into_response()
            }),
        )
        .route(
            "/broken",
            post(move |Query(q): Query<Size>| async move {
                r3.bump();
                let prefix = Bytes::from(pattern(q.size.unwrap_or(0)));
                let frames: Vec<Result<Bytes, std::io::Error>> = vec![Ok(prefix), Err(std::io::Error::other("handler body failed"))];
                Response::new(Body::from_stream(futures_util::stream::iter(frames)))
            }),
        )
        .route(
            "/stall",
            post(move || async move {
                r4.bump();
                let first = futures_util::stream::iter([Ok::<_, std::convert::Infallible>(Bytes::from_static(b"first"))]);
                Response::new(Body::from_stream(futures_util::StreamExt::chain(first, futures_util::stream::pending())))
            }),
        )
}

pub struct Server {
    pub base: String,
    pub pool: PgPool,
    pub runs: Runs,
    pub sandbox: Option<Sandbox>,
    task: tokio::task::JoinHandle<()>,
}

pub fn config() -> Config {
    let mut c = Config::new(JwtKey::new(SECRET), "craig-cases");
    c.claim_ttl = Duration::from_secs(2);
    c
}

/// A sandboxed database with the cases schema.
pub async fn database(label: &str) -> (Sandbox, PgPool) {
    let sandbox = Sandbox::create(&format!("craig-api::{label}"), &["cases"]).await.expect("sandbox");
    let pool = sandbox.pool("cases").await.expect("pool");
    migrator().await.run(&pool).await.expect("migrate");
    (sandbox, pool)
}

impl Server {
    pub async fn start(label: &str, cfg: Config) -> Self {
        let (sandbox, pool) = database(label).await;
        let mut s = Self::on(pool, cfg).await;
        s.sandbox = Some(sandbox);
        s
    }

    /// Another server (a second replica) on the same database.
    pub async fn on(pool: PgPool, cfg: Config) -> Self {
        let runs = Runs::default();
        let app = routes(runs.clone()).route_layer(IdempotencyLayer::new(cfg, Store::postgres(pool.clone())));
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let base = format!("http://{}", listener.local_addr().unwrap());
        let task = tokio::spawn(async move {
            axum::serve(listener, app).await.unwrap();
        });
        Self { base, pool, runs, sandbox: None, task }
    }

    pub async fn finish(mut self) {
        self.task.abort();
        self.pool.close().await;
        if let Some(s) = self.sandbox.take() {
            s.destroy().await.expect("destroy sandbox");
        }
    }
}

pub fn token_for(sub: Uuid, aud: &str) -> String {
    JwtKey::new(SECRET).sign(&Claims { sub, aud: vec![aud.into()], scope: String::new(), exp: chrono::Utc::now().timestamp() + 600 })
}

pub fn token() -> String {
    token_for(Uuid::from_u128(7), "craig-cases")
}

pub fn client() -> reqwest::Client {
    reqwest::Client::builder().timeout(Duration::from_secs(20)).build().unwrap()
}

/// The row a cache key left: (status, status_code, body length, body_too_large, generation).
pub async fn row(pool: &PgPool, cache_key: &str) -> Option<(String, Option<i16>, Option<i32>, bool, i64)> {
    sqlx::query_as(
        "SELECT status, status_code, length(body), body_too_large, claim_generation FROM idempotency_responses WHERE cache_key = $1",
    )
    .bind(cache_key)
    .fetch_optional(pool)
    .await
    .unwrap()
}

pub fn key_of(path: &str, query: &str, key: &str) -> String {
    craig_api::idempotency::cache_key("POST", path, query, Uuid::from_u128(7), key)
}
