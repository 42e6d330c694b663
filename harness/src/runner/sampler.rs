//! The sampler (outbox depth, publish lag, effects over time, for the timeline and the
//! progress line) and the drain that measures liveness once every fault has healed.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use sqlx::PgPool;
use tokio::sync::{Mutex, watch};
use tokio::time::Instant;
use uuid::Uuid;

use super::{Log, PROBE, bounded, consumes};
use crate::backend::Backend;
use crate::history::Event;
use crate::scenario::Scenario;

pub(super) async fn sample(
    log: Log,
    pools: BTreeMap<String, PgPool>,
    mut stop: watch::Receiver<bool>,
    progress: bool,
    (written, writes): (watch::Receiver<u32>, u32),
) {
    let mut last_print = Instant::now();
    loop {
        let (mut pending, mut published, mut effects, mut lag, mut lag_n) = (0i64, 0i64, 0i64, 0f64, 0);
        for (svc, pool) in &pools {
            let row: Option<(i64, i64, Option<f64>)> = bounded(
                PROBE,
                "sampling the outbox",
                sqlx::query_as(
                    "SELECT count(*) FILTER (WHERE published_at IS NULL), count(published_at), \
                     (avg(EXTRACT(EPOCH FROM (published_at - created_at))) FILTER (WHERE published_at > now() - interval '1 second'))::float8 * 1000 \
                     FROM event_outbox",
                )
                .fetch_optional(pool),
            )
            .await
            .ok()
            .flatten();
            if let Some((p, pubd, l)) = row {
                pending += p;
                published += pubd;
                if let Some(l) = l {
                    lag += l;
                    lag_n += 1;
                }
            }
            effects += bounded(PROBE, "effect count", super::collect::effect_count(svc, pool)).await.unwrap_or(0);
        }
        let lag_ms = if lag_n > 0 { lag / lag_n as f64 } else { 0.0 };
        log.push(Event::Sample { outbox_pending: pending, published, effects, lag_ms });
        if progress && last_print.elapsed() >= Duration::from_secs(2) {
            last_print = Instant::now();
            eprintln!(
                "  t={:>6.1}s  writes {}/{writes}  published {published}  pending {pending}  effects {effects}  lag {lag_ms:.0} ms",
                log.now() as f64 / 1000.0,
                *written.borrow()
            );
        }
        tokio::select! {
            _ = stop.changed() => return,
            _ = tokio::time::sleep(Duration::from_millis(250)) => {}
        }
    }
}

/// Liveness: how long after every fault healed until the system is quiet — nothing
/// pending in any outbox (but the poison rows), no ready message in any consumer queue, no
/// delivery unacked, and the effect count unchanged for a full second — within the bound.
/// Records `Drained` and the dead letters (in the DLQ or already audited).
pub(super) async fn drain(
    s: &Scenario,
    log: &Log,
    pools: &BTreeMap<String, PgPool>,
    poison: &[Uuid],
    amqp_url: &str,
    backend: &Arc<Mutex<Backend>>,
) {
    // Liveness: how long until the system is quiet — nothing pending in any outbox, no
    // ready message in any consumer queue, and the effect count unchanged for a full
    // second (a delivery in flight is neither pending nor ready, but it moves the count).
    let bound = Duration::from_millis(s.liveness_bound_ms);
    let healed = Instant::now();
    let mut drained_after = None;
    let mut unacked_unknown = false;
    let mut pending_total = 0;
    let mut quiet_since: Option<(Instant, i64)> = None;
    let mut probe = DepthProbe { amqp: amqp_url, conn: None };
    while healed.elapsed() < bound {
        pending_total = 0;
        for (svc, pool) in pools {
            // The injected poison rows stay pending by design; every other row must drain.
            pending_total += bounded(PROBE, "pending count", pending_except(pool, poison)).await.unwrap_or(1);
            // With a partner, financial's send queue must drain too (#1185): a job a killed
            // sender held comes back when its lease expires.
            if svc == "financial" && s.partner.is_some() {
                pending_total += bounded(PROBE, "send-queue count", unsent_jobs(pool)).await.unwrap_or(1);
            }
        }
        // Bounded: a probe that hangs must not hang the run (a hung connection is dropped).
        let depth = match tokio::time::timeout(Duration::from_secs(5), probe.depths(s)).await {
            Ok(Ok(d)) => d,
            Ok(Err(_)) => 1,
            Err(_) => {
                probe.conn = None;
                1
            }
        };
        let mut effects = 0;
        for (svc, pool) in pools {
            effects += bounded(PROBE, "effect count", super::collect::effect_count(svc, pool)).await.unwrap_or(-1);
            // Issue 22.7: the dead-letter audit still growing is not quiet either.
            if svc == "security" {
                let audit = sqlx::query_scalar::<_, i64>("SELECT count(*) FROM dead_letter_audit").fetch_one(pool);
                effects += bounded(PROBE, "dead-letter audit count", audit).await.unwrap_or(-1_000_000);
            }
        }
        if pending_total == 0 && depth == 0 {
            match quiet_since {
                Some((since, n)) if n == effects => {
                    if since.elapsed() >= Duration::from_secs(1) {
                        // Quiet also means nothing delivered and still unacked (a delivery
                        // in flight is not ready); the broker says, where it can.
                        let mut queues: Vec<String> =
                            s.fleet.keys().filter(|svc| consumes(svc)).map(|svc| craig_mq::topology::consumer_queue(svc)).collect();
                        // Issue 22.7: the DLQ's session holds deliveries while it parks.
                        if s.fleet.contains_key("security") {
                            queues.push(craig_mq::topology::DLQ_QUEUE.to_owned());
                        }
                        let unacked = {
                            let b = backend.lock().await;
                            tokio::time::timeout(Duration::from_secs(10), b.unacked(&queues)).await
                        };
                        match unacked {
                            // Counted, and not quiet: whatever an earlier count said, this
                            // one is known (a stall to the bound is a violation, not unknown).
                            Ok(Ok(Some(n))) if n > 0 => {
                                unacked_unknown = false;
                                quiet_since = None;
                            }
                            Ok(Ok(Some(_))) => {
                                unacked_unknown = false;
                                drained_after = Some(since.duration_since(healed).as_millis() as u64);
                                break;
                            }
                            // A backend that cannot count them: the drain is not proven.
                            Ok(Ok(None)) => {
                                unacked_unknown = true;
                                drained_after = Some(since.duration_since(healed).as_millis() as u64);
                                break;
                            }
                            // Issue 22.7: a count that failed, or a statistic not reported yet
                            // (a new queue's), is unknown, never 0: ask again until the bound.
                            _ => {
                                unacked_unknown = true;
                                quiet_since = None;
                            }
                        }
                    }
                }
                _ => quiet_since = Some((Instant::now(), effects)),
            }
        } else {
            quiet_since = None;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    probe.close().await;
    log.push(Event::Drained { after_ms: drained_after, bound_ms: s.liveness_bound_ms, pending: pending_total, unacked_unknown });
    // Dead letters so far: those still in the DLQ plus those the security service has
    // already taken off it into dead_letter_audit (§D3), one row per delivery it received.
    let waiting = tokio::time::timeout(Duration::from_secs(5), dead_letters(amqp_url)).await.ok().and_then(Result::ok);
    let audited = match pools.get("security") {
        Some(p) => bounded(PROBE, "dead-letter audit count", sqlx::query_scalar::<_, i64>("SELECT count(*) FROM dead_letter_audit").fetch_one(p))
            .await
            .ok()
            .map(|n| u32::try_from(n).unwrap_or(u32::MAX)),
        None => Some(0),
    };
    // What security set aside in its capture queue reached the DLQ path too (issue 21.1):
    // counted toward the activity floor, and judged by dlq_occurrence_once.
    let mut captured = Some(0);
    if s.fleet.contains_key("security") {
        captured = match tokio::time::timeout(Duration::from_secs(5), queue_messages(amqp_url, craig_mq::dlq::CAPTURE_QUEUE)).await {
            Ok(Ok(n)) => Some(n),
            _ => None,
        };
        match captured {
            Some(0) => {}
            Some(n) => log.push(Event::CaptureLeft { count: n }),
            // Unread is not "none left": dlq_occurrence_once says it could not tell.
            None => log.push(Event::CaptureLeft { count: u32::MAX }),
        }
    }
    if let (Some(w), Some(a)) = (waiting, audited) {
        log.push(Event::DeadLetters { count: w.saturating_add(a).saturating_add(captured.unwrap_or(0)) });
    }
}

/// Messages waiting in `queue` (0 when it was never declared).
async fn queue_messages(amqp: &str, queue: &str) -> anyhow::Result<u32> {
    let conn = craig_mq::publisher::connect(amqp, 5, "chaos-probe").await?;
    let ch = conn.create_channel().await?;
    let n = match craig_mq::topology::queue_depth(&ch, queue).await {
        Ok(n) => n,
        // A passive declare of a queue nobody declared: NOT_FOUND, nothing was captured.
        Err(e) if format!("{e} {e:?}").contains("NOT_FOUND") => 0,
        Err(e) => return Err(e.into()),
    };
    let _ = tokio::time::timeout(Duration::from_secs(2), conn.close(200, "probe".into())).await;
    Ok(n)
}

/// Rows not yet ACKed, leaving out `except`.
async fn pending_except(pool: &PgPool, except: &[Uuid]) -> Result<i64, sqlx::Error> {
    sqlx::query_scalar("SELECT count(*) FROM event_outbox WHERE published_at IS NULL AND id <> ALL($1)")
        .bind(except)
        .fetch_one(pool)
        .await
}

async fn unsent_jobs(pool: &PgPool) -> Result<i64, sqlx::Error> {
    sqlx::query_scalar("SELECT count(*) FROM exchange_send_jobs WHERE status IN ('pending', 'in_flight')").fetch_one(pool).await
}

/// The drain's view of the consumer queues: ONE connection for every poll, opened again
/// only after it failed (a broker restart), closed when the drain is done.
struct DepthProbe<'a> {
    amqp: &'a str,
    conn: Option<lapin::Connection>,
}

impl DepthProbe<'_> {
    /// Ready messages in the scenario's consumer queues (and the DLQ, with security).
    async fn depths(&mut self, s: &Scenario) -> anyhow::Result<u32> {
        let total = self.count(s).await;
        if total.is_err() {
            self.conn = None; // reopened on the next poll
        }
        total
    }

    async fn count(&mut self, s: &Scenario) -> anyhow::Result<u32> {
        if !self.conn.as_ref().is_some_and(|c| c.status().connected()) {
            self.conn = Some(craig_mq::publisher::connect(self.amqp, 5, "chaos-probe").await?);
        }
        let conn = self.conn.as_ref().expect("connected above");
        let mut total = 0;
        // A passive declare of a missing queue closes its channel: one channel per queue.
        for svc in s.fleet.keys().filter(|svc| consumes(svc)) {
            let ch = conn.create_channel().await?;
            total += craig_mq::topology::queue_depth(&ch, &craig_mq::topology::consumer_queue(svc)).await?;
            let _ = ch.close(200, "probe".into()).await;
        }
        // With a security service the DLQ is a consumer queue too: quiet means it took every
        // dead letter off (and recorded it, or the audit checkers say otherwise).
        if s.fleet.contains_key("security") {
            let ch = conn.create_channel().await?;
            // Issue 22.7: a failed read is unknown, never 0 (only a DLQ nobody declared yet is
            // empty).
            total += match craig_mq::topology::queue_depth(&ch, craig_mq::topology::DLQ_QUEUE).await {
                Ok(n) => n,
                Err(e) if format!("{e} {e:?}").contains("NOT_FOUND") => 0,
                Err(e) => return Err(e.into()),
            };
            let _ = ch.close(200, "probe".into()).await;
        }
        Ok(total)
    }

    async fn close(self) {
        if let Some(c) = self.conn {
            let _ = tokio::time::timeout(Duration::from_secs(2), c.close(200, "probe".into())).await;
        }
    }
}

/// Messages waiting in the DLQ (0 when it was never declared).
async fn dead_letters(amqp: &str) -> anyhow::Result<u32> {
    let conn = craig_mq::publisher::connect(amqp, 5, "chaos-probe").await?;
    let ch = conn.create_channel().await?;
    let n = craig_mq::topology::queue_depth(&ch, craig_mq::topology::DLQ_QUEUE).await.unwrap_or(0);
    let _ = tokio::time::timeout(Duration::from_secs(2), conn.close(200, "probe".into())).await;
    Ok(n)
}
