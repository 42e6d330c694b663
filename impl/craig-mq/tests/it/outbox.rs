//! ADR-022 §D1 + #1128 on real PostgreSQL and RabbitMQ.



use std::collections::HashSet;
use std::time::{Duration, Instant};

use uuid::Uuid;

use crate::common::*;

#[tokio::test]
async fn rolled_back_staging_publishes_nothing() {
    let env = env("rolled_back_staging").await;
    env.declare_rules_queue().await;
    let mut tx = env.pool.begin().await.unwrap();
    craig_mq::publish_in_tx(&mut tx, &envelope()).await.unwrap();
    tx.rollback().await.unwrap();
    let kept = env.stage(1, 1).await;

    let report = env.worker(fast_outbox()).drain().await.unwrap();
    assert_eq!(report.published, 1);
    let rows: i64 = sqlx::query_scalar("SELECT count(*) FROM event_outbox").fetch_one(&env.pool).await.unwrap();
    assert_eq!(rows, 1, "the rolled-back envelope must not be in the outbox");
    assert_eq!(env.take_all().await, vec![kept[0].to_string()]);
    env.finish().await;
}

#[tokio::test]
async fn ten_thousand_staged_events_all_reach_the_rules_queue() {
    let env = env("ten_thousand").await;
    env.declare_rules_queue().await;
    let ids = env.stage(10_000, 500).await;

    let started = Instant::now();
    let report = env.worker(fast_outbox()).drain().await.unwrap();
    let took = started.elapsed();
    eprintln!(
        "drained {} events in {:.2} s ({:.0} events/s, {} passes)",
        report.published,
        took.as_secs_f64(),
        report.published as f64 / took.as_secs_f64(),
        report.passes
    );
    assert_eq!(report.published, 10_000);
    assert_eq!(report.failed, 0);
    assert_eq!(env.pending().await, 0);
    let got = env.take_all().await;
    assert_eq!(got.len(), 10_000);
    let want: HashSet<String> = ids.iter().map(|u| u.to_string()).collect();
    assert_eq!(got.into_iter().collect::<HashSet<_>>(), want);
    env.finish().await;
}

#[tokio::test]
async fn two_workers_never_publish_a_row_twice_while_the_lease_holds() {
    let env = env("two_workers").await;
    env.declare_rules_queue().await;
    let ids = env.stage(3_000, 500).await;
    let cfg = crate::common::OutboxConfigExt::small_batches(fast_outbox());
    let (mut a, mut b) = (env.worker(cfg), env.worker(cfg));
    let (ra, rb) = tokio::join!(a.drain(), b.drain());
    let (ra, rb) = (ra.unwrap(), rb.unwrap());
    // Both did real work: the test proves concurrent claims, not one idle worker.
    assert!(ra.published > 0 && rb.published > 0, "a={ra:?} b={rb:?}");
    // Whichever stopped first may have left rows for the other; finish them.
    let rest = env.worker(cfg).drain().await.unwrap();
    assert_eq!(ra.published + rb.published + rest.published, 3_000);

    let got = env.take_all().await;
    let unique: HashSet<&String> = got.iter().collect();
    assert_eq!(got.len(), 3_000, "every row published exactly once");
    assert_eq!(unique.len(), 3_000);
    assert_eq!(unique, ids.iter().map(|u| u.to_string()).collect::<HashSet<_>>().iter().collect());
    env.finish().await;
}

#[tokio::test]
async fn an_expired_claim_is_reclaimed_and_a_live_one_is_not() {
    let env = env("lease_expiry").await;
    env.declare_rules_queue().await;
    let ids = env.stage(5, 5).await;
    // A worker that claimed and vanished: claimed_at stamped, nothing published.
    sqlx::query("UPDATE event_outbox SET claimed_at = now()").execute(&env.pool).await.unwrap();
    let mut cfg = fast_outbox();
    cfg.claim_lease = Duration::from_millis(1500);
    let mut w = env.worker(cfg);
    let live = w.pass().await.unwrap();
    assert_eq!(live.claimed, 0, "rows under a live lease must not be claimed");

    tokio::time::sleep(Duration::from_millis(1600)).await;
    let healed = w.pass().await.unwrap();
    assert_eq!((healed.claimed, healed.reclaimed, healed.published), (5, 5, 5));
    assert_eq!(env.pending().await, 0);
    let got: HashSet<String> = env.take_all().await.into_iter().collect();
    assert_eq!(got, ids.iter().map(|u| u.to_string()).collect());
    env.finish().await;
}

#[tokio::test]
async fn broker_refusing_then_closing_leaves_rows_pending_until_it_returns() {
    let env = env("broker_refuses").await;
    env.declare_rules_queue().await;
    let first = env.stage(10, 10).await;
    let mut worker = env.worker(fast_outbox());
    assert_eq!(worker.drain().await.unwrap().published, 10, "broker healthy: all published");

    // Closing: deleting the vhost force-closes the worker's open connection.
    env.sandbox.drop_vhost().await.unwrap();
    let staged = env.stage(20, 20).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    let closed = worker.pass().await.unwrap();
    assert_eq!((closed.claimed, closed.published, closed.failed), (20, 0, 20));
    // Refusing: the next pass reconnects and the broker refuses the vhost.
    let refused = worker.pass().await.unwrap();
    assert_eq!((refused.published, refused.failed), (0, 20));

    let rows: Vec<(i32, Option<String>, bool)> = sqlx::query_as(
        "SELECT attempts, last_error, claimed_at IS NULL FROM event_outbox WHERE published_at IS NULL",
    )
    .fetch_all(&env.pool)
    .await
    .unwrap();
    assert_eq!(rows.len(), 20);
    for (attempts, last_error, released) in &rows {
        assert_eq!(*attempts, 2);
        assert!(last_error.as_deref().is_some_and(|e| e.starts_with("connection:")), "{last_error:?}");
        assert!(released, "a failed publish releases its claim at once");
    }

    env.sandbox.restore_vhost().await.unwrap();
    env.declare_rules_queue().await;
    let back = worker.drain().await.unwrap();
    assert_eq!((back.published, back.failed), (20, 0));
    assert_eq!(env.pending().await, 0);
    let got: HashSet<String> = env.take_all().await.into_iter().collect();
    assert_eq!(got, staged.iter().map(|u| u.to_string()).collect(), "the first 10 went down with the old vhost");
    assert!(first.iter().all(|id| !got.contains(&id.to_string())));
    env.finish().await;
}

#[tokio::test]
async fn a_broker_nack_is_typed_and_keeps_the_row_pending() {
    let env = env("broker_nack").await;
    // A full queue with reject-publish overflow makes the broker NACK routed publishes.
    let conn = env.declare_full_queue(1).await;

    let publisher = craig_mq::Publisher::connect(env.sandbox.amqp_url(), fast_publisher()).await.unwrap();
    publisher.publish(&envelope()).await.expect("first fits");
    let second = envelope();
    match publisher.publish(&second).await {
        Err(craig_mq::PublishError::Nacked { id }) => assert_eq!(id, second.id),
        other => panic!("expected a typed Nack, got {other:?}"),
    }
    assert!(publisher.is_usable(), "a Nack does not poison the channel");
    publisher.close().await;

    let ids = env.stage(1, 1).await;
    let pass = env.worker(fast_outbox()).pass().await.unwrap();
    assert_eq!((pass.published, pass.failed), (0, 1));
    let (attempts, last_error): (i32, String) =
        sqlx::query_as("SELECT attempts, last_error FROM event_outbox WHERE id = $1").bind(ids[0]).fetch_one(&env.pool).await.unwrap();
    assert_eq!(attempts, 1);
    assert!(last_error.starts_with("nacked:"), "{last_error}");
    let _ = conn.close(200, "bye".into()).await;
    env.finish().await;
}

#[tokio::test]
async fn a_malformed_outbox_row_is_released_with_its_error_and_does_not_block_others() {
    let env = env("malformed_row").await;
    env.declare_rules_queue().await;
    sqlx::query("INSERT INTO event_outbox (event_type, envelope) VALUES ('case.referral_created', '{\"not\": \"an envelope\"}')")
        .execute(&env.pool)
        .await
        .unwrap();
    let good = env.stage(3, 3).await;
    let pass = env.worker(fast_outbox()).pass().await.unwrap();
    assert_eq!((pass.claimed, pass.published, pass.failed), (4, 3, 1));
    let err: String = sqlx::query_scalar("SELECT last_error FROM event_outbox WHERE published_at IS NULL")
        .fetch_one(&env.pool)
        .await
        .unwrap();
    assert!(err.starts_with("malformed:"), "{err}");
    assert_eq!(env.take_all().await.len(), good.len());
    env.finish().await;
}

/// Issue 7.1: without `mandatory`, the broker ACKs a message no queue took and the worker
/// stamped it published — gone. Now it is `Unroutable`, the row stays pending with its
/// reason and backs off on its own, and it arrives once the consumer queue exists.
#[tokio::test]
async fn an_unroutable_publish_is_a_typed_failure_and_the_row_waits_for_its_queue() {
    let env = env("unroutable").await;
    let (conn, ch) = env.channel().await;
    craig_mq::topology::declare_exchanges(&ch, env.sandbox.queue_type()).await.unwrap();
    let publisher = craig_mq::Publisher::connect(env.sandbox.amqp_url(), fast_publisher()).await.unwrap();
    let lone = envelope();
    match publisher.publish(&lone).await {
        Err(craig_mq::PublishError::Unroutable { id, routing_key, reply_code, .. }) => {
            assert_eq!((id, routing_key.as_str(), reply_code), (lone.id, EVENT, 312));
        }
        other => panic!("expected Unroutable, got {other:?}"),
    }
    assert!(publisher.is_usable(), "a returned message does not poison the channel");
    publisher.close().await;

    let ids = env.stage(3, 3).await;
    let mut worker = env.worker(fast_outbox());
    let first = worker.drain().await.unwrap();
    assert_eq!((first.published, first.failed, first.broker_failed), (0, 3, 0));
    let rows: Vec<(i32, String, bool, bool)> = sqlx::query_as(
        "SELECT attempts, last_error, claimed_at IS NULL, next_attempt_at > now() FROM event_outbox WHERE published_at IS NULL",
    )
    .fetch_all(&env.pool)
    .await
    .unwrap();
    assert_eq!(rows.len(), 3, "nothing was stamped published");
    for (attempts, last_error, released, backing_off) in rows {
        assert_eq!(attempts, 1);
        assert!(last_error.starts_with("unroutable:"), "{last_error}");
        assert!(released && backing_off, "released at once, retried after its own backoff");
    }

    env.declare_rules_queue().await;
    tokio::time::sleep(fast_outbox().backoff_base * 2).await;
    let back = worker.drain().await.unwrap();
    assert_eq!((back.published, back.failed), (3, 0));
    let got: HashSet<String> = env.take_all().await.into_iter().collect();
    assert_eq!(got, ids.iter().map(|u| u.to_string()).collect());
    let _ = conn.close(200, "bye".into()).await;
    env.finish().await;
}

/// Issue 7.2: one unpublishable row ahead of everything else used to end every drain after
/// its first pass and back the whole worker off, 99 healthy rows per backoff step. Now one
/// drain publishes every healthy row, and the poison row backs off alone, pending, counted.
#[tokio::test]
async fn a_poison_row_does_not_stall_the_drain_behind_it() {
    let env = env("poison_row").await;
    env.declare_rules_queue().await;
    let poison: Uuid = sqlx::query_scalar(
        "INSERT INTO event_outbox (event_type, envelope, created_at) \
         VALUES ('case.referral_created', '{\"not\": \"an envelope\"}', now() - interval '1 hour') RETURNING id",
    )
    .fetch_one(&env.pool)
    .await
    .unwrap();
    let good = env.stage(300, 100).await;
    // A row backoff longer than the drain, so the poison row is refused exactly once here.
    let mut cfg = fast_outbox();
    cfg.backoff_base = Duration::from_secs(30);
    cfg.backoff_max = Duration::from_secs(60);
    let mut worker = env.worker(cfg);
    let drain = worker.drain().await.unwrap();
    assert_eq!((drain.published, drain.failed, drain.broker_failed), (300, 1, 0), "{drain:?}");
    assert_eq!(env.take_all().await.len(), good.len());

    let (attempts, last_error, backing_off): (i32, String, bool) =
        sqlx::query_as("SELECT attempts, last_error, next_attempt_at > now() FROM event_outbox WHERE id = $1 AND published_at IS NULL")
            .bind(poison)
            .fetch_one(&env.pool)
            .await
            .unwrap();
    assert_eq!(attempts, 1);
    assert!(last_error.starts_with("malformed:") && backing_off, "{last_error}");
    assert_eq!(env.pending().await, 1, "the poison row is never faked as published, never deleted");
    // While it backs off, a drain does not touch it.
    assert_eq!(worker.drain().await.unwrap().failed, 0);
    env.finish().await;
}

/// Issue 7.2: a Nack is row-level. A full reject-publish queue Nacks the overflow; the
/// drain does not count that as a broker failure, and the refused rows back off alone.
#[tokio::test]
async fn nacked_rows_back_off_alone_and_the_drain_is_not_a_broker_failure() {
    let env = env("nack_drain").await;
    let conn = env.declare_full_queue(2).await;
    env.stage(5, 5).await;
    let drain = env.worker(fast_outbox()).drain().await.unwrap();
    assert_eq!((drain.published, drain.failed, drain.broker_failed), (2, 3, 0), "{drain:?}");
    let nacked: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM event_outbox WHERE published_at IS NULL AND last_error LIKE 'nacked:%' AND next_attempt_at > now()",
    )
    .fetch_one(&env.pool)
    .await
    .unwrap();
    assert_eq!(nacked, 3);
    let _ = conn.close(200, "bye".into()).await;
    env.finish().await;
}

/// Issue 7.2: `publish_in_tx` refuses an envelope the worker could never publish (here: a
/// NUL in the payload, which jsonb cannot hold) with the typed envelope error; nothing is staged.
#[tokio::test]
async fn staging_refuses_an_unpublishable_envelope_and_stages_nothing() {
    let env = env("refused_staging").await;
    let mut bad = envelope();
    bad.payload = serde_json::json!({ "subject": "a\u{0}b" });
    let mut tx = env.pool.begin().await.unwrap();
    let err = craig_mq::publish_in_tx(&mut tx, &bad).await.unwrap_err();
    assert!(
        matches!(craig_mq::refused_envelope(&err), Some(craig_mq::EnvelopeError::Nul { path }) if path == "payload.subject"),
        "{err}"
    );
    let mut bad_name = envelope();
    bad_name.event_type = "Case Created".into();
    let err = craig_mq::publish_in_tx(&mut tx, &bad_name).await.unwrap_err();
    assert!(matches!(craig_mq::refused_envelope(&err), Some(craig_mq::EnvelopeError::BadName { .. })), "{err}");
    tx.commit().await.unwrap();
    assert_eq!(env.pending().await, 0);
    env.finish().await;
}

/// Issue 7.5: a SIGTERM's last drain is bounded even while another writer keeps the outbox
/// full, and stops between passes: no claim is abandoned to wait out its lease.
#[tokio::test]
async fn the_final_drain_is_bounded_and_abandons_no_claim() {
    let env = env("final_drain").await;
    env.declare_rules_queue().await;
    let mut cfg = fast_outbox();
    cfg.batch_size = 20;
    let shutdown = tokio_util::sync::CancellationToken::new();
    let feeding = tokio_util::sync::CancellationToken::new();
    let feeder = {
        let (pool, stop) = (env.pool.clone(), feeding.clone());
        tokio::spawn(async move {
            while !stop.is_cancelled() {
                let mut tx = pool.begin().await.unwrap();
                for _ in 0..50 {
                    craig_mq::publish_in_tx(&mut tx, &envelope()).await.unwrap();
                }
                tx.commit().await.unwrap();
            }
        })
    };
    let worker = tokio::spawn(env.worker(cfg).run(shutdown.clone()));
    tokio::time::sleep(Duration::from_millis(500)).await;
    shutdown.cancel();
    // Generous: this asserts that run() returns at all while the outbox never empties.
    tokio::time::timeout(Duration::from_secs(60), worker).await.expect("final drain bounded").unwrap();
    feeding.cancel();
    feeder.await.unwrap();
    let held: i64 = sqlx::query_scalar("SELECT count(*) FROM event_outbox WHERE published_at IS NULL AND claimed_at IS NOT NULL")
        .fetch_one(&env.pool)
        .await
        .unwrap();
    assert_eq!(held, 0, "a stopped worker leaves no claim behind");
    env.finish().await;
}

/// Broker behaviour scenario `broker-nacks` relies on, pinned (RabbitMQ 3.10, classic
/// queue). Under a `reject-publish` length limit, deliveries a crashed consumer held unacked
/// come back to the queue and are KEPT past the limit (unacked deliveries do not count toward
/// it). But a FIRST limit applied to a queue already over it drops the head — dead-letters
/// it — even with `reject-publish` (max-length takes effect while overflow is still the
/// default drop-head): that is why the scenario sets the limit before its consumer
/// goes down, never while a backlog exists (found when an earlier schedule lost 85 events).
#[tokio::test]
async fn requeued_deliveries_past_a_reject_publish_limit_are_kept_but_a_late_limit_drops_the_head() {
    use futures_util::StreamExt;
    use lapin::options::{BasicConsumeOptions, BasicQosOptions};
    use lapin::types::FieldTable;
    let env = env("requeue_past_limit").await;
    env.declare_rules_queue().await;
    let policy = serde_json::json!({"max-length": 2, "overflow": "reject-publish"});
    env.sandbox.set_policy("limit", "^craig-rules\\.events$", &policy).await.unwrap();
    tokio::time::sleep(Duration::from_millis(500)).await;

    let (consumer_conn, ch) = env.channel().await;
    ch.basic_qos(5, BasicQosOptions::default()).await.unwrap();
    let mut consumer = ch.basic_consume(QUEUE.into(), "".into(), BasicConsumeOptions::default(), FieldTable::default()).await.unwrap();
    let publisher = craig_mq::Publisher::connect(env.sandbox.amqp_url(), fast_publisher()).await.unwrap();
    for _ in 0..5 {
        publisher.publish(&envelope()).await.expect("one at a time, straight to the consumer");
        consumer.next().await.unwrap().unwrap(); // held, never acked
    }
    publisher.publish(&envelope()).await.expect("1 ready");
    publisher.publish(&envelope()).await.expect("2 ready");
    assert!(matches!(publisher.publish(&envelope()).await, Err(craig_mq::PublishError::Nacked { .. })), "full");
    // The consumer dies: its 5 deliveries come back to a queue already at its limit.
    drop(consumer);
    let _ = consumer_conn.close(200, "crash".into()).await;
    let (conn, ch) = env.channel().await;
    // The broker requeues and applies policies on its own time: poll (bounded), then judge.
    let settled = |queue: &'static str, want: (u32, u32)| {
        let ch = ch.clone();
        async move {
            let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
            loop {
                let ready = craig_mq::topology::queue_depth(&ch, queue).await.unwrap();
                let dead = craig_mq::topology::queue_depth(&ch, craig_mq::topology::DLQ_QUEUE).await.unwrap();
                if (ready, dead) == want || tokio::time::Instant::now() > deadline {
                    return (ready, dead);
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    };
    assert_eq!(settled(QUEUE, (7, 0)).await, (7, 0), "requeued deliveries are kept past the limit");

    // A FIRST limit lands on a backlog of 5 (a queue with no limit yet, so overflow is still
    // the default drop-head when max-length takes effect): the head goes to craig.dlx.
    env.sandbox.clear_policy("limit").await.unwrap();
    let backlog = craig_mq::topology::QueueSpec { queue: "craig-backlog.events".into(), bindings: vec![EVENT.into()], with_dlx: true, queue_type: env.sandbox.queue_type() };
    craig_mq::topology::declare_consumer_queue(&ch, &backlog).await.unwrap();
    for _ in 0..5 {
        publisher.publish(&envelope()).await.unwrap();
    }
    env.sandbox.set_policy("late", "^craig-backlog\\.events$", &policy).await.unwrap();
    assert_eq!(settled("craig-backlog.events", (2, 3)).await, (2, 3), "a first limit applied over a backlog dead-letters the excess");
    let _ = conn.close(200, "bye".into()).await;
    publisher.close().await;
    env.finish().await;
}

/// Audit finding: lapin hands a returned message to whichever confirm completes next, so in a
/// pipelined batch mixing routable and unroutable envelopes a return must be matched to its
/// row by message id. Otherwise an unroutable row is "ACKed" (stamped, lost) and a routable
/// one reported unroutable.
#[tokio::test]
async fn in_a_mixed_batch_exactly_the_unroutable_envelopes_are_unroutable() {
    let env = env("mixed_batch").await;
    env.declare_rules_queue().await;
    let publisher = craig_mq::Publisher::connect(env.sandbox.amqp_url(), fast_publisher()).await.unwrap();
    let batch: Vec<craig_mq::EventEnvelope> = (0..40)
        .map(|i| if i % 3 == 0 { craig_mq::EventEnvelope::new("nobody.listens", "cases", None, serde_json::json!({})).unwrap() } else { envelope() })
        .collect();
    let results = publisher.publish_batch(&batch).await;
    for (i, (env, res)) in batch.iter().zip(&results).enumerate() {
        match (i % 3 == 0, res) {
            (true, Err(craig_mq::PublishError::Unroutable { id, .. })) => assert_eq!(*id, env.id),
            (false, Ok(())) => {}
            (unroutable, other) => panic!("envelope {i} (unroutable: {unroutable}) got {other:?}"),
        }
    }
    publisher.close().await;
    let routed: HashSet<String> = batch.iter().enumerate().filter(|(i, _)| i % 3 != 0).map(|(_, e)| e.id.to_string()).collect();
    assert_eq!(env.take_all().await.into_iter().collect::<HashSet<_>>(), routed);
    env.finish().await;
}

/// Issue 12: a drain that claimed a batch ahead and then stops hands it back untried: the
/// rows are claimable at once, with no attempt counted; a stale fence changes nothing.
#[tokio::test]
async fn a_batch_claimed_ahead_is_handed_back_untried_and_only_under_its_own_claim() {
    use craig_mq::outbox::lease;
    let env = env("unclaim").await;
    env.stage(5, 5).await;
    let rows = lease::claim(&env.pool, Duration::from_secs(60), 10).await.unwrap();
    assert_eq!(rows.len(), 5);
    let held: Vec<lease::Held> = rows.iter().map(|r| lease::Held { id: r.id, claim: r.claim }).collect();
    let stale = lease::Held { claim: held[0].claim - chrono::Duration::seconds(1), ..held[0] };
    assert_eq!(lease::unclaim(&env.pool, &[stale]).await.unwrap().stale, vec![stale.id], "another claim's fence");
    let back = lease::unclaim(&env.pool, &held).await.unwrap();
    assert_eq!(back.applied.len(), 5);
    let (attempts, claimed): (i64, i64) =
        sqlx::query_as("SELECT sum(attempts)::bigint, count(claimed_at) FROM event_outbox").fetch_one(&env.pool).await.unwrap();
    assert_eq!((attempts, claimed), (0, 0), "handed back untried: no attempt counted, no claim left");
    assert_eq!(lease::claim(&env.pool, Duration::from_secs(60), 10).await.unwrap().len(), 5, "claimable at once");
    env.finish().await;
}

/// The LISTEN/NOTIFY upgrade path (issue 12): with a 60 s poll, a staged row is published
/// because the staging transaction's NOTIFY woke the worker; after the server terminates
/// the listener connection, a row staged while nobody listens is still published (the
/// lost listener wakes the worker, then reconnects), exactly once each.
#[tokio::test]
async fn notify_wakes_the_worker_and_a_lost_listener_loses_nothing() {
    let owned = env("notify").await;
    let env = &owned;
    env.declare_rules_queue().await;
    let mut cfg = fast_outbox();
    cfg.poll_interval = Duration::from_secs(60);
    craig_mq::outbox::notify::set_staging_notifies(true);
    let stop = tokio_util::sync::CancellationToken::new();
    let worker = tokio::spawn(env.worker(cfg).with_notify(true).run(stop.clone()));
    let listeners = || async {
        let n: i64 = sqlx::query_scalar("SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND application_name = $1")
            .bind(craig_mq::outbox::notify::APPLICATION_NAME)
            .fetch_one(&env.pool)
            .await
            .unwrap();
        n
    };
    let published_within = |secs: u64| async move {
        let until = Instant::now() + Duration::from_secs(secs);
        while env.pending().await > 0 && Instant::now() < until {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        env.pending().await == 0
    };
    let until = Instant::now() + Duration::from_secs(10);
    while listeners().await == 0 && Instant::now() < until {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(listeners().await, 1, "one listener connection");
    // Let the worker's first (start-up) drain pass, so only a wake-up can publish.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let first = env.stage(1, 1).await;
    assert!(published_within(20).await, "the NOTIFY woke the worker long before its 60 s poll");

    let cut: Vec<bool> = sqlx::query_scalar(
        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = current_database() AND application_name = $1",
    )
    .bind(craig_mq::outbox::notify::APPLICATION_NAME)
    .fetch_all(&env.pool)
    .await
    .unwrap();
    assert_eq!(cut, vec![true], "the server terminated the listener");
    let second = env.stage(1, 1).await;
    assert!(published_within(20).await, "the lost listener woke the worker; nothing waits for the 60 s poll");
    stop.cancel();
    worker.await.unwrap();
    craig_mq::outbox::notify::set_staging_notifies(false);
    let got: Vec<String> = env.take_all().await;
    assert_eq!(got, vec![first[0].to_string(), second[0].to_string()], "each exactly once");
    owned.finish().await;
}
