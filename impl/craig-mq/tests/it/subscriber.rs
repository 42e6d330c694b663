//! The consume session's concurrency (issue 12) on a real broker.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use craig_mq::subscriber::{HandlerError, SubscriberConfig, run_subscriber};

use crate::common::*;

async fn publish(env: &Env, n: usize) {
    let (conn, ch) = env.channel().await;
    ch.confirm_select(lapin::options::ConfirmSelectOptions::default()).await.unwrap();
    for _ in 0..n {
        let e = envelope();
        ch.basic_publish("craig.events".into(), EVENT.into(), lapin::options::BasicPublishOptions::default(), &e.to_vec(), lapin::BasicProperties::default())
            .await
            .unwrap()
            .await
            .unwrap();
    }
    let _ = conn.close(200, "bye".into()).await;
}

fn cfg(env: &Env, concurrency: u16) -> SubscriberConfig {
    SubscriberConfig {
        amqp_url: env.sandbox.amqp_url().to_owned(),
        spec: env.rules_spec(),
        prefetch: 32,
        concurrency,
        heartbeat_secs: 2,
        retry_delay: Duration::from_millis(50),
        reconnect_delay: Duration::from_millis(200),
    }
}

/// Four deliveries are inside the handler at once: each waits at a barrier of four, which
/// only opens when the session runs four handlers together; never more than four.
#[tokio::test]
async fn a_session_runs_up_to_its_concurrency_of_handlers_at_once() {
    let env = env("subscriber_concurrency").await;
    env.declare_rules_queue().await;
    publish(&env, 16).await;
    let barrier = Arc::new(tokio::sync::Barrier::new(4));
    let (inside, most, done) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
    let handler = {
        let (barrier, inside, most, done) = (barrier.clone(), inside.clone(), most.clone(), done.clone());
        move |_env| {
            let (barrier, inside, most, done) = (barrier.clone(), inside.clone(), most.clone(), done.clone());
            async move {
                let now = inside.fetch_add(1, Ordering::SeqCst) + 1;
                most.fetch_max(now, Ordering::SeqCst);
                let met = tokio::time::timeout(Duration::from_secs(20), barrier.wait()).await.is_ok();
                inside.fetch_sub(1, Ordering::SeqCst);
                if !met {
                    return Err(HandlerError::Transient("the barrier never filled".into()));
                }
                done.fetch_add(1, Ordering::SeqCst);
                Ok(())
            }
        }
    };
    let stop = tokio_util::sync::CancellationToken::new();
    let session = tokio::spawn(run_subscriber(cfg(&env, 4), handler, stop.clone()));
    let until = std::time::Instant::now() + Duration::from_secs(30);
    while done.load(Ordering::SeqCst) < 16 && std::time::Instant::now() < until {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    stop.cancel();
    session.await.unwrap();
    assert_eq!(done.load(Ordering::SeqCst), 16, "every delivery passed a barrier of four");
    assert_eq!(most.load(Ordering::SeqCst), 4, "never more than the concurrency");
    assert_eq!(env.depth().await, 0, "all acked");
    env.finish().await;
}

/// `concurrency = 1` is the old one-at-a-time consumer: never two handlers at once.
#[tokio::test]
async fn concurrency_one_handles_one_delivery_at_a_time() {
    let env = env("subscriber_sequential").await;
    env.declare_rules_queue().await;
    publish(&env, 10).await;
    let (inside, most, done) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
    let handler = {
        let (inside, most, done) = (inside.clone(), most.clone(), done.clone());
        move |_env| {
            let (inside, most, done) = (inside.clone(), most.clone(), done.clone());
            async move {
                let now = inside.fetch_add(1, Ordering::SeqCst) + 1;
                most.fetch_max(now, Ordering::SeqCst);
                tokio::time::sleep(Duration::from_millis(10)).await;
                inside.fetch_sub(1, Ordering::SeqCst);
                done.fetch_add(1, Ordering::SeqCst);
                Ok::<(), HandlerError>(())
            }
        }
    };
    let stop = tokio_util::sync::CancellationToken::new();
    let session = tokio::spawn(run_subscriber(cfg(&env, 1), handler, stop.clone()));
    let until = std::time::Instant::now() + Duration::from_secs(30);
    while done.load(Ordering::SeqCst) < 10 && std::time::Instant::now() < until {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    stop.cancel();
    session.await.unwrap();
    assert_eq!((done.load(Ordering::SeqCst), most.load(Ordering::SeqCst)), (10, 1));
    env.finish().await;
}

/// Deliveries of ONE envelope never run at once, whatever the concurrency: a copy waits for
/// the original to settle (so the inbox would see it stamped), while other envelopes go on.
#[tokio::test]
async fn copies_of_one_envelope_never_run_at_once() {
    let env = env("subscriber_same_envelope").await;
    env.declare_rules_queue().await;
    let (conn, ch) = env.channel().await;
    ch.confirm_select(lapin::options::ConfirmSelectOptions::default()).await.unwrap();
    let copied = envelope();
    let mut bodies = vec![copied.to_vec(); 3];
    bodies.extend((0..5).map(|_| envelope().to_vec()));
    for body in &bodies {
        ch.basic_publish("craig.events".into(), EVENT.into(), lapin::options::BasicPublishOptions::default(), body, lapin::BasicProperties::default())
            .await
            .unwrap()
            .await
            .unwrap();
    }
    let _ = conn.close(200, "bye".into()).await;
    let (inside, most, done) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
    let handler = {
        let (inside, most, done, id) = (inside.clone(), most.clone(), done.clone(), copied.id);
        move |e: craig_mq::EventEnvelope| {
            let (inside, most, done) = (inside.clone(), most.clone(), done.clone());
            async move {
                if e.id == id {
                    let now = inside.fetch_add(1, Ordering::SeqCst) + 1;
                    most.fetch_max(now, Ordering::SeqCst);
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    inside.fetch_sub(1, Ordering::SeqCst);
                }
                done.fetch_add(1, Ordering::SeqCst);
                Ok::<(), HandlerError>(())
            }
        }
    };
    let stop = tokio_util::sync::CancellationToken::new();
    let session = tokio::spawn(run_subscriber(cfg(&env, 8), handler, stop.clone()));
    let until = std::time::Instant::now() + Duration::from_secs(30);
    while done.load(Ordering::SeqCst) < 8 && std::time::Instant::now() < until {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    stop.cancel();
    session.await.unwrap();
    assert_eq!(done.load(Ordering::SeqCst), 8, "every delivery handled");
    assert_eq!(most.load(Ordering::SeqCst), 1, "the three copies ran one after another");
    env.finish().await;
}
