//! The event envelope every ADR-022 event travels in (§D1 `envelope JSONB`, §D2 inbox key).
//!
//! Wire shape (CONTRACT § AMQP): `id` (UUIDv7), `event_type`, `source_service`,
//! `aggregate_id`, `occurred_at` (RFC 3339), `schema_version`, `payload`.
//! Parsing is strict: unknown fields, a non-v7 id, an empty or oversized event type are
//! typed [`EnvelopeError`]s, never a silently defaulted value.

use chrono::{DateTime, SubsecRound, Utc};
use serde::{Deserialize, Serialize};
use uuid::Uuid;

/// Longest `event_type` / `source_service` accepted: both become AMQP short strings
/// (routing key, header) and must stay well under 255 bytes.
pub const MAX_NAME_LEN: usize = 128;

/// Largest serialized envelope accepted: RabbitMQ 4's default `max_message_size` (16 MiB;
/// 3.x allows more). A larger message makes the broker close the channel — a failure that
/// looks broker-wide — so it is refused at staging, and a legacy row that large is malformed.
pub const MAX_ENVELOPE_BYTES: usize = 16 * 1024 * 1024;

/// One domain event. Construct with [`EventEnvelope::new`]; parse with
/// [`EventEnvelope::from_slice`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EventEnvelope {
    pub id: Uuid,
    pub event_type: String,
    pub source_service: String,
    pub aggregate_id: Option<Uuid>,
    pub occurred_at: DateTime<Utc>,
    pub schema_version: u32,
    pub payload: serde_json::Value,
}

/// Why bytes or JSON are not an [`EventEnvelope`].
#[derive(Debug, thiserror::Error)]
pub enum EnvelopeError {
    #[error("envelope is not valid JSON of the envelope shape: {0}")]
    Malformed(#[from] serde_json::Error),
    #[error("envelope id {0} is not a UUIDv7")]
    NotUuidV7(Uuid),
    #[error("envelope field `{field}` is empty")]
    Empty { field: &'static str },
    #[error("envelope field `{field}` is {len} bytes, longer than {MAX_NAME_LEN}")]
    TooLong { field: &'static str, len: usize },
    #[error("envelope field `{field}` has characters outside [a-z0-9._-]: {value:?}")]
    BadName { field: &'static str, value: String },
    #[error("envelope is {len} bytes serialized, larger than {MAX_ENVELOPE_BYTES} (the broker's message size limit)")]
    TooLarge { len: usize },
    /// PostgreSQL's `jsonb` cannot hold U+0000, so such an envelope can never be staged.
    #[error("envelope payload holds a NUL character (U+0000) at {path}, which the outbox cannot store")]
    Nul { path: String },
}

impl EventEnvelope {
    /// A fresh envelope with a new UUIDv7 id and `occurred_at = now` (microsecond
    /// precision, so it round-trips through Postgres `timestamptz` unchanged).
    pub fn new(
        event_type: impl Into<String>,
        source_service: impl Into<String>,
        aggregate_id: Option<Uuid>,
        payload: serde_json::Value,
    ) -> Result<Self, EnvelopeError> {
        let env = Self {
            id: Uuid::now_v7(),
            event_type: event_type.into(),
            source_service: source_service.into(),
            aggregate_id,
            occurred_at: Utc::now().trunc_subsecs(6),
            schema_version: 1,
            payload,
        };
        env.validate()?;
        Ok(env)
    }

    /// Strict parse of wire bytes (an AMQP body or an outbox `envelope` column).
    pub fn from_slice(bytes: &[u8]) -> Result<Self, EnvelopeError> {
        let env: Self = serde_json::from_slice(bytes)?;
        env.validate()?;
        Ok(env)
    }

    /// Strict parse of an already-decoded JSON value (the outbox `envelope` JSONB).
    pub fn from_value(value: serde_json::Value) -> Result<Self, EnvelopeError> {
        let env: Self = serde_json::from_value(value)?;
        env.validate()?;
        Ok(env)
    }

    /// Wire bytes. Serializing this type cannot fail (no maps with non-string keys).
    pub fn to_vec(&self) -> Vec<u8> {
        serde_json::to_vec(self).expect("EventEnvelope always serializes")
    }

    pub fn validate(&self) -> Result<(), EnvelopeError> {
        if self.id.get_version_num() != 7 {
            return Err(EnvelopeError::NotUuidV7(self.id));
        }
        check_name("event_type", &self.event_type)?;
        check_name("source_service", &self.source_service)?;
        let len = serde_json::to_vec(&self.payload).map_or(0, |v| v.len());
        if len > MAX_ENVELOPE_BYTES {
            return Err(EnvelopeError::TooLarge { len });
        }
        Ok(())
    }
}

impl EventEnvelope {
    /// [`validate`](Self::validate), plus what the outbox's `jsonb` column must be able to
    /// store: no U+0000 anywhere in the payload (strings or keys).
    pub fn validate_storable(&self) -> Result<(), EnvelopeError> {
        self.validate()?;
        find_nul(&self.payload, &mut String::from("payload"))
    }
}

fn find_nul(v: &serde_json::Value, path: &mut String) -> Result<(), EnvelopeError> {
    use serde_json::Value;
    let nul = |path: &str| Err(EnvelopeError::Nul { path: path.to_owned() });
    match v {
        Value::String(s) if s.contains('\0') => nul(path),
        Value::Array(items) => {
            for (i, item) in items.iter().enumerate() {
                let len = path.len();
                path.push_str(&format!("[{i}]"));
                find_nul(item, path)?;
                path.truncate(len);
            }
            Ok(())
        }
        Value::Object(map) => {
            for (k, item) in map {
                let len = path.len();
                path.push('.');
                path.push_str(&k.replace('\0', "\\0"));
                if k.contains('\0') {
                    return nul(path);
                }
                find_nul(item, path)?;
                path.truncate(len);
            }
            Ok(())
        }
        _ => Ok(()),
    }
}

/// Whether `value` is a valid `event_type` (the envelope's own rule: 1..=128 bytes of
/// lower-case ASCII, digits, `.`, `_`, `-`).
pub fn is_event_type(value: &str) -> bool {
    check_name("event_type", value).is_ok()
}

fn check_name(field: &'static str, value: &str) -> Result<(), EnvelopeError> {
    if value.is_empty() {
        return Err(EnvelopeError::Empty { field });
    }
    if value.len() > MAX_NAME_LEN {
        return Err(EnvelopeError::TooLong { field, len: value.len() });
    }
    let ok = value
        .bytes()
        .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || matches!(b, b'.' | b'_' | b'-'));
    if !ok {
        return Err(EnvelopeError::BadName { field, value: value.to_owned() });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn sample() -> EventEnvelope {
        EventEnvelope::new("case.referral_created", "cases", Some(Uuid::now_v7()), json!({"k": 1}))
            .unwrap()
    }

    #[test]
    fn round_trips_through_bytes() {
        let env = sample();
        assert_eq!(EventEnvelope::from_slice(&env.to_vec()).unwrap(), env);
    }

    #[test]
    fn wire_shape_has_exactly_the_contract_fields() {
        let v = serde_json::to_value(sample()).unwrap();
        let mut keys: Vec<_> = v.as_object().unwrap().keys().cloned().collect();
        keys.sort();
        assert_eq!(
            keys,
            ["aggregate_id", "event_type", "id", "occurred_at", "payload", "schema_version", "source_service"]
        );
    }

    #[test]
    fn rejects_unknown_fields() {
        let mut v = serde_json::to_value(sample()).unwrap();
        v["extra"] = json!(true);
        assert!(matches!(EventEnvelope::from_value(v), Err(EnvelopeError::Malformed(_))));
    }

    #[test]
    fn rejects_non_v7_id() {
        let mut v = serde_json::to_value(sample()).unwrap();
        let v4 = Uuid::from_u128(0x6f1e_0000_0000_4000_8000_0000_0000_0001);
        v["id"] = json!(v4);
        assert!(matches!(EventEnvelope::from_value(v), Err(EnvelopeError::NotUuidV7(id)) if id == v4));
    }

    #[test]
    fn rejects_bad_names() {
        let mut v = serde_json::to_value(sample()).unwrap();
        v["event_type"] = json!("");
        assert!(matches!(
            EventEnvelope::from_value(v.clone()),
            Err(EnvelopeError::Empty { field: "event_type" })
        ));
        v["event_type"] = json!("case.created\r\nX-Injected: 1");
        assert!(matches!(EventEnvelope::from_value(v.clone()), Err(EnvelopeError::BadName { .. })));
        v["event_type"] = json!("a".repeat(MAX_NAME_LEN + 1));
        assert!(matches!(EventEnvelope::from_value(v), Err(EnvelopeError::TooLong { .. })));
    }

    #[test]
    fn a_nul_anywhere_in_the_payload_is_not_storable() {
        let mut env = sample();
        assert!(env.validate_storable().is_ok());
        env.payload = json!({"a": [1, {"b": "x\u{0}y"}]});
        let err = env.validate_storable().unwrap_err();
        assert!(matches!(&err, EnvelopeError::Nul { path } if path == "payload.a[1].b"), "{err}");
        env.payload = json!({"k\u{0}": 1});
        assert!(matches!(env.validate_storable(), Err(EnvelopeError::Nul { .. })));
        // validate() alone is about the wire shape; the payload is the producer's business.
        assert!(env.validate().is_ok());
    }

    #[test]
    fn an_envelope_over_the_broker_message_limit_is_refused() {
        let mut env = sample();
        env.payload = json!({ "blob": "x".repeat(MAX_ENVELOPE_BYTES) });
        assert!(matches!(env.validate(), Err(EnvelopeError::TooLarge { .. })));
        assert!(matches!(EventEnvelope::from_value(serde_json::to_value(&env).unwrap()), Err(EnvelopeError::TooLarge { .. })));
    }

    /// The limit is the broker's 16 MiB, not less (a mutation test found nothing held the
    /// bound from below: `16 * 1024 + 1024` bytes refused every envelope over 17 KiB and
    /// every test passed): a payload of exactly 16 MiB serialized is accepted, one byte
    /// more is refused.
    #[test]
    fn an_envelope_up_to_the_broker_message_limit_is_accepted() {
        assert_eq!(MAX_ENVELOPE_BYTES, 16 * 1024 * 1024);
        let mut env = sample();
        // `{"b":"…"}` is 8 bytes around the string.
        env.payload = json!({ "b": "x".repeat(MAX_ENVELOPE_BYTES - 8) });
        assert_eq!(serde_json::to_vec(&env.payload).unwrap().len(), MAX_ENVELOPE_BYTES);
        assert!(env.validate().is_ok());
        env.payload = json!({ "b": "x".repeat(MAX_ENVELOPE_BYTES - 7) });
        assert!(matches!(env.validate(), Err(EnvelopeError::TooLarge { len }) if len == MAX_ENVELOPE_BYTES + 1));
    }

    #[test]
    fn rejects_non_json_bytes() {
        assert!(matches!(EventEnvelope::from_slice(b"\xff\x00not json"), Err(EnvelopeError::Malformed(_))));
    }
}
