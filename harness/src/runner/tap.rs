//! The dead-letter tap: the harness's own record of what reached `craig.dlx` (§D3), to hold
//! the audit against. A durable queue `chaos.dead-letter-tap` bound `dlq.#` gets a copy of
//! every dead letter the broker or an app path routes there (a topic exchange copies to
//! every bound queue; the DLQ's own copy and the security service are untouched). Durable,
//! so a broker restart mid-run does not lose the copies; read and deleted at the end.

use std::time::Duration;

use lapin::options::{BasicGetOptions, ExchangeDeclareOptions, QueueBindOptions, QueueDeclareOptions, QueueDeleteOptions};
use lapin::types::FieldTable;

use super::Log;
use crate::history::{Event, dead_letter_key};

pub(super) const TAP_QUEUE: &str = "chaos.dead-letter-tap";

/// Declare the tap once the fleet has declared `craig.dlx` (never declared here: the
/// harness does not create topology a deployment would lack). Bounded.
pub(super) async fn open(amqp_url: &str, within: Duration) -> anyhow::Result<()> {
    let deadline = tokio::time::Instant::now() + within;
    let mut last = String::new();
    while tokio::time::Instant::now() < deadline {
        match tokio::time::timeout(Duration::from_secs(5), try_open(amqp_url)).await {
            Ok(Ok(())) => return Ok(()),
            Ok(Err(e)) => last = e,
            Err(_) => last = "no answer within 5 s".into(),
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    anyhow::bail!("the dead-letter tap could not bind to {} within {within:?}: {last}", craig_mq::topology::DLX_EXCHANGE)
}

async fn try_open(amqp_url: &str) -> Result<(), String> {
    let conn = craig_mq::publisher::connect(amqp_url, 5, "chaos-dead-letter-tap").await.map_err(|e| e.to_string())?;
    let result = async {
        let ch = conn.create_channel().await.map_err(|e| e.to_string())?;
        let durable = QueueDeclareOptions { durable: true, ..Default::default() };
        bind_on_dlx(&ch, TAP_QUEUE, durable, "dlq.#").await.map(drop)
    }
    .await;
    let _ = tokio::time::timeout(Duration::from_secs(2), conn.close(200, "tap".into())).await;
    result
}

/// A harness queue on `craig.dlx`: check that the exchange is there (passive: the harness
/// never creates topology a deployment would lack), declare `queue` with `opts` (`""` for a
/// server-named one) and bind it with `key`. Its name.
pub(super) async fn bind_on_dlx(ch: &lapin::Channel, queue: &str, opts: QueueDeclareOptions, key: &str) -> Result<String, String> {
    use craig_mq::topology::DLX_EXCHANGE;
    let passive = ExchangeDeclareOptions { passive: true, ..Default::default() };
    ch.exchange_declare(DLX_EXCHANGE.into(), lapin::ExchangeKind::Topic, passive, FieldTable::default())
        .await
        .map_err(|e| format!("{DLX_EXCHANGE} is not there: {e}"))?;
    let name = ch.queue_declare(queue.into(), opts, FieldTable::default()).await.map_err(|e| e.to_string())?.name().to_string();
    ch.queue_bind(name.as_str().into(), DLX_EXCHANGE.into(), key.into(), QueueBindOptions::default(), FieldTable::default())
        .await
        .map_err(|e| e.to_string())?;
    Ok(name)
}

/// Take every copy off the tap into the history (one `DeadLettered` each, read as the DLQ
/// consumer reads it), then delete the tap. Bounded; the count taken.
pub(super) async fn read(amqp_url: &str, log: &Log) -> anyhow::Result<usize> {
    let work = async {
        let conn = craig_mq::publisher::connect(amqp_url, 5, "chaos-dead-letter-tap").await?;
        let ch = conn.create_channel().await?;
        let mut n = 0;
        while let Some(m) = ch.basic_get(TAP_QUEUE.into(), BasicGetOptions { no_ack: true }).await? {
            let d = m.delivery;
            let read =
                craig_mq::dlq::DeadLetterDelivery::read(&d.data, d.routing_key.as_str(), d.properties.headers().as_ref());
            log.push(Event::DeadLettered {
                key: dead_letter_key(d.routing_key.as_str(), &d.data),
                token: read.token.map(|t| t.into_string()),
                envelope: read.envelope.map(|e| e.id),
                queue: read.original_queue,
            });
            n += 1;
        }
        ch.queue_delete(TAP_QUEUE.into(), QueueDeleteOptions::default()).await?;
        let _ = tokio::time::timeout(Duration::from_secs(2), conn.close(200, "tap".into())).await;
        Ok::<usize, lapin::Error>(n)
    };
    match tokio::time::timeout(Duration::from_secs(30), work).await {
        Ok(r) => Ok(r?),
        Err(_) => anyhow::bail!("reading the dead-letter tap took over 30 s"),
    }
}
