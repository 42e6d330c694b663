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
            let event = Event::DeadLettered {
                key: dead_letter_key(d.routing_key.as_str(), &d.data),
                token: read.token.map(|t| t.into_string()),
                envelope: read.envelope.map(|e| e.id),
                queue: read.original_queue,
                event_type: tapped_event_type(&d.data, d.properties.headers().as_ref()),
            };
            // Placed at the moment it was dead-lettered (the tap is read at the end), as the
            // broker or the surfacing consumer stamped it; else when it was read.
            match died_epoch_ms(&d.data, d.properties.headers().as_ref()) {
                Some(ms) => log.push_at(log.rel(ms), event),
                None => log.push(event),
            }
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

/// When a dead letter was dead-lettered, read by the harness itself from what travels with
/// it: the latest `x-death` entry's `time` (the broker's stamp, whole seconds) or an app-path
/// wrapper's `_dlx.surfaced_at`. Epoch ms; `None` when neither is readable.
fn died_epoch_ms(body: &[u8], headers: Option<&lapin::types::FieldTable>) -> Option<i64> {
    use lapin::types::AMQPValue;
    if let Some(AMQPValue::FieldArray(entries)) = headers.and_then(|h| h.inner().get("x-death")) {
        if let Some(AMQPValue::FieldTable(latest)) = entries.as_slice().first() {
            if let Some(AMQPValue::Timestamp(secs)) = latest.inner().get("time") {
                return i64::try_from(*secs).ok()?.checked_mul(1000);
            }
        }
    }
    let v: serde_json::Value = serde_json::from_slice(body).ok()?;
    let at = v.get("_dlx")?.get("surfaced_at")?.as_str()?;
    Some(chrono::DateTime::parse_from_rfc3339(at).ok()?.timestamp_millis())
}

/// The event type of a dead letter by the harness's own reading (issue 22.4): the
/// envelope's `event_type` (inside an app-path `_dlx` wrapper or bare), else the routing key
/// it was first published with (the oldest `x-death` entry's first `routing-keys`; CONTRACT:
/// routing key = event type).
fn tapped_event_type(body: &[u8], headers: Option<&lapin::types::FieldTable>) -> Option<String> {
    use lapin::types::AMQPValue;
    let from_body = serde_json::from_slice::<serde_json::Value>(body).ok().and_then(|v| {
        let env = v.get("_dlx").and_then(|w| w.get("envelope")).unwrap_or(&v);
        env.get("event_type")?.as_str().filter(|t| !t.is_empty() && env.get("id").is_some()).map(str::to_owned)
    });
    from_body.or_else(|| {
        let AMQPValue::FieldArray(entries) = headers?.inner().get("x-death")? else { return None };
        let AMQPValue::FieldTable(oldest) = entries.as_slice().last()? else { return None };
        let AMQPValue::FieldArray(keys) = oldest.inner().get("routing-keys")? else { return None };
        match keys.as_slice().first()? {
            AMQPValue::LongString(k) => String::from_utf8(k.as_bytes().to_vec()).ok(),
            AMQPValue::ShortString(k) => Some(k.as_str().to_owned()),
            _ => None,
        }
    })
}

#[cfg(test)]
mod tests {
    use super::{died_epoch_ms, tapped_event_type};

    #[test]
    fn a_dead_letter_is_typed_by_its_envelope_else_its_first_routing_key() {
        let env = br#"{"id": "01a2336d-26e6-730b-871a-29bc46d5f956", "event_type": "case.referral_created"}"#;
        assert_eq!(tapped_event_type(env, None).as_deref(), Some("case.referral_created"));
        let wrapped = br#"{"_dlx": {"envelope": {"id": "x", "event_type": "placement.activated"}}}"#;
        assert_eq!(tapped_event_type(wrapped, None).as_deref(), Some("placement.activated"));
        let mut first = FieldTable::default();
        first.insert("routing-keys".into(), AMQPValue::FieldArray(vec![AMQPValue::LongString("case.referral_created".into())].into()));
        let mut later = FieldTable::default();
        later.insert("routing-keys".into(), AMQPValue::FieldArray(vec![AMQPValue::LongString("dlq.craig-rules.events".into())].into()));
        let mut h = FieldTable::default();
        h.insert("x-death".into(), AMQPValue::FieldArray(vec![AMQPValue::FieldTable(later), AMQPValue::FieldTable(first)].into()));
        assert_eq!(tapped_event_type(b"{garbage", Some(&h)).as_deref(), Some("case.referral_created"));
        assert_eq!(tapped_event_type(b"{garbage", None), None);
    }
    use lapin::types::{AMQPValue, FieldTable};

    #[test]
    fn a_dead_letter_is_dated_by_its_latest_death_or_its_surface() {
        let mut entry = FieldTable::default();
        entry.insert("time".into(), AMQPValue::Timestamp(1_700_000_000));
        let mut older = FieldTable::default();
        older.insert("time".into(), AMQPValue::Timestamp(1));
        let mut h = FieldTable::default();
        h.insert("x-death".into(), AMQPValue::FieldArray(vec![AMQPValue::FieldTable(entry), AMQPValue::FieldTable(older)].into()));
        assert_eq!(died_epoch_ms(b"{}", Some(&h)), Some(1_700_000_000_000));
        let wrapped = br#"{"_dlx": {"surfaced_at": "2026-12-01T12:00:00.250Z"}}"#;
        assert_eq!(died_epoch_ms(wrapped, None), Some(1_796_126_400_250));
        assert_eq!(died_epoch_ms(b"garbage", None), None);
    }
}
