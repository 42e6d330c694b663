//! `chaos`: the ADR-022 chaos-verification harness CLI (CONTRACT § chaos).
//!
//! Exit codes: 0 every scenario met its `expect`; 1 one did not; 2 bad input (file, line,
//! reason); 3 inconclusive (nothing to check, a checker failed, or the run could not do
//! what the scenario asked).

use std::io::IsTerminal as _;
use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};
use craig_chaos::backend::BackendKind;
use craig_chaos::bench::BenchOptions;
use craig_chaos::report::RunReport;
use craig_chaos::runner::{RunOptions, derived_seed, run_scenario, scenario_seed};
use craig_chaos::scenario;

/// Run ADR-022 chaos scenarios against real PostgreSQL and RabbitMQ and check the invariants.
#[derive(Parser)]
#[command(name = "chaos", version)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Run scenario files or folders (default: scenarios/) and print a verdict table.
    Run {
        /// Scenario files or folders.
        paths: Vec<PathBuf>,
        /// Seed for every random choice (default: from the clock; printed either way).
        #[arg(long)]
        seed: Option<u64>,
        /// auto, local, external or containers.
        #[arg(long, env = "CHAOS_BACKEND", default_value = "auto")]
        backend: BackendKind,
        /// Report folder (default: target/chaos/<run id>).
        #[arg(long)]
        report: Option<PathBuf>,
        /// Also write the verdicts as JUnit XML to FILE (a test case per scenario and invariant).
        #[arg(long, value_name = "FILE")]
        junit: Option<PathBuf>,
        /// Run every scenario under N seeds derived from --seed (the first is --seed itself)
        /// and report per scenario how many held, with each failing seed's reproduce command.
        #[arg(long, value_name = "N", value_parser = clap::value_parser!(u32).range(1..=1000))]
        seeds: Option<u32>,
    },
    /// List the scenarios found, with what each expects.
    List {
        paths: Vec<PathBuf>,
    },
    /// Measure the implementation on the local backend, each figure a ratio to a baseline
    /// from the same run (relay, pre-1128, parallel drain, publish lag with polling and
    /// LISTEN/NOTIFY, consumer, middleware, the claim's plan). Prints a table on stderr and
    /// the JSON on stdout; writes bench.json and bench.md to the report folder. Measure a
    /// `--release` build (full optimisation). Exit 1 when a correctness check failed.
    Bench {
        /// Seconds instead of minutes: tiny sizes, one round (what ci/test runs).
        #[arg(long)]
        smoke: bool,
        /// Rounds of each measurement (baseline and subject alternate; medians).
        #[arg(long, value_parser = clap::value_parser!(u32).range(1..=20))]
        rounds: Option<u32>,
        /// Rows of the relay, pre-1128 and parallel-drain backlogs (default 100000).
        #[arg(long, value_parser = clap::value_parser!(u64).range(100..=2_000_000))]
        backlog: Option<u64>,
        /// The outbox worker's batch, as CRAIG_OUTBOX_BATCH (default 100, production's).
        #[arg(long, value_parser = clap::value_parser!(u32).range(1..=10_000))]
        batch: Option<u32>,
        /// Events of the consumer backlog (default 50000).
        #[arg(long, value_parser = clap::value_parser!(u64).range(100..=2_000_000))]
        consumer_backlog: Option<u64>,
        /// The subject consumer's concurrency, 1..=32 (default 32, the prefetch); the
        /// baseline is always concurrency 1.
        #[arg(long, value_parser = clap::value_parser!(u16).range(1..=32))]
        consumer_concurrency: Option<u16>,
        /// Seconds of each lag measurement (default 30).
        #[arg(long, value_parser = clap::value_parser!(u64).range(1..=600))]
        lag_secs: Option<u64>,
        /// Only these groups: relay, parallel, lag, consumer, http, explain (repeatable).
        #[arg(long, value_delimiter = ',')]
        only: Vec<String>,
        /// Report folder (default: target/chaos/bench-<time>).
        #[arg(long)]
        report: Option<PathBuf>,
    },
    /// Serve the fault proxy behind Toxiproxy's HTTP API (version 2.12.0's routes and error
    /// bodies), as a Toxiproxy server would: the containers backend's Toxiproxy (ci/images/build
    /// always builds it: the official image keeps no counters, so a link fault could not
    /// prove it fired; issue 24). Prints `Starting Toxiproxy HTTP server
    /// on ADDR` on stdout once it listens (Toxiproxy's own readiness line, so one wait serves
    /// both), and runs until SIGTERM or Ctrl-C (exit 0). Proxies listen where the client's
    /// `listen` says.
    Proxy {
        /// Address of the HTTP API (port 0 picks a free one; the line above names it).
        #[arg(long, value_name = "ADDR", default_value = "127.0.0.1:8474")]
        api: std::net::SocketAddr,
        /// Seed of the toxics' random choices (toxicity, jitter); default from the clock.
        #[arg(long)]
        seed: Option<u64>,
    },
}

fn main() -> ExitCode {
    // `chaos craig-node …` runs a fleet node: the harness's replicas are this binary.
    let mut args = std::env::args_os();
    if std::env::args_os().nth(1).is_some_and(|a| a == "craig-node") {
        let _self = args.next();
        return craig_fleet::cli::run(args);
    }
    let cli = Cli::parse();
    match cli.command {
        Command::List { paths } => list(&paths),
        Command::Proxy { api, seed } => proxy(api, seed),
        Command::Bench { smoke, rounds, backlog, batch, consumer_backlog, consumer_concurrency, lag_secs, only, report } => {
            let dir = report.unwrap_or_else(|| PathBuf::from("target/chaos").join(format!("bench-{}", chrono::Utc::now().format("%Y%m%d-%H%M%S"))));
            let mut opts = if smoke { BenchOptions::smoke(dir.clone()) } else { BenchOptions::full(dir.clone()) };
            if let Some(r) = rounds {
                opts.rounds = r as usize;
            }
            if let Some(b) = backlog {
                opts.backlog = b as usize;
            }
            if let Some(b) = batch {
                opts.batch = b;
            }
            if let Some(b) = consumer_backlog {
                opts.consumer_backlog = b as usize;
            }
            if let Some(c) = consumer_concurrency {
                opts.consumer_concurrency = c;
            }
            if let Some(s) = lag_secs {
                opts.lag_secs = s;
            }
            if let Some(bad) = only.iter().find(|o| !craig_chaos::bench::GROUPS.contains(&o.as_str())) {
                eprintln!("chaos bench: unknown group {bad:?}; known: {}", craig_chaos::bench::GROUPS.join(", "));
                return ExitCode::from(2);
            }
            opts.only = only;
            let command = std::env::args().collect::<Vec<_>>().join(" ");
            let rt = tokio::runtime::Runtime::new().expect("tokio runtime");
            match rt.block_on(craig_chaos::bench::run(&opts, &command)) {
                Ok(rep) => {
                    eprintln!("\n{}", rep.table());
                    println!("{}", serde_json::to_string_pretty(&rep).unwrap_or_default());
                    if let Err(e) = rep.write(&dir) {
                        eprintln!("chaos bench: writing {}: {e}", dir.display());
                        return ExitCode::from(3);
                    }
                    eprintln!("bench: {}/bench.json and bench.md", dir.display());
                    if rep.failures.is_empty() { ExitCode::SUCCESS } else { ExitCode::from(1) }
                }
                Err(e) => {
                    eprintln!("chaos bench: {e:#}");
                    ExitCode::from(3)
                }
            }
        }
        Command::Run { paths, seed, backend, report, junit, seeds } => {
            let rt = tokio::runtime::Runtime::new().expect("tokio runtime");
            rt.block_on(async {
                let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()).expect("SIGTERM handler");
                // Dropping the run future drops its backend and replicas: servers are
                // killed and temp dirs removed before we exit.
                tokio::select! {
                    code = run(paths, seed, backend, report, junit, seeds.unwrap_or(1)) => code,
                    _ = tokio::signal::ctrl_c() => {
                        eprintln!("chaos: interrupted; servers and replicas stopped, temp dirs removed");
                        ExitCode::from(130)
                    }
                    _ = term.recv() => {
                        eprintln!("chaos: terminated; servers and replicas stopped, temp dirs removed");
                        ExitCode::from(143)
                    }
                }
            })
        }
    }
}

/// `chaos proxy --api ADDR`: the fault proxy as a Toxiproxy-API server, until a signal.
fn proxy(addr: std::net::SocketAddr, seed: Option<u64>) -> ExitCode {
    use std::io::Write as _;
    let seed = seed.unwrap_or_else(|| std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos() as u64));
    let rt = tokio::runtime::Runtime::new().expect("tokio runtime");
    rt.block_on(async {
        let mut term = match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(t) => t,
            Err(e) => {
                eprintln!("chaos proxy: installing the SIGTERM handler: {e}");
                return ExitCode::from(3);
            }
        };
        let (bound, task) = match craig_chaos::proxy::api::serve(craig_chaos::proxy::FaultProxy::new(seed), addr).await {
            Ok(served) => served,
            Err(e) => {
                eprintln!("chaos proxy: cannot listen on {addr}: {e}");
                return ExitCode::from(2);
            }
        };
        println!("Starting Toxiproxy HTTP server on {bound} (chaos proxy, Toxiproxy API {}, seed {seed})", craig_chaos::proxy::api::VERSION);
        let _ = std::io::stdout().flush();
        tokio::select! {
            _ = task => {
                eprintln!("chaos proxy: the API server stopped");
                ExitCode::from(3)
            }
            _ = tokio::signal::ctrl_c() => ExitCode::SUCCESS,
            _ = term.recv() => ExitCode::SUCCESS,
        }
    })
}

fn list(paths: &[PathBuf]) -> ExitCode {
    match scenario::load(paths) {
        Ok(all) if all.is_empty() => {
            println!("chaos: no scenarios found");
            ExitCode::SUCCESS
        }
        Ok(all) => {
            for s in all {
                let expect: Vec<String> = s
                    .expect
                    .iter()
                    .map(|(k, v)| {
                        let v = v.get_ref();
                        let word = match v.expect {
                            scenario::Expect::Hold => "hold",
                            scenario::Expect::Violate => "violate",
                        };
                        if v.cause.is_empty() { format!("{k}={word}") } else { format!("{k}={word}({})", v.cause.join("+")) }
                    })
                    .collect();
                println!("{:<32} {:<8} compat {:<10} {}", s.name, s.amendment, s.compat_summary(), expect.join(" "));
            }
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("chaos: {e}");
            ExitCode::from(2)
        }
    }
}

/// Per scenario: how many seeds met the expectations, and each other seed's reproduce command.
fn seeds_summary(
    scenarios: &[craig_chaos::scenario::Scenario],
    results: &[craig_chaos::runner::ScenarioResult],
    per_seed: &[(u64, usize)],
    backend: BackendKind,
    seed: u64,
) -> String {
    use std::fmt::Write as _;
    let mut out = format!("seeds: {} derived from --seed {seed}\n\n", per_seed.len());
    for (i, s) in scenarios.iter().enumerate() {
        let runs: Vec<(u64, &craig_chaos::runner::ScenarioResult)> =
            per_seed.iter().map(|(rs, first)| (*rs, &results[first + i])).collect();
        let met = runs.iter().filter(|(_, r)| r.passed).count();
        let secs: f64 = runs.iter().map(|(_, r)| r.duration_ms as f64 / 1000.0).sum();
        let _ = writeln!(out, "{:<28} {met}/{} seeds met  ({secs:.0} s)", s.name, runs.len());
        for (rs, r) in runs.iter().filter(|(_, r)| !r.passed) {
            let word = if r.inconclusive { "inconclusive" } else { "NOT met" };
            let _ = writeln!(
                out,
                "    {word} under --seed {rs}: cargo run --profile ci -p craig-chaos -- run {} --seed {rs} --backend {backend}",
                s.path.display()
            );
        }
    }
    out
}

async fn run(paths: Vec<PathBuf>, seed: Option<u64>, backend: BackendKind, report: Option<PathBuf>, junit: Option<PathBuf>, seeds: u32) -> ExitCode {
    let scenarios = match scenario::load(&paths) {
        Ok(s) => s,
        Err(e) => {
            eprintln!("chaos: {e}");
            return ExitCode::from(2);
        }
    };
    if scenarios.is_empty() {
        println!("chaos: no scenarios found; nothing to check");
        return ExitCode::from(3);
    }
    let seed = seed.unwrap_or_else(|| {
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_nanos() as u64).unwrap_or(1)
    });
    let run_id = format!("{}-{:08x}", chrono::Utc::now().format("%Y%m%d-%H%M%S"), seed as u32);
    let report_dir = report.unwrap_or_else(|| PathBuf::from("target/chaos").join(&run_id));
    let shown: Vec<String> = paths.iter().map(|p| p.display().to_string()).collect();
    let command = format!(
        "cargo run --profile ci -p craig-chaos -- run {}--seed {seed}{} --backend {backend}",
        if shown.is_empty() { String::new() } else { format!("{} ", shown.join(" ")) },
        if seeds > 1 { format!(" --seeds {seeds}") } else { String::new() }
    );
    // Progress lines go to stderr either way; on a terminal they come every 2 s per scenario.
    let progress = std::io::stderr().is_terminal() || std::env::var_os("CI").is_some() || std::env::var_os("CHAOS_PROGRESS").is_some();
    println!("chaos run {run_id}: {} scenarios, seed {seed}, backend {backend}", scenarios.len());
    println!("reproduce: {command}");
    let node_program = match craig_chaos::process::NodeProgram::from_env() {
        Ok(p) => p,
        Err(e) => {
            eprintln!("chaos: cannot locate the node program: {e}");
            return ExitCode::from(3);
        }
    };
    // With --seeds N each run seed gets its own complete report folder (seed-<seed>/).
    let run_seeds: Vec<u64> = (0..seeds).map(|k| derived_seed(seed, k)).collect();
    let mut results = Vec::new();
    let mut per_seed: Vec<(u64, usize)> = Vec::new(); // (run seed, index of its first result)
    for (k, &run_seed) in run_seeds.iter().enumerate() {
        let dir = if seeds > 1 { report_dir.join(format!("seed-{run_seed}")) } else { report_dir.clone() };
        let opts = RunOptions { backend, node_program: node_program.clone(), report_dir: dir.clone(), progress };
        per_seed.push((run_seed, results.len()));
        if seeds > 1 {
            eprintln!("== seed {}/{seeds}: --seed {run_seed}", k + 1);
        }
        for (i, s) in scenarios.iter().enumerate() {
            let sseed = scenario_seed(run_seed, s);
            eprintln!("[{}/{}] {} ({}, compat {}) seed {sseed}", i + 1, scenarios.len(), s.name, s.amendment, s.compat_summary());
            let r = run_scenario(s, &opts, sseed).await;
            let word = if r.passed { "met" } else if r.inconclusive { "INCONCLUSIVE" } else { "NOT MET" };
            eprintln!("[{}/{}] {} — {word} in {:.1} s{}", i + 1, scenarios.len(), s.name, r.duration_ms as f64 / 1000.0,
                r.error.as_deref().map(|e| format!(": {e}")).unwrap_or_default());
            // A CI log is often all a reader has: say why, not only that.
            for inv in r.invariants.iter().filter(|inv| !inv.met()) {
                let counts: Vec<String> = inv.counts.iter().map(|(k, v)| format!("{k}={v}")).collect();
                eprintln!("      {} expected {:?}, observed {}: {}", inv.name, inv.expected,
                    inv.observed.as_deref().unwrap_or("undecided"), counts.join(", "));
                for w in inv.witnesses.iter().take(5) {
                    eprintln!("        - {w}");
                }
                if inv.witnesses.len() > 5 {
                    eprintln!("        … {} more in the report", inv.witnesses.len() - 5);
                }
            }
            results.push(r);
        }
        if seeds > 1 {
            let slice = &results[per_seed[k].1..];
            let backend_used = slice.iter().map(|r| r.backend.as_str()).find(|b| !b.is_empty()).unwrap_or(backend.name()).to_owned();
            let seed_command = command.replace(&format!("--seed {seed}"), &format!("--seed {run_seed}"));
            let rep = RunReport { run_id: &run_id, seed: run_seed, backend: &backend_used, command: &seed_command, results: slice };
            if let Err(e) = rep.write(&dir) {
                eprintln!("chaos: writing the report to {}: {e}", dir.display());
                return ExitCode::from(3);
            }
        }
    }
    let backend_used = results.iter().map(|r| r.backend.as_str()).find(|b| !b.is_empty()).unwrap_or(backend.name()).to_owned();
    if seeds > 1 {
        let summary = seeds_summary(&scenarios, &results, &per_seed, backend, seed);
        println!("\n{summary}");
        if let Err(e) = std::fs::create_dir_all(&report_dir).and_then(|()| std::fs::write(report_dir.join("seeds.md"), &summary)) {
            eprintln!("chaos: writing the seeds summary to {}: {e}", report_dir.display());
            return ExitCode::from(3);
        }
        println!("report: {}/seeds.md (each seed's full report in seed-<seed>/)", report_dir.display());
    } else {
        let rep = RunReport { run_id: &run_id, seed, backend: &backend_used, command: &command, results: &results };
        println!("\n{}", rep.table());
        if let Err(e) = rep.write(&report_dir) {
            eprintln!("chaos: writing the report to {}: {e}", report_dir.display());
            return ExitCode::from(3);
        }
        println!("report: {}/report.md (timeline.svg, report.json, history.jsonl beside it)", report_dir.display());
    }
    if let Some(path) = junit {
        // One suite per scenario and seed when there are several seeds.
        let named: Vec<_> = results
            .iter()
            .map(|r| {
                let mut r = r.clone();
                if seeds > 1 {
                    r.name = format!("{} (seed {})", r.name, r.seed);
                }
                r
            })
            .collect();
        let rep = RunReport { run_id: &run_id, seed, backend: &backend_used, command: &command, results: &named };
        if let Err(e) = std::fs::write(&path, rep.junit()) {
            eprintln!("chaos: writing JUnit XML to {}: {e}", path.display());
            return ExitCode::from(3);
        }
        println!("junit: {}", path.display());
    }
    let failed = results.iter().any(|r| !r.passed && !r.inconclusive);
    let inconclusive = results.iter().any(|r| r.inconclusive);
    if failed {
        println!("chaos: a scenario did not meet its expectations; reproduce with: {command}");
        ExitCode::from(1)
    } else if inconclusive {
        println!("chaos: inconclusive; reproduce with: {command}");
        ExitCode::from(3)
    } else {
        println!("chaos: every scenario met its expectations");
        ExitCode::SUCCESS
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use craig_chaos::runner::ScenarioResult;
    use std::path::Path;

    #[test]
    fn derived_seeds_start_at_the_run_seed_and_differ() {
        assert_eq!(derived_seed(20261130, 0), 20261130, "seed 1 of N is CI's seed");
        let seeds: std::collections::BTreeSet<u64> = (0..20).map(|k| derived_seed(20261130, k)).collect();
        assert_eq!(seeds.len(), 20, "20 distinct seeds");
        assert_eq!(derived_seed(7, 3), derived_seed(7, 3), "reproducible");
    }

    fn result(name: &str, passed: bool, inconclusive: bool) -> ScenarioResult {
        ScenarioResult {
            name: name.into(),
            amendment: "x".into(),
            compat: "current".into(),
            seed: 0,
            backend: "local".into(),
            faults: vec![],
            invariants: vec![],
            passed,
            inconclusive,
            duration_ms: 1500,
            error: None,
            metrics: Default::default(),
            history: Default::default(),
        }
    }

    /// Per scenario across seeds: how many met, the total time, and for every other seed
    /// the word (NOT met / inconclusive) and the command that reproduces it.
    #[test]
    fn the_seeds_summary_counts_per_scenario_and_names_each_failing_seed() {
        let scenario = |name: &str| {
            let mut s = craig_chaos::scenario::parse(
                Path::new(&format!("scenarios/{name}.toml")),
                &format!("name = \"{name}\"\namendment = \"x\"\n[fleet]\ncases = {{}}\n[workload]\nwrites = 4\nrate = 10\n[expect]\nno_loss = \"hold\"\n"),
            )
            .unwrap();
            s.path = format!("scenarios/{name}.toml").into();
            s
        };
        let scenarios = [scenario("a"), scenario("b")];
        // Two seeds, two scenarios each: a meets both; b fails under the second, inconclusive under the first.
        let results = [result("a", true, false), result("b", false, true), result("a", true, false), result("b", false, false)];
        let per_seed = [(11, 0), (22, 2)];
        let out = seeds_summary(&scenarios, &results, &per_seed, BackendKind::Local, 11);
        assert!(out.starts_with("seeds: 2 derived from --seed 11\n"), "{out}");
        assert!(out.contains("a                            2/2 seeds met  (3 s)"), "{out}");
        assert!(out.contains("b                            0/2 seeds met  (3 s)"), "{out}");
        assert!(out.contains("inconclusive under --seed 11: cargo run --profile ci -p craig-chaos -- run scenarios/b.toml --seed 11 --backend local"), "{out}");
        assert!(out.contains("NOT met under --seed 22: cargo run --profile ci -p craig-chaos -- run scenarios/b.toml --seed 22 --backend local"), "{out}");
        assert!(!out.contains("scenarios/a.toml"), "a seed that met needs no reproduce command: {out}");
    }
}
