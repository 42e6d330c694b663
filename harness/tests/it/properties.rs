//! Property-based invariant runs: proptest generates workloads and fault schedules, each
//! case runs on the real servers (the `external` backend: a fresh database per service and
//! a fresh vhost per case) with real replica processes, and the same checkers must hold.
//! Failures shrink and persist under `fixtures/proptest-regressions/`.
//!
//! `PROPTEST_CASES` sets the number of cases (default 2: a smoke run for CI).

use std::time::Duration;

use craig_chaos::backend::BackendKind;
use craig_chaos::process::NodeProgram;
use craig_chaos::runner::{RunOptions, run_scenario};
use proptest::prelude::*;
use proptest::test_runner::{Config, FileFailurePersistence, TestRunner};

#[derive(Debug, Clone)]
enum FaultGen {
    Down { replica: &'static str, at: u64, dur: u64 },
    Latency { at: u64, dur: u64, ms: u64 },
    Reset { replica: &'static str, at: u64, dur: u64 },
    ProducerCrash { hit: u32 },
    ConsumerCrash { hit: u32 },
}

impl FaultGen {
    fn toml(&self) -> String {
        match self {
            FaultGen::Down { replica, at, dur } => format!(
                "[[faults]]\nkind = \"down\"\ntarget = \"{replica}->broker\"\nat = {{ after_ms = {at} }}\nduration_ms = {dur}\n"
            ),
            FaultGen::Latency { at, dur, ms } => format!(
                "[[faults]]\nkind = \"toxic\"\ntarget = \"cases-1->broker\"\nat = {{ after_ms = {at} }}\nduration_ms = {dur}\n\
                 toxic = {{ type = \"latency\", stream = \"downstream\", attributes = {{ latency = {ms} }} }}\n"
            ),
            FaultGen::Reset { replica, at, dur } => format!(
                "[[faults]]\nkind = \"toxic\"\ntarget = \"{replica}->broker\"\nat = {{ after_ms = {at} }}\nduration_ms = {dur}\n\
                 toxic = {{ type = \"reset_peer\", stream = \"upstream\", attributes = {{ timeout = 50 }} }}\n"
            ),
            FaultGen::ProducerCrash { hit } => format!(
                "[[faults]]\nkind = \"crash\"\ntarget = \"cases-1\"\nfailpoint = \"outbox::after_publish_before_stamp\"\n\
                 at = {{ failpoint_hit = {hit} }}\nrestart_after_ms = 200\n"
            ),
            FaultGen::ConsumerCrash { hit } => format!(
                "[[faults]]\nkind = \"crash\"\ntarget = \"rules-1\"\nfailpoint = \"inbox::after_handler_before_stamp\"\n\
                 at = {{ failpoint_hit = {hit} }}\nrestart_after_ms = 200\n"
            ),
        }
    }

    fn target(&self) -> &'static str {
        match self {
            FaultGen::ProducerCrash { .. } => "cases-1",
            FaultGen::ConsumerCrash { .. } => "rules-1",
            _ => "",
        }
    }
}

fn fault() -> impl Strategy<Value = FaultGen> {
    let replica = prop_oneof![Just("cases-1"), Just("rules-1")];
    prop_oneof![
        (replica.clone(), 0u64..800, 200u64..1500).prop_map(|(replica, at, dur)| FaultGen::Down { replica, at, dur }),
        (0u64..800, 200u64..1500, 20u64..300).prop_map(|(at, dur, ms)| FaultGen::Latency { at, dur, ms }),
        (replica, 0u64..800, 200u64..1200).prop_map(|(replica, at, dur)| FaultGen::Reset { replica, at, dur }),
        // Hits every generated workload reaches (>= 20 writes, >= 2 drain passes): a crash
        // point that never fires makes the run inconclusive, and the case is rejected below.
        (1u32..3).prop_map(|hit| FaultGen::ProducerCrash { hit }),
        (1u32..12).prop_map(|hit| FaultGen::ConsumerCrash { hit }),
    ]
}

fn scenario_text(writes: u32, rate: u32, rollback: f64, faults: &[FaultGen]) -> String {
    let mut t = format!(
        "name = \"prop\"\namendment = \"property\"\n\n[deploy]\ntopology = true\n\n[fleet]\ncases = {{ replicas = 1 }}\nrules = {{ replicas = 1 }}\n\n\
         [workload]\nwrites = {writes}\nrate = {rate}\nrollback_share = {rollback}\n\n"
    );
    // At most one crash point per replica (FAILPOINTS arms one schedule per name).
    let mut crashed: Vec<&str> = Vec::new();
    for f in faults {
        let target = f.target();
        if !target.is_empty() {
            if crashed.contains(&target) {
                continue;
            }
            crashed.push(target);
        }
        t.push_str(&f.toml());
        t.push('\n');
    }
    t.push_str("[expect]\nno_loss = \"hold\"\nno_phantom = \"hold\"\neffect_once = \"hold\"\nliveness = \"hold\"\n");
    t
}

#[test]
fn invariants_hold_under_generated_fault_schedules() {
    let cases = std::env::var("PROPTEST_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(2);
    let config = Config {
        cases,
        max_shrink_iters: 8,
        failure_persistence: Some(Box::new(FileFailurePersistence::Direct(
            "../fixtures/proptest-regressions/chaos-properties.txt",
        ))),
        ..Config::default()
    };
    let rt = tokio::runtime::Runtime::new().unwrap();
    let report = std::env::temp_dir().join(format!("chaos-prop-{}", std::process::id()));
    let mut runner = TestRunner::new(config);
    let strategy = (20u32..80, 50u32..200, 0.0f64..0.2, proptest::collection::vec(fault(), 0..3));
    let result = runner.run(&strategy, |(writes, rate, rollback, faults)| {
        let text = scenario_text(writes, rate, (rollback * 100.0).round() / 100.0, &faults);
        let s = craig_chaos::scenario::parse(std::path::Path::new("generated.toml"), &text)
            .map_err(|e| TestCaseError::fail(format!("generated a bad scenario: {e}\n{text}")))?;
        let opts = RunOptions {
            backend: BackendKind::External,
            node_program: NodeProgram::harness(env!("CARGO_BIN_EXE_chaos")),
            report_dir: report.clone(),
            progress: false,
        };
        let r = rt.block_on(async { tokio::time::timeout(Duration::from_secs(120), run_scenario(&s, &opts, 42)).await })
            .map_err(|_| TestCaseError::fail(format!("case did not finish in 120 s:\n{text}")))?;
        if let Some(e) = &r.error {
            // A schedule whose fault had nothing to act on (a crash point never reached, a
            // link cut before any connection, a toxic on an idle link) tested nothing:
            // generate another. Any other reason (a replica that exited on its own, say)
            // fails the case.
            let untaken = e.split("; ").all(|part| part.contains("never fired") || part.contains("no evidence it took effect"));
            if untaken {
                return Err(TestCaseError::reject(format!("{e}\n{text}")));
            }
            return Err(TestCaseError::fail(format!("run error: {e}\n{text}")));
        }
        for i in &r.invariants {
            prop_assert_eq!(i.observed.as_deref(), Some("held"), "{} {:?} {:?}\n{}", i.name, i.counts, i.witnesses, text);
        }
        Ok(())
    });
    let _ = std::fs::remove_dir_all(&report);
    if let Err(e) = result {
        panic!("{e}");
    }
}
