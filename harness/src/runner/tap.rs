//! The dead-letter tap: the harness's own record of what reached `craig.dlx` (§D3), to hold
//! the audit against. A durable queue `chaos.dead-letter-tap` bound `dlq.#` gets a copy of
//! every dead letter the broker or an app path routes there (a topic exchange copies to
//! every bound queue; the DLQ's own copy and the security service are untouched). Durable,
//! so a broker restart mid-run does not lose the copies, and on a broker cluster a quorum
//! queue whatever the fleet's queue type, so a node's disk loss does not either (the
//! harness's record is never on the weaker queue the run may be testing); read and deleted
//! at the end.

use std::time::Duration;

use lapin::options::{BasicGetOptions, ExchangeDeclareOptions, QueueBindOptions, QueueDeclareOptions, QueueDeleteOptions};
use lapin::types::FieldTable;

use super::Log;
use crate::history::{Event, dead_letter_key};

pub(super) const TAP_QUEUE: &str = "chaos.dead-letter-tap";

/// Declare the tap once the fleet has declared `craig.dlx` (never declared here: the
/// harness does not create topology a deployment would lack). Bounded.
pub(super) async fn open(amqp_url: &str, within: Duration, replicated: bool) -> anyhow::Result<()> {
    retry_within(within, craig_mq::topology::DLX_EXCHANGE, "dead-letter", || try_open(amqp_url, replicated)).await
}

/// Try `attempt` (each bounded by 5 s) every 200 ms until it succeeds or `within` is up; the
/// error names the tap, the exchange and the last failure.
async fn retry_within<F, Fut>(within: Duration, exchange: &str, tap: &str, attempt: F) -> anyhow::Result<()>
where
    F: Fn() -> Fut,
    Fut: std::future::Future<Output = Result<(), String>>,
{
    let deadline = tokio::time::Instant::now() + within;
    let mut last = String::new();
    while tokio::time::Instant::now() < deadline {
        match tokio::time::timeout(Duration::from_secs(5), attempt()).await {
            Ok(Ok(())) => return Ok(()),
            Ok(Err(e)) => last = e,
            Err(_) => last = "no answer within 5 s".into(),
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    anyhow::bail!("the {tap} tap could not bind to {exchange} within {within:?}: {last}")
}

async fn try_open(amqp_url: &str, replicated: bool) -> Result<(), String> {
    let conn = craig_mq::publisher::connect(amqp_url, 5, "chaos-dead-letter-tap").await.map_err(|e| e.to_string())?;
    let result = async {
        let ch = conn.create_channel().await.map_err(|e| e.to_string())?;
        let durable = QueueDeclareOptions { durable: true, ..Default::default() };
        let args = if replicated { craig_mq::topology::QueueType::Quorum } else { craig_mq::topology::QueueType::Classic }.plain_args();
        bind_on_dlx(&ch, TAP_QUEUE, durable, args, "dlq.#").await.map(drop)
    }
    .await;
    let _ = tokio::time::timeout(Duration::from_secs(2), conn.close(200, "tap".into())).await;
    result
}

/// A harness queue on `craig.dlx`: check that the exchange is there (passive: the harness
/// never creates topology a deployment would lack), declare `queue` with `opts` (`""` for a
/// server-named one) and bind it with `key`. Its name.
pub(super) async fn bind_on_dlx(ch: &lapin::Channel, queue: &str, opts: QueueDeclareOptions, args: FieldTable, key: &str) -> Result<String, String> {
    use craig_mq::topology::DLX_EXCHANGE;
    let passive = ExchangeDeclareOptions { passive: true, ..Default::default() };
    ch.exchange_declare(DLX_EXCHANGE.into(), lapin::ExchangeKind::Topic, passive, FieldTable::default())
        .await
        .map_err(|e| format!("{DLX_EXCHANGE} is not there: {e}"))?;
    let name = ch.queue_declare(queue.into(), opts, args).await.map_err(|e| e.to_string())?.name().to_string();
    ch.queue_bind(name.as_str().into(), DLX_EXCHANGE.into(), key.into(), QueueBindOptions::default(), FieldTable::default())
        .await
        .map_err(|e| e.to_string())?;
    Ok(name)
}

/// Take every copy off the tap into the history (one `DeadLettered` each, read as the DLQ
/// consumer reads it), then delete the tap. Bounded; the count taken.
pub(super) async fn read(amqp_url: &str, log: &Log) -> anyhow::Result<usize> {
    take_all(amqp_url, TAP_QUEUE, "dead-letter", |d| {
        let read = craig_mq::dlq::DeadLetterDelivery::read(&d.data, d.routing_key.as_str(), d.properties.headers().as_ref());
        let event = Event::DeadLettered {
            key: dead_letter_key(d.routing_key.as_str(), &d.data),
            // The occurrence by the harness's own derivation (issue 22.5).
            token: occurrence_token(&d.data, d.routing_key.as_str(), d.properties.headers().as_ref()),
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
    })
    .await
}

/// Every message of the harness's queue `queue` handed to `each`, then the queue deleted.
/// Bounded by 30 s; the count taken.
async fn take_all(amqp_url: &str, queue: &str, tap: &str, mut each: impl FnMut(&lapin::message::Delivery)) -> anyhow::Result<usize> {
    let work = async {
        let conn = craig_mq::publisher::connect(amqp_url, 5, &format!("chaos-{tap}-tap")).await?;
        let ch = conn.create_channel().await?;
        let mut n = 0;
        while let Some(m) = ch.basic_get(queue.into(), BasicGetOptions { no_ack: true }).await? {
            each(&m.delivery);
            n += 1;
        }
        ch.queue_delete(queue.into(), QueueDeleteOptions::default()).await?;
        let _ = tokio::time::timeout(Duration::from_secs(2), conn.close(200, "tap".into())).await;
        Ok::<usize, lapin::Error>(n)
    };
    match tokio::time::timeout(Duration::from_secs(30), work).await {
        Ok(r) => Ok(r?),
        Err(_) => anyhow::bail!("reading the {tap} tap took over 30 s"),
    }
}

/// The evaluations tap (issue 26, rules' side): the harness's own copy of every
/// `rule.evaluated` rules published, so that an evaluation the database later forgets (an
/// asynchronous failover) is still on record. A durable queue bound on `craig.events` with
/// `rule.evaluated` only. Opened only where the run deployed the topology first: security's
/// wildcard queue then routes every `rule.evaluated` from the start, so the tap makes no
/// publish routable that was not (the world is never kinder than production).
pub(super) const EVALUATIONS_TAP: &str = "chaos.rule-evaluated-tap";

/// Declare the evaluations tap on `craig.events` (checked passively, as the DLX tap's
/// exchange is). Bounded.
pub(super) async fn open_evaluations(amqp_url: &str, within: Duration, replicated: bool) -> anyhow::Result<()> {
    use craig_mq::topology::EVENTS_EXCHANGE;
    let attempt = || async {
        let conn = craig_mq::publisher::connect(amqp_url, 5, "chaos-evaluations-tap").await.map_err(|e| e.to_string())?;
        let result = async {
            let ch = conn.create_channel().await.map_err(|e| e.to_string())?;
            let passive = ExchangeDeclareOptions { passive: true, ..Default::default() };
            ch.exchange_declare(EVENTS_EXCHANGE.into(), lapin::ExchangeKind::Topic, passive, FieldTable::default())
                .await
                .map_err(|e| format!("{EVENTS_EXCHANGE} is not there: {e}"))?;
            let args = if replicated { craig_mq::topology::QueueType::Quorum } else { craig_mq::topology::QueueType::Classic }.plain_args();
            let durable = QueueDeclareOptions { durable: true, ..Default::default() };
            ch.queue_declare(EVALUATIONS_TAP.into(), durable, args).await.map_err(|e| e.to_string())?;
            ch.queue_bind(EVALUATIONS_TAP.into(), EVENTS_EXCHANGE.into(), "rule.evaluated".into(), QueueBindOptions::default(), FieldTable::default())
                .await
                .map_err(|e| e.to_string())
        }
        .await;
        let _ = tokio::time::timeout(Duration::from_secs(2), conn.close(200, "tap".into())).await;
        result
    };
    retry_within(within, EVENTS_EXCHANGE, "evaluations", attempt).await
}

/// Take every copy off the evaluations tap into the history (one `EvaluationPublished`
/// each, at the evaluation's `occurred_at`), then delete it. Bounded; the count taken.
pub(super) async fn read_evaluations(amqp_url: &str, log: &Log) -> anyhow::Result<usize> {
    take_all(amqp_url, EVALUATIONS_TAP, "evaluations", |d| match evaluation_of(&d.data) {
        Some((at, event)) => log.push_at(log.rel(at), event),
        None => log.finding(format!("the evaluations tap holds a rule.evaluated that is no evaluation envelope ({} bytes)", d.data.len())),
    })
    .await
}

/// A tapped `rule.evaluated` as the harness reads it: the envelope (by the envelope's own
/// rule), its `payload.source_envelope` and `payload.referral_id`, and when it occurred
/// (epoch ms).
fn evaluation_of(body: &[u8]) -> Option<(i64, Event)> {
    let env = craig_mq::EventEnvelope::from_slice(body).ok()?;
    if env.event_type != "rule.evaluated" {
        return None;
    }
    let id = |field: &str| env.payload.get(field)?.as_str()?.parse().ok();
    let (source, referral) = (id("source_envelope")?, id("referral_id")?);
    Some((env.occurred_at.timestamp_millis(), Event::EvaluationPublished { envelope: env.id, source, referral }))
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

/// The occurrence a dead letter names, derived by the harness itself from the raw bytes
/// and headers (issue 22.5: never through the DLQ consumer's own parser, so a bug in its
/// token derivation is not shared by the checker), by ADR-022 #1181 as written:
/// - broker path: the LATEST `x-death` entry (`queue`, `reason`, `count`, `time`), when it
///   is well formed and names the queue the delivery was dead-lettered from (`dlq.<queue>`),
///   is `xdeath:{envelope_id}:{queue}:{reason}:{count}:{time}`;
/// - app path (no usable `x-death`): a `_dlx` v1 wrapper's `token`, when it is
///   `dlxcap:{envelope_id}:{original_queue}:{micros}` of the envelope it carries;
/// - a token is at most 256 bytes of ASCII graphic characters; anything else is no token.
pub(crate) fn occurrence_token(body: &[u8], routing_key: &str, headers: Option<&lapin::types::FieldTable>) -> Option<String> {
    use lapin::types::AMQPValue;
    const REASONS: [&str; 4] = ["rejected", "expired", "maxlen", "delivery_limit"];
    let bounded = |t: String| (t.len() <= 256 && t.bytes().all(|b| b.is_ascii_graphic())).then_some(t);
    let text = |v: Option<&AMQPValue>| match v? {
        AMQPValue::LongString(s) => String::from_utf8(s.as_bytes().to_vec()).ok(),
        AMQPValue::ShortString(s) => Some(s.as_str().to_owned()),
        _ => None,
    };
    let value: Option<serde_json::Value> = serde_json::from_slice(body).ok();
    let wrapper = value.as_ref().and_then(|v| v.get("_dlx"));
    // The envelope carried: the wrapper's (version 1 only) or the body itself, valid as an
    // envelope; its id.
    let envelope = match wrapper {
        Some(w) if w.get("v").and_then(|v| v.as_u64()) == Some(1) => w.get("envelope").cloned(),
        Some(_) => None,
        None => value.clone(),
    }
    .and_then(|e| craig_mq::EventEnvelope::from_value(e).ok());
    let routed_from = routing_key.strip_prefix("dlq.").filter(|q| !q.is_empty());
    let death = headers.and_then(|h| h.inner().get("x-death")).and_then(|x| {
        let AMQPValue::FieldArray(entries) = x else { return None };
        let AMQPValue::FieldTable(latest) = entries.as_slice().first()? else { return None };
        let f = |k: &str| latest.inner().get(k);
        let count: i64 = match f("count")? {
            AMQPValue::LongLongInt(n) => *n,
            AMQPValue::LongInt(n) => i64::from(*n),
            AMQPValue::LongUInt(n) => i64::from(*n),
            AMQPValue::ShortInt(n) => i64::from(*n),
            AMQPValue::ShortUInt(n) => i64::from(*n),
            AMQPValue::ShortShortInt(n) => i64::from(*n),
            AMQPValue::ShortShortUInt(n) => i64::from(*n),
            _ => return None,
        };
        let AMQPValue::Timestamp(time) = f("time")? else { return None };
        let ok = (1..=1_000_000_000).contains(&count) && *time <= i64::MAX as u64 / 1_000_000;
        ok.then_some((text(f("queue"))?, text(f("reason"))?, count, *time))
    });
    if let Some((queue, reason, count, time)) = death {
        // A usable history outranks any wrapper; one of another queue names no occurrence.
        if routed_from != Some(queue.as_str()) || !REASONS.contains(&reason.as_str()) || queue.is_empty() {
            return None;
        }
        let env = envelope?;
        return bounded(format!("xdeath:{}:{queue}:{reason}:{count}:{time}", env.id));
    }
    let w = wrapper?;
    let keys: std::collections::BTreeSet<&str> = w.as_object()?.keys().map(String::as_str).collect();
    let expected: std::collections::BTreeSet<&str> =
        ["v", "token", "original_queue", "source_service", "surfaced_at", "reason", "envelope"].into_iter().collect();
    if keys != expected || chrono::DateTime::parse_from_rfc3339(w.get("surfaced_at")?.as_str()?).is_err() {
        return None;
    }
    let (env, queue, token) = (envelope?, w.get("original_queue")?.as_str()?, w.get("token")?.as_str()?);
    for field in ["source_service", "reason"] {
        w.get(field)?.as_str()?;
    }
    let micros = token.strip_prefix(&format!("dlxcap:{}:{queue}:", env.id))?;
    let canonical = micros.parse::<i64>().is_ok_and(|n| n >= 0 && n.to_string() == micros);
    (canonical && !queue.is_empty()).then(|| bounded(token.to_owned())).flatten()
}

/// The event type of a dead letter by the harness's own reading (issue 22.4): the
/// envelope's `event_type` (inside an app-path `_dlx` wrapper or bare), else the routing key
/// it was first published with (the oldest `x-death` entry's first `routing-keys`; CONTRACT:
/// routing key = event type).
fn tapped_event_type(body: &[u8], headers: Option<&lapin::types::FieldTable>) -> Option<String> {
    use lapin::types::AMQPValue;
    // A body that is an envelope (inside a wrapper or bare) by the envelope's own rule.
    let from_body = serde_json::from_slice::<serde_json::Value>(body).ok().and_then(|v| {
        let env = v.get("_dlx").and_then(|w| w.get("envelope")).cloned().unwrap_or(v);
        craig_mq::EventEnvelope::from_value(env).ok().map(|e| e.event_type)
    });
    from_body.or_else(|| {
        let AMQPValue::FieldArray(entries) = headers?.inner().get("x-death")? else { return None };
        let AMQPValue::FieldTable(oldest) = entries.as_slice().last()? else { return None };
        let text = |v: &AMQPValue| match v {
            AMQPValue::LongString(k) => String::from_utf8(k.as_bytes().to_vec()).ok(),
            AMQPValue::ShortString(k) => Some(k.as_str().to_owned()),
            _ => None,
        };
        // First published through craig.events, under a key that is an event type.
        if text(oldest.inner().get("exchange")?)? != craig_mq::topology::EVENTS_EXCHANGE {
            return None;
        }
        let AMQPValue::FieldArray(keys) = oldest.inner().get("routing-keys")? else { return None };
        text(keys.as_slice().first()?).filter(|k| craig_mq::envelope::is_event_type(k))
    })
}

#[cfg(test)]
mod tests {
    use super::{died_epoch_ms, occurrence_token, tapped_event_type};
    use serde_json::Value;

    /// A typed AMQP value from the fixture notation (`{"S": "text"}`, `{"l": 1}`, …).
    fn amqp(v: &Value) -> AMQPValue {
        let (kind, inner) = v.as_object().and_then(|o| o.iter().next()).expect("typed value");
        match kind.as_str() {
            "S" => AMQPValue::LongString(inner.as_str().unwrap().into()),
            "Sx" => AMQPValue::LongString(lapin::types::LongString::from(hex(inner.as_str().unwrap()))),
            "l" => AMQPValue::LongLongInt(inner.as_i64().unwrap()),
            "T" => AMQPValue::Timestamp(inner.as_u64().unwrap()),
            "t" => AMQPValue::Boolean(inner.as_bool().unwrap()),
            "A" => AMQPValue::FieldArray(inner.as_array().unwrap().iter().map(amqp).collect::<Vec<_>>().into()),
            "F" => {
                let mut t = FieldTable::default();
                for (k, v) in inner.as_object().unwrap() {
                    t.insert(k.as_str().into(), amqp(v));
                }
                AMQPValue::FieldTable(t)
            }
            other => panic!("unknown AMQP type tag {other}"),
        }
    }

    fn hex(s: &str) -> Vec<u8> {
        (0..s.len()).step_by(2).map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap()).collect()
    }

    const Q: &str = "craig-rules.events";
    const RK: &str = "dlq.craig-rules.events";

    fn fixture_body(spec: &Value, env: &craig_mq::EventEnvelope) -> Vec<u8> {
        if let Some(t) = spec.get("text") {
            return t.as_str().unwrap().as_bytes().to_vec();
        }
        if let Some(h) = spec.get("hex") {
            return hex(h.as_str().unwrap());
        }
        let mut env = env.clone();
        if let Some(over) = spec.get("envelope") {
            if let Some(p) = over.get("payload") {
                env.payload = p.clone();
            }
            return serde_json::to_vec(&env).unwrap();
        }
        let over = spec.get("wrapper").expect("text, hex, envelope or wrapper");
        let token = craig_mq::dlq::OccurrenceToken::dlxcap(env.id, Q, chrono::Utc::now()).unwrap();
        let mut w = serde_json::to_value(craig_mq::dlq::DlxWrapper::new(&token, Q, "retry cap", env.clone())).unwrap();
        for (k, v) in over.as_object().unwrap() {
            let v = match v.as_str() {
                Some(s) => Value::String(s.replace("{id}", &env.id.to_string()).replace("{q}", Q)),
                None => v.clone(),
            };
            w["_dlx"][k] = v;
        }
        serde_json::to_vec(&w).unwrap()
    }

    /// Issue 22.5: the harness derives each occurrence itself, and agrees with the DLQ
    /// consumer's library over every fixture under `fixtures/dead-letters/` (and on a repeat
    /// death, which is another occurrence).
    #[test]
    fn the_harness_derives_occurrences_as_the_library_does_over_the_fixtures() {
        let text = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../fixtures/dead-letters/hostile.json")).unwrap();
        let cases: Value = serde_json::from_str(&text).unwrap();
        let mut checked = 0;
        for case in cases["cases"].as_array().unwrap() {
            let env = craig_mq::EventEnvelope::new("case.referral_created", "cases", None, serde_json::json!({ "k": 1 })).unwrap();
            let body = fixture_body(&case["body"], &env);
            let headers = (!case["x_death"].is_null()).then(|| {
                let mut h = FieldTable::default();
                h.insert("x-death".into(), amqp(&case["x_death"]));
                h
            });
            let library = craig_mq::dlq::DeadLetterDelivery::read(&body, RK, headers.as_ref()).token.map(|t| t.into_string());
            assert_eq!(occurrence_token(&body, RK, headers.as_ref()), library, "{}", case["name"]);
            checked += 1;
        }
        assert!(checked >= 20, "{checked} fixtures");
        // A second death of one envelope is a second occurrence.
        let env = craig_mq::EventEnvelope::new("case.referral_created", "cases", None, serde_json::json!({})).unwrap();
        let death = |count: i64, time: u64| {
            let mut e = FieldTable::default();
            e.insert("queue".into(), AMQPValue::LongString(Q.into()));
            e.insert("reason".into(), AMQPValue::LongString("rejected".into()));
            e.insert("count".into(), AMQPValue::LongLongInt(count));
            e.insert("time".into(), AMQPValue::Timestamp(time));
            let mut h = FieldTable::default();
            h.insert("x-death".into(), AMQPValue::FieldArray(vec![AMQPValue::FieldTable(e)].into()));
            h
        };
        let first = occurrence_token(&env.to_vec(), RK, Some(&death(1, 1_700_000_000)));
        let again = occurrence_token(&env.to_vec(), RK, Some(&death(1, 1_700_000_100)));
        assert_eq!(first, Some(format!("xdeath:{}:{Q}:rejected:1:1700000000", env.id)));
        assert_ne!(first, again, "a replayed envelope that dies again is a new occurrence");
    }

    #[test]
    fn a_dead_letter_is_typed_by_its_envelope_else_its_first_routing_key() {
        let env = craig_mq::EventEnvelope::new("case.referral_created", "cases", None, serde_json::json!({})).unwrap();
        assert_eq!(tapped_event_type(&env.to_vec(), None).as_deref(), Some("case.referral_created"));
        let placement = craig_mq::EventEnvelope::new("placement.activated", "cases", None, serde_json::json!({})).unwrap();
        let wrapped = serde_json::to_vec(&serde_json::json!({ "_dlx": { "envelope": placement } })).unwrap();
        assert_eq!(tapped_event_type(&wrapped, None).as_deref(), Some("placement.activated"));
        let mut first = FieldTable::default();
        first.insert("exchange".into(), AMQPValue::LongString("craig.events".into()));
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
