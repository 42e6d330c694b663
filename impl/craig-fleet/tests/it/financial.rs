//! The arbiter-backed payment consumer (ADR-022 #1179) on real PostgreSQL, and end to end
//! on real `craig-node` processes and RabbitMQ: a replayed `placement.activated` never pays
//! twice, is absorbed before the rate lookup, and is told apart from derivation drift; the
//! pre-#1179 handler on its own schema pays twice, exactly the bug the amendment fixed.

use std::time::Duration;

use crate::common::*;
use craig_fleet::financial::{Paid, pay};
use craig_fleet::{Compat, CompatSet, Service};
use craig_mq::EventEnvelope;
use serde_json::json;
use uuid::Uuid;

fn activated(placement: Uuid, days: i64, care_level: &str) -> EventEnvelope {
    EventEnvelope::new(
        "placement.activated",
        "cases",
        Some(placement),
        json!({ "placement_id": placement, "care_level": care_level, "period_start": "2026-12-01", "days": days }),
    )
    .unwrap()
}

async fn payments(pool: &sqlx::PgPool, placement: Uuid) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM payments WHERE placement_id = $1").bind(placement).fetch_one(pool).await.unwrap()
}

async fn staged_payment_events(pool: &sqlx::PgPool) -> i64 {
    count(pool, "SELECT count(*) FROM event_outbox WHERE event_type = 'payment.created'").await
}

#[tokio::test]
async fn a_replay_is_absorbed_by_the_arbiter_before_the_rate_lookup_and_drift_is_told_apart() {
    let fleet = Fleet::new("financial_arbiter", &[Service::Financial]).await;
    let db = fleet.pool(Service::Financial).await;
    let p = Uuid::now_v7();
    let first = activated(p, 31, "standard");
    let Paid::Created(id) = pay(&db, &first, Some("financial-1"), true).await.unwrap() else { panic!("first run pays") };
    let amount: i64 = sqlx::query_scalar("SELECT amount_cents FROM payments WHERE id = $1").bind(id).fetch_one(&db).await.unwrap();
    assert_eq!(amount, 31 * 12000, "days x the standard rate");
    assert_eq!(staged_payment_events(&db).await, 1, "payment.created staged with the insert");

    // The same envelope again (an inbox re-run), and the same facts in another envelope
    // (a replay re-published by an admin): both absorbed, nothing written or staged.
    assert_eq!(pay(&db, &first, Some("financial-1"), true).await.unwrap(), Paid::Replay);
    assert_eq!(pay(&db, &activated(p, 31, "standard"), None, true).await.unwrap(), Paid::Replay);

    // The early probe runs before any dependency lookup: with the rate table unreadable
    // (an outage of that dependency), a replay still resolves Ok.
    sqlx::query("ALTER TABLE perdiem_rates RENAME TO perdiem_rates_away").execute(&db).await.unwrap();
    assert_eq!(pay(&db, &first, None, true).await.unwrap(), Paid::Replay, "absorbed without touching perdiem_rates");
    let fresh = pay(&db, &activated(Uuid::now_v7(), 31, "standard"), None, true).await;
    assert!(fresh.is_err(), "a new payment needs the rate: {fresh:?}");
    sqlx::query("ALTER TABLE perdiem_rates_away RENAME TO perdiem_rates").execute(&db).await.unwrap();

    // Derivation drift: the same natural key with other facts is detected, never written.
    assert_eq!(pay(&db, &activated(p, 30, "standard"), None, true).await.unwrap(), Paid::Drift);
    assert_eq!(pay(&db, &activated(p, 31, "enhanced"), None, true).await.unwrap(), Paid::Drift);

    // Lifetime semantics: voiding the payment does not free its key.
    sqlx::query("UPDATE payments SET status = 'voided' WHERE id = $1").bind(id).execute(&db).await.unwrap();
    assert_eq!(pay(&db, &first, None, true).await.unwrap(), Paid::Replay);

    assert_eq!(payments(&db, p).await, 1);
    assert_eq!(staged_payment_events(&db).await, 1, "every side effect ran only on the real insert");

    // An unknown care level can never be paid: permanent (dead-lettered), not retried.
    let err = pay(&db, &activated(Uuid::now_v7(), 5, "no-such-level"), None, true).await.unwrap_err();
    assert!(matches!(craig_mq::subscriber::HandlerError::from(err), craig_mq::subscriber::HandlerError::Permanent(_)));
    db.close().await;
    fleet.finish().await;
}

#[tokio::test]
async fn concurrent_runs_of_one_key_pay_once_and_stage_once() {
    let fleet = Fleet::new("financial_race", &[Service::Financial]).await;
    let db = fleet.pool(Service::Financial).await;
    let p = Uuid::now_v7();
    let envelopes: Vec<EventEnvelope> = (0..8).map(|_| activated(p, 12, "enhanced")).collect();
    let runs = futures_util::future::join_all(envelopes.iter().map(|e| pay(&db, e, None, true))).await;
    let created = runs.iter().filter(|r| matches!(r, Ok(Paid::Created(_)))).count();
    let replays = runs.iter().filter(|r| matches!(r, Ok(Paid::Replay))).count();
    assert_eq!((created, replays), (1, 7), "{runs:?}");
    assert_eq!(payments(&db, p).await, 1);
    assert_eq!(staged_payment_events(&db).await, 1);
    db.close().await;
    fleet.finish().await;
}

#[tokio::test]
async fn pre_1179_pays_twice_on_its_own_schema_and_is_refused_by_the_arbiter_on_the_current_one() {
    let old = Fleet::with_schema("financial_pre1179", &[Service::Financial], &CompatSet::new([Compat::Pre1179])).await;
    let db = old.pool(Service::Financial).await;
    let p = Uuid::now_v7();
    let env = activated(p, 31, "standard");
    assert!(matches!(pay(&db, &env, None, false).await.unwrap(), Paid::Created(_)));
    assert!(matches!(pay(&db, &env, None, false).await.unwrap(), Paid::Created(_)), "no arbiter: the re-run pays again");
    assert_eq!(payments(&db, p).await, 2);
    assert_eq!(staged_payment_events(&db).await, 2);
    db.close().await;
    old.finish().await;

    // The old handler on the current schema: the arbiter refuses its second insert
    // (SQLSTATE 23505), a permanent failure — dead-lettered, never paid twice.
    let fleet = Fleet::new("financial_pre1179_current_schema", &[Service::Financial]).await;
    let db = fleet.pool(Service::Financial).await;
    assert!(matches!(pay(&db, &env, None, false).await.unwrap(), Paid::Created(_)));
    let err = pay(&db, &env, None, false).await.unwrap_err();
    assert!(matches!(craig_mq::subscriber::HandlerError::from(err), craig_mq::subscriber::HandlerError::Permanent(_)));
    assert_eq!(payments(&db, p).await, 1);
    db.close().await;
    fleet.finish().await;
}

/// End to end: an activation over HTTP on cases becomes one payment on financial; a second
/// activation of the same placement is refused (409), and a malformed placement.activated
/// is dead-lettered from financial's own queue.
#[tokio::test]
async fn an_activation_flows_from_http_to_one_payment() {
    let fleet = Fleet::new("http_to_financial", &[Service::Cases, Service::Financial]).await;
    craig_fleet::node::declare_topology(fleet.sandbox.amqp_url(), true, fleet.sandbox.queue_type()).await.unwrap();
    let financial = fleet.start(Service::Financial, &[], &[]).await;
    let cases = fleet.start(Service::Cases, &[], &[]).await;
    let http = reqwest::Client::new();
    let good = token("craig-cases", "");
    let p = Uuid::now_v7();
    let url = format!("{}/v1/cases/placements/{p}/activate", cases.base);
    let r = http.post(&url).header("idempotency-key", uuid::Uuid::now_v7().to_string()).json(&json!({ "care_level": "standard" })).send().await.unwrap();
    assert_eq!(r.status(), 401);
    let r = http.post(&url).header("idempotency-key", uuid::Uuid::now_v7().to_string()).bearer_auth(&good).json(&json!({ "care_level": "" })).send().await.unwrap();
    assert_eq!(r.status(), 400);
    let r = http.post(&url).header("idempotency-key", uuid::Uuid::now_v7().to_string()).bearer_auth(&good).json(&json!({ "care_level": "standard", "start": "2026-12-10" })).send().await.unwrap();
    assert_eq!(r.status(), 200);
    let body: serde_json::Value = r.json().await.unwrap();
    assert_eq!((body["period_start"].as_str(), body["days"].as_i64()), (Some("2026-12-01"), Some(22)));
    let again = http.post(&url).header("idempotency-key", uuid::Uuid::now_v7().to_string()).bearer_auth(&good).json(&json!({ "care_level": "standard" })).send().await.unwrap();
    assert_eq!(again.status(), 409, "an active placement is not activated twice");

    // A placement.activated financial can never pay: dead-lettered from its own queue.
    let publisher = craig_mq::Publisher::connect(fleet.sandbox.amqp_url(), Default::default()).await.unwrap();
    let broken = EventEnvelope::new("placement.activated", "cases", None, json!({ "care_level": "standard" })).unwrap();
    publisher.publish(&broken).await.unwrap();

    let db = fleet.pool(Service::Financial).await;
    eventually(Duration::from_secs(30), "one payment", || {
        let db = db.clone();
        async move { payments(&db, p).await == 1 }
    })
    .await;
    let (days, amount): (i32, i64) =
        sqlx::query_as("SELECT days, amount_cents FROM payments WHERE placement_id = $1").bind(p).fetch_one(&db).await.unwrap();
    assert_eq!((days, amount), (22, 22 * 12000));
    eventually(Duration::from_secs(15), "the broken envelope dead-lettered", || async {
        fleet.depth(craig_mq::topology::DLQ_QUEUE).await == 1
    })
    .await;
    assert_eq!(cases.stop().await.code(), Some(0));
    assert_eq!(financial.stop().await.code(), Some(0));
    db.close().await;
    fleet.finish().await;
}

/// #1179 against the real #1180 window: financial aborts after the payment committed and
/// before the inbox stamp, restarts, and the redelivery re-runs the handler. With the
/// arbiter there is one payment; pre-#1179 (its schema, its handler) there are two.
#[cfg(feature = "failpoints")]
async fn crash_in_the_inbox_window(label: &str, compat: &[Compat]) -> i64 {
    let set = CompatSet::new(compat.iter().copied());
    let fleet = Fleet::with_schema(label, &[Service::Financial], &set).await;
    craig_fleet::node::declare_topology(fleet.sandbox.amqp_url(), true, fleet.sandbox.queue_type()).await.unwrap();
    let args: Vec<&str> = compat.iter().flat_map(|c| ["--compat", c.name()]).collect();
    let mut doomed =
        fleet.start(Service::Financial, &[("FAILPOINTS", "inbox::after_handler_before_stamp=return(abort)")], &args).await;
    let p = Uuid::now_v7();
    let publisher = craig_mq::Publisher::connect(fleet.sandbox.amqp_url(), Default::default()).await.unwrap();
    publisher.publish(&activated(p, 31, "standard")).await.unwrap();
    let status = doomed.wait(Duration::from_secs(20)).await;
    assert_eq!(killed_by(status), Some(nix::sys::signal::Signal::SIGABRT as i32), "aborted in the window: {status:?}");
    let db = fleet.pool(Service::Financial).await;
    assert_eq!(payments(&db, p).await, 1, "the first run committed its payment");
    assert_eq!(count(&db, "SELECT count(*) FROM event_inbox WHERE processed_at IS NULL").await, 1, "never stamped");

    let healer = fleet.start(Service::Financial, &[], &args).await;
    eventually(Duration::from_secs(30), "the redelivery stamped", || {
        let db = db.clone();
        async move { count(&db, "SELECT count(*) FROM event_inbox WHERE processed_at IS NOT NULL").await == 1 }
    })
    .await;
    assert_eq!(healer.stop().await.code(), Some(0));
    let n = payments(&db, p).await;
    db.close().await;
    fleet.finish().await;
    n
}

#[cfg(feature = "failpoints")]
#[tokio::test]
async fn a_rerun_inside_the_inbox_window_pays_once_with_the_arbiter_and_twice_without() {
    assert_eq!(crash_in_the_inbox_window("financial_crash_window", &[]).await, 1);
    assert_eq!(crash_in_the_inbox_window("financial_crash_window_pre1179", &[Compat::Pre1179]).await, 2);
}
