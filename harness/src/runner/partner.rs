//! The partner HTTP server the financial send queue POSTs to (ADR-022 #1185), run by the
//! harness on loopback. It records every POST — its `craig_correlation_id` and the replica
//! that sent it (the `craig-replica` header) — as `Event::PartnerPost`, and behaves as
//! `[partner]` says: slow (`delay_ms`), failing (`fail_share` answered 500) or accepting and
//! then hanging (`hang_share`: recorded, never answered; the sender's 30 s cap ends it).
//!
//! Like a real partner with a dedup boundary on the correlation id, a POST of a
//! transmission it is still processing is answered 409 (a concurrent duplicate: refused),
//! and one it already accepted is answered 200 again (an idempotent replay).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use rand::{RngExt, SeedableRng};
use rand_chacha::ChaCha8Rng;
use uuid::Uuid;

use super::Log;
use crate::history::Event;
use crate::scenario::PartnerSpec;

#[derive(Clone, Copy, PartialEq, Eq)]
enum Seen {
    InProgress,
    Accepted,
}

struct Shared {
    spec: PartnerSpec,
    log: Log,
    rng: Mutex<ChaCha8Rng>,
    seen: Mutex<HashMap<Uuid, Seen>>,
}

/// Serve on an ephemeral loopback port; returns the URL the replicas POST to and the task.
pub(super) async fn serve(spec: PartnerSpec, log: Log, seed: u64) -> anyhow::Result<(String, tokio::task::JoinHandle<()>)> {
    let shared = Arc::new(Shared { spec, log, rng: Mutex::new(ChaCha8Rng::seed_from_u64(seed)), seen: Mutex::default() });
    let app = axum::Router::new().route("/transmissions", axum::routing::post(transmission)).with_state(shared);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let url = format!("http://{}/transmissions", listener.local_addr()?);
    let task = tokio::spawn(async move {
        let _ = axum::serve(listener, app).await;
    });
    Ok((url, task))
}

async fn transmission(State(p): State<Arc<Shared>>, headers: HeaderMap, body: axum::body::Bytes) -> StatusCode {
    let correlation = serde_json::from_slice::<serde_json::Value>(&body)
        .ok()
        .and_then(|v| v.get("craig_correlation_id").and_then(|c| c.as_str()).and_then(|c| c.parse::<Uuid>().ok()));
    let replica = headers.get("craig-replica").and_then(|v| v.to_str().ok()).map(str::to_owned);
    let Some(correlation) = correlation else {
        p.log.push(Event::PartnerPost { correlation: None, replica, status: 400 });
        return StatusCode::BAD_REQUEST;
    };
    let before = {
        let mut seen = p.seen.lock().unwrap();
        let before = seen.get(&correlation).copied();
        if before.is_none() {
            seen.insert(correlation, Seen::InProgress);
        }
        before
    };
    let status = match before {
        Some(Seen::InProgress) => StatusCode::CONFLICT,
        Some(Seen::Accepted) => StatusCode::OK,
        None => {
            let (fail, hang) = {
                let mut rng = p.rng.lock().unwrap();
                (rng.random_bool(p.spec.fail_share), rng.random_bool(p.spec.hang_share))
            };
            p.log.push(Event::PartnerPost { correlation: Some(correlation), replica, status: if hang { 0 } else if fail { 500 } else { 200 } });
            if hang {
                tokio::time::sleep(Duration::from_secs(120)).await;
            }
            tokio::time::sleep(Duration::from_millis(p.spec.delay_ms)).await;
            let mut seen = p.seen.lock().unwrap();
            if fail {
                seen.remove(&correlation);
                return StatusCode::INTERNAL_SERVER_ERROR;
            }
            seen.insert(correlation, Seen::Accepted);
            return StatusCode::OK;
        }
    };
    p.log.push(Event::PartnerPost { correlation: Some(correlation), replica, status: status.as_u16() });
    status
}
