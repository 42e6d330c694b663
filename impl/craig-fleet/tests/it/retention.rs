//! Retention (ADR-022 § Retention policy, #965/#1129) on real PostgreSQL, time moved by
//! writing `created_at` / `received_at` / `expires_at` in the past (never by sleeping), and
//! the §D4 admin replay on a real node: refused past the outbox window, re-staging inside it.

use std::time::Duration;

use crate::common::*;
use craig_fleet::Service;
use craig_mq::retention::{PruneConfig, prune_once};
use serde_json::json;
use uuid::Uuid;

/// An outbox row `days` old, published or pending.
async fn outbox_row(db: &sqlx::PgPool, days: f64, published: bool) -> Uuid {
    let id = Uuid::now_v7();
    let env = craig_mq::EventEnvelope::new("case.referral_created", "cases", Some(id), json!({ "referral_id": id })).unwrap();
    sqlx::query(
        "INSERT INTO event_outbox (id, aggregate_id, event_type, envelope, created_at, published_at) \
         VALUES ($1, $1, 'case.referral_created', $2, now() - make_interval(secs => $3), CASE WHEN $4 THEN now() END)",
    )
    .bind(env.id)
    .bind(serde_json::to_value(&env).unwrap())
    .bind(days * 86_400.0)
    .bind(published)
    .execute(db)
    .await
    .unwrap();
    env.id
}

async fn inbox_row(db: &sqlx::PgPool, days: f64) -> Uuid {
    let id = Uuid::now_v7();
    sqlx::query("INSERT INTO event_inbox (envelope_id, source_service, event_type, received_at, processed_at) VALUES ($1, 'cases', 'x', now() - make_interval(secs => $2), now())")
        .bind(id)
        .bind(days * 86_400.0)
        .execute(db)
        .await
        .unwrap();
    id
}

async fn exists(db: &sqlx::PgPool, table: &str, column: &str, id: Uuid) -> bool {
    sqlx::query_scalar::<_, bool>(sqlx::AssertSqlSafe(format!("SELECT EXISTS (SELECT 1 FROM {table} WHERE {column} = $1)")))
        .bind(id)
        .fetch_one(db)
        .await
        .unwrap()
}

#[tokio::test]
async fn the_prune_keeps_pending_rows_forever_and_windows_each_table() {
    let fleet = Fleet::new("retention_prune", &[Service::Cases]).await;
    let db = fleet.pool(Service::Cases).await;
    let old_published = outbox_row(&db, 31.0, true).await;
    let old_pending = outbox_row(&db, 40.0, false).await;
    let recent_published = outbox_row(&db, 29.0, true).await;
    let inbox_inside = inbox_row(&db, 30.5).await;
    let inbox_past = inbox_row(&db, 31.5).await;
    for (key, expired) in [("expired", true), ("live", false)] {
        sqlx::query("INSERT INTO idempotency_responses (cache_key, method, path, user_sub, expires_at) VALUES ($1, 'POST', '/x', $2, now() + CASE WHEN $3 THEN interval '-1 hour' ELSE interval '1 hour' END)")
            .bind(key)
            .bind(Uuid::now_v7())
            .bind(expired)
            .execute(&db)
            .await
            .unwrap();
    }
    let r = prune_once(&db, &PruneConfig::default()).await.unwrap();
    assert_eq!((r.skipped, r.outbox, r.inbox, r.idempotency, r.unpublished_beyond_grace), (false, 1, 1, 1, 1), "{r:?}");
    assert!(!exists(&db, "event_outbox", "id", old_published).await, "published and past 30 d: pruned");
    assert!(exists(&db, "event_outbox", "id", old_pending).await, "pending: kept forever, however old");
    assert!(exists(&db, "event_outbox", "id", recent_published).await);
    assert!(exists(&db, "event_inbox", "envelope_id", inbox_inside).await, "30.5 d is inside the 31 d inbox window");
    assert!(!exists(&db, "event_inbox", "envelope_id", inbox_past).await);
    assert_eq!(count(&db, "SELECT count(*) FROM idempotency_responses").await, 1);

    // pre-965: pending rows deleted, the inbox windowed like the outbox.
    let r = prune_once(&db, &PruneConfig { pre_965: true, ..Default::default() }).await.unwrap();
    assert_eq!((r.outbox, r.inbox), (1, 1), "{r:?}");
    assert!(!exists(&db, "event_outbox", "id", old_pending).await, "pre-965 deletes the only evidence of an undelivered event");
    assert!(!exists(&db, "event_inbox", "envelope_id", inbox_inside).await, "pre-965 forgets dedup records inside the outbox's replay window's margin");

    // A 0 window disables that table, each on its own.
    outbox_row(&db, 31.0, true).await;
    inbox_row(&db, 40.0).await;
    sqlx::query("INSERT INTO idempotency_responses (cache_key, method, path, user_sub, expires_at) VALUES ('old', 'POST', '/x', $1, now() - interval '1 hour')")
        .bind(Uuid::now_v7())
        .execute(&db)
        .await
        .unwrap();
    let off = craig_mq::Retention { outbox_days: 0, inbox_days: 0, idempotency_hours: 0 };
    let r = prune_once(&db, &PruneConfig { retention: off, ..Default::default() }).await.unwrap();
    assert_eq!((r.outbox, r.inbox, r.idempotency), (0, 0, 0), "{r:?}");
    let r = prune_once(&db, &PruneConfig::default()).await.unwrap();
    assert_eq!((r.outbox, r.inbox, r.idempotency), (1, 1, 1), "{r:?}");
    db.close().await;
    fleet.finish().await;
}

#[tokio::test]
async fn the_prune_is_batched_cycle_capped_and_one_replica_at_a_time() {
    let fleet = Fleet::new("retention_batches", &[Service::Cases]).await;
    let db = fleet.pool(Service::Cases).await;
    for _ in 0..5 {
        outbox_row(&db, 31.0, true).await;
    }
    let capped = PruneConfig { batch: 2, max_batches: 2, ..Default::default() };
    assert_eq!(prune_once(&db, &capped).await.unwrap().outbox, 4, "two batches of two, then the cycle stops");
    // Another replica holds the lock: this one skips the cycle.
    let mut holder = db.acquire().await.unwrap();
    sqlx::query("SELECT pg_advisory_lock($1)").bind(craig_mq::retention::PRUNE_LOCK_KEY).execute(&mut *holder).await.unwrap();
    assert!(prune_once(&db, &capped).await.unwrap().skipped);
    sqlx::query("SELECT pg_advisory_unlock($1)").bind(craig_mq::retention::PRUNE_LOCK_KEY).execute(&mut *holder).await.unwrap();
    drop(holder);
    assert_eq!(prune_once(&db, &capped).await.unwrap().outbox, 1, "the next cycle takes the rest");
    db.close().await;
    fleet.finish().await;
}

/// A cycle stops at its first short batch (§ Retention policy: batched deletes, bounded
/// lock time): every DELETE statement the prune runs on `event_outbox` is counted by a
/// statement-level trigger, which fires for a statement that deleted nothing too. Five
/// prunable rows in batches of two are three statements (2, 2, 1), whatever the cycle cap;
/// a loop that missed the short batch would run the cap's ten, nine of them for nothing.
#[tokio::test]
async fn a_prune_cycle_stops_at_its_first_short_batch() {
    let fleet = Fleet::new("retention_short_batch", &[Service::Cases]).await;
    let db = fleet.pool(Service::Cases).await;
    for statement in [
        "CREATE TABLE test_delete_statements ()",
        "CREATE FUNCTION test_count_delete() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN \
           INSERT INTO test_delete_statements DEFAULT VALUES; RETURN NULL; END $$",
        "CREATE TRIGGER test_count_delete AFTER DELETE ON event_outbox FOR EACH STATEMENT EXECUTE FUNCTION test_count_delete()",
    ] {
        sqlx::query(statement).execute(&db).await.unwrap();
    }
    for _ in 0..5 {
        outbox_row(&db, 31.0, true).await;
    }
    let cfg = PruneConfig { batch: 2, max_batches: 10, ..Default::default() };
    assert_eq!(prune_once(&db, &cfg).await.unwrap().outbox, 5);
    let statements: i64 = sqlx::query_scalar("SELECT count(*) FROM test_delete_statements").fetch_one(&db).await.unwrap();
    assert_eq!(statements, 3, "batches of 2, 2 and 1: the short one ends the cycle");
    db.close().await;
    fleet.finish().await;
}

#[tokio::test]
async fn replay_is_refused_past_the_outbox_window_and_restages_inside_it() {
    let fleet = Fleet::new("replay", &[Service::Cases]).await;
    craig_fleet::node::declare_topology(fleet.sandbox.amqp_url(), true, fleet.sandbox.queue_type()).await.unwrap();
    let db = fleet.pool(Service::Cases).await;
    let inside = outbox_row(&db, 29.0, true).await;
    let other = outbox_row(&db, 1.0, true).await;
    sqlx::query("UPDATE event_outbox SET event_type = 'placement.activated' WHERE id = $1").bind(other).execute(&db).await.unwrap();
    let node = fleet.start(Service::Cases, &[], &[]).await;
    let http = reqwest::Client::new();
    let url = format!("{}/v1/cases/admin/events/replay", node.base);
    let day = chrono::Duration::days(1);
    let now = chrono::Utc::now();
    let rfc = |t: chrono::DateTime<chrono::Utc>| t.to_rfc3339_opts(chrono::SecondsFormat::Secs, true);
    let admin = token("craig-cases", "cases.admin");
    let call = |token: Option<String>, query: String| {
        let mut r = http.post(format!("{url}?{query}"));
        if let Some(t) = token {
            r = r.bearer_auth(t);
        }
        r.send()
    };
    let window = |from: chrono::DateTime<chrono::Utc>| format!("from={}&to={}", rfc(from), rfc(now));
    assert_eq!(call(None, window(now - day)).await.unwrap().status(), 401);
    assert_eq!(call(Some(token("craig-cases", "")), window(now - day)).await.unwrap().status(), 403, "no admin scope");
    assert_eq!(call(Some(token("craig-rules", "cases.admin")), window(now - day)).await.unwrap().status(), 403, "wrong audience");
    assert_eq!(call(Some(admin.clone()), "from=yesterday&to=now".into()).await.unwrap().status(), 400);
    assert_eq!(call(Some(admin.clone()), format!("from={}&to={}", rfc(now), rfc(now - day))).await.unwrap().status(), 400, "inverted");
    // Issue 22.10 (shard 3/50's survivor `replace || with && in replay`): event_type is
    // 1..=255 bytes without NUL, each bound on its own: empty, 256 bytes or a NUL is a 400,
    // before anything is read or re-staged; exactly 255 bytes is a filter like any other.
    for (et, status) in [(String::new(), 400), ("e".repeat(256), 400), ("case%00created".to_owned(), 400), ("e".repeat(255), 200)] {
        let q = format!("{}&event_type={et}&dry_run=true", window(now - day));
        assert_eq!(call(Some(admin.clone()), q).await.unwrap().status(), status, "event_type {et:.20} ({} bytes as sent)", et.len());
    }
    let past = call(Some(admin.clone()), window(now - day * 30 - chrono::Duration::hours(1))).await.unwrap();
    assert_eq!(past.status(), 422);
    assert!(past.text().await.unwrap().contains("before the outbox retention horizon"));

    let dry: serde_json::Value =
        call(Some(admin.clone()), format!("{}&dry_run=true", window(now - day * 29 - chrono::Duration::hours(1)))).await.unwrap().json().await.unwrap();
    assert_eq!((dry["matched"].as_i64(), dry["restaged"].as_i64(), dry["dry_run"].as_bool()), (Some(2), Some(0), Some(true)), "{dry}");
    assert_eq!(count(&db, "SELECT count(*) FROM event_outbox WHERE published_at IS NULL").await, 0, "a dry run re-stages nothing");

    let scoped = call(Some(admin.clone()), format!("{}&event_type=case.referral_created", window(now - day * 29 - chrono::Duration::hours(1))));
    let body: serde_json::Value = scoped.await.unwrap().json().await.unwrap();
    assert_eq!((body["matched"].as_i64(), body["restaged"].as_i64(), body["event_type"].as_str()), (Some(1), Some(1), Some("case.referral_created")), "{body}");
    // The worker re-publishes the re-staged row on its next tick.
    eventually(Duration::from_secs(15), "the re-staged row re-published", || {
        let db = db.clone();
        async move { count(&db, "SELECT count(*) FROM event_outbox WHERE published_at IS NULL").await == 0 }
    })
    .await;
    assert_eq!(fleet.take_all("craig-rules.events").await, vec![inside.to_string()], "exactly the scoped row went out again");
    assert_eq!(node.stop().await.code(), Some(0));
    db.close().await;
    fleet.finish().await;
}

/// The prune runs inside a real node's outbox worker on its cadence, and the operator signal
/// reaches `/metrics`: a pending row 40 days old (backing off for an hour) is kept and
/// counted in `outbox_unpublished_beyond_grace`.
#[tokio::test]
async fn a_node_prunes_on_its_cadence_and_exports_the_unpublished_signal() {
    let fleet = Fleet::new("retention_node", &[Service::Cases]).await;
    let db = fleet.pool(Service::Cases).await;
    let pending = outbox_row(&db, 40.0, false).await;
    sqlx::query("UPDATE event_outbox SET next_attempt_at = now() + interval '1 hour' WHERE id = $1").bind(pending).execute(&db).await.unwrap();
    let published = outbox_row(&db, 31.0, true).await;
    let node = fleet.start(Service::Cases, &[("CRAIG_RETENTION_INTERVAL_SECS", "1")], &[]).await;
    eventually(Duration::from_secs(15), "the published row past the window pruned", || {
        let db = db.clone();
        async move { !exists(&db, "event_outbox", "id", published).await }
    })
    .await;
    let scrape = || async { reqwest::get(format!("{}/metrics", node.base)).await.unwrap().text().await.unwrap() };
    let mut seen = String::new();
    for _ in 0..50 {
        seen = scrape().await;
        if seen.lines().any(|l| l == "outbox_unpublished_beyond_grace 1") {
            break;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert!(seen.lines().any(|l| l == "outbox_unpublished_beyond_grace 1"), "{seen}");
    assert!(exists(&db, "event_outbox", "id", pending).await, "the pending row is kept");
    assert_eq!(node.stop().await.code(), Some(0));
    db.close().await;
    fleet.finish().await;
}

/// Issue 21.5 (#965, §D4): the prune's DELETE re-checks its predicate on the row it deletes.
/// Deterministic two sessions: a replay's UPDATE holds the row of a published row past the
/// window (re-staging it), the prune starts and blocks on that row, the replay commits. The
/// row is now pending and the replay reported it re-staged: the prune must keep it. Before
/// the fix the outer `DELETE … WHERE id IN (subquery)` deleted it (it re-checks only the id).
#[tokio::test]
async fn the_prune_keeps_a_row_a_concurrent_replay_re_staged() {
    let fleet = Fleet::new("retention_prune_vs_replay", &[Service::Cases]).await;
    let db = fleet.pool(Service::Cases).await;
    let row = outbox_row(&db, 31.0, true).await;
    let mut replay = db.begin().await.unwrap();
    let restaged = sqlx::query("UPDATE event_outbox SET published_at = NULL, attempts = 0, claimed_at = NULL WHERE id = $1")
        .bind(row)
        .execute(&mut *replay)
        .await
        .unwrap()
        .rows_affected();
    assert_eq!(restaged, 1);
    let prune = tokio::spawn({
        let db = db.clone();
        async move { prune_once(&db, &PruneConfig::default()).await.unwrap() }
    });
    // The prune is blocked on the replay's row lock before the replay commits.
    eventually(Duration::from_secs(20), "the prune waits on the replay's row lock", || {
        let db = db.clone();
        async move {
            count(&db, "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND wait_event_type = 'Lock' AND query LIKE 'DELETE FROM event_outbox%'").await > 0
        }
    })
    .await;
    replay.commit().await.unwrap();
    let report = prune.await.unwrap();
    assert!(exists(&db, "event_outbox", "id", row).await, "the prune deleted a row the replay had re-staged: {report:?}");
    assert_eq!(report.outbox, 0, "{report:?}");
    let pending: bool = sqlx::query_scalar("SELECT published_at IS NULL FROM event_outbox WHERE id = $1").bind(row).fetch_one(&db).await.unwrap();
    assert!(pending);
    db.close().await;
    fleet.finish().await;
}
