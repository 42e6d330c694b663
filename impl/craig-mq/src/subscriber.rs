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
}

/// An ack or nack counts only when lapin actually sent it: `Ok(false)` is the ack failure
/// #1197 says tears the session down, never a success.
pub(crate) fn settled(op: &'static str, sent: Result<bool, lapin::Error>) -> Result<(), SessionError> {
    match sent {
        Ok(true) => Ok(()),
        Ok(false) => Err(SessionError::NotSettled(op)),
        Err(e) => Err(SessionError::Amqp(e)),
    }
}

/// Bound on a session's set-up after the handshake.
pub(crate) const SET_UP_TIMEOUT: Duration = Duration::from_secs(10);

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
    // The set-up is bounded like the handshake: a broker that accepts the connection and
    // then stops answering (mid-boot, killed) must end the session, not park it.
    let set_up = async {
        let ch = conn.create_channel().await?;
        topology::declare_consumer_queue(&ch, &cfg.spec).await?;
        ch.basic_qos(cfg.prefetch, BasicQosOptions::default()).await?;
        let consumer =
            ch.basic_consume(queue.into(), "".into(), BasicConsumeOptions::default(), FieldTable::default()).await?;
        Ok::<_, lapin::Error>((ch, consumer))
    };
    let (ch, mut consumer) = match tokio::time::timeout(SET_UP_TIMEOUT, set_up).await {
        Ok(r) => r?,
        Err(_) => {
            let _ = tokio::time::timeout(Duration::from_secs(2), conn.close(200, "set-up timed out".into())).await;
            return Err(SessionError::SetUpTimeout(SET_UP_TIMEOUT));
        }
    };
    tracing::info!(event = "subscriber.started", queue);
    let mut liveness = tokio::time::interval(Duration::from_secs(1));
    let result = loop {
        let next = tokio::select! {
            _ = shutdown.cancelled() => break Ok(()),
            next = consumer.next() => next,
            // A consumer stream is expected to end when its connection fails; this check
            // does not rely on it (a session that silently stopped delivering would strand
            // the queue behind it).
            _ = liveness.tick() => {
                if conn.status().connected() && ch.status().connected() {
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
        if let Err(e) = dispatch(cfg, handler, delivery).await {
            break Err(e);
        }
    };
    let _ = tokio::time::timeout(Duration::from_secs(2), conn.close(200, "bye".into())).await;
    result
}

async fn dispatch<H, Fut>(cfg: &SubscriberConfig, handler: &H, delivery: Delivery) -> Result<(), SessionError>
where
    H: Fn(EventEnvelope) -> Fut,
    Fut: Future<Output = Result<(), HandlerError>>,
{
    let queue = cfg.spec.queue.as_str();
    let envelope = match EventEnvelope::from_slice(&delivery.data) {
        Ok(env) => env,
        Err(e) => {
            tracing::error!(event = "subscriber.malformed_envelope", queue, error = %e, bytes = delivery.data.len(),
                "dead-lettering malformed delivery with its raw bytes");
            settled("nack", delivery.acker.nack(BasicNackOptions { requeue: false, ..Default::default() }).await)?;
            return Ok(());
        }
    };
    match handler(envelope.clone()).await {
        Ok(()) => settled("ack", delivery.acker.ack(BasicAckOptions::default()).await)?,
        Err(HandlerError::Transient(why)) => {
            tracing::warn!(event = "subscriber.transient_failure", queue, envelope_id = %envelope.id, error = %why);
            tokio::time::sleep(cfg.retry_delay).await;
            settled("nack", delivery.acker.nack(BasicNackOptions { requeue: true, ..Default::default() }).await)?;
        }
        Err(HandlerError::Permanent(why)) => {
            tracing::error!(event = "subscriber.permanent_failure", queue, envelope_id = %envelope.id, error = %why,
                "dead-lettering to craig.dlx");
            settled("nack", delivery.acker.nack(BasicNackOptions { requeue: false, ..Default::default() }).await)?;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_ack_that_was_not_sent_is_a_failure() {
        assert!(settled("ack", Ok(true)).is_ok());
        let err = settled("ack", Ok(false)).unwrap_err();
        assert!(matches!(err, SessionError::NotSettled("ack")), "{err}");
        assert!(settled("nack", Err(lapin::ErrorKind::InvalidChannelState(lapin::ChannelState::Closed, "test").into())).is_err());
    }
}
