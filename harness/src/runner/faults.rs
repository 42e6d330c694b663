//! The fault schedule: crash points armed through `FAILPOINTS` (the watcher records each
//! crash and restarts), every other fault injected at its time, write count or marker,
//! late starts, rollouts. One interface, [`Schedule`]: start it, await `healed`, `finish`.

use std::time::Duration;

use anyhow::Context as _;
use serde_json::json;
use tokio::sync::{Mutex, watch};
use tokio::time::Instant;

use super::{Log, Replicas, consumes};
use crate::backend::{Backend, Target};
use crate::history::{Event, Phase};
use crate::process::describe;
use crate::proxy::{Toxic, ToxiproxyClient};
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

/// Held by an upgrade or downgrade from its stop to its replica's restart.
static ROLLOUT: Mutex<()> = Mutex::const_new(());

/// Poll replica log `path` (every 20 ms) until `reached` holds for its text; false once the
/// first-phase writes (`total` of them) have been done for 5 s without it.
async fn in_log(path: &std::path::Path, writes: &watch::Receiver<u32>, total: u32, mut reached: impl FnMut(&str) -> bool) -> bool {
    let mut done_since: Option<Instant> = None;
    loop {
        if reached(&std::fs::read_to_string(path).unwrap_or_default()) {
            return true;
        }
        if *writes.borrow() >= total && done_since.get_or_insert_with(Instant::now).elapsed() > Duration::from_secs(5) {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

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
) -> anyhow::Result<()> {
    match f.at {
        Trigger::AfterMs(ms) => tokio::time::sleep_until(log.started() + Duration::from_millis(ms)).await,
        Trigger::AfterWrites(n) => {
            let _ = writes.wait_for(|done| *done >= n).await;
        }
        Trigger::AfterPublished(n) => {
            // The publisher is live: the replica logged n rows stamped published (one
            // `outbox.stamped` line per row, on the #1128 path and the pre-1128 one alike), or
            // give up once the workload is done.
            let name = match &target {
                FaultTarget::Replica(r) | FaultTarget::Link { replica: r, .. } => r.clone(),
                _ => unreachable!("validated: after_published times a replica or its link"),
            };
            let r = replicas.get(&name).expect("validated").clone();
            let path = r.lock().await.log_path().to_path_buf();
            let mut published = 0;
            let reached = in_log(&path, &writes, total_writes, |text| {
                published = text.lines().filter(|l| l.contains("event=\"outbox.stamped\"")).count();
                published >= n as usize
            });
            if !reached.await {
                log.finding(format!("{} {}: {name} published {published} rows, never {n}; not done", f.kind.name(), f.target));
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
    let kind = f.kind.name();
    let label = label(&f);
    let hold = Duration::from_millis(f.duration_ms.or(f.restart_after_ms).unwrap_or(0));
    if f.kind != FaultKind::QueueLimit {
        log.fault(kind, &label, Phase::Start);
    }
    match (&target, f.kind) {
        (FaultTarget::Broker | FaultTarget::Database, FaultKind::Kill) => {
            let t = if target == FaultTarget::Broker { Target::Broker } else { Target::Database };
            let died = backend.lock().await.kill(t).await?;
            log.evidence(kind, &label, died);
            tokio::time::sleep(hold).await;
            backend.lock().await.restart(t).await?;
        }
        (FaultTarget::Broker | FaultTarget::Database, FaultKind::Pause) => {
            let t = if target == FaultTarget::Broker { Target::Broker } else { Target::Database };
            let stopped = backend.lock().await.pause(t, true).await?;
            log.evidence(kind, &label, stopped);
            tokio::time::sleep(hold).await;
            backend.lock().await.pause(t, false).await?;
        }
        (FaultTarget::Replica(name), FaultKind::Kill) => {
            let r = replicas.get(name).expect("validated").clone();
            let service = name.rsplit_once('-').map(|(s, _)| s).unwrap_or(name);
            let pid = r.lock().await.pid();
            let status = r.lock().await.kill().await?;
            log.evidence(kind, &label, pid.map(|p| format!("pid {p} died ({})", describe(status))));
            log.push(Event::Crash { replica: name.clone(), consumer: consumes(service), how: describe(status) });
            tokio::time::sleep(hold).await;
            let mut r = r.lock().await;
            log.push(Event::Started { replica: name.clone(), compat: r.spec.compat.clone() });
            r.start().await?;
        }
        (FaultTarget::Replica(name), FaultKind::Upgrade | FaultKind::Downgrade) => {
            // One replica at a time, as a rollout goes: an upgrade whose time comes while
            // another is still restarting waits for it.
            let _one_at_a_time = ROLLOUT.lock().await;
            // Graceful: SIGTERM, the node's bounded drain, exit; then the other behaviour.
            let r = replicas.get(name).expect("validated").clone();
            let mut r = r.lock().await;
            let pid = r.pid();
            let stopped = match pid {
                Some(_) => Some(r.stop(Duration::from_secs(15)).await?),
                None => None,
            };
            // Evidence: the old process exited by itself on SIGTERM (a stop that had to
            // SIGKILL it was no graceful step of a rollout).
            log.evidence(
                kind,
                &label,
                match (pid, stopped) {
                    (Some(p), Some(st)) if st.success() => Some(format!("pid {p} drained and exited ({})", describe(st))),
                    _ => None,
                },
            );
            r.spec.compat = f.compat.clone().unwrap_or_default();
            r.spec.failpoints = mutants_only(r.spec.failpoints.take()); // the marker served its purpose
            log.push(Event::Started { replica: name.clone(), compat: r.spec.compat.clone() });
            r.start().await?;
        }
        (FaultTarget::Replica(name), FaultKind::Pause) => {
            let r = replicas.get(name).expect("validated").clone();
            let pid = r.lock().await.pid();
            r.lock().await.pause()?;
            // Evidence: the kernel reports the process stopped (SIGSTOP lands asynchronously).
            let seen = match pid {
                Some(p) => crate::process::wait_stopped(p).await,
                None => false,
            };
            log.evidence(kind, &label, pid.filter(|_| seen).map(|p| format!("pid {p} stopped")));
            tokio::time::sleep(hold).await;
            r.lock().await.resume()?;
        }
        (FaultTarget::Link { replica, to }, FaultKind::Toxic) => {
            let proxy = format!("{replica}->{to}");
            let spec = f.toxic.clone().expect("validated");
            let toxic = Toxic { name: format!("fault-{index}"), stream: spec.stream, toxicity: spec.toxicity, kind: spec.kind };
            toxi.add_toxic(&proxy, &toxic).await?;
            tokio::time::sleep(hold).await;
            // Evidence before removal: what the toxic acted on while it was in place.
            // Bytes it took in: a toxic on idle connections acted on nothing. A Toxiproxy
            // without these counters gives no evidence either.
            let affected = toxi.proxy(&proxy).await?.affected;
            log.evidence(
                kind,
                &label,
                // Issue 22.9: payload, not heartbeats (an idle AMQP link still beats).
                affected
                    .get(&toxic.name)
                    .filter(|a| a.payload_bytes > 0)
                    .map(|a| format!("{} bytes ({} of payload) over {} connections", a.bytes, a.payload_bytes, a.connections)),
            );
            toxi.remove_toxic(&proxy, &toxic.name).await?;
        }
        (FaultTarget::Broker, FaultKind::QueueLimit) => {
            let queue = f.queue.as_deref().expect("validated");
            let policy = format!("chaos-queue-limit-{index}");
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
            let probe = HeadDropProbe::open(&amqp_url, queue).await;
            if let Err(e) = &probe {
                log.finding(format!("queue_limit {label}: cannot watch for head drops ({e}); a loss in this run may be the fault's own"));
            }
            let asked = Instant::now();
            backend.lock().await.set_policy(&policy, &pattern, &definition).await?;
            log.fault(kind, &label, Phase::Start);
            if let Some(ready) = ready {
                let _ = ready.send(());
            }
            log.evidence(kind, &label, Some(format!("policy in force {} ms after it was asked for", asked.elapsed().as_millis())));
            // (One hold: the limit is in force for duration_ms, as the scenario says; it
            // used to be held twice over.)
            tokio::time::sleep(hold).await;
            backend.lock().await.clear_policy(&policy).await?;
            // Read once the limit is gone: head drops of the whole window count.
            if let Ok(probe) = probe {
                match probe.head_drops().await {
                    Ok(0) => {}
                    Ok(n) => log.finding(format!(
                        "queue_limit {label}: the limit landed on a backlog and RabbitMQ dropped {n} message(s) from the head of {queue} to {} (x-death reason maxlen), so the fault itself lost them and the run proves nothing about loss",
                        craig_mq::topology::DLX_EXCHANGE
                    )),
                    Err(e) => log.finding(format!("queue_limit {label}: cannot read the head-drop probe ({e}): a loss in this run may be the fault's own")),
                }
            }
        }
        (FaultTarget::Link { replica, to }, FaultKind::Down) => {
            let proxy = format!("{replica}->{to}");
            let before = toxi.proxy(&proxy).await?.cut_connections;
            let after = toxi.set_enabled(&proxy, false).await?.cut_connections;
            // Evidence: live connections it cut (new ones are refused while it is down,
            // which the proxy cannot count).
            log.evidence(
                kind,
                &label,
                match (before, after) {
                    (Some(b), Some(a)) if a > b => Some(format!("{} live connections cut", a - b)),
                    _ => None,
                },
            );
            tokio::time::sleep(hold).await;
            toxi.set_enabled(&proxy, true).await?;
        }
        (FaultTarget::Database, FaultKind::Terminate) => {
            let name = f.application_name.clone().unwrap_or_else(|| craig_mq::outbox::notify::APPLICATION_NAME.to_owned());
            let databases = backend.lock().await.endpoints().databases;
            let url = databases.first().map(|(_, u)| u.clone()).context("no database")?;
            // This run's databases only: on a shared server (`external`) another run's
            // backends are neither ours to cut nor our evidence.
            let names: Vec<String> = databases
                .iter()
                .filter_map(|(_, u)| u.rsplit_once('/').map(|(_, db)| db.split('?').next().unwrap_or(db).to_owned()))
                .collect();
            let pool = sqlx::postgres::PgPoolOptions::new().max_connections(1).connect(&url).await?;
            let until = Instant::now() + hold;
            let mut pids: Vec<i32> = Vec::new();
            loop {
                // The server's own word: the pids it terminated.
                // In the target list, so it runs only on the rows the WHERE kept.
                let cut: Vec<(i32, bool)> = sqlx::query_as(
                    "SELECT pid, pg_terminate_backend(pid) FROM pg_stat_activity \
                     WHERE application_name = $1 AND datname = ANY($2) AND pid <> pg_backend_pid()",
                )
                .bind(&name)
                .bind(&names)
                .fetch_all(&pool)
                .await
                .unwrap_or_default();
                pids.extend(cut.into_iter().filter(|(_, done)| *done).map(|(pid, _)| pid));
                if Instant::now() >= until {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(250)).await;
            }
            pool.close().await;
            log.evidence(kind, &label, (!pids.is_empty()).then(|| format!("{} backend(s) named {name} terminated (pids {pids:?})", pids.len())));
        }
        (FaultTarget::Database, FaultKind::RefuseStaging) => {
            let (svc, every, table) = (f.service.clone().expect("validated"), f.every.expect("validated"), f.refused_table().to_owned());
            let url = backend.lock().await.endpoints().database_url(&svc).context("no database for the service")?.to_owned();
            let pool = sqlx::postgres::PgPoolOptions::new().max_connections(1).connect(&url).await?;
            // A sequence counts every insert tried (nextval survives the rollback it causes):
            // its value is the evidence of how many were refused.
            for sql in [
                "CREATE SEQUENCE IF NOT EXISTS chaos_refuse_staging_seq".to_owned(),
                "ALTER SEQUENCE chaos_refuse_staging_seq RESTART".to_owned(),
                format!(
                    "CREATE OR REPLACE FUNCTION chaos_refuse_staging() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN \
                     IF nextval('chaos_refuse_staging_seq') % {every} = 0 THEN \
                     RAISE EXCEPTION 'chaos refuse_staging: this insert into {table} is refused' USING ERRCODE = '40001'; END IF; \
                     RETURN NEW; END $$"
                ),
                format!("DROP TRIGGER IF EXISTS chaos_refuse_staging ON {table}"),
                format!("CREATE TRIGGER chaos_refuse_staging BEFORE INSERT ON {table} FOR EACH ROW EXECUTE FUNCTION chaos_refuse_staging()"),
            ] {
                sqlx::query(sqlx::AssertSqlSafe(sql)).execute(&pool).await?;
            }
            tokio::time::sleep(hold).await;
            // Healed first, whatever the evidence read says.
            sqlx::query(sqlx::AssertSqlSafe(format!("DROP TRIGGER IF EXISTS chaos_refuse_staging ON {table}"))).execute(&pool).await?;
            let tried: Option<i64> = sqlx::query_scalar("SELECT CASE WHEN is_called THEN last_value ELSE 0 END FROM chaos_refuse_staging_seq")
                .fetch_optional(&pool)
                .await
                .ok()
                .flatten();
            pool.close().await;
            // A sequence that could not be read proves nothing (never "0 refused").
            let evidence = match tried {
                None => {
                    tracing::warn!(service = %svc, "refuse_staging: its sequence could not be read: no evidence");
                    None
                }
                Some(tried) => {
                    let refused = tried / i64::from(every);
                    (refused > 0).then(|| format!("{refused} of {tried} inserts into {svc}'s {table} refused"))
                }
            };
            log.evidence(kind, &label, evidence);
        }
        _ => anyhow::bail!("fault {kind} on {} is not supported", f.target),
    }
    log.fault(kind, &label, Phase::End);
    Ok(())
}

/// Watches one queue's dead letters for head drops (x-death reason `maxlen`) while a
/// `queue_limit` is in force: an exclusive server-named queue bound on `craig.dlx` to
/// `dlq.<queue>`, gone with its connection. Every broker call is bounded.
struct HeadDropProbe {
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
            let probe = super::tap::bind_on_dlx(&ch, "", q, &craig_mq::topology::dlq_routing_key(queue)).await?;
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

/// How the report names fault `f`; `History::fault_windows` turns it back into the cause
/// tag `fault:<kind> <target>` that a scenario's `[expect]` names (a test holds every
/// shipped fault to it).
pub(crate) fn label(f: &Fault) -> String {
    match (&f.toxic, f.kind) {
        (_, FaultKind::Crash) => format!("{} at {}", f.target, f.failpoint.as_deref().unwrap_or("?")),
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
    use craig_mq::topology::{QueueSpec, declare_consumer_queue, queue_depth};

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
        declare_consumer_queue(&ch, &QueueSpec { queue: queue.into(), bindings: vec!["k".into()], with_dlx: true }).await.unwrap();
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
