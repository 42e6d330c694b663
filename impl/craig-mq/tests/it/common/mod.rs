//! Shared set-up for craig-mq's integration tests: a sandbox (own database + own vhost)
//! migrated with the rules service schema, and small AMQP helpers.
#![allow(dead_code)]

use std::time::Duration;

use craig_mq::topology::{self, QueueSpec, QueueType};
use craig_mq::{EventEnvelope, OutboxConfig, OutboxWorker, PublisherConfig};
use craig_sandbox::Sandbox;
use lapin::options::BasicGetOptions;
use sqlx::PgPool;

pub const QUEUE: &str = "craig-rules.events";
pub const EVENT: &str = "case.referral_created";

pub struct Env {
    pub sandbox: Sandbox,
    pub pool: PgPool,
}

pub async fn env(label: &str) -> Env {
    env_typed(label, QueueType::Classic).await
}

/// [`env`] whose queues are of `queue_type` (issue 25).
pub async fn env_typed(label: &str, queue_type: QueueType) -> Env {
    let sandbox = Sandbox::create_typed(&format!("craig-mq::{label}"), &["svc"], queue_type).await.expect("sandbox");
    let pool = sandbox.pool("svc").await.expect("pool");
    // Read from the checkout at run time (no sqlx macro crates in the build).
    let dir = std::path::Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/../../migrations/rules"));
    sqlx::migrate::Migrator::new(dir).await.expect("migrations/rules").run(&pool).await.expect("migrate");
    Env { sandbox, pool }
}

impl Env {
    pub async fn finish(self) {
        self.pool.close().await;
        self.sandbox.destroy().await.expect("destroy sandbox");
    }

    pub fn worker(&self, cfg: OutboxConfig) -> OutboxWorker {
        OutboxWorker::new(self.pool.clone(), self.sandbox.amqp_url(), fast_publisher(), cfg)
    }

    pub async fn channel(&self) -> (lapin::Connection, lapin::Channel) {
        let conn = craig_mq::publisher::connect(self.sandbox.amqp_url(), 5, "test").await.expect("amqp");
        let ch = conn.create_channel().await.expect("channel");
        (conn, ch)
    }

    /// The rules consumer queue as a node declares it, of the sandbox's type.
    pub fn rules_spec(&self) -> QueueSpec {
        QueueSpec { queue: QUEUE.into(), bindings: vec![EVENT.into()], with_dlx: true, queue_type: self.sandbox.queue_type() }
    }

    /// Declare the rules consumer queue exactly as a node would.
    pub async fn declare_rules_queue(&self) {
        let (conn, ch) = self.channel().await;
        let spec = self.rules_spec();
        topology::declare_consumer_queue(&ch, &spec).await.expect("declare");
        let _ = conn.close(200, "bye".into()).await;
    }

    /// Queue `full`, bound to EVENT, holding at most `max` ready messages with
    /// `reject-publish` overflow: past that the broker Nacks what is routed to it. The
    /// connection is returned so the caller closes it when done.
    pub async fn declare_full_queue(&self, max: i32) -> lapin::Connection {
        use lapin::options::{QueueBindOptions, QueueDeclareOptions};
        use lapin::types::{AMQPValue, FieldTable};
        let (conn, ch) = self.channel().await;
        topology::declare_exchanges(&ch, self.sandbox.queue_type()).await.expect("exchanges");
        let mut args = FieldTable::default();
        args.insert("x-max-length".into(), AMQPValue::LongInt(max));
        args.insert("x-overflow".into(), AMQPValue::LongString("reject-publish".into()));
        ch.queue_declare("full".into(), QueueDeclareOptions { durable: true, ..Default::default() }, args).await.expect("declare");
        ch.queue_bind("full".into(), "craig.events".into(), EVENT.into(), QueueBindOptions::default(), FieldTable::default())
            .await
            .expect("bind");
        conn
    }

    pub async fn depth(&self) -> u32 {
        let (conn, ch) = self.channel().await;
        let n = topology::queue_depth(&ch, QUEUE).await.expect("passive declare");
        let _ = conn.close(200, "bye".into()).await;
        n
    }

    /// Take every message now in the queue; return their `message_id`s in order.
    pub async fn take_all(&self) -> Vec<String> {
        let (conn, ch) = self.channel().await;
        let mut ids = Vec::new();
        while let Some(m) = ch.basic_get(QUEUE.into(), BasicGetOptions { no_ack: true }).await.expect("basic.get") {
            ids.push(m.delivery.properties.message_id().as_ref().map(|s| s.to_string()).unwrap_or_default());
        }
        let _ = conn.close(200, "bye".into()).await;
        ids
    }

    /// Stage `n` envelopes, `per_tx` to a transaction; returns their ids.
    pub async fn stage(&self, n: usize, per_tx: usize) -> Vec<uuid::Uuid> {
        let mut ids = Vec::with_capacity(n);
        let mut left = n;
        while left > 0 {
            let k = left.min(per_tx);
            let mut tx = self.pool.begin().await.unwrap();
            for _ in 0..k {
                let env = envelope();
                craig_mq::publish_in_tx(&mut tx, &env).await.unwrap();
                ids.push(env.id);
            }
            tx.commit().await.unwrap();
            left -= k;
        }
        ids
    }

    pub async fn pending(&self) -> i64 {
        craig_mq::outbox::pending_count(&self.pool).await.unwrap()
    }
}

pub fn envelope() -> EventEnvelope {
    let id = uuid::Uuid::now_v7();
    EventEnvelope::new(EVENT, "cases", Some(id), serde_json::json!({ "referral_id": id, "subject": "t" })).unwrap()
}

pub fn fast_publisher() -> PublisherConfig {
    PublisherConfig { heartbeat_secs: 2, confirm_timeout: Duration::from_secs(3), connect_timeout: Duration::from_secs(3) }
}

pub fn fast_outbox() -> OutboxConfig {
    OutboxConfig {
        poll_interval: Duration::from_millis(50),
        batch_size: 100,
        claim_lease: Duration::from_secs(60),
        backoff_base: Duration::from_millis(20),
        backoff_max: Duration::from_millis(200),
    }
}

pub trait OutboxConfigExt {
    /// Small batches so two concurrent drains interleave many claims.
    fn small_batches(self) -> Self;
}

impl OutboxConfigExt for OutboxConfig {
    fn small_batches(mut self) -> Self {
        self.batch_size = 25;
        self
    }
}
