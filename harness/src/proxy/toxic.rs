//! Toxiproxy's toxic model, as its HTTP API spells it: `{"name", "type", "stream",
//! "toxicity", "attributes": {...}}`. Units follow Toxiproxy: milliseconds, KB/s, bytes,
//! and microseconds for the slicer's `delay`.

use serde::{Deserialize, Serialize};

/// Which way the data a toxic acts on flows. `upstream` is client → server.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum Stream {
    Upstream,
    #[default]
    Downstream,
}

impl Stream {
    pub fn as_str(self) -> &'static str {
        match self {
            Stream::Upstream => "upstream",
            Stream::Downstream => "downstream",
        }
    }
}

/// The toxic types and their attributes (missing attributes default to 0, as in Toxiproxy).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", content = "attributes", rename_all = "snake_case")]
pub enum ToxicKind {
    /// Delay each chunk by `latency` ± `jitter` ms.
    Latency {
        #[serde(default)]
        latency: u64,
        #[serde(default)]
        jitter: u64,
    },
    /// Limit throughput to `rate` KB/s.
    Bandwidth {
        #[serde(default)]
        rate: u64,
    },
    /// Delay the close of the connection by `delay` ms after the source closes.
    SlowClose {
        #[serde(default)]
        delay: u64,
    },
    /// Drop all data; close the connection `timeout` ms after the last chunk (0: never).
    Timeout {
        #[serde(default)]
        timeout: u64,
    },
    /// On the next chunk, wait `timeout` ms and reset the connection (TCP RST).
    ResetPeer {
        #[serde(default)]
        timeout: u64,
    },
    /// Cut data into pieces of `average_size` ± `size_variation` bytes, `delay` µs apart.
    Slicer {
        #[serde(default)]
        average_size: usize,
        #[serde(default)]
        size_variation: usize,
        #[serde(default)]
        delay: u64,
    },
    /// Close the connection once `bytes` have passed.
    LimitData {
        #[serde(default)]
        bytes: u64,
    },
}

impl ToxicKind {
    /// How a report names it: the type (which the checkers read), and for `latency` the
    /// most it delays a chunk (`latency 1200ms`), for the reader.
    pub fn label(&self) -> String {
        match self {
            ToxicKind::Latency { latency, jitter } => format!("latency {}ms", latency.saturating_add(*jitter)),
            other => other.type_name().to_owned(),
        }
    }

    pub fn type_name(&self) -> &'static str {
        match self {
            ToxicKind::Latency { .. } => "latency",
            ToxicKind::Bandwidth { .. } => "bandwidth",
            ToxicKind::SlowClose { .. } => "slow_close",
            ToxicKind::Timeout { .. } => "timeout",
            ToxicKind::ResetPeer { .. } => "reset_peer",
            ToxicKind::Slicer { .. } => "slicer",
            ToxicKind::LimitData { .. } => "limit_data",
        }
    }
}

/// One toxic on a proxy.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Toxic {
    #[serde(default)]
    pub name: String,
    #[serde(default)]
    pub stream: Stream,
    #[serde(default = "one")]
    pub toxicity: f32,
    #[serde(flatten)]
    pub kind: ToxicKind,
}

fn one() -> f32 {
    1.0
}

impl Toxic {
    /// A toxic at toxicity 1, named as Toxiproxy names it by default (`<type>_<stream>`).
    pub fn new(stream: Stream, kind: ToxicKind) -> Self {
        Self { name: format!("{}_{}", kind.type_name(), stream.as_str()), stream, toxicity: 1.0, kind }
    }

    pub fn named(mut self, name: impl Into<String>) -> Self {
        self.name = name.into();
        self
    }

    pub fn toxicity(mut self, p: f32) -> Self {
        self.toxicity = p;
        self
    }

    /// Fill the default name and check the values Toxiproxy would refuse.
    pub fn normalized(mut self) -> Result<Self, String> {
        if self.name.is_empty() {
            self.name = format!("{}_{}", self.kind.type_name(), self.stream.as_str());
        }
        if !(0.0..=1.0).contains(&self.toxicity) || self.toxicity.is_nan() {
            return Err(format!("toxicity {} is outside 0..=1", self.toxicity));
        }
        if let ToxicKind::Slicer { average_size: 0, .. } = self.kind {
            return Err("slicer average_size must be at least 1".into());
        }
        Ok(self)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The report's label says what a toxic does to a request (sentinel_integrity reads it):
    /// a latency toxic's most delay per chunk, the type for the rest.
    #[test]
    fn a_label_names_the_type_and_a_latency_its_most_delay() {
        assert_eq!(ToxicKind::Latency { latency: 800, jitter: 400 }.label(), "latency 1200ms");
        assert_eq!(ToxicKind::Latency { latency: u64::MAX, jitter: 1 }.label(), format!("latency {}ms", u64::MAX));
        assert_eq!(ToxicKind::Timeout { timeout: 0 }.label(), "timeout");
        assert_eq!(ToxicKind::ResetPeer { timeout: 5 }.label(), "reset_peer");
    }

    #[test]
    fn parses_toxiproxy_json_and_fills_defaults() {
        let t: Toxic = serde_json::from_str(r#"{"type":"latency","attributes":{"latency":100}}"#).unwrap();
        let t = t.normalized().unwrap();
        assert_eq!(t.name, "latency_downstream");
        assert_eq!(t.stream, Stream::Downstream);
        assert_eq!(t.toxicity, 1.0);
        assert_eq!(t.kind, ToxicKind::Latency { latency: 100, jitter: 0 });
    }

    #[test]
    fn serializes_as_toxiproxy_does() {
        let t = Toxic::new(Stream::Upstream, ToxicKind::LimitData { bytes: 10 });
        let v = serde_json::to_value(&t).unwrap();
        assert_eq!(
            v,
            serde_json::json!({"name": "limit_data_upstream", "stream": "upstream", "toxicity": 1.0,
                               "type": "limit_data", "attributes": {"bytes": 10}})
        );
    }

    #[test]
    fn refuses_bad_values() {
        let t: Toxic = serde_json::from_str(r#"{"type":"slicer","attributes":{}}"#).unwrap();
        assert!(t.normalized().is_err());
        let t = Toxic::new(Stream::Upstream, ToxicKind::Timeout { timeout: 0 }).toxicity(1.5);
        assert!(t.normalized().is_err());
        assert!(serde_json::from_str::<Toxic>(r#"{"type":"nope","attributes":{}}"#).is_err());
    }
}
