//! Send-jobs (ADR-022 #1185) on real PostgreSQL, and end to end against a real partner HTTP
//! server on loopback: the lease holds a claimed job, a reclaimed job is Stale for its old
//! claim (nothing stamped, no event), a terminal transaction never flips to another terminal
//! status, `failed → pending` is the only exit, and the pre-#1185 sweep steals an overdue
//! job in flight.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::common::*;
use craig_fleet::Service;
use craig_fleet::send_jobs::{self, Fence, Sent, Transition, TxStatus};
use serde_json::json;
use uuid::Uuid;

async fn stage(db: &sqlx::PgPool, overdue_secs: i64) -> Uuid {
    let mut tx = db.begin().await.unwrap();
    let t = send_jobs::stage_in_tx(&mut tx, None, &json!({ "amount_cents": 100 })).await.unwrap();
    sqlx::query("UPDATE exchange_send_jobs SET next_attempt_at = now() - make_interval(secs => $2) WHERE transaction_id = $1")
        .bind(t)
        .bind(overdue_secs as f64)
        .execute(&mut *tx)
        .await
        .unwrap();
    tx.commit().await.unwrap();
    t
}

async fn events(db: &sqlx::PgPool, kind: &str) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM event_outbox WHERE event_type = $1").bind(kind).fetch_one(db).await.unwrap()
}

async fn status(db: &sqlx::PgPool, t: Uuid) -> (String, String) {
    sqlx::query_as("SELECT t.status, j.status FROM exchange_transactions t JOIN exchange_send_jobs j ON j.transaction_id = t.id WHERE t.id = $1")
        .bind(t)
        .fetch_one(db)
        .await
        .unwrap()
}

const LEASE: Duration = Duration::from_secs(send_jobs::CLAIM_LEASE_SECS);

#[tokio::test]
async fn the_lease_holds_a_claim_and_a_reclaimed_job_is_stale_for_its_old_claim() {
    let fleet = Fleet::new("send_jobs_lease", &[Service::Financial]).await;
    let db = fleet.pool(Service::Financial).await;
    let t = stage(&db, 300).await;
    let first = send_jobs::claim(&db, 10, LEASE).await.unwrap();
    assert_eq!((first.len(), first[0].generation), (1, 1));
    assert!(send_jobs::claim(&db, 10, LEASE).await.unwrap().is_empty(), "a live lease is not re-admitted, however overdue the job");

    // The lease expires (time moved by writing claimed_at in the past): the ordinary claim
    // re-admits it under a new generation.
    sqlx::query("UPDATE exchange_send_jobs SET claimed_at = now() - interval '100 seconds'").execute(&db).await.unwrap();
    let second = send_jobs::claim(&db, 10, LEASE).await.unwrap();
    assert_eq!((second.len(), second[0].generation), (1, 2));

    // The old claim's worker comes back: Stale, and it stamps nothing and stages nothing.
    assert_eq!(send_jobs::finalize(&db, &first[0], &Sent::Accepted, Some("financial-1"), false).await.unwrap(), Fence::Stale);
    assert_eq!(send_jobs::finalize(&db, &first[0], &Sent::Failed("x".into()), None, false).await.unwrap(), Fence::Stale, "a retry is fenced too");
    assert_eq!(status(&db, t).await, ("pending".into(), "in_flight".into()));
    assert_eq!(events(&db, send_jobs::EXCHANGE_SENT).await, 0);

    assert_eq!(send_jobs::finalize(&db, &second[0], &Sent::Accepted, Some("financial-2"), false).await.unwrap(), Fence::Applied);
    assert_eq!(status(&db, t).await, ("sent".into(), "sent".into()));
    assert_eq!(send_jobs::finalize(&db, &second[0], &Sent::Refused("late".into()), None, false).await.unwrap(), Fence::Stale);
    assert_eq!((events(&db, send_jobs::EXCHANGE_SENT).await, events(&db, send_jobs::EXCHANGE_FAILED).await), (1, 0));
    db.close().await;
    fleet.finish().await;
}

#[tokio::test]
async fn a_terminal_transaction_never_flips_and_failed_to_pending_is_the_only_exit() {
    let fleet = Fleet::new("send_jobs_terminal", &[Service::Financial]).await;
    let db = fleet.pool(Service::Financial).await;
    let t = stage(&db, 0).await;
    let mut tx = db.begin().await.unwrap();
    assert_eq!(send_jobs::update_transaction_status(&mut tx, t, TxStatus::Sent, true).await.unwrap(), Transition::Applied);
    assert_eq!(send_jobs::update_transaction_status(&mut tx, t, TxStatus::Failed, true).await.unwrap(), Transition::Refused, "sent -> failed");
    assert_eq!(send_jobs::update_transaction_status(&mut tx, t, TxStatus::Pending, true).await.unwrap(), Transition::Refused, "sent -> pending");
    tx.commit().await.unwrap();
    assert_eq!(send_jobs::retry_failed(&db, t).await.unwrap(), Transition::Refused, "a sent transaction is not retried");

    // A job refused by the partner fails its transaction; retry_failed re-pends both.
    let u = stage(&db, 0).await;
    let job = send_jobs::claim(&db, 10, LEASE).await.unwrap().into_iter().find(|j| j.transaction_id == u).unwrap();
    assert_eq!(send_jobs::finalize(&db, &job, &Sent::Refused("422".into()), None, false).await.unwrap(), Fence::Applied);
    assert_eq!(status(&db, u).await, ("failed".into(), "failed".into()));
    let mut tx = db.begin().await.unwrap();
    assert_eq!(send_jobs::update_transaction_status(&mut tx, u, TxStatus::Sent, true).await.unwrap(), Transition::Refused, "failed -> sent");
    tx.rollback().await.unwrap();
    assert_eq!(send_jobs::retry_failed(&db, u).await.unwrap(), Transition::Applied);
    assert_eq!(status(&db, u).await, ("pending".into(), "pending".into()));
    assert_eq!(send_jobs::claim(&db, 10, LEASE).await.unwrap().len(), 1, "the retried job is due again");
    assert_eq!(events(&db, send_jobs::EXCHANGE_FAILED).await, 1);
    db.close().await;
    fleet.finish().await;
}

#[tokio::test]
async fn transport_failures_retry_fenced_until_max_attempts_then_fail() {
    let fleet = Fleet::new("send_jobs_retry", &[Service::Financial]).await;
    let db = fleet.pool(Service::Financial).await;
    let t = stage(&db, 0).await;
    for attempt in 1..=send_jobs::MAX_ATTEMPTS {
        sqlx::query("UPDATE exchange_send_jobs SET next_attempt_at = now() - interval '1 second' WHERE status = 'pending'").execute(&db).await.unwrap();
        let job = send_jobs::claim(&db, 10, LEASE).await.unwrap().pop().expect("due");
        assert_eq!(job.attempts, attempt - 1, "adapter errors so far");
        assert_eq!(send_jobs::finalize(&db, &job, &Sent::Failed("503".into()), None, false).await.unwrap(), Fence::Applied);
    }
    assert_eq!(status(&db, t).await, ("failed".into(), "failed".into()));
    assert_eq!((events(&db, send_jobs::EXCHANGE_SENT).await, events(&db, send_jobs::EXCHANGE_FAILED).await), (0, 1));
    db.close().await;
    fleet.finish().await;
}

/// Defense in depth: a job whose transaction is already terminal (written behind the
/// queue's back) is not stamped over: nothing on the transaction changes, no event is
/// staged, and the job is closed with the reason so it is never re-sent.
#[tokio::test]
async fn a_finalize_onto_a_terminal_transaction_changes_nothing_and_closes_the_job() {
    let fleet = Fleet::new("send_jobs_refused_flip", &[Service::Financial]).await;
    let db = fleet.pool(Service::Financial).await;
    let t = stage(&db, 0).await;
    let job = send_jobs::claim(&db, 10, LEASE).await.unwrap().pop().unwrap();
    sqlx::query("UPDATE exchange_transactions SET status = 'failed' WHERE id = $1").bind(t).execute(&db).await.unwrap();
    assert_eq!(send_jobs::finalize(&db, &job, &Sent::Accepted, None, false).await.unwrap(), Fence::Stale);
    assert_eq!(status(&db, t).await, ("failed".into(), "failed".into()), "failed stays failed; the job is closed");
    let why: Option<String> = sqlx::query_scalar("SELECT last_error FROM exchange_send_jobs WHERE transaction_id = $1").bind(t).fetch_one(&db).await.unwrap();
    assert_eq!(why.as_deref(), Some("refused: its transaction is already terminal"));
    assert_eq!((events(&db, send_jobs::EXCHANGE_SENT).await, events(&db, send_jobs::EXCHANGE_FAILED).await), (0, 0));
    assert!(send_jobs::claim(&db, 10, Duration::ZERO).await.unwrap().is_empty(), "never claimed again");
    db.close().await;
    fleet.finish().await;
}

/// The #1185 bug, reproduced: a job claimed out of a backlog more than 60 s overdue looks
/// stuck to the pre-#1185 boot sweep at once; the rebooting peer re-claims it mid-send and
/// its bare-id finalize stamps over the live claim, flipping the transaction.
#[tokio::test]
async fn the_pre_1185_sweep_steals_an_overdue_job_in_flight_and_its_finalize_is_unfenced() {
    let fleet = Fleet::new("send_jobs_pre1185", &[Service::Financial]).await;
    let db = fleet.pool(Service::Financial).await;
    let t = stage(&db, 300).await;
    let live = send_jobs::claim(&db, 10, LEASE).await.unwrap().pop().unwrap();
    assert_eq!(send_jobs::recover_at_boot_pre_1185(&db).await.unwrap(), 1, "in flight for milliseconds, 'stuck' by next_attempt_at");
    let stolen = send_jobs::claim_pre_1185(&db, 10).await.unwrap().pop().expect("re-claimed mid-send");
    assert_eq!(stolen.correlation_id, live.correlation_id, "the same transmission, about to be POSTed twice");
    assert_eq!(send_jobs::finalize(&db, &live, &Sent::Accepted, None, false).await.unwrap(), Fence::Applied, "no generation was bumped");
    assert_eq!(send_jobs::finalize(&db, &stolen, &Sent::Refused("409".into()), None, true).await.unwrap(), Fence::Applied, "bare id");
    assert_eq!(status(&db, t).await, ("failed".into(), "failed".into()), "sent flipped to failed");
    assert_eq!((events(&db, send_jobs::EXCHANGE_SENT).await, events(&db, send_jobs::EXCHANGE_FAILED).await), (1, 1), "conflicting events");
    db.close().await;
    fleet.finish().await;
}

/// A partner on loopback: records every POST's correlation id (body and header) and
/// answers `status`.
async fn partner(status: u16) -> (String, Arc<Mutex<Vec<(String, String)>>>) {
    let seen: Arc<Mutex<Vec<(String, String)>>> = Arc::default();
    let record = seen.clone();
    let app = axum::Router::new().route(
        "/transmissions",
        axum::routing::post(move |headers: axum::http::HeaderMap, body: axum::Json<serde_json::Value>| {
            let record = record.clone();
            async move {
                let header = headers.get("craig-correlation-id").and_then(|v| v.to_str().ok()).unwrap_or("").to_owned();
                let field = body.0["craig_correlation_id"].as_str().unwrap_or("").to_owned();
                record.lock().unwrap().push((field, header));
                axum::http::StatusCode::from_u16(status).unwrap()
            }
        }),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}/transmissions", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    (url, seen)
}

#[tokio::test]
async fn a_payment_is_posted_to_the_partner_once_with_its_correlation_id() {
    let fleet = Fleet::new("send_jobs_e2e", &[Service::Financial]).await;
    craig_fleet::node::declare_topology(fleet.sandbox.amqp_url(), true, fleet.sandbox.queue_type()).await.unwrap();
    let (url, seen) = partner(200).await;
    let node = fleet.start(Service::Financial, &[("CRAIG_PARTNER_URL", &url)], &[]).await;
    let publisher = craig_mq::Publisher::connect(fleet.sandbox.amqp_url(), Default::default()).await.unwrap();
    let p = Uuid::now_v7();
    let env = craig_mq::EventEnvelope::new(
        "placement.activated",
        "cases",
        Some(p),
        json!({ "placement_id": p, "care_level": "standard", "period_start": "2026-12-01", "days": 3 }),
    )
    .unwrap();
    publisher.publish(&env).await.unwrap();
    let db = fleet.pool(Service::Financial).await;
    eventually(Duration::from_secs(30), "the transmission sent", || {
        let db = db.clone();
        async move { count(&db, "SELECT count(*) FROM exchange_send_jobs WHERE status = 'sent'").await == 1 }
    })
    .await;
    let correlation: Uuid = sqlx::query_scalar("SELECT correlation_id FROM exchange_send_jobs").fetch_one(&db).await.unwrap();
    assert_eq!(*seen.lock().unwrap(), vec![(correlation.to_string(), correlation.to_string())], "one POST, with craig_correlation_id");
    assert_eq!(events(&db, send_jobs::EXCHANGE_SENT).await, 1);
    assert_eq!(node.stop().await.code(), Some(0));
    db.close().await;
    fleet.finish().await;
}
