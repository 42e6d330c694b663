//! Runs one scenario end to end: backend → migrations and topology → a fault proxy in
//! front of every replica's database and broker connections → replicas → workload, faults
//! and sampling → drain (liveness) → collection → checkers.
//!
//! One seed drives the workload's choices and the proxy's jitter; every fault is recorded
//! in the history with its time. A seed fixes the schedule, not the interleaving: real
//! processes, sockets and the OS scheduler still decide what overlaps (as TigerBeetle's
//! Vortex says of itself).

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use sqlx::PgPool;
use tokio::sync::{Mutex, watch};
use tokio::time::Instant;
use uuid::Uuid;

use crate::backend::{Backend, BackendKind, Choice};
use crate::checkers::{self, Validity, Verdict};
use crate::history::{Event, History, Outcome};
use crate::process::{NodeProgram, Replica, ReplicaSpec};
use crate::proxy::{FaultProxy, ToxiproxyClient, api};
use crate::scenario::{Expect, Expectation, FaultKind, Scenario};

mod collect;
mod faults;
mod partner;
mod record;
mod sampler;
mod tap;
mod workload;

use record::Log;

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
    /// The causes every violation must point at (`{ violate = [..] }`), and whether they
    /// all did (absent when none is named or nothing was violated).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub cause: Vec<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cause_met: Option<bool>,
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
    /// Named in the scenario's `[expect]` (false: run because its inputs were there, issue
    /// 22.1; it must hold).
    #[serde(skip_serializing_if = "Clone::clone")]
    pub listed: bool,
}

impl InvariantResult {
    /// Observed as expected (and, for a twin naming its cause, violated for that cause).
    pub fn met(&self) -> bool {
        self.observed.as_deref() == Some(expected_word(self.expected)) && self.cause_met != Some(false)
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

/// The k-th run seed of a multi-seed run (`chaos run --seeds N`, `CHAOS_SEEDS=N` in the
/// scenario tests); the 0th is the run seed itself.
pub fn derived_seed(seed: u64, k: u32) -> u64 {
    seed ^ u64::from(k).wrapping_mul(0x9e37_79b9_7f4a_7c15)
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
    let run_failed = result.error.is_some();
    let mut history = log.history.lock().unwrap().clone();
    history.sort();
    result.faults = log.faults.lock().unwrap().clone();
    if result.error.is_none() {
        result.invariants = judge(s, &history);
        result.inconclusive = result.invariants.iter().any(|i| i.observed.is_none());
        result.passed = !result.inconclusive && result.invariants.iter().all(InvariantResult::met);
        // An unlisted checker that could not decide says why in the run's error (a listed
        // one says it in its own row of the table).
        let undecided: Vec<String> = result
            .invariants
            .iter()
            .filter(|i| !i.listed && i.observed.is_none())
            .map(|i| format!("{} (unlisted) undecided: {}", i.name, i.error.as_deref().unwrap_or("no reason given")))
            .collect();
        for why in undecided {
            inconclusive(&mut result, why);
        }
    }
    let findings = log.findings.lock().unwrap().clone();
    if !findings.is_empty() {
        inconclusive(&mut result, findings.join("; "));
    }
    // Issue 22.7: a drain that ran out of time leaves work in flight that no checker has
    // seen finish; where liveness is not the scenario's own question, nothing is proven.
    let timed_out = history.iter().find_map(|e| match &e.event {
        Event::Drained { after_ms: None, bound_ms, .. } => Some(*bound_ms),
        _ => None,
    });
    // (Only where the scenario otherwise met its expectations: a NOT MET stays NOT MET.)
    if let (Some(bound), false, true) = (timed_out, s.expect.contains_key("liveness"), result.passed) {
        inconclusive(&mut result, format!("the drain did not end within {bound} ms after the heal: work still in flight was never judged"));
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
    if !run_failed {
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

/// Every checker whose inputs the history has (issue 22.1): those `[expect]` lists, judged
/// against what it states; every other one that could decide, held to "hold" (an unlisted
/// checker that comes out violated fails the run). One with nothing to check is left out.
fn judge(s: &Scenario, history: &History) -> Vec<InvariantResult> {
    let mut out = Vec::new();
    for (name, expect) in &s.expect {
        let v = checkers::check(name, history).unwrap_or_else(|| Verdict::undecided(name, "no such checker"));
        out.push(invariant_result(v, expect.get_ref()));
    }
    let hold = Expectation { expect: Expect::Hold, cause: vec![] };
    for name in checkers::INVARIANTS.iter().filter(|n| !s.expect.contains_key(**n)) {
        let Some(v) = checkers::check(name, history) else { continue };
        // Left out only when there was nothing to judge: an unlisted checker that could not
        // decide (it panicked, a queue was unreadable, a drain unproven) leaves the run
        // inconclusive, as a listed one would.
        if !v.nothing_to_check() {
            out.push(InvariantResult { listed: false, ..invariant_result(v, &hold) });
        }
    }
    out
}

/// Why the run did too little to be trusted (None: every floor met): fewer acknowledged
/// writes, absorbed redeliveries or dead letters than `[expect]` asks, or no write
/// acknowledged after every fault healed.
fn below_floor(s: &Scenario, h: &History, metrics: &BTreeMap<String, BTreeMap<String, f64>>) -> Option<String> {
    let healed = h.iter().find(|e| matches!(e.event, Event::Healed)).map(|e| e.t_ms);
    let (mut acknowledged, mut after_heal) = (0u64, 0u64);
    for e in h.iter() {
        if matches!(e.event, Event::Write { outcome: Outcome::Ok, .. } | Event::HttpExchange { status: Some(200), .. }) {
            acknowledged += 1;
            if healed.is_some_and(|t| e.t_ms >= t) {
                after_heal += 1;
            }
        }
    }
    // Issue 22.1: the redeliveries as the harness's own triggers counted them in the
    // databases; the nodes' counters only annotate a shortfall.
    let (mut redeliveries, dlq_duplicates) = h.iter().fold((0u64, 0u64), |(i, d), e| match &e.event {
        Event::Redelivered { inbox, dead_letters, .. } => (i + inbox, d + dead_letters),
        _ => (i, d),
    });
    // Issue 26: after a failover the counters are the promoted server's (unlogged: zero at
    // promotion), and an arrival counts only where the inbox record it met was stamped
    // processed before the failover (10 ms for the clocks): a record the failover kept, not
    // one made after it (the after-heal writes', a replay's of them).
    let failover = h.iter().filter(|e| matches!(e.event, Event::Failover { .. })).map(|e| e.t_ms).min();
    let mut after_failover = "";
    if let Some(t) = failover {
        after_failover = " before the failover";
        redeliveries = h
            .iter()
            .map(|e| match &e.event {
                Event::Redelivered { inbox_met_processed_ms, .. } => {
                    inbox_met_processed_ms.iter().filter(|p| **p + checkers::FAILOVER_CLOCK_SLACK_MS <= t).count() as u64
                }
                _ => 0,
            })
            .sum();
    }
    let counter = |name: &str| -> f64 { metrics.values().flat_map(|m| m.iter()).filter(|(k, _)| k.as_str() == name).map(|(_, v)| v).sum() };
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
    if redeliveries < f.redeliveries {
        why.push(format!(
            "{redeliveries} deliveries of an envelope an inbox already held processed{after_failover} (the database's count), below min_redeliveries = {} \
             (the nodes' inbox_dedup_hits_total: {})",
            f.redeliveries,
            counter("inbox_dedup_hits_total")
        ));
    }
    if dlq_duplicates < f.dlq_duplicates {
        why.push(format!(
            "{dlq_duplicates} arrivals of a dead letter the audit already recorded with the same facts (the database's count), \
             below min_dlq_duplicates = {} (the nodes' dlq_outcomes_total{{outcome=\"duplicate\"}}: {})",
            f.dlq_duplicates,
            counter("dlq_outcomes_total{outcome=\"duplicate\"}")
        ));
    }
    if f.lease_resends > 0 {
        let resent = crate::checkers::fencing(h).counts.get("resent_after_lease").copied().unwrap_or(0);
        if resent < f.lease_resends {
            why.push(format!("{resent} transmissions re-sent after their claim ended, below min_lease_resends = {}", f.lease_resends));
        }
    }
    if f.replays > 0 || f.sentinels > 0 {
        let v = crate::checkers::sentinel_integrity(h);
        let (replays, sentinels) = (v.counts.get("replays").copied().unwrap_or(0), v.counts.get("sentinels_replayed").copied().unwrap_or(0));
        if replays < f.replays {
            why.push(format!("{replays} §D5 replays served (Idempotent-Replayed), below min_replays = {}", f.replays));
        }
        if sentinels < f.sentinels {
            why.push(format!("{sentinels} too-large sentinels replayed (Idempotency-Body-Too-Large), below min_sentinels = {}", f.sentinels));
        }
    }
    let crossings = h.iter().filter(|e| matches!(e.event, Event::ThresholdExceeded { .. })).count() as u64;
    if crossings < f.crossings {
        why.push(format!("{crossings} threshold events staged (security.dlq.threshold_exceeded), below min_crossings = {}", f.crossings));
    }
    // Issue 22.9: distinct occurrences by the harness's own tap on craig.dlx (always bound,
    // issue 22.1), not the messages still queued or the rows the recorder wrote (a doubled
    // row is no more activity).
    if f.dead_letters > 0 {
        let dead = crate::checkers::dlq_occurrence_once(h).counts.get("occurrences").copied().unwrap_or(0);
        if dead < f.dead_letters {
            why.push(format!("{dead} distinct dead-lettered occurrences (the harness's tap on craig.dlx), below min_dead_letters = {}", f.dead_letters));
        }
    }
    if f.payments_absorbed > 0 {
        let (absorbed, claimed) = absorbed_payments(h);
        if absorbed < f.payments_absorbed {
            why.push(format!(
                "{absorbed} payment replays absorbed by the arbiter against a payment financial's database holds ({claimed} claimed by \
                 financial.payment_replay_absorbed), below min_payments_absorbed = {}",
                f.payments_absorbed
            ));
        }
    }
    (!why.is_empty()).then(|| format!("below the activity floor: {}", why.join("; ")))
}

/// The #1179 absorbs that count towards `min_payments_absorbed` (issue 22: a floor does not
/// rest on the system's word alone), and how many financial claimed. An absorb
/// (`financial.payment_replay_absorbed`, the arbiter's own line) counts only when
/// financial's database, read at the end, holds the payment it absorbed against: a
/// `payments` row of the same envelope, or of the placement that envelope was staged for,
/// made before the line (`ABSORB_ROUNDING_MS` for the log's and the database's clocks). An
/// arbiter that says "absorbed" with no payment behind it exercised nothing.
fn absorbed_payments(h: &History) -> (u64, u64) {
    const ABSORB_ROUNDING_MS: u64 = 250;
    let mut placement_of: HashMap<Uuid, Uuid> = HashMap::new();
    let mut paid_envelope: HashMap<Uuid, u64> = HashMap::new();
    let mut paid_placement: HashMap<Uuid, u64> = HashMap::new();
    for e in h.iter() {
        match &e.event {
            Event::Staged { envelope, referral: Some(p), service, .. } if service == "cases" => {
                placement_of.insert(*envelope, *p);
            }
            Event::Effect { envelope, referral, service, .. } if service == "financial" => {
                let earliest = |m: &mut HashMap<Uuid, u64>, k: Uuid| {
                    m.entry(k).and_modify(|t| *t = (*t).min(e.t_ms)).or_insert(e.t_ms);
                };
                earliest(&mut paid_envelope, *envelope);
                if let Some(p) = referral {
                    earliest(&mut paid_placement, *p);
                }
            }
            _ => {}
        }
    }
    let (mut absorbed, mut claimed) = (0, 0);
    for e in h.iter() {
        let Event::PaymentAbsorbed { envelope, .. } = &e.event else { continue };
        claimed += 1;
        let before = |t: Option<&u64>| t.is_some_and(|&t| t <= e.t_ms + ABSORB_ROUNDING_MS);
        if before(paid_envelope.get(envelope)) || before(placement_of.get(envelope).and_then(|p| paid_placement.get(p))) {
            absorbed += 1;
        }
    }
    (absorbed, claimed)
}

/// Mark the result inconclusive for `why`; every reason found is reported, in the order
/// found (a run error first).
fn inconclusive(result: &mut ScenarioResult, why: String) {
    result.error = Some(match result.error.take() {
        Some(earlier) => format!("{earlier}; {why}"),
        None => why,
    });
    result.inconclusive = true;
    result.passed = false;
}

fn expected_word(e: Expect) -> &'static str {
    match e {
        Expect::Hold => "held",
        Expect::Violate => "violated",
    }
}

fn invariant_result(v: Verdict, expected: &Expectation) -> InvariantResult {
    let observed = match v.validity {
        Validity::Valid => Some("held".to_owned()),
        Validity::Invalid => Some("violated".to_owned()),
        Validity::Unknown => None,
    };
    // Red, but for the documented reason? Only when every violation points at every cause.
    let cause_met = (v.validity == Validity::Invalid && !expected.cause.is_empty())
        .then(|| expected.cause.iter().all(|c| v.all_point_at(c)));
    InvariantResult {
        name: v.name,
        expected: expected.expect,
        cause: expected.cause.clone(),
        cause_met,
        observed,
        counts: v.counts,
        witnesses: v.witnesses,
        violations: v.violations,
        culprits: v.culprits,
        error: v.error,
        listed: true,
    }
}

async fn execute(s: &Scenario, opts: &RunOptions, seed: u64, log: &Log, result: &mut ScenarioResult) -> anyhow::Result<()> {
    use anyhow::Context as _;
    let services: Vec<String> = s.fleet.keys().cloned().collect();
    let svc_refs: Vec<&str> = services.iter().map(String::as_str).collect();
    // A fault the chosen backend cannot do refuses the scenario before anything starts.
    let chosen = Backend::resolve(opts.backend).await.context("choosing the backend")?;
    result.backend = chosen.kind.name().to_owned();
    faults::refuse_unsupported(s, chosen.kind)?;
    // The official Toxiproxy keeps no counters, so a link fault could never prove it fired:
    // refused here, before any container starts (the proxy's own answer is checked again
    // once it runs, for any other image).
    if chosen.kind == BackendKind::Containers
        && crate::backend::containers::Images::from_env()?.toxiproxy.name == crate::backend::containers::TOXIPROXY_IMAGE
        && s.faults.iter().any(|f| matches!(f.get_ref().kind, FaultKind::Toxic | FaultKind::Down | FaultKind::ReplicationLag))
    {
        anyhow::bail!(
            "CHAOS_TOXIPROXY_IMAGE is the official Toxiproxy ({}), which keeps no counters, so this scenario's link faults could never prove they fired; use craig-chaos/toxiproxy-api (ci/images/build)",
            crate::backend::containers::TOXIPROXY_IMAGE
        );
    }
    // A broker cluster (issue 25) runs on the local backend only, so far.
    if s.broker_nodes > 1 && chosen.kind != BackendKind::Local {
        anyhow::bail!("backend {} runs a one-node broker; this scenario asks for {} broker nodes (CHAOS_BACKEND=local runs a cluster)", chosen.kind, s.broker_nodes);
    }
    // A database standby (issue 26) too: the local and containers backends run one.
    if s.standby.is_some() && !matches!(chosen.kind, BackendKind::Local | BackendKind::Containers) {
        anyhow::bail!("backend {} runs one database server; this scenario asks for a standby (CHAOS_BACKEND=local or containers runs one)", chosen.kind);
    }
    // Two links a replica, each a published port of the Toxiproxy container, and with a
    // standby one more: the database address a failover moves.
    let replicas: u32 = s.fleet.values().map(|e| e.get_ref().count()).sum();
    let address = u32::from(s.standby.is_some());
    if chosen.kind == BackendKind::Containers && replicas * 2 + address > u32::from(crate::backend::containers::PROXY_SLOTS) {
        anyhow::bail!(
            "backend containers publishes {} links (two a replica{}) and this fleet has {replicas} replicas; run it on CHAOS_BACKEND=local",
            crate::backend::containers::PROXY_SLOTS,
            if address == 1 { ", one the database address" } else { "" },
        );
    }
    let (backend, choice): (Backend, Choice) =
        bounded(BACKEND_BOUND, "starting the backend", async {
            Backend::start_chosen_with(chosen, &format!("{}-{seed}", s.name), &svc_refs, usize::from(s.broker_nodes)).await.context("starting the backend")
        })
        .await?;
    if opts.progress {
        eprintln!("  backend: {} ({})", choice.kind, choice.reason);
    }
    let backend = Arc::new(Mutex::new(backend));
    let outcome = drive(s, opts, seed, log, backend.clone(), &mut result.metrics).await;
    let stop = match Arc::try_unwrap(backend) {
        Ok(b) => {
            bounded(BACKEND_BOUND, "stopping the backend", async { b.into_inner().stop().await.context("stopping the backend") }).await
        }
        Err(_) => Ok(()), // a task still holds it; its Drop cleans up
    };
    outcome.and(stop)
}

/// The compat modes every replica of `svc` starts on (the schema its fleet had).
fn schema_compat(s: &Scenario, svc: &str) -> craig_fleet::CompatSet {
    let Some(entry) = s.fleet.get(svc) else { return Default::default() };
    let e = entry.get_ref();
    let first = e.compat_of(1);
    let common = first.iter().filter(|m| (2..=e.count()).all(|i| e.compat_of(i).contains(*m)));
    craig_fleet::CompatSet::new(common.filter_map(|m| m.parse::<craig_fleet::Compat>().ok()))
}

/// One run of `s` on a started backend, as named phases in order: [`deploy`] → [`start`]
/// → [`load_and_faults`] → [`heal`] → [`drain`] → [`collect_all`]; the judging follows in
/// [`run_scenario`] ([`judge`]). A fault the backend cannot do refused the scenario before
/// the backend started (`faults::refuse_unsupported`, in [`execute`]).
async fn drive(
    s: &Scenario,
    opts: &RunOptions,
    seed: u64,
    log: &Log,
    backend: Arc<Mutex<Backend>>,
    metrics: &mut BTreeMap<String, BTreeMap<String, f64>>,
) -> anyhow::Result<()> {
    // A standby (issue 26) before anything connects: every client then reaches the database
    // by the address a failover moves.
    if let Some(standby) = s.standby {
        let began = std::time::Instant::now();
        bounded(Duration::from_secs(60), "starting the database's standby", async { backend.lock().await.add_standby(standby.sync).await.map_err(anyhow::Error::from) })
            .await?;
        if opts.progress {
            eprintln!("  database standby: base backup taken and started in {:.1} s", began.elapsed().as_secs_f64());
        }
    }
    let ep = backend.lock().await.endpoints();
    let deployed = deploy(s, opts, seed, log, &ep, &backend).await?;
    let fleet = start(s, opts, seed, log, &ep, &backend, &deployed).await?;
    let writer = workload::Writer { s, log, replicas: &fleet.replicas, cases: &deployed.cases_pool, secret: &fleet.secret, exports: Default::default() };
    let mut load = load_and_faults(s, opts, seed, log, &ep, &backend, &deployed, &fleet, &writer).await?;
    heal(s, seed, log, &fleet, &writer, &mut load).await?;
    drain(s, log, &ep, &backend, &deployed).await?;
    collect_all(s, log, &ep, &deployed, fleet, load, metrics).await
}

/// What [`deploy`] put in place: every service's pool, the broker accounts, what the
/// workload staged before the replicas, and the partner.
struct Deployed {
    pools: BTreeMap<String, PgPool>,
    cases_pool: PgPool,
    accounts: BTreeMap<String, String>,
    staged: workload::Staged,
    partner: Option<(String, tokio::task::JoinHandle<()>)>,
}

/// Deploy: each service's schema, the operator's part of the broker (and the consumer
/// queues with `[deploy] topology`), the service accounts, what the workload stages before
/// the replicas start, the partner.
async fn deploy(s: &Scenario, opts: &RunOptions, seed: u64, log: &Log, ep: &crate::backend::Endpoints, backend: &Arc<Mutex<Backend>>) -> anyhow::Result<Deployed> {
    use anyhow::Context as _;
    // Schema first. Broker topology only if the scenario deploys it (`[deploy] topology`):
    // otherwise each node declares just its own queue at start, as in a deployment without
    // the deploy step, and an event with no queue yet must wait (mandatory publishes).
    let mut pools: BTreeMap<String, PgPool> = BTreeMap::new();
    for svc in s.fleet.keys() {
        let url = ep.database_url(svc).context("backend has no database for a fleet service")?;
        // The schema the service's fleet had: an amendment's migration is left out only when
        // every replica starts on the mode that reverts it (`craig-node migrate --compat`).
        let schema = schema_compat(s, svc);
        bounded(Duration::from_secs(90), "applying migrations", craig_fleet::node::migrate_for(svc.parse()?, url, Duration::from_secs(30), &schema))
            .await?;
        pools.insert(
            svc.clone(),
            sqlx::postgres::PgPoolOptions::new().max_connections(3).acquire_timeout(Duration::from_secs(5)).connect_lazy(url)?,
        );
    }
    // The operator's part of every deploy (ADR-022 #1202): the exchanges and the DLQ, with
    // the admin credential; no service account may declare them. `[deploy] topology`
    // adds every consumer queue (`craig-node topology`); without it each node declares
    // its own queue at start.
    bounded(Duration::from_secs(30), "declaring the exchanges and the DLQ", craig_mq::topology::deploy_operator_part(&ep.amqp_url, s.settings.queue_type)).await?;
    if s.deploy.topology {
        deploy_topology(&opts.node_program, &ep.amqp_url, s.settings.queue_type).await?;
    }
    // Every service logs in with its own least-privilege account, as deployed.
    let accounts: BTreeMap<String, String> = bounded(
        Duration::from_secs(60),
        "creating the service accounts",
        async { backend.lock().await.service_accounts().await },
    )
    .await?
    .into_iter()
    .collect();
    let cases_pool = pools.get("cases").cloned().context("fleet has no cases")?;
    // What the workload puts in place before the replicas start (poison rows, older
    // than anything else); the rest of its staging follows once the run's clock starts.
    let staged = workload::Staged::before_start(s, &pools).await?;
    // The partner financial's send queue POSTs to (#1185), when the scenario has one.
    let partner = match s.partner {
        Some(spec) => Some(partner::serve(spec, log.clone(), seed.rotate_left(29)).await?),
        None => None,
    };
    Ok(Deployed { pools, cases_pool, accounts, staged, partner })
}

/// What [`start`] started: the fault proxy (its API) and the replicas behind it.
struct Fleet {
    toxi: ToxiproxyClient,
    /// The harness's own Toxiproxy API server, where the backend runs none.
    api_task: Option<tokio::task::JoinHandle<()>>,
    /// The ports its links listen on, leased for the run.
    _link_ports: Vec<crate::backend::local::PortLease>,
    logs_dir: PathBuf,
    secret: String,
    replicas: Replicas,
}

/// Whatever way a run ends (an error in heal, drain or collect too), the harness's own proxy
/// API stops, and with its registry every link's listener, before the links' port leases go.
impl Drop for Fleet {
    fn drop(&mut self) {
        if let Some(t) = self.api_task.take() {
            t.abort();
        }
    }
}

/// Start: the fault proxy, a link through it for each replica's database and broker
/// connections, and every replica that starts with the run (its crash points, mutants and
/// markers armed).
#[allow(clippy::too_many_arguments)]
async fn start(
    s: &Scenario,
    opts: &RunOptions,
    seed: u64,
    log: &Log,
    ep: &crate::backend::Endpoints,
    backend: &Arc<Mutex<Backend>>,
    deployed: &Deployed,
) -> anyhow::Result<Fleet> {
    use anyhow::Context as _;
    // The backend's Toxiproxy (the containers backend's container), else the harness's own.
    let backend_api = backend.lock().await.toxiproxy_api();
    let (toxi, api_task) = match backend_api {
        Some(url) => (ToxiproxyClient::new(url), None),
        None => {
            let (api_addr, api_task) = api::serve(FaultProxy::new(seed.rotate_left(17)), "127.0.0.1:0".parse()?).await?;
            (ToxiproxyClient::new(format!("http://{api_addr}")), Some(api_task))
        }
    };
    // Where a link listens, and where its replica reaches it.
    // On loopback (the harness's own proxy) a link takes a leased port outside the
    // ephemeral range: a link that is down has closed its listener, and must get its port
    // back when it comes up, so no outgoing connection (an ephemeral source port) and no
    // other run (the lease) may take it meanwhile.
    let mut link_ports = Vec::new();
    let mut link = async || {
        let slot = backend.lock().await.proxy_listen()?;
        anyhow::Ok(match slot {
            Some((listen, reach)) => (listen, Some(reach)),
            None => {
                let lease = crate::backend::local::lease_port()?;
                let listen = format!("127.0.0.1:{}", lease.port());
                link_ports.push(lease);
                (listen, None)
            }
        })
    };
    let through = |url: &str, at: &str| url.replacen(&crate::backend::external_authority(url), at, 1);
    // Issue 26: the standby's replication connection through the fault proxy (the link
    // `standby->database`, a target for toxic and down), then the standby streaming in its
    // mode, caught up, as the primary reports it.
    let replication = backend.lock().await.replication_link();
    if let Some((listen, upstream)) = replication {
        toxi.create_proxy(crate::scenario::REPLICATION_LINK, &listen, &upstream).await?;
        let state = bounded(Duration::from_secs(40), "starting replication to the standby", async {
            backend.lock().await.start_replication().await.map_err(anyhow::Error::from)
        })
        .await?;
        let mode = if s.standby.is_some_and(|sb| sb.sync) { "sync" } else { "async" };
        log.push(Event::Replication { mode: mode.into(), state });
    }
    let logs_dir = opts.report_dir.join("logs").join(&s.name);
    // Fresh logs: the collector and the failpoint markers read them whole, and a report
    // folder reused by an earlier run (ci/test's) must not lend its lines to this one.
    let _ = std::fs::remove_dir_all(&logs_dir);
    std::fs::create_dir_all(&logs_dir)?;
    let program = opts.node_program.clone();
    let secret = format!("chaos-{seed:x}");

    let mut replicas = BTreeMap::new();
    for (svc, entry) in &s.fleet {
        for i in 1..=entry.get_ref().count() {
            let name = format!("{svc}-{i}");
            let (db_listen, db_reach) = link().await?;
            let db = toxi.create_proxy(&format!("{name}->database"), &db_listen, &ep.database_addr).await?;
            // A link fault proves it fired by the proxy's own counters; a Toxiproxy that
            // keeps none (the official image) could never show it, so the scenario is
            // refused before any replica starts.
            if db.cut_connections.is_none() && s.faults.iter().any(|f| matches!(f.get_ref().kind, FaultKind::Toxic | FaultKind::Down | FaultKind::ReplicationLag)) {
                anyhow::bail!(
                    "the Toxiproxy at {} keeps no counters (the official image?), so a link fault could never prove it fired; use craig-chaos/toxiproxy-api (ci/images/build, CHAOS_TOXIPROXY_IMAGE)",
                    toxi.base()
                );
            }
            let db_url = through(ep.database_url(svc).unwrap(), &db_reach.unwrap_or(db.listen));
            let account = deployed.accounts.get(svc).with_context(|| format!("no broker account for {svc}"))?;
            // A link to each broker node (`->broker` for node 1, `->broker-N` for a cluster's
            // others), the replica's AMQP_URL the list of them (issue 25: it moves to the
            // next node when one fails).
            let mut amqp_urls = Vec::new();
            for (k, addr) in ep.broker_nodes.iter().enumerate() {
                let to = if k == 0 { crate::backend::Target::Broker } else { crate::backend::Target::BrokerNode(k as u8 + 1) };
                let (mq_listen, mq_reach) = link().await?;
                let mq = toxi.create_proxy(&format!("{name}->{to}"), &mq_listen, addr).await?;
                amqp_urls.push(through(account, &mq_reach.unwrap_or(mq.listen)));
            }
            // Replica i starts on node ((i - 1) mod N) + 1 and moves on in node order, so the
            // replicas of a service publish and consume through every node of a cluster, not
            // all through node 1 (issue 25: "producers publish with confirms to every node").
            // One replica, or one node: node 1 first, as before.
            let nodes = amqp_urls.len().max(1);
            amqp_urls.rotate_left((i as usize - 1) % nodes);
            let amqp_url = amqp_urls.join(",");
            let mut spec = ReplicaSpec::new(svc.clone(), i);
            spec.compat = entry.get_ref().compat_of(i);
            spec.failpoints = faults::failpoints_for(s, &name);
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
                ("CRAIG_INBOX_RETRY_CAP".into(), s.settings.inbox_retry_cap.to_string()),
                ("CRAIG_RETENTION_INTERVAL_SECS".into(), s.settings.retention_interval_secs.to_string()),
                ("CRAIG_IDEMPOTENCY_CLAIM_SECS".into(), s.settings.idempotency_claim_secs.to_string()),
                ("CRAIG_OUTBOX_NOTIFY".into(), if s.settings.outbox_notify { "1" } else { "0" }.into()),
                ("CRAIG_CONSUMER_CONCURRENCY".into(), s.settings.consumer_concurrency.to_string()),
                ("CRAIG_DLQ_PARK_MS".into(), s.settings.dlq_park_ms.to_string()),
                ("CRAIG_DLQ_MAX_PARKS".into(), s.settings.dlq_max_parks.to_string()),
                ("CRAIG_DLQ_REDRIVE_SECS".into(), s.settings.dlq_redrive_secs.to_string()),
                ("CRAIG_QUEUE_TYPE".into(), s.settings.queue_type.as_str().into()),
                // The windows the checkers hold the prune to (retention_safety), set here so no
                // stray variable of the harness's own environment moves them.
                ("CRAIG_OUTBOX_RETENTION_DAYS".into(), "30".into()),
                ("CRAIG_INBOX_RETENTION_DAYS".into(), (workload::INBOX_WINDOW_MS / 86_400_000).to_string()),
                // `craig_mq::outbox=debug` for `outbox.stamped`: who stamped what.
                ("RUST_LOG".into(), "info,craig_mq::outbox=debug,sqlx=warn,lapin=warn,lapin::returned_messages=error".into()),
            ];
            if let (Some((url, _)), "financial") = (&deployed.partner, svc.as_str()) {
                spec.env.push(("CRAIG_PARTNER_URL".into(), url.clone()));
                spec.env.push(("CRAIG_SEND_TIMEOUT_SECS".into(), s.settings.send_timeout_secs.to_string()));
                spec.env.push(("CRAIG_SEND_CLAIM_LEASE_SECS".into(), s.settings.send_lease_secs.to_string()));
            }
            let mut r = Replica::new(spec, program.clone(), &logs_dir);
            if entry.get_ref().start_after_ms.is_none() {
                r.start().await.with_context(|| format!("starting replica {name}"))?;
            }
            replicas.insert(name, Arc::new(Mutex::new(r)));
        }
    }
    Ok(Fleet { toxi, api_task, _link_ports: link_ports, logs_dir, secret, replicas: Arc::new(replicas) })
}

/// What runs from [`load_and_faults`] to [`collect_all`]: the fault schedule, the sampler
/// and its stop signal, the mutants in force.
struct Load {
    schedule: faults::Schedule,
    sampler: tokio::task::JoinHandle<()>,
    stop_tx: watch::Sender<bool>,
    mutants: Vec<(String, String)>,
}

/// Load and faults: the run's clock starts, the dead-letter tap opens, the workload's
/// staging and first-phase writes go out while the fault schedule and the sampler run.
#[allow(clippy::too_many_arguments)]
async fn load_and_faults(
    s: &Scenario,
    opts: &RunOptions,
    seed: u64,
    log: &Log,
    ep: &crate::backend::Endpoints,
    backend: &Arc<Mutex<Backend>>,
    deployed: &Deployed,
    fleet: &Fleet,
    writer: &workload::Writer<'_>,
) -> anyhow::Result<Load> {
    let replicas = &fleet.replicas;
    log.rebase();
    log.measure_db_clock(&deployed.cases_pool).await;
    if deployed.partner.is_some() {
        log.push_at(0, Event::SendQueue { lease_ms: s.settings.send_lease_secs * 1000, cap_ms: s.settings.send_timeout_secs * 1000 });
    }
    for (name, r) in replicas.iter() {
        let r = r.lock().await;
        if r.pid().is_some() {
            log.push_at(0, Event::Started { replica: name.clone(), compat: r.spec.compat.clone() });
        }
    }
    // Mutants are in force from the start (their evidence: the node's own word, at the end).
    let mutants = faults::mutants_in_force(s, log);
    // The dead-letter checkers need the truth of what reached craig.dlx: the harness's own
    // tap, bound before the workload makes any.
    // no_loss follows every staged dead letter to craig.dlx through the tap too.
    // Always open (issue 22.1): a dead letter nobody staged is a finding in any scenario.
    tap::open(&ep.amqp_url, Duration::from_secs(15), s.broker_nodes > 1).await?;
    if evaluations_tapped(s) {
        tap::open_evaluations(&ep.amqp_url, Duration::from_secs(15), s.broker_nodes > 1).await?;
    }
    deployed.staged.after_start(s, log, &deployed.pools).await?;
    let (stop_tx, stop_rx) = watch::channel(false);
    let (writes_tx, writes_rx) = watch::channel(0u32);
    let sampler = tokio::spawn(sampler::sample(
        log.clone(),
        deployed.pools.clone(),
        stop_rx.clone(),
        opts.progress,
        (writes_rx.clone(), s.workload.writes),
    ));
    let mut schedule = faults::Schedule::start(s, log, backend, replicas, &fleet.toxi, &ep.amqp_url, (writes_rx, s.workload.writes), stop_rx);
    schedule.in_force_at_start().await;
    writer.write(seed, (0, s.workload.writes), writes_tx).await;
    Ok(Load { schedule, sampler, stop_tx, mutants })
}

/// Heal: every fault lifted (every crashed replica running again), then the system must
/// work again, not only have survived: the after-heal writes and the replays.
async fn heal(s: &Scenario, seed: u64, log: &Log, fleet: &Fleet, writer: &workload::Writer<'_>, load: &mut Load) -> anyhow::Result<()> {
    load.schedule.healed(s, &fleet.replicas).await?;
    log.push(Event::Healed);
    writer.write(seed ^ 0x4ea1, (s.workload.writes, s.workload.after_heal), watch::channel(0u32).0).await;
    if s.workload.replay {
        writer.replays().await;
    }
    Ok(())
}

/// Drain: wait for quiet (liveness), then every outbox claim past its lease is recorded as
/// stuck.
async fn drain(s: &Scenario, log: &Log, ep: &crate::backend::Endpoints, backend: &Arc<Mutex<Backend>>, deployed: &Deployed) -> anyhow::Result<()> {
    sampler::drain(s, log, &deployed.pools, &deployed.staged.poison, &ep.amqp_url, backend).await;
    for (svc, pool) in &deployed.pools {
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
    Ok(())
}

/// Collect: stop the schedule and the sampler, scrape each replica's metrics, stop every
/// replica (a non-zero exit is a finding), then read the databases, the logs, the mutants'
/// evidence and the tap into the history.
async fn collect_all(
    s: &Scenario,
    log: &Log,
    ep: &crate::backend::Endpoints,
    deployed: &Deployed,
    fleet: Fleet,
    load: Load,
    metrics: &mut BTreeMap<String, BTreeMap<String, f64>>,
) -> anyhow::Result<()> {
    let _ = load.stop_tx.send(true);
    load.schedule.finish().await?;
    let _ = load.sampler.await;
    for (name, r) in fleet.replicas.iter() {
        let addr = r.lock().await.addr.clone();
        if let Some(addr) = addr {
            metrics.insert(name.clone(), collect::scrape_metrics(&addr).await);
        }
    }
    for (name, r) in fleet.replicas.iter() {
        let mut r = r.lock().await;
        if r.pid().is_some() {
            // Issue 22.9: SIGTERM drains and exits 0 (CONTRACT); anything else at the final
            // stop is a finding, never discarded.
            match r.stop(Duration::from_secs(15)).await {
                Ok(status) if status.success() => {}
                Ok(status) => log.finding(format!("{name} ended {} at the final SIGTERM, not exit 0", crate::process::describe(status))),
                Err(e) => log.finding(format!("{name} could not be stopped at the end: {e}")),
            }
        }
    }
    collect::collect(log, &deployed.pools, s.workload.kind == crate::scenario::WorkloadKind::Exports).await?;
    collect::collect_logs(log, &fleet.logs_dir);
    faults::mutant_evidence(log, &fleet.logs_dir, &load.mutants);
    tap::read(&ep.amqp_url, log).await?;
    if evaluations_tapped(s) {
        tap::read_evaluations(&ep.amqp_url, log).await?;
    }
    for p in deployed.pools.values() {
        p.close().await;
    }
    // (The fleet's Drop stops the harness's own proxy API, whatever way the run ends.)
    drop(fleet);
    Ok(())
}

/// Whether the run taps `rule.evaluated` (issue 26): rules is in the fleet and the topology
/// was deployed before it (security's wildcard queue already routes every `rule.evaluated`,
/// so the tap changes no publish's fate). One exception: on a broker cluster of classic
/// queues, a node whose data is wiped loses security's queue until it is declared again,
/// while the tap (a quorum queue there) still takes `rule.evaluated`; no shipped scenario
/// evaluates anything in that gap (`classic-queue-node-lost`'s writes end by 1 s and the wipe
/// takes their backlog: nothing is left for rules to evaluate before the heal's redeploy).
fn evaluations_tapped(s: &Scenario) -> bool {
    s.fleet.contains_key("rules") && s.deploy.topology
}

/// `craig-node topology` through the same program the replicas run: the deploy step.
async fn deploy_topology(program: &NodeProgram, amqp_url: &str, queue_type: craig_mq::topology::QueueType) -> anyhow::Result<()> {
    let out = tokio::time::timeout(
        Duration::from_secs(30),
        tokio::process::Command::new(&program.program)
            .args(&program.prefix)
            .arg("topology")
            .env("AMQP_URL", amqp_url)
            .env("CRAIG_QUEUE_TYPE", queue_type.as_str())
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

/// Bound on starting or stopping a backend (private servers: a broker may take up to 60 s
/// to answer; a shared server that hangs, or another run holding the sandbox registry
/// lock, must not hang this one).
const BACKEND_BOUND: Duration = Duration::from_secs(150);

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

/// The folder for this scenario's own files inside the report.
pub fn scenario_dir(report: &Path, name: &str) -> PathBuf {
    report.join("scenarios").join(name)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A call that never answers (a paused database) ends as an error of its own, never a
    /// hang of the run.
    #[tokio::test]
    async fn a_call_that_never_answers_is_an_error_not_a_hang() {
        let hung = std::future::pending::<Result<i64, sqlx::Error>>();
        let e = bounded(Duration::from_millis(20), "pending count", hung).await.unwrap_err();
        assert_eq!(e.to_string(), "pending count: no answer within 20ms");
        assert_eq!(bounded(PROBE, "x", async { Ok::<_, sqlx::Error>(7) }).await.unwrap(), 7);
    }

    #[test]
    fn too_little_activity_is_inconclusive_with_the_reason() {
        let s = crate::scenario::parse(
            Path::new("t.toml"),
            "name = \"t\"\namendment = \"x\"\n[fleet]\ncases = {}\n[workload]\nwrites = 4\nrate = 10\n\
             [[faults]]\nkind = \"kill\"\ntarget = \"broker\"\nat = { after_ms = 1 }\nduration_ms = 1\n\
             [expect]\nmin_redeliveries = 1\nmin_dlq_duplicates = 1\nno_loss = \"hold\"\n",
        )
        .unwrap();
        let write = |h: &mut History, t, n: u128, outcome| {
            h.push(t, Event::Write { referral: Uuid::from_u128(n), replica: "cases-1".into(), outcome, status: None, answered_ms: None })
        };
        let mut h = History::default();
        write(&mut h, 10, 1, Outcome::Ok);
        write(&mut h, 20, 2, Outcome::Ok);
        h.push(30, Event::Healed);
        let none = BTreeMap::new();
        let why = below_floor(&s, &h, &none).unwrap();
        assert!(why.contains("no write acknowledged after every fault healed (@30ms)"), "{why}");
        assert!(why.contains("0 deliveries of an envelope an inbox already held processed"), "{why}");
        assert!(why.contains("0 arrivals of a dead letter the audit already recorded"), "{why}");
        write(&mut h, 40, 3, Outcome::Ok);
        // Issue 22.1: a node's counter is no proof: it says 2, the database counted none.
        let metrics = BTreeMap::from([("rules-1".to_owned(), BTreeMap::from([("inbox_dedup_hits_total".to_owned(), 2.0)]))]);
        let why = below_floor(&s, &h, &metrics).unwrap();
        assert!(why.contains("0 deliveries") && why.contains("inbox_dedup_hits_total: 2"), "{why}");
        h.push(50, Event::Redelivered { service: "rules".into(), inbox: 2, dead_letters: 0, inbox_met_processed_ms: vec![] });
        h.push(50, Event::Redelivered { service: "security".into(), inbox: 0, dead_letters: 1, inbox_met_processed_ms: vec![] });
        assert_eq!(below_floor(&s, &h, &none), None, "3 acknowledged >= 4/2, one after the heal, 2 redeliveries in the database");
        let mut thin = History::default();
        write(&mut thin, 10, 1, Outcome::Ok);
        thin.push(30, Event::Healed);
        write(&mut thin, 40, 3, Outcome::Failed);
        let why = below_floor(&s, &thin, &metrics).unwrap();
        assert!(why.contains("1 writes acknowledged, below min_acknowledged = 2"), "{why}");
    }

    /// Issue 26: after a failover an inbox arrival proves a record the failover kept only
    /// where the record it met was stamped processed before the failover (10 ms for the
    /// clocks); the arrivals that met records made after it (the after-heal writes, a
    /// replay's of them) and the counter's total prove nothing.
    #[test]
    fn after_a_failover_only_arrivals_at_records_stamped_before_it_meet_the_redelivery_floor() {
        let s = crate::scenario::parse(
            Path::new("t.toml"),
            "name = \"t\"\namendment = \"x\"\n[fleet]\ncases = {}\n[workload]\nwrites = 2\nrate = 10\n\
             [expect]\nmin_redeliveries = 2\nno_loss = \"hold\"\n",
        )
        .unwrap();
        let none = BTreeMap::new();
        let run = |stamped: Vec<u64>| {
            let mut h = History::default();
            for (t, n) in [(10, 1u128), (20, 2)] {
                h.push(t, Event::Write { referral: Uuid::from_u128(n), replica: "cases-1".into(), outcome: Outcome::Ok, status: None, answered_ms: None });
            }
            h.push(100, Event::Failover { replayed_until_ms: Some(80), mode: "sync".into(), promoted_ms: Some(300) });
            h.push(900, Event::Redelivered { service: "rules".into(), inbox: 40, dead_letters: 0, inbox_met_processed_ms: stamped });
            below_floor(&s, &h, &none)
        };
        assert_eq!(run(vec![40, 90, 91, 150, 400]), None, "stamped @40 and @90: two records the failover kept");
        let why = run(vec![40, 91, 150, 400, 500]).unwrap();
        assert!(why.contains("1 deliveries of an envelope an inbox already held processed before the failover"), "{why}");
        let why = run(vec![]).unwrap();
        assert!(why.contains("0 deliveries") && why.contains("before the failover"), "the counter's 40 count for nothing: {why}");
    }

    /// Issue 22: the arbiter's own "absorbed" line counts only with the payment it absorbed
    /// against in financial's database, made before the line (same envelope, or the
    /// placement that envelope was staged for).
    #[test]
    fn an_absorb_counts_only_with_the_payment_it_absorbed_against() {
        let (env, other, placement) = (Uuid::from_u128(1), Uuid::from_u128(2), Uuid::from_u128(9));
        let absorbed = |h: &mut History, t| h.push(t, Event::PaymentAbsorbed { envelope: env, replica: "financial-1".into() });
        let paid = |h: &mut History, t, envelope| {
            h.push(t, Event::Effect { envelope, referral: Some(placement), service: "financial".into(), replica: Some("financial-1".into()) })
        };
        // Claimed with no payment anywhere: nothing was exercised.
        let mut h = History::default();
        absorbed(&mut h, 100);
        assert_eq!(absorbed_payments(&h), (0, 1));
        // The payment of the same envelope, but made only after the line: not what it absorbed against.
        paid(&mut h, 2000, env);
        assert_eq!(absorbed_payments(&h), (0, 1));
        // The payment of the same envelope before the line (within the clocks' rounding).
        let mut h = History::default();
        paid(&mut h, 300, env);
        absorbed(&mut h, 100);
        assert_eq!(absorbed_payments(&h), (1, 1));
        // A replay under another envelope of the same placement: the placement's payment counts.
        let mut h = History::default();
        h.push(5, Event::Staged { envelope: env, referral: Some(placement), service: "cases".into(), published: true, attempts: 1, last_error: None });
        paid(&mut h, 50, other);
        absorbed(&mut h, 100);
        assert_eq!(absorbed_payments(&h), (1, 1));
        // A payment of another placement is no corroboration.
        let mut h = History::default();
        h.push(5, Event::Staged { envelope: env, referral: Some(Uuid::from_u128(8)), service: "cases".into(), published: true, attempts: 1, last_error: None });
        paid(&mut h, 50, other);
        absorbed(&mut h, 100);
        assert_eq!(absorbed_payments(&h), (0, 1));
    }

    #[test]
    fn every_reason_for_an_inconclusive_result_is_reported() {
        let mut r = ScenarioResult {
            name: "t".into(),
            amendment: "x".into(),
            compat: "current".into(),
            seed: 1,
            backend: "local".into(),
            faults: vec![],
            invariants: vec![],
            passed: true,
            inconclusive: false,
            duration_ms: 0,
            error: None,
            metrics: BTreeMap::new(),
            history: History::default(),
        };
        inconclusive(&mut r, "replica rules-1 exited".into());
        inconclusive(&mut r, "crash point x on cases-1 never fired: the fault did not take effect".into());
        assert!(r.inconclusive && !r.passed);
        assert_eq!(
            r.error.as_deref(),
            Some("replica rules-1 exited; crash point x on cases-1 never fired: the fault did not take effect")
        );
    }

/// Issue 22.1: every checker with inputs runs; one the scenario does not list must hold,
    /// and one with nothing to check is left out.
    #[test]
    fn an_unlisted_checker_that_comes_out_violated_fails_the_run() {
        let s = crate::scenario::parse(
            Path::new("t.toml"),
            "name = \"t\"\namendment = \"x\"\n[fleet]\ncases = {}\nrules = {}\n[workload]\nwrites = 4\nrate = 10\n[expect]\nno_phantom = \"hold\"\n",
        )
        .unwrap();
        let mut h = History::default();
        h.push(1, Event::Write { referral: Uuid::from_u128(1), replica: "cases-1".into(), outcome: Outcome::Ok, status: Some(201), answered_ms: None });
        h.push(2, Event::Effect { envelope: Uuid::from_u128(9), referral: Some(Uuid::from_u128(1)), service: "rules".into(), replica: None });
        let judged = judge(&s, &h);
        let names: Vec<(&str, bool)> = judged.iter().map(|i| (i.name.as_str(), i.listed)).collect();
        assert_eq!(names[0], ("no_phantom", true));
        assert!(names.contains(&("no_loss", false)), "{names:?}");
        assert!(!names.iter().any(|(n, _)| *n == "sentinel_integrity"), "nothing to check: left out: {names:?}");
        assert!(judged.iter().all(InvariantResult::met), "{judged:?}");
        // The same run, but the acknowledged write never took effect: no_loss, unlisted, fails it.
        h.push(3, Event::Write { referral: Uuid::from_u128(2), replica: "cases-1".into(), outcome: Outcome::Ok, status: Some(201), answered_ms: None });
        let judged = judge(&s, &h);
        let lost = judged.iter().find(|i| i.name == "no_loss").unwrap();
        assert_eq!((lost.observed.as_deref(), lost.listed, lost.met()), (Some("violated"), false, false));
        // An unlisted checker that could not decide for a reason other than "nothing to
        // check" (here: the broker never counted its unacked deliveries) is kept, unknown.
        h.push(4, Event::Effect { envelope: Uuid::from_u128(10), referral: Some(Uuid::from_u128(2)), service: "rules".into(), replica: None });
        h.push(5, Event::Drained { after_ms: None, bound_ms: 1000, pending: 0, unacked_unknown: true });
        let judged = judge(&s, &h);
        let live = judged.iter().find(|i| i.name == "liveness").expect("kept though unknown");
        assert_eq!((live.observed.as_deref(), live.listed), (None, false), "{live:?}");
        assert!(live.error.as_deref().unwrap().contains("drain is not proven"), "{live:?}");
    }

    #[test]
    fn a_mutant_outlives_the_crash_point_it_shares_a_replica_with() {
        assert_eq!(faults::mutants_only(Some("inbox::x=9*off->return(abort);financial::absorb_fails=return(on)".into())).as_deref(), Some("financial::absorb_fails=return(on)"));
        assert_eq!(faults::mutants_only(Some("inbox::x=return(abort)".into())), None);
        assert_eq!(faults::mutants_only(None), None);
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
        let twin = Expectation { expect: Expect::Violate, cause: vec!["compat:pre-1128".into(), "fault:toxic cases-1->broker".into()] };
        let r = invariant_result(
            violated_by(&[("compat:pre-1128", 3), ("replica:cases-1", 3), ("fault:toxic cases-1->broker", 3)], 3),
            &twin,
        );
        assert!(r.met(), "{r:?}");
        let r = invariant_result(violated_by(&[("compat:pre-1128", 2), ("compat:current", 1), ("fault:toxic cases-1->broker", 3)], 3), &twin);
        assert_eq!((r.observed.as_deref(), r.cause_met), (Some("violated"), Some(false)));
        assert!(!r.met());
        let r = invariant_result(violated_by(&[("compat:pre-1128", 3)], 3), &twin);
        assert!(!r.met(), "every named cause must be pointed at, the fault too");
        // Without a cause, any violation meets a "violate".
        let any = Expectation { expect: Expect::Violate, cause: vec![] };
        assert!(invariant_result(violated_by(&[("compat:current", 1)], 1), &any).met());
    }
}
