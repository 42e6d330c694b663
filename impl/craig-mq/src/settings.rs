//! `ServiceSettings::load()` — ADR-022 § Retention policy (as corrected by #965/#1129, ADR-058)
//! and the #1128 worker knobs.
//!
//! Binding rule: the inbox window must be strictly wider than the outbox window, with at
//! least one day of margin (`inbox ≥ outbox + 1 day`); `load()` REJECTS anything less,
//! naming both values. A window of 0 disables that table's prune.
//!
//! | variable | default |
//! |---|---|
//! | `DATABASE_URL` | `postgres://postgres@127.0.0.1:5432/postgres` |
//! | `AMQP_URL` | `amqp://guest:guest@127.0.0.1:5672/%2f` |
//! | `CRAIG_OUTBOX_RETENTION_DAYS` | 30 |
//! | `CRAIG_INBOX_RETENTION_DAYS` | 31 |
//! | `CRAIG_IDEMPOTENCY_TTL_HOURS` | 24 |
//! | `CRAIG_OUTBOX_POLL_MS` | 1000 |
//! | `CRAIG_OUTBOX_BATCH` | 100 |
//! | `CRAIG_OUTBOX_CLAIM_LEASE_SECS` | 60 |
//! | `CRAIG_OUTBOX_BACKOFF_BASE_MS` / `CRAIG_OUTBOX_BACKOFF_MAX_MS` | 1000 / 60000 |
//! | `CRAIG_AMQP_HEARTBEAT_SECS` | 5 |
//! | `CRAIG_PUBLISH_CONFIRM_TIMEOUT_MS` | 5000 |
//! | `CRAIG_AMQP_CONNECT_TIMEOUT_MS` | 5000 |
//! | `CRAIG_RETENTION_INTERVAL_SECS` | 3600 (the prune's cadence, jittered ±10 %; at least 1) |
//! | `CRAIG_RETENTION_BATCH` / `CRAIG_RETENTION_MAX_BATCHES` | 1000 / 100 (rows a DELETE, DELETEs a table a cycle) |
//! | `CRAIG_OUTBOX_UNPUBLISHED_GRACE_SECS` | 3600 (pending rows older than this: `outbox_unpublished_beyond_grace`) |
//! | `CRAIG_OUTBOX_NOTIFY` | 0 (1: the LISTEN/NOTIFY wake-up, polling kept as the fallback; `outbox::notify`) |
//! | `CRAIG_CONSUMER_CONCURRENCY` | the prefetch, 32 (deliveries a consumer handles at once, 1..=32) |
//! | `CRAIG_DLQ_PARK_MS` / `CRAIG_DLQ_MAX_PARKS` | 2000 / 30 (security's DLQ park, and the parks one delivery the database keeps refusing may cause before it is captured; #1197) |
//! | `CRAIG_DLQ_REDRIVE_SECS` | 60 (security re-reads its capture queue this often; 0: only `craig-node dlq redrive-capture`) |
//!
//! Settings that would silently switch the protocol off are rejected with the value and the
//! rule ([`SettingsError::Unsafe`]): a zero lease, poll interval, backoff base or confirm
//! timeout, a backoff cap below the base, and a lease shorter than `2 × confirm timeout + connect timeout` — the longest a
//! claimed batch can legitimately stay in flight, so a shorter lease lets a second worker
//! re-claim rows whose publish is still running.

use std::time::Duration;

use crate::outbox::OutboxConfig;
use crate::publisher::PublisherConfig;

pub const DEFAULT_DATABASE_URL: &str = "postgres://postgres@127.0.0.1:5432/postgres";
pub const DEFAULT_AMQP_URL: &str = "amqp://guest:guest@127.0.0.1:5672/%2f";

/// The longest retention window a setting may name: 100 years. Every window is bounded by
/// it (`CRAIG_IDEMPOTENCY_TTL_HOURS` by `24 ×` it), so the prune's `make_interval`, the
/// replay horizon (`chrono`) and the idempotency row's `expires_at` never overflow.
pub const MAX_RETENTION_DAYS: u32 = 36_500;

/// The ceiling of every numeric setting but the retention windows (those have
/// [`MAX_RETENTION_DAYS`]): name, largest value, what it means.
pub const SETTING_CEILINGS: &[(&str, u64, &str)] = &[
    ("CRAIG_OUTBOX_POLL_MS", 3_600_000, "one hour"),
    ("CRAIG_OUTBOX_BATCH", 10_000, "rows a claim takes"),
    ("CRAIG_OUTBOX_CLAIM_LEASE_SECS", 86_400, "one day"),
    ("CRAIG_OUTBOX_BACKOFF_BASE_MS", 86_400_000, "one day"),
    ("CRAIG_OUTBOX_BACKOFF_MAX_MS", 86_400_000, "one day"),
    ("CRAIG_PUBLISH_CONFIRM_TIMEOUT_MS", 600_000, "ten minutes"),
    ("CRAIG_AMQP_CONNECT_TIMEOUT_MS", 600_000, "ten minutes"),
    ("CRAIG_INBOX_RETRY_CAP", 1_000_000, "failures of one envelope"),
    ("CRAIG_RETENTION_INTERVAL_SECS", 2_592_000, "thirty days"),
    ("CRAIG_RETENTION_BATCH", 1_000_000, "rows a DELETE takes"),
    ("CRAIG_RETENTION_MAX_BATCHES", 1_000_000, "DELETEs a cycle"),
    ("CRAIG_OUTBOX_UNPUBLISHED_GRACE_SECS", MAX_RETENTION_DAYS as u64 * 86_400, "the longest retention window"),
    ("CRAIG_DLQ_PARK_MS", 600_000, "ten minutes"),
    ("CRAIG_DLQ_MAX_PARKS", 10_000, "parks of one delivery"),
];

/// Retention windows (ADR-022 § Retention policy). Days / hours; 0 disables the prune
/// (for `idempotency_hours`: the rows keep the default 24 h life and are never pruned).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Retention {
    pub outbox_days: u32,
    pub inbox_days: u32,
    pub idempotency_hours: u32,
}

impl Default for Retention {
    fn default() -> Self {
        Self { outbox_days: 30, inbox_days: 31, idempotency_hours: 24 }
    }
}

/// Default [`ServiceSettings::inbox_retry_cap`]: with the subscriber's 500 ms pause before
/// each requeue, at least 5 s of failures of one envelope before it is surfaced; a
/// database outage cannot surface anything (the surface itself reads the inbox row).
pub const DEFAULT_INBOX_RETRY_CAP: u32 = 10;

#[derive(Debug, Clone)]
pub struct ServiceSettings {
    pub database_url: String,
    pub amqp_url: String,
    pub retention: Retention,
    pub outbox: OutboxConfig,
    pub publisher: PublisherConfig,
    /// Transient handler failures of one envelope before the inbox surfaces it to
    /// `craig.dlx` (§D3 app path, #1196), `CRAIG_INBOX_RETRY_CAP`, at least 1.
    pub inbox_retry_cap: u32,
    /// The retention prune (#965/#1129), windows from [`Self::retention`].
    pub prune: crate::retention::PruneConfig,
    /// `CRAIG_OUTBOX_NOTIFY`: stage with NOTIFY and wake the worker on it (`outbox::notify`).
    pub outbox_notify: bool,
    /// `CRAIG_CONSUMER_CONCURRENCY`: deliveries a consumer session handles at once,
    /// 1..=[`CONSUMER_PREFETCH`] (default: the prefetch).
    pub consumer_concurrency: u16,
    /// Security's DLQ retry policy (#1197): `CRAIG_DLQ_PARK_MS`, `CRAIG_DLQ_MAX_PARKS`.
    pub dlq_retry: crate::dlq::DlqRetryConfig,
    /// `CRAIG_DLQ_REDRIVE_SECS`: how often security re-reads its capture queue (`None`: never
    /// by itself).
    pub dlq_redrive: Option<Duration>,
    /// `CRAIG_QUEUE_TYPE`: `classic` (default) or `quorum`, for every queue the fleet
    /// declares (issue 25; the deploy step and every node must agree).
    pub queue_type: crate::topology::QueueType,
}

/// The prefetch of every consumer session of the fleet (§D3).
pub const CONSUMER_PREFETCH: u16 = 32;

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum SettingsError {
    #[error(
        "inbox retention ({inbox_days} d) must be at least outbox retention ({outbox_days} d) + 1 day: \
         the tables are pruned asynchronously, so an equal or shorter inbox window lets a replayed \
         outbox row arrive after its dedup record was pruned (ADR-022 § Retention policy, #965/#1129)"
    )]
    InboxWindowTooShort { inbox_days: u32, outbox_days: u32 },
    #[error("{name}={value:?} is not a valid {expected}")]
    Invalid { name: &'static str, value: String, expected: &'static str },
    #[error("{name}={value} is refused: {rule}")]
    Unsafe { name: &'static str, value: String, rule: String },
}

impl ServiceSettings {
    /// Read the process environment.
    pub fn load() -> Result<Self, SettingsError> {
        Self::load_from(|k| std::env::var(k).ok())
    }

    /// Read settings through `lookup` (the environment in production, a map in tests).
    pub fn load_from(lookup: impl Fn(&str) -> Option<String>) -> Result<Self, SettingsError> {
        let num = |name: &'static str, default: u64| -> Result<u64, SettingsError> {
            let v: u64 = match lookup(name) {
                None => default,
                Some(v) => v.trim().parse().map_err(|_| SettingsError::Invalid {
                    name,
                    value: v,
                    expected: "non-negative integer below 2^64",
                })?,
            };
            // Issue 21.4 (audit): every numeric knob has a ceiling, so nothing downstream
            // (an interval, a LIMIT, a sleep) overflows or wraps.
            match SETTING_CEILINGS.iter().find(|(n, ..)| *n == name) {
                Some((_, max, why)) if v > *max => Err(SettingsError::Unsafe {
                    name,
                    value: v.to_string(),
                    rule: format!("at most {max} ({why}); a larger value overflows what it is bound into"),
                }),
                _ => Ok(v),
            }
        };
        let small = |name: &'static str, default: u64| -> Result<u32, SettingsError> {
            let v = num(name, default)?;
            u32::try_from(v).map_err(|_| SettingsError::Invalid {
                name,
                value: v.to_string(),
                expected: "integer below 2^32",
            })
        };
        // Issue 21.4: a window past what PostgreSQL intervals and chrono hold overflowed
        // (4294967295 days bound as -1 day: every dedup record pruned at once).
        let window = |name: &'static str, default: u64, max: u32, unit: &str| -> Result<u32, SettingsError> {
            let v = num(name, default)?;
            if v > u64::from(max) {
                return Err(SettingsError::Unsafe {
                    name,
                    value: v.to_string(),
                    rule: format!(
                        "a retention window may be at most {max} {unit} ({MAX_RETENTION_DAYS} days, 100 years): a larger one \
                         overflows the database's interval arithmetic and prunes every row, or none (ADR-022 § Retention policy)"
                    ),
                });
            }
            Ok(v as u32)
        };
        let retention = Retention {
            outbox_days: window("CRAIG_OUTBOX_RETENTION_DAYS", 30, MAX_RETENTION_DAYS, "days")?,
            inbox_days: window("CRAIG_INBOX_RETENTION_DAYS", 31, MAX_RETENTION_DAYS, "days")?,
            idempotency_hours: window("CRAIG_IDEMPOTENCY_TTL_HOURS", 24, MAX_RETENTION_DAYS * 24, "hours")?,
        };
        retention.check()?;
        let batch = small("CRAIG_OUTBOX_BATCH", 100)?;
        if batch == 0 {
            return Err(SettingsError::Invalid {
                name: "CRAIG_OUTBOX_BATCH",
                value: "0".into(),
                expected: "batch size of at least 1",
            });
        }
        let outbox = OutboxConfig {
            poll_interval: Duration::from_millis(num("CRAIG_OUTBOX_POLL_MS", 1000)?),
            batch_size: batch,
            claim_lease: Duration::from_secs(num("CRAIG_OUTBOX_CLAIM_LEASE_SECS", 60)?),
            backoff_base: Duration::from_millis(num("CRAIG_OUTBOX_BACKOFF_BASE_MS", 1000)?),
            backoff_max: Duration::from_millis(num("CRAIG_OUTBOX_BACKOFF_MAX_MS", 60_000)?),
        };
        let publisher = PublisherConfig {
            heartbeat_secs: u16::try_from(num("CRAIG_AMQP_HEARTBEAT_SECS", 5)?).map_err(|_| {
                SettingsError::Invalid {
                    name: "CRAIG_AMQP_HEARTBEAT_SECS",
                    value: lookup("CRAIG_AMQP_HEARTBEAT_SECS").unwrap_or_default(),
                    expected: "heartbeat below 65536 s",
                }
            })?,
            confirm_timeout: Duration::from_millis(num("CRAIG_PUBLISH_CONFIRM_TIMEOUT_MS", 5000)?),
            connect_timeout: Duration::from_millis(num("CRAIG_AMQP_CONNECT_TIMEOUT_MS", 5000)?),
        };
        check_protocol(&outbox, &publisher)?;
        let inbox_retry_cap = small("CRAIG_INBOX_RETRY_CAP", u64::from(DEFAULT_INBOX_RETRY_CAP))?;
        if inbox_retry_cap == 0 {
            return Err(SettingsError::Invalid {
                name: "CRAIG_INBOX_RETRY_CAP",
                value: "0".into(),
                expected: "retry cap of at least 1",
            });
        }
        let positive = |name: &'static str, default: u64, expected: &'static str| -> Result<u64, SettingsError> {
            let v = num(name, default)?;
            if v == 0 {
                return Err(SettingsError::Invalid { name, value: "0".into(), expected });
            }
            Ok(v)
        };
        let prune = crate::retention::PruneConfig {
            retention,
            interval: Duration::from_secs(positive("CRAIG_RETENTION_INTERVAL_SECS", 3600, "prune interval of at least 1 s (a window of 0 disables one table)")?),
            batch: positive("CRAIG_RETENTION_BATCH", 1000, "prune batch of at least 1 row")? as i64,
            max_batches: u32::try_from(positive("CRAIG_RETENTION_MAX_BATCHES", 100, "cycle cap of at least 1 batch")?).unwrap_or(u32::MAX),
            grace: Duration::from_secs(num("CRAIG_OUTBOX_UNPUBLISHED_GRACE_SECS", 3600)?),
            pre_965: false,
        };
        let outbox_notify = match lookup("CRAIG_OUTBOX_NOTIFY").as_deref().map(str::trim) {
            None | Some("" | "0" | "false") => false,
            Some("1" | "true") => true,
            Some(v) => return Err(SettingsError::Invalid { name: "CRAIG_OUTBOX_NOTIFY", value: v.into(), expected: "0 or 1" }),
        };
        let consumer_concurrency = num("CRAIG_CONSUMER_CONCURRENCY", u64::from(CONSUMER_PREFETCH))?;
        if !(1..=u64::from(CONSUMER_PREFETCH)).contains(&consumer_concurrency) {
            return Err(SettingsError::Invalid {
                name: "CRAIG_CONSUMER_CONCURRENCY",
                value: consumer_concurrency.to_string(),
                expected: "concurrency of 1 up to the prefetch (32)",
            });
        }
        let dlq_invalid = |name: &'static str, e: crate::dlq::DlqConfigError| SettingsError::Invalid {
            name,
            value: lookup(name).unwrap_or_default(),
            expected: match e {
                crate::dlq::DlqConfigError::ParkDelay { .. } => "park of 200 ms (the in-session retry delay) up to 600000 ms",
                _ => "count of parks, 1..=10000",
            },
        };
        let defaults = crate::dlq::DlqRetryConfig::default();
        let park_ms = num("CRAIG_DLQ_PARK_MS", defaults.park_delay().as_millis() as u64)?;
        let dlq_retry = crate::dlq::DlqRetryConfig::new(defaults.max_attempts(), defaults.retry_delay(), Duration::from_millis(park_ms))
            .map_err(|e| dlq_invalid("CRAIG_DLQ_PARK_MS", e))?;
        let max_parks = num("CRAIG_DLQ_MAX_PARKS", u64::from(crate::dlq::DEFAULT_MAX_PARKS))?;
        let dlq_retry = dlq_retry
            .with_max_parks(u32::try_from(max_parks).unwrap_or(u32::MAX))
            .map_err(|e| dlq_invalid("CRAIG_DLQ_MAX_PARKS", e))?;
        let redrive = num("CRAIG_DLQ_REDRIVE_SECS", 60)?;
        if redrive > 86_400 {
            return Err(SettingsError::Invalid { name: "CRAIG_DLQ_REDRIVE_SECS", value: redrive.to_string(), expected: "interval of 0 (off) up to 86400 s" });
        }
        let dlq_redrive = (redrive > 0).then(|| Duration::from_secs(redrive));
        let queue_type = match lookup("CRAIG_QUEUE_TYPE") {
            None => crate::topology::QueueType::default(),
            Some(v) => v.parse().map_err(|_| SettingsError::Invalid { name: "CRAIG_QUEUE_TYPE", value: v, expected: "queue type: classic or quorum" })?,
        };
        let database_url = lookup("DATABASE_URL").unwrap_or_else(|| DEFAULT_DATABASE_URL.into());
        // Several broker endpoints (issue 25): `AMQP_URLS`, else `AMQP_URL`, either a list
        // joined by commas; a node connects to the first that answers and moves to the next
        // on failure (`publisher::connect`).
        let (amqp_name, amqp_url) = match lookup("AMQP_URLS").filter(|v| !v.trim().is_empty()) {
            Some(list) => ("AMQP_URLS", list.trim().to_owned()),
            None => ("AMQP_URL", lookup("AMQP_URL").unwrap_or_else(|| DEFAULT_AMQP_URL.into())),
        };
        // Refused here, redacted, rather than by a driver that would print them whole.
        if misspelled_password_key(&database_url).is_some() {
            return Err(SettingsError::Invalid {
                name: "DATABASE_URL",
                value: redact(&database_url),
                expected: "URL whose password parameter is spelled `password` (libpq's key; any other spelling would be logged with its value)",
            });
        }
        if amqp_endpoints(&amqp_url).iter().any(|u| u.parse::<lapin::uri::AMQPUri>().is_err()) {
            return Err(SettingsError::Invalid {
                name: amqp_name,
                value: redact(&amqp_url),
                expected: "amqp:// or amqps:// URL, or several joined by commas",
            });
        }
        Ok(Self {
            queue_type,
            dlq_retry,
            dlq_redrive,
            outbox_notify,
            consumer_concurrency: consumer_concurrency as u16,
            prune,
            database_url,
            amqp_url,
            retention,
            outbox,
            publisher,
            inbox_retry_cap,
        })
    }
}

/// `url` with any password replaced by `***`, for every log and error line that names a
/// DATABASE_URL or AMQP_URL: the userinfo form (`postgres://u:***@host/db`) and the query
/// parameter form (`?password=***`, libpq's; the key matched in any case and
/// percent-decoded). The query is redacted first, so an `@` inside a password value cannot
/// move the userinfo split; a URL without `//` (`amqp:u:pw@h`) is read the same way.
pub fn redact(url: &str) -> String {
    let list = amqp_endpoints(url);
    if list.len() > 1 {
        return list.iter().map(|u| redact(u)).collect::<Vec<_>>().join(",");
    }
    let url = redact_query(url);
    let (scheme, sep, rest) = match url.split_once("://") {
        Some((s, r)) => (s, "://", r),
        None => match url.split_once(':') {
            Some((s, r)) if !s.is_empty() && s.bytes().all(|b| b.is_ascii_alphanumeric() || b"+-.".contains(&b)) => (s, ":", r),
            _ => return url,
        },
    };
    // Up to the LAST '@': a password may hold '/', '?', '#' or '@' (unencoded, in a URL that
    // is malformed for exactly that reason); hiding too much beats printing a secret.
    match rest.rsplit_once('@') {
        Some((userinfo, host)) if userinfo.contains(':') => {
            let user = userinfo.split_once(':').map_or(userinfo, |(u, _)| u);
            format!("{scheme}{sep}{user}:***@{host}")
        }
        _ => url,
    }
}

/// Whether a query key names the password: `password` in any case, percent-decoded.
fn is_password_key(key: &str) -> bool {
    percent_decode(key).eq_ignore_ascii_case("password")
}

/// Every password parameter's value (after `?` or `&`, up to `&` or `#`) as `***`.
fn redact_query(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    let mut rest = s;
    let mut in_param = false;
    loop {
        let end = rest.find(['?', '&']).unwrap_or(rest.len());
        let segment = &rest[..end];
        match segment.split_once('=') {
            Some((key, value)) if in_param && is_password_key(key) => {
                let tail = value.find('#').map_or("", |i| &value[i..]);
                out.push_str(key);
                out.push_str("=***");
                out.push_str(tail);
            }
            _ => out.push_str(segment),
        }
        if end == rest.len() {
            return out;
        }
        out.push_str(&rest[end..end + 1]);
        rest = &rest[end + 1..];
        in_param = true;
    }
}

/// A password-like query key that is not libpq's own spelling (`Password`, `pass%77ord`):
/// the driver would log it as an unrecognised parameter WITH its value, so it is refused
/// before the URL reaches the driver.
pub fn misspelled_password_key(url: &str) -> Option<String> {
    let (_, query) = url.split_once('?')?;
    query.split(['&', '#']).filter_map(|p| p.split_once('=')).map(|(k, _)| k).find(|k| is_password_key(k) && *k != "password").map(str::to_owned)
}

/// The secrets `url` carries: the userinfo password and every password query value, each
/// as written and percent-decoded.
fn secrets(url: &str) -> Vec<String> {
    let mut found = Vec::new();
    let mut in_param = false;
    let mut userinfo_part = url;
    for (i, segment) in url.split(['?', '&']).enumerate() {
        if i == 0 {
            userinfo_part = segment;
        }
        if let Some((key, value)) = segment.split_once('=').filter(|_| in_param) {
            if is_password_key(key) {
                found.push(value.split('#').next().unwrap_or(value).to_owned());
            }
        }
        in_param = true;
    }
    // The userinfo password: before the last '@' of the whole URL, and of the part before the
    // query (either split may be the real one in a malformed URL; both are hidden).
    for candidate in [url, userinfo_part] {
        let rest = candidate.split_once("://").map(|(_, r)| r).or_else(|| candidate.split_once(':').map(|(_, r)| r)).unwrap_or(candidate);
        if let Some(pass) = rest.rsplit_once('@').and_then(|(ui, _)| ui.split_once(':')).map(|(_, p)| p) {
            found.push(pass.to_owned());
        }
    }
    let decoded: Vec<String> = found.iter().map(|s| percent_decode(s)).collect();
    found.extend(decoded);
    found.retain(|s| !s.is_empty());
    // Longest first, so a secret that contains another is replaced whole.
    found.sort_by_key(|s| std::cmp::Reverse(s.len()));
    found.dedup();
    found
}

fn percent_decode(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        let hex = |c: u8| (c as char).to_digit(16);
        if b[i] == b'%' && i + 2 < b.len() {
            if let (Some(h), Some(l)) = (hex(b[i + 1]), hex(b[i + 2])) {
                out.push((h * 16 + l) as u8);
                i += 3;
                continue;
            }
        }
        out.push(b[i]);
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// `text` (an error a driver produced from `url`) with the URL redacted and every secret
/// it carries replaced by `***`, should the driver have echoed one alone.
pub fn redact_text(text: &str, url: &str) -> String {
    let mut out = text.replace(url, &redact(url));
    for endpoint in amqp_endpoints(url) {
        out = out.replace(endpoint, &redact(endpoint));
        for secret in secrets(endpoint) {
            out = out.replace(&secret, "***");
        }
    }
    for secret in secrets(url) {
        out = out.replace(&secret, "***");
    }
    redact_query(&out)
}

/// The broker endpoints of an AMQP URL setting (issue 25): one URL, or several joined by
/// commas (`amqp://a:5672/%2f,amqp://b:5672/%2f`; `AMQP_URLS`). A list is split only where
/// a comma is followed by a scheme (`amqp://`, `amqps://`), so a comma inside a URL (an
/// unencoded password) never cuts it in two.
pub fn amqp_endpoints(list: &str) -> Vec<&str> {
    let mut out = Vec::new();
    let mut start = 0;
    for (i, _) in list.match_indices(',') {
        let next = &list[i + 1..];
        if next.starts_with("amqp://") || next.starts_with("amqps://") {
            out.push(&list[start..i]);
            start = i + 1;
        }
    }
    out.push(&list[start..]);
    out
}

/// Reject worker settings that would silently disable the #1128 protocol.
pub fn check_protocol(outbox: &OutboxConfig, publisher: &PublisherConfig) -> Result<(), SettingsError> {
    let unsafe_ = |name: &'static str, value: String, rule: &str| {
        Err(SettingsError::Unsafe { name, value, rule: rule.to_owned() })
    };
    let ms = |d: Duration| format!("{}ms", d.as_millis());
    if outbox.claim_lease.is_zero() {
        return unsafe_("CRAIG_OUTBOX_CLAIM_LEASE_SECS", "0".into(),
            "a zero claim lease makes every claimed row claimable again at once (ADR-022 #1128)");
    }
    if outbox.poll_interval.is_zero() {
        return unsafe_("CRAIG_OUTBOX_POLL_MS", "0".into(), "a zero poll interval spins the worker against the database");
    }
    if outbox.backoff_base.is_zero() {
        return unsafe_("CRAIG_OUTBOX_BACKOFF_BASE_MS", "0".into(),
            "a zero backoff base retries a failing broker or a refused row without pause");
    }
    if outbox.backoff_max < outbox.backoff_base {
        return unsafe_("CRAIG_OUTBOX_BACKOFF_MAX_MS", ms(outbox.backoff_max), &format!(
            "the backoff cap must be at least the backoff base ({}); a smaller cap retries without pause",
            ms(outbox.backoff_base)));
    }
    if publisher.confirm_timeout.is_zero() {
        return unsafe_("CRAIG_PUBLISH_CONFIRM_TIMEOUT_MS", "0".into(),
            "a zero confirm timeout counts every publish as unconfirmed");
    }
    let in_flight = publisher.worst_case_publish();
    if outbox.claim_lease < in_flight {
        return unsafe_("CRAIG_OUTBOX_CLAIM_LEASE_SECS", format!("{}s", outbox.claim_lease.as_secs_f64()), &format!(
            "the lease must be at least 2 x confirm timeout ({}) + connect timeout ({}) = {}, the longest a \
             claimed batch can be in flight; a shorter lease lets another worker re-claim rows still being \
             published (ADR-022 #1128)",
            ms(publisher.confirm_timeout), ms(publisher.connect_timeout), ms(in_flight)));
    }
    Ok(())
}

impl Retention {
    /// `inbox ≥ outbox + 1 day` (ADR-022 § Retention policy). A disabled inbox prune (0)
    /// keeps dedup records forever and is always safe; a disabled outbox prune (0) with a
    /// finite inbox window is not, and is rejected like any too-short inbox window.
    pub fn check(&self) -> Result<(), SettingsError> {
        for (name, v, max) in [
            ("CRAIG_OUTBOX_RETENTION_DAYS", self.outbox_days, MAX_RETENTION_DAYS),
            ("CRAIG_INBOX_RETENTION_DAYS", self.inbox_days, MAX_RETENTION_DAYS),
            ("CRAIG_IDEMPOTENCY_TTL_HOURS", self.idempotency_hours, MAX_RETENTION_DAYS * 24),
        ] {
            if v > max {
                return Err(SettingsError::Unsafe { name, value: v.to_string(), rule: format!("a retention window may be at most {max} ({MAX_RETENTION_DAYS} days)") });
            }
        }
        let inbox_forever = self.inbox_days == 0;
        let outbox_forever = self.outbox_days == 0;
        let ok = inbox_forever
            || (!outbox_forever && u64::from(self.inbox_days) >= u64::from(self.outbox_days) + 1);
        if ok {
            Ok(())
        } else {
            Err(SettingsError::InboxWindowTooShort {
                inbox_days: self.inbox_days,
                outbox_days: self.outbox_days,
            })
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn load(pairs: &[(&str, &str)]) -> Result<ServiceSettings, SettingsError> {
        let map: HashMap<String, String> =
            pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        ServiceSettings::load_from(|k| map.get(k).cloned())
    }

    #[test]
    fn defaults_are_the_adr_windows() {
        let s = load(&[]).unwrap();
        assert_eq!(s.retention, Retention { outbox_days: 30, inbox_days: 31, idempotency_hours: 24 });
        assert_eq!(s.outbox.batch_size, 100);
        assert_eq!(s.outbox.claim_lease, Duration::from_secs(60));
        assert_eq!(s.outbox.poll_interval, Duration::from_secs(1));
        assert_eq!(s.outbox.backoff_max, Duration::from_secs(60));
        assert_eq!(s.inbox_retry_cap, DEFAULT_INBOX_RETRY_CAP);
    }

    #[test]
    fn the_queue_type_is_classic_unless_quorum_is_asked_for() {
        use crate::topology::QueueType;
        assert_eq!(load(&[]).unwrap().queue_type, QueueType::Classic);
        assert_eq!(load(&[("CRAIG_QUEUE_TYPE", "quorum")]).unwrap().queue_type, QueueType::Quorum);
        let err = load(&[("CRAIG_QUEUE_TYPE", "mirrored")]).unwrap_err();
        assert_eq!(err.to_string(), "CRAIG_QUEUE_TYPE=\"mirrored\" is not a valid queue type: classic or quorum");
    }

    #[test]
    fn several_broker_endpoints_are_one_list_and_each_is_checked_and_redacted() {
        let two = "amqp://u:p1@a:5672/%2f,amqp://u:p,2@b:5673/%2f";
        assert_eq!(amqp_endpoints(two), ["amqp://u:p1@a:5672/%2f", "amqp://u:p,2@b:5673/%2f"], "a comma inside a URL does not cut it");
        assert_eq!(amqp_endpoints("amqp://a"), ["amqp://a"]);
        let s = load(&[("AMQP_URLS", two), ("AMQP_URL", "amqp://ignored")]).unwrap();
        assert_eq!(s.amqp_url, two);
        assert_eq!(redact(two), "amqp://u:***@a:5672/%2f,amqp://u:***@b:5673/%2f");
        let said = redact_text(&format!("connecting to {two}: refused (p1, p,2)"), two);
        assert!(!said.contains("p1") && !said.contains("p,2"), "{said}");
        assert_eq!(load(&[("AMQP_URL", two)]).unwrap().amqp_url, two, "AMQP_URL may hold the list too");
        let err = load(&[("AMQP_URLS", "amqp://u:secret@a,amqp://b:notaport")]).unwrap_err().to_string();
        assert!(err.starts_with("AMQP_URLS=") && err.contains("several joined by commas") && !err.contains("secret"), "{err}");
    }

    #[test]
    fn the_inbox_retry_cap_is_at_least_one() {
        assert_eq!(load(&[("CRAIG_INBOX_RETRY_CAP", "3")]).unwrap().inbox_retry_cap, 3);
        let err = load(&[("CRAIG_INBOX_RETRY_CAP", "0")]).unwrap_err();
        assert!(err.to_string().contains("CRAIG_INBOX_RETRY_CAP"), "{err}");
    }

    #[test]
    fn rejects_inbox_equal_to_outbox_naming_both_values() {
        let err = load(&[("CRAIG_OUTBOX_RETENTION_DAYS", "30"), ("CRAIG_INBOX_RETENTION_DAYS", "30")])
            .unwrap_err();
        assert_eq!(err, SettingsError::InboxWindowTooShort { inbox_days: 30, outbox_days: 30 });
        let msg = err.to_string();
        assert!(msg.contains("inbox retention (30 d)") && msg.contains("outbox retention (30 d)"), "{msg}");
    }

    #[test]
    fn rejects_inbox_shorter_and_accepts_one_day_margin() {
        assert!(load(&[("CRAIG_INBOX_RETENTION_DAYS", "7")]).is_err());
        assert!(load(&[("CRAIG_OUTBOX_RETENTION_DAYS", "10"), ("CRAIG_INBOX_RETENTION_DAYS", "11")]).is_ok());
    }

    #[test]
    fn disabled_windows() {
        // Inbox kept forever: always safe.
        assert!(load(&[("CRAIG_INBOX_RETENTION_DAYS", "0")]).is_ok());
        // Outbox kept forever but inbox pruned: a replay can outlive its dedup record.
        assert_eq!(
            load(&[("CRAIG_OUTBOX_RETENTION_DAYS", "0")]).unwrap_err(),
            SettingsError::InboxWindowTooShort { inbox_days: 31, outbox_days: 0 }
        );
    }

    #[test]
    fn settings_that_disable_the_protocol_are_refused_with_value_and_rule() {
        for name in ["CRAIG_OUTBOX_CLAIM_LEASE_SECS", "CRAIG_OUTBOX_POLL_MS", "CRAIG_OUTBOX_BACKOFF_BASE_MS", "CRAIG_OUTBOX_BACKOFF_MAX_MS", "CRAIG_PUBLISH_CONFIRM_TIMEOUT_MS"] {
            let err = load(&[(name, "0")]).unwrap_err();
            assert!(matches!(&err, SettingsError::Unsafe { name: n, .. } if *n == name), "{name}: {err}");
            assert!(err.to_string().starts_with(&format!("{name}=0")) && err.to_string().contains(" is refused: "), "{err}");
        }
        // 2 × 5 s + 5 s = 15 s: a 14 s lease could expire under its own publish.
        let err = load(&[("CRAIG_OUTBOX_CLAIM_LEASE_SECS", "14")]).unwrap_err();
        let msg = err.to_string();
        assert!(msg.contains("CRAIG_OUTBOX_CLAIM_LEASE_SECS=14s") && msg.contains("= 15000ms"), "{msg}");
        assert!(load(&[("CRAIG_OUTBOX_CLAIM_LEASE_SECS", "15")]).is_ok());
        // Shorter timeouts allow a shorter lease (the harness runs 4 s leases this way).
        assert!(load(&[
            ("CRAIG_OUTBOX_CLAIM_LEASE_SECS", "4"),
            ("CRAIG_PUBLISH_CONFIRM_TIMEOUT_MS", "1500"),
            ("CRAIG_AMQP_CONNECT_TIMEOUT_MS", "1000"),
        ])
        .is_ok());
    }

    #[test]
    fn passwords_are_redacted() {
        assert_eq!(redact("postgres://u:s3cret@127.0.0.1:5432/db"), "postgres://u:***@127.0.0.1:5432/db");
        assert_eq!(redact("amqp://guest:guest@h:5672/%2f?heartbeat=5"), "amqp://guest:***@h:5672/%2f?heartbeat=5");
        assert_eq!(redact("postgres://u:p@ss:w@rd@h/db"), "postgres://u:***@h/db");
        assert_eq!(redact("postgres://u:pa/ss@h/db"), "postgres://u:***@h/db");
        assert_eq!(redact("postgres://u:pa?ss#x@h:notaport/db"), "postgres://u:***@h:notaport/db");
        assert_eq!(redact("postgres://postgres@127.0.0.1/db"), "postgres://postgres@127.0.0.1/db");
        assert_eq!(redact("not a url"), "not a url");
    }

    /// Issue 21.4, measured: `CRAIG_INBOX_RETENTION_DAYS=4294967295` passed `load()` and bound
    /// as -1 day, so every cycle deleted every dedup record. Every window is bounded on both
    /// sides of [`MAX_RETENTION_DAYS`].
    #[test]
    fn retention_windows_are_bounded_naming_the_value_and_the_rule() {
        let max = MAX_RETENTION_DAYS.to_string();
        let over = (MAX_RETENTION_DAYS + 1).to_string();
        let ok = load(&[("CRAIG_OUTBOX_RETENTION_DAYS", "30"), ("CRAIG_INBOX_RETENTION_DAYS", &max)]).unwrap();
        assert_eq!(ok.retention.inbox_days, MAX_RETENTION_DAYS);
        for (name, value) in [
            ("CRAIG_INBOX_RETENTION_DAYS", over.as_str()),
            ("CRAIG_INBOX_RETENTION_DAYS", "4294967295"),
            ("CRAIG_INBOX_RETENTION_DAYS", "100000000"),
            ("CRAIG_OUTBOX_RETENTION_DAYS", over.as_str()),
        ] {
            let err = load(&[(name, value), ("CRAIG_INBOX_RETENTION_DAYS", if name == "CRAIG_OUTBOX_RETENTION_DAYS" { "0" } else { value })])
                .unwrap_err();
            let msg = err.to_string();
            assert!(msg.contains(name) && msg.contains(value) && msg.contains(&max), "{name}={value}: {msg}");
        }
        let hours_max = (MAX_RETENTION_DAYS * 24).to_string();
        assert_eq!(load(&[("CRAIG_IDEMPOTENCY_TTL_HOURS", &hours_max)]).unwrap().retention.idempotency_hours, MAX_RETENTION_DAYS * 24);
        let hours_over = (MAX_RETENTION_DAYS * 24 + 1).to_string();
        let msg = load(&[("CRAIG_IDEMPOTENCY_TTL_HOURS", &hours_over)]).unwrap_err().to_string();
        assert!(msg.contains("CRAIG_IDEMPOTENCY_TTL_HOURS") && msg.contains(&hours_over), "{msg}");
        // The largest accepted window still computes a horizon (the replay rule).
        let r = Retention { outbox_days: MAX_RETENTION_DAYS, inbox_days: MAX_RETENTION_DAYS + 1, idempotency_hours: 24 };
        let now = chrono::Utc::now();
        assert!(crate::retention::replay_allowed(now - chrono::Duration::days(1), now, now, &r).is_ok());
    }

    /// Issue 21.4 (audit): every other numeric knob has a ceiling, tested on both sides.
    #[test]
    fn every_numeric_setting_has_a_ceiling() {
        for (name, max, _) in SETTING_CEILINGS {
            let over = (max + 1).to_string();
            let err = load(&[(name, over.as_str())]).unwrap_err().to_string();
            assert!(err.contains(name) && err.contains(&over), "{name}={over}: {err}");
        }
        for name in ["CRAIG_RETENTION_INTERVAL_SECS", "CRAIG_RETENTION_BATCH", "CRAIG_RETENTION_MAX_BATCHES", "CRAIG_OUTBOX_UNPUBLISHED_GRACE_SECS"] {
            let max = SETTING_CEILINGS.iter().find(|(n, ..)| *n == name).unwrap().1.to_string();
            assert!(load(&[(name, max.as_str())]).is_ok(), "{name}={max}");
        }
        let err = load(&[("CRAIG_RETENTION_BATCH", "99999999999999999999")]).unwrap_err().to_string();
        assert!(err.contains("CRAIG_RETENTION_BATCH"), "{err}");
        assert!(Retention { outbox_days: MAX_RETENTION_DAYS + 1, inbox_days: 0, idempotency_hours: 1 }.check().is_err());
    }

    /// Issue 21.7 (audit): a misspelled password key, and an AMQP URL the client cannot
    /// read, are refused at load with the URL redacted (a driver would print them whole).
    #[test]
    fn urls_a_driver_would_print_whole_are_refused_redacted() {
        let err = load(&[("DATABASE_URL", "postgres://app@h/x?Password=s3cr3t")]).unwrap_err().to_string();
        assert!(err.contains("DATABASE_URL") && !err.contains("s3cr3t"), "{err}");
        let err = load(&[("AMQP_URL", "amqp:guest:s3cr3t@h")]).unwrap_err().to_string();
        assert!(err.contains("AMQP_URL") && !err.contains("s3cr3t"), "{err}");
        assert!(load(&[("AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/%2f?heartbeat=5")]).is_ok());
    }

    /// Issue 21.7, measured: a password given as a query parameter was printed.
    #[test]
    fn passwords_in_the_query_are_redacted_too() {
        assert_eq!(
            redact("postgres://app@127.0.0.1:1/x?password=s3cr3t&sslmode=bogus"),
            "postgres://app@127.0.0.1:1/x?password=***&sslmode=bogus"
        );
        assert_eq!(redact("postgres://app@h/x?sslmode=disable&PassWord=s3cr3t"), "postgres://app@h/x?sslmode=disable&PassWord=***");
        assert_eq!(redact("postgres://app:u@h/x?password=q#frag"), "postgres://app:***@h/x?password=***#frag");
        assert_eq!(redact("amqp://guest@h/%2f?password=s3cr3t&heartbeat=5"), "amqp://guest@h/%2f?password=***&heartbeat=5");
        // Audit findings: an '@' in the query value, an encoded key, a URL without '//'.
        assert!(!redact("postgres://app@h:5432/x?password=abc@def").contains("def"), "{}", redact("postgres://app@h:5432/x?password=abc@def"));
        assert!(!redact("postgres://app@h:5432/x?password=abc@def").contains("abc"));
        assert_eq!(redact("postgres://app@h/x?pass%77ord=s3cr3t"), "postgres://app@h/x?pass%77ord=***");
        assert_eq!(redact("amqp:guest:s3cr3t@h"), "amqp:guest:***@h");
        assert_eq!(misspelled_password_key("postgres://app@h/x?Password=s3cr3t"), Some("Password".to_owned()));
        assert_eq!(misspelled_password_key("postgres://app@h/x?pass%77ord=s3cr3t"), Some("pass%77ord".to_owned()));
        assert_eq!(misspelled_password_key("postgres://app@h/x?password=s3cr3t&sslmode=require"), None);
        let at = redact_text("error for postgres://app@h:5432/x?password=abc@def: abc@def", "postgres://app@h:5432/x?password=abc@def");
        assert!(!at.contains("abc") && !at.contains("def"), "{at}");
        let text = "invalid sslmode in postgres://app@h/x?password=s3cr3t&sslmode=bogus (password s3cr3t, s3cr%33t)";
        let out = redact_text(text, "postgres://app@h/x?password=s3cr%33t&sslmode=bogus");
        assert!(!out.contains("s3cr"), "{out}");
    }

    /// Issue 21.1: the DLQ park and its cap are settable, and refused out of range.
    #[test]
    fn the_dlq_park_and_its_cap_are_settable() {
        let s = load(&[("CRAIG_DLQ_PARK_MS", "500"), ("CRAIG_DLQ_MAX_PARKS", "2"), ("CRAIG_DLQ_REDRIVE_SECS", "0")]).unwrap();
        assert_eq!((s.dlq_retry.park_delay(), s.dlq_retry.max_parks(), s.dlq_redrive), (Duration::from_millis(500), 2, None));
        let d = load(&[]).unwrap();
        assert_eq!((d.dlq_retry, d.dlq_redrive), (crate::dlq::DlqRetryConfig::default(), Some(Duration::from_secs(60))));
        for (name, value) in [("CRAIG_DLQ_PARK_MS", "100"), ("CRAIG_DLQ_PARK_MS", "600001"), ("CRAIG_DLQ_MAX_PARKS", "0"), ("CRAIG_DLQ_MAX_PARKS", "99999999999"), ("CRAIG_DLQ_REDRIVE_SECS", "86401")] {
            let err = load(&[(name, value)]).unwrap_err().to_string();
            assert!(err.contains(name) && err.contains(value), "{name}={value}: {err}");
        }
    }

    #[test]
    fn garbage_is_a_typed_error_naming_the_variable() {
        let err = load(&[("CRAIG_OUTBOX_BATCH", "many")]).unwrap_err();
        assert!(matches!(err, SettingsError::Invalid { name: "CRAIG_OUTBOX_BATCH", .. }));
        assert!(load(&[("CRAIG_OUTBOX_BATCH", "0")]).is_err());
    }
}
