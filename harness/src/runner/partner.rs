//! The partner HTTP server the financial send queue POSTs to (ADR-022 #1185), run by the
//! harness on loopback. It records every POST — its `craig_correlation_id` and the replica
//! that sent it (the `craig-replica` header) — as `Event::PartnerPost`, and behaves as
//! `[partner]` says: slow (`delay_ms`), failing (`fail_share` answered 500) or accepting and
//! then hanging (`hang_share`: accepted at receipt, never answered; the sender's transport
//! cap ends it).
//!
//! Like a real partner with a dedup boundary on the correlation id, a POST of a
//! transmission it is still processing is answered 409 (a concurrent duplicate: refused),
//! and one it already accepted is answered 200 again (an idempotent replay). A request whose
//! sender went away mid-request (timed out, died) is still processed to the end.

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

/// The partner's processing of one new transmission: however it ends — answered, or the
/// sender gone mid-request (its timeout, its death) — the partner got the whole request and
/// finishes it: accepted, unless it was chosen to fail (then forgotten, so a retry is new).
struct Processing {
    p: Arc<Shared>,
    correlation: Uuid,
    fail: bool,
    /// The answer is going out; false when the sender went away first (or it hung).
    answered: bool,
}

impl Drop for Processing {
    fn drop(&mut self) {
        if !self.answered {
            // The sender never got an answer: its next POST is its retry after the cap.
            self.p.log.push(Event::PartnerUnanswered { correlation: self.correlation });
        }
        let mut seen = self.p.seen.lock().unwrap();
        if self.fail {
            seen.remove(&self.correlation);
        } else {
            seen.insert(self.correlation, Seen::Accepted);
        }
    }
}

async fn transmission(State(p): State<Arc<Shared>>, headers: HeaderMap, body: axum::body::Bytes) -> StatusCode {
    let parsed = serde_json::from_slice::<serde_json::Value>(&body).ok();
    let correlation =
        parsed.as_ref().and_then(|v| v.get("craig_correlation_id").and_then(|c| c.as_str()).and_then(|c| c.parse::<Uuid>().ok()));
    // What the transmission pays for, in the partner's own reading of the body.
    let subject = parsed.as_ref().and_then(|v| {
        let payload = v.get("payload")?;
        let placement = payload.get("placement_id")?.as_str()?.parse::<Uuid>().ok()?;
        let period = payload.get("period_start")?.as_str()?.to_owned();
        Some((placement, period))
    });
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
            // Only what the partner accepted pays (a hung one was accepted at receipt); a
            // POST answered 500 paid nothing, and its retry is a new receipt.
            if let Some((placement, period)) = subject.filter(|_| hang || !fail) {
                p.log.push(Event::PartnerTransmission { correlation, placement, period });
            }
            p.log.push(Event::PartnerPost { correlation: Some(correlation), replica, status: if hang { 0 } else if fail { 500 } else { 200 } });
            let mut processing = Processing { p: p.clone(), correlation, fail: fail && !hang, answered: false };
            if hang {
                // Accepted at receipt, never answered: the sender's transport cap ends it.
                drop(processing);
                std::future::pending::<()>().await;
                unreachable!("a hung answer never comes");
            }
            tokio::time::sleep(Duration::from_millis(p.spec.delay_ms)).await;
            processing.answered = true;
            drop(processing);
            return if fail { StatusCode::INTERNAL_SERVER_ERROR } else { StatusCode::OK };
        }
    };
    p.log.push(Event::PartnerPost { correlation: Some(correlation), replica, status: status.as_u16() });
    status
}

#[cfg(test)]
mod tests {
    use super::*;

    fn body(c: Uuid) -> serde_json::Value {
        serde_json::json!({ "craig_correlation_id": c, "payload": {} })
    }

    fn posts(log: &Log) -> Vec<(Option<Uuid>, Option<String>, u16)> {
        log.history
            .lock()
            .unwrap()
            .iter()
            .filter_map(|e| match &e.event {
                Event::PartnerPost { correlation, replica, status } => Some((*correlation, replica.clone(), *status)),
                _ => None,
            })
            .collect()
    }

    /// A real server on loopback: a concurrent duplicate is refused (409), a replay of an
    /// accepted transmission is answered 200, each POST is recorded with its sender.
    #[tokio::test]
    async fn the_partner_refuses_a_concurrent_duplicate_and_answers_a_replay() {
        let log = Log::new();
        let spec = PartnerSpec { delay_ms: 300, fail_share: 0.0, hang_share: 0.0 };
        let (url, task) = serve(spec, log.clone(), 7).await.unwrap();
        let http = reqwest::Client::new();
        let c = Uuid::now_v7();
        let send = |who: &'static str| http.post(&url).header("craig-replica", who).json(&body(c)).send();
        let (a, b) = tokio::join!(send("financial-1"), async {
            tokio::time::sleep(Duration::from_millis(100)).await;
            send("financial-2").await
        });
        assert_eq!((a.unwrap().status().as_u16(), b.unwrap().status().as_u16()), (200, 409));
        assert_eq!(send("financial-2").await.unwrap().status().as_u16(), 200, "a replay of an accepted transmission");
        let bad = http.post(&url).json(&serde_json::json!({})).send().await.unwrap();
        assert_eq!(bad.status().as_u16(), 400, "no craig_correlation_id");
        let statuses: Vec<(Option<String>, u16)> = posts(&log).into_iter().map(|(_, r, s)| (r, s)).collect();
        assert_eq!(
            statuses,
            vec![(Some("financial-1".into()), 200), (Some("financial-2".into()), 409), (Some("financial-2".into()), 200), (None, 400)]
        );
        task.abort();
    }

    /// Failing and hanging partners: a 500 frees the transmission for a retry; a hung POST
    /// is recorded (status 0) and never answered.
    #[tokio::test]
    async fn the_partner_can_fail_and_hang() {
        let log = Log::new();
        let (url, task) = serve(PartnerSpec { delay_ms: 0, fail_share: 1.0, hang_share: 0.0 }, log.clone(), 7).await.unwrap();
        let http = reqwest::Client::new();
        let c = Uuid::now_v7();
        for _ in 0..2 {
            assert_eq!(http.post(&url).json(&body(c)).send().await.unwrap().status().as_u16(), 500);
        }
        task.abort();
        let (url, task) = serve(PartnerSpec { delay_ms: 0, fail_share: 0.0, hang_share: 1.0 }, log.clone(), 7).await.unwrap();
        let quick = reqwest::Client::builder().timeout(Duration::from_millis(300)).build().unwrap();
        let hung = quick.post(&url).json(&body(Uuid::now_v7())).send().await;
        assert!(hung.is_err_and(|e| e.is_timeout()), "accepted and never answered");
        let statuses: Vec<u16> = posts(&log).into_iter().map(|(_, _, s)| s).collect();
        assert_eq!(statuses, vec![500, 500, 0]);
        task.abort();
    }
}
