//! Network faults between a publisher and the real broker, through the fault proxy:
//! lapin must surface them as the typed errors craig-mq's publisher maps, and the outbox
//! must keep the rows pending until the link heals.

use std::time::Duration;

use craig_chaos::proxy::{FaultProxy, Stream, Toxic, ToxicKind, ToxiproxyClient, api};
use craig_mq::{EventEnvelope, OutboxConfig, OutboxWorker, PublishError, Publisher, PublisherConfig};
use craig_sandbox::Sandbox;

struct Rig {
    sandbox: Sandbox,
    api: ToxiproxyClient,
    /// AMQP URL through the proxy.
    proxied: String,
}

async fn rig(label: &str) -> Rig {
    let sandbox = Sandbox::create(&format!("chaos-amqp::{label}"), &["svc"]).await.unwrap();
    let (api_addr, _) = api::serve(FaultProxy::new(1), "127.0.0.1:0".parse().unwrap()).await.unwrap();
    let api = ToxiproxyClient::new(format!("http://{api_addr}"));
    let broker = craig_chaos::backend::external_authority(sandbox.amqp_url());
    let info = api.create_proxy("broker", "127.0.0.1:0", &broker).await.unwrap();
    let proxied = sandbox.amqp_url().replacen(&broker, &info.listen, 1);
    // Publishes are mandatory: give them the queue a deployment would have.
    let conn = craig_mq::publisher::connect(sandbox.amqp_url(), 30, "test-setup").await.unwrap();
    let ch = conn.create_channel().await.unwrap();
    let spec = craig_mq::topology::QueueSpec {
        queue: "craig-rules.events".into(),
        bindings: vec!["case.referral_created".into()],
        with_dlx: true,
        queue_type: Default::default(),
    };
    craig_mq::topology::declare_consumer_queue(&ch, &spec).await.unwrap();
    let _ = conn.close(200, "bye".into()).await;
    Rig { sandbox, api, proxied }
}

fn cfg() -> PublisherConfig {
    PublisherConfig { heartbeat_secs: 30, confirm_timeout: Duration::from_millis(800), ..PublisherConfig::default() }
}

fn envelope() -> EventEnvelope {
    EventEnvelope::new("case.referral_created", "cases", None, serde_json::json!({})).unwrap()
}

#[tokio::test]
async fn a_black_holed_confirm_is_a_typed_confirm_timeout() {
    let rig = rig("black_hole").await;
    let publisher = Publisher::connect(&rig.proxied, cfg()).await.unwrap();
    publisher.publish(&envelope()).await.expect("healthy link");
    // The broker's replies (confirms) vanish; our frames still reach it.
    rig.api.add_toxic("broker", &Toxic::new(Stream::Downstream, ToxicKind::Timeout { timeout: 0 })).await.unwrap();
    let env = envelope();
    let res = tokio::time::timeout(Duration::from_secs(10), publisher.publish(&env)).await.expect("bounded by the confirm timeout");
    match res {
        Err(PublishError::ConfirmTimeout { id, after }) => {
            assert_eq!(id, env.id);
            assert_eq!(after, Duration::from_millis(800));
        }
        other => panic!("expected ConfirmTimeout, got {other:?}"),
    }
    assert!(!publisher.is_usable(), "a timed-out channel is poisoned and must be replaced");
    rig.sandbox.destroy().await.unwrap();
}

#[tokio::test]
async fn a_reset_peer_is_a_typed_connection_error() {
    let rig = rig("reset_peer").await;
    let publisher = Publisher::connect(&rig.proxied, cfg()).await.unwrap();
    publisher.publish(&envelope()).await.expect("healthy link");
    rig.api.add_toxic("broker", &Toxic::new(Stream::Upstream, ToxicKind::ResetPeer { timeout: 0 })).await.unwrap();
    let res = tokio::time::timeout(Duration::from_secs(10), publisher.publish(&envelope())).await.expect("bounded");
    match res {
        Err(PublishError::Connection(e)) => {
            let text = format!("{e:?}");
            assert!(text.contains("ConnectionReset") || text.contains("reset") || text.contains("IOError"), "{text}");
        }
        other => panic!("expected a Connection error, got {other:?}"),
    }
    assert!(!publisher.is_usable());
    rig.sandbox.destroy().await.unwrap();
}

#[tokio::test]
async fn the_outbox_keeps_rows_pending_through_a_black_hole_and_drains_after() {
    let rig = rig("outbox_black_hole").await;
    let pool = rig.sandbox.pool("svc").await.unwrap();
    craig_fleet::Service::Cases.migrator().run(&pool).await.unwrap();
    let ocfg = OutboxConfig {
        poll_interval: Duration::from_millis(50),
        batch_size: 100,
        claim_lease: Duration::from_secs(60),
        backoff_base: Duration::from_millis(10),
        backoff_max: Duration::from_millis(100),
    };
    let mut worker = OutboxWorker::new(pool.clone(), &rig.proxied, cfg(), ocfg);
    let mut tx = pool.begin().await.unwrap();
    craig_mq::publish_in_tx(&mut tx, &envelope()).await.unwrap();
    tx.commit().await.unwrap();
    assert_eq!(worker.drain().await.unwrap().published, 1, "connected over a healthy link");
    let mut tx = pool.begin().await.unwrap();
    for _ in 0..10 {
        craig_mq::publish_in_tx(&mut tx, &envelope()).await.unwrap();
    }
    tx.commit().await.unwrap();
    rig.api.add_toxic("broker", &Toxic::new(Stream::Downstream, ToxicKind::Timeout { timeout: 0 })).await.unwrap();
    let pass = worker.pass().await.unwrap();
    assert_eq!((pass.published, pass.failed), (0, 10));
    let errors: Vec<String> = sqlx::query_scalar("SELECT last_error FROM event_outbox WHERE published_at IS NULL")
        .fetch_all(&pool)
        .await
        .unwrap();
    assert_eq!(errors.len(), 10);
    assert!(errors.iter().all(|e| e.starts_with("confirm_timeout:")), "{errors:?}");

    rig.api.reset().await.unwrap();
    let drained = worker.drain().await.unwrap();
    assert_eq!((drained.published, drained.failed), (10, 0));
    pool.close().await;
    rig.sandbox.destroy().await.unwrap();
}
