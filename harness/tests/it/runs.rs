//! Runner behaviour on real servers that no literal history can show (issue 22.1).

use std::time::Duration;

use craig_chaos::backend::BackendKind;
use craig_chaos::runner::{RunOptions, run_scenario};
use craig_chaos::process::NodeProgram;

/// The tap on `craig.dlx` is bound in every run, not only where dead letters are staged or
/// a DLQ checker is listed: `mutant-absorb-dead-letters` without its `dlq_occurrence_once`
/// line stages no dead letter and lists no DLQ checker, and the dead letters its mutant
/// makes (a replay's absorb failing into the app path) still turn the run red, through
/// the unlisted checker, for `kind:unexpected_dead_letter`.
///
/// On the local backend's private servers: on the shared PostgreSQL (external backend), this
/// run's fleet and harness pools took most of its 100 connections, and a test beside it
/// could not create its sandbox (`too many clients already`; seen in mutation shard 5, where
/// that failure was counted as catching 10 mutants).
#[test]
fn the_dead_letter_tap_is_bound_where_no_scenario_line_asks_for_it() {
    let shipped = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../scenarios/mutant-absorb-dead-letters.toml")).unwrap();
    let text: String = shipped.lines().filter(|l| !l.starts_with("dlq_occurrence_once")).map(|l| format!("{l}\n")).collect();
    assert_ne!(text.lines().count(), shipped.lines().count(), "the shipped scenario lists dlq_occurrence_once");
    let s = craig_chaos::scenario::parse(std::path::Path::new("unlisted.toml"), &text).expect("parses");
    assert!(!s.expect.keys().any(|k| k.starts_with("dlq") || k.starts_with("threshold")), "{:?}", s.expect.keys());
    let report = std::env::temp_dir().join(format!("chaos-tap-{}", std::process::id()));
    let opts = RunOptions {
        backend: BackendKind::Local,
        node_program: NodeProgram::harness(env!("CARGO_BIN_EXE_chaos")),
        report_dir: report.clone(),
        progress: false,
    };
    let rt = tokio::runtime::Runtime::new().unwrap();
    let r = rt.block_on(async { tokio::time::timeout(Duration::from_secs(180), run_scenario(&s, &opts, 20261130)).await }).expect("finishes");
    let _ = std::fs::remove_dir_all(&report);
    assert_eq!(r.error, None, "{r:?}");
    let dlq = r.invariants.iter().find(|i| i.name == "dlq_occurrence_once").expect("judged though unlisted");
    assert_eq!((dlq.listed, dlq.observed.as_deref()), (false, Some("violated")), "{dlq:?}");
    assert!(dlq.culprits.get("kind:unexpected_dead_letter").copied().unwrap_or(0) > 0, "{:?}", dlq.culprits);
    assert!(!r.passed, "an unlisted checker that comes out violated fails the run");
}
