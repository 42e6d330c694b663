//! The inbox retry cap and the app dead-letter path (issue 9; ADR-022 §D3 with #1196 and
//! #1181) on real PostgreSQL, RabbitMQ and `craig-node` processes: a rules handler that
//! keeps failing one envelope transiently surfaces it to `craig.dlx` under the CONSUMER
//! queue with a token derived from the inbox row, security records it, and the envelopes
//! behind it are processed.

use std::time::Duration;

use crate::common::*;
use chrono::{DateTime, Utc};
use craig_fleet::Service;
use craig_mq::EventEnvelope;
use serde_json::json;
use uuid::Uuid;

const RULES_QUEUE: &str = "craig-rules.events";

/// A trigger that fails every evaluation of `referral` with a plain exception (SQLSTATE
/// P0001, no constraint): the rules handler classifies it transient, so only the retry cap
/// can end it.
async fn fail_evaluations_of(pool: &sqlx::PgPool, referral: Uuid) {
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "CREATE FUNCTION test_fail_referral() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN \
           IF NEW.referral_id = '{referral}' THEN RAISE EXCEPTION 'injected failure for referral {referral}'; END IF; \
           RETURN NEW; END $$"
    )))
    .execute(pool)
    .await
    .unwrap();
    sqlx::query("CREATE TRIGGER test_fail BEFORE INSERT ON rule_evaluations FOR EACH ROW EXECUTE FUNCTION test_fail_referral()")
        .execute(pool)
        .await
        .unwrap();
}

/// One stuck envelope and two healthy ones through a rules node with a retry cap of 3;
/// returns the stuck envelope, the audit row's (path, disposition, routing key, original
/// queue, source service, token) and the inbox row's received_at.
/// With `least_privilege`, every node logs in with its own account (#1202).
async fn surface_one(
    label: &str,
    compat: &[&str],
    least_privilege: bool,
    queue_type: QueueType,
) -> (EventEnvelope, (String, String, String, Option<String>, Option<String>, Option<String>), DateTime<Utc>) {
    let mut fleet = Fleet::typed(label, &[Service::Rules, Service::Security], &Default::default(), queue_type).await;
    if least_privilege {
        fleet.least_privilege().await;
    }
    let rules_db = fleet.pool(Service::Rules).await;
    let security_db = fleet.pool(Service::Security).await;
    let stuck_referral = Uuid::now_v7();
    fail_evaluations_of(&rules_db, stuck_referral).await;
    let mut args = Vec::new();
    for c in compat {
        args.extend(["--compat", c]);
    }
    let rules = fleet.start(Service::Rules, &[("CRAIG_INBOX_RETRY_CAP", "3")], &args).await;
    let security = fleet.start(Service::Security, &[], &[]).await;
    fleet.wait_for_queues(&[RULES_QUEUE, craig_mq::topology::DLQ_QUEUE]).await;

    let referral = |id: Uuid| EventEnvelope::new("case.referral_created", "cases", Some(id), json!({ "referral_id": id })).unwrap();
    let stuck = referral(stuck_referral);
    let publisher = craig_mq::Publisher::connect(fleet.sandbox.amqp_url(), Default::default()).await.unwrap();
    publisher.publish(&stuck).await.unwrap();
    for _ in 0..2 {
        publisher.publish(&referral(Uuid::now_v7())).await.unwrap();
    }
    publisher.close().await;

    eventually(Duration::from_secs(30), "the stuck envelope recorded as a dead letter", || {
        let pool = security_db.clone();
        async move { count(&pool, "SELECT count(*) FROM dead_letter_audit").await >= 1 }
    })
    .await;
    eventually(Duration::from_secs(20), "the healthy envelopes evaluated", || {
        let pool = rules_db.clone();
        async move { count(&pool, "SELECT count(*) FROM rule_evaluations").await == 2 }
    })
    .await;
    eventually(Duration::from_secs(10), "the rules queue drained (the stuck one acked)", || async {
        fleet.depth(RULES_QUEUE).await == 0
    })
    .await;
    let row: (String, String, String, Option<String>, Option<String>, Option<String>) = sqlx::query_as(
        "SELECT path, disposition, routing_key, original_queue, source_service, occurrence_token FROM dead_letter_audit",
    )
    .fetch_one(&security_db)
    .await
    .unwrap();
    let received_at: DateTime<Utc> = sqlx::query_scalar("SELECT received_at FROM event_inbox WHERE envelope_id = $1")
        .bind(stuck.id)
        .fetch_one(&rules_db)
        .await
        .unwrap();
    assert_eq!(security.stop().await.code(), Some(0));
    assert_eq!(rules.stop().await.code(), Some(0));
    rules_db.close().await;
    security_db.close().await;
    fleet.finish().await;
    (stuck, row, received_at)
}

/// #1196: the app path routes `dlq.<consumer-queue>`, records the consumer queue as
/// `original_queue` and the producer only as provenance; #1181: its token is
/// `dlxcap:{id}:{queue}:{inbox received_at, µs}`. Rules and security run on their own
/// least-privilege accounts (#1202): the whole path works without the admin credential.
#[tokio::test]
async fn the_retry_cap_surfaces_under_the_consumer_queue_with_the_inbox_token() {
    the_retry_cap_surfaces("app-path", QueueType::Classic).await;
}

/// The same app path on quorum queues (issue 25).
#[tokio::test]
async fn the_retry_cap_surfaces_on_quorum_queues() {
    the_retry_cap_surfaces("app-path-quorum", QueueType::Quorum).await;
}

async fn the_retry_cap_surfaces(label: &str, queue_type: QueueType) {
    let (stuck, (path, disposition, routing_key, original_queue, source, token), received_at) =
        surface_one(label, &[], true, queue_type).await;
    assert_eq!((path.as_str(), disposition.as_str()), ("app", "recorded"));
    assert_eq!(routing_key, format!("dlq.{RULES_QUEUE}"));
    assert_eq!(original_queue.as_deref(), Some(RULES_QUEUE));
    assert_eq!(source.as_deref(), Some("cases"), "the producer, as provenance only");
    assert_eq!(token, Some(format!("dlxcap:{}:{RULES_QUEUE}:{}", stuck.id, received_at.timestamp_micros())));
}

/// Compat `pre-1196`: the same failure keyed by the producer (`dlq.craig-cases`), the
/// forensic identity the broker path never uses.
#[tokio::test]
async fn compat_pre_1196_keys_the_app_path_by_the_producer() {
    let (_, (path, _, routing_key, original_queue, _, _), _) = surface_one("app-path-pre1196", &["pre-1196"], false, QueueType::Classic).await;
    assert_eq!(path, "app");
    assert_eq!(routing_key, "dlq.craig-cases");
    assert_eq!(original_queue.as_deref(), Some("craig-cases"));
}
