//! Publisher with publisher confirms — ADR-022 §D1 and Amendment #1128 ("Publisher confirms
//! enabled (bootstrap confirm_select): published_at now means 'broker ACKed', not 'written to
//! socket'; a broker Nack maps to a typed publish error and the row stays pending").
//!
//! Every publish is `mandatory` (CONTRACT § fleet): a message that reached no queue comes
//! back with the ACK (`Confirmation::Ack(Some(returned))`), and that is a failure
//! (`Unroutable`), never success: on a fresh vhost whose consumer queues do not exist yet
//! the broker would otherwise ACK, and the outbox would stamp, an event nobody can ever see.
//!
//! The failure kinds stay distinct ([`PublishError`]). Row-level, where the broker is healthy
//! and refused THIS message ([`PublishError::is_row_level`]): it said no (`Nacked`) or had no
//! route for it (`Unroutable`). Broker-level: the broker said nothing within the confirm
//! timeout (`ConfirmTimeout`, e.g. a black-holed link) or the connection or channel failed
//! (`Connection`). Only an ACK without a returned message is success.
//! After a timeout or a connection error the publisher is [poisoned](Publisher::is_usable):
//! its channel state is unknown, so the caller drops it and reconnects.
//!
//! Lost confirms surface in lapin only through the heartbeat or our own timeout, so both
//! are set: the heartbeat on the connection URI, the timeout around every confirm.

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use lapin::options::{BasicPublishOptions, ConfirmSelectOptions};
use lapin::Confirmation;
use lapin::types::ShortString;
use lapin::{BasicProperties, Channel, Connection, ConnectionProperties};
use tokio::time::{Instant, timeout_at};
use uuid::Uuid;

use crate::envelope::EventEnvelope;
use crate::topology::EVENTS_EXCHANGE;

/// Connection knobs that decide how fast a dead broker is noticed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PublisherConfig {
    /// AMQP heartbeat, seconds (0 disables; not recommended).
    pub heartbeat_secs: u16,
    /// How long to wait for the broker's confirm of a publish (or a batch of them).
    pub confirm_timeout: Duration,
    /// How long an AMQP handshake may take before the connection counts as failed: a
    /// black-holed broker must not hang a worker in `connect`.
    pub connect_timeout: Duration,
}

impl Default for PublisherConfig {
    fn default() -> Self {
        Self { heartbeat_secs: 5, confirm_timeout: Duration::from_secs(5), connect_timeout: CONNECT_TIMEOUT }
    }
}

impl PublisherConfig {
    /// The longest one claimed batch can stay in flight: the connect, then the two phases of
    /// [`Publisher::publish_batch`] (write, confirm), each bounded by the confirm timeout. A
    /// claim lease shorter than this could expire while its own publish is still running.
    pub fn worst_case_publish(&self) -> Duration {
        self.confirm_timeout.saturating_mul(2).saturating_add(self.connect_timeout)
    }
}

#[derive(Debug, thiserror::Error)]
pub enum PublishError {
    #[error("broker nacked envelope {id}")]
    Nacked { id: Uuid },
    /// The broker returned the mandatory message: no queue is bound for its routing key.
    #[error("broker returned envelope {id} as unroutable (no queue bound for {routing_key:?}): {reply_code} {reply_text}")]
    Unroutable { id: Uuid, routing_key: String, reply_code: u16, reply_text: String },
    #[error("no publisher confirm for envelope {id} within {after:?}")]
    ConfirmTimeout { id: Uuid, after: Duration },
    #[error("AMQP connection or channel failed: {0}")]
    Connection(#[from] lapin::Error),
    #[error("AMQP channel has no publisher confirms; refusing to count an unconfirmed publish")]
    NotConfirmed { id: Uuid },
}

impl PublishError {
    /// Whether the channel can still be trusted after this error.
    pub fn poisons_channel(&self) -> bool {
        !self.is_row_level()
    }

    /// The broker is healthy and refused this one message (Nack, no route): the row backs
    /// off on its own and the drain goes on. Everything else is broker-level and backs the
    /// whole worker off.
    pub fn is_row_level(&self) -> bool {
        matches!(self, PublishError::Nacked { .. } | PublishError::Unroutable { .. })
    }

    /// Short stable label for metrics and `last_error` prefixes.
    pub fn kind(&self) -> &'static str {
        match self {
            PublishError::Nacked { .. } => "nacked",
            PublishError::Unroutable { .. } => "unroutable",
            PublishError::ConfirmTimeout { .. } => "confirm_timeout",
            PublishError::Connection(_) => "connection",
            // A channel without confirms is a broken channel, as far as the CONTRACT's
            // `outbox_publish_errors_total{kind}` labels go.
            PublishError::NotConfirmed { .. } => "connection",
        }
    }
}

/// A confirm-mode channel to `craig.events` on its own connection.
pub struct Publisher {
    conn: Connection,
    channel: Channel,
    cfg: PublisherConfig,
    poisoned: AtomicBool,
    confirms: bool,
}

/// Add `heartbeat=N` to an AMQP URI unless the caller already chose one.
pub fn with_heartbeat(amqp_url: &str, heartbeat_secs: u16) -> String {
    if amqp_url.contains("heartbeat=") {
        return amqp_url.to_owned();
    }
    let sep = if amqp_url.contains('?') { '&' } else { '?' };
    format!("{amqp_url}{sep}heartbeat={heartbeat_secs}")
}

/// The default bound on an AMQP handshake ([`PublisherConfig::connect_timeout`]).
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

/// Open an AMQP connection with the heartbeat set and a connection name for the broker UI,
/// bounded by [`CONNECT_TIMEOUT`] (an `IOError` of kind `TimedOut` past it).
pub async fn connect(amqp_url: &str, heartbeat_secs: u16, name: &str) -> Result<Connection, lapin::Error> {
    connect_within(amqp_url, heartbeat_secs, name, CONNECT_TIMEOUT).await
}

/// [`connect`] with its own handshake bound, per endpoint.
///
/// Several broker endpoints (issue 25: `amqp_url` a list, [`crate::settings::amqp_endpoints`]):
/// the endpoints are tried in turn, starting where the process's last connection succeeded,
/// and the first that completes the handshake is used; a failure moves on to the next. The
/// starting point moves BEFORE each try, so a caller whose own bound cancels a try (a node
/// that hangs) starts its next connect at the next node, never at the hung one again; a
/// success brings it back to the node that answered. Every node and every connection of the
/// process (publisher, consumers, the DLQ consumer) goes through here.
pub async fn connect_within(amqp_url: &str, heartbeat_secs: u16, name: &str, within: Duration) -> Result<Connection, lapin::Error> {
    let endpoints = crate::settings::amqp_endpoints(amqp_url);
    let n = endpoints.len();
    // Wrapped by `(first + k) % n` below (it is i + 1 of the last try, plus one per
    // skip_endpoint since: nowhere near overflow).
    let first = NEXT_ENDPOINT.load(std::sync::atomic::Ordering::Relaxed);
    let mut last = None;
    for k in 0..n {
        let i = (first + k) % n;
        NEXT_ENDPOINT.store(i + 1, std::sync::atomic::Ordering::Relaxed);
        match connect_one(endpoints[i], heartbeat_secs, name, within).await {
            Ok(conn) => {
                NEXT_ENDPOINT.store(i, std::sync::atomic::Ordering::Relaxed);
                if n > 1 {
                    // Info: rare (a connect), and the one record of which node a process
                    // publishes or consumes through (redacted: no password).
                    tracing::info!(event = "amqp.endpoint_connected", endpoint = i, endpoints = n, name,
                        url = %crate::settings::redact(endpoints[i]));
                }
                return Ok(conn);
            }
            Err(e) => {
                if n > 1 {
                    tracing::warn!(event = "amqp.endpoint_failed", endpoint = i, endpoints = n, name,
                        error = %crate::settings::redact_text(&e.to_string(), endpoints[i]), "trying the next broker endpoint");
                }
                last = Some(e);
            }
        }
    }
    Err(last.expect("at least one endpoint"))
}

/// Where the next [`connect_within`] of this process starts in its endpoint list.
static NEXT_ENDPOINT: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

/// The endpoint the last connection went to took the login but failed the caller's set-up
/// (a node that cannot serve yet: no exchanges, a queue it refuses): the next connect starts
/// at the next endpoint, never sticking to it.
pub fn skip_endpoint() {
    NEXT_ENDPOINT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
}

async fn connect_one(amqp_url: &str, heartbeat_secs: u16, name: &str, within: Duration) -> Result<Connection, lapin::Error> {
    let props = ConnectionProperties::default().with_connection_name(name.into());
    match tokio::time::timeout(within, Connection::connect(&with_heartbeat(amqp_url, heartbeat_secs), props)).await {
        Ok(res) => res,
        Err(_) => Err(lapin::ErrorKind::IOError(std::sync::Arc::new(std::io::Error::new(
            std::io::ErrorKind::TimedOut,
            format!("AMQP handshake not finished within {within:?}"),
        )))
        .into()),
    }
}

impl Publisher {
    /// Connect and enable publisher confirms (`confirm.select`).
    pub async fn connect(amqp_url: &str, cfg: PublisherConfig) -> Result<Self, PublishError> {
        Self::connect_with(amqp_url, cfg, true).await
    }

    /// Connect WITHOUT confirms: the pre-#1128 behaviour, for compat mode `pre-1128` only.
    /// [`Publisher::publish_batch`] then reports success once the frames are written.
    pub async fn connect_unconfirmed(amqp_url: &str, cfg: PublisherConfig) -> Result<Self, PublishError> {
        Self::connect_with(amqp_url, cfg, false).await
    }

    /// The whole set-up (handshake, channel, exchange declarations, `confirm.select`) is
    /// bounded by `connect_timeout`, which the claim lease budgets for
    /// ([`PublisherConfig::worst_case_publish`]).
    async fn connect_with(amqp_url: &str, cfg: PublisherConfig, confirms: bool) -> Result<Self, PublishError> {
        match tokio::time::timeout(cfg.connect_timeout, Self::set_up(amqp_url, cfg, confirms)).await {
            Ok(res) => res.inspect_err(|_| skip_endpoint()),
            Err(_) => Err(PublishError::Connection(
                lapin::ErrorKind::IOError(std::sync::Arc::new(std::io::Error::new(
                    std::io::ErrorKind::TimedOut,
                    format!("AMQP connection set-up not finished within {:?}", cfg.connect_timeout),
                )))
                .into(),
            )),
        }
    }

    async fn set_up(amqp_url: &str, cfg: PublisherConfig, confirms: bool) -> Result<Self, PublishError> {
        let conn = connect_within(amqp_url, cfg.heartbeat_secs, "craig-publisher", cfg.connect_timeout).await?;
        let channel = conn.create_channel().await?;
        // The exchanges are operator-owned (#1202): a missing one fails the set-up here,
        // named, instead of turning every publish into a 404 that closes the channel.
        crate::topology::require_exchanges(&channel).await?;
        if confirms {
            channel.confirm_select(ConfirmSelectOptions::default()).await?;
        }
        Ok(Self { conn, channel, cfg, poisoned: AtomicBool::new(false), confirms })
    }

    /// False once a timeout or connection error left the channel in an unknown state.
    pub fn is_usable(&self) -> bool {
        !self.poisoned.load(Ordering::Relaxed) && self.conn.status().connected() && self.channel.status().connected()
    }

    /// Publish one envelope and wait for its confirm.
    pub async fn publish(&self, envelope: &EventEnvelope) -> Result<(), PublishError> {
        self.publish_batch(std::slice::from_ref(envelope)).await.remove(0)
    }

    /// Publish a batch pipelined (all frames first, then all confirms), one result per
    /// envelope in order. The whole batch shares one deadline per phase, so a
    /// black-holed link costs at most `2 × confirm_timeout`.
    pub async fn publish_batch(&self, envelopes: &[EventEnvelope]) -> Vec<Result<(), PublishError>> {
        let timeout = self.cfg.confirm_timeout;
        let deadline = Instant::now() + timeout;
        let mut pending = Vec::with_capacity(envelopes.len());
        // Once a write fails or blocks, the rest of the batch is not attempted: it fails
        // with the same cause and stays pending.
        let mut broken: Option<PublishError> = None;
        for env in envelopes {
            if let Some(cause) = &broken {
                pending.push(Err(match cause {
                    PublishError::Connection(e) => PublishError::Connection(e.clone()),
                    _ => PublishError::ConfirmTimeout { id: env.id, after: timeout },
                }));
                continue;
            }
            let props = BasicProperties::default()
                .with_message_id(ShortString::from(env.id.to_string()))
                .with_content_type(ShortString::from("application/json"))
                .with_delivery_mode(2)
                .with_type(ShortString::from(env.event_type.as_str()))
                .with_timestamp(env.occurred_at.timestamp().max(0) as u64);
            let sent = timeout_at(
                deadline,
                self.channel.basic_publish(
                    ShortString::from(EVENTS_EXCHANGE),
                    ShortString::from(env.event_type.as_str()),
                    // Mandatory under confirms: an unroutable message comes back with its ACK.
                    // The pre-#1128 unconfirmed mode never learned of returns.
                    BasicPublishOptions { mandatory: self.confirms, immediate: false },
                    &env.to_vec(),
                    props,
                ),
            )
            .await;
            match sent {
                Ok(Ok(confirm)) => pending.push(Ok(confirm)),
                Ok(Err(e)) => {
                    broken = Some(PublishError::Connection(e.clone()));
                    pending.push(Err(self.poison(e)));
                }
                Err(_) => {
                    self.poisoned.store(true, Ordering::Relaxed);
                    broken = Some(PublishError::ConfirmTimeout { id: env.id, after: timeout });
                    pending.push(Err(PublishError::ConfirmTimeout { id: env.id, after: timeout }));
                }
            }
        }
        // Confirms first, verdicts after: lapin hands a returned message to whichever confirm
        // completes next (and settles a multiple-ack in no fixed order), not necessarily to
        // its own publish. So every return of the batch is collected and matched to its row by
        // `message_id` (the envelope id); only an ACK whose envelope came back from no return
        // is a success.
        let deadline = Instant::now() + timeout;
        let mut confirmed: Vec<Result<Confirmation, PublishError>> = Vec::with_capacity(envelopes.len());
        for (env, p) in envelopes.iter().zip(pending) {
            confirmed.push(match p {
                Ok(confirm) => match timeout_at(deadline, confirm).await {
                    Ok(Ok(c)) => Ok(c),
                    Ok(Err(e)) => Err(self.poison(e)),
                    Err(_) => {
                        self.poisoned.store(true, Ordering::Relaxed);
                        Err(PublishError::ConfirmTimeout { id: env.id, after: timeout })
                    }
                },
                Err(e) => Err(e),
            });
        }
        let mut returned: std::collections::HashMap<String, (u16, String)> = std::collections::HashMap::new();
        for c in confirmed.iter().flatten() {
            if let Confirmation::Ack(Some(r)) | Confirmation::Nack(Some(r)) = c {
                let id = r.delivery.properties.message_id().as_ref().map(|s| s.to_string()).unwrap_or_default();
                returned.insert(id, (r.reply_code, r.reply_text.to_string()));
            }
        }
        envelopes
            .iter()
            .zip(confirmed)
            .map(|(env, c)| {
                let c = c?;
                // The broker ACKs a returned message too: no queue took it, so it is NOT
                // published (ADR-022 #1128: published_at means "a queue has it").
                if let Some((reply_code, reply_text)) = returned.get(&env.id.to_string()) {
                    return Err(PublishError::Unroutable {
                        id: env.id,
                        routing_key: env.event_type.clone(),
                        reply_code: *reply_code,
                        reply_text: reply_text.clone(),
                    });
                }
                match c {
                    Confirmation::Ack(_) => Ok(()),
                    Confirmation::Nack(_) => Err(PublishError::Nacked { id: env.id }),
                    Confirmation::NotRequested if !self.confirms => Ok(()),
                    Confirmation::NotRequested => Err(PublishError::NotConfirmed { id: env.id }),
                }
            })
            .collect()
    }

    /// Publish one message that is not an event to `exchange` under `routing_key` (the
    /// app-path dead letter on `craig.dlx`, #1196) and wait for its confirm, with the same
    /// rules as [`Self::publish_batch`]: mandatory, a returned message is `Unroutable`, only
    /// an ACK without a return is success. `id` becomes the `message_id`.
    pub async fn publish_raw(&self, exchange: &str, routing_key: &str, body: &[u8], id: Uuid) -> Result<(), PublishError> {
        let timeout = self.cfg.confirm_timeout;
        let props = BasicProperties::default()
            .with_message_id(ShortString::from(id.to_string()))
            .with_content_type(ShortString::from("application/json"))
            .with_delivery_mode(2);
        let sent = timeout_at(
            Instant::now() + timeout,
            self.channel.basic_publish(
                ShortString::from(exchange),
                ShortString::from(routing_key),
                BasicPublishOptions { mandatory: self.confirms, immediate: false },
                body,
                props,
            ),
        )
        .await;
        let confirm = match sent {
            Ok(Ok(confirm)) => confirm,
            Ok(Err(e)) => return Err(self.poison(e)),
            Err(_) => {
                self.poisoned.store(true, Ordering::Relaxed);
                return Err(PublishError::ConfirmTimeout { id, after: timeout });
            }
        };
        match timeout_at(Instant::now() + timeout, confirm).await {
            Ok(Ok(Confirmation::Ack(Some(r)) | Confirmation::Nack(Some(r)))) => Err(PublishError::Unroutable {
                id,
                routing_key: routing_key.to_owned(),
                reply_code: r.reply_code,
                reply_text: r.reply_text.to_string(),
            }),
            Ok(Ok(Confirmation::Ack(None))) => Ok(()),
            Ok(Ok(Confirmation::Nack(None))) => Err(PublishError::Nacked { id }),
            Ok(Ok(Confirmation::NotRequested)) if !self.confirms => Ok(()),
            Ok(Ok(Confirmation::NotRequested)) => Err(PublishError::NotConfirmed { id }),
            Ok(Err(e)) => Err(self.poison(e)),
            Err(_) => {
                self.poisoned.store(true, Ordering::Relaxed);
                Err(PublishError::ConfirmTimeout { id, after: timeout })
            }
        }
    }

    fn poison(&self, e: lapin::Error) -> PublishError {
        self.poisoned.store(true, Ordering::Relaxed);
        PublishError::Connection(e)
    }

    /// Close the connection, bounded: a dead peer must not hang shutdown.
    pub async fn close(self) {
        let _ = tokio::time::timeout(Duration::from_secs(2), self.conn.close(200, ShortString::from("bye"))).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn heartbeat_is_added_once() {
        assert_eq!(with_heartbeat("amqp://h/%2f", 5), "amqp://h/%2f?heartbeat=5");
        assert_eq!(with_heartbeat("amqp://h/v?frame_max=9", 5), "amqp://h/v?frame_max=9&heartbeat=5");
        assert_eq!(with_heartbeat("amqp://h/v?heartbeat=30", 5), "amqp://h/v?heartbeat=30");
    }

    #[test]
    fn only_row_level_refusals_keep_the_channel() {
        let id = Uuid::now_v7();
        assert!(!PublishError::Nacked { id }.poisons_channel());
        let unroutable =
            PublishError::Unroutable { id, routing_key: "x".into(), reply_code: 312, reply_text: "NO_ROUTE".into() };
        assert!(unroutable.is_row_level() && !unroutable.poisons_channel());
        assert_eq!(unroutable.kind(), "unroutable");
        assert!(PublishError::ConfirmTimeout { id, after: Duration::from_secs(1) }.poisons_channel());
    }
}
