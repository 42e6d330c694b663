//! Runs one scenario end to end: backend → migrations and topology → a fault proxy in
//! front of every replica's database and broker connections → replicas → workload, faults
//! and sampling → drain (liveness) → collection → checkers.
//!
//! One seed drives the workload's choices and the proxy's jitter; every fault is recorded
//! in the history with its time. A seed fixes the schedule, not the interleaving: real
//! processes, sockets and the OS scheduler still decide what overlaps (as TigerBeetle's
//! Vortex says of itself).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use rand::{RngExt, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde_json::json;
use sqlx::PgPool;
use tokio::sync::{Mutex, watch};
use tokio::time::Instant;
use uuid::Uuid;

use crate::backend::{Backend, BackendKind, Choice, Target};
use crate::checkers::{self, Validity, Verdict};
use crate::history::{Event, History, Outcome, Phase};
use crate::process::{NodeProgram, Replica, ReplicaSpec, describe};
use crate::proxy::{FaultProxy, Toxic, ToxiproxyClient, api};
use crate::scenario::{Expect, Expectation, Fault, FaultKind, FaultTarget, Scenario, Trigger};

pub struct RunOptions {
    pub backend: BackendKind,
    /// How replicas are launched (the harness binary, or `CRAIG_NODE_BIN`).
    pub node_program: NodeProgram,
    pub report_dir: PathBuf,
    /// Print live progress lines to stderr.
    pub progress: bool,
}

#[derive(Debug, Clone, serde::Serialize)]
pub struct FaultRecord {
    pub kind: String,
    pub target: String,
    pub at_ms: u64,
    /// What shows the fault took effect: the pid that died, the bytes and connections a
    /// toxic acted on.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub evidence: Option<String>,
}

#[derive(Debug, Clone, serde::Serialize)]
pub struct InvariantResult {
    pub name: String,
    pub expected: Expect,
    /// The cause every violation must point at (`{ violate = "<cause>" }`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cause: Option<String>,
    /// "held" | "violated"; absent when the checker could not decide.
    pub observed: Option<String>,
    pub counts: BTreeMap<String, u64>,
    pub witnesses: Vec<String>,
    /// Violations found, and how many point at each replica and compat mode.
    pub violations: u64,
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    pub culprits: BTreeMap<String, u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

impl InvariantResult {
    /// Observed as expected.
    pub fn met(&self) -> bool {
        self.observed.as_deref() == Some(expected_word(self.expected))
    }
}

#[derive(Debug, Clone, serde::Serialize)]
pub struct ScenarioResult {
    pub name: String,
    pub amendment: String,
    pub compat: String,
    pub seed: u64,
    pub backend: String,
    pub faults: Vec<FaultRecord>,
    pub invariants: Vec<InvariantResult>,
    pub passed: bool,
    /// Some result could not be decided (a checker with nothing to check, or a run error).
    pub inconclusive: bool,
    pub duration_ms: u64,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    /// Each replica's `/metrics` (CONTRACT § Metrics) scraped at the end of the run, before
    /// it stopped: counters since that replica's last start. Shows, e.g., that redeliveries
    /// were absorbed (`inbox_dedup_hits_total`) rather than absent.
    pub metrics: BTreeMap<String, BTreeMap<String, f64>>,
    #[serde(skip)]
    pub history: History,
}

/// The per-scenario seed: the scenario's own, else derived from the run seed and the name.
pub fn scenario_seed(run_seed: u64, s: &Scenario) -> u64 {
    s.seed.unwrap_or_else(|| {
        let mut h: u64 = 0xcbf2_9ce4_8422_2325;
        for b in s.name.bytes() {
            h = (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3);
        }
        h ^ run_seed
    })
}

/// Shared clock and history of one run. Time 0 is the start of the workload (set by
/// [`Log::rebase`] once the servers and replicas are up); set-up happens "before" 0.
#[derive(Clone)]
struct Log {
    origin: Arc<std::sync::Mutex<(Instant, i64)>>,
    /// Database clock minus harness wall clock, ms, measured at [`Log::rebase`]: every DB
    /// timestamp is converted with it ([`Log::rel_db`]), so the checkers compare one clock.
    db_offset_ms: Arc<std::sync::atomic::AtomicI64>,
    history: Arc<std::sync::Mutex<History>>,
    faults: Arc<std::sync::Mutex<Vec<FaultRecord>>>,
    /// Things that went wrong outside the schedule (a replica exiting on its own, a restart
    /// that failed): each makes the scenario inconclusive, with the reason.
    findings: Arc<std::sync::Mutex<Vec<String>>>,
}

impl Log {
    fn new() -> Self {
        Self {
            origin: Arc::new(std::sync::Mutex::new((Instant::now(), chrono::Utc::now().timestamp_millis()))),
            db_offset_ms: Arc::default(),
            history: Arc::default(),
            faults: Arc::default(),
            findings: Arc::default(),
        }
    }
    fn rebase(&self) {
        *self.origin.lock().unwrap() = (Instant::now(), chrono::Utc::now().timestamp_millis());
    }
    fn started(&self) -> Instant {
        self.origin.lock().unwrap().0
    }
    fn now(&self) -> u64 {
        self.started().elapsed().as_millis() as u64
    }
    fn push(&self, event: Event) {
        let t = self.now();
        self.history.lock().unwrap().push(t, event);
    }
    fn push_at(&self, t: u64, event: Event) {
        self.history.lock().unwrap().push(t, event);
    }
    fn finding(&self, what: String) {
        self.findings.lock().unwrap().push(format!("{what} @{}ms", self.now()));
    }
    fn fault(&self, kind: &str, target: &str, phase: Phase) {
        if phase == Phase::Start {
            self.faults.lock().unwrap().push(FaultRecord { kind: kind.into(), target: target.into(), at_ms: self.now(), evidence: None });
        }
        self.push(Event::Fault { kind: kind.into(), target: target.into(), phase });
    }
    /// Record what shows the fault `kind` on `target` took effect; `None`: it did not,
    /// which is a finding (the run proves nothing about a fault that never happened).
    fn evidence(&self, kind: &str, target: &str, evidence: Option<String>) {
        if let Some(r) = self.faults.lock().unwrap().iter_mut().rev().find(|r| r.kind == kind && r.target == target) {
            r.evidence = evidence.clone();
        }
        if evidence.is_none() {
            self.finding(format!("{kind} {target}: no evidence it took effect"));
        }
    }
    /// A harness wall-clock time (epoch ms) as run time (clamped at 0).
    fn rel(&self, epoch_ms: i64) -> u64 {
        (epoch_ms - self.origin.lock().unwrap().1).max(0) as u64
    }
    /// A database timestamp (epoch ms, the DB's clock) as run time.
    fn rel_db(&self, db_epoch_ms: i64) -> u64 {
        self.rel(db_epoch_ms - self.db_offset_ms.load(std::sync::atomic::Ordering::Relaxed))
    }
    /// Measure the database clock against ours (midpoint of one bounded round trip).
    async fn measure_db_clock(&self, pool: &PgPool) {
        let before = chrono::Utc::now().timestamp_millis();
        let db = tokio::time::timeout(
            Duration::from_secs(5),
            sqlx::query_scalar::<_, i64>("SELECT (EXTRACT(EPOCH FROM clock_timestamp()) * 1000)::int8").fetch_one(pool),
        )
        .await;
        let after = chrono::Utc::now().timestamp_millis();
        if let Ok(Ok(db)) = db {
            self.db_offset_ms.store(db - (before + after) / 2, std::sync::atomic::Ordering::Relaxed);
        }
    }
}

type Replicas = Arc<BTreeMap<String, Arc<Mutex<Replica>>>>;

fn consumes(service: &str) -> bool {
    service.parse::<craig_fleet::Service>().map(|s| !s.consumes().is_empty()).unwrap_or(false)
}

/// Run one scenario. Errors inside the run are reported in the result (inconclusive).
pub async fn run_scenario(s: &Scenario, opts: &RunOptions, seed: u64) -> ScenarioResult {
    let run_clock = Instant::now();
    let log = Log::new();
    log.push(Event::Seed { seed, scenario: s.name.clone() });
    let mut result = ScenarioResult {
        name: s.name.clone(),
        amendment: s.amendment.clone(),
        compat: s.compat_summary(),
        seed,
        backend: String::new(),
        faults: vec![],
        invariants: vec![],
        passed: false,
        inconclusive: false,
        duration_ms: 0,
        error: None,
        metrics: BTreeMap::new(),
        history: History::default(),
    };
    match execute(s, opts, seed, &log, &mut result).await {
        Ok(()) => {}
        Err(e) => {
            result.error = Some(format!("{e:#}"));
            result.inconclusive = true;
        }
    }
    let mut history = log.history.lock().unwrap().clone();
    history.sort();
    result.faults = log.faults.lock().unwrap().clone();
    if result.error.is_none() {
        for (name, expect) in &s.expect {
            let v = checkers::check(name, &history).unwrap_or_else(|| Verdict::undecided(name, "no such checker"));
            result.invariants.push(invariant_result(v, expect.get_ref()));
        }
        result.inconclusive = result.invariants.iter().any(|i| i.observed.is_none());
        result.passed = !result.inconclusive && result.invariants.iter().all(InvariantResult::met);
    }
    let findings = log.findings.lock().unwrap().clone();
    if !findings.is_empty() {
        inconclusive(&mut result, findings.join("; "));
    }
    // A queue limit that made the broker Nack nothing proves nothing either: the evidence is
    // the producers' own `outbox_publish_errors_total{kind="nacked"}`.
    if s.faults.iter().any(|f| f.get_ref().kind == FaultKind::QueueLimit) {
        let nacked: f64 = result
            .metrics
            .values()
            .flat_map(|m| m.iter())
            .filter(|(k, _)| k.as_str() == "outbox_publish_errors_total{kind=\"nacked\"}")
            .map(|(_, v)| v)
            .sum();
        if nacked == 0.0 {
            inconclusive(
                &mut result,
                "queue_limit: no replica reports a Nacked publish (outbox_publish_errors_total{kind=\"nacked\"} = 0): the fault did not take effect".into(),
            );
        }
    }
    // Too little activity proves nothing, whatever the verdicts.
    if result.error.is_none() {
        if let Some(why) = below_floor(s, &history, &result.metrics) {
            inconclusive(&mut result, why);
        }
    }
    // A named crash point that never fired proves nothing: inconclusive, with the reason.
    let unfired: Vec<String> = s
        .faults
        .iter()
        .map(|f| f.get_ref())
        .filter(|f| f.kind == FaultKind::Crash)
        .filter(|f| !result.faults.iter().any(|r| r.kind == "crash" && r.target.starts_with(&format!("{} at ", f.target))))
        .map(|f| format!("crash point {} on {} never fired", f.failpoint.as_deref().unwrap_or("?"), f.target))
        .collect();
    if !unfired.is_empty() {
        inconclusive(&mut result, format!("{}: the fault did not take effect", unfired.join("; ")));
    }
    result.duration_ms = run_clock.elapsed().as_millis() as u64;
    result.history = history;
    result
}

/// Why the run did too little to be trusted (None: every floor met): fewer acknowledged
/// writes, absorbed redeliveries or dead letters than `[expect]` asks, or no write
/// acknowledged after every fault healed.
fn below_floor(s: &Scenario, h: &History, metrics: &BTreeMap<String, BTreeMap<String, f64>>) -> Option<String> {
    let healed = h.iter().find(|e| matches!(e.event, Event::Healed)).map(|e| e.t_ms);
    let (mut acknowledged, mut after_heal) = (0u64, 0u64);
    for e in h.iter() {
        if let Event::Write { outcome: Outcome::Ok, .. } = e.event {
            acknowledged += 1;
            if healed.is_some_and(|t| e.t_ms >= t) {
                after_heal += 1;
            }
        }
    }
    let redeliveries: f64 =
        metrics.values().flat_map(|m| m.iter()).filter(|(k, _)| k.as_str() == "inbox_dedup_hits_total").map(|(_, v)| v).sum();
    let dead = h.iter().find_map(|e| if let Event::DeadLetters { count } = e.event { Some(u64::from(count)) } else { None });
    let f = s.floor;
    let mut why = Vec::new();
    if acknowledged < f.acknowledged {
        why.push(format!("{acknowledged} writes acknowledged, below min_acknowledged = {}", f.acknowledged));
    }
    if !s.faults.is_empty() && after_heal == 0 {
        why.push(match healed {
            Some(t) => format!("no write acknowledged after every fault healed (@{t}ms)"),
            None => "the run never reached the point where every fault had healed".to_owned(),
        });
    }
    if (redeliveries as u64) < f.redeliveries {
        why.push(format!("{redeliveries} redeliveries absorbed by an inbox (inbox_dedup_hits_total), below min_redeliveries = {}", f.redeliveries));
    }
    if f.dead_letters > 0 && dead.unwrap_or(0) < f.dead_letters {
        why.push(format!("{} dead letters in {}, below min_dead_letters = {}", dead.map_or("unknown".into(), |d| d.to_string()), craig_mq::topology::DLQ_QUEUE, f.dead_letters));
    }
    (!why.is_empty()).then(|| format!("below the activity floor: {}", why.join("; ")))
}

/// Mark the result inconclusive for `why`, unless an earlier reason already did (the first
/// reason found is the one reported).
fn inconclusive(result: &mut ScenarioResult, why: String) {
    if result.error.is_none() {
        result.error = Some(why);
        result.inconclusive = true;
        result.passed = false;
    }
}

fn expected_word(e: Expect) -> &'static str {
    match e {
        Expect::Hold => "held",
        Expect::Violate => "violated",
    }
}

/// What [`InvariantResult::observed`] says of a violation that does not all point at the
/// expected cause: red, but not (only) for the documented reason.
pub const OTHER_CAUSE: &str = "violated, not only by its cause";

fn invariant_result(v: Verdict, expected: &Expectation) -> InvariantResult {
    let observed = match v.validity {
        Validity::Valid => Some("held".to_owned()),
        Validity::Invalid => match &expected.cause {
            Some(cause) if !v.all_point_at(cause) => Some(OTHER_CAUSE.to_owned()),
            _ => Some("violated".to_owned()),
        },
        Validity::Unknown => None,
    };
    InvariantResult {
        name: v.name,
        expected: expected.expect,
        cause: expected.cause.clone(),
        observed,
        counts: v.counts,
        witnesses: v.witnesses,
        violations: v.violations,
        culprits: v.culprits,
        error: v.error,
    }
}

async fn execute(s: &Scenario, opts: &RunOptions, seed: u64, log: &Log, result: &mut ScenarioResult) -> anyhow::Result<()> {
    use anyhow::Context as _;
    let services: Vec<String> = s.fleet.keys().cloned().collect();
    let svc_refs: Vec<&str> = services.iter().map(String::as_str).collect();
    let (backend, choice): (Backend, Choice) =
        Backend::start(opts.backend, &format!("{}-{seed}", s.name), &svc_refs).await.context("starting the backend")?;
    result.backend = choice.kind.name().to_owned();
    if opts.progress {
        eprintln!("  backend: {} ({})", choice.kind, choice.reason);
    }
    let backend = Arc::new(Mutex::new(backend));
    let outcome = drive(s, opts, seed, log, backend.clone(), &mut result.metrics).await;
    let stop = match Arc::try_unwrap(backend) {
        Ok(b) => b.into_inner().stop().await.context("stopping the backend"),
        Err(_) => Ok(()), // a task still holds it; its Drop cleans up
    };
    outcome.and(stop)
}

async fn drive(
    s: &Scenario,
    opts: &RunOptions,
    seed: u64,
    log: &Log,
    backend: Arc<Mutex<Backend>>,
    metrics: &mut BTreeMap<String, BTreeMap<String, f64>>,
) -> anyhow::Result<()> {
    use anyhow::Context as _;
    let ep = backend.lock().await.endpoints();
    if matches!(backend.lock().await.kind(), BackendKind::Containers) {
        anyhow::bail!("scenario runs on the containers backend need its Toxiproxy wiring, which is not built yet; use local or external");
    }
    // Schema first. Broker topology only if the scenario deploys it (`[deploy] topology`):
    // otherwise each node declares just its own queue at start, as in a deployment without
    // the deploy step, and an event with no queue yet must wait (mandatory publishes).
    let mut pools: BTreeMap<String, PgPool> = BTreeMap::new();
    for svc in s.fleet.keys() {
        let url = ep.database_url(svc).context("backend has no database for a fleet service")?;
        bounded(Duration::from_secs(90), "applying migrations", craig_fleet::node::migrate(svc.parse()?, url, Duration::from_secs(30))).await?;
        pools.insert(
            svc.clone(),
            sqlx::postgres::PgPoolOptions::new().max_connections(3).acquire_timeout(Duration::from_secs(5)).connect_lazy(url)?,
        );
    }
    if s.deploy.topology {
        deploy_topology(&opts.node_program, &ep.amqp_url).await?;
    }
    let cases_pool = pools.get("cases").cloned().context("fleet has no cases")?;
    let poison = stage_poison_rows(&cases_pool, s.workload.poison_rows).await?;

    let (api_addr, api_task) = api::serve(FaultProxy::new(seed.rotate_left(17)), "127.0.0.1:0".parse()?).await?;
    let toxi = ToxiproxyClient::new(format!("http://{api_addr}"));
    let logs_dir = opts.report_dir.join("logs").join(&s.name);
    std::fs::create_dir_all(&logs_dir)?;
    let program = opts.node_program.clone();
    let secret = format!("chaos-{seed:x}");

    let mut replicas = BTreeMap::new();
    for (svc, entry) in &s.fleet {
        for i in 1..=entry.get_ref().count() {
            let name = format!("{svc}-{i}");
            let db = toxi.create_proxy(&format!("{name}->database"), "127.0.0.1:0", &ep.database_addr).await?;
            let mq = toxi.create_proxy(&format!("{name}->broker"), "127.0.0.1:0", &ep.broker_addr).await?;
            let db_url = ep.database_url(svc).unwrap().replacen(&ep.database_addr, &db.listen, 1);
            let amqp_url = ep.amqp_url.replacen(&ep.broker_addr, &mq.listen, 1);
            let mut spec = ReplicaSpec::new(svc.clone(), i);
            spec.compat = entry.get_ref().compat_of(i);
            let fps: Vec<String> = s
                .faults
                .iter()
                .map(|f| f.get_ref())
                .filter(|f| f.target == name)
                .filter_map(|f| match (f.kind, f.failpoint.as_deref(), f.at) {
                    (FaultKind::Crash, Some(fp), Trigger::FailpointHit(n)) if n > 1 => {
                        Some(format!("{fp}={}*off->return(abort)", n - 1))
                    }
                    (FaultKind::Crash, Some(fp), _) => Some(format!("{fp}=return(abort)")),
                    // A marker only: the node logs `failpoint.hit` once, at hit N.
                    (FaultKind::Upgrade | FaultKind::Downgrade, Some(fp), Trigger::FailpointHit(n)) => {
                        Some(format!("{fp}={}*off->1*return(hit)->off", n - 1))
                    }
                    _ => None,
                })
                .collect();
            spec.failpoints = (!fps.is_empty()).then(|| fps.join(";"));
            spec.env = vec![
                ("DATABASE_URL".into(), db_url),
                ("AMQP_URL".into(), amqp_url),
                ("CRAIG_JWT_SECRET".into(), secret.clone()),
                ("CRAIG_REPLICA".into(), name.clone()),
                ("CRAIG_OUTBOX_CLAIM_LEASE_SECS".into(), s.settings.claim_lease_secs.to_string()),
                ("CRAIG_OUTBOX_POLL_MS".into(), s.settings.poll_ms.to_string()),
                ("CRAIG_PUBLISH_CONFIRM_TIMEOUT_MS".into(), s.settings.confirm_timeout_ms.to_string()),
                ("CRAIG_AMQP_HEARTBEAT_SECS".into(), s.settings.heartbeat_secs.to_string()),
                ("CRAIG_AMQP_CONNECT_TIMEOUT_MS".into(), s.settings.connect_timeout_ms.to_string()),
                ("CRAIG_OUTBOX_BACKOFF_BASE_MS".into(), s.settings.backoff_base_ms.to_string()),
                ("CRAIG_OUTBOX_BACKOFF_MAX_MS".into(), s.settings.backoff_max_ms.to_string()),
                // `craig_mq::outbox=debug` for `outbox.stamped`: who stamped what.
                ("RUST_LOG".into(), "info,craig_mq::outbox=debug,sqlx=warn,lapin=warn,lapin::returned_messages=error".into()),
            ];
            let mut r = Replica::new(spec, program.clone(), &logs_dir);
            if entry.get_ref().start_after_ms.is_none() {
                r.start().await.with_context(|| format!("starting replica {name}"))?;
            }
            replicas.insert(name, Arc::new(Mutex::new(r)));
        }
    }
    let replicas: Replicas = Arc::new(replicas);

    log.rebase();
    log.measure_db_clock(&cases_pool).await;
    for (name, r) in replicas.iter() {
        let r = r.lock().await;
        if r.pid().is_some() {
            log.push_at(0, Event::Started { replica: name.clone(), compat: r.spec.compat.clone() });
        }
    }
    for envelope in &poison {
        log.push(Event::Poison { envelope: *envelope, service: "cases".into() });
    }
    let late_starts = start_late(s, log, &replicas);
    let (stop_tx, stop_rx) = watch::channel(false);
    let (writes_tx, writes_rx) = watch::channel(0u32);
    let sampler =
        tokio::spawn(sample(log.clone(), pools.clone(), stop_rx.clone(), opts.progress, (writes_rx.clone(), s.workload.writes)));
    let watcher = tokio::spawn(watch_replicas(s.clone(), log.clone(), replicas.clone(), stop_rx.clone()));
    let mut fault_tasks = Vec::new();
    for (i, f) in s.faults.iter().enumerate() {
        let f = f.get_ref().clone();
        if f.kind == FaultKind::Crash {
            continue; // armed through FAILPOINTS; the watcher records and restarts
        }
        let target = s.parse_target(&f.target).expect("validated");
        fault_tasks.push(tokio::spawn(inject(
            i,
            f,
            target,
            log.clone(),
            backend.clone(),
            replicas.clone(),
            toxi.clone(),
            (writes_rx.clone(), s.workload.writes),
        )));
    }
    workload(s, seed, (0, s.workload.writes), log, &replicas, &cases_pool, &secret, writes_tx).await;
    for t in fault_tasks {
        t.await.context("fault task panicked")??;
    }
    for t in late_starts {
        t.await.context("late start panicked")??;
    }
    // Wait for crash restarts the watcher scheduled.
    wait_crash_restarts(s, &replicas).await;
    // Every fault has healed: the system must work again, not only have survived.
    log.push(Event::Healed);
    let (heal_tx, _) = watch::channel(0u32);
    workload(s, seed ^ 0x4ea1, (s.workload.writes, s.workload.after_heal), log, &replicas, &cases_pool, &secret, heal_tx).await;

    // Liveness: how long until the system is quiet — nothing pending in any outbox, no
    // ready message in any consumer queue, and the effect count unchanged for a full
    // second (a delivery in flight is neither pending nor ready, but it moves the count).
    let bound = Duration::from_millis(s.liveness_bound_ms);
    let healed = Instant::now();
    let mut drained_after = None;
    let mut pending_total = 0;
    let mut quiet_since: Option<(Instant, i64)> = None;
    while healed.elapsed() < bound {
        pending_total = 0;
        for pool in pools.values() {
            // The injected poison rows stay pending by design; every other row must drain.
            pending_total += bounded(PROBE, "pending count", pending_except(pool, &poison)).await.unwrap_or(1);
        }
        // Bounded: a probe that hangs must not hang the run.
        let depth = match tokio::time::timeout(Duration::from_secs(5), queue_depths(&ep.amqp_url, s)).await {
            Ok(Ok(d)) => d,
            _ => 1,
        };
        let effects = match pools.get("rules") {
            Some(p) => bounded(PROBE, "effect count", sqlx::query_scalar::<_, i64>("SELECT count(*) FROM rule_evaluations").fetch_one(p))
                .await
                .unwrap_or(-1),
            None => 0,
        };
        if pending_total == 0 && depth == 0 {
            match quiet_since {
                Some((since, n)) if n == effects => {
                    if since.elapsed() >= Duration::from_secs(1) {
                        // Quiet also means nothing delivered and still unacked (a delivery
                        // in flight is not ready); the broker says, where it can.
                        let queues: Vec<String> =
                            s.fleet.keys().filter(|svc| consumes(svc)).map(|svc| craig_mq::topology::consumer_queue(svc)).collect();
                        let unacked = {
                            let b = backend.lock().await;
                            tokio::time::timeout(Duration::from_secs(10), b.unacked(&queues)).await
                        };
                        match unacked {
                            Ok(Ok(Some(n))) if n > 0 => quiet_since = None,
                            other => {
                                if !matches!(other, Ok(Ok(_))) {
                                    tracing::warn!(event = "chaos.unacked_unknown", "could not count unacked deliveries; quiet by the other signs");
                                }
                                drained_after = Some(since.duration_since(healed).as_millis() as u64);
                                break;
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
    log.push(Event::Drained { after_ms: drained_after, bound_ms: s.liveness_bound_ms, pending: pending_total });
    if let Ok(Ok(n)) = tokio::time::timeout(Duration::from_secs(5), dead_letters(&ep.amqp_url)).await {
        log.push(Event::DeadLetters { count: n });
    }
    for (svc, pool) in &pools {
        let stuck: Vec<(Uuid, f64)> = bounded(
            COLLECT,
            "reading claims past their lease",
            sqlx::query_as(
                "SELECT id, EXTRACT(EPOCH FROM (now() - claimed_at)) * 1000 FROM event_outbox \
                 WHERE published_at IS NULL AND claimed_at < now() - make_interval(secs => $1)",
            )
            .bind(s.settings.claim_lease_secs as f64)
            .fetch_all(pool),
        )
        .await?;
        for (envelope, ago) in stuck {
            log.push(Event::Stuck { envelope, service: svc.clone(), claimed_ms_ago: ago as i64 });
        }
    }

    let _ = stop_tx.send(true);
    let _ = watcher.await;
    let _ = sampler.await;
    for (name, r) in replicas.iter() {
        let addr = r.lock().await.addr.clone();
        if let Some(addr) = addr {
            metrics.insert(name.clone(), scrape_metrics(&addr).await);
        }
    }
    for r in replicas.values() {
        let mut r = r.lock().await;
        if r.pid().is_some() {
            let _ = r.stop(Duration::from_secs(15)).await;
        }
    }
    collect(log, &pools).await?;
    collect_logs(log, &logs_dir);
    for p in pools.values() {
        p.close().await;
    }
    api_task.abort();
    Ok(())
}

/// The CONTRACT's series from a replica's `GET /metrics` (bounded; empty when it does not
/// answer). Histograms keep their `_count` and `_sum`.
async fn scrape_metrics(addr: &str) -> BTreeMap<String, f64> {
    let wanted = ["outbox_", "inbox_", "dlq_", "idempotency_"];
    let text = async {
        let client = reqwest::Client::builder().timeout(Duration::from_secs(3)).build().ok()?;
        client.get(format!("http://{addr}/metrics")).send().await.ok()?.text().await.ok()
    }
    .await
    .unwrap_or_default();
    text.lines()
        .filter(|l| !l.starts_with('#') && wanted.iter().any(|w| l.starts_with(w)) && !l.contains("_bucket"))
        .filter_map(|l| {
            let (series, value) = l.rsplit_once(' ')?;
            Some((series.to_owned(), value.parse().ok()?))
        })
        .collect()
}

/// `craig-node topology` through the same program the replicas run: the deploy step.
async fn deploy_topology(program: &NodeProgram, amqp_url: &str) -> anyhow::Result<()> {
    let out = tokio::time::timeout(
        Duration::from_secs(30),
        tokio::process::Command::new(&program.program)
            .args(&program.prefix)
            .arg("topology")
            .env("AMQP_URL", amqp_url)
            .env("RUST_LOG", "warn")
            .stdin(std::process::Stdio::null())
            .output(),
    )
    .await
    .map_err(|_| anyhow::anyhow!("craig-node topology did not finish within 30 s"))??;
    if !out.status.success() {
        anyhow::bail!("craig-node topology failed ({}): {}", out.status, String::from_utf8_lossy(&out.stderr).trim());
    }
    Ok(())
}

/// Malformed rows written straight into the outbox (by hand, or by an older replica),
/// older than anything the workload stages. Returns their ids.
async fn stage_poison_rows(cases: &PgPool, n: u32) -> anyhow::Result<Vec<Uuid>> {
    let mut ids = Vec::new();
    for i in 0..n {
        let id: Uuid = bounded(
            COLLECT,
            "writing a poison row",
            sqlx::query_scalar(
                "INSERT INTO event_outbox (event_type, envelope, created_at) \
                 VALUES ('case.referral_created', $1, now() - interval '1 hour') RETURNING id",
            )
            .bind(json!({ "poison": i, "note": "not an envelope: written by hand" }))
            .fetch_one(cases),
        )
        .await?;
        ids.push(id);
    }
    Ok(ids)
}

/// Bound on one poll of the sampler or the drain loop (a miss is "not quiet", not a hang).
const PROBE: Duration = Duration::from_secs(3);
/// Bound on a read whose result the verdict needs (its miss is an error of the run).
const COLLECT: Duration = Duration::from_secs(30);

/// Every database call of the runner, sampler and collector is bounded: a paused or
/// black-holed database must not hang a run.
async fn bounded<T, E: Into<anyhow::Error>>(
    limit: Duration,
    what: &str,
    call: impl std::future::Future<Output = Result<T, E>>,
) -> anyhow::Result<T> {
    match tokio::time::timeout(limit, call).await {
        Ok(r) => r.map_err(Into::into),
        Err(_) => Err(anyhow::anyhow!("{what}: no answer within {limit:?}")),
    }
}

/// Rows not yet ACKed, leaving out `except`.
async fn pending_except(pool: &PgPool, except: &[Uuid]) -> Result<i64, sqlx::Error> {
    sqlx::query_scalar("SELECT count(*) FROM event_outbox WHERE published_at IS NULL AND id <> ALL($1)")
        .bind(except)
        .fetch_one(pool)
        .await
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

async fn queue_depths(amqp: &str, s: &Scenario) -> anyhow::Result<u32> {
    let conn = craig_mq::publisher::connect(amqp, 5, "chaos-probe").await?;
    let mut total = 0;
    for svc in s.fleet.keys().filter(|svc| consumes(svc)) {
        let ch = conn.create_channel().await?;
        total += craig_mq::topology::queue_depth(&ch, &craig_mq::topology::consumer_queue(svc)).await?;
    }
    let _ = tokio::time::timeout(Duration::from_secs(2), conn.close(200, "probe".into())).await;
    Ok(total)
}

/// Messages waiting in the DLQ (0 when it was never declared).
async fn dead_letters(amqp: &str) -> anyhow::Result<u32> {
    let conn = craig_mq::publisher::connect(amqp, 5, "chaos-probe").await?;
    let ch = conn.create_channel().await?;
    let n = craig_mq::topology::queue_depth(&ch, craig_mq::topology::DLQ_QUEUE).await.unwrap_or(0);
    let _ = tokio::time::timeout(Duration::from_secs(2), conn.close(200, "probe".into())).await;
    Ok(n)
}

async fn wait_crash_restarts(s: &Scenario, replicas: &Replicas) {
    let deadline = Instant::now() + Duration::from_secs(30);
    for f in s.faults.iter().map(|f| f.get_ref()).filter(|f| f.kind == FaultKind::Crash && f.restart_after_ms.is_some()) {
        let Some(r) = replicas.get(&f.target) else { continue };
        // A crash point that never fired leaves the replica running; one that fired gets
        // restarted by the watcher. Either way the replica should be up before the drain.
        while Instant::now() < deadline {
            if r.lock().await.pid().is_some() {
                break;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
}

/// Record crashes as they happen; restart crashed replicas whose crash fault asks for it.
async fn watch_replicas(s: Scenario, log: Log, replicas: Replicas, mut stop: watch::Receiver<bool>) {
    loop {
        for (name, r) in replicas.iter() {
            let status = r.lock().await.exited();
            let Some(status) = status else { continue };
            let service = name.rsplit_once('-').map(|(s, _)| s).unwrap_or(name);
            log.push(Event::Crash { replica: name.clone(), consumer: consumes(service), how: describe(status) });
            let fault = s.faults.iter().map(|f| f.get_ref()).find(|f| f.kind == FaultKind::Crash && &f.target == name);
            if fault.is_none() {
                log.finding(format!("replica {name} exited ({}) with no fault targeting it; not restarted", describe(status)));
            }
            if let Some(f) = fault {
                log.fault("crash", &format!("{name} at {}", f.failpoint.as_deref().unwrap_or("?")), Phase::Start);
                if let Some(ms) = f.restart_after_ms {
                    let (r, log, name) = (r.clone(), log.clone(), name.clone());
                    tokio::spawn(async move {
                        tokio::time::sleep(Duration::from_millis(ms)).await;
                        let mut r = r.lock().await;
                        r.spec.failpoints = None; // fire once
                        log.push(Event::Started { replica: name.clone(), compat: r.spec.compat.clone() });
                        if let Err(e) = r.start().await {
                            tracing::error!(event = "chaos.restart_failed", replica = %name, error = %e);
                            log.finding(format!("restarting {name} after its crash failed: {e}"));
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

/// Held by an upgrade or downgrade from its stop to its replica's restart.
static ROLLOUT: Mutex<()> = Mutex::const_new(());

#[allow(clippy::too_many_arguments)]
async fn inject(
    index: usize,
    f: Fault,
    target: FaultTarget,
    log: Log,
    backend: Arc<Mutex<Backend>>,
    replicas: Replicas,
    toxi: ToxiproxyClient,
    (mut writes, total_writes): (watch::Receiver<u32>, u32),
) -> anyhow::Result<()> {
    match f.at {
        Trigger::AfterMs(ms) => tokio::time::sleep_until(log.started() + Duration::from_millis(ms)).await,
        Trigger::AfterWrites(n) => {
            let _ = writes.wait_for(|done| *done >= n).await;
        }
        Trigger::FailpointHit(n) => {
            // Only upgrades and downgrades get here (crashes are armed, not injected): wait
            // for the target's `failpoint.hit` marker, or give up once the workload is done.
            let fp = f.failpoint.clone().expect("validated");
            let r = replicas.get(&f.target).expect("validated").clone();
            let path = r.lock().await.log_path().to_path_buf();
            let mut done_since: Option<Instant> = None;
            loop {
                let text = std::fs::read_to_string(&path).unwrap_or_default();
                if text.lines().any(|l| l.contains("event=\"failpoint.hit\"") && l.contains(&format!("failpoint=\"{fp}\""))) {
                    break;
                }
                if *writes.borrow() >= total_writes {
                    let since = *done_since.get_or_insert_with(Instant::now);
                    if since.elapsed() > Duration::from_secs(5) {
                        log.finding(format!("{} {}: failpoint {fp} never reached hit {n}; not done", f.kind.name(), f.target));
                        return Ok(());
                    }
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
    }
    let kind = f.kind.name();
    let label = match (&f.toxic, f.kind) {
        (_, FaultKind::Upgrade | FaultKind::Downgrade) => {
            let to = f.compat.as_deref().filter(|c| !c.is_empty()).map(|c| c.join(",")).unwrap_or_else(|| "current".into());
            format!("{} to {to}", f.target)
        }
        (Some(t), FaultKind::Toxic) => format!("{} ({} {})", f.target, t.kind.type_name(), t.stream.as_str()),
        (_, FaultKind::QueueLimit) => {
            format!("{} (max-length {}, reject-publish)", f.queue.as_deref().unwrap_or("?"), f.max_length.unwrap_or(0))
        }
        _ => f.target.clone(),
    };
    let hold = Duration::from_millis(f.duration_ms.or(f.restart_after_ms).unwrap_or(0));
    log.fault(kind, &label, Phase::Start);
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
            backend.lock().await.pause(t, true).await?;
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
            if r.pid().is_some() {
                r.stop(Duration::from_secs(15)).await?;
            }
            r.spec.compat = f.compat.clone().unwrap_or_default();
            r.spec.failpoints = None; // the marker served its purpose
            log.push(Event::Started { replica: name.clone(), compat: r.spec.compat.clone() });
            r.start().await?;
        }
        (FaultTarget::Replica(name), FaultKind::Pause) => {
            let r = replicas.get(name).expect("validated").clone();
            r.lock().await.pause()?;
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
            let affected = toxi.proxy(&proxy).await?.affected;
            log.evidence(
                kind,
                &label,
                match affected.get(&toxic.name) {
                    Some(a) if a.bytes > 0 || a.connections > 0 => Some(format!("{} bytes, {} connections", a.bytes, a.connections)),
                    Some(_) => None,
                    None => Some("not counted by this Toxiproxy".into()),
                },
            );
            toxi.remove_toxic(&proxy, &toxic.name).await?;
        }
        (FaultTarget::Broker, FaultKind::QueueLimit) => {
            let queue = f.queue.as_deref().expect("validated");
            let policy = format!("chaos-queue-limit-{index}");
            let pattern = format!("^{}$", queue.replace('.', "\\."));
            let definition = json!({ "max-length": f.max_length.expect("validated"), "overflow": "reject-publish" });
            backend.lock().await.set_policy(&policy, &pattern, &definition).await?;
            tokio::time::sleep(hold).await;
            backend.lock().await.clear_policy(&policy).await?;
        }
        (FaultTarget::Link { replica, to }, FaultKind::Down) => {
            let proxy = format!("{replica}->{to}");
            toxi.set_enabled(&proxy, false).await?;
            tokio::time::sleep(hold).await;
            toxi.set_enabled(&proxy, true).await?;
        }
        _ => anyhow::bail!("fault {kind} on {} is not supported", f.target),
    }
    log.fault(kind, &label, Phase::End);
    Ok(())
}

/// `count` writes at the scenario's rate through the cases replicas (round robin), numbered
/// from `first` (so the replica rotation goes on across phases); `done` counts completions.
#[allow(clippy::too_many_arguments)]
async fn workload(
    s: &Scenario,
    seed: u64,
    (first, count): (u32, u32),
    log: &Log,
    replicas: &Replicas,
    cases: &PgPool,
    secret: &str,
    done: watch::Sender<u32>,
) {
    use fake::Fake;
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let cases_replicas: Vec<Arc<Mutex<Replica>>> =
        replicas.iter().filter(|(n, _)| n.starts_with("cases-")).map(|(_, r)| r.clone()).collect();
    let http = reqwest::Client::builder().timeout(Duration::from_secs(5)).build().expect("http client");
    let key = craig_api::JwtKey::new(secret);
    let token = key.sign(&craig_api::Claims {
        sub: Uuid::now_v7(),
        aud: vec!["craig-cases".into()],
        scope: String::new(),
        exp: chrono::Utc::now().timestamp() + 24 * 3600,
    });
    let gap = Duration::from_secs_f64(1.0 / s.workload.rate);
    let began = Instant::now();
    let inflight = Arc::new(tokio::sync::Semaphore::new(64));
    let completed = Arc::new(std::sync::atomic::AtomicU32::new(0));
    let done = Arc::new(done);
    let mut tasks = tokio::task::JoinSet::new();
    for k in 0..count {
        let i = first + k;
        tokio::time::sleep_until(began + gap * k).await;
        if rng.random_bool(s.workload.rollback_share) {
            // Bounded: a paused database must not stall the workload's schedule.
            let _ = tokio::time::timeout(PROBE, rolled_back_write(log, cases)).await;
        }
        let subject: String = fake::faker::name::en::Name().fake_with_rng(&mut rng);
        // Round robin, like a load balancer: a replica that is down or being restarted
        // (its lock held by a fault) is skipped for the next one that is up.
        let n = cases_replicas.len();
        let mut pick = (i as usize % n, None);
        for k in 0..n {
            let j = (i as usize + k) % n;
            if let Ok(r) = cases_replicas[j].try_lock() {
                if let Some(addr) = r.addr.clone() {
                    pick = (j, Some(addr));
                    break;
                }
            }
        }
        let (j, addr) = pick;
        let permit = inflight.clone().acquire_owned().await.expect("semaphore open");
        let (http, token, log, completed, done) = (http.clone(), token.clone(), log.clone(), completed.clone(), done.clone());
        let replica_name = format!("cases-{}", j + 1);
        tasks.spawn(async move {
            let referral = Uuid::now_v7();
            let t = log.now();
            let (outcome, status) = match addr {
                None => (Outcome::Failed, None), // replica down: nothing was sent
                Some(addr) => {
                    let sent = http
                        .post(format!("http://{addr}/v1/cases/referrals"))
                        .bearer_auth(&token)
                        .json(&json!({ "id": referral, "subject": subject }))
                        .send()
                        .await;
                    match sent {
                        Ok(resp) => {
                            let code = resp.status().as_u16();
                            let o = match code {
                                201 => Outcome::Ok,
                                400..=499 => Outcome::Failed,
                                _ => Outcome::Unknown,
                            };
                            (o, Some(code))
                        }
                        Err(e) if e.is_connect() => (Outcome::Failed, None),
                        Err(_) => (Outcome::Unknown, None),
                    }
                }
            };
            log.push_at(t, Event::Write { referral, replica: replica_name, outcome, status });
            let n = completed.fetch_add(1, std::sync::atomic::Ordering::Relaxed) + 1;
            done.send_replace(n);
            drop(permit);
        });
    }
    while tasks.join_next().await.is_some() {}
}

/// A write staged in a transaction the harness rolls back: its event must never appear.
async fn rolled_back_write(log: &Log, cases: &PgPool) {
    let referral = Uuid::now_v7();
    let Ok(env) = craig_mq::EventEnvelope::new(
        craig_fleet::cases::REFERRAL_CREATED,
        "cases",
        Some(referral),
        json!({ "referral_id": referral, "subject": "rolled back" }),
    ) else {
        return;
    };
    let Ok(mut tx) = cases.begin().await else { return };
    let staged = sqlx::query("INSERT INTO referrals (id, subject, created_by) VALUES ($1, 'rolled back', $1)")
        .bind(referral)
        .execute(&mut *tx)
        .await
        .is_ok()
        && craig_mq::publish_in_tx(&mut tx, &env).await.is_ok();
    if staged && tx.rollback().await.is_ok() {
        log.push(Event::RolledBack { referral });
    }
}

async fn sample(
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
            if svc == "rules" {
                effects += bounded(PROBE, "effect count", sqlx::query_scalar::<_, i64>("SELECT count(*) FROM rule_evaluations").fetch_one(pool))
                    .await
                    .unwrap_or(0);
            }
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

/// Read what the databases say happened: staged envelopes and counted side effects.
async fn collect(log: &Log, pools: &BTreeMap<String, PgPool>) -> anyhow::Result<()> {
    for (svc, pool) in pools {
        let rows: Vec<(Uuid, Option<Uuid>, bool, i32, i64, Option<String>)> = bounded(
            COLLECT,
            "reading the outbox",
            sqlx::query_as(
                "SELECT id, aggregate_id, published_at IS NOT NULL, attempts, (EXTRACT(EPOCH FROM created_at) * 1000)::int8, \
                        last_error FROM event_outbox",
            )
            .fetch_all(pool),
        )
        .await?;
        for (envelope, referral, published, attempts, at, last_error) in rows {
            log.push_at(log.rel_db(at), Event::Staged { envelope, referral, service: svc.clone(), published, attempts, last_error });
        }
        if svc == "rules" {
            let rows: Vec<(Uuid, Option<Uuid>, i64, Option<String>)> = bounded(
                COLLECT,
                "reading rule_evaluations",
                sqlx::query_as(
                    "SELECT envelope_id, referral_id, (EXTRACT(EPOCH FROM evaluated_at) * 1000)::int8, replica FROM rule_evaluations",
                )
                .fetch_all(pool),
            )
            .await?;
            for (envelope, referral, at, replica) in rows {
                log.push_at(log.rel_db(at), Event::Effect { envelope, referral, service: "rules".into(), replica });
            }
        }
    }
    Ok(())
}

/// What the replicas' own logs say (each log holds all incarnations of its replica, each
/// after a `--- start N of R (compat M) ---` line):
/// - every `inbox.reprocessed`: the inbox's own word that a re-execution was of an envelope
///   recorded but never stamped;
/// - every `outbox.stamped`: which replica, running which compat modes, stamped an
///   envelope published.
fn collect_logs(log: &Log, logs_dir: &Path) {
    let Ok(dir) = std::fs::read_dir(logs_dir) else { return };
    for entry in dir.flatten() {
        let path = entry.path();
        let Some(replica) = path.file_stem().and_then(|s| s.to_str()).map(str::to_owned) else { continue };
        let Ok(text) = std::fs::read_to_string(&path) else { continue };
        for (at, event) in parse_replica_log(&replica, &text, |epoch_ms| log.rel(epoch_ms)) {
            log.push_at(at.unwrap_or_else(|| log.now()), event);
        }
    }
}

/// The events one replica log reports, with their times (`rel` converts the log's epoch ms
/// to run time; None when a line has no readable timestamp).
fn parse_replica_log(replica: &str, text: &str, rel: impl Fn(i64) -> u64) -> Vec<(Option<u64>, Event)> {
    let mut out = Vec::new();
    let mut compat: Vec<String> = Vec::new();
    for line in text.lines() {
        if let Some(modes) = line.strip_prefix("--- start ").and_then(|l| l.split_once("(compat ")).map(|(_, m)| m) {
            let modes = modes.trim_end_matches(" ---").trim_end_matches(')');
            compat = if modes == "-" { vec![] } else { modes.split(',').map(str::to_owned).collect() };
            continue;
        }
        let reprocessed = line.contains("event=\"inbox.reprocessed\"");
        let stamped = line.contains("event=\"outbox.stamped\"");
        if !reprocessed && !stamped {
            continue;
        }
        let Some(envelope) = line
            .split_once("envelope_id=")
            .and_then(|(_, rest)| rest.split_whitespace().next())
            .and_then(|id| id.parse::<Uuid>().ok())
        else {
            continue;
        };
        let at = line
            .split_whitespace()
            .next()
            .and_then(|ts| chrono::DateTime::parse_from_rfc3339(ts).ok())
            .map(|ts| rel(ts.timestamp_millis()));
        let event = if reprocessed {
            Event::Reprocessed { envelope, replica: replica.to_owned() }
        } else {
            Event::Stamped { envelope, replica: replica.to_owned(), compat: compat.clone() }
        };
        out.push((at, event));
    }
    out
}

/// The folder for this scenario's own files inside the report.
pub fn scenario_dir(report: &Path, name: &str) -> PathBuf {
    report.join("scenarios").join(name)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn replica_logs_say_who_stamped_what_under_which_compat() {
        let env = Uuid::from_u128(7);
        let text = format!(
            "--- start 1 of cases-1 (compat pre-1128) ---\n\
             2026-11-30T16:00:00.100000Z DEBUG craig_mq::outbox: event=\"outbox.stamped\" envelope_id={env}\n\
             --- start 2 of cases-1 (compat -) ---\n\
             2026-11-30T16:00:01.000000Z DEBUG craig_mq::outbox: event=\"outbox.stamped\" envelope_id={env}\n\
             2026-11-30T16:00:01.500000Z  WARN craig_mq::inbox: event=\"inbox.reprocessed\" envelope_id={env} source=x\n\
             not a line of interest envelope_id={env}\n"
        );
        let origin = chrono::DateTime::parse_from_rfc3339("2026-11-30T16:00:00Z").unwrap().timestamp_millis();
        let events = parse_replica_log("cases-1", &text, |ms| (ms - origin) as u64);
        assert_eq!(
            events,
            vec![
                (Some(100), Event::Stamped { envelope: env, replica: "cases-1".into(), compat: vec!["pre-1128".into()] }),
                (Some(1000), Event::Stamped { envelope: env, replica: "cases-1".into(), compat: vec![] }),
                (Some(1500), Event::Reprocessed { envelope: env, replica: "cases-1".into() }),
            ]
        );
    }

    /// A call that never answers (a paused database) ends as an error of its own, never a
    /// hang of the run.
    #[tokio::test]
    async fn a_call_that_never_answers_is_an_error_not_a_hang() {
        let hung = std::future::pending::<Result<i64, sqlx::Error>>();
        let e = bounded(Duration::from_millis(20), "pending count", hung).await.unwrap_err();
        assert_eq!(e.to_string(), "pending count: no answer within 20ms");
        assert_eq!(bounded(PROBE, "x", async { Ok::<_, sqlx::Error>(7) }).await.unwrap(), 7);
    }

    fn violated_by(culprits: &[(&str, u64)], violations: u64) -> Verdict {
        let mut v = Verdict::undecided("no_loss", "x");
        v.error = None;
        v.validity = Validity::Invalid;
        v.violations = violations;
        v.culprits = culprits.iter().map(|(k, n)| (k.to_string(), *n)).collect();
        v
    }

    /// A twin is met only when every violation points at its documented cause.
    #[test]
    fn a_twin_violated_for_another_cause_is_not_met() {
        let twin = Expectation { expect: Expect::Violate, cause: Some("compat:pre-1128".into()) };
        let r = invariant_result(violated_by(&[("compat:pre-1128", 3), ("replica:cases-1", 3)], 3), &twin);
        assert!(r.met(), "{r:?}");
        let r = invariant_result(violated_by(&[("compat:pre-1128", 2), ("compat:current", 1)], 3), &twin);
        assert_eq!(r.observed.as_deref(), Some(OTHER_CAUSE));
        assert!(!r.met());
        // Without a cause, any violation meets a "violate".
        let any = Expectation { expect: Expect::Violate, cause: None };
        assert!(invariant_result(violated_by(&[("compat:current", 1)], 1), &any).met());
    }
}
