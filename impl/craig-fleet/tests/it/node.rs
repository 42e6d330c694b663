//! `craig-node` end to end on real PostgreSQL and RabbitMQ: HTTP → outbox → broker → inbox.



use std::time::Duration;

use crate::common::*;
use craig_fleet::Service;
use craig_mq::{EventEnvelope, Publisher};
use serde_json::json;

const EVENT: &str = "case.referral_created";

fn referral_envelope() -> EventEnvelope {
    let id = uuid::Uuid::now_v7();
    EventEnvelope::new(EVENT, "cases", Some(id), json!({ "referral_id": id, "subject": "s" })).unwrap()
}

/// Deliver `dup` twice, then a marker; once the marker is evaluated both copies were
/// handled (one consumer, in order). Returns rule_evaluations rows for `dup`.
async fn deliver_twice(label: &str, compat: &[&str]) -> i64 {
    let fleet = Fleet::new(label, &[Service::Rules]).await;
    let node = fleet.start(Service::Rules, &[], compat).await;
    let pool = fleet.pool(Service::Rules).await;
    eventually(Duration::from_secs(15), "rules queue declared", || async {
        let (conn, ch) = fleet.channel().await;
        let ok = craig_mq::topology::queue_depth(&ch, "craig-rules.events").await.is_ok();
        let _ = conn.close(200, "bye".into()).await;
        ok
    })
    .await;

    let (dup, marker) = (referral_envelope(), referral_envelope());
    let publisher = Publisher::connect(fleet.sandbox.amqp_url(), Default::default()).await.unwrap();
    for env in [&dup, &dup, &marker] {
        publisher.publish(env).await.unwrap();
    }
    publisher.close().await;
    eventually(Duration::from_secs(20), "marker evaluated", || {
        let pool = pool.clone();
        let id = marker.id;
        async move {
            sqlx::query_scalar::<_, i64>("SELECT count(*) FROM rule_evaluations WHERE envelope_id = $1")
                .bind(id)
                .fetch_one(&pool)
                .await
                .unwrap()
                > 0
        }
    })
    .await;
    let rows: i64 = sqlx::query_scalar("SELECT count(*) FROM rule_evaluations WHERE envelope_id = $1")
        .bind(dup.id)
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(node.stop().await.code(), Some(0));
    pool.close().await;
    fleet.finish().await;
    rows
}

#[tokio::test]
async fn a_redelivered_envelope_runs_the_rules_handler_once() {
    assert_eq!(deliver_twice("redelivery_inbox", &[]).await, 1);
}

/// The twin: without the inbox (compat pre-d2) the same redelivery doubles the effect,
/// which is what makes the assertion above mean something.
#[tokio::test]
async fn without_the_inbox_a_redelivery_runs_the_handler_twice() {
    assert_eq!(deliver_twice("redelivery_pre_d2", &["--compat", "pre-d2"]).await, 2);
}

#[tokio::test]
async fn referrals_flow_from_http_to_rule_evaluations() {
    let fleet = Fleet::new("http_to_rules", &[Service::Cases, Service::Rules]).await;
    let rules = fleet.start(Service::Rules, &[], &[]).await;
    let cases = fleet.start(Service::Cases, &[], &[]).await;
    let http = reqwest::Client::new();
    let url = format!("{}/v1/cases/referrals", cases.base);
    let good = token("craig-cases", "");

    let unauth = http.post(&url).json(&json!({"subject": "x"})).send().await.unwrap();
    assert_eq!(unauth.status(), 401);
    let wrong_aud = http.post(&url).bearer_auth(token("craig-rules", "")).json(&json!({"subject": "x"})).send().await.unwrap();
    assert_eq!(wrong_aud.status(), 403);
    let bad_body = http.post(&url).bearer_auth(&good).json(&json!({"subject": ""})).send().await.unwrap();
    assert_eq!(bad_body.status(), 400);

    let mut ids = Vec::new();
    for i in 0..20 {
        let id = uuid::Uuid::now_v7();
        let r = http.post(&url).bearer_auth(&good).json(&json!({"id": id, "subject": format!("s{i}")})).send().await.unwrap();
        assert_eq!(r.status(), 201);
        let body: serde_json::Value = r.json().await.unwrap();
        assert_eq!(body["id"], json!(id));
        ids.push(id);
    }
    let again = http.post(&url).bearer_auth(&good).json(&json!({"id": ids[0], "subject": "s0"})).send().await.unwrap();
    assert_eq!(again.status(), 409, "a repeated id is refused, never written twice");

    let cases_db = fleet.pool(Service::Cases).await;
    let rules_db = fleet.pool(Service::Rules).await;
    eventually(Duration::from_secs(30), "20 evaluations", || {
        let rules_db = rules_db.clone();
        async move { count(&rules_db, "SELECT count(*) FROM rule_evaluations").await == 20 }
    })
    .await;
    let evaluated: Vec<uuid::Uuid> = sqlx::query_scalar("SELECT referral_id FROM rule_evaluations ORDER BY referral_id")
        .fetch_all(&rules_db)
        .await
        .unwrap();
    assert_eq!(evaluated, ids, "exactly the written referrals were evaluated");
    assert_eq!(count(&cases_db, "SELECT count(*) FROM referrals").await, 20);
    assert_eq!(count(&cases_db, "SELECT count(*) FROM event_outbox WHERE published_at IS NOT NULL").await, 20);
    // rules stages rule.evaluated for each, in the same transaction as the row.
    eventually(Duration::from_secs(10), "rules outbox drained", || {
        let rules_db = rules_db.clone();
        async move { count(&rules_db, "SELECT count(*) FROM event_outbox WHERE published_at IS NOT NULL").await == 20 }
    })
    .await;

    assert_eq!(cases.stop().await.code(), Some(0));
    assert_eq!(rules.stop().await.code(), Some(0));
    cases_db.close().await;
    rules_db.close().await;
    fleet.finish().await;
}

#[tokio::test]
async fn node_refuses_an_inbox_window_equal_to_the_outbox_window() {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_craig-node"))
        .args(["--service", "rules"])
        .env("CRAIG_JWT_SECRET", SECRET)
        .env("CRAIG_OUTBOX_RETENTION_DAYS", "30")
        .env("CRAIG_INBOX_RETENTION_DAYS", "30")
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("inbox retention (30 d) must be at least outbox retention (30 d) + 1 day"), "{err}");
}

#[tokio::test]
async fn node_refuses_to_serve_without_a_jwt_secret_or_with_an_unbuilt_compat_mode() {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_craig-node"))
        .args(["--service", "cases"])
        .env_remove("CRAIG_JWT_SECRET")
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("CRAIG_JWT_SECRET is not set"));

    let out = std::process::Command::new(env!("CARGO_BIN_EXE_craig-node"))
        .args(["--service", "cases", "--compat", "pre-nope"])
        .env("CRAIG_JWT_SECRET", SECRET)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2), "clap usage error");
    assert!(String::from_utf8_lossy(&out.stderr).contains("unknown compat mode \"pre-nope\""));
}
