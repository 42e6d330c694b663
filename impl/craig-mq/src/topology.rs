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
//!
//! Queue type (issue 25): every consumer queue, the DLQ and security's capture queue are of
//! one [`QueueType`], `CRAIG_QUEUE_TYPE` (default `classic`, the ADR's topology). The deploy
//! step and every node must be given the same one: a queue redeclared with other arguments
//! is refused by the broker (406 PRECONDITION_FAILED), and that refusal is the node's error.
//! A `quorum` consumer queue keeps the §D3 wiring and adds what quorum dead-lettering needs
//! to be at-least-once: `x-dead-letter-strategy = at-least-once`, which RabbitMQ honours only
//! with `x-overflow = reject-publish` (else it falls back to at-most-once). No
//! `x-delivery-limit` is set: a poison message is the inbox's to surface (its retry cap,
//! `CRAIG_INBOX_RETRY_CAP`), and a broker limit below that cap would dead-letter a delivery
//! the app path still counts (RabbitMQ 3.10 sets none by default).

use lapin::options::{ExchangeDeclareOptions, QueueBindOptions, QueueDeclareOptions};
use lapin::types::{AMQPValue, FieldTable, ShortString};
use lapin::{Channel, ExchangeKind};

pub const EVENTS_EXCHANGE: &str = "craig.events";
pub const DLX_EXCHANGE: &str = "craig.dlx";
pub const DLQ_QUEUE: &str = "craig-security.dlq";

/// The type of every queue the fleet declares (issue 25): `CRAIG_QUEUE_TYPE`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum QueueType {
    /// A classic durable queue on one node: the ADR's topology. Its messages live on that
    /// node only: a node whose disk is lost loses what it had confirmed.
    #[default]
    Classic,
    /// A Raft-replicated quorum queue: a message is confirmed once a majority of its
    /// members wrote it, so it survives the loss of any minority of nodes.
    Quorum,
}

impl QueueType {
    pub fn as_str(self) -> &'static str {
        match self {
            QueueType::Classic => "classic",
            QueueType::Quorum => "quorum",
        }
    }

    /// The arguments this type adds to a queue's declaration; `dead_letters`: the queue
    /// dead-letters (a consumer queue with its DLX).
    fn add_args(self, args: &mut FieldTable, dead_letters: bool) {
        if self == QueueType::Quorum {
            args.insert(ShortString::from("x-queue-type"), AMQPValue::LongString("quorum".into()));
            if dead_letters {
                args.insert(ShortString::from("x-dead-letter-strategy"), AMQPValue::LongString("at-least-once".into()));
                args.insert(ShortString::from("x-overflow"), AMQPValue::LongString("reject-publish".into()));
            }
        }
    }

    /// The declaration arguments of a queue of this type that dead-letters nothing (the DLQ,
    /// the capture queue).
    pub fn plain_args(self) -> FieldTable {
        let mut args = FieldTable::default();
        self.add_args(&mut args, false);
        args
    }
}

impl std::fmt::Display for QueueType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl std::str::FromStr for QueueType {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        match s.trim() {
            "classic" => Ok(QueueType::Classic),
            "quorum" => Ok(QueueType::Quorum),
            other => Err(format!("{other:?} is not a queue type (classic or quorum)")),
        }
    }
}

/// `craig-<service>.events`.
pub fn consumer_queue(service: &str) -> String {
    format!("craig-{service}.events")
}

/// `dlq.<queue>` — the broker-path dead-letter routing key (#1196: keyed by the CONSUMER
/// queue, never the producer).
pub fn dlq_routing_key(queue: &str) -> String {
    format!("dlq.{queue}")
}

/// The arguments every consumer queue is declared with (§D3), with its type's.
pub fn consumer_queue_args(queue: &str, queue_type: QueueType) -> FieldTable {
    let mut args = FieldTable::default();
    queue_type.add_args(&mut args, true);
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
pub async fn declare_exchanges(ch: &Channel, queue_type: QueueType) -> Result<(), lapin::Error> {
    let durable = ExchangeDeclareOptions { durable: true, ..Default::default() };
    for name in [EVENTS_EXCHANGE, DLX_EXCHANGE] {
        ch.exchange_declare(name.into(), ExchangeKind::Topic, durable, FieldTable::default()).await?;
    }
    declare_dlq(ch, queue_type).await
}

/// The operator's part of a deploy on `amqp_url` (its credential): connect,
/// [`declare_exchanges`], close. Bounded: 10 s to connect to each endpoint, 10 s to declare.
pub async fn deploy_operator_part(amqp_url: &str, queue_type: QueueType) -> Result<(), lapin::Error> {
    use std::time::Duration;
    let conn = crate::publisher::connect_within(amqp_url, 0, "craig-operator", Duration::from_secs(10)).await?;
    let declared = tokio::time::timeout(Duration::from_secs(10), async { declare_exchanges(&conn.create_channel().await?, queue_type).await }).await;
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
pub async fn declare_dlq(ch: &Channel, queue_type: QueueType) -> Result<(), lapin::Error> {
    let q = QueueDeclareOptions { durable: true, ..Default::default() };
    ch.queue_declare(DLQ_QUEUE.into(), q, queue_type.plain_args()).await?;
    ch.queue_bind(DLQ_QUEUE.into(), DLX_EXCHANGE.into(), "dlq.#".into(), QueueBindOptions::default(), FieldTable::default())
        .await
}

/// How a consumer queue is declared. `with_dlx = false` reproduces compat mode `pre-d3`.
#[derive(Debug, Clone)]
pub struct QueueSpec {
    pub queue: String,
    pub bindings: Vec<String>,
    pub with_dlx: bool,
    pub queue_type: QueueType,
}

/// Declare a consumer queue and bind it to `craig.events` for each routing key; the
/// exchanges must exist (operator-owned, #1202).
pub async fn declare_consumer_queue(ch: &Channel, spec: &QueueSpec) -> Result<(), lapin::Error> {
    require_exchanges(ch).await?;
    let args = if spec.with_dlx { consumer_queue_args(&spec.queue, spec.queue_type) } else { spec.queue_type.plain_args() };
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
        let args = consumer_queue_args("craig-rules.events", QueueType::Classic);
        let inner = args.inner();
        assert_eq!(inner.len(), 2, "a classic queue has the ADR's two arguments only");
        assert_eq!(
            inner.get("x-dead-letter-exchange"),
            Some(&AMQPValue::LongString("craig.dlx".into()))
        );
        assert_eq!(
            inner.get("x-dead-letter-routing-key"),
            Some(&AMQPValue::LongString("dlq.craig-rules.events".into()))
        );
    }

    #[test]
    fn a_quorum_queue_dead_letters_at_least_once() {
        let args = consumer_queue_args("craig-rules.events", QueueType::Quorum);
        let get = |k: &str| args.inner().get(k).cloned();
        let s = |v: &str| Some(AMQPValue::LongString(v.into()));
        assert_eq!(get("x-queue-type"), s("quorum"));
        assert_eq!(get("x-dead-letter-exchange"), s("craig.dlx"));
        assert_eq!(get("x-dead-letter-routing-key"), s("dlq.craig-rules.events"));
        assert_eq!(get("x-dead-letter-strategy"), s("at-least-once"));
        assert_eq!(get("x-overflow"), s("reject-publish"), "at-least-once needs reject-publish");
        assert_eq!(get("x-delivery-limit"), None, "the inbox's retry cap surfaces poison, not the broker");
        let plain = QueueType::Quorum.plain_args();
        assert_eq!((plain.inner().len(), plain.inner().get("x-queue-type").cloned()), (1, s("quorum")));
        assert!(QueueType::Classic.plain_args().inner().is_empty());
        assert_eq!(("quorum".parse(), " classic ".parse()), (Ok(QueueType::Quorum), Ok(QueueType::Classic)));
        assert!("mirrored".parse::<QueueType>().unwrap_err().contains("classic or quorum"));
    }
}
