//! The run's clock and record: one time base (0 = the workload's start) for every event,
//! the history, the faults with their evidence, and findings (what went wrong outside the
//! schedule).

use std::sync::Arc;
use std::time::Duration;

use sqlx::PgPool;
use tokio::time::Instant;

use super::FaultRecord;
use crate::history::{Event, History, Phase};

/// Shared clock and history of one run. Time 0 is the start of the workload (set by
/// [`Log::rebase`] once the servers and replicas are up); set-up happens "before" 0.
#[derive(Clone)]
pub(super) struct Log {
    origin: Arc<std::sync::Mutex<(Instant, i64)>>,
    /// Database clock minus harness wall clock, ms, measured at [`Log::rebase`]: every DB
    /// timestamp is converted with it ([`Log::rel_db`]), so the checkers compare one clock.
    db_offset_ms: Arc<std::sync::atomic::AtomicI64>,
    pub(super) history: Arc<std::sync::Mutex<History>>,
    pub(super) faults: Arc<std::sync::Mutex<Vec<FaultRecord>>>,
    /// Things that went wrong outside the schedule (a replica exiting on its own, a restart
    /// that failed): each makes the scenario inconclusive, with the reason.
    pub(super) findings: Arc<std::sync::Mutex<Vec<String>>>,
}

impl Log {
    pub(super) fn new() -> Self {
        Self {
            origin: Arc::new(std::sync::Mutex::new((Instant::now(), chrono::Utc::now().timestamp_millis()))),
            db_offset_ms: Arc::default(),
            history: Arc::default(),
            faults: Arc::default(),
            findings: Arc::default(),
        }
    }
    /// Start the run's clock now. Whatever was recorded before (the partner answering a
    /// replica that began its send backlog while the next one was still starting) happened
    /// at the start, as [`Log::rel`] clamps a replica's earlier log lines: re-expressed on
    /// the new clock, at 0, never seconds into the run under the backend's start-up time.
    pub(super) fn rebase(&self) {
        let shift = {
            let mut origin = self.origin.lock().unwrap();
            let shift = origin.0.elapsed().as_millis() as u64;
            *origin = (Instant::now(), chrono::Utc::now().timestamp_millis());
            shift
        };
        for e in self.history.lock().unwrap().entries.iter_mut() {
            e.t_ms = e.t_ms.saturating_sub(shift);
        }
        for f in self.faults.lock().unwrap().iter_mut() {
            f.at_ms = f.at_ms.saturating_sub(shift);
        }
    }
    pub(super) fn started(&self) -> Instant {
        self.origin.lock().unwrap().0
    }
    pub(super) fn now(&self) -> u64 {
        self.started().elapsed().as_millis() as u64
    }
    pub(super) fn push(&self, event: Event) {
        let t = self.now();
        self.history.lock().unwrap().push(t, event);
    }
    pub(super) fn push_at(&self, t: u64, event: Event) {
        self.history.lock().unwrap().push(t, event);
    }
    pub(super) fn finding(&self, what: String) {
        self.findings.lock().unwrap().push(format!("{what} @{}ms", self.now()));
    }
    pub(super) fn fault(&self, kind: &str, target: &str, phase: Phase) {
        if phase == Phase::Start {
            self.faults.lock().unwrap().push(FaultRecord { kind: kind.into(), target: target.into(), at_ms: self.now(), evidence: None });
        }
        self.push(Event::Fault { kind: kind.into(), target: target.into(), phase });
    }
    /// Record what shows the fault `kind` on `target` took effect; `None`: it did not,
    /// which is a finding (the run proves nothing about a fault that never happened).
    pub(super) fn evidence(&self, kind: &str, target: &str, evidence: Option<String>) {
        if let Some(r) = self.faults.lock().unwrap().iter_mut().rev().find(|r| r.kind == kind && r.target == target) {
            r.evidence = evidence.clone();
        }
        if evidence.is_none() {
            self.finding(format!("{kind} {target}: no evidence it took effect"));
        }
    }
    /// A harness wall-clock time (epoch ms) as run time (clamped at 0).
    pub(super) fn rel(&self, epoch_ms: i64) -> u64 {
        (epoch_ms - self.origin.lock().unwrap().1).max(0) as u64
    }
    /// A database timestamp (epoch ms, the DB's clock) as run time.
    pub(super) fn rel_db(&self, db_epoch_ms: i64) -> u64 {
        self.rel(db_epoch_ms - self.db_offset_ms.load(std::sync::atomic::Ordering::Relaxed))
    }
    /// Measure the database clock against ours (midpoint of one bounded round trip).
    pub(super) async fn measure_db_clock(&self, pool: &PgPool) {
        let before = chrono::Utc::now().timestamp_millis();
        let db = tokio::time::timeout(
            Duration::from_secs(5),
            sqlx::query_scalar::<_, i64>("SELECT (EXTRACT(EPOCH FROM clock_timestamp()) * 1000)::int8").fetch_one(pool),
        )
        .await;
        let after = chrono::Utc::now().timestamp_millis();
        match db {
            Ok(Ok(db)) => self.db_offset_ms.store(db - (before + after) / 2, std::sync::atomic::Ordering::Relaxed),
            // Without the offset, database times are compared as if both clocks agreed.
            Ok(Err(e)) => self.finding(format!("cannot measure the database clock ({e}); its times are compared unconverted")),
            Err(_) => self.finding("cannot measure the database clock (no answer within 5 s); its times are compared unconverted".into()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Found by a fresh-clone CI run of send-jobs-flaky-partner: the partner recorded
    /// financial-1's first POSTs before the clock started, stamped with the backend's
    /// start-up time (10 s), so the fencing checker saw them POSTed again 10 s later, while
    /// another replica's claim was live. An event recorded before the clock starts is at 0.
    #[test]
    fn what_was_recorded_before_the_clock_started_happened_at_the_start() {
        let log = Log::new();
        std::thread::sleep(Duration::from_millis(50));
        log.push(Event::Healed);
        log.fault("kill", "broker", Phase::Start);
        log.rebase();
        std::thread::sleep(Duration::from_millis(20));
        log.push(Event::Healed);
        let h = log.history.lock().unwrap().clone();
        assert_eq!(h.entries[0].t_ms, 0, "{h:?}");
        assert_eq!(h.entries[1].t_ms, 0, "{h:?}");
        assert!(h.entries[2].t_ms >= 20, "{h:?}");
        assert_eq!(log.faults.lock().unwrap()[0].at_ms, 0);
    }

    /// A fault with no evidence it took effect is a finding (which makes the run
    /// inconclusive); one with evidence is recorded with it.
    #[test]
    fn a_fault_without_evidence_is_a_finding_and_one_with_evidence_is_recorded() {
        let log = Log::new();
        log.fault("kill", "broker", Phase::Start);
        log.evidence("kill", "broker", Some("pid 7 (and its process group) died".into()));
        log.fault("toxic", "cases-1->broker (timeout upstream)", Phase::Start);
        log.evidence("toxic", "cases-1->broker (timeout upstream)", None);
        let faults = log.faults.lock().unwrap().clone();
        assert_eq!(faults[0].evidence.as_deref(), Some("pid 7 (and its process group) died"));
        assert_eq!(faults[1].evidence, None);
        let findings = log.findings.lock().unwrap().clone();
        assert_eq!(findings.len(), 1, "{findings:?}");
        assert!(findings[0].starts_with("toxic cases-1->broker (timeout upstream): no evidence it took effect @"), "{findings:?}");
    }
}
