//! Compat modes (CONTRACT § Compat modes): each reproduces the behaviour an ADR-022
//! amendment removed, so the harness can show a checker going red and a mixed fleet
//! behaving as the ADR says. A mode that is named by the contract but not built yet is
//! refused at start-up, never silently ignored.

use std::fmt;
use std::str::FromStr;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Compat {
    /// §D1 context item 1: publish after commit, warn on failure.
    PreD1,
    /// §D2 context item 2: no inbox; every delivery runs the handler.
    PreD2,
    /// §D3 context item 3: consumer queues declared without DLX arguments.
    PreD3,
    /// §D5 context item 5: idempotency in memory, per process (lost on restart, not shared).
    PreD5,
    /// #965/#1129: the prune deletes pending outbox rows too and windows the inbox like the
    /// outbox.
    Pre965,
    /// #1128: locks held across publishes, no publisher confirms, one batch a tick.
    Pre1128,
    /// #1156: the DLQ threshold event re-emits on every arrival over the threshold.
    Pre1156,
    /// #1179: the payment handler without the arbiter (a plain INSERT behind the inbox
    /// alone), on the schema without it (`migrate --compat pre-1179`).
    Pre1179,
    /// #1181: no per-occurrence idempotency; every DLQ delivery records a row, and the app
    /// path mints its token per call.
    Pre1181,
    /// #1183: the capped `to_bytes` that stored an over-cap 2xx with an empty body.
    Pre1183,
    /// #1184: the query string left out of the idempotency cache key.
    Pre1184,
    /// #1185: the send queue's boot-time sweep keyed on `next_attempt_at`, claims without a
    /// timestamp or generation, bare-id finalizers, no terminal guard on the transaction.
    Pre1185,
    /// #1196: the app dead-letter path keyed by the producer (`dlq.craig-<source_service>`).
    Pre1196,
    /// #1197: the DLQ consumer logs a failure and acks anyway.
    Pre1197,
}

const NAMES: &[(&str, Compat)] = &[
    ("pre-d1", Compat::PreD1),
    ("pre-d2", Compat::PreD2),
    ("pre-d3", Compat::PreD3),
    ("pre-d5", Compat::PreD5),
    ("pre-965", Compat::Pre965),
    ("pre-1128", Compat::Pre1128),
    ("pre-1156", Compat::Pre1156),
    ("pre-1179", Compat::Pre1179),
    ("pre-1181", Compat::Pre1181),
    ("pre-1183", Compat::Pre1183),
    ("pre-1184", Compat::Pre1184),
    ("pre-1185", Compat::Pre1185),
    ("pre-1196", Compat::Pre1196),
    ("pre-1197", Compat::Pre1197),
];

impl Compat {
    pub fn name(self) -> &'static str {
        NAMES.iter().find(|(_, c)| *c == self).map(|(n, _)| *n).expect("every mode is named")
    }

    /// Whether this build implements the mode.
    pub fn implemented(self) -> bool {
        matches!(
            self,
            Compat::PreD1
                | Compat::PreD2
                | Compat::PreD3
                | Compat::PreD5
                | Compat::Pre965
                | Compat::Pre1128
                | Compat::Pre1156
                | Compat::Pre1179
                | Compat::Pre1181
                | Compat::Pre1183
                | Compat::Pre1184
                | Compat::Pre1185
                | Compat::Pre1196
                | Compat::Pre1197
        )
    }
}

impl fmt::Display for Compat {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum CompatError {
    #[error("unknown compat mode {0:?}; known: {known}", known = known_names())]
    Unknown(String),
    #[error("compat mode {0} is in the contract but not implemented in this build yet")]
    NotImplemented(Compat),
}

fn known_names() -> String {
    NAMES.iter().map(|(n, _)| *n).collect::<Vec<_>>().join(", ")
}

impl FromStr for Compat {
    type Err = CompatError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let mode = NAMES
            .iter()
            .find(|(n, _)| *n == s)
            .map(|(_, c)| *c)
            .ok_or_else(|| CompatError::Unknown(s.to_owned()))?;
        if mode.implemented() { Ok(mode) } else { Err(CompatError::NotImplemented(mode)) }
    }
}

/// Compat `pre-d1` (ADR-022 context item 1): publish straight to the broker AFTER the
/// commit and only warn when that fails — the event is then lost. Not used otherwise.
pub struct DirectPublisher {
    amqp_url: String,
    cfg: craig_mq::PublisherConfig,
    inner: tokio::sync::Mutex<Option<craig_mq::Publisher>>,
}

impl DirectPublisher {
    pub fn new(amqp_url: impl Into<String>, cfg: craig_mq::PublisherConfig) -> Self {
        Self { amqp_url: amqp_url.into(), cfg, inner: tokio::sync::Mutex::new(None) }
    }

    pub async fn publish(&self, env: &craig_mq::EventEnvelope) -> Result<(), craig_mq::PublishError> {
        let mut guard = self.inner.lock().await;
        if guard.as_ref().is_none_or(|p| !p.is_usable()) {
            *guard = Some(craig_mq::Publisher::connect(&self.amqp_url, self.cfg).await?);
        }
        guard.as_ref().expect("just set").publish(env).await
    }
}

/// The set of modes a node runs with.
#[derive(Debug, Clone, Default)]
pub struct CompatSet(Vec<Compat>);

impl CompatSet {
    pub fn new(modes: impl IntoIterator<Item = Compat>) -> Self {
        Self(modes.into_iter().collect())
    }
    pub fn has(&self, mode: Compat) -> bool {
        self.0.contains(&mode)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_contract_mode_parses_and_an_unknown_one_is_refused() {
        assert_eq!("pre-d2".parse::<Compat>(), Ok(Compat::PreD2));
        assert_eq!("pre-1183".parse::<Compat>(), Ok(Compat::Pre1183));
        assert!(NAMES.iter().all(|(_, m)| m.implemented()), "every contract mode is built");
        let err = "pre-9999".parse::<Compat>().unwrap_err();
        assert!(err.to_string().contains("pre-1197"), "{err}");
        for (name, mode) in NAMES {
            assert_eq!(mode.name(), *name);
        }
    }
}
