//! The fault schedule: crash points armed through `FAILPOINTS` (the watcher records each
//! crash and restarts), every other fault injected at its time, write count or marker,
//! late starts, rollouts. One interface, [`Schedule`]: start it, await `healed`, `finish`.
//!
//! Each injected fault kind has a room of its own behind one small trait, [`Room`]: which
//! backends can do it, how it is applied and healed, and the evidence each step reads.
//!
//! | room | faults |
//! |---|---|
//! | [`kill`] | `kill` of the broker, the database or a replica |
//! | [`pause`] | `pause` of the broker, the database or a replica |
//! | [`partition`] | `partition` of the broker or the database from every replica |
//! | [`rollout`] | `upgrade`, `downgrade` of a replica |
//! | [`toxic`] | `toxic` on a replica's link |
//! | [`down`] | `down` of a replica's link |
//! | [`queue_limit`] | `queue_limit` on the broker |
//! | [`terminate`] | `terminate` of the database's backends |
//! | [`refuse_staging`] | `refuse_staging` on a service's table |
//! | [`failover`] | `failover` of the database to its standby |
//! | [`replication_lag`] | `replication_lag` on the standby's replication link |
//! | [`armed`] | `crash` and `mutant`, armed in the replicas through `FAILPOINTS` |
//!
//! A scenario with a fault its backend cannot do is refused before its run starts
//! ([`refuse_unsupported`]).

mod armed;
mod down;
mod failover;
mod kill;
mod partition;
mod pause;
mod queue_limit;
mod refuse_staging;
mod replication_lag;
mod rollout;
mod terminate;
mod toxic;

pub(super) use armed::{failpoints_for, mutant_evidence, mutants_in_force};

use std::time::Duration;

use tokio::sync::{Mutex, watch};
use tokio::time::Instant;

use super::{Log, Replicas, consumes};
use crate::backend::{Backend, BackendKind};
use crate::history::{Event, Phase};
use crate::process::describe;
use crate::proxy::ToxiproxyClient;
use crate::scenario::{Fault, FaultKind, FaultTarget, Scenario, Trigger};

use std::sync::Arc;

/// The running schedule of one scenario.
pub(super) struct Schedule {
    faults: Vec<tokio::task::JoinHandle<anyhow::Result<()>>>,
    late_starts: Vec<tokio::task::JoinHandle<anyhow::Result<()>>>,
    watcher: tokio::task::JoinHandle<()>,
    restarts: Restarts,
    /// One per fault that must be in force before the first write (a queue_limit at
    /// `after_ms = 0`): its policy is set.
    at_start: Vec<tokio::sync::oneshot::Receiver<()>>,
}

/// What the watcher knows about crash restarts: the replicas whose crash point fired, and
/// every restart that failed (an error of the run, not a log line).
#[derive(Clone, Default)]
struct Restarts {
    fired: Arc<std::sync::Mutex<std::collections::HashSet<String>>>,
    failed: Arc<std::sync::Mutex<Vec<String>>>,
}

impl Restarts {
    fn fired(&self, name: &str) -> bool {
        self.fired.lock().unwrap().contains(name)
    }

    fn failure(&self) -> anyhow::Result<()> {
        match self.failed.lock().unwrap().first() {
            Some(e) => Err(anyhow::anyhow!("{e}")),
            None => Ok(()),
        }
    }
}

impl Schedule {
    /// Arm everything: the replica watcher, late starts and one task per injected fault.
    pub(super) fn start(
        s: &Scenario,
        log: &Log,
        backend: &Arc<Mutex<Backend>>,
        replicas: &Replicas,
        toxi: &ToxiproxyClient,
        amqp_url: &str,
        writes: (watch::Receiver<u32>, u32),
        stop: watch::Receiver<bool>,
    ) -> Self {
        let late_starts = start_late(s, log, replicas);
        let restarts = Restarts::default();
        let watcher = tokio::spawn(watch_replicas(s.clone(), log.clone(), replicas.clone(), restarts.clone(), stop));
        let mut faults = Vec::new();
        let mut at_start = Vec::new();
        let turns = NodeTurns::new(s.broker_nodes);
        for (i, f) in s.faults.iter().enumerate() {
            let f = f.get_ref().clone();
            if matches!(f.kind, FaultKind::Crash | FaultKind::Mutant) {
                continue; // armed through FAILPOINTS; the watcher records and restarts
            }
            let target = s.parse_target(&f.target).expect("validated");
            // A limit "from the start" is in force before the first write, however long
            // rabbitmqctl takes on a busy machine: applied later, it would land on a backlog.
            let ready = (f.kind == FaultKind::QueueLimit && f.at == Trigger::AfterMs(0)).then(|| {
                let (tx, rx) = tokio::sync::oneshot::channel();
                at_start.push(rx);
                tx
            });
            faults.push(tokio::spawn(inject(
                i,
                f,
                ready,
                target,
                log.clone(),
                backend.clone(),
                replicas.clone(),
                toxi.clone(),
                amqp_url.to_owned(),
                (writes.0.clone(), writes.1),
                (s.settings.queue_type, s.deploy.topology, turns.clone()),
            )));
        }
        Self { faults, late_starts, watcher, restarts, at_start }
    }

    /// Every fault that is in force from the start is: the workload writes after this. (A
    /// fault that failed to apply says so when `healed` awaits it.)
    pub(super) async fn in_force_at_start(&mut self) {
        for rx in self.at_start.drain(..) {
            let _ = rx.await;
        }
    }

    /// Every injected fault has healed, every late replica started, every crashed one
    /// restarted; a fault that failed is an error of the run.
    pub(super) async fn healed(&mut self, s: &Scenario, replicas: &Replicas) -> anyhow::Result<()> {
        use anyhow::Context as _;
        let outcome = async {
            while !self.faults.is_empty() {
                self.faults.remove(0).await.context("fault task panicked")??;
            }
            while !self.late_starts.is_empty() {
                self.late_starts.remove(0).await.context("late start panicked")??;
            }
            anyhow::Ok(())
        }
        .await;
        if outcome.is_err() {
            // One fault failed: the rest must not go on injecting into a torn-down run.
            for t in self.faults.drain(..).chain(self.late_starts.drain(..)) {
                t.abort();
            }
            return outcome;
        }
        wait_crash_restarts(s, replicas, &self.restarts).await
    }

    /// After the stop signal: the watcher's last round. A crash restart that failed at any
    /// time of the run is an error of the run.
    pub(super) async fn finish(self) -> anyhow::Result<()> {
        let _ = self.watcher.await;
        self.restarts.failure()
    }
}

/// Start the replicas of services with `start_after_ms` at that time of the run.
fn start_late(s: &Scenario, log: &Log, replicas: &Replicas) -> Vec<tokio::task::JoinHandle<anyhow::Result<()>>> {
    let mut tasks = Vec::new();
    for (svc, entry) in &s.fleet {
        let Some(ms) = entry.get_ref().start_after_ms else { continue };
        for i in 1..=entry.get_ref().count() {
            let name = format!("{svc}-{i}");
            let (r, log) = (replicas.get(&name).expect("every replica is registered").clone(), log.clone());
            tasks.push(tokio::spawn(async move {
                tokio::time::sleep_until(log.started() + Duration::from_millis(ms)).await;
                log.fault("start", &name, Phase::Start);
                let mut r = r.lock().await;
                log.push(Event::Started { replica: name.clone(), compat: r.spec.compat.clone() });
                r.start().await.map_err(|e| anyhow::anyhow!("starting late replica {name}: {e}"))?;
                Ok(())
            }));
        }
    }
    tasks
}

/// How long the heal waits for a crash point that has not fired yet when the writes end.
const CRASH_FIRE_WAIT: Duration = Duration::from_secs(10);

/// Every replica whose crash point fired and asks for a restart is running again before
/// the drain: a restart that failed, or one not done within its delay plus 30 s, is an
/// error of the run. A crash point that has not fired within [`CRASH_FIRE_WAIT`] leaves its
/// replica running (the run's verdict says it never fired).
async fn wait_crash_restarts(s: &Scenario, replicas: &Replicas, restarts: &Restarts) -> anyhow::Result<()> {
    for f in s.faults.iter().map(|f| f.get_ref()).filter(|f| f.kind == FaultKind::Crash) {
        let (Some(ms), Some(r)) = (f.restart_after_ms, replicas.get(&f.target)) else { continue };
        // A crash point the workload has not reached yet (its hit comes from work still
        // pending when the writes end) must fire and heal BEFORE the after-heal writes, or
        // it would fire among them; one that does not fire within the wait never will here
        // (the run is inconclusive for it).
        let fire_by = Instant::now() + CRASH_FIRE_WAIT;
        let mut deadline = None;
        loop {
            restarts.failure()?;
            if !restarts.fired(&f.target) {
                if Instant::now() > fire_by {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
            let deadline = *deadline.get_or_insert_with(|| Instant::now() + Duration::from_millis(ms) + Duration::from_secs(30));
            if r.lock().await.pid().is_some() {
                break;
            }
            if Instant::now() > deadline {
                anyhow::bail!(
                    "replica {} crashed at {} and was not running again {} ms + 30 s later",
                    f.target,
                    f.failpoint.as_deref().unwrap_or("?"),
                    ms
                );
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
    Ok(())
}

/// Record crashes as they happen; restart crashed replicas whose crash fault asks for it.
async fn watch_replicas(s: Scenario, log: Log, replicas: Replicas, restarts: Restarts, mut stop: watch::Receiver<bool>) {
    loop {
        for (name, r) in replicas.iter() {
            // A replica whose lock a fault holds (an upgrade stopping and starting it) is
            // being handled; the others must not wait for it.
            let Ok(mut guard) = r.try_lock() else { continue };
            let status = guard.exited();
            let log_path = guard.log_path().to_path_buf();
            drop(guard);
            let Some(status) = status else { continue };
            let service = name.rsplit_once('-').map(|(s, _)| s).unwrap_or(name);
            log.push(Event::Crash { replica: name.clone(), consumer: consumes(service), how: describe(status) });
            let fault = s
                .faults
                .iter()
                .map(|f| f.get_ref())
                .find(|f| f.kind == FaultKind::Crash && &f.target == name)
                .filter(|_| !restarts.fired(name));
            if fault.is_none() {
                log.finding(format!("replica {name} exited ({}) with no fault targeting it; not restarted", describe(status)));
            }
            if let Some(f) = fault {
                restarts.fired.lock().unwrap().insert(name.clone());
                let fp = f.failpoint.as_deref().unwrap_or("?");
                let label = label(f);
                log.fault("crash", &label, Phase::Start);
                // The evidence: the node's own `failpoint.abort` for this crash point in its
                // last incarnation — any other exit is not the fault that was asked for.
                let text = std::fs::read_to_string(&log_path).unwrap_or_default();
                let last = text.rsplit_once("--- start ").map(|(_, l)| l).unwrap_or(&text);
                let aborted = last.lines().any(|l| l.contains("event=\"failpoint.abort\"") && l.contains(&format!("failpoint=\"{fp}\"")));
                log.evidence("crash", &label, aborted.then(|| format!("failpoint.abort {fp}, then {}", describe(status))));
                if let Some(ms) = f.restart_after_ms {
                    let (r, log, name, failed) = (r.clone(), log.clone(), name.clone(), restarts.failed.clone());
                    tokio::spawn(async move {
                        tokio::time::sleep(Duration::from_millis(ms)).await;
                        let mut r = r.lock().await;
                        r.spec.failpoints = mutants_only(r.spec.failpoints.take()); // fire once; a mutant stays
                        log.push(Event::Started { replica: name.clone(), compat: r.spec.compat.clone() });
                        if let Err(e) = r.start().await {
                            tracing::error!(event = "chaos.restart_failed", replica = %name, error = %e);
                            failed.lock().unwrap().push(format!("restarting {name} after its crash failed: {e}"));
                        }
                        log.fault("crash", &format!("{name} restarted"), Phase::End);
                    });
                }
            }
        }
        tokio::select! {
            _ = stop.changed() => return,
            _ = tokio::time::sleep(Duration::from_millis(50)) => {}
        }
    }
}

/// A replica's `FAILPOINTS` once its crash point or marker has served: only its mutants,
/// which are in force for the whole run.
pub(super) fn mutants_only(fps: Option<String>) -> Option<String> {
    let kept: Vec<&str> = fps.as_deref().unwrap_or("").split(';').filter(|f| f.ends_with("=return(on)")).collect();
    (!kept.is_empty()).then(|| kept.join(";"))
}

/// Poll replica log `path` (every 20 ms) until `reached` holds for its text; false once the
/// first-phase writes (`total` of them) have been done for 5 s without it.
async fn in_log(path: &std::path::Path, writes: &watch::Receiver<u32>, total: u32, reached: impl FnMut(&str) -> bool) -> bool {
    in_logs(std::slice::from_ref(&path.to_path_buf()), writes, total, reached).await
}

/// [`in_log`] over several logs, read as one text (each whole, one after another).
async fn in_logs(paths: &[std::path::PathBuf], writes: &watch::Receiver<u32>, total: u32, mut reached: impl FnMut(&str) -> bool) -> bool {
    let mut done_since: Option<Instant> = None;
    loop {
        let text: String = paths.iter().map(|p| std::fs::read_to_string(p).unwrap_or_default()).collect::<Vec<_>>().join("\n");
        if reached(&text) {
            return true;
        }
        if *writes.borrow() >= total && done_since.get_or_insert_with(Instant::now).elapsed() > Duration::from_secs(5) {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// What a fault's room works with: the run's log, backend, replicas and proxy, and which
/// fault of the scenario it is.
pub(super) struct Cx {
    /// The fault's place in the scenario's `[[faults]]` (names its toxic and policy).
    index: usize,
    kind: &'static str,
    label: String,
    log: Log,
    backend: Arc<Mutex<Backend>>,
    replicas: Replicas,
    toxi: ToxiproxyClient,
    amqp_url: String,
    /// The run's queue type (`[settings] queue_type`): what a wiped broker node held.
    queue_type: craig_mq::topology::QueueType,
    /// Whether the scenario runs the deploy step (`[deploy] topology`): an operator who
    /// replaced a wiped broker node runs it again.
    redeploy: bool,
    /// Told once the fault is in force, where the workload waits for it (a queue limit at
    /// `after_ms = 0`).
    ready: std::sync::Mutex<Option<tokio::sync::oneshot::Sender<()>>>,
    /// How long a broker node's fault waited for another node's to heal before it started
    /// (one node out at a time, [`inject`]).
    waited_ms: u64,
}

impl Cx {
    /// The fault's evidence (`Event::Evidence`): `None` is a fault that did not fire. A wait
    /// of a second or more for another broker node's fault is part of it.
    fn evidence(&self, what: Option<String>) {
        let what = what.map(|w| match self.waited_ms {
            0..1000 => w,
            ms => format!("{w} (after waiting {ms} ms for another broker node's fault to heal)"),
        });
        self.log.evidence(self.kind, &self.label, what);
    }

    /// A replica the scenario names (validated).
    fn replica(&self, name: &str) -> Arc<Mutex<crate::process::Replica>> {
        self.replicas.get(name).expect("validated").clone()
    }
}

/// One fault kind (issue 24): which backends can do it, and how it is put in force and
/// lifted, each step with the evidence it can read. [`inject`] times the fault (its
/// trigger), records its start and end, and holds it between `apply` and `heal`.
pub(super) trait Room {
    /// What `heal` needs of what `apply` did.
    type Applied: Send;
    /// Whether the fault is held between apply and heal (`duration_ms`, `restart_after_ms`);
    /// a rollout step is not.
    const HOLDS: bool = true;
    /// Whether `apply` records the start itself: when the fault is really in force, not
    /// when it was asked for (a queue policy takes a second or more).
    const STARTS_ITSELF: bool = false;
    /// Whether `backend` can do this fault on `target`; the reason where not. Asked for
    /// every fault of a scenario before its run starts ([`refuse_unsupported`]).
    fn supported(backend: BackendKind, target: &FaultTarget) -> Result<(), &'static str>;
    async fn apply(cx: &Cx, f: &Fault, target: &FaultTarget) -> anyhow::Result<Self::Applied>;
    async fn heal(cx: &Cx, f: &Fault, target: &FaultTarget, applied: Self::Applied) -> anyhow::Result<()>;
}

/// Apply, hold, heal: one fault of room `R`, recorded from start to end.
async fn run<R: Room>(cx: &Cx, f: &Fault, target: &FaultTarget) -> anyhow::Result<()> {
    if !R::STARTS_ITSELF {
        cx.log.fault(cx.kind, &cx.label, Phase::Start);
    }
    let applied = R::apply(cx, f, target).await?;
    if R::HOLDS {
        tokio::time::sleep(hold(f)).await;
    }
    R::heal(cx, f, target, applied).await?;
    cx.log.fault(cx.kind, &cx.label, Phase::End);
    Ok(())
}

/// The queues node `me` leads in a listing (issue 25): what its kill, partition or drain
/// must move.
pub(super) fn led_by(listing: &[crate::backend::local::QueuePlacement], me: &str) -> Vec<String> {
    listing.iter().filter(|q| q.leader == me).map(|q| q.name.clone()).collect()
}

/// Where the quorum queues a broker node led (`led`) have their leaders in a listing `now`
/// (issue 25), as `queue → node`, or `still it` where node `me` still leads: the evidence a
/// kill and a partition of a cluster node give. A queue the listing lacks is left out.
pub(super) fn leaders_now(led: &[impl AsRef<str>], now: &[crate::backend::local::QueuePlacement], me: &str) -> Vec<String> {
    led.iter()
        .filter_map(|l| {
            let l = l.as_ref();
            now.iter().find(|q| q.name == l).map(|q| format!("{l} → {}", if q.leader == me { "still it" } else { q.leader.as_str() }))
        })
        .collect()
}

/// How long fault `f` is held in force (`duration_ms`, or `restart_after_ms` for a kill).
fn hold(f: &Fault) -> Duration {
    Duration::from_millis(f.duration_ms.or(f.restart_after_ms).unwrap_or(0))
}

/// Whether `backend` can do fault kind `kind` on `target` (crash points and mutants are
/// armed in the replicas, which every backend runs as processes of the host).
pub(crate) fn supported(kind: FaultKind, backend: BackendKind, target: &FaultTarget) -> Result<(), &'static str> {
    match kind {
        FaultKind::Kill => kill::Kill::supported(backend, target),
        FaultKind::Pause => pause::Pause::supported(backend, target),
        FaultKind::Partition => partition::Partition::supported(backend, target),
        FaultKind::Upgrade | FaultKind::Downgrade => rollout::Rollout::supported(backend, target),
        FaultKind::Toxic => toxic::ToxicRoom::supported(backend, target),
        FaultKind::Down => down::Down::supported(backend, target),
        FaultKind::QueueLimit => queue_limit::QueueLimit::supported(backend, target),
        FaultKind::Terminate => terminate::Terminate::supported(backend, target),
        FaultKind::RefuseStaging => refuse_staging::RefuseStaging::supported(backend, target),
        FaultKind::Failover => failover::FailoverRoom::supported(backend, target),
        FaultKind::ReplicationLag => replication_lag::ReplicationLag::supported(backend, target),
        FaultKind::Crash | FaultKind::Mutant => Ok(()),
    }
}

/// Every fault of `s` that `backend` cannot do, refused before the run starts anything of
/// the scenario (one line per fault, with the reason): never a run that fails when the
/// fault comes due.
pub(super) fn refuse_unsupported(s: &Scenario, backend: BackendKind) -> anyhow::Result<()> {
    let refused: Vec<String> = s
        .faults
        .iter()
        .map(|f| f.get_ref())
        .filter_map(|f| {
            let target = s.parse_target(&f.target)?;
            supported(f.kind, backend, &target).err().map(|why| format!("{} {}: {why}", f.kind.name(), f.target))
        })
        .collect();
    if refused.is_empty() {
        return Ok(());
    }
    anyhow::bail!("backend {backend} cannot run this scenario's faults: {}", refused.join("; "))
}

/// Wait for fault `f`'s trigger, then run it in its room.
#[allow(clippy::too_many_arguments)]
async fn inject(
    index: usize,
    f: Fault,
    ready: Option<tokio::sync::oneshot::Sender<()>>,
    target: FaultTarget,
    log: Log,
    backend: Arc<Mutex<Backend>>,
    replicas: Replicas,
    toxi: ToxiproxyClient,
    amqp_url: String,
    (mut writes, total_writes): (watch::Receiver<u32>, u32),
    (queue_type, redeploy, turns): (craig_mq::topology::QueueType, bool, NodeTurns),
) -> anyhow::Result<()> {
    match f.at {
        Trigger::AfterMs(ms) => tokio::time::sleep_until(log.started() + Duration::from_millis(ms)).await,
        Trigger::AfterWrites(n) => {
            let _ = writes.wait_for(|done| *done >= n).await;
        }
        Trigger::AfterPublished(n) => {
            // The publisher is live: the replica logged n rows stamped published (one
            // `outbox.stamped` line per row, on the #1128 path and the pre-1128 one alike), or
            // give up once the workload is done. A fault on a server (the broker, the
            // database) counts the whole fleet's rows: a server cut off before any publisher
            // connected catches nothing in flight, whatever the machine's load.
            let names: Vec<String> = match &target {
                FaultTarget::Replica(r) | FaultTarget::Link { replica: r, .. } if replicas.contains_key(r) => vec![r.clone()],
                // A server, a broker node, the standby's replication link.
                _ => replicas.keys().cloned().collect(),
            };
            let mut paths = Vec::new();
            for name in &names {
                let r = replicas.get(name).expect("validated").clone();
                paths.push(r.lock().await.log_path().to_path_buf());
            }
            let whose = if names.len() == 1 { names[0].clone() } else { "the fleet".to_owned() };
            let mut published = 0;
            let reached = in_logs(&paths, &writes, total_writes, |text| {
                published = text.lines().filter(|l| l.contains("event=\"outbox.stamped\"")).count();
                published >= n as usize
            });
            if !reached.await {
                log.finding(format!("{} {}: {whose} published {published} rows, never {n}; not done", f.kind.name(), f.target));
                return Ok(());
            }
        }
        Trigger::FailpointHit(n) => {
            // Only upgrades and downgrades get here (crashes are armed, not injected): wait
            // for the target's `failpoint.hit` marker, or give up once the workload is done.
            let fp = f.failpoint.clone().expect("validated");
            let r = replicas.get(&f.target).expect("validated").clone();
            let path = r.lock().await.log_path().to_path_buf();
            let marker = format!("failpoint=\"{fp}\"");
            let hit = in_log(&path, &writes, total_writes, |text| text.lines().any(|l| l.contains("event=\"failpoint.hit\"") && l.contains(&marker)));
            if !hit.await {
                log.finding(format!("{} {}: failpoint {fp} never reached hit {n}; not done", f.kind.name(), f.target));
                return Ok(());
            }
        }
    }
    if let Some(ms) = f.delay_ms {
        tokio::time::sleep(Duration::from_millis(ms)).await;
    }
    // A broker cluster loses one node at a time (issue 25; [`NodeTurns`]).
    let under_load = *writes.borrow() < total_writes;
    let (turn, waited_ms) = match turns.take(f.kind, &target, || log.now()).await {
        Turn::Free => (None, 0),
        Turn::Held(guard, waited_ms) => (Some(guard), waited_ms),
        Turn::Refused => {
            log.finding(format!(
                "{} {}: an earlier fault on a broker node failed, and its node may still be down; not done (no later broker node fault is)",
                f.kind.name(),
                f.target
            ));
            return Ok(());
        }
    };
    if waited_ms > 0 && under_load && *writes.borrow() >= total_writes {
        // Its trigger came under load, but the load ended while it waited: what the
        // scenario says of a fault under load was not tried.
        log.finding(format!(
            "{} {}: waited {waited_ms} ms for another broker node's fault to heal, and the first-phase writes had ended; it did not come under load",
            f.kind.name(),
            f.target
        ));
    }
    let cx = Cx {
        index,
        kind: f.kind.name(),
        label: label(&f),
        log,
        backend,
        replicas,
        toxi,
        amqp_url,
        queue_type,
        redeploy,
        ready: std::sync::Mutex::new(ready),
        waited_ms,
    };
    in_turn(turn, async {
        match f.kind {
            FaultKind::Kill => run::<kill::Kill>(&cx, &f, &target).await,
            FaultKind::Pause => run::<pause::Pause>(&cx, &f, &target).await,
            FaultKind::Partition => run::<partition::Partition>(&cx, &f, &target).await,
            FaultKind::Upgrade | FaultKind::Downgrade => run::<rollout::Rollout>(&cx, &f, &target).await,
            FaultKind::Toxic => run::<toxic::ToxicRoom>(&cx, &f, &target).await,
            FaultKind::Down => run::<down::Down>(&cx, &f, &target).await,
            FaultKind::QueueLimit => run::<queue_limit::QueueLimit>(&cx, &f, &target).await,
            FaultKind::Terminate => run::<terminate::Terminate>(&cx, &f, &target).await,
            FaultKind::RefuseStaging => run::<refuse_staging::RefuseStaging>(&cx, &f, &target).await,
            FaultKind::Failover => run::<failover::FailoverRoom>(&cx, &f, &target).await,
            FaultKind::ReplicationLag => run::<replication_lag::ReplicationLag>(&cx, &f, &target).await,
            FaultKind::Crash | FaultKind::Mutant => unreachable!("armed through FAILPOINTS, never injected"),
        }
    })
    .await
}

/// Run a fault (`act`) in its turn, held until it ends: one that fails (an error, or a
/// panic or abort that never finishes) marks the turn, and no later broker node fault acts.
async fn in_turn(turn: Option<NodeTurn>, act: impl std::future::Future<Output = anyhow::Result<()>>) -> anyhow::Result<()> {
    let done = act.await;
    if let (Some(mut t), true) = (turn, done.is_ok()) {
        t.finished = true;
    }
    done
}

/// One broker node out at a time (issue 25). On a broker cluster, a fault on a broker node
/// (`broker-N`, or `broker`, which is node 1) that comes due while a fault on a node is in
/// force (from its start through its heal: a killed node's hold, restart and return to its
/// quorum queues) waits for it, and only then records its start and acts, as an operator's
/// rolling restart waits between nodes. A fresh-clone CI on efe0f98 had a restart slow
/// enough (19 s) to push one kill into the next one's hold: broker-3 killed while broker-2
/// was still down, queues with no majority and no leader for 60 s. Where the fault before
/// failed, its node may still be down: every later one is refused (a finding). Only faults
/// that take a node out take turns (kill, pause, partition, a graceful restart); a queue
/// limit is the cluster's policy, on no node. Every shipped cluster scenario keeps a
/// majority up; two nodes out at once is not yet a fault.
#[derive(Clone)]
pub(super) struct NodeTurns {
    cluster: bool,
    /// Whether a fault that held the turn failed.
    turn: Arc<Mutex<bool>>,
}

/// A fault's turn at the cluster ([`NodeTurns::take`]).
pub(super) enum Turn {
    /// Not a broker node of a cluster: no turn to wait for.
    Free,
    /// Its turn, after waiting this many ms; held until the fault has healed.
    Held(NodeTurn, u64),
    /// A fault that held the turn before failed.
    Refused,
}

/// The turn a broker node's fault holds from its start through its heal. Let go of without
/// `finished` (the fault failed, panicked or was aborted), it refuses every later one.
pub(super) struct NodeTurn {
    guard: tokio::sync::OwnedMutexGuard<bool>,
    finished: bool,
}

impl Drop for NodeTurn {
    fn drop(&mut self) {
        if !self.finished {
            *self.guard = true;
        }
    }
}

impl NodeTurns {
    pub(super) fn new(broker_nodes: u8) -> Self {
        Self { cluster: broker_nodes > 1, turn: Arc::new(Mutex::new(false)) }
    }

    /// Wait for the turn of fault `kind` on `target` (`now`: the run's clock, ms).
    pub(super) async fn take(&self, kind: FaultKind, target: &FaultTarget, now: impl Fn() -> u64) -> Turn {
        let takes_a_node_out = matches!(kind, FaultKind::Kill | FaultKind::Pause | FaultKind::Partition | FaultKind::Upgrade | FaultKind::Downgrade);
        if !self.cluster || !takes_a_node_out || !matches!(target, FaultTarget::BrokerNode(_) | FaultTarget::Broker) {
            return Turn::Free;
        }
        let asked = now();
        // 0 only where nothing held the turn: a wait is never lost to the clock's rounding.
        let (guard, waited_ms) = match self.turn.clone().try_lock_owned() {
            Ok(guard) => (guard, 0),
            Err(_) => {
                let guard = self.turn.clone().lock_owned().await;
                (guard, now().saturating_sub(asked).max(1))
            }
        };
        if *guard {
            return Turn::Refused;
        }
        Turn::Held(NodeTurn { guard, finished: false }, waited_ms)
    }
}

/// A fault on a target its room does not handle (the scenario's validation keeps these out).
fn not_supported(f: &Fault) -> anyhow::Error {
    anyhow::anyhow!("fault {} on {} is not supported", f.kind.name(), f.target)
}

/// How the report names fault `f`; `History::fault_windows` turns it back into the cause
/// tag `fault:<kind> <target>` that a scenario's `[expect]` names (a test holds every
/// shipped fault to it).
pub(crate) fn label(f: &Fault) -> String {
    match (&f.toxic, f.kind) {
        (_, FaultKind::Crash) => format!("{} at {}", f.target, f.failpoint.as_deref().unwrap_or("?")),
        (_, FaultKind::Upgrade) if f.target.starts_with("broker-") => format!("{} (drained, restarted)", f.target),
        (_, FaultKind::Upgrade | FaultKind::Downgrade) => {
            let to = f.compat.as_deref().filter(|c| !c.is_empty()).map(|c| c.join(",")).unwrap_or_else(|| "current".into());
            format!("{} to {to}", f.target)
        }
        // "database (cases)": which service's outbox refuses (the cause tag stays
        // `fault:refuse_staging database`).
        (_, FaultKind::RefuseStaging) => format!("{} ({})", f.target, f.service.as_deref().unwrap_or("?")),
        (_, FaultKind::Terminate) => {
            format!("{} ({})", f.target, f.application_name.as_deref().unwrap_or(craig_mq::outbox::notify::APPLICATION_NAME))
        }
        (Some(t), FaultKind::Toxic) => format!("{} ({} {})", f.target, t.kind.label(), t.stream.as_str()),
        (_, FaultKind::ReplicationLag) => format!("{} ({} ms)", f.target, f.lag_ms.unwrap_or(0)),
        (_, FaultKind::QueueLimit) => {
            // "broker (craig-rules.events max-length 20, reject-publish)": the cause tag is
            // `fault:queue_limit broker`, as the scenario targets it.
            format!("{} ({} max-length {}, reject-publish)", f.target, f.queue.as_deref().unwrap_or("?"), f.max_length.unwrap_or(0))
        }
        _ => f.target.clone(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// One broker node out at a time: a second node's fault acts only once the first has
    /// healed (its `in_turn` ended); a failed one refuses every later one; a single node, a
    /// queue limit, the database and a replica never wait.
    #[tokio::test]
    async fn a_broker_node_fault_waits_for_the_one_in_force_and_a_failed_one_refuses_the_rest() {
        use FaultKind::*;
        let turns = NodeTurns::new(3);
        let take = |kind, target| {
            let t = turns.clone();
            async move { t.take(kind, &target, || 0).await }
        };
        let settle = || async {
            for _ in 0..20 {
                tokio::task::yield_now().await;
            }
        };
        let Turn::Held(first, 0) = take(Kill, FaultTarget::BrokerNode(2)).await else { panic!("the first fault waits for nothing") };
        let order = Arc::new(std::sync::Mutex::new(Vec::new()));
        let (o, t) = (order.clone(), take(Pause, FaultTarget::BrokerNode(3)));
        let second = tokio::spawn(async move {
            let turn = t.await;
            o.lock().unwrap().push("broker-3 acts");
            turn
        });
        // broker-2's fault runs in its turn: broker-3's waits all along.
        let o = order.clone();
        in_turn(Some(first), async {
            settle().await;
            o.lock().unwrap().push("broker-2 healed");
            // Not a node taken out: no turn to take, even now.
            for (kind, other) in [(Kill, FaultTarget::Database), (Kill, FaultTarget::Replica("cases-1".into())), (QueueLimit, FaultTarget::Broker)] {
                assert!(matches!(take(kind, other).await, Turn::Free));
            }
            Ok(())
        })
        .await
        .unwrap();
        let Turn::Held(second, waited) = second.await.unwrap() else { panic!("broker-3's fault never got its turn") };
        assert!(waited > 0, "a wait is never 0 ms");
        assert_eq!(*order.lock().unwrap(), ["broker-2 healed", "broker-3 acts"]);
        // `broker`, node 1 by its cluster-wide name, waits its turn too; broker-3's fault
        // fails, and neither it nor a later one acts.
        let third = tokio::spawn(take(Kill, FaultTarget::Broker));
        settle().await;
        assert!(in_turn(Some(second), async { anyhow::bail!("broker-3 was killed but no leader moved") }).await.is_err());
        assert!(matches!(third.await.unwrap(), Turn::Refused), "a fault waiting behind a failed one acted");
        assert!(matches!(take(Upgrade, FaultTarget::BrokerNode(1)).await, Turn::Refused), "a later fault acted after a failed one");
        // A fault that never finishes (a panic, an abort) counts as failed.
        let other = NodeTurns::new(3);
        let Turn::Held(turn, _) = other.take(Kill, &FaultTarget::BrokerNode(1), || 0).await else { panic!() };
        drop(turn);
        assert!(matches!(other.take(Kill, &FaultTarget::BrokerNode(2), || 0).await, Turn::Refused));
        // One broker node: nothing to take turns at.
        assert!(matches!(NodeTurns::new(1).take(Kill, &FaultTarget::Broker, || 0).await, Turn::Free));
    }

    /// The leaders a node held, as a listing after its kill or partition shows them: moved,
    /// still on it, or (a queue the listing lacks) left out.
    #[test]
    fn leaders_now_says_where_each_led_queue_is_led() {
        let q = |name: &str, leader: &str| crate::backend::local::QueuePlacement {
            name: name.into(),
            kind: "quorum".into(),
            nodes: vec![],
            leader: leader.into(),
            messages: 0,
        };
        let now = [q("a", "n2"), q("b", "n1"), q("c", "n3")];
        assert_eq!(leaders_now(&["a", "b", "gone"], &now, "n1"), ["a → n2", "b → still it"]);
    }

    /// Issue 24: a backend states what it can do, and a scenario it cannot run is refused
    /// before the run starts, naming each fault and why. Every shipped scenario runs on
    /// `local` (a partition between broker nodes only as root) and `containers`; `external`
    /// refuses exactly those that kill or pause a server, cut a broker node off from its
    /// peers or restart one.
    #[test]
    fn each_backend_refuses_exactly_the_shipped_faults_it_cannot_do() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../scenarios");
        let mut paths: Vec<_> = std::fs::read_dir(&dir).unwrap().map(|e| e.unwrap().path()).filter(|p| p.extension().is_some_and(|e| e == "toml")).collect();
        paths.sort();
        let mut external = 0;
        for s in crate::scenario::load(&paths).unwrap() {
            let faults: Vec<(FaultKind, FaultTarget)> = s.faults.iter().map(|f| (f.get_ref().kind, s.parse_target(&f.get_ref().target).unwrap())).collect();
            // A partition between broker nodes needs root and iptables: refused up front otherwise.
            let cuts_a_node = faults.iter().any(|(k, t)| *k == FaultKind::Partition && matches!(t, FaultTarget::BrokerNode(_)));
            let local = refuse_unsupported(&s, BackendKind::Local);
            let can_cut = crate::backend::local::can_cut_nodes().is_ok();
            assert_eq!(local.is_err(), cuts_a_node && !can_cut, "{}: {local:?}", s.name);
            if let Err(e) = local {
                assert!(e.to_string().contains("partition broker-") && e.to_string().contains("needs root"), "{e}");
            }
            let on_server = faults.iter().any(|(k, t)| {
                (matches!(k, FaultKind::Kill | FaultKind::Pause | FaultKind::Failover) && matches!(t, FaultTarget::Broker | FaultTarget::BrokerNode(_) | FaultTarget::Database))
                    || (matches!(k, FaultKind::Partition | FaultKind::Upgrade) && matches!(t, FaultTarget::BrokerNode(_)))
            });
            match refuse_unsupported(&s, BackendKind::External) {
                Ok(()) => assert!(!on_server, "{}: external must refuse a server fault", s.name),
                Err(e) => {
                    assert!(on_server, "{}: {e}", s.name);
                    assert!(e.to_string().contains("backend external cannot run this scenario's faults") && e.to_string().contains("the servers are shared"), "{e}");
                    external += 1;
                }
            }
            // A database failover and a replication lag (issue 26) run on containers too.
            assert!(refuse_unsupported(&s, BackendKind::Containers).is_ok(), "{}: containers refused it", s.name);
        }
        assert!(external > 0, "shipped scenarios cover the refusal: {external}");
    }

    /// A cause a scenario names (`fault:<kind> <target>`, what the parser accepts) is the tag
    /// its fault's window carries: for every fault of every shipped scenario, the report's
    /// label (a crash's restart too) reads back as that tag. (`fault:queue_limit broker`
    /// could never be met while the label led with the queue.)
    #[test]
    fn every_shipped_fault_reads_back_as_the_cause_its_scenario_names() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../scenarios");
        let mut paths: Vec<_> = std::fs::read_dir(&dir).unwrap().map(|e| e.unwrap().path()).filter(|p| p.extension().is_some_and(|e| e == "toml")).collect();
        paths.sort();
        let mut kinds = std::collections::BTreeSet::new();
        for s in crate::scenario::load(&paths).unwrap() {
            for f in s.faults.iter().map(|f| f.get_ref()) {
                let mut h = crate::history::History::default();
                let end = if f.kind == FaultKind::Crash { format!("{} restarted", f.target) } else { label(f) };
                h.push(1, Event::Fault { kind: f.kind.name().into(), target: label(f), phase: Phase::Start });
                h.push(2, Event::Fault { kind: f.kind.name().into(), target: end, phase: Phase::End });
                let want = format!("fault:{} {}", f.kind.name(), f.target);
                assert_eq!(h.fault_windows(), vec![(want, 1, 2)], "{}: {f:?}", s.name);
                kinds.insert(f.kind.name());
            }
        }
        assert!(kinds.contains("queue_limit") && kinds.contains("toxic") && kinds.contains("crash"), "{kinds:?}");
    }
}
