//! The §D5 middleware in `chaos bench`: requests/s and latency of a cache miss and of a
//! replay, against the same route without the layer, driven by a real HTTP client over TCP
//! with 16 requests in flight.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Instant;

use axum::Router;
use axum::routing::post;
use craig_api::idempotency::{Config, IDEMPOTENCY_KEY, IdempotencyLayer, REPLAYED_HEADER, Store};
use serde_json::json;
use uuid::Uuid;

use super::{BenchOptions, Env, Figure, percentile, progress, throughput};

const CONCURRENCY: usize = 16;
const SECRET: &str = "chaos-bench-secret";

async fn answer(_body: axum::body::Bytes) -> Vec<u8> {
    vec![b'x'; 1000]
}

/// Serve the bench routes on loopback: `/bench/idem` behind the layer, `/bench/bare` not.
async fn serve(env: &Env) -> anyhow::Result<std::net::SocketAddr> {
    let cfg = Config::new(craig_api::JwtKey::new(SECRET), "craig-cases");
    let layer = IdempotencyLayer::new(cfg, Store::postgres(env.cases.clone()));
    let app = Router::new().route("/bench/idem", post(answer)).route_layer(layer).merge(Router::new().route("/bench/bare", post(answer)));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    tokio::spawn(async move {
        let _ = axum::serve(listener, app).await;
    });
    Ok(addr)
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Kind {
    Bare,
    Miss,
    Replay,
}

/// `n` requests, 16 in flight; (requests/s, sorted latencies in ms, wrong answers).
async fn drive(client: &reqwest::Client, addr: std::net::SocketAddr, token: &str, kind: Kind, n: usize, keys: &[String]) -> anyhow::Result<(f64, Vec<f64>, usize)> {
    let next = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let t = Instant::now();
    let mut tasks = Vec::new();
    for worker in 0..CONCURRENCY {
        let (client, token, next, keys) = (client.clone(), token.to_owned(), next.clone(), keys.to_vec());
        tasks.push(tokio::spawn(async move {
            let mut lat = Vec::new();
            let mut wrong = 0usize;
            while next.fetch_add(1, std::sync::atomic::Ordering::Relaxed) < n {
                let key = match kind {
                    Kind::Replay => keys[worker % keys.len()].clone(),
                    _ => Uuid::now_v7().to_string(),
                };
                let path = if kind == Kind::Bare { "bare" } else { "idem" };
                let started = Instant::now();
                let res = client
                    .post(format!("http://{addr}/bench/{path}"))
                    .bearer_auth(&token)
                    .header(IDEMPOTENCY_KEY, &key)
                    .body(r#"{"n":1}"#)
                    .send()
                    .await;
                let ok = match res {
                    Ok(r) => {
                        let replayed = r.headers().get(REPLAYED_HEADER).is_some();
                        let status = r.status();
                        let body = r.bytes().await.map(|b| b.len()).unwrap_or(0);
                        status.is_success() && body == 1000 && replayed == (kind == Kind::Replay)
                    }
                    Err(_) => false,
                };
                lat.push(started.elapsed().as_secs_f64() * 1000.0);
                wrong += usize::from(!ok);
            }
            (lat, wrong)
        }));
    }
    let (mut all, mut wrong) = (Vec::new(), 0);
    for task in tasks {
        let (lat, w) = task.await?;
        all.extend(lat);
        wrong += w;
    }
    let secs = t.elapsed().as_secs_f64();
    all.sort_by(|a, b| a.total_cmp(b));
    Ok((all.len() as f64 / secs, all, wrong))
}

pub(super) async fn middleware(env: &Env, opts: &BenchOptions) -> anyhow::Result<(Vec<Figure>, Vec<String>)> {
    let addr = serve(env).await?;
    let token = craig_api::JwtKey::new(SECRET).sign(&craig_api::Claims {
        sub: Uuid::now_v7(),
        aud: vec!["craig-cases".into()],
        scope: String::new(),
        exp: chrono::Utc::now().timestamp() + 3600,
    });
    let client = reqwest::Client::builder().pool_max_idle_per_host(CONCURRENCY).build()?;
    // The replayed keys: one per client, each answered once before the clock starts.
    let keys: Vec<String> = (0..CONCURRENCY).map(|_| Uuid::now_v7().to_string()).collect();
    for k in &keys {
        let r = client.post(format!("http://{addr}/bench/idem")).bearer_auth(&token).header(IDEMPOTENCY_KEY, k).body(r#"{"n":1}"#).send().await?;
        anyhow::ensure!(r.status().is_success(), "warming a replay key: {}", r.status());
    }
    // Warm the connection pool and the server.
    drive(&client, addr, &token, Kind::Bare, CONCURRENCY * 4, &keys).await?;
    let mut rps: BTreeMap<&str, Vec<f64>> = BTreeMap::new();
    let mut lat: BTreeMap<&str, Vec<f64>> = BTreeMap::new();
    let mut failures = Vec::new();
    for round in 1..=opts.rounds {
        for (name, kind) in [("bare", Kind::Bare), ("miss", Kind::Miss), ("replay", Kind::Replay)] {
            let (r, l, wrong) = drive(&client, addr, &token, kind, opts.requests, &keys).await?;
            if wrong > 0 {
                failures.push(format!("middleware {name} round {round}: {wrong} of {} answers were not the expected 200 (replayed only for a replay)", l.len()));
            }
            progress(format!("middleware round {round}/{} {name}: {r:.0} req/s, p50 {:.2} ms, p99 {:.2} ms", opts.rounds, percentile(&l, 50.0), percentile(&l, 99.0)));
            rps.entry(name).or_default().push(r);
            lat.entry(name).or_default().extend(l);
        }
    }
    for v in lat.values_mut() {
        v.sort_by(|a, b| a.total_cmp(b));
    }
    let pcts = |name: &str| {
        let v = &lat[name];
        json!({ "p50_ms": percentile(v, 50.0), "p99_ms": percentile(v, 99.0), "requests": v.len() })
    };
    let mut figures = Vec::new();
    for (id, name, label) in [("idem_miss", "miss", "cache miss"), ("idem_replay", "replay", "replay")] {
        let mut details = BTreeMap::new();
        details.insert("subject".into(), pcts(name));
        details.insert("baseline".into(), pcts("bare"));
        details.insert("concurrency".into(), json!(CONCURRENCY));
        figures.push(throughput(
            id,
            &format!("requests/s of a {label} against the same route without the layer, {CONCURRENCY} in flight over TCP"),
            "req/s",
            (label, rps[name].clone()),
            ("no layer", rps["bare"].clone()),
            None,
            details,
        ));
    }
    Ok((figures, failures))
}
