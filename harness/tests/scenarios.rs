//! Every shipped scenario as a test (issue 23): `scenario::<name>` for each file under
//! `scenarios/`, run through the same runner as `chaos run` (`runner::run_scenario`), so
//! nextest's filters, test groups, JUnit, partitions and archives apply to them.
//!
//! - `CHAOS_SEED` (default 20261130, `ci/test`'s): the run seed, as `chaos run --seed`.
//! - `CHAOS_SEEDS=N`: each scenario becomes N tests, `scenario::<name>::seed-<k>` (k = 1..N),
//!   under the run seeds `chaos run --seeds N` derives (seed-1 is `CHAOS_SEED` itself).
//! - `CHAOS_BACKEND`: auto (default), local, external or containers.
//! - `CHAOS_SCENARIOS`: another folder (or file) of scenarios.
//!
//! - The containers backend (issue 24): where a Docker engine answers, its images are set up
//!   (`CHAOS_TOXIPROXY_IMAGE`, which `ci/images/build` prints: a link fault needs our
//!   Toxiproxy-API server's counters) and `CHAOS_BACKEND` is not `containers` already,
//!   [`CONTAINERS_SUBSET`] runs on it too, as `containers::<name>` (one scenario per fault
//!   kind, and twins); otherwise those tests are listed and ignored, so a run says the
//!   backend went untested.
//!
//! A test passes when the scenario met every expectation; it fails with the verdict lines,
//! the unmet invariants' counts and witnesses, the report folder and the commands that
//! reproduce it. An inconclusive run fails too (`chaos run` exits 3 for it). A scenario file
//! that does not parse is a failing test named after its file, with file, line and reason.

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use craig_chaos::backend::BackendKind;
use craig_chaos::process::NodeProgram;
use craig_chaos::report::RunReport;
use craig_chaos::runner::{RunOptions, derived_seed, run_scenario, scenario_seed};
use craig_chaos::scenario::{self, Scenario};
use libtest_mimic::{Arguments, Failed, Trial};

/// The scenarios that also run on the containers backend: one per fault kind (a server
/// killed, a toxic, a link down, a queue limit, backends terminated, a crash point, a mutant
/// with refused staging, a rollout, a server partitioned off the run's network, a server
/// paused, exports under a partitioned database) and the twins `pre-1128-black-hole`,
/// `rolling-upgrade-1128` and `pre-1128-broker-partition` (red on a real network partition).
/// Not the database failover (issue 26): run beside the local scenarios it was starved
/// (`pool timed out`) and starved `failover-sync-pays-once` below its floor; it is measured
/// by hand (README).
const CONTAINERS_SUBSET: &[&str] = &[
    "broker-kill",
    "database-restart",
    "lost-confirm",
    "consumer-ack-failure",
    "pre-1128-black-hole",
    "broker-nacks",
    "dead-letters-audit-db-down",
    "outbox-notify-listener-lost",
    "crash-claim-stamp",
    "mutant-stage-after-commit",
    "rolling-upgrade-1128",
    "broker-partition",
    "pre-1128-broker-partition",
    "exports-database-partition",
    "database-pause",
];

/// Whether a Docker engine answers on its socket (`DOCKER_HOST` as unix://, else the
/// default): a connect, no more, so listing the tests stays instant.
fn docker_answers() -> bool {
    let host = std::env::var("DOCKER_HOST").unwrap_or_else(|_| "unix:///var/run/docker.sock".into());
    match host.strip_prefix("unix://") {
        Some(path) => std::os::unix::net::UnixStream::connect(path).is_ok(),
        None => host.strip_prefix("tcp://").is_some_and(|addr| std::net::TcpStream::connect(addr).is_ok()),
    }
}

/// `ci/test`'s run seed.
const DEFAULT_SEED: u64 = 20261130;

/// The workspace root: nextest sets `CARGO_MANIFEST_DIR` at run time (remapped when the
/// tests run from an archive on another machine), cargo's compile-time value otherwise.
fn workspace() -> PathBuf {
    let manifest = std::env::var_os("CARGO_MANIFEST_DIR").map(PathBuf::from).unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")));
    manifest.parent().map(Path::to_path_buf).unwrap_or(manifest)
}

/// The harness binary the replicas run as (`chaos craig-node …`): nextest's
/// `NEXTEST_BIN_EXE_chaos` (remapped with an archive), else cargo's.
fn chaos_binary() -> PathBuf {
    std::env::var_os("NEXTEST_BIN_EXE_chaos").map(PathBuf::from).unwrap_or_else(|| PathBuf::from(env!("CARGO_BIN_EXE_chaos")))
}

#[derive(Debug)]
struct Settings {
    seed: u64,
    seeds: u32,
    backend: BackendKind,
}

fn settings() -> Result<Settings, String> {
    let var = |name: &str| std::env::var(name).ok().filter(|v| !v.trim().is_empty());
    let seed = match var("CHAOS_SEED") {
        Some(v) => v.trim().parse::<u64>().map_err(|e| format!("CHAOS_SEED={v:?}: not a seed (an unsigned 64-bit integer): {e}"))?,
        None => DEFAULT_SEED,
    };
    let seeds = match var("CHAOS_SEEDS") {
        Some(v) => match v.trim().parse::<u32>() {
            Ok(n @ 1..=1000) => n,
            _ => return Err(format!("CHAOS_SEEDS={v:?}: expected a count from 1 to 1000")),
        },
        None => 1,
    };
    let backend = match var("CHAOS_BACKEND") {
        Some(v) => v.trim().parse::<BackendKind>().map_err(|e| format!("CHAOS_BACKEND={v:?}: {e}"))?,
        None => BackendKind::Auto,
    };
    Ok(Settings { seed, seeds, backend })
}

fn main() -> ExitCode {
    let args = Arguments::from_args();
    let settings = match settings() {
        Ok(s) => s,
        Err(e) => {
            eprintln!("scenarios: {e}");
            return ExitCode::from(2);
        }
    };
    let root = std::env::var_os("CHAOS_SCENARIOS").map(PathBuf::from).unwrap_or_else(|| workspace().join("scenarios"));
    let files = match scenario::discover(std::slice::from_ref(&root)) {
        Ok(f) => f,
        Err(e) => {
            eprintln!("scenarios: {e}");
            return ExitCode::from(2);
        }
    };
    let mut trials = Vec::new();
    let docker = Docker::default();
    for file in files {
        let parsed = std::fs::read_to_string(&file)
            .map_err(|e| format!("{}: {e}", file.display()))
            .and_then(|text| scenario::parse(&file, &text).map_err(|e| e.to_string()));
        match parsed {
            Ok(s) => {
                for k in 0..settings.seeds {
                    let run_seed = derived_seed(settings.seed, k);
                    let name = if settings.seeds > 1 { format!("scenario::{}::seed-{}", s.name, k + 1) } else { format!("scenario::{}", s.name) };
                    let s = s.clone();
                    let backend = settings.backend;
                    let seeds = settings.seeds;
                    trials.push(Trial::test(name.clone(), move || run_one(&name, &s, run_seed, seeds, backend)));
                }
                if settings.backend != BackendKind::Containers && CONTAINERS_SUBSET.contains(&s.name.as_str()) {
                    let name = format!("containers::{}", s.name);
                    let run_seed = settings.seed;
                    let s = s.clone();
                    trials.push(
                        Trial::test(name.clone(), move || run_one(&name, &s, run_seed, 1, BackendKind::Containers)).with_ignored_flag(!docker.answers()),
                    );
                }
            }
            Err(e) => {
                // A file that does not parse is a red test, never a silently shorter list.
                let stem = file.file_stem().map(|s| s.to_string_lossy().into_owned()).unwrap_or_default();
                trials.push(Trial::test(format!("scenario::{stem}"), move || Err(Failed::from(format!("scenario file error: {e}")))));
            }
        }
    }
    // A subset name that matches no shipped scenario is a red test, never a shorter subset.
    if std::env::var_os("CHAOS_SCENARIOS").is_none() && settings.backend != BackendKind::Containers {
        for name in CONTAINERS_SUBSET {
            let test = format!("containers::{name}");
            if !trials.iter().any(|t| t.name() == test) {
                trials.push(Trial::test(test, move || Err(Failed::from(format!("CONTAINERS_SUBSET names {name}, which no file under scenarios/ is")))));
            }
        }
    }
    libtest_mimic::run(&args, trials).exit_code()
}

/// [`docker_answers`], asked once.
#[derive(Default)]
struct Docker(std::cell::OnceCell<bool>);

impl Docker {
    /// An engine answers, and the images are set up (`CHAOS_TOXIPROXY_IMAGE`).
    fn answers(&self) -> bool {
        *self.0.get_or_init(|| std::env::var_os("CHAOS_TOXIPROXY_IMAGE").is_some() && docker_answers())
    }
}

fn run_one(test: &str, s: &Scenario, run_seed: u64, seeds: u32, backend: BackendKind) -> Result<(), Failed> {
    let slug: String = test.chars().map(|c| if c.is_ascii_alphanumeric() || c == '-' { c } else { '_' }).collect();
    let report_dir = workspace().join("target/chaos/tests").join(format!("{slug}-{run_seed}"));
    let opts = RunOptions {
        backend,
        node_program: NodeProgram::harness(chaos_binary()),
        report_dir: report_dir.clone(),
        progress: std::env::var_os("CHAOS_PROGRESS").is_some(),
    };
    let rt = tokio::runtime::Runtime::new().map_err(|e| format!("tokio runtime: {e}"))?;
    let sseed = scenario_seed(run_seed, s);
    let result = rt.block_on(async {
        let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()).map_err(|e| format!("SIGTERM handler: {e}"))?;
        // nextest ends a test that outlives its slow-timeout with SIGTERM: dropping the run
        // stops its servers and replicas and removes their temp dirs before the process ends.
        tokio::select! {
            r = run_scenario(s, &opts, sseed) => Ok(r),
            _ = tokio::signal::ctrl_c() => Err("interrupted; servers and replicas stopped, temp dirs removed".to_owned()),
            _ = term.recv() => Err("terminated (a timeout?); servers and replicas stopped, temp dirs removed".to_owned()),
        }
    })?;
    let backend_used = if result.backend.is_empty() { backend.name().to_owned() } else { result.backend.clone() };
    let file = s.path.strip_prefix(workspace()).unwrap_or(&s.path).display().to_string();
    let chaos = format!("cargo run --profile ci -p craig-chaos -- run {file} --seed {run_seed} --backend {backend_used}");
    let mut seed_env = if seeds > 1 || run_seed != DEFAULT_SEED { format!("CHAOS_SEED={run_seed} ") } else { String::new() };
    if let Some(dir) = std::env::var_os("CHAOS_SCENARIOS") {
        seed_env.push_str(&format!("CHAOS_SCENARIOS={} ", Path::new(&dir).display()));
    }
    let exact = if seeds > 1 { format!("scenario::{}", s.name) } else { test.to_owned() };
    // A containers:: test is its own name on any backend setting.
    let backend_env = if test.starts_with("containers::") { String::new() } else { format!("CHAOS_BACKEND={backend_used} ") };
    let nextest = format!(
        "{seed_env}{backend_env}cargo nextest run --cargo-profile ci --workspace --features craig-fleet/failpoints -E 'binary(scenarios) and test(={exact})'"
    );
    let results = std::slice::from_ref(&result);
    let rep = RunReport { run_id: test, seed: run_seed, backend: &backend_used, command: &chaos, results };
    let wrote = rep.write(&report_dir);
    let word = if result.passed { "met" } else if result.inconclusive { "INCONCLUSIVE" } else { "NOT MET" };
    let mut out = format!(
        "{} ({}, compat {}) seed {sseed} (run seed {run_seed}), backend {backend_used}: {word} in {:.1} s\n\n{}",
        s.name,
        s.amendment,
        s.compat_summary(),
        result.duration_ms as f64 / 1000.0,
        rep.table()
    );
    if let Some(e) = &result.error {
        out.push_str(&format!("\nerror: {e}\n"));
    }
    for inv in result.invariants.iter().filter(|i| !i.met()) {
        let counts: Vec<String> = inv.counts.iter().map(|(k, v)| format!("{k}={v}")).collect();
        out.push_str(&format!(
            "\n{} expected {:?}, observed {}: {}\n",
            inv.name,
            inv.expected,
            inv.observed.as_deref().unwrap_or("undecided"),
            counts.join(", ")
        ));
        if let Some(e) = &inv.error {
            out.push_str(&format!("  why: {e}\n"));
        }
        for w in inv.witnesses.iter().take(10) {
            out.push_str(&format!("  - {w}\n"));
        }
        if inv.witnesses.len() > 10 {
            out.push_str(&format!("  … {} more in the report\n", inv.witnesses.len() - 10));
        }
    }
    match wrote {
        Ok(()) => out.push_str(&format!("\nreport: {}/report.md\n", report_dir.display())),
        Err(e) => out.push_str(&format!("\nreport: could not be written to {}: {e}\n", report_dir.display())),
    }
    out.push_str(&format!("reproduce: {chaos}\n       or: {nextest}\n"));
    if result.passed {
        println!("{out}");
        Ok(())
    } else {
        Err(Failed::from(out))
    }
}
