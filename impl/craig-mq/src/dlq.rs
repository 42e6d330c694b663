//! Dead letters at the consume boundary — ADR-022 §D3 with #1196 (consumer-queue identity)
//! and #1181 (per-occurrence idempotency).
//!
//! Everything here is pure: it turns what the broker handed over (body bytes, headers,
//! routing key) into a typed [`DeadLetterDelivery`] that the DLQ consumer records. Nothing
//! in it can fail: hostile or malformed input degrades — to a tokenless capture, or to a
//! quarantine of the raw bytes — and never to an error the DLQ loop could ack-and-lose.
//!
//! **Occurrence tokens (#1181).** A dead-lettered occurrence is named by an
//! [`OccurrenceToken`]:
//! - app path (inbox retry cap, `surface_to_dlx`):
//!   `dlxcap:{envelope_id}:{queue}:{received_at}` where `received_at` is the inbox row's
//!   `received_at` in microseconds since the Unix epoch — durable state that exists before
//!   any publish, so a retried surface re-derives the same token. It travels in the
//!   versioned [`DlxWrapper`] (`_dlx`, `v: 1`) with the surface time.
//! - broker path (nack without requeue): `xdeath:{envelope_id}:{queue}:{reason}:{count}:{time}`
//!   from the LATEST `x-death` entry only (`{queue, reason}` is RabbitMQ's compression key);
//!   a latest entry naming another queue than the one the delivery was dead-lettered from
//!   records tokenless; values must be strict UTF-8; the entry's `time` becomes
//!   `occurred_at` only when `count == 1` (a repeat death keeps the FIRST death's time).
//! - a valid `x-death` OUTRANKS the wrapper: an app-wrapped envelope the broker dead-letters
//!   again is a new occurrence.
//!
//! A token is at most [`TOKEN_MAX_BYTES`] bytes of ASCII graphic characters and follows its
//! prefix's grammar; anything else is no token at all (tokenless capture, with the reason
//! kept in [`DeadLetterDelivery::token_note`]).

use std::fmt;
use std::future::Future;
use std::time::Duration;

use chrono::{DateTime, TimeZone, Utc};
use futures_util::StreamExt;
use lapin::options::{
    BasicAckOptions, BasicConsumeOptions, BasicNackOptions, BasicPublishOptions, BasicQosOptions, ConfirmSelectOptions,
    QueueDeclareOptions,
};
use lapin::types::{AMQPValue, FieldTable};
use tokio_util::sync::CancellationToken;
use serde::{Deserialize, Serialize};
use uuid::Uuid;

use crate::envelope::EventEnvelope;
use crate::topology::DLQ_QUEUE;

/// Longest occurrence token accepted (#1181).
pub const TOKEN_MAX_BYTES: usize = 256;

/// The only `_dlx` wrapper version this build reads and writes (#1181).
pub const DLX_WRAPPER_VERSION: u32 = 1;

/// Largest `x-death` count taken into a token: RabbitMQ counts are 64-bit, but a count
/// beyond this is forged or corrupt, not a history.
pub const MAX_XDEATH_COUNT: i64 = 1_000_000_000;

/// Routing-key prefix of every dead letter on `craig.dlx` (§D3: `dlq.<consumer-queue>`).
pub const DLQ_ROUTING_PREFIX: &str = "dlq.";

/// A validated per-occurrence token (#1181): `xdeath:` or `dlxcap:` followed by its
/// grammar, at most [`TOKEN_MAX_BYTES`] bytes, ASCII graphic only.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct OccurrenceToken(String);

/// Why a string is not an [`OccurrenceToken`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TokenError {
    #[error("token is {0} bytes, longer than {TOKEN_MAX_BYTES}")]
    TooLong(usize),
    #[error("token has a byte outside ASCII graphic (0x21..=0x7e) at offset {0}")]
    NotGraphic(usize),
    #[error("token does not start with `xdeath:` or `dlxcap:`")]
    UnknownPrefix,
    #[error("`{prefix}` token is not `{grammar}`")]
    Grammar { prefix: &'static str, grammar: &'static str },
}

const XDEATH_GRAMMAR: &str = "xdeath:{envelope_id}:{queue}:{reason}:{count}:{time}";
const DLXCAP_GRAMMAR: &str = "dlxcap:{envelope_id}:{queue}:{received_at_micros}";

/// The dead-letter reasons RabbitMQ writes into `x-death`.
const XDEATH_REASONS: [&str; 4] = ["rejected", "expired", "maxlen", "delivery_limit"];

impl OccurrenceToken {
    /// Validate a token read from the wire (the `_dlx` wrapper) or built here.
    pub fn parse(s: &str) -> Result<Self, TokenError> {
        if s.len() > TOKEN_MAX_BYTES {
            return Err(TokenError::TooLong(s.len()));
        }
        if let Some(at) = s.bytes().position(|b| !b.is_ascii_graphic()) {
            return Err(TokenError::NotGraphic(at));
        }
        if let Some(rest) = s.strip_prefix("xdeath:") {
            let bad = || TokenError::Grammar { prefix: "xdeath", grammar: XDEATH_GRAMMAR };
            let (id, rest) = split_id(rest).ok_or_else(bad)?;
            let mut tail = rest.rsplitn(4, ':');
            let (time, count, reason, queue) = (tail.next(), tail.next(), tail.next(), tail.next());
            let (Some(time), Some(count), Some(reason), Some(queue)) = (time, count, reason, queue) else {
                return Err(bad());
            };
            let count = canonical_number(count).ok_or_else(bad)?;
            let time_ok = canonical_number(time).is_some();
            if id.is_nil() || queue.is_empty() || !XDEATH_REASONS.contains(&reason) || !(1..=MAX_XDEATH_COUNT).contains(&count) || !time_ok {
                return Err(bad());
            }
            Ok(Self(s.to_owned()))
        } else if let Some(rest) = s.strip_prefix("dlxcap:") {
            let bad = || TokenError::Grammar { prefix: "dlxcap", grammar: DLXCAP_GRAMMAR };
            let (id, rest) = split_id(rest).ok_or_else(bad)?;
            let (queue, micros) = rest.rsplit_once(':').ok_or_else(bad)?;
            let micros_ok = canonical_number(micros).is_some();
            if id.is_nil() || queue.is_empty() || !micros_ok {
                return Err(bad());
            }
            Ok(Self(s.to_owned()))
        } else {
            Err(TokenError::UnknownPrefix)
        }
    }

    /// The app-path token (#1181): derived from the inbox row's `received_at`, never minted
    /// per call, so a retried surface re-derives the same token.
    pub fn dlxcap(envelope_id: Uuid, consumer_queue: &str, inbox_received_at: DateTime<Utc>) -> Result<Self, TokenError> {
        Self::parse(&format!("dlxcap:{envelope_id}:{consumer_queue}:{}", inbox_received_at.timestamp_micros()))
    }

    /// The broker-path token (#1181), from the latest `x-death` entry.
    pub fn xdeath(envelope_id: Uuid, queue: &str, reason: &str, count: i64, time: u64) -> Result<Self, TokenError> {
        Self::parse(&format!("xdeath:{envelope_id}:{queue}:{reason}:{count}:{time}"))
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }

    pub fn into_string(self) -> String {
        self.0
    }
}

impl fmt::Display for OccurrenceToken {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// A non-negative decimal in its one canonical spelling (no sign, no leading zero, fits
/// `i64`): one occurrence, one token — `007` and `+7` would otherwise name `7` again.
fn canonical_number(s: &str) -> Option<i64> {
    let n: i64 = s.parse().ok()?;
    (n >= 0 && n.to_string() == s).then_some(n)
}

/// `{uuid}:{rest}` → (uuid, rest), the UUID in its 36-character hyphenated form.
fn split_id(s: &str) -> Option<(Uuid, &str)> {
    let (id, rest) = (s.get(..36)?, s.get(36..)?);
    let rest = rest.strip_prefix(':')?;
    let parsed = Uuid::try_parse(id).ok()?;
    // Only the canonical lower-case hyphenated form: one occurrence, one spelling.
    (parsed.hyphenated().to_string() == id).then_some((parsed, rest))
}

/// The app-path dead letter's body (CONTRACT § AMQP): `{"_dlx": {…}}`, version 1.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DlxWrapper {
    #[serde(rename = "_dlx")]
    pub dlx: DlxWrapperV1,
}

/// The fields of a `v: 1` wrapper.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DlxWrapperV1 {
    pub v: u32,
    pub token: String,
    /// The CONSUMER queue whose handler gave up (#1196), never the producer.
    pub original_queue: String,
    /// Producer provenance only (#1196).
    pub source_service: String,
    pub surfaced_at: DateTime<Utc>,
    pub reason: String,
    pub envelope: EventEnvelope,
}

impl DlxWrapper {
    pub fn new(token: &OccurrenceToken, original_queue: &str, reason: &str, envelope: EventEnvelope) -> Self {
        Self {
            dlx: DlxWrapperV1 {
                v: DLX_WRAPPER_VERSION,
                token: token.as_str().to_owned(),
                original_queue: original_queue.to_owned(),
                source_service: envelope.source_service.clone(),
                surfaced_at: Utc::now(),
                reason: reason.to_owned(),
                envelope,
            },
        }
    }

    pub fn to_vec(&self) -> Vec<u8> {
        serde_json::to_vec(self).expect("DlxWrapper always serializes")
    }
}

/// Which producer of `craig.dlx` routing keys a dead letter came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum DeadLetterPath {
    /// RabbitMQ dead-lettered it (nack without requeue, expiry, …): it has `x-death`.
    Broker,
    /// The inbox retry cap surfaced it (`surface_to_dlx`): a `_dlx` wrapper.
    App,
    /// Neither: a raw or foreign publish to `craig.dlx`.
    Unknown,
}

impl DeadLetterPath {
    pub fn as_str(self) -> &'static str {
        match self {
            DeadLetterPath::Broker => "broker",
            DeadLetterPath::App => "app",
            DeadLetterPath::Unknown => "unknown",
        }
    }
}

/// One delivery from `craig-security.dlq`, read as far as it can be trusted (#1181: the
/// handler receives this, never raw bytes it must parse itself).
#[derive(Debug, Clone, PartialEq)]
pub struct DeadLetterDelivery {
    /// The body exactly as delivered (kept in the audit row whatever else happens).
    pub raw: Vec<u8>,
    /// The routing key on `craig.dlx` (`dlq.<consumer-queue>`).
    pub routing_key: String,
    pub path: DeadLetterPath,
    /// The consumer queue the occurrence happened on, when known.
    pub original_queue: Option<String>,
    /// The dead-lettered envelope; `None` when the bytes are not one ([`Self::quarantine`]).
    pub envelope: Option<EventEnvelope>,
    pub token: Option<OccurrenceToken>,
    /// When the occurrence happened, when trustworthy (x-death `count == 1`, or the
    /// wrapper's surface time).
    pub occurred_at: Option<DateTime<Utc>>,
    /// Why it was dead-lettered (x-death reason, or the wrapper's).
    pub reason: Option<String>,
    /// Why the body could not be read as an envelope: the row is a quarantine of raw bytes.
    pub quarantine: Option<String>,
    /// Why the occurrence is tokenless although it came with token material.
    pub token_note: Option<String>,
    /// The routing key the dead letter was first published with (the oldest `x-death`
    /// entry's `routing-keys`; CONTRACT: routing key = `event_type`), when it is a valid
    /// event type: the #1156 window's key for a body that is not an envelope.
    pub routed_event_type: Option<String>,
}

impl DeadLetterDelivery {
    /// Read a DLQ delivery. Never fails: see the module doc for what degrades to what.
    pub fn read(raw: &[u8], routing_key: &str, headers: Option<&FieldTable>) -> Self {
        // The queue the delivery was dead-lettered from, as craig.dlx routed it.
        let routed_from = routing_key.strip_prefix(DLQ_ROUTING_PREFIX).filter(|q| !q.is_empty()).map(str::to_owned);
        let mut d = DeadLetterDelivery {
            raw: raw.to_vec(),
            routing_key: routing_key.to_owned(),
            path: DeadLetterPath::Unknown,
            original_queue: routed_from.clone(),
            envelope: None,
            token: None,
            occurred_at: None,
            reason: None,
            quarantine: None,
            token_note: None,
            routed_event_type: None,
        };
        let mut notes: Vec<String> = Vec::new();

        // The body: a `_dlx` wrapper, or a bare envelope.
        let mut wrapper_token = None;
        match serde_json::from_slice::<serde_json::Value>(raw) {
            Err(e) => d.quarantine = Some(format!("body is not JSON: {e}")),
            Ok(serde_json::Value::Object(map)) if map.contains_key("_dlx") => {
                let version = map.get("_dlx").and_then(|w| w.get("v")).and_then(|v| v.as_u64());
                if version != Some(u64::from(DLX_WRAPPER_VERSION)) {
                    d.quarantine = Some(format!("_dlx wrapper version {version:?} is not {DLX_WRAPPER_VERSION}"));
                } else {
                    match serde_json::from_value::<DlxWrapper>(serde_json::Value::Object(map)) {
                        Err(e) => d.quarantine = Some(format!("_dlx wrapper v1 is malformed: {e}")),
                        Ok(w) => match w.dlx.envelope.validate() {
                            Err(e) => d.quarantine = Some(format!("_dlx wrapper's envelope is invalid: {e}")),
                            Ok(()) => {
                                let w = w.dlx;
                                d.path = DeadLetterPath::App;
                                d.reason = Some(w.reason.clone());
                                if d.original_queue.as_deref() != Some(w.original_queue.as_str()) {
                                    notes.push(format!(
                                        "wrapper original_queue {:?} is not the routing key's {:?}",
                                        w.original_queue, d.original_queue
                                    ));
                                }
                                d.original_queue = Some(w.original_queue.clone());
                                match OccurrenceToken::parse(&w.token) {
                                    Ok(t) if token_names(&t, w.envelope.id, &w.original_queue) => {
                                        wrapper_token = Some((t, w.surfaced_at))
                                    }
                                    Ok(_) => notes.push("wrapper token names another envelope or queue".to_owned()),
                                    Err(e) => notes.push(format!("wrapper token rejected: {e}")),
                                }
                                d.envelope = Some(w.envelope);
                            }
                        },
                    }
                }
            }
            Ok(value) => match EventEnvelope::from_value(value) {
                Ok(env) => d.envelope = Some(env),
                Err(e) => d.quarantine = Some(format!("body is not an envelope: {e}")),
            },
        }

        // A VALID x-death outranks the wrapper (#1181); an unusable one is no history at all,
        // so the wrapper's token (if any) still names the occurrence.
        let death = headers.and_then(|h| h.inner().get("x-death")).map(latest_death);
        match &death {
            None | Some(Err(_)) => {
                if let Some(Err(why)) = &death {
                    notes.push(format!("x-death unusable: {why}"));
                    if wrapper_token.is_none() {
                        d.path = DeadLetterPath::Broker;
                    }
                }
                if let Some((t, surfaced_at)) = wrapper_token {
                    d.token = Some(t);
                    d.occurred_at = Some(surfaced_at);
                }
            }
            Some(Ok(death)) => {
                d.path = DeadLetterPath::Broker;
                d.reason = Some(death.reason.clone());
                // Compared with the queue craig.dlx routed it from, never with a
                // wrapper's claim: a wrapped envelope dead-lettered again by the
                // broker is that queue's occurrence (#1181 precedence).
                if routed_from.as_deref() != Some(death.queue.as_str()) {
                    notes.push(format!(
                        "latest x-death names queue {:?}, the delivery was dead-lettered from {:?}",
                        death.queue, routed_from
                    ));
                } else if let Some(env) = &d.envelope {
                    d.original_queue = Some(death.queue.clone());
                    match OccurrenceToken::xdeath(env.id, &death.queue, &death.reason, death.count, death.time) {
                        Ok(t) => {
                            d.token = Some(t);
                            d.occurred_at = (death.count == 1).then(|| Utc.timestamp_opt(death.time as i64, 0).single()).flatten();
                        }
                        Err(e) => notes.push(format!("x-death token rejected: {e}")),
                    }
                }
            }
        }
        // The routed event type (issue 21.2), only from a valid x-death history of the very
        // queue the delivery was dead-lettered from (#1181: never another queue's history).
        if let Some(Ok(death)) = &death {
            if routed_from.as_deref() == Some(death.queue.as_str()) {
                d.routed_event_type = headers.and_then(|h| h.inner().get("x-death")).and_then(first_routing_key);
            }
        }
        if !notes.is_empty() {
            d.token_note = Some(notes.join("; "));
        }
        d
    }

    /// The threshold's key (#1156): the envelope's `event_type`, or, when the body is not an
    /// envelope, the routing key it was first published with (issue 21.2: a burst of
    /// garbage on one stream is exactly the incident the threshold exists for).
    pub fn event_type(&self) -> Option<&str> {
        match &self.envelope {
            Some(e) => Some(e.event_type.as_str()),
            None => self.routed_event_type.as_deref(),
        }
    }
}

/// The first routing key of the OLDEST `x-death` entry (the publish that started the
/// history), when that publish went through `craig.events` and the key is a valid event
/// type by the envelope's own rule ([`crate::envelope::is_event_type`]). Anything else is no
/// event type at all.
fn first_routing_key(xdeath: &AMQPValue) -> Option<String> {
    let AMQPValue::FieldArray(entries) = xdeath else { return None };
    let AMQPValue::FieldTable(oldest) = entries.as_slice().last()? else { return None };
    let via_events = match oldest.inner().get("exchange")? {
        AMQPValue::LongString(s) => s.as_bytes() == crate::topology::EVENTS_EXCHANGE.as_bytes(),
        AMQPValue::ShortString(s) => s.as_str() == crate::topology::EVENTS_EXCHANGE,
        _ => false,
    };
    if !via_events {
        return None;
    }
    let AMQPValue::FieldArray(keys) = oldest.inner().get("routing-keys")? else { return None };
    let key = match keys.as_slice().first()? {
        AMQPValue::LongString(s) => String::from_utf8(s.as_bytes().to_vec()).ok()?,
        AMQPValue::ShortString(s) => s.as_str().to_owned(),
        _ => return None,
    };
    crate::envelope::is_event_type(&key).then_some(key)
}

/// A wrapper's token must name the envelope and queue it travels with; a token that names
/// others is not this occurrence's.
fn token_names(t: &OccurrenceToken, id: Uuid, queue: &str) -> bool {
    t.as_str().strip_prefix("dlxcap:").is_some_and(|rest| {
        rest.strip_prefix(&id.hyphenated().to_string())
            .and_then(|r| r.strip_prefix(':'))
            .and_then(|r| r.rsplit_once(':'))
            .is_some_and(|(q, _)| q == queue)
    })
}

/// The latest `x-death` entry's compression key and history.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Death {
    pub queue: String,
    pub reason: String,
    pub count: i64,
    /// Seconds since the Unix epoch (AMQP timestamps have 1-second resolution).
    pub time: u64,
}

/// Read the LATEST (first) entry of an `x-death` header, strictly.
pub fn latest_death(xdeath: &AMQPValue) -> Result<Death, String> {
    let AMQPValue::FieldArray(entries) = xdeath else {
        return Err("x-death is not an array".to_owned());
    };
    let Some(first) = entries.as_slice().first() else {
        return Err("x-death is empty".to_owned());
    };
    let AMQPValue::FieldTable(entry) = first else {
        return Err("latest x-death entry is not a table".to_owned());
    };
    let field = |k: &str| entry.inner().get(k);
    let text = |k: &str| -> Result<String, String> {
        match field(k) {
            Some(AMQPValue::LongString(s)) => {
                String::from_utf8(s.as_bytes().to_vec()).map_err(|_| format!("x-death {k} is not UTF-8"))
            }
            Some(AMQPValue::ShortString(s)) => Ok(s.as_str().to_owned()),
            Some(other) => Err(format!("x-death {k} is a {:?}, not a string", other.get_type())),
            None => Err(format!("x-death entry has no {k}")),
        }
    };
    let queue = text("queue")?;
    let reason = text("reason")?;
    let count = match field("count") {
        Some(AMQPValue::LongLongInt(n)) => *n,
        Some(AMQPValue::LongInt(n)) => i64::from(*n),
        Some(AMQPValue::LongUInt(n)) => i64::from(*n),
        Some(AMQPValue::ShortInt(n)) => i64::from(*n),
        Some(AMQPValue::ShortUInt(n)) => i64::from(*n),
        Some(AMQPValue::ShortShortInt(n)) => i64::from(*n),
        Some(AMQPValue::ShortShortUInt(n)) => i64::from(*n),
        Some(other) => return Err(format!("x-death count is a {:?}, not an integer", other.get_type())),
        None => return Err("x-death entry has no count".to_owned()),
    };
    if !(1..=MAX_XDEATH_COUNT).contains(&count) {
        return Err(format!("x-death count {count} is out of range 1..={MAX_XDEATH_COUNT}"));
    }
    let time = match field("time") {
        Some(AMQPValue::Timestamp(t)) => *t,
        Some(other) => return Err(format!("x-death time is a {:?}, not a timestamp", other.get_type())),
        None => return Err("x-death entry has no time".to_owned()),
    };
    if time > i64::MAX as u64 / 1_000_000 {
        return Err(format!("x-death time {time} is out of range"));
    }
    Ok(Death { queue, reason, count, time })
}

// ---------------------------------------------------------------------------------------
// The DLQ consume session (#1197)
// ---------------------------------------------------------------------------------------

/// How a DLQ handler failed, as the handler classifies it (#1197).
#[derive(Debug, thiserror::Error)]
pub enum DlqError<E: std::error::Error + 'static> {
    /// Retry in the session (after [`DlqRetryConfig::retry_delay`]), up to
    /// [`DlqRetryConfig::max_attempts`]; then park.
    #[error("transient, retry in session: {0}")]
    TransientRetry(#[source] E),
    /// Park the session for [`DlqRetryConfig::park_delay`] (a database outage), then requeue
    /// the delivery: nothing is acked, nothing is lost. Never counted toward
    /// [`DlqRetryConfig::max_parks`]: an outage is not the delivery's fault (issue 21.1).
    #[error("transient, park: {0}")]
    TransientPark(#[source] E),
    /// Will never succeed: the raw delivery is captured (published with a confirm to
    /// [`CAPTURE_QUEUE`]) and acked only once the broker confirmed the capture.
    #[error("permanent: {0}")]
    Permanent(#[source] E),
}

/// Where a delivery the handler can never record is captured (ADR-059 quarantine).
pub const CAPTURE_QUEUE: &str = "craig-security.dlq.capture";

/// The validated retry policy of [`subscribe_dlq`] (#1197).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DlqRetryConfig {
    max_attempts: u32,
    retry_delay: Duration,
    park_delay: Duration,
    max_parks: u32,
}

/// Why a [`DlqRetryConfig`] was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DlqConfigError {
    #[error("max_attempts must be 1..=100, got {0}")]
    Attempts(u32),
    #[error("retry_delay must be 1 ms..=60 s, got {0:?}")]
    RetryDelay(Duration),
    #[error("park_delay must be at least retry_delay ({retry:?}) and at most 10 min, got {park:?}")]
    ParkDelay { park: Duration, retry: Duration },
    #[error("max_parks must be 1..=10000, got {0}")]
    Parks(u32),
}

impl DlqRetryConfig {
    pub fn new(max_attempts: u32, retry_delay: Duration, park_delay: Duration) -> Result<Self, DlqConfigError> {
        if !(1..=100).contains(&max_attempts) {
            return Err(DlqConfigError::Attempts(max_attempts));
        }
        if retry_delay < Duration::from_millis(1) || retry_delay > Duration::from_secs(60) {
            return Err(DlqConfigError::RetryDelay(retry_delay));
        }
        if park_delay < retry_delay || park_delay > Duration::from_secs(600) {
            return Err(DlqConfigError::ParkDelay { park: park_delay, retry: retry_delay });
        }
        Ok(Self { max_attempts, retry_delay, park_delay, max_parks: DEFAULT_MAX_PARKS })
    }
    /// How many times ONE delivery may park the session, with the database ANSWERING and
    /// refusing it ([`DlqError::TransientRetry`] past its attempts), before it is captured
    /// instead; parks of an unreachable database never count. A delivery that fails
    /// "transiently" forever (a statement timeout on that row, say)
    /// must not hold the healthy dead letters behind it (default [`DEFAULT_MAX_PARKS`]).
    /// Captured is not lost: its raw bytes and the reason wait in [`CAPTURE_QUEUE`].
    pub fn with_max_parks(self, max_parks: u32) -> Result<Self, DlqConfigError> {
        if !(1..=10_000).contains(&max_parks) {
            return Err(DlqConfigError::Parks(max_parks));
        }
        Ok(Self { max_parks, ..self })
    }
    pub fn max_parks(&self) -> u32 {
        self.max_parks
    }
    pub fn max_attempts(&self) -> u32 {
        self.max_attempts
    }
    pub fn retry_delay(&self) -> Duration {
        self.retry_delay
    }
    pub fn park_delay(&self) -> Duration {
        self.park_delay
    }
}

impl Default for DlqRetryConfig {
    fn default() -> Self {
        Self::new(3, Duration::from_millis(200), Duration::from_secs(2)).expect("valid defaults")
    }
}

/// Parks one delivery may cause before it is captured ([`DlqRetryConfig::with_max_parks`]):
/// with the default 2 s park, about a minute of a failure that only this delivery sees.
pub const DEFAULT_MAX_PARKS: u32 = 30;

/// Parks per delivery, kept across sessions (a park requeues the delivery and may end the
/// session): keyed by a hash of routing key and body, bounded.
#[derive(Default)]
struct ParkCounts(std::collections::HashMap<u64, u32>);

/// The identity of one dead-letter delivery's bytes: a digest of its routing key and raw
/// body (SipHash with fixed keys: stable within a build). The park counts key deliveries
/// by it, and the chaos harness keys what its tap saw against the audit rows by it.
pub fn delivery_digest(routing_key: &str, body: &[u8]) -> u64 {
    use std::hash::{Hash, Hasher};
    let mut h = std::collections::hash_map::DefaultHasher::new();
    routing_key.hash(&mut h);
    body.hash(&mut h);
    h.finish()
}

impl ParkCounts {
    const MAX_TRACKED: usize = 4096;

    fn key(dl: &DeadLetterDelivery) -> u64 {
        delivery_digest(&dl.routing_key, &dl.raw)
    }

    /// Count one more park of `dl`; the total so far.
    fn park(&mut self, dl: &DeadLetterDelivery) -> u32 {
        if self.0.len() >= Self::MAX_TRACKED {
            self.0.clear();
        }
        let n = self.0.entry(Self::key(dl)).or_default();
        *n += 1;
        *n
    }

    /// Parks counted so far for `dl` (an uncounted park leaves it as it is).
    fn count(&self, dl: &DeadLetterDelivery) -> u32 {
        self.0.get(&Self::key(dl)).copied().unwrap_or(0)
    }

    fn settled(&mut self, dl: &DeadLetterDelivery) {
        self.0.remove(&Self::key(dl));
    }
}

/// [`subscribe_dlq`]'s settings.
#[derive(Debug, Clone)]
pub struct DlqConsumerConfig {
    pub amqp_url: String,
    pub prefetch: u16,
    pub heartbeat_secs: u16,
    pub reconnect_delay: Duration,
    pub retry: DlqRetryConfig,
    /// Compat `pre-1197`: log a handler failure and ack anyway (the retired posture).
    pub log_and_ack: bool,
    /// The DLQ's and the capture queue's type (`CRAIG_QUEUE_TYPE`, issue 25).
    pub queue_type: crate::topology::QueueType,
}

#[derive(Debug, thiserror::Error)]
enum DlqSessionError {
    #[error(transparent)]
    Session(#[from] crate::subscriber::SessionError),
    #[error("capture publish of a permanently failing dead letter was not confirmed: {0}")]
    Capture(String),
}

impl From<lapin::Error> for DlqSessionError {
    fn from(e: lapin::Error) -> Self {
        Self::Session(e.into())
    }
}

/// Consume `craig-security.dlq` until `shutdown` (§D3 with #1181 and #1197): each delivery is
/// read into a [`DeadLetterDelivery`] and handed to `handler`; acked ONLY after the handler
/// returned `Ok` (its audit row committed) or a capture publish was confirmed. Every
/// ack/nack failure ends the session (its unacked deliveries return to the queue) and a new
/// one starts after `reconnect_delay`. The queue's depth is sampled into `dlq_queue_depth`.
pub async fn subscribe_dlq<H, Fut, E>(cfg: DlqConsumerConfig, handler: H, shutdown: CancellationToken)
where
    H: Fn(DeadLetterDelivery) -> Fut,
    Fut: Future<Output = Result<(), DlqError<E>>>,
    E: std::error::Error + 'static,
{
    let mut parks = ParkCounts::default();
    loop {
        match dlq_session(&cfg, &handler, &mut parks, &shutdown).await {
            Ok(()) => return,
            Err(e) => tracing::warn!(event = "security.dlq.session_ended", queue = DLQ_QUEUE, error = %e),
        }
        tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = tokio::time::sleep(cfg.reconnect_delay) => {}
        }
    }
}

async fn dlq_session<H, Fut, E>(
    cfg: &DlqConsumerConfig,
    handler: &H,
    parks: &mut ParkCounts,
    shutdown: &CancellationToken,
) -> Result<(), DlqSessionError>
where
    H: Fn(DeadLetterDelivery) -> Fut,
    Fut: Future<Output = Result<(), DlqError<E>>>,
    E: std::error::Error + 'static,
{
    use crate::subscriber::SessionError;
    let conn = crate::publisher::connect(&cfg.amqp_url, cfg.heartbeat_secs, DLQ_QUEUE).await?;
    let set_up = async {
        let ch = conn.create_channel().await?;
        // The exchanges are the operator's (#1202); the DLQ is security's own.
        crate::topology::require_exchanges(&ch).await?;
        crate::topology::declare_dlq(&ch, cfg.queue_type).await?;
        let durable = QueueDeclareOptions { durable: true, ..Default::default() };
        ch.queue_declare(CAPTURE_QUEUE.into(), durable, cfg.queue_type.plain_args()).await?;
        let capture = conn.create_channel().await?;
        capture.confirm_select(ConfirmSelectOptions::default()).await?;
        ch.basic_qos(cfg.prefetch, BasicQosOptions::default()).await?;
        let consumer =
            ch.basic_consume(DLQ_QUEUE.into(), "".into(), BasicConsumeOptions::default(), FieldTable::default()).await?;
        // The depth gauge's passive declares get a channel of their own: a declare that
        // fails closes ITS channel, never the one holding the unacked deliveries.
        let gauge = conn.create_channel().await?;
        Ok::<_, lapin::Error>((ch, capture, consumer, gauge))
    };
    let (ch, capture, mut consumer, gauge) = crate::subscriber::bounded_set_up(&conn, set_up).await?;
    tracing::info!(event = "security.dlq.started", queue = DLQ_QUEUE);
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    // A slow handler must not be followed by a burst of catch-up ticks.
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
    let result = loop {
        let next = tokio::select! {
            _ = shutdown.cancelled() => break Ok(()),
            next = consumer.next() => next,
            _ = tick.tick() => {
                if !crate::subscriber::alive(&conn, &ch) {
                    break Err(SessionError::StreamEnded.into());
                }
                if gauge.status().connected() {
                    if let Ok(Ok(n)) = tokio::time::timeout(Duration::from_secs(2), crate::topology::queue_depth(&gauge, DLQ_QUEUE)).await {
                        crate::metrics::dlq_queue_depth(n);
                    }
                }
                continue;
            }
        };
        let delivery = match next {
            Some(Ok(d)) => d,
            Some(Err(e)) => break Err(e.into()),
            None => break Err(SessionError::StreamEnded.into()),
        };
        if let Err(e) = dispatch_dlq(cfg, handler, &capture, delivery, parks, shutdown).await {
            break Err(e);
        }
    };
    let _ = tokio::time::timeout(Duration::from_secs(2), conn.close(200, "bye".into())).await;
    result
}

async fn dispatch_dlq<H, Fut, E>(
    cfg: &DlqConsumerConfig,
    handler: &H,
    capture: &lapin::Channel,
    delivery: lapin::message::Delivery,
    parks: &mut ParkCounts,
    shutdown: &CancellationToken,
) -> Result<(), DlqSessionError>
where
    H: Fn(DeadLetterDelivery) -> Fut,
    Fut: Future<Output = Result<(), DlqError<E>>>,
    E: std::error::Error + 'static,
{
    use crate::subscriber::settled;
    let dl = DeadLetterDelivery::read(&delivery.data, delivery.routing_key.as_str(), delivery.properties.headers().as_ref());
    let mut attempt = 1;
    loop {
        let err = match handler(dl.clone()).await {
            Ok(()) => {
                parks.settled(&dl);
                // #1181's window: the row is committed, the delivery not yet acked.
                crate::crash::hit("dlq::after_record_before_ack");
                settled("ack", delivery.acker.ack(BasicAckOptions::default())).await?;
                return Ok(());
            }
            Err(e) => e,
        };
        if cfg.log_and_ack {
            // Compat pre-1197: the retired log-and-ack posture (a forensic loss).
            // Named by the digest of its bytes (the harness's key for a delivery) and its
            // envelope: the system's own word on which dead letter went unrecorded.
            tracing::warn!(event = "security.dlq.log_and_ack", digest = %format!("{:016x}", delivery_digest(&dl.routing_key, &dl.raw)),
                envelope_id = %dl.envelope.as_ref().map_or_else(|| "-".to_owned(), |e| e.id.to_string()),
                routing_key = %dl.routing_key, error = %err);
            crate::metrics::dlq_outcome("acked_unrecorded");
            settled("ack", delivery.acker.ack(BasicAckOptions::default())).await?;
            return Ok(());
        }
        let (e, answered) = match err {
            DlqError::TransientRetry(e) if attempt < cfg.retry.max_attempts => {
                tracing::warn!(event = "security.dlq.retry", attempt, routing_key = %dl.routing_key, error = %e);
                crate::metrics::dlq_outcome("retried");
                attempt += 1;
                tokio::time::sleep(cfg.retry.retry_delay).await;
                continue;
            }
            // The database answered and still failed this row, attempt after attempt.
            DlqError::TransientRetry(e) => (e, true),
            // The database is unreachable: an outage, not this delivery's fault.
            DlqError::TransientPark(e) => (e, false),
            DlqError::Permanent(e) => {
                capture_delivery(capture, &delivery, &dl, &e.to_string()).await?;
                parks.settled(&dl);
                return Ok(());
            }
        };
        // Issue 21.1 (#1197): only parks the database answered count toward max_parks. An
        // outage parks every delivery alike for as long as it lasts; counting it would move
        // the queued dead letters out of the audit one by one (captured, never recorded).
        let n = if answered { parks.park(&dl) } else { parks.count(&dl) };
        if answered && n > cfg.retry.max_parks {
            // This delivery alone has kept failing for max_parks parks: set it aside so the
            // dead letters behind it are recorded (it is captured, not lost: see
            // [`redrive_capture`]).
            let why = format!("parked {} times without being recorded; last error: {e}", n - 1);
            capture_delivery(capture, &delivery, &dl, &why).await?;
            parks.settled(&dl);
            return Ok(());
        }
        tracing::warn!(event = "security.dlq.parked", attempt, parks = n, counted = answered, routing_key = %dl.routing_key, error = %e,
            park = ?cfg.retry.park_delay, "parking the session; the delivery is requeued, not acked");
        crate::metrics::dlq_outcome("parked");
        tokio::select! {
            _ = shutdown.cancelled() => {}
            _ = tokio::time::sleep(cfg.retry.park_delay) => {}
        }
        settled("nack", delivery.acker.nack(BasicNackOptions { requeue: true, ..Default::default() })).await?;
        return Ok(());
    }
}

/// Publish the raw delivery to [`CAPTURE_QUEUE`] with its reason, and ack it only once the
/// broker confirmed the capture (#1197).
async fn capture_delivery(
    capture: &lapin::Channel,
    delivery: &lapin::message::Delivery,
    dl: &DeadLetterDelivery,
    reason: &str,
) -> Result<(), DlqSessionError> {
    use crate::subscriber::settled;
    tracing::error!(event = "security.dlq.capture", routing_key = %dl.routing_key, reason,
        bytes = dl.raw.len(), "capturing a dead letter that cannot be recorded");
    let mut headers = delivery.properties.headers().clone().unwrap_or_default();
    headers.insert("x-craig-capture-reason".into(), AMQPValue::LongString(reason.into()));
    headers.insert("x-craig-dlq-routing-key".into(), AMQPValue::LongString(dl.routing_key.as_str().into()));
    let props = lapin::BasicProperties::default().with_delivery_mode(2).with_headers(headers);
    let confirm = async {
        capture
            .basic_publish("".into(), CAPTURE_QUEUE.into(), BasicPublishOptions { mandatory: true, immediate: false }, &dl.raw, props)
            .await?
            .await
    };
    match tokio::time::timeout(Duration::from_secs(10), confirm).await {
        Ok(Ok(lapin::Confirmation::Ack(None))) => {}
        other => return Err(DlqSessionError::Capture(format!("{other:?}"))),
    }
    crate::metrics::dlq_outcome("captured");
    settled("ack", delivery.acker.ack(BasicAckOptions::default())).await?;
    Ok(())
}

// ---------------------------------------------------------------------------------------
// The way back from the capture queue (issue 21.1)
// ---------------------------------------------------------------------------------------

/// What one [`redrive_capture`] pass did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RedriveReport {
    /// Captured deliveries the handler took (a new audit row, or absorbed by the occurrence
    /// token it already has): acked off the capture queue.
    pub redriven: u64,
    /// Deliveries the handler still refused while the database answered: put back at the
    /// queue's tail with their bytes and headers, so they never hold up the ones behind.
    pub kept: u64,
    /// The pass stopped because the database is unreachable; the rest wait for the next.
    pub unreachable: bool,
}

/// Why a redrive pass stopped with an error (what it had done is lost with it: nothing is
/// acked that was not recorded or kept).
#[derive(Debug, thiserror::Error)]
pub enum RedriveError {
    #[error("capture redrive: {0}")]
    Amqp(#[from] lapin::Error),
    #[error("capture redrive: putting a refused delivery back was not confirmed: {0}")]
    Keep(String),
}

fn header_text(h: Option<&FieldTable>, key: &str) -> Option<String> {
    match h?.inner().get(key)? {
        AMQPValue::LongString(s) => String::from_utf8(s.as_bytes().to_vec()).ok(),
        AMQPValue::ShortString(s) => Some(s.as_str().to_owned()),
        _ => None,
    }
}

/// One pass over [`CAPTURE_QUEUE`] (issue 21.1: the capture queue is not a dead end): each
/// delivery waiting when the pass began is read back exactly as the DLQ consumer read it
/// (its raw bytes, its original headers with `x-death`, the DLQ routing key it arrived
/// under) and handed to `handler`, the DLQ consumer's own. Recorded (or absorbed by its
/// occurrence token, #1181) → acked and counted `dlq_outcomes_total{outcome="redriven"}`;
/// refused while the database answers → published again at the tail (confirmed) and the
/// original acked (`redrive_kept`); the database unreachable → requeued and the pass ends.
/// Run by the security node every `CRAIG_DLQ_REDRIVE_SECS` and by `craig-node dlq
/// redrive-capture`.
///
/// Bound (as #1181's for tokenless rows): an ack lost after the handler recorded a
/// TOKENLESS delivery, or after a refused one was put back, leaves a second copy, recorded
/// again on a later pass; a tokened occurrence is absorbed by its token.
pub async fn redrive_capture<H, Fut, E>(
    amqp_url: &str,
    heartbeat_secs: u16,
    queue_type: crate::topology::QueueType,
    handler: &H,
    stop: &CancellationToken,
) -> Result<RedriveReport, RedriveError>
where
    H: Fn(DeadLetterDelivery) -> Fut,
    Fut: Future<Output = Result<(), DlqError<E>>>,
    E: std::error::Error + 'static,
{
    let conn = crate::publisher::connect(amqp_url, heartbeat_secs, "craig-security.dlq.redrive").await?;
    let result = redrive_on(&conn, queue_type, handler, stop).await;
    let _ = tokio::time::timeout(Duration::from_secs(2), conn.close(200, "redriven".into())).await;
    result
}

async fn redrive_on<H, Fut, E>(
    conn: &lapin::Connection,
    queue_type: crate::topology::QueueType,
    handler: &H,
    stop: &CancellationToken,
) -> Result<RedriveReport, RedriveError>
where
    H: Fn(DeadLetterDelivery) -> Fut,
    Fut: Future<Output = Result<(), DlqError<E>>>,
    E: std::error::Error + 'static,
{
    use lapin::options::BasicGetOptions;
    let ch = conn.create_channel().await?;
    ch.confirm_select(ConfirmSelectOptions::default()).await?;
    let durable = QueueDeclareOptions { durable: true, ..Default::default() };
    let waiting = ch.queue_declare(CAPTURE_QUEUE.into(), durable, queue_type.plain_args()).await?.message_count();
    let mut report = RedriveReport::default();
    for _ in 0..waiting {
        // A stopping node ends the pass between deliveries; the rest wait for the next one.
        if stop.is_cancelled() {
            break;
        }
        let Some(got) = ch.basic_get(CAPTURE_QUEUE.into(), BasicGetOptions { no_ack: false }).await? else { break };
        let delivery = got.delivery;
        let headers = delivery.properties.headers().clone();
        let routing_key = header_text(headers.as_ref(), "x-craig-dlq-routing-key").unwrap_or_else(|| delivery.routing_key.to_string());
        let dl = DeadLetterDelivery::read(&delivery.data, &routing_key, headers.as_ref());
        match handler(dl).await {
            Ok(()) => {
                delivery.acker.ack(BasicAckOptions::default()).await?;
                crate::metrics::dlq_outcome("redriven");
                report.redriven += 1;
                tracing::info!(event = "security.dlq.redriven", routing_key = %routing_key, bytes = delivery.data.len(),
                    "a captured dead letter is recorded");
            }
            Err(DlqError::TransientPark(e)) => {
                delivery.acker.nack(BasicNackOptions { requeue: true, ..Default::default() }).await?;
                report.unreachable = true;
                tracing::warn!(event = "security.dlq.redrive_paused", error = %e, "the database is unreachable; the capture queue waits");
                break;
            }
            Err(DlqError::TransientRetry(e) | DlqError::Permanent(e)) => {
                let mut h = headers.unwrap_or_default();
                h.insert("x-craig-redrive-error".into(), AMQPValue::LongString(e.to_string().into()));
                let props = lapin::BasicProperties::default().with_delivery_mode(2).with_headers(h);
                let confirm = async {
                    ch.basic_publish("".into(), CAPTURE_QUEUE.into(), BasicPublishOptions { mandatory: true, immediate: false }, &delivery.data, props)
                        .await?
                        .await
                };
                match tokio::time::timeout(Duration::from_secs(10), confirm).await {
                    Ok(Ok(lapin::Confirmation::Ack(None))) => {}
                    other => {
                        let _ = delivery.acker.nack(BasicNackOptions { requeue: true, ..Default::default() }).await;
                        return Err(RedriveError::Keep(format!("{other:?}")));
                    }
                }
                delivery.acker.ack(BasicAckOptions::default()).await?;
                crate::metrics::dlq_outcome("redrive_kept");
                report.kept += 1;
                tracing::warn!(event = "security.dlq.redrive_kept", routing_key = %routing_key, error = %e,
                    "a captured dead letter is still refused; kept in the capture queue");
            }
        }
    }
    let _ = ch.close(200, "redriven".into()).await;
    Ok(report)
}

#[cfg(test)]
mod tests {
    use super::*;
    use lapin::types::{FieldArray, LongString, ShortString};

    fn env() -> EventEnvelope {
        EventEnvelope::new("case.referral_created", "cases", None, serde_json::json!({"k": 1})).unwrap()
    }

    fn death(queue: &[u8], reason: &str, count: AMQPValue, time: AMQPValue) -> AMQPValue {
        let mut t = FieldTable::default();
        t.insert(ShortString::from("queue"), AMQPValue::LongString(LongString::from(queue.to_vec())));
        t.insert(ShortString::from("reason"), AMQPValue::LongString(reason.into()));
        t.insert(ShortString::from("count"), count);
        t.insert(ShortString::from("time"), time);
        t.insert(ShortString::from("exchange"), AMQPValue::LongString("craig.events".into()));
        AMQPValue::FieldTable(t)
    }

    fn headers(entries: Vec<AMQPValue>) -> FieldTable {
        let mut h = FieldTable::default();
        h.insert(ShortString::from("x-death"), AMQPValue::FieldArray(FieldArray::from(entries)));
        h
    }

    const Q: &str = "craig-rules.events";
    const RK: &str = "dlq.craig-rules.events";

    #[test]
    fn token_grammar() {
        let id = Uuid::now_v7();
        let t = OccurrenceToken::xdeath(id, Q, "rejected", 1, 1_700_000_000).unwrap();
        assert_eq!(t.as_str(), format!("xdeath:{id}:{Q}:rejected:1:1700000000"));
        assert_eq!(OccurrenceToken::parse(t.as_str()).unwrap(), t);
        let at = Utc.timestamp_micros(1_700_000_000_123_456).unwrap();
        let c = OccurrenceToken::dlxcap(id, Q, at).unwrap();
        assert_eq!(c.as_str(), format!("dlxcap:{id}:{Q}:1700000000123456"));
        // A queue name may itself hold colons; the grammar splits from both ends.
        assert!(OccurrenceToken::xdeath(id, "a:b", "expired", 3, 5).is_ok());
        assert!(OccurrenceToken::dlxcap(id, "a:b", at).is_ok());

        for bad in [
            String::new(),
            "xdeath:".to_owned(),
            format!("xdeath:{id}:{Q}:exploded:1:1"),
            format!("xdeath:{id}:{Q}:rejected:0:1"),
            format!("xdeath:{id}:{Q}:rejected:-1:1"),
            format!("xdeath:{id}:{Q}:rejected:1:-5"),
            format!("xdeath:{id}::rejected:1:1"),
            format!("xdeath:{}:{Q}:rejected:1:1", Uuid::nil()),
            format!("xdeath:{}:{Q}:rejected:1:1", id.simple()),
            format!("dlxcap:{id}:{Q}"),
            format!("dlxcap:{id}:{Q}:+5"),
            format!("dlxcap:{id}:{Q}:1.5"),
            // One occurrence, one spelling: no leading zeros.
            format!("dlxcap:{id}:{Q}:0017"),
            format!("xdeath:{id}:{Q}:rejected:01:1"),
            format!("xdeath:{id}:{Q}:rejected:1:0017"),
            format!("other:{id}:{Q}:1"),
            format!("xdeath:{id}:{Q} x:rejected:1:1"),
            format!("xdeath:{id}:{Q}\u{e9}:rejected:1:1"),
            format!("xdeath:{id}:{}:rejected:1:1", "q".repeat(300)),
        ] {
            assert!(OccurrenceToken::parse(&bad).is_err(), "accepted {bad:?}");
        }
        assert_eq!(OccurrenceToken::parse(&"x".repeat(257)), Err(TokenError::TooLong(257)));
        assert_eq!(OccurrenceToken::parse("xdeath:\u{7f}"), Err(TokenError::NotGraphic(7)));
    }

    /// Issue 22.10, shard 3/50's survivor `replace > with >= in OccurrenceToken::parse`: a
    /// token of exactly [`TOKEN_MAX_BYTES`] bytes is a token; one byte more is not.
    #[test]
    fn a_token_of_exactly_the_limit_is_accepted_and_one_byte_more_refused() {
        let id = Uuid::now_v7();
        let fixed = format!("xdeath:{id}::rejected:1:1700000000").len();
        let queue = "q".repeat(TOKEN_MAX_BYTES - fixed);
        let at_limit = format!("xdeath:{id}:{queue}:rejected:1:1700000000");
        assert_eq!(at_limit.len(), TOKEN_MAX_BYTES);
        assert_eq!(OccurrenceToken::parse(&at_limit).map(|t| t.as_str().len()), Ok(TOKEN_MAX_BYTES));
        let over = format!("xdeath:{id}:{queue}q:rejected:1:1700000000");
        assert_eq!(OccurrenceToken::parse(&over), Err(TokenError::TooLong(TOKEN_MAX_BYTES + 1)));
    }

    /// Issue 22.10, shard 3/50's survivor `replace first_routing_key -> Option<String> with
    /// None`: a dead letter whose body is no envelope takes its #1156 threshold key from the
    /// routing key its OLDEST x-death entry was published with through `craig.events`;
    /// through another exchange, or with a key that is no event type, it has none.
    #[test]
    fn an_unreadable_dead_letter_is_keyed_by_the_routing_key_it_was_first_published_with() {
        let first_publish = |exchange: &str, key: &str| {
            let AMQPValue::FieldTable(mut t) = death(b"craig-financial.events", "expired", AMQPValue::LongLongInt(1), AMQPValue::Timestamp(1)) else {
                unreachable!("death is a table")
            };
            t.insert(ShortString::from("exchange"), AMQPValue::LongString(exchange.into()));
            t.insert(ShortString::from("routing-keys"), AMQPValue::FieldArray(vec![AMQPValue::LongString(key.into())].into()));
            AMQPValue::FieldTable(t)
        };
        let read = |oldest: AMQPValue| {
            let latest = death(Q.as_bytes(), "rejected", AMQPValue::LongLongInt(1), AMQPValue::Timestamp(1_700_000_000));
            DeadLetterDelivery::read(b"{not json", RK, Some(&headers(vec![latest, oldest])))
        };
        let d = read(first_publish("craig.events", "case.referral_created"));
        assert_eq!((d.envelope.is_none(), d.event_type()), (true, Some("case.referral_created")));
        assert_eq!(read(first_publish("amq.direct", "case.referral_created")).event_type(), None);
        assert_eq!(read(first_publish("craig.events", "not an event type!")).event_type(), None);
    }

    #[test]
    fn a_broker_dead_letter_is_tokened_from_its_latest_death() {
        let e = env();
        let h = headers(vec![
            death(Q.as_bytes(), "rejected", AMQPValue::LongLongInt(1), AMQPValue::Timestamp(1_700_000_000)),
            death(b"other.queue", "expired", AMQPValue::LongLongInt(4), AMQPValue::Timestamp(1)),
        ]);
        let d = DeadLetterDelivery::read(&e.to_vec(), RK, Some(&h));
        assert_eq!(d.path, DeadLetterPath::Broker);
        assert_eq!(d.token.as_ref().unwrap().as_str(), format!("xdeath:{}:{Q}:rejected:1:1700000000", e.id));
        assert_eq!(d.occurred_at, Utc.timestamp_opt(1_700_000_000, 0).single());
        assert_eq!(d.original_queue.as_deref(), Some(Q));
        assert_eq!(d.envelope.as_ref(), Some(&e));
        assert_eq!(d.quarantine, None);
        assert_eq!(d.token_note, None);

        // A repeat death: tokened by its count, but its time is the FIRST death's.
        let h = headers(vec![death(Q.as_bytes(), "rejected", AMQPValue::LongLongInt(3), AMQPValue::Timestamp(1_700_000_000))]);
        let d = DeadLetterDelivery::read(&e.to_vec(), RK, Some(&h));
        assert!(d.token.as_ref().unwrap().as_str().ends_with(":rejected:3:1700000000"));
        assert_eq!(d.occurred_at, None);
    }

    #[test]
    fn x_death_outranks_the_wrapper() {
        let e = env();
        let at = Utc::now();
        let token = OccurrenceToken::dlxcap(e.id, Q, at).unwrap();
        let body = DlxWrapper::new(&token, Q, "retry cap", e.clone()).to_vec();
        let d = DeadLetterDelivery::read(&body, RK, None);
        assert_eq!((d.path, d.token.as_ref()), (DeadLetterPath::App, Some(&token)));
        assert!(d.occurred_at.is_some());
        assert_eq!(d.envelope.as_ref(), Some(&e));

        let h = headers(vec![death(Q.as_bytes(), "rejected", AMQPValue::LongLongInt(1), AMQPValue::Timestamp(1_700_000_000))]);
        let d = DeadLetterDelivery::read(&body, RK, Some(&h));
        assert_eq!(d.path, DeadLetterPath::Broker);
        assert!(d.token.as_ref().unwrap().as_str().starts_with("xdeath:"));
    }

    /// Audit finding: the broker dead-letters a wrapped envelope again from the queue the
    /// routing key names, while the wrapper claims another: the x-death is compared with the
    /// routed queue (not the wrapper's claim), and that queue becomes the row's.
    #[test]
    fn a_re_dead_lettered_wrapper_is_the_routed_queues_occurrence() {
        let e = env();
        let earlier = "craig-financial.events";
        let body = DlxWrapper::new(&OccurrenceToken::dlxcap(e.id, earlier, Utc::now()).unwrap(), earlier, "retry cap", e.clone()).to_vec();
        let h = headers(vec![death(Q.as_bytes(), "rejected", AMQPValue::LongLongInt(1), AMQPValue::Timestamp(1_700_000_000))]);
        let d = DeadLetterDelivery::read(&body, RK, Some(&h));
        assert_eq!(d.path, DeadLetterPath::Broker);
        assert_eq!(d.token.as_ref().unwrap().as_str(), format!("xdeath:{}:{Q}:rejected:1:1700000000", e.id));
        assert_eq!(d.original_queue.as_deref(), Some(Q));
        assert_eq!(d.reason.as_deref(), Some("rejected"));
    }

    /// Audit finding: an x-death that cannot be read is no history; it must not strip a
    /// valid wrapper of its token (only a VALID x-death outranks it).
    #[test]
    fn an_unusable_x_death_leaves_the_wrapper_token_in_force() {
        let e = env();
        let token = OccurrenceToken::dlxcap(e.id, Q, Utc::now()).unwrap();
        let body = DlxWrapper::new(&token, Q, "retry cap", e.clone()).to_vec();
        let mut h = FieldTable::default();
        h.insert(ShortString::from("x-death"), AMQPValue::LongString("garbage".into()));
        let d = DeadLetterDelivery::read(&body, RK, Some(&h));
        assert_eq!((d.path, d.token.as_ref()), (DeadLetterPath::App, Some(&token)));
        assert!(d.occurred_at.is_some());
        assert!(d.token_note.as_deref().unwrap().contains("x-death unusable"));
    }

    #[test]
    fn hostile_x_death_degrades_to_tokenless_never_to_an_error() {
        let e = env();
        let ok_time = AMQPValue::Timestamp(1_700_000_000);
        let cases: Vec<(&str, AMQPValue)> = vec![
            ("empty", AMQPValue::FieldArray(FieldArray::default())),
            ("not an array", AMQPValue::LongString("x".into())),
            ("entry not a table", AMQPValue::FieldArray(vec![AMQPValue::Boolean(true)].into())),
            ("queue mismatch", AMQPValue::FieldArray(vec![death(b"craig-cases.events", "rejected", AMQPValue::LongLongInt(1), ok_time.clone())].into())),
            ("non-UTF-8 queue", AMQPValue::FieldArray(vec![death(b"craig-\xff.events", "rejected", AMQPValue::LongLongInt(1), ok_time.clone())].into())),
            ("huge count", AMQPValue::FieldArray(vec![death(Q.as_bytes(), "rejected", AMQPValue::LongLongInt(i64::MAX), ok_time.clone())].into())),
            ("zero count", AMQPValue::FieldArray(vec![death(Q.as_bytes(), "rejected", AMQPValue::LongLongInt(0), ok_time.clone())].into())),
            ("count as string", AMQPValue::FieldArray(vec![death(Q.as_bytes(), "rejected", AMQPValue::LongString("1".into()), ok_time.clone())].into())),
            ("time as string", AMQPValue::FieldArray(vec![death(Q.as_bytes(), "rejected", AMQPValue::LongLongInt(1), AMQPValue::LongString("now".into()))].into())),
            ("huge time", AMQPValue::FieldArray(vec![death(Q.as_bytes(), "rejected", AMQPValue::LongLongInt(1), AMQPValue::Timestamp(u64::MAX))].into())),
            ("unknown reason", AMQPValue::FieldArray(vec![death(Q.as_bytes(), "because", AMQPValue::LongLongInt(1), ok_time.clone())].into())),
        ];
        for (what, xdeath) in cases {
            let mut h = FieldTable::default();
            h.insert(ShortString::from("x-death"), xdeath);
            let d = DeadLetterDelivery::read(&e.to_vec(), RK, Some(&h));
            assert_eq!(d.token, None, "{what}");
            assert_eq!(d.occurred_at, None, "{what}");
            assert!(d.token_note.is_some(), "{what}: no reason kept");
            assert_eq!(d.envelope.as_ref(), Some(&e), "{what}: the envelope is still recorded");
            assert_eq!(d.path, DeadLetterPath::Broker, "{what}");
        }
    }

    #[test]
    fn unreadable_bodies_are_quarantined_with_their_bytes() {
        let e = env();
        let mut v2 = serde_json::to_value(DlxWrapper::new(&OccurrenceToken::dlxcap(e.id, Q, Utc::now()).unwrap(), Q, "r", e.clone())).unwrap();
        v2["_dlx"]["v"] = 2.into();
        let mut bad_env = serde_json::to_value(&e).unwrap();
        bad_env["id"] = Uuid::from_u128(0x1234_5678_9abc_4def_8123_456789abcdef).to_string().into();
        for (what, body) in [
            ("not JSON", b"{not json".to_vec()),
            ("not UTF-8", vec![0xff, 0xfe, b'{']),
            ("unknown wrapper version", serde_json::to_vec(&v2).unwrap()),
            ("JSON, not an envelope", br#"{"hello": 1}"#.to_vec()),
            ("envelope with a v4 id", serde_json::to_vec(&bad_env).unwrap()),
            ("empty", Vec::new()),
        ] {
            let d = DeadLetterDelivery::read(&body, RK, None);
            assert!(d.quarantine.is_some(), "{what}");
            assert_eq!(d.raw, body, "{what}: raw bytes kept");
            assert_eq!((d.envelope.as_ref(), d.token.as_ref()), (None, None), "{what}");
        }
    }

    #[test]
    fn a_wrapper_token_that_is_not_this_occurrences_is_dropped() {
        let e = env();
        let other = OccurrenceToken::dlxcap(Uuid::now_v7(), Q, Utc::now()).unwrap();
        let d = DeadLetterDelivery::read(&DlxWrapper::new(&other, Q, "r", e.clone()).to_vec(), RK, None);
        assert_eq!((d.token, d.envelope.is_some()), (None, true));
        let mut w = DlxWrapper::new(&OccurrenceToken::dlxcap(e.id, Q, Utc::now()).unwrap(), Q, "r", e.clone());
        w.dlx.token = format!("dlxcap:{}:{Q}:{}", e.id, "9".repeat(300));
        let d = DeadLetterDelivery::read(&w.to_vec(), RK, None);
        assert_eq!(d.token, None);
        assert!(d.token_note.as_deref().unwrap().contains("longer than 256"));
    }
}
