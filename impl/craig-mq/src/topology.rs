//! Broker topology — ADR-022 §D3 (DLX/DLQ wiring) on ADR-003's topic exchange.
//!
//! - `craig.events`: durable topic exchange, routing key = `event_type`.
//! - `craig.dlx`: durable topic exchange for dead letters.
//! - every consumer queue `craig-<service>.events` is durable and declared with
//!   `x-dead-letter-exchange = craig.dlx`, `x-dead-letter-routing-key = dlq.<queue>`.
//! - `craig-security.dlq` is bound to `craig.dlx` with `dlq.#`, so a dead letter is kept
//!   even before the DLQ consumer runs.
//!
//! Ownership (#1202, least privilege): the exchanges — and the DLQ with its binding, so a
//! dead letter is kept before any consumer runs — are OPERATOR-owned: the deploy step
//! (`craig-node topology`, with the operator's credential) declares them with
//! [`declare_exchanges`]. A service's own credential has no `configure` on a shared
//! exchange, so a node only checks they exist ([`require_exchanges`], a passive declare,
//! which needs no permission) and declares what is its own: its consumer queue
//! ([`declare_consumer_queue`]) and, for security, the DLQ ([`declare_dlq`]). The
//! permissions themselves live in `craig_fleet::access`. Declarations are idempotent;
//! every node declares what it relies on at (re)connect.

use lapin::options::{ExchangeDeclareOptions, QueueBindOptions, QueueDeclareOptions};
use lapin::types::{AMQPValue, FieldTable, ShortString};
use lapin::{Channel, ExchangeKind};

pub const EVENTS_EXCHANGE: &str = "craig.events";
pub const DLX_EXCHANGE: &str = "craig.dlx";
pub const DLQ_QUEUE: &str = "craig-security.dlq";

/// `craig-<service>.events`.
pub fn consumer_queue(service: &str) -> String {
    format!("craig-{service}.events")
}

/// `dlq.<queue>` — the broker-path dead-letter routing key (#1196: keyed by the CONSUMER
/// queue, never the producer).
pub fn dlq_routing_key(queue: &str) -> String {
    format!("dlq.{queue}")
}

/// The arguments every consumer queue is declared with (§D3).
pub fn consumer_queue_args(queue: &str) -> FieldTable {
    let mut args = FieldTable::default();
    args.insert(
        ShortString::from("x-dead-letter-exchange"),
        AMQPValue::LongString(DLX_EXCHANGE.into()),
    );
    args.insert(
        ShortString::from("x-dead-letter-routing-key"),
        AMQPValue::LongString(dlq_routing_key(queue).as_str().into()),
    );
    args
}

/// The operator's part of the deploy (#1202): both exchanges, and the DLQ with its
/// binding. Needs `configure` on the exchanges, which no service credential has.
pub async fn declare_exchanges(ch: &Channel) -> Result<(), lapin::Error> {
    let durable = ExchangeDeclareOptions { durable: true, ..Default::default() };
    for name in [EVENTS_EXCHANGE, DLX_EXCHANGE] {
        ch.exchange_declare(name.into(), ExchangeKind::Topic, durable, FieldTable::default()).await?;
    }
    declare_dlq(ch).await
}

/// The operator's part of a deploy on `amqp_url` (its credential): connect,
/// [`declare_exchanges`], close. Bounded: 10 s to connect, 10 s to declare.
pub async fn deploy_operator_part(amqp_url: &str) -> Result<(), lapin::Error> {
    use std::time::Duration;
    let conn = crate::publisher::connect_within(amqp_url, 0, "craig-operator", Duration::from_secs(10)).await?;
    let declared = tokio::time::timeout(Duration::from_secs(10), async { declare_exchanges(&conn.create_channel().await?).await }).await;
    let _ = tokio::time::timeout(Duration::from_secs(2), conn.close(200, "deployed".into())).await;
    declared.unwrap_or_else(|_| {
        Err(lapin::ErrorKind::IOError(std::sync::Arc::new(std::io::Error::new(
            std::io::ErrorKind::TimedOut,
            "declaring the exchanges and the DLQ: no answer within 10 s",
        )))
        .into())
    })
}

/// A service's check that the operator-owned exchanges exist (#1202): passive declares,
/// which need no permission and create nothing. A missing exchange is a channel error
/// (404 NOT_FOUND) naming it: the deploy step has not run.
pub async fn require_exchanges(ch: &Channel) -> Result<(), lapin::Error> {
    let passive = ExchangeDeclareOptions { passive: true, ..Default::default() };
    for name in [EVENTS_EXCHANGE, DLX_EXCHANGE] {
        ch.exchange_declare(name.into(), ExchangeKind::Topic, passive, FieldTable::default()).await?;
    }
    Ok(())
}

/// `craig-security.dlq` bound to `craig.dlx` with `dlq.#` (§D3): the operator declares it
/// in the deploy step and security, whose queue it is, at every (re)connect.
pub async fn declare_dlq(ch: &Channel) -> Result<(), lapin::Error> {
    let q = QueueDeclareOptions { durable: true, ..Default::default() };
    ch.queue_declare(DLQ_QUEUE.into(), q, FieldTable::default()).await?;
    ch.queue_bind(DLQ_QUEUE.into(), DLX_EXCHANGE.into(), "dlq.#".into(), QueueBindOptions::default(), FieldTable::default())
        .await
}

/// How a consumer queue is declared. `with_dlx = false` reproduces compat mode `pre-d3`.
#[derive(Debug, Clone)]
pub struct QueueSpec {
    pub queue: String,
    pub bindings: Vec<String>,
    pub with_dlx: bool,
}

/// Declare a consumer queue and bind it to `craig.events` for each routing key; the
/// exchanges must exist (operator-owned, #1202).
pub async fn declare_consumer_queue(ch: &Channel, spec: &QueueSpec) -> Result<(), lapin::Error> {
    require_exchanges(ch).await?;
    let args = if spec.with_dlx { consumer_queue_args(&spec.queue) } else { FieldTable::default() };
    let q = QueueDeclareOptions { durable: true, ..Default::default() };
    ch.queue_declare(spec.queue.as_str().into(), q, args).await?;
    for key in &spec.bindings {
        ch.queue_bind(
            spec.queue.as_str().into(),
            EVENTS_EXCHANGE.into(),
            key.as_str().into(),
            QueueBindOptions::default(),
            FieldTable::default(),
        )
        .await?;
    }
    Ok(())
}

/// Message count of a queue by passive declare (rabbitmqctl counts lag for seconds).
pub async fn queue_depth(ch: &Channel, queue: &str) -> Result<u32, lapin::Error> {
    let q = QueueDeclareOptions { passive: true, ..Default::default() };
    Ok(ch.queue_declare(queue.into(), q, FieldTable::default()).await?.message_count())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_follow_the_adr() {
        assert_eq!(consumer_queue("rules"), "craig-rules.events");
        assert_eq!(dlq_routing_key("craig-rules.events"), "dlq.craig-rules.events");
        let args = consumer_queue_args("craig-rules.events");
        let inner = args.inner();
        assert_eq!(
            inner.get("x-dead-letter-exchange"),
            Some(&AMQPValue::LongString("craig.dlx".into()))
        );
        assert_eq!(
            inner.get("x-dead-letter-routing-key"),
            Some(&AMQPValue::LongString("dlq.craig-rules.events".into()))
        );
    }
}
