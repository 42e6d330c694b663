//! Consumer sessions — ADR-022 §D3 queue wiring, with the #1197 posture on ack failures.
//!
//! [`run_subscriber`] keeps one consume session alive on a queue declared by
//! [`topology::declare_consumer_queue`]: it (re)connects with backoff, sets prefetch, parses
//! each delivery strictly and hands the [`EventEnvelope`] to the handler.
//!
//! - handler `Ok` → ack.
//! - [`HandlerError::Transient`] (a database outage, say) → wait `retry_delay`, then nack
//!   with requeue: the message comes back, nothing is lost.
//! - [`HandlerError::Permanent`], or bytes that are not an envelope → nack without
//!   requeue: the broker dead-letters it to `craig.dlx` under `dlq.<queue>` with its raw
//!   bytes intact.
//! - an ack or nack that FAILS tears the session down (#1197: never warn-and-continue,
//!   which silently leaks prefetch credit); unacked deliveries return to the queue.
//!
//! **Concurrency.** A session handles up to [`SubscriberConfig::concurrency`] deliveries at
//! once (at most the prefetch; `CRAIG_CONSUMER_CONCURRENCY`, default the prefetch), each
//! settled on its own delivery tag, so one slow or failing delivery (a transient failure's
//! `retry_delay`) never holds up the healthy ones behind it. Deliveries of the SAME envelope
//! (a redelivery, a re-publish) never run at once: a later one waits for the earlier to
//! settle, so the inbox sees it stamped and absorbs the copy, exactly as one at a time did. The price, stated where the
//! inbox states its window (#1180): up to `concurrency` envelopes per replica can sit
//! between handler and stamp when the replica dies. A session that ends (an ack failure,
//! shutdown) first lets the handlers already running finish and settle; it takes no new
//! delivery meanwhile.

use std::collections::{HashMap, VecDeque};
use std::future::Future;
use std::time::Duration;

use futures_util::StreamExt;
use lapin::message::Delivery;
use lapin::options::{BasicAckOptions, BasicConsumeOptions, BasicNackOptions, BasicQosOptions};
use lapin::types::FieldTable;
use tokio_util::sync::CancellationToken;

use crate::envelope::EventEnvelope;
use crate::publisher::connect;
use crate::topology::{self, QueueSpec};

/// How a handler failed, which decides requeue vs dead-letter.
#[derive(Debug, thiserror::Error)]
pub enum HandlerError {
    #[error("transient: {0}")]
    Transient(String),
    #[error("permanent: {0}")]
    Permanent(String),
}

#[derive(Debug, Clone)]
pub struct SubscriberConfig {
    pub amqp_url: String,
    pub spec: QueueSpec,
    pub prefetch: u16,
    /// Deliveries handled at once, 1..=prefetch (0 or more than the prefetch: the prefetch).
    pub concurrency: u16,
    pub heartbeat_secs: u16,
    /// Pause before a transient failure is requeued (keeps an outage from spinning).
    pub retry_delay: Duration,
    /// Pause before reconnecting after a session ends in error.
    pub reconnect_delay: Duration,
}

#[derive(Debug, thiserror::Error)]
pub(crate) enum SessionError {
    #[error("AMQP: {0}")]
    Amqp(#[from] lapin::Error),
    #[error("consumer stream ended (channel or connection closed)")]
    StreamEnded,
    #[error("consume set-up (channel, queue, qos, consume) not finished within {0:?}")]
    SetUpTimeout(Duration),
    /// `ack`/`nack` answered `Ok(false)`: the acker was already used or its channel is
    /// poisoned, so the broker never got the settlement (#1197: an ack failure).
    #[error("basic.{0} was not sent: the delivery's channel is closed or the acker already used")]
    NotSettled(&'static str),
    #[error("basic.{0} did not complete within {1:?} (a connection being recovered)")]
    SettleTimeout(&'static str, Duration),
}

/// An ack or nack counts only when lapin actually sent it: `Ok(false)` is the ack failure
/// #1197 says tears the session down, never a success. It is bounded by [`SETTLE_TIMEOUT`]:
/// on a connection lapin is still trying to recover the ack's future may never resolve,
/// and a session awaiting it would stop consuming for good (found by the 20-seed run:
/// `broker-kill` stalled 2 of 20 times with the queue full and the session never ended).
pub(crate) async fn settled(
    op: &'static str,
    sent: impl Future<Output = Result<bool, lapin::Error>>,
) -> Result<(), SessionError> {
    match tokio::time::timeout(SETTLE_TIMEOUT, sent).await {
        Ok(Ok(true)) => Ok(()),
        Ok(Ok(false)) => Err(SessionError::NotSettled(op)),
        Ok(Err(e)) => Err(SessionError::Amqp(e)),
        Err(_) => Err(SessionError::SettleTimeout(op, SETTLE_TIMEOUT)),
    }
}

/// Bound on one ack or nack.
pub(crate) const SETTLE_TIMEOUT: Duration = Duration::from_secs(10);

/// Bound on a session's set-up after the handshake.
pub(crate) const SET_UP_TIMEOUT: Duration = Duration::from_secs(10);

/// Run a consume session's set-up (channels, declarations, qos, consume) within
/// [`SET_UP_TIMEOUT`]: a broker that accepts the connection and then stops answering
/// (mid-boot, killed) must end the session, not park it. On timeout the connection is
/// closed (bounded) before the error returns.
pub(crate) async fn bounded_set_up<T>(
    conn: &lapin::Connection,
    set_up: impl Future<Output = Result<T, lapin::Error>>,
) -> Result<T, SessionError> {
    let r = match tokio::time::timeout(SET_UP_TIMEOUT, set_up).await {
        Ok(r) => r.map_err(SessionError::from),
        Err(_) => {
            let _ = tokio::time::timeout(Duration::from_secs(2), conn.close(200, "set-up timed out".into())).await;
            Err(SessionError::SetUpTimeout(SET_UP_TIMEOUT))
        }
    };
    if r.is_err() {
        // A broker that took the login but cannot serve (a node with no exchanges yet):
        // the next connect starts at the next endpoint (issue 25).
        crate::publisher::skip_endpoint();
    }
    r
}

/// The liveness tick's test: a consumer stream is expected to end when its connection
/// fails, but a session must not rely on it (one that silently stopped delivering would
/// strand the queue behind it).
pub(crate) fn alive(conn: &lapin::Connection, ch: &lapin::Channel) -> bool {
    conn.status().connected() && ch.status().connected()
}

/// Run consume sessions until `shutdown`. Each session error is logged and followed by a
/// reconnect; the function returns only on shutdown.
pub async fn run_subscriber<H, Fut>(cfg: SubscriberConfig, handler: H, shutdown: CancellationToken)
where
    H: Fn(EventEnvelope) -> Fut,
    Fut: Future<Output = Result<(), HandlerError>>,
{
    let queue = cfg.spec.queue.clone();
    loop {
        match session(&cfg, &handler, &shutdown).await {
            Ok(()) => return,
            Err(e) => tracing::warn!(event = "subscriber.session_ended", queue = %queue, error = %e),
        }
        tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = tokio::time::sleep(cfg.reconnect_delay) => {}
        }
    }
}

async fn session<H, Fut>(cfg: &SubscriberConfig, handler: &H, shutdown: &CancellationToken) -> Result<(), SessionError>
where
    H: Fn(EventEnvelope) -> Fut,
    Fut: Future<Output = Result<(), HandlerError>>,
{
    let queue = cfg.spec.queue.as_str();
    let conn = connect(&cfg.amqp_url, cfg.heartbeat_secs, queue).await?;
    let set_up = async {
        let ch = conn.create_channel().await?;
        topology::declare_consumer_queue(&ch, &cfg.spec).await?;
        ch.basic_qos(cfg.prefetch, BasicQosOptions::default()).await?;
        let consumer =
            ch.basic_consume(queue.into(), "".into(), BasicConsumeOptions::default(), FieldTable::default()).await?;
        Ok::<_, lapin::Error>((ch, consumer))
    };
    let (ch, mut consumer) = bounded_set_up(&conn, set_up).await?;
    let limit = effective_concurrency(cfg.prefetch, cfg.concurrency);
    tracing::info!(event = "subscriber.started", queue, concurrency = limit);
    let mut liveness = tokio::time::interval(Duration::from_secs(1));
    let mut running = futures_util::stream::FuturesUnordered::new();
    // Envelopes being handled, each with the deliveries of the SAME envelope that arrived
    // meanwhile: those wait for it, so the inbox sees the first one stamped and absorbs them
    // (a redelivery must not race its original inside one session).
    let mut busy: HashMap<uuid::Uuid, VecDeque<(Delivery, EventEnvelope)>> = HashMap::new();
    let mut waiting = 0usize;
    let result = loop {
        let room = running.len() + waiting < limit;
        let next = tokio::select! {
            _ = shutdown.cancelled() => break Ok(()),
            Some((id, done)) = running.next(), if !running.is_empty() => {
                if let Err(e) = done {
                    break Err(e);
                }
                if let Some(id) = id {
                    match busy.get_mut(&id).and_then(VecDeque::pop_front) {
                        Some((delivery, envelope)) => {
                            waiting -= 1;
                            running.push(dispatch(cfg, handler, delivery, Ok(envelope)));
                        }
                        None => {
                            busy.remove(&id);
                        }
                    }
                }
                continue;
            }
            next = consumer.next(), if room => next,
            _ = liveness.tick() => {
                if alive(&conn, &ch) {
                    continue;
                }
                break Err(SessionError::StreamEnded);
            }
        };
        let delivery = match next {
            Some(Ok(d)) => d,
            Some(Err(e)) => break Err(e.into()),
            None => break Err(SessionError::StreamEnded),
        };
        match EventEnvelope::from_slice(&delivery.data) {
            Ok(envelope) => match busy.get_mut(&envelope.id) {
                Some(queued) => {
                    queued.push_back((delivery, envelope));
                    waiting += 1;
                }
                None => {
                    busy.insert(envelope.id, VecDeque::new());
                    running.push(dispatch(cfg, handler, delivery, Ok(envelope)));
                }
            },
            Err(e) => running.push(dispatch(cfg, handler, delivery, Err(e.to_string()))),
        }
    };
    // The handlers already running finish and settle (their outcome is logged by dispatch);
    // cutting them off would open the #1180 window for no reason. Deliveries still waiting
    // behind one of them go back to the queue unsettled when the connection closes.
    while let Some((_, done)) = running.next().await {
        if let Err(e) = done {
            tracing::warn!(event = "subscriber.settle_failed", queue, error = %e);
        }
    }
    let _ = tokio::time::timeout(Duration::from_secs(2), conn.close(200, "bye".into())).await;
    result
}

/// Deliveries a session handles at once: `concurrency` within 1..=prefetch, else the prefetch.
pub fn effective_concurrency(prefetch: u16, concurrency: u16) -> usize {
    let prefetch = usize::from(prefetch.max(1));
    match usize::from(concurrency) {
        0 => prefetch,
        n => n.min(prefetch),
    }
}

/// Handle one delivery: `parsed` is its envelope, or why its bytes are not one. Returns the
/// envelope id (to release the same-envelope serialization) and the settlement's result.
async fn dispatch<H, Fut>(
    cfg: &SubscriberConfig,
    handler: &H,
    delivery: Delivery,
    parsed: Result<EventEnvelope, String>,
) -> (Option<uuid::Uuid>, Result<(), SessionError>)
where
    H: Fn(EventEnvelope) -> Fut,
    Fut: Future<Output = Result<(), HandlerError>>,
{
    let queue = cfg.spec.queue.as_str();
    let envelope = match parsed {
        Ok(env) => env,
        Err(e) => {
            tracing::error!(event = "subscriber.malformed_envelope", queue, error = %e, bytes = delivery.data.len(),
                "dead-lettering malformed delivery with its raw bytes");
            let r = settled("nack", delivery.acker.nack(BasicNackOptions { requeue: false, ..Default::default() })).await;
            return (None, r);
        }
    };
    let id = envelope.id;
    let r = match handler(envelope).await {
        Ok(()) => settled("ack", delivery.acker.ack(BasicAckOptions::default())).await,
        Err(HandlerError::Transient(why)) => {
            tracing::warn!(event = "subscriber.transient_failure", queue, envelope_id = %id, error = %why);
            tokio::time::sleep(cfg.retry_delay).await;
            settled("nack", delivery.acker.nack(BasicNackOptions { requeue: true, ..Default::default() })).await
        }
        Err(HandlerError::Permanent(why)) => {
            tracing::error!(event = "subscriber.permanent_failure", queue, envelope_id = %id, error = %why,
                "dead-lettering to craig.dlx");
            settled("nack", delivery.acker.nack(BasicNackOptions { requeue: false, ..Default::default() })).await
        }
    };
    (Some(id), r)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn concurrency_stays_within_one_and_the_prefetch() {
        assert_eq!(effective_concurrency(32, 0), 32);
        assert_eq!(effective_concurrency(32, 1), 1);
        assert_eq!(effective_concurrency(32, 8), 8);
        assert_eq!(effective_concurrency(32, 64), 32);
        assert_eq!(effective_concurrency(0, 0), 1);
    }

    /// The liveness tick's test (mutation survivor `alive -> true`, docs/mutants.md): a
    /// session is alive only while both its connection and its channel are open, so a
    /// session whose channel or connection closed without its stream ending is torn down.
    #[tokio::test]
    async fn a_session_is_alive_only_while_its_connection_and_channel_are_open() {
        let sandbox = craig_sandbox::Sandbox::create("craig-mq::subscriber-alive", &[]).await.expect("sandbox");
        let conn = crate::publisher::connect(sandbox.amqp_url(), 5, "test").await.expect("amqp");
        let ch = conn.create_channel().await.expect("channel");
        assert!(alive(&conn, &ch), "an open connection and channel");
        ch.close(200, "test".into()).await.expect("close the channel");
        assert!(!alive(&conn, &ch), "its channel closed");
        let other = conn.create_channel().await.expect("channel");
        assert!(alive(&conn, &other));
        conn.close(200, "test".into()).await.expect("close the connection");
        assert!(!alive(&conn, &other), "its connection closed");
        sandbox.destroy().await.expect("destroy sandbox");
    }

    #[tokio::test]
    async fn an_ack_that_was_not_sent_or_never_completes_is_a_failure() {
        assert!(settled("ack", std::future::ready(Ok(true))).await.is_ok());
        let err = settled("ack", std::future::ready(Ok(false))).await.unwrap_err();
        assert!(matches!(err, SessionError::NotSettled("ack")), "{err}");
        let closed = lapin::ErrorKind::InvalidChannelState(lapin::ChannelState::Closed, "test").into();
        assert!(settled("nack", std::future::ready(Err(closed))).await.is_err());
        // An ack whose future never resolves (a connection lapin is recovering) ends in a
        // typed error, so the session is torn down instead of stalling for good.
        let err = settled("ack", std::future::pending()).await.unwrap_err();
        assert!(matches!(err, SessionError::SettleTimeout("ack", _)), "{err}");
    }
}
