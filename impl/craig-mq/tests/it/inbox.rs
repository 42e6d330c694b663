//! The inbox's `processed_at` stamp (ADR-022 §D2, #1180) on a real database.

use std::time::Duration;

use craig_mq::{InboxOutcome, handle_idempotently};
use sqlx::postgres::PgPoolOptions;

use crate::common::{QUEUE, env, envelope};

/// A stamp that waits for a pooled connection past the pool's acquire timeout is tried
/// again, not given up: the #1180 window is a crash between the handler's commit and the
/// stamp, and a busy pool must not widen it (seen: a consumer's pool timed out for seconds
/// after a database pause and every such envelope ran twice). Before the retry, the first
/// call failed with the pool's timeout and the redelivery ran the handler again.
#[tokio::test]
async fn a_stamp_that_waits_for_a_connection_is_retried_and_the_handler_runs_once() {
    let e = env("inbox-stamp-retry").await;
    // One connection, a short acquire timeout: while the handler's own work holds the
    // connection a little after the handler returns, the stamp's first acquire times out.
    let url = e.sandbox.database_url("svc").to_owned();
    let pool = PgPoolOptions::new().max_connections(1).acquire_timeout(Duration::from_millis(300)).connect(&url).await.unwrap();
    let env1 = envelope();
    let runs = std::sync::Arc::new(std::sync::atomic::AtomicU32::new(0));
    let handler = |runs: std::sync::Arc<std::sync::atomic::AtomicU32>, pool: sqlx::PgPool| {
        move |_| async move {
            runs.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            let mut held = pool.acquire().await.map_err(std::io::Error::other)?;
            tokio::spawn(async move {
                sqlx::query("SELECT pg_sleep(0.8)").execute(&mut *held).await.unwrap();
            });
            Ok::<(), std::io::Error>(())
        }
    };
    let outcome = handle_idempotently(&pool, &env1, QUEUE, handler(runs.clone(), pool.clone())).await;
    assert!(matches!(outcome, Ok(InboxOutcome::Processed)), "{outcome:?}");
    let stamped: bool = sqlx::query_scalar("SELECT processed_at IS NOT NULL FROM event_inbox WHERE envelope_id = $1")
        .bind(env1.id)
        .fetch_one(&pool)
        .await
        .unwrap();
    assert!(stamped, "processed_at stamped once the connection came back");
    // The redelivery is a dedup hit: the handler ran once.
    let again = handle_idempotently(&pool, &env1, QUEUE, handler(runs.clone(), pool.clone())).await;
    assert!(matches!(again, Ok(InboxOutcome::Duplicate)), "{again:?}");
    assert_eq!(runs.load(std::sync::atomic::Ordering::SeqCst), 1);
    pool.close().await;
    e.finish().await;
}
