//! `queue_limit`: a RabbitMQ policy (`max-length`, `reject-publish`) on one queue for the
//! hold (`duration_ms`). Its window starts when the policy is in force, not when it was
//! asked for; a head-drop probe tells the fault's own losses apart (a finding).

use std::time::Duration;

use serde_json::json;
use tokio::time::Instant;

use super::{Cx, Room, not_supported};
use crate::backend::BackendKind;
use crate::history::Phase;
use crate::scenario::{Fault, FaultTarget};

pub(super) struct QueueLimit;

impl Room for QueueLimit {
    /// The policy's name and the probe (or why it could not open).
    type Applied = (String, Result<HeadDropProbe, String>);
    const STARTS_ITSELF: bool = true;

    /// A policy through the backend: rabbitmqctl (local), the management API (external,
    /// containers).
    fn supported(_: BackendKind, _: &FaultTarget) -> Result<(), &'static str> {
        Ok(())
    }

    async fn apply(cx: &Cx, f: &Fault, target: &FaultTarget) -> anyhow::Result<Self::Applied> {
        if *target != FaultTarget::Broker {
            return Err(not_supported(f));
        }
        let queue = f.queue.as_deref().expect("validated");
        let policy = format!("chaos-queue-limit-{}", cx.index);
        let pattern = format!("^{}$", queue.replace('.', "\\."));
        let definition = json!({ "max-length": f.max_length.expect("validated"), "overflow": "reject-publish" });
        // The window starts when the limit is in force (rabbitmqctl takes a second or
        // more), not when it was asked for. A limit first applied to a queue already over
        // it makes RabbitMQ drop the head to craig.dlx even under reject-publish: a loss
        // the fault itself caused, so it is a finding, never blamed on the system.
        //
        // Those head drops are told apart from every other dead letter (a poison row's
        // reject, say) by a probe: a private queue bound on craig.dlx to this queue's
        // dead-letter key, whose copies carry RabbitMQ's x-death reason `maxlen`.
        let probe = HeadDropProbe::open(&cx.amqp_url, queue).await;
        if let Err(e) = &probe {
            cx.log.finding(format!("queue_limit {}: cannot watch for head drops ({e}); a loss in this run may be the fault's own", cx.label));
        }
        let asked = Instant::now();
        cx.backend.lock().await.set_policy(&policy, &pattern, &definition).await?;
        cx.log.fault(cx.kind, &cx.label, Phase::Start);
        if let Some(ready) = cx.ready.lock().unwrap().take() {
            let _ = ready.send(());
        }
        cx.evidence(Some(format!("policy in force {} ms after it was asked for", asked.elapsed().as_millis())));
        // (One hold: the limit is in force for duration_ms, as the scenario says; it
        // used to be held twice over.)
        Ok((policy, probe))
    }

    async fn heal(cx: &Cx, f: &Fault, _: &FaultTarget, (policy, probe): Self::Applied) -> anyhow::Result<()> {
        let queue = f.queue.as_deref().expect("validated");
        let label = &cx.label;
        cx.backend.lock().await.clear_policy(&policy).await?;
        // Read once the limit is gone: head drops of the whole window count.
        if let Ok(probe) = probe {
            match probe.head_drops().await {
                Ok(0) => {}
                Ok(n) => cx.log.finding(format!(
                    "queue_limit {label}: the limit landed on a backlog and RabbitMQ dropped {n} message(s) from the head of {queue} to {} (x-death reason maxlen), so the fault itself lost them and the run proves nothing about loss",
                    craig_mq::topology::DLX_EXCHANGE
                )),
                Err(e) => cx.log.finding(format!("queue_limit {label}: cannot read the head-drop probe ({e}): a loss in this run may be the fault's own")),
            }
        }
        Ok(())
    }
}

/// Watches one queue's dead letters for head drops (x-death reason `maxlen`) while a
/// `queue_limit` is in force: an exclusive server-named queue bound on `craig.dlx` to
/// `dlq.<queue>`, gone with its connection. Every broker call is bounded.
pub(super) struct HeadDropProbe {
    conn: lapin::Connection,
    ch: lapin::Channel,
    probe: String,
    queue: String,
}

impl HeadDropProbe {
    const BOUND: Duration = Duration::from_secs(5);

    async fn open(amqp_url: &str, queue: &str) -> Result<Self, String> {
        use lapin::options::QueueDeclareOptions;
        let set_up = async {
            let conn = craig_mq::publisher::connect(amqp_url, 5, "chaos-head-drop-probe").await.map_err(|e| e.to_string())?;
            let ch = conn.create_channel().await.map_err(|e| e.to_string())?;
            let q = QueueDeclareOptions { exclusive: true, auto_delete: true, ..Default::default() };
            let probe = crate::runner::tap::bind_on_dlx(&ch, "", q, Default::default(), &craig_mq::topology::dlq_routing_key(queue)).await?;
            Ok(HeadDropProbe { conn, ch, probe, queue: queue.to_owned() })
        };
        tokio::time::timeout(Self::BOUND, set_up).await.map_err(|_| format!("no answer within {:?}", Self::BOUND))?
    }

    /// Dead letters of the watched queue whose latest x-death says `maxlen`; closes the probe.
    async fn head_drops(self) -> Result<u32, String> {
        let count = async {
            let mut n = 0;
            while let Some(m) = self
                .ch
                .basic_get(self.probe.as_str().into(), lapin::options::BasicGetOptions { no_ack: true })
                .await
                .map_err(|e| e.to_string())?
            {
                let death = m
                    .delivery
                    .properties
                    .headers()
                    .as_ref()
                    .and_then(|h| h.inner().get("x-death"))
                    .and_then(|x| craig_mq::dlq::latest_death(x).ok());
                if death.is_some_and(|d| d.reason == "maxlen" && d.queue == self.queue) {
                    n += 1;
                }
            }
            Ok::<u32, String>(n)
        };
        let n = tokio::time::timeout(Self::BOUND, count).await.map_err(|_| format!("no answer within {:?}", Self::BOUND))?;
        let _ = tokio::time::timeout(Duration::from_secs(2), self.conn.close(200, "probe".into())).await;
        n
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use craig_mq::topology::{QueueSpec, declare_consumer_queue, queue_depth};
    use lapin::BasicProperties;
    use lapin::options::{BasicGetOptions, BasicNackOptions, BasicPublishOptions};

    /// The review's case: a limit applied to a queue already over it drops the head to
    /// craig.dlx (reason `maxlen`); the probe counts exactly those, not a consumer's reject
    /// of another message of the same queue.
    #[tokio::test]
    async fn the_probe_counts_head_drops_of_a_limit_landing_on_a_backlog_and_nothing_else() {
        let sandbox = craig_sandbox::Sandbox::create("chaos-faults::head_drop_probe", &[]).await.unwrap();
        let conn = craig_mq::publisher::connect(sandbox.amqp_url(), 30, "test").await.unwrap();
        let ch = conn.create_channel().await.unwrap();
        let queue = "craig-rules.events";
        declare_consumer_queue(&ch, &QueueSpec { queue: queue.into(), bindings: vec!["k".into()], with_dlx: true, queue_type: Default::default() }).await.unwrap();
        for i in 0..10u8 {
            ch.basic_publish("".into(), queue.into(), BasicPublishOptions::default(), &[i], BasicProperties::default()).await.unwrap();
        }
        let probe = HeadDropProbe::open(sandbox.amqp_url(), queue).await.expect("probe opens");
        // One rejected by a consumer: a dead letter of this queue, but no head drop.
        let m = ch.basic_get(queue.into(), BasicGetOptions::default()).await.unwrap().expect("a message");
        m.delivery.acker.nack(BasicNackOptions { requeue: false, ..Default::default() }).await.unwrap();
        sandbox
            .set_policy("limit", &format!("^{}$", queue.replace('.', "\\.")), &json!({ "max-length": 3, "overflow": "reject-publish" }))
            .await
            .unwrap();
        for _ in 0..100 {
            if queue_depth(&ch, queue).await.unwrap() <= 3 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        assert_eq!(queue_depth(&ch, queue).await.unwrap(), 3);
        assert_eq!(probe.head_drops().await, Ok(6), "10 published, 1 rejected, 3 kept");
        let _ = conn.close(200, "bye".into()).await;
        sandbox.destroy().await.unwrap();
    }

    #[tokio::test]
    async fn a_probe_without_the_dead_letter_exchange_says_why() {
        let sandbox = craig_sandbox::Sandbox::create("chaos-faults::probe_no_dlx", &[]).await.unwrap();
        // A sandbox comes deployed (the operator's exchanges); take craig.dlx away.
        let conn = craig_mq::publisher::connect(sandbox.amqp_url(), 30, "test").await.unwrap();
        let ch = conn.create_channel().await.unwrap();
        ch.exchange_delete(craig_mq::topology::DLX_EXCHANGE.into(), Default::default()).await.unwrap();
        let _ = conn.close(200, "bye".into()).await;
        let err = HeadDropProbe::open(sandbox.amqp_url(), "craig-rules.events").await.err().expect("no craig.dlx yet");
        assert!(err.contains("craig.dlx is not there"), "{err}");
        sandbox.destroy().await.unwrap();
    }
}
