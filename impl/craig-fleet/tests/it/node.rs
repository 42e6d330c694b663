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
/// handled (one consumer, in order). Returns rule_evaluations rows for `dup` and the
/// node's `/metrics` text.
async fn deliver_twice(label: &str, compat: &[&str]) -> (i64, String) {
    let fleet = Fleet::new(label, &[Service::Rules]).await;
    // One handler at a time, so deliveries finish in order and "the marker is evaluated"
    // means both copies before it were handled. With the default (32 at once) the marker
    // could commit while the second copy was still running, and the count read below saw
    // one row where pre-d2 makes two (seen under three test threads).
    let node = fleet.start(Service::Rules, &[("CRAIG_CONSUMER_CONCURRENCY", "1")], compat).await;
    let pool = fleet.pool(Service::Rules).await;
    fleet.wait_for_queues(&["craig-rules.events"]).await;

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
    // The node's outbox refuses its rule.evaluated rows on its own poll: wait for that
    // refusal to be counted (on a loaded machine it can come after the marker's effect).
    // With the inbox, wait too for the marker's processed count: the inbox stamps and counts
    // after the handler's row commits, so the row alone can be seen a moment before.
    let scrape = || async { reqwest::get(format!("{}/metrics", node.base)).await.unwrap().text().await.unwrap() };
    let inbox = compat.is_empty();
    eventually(Duration::from_secs(20), "rule.evaluated refused as unroutable (and the marker counted processed)", || async {
        let m = scrape().await;
        series(&m, "outbox_publish_errors_total{kind=\"unroutable\"}").is_some_and(|n| n >= 1.0)
            && (!inbox || series(&m, "inbox_processed_total").is_some_and(|n| n >= 2.0))
    })
    .await;
    let metrics = scrape().await;
    assert_eq!(node.stop().await.code(), Some(0));
    pool.close().await;
    fleet.finish().await;
    (rows, metrics)
}

/// The value of an unlabelled series in Prometheus text.
fn series(text: &str, name: &str) -> Option<f64> {
    text.lines().find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.trim().parse().ok())
}

#[tokio::test]
async fn a_redelivered_envelope_runs_the_rules_handler_once() {
    let (rows, metrics) = deliver_twice("redelivery_inbox", &[]).await;
    assert_eq!(rows, 1);
    // The absorbed redelivery is visible, not just the absence of a duplicate.
    assert_eq!(series(&metrics, "inbox_dedup_hits_total"), Some(1.0), "{metrics}");
    assert_eq!(series(&metrics, "inbox_processed_total"), Some(2.0), "{metrics}");
    assert_eq!(series(&metrics, "inbox_reprocessed_total"), Some(0.0), "{metrics}");
    // rule.evaluated has no queue here (no deploy step): refused as unroutable, counted.
    assert!(series(&metrics, "outbox_publish_errors_total{kind=\"unroutable\"}").is_some_and(|n| n >= 1.0), "{metrics}");
}

/// The twin: without the inbox (compat pre-d2) the same redelivery doubles the effect,
/// which is what makes the assertion above mean something.
#[tokio::test]
async fn without_the_inbox_a_redelivery_runs_the_handler_twice() {
    let (rows, metrics) = deliver_twice("redelivery_pre_d2", &["--compat", "pre-d2"]).await;
    assert_eq!(rows, 2);
    assert_eq!(series(&metrics, "inbox_dedup_hits_total"), Some(0.0), "{metrics}");
}

#[tokio::test]
async fn referrals_flow_from_http_to_rule_evaluations() {
    let fleet = Fleet::new("http_to_rules", &[Service::Cases, Service::Rules]).await;
    // The deploy step (docs/operations.md): rule.evaluated needs security's audit queue to be routable.
    craig_fleet::node::declare_topology(fleet.sandbox.amqp_url(), true, fleet.sandbox.queue_type()).await.unwrap();
    let rules = fleet.start(Service::Rules, &[], &[]).await;
    let cases = fleet.start(Service::Cases, &[], &[]).await;
    let http = reqwest::Client::new();
    let url = format!("{}/v1/cases/referrals", cases.base);
    let good = token("craig-cases", "");

    let unauth = http.post(&url).header("idempotency-key", uuid::Uuid::now_v7().to_string()).json(&json!({"subject": "x"})).send().await.unwrap();
    assert_eq!(unauth.status(), 401);
    let wrong_aud = http.post(&url).header("idempotency-key", uuid::Uuid::now_v7().to_string()).bearer_auth(token("craig-rules", "")).json(&json!({"subject": "x"})).send().await.unwrap();
    assert_eq!(wrong_aud.status(), 403);
    let bad_body = http.post(&url).header("idempotency-key", uuid::Uuid::now_v7().to_string()).bearer_auth(&good).json(&json!({"subject": ""})).send().await.unwrap();
    assert_eq!(bad_body.status(), 400);
    // The subject's bound, 1..=1024 bytes, held at its edge (a mutation test found the upper
    // bound held by nothing): 1025 bytes is the client's error, and nothing is written.
    let long = http.post(&url).header("idempotency-key", uuid::Uuid::now_v7().to_string()).bearer_auth(&good).json(&json!({"subject": "x".repeat(1025)})).send().await.unwrap();
    assert_eq!(long.status(), 400);
    assert!(long.text().await.unwrap().contains("subject must be 1..=1024 bytes"));

    let mut ids = Vec::new();
    for i in 0..20 {
        let id = uuid::Uuid::now_v7();
        // The first at exactly the upper bound, 1024 bytes, which is written (a mutation
        // test found `>` as `>=` refusing it unseen).
        let subject = if i == 0 { "x".repeat(1024) } else { format!("s{i}") };
        let r = http.post(&url).header("idempotency-key", uuid::Uuid::now_v7().to_string()).bearer_auth(&good).json(&json!({"id": id, "subject": subject})).send().await.unwrap();
        assert_eq!(r.status(), 201);
        let body: serde_json::Value = r.json().await.unwrap();
        assert_eq!(body["id"], json!(id));
        ids.push(id);
    }
    let again = http.post(&url).header("idempotency-key", uuid::Uuid::now_v7().to_string()).bearer_auth(&good).json(&json!({"id": ids[0], "subject": "s0"})).send().await.unwrap();
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
    // cases stamps a row after the broker's confirm, which can come after the consumer
    // already handled the message: wait for the stamps (and their counters) too.
    eventually(Duration::from_secs(10), "cases outbox drained", || {
        let cases_db = cases_db.clone();
        async move { count(&cases_db, "SELECT count(*) FROM event_outbox WHERE published_at IS NOT NULL").await == 20 }
    })
    .await;
    let metrics_of = |base: String| async move { reqwest::get(format!("{base}/metrics")).await.unwrap().text().await.unwrap() };
    eventually(Duration::from_secs(10), "cases counted 20 published", || {
        let m = metrics_of(cases.base.clone());
        async move { series(&m.await, "outbox_published_total") == Some(20.0) }
    })
    .await;
    let metrics = metrics_of(cases.base.clone()).await;
    assert_eq!(series(&metrics, "outbox_published_total"), Some(20.0), "{metrics}");
    assert_eq!(series(&metrics, "outbox_publish_lag_seconds_count"), Some(20.0), "{metrics}");
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

/// Issue 7.1: on a fresh vhost where cases starts before rules has ever run, nothing can
/// route `case.referral_created`. Before `mandatory`, the broker ACKed those publishes, the
/// rows were stamped published, and rules never saw them. Now they stay pending as
/// unroutable, and every one is evaluated once rules starts and declares its queue.
#[tokio::test]
async fn events_published_before_their_consumer_queue_exists_wait_for_it() {
    let fleet = Fleet::new("late_consumer", &[Service::Cases, Service::Rules]).await;
    let fast = [("CRAIG_OUTBOX_BACKOFF_MAX_MS", "500"), ("CRAIG_OUTBOX_BACKOFF_BASE_MS", "100")];
    let cases = fleet.start(Service::Cases, &fast, &[]).await;
    let http = reqwest::Client::new();
    let good = token("craig-cases", "");
    for i in 0..5 {
        let r = http
            .post(format!("{}/v1/cases/referrals", cases.base))
            .header("idempotency-key", uuid::Uuid::now_v7().to_string())
            .bearer_auth(&good)
            .json(&json!({"subject": format!("early {i}")}))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 201);
    }
    let cases_db = fleet.pool(Service::Cases).await;
    eventually(Duration::from_secs(15), "all 5 refused as unroutable", || {
        let pool = cases_db.clone();
        async move {
            count(&pool, "SELECT count(*) FROM event_outbox WHERE published_at IS NULL AND last_error LIKE 'unroutable:%'").await == 5
        }
    })
    .await;

    let rules = fleet.start(Service::Rules, &fast, &[]).await;
    let rules_db = fleet.pool(Service::Rules).await;
    eventually(Duration::from_secs(30), "5 evaluations after rules started", || {
        let pool = rules_db.clone();
        async move { count(&pool, "SELECT count(*) FROM rule_evaluations").await == 5 }
    })
    .await;
    // Stamped after the confirm, which can come after the consumer handled the message.
    eventually(Duration::from_secs(10), "cases outbox drained", || {
        let pool = cases_db.clone();
        async move { count(&pool, "SELECT count(*) FROM event_outbox WHERE published_at IS NULL").await == 0 }
    })
    .await;
    assert_eq!(rules.stop().await.code(), Some(0));
    assert_eq!(cases.stop().await.code(), Some(0));
    fleet.finish().await;
}

/// `craig-node topology` declares the whole fleet, idempotently: afterwards every consumer
/// queue exists and takes its events, security's audit queue takes every event.
#[tokio::test]
async fn craig_node_topology_declares_the_whole_fleet_idempotently() {
    topology_declares_the_fleet("topology", QueueType::Classic).await.finish().await;
}

/// The same deploy step with `CRAIG_QUEUE_TYPE=quorum` (issue 25): every queue is a quorum
/// queue; a node or deploy step given the other type is refused by the broker, naming the
/// argument (a queue is never redeclared with other arguments).
#[tokio::test]
async fn craig_node_topology_declares_quorum_queues_and_a_mismatch_is_refused() {
    let fleet = topology_declares_the_fleet("topology-quorum", QueueType::Quorum).await;
    let out = tokio::process::Command::new(env!("CARGO_BIN_EXE_craig-node"))
        .arg("topology")
        .env("AMQP_URL", fleet.sandbox.amqp_url())
        .env("CRAIG_QUEUE_TYPE", "classic")
        .output()
        .await
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("PRECONDITION_FAILED") && err.contains("x-queue-type"), "{err}");
    fleet.finish().await;
}

async fn topology_declares_the_fleet(label: &str, queue_type: QueueType) -> Fleet {
    let fleet = Fleet::typed(label, &[], &Default::default(), queue_type).await;
    for _ in 0..2 {
        let out = tokio::process::Command::new(env!("CARGO_BIN_EXE_craig-node"))
            .arg("topology")
            .env("AMQP_URL", fleet.sandbox.amqp_url())
            .env("CRAIG_QUEUE_TYPE", queue_type.as_str())
            .output()
            .await
            .unwrap();
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(text.contains(&format!("declared craig-rules.events ({queue_type}) <- craig.events [case.referral_created]")), "{text}");
        assert!(text.contains(&format!("declared craig-security.events ({queue_type}) <- craig.events [#]")), "{text}");
    }
    for q in ["craig-rules.events", "craig-security.dlq"] {
        assert_eq!(fleet.sandbox.queue_type_of(q).await.unwrap(), queue_type.as_str(), "{q}");
    }
    let publisher = Publisher::connect(fleet.sandbox.amqp_url(), Default::default()).await.unwrap();
    publisher.publish(&referral_envelope()).await.expect("routable to rules and the audit queue");
    let rule_evaluated = EventEnvelope::new("rule.evaluated", "rules", None, json!({})).unwrap();
    publisher.publish(&rule_evaluated).await.expect("routable to the audit queue");
    publisher.close().await;
    assert_eq!(fleet.depth("craig-rules.events").await, 1);
    assert_eq!(fleet.depth("craig-security.events").await, 2);
    assert_eq!(fleet.depth("craig-financial.events").await, 0);
    fleet
}

/// Issue 7.5: a password in DATABASE_URL never reaches a log or error line.
#[tokio::test]
async fn database_passwords_are_never_printed() {
    for (args, url) in [
        (vec!["migrate", "--service", "cases", "--wait", "1"], "postgres://craig:s3cretpw@127.0.0.1:1/cases"),
        (vec!["migrate", "--service", "cases", "--wait", "0"], "postgres://craig:s3cretpw@127.0.0.1:notaport/cases"),
        (vec!["--service", "cases"], "postgres://craig:s3cretpw@127.0.0.1:notaport/cases"),
    ] {
        let out = tokio::process::Command::new(env!("CARGO_BIN_EXE_craig-node"))
            .args(&args)
            .env("DATABASE_URL", url)
            .env("CRAIG_JWT_SECRET", "x")
            .env("RUST_LOG", "debug")
            .output()
            .await
            .unwrap();
        let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
        assert!(!out.status.success(), "{args:?} must fail: {text}");
        assert!(!text.contains("s3cretpw"), "{args:?} printed the password: {text}");
        assert!(text.contains("craig:***@"), "{args:?} names the (redacted) URL: {text}");
    }
}

/// A database error that is not a duplicate id (here the referral's event refused by a
/// trigger on `event_outbox`, the way the `refuse_staging` fault refuses it, though with
/// another SQLSTATE) is the node's 503 and, by §D1's one transaction, writes nothing; never a
/// 409 "already exists": the same id then writes (201). A mutation test found every
/// database error answered 409 unseen.
#[tokio::test]
async fn a_database_error_other_than_a_duplicate_is_a_503_and_writes_nothing() {
    let fleet = Fleet::new("referral_db_error", &[Service::Cases]).await;
    let db = fleet.pool(Service::Cases).await;
    for statement in [
        "CREATE FUNCTION test_refuse_staging() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN \
           RAISE EXCEPTION 'test: staging refused'; END $$",
        "CREATE TRIGGER test_refuse_staging BEFORE INSERT ON event_outbox FOR EACH ROW EXECUTE FUNCTION test_refuse_staging()",
    ] {
        sqlx::query(statement).execute(&db).await.unwrap();
    }
    let cases = fleet.start(Service::Cases, &[], &[]).await;
    let id = uuid::Uuid::now_v7();
    let post = || {
        reqwest::Client::new()
            .post(format!("{}/v1/cases/referrals", cases.base))
            .header("idempotency-key", uuid::Uuid::now_v7().to_string())
            .bearer_auth(token("craig-cases", ""))
            .json(&json!({"id": id, "subject": "refused"}))
            .send()
    };
    let refused = post().await.unwrap();
    assert_eq!(refused.status(), 503, "{:?}", refused.text().await);
    assert_eq!(count(&db, "SELECT count(*) FROM referrals").await, 0, "the refused event took its referral with it");
    sqlx::query("DROP TRIGGER test_refuse_staging ON event_outbox").execute(&db).await.unwrap();
    assert_eq!(post().await.unwrap().status(), 201, "nothing was written: the same id writes now");
    assert_eq!(cases.stop().await.code(), Some(0));
    db.close().await;
    fleet.finish().await;
}

/// Issue 7.5: a NUL byte in a string field is the client's error (400), never a 503.
#[tokio::test]
async fn a_nul_in_the_subject_is_a_400() {
    let fleet = Fleet::new("nul_subject", &[Service::Cases]).await;
    let cases = fleet.start(Service::Cases, &[], &[]).await;
    let r = reqwest::Client::new()
        .post(format!("{}/v1/cases/referrals", cases.base))
        .header("idempotency-key", uuid::Uuid::now_v7().to_string())
        .bearer_auth(token("craig-cases", ""))
        .json(&json!({"subject": "a\u{0}b"}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 400);
    let upper = reqwest::Client::new()
        .post(format!("{}/v1/cases/referrals", cases.base))
        .header("idempotency-key", uuid::Uuid::now_v7().to_string())
        .header("authorization", format!("BEARER {}", token("craig-cases", "")))
        .json(&json!({"subject": "fine"}))
        .send()
        .await
        .unwrap();
    assert_eq!(upper.status(), 201, "the bearer scheme is case-insensitive (RFC 7235)");
    assert_eq!(cases.stop().await.code(), Some(0));
    fleet.finish().await;
}
