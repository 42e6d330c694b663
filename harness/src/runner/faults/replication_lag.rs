//! `replication_lag` (issue 26): the standby's replication link (`standby->database`) delays
//! what the primary sends by `lag_ms` for the hold, so that a failover can land while the
//! standby is behind. A latency toxic on the link's downstream (primary → standby). Evidence,
//! taken at the heal: the WAL the toxic delayed (the proxy's payload counter) and, from
//! samples of the primary's own `pg_stat_replication` every 100 ms while it held, the most
//! the standby was behind (WAL bytes not yet applied), against one sample taken just before
//! the toxic: it must be at least twice that and 8 KiB (a WAL page) or more, as a standby
//! streaming a writing primary is always a little behind. A link that carried
//! nothing, or a standby never seen behind, leaves none.

use std::time::Duration;

use tokio::sync::oneshot;
use tokio::task::JoinHandle;

use super::toxic::proxy_of;
use super::{Cx, Room, not_supported};
use crate::backend::BackendKind;
use crate::backend::local::ReplicationWatch;
use crate::proxy::{Stream, Toxic, ToxicKind};
use crate::scenario::{Fault, FaultTarget};

pub(super) struct ReplicationLag;

pub(super) struct Applied {
    proxy: String,
    name: String,
    stop: oneshot::Sender<()>,
    sampler: JoinHandle<i64>,
    /// The standby's distance just before the toxic (WAL bytes not yet applied).
    before: i64,
}

/// The least "most behind" that shows the toxic held the standby back, given `before`.
fn held_back(before: i64) -> i64 {
    2 * before.max(8192)
}

/// Samples the primary's `pg_stat_replication` every 100 ms until told to stop, on the
/// watch's own connection (never the backend's lock, which a failover holds).
fn sample(mut watch: Option<ReplicationWatch>, mut stop: oneshot::Receiver<()>) -> JoinHandle<i64> {
    tokio::spawn(async move {
        let mut most = 0i64;
        loop {
            if let Some(w) = watch.as_mut()
                && let Ok(Some(bytes)) = tokio::time::timeout(Duration::from_millis(500), w.behind()).await
            {
                most = most.max(bytes);
            }
            tokio::select! {
                _ = &mut stop => return most,
                () = tokio::time::sleep(Duration::from_millis(100)) => {}
            }
        }
    })
}

impl Room for ReplicationLag {
    type Applied = Applied;

    fn supported(backend: BackendKind, _: &FaultTarget) -> Result<(), &'static str> {
        match backend {
            BackendKind::Local | BackendKind::Containers => Ok(()),
            _ => Err("a database standby runs on the local and containers backends only (issue 26)"),
        }
    }

    async fn apply(cx: &Cx, f: &Fault, target: &FaultTarget) -> anyhow::Result<Applied> {
        let FaultTarget::Link { replica, .. } = target else { return Err(not_supported(f)) };
        if replica != "standby" {
            return Err(not_supported(f));
        }
        let proxy = proxy_of(f, target)?;
        let latency = f.lag_ms.expect("validated");
        let mut watch = cx.backend.lock().await.replication_watch();
        let before = match watch.as_mut() {
            Some(w) => tokio::time::timeout(Duration::from_secs(5), w.behind()).await.ok().flatten().unwrap_or(0),
            None => 0,
        };
        let toxic = Toxic { name: format!("fault-{}", cx.index), stream: Stream::Downstream, toxicity: 1.0, kind: ToxicKind::Latency { latency, jitter: 0 } };
        cx.toxi.add_toxic(&proxy, &toxic).await?;
        let (stop, stopped) = oneshot::channel();
        let sampler = sample(watch, stopped);
        Ok(Applied { proxy, name: toxic.name, stop, sampler, before })
    }

    async fn heal(cx: &Cx, f: &Fault, _: &FaultTarget, a: Applied) -> anyhow::Result<()> {
        let _ = a.stop.send(());
        let bytes = a.sampler.await.unwrap_or(0);
        let affected = cx.toxi.proxy(&a.proxy).await?.affected;
        let delayed = affected.get(&a.name).filter(|d| d.payload_bytes > 0);
        cx.evidence(match delayed {
            Some(d) if bytes >= held_back(a.before) => Some(format!(
                "the replication link delayed {} ms: {} bytes of WAL over {} connections; the primary's pg_stat_replication showed the standby up to {bytes} bytes behind ({} just before)",
                f.lag_ms.unwrap_or(0),
                d.payload_bytes,
                d.connections,
                a.before,
            )),
            _ => None,
        });
        cx.toxi.remove_toxic(&a.proxy, &a.name).await?;
        Ok(())
    }
}
