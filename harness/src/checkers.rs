//! Invariant checkers: pure functions of a [`History`], in the shape of Jepsen's
//! `total-queue` — each returns a [`Verdict`] with a validity, counts and at most ten
//! witnesses. No I/O, no clock, no runtime. [`check_all`] runs them; a checker that panics
//! yields `unknown` with the panic message instead of taking the run down.
//!
//! | checker | violated when |
//! |---|---|
//! | `no_loss` | an acknowledged write's event never produced its effect |
//! | `no_phantom` | an effect exists for a write that failed, was rolled back, or was never attempted |
//! | `effect_once` | an envelope's effect ran twice and no consumer crash or consumer-database fault sits between the two runs (#1180 attribution) |
//! | `liveness` | the outbox did not drain within the bound after faults healed, or a row stayed claimed past its lease |

use std::collections::{BTreeMap, HashMap, HashSet};

use serde::{Deserialize, Serialize};
use uuid::Uuid;

use crate::history::{Event, History, Outcome, Phase};

pub const MAX_WITNESSES: usize = 10;

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Validity {
    Valid,
    Unknown,
    Invalid,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Verdict {
    pub name: String,
    pub validity: Validity,
    pub counts: BTreeMap<String, u64>,
    pub witnesses: Vec<String>,
    pub error: Option<String>,
}

impl Verdict {
    fn new(name: &str) -> Self {
        Self { name: name.into(), validity: Validity::Valid, counts: BTreeMap::new(), witnesses: vec![], error: None }
    }

    fn count(&mut self, key: &str, n: usize) {
        self.counts.insert(key.into(), n as u64);
    }

    fn witness(&mut self, w: String) {
        if self.witnesses.len() < MAX_WITNESSES {
            self.witnesses.push(w);
        }
    }
}

pub const INVARIANTS: &[&str] = &["no_loss", "no_phantom", "effect_once", "liveness"];

/// Run one checker by name (None: no such checker).
pub fn check(name: &str, h: &History) -> Option<Verdict> {
    let f: fn(&History) -> Verdict = match name {
        "no_loss" => no_loss,
        "no_phantom" => no_phantom,
        "effect_once" => effect_once,
        "liveness" => liveness,
        _ => return None,
    };
    Some(match std::panic::catch_unwind(|| f(h)) {
        Ok(v) => v,
        Err(panic) => {
            let msg = panic
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
                .unwrap_or_else(|| "checker panicked".into());
            Verdict { error: Some(msg), validity: Validity::Unknown, ..Verdict::new(name) }
        }
    })
}

/// Every checker; the worst validity is the run's.
pub fn check_all(h: &History) -> Vec<Verdict> {
    INVARIANTS.iter().filter_map(|n| check(n, h)).collect()
}

struct Effects {
    /// referral → (first effect time)
    by_referral: HashMap<Uuid, u64>,
    /// envelope → effect times in order
    by_envelope: BTreeMap<Uuid, Vec<u64>>,
    total: usize,
}

fn effects(h: &History) -> Effects {
    let mut e = Effects { by_referral: HashMap::new(), by_envelope: BTreeMap::new(), total: 0 };
    for entry in h.iter() {
        if let Event::Effect { envelope, referral, .. } = &entry.event {
            e.total += 1;
            e.by_envelope.entry(*envelope).or_default().push(entry.t_ms);
            if let Some(r) = referral {
                e.by_referral.entry(*r).or_insert(entry.t_ms);
            }
        }
    }
    e
}

/// Every acknowledged write's event reached the consumer (took effect at least once).
/// Unknown-outcome writes that show up are `recovered`, never `lost`.
pub fn no_loss(h: &History) -> Verdict {
    let mut v = Verdict::new("no_loss");
    let fx = effects(h);
    let (mut attempted, mut acknowledged, mut ok, mut lost, mut recovered, mut unknown, mut failed) = (0, 0, 0, 0, 0, 0, 0);
    for entry in h.iter() {
        let Event::Write { referral, outcome, replica, .. } = &entry.event else { continue };
        attempted += 1;
        let delivered = fx.by_referral.contains_key(referral);
        match outcome {
            Outcome::Ok => {
                acknowledged += 1;
                if delivered {
                    ok += 1;
                } else {
                    lost += 1;
                    v.witness(format!(
                        "referral {referral} acknowledged by {replica} @{}ms never took effect; {}",
                        entry.t_ms,
                        h.fault_near(entry.t_ms)
                    ));
                }
            }
            Outcome::Unknown => {
                unknown += 1;
                if delivered {
                    recovered += 1;
                }
            }
            Outcome::Failed => failed += 1,
        }
    }
    for (k, n) in [
        ("attempted", attempted),
        ("acknowledged", acknowledged),
        ("ok", ok),
        ("lost", lost),
        ("recovered", recovered),
        ("unknown", unknown),
        ("failed", failed),
    ] {
        v.count(k, n);
    }
    v.validity = if lost > 0 {
        Validity::Invalid
    } else if acknowledged == 0 {
        v.error = Some("nothing to check: no acknowledged writes".into());
        Validity::Unknown
    } else {
        Validity::Valid
    };
    v
}

/// No effect without a write that may have committed.
pub fn no_phantom(h: &History) -> Verdict {
    let mut v = Verdict::new("no_phantom");
    let fx = effects(h);
    let mut may_exist: HashSet<Uuid> = HashSet::new();
    let mut must_not: HashMap<Uuid, &'static str> = HashMap::new();
    for entry in h.iter() {
        match &entry.event {
            Event::Write { referral, outcome: Outcome::Failed, .. } => {
                must_not.insert(*referral, "failed");
            }
            Event::Write { referral, .. } => {
                may_exist.insert(*referral);
            }
            Event::RolledBack { referral } => {
                must_not.insert(*referral, "rolled back");
            }
            _ => {}
        }
    }
    let mut unexpected = 0;
    let mut referrals: Vec<(&Uuid, &u64)> = fx.by_referral.iter().collect();
    referrals.sort();
    for (referral, t) in referrals {
        let why = match must_not.get(referral) {
            Some(why) => Some(*why),
            None if !may_exist.contains(referral) => Some("never attempted"),
            None => None,
        };
        if let Some(why) = why {
            unexpected += 1;
            v.witness(format!("referral {referral} took effect @{t}ms but was {why}"));
        }
    }
    v.count("effects", fx.total);
    v.count("rolled_back_or_failed", must_not.len());
    v.count("unexpected", unexpected);
    v.validity = if unexpected > 0 {
        Validity::Invalid
    } else if must_not.is_empty() && fx.total == 0 {
        v.error = Some("nothing to check: no effects and no failed or rolled-back writes".into());
        Validity::Unknown
    } else {
        Validity::Valid
    };
    v
}

/// Each envelope's effect at most once — except a re-execution inside the documented #1180
/// window (a consumer crash, or a fault of the consumer's database, between the first and
/// the second run), which is counted as `crash_window_reexecutions` and attributed to that
/// fault, never silently allowed.
pub fn effect_once(h: &History) -> Verdict {
    let mut v = Verdict::new("effect_once");
    let fx = effects(h);
    // What can open the #1180 window (handler committed, stamp not): a consumer process
    // crash, or its database failing between the two commits — the whole server, or the
    // consumer's own link to it.
    let consumers: HashSet<&str> = h
        .iter()
        .filter_map(|e| match &e.event {
            Event::Effect { service, .. } => Some(service.as_str()),
            _ => None,
        })
        .collect();
    let consumer_db_fault = |target: &str| {
        target == "database"
            || target.split_once("->database").is_some_and(|(replica, _)| {
                replica.rsplit_once('-').is_some_and(|(svc, _)| consumers.contains(svc))
            })
    };
    let crashes: Vec<(u64, String)> = h
        .iter()
        .filter_map(|e| match &e.event {
            Event::Crash { replica, consumer: true, how } => Some((e.t_ms, format!("crash {replica} ({how}) @{}ms", e.t_ms))),
            Event::Fault { kind, target, phase: Phase::Start } if consumer_db_fault(target) => {
                Some((e.t_ms, format!("{kind} {target} @{}ms", e.t_ms)))
            }
            _ => None,
        })
        .collect();
    let (mut duplicated, mut attributed, mut unattributed) = (0, 0, 0);
    for (envelope, times) in &fx.by_envelope {
        if times.len() < 2 {
            continue;
        }
        duplicated += 1;
        for pair in times.windows(2) {
            let (t1, t2) = (pair[0], pair[1]);
            match crashes.iter().find(|(tc, _)| *tc >= t1 && *tc <= t2) {
                Some((_, crash)) => {
                    attributed += 1;
                    v.witness(format!("envelope {envelope} re-ran @{t2}ms after {crash} (#1180 window)"));
                }
                None => {
                    unattributed += 1;
                    v.witness(format!(
                        "envelope {envelope} took effect @{t1}ms and again @{t2}ms with no consumer crash between; {}",
                        h.fault_near(t2)
                    ));
                }
            }
        }
    }
    v.count("envelopes", fx.by_envelope.len());
    v.count("effects", fx.total);
    v.count("duplicated", duplicated);
    v.count("crash_window_reexecutions", attributed);
    v.count("unattributed", unattributed);
    v.validity = if unattributed > 0 {
        Validity::Invalid
    } else if fx.total == 0 {
        v.error = Some("nothing to check: no effects".into());
        Validity::Unknown
    } else {
        Validity::Valid
    };
    v
}

/// Everything drains within the bound after faults heal; no row stays claimed past its lease.
///
/// The only rows excused from draining are the poison rows the harness itself wrote
/// (`Event::Poison`), and only while the system corroborates them: each must still be
/// pending (never stamped) and refused by the worker as malformed (`attempts ≥ 1` and
/// `last_error` starting `malformed:`). A poison row the worker never refused as such means
/// the fault did not fire: unknown, not valid.
pub fn liveness(h: &History) -> Verdict {
    let mut v = Verdict::new("liveness");
    let mut drained = None;
    let mut stuck = 0;
    let poison: HashSet<Uuid> =
        h.iter().filter_map(|e| if let Event::Poison { envelope, .. } = &e.event { Some(*envelope) } else { None }).collect();
    let (mut poison_published, mut poison_untouched, mut poison_refusals, mut poison_seen) = (0, 0, 0, 0);
    for e in h.iter() {
        match &e.event {
            Event::Staged { envelope, published, attempts, service, last_error, .. } if poison.contains(envelope) => {
                poison_seen += 1;
                poison_refusals += (*attempts).max(0) as usize;
                let refused = *attempts > 0 && last_error.as_deref().is_some_and(|e| e.starts_with("malformed:"));
                if *published {
                    poison_published += 1;
                    v.witness(format!("{service} poison row {envelope} was stamped published: it can never have been"));
                } else if !refused {
                    poison_untouched += 1;
                    v.witness(format!(
                        "{service} poison row {envelope} was never refused as malformed (attempts {attempts}, last_error {last_error:?}): the fault did not fire"
                    ));
                }
            }
            Event::Drained { after_ms, bound_ms, pending } => drained = Some((*after_ms, *bound_ms, *pending)),
            Event::Stuck { envelope, service, claimed_ms_ago } => {
                stuck += 1;
                v.witness(format!("{service} outbox row {envelope} still claimed {claimed_ms_ago} ms after its claim"));
            }
            _ => {}
        }
    }
    v.count("stuck_claims", stuck);
    if !poison.is_empty() {
        v.count("poison_rows", poison.len());
        v.count("poison_refusals", poison_refusals);
        if poison_seen < poison.len() {
            poison_published += poison.len() - poison_seen;
            v.witness(format!("{} poison rows vanished from the outbox (deleted?)", poison.len() - poison_seen));
        }
    }
    match drained {
        None => {
            v.error = Some("nothing to check: the run recorded no drain measurement".into());
            v.validity = Validity::Unknown;
        }
        Some((after, bound, pending)) => {
            v.count("bound_ms", bound as usize);
            v.count("pending_at_end", pending as usize);
            if let Some(ms) = after {
                v.count("drained_after_ms", ms as usize);
            }
            if after.is_none() {
                v.witness(format!("{pending} outbox rows still pending {bound} ms after the faults healed"));
            }
            v.validity = if after.is_none() || stuck > 0 || poison_published > 0 {
                Validity::Invalid
            } else if poison_untouched > 0 {
                v.error = Some("a poison row was never claimed: the fault did not fire".into());
                Validity::Unknown
            } else {
                Validity::Valid
            };
        }
    }
    v
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::history::Phase;

    fn id(n: u128) -> Uuid {
        Uuid::from_u128(n)
    }

    fn write(h: &mut History, t: u64, n: u128, outcome: Outcome) {
        h.push(t, Event::Write { referral: id(n), replica: "cases-1".into(), outcome, status: None });
    }

    fn effect(h: &mut History, t: u64, env: u128, referral: u128) {
        h.push(t, Event::Effect { envelope: id(env), referral: Some(id(referral)), service: "rules".into() });
    }

    #[test]
    fn no_loss_classifies_ok_lost_and_recovered() {
        let mut h = History::default();
        write(&mut h, 1, 1, Outcome::Ok);
        write(&mut h, 2, 2, Outcome::Ok);
        write(&mut h, 3, 3, Outcome::Unknown);
        write(&mut h, 4, 4, Outcome::Unknown);
        write(&mut h, 5, 5, Outcome::Failed);
        h.push(6, Event::Fault { kind: "down".into(), target: "cases-1->broker".into(), phase: Phase::Start });
        effect(&mut h, 10, 101, 1);
        effect(&mut h, 11, 103, 3);
        let v = no_loss(&h);
        assert_eq!(v.validity, Validity::Invalid);
        let c = |k: &str| v.counts[k];
        assert_eq!(
            (c("attempted"), c("acknowledged"), c("ok"), c("lost"), c("recovered"), c("unknown"), c("failed")),
            (5, 2, 1, 1, 1, 2, 1)
        );
        assert_eq!(v.witnesses.len(), 1);
        assert!(v.witnesses[0].contains(&id(2).to_string()), "{:?}", v.witnesses);
        assert!(v.witnesses[0].ends_with("no fault before it; next fault: down cases-1->broker @6ms"), "{}", v.witnesses[0]);
    }

    #[test]
    fn no_loss_names_the_fault_before_a_loss() {
        let mut h = History::default();
        h.push(1, Event::Fault { kind: "kill".into(), target: "broker".into(), phase: Phase::Start });
        write(&mut h, 2, 1, Outcome::Ok);
        let v = no_loss(&h);
        assert_eq!(v.validity, Validity::Invalid);
        assert!(v.witnesses[0].ends_with("last fault before it: kill broker @1ms"), "{}", v.witnesses[0]);
    }

    #[test]
    fn no_loss_with_nothing_acknowledged_is_unknown_not_valid() {
        let mut h = History::default();
        write(&mut h, 1, 1, Outcome::Unknown);
        assert_eq!(no_loss(&h).validity, Validity::Unknown);
    }

    #[test]
    fn no_phantom_flags_failed_rolled_back_and_unattempted_effects() {
        let mut h = History::default();
        write(&mut h, 1, 1, Outcome::Ok);
        write(&mut h, 2, 2, Outcome::Failed);
        h.push(3, Event::RolledBack { referral: id(3) });
        effect(&mut h, 10, 101, 1);
        let v = no_phantom(&h);
        assert_eq!((v.validity, v.counts["unexpected"]), (Validity::Valid, 0));

        effect(&mut h, 11, 102, 2);
        effect(&mut h, 12, 103, 3);
        effect(&mut h, 13, 109, 9);
        let v = no_phantom(&h);
        assert_eq!((v.validity, v.counts["unexpected"]), (Validity::Invalid, 3));
        let all = v.witnesses.join("\n");
        assert!(all.contains("was failed") && all.contains("was rolled back") && all.contains("was never attempted"), "{all}");
    }

    #[test]
    fn effect_once_attributes_crash_window_reexecutions_and_flags_the_rest() {
        let mut h = History::default();
        effect(&mut h, 10, 101, 1);
        h.push(15, Event::Crash { replica: "rules-1".into(), consumer: true, how: "SIGABRT".into() });
        effect(&mut h, 20, 101, 1); // re-run after the consumer crash: attributed
        effect(&mut h, 30, 102, 2);
        effect(&mut h, 31, 102, 2); // duplicate with no crash between: a violation
        h.push(25, Event::Crash { replica: "cases-1".into(), consumer: false, how: "SIGABRT".into() });
        h.sort();
        let v = effect_once(&h);
        assert_eq!(v.validity, Validity::Invalid);
        assert_eq!(
            (v.counts["duplicated"], v.counts["crash_window_reexecutions"], v.counts["unattributed"]),
            (2, 1, 1)
        );
        assert!(v.witnesses.iter().any(|w| w.contains("after crash rules-1 (SIGABRT) @15ms (#1180 window)")), "{:?}", v.witnesses);
        assert!(
            v.witnesses.iter().any(|w| w.contains("no consumer crash between; last fault before it: crash cases-1")),
            "{:?}",
            v.witnesses
        );
    }

    #[test]
    fn a_consumer_database_fault_opens_the_window_a_producer_one_does_not() {
        let mut h = History::default();
        effect(&mut h, 10, 101, 1);
        h.push(12, Event::Fault { kind: "kill".into(), target: "database".into(), phase: Phase::Start });
        effect(&mut h, 20, 101, 1);
        effect(&mut h, 30, 102, 2);
        h.push(32, Event::Fault { kind: "down".into(), target: "cases-1->database".into(), phase: Phase::Start });
        effect(&mut h, 40, 102, 2);
        effect(&mut h, 50, 103, 3);
        h.push(52, Event::Fault { kind: "down".into(), target: "rules-1->database".into(), phase: Phase::Start });
        effect(&mut h, 60, 103, 3);
        h.sort();
        let v = effect_once(&h);
        assert_eq!((v.counts["crash_window_reexecutions"], v.counts["unattributed"]), (2, 1), "{:?}", v.witnesses);
        assert!(v.witnesses.iter().any(|w| w.contains("after kill database @12ms (#1180 window)")), "{:?}", v.witnesses);
    }

    #[test]
    fn effect_once_holds_with_only_attributed_reexecutions() {
        let mut h = History::default();
        effect(&mut h, 10, 101, 1);
        h.push(15, Event::Crash { replica: "rules-1".into(), consumer: true, how: "SIGKILL".into() });
        effect(&mut h, 20, 101, 1);
        let v = effect_once(&h);
        assert_eq!((v.validity, v.counts["crash_window_reexecutions"]), (Validity::Valid, 1));
    }

    #[test]
    fn liveness_needs_a_drain_within_the_bound_and_no_stuck_claims() {
        let mut h = History::default();
        assert_eq!(liveness(&h).validity, Validity::Unknown);
        h.push(100, Event::Drained { after_ms: Some(1200), bound_ms: 60_000, pending: 0 });
        assert_eq!(liveness(&h).validity, Validity::Valid);
        h.push(101, Event::Stuck { envelope: id(7), service: "cases".into(), claimed_ms_ago: 90_000 });
        let v = liveness(&h);
        assert_eq!((v.validity, v.counts["stuck_claims"]), (Validity::Invalid, 1));
        let mut h = History::default();
        h.push(100, Event::Drained { after_ms: None, bound_ms: 60_000, pending: 12 });
        let v = liveness(&h);
        assert_eq!(v.validity, Validity::Invalid);
        assert!(v.witnesses[0].starts_with("12 outbox rows still pending"));
    }

    fn poisoned(published: bool, attempts: i32) -> History {
        poisoned_with(published, attempts, "malformed: missing field `id`")
    }

    fn poisoned_with(published: bool, attempts: i32, last_error: &str) -> History {
        let mut h = History::default();
        h.push(0, Event::Poison { envelope: id(9), service: "cases".into() });
        let last_error = Some(last_error.to_owned());
        h.push(0, Event::Staged { envelope: id(9), referral: None, service: "cases".into(), published, attempts, last_error });
        h.push(100, Event::Drained { after_ms: Some(900), bound_ms: 60_000, pending: 0 });
        h
    }

    #[test]
    fn a_poison_row_is_excused_only_while_the_system_says_it_refused_it() {
        let v = liveness(&poisoned(false, 3));
        assert_eq!((v.validity, v.counts["poison_rows"], v.counts["poison_refusals"]), (Validity::Valid, 1, 3));
        let v = liveness(&poisoned(true, 1));
        assert_eq!(v.validity, Validity::Invalid);
        assert!(v.witnesses[0].contains("was stamped published"), "{:?}", v.witnesses);
        let v = liveness(&poisoned(false, 0));
        assert_eq!(v.validity, Validity::Unknown, "never claimed: the fault did not fire");
        // Attempts alone do not corroborate: a broker outage also counts attempts.
        let v = liveness(&poisoned_with(false, 2, "connection: broker unreachable"));
        assert_eq!(v.validity, Validity::Unknown, "not refused as malformed");
        let mut gone = History::default();
        gone.push(0, Event::Poison { envelope: id(9), service: "cases".into() });
        gone.push(100, Event::Drained { after_ms: Some(900), bound_ms: 60_000, pending: 0 });
        assert_eq!(liveness(&gone).validity, Validity::Invalid, "a deleted poison row is a loss of evidence");
    }

    #[test]
    fn witnesses_are_capped() {
        let mut h = History::default();
        for n in 0..50 {
            write(&mut h, n as u64, n, Outcome::Ok);
        }
        let v = no_loss(&h);
        assert_eq!((v.counts["lost"], v.witnesses.len()), (50, MAX_WITNESSES));
    }

    #[test]
    fn a_panicking_checker_is_unknown_with_its_error() {
        assert!(check("nope", &History::default()).is_none());
        let v = Verdict { error: Some("boom".into()), validity: Validity::Unknown, ..Verdict::new("x") };
        assert_eq!(v.validity, Validity::Unknown);
        // check() itself wraps the real checkers; all return without panicking on empty input.
        for name in INVARIANTS {
            let v = check(name, &History::default()).unwrap();
            assert_ne!(v.validity, Validity::Invalid, "{name} on an empty history");
        }
    }

    mod properties {
        use proptest::prelude::*;

        use super::*;

        fn outcome() -> impl Strategy<Value = Outcome> {
            prop_oneof![Just(Outcome::Ok), Just(Outcome::Failed), Just(Outcome::Unknown)]
        }

        proptest! {
            /// Total-queue bookkeeping holds for any history: every acknowledged write is
            /// ok or lost, recovered writes are unknown ones that took effect, and the
            /// verdict is red exactly when something was lost.
            #[test]
            fn no_loss_accounting_is_exhaustive(writes in proptest::collection::vec((outcome(), any::<bool>()), 0..60)) {
                let mut h = History::default();
                for (n, (o, delivered)) in writes.iter().enumerate() {
                    write(&mut h, n as u64, n as u128, *o);
                    if *delivered && *o != Outcome::Failed {
                        effect(&mut h, 1000 + n as u64, 10_000 + n as u128, n as u128);
                    }
                }
                let v = no_loss(&h);
                let c = |k: &str| v.counts[k];
                prop_assert_eq!(c("attempted") as usize, writes.len());
                prop_assert_eq!(c("ok") + c("lost"), c("acknowledged"));
                prop_assert!(c("recovered") <= c("unknown"));
                prop_assert_eq!(c("acknowledged") + c("unknown") + c("failed"), c("attempted"));
                let lost = writes.iter().filter(|(o, d)| *o == Outcome::Ok && !d).count() as u64;
                prop_assert_eq!(c("lost"), lost);
                prop_assert_eq!(v.validity == Validity::Invalid, lost > 0);
                prop_assert!(v.witnesses.len() <= MAX_WITNESSES);
            }

            /// effect_once: every duplicate run is either attributed to a consumer crash
            /// between the two runs or counted as a violation — never dropped.
            #[test]
            fn effect_once_accounts_for_every_rerun(runs in proptest::collection::vec((1usize..4, any::<bool>()), 1..30)) {
                let mut h = History::default();
                let mut t = 0;
                let mut reruns = 0;
                for (env, (times, crash_between)) in runs.iter().enumerate() {
                    for k in 0..*times {
                        if k > 0 {
                            reruns += 1;
                            if *crash_between {
                                t += 1;
                                h.push(t, Event::Crash { replica: "rules-1".into(), consumer: true, how: "SIGKILL".into() });
                            }
                        }
                        t += 1;
                        effect(&mut h, t, env as u128, env as u128);
                    }
                }
                let v = effect_once(&h);
                prop_assert_eq!(v.counts["crash_window_reexecutions"] + v.counts["unattributed"], reruns);
                let unattributed: u64 = runs.iter().filter(|(_, c)| !c).map(|(n, _)| *n as u64 - 1).sum();
                prop_assert_eq!(v.counts["unattributed"], unattributed);
                prop_assert_eq!(v.validity == Validity::Invalid, unattributed > 0);
            }
        }
    }
}
