//! `chaos bench` (CONTRACT § chaos; issue 12): how fast the ADR-022 implementation is on this
//! machine, each figure a RATIO to a baseline measured in the same run — baseline and subject
//! alternate, several rounds, medians — so a slower or busier machine moves both.
//!
//! | figure | subject | baseline | goal |
//! |---|---|---|---|
//! | `relay` | the #1128 outbox worker draining a backlog into a durable queue | raw lapin, the same envelopes, confirms fully pipelined on one channel, no database | ≥ 0.6 |
//! | `pre_1128` | the current drain (polling, 1 s) | the pre-#1128 drain on the same backlog (locks across publish, no confirms, 100 a tick) | gain |
//! | `parallel_2`, `parallel_4` | 2 / 4 workers on one backlog | 1 worker | no row published twice |
//! | `lag_poll` | commit → consumer receipt at 1,000 events/s, 1 s polling | a direct publish → receipt at the same rate | p99 ≤ 1.1 s |
//! | `lag_notify` | the same with LISTEN/NOTIFY (`outbox::notify`) | the same direct publish | p50 ≤ 10 ms, p99 ≤ 50 ms |
//! | `inbox` | the rules consumer with `handle_idempotently` | the same handler without the inbox | ≥ 0.5 |
//! | `consumer` | the consumer at concurrency N (the prefetch) end to end | the same at concurrency 1 (the old consumer) | ≥ 3 |
//! | `notify_staging` | 8 concurrent producers staging with NOTIFY | the same without | (its cost) |
//! | `idem_miss`, `idem_replay` | the §D5 middleware, a miss / a replay, 16 concurrent HTTP clients over TCP | the same route without the layer | — |
//!
//! Plus the claim query's plan (`EXPLAIN`), which must use the partial index. Every run is
//! also checked for correctness: the relay published every row exactly once (queue depth =
//! rows, nothing left pending), parallel workers published nothing twice, every event of
//! the lag runs arrived, every delivery of the consumer runs had its effect. A correctness
//! failure fails the bench (exit 1); a goal missed is reported, not failed (the figures
//! depend on the machine).
//!
//! Runs on the local backend (private PostgreSQL with `fsync=off`, private RabbitMQ), in
//! process: the worker, the consumer and the middleware are the library code the nodes run.
//! Measure a `--release` build (full optimisation): the `ci` profile that `ci/test` builds is
//! at opt-level 1 (the harness at 0) and runs only the smoke run.

mod consumer;
mod http;
mod relay;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::Context as _;
use serde::Serialize;
use sqlx::PgPool;
use sqlx::postgres::PgPoolOptions;

use crate::backend::{Backend, BackendKind};

/// What to run and how big.
#[derive(Debug, Clone)]
pub struct BenchOptions {
    /// Seconds, not minutes: tiny sizes, one round (`ci/test` runs this so the command
    /// cannot rot; its figures mean little).
    pub smoke: bool,
    pub rounds: usize,
    /// Rows of the relay, pre-1128 and parallel-drain backlogs.
    pub backlog: usize,
    /// Events of the consumer backlog (the concurrency-1 baseline drains at most
    /// [`BenchOptions::sequential_backlog`] of them).
    pub consumer_backlog: usize,
    pub sequential_backlog: usize,
    /// The subject consumer's concurrency (default: the prefetch).
    pub consumer_concurrency: u16,
    /// Events/s and seconds of each lag run.
    pub lag_rate: u32,
    pub lag_secs: u64,
    /// Requests per HTTP measurement.
    pub requests: usize,
    /// The outbox worker's batch (`CRAIG_OUTBOX_BATCH`; default production's 100).
    pub batch: u32,
    /// Only these figures (empty: all).
    pub only: Vec<String>,
    pub report_dir: PathBuf,
}

impl BenchOptions {
    pub fn full(report_dir: PathBuf) -> Self {
        BenchOptions {
            smoke: false,
            rounds: 3,
            backlog: 100_000,
            consumer_backlog: 50_000,
            sequential_backlog: 20_000,
            consumer_concurrency: craig_mq::settings::CONSUMER_PREFETCH,
            lag_rate: 1_000,
            lag_secs: 30,
            requests: 5_000,
            batch: craig_mq::OutboxConfig::default().batch_size,
            only: Vec::new(),
            report_dir,
        }
    }

    pub fn smoke(report_dir: PathBuf) -> Self {
        BenchOptions {
            smoke: true,
            rounds: 1,
            backlog: 2_000,
            consumer_backlog: 1_000,
            sequential_backlog: 300,
            lag_rate: 500,
            lag_secs: 2,
            requests: 200,
            ..Self::full(report_dir)
        }
    }

    fn wants(&self, group: &str) -> bool {
        self.only.is_empty() || self.only.iter().any(|o| o == group)
    }
}

/// The measurement groups `--only` accepts.
pub const GROUPS: &[&str] = &["relay", "parallel", "lag", "consumer", "http", "explain"];

/// One figure: subject and baseline medians over the rounds, and their ratio.
#[derive(Debug, Clone, Serialize)]
pub struct Figure {
    pub id: String,
    pub what: String,
    pub unit: String,
    pub subject_label: String,
    pub subject: f64,
    pub subject_rounds: Vec<f64>,
    pub baseline_label: String,
    pub baseline: f64,
    pub baseline_rounds: Vec<f64>,
    /// subject / baseline (for a latency figure, subject p99 over baseline p99).
    pub ratio: f64,
    pub goal: Option<String>,
    pub met: Option<bool>,
    pub details: BTreeMap<String, serde_json::Value>,
}

/// What `chaos bench` writes (`bench.json`) and prints.
#[derive(Debug, Serialize)]
pub struct BenchReport {
    pub command: String,
    pub started_at: String,
    pub duration_s: f64,
    pub machine: BTreeMap<String, serde_json::Value>,
    pub options: BTreeMap<String, serde_json::Value>,
    pub figures: Vec<Figure>,
    pub explain: Option<Explain>,
    /// Correctness checks that failed (each fails the bench).
    pub failures: Vec<String>,
}

#[derive(Debug, Clone, Serialize)]
pub struct Explain {
    pub query: String,
    pub plan: Vec<String>,
    pub uses_partial_index: bool,
}

pub fn median(v: &[f64]) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    let mut s = v.to_vec();
    s.sort_by(|a, b| a.total_cmp(b));
    let n = s.len();
    if n % 2 == 1 { s[n / 2] } else { (s[n / 2 - 1] + s[n / 2]) / 2.0 }
}

/// The `p`-th percentile (0..=100) by nearest rank.
pub fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let rank = ((p / 100.0) * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

/// CPU time spent while a closure runs: this process (worker, client, lapin, sqlx) against
/// the whole machine (the rest is PostgreSQL and RabbitMQ), in core-seconds. The profile of
/// where the time goes when a goal is missed.
#[derive(Debug, Clone, Copy, Default, Serialize)]
pub struct CpuSplit {
    pub wall_s: f64,
    pub bench_process_s: f64,
    pub servers_and_rest_s: f64,
    pub idle_s: f64,
}

struct CpuMark {
    at: Instant,
    ours: f64,
    busy: f64,
    idle: f64,
}

fn cpu_mark() -> CpuMark {
    let tick = 100.0; // USER_HZ on Linux
    let ours = std::fs::read_to_string("/proc/self/stat")
        .ok()
        .and_then(|s| {
            let rest = s.rsplit_once(") ")?.1.to_owned();
            let f: Vec<&str> = rest.split_whitespace().collect();
            Some((f.get(11)?.parse::<f64>().ok()? + f.get(12)?.parse::<f64>().ok()?) / tick)
        })
        .unwrap_or(0.0);
    let (busy, idle) = std::fs::read_to_string("/proc/stat")
        .ok()
        .and_then(|s| {
            let f: Vec<f64> = s.lines().next()?.split_whitespace().skip(1).filter_map(|x| x.parse().ok()).collect();
            let idle = f.get(3)? + f.get(4).unwrap_or(&0.0);
            Some(((f.iter().sum::<f64>() - idle) / tick, idle / tick))
        })
        .unwrap_or((0.0, 0.0));
    CpuMark { at: Instant::now(), ours, busy, idle }
}

impl CpuMark {
    fn split(&self) -> CpuSplit {
        let now = cpu_mark();
        let ours = now.ours - self.ours;
        CpuSplit {
            wall_s: self.at.elapsed().as_secs_f64(),
            bench_process_s: ours,
            servers_and_rest_s: (now.busy - self.busy - ours).max(0.0),
            idle_s: now.idle - self.idle,
        }
    }
}

/// The servers and pools every measurement shares.
pub(crate) struct Env {
    _backend: Backend,
    pub cases: PgPool,
    pub rules: PgPool,
    pub rules_url: String,
    pub amqp_url: String,
}

impl Env {
    async fn start() -> anyhow::Result<Env> {
        let (backend, _) = Backend::start(BackendKind::Local, "bench", &["cases", "rules"])
            .await
            .context("starting the local backend (private PostgreSQL and RabbitMQ)")?;
        let ep = backend.endpoints();
        let mut pools = Vec::new();
        for (svc, url) in &ep.databases {
            let service: craig_fleet::Service = svc.parse()?;
            craig_fleet::node::migrate_for(service, url, Duration::from_secs(30), &craig_fleet::CompatSet::default()).await?;
            pools.push(PgPoolOptions::new().max_connections(40).connect(url).await?);
        }
        craig_mq::topology::deploy_operator_part(&ep.amqp_url, Default::default()).await?;
        let rules = pools.pop().context("rules pool")?;
        let cases = pools.pop().context("cases pool")?;
        let rules_url = ep.database_url("rules").context("rules database")?.to_owned();
        Ok(Env { _backend: backend, cases, rules, rules_url, amqp_url: ep.amqp_url })
    }
}

fn progress(msg: impl AsRef<str>) {
    eprintln!("bench: {}", msg.as_ref());
}

/// Run every measurement `opts` asks for.
pub async fn run(opts: &BenchOptions, command: &str) -> anyhow::Result<BenchReport> {
    let t0 = Instant::now();
    let started_at = chrono::Utc::now().to_rfc3339();
    progress("starting private PostgreSQL and RabbitMQ");
    let env = Env::start().await?;
    let mut figures = Vec::new();
    let mut failures = Vec::new();
    let mut explain = None;
    if opts.wants("relay") || opts.wants("explain") {
        let (figs, fails, plan) = relay::relay(&env, opts).await?;
        figures.extend(figs);
        failures.extend(fails);
        explain = plan;
    }
    if opts.wants("parallel") {
        let (figs, fails) = relay::parallel(&env, opts).await?;
        figures.extend(figs);
        failures.extend(fails);
    }
    if opts.wants("lag") {
        let (figs, fails) = relay::lag(&env, opts).await?;
        figures.extend(figs);
        failures.extend(fails);
        figures.push(relay::staging_cost(&env, opts).await?);
    }
    if opts.wants("consumer") {
        let (figs, fails) = consumer::consumer(&env, opts).await?;
        figures.extend(figs);
        failures.extend(fails);
    }
    if opts.wants("http") {
        let (figs, fails) = http::middleware(&env, opts).await?;
        figures.extend(figs);
        failures.extend(fails);
    }
    let mut machine = BTreeMap::new();
    machine.insert("cores".into(), serde_json::json!(std::thread::available_parallelism().map(|n| n.get()).unwrap_or(0)));
    machine.insert("postgres".into(), serde_json::json!("private server, fsync=off"));
    let exe = std::env::current_exe().map(|p| p.display().to_string()).unwrap_or_default();
    let profile = if exe.contains("/target/release/") {
        "release (full optimisation)"
    } else if exe.contains("/target/ci/") {
        "ci (opt-level 1, the harness 0: not for figures)"
    } else {
        "unknown"
    };
    machine.insert("binary".into(), serde_json::json!(exe));
    machine.insert("profile".into(), serde_json::json!(profile));
    let mut options = BTreeMap::new();
    options.insert("smoke".into(), serde_json::json!(opts.smoke));
    options.insert("rounds".into(), serde_json::json!(opts.rounds));
    options.insert("backlog".into(), serde_json::json!(opts.backlog));
    options.insert("consumer_backlog".into(), serde_json::json!(opts.consumer_backlog));
    options.insert("sequential_backlog".into(), serde_json::json!(opts.sequential_backlog));
    options.insert("consumer_concurrency".into(), serde_json::json!(opts.consumer_concurrency));
    options.insert("lag_rate".into(), serde_json::json!(opts.lag_rate));
    options.insert("lag_secs".into(), serde_json::json!(opts.lag_secs));
    options.insert("requests".into(), serde_json::json!(opts.requests));
    options.insert("batch".into(), serde_json::json!(opts.batch));
    Ok(BenchReport {
        command: command.to_owned(),
        started_at,
        duration_s: t0.elapsed().as_secs_f64(),
        machine,
        options,
        figures,
        explain,
        failures,
    })
}

impl BenchReport {
    /// The table for a person (also `bench.md`).
    pub fn table(&self) -> String {
        use std::fmt::Write as _;
        let mut out = String::new();
        let _ = writeln!(out, "| figure | subject | baseline | ratio | goal |");
        let _ = writeln!(out, "|---|---|---|---|---|");
        for f in &self.figures {
            let goal = match (&f.goal, f.met) {
                (Some(g), Some(true)) => format!("{g}: met"),
                (Some(g), Some(false)) => format!("{g}: **not met**"),
                (Some(g), None) => g.clone(),
                (None, _) => "—".into(),
            };
            let _ = writeln!(
                out,
                "| {} | {}: {} {} | {}: {} {} | {:.2} | {} |",
                f.id,
                f.subject_label,
                fmt_num(f.subject),
                f.unit,
                f.baseline_label,
                fmt_num(f.baseline),
                f.unit,
                f.ratio,
                goal
            );
        }
        if let Some(e) = &self.explain {
            let _ = writeln!(
                out,
                "\nclaim query plan ({}): {}",
                if e.uses_partial_index { "uses idx_event_outbox_pending" } else { "does NOT use idx_event_outbox_pending" },
                e.plan.iter().map(|l| l.trim()).collect::<Vec<_>>().join(" / ")
            );
        }
        let cores = self.machine.get("cores").cloned().unwrap_or_default();
        let profile = self.machine.get("profile").and_then(|p| p.as_str()).unwrap_or("?").to_owned();
        let _ = writeln!(out, "\n{cores} cores, {profile}, PostgreSQL fsync=off; {:.0} s; `{}`", self.duration_s, self.command);
        for f in &self.failures {
            let _ = writeln!(out, "\nFAILED: {f}");
        }
        out
    }

    pub fn write(&self, dir: &Path) -> std::io::Result<()> {
        std::fs::create_dir_all(dir)?;
        std::fs::write(dir.join("bench.json"), serde_json::to_string_pretty(self).unwrap_or_default())?;
        std::fs::write(dir.join("bench.md"), self.table())
    }
}

fn fmt_num(x: f64) -> String {
    if !x.is_finite() {
        "n/a".into()
    } else if x >= 100.0 {
        format!("{x:.0}")
    } else if x >= 10.0 {
        format!("{x:.1}")
    } else {
        format!("{x:.2}")
    }
}

/// A throughput figure (higher is better) from per-round rates.
#[allow(clippy::too_many_arguments)]
pub(crate) fn throughput(
    id: &str,
    what: &str,
    unit: &str,
    (subject_label, subject): (&str, Vec<f64>),
    (baseline_label, baseline): (&str, Vec<f64>),
    goal: Option<(&str, f64)>,
    details: BTreeMap<String, serde_json::Value>,
) -> Figure {
    let (s, b) = (median(&subject), median(&baseline));
    let ratio = s / b;
    Figure {
        id: id.into(),
        what: what.into(),
        unit: unit.into(),
        subject_label: subject_label.into(),
        subject: s,
        subject_rounds: subject,
        baseline_label: baseline_label.into(),
        baseline: b,
        baseline_rounds: baseline,
        ratio,
        goal: goal.map(|(g, _)| g.to_owned()),
        met: goal.map(|(_, min)| ratio >= min),
        details,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn medians_and_percentiles() {
        assert_eq!(median(&[3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(&[4.0, 1.0, 2.0, 3.0]), 2.5);
        assert!(median(&[]).is_nan());
        let v: Vec<f64> = (1..=100).map(f64::from).collect();
        assert_eq!(percentile(&v, 50.0), 50.0);
        assert_eq!(percentile(&v, 99.0), 99.0);
        assert_eq!(percentile(&v, 100.0), 100.0);
        assert_eq!(percentile(&[7.0], 99.0), 7.0);
    }

    #[test]
    fn a_ratio_is_subject_over_baseline_and_the_goal_is_judged_on_it() {
        let f = throughput("relay", "x", "events/s", ("worker", vec![6.0, 7.0, 5.0]), ("raw", vec![10.0, 10.0, 9.0]), Some((">= 0.6", 0.6)), BTreeMap::new());
        assert_eq!((f.subject, f.baseline, f.ratio, f.met), (6.0, 10.0, 0.6, Some(true)));
        let rep = BenchReport {
            command: "chaos bench".into(),
            started_at: String::new(),
            duration_s: 1.0,
            machine: BTreeMap::new(),
            options: BTreeMap::new(),
            figures: vec![f],
            explain: None,
            failures: vec!["relay: 3 rows published twice".into()],
        };
        let t = rep.table();
        assert!(t.contains("| relay | worker: 6.00 events/s | raw: 10.0 events/s | 0.60 | >= 0.6: met |"), "{t}");
        assert!(t.contains("FAILED: relay: 3 rows published twice"), "{t}");
    }
}
