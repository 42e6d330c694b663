//! `crash` and `mutant`: armed in the replicas through `FAILPOINTS` before they start, not
//! injected. The watcher ([`super::Schedule`]) records each crash and restarts the replica;
//! a mutant is in force for the whole run, its evidence the node's own `failpoint.mutant`
//! lines, read at the end.

use std::path::Path;

use super::super::Log;
use crate::history::Phase;
use crate::scenario::{FaultKind, Scenario, Trigger};

/// Replica `name`'s `FAILPOINTS`: its crash points (abort at hit N), its mutants (on from
/// the start) and its rollout markers (`failpoint.hit` once, at hit N); None without any.
pub(in crate::runner) fn failpoints_for(s: &Scenario, name: &str) -> Option<String> {
    let fps: Vec<String> = s
        .faults
        .iter()
        .map(|f| f.get_ref())
        .filter(|f| f.target == name)
        .filter_map(|f| match (f.kind, f.failpoint.as_deref(), f.at) {
            (FaultKind::Crash, Some(fp), Trigger::FailpointHit(n)) if n > 1 => Some(format!("{fp}={}*off->return(abort)", n - 1)),
            (FaultKind::Crash, Some(fp), _) => Some(format!("{fp}=return(abort)")),
            (FaultKind::Mutant, Some(fp), _) => Some(format!("{fp}=return(on)")),
            // A marker only: the node logs `failpoint.hit` once, at hit N.
            (FaultKind::Upgrade | FaultKind::Downgrade, Some(fp), Trigger::FailpointHit(n)) => Some(format!("{fp}={}*off->1*return(hit)->off", n - 1)),
            _ => None,
        })
        .collect();
    (!fps.is_empty()).then(|| fps.join(";"))
}

/// The scenario's mutants, (replica, mutant), recorded as in force from the start.
pub(in crate::runner) fn mutants_in_force(s: &Scenario, log: &Log) -> Vec<(String, String)> {
    let mutants: Vec<(String, String)> = s
        .faults
        .iter()
        .map(|f| f.get_ref())
        .filter(|f| f.kind == FaultKind::Mutant)
        .map(|f| (f.target.clone(), f.failpoint.clone().unwrap_or_default()))
        .collect();
    for (target, _) in &mutants {
        log.fault("mutant", target, Phase::Start);
    }
    mutants
}

/// Each mutant's end and evidence: the `failpoint.mutant` lines in its replica's log.
pub(in crate::runner) fn mutant_evidence(log: &Log, logs_dir: &Path, mutants: &[(String, String)]) {
    for (target, fp) in mutants {
        let text = std::fs::read_to_string(logs_dir.join(format!("{target}.log"))).unwrap_or_default();
        let fired = text.lines().filter(|l| l.contains("event=\"failpoint.mutant\"") && l.contains(&format!("failpoint=\"{fp}\""))).count();
        log.fault("mutant", target, Phase::End);
        log.evidence("mutant", target, (fired > 0).then(|| format!("{fp} changed behaviour {fired} time(s) (failpoint.mutant)")));
    }
}
