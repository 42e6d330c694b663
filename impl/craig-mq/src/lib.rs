//! `craig-mq`: the eventing half of ADR-022 "Event Durability + Idempotency".
//!
//! One module per decision, named as the ADR names it:
//!
//! | module | ADR section |
//! |---|---|
//! | [`envelope`] | the event envelope (CONTRACT § AMQP) |
//! | [`publisher`] | §D1 publisher, #1128 publisher confirms |
//! | [`outbox`] | §D1 transactional outbox, #1128 claim-lease drain |
//! | [`inbox`] | §D2 idempotent inbox, #1180 boundary, #1196 consumer identity |
//! | [`topology`] | §D3 DLX/DLQ wiring |
//! | [`subscriber`] | §D3 consumer sessions, #1197 ack-failure posture |
//! | [`dlq`] | §D3 DLQ consumer: #1181 occurrence tokens, #1196 queue identity, #1197 no log-and-ack |
//! | [`metrics`] | the Prometheus instruments (CONTRACT § Metrics) |
//! | [`retention`] | § Retention policy enforced (#965/#1129): the prune, the replay rule |
//! | [`settings`] | § Retention policy (#965/#1129), worker knobs |
//! | [`crash`] | crash points for the harness (feature `failpoints`) |

pub mod crash;
pub mod dlq;
pub mod envelope;
pub mod inbox;
pub mod metrics;
pub mod outbox;
pub mod publisher;
pub mod retention;
pub mod settings;
pub mod subscriber;
pub mod topology;

pub use envelope::{EnvelopeError, EventEnvelope};
pub use inbox::{InboxError, InboxOutcome, handle_idempotently};
pub use outbox::{DrainMode, OutboxConfig, OutboxWorker, publish_in_tx, refused_envelope};
pub use publisher::{PublishError, Publisher, PublisherConfig};
pub use settings::{Retention, ServiceSettings, SettingsError};
