//! Invariant checkers: pure functions of a [`History`], in the shape of Jepsen's
//! `total-queue` — each returns a [`Verdict`] with a validity, counts and at most ten
//! witnesses. No I/O, no clock, no runtime. [`check_all`] runs them; a checker that panics
//! yields `unknown` with the panic message instead of taking the run down.
//!
//! | checker | violated when |
//! |---|---|
//! | `no_loss` | an acknowledged write's event never produced its effect |
//! | `no_phantom` | an effect (a consumer's row, or a transmission the partner got) exists for a write that failed, was rolled back, or was never attempted, or of an aggregate cases' database does not hold |
//! | `effect_once` | an envelope's effect ran twice and no consumer crash or consumer-database fault sits between the two runs (#1180 attribution); for an arbiter-backed consumer (#1179), any second effect; a payment without exactly one `payment.created` and one transmission; a placement period the partner got two transmissions of, one whose job financial's database no longer holds (issue 26) |
//! | `liveness` | the outbox did not drain within the bound after faults healed, or a row stayed claimed past its lease |
//! | `dlq_occurrence_once` | a dead letter that reached `craig.dlx` (occurrence by the harness's own derivation) has no audit row, or one occurrence has two, or deliveries are left in the capture queue; or an envelope both took effect and was dead-lettered |
//! | `fencing` | the partner got two POSTs of one transmission while a send lease was live, a send job has both `exchange.sent` and `exchange.failed`, or a transaction left a terminal status other than `failed → pending` (#1185) |
//! | `retention_safety` | a pending outbox row was pruned, a dedup record was pruned inside the inbox window, or an admin replay reaching past the outbox window was answered anything but 422 (#965/#1129) |
//! | `sentinel_integrity` | an export's handler ran twice for one key and query outside the claim-expiry residue, a stored `succeeded` row is empty though its handler's body was not, or a client received other bytes than the handler produced for its request (live or replayed; a sentinel only for an over-cap body), or a key never got a 200 after the heal (§D5, #1183, #1184) |
//! | `threshold_crossing_once` | a `security.dlq.threshold_exceeded` event is not in the transaction of a crossing (10 → 11 in the sliding hour, by the harness's own count and types), or a crossing has none |
//!
//! One file per invariant (`no_loss.rs`, …), each opening with the rule it judges and the
//! excuses it allows; the shared pieces (`Verdict`, blame and cause tags, witness capping)
//! live here; the literal-history tests in `tests.rs`.

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
    /// Violations found (all of them; `witnesses` shows the first [`MAX_WITNESSES`]).
    #[serde(default)]
    pub violations: u64,
    /// How many violations point at each cause: `replica:<name>` and `compat:<mode>` (or
    /// `compat:current`) of the replica that did the harm at that time — the one that
    /// stamped a lost event, or ran a duplicate. A twin's `{ violate = "<cause>" }` needs
    /// every violation to point at its cause.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub culprits: BTreeMap<String, u64>,
}

/// The cause tags of harm done by `replica` while it ran `compat` (None: never started).
pub fn culprit_tags(replica: &str, compat: Option<&[String]>) -> Vec<String> {
    let mut tags = vec![format!("replica:{replica}")];
    match compat {
        Some([]) => tags.push("compat:current".into()),
        Some(modes) => tags.extend(modes.iter().map(|m| format!("compat:{m}"))),
        None => tags.push("compat:unknown".into()),
    }
    tags
}

/// How far a fault window reaches beyond its recorded edges when blaming (a publish goes
/// out a few ms before its stamp is logged; a fault is recorded as it is being applied).
pub const WINDOW_SLACK_MS: u64 = 250;

/// The `fault:` tags of faults that could have hurt `replica` at `t`: those on its own
/// links, on the broker or the database, or on the replica itself, in force at `t`.
fn faults_on(windows: &[(String, u64, u64)], replica: &str, t: u64) -> Vec<String> {
    windows
        .iter()
        .filter(|(tag, from, to)| {
            let target = tag.split_once(' ').map(|(_, t)| t).unwrap_or("");
            // `broker-N`: a node of a broker cluster every replica holds a link to.
            let mine = target == "broker"
                || target.strip_prefix("broker-").is_some_and(|n| n.parse::<u8>().is_ok())
                || target == "database"
                || target == replica
                || target.strip_prefix(replica).is_some_and(|rest| rest.starts_with("->"));
            mine && from.saturating_sub(WINDOW_SLACK_MS) <= t && t <= to.saturating_add(WINDOW_SLACK_MS)
        })
        .map(|(tag, ..)| tag.clone())
        .collect()
}

/// The replicas that did it (`by`: when, who, the behaviour it ran) as cause tags added to
/// `tags`, with the faults in force on each at its time where `windows` is given; and as
/// "cases-1 (current) @12ms, …" for the witness.
fn each_culprit(by: &[(u64, &str, &[String])], windows: Option<&[(String, u64, u64)]>, tags: &mut Vec<String>) -> String {
    let mut who = Vec::new();
    for (t, r, c) in by {
        tags.extend(culprit_tags(r, Some(c)));
        if let Some(w) = windows {
            tags.extend(faults_on(w, r, *t));
        }
        who.push(format!("{} @{t}ms", running(r, Some(c))));
    }
    who.join(", ")
}

/// Issue 26: per aggregate, the latest its commit can have been by what the harness saw
/// besides a client's answer: the first stamp of its event (a replica logs `outbox.stamped`
/// only for a row that committed and was published) and its first effect. Its event is found
/// by cases' outbox row, or by an effect naming it: a commit a failover lost leaves no outbox
/// row, but the stamp and the effect of its published event stay on record.
fn commit_seen_by(h: &History) -> HashMap<Uuid, u64> {
    fn earliest(m: &mut HashMap<Uuid, u64>, r: Uuid, t: u64) {
        let e = m.entry(r).or_insert(t);
        *e = (*e).min(t);
    }
    let mut aggregate_of: HashMap<Uuid, Uuid> = HashMap::new();
    let mut seen: HashMap<Uuid, u64> = HashMap::new();
    for e in h.iter() {
        match &e.event {
            Event::Staged { envelope, referral: Some(r), service, .. } if service == "cases" => {
                aggregate_of.insert(*envelope, *r);
            }
            Event::Effect { envelope, referral: Some(r), .. } => {
                aggregate_of.entry(*envelope).or_insert(*r);
                earliest(&mut seen, *r, e.t_ms);
            }
            _ => {}
        }
    }
    for e in h.iter() {
        if let Event::Stamped { envelope, .. } = &e.event {
            if let Some(r) = aggregate_of.get(envelope) {
                earliest(&mut seen, *r, e.t_ms);
            }
        }
    }
    seen
}

/// How far apart the run's clock and the database's (converted) may read one moment.
pub(crate) const FAILOVER_CLOCK_SLACK_MS: u64 = 10;

/// Issue 26: per envelope, the first and the last time a replica logged claiming its row
/// from an outbox (`outbox.claimed`) or stamping it published (`outbox.stamped`). Each is
/// logged only for a row its UPDATE found committed: the first bounds the row's commit, and
/// one after a failover's promotion shows the promoted server held the row.
fn claim_or_stamp_lines(h: &History) -> HashMap<Uuid, (u64, u64)> {
    let mut lines: HashMap<Uuid, (u64, u64)> = HashMap::new();
    for e in h.iter() {
        if let Event::Stamped { envelope, .. } | Event::Claimed { envelope, .. } = &e.event {
            let (first, last) = lines.entry(*envelope).or_insert((e.t_ms, e.t_ms));
            (*first, *last) = ((*first).min(e.t_ms), (*last).max(e.t_ms));
        }
    }
    lines
}

/// Issue 26: the database failovers that can have forgotten a commit made between `from`
/// (when its write was first sent, run ms) and `to` (the latest the commit can have been:
/// when a client heard it committed, or its event was stamped or took effect; None where
/// nothing bounds it): an asynchronous failover whose old primary was killed at or after
/// `from`, and whose standby had not applied everything up to `to` (the commit time of the
/// last transaction it replayed, the promoted server's own word, is before `to`). Anything
/// else was on the standby, or went to the new primary; and a synchronous standby
/// (`remote_apply`) had every commit anyone could see: a failover is no excuse for those.
/// Each gives `fault:failover database` and `replication:async`, with a witness's words.
fn failover_forgot(h: &History, from: u64, to: Option<u64>) -> (Vec<String>, String) {
    failover_forgot_before(h, from, to, None)
}

/// [`failover_forgot`], where the system also logged a line of the commit's row at `last`
/// (an `outbox.stamped`, logged only for a row its UPDATE found): a failover is no excuse
/// when that line came after the database address led to the promoted standby (10 ms of
/// slack; the kill's time where that was not recorded), for the promoted server then held
/// the row.
fn failover_forgot_before(h: &History, from: u64, to: Option<u64>, last: Option<u64>) -> (Vec<String>, String) {
    let mut tags = Vec::new();
    let mut said = String::new();
    for e in h.iter() {
        let Event::Failover { replayed_until_ms, mode, promoted_ms } = &e.event else { continue };
        if mode != "async" {
            continue;
        }
        if last.is_some_and(|l| l > promoted_ms.unwrap_or(e.t_ms) + FAILOVER_CLOCK_SLACK_MS) {
            continue;
        }
        // The answer's time and the commit's are read on two clocks of one machine (the
        // run's monotonic one, the database's wall clock converted): a few ms of slack.
        let behind = match (replayed_until_ms, to) {
            (Some(r), Some(to)) => to + FAILOVER_CLOCK_SLACK_MS > *r,
            _ => true,
        };
        if e.t_ms >= from && behind {
            tags.extend(["fault:failover database".to_owned(), format!("replication:{mode}")]);
            said = format!(
                "; the database failed over @{}ms ({mode} replication), its standby having applied commits up to {}",
                e.t_ms,
                replayed_until_ms.map_or("none".to_owned(), |r| format!("@{r}ms"))
            );
        }
    }
    (tags, said)
}

/// "cases-1 (compat pre-1128)" for witness texts.
fn running(replica: &str, compat: Option<&[String]>) -> String {
    match compat {
        Some([]) => format!("{replica} (current)"),
        Some(modes) => format!("{replica} (compat {})", modes.join(",")),
        None => replica.to_owned(),
    }
}

impl Verdict {
    fn new(name: &str) -> Self {
        Self {
            name: name.into(),
            validity: Validity::Valid,
            counts: BTreeMap::new(),
            witnesses: vec![],
            error: None,
            violations: 0,
            culprits: BTreeMap::new(),
        }
    }

    /// A verdict that could not be reached.
    pub fn undecided(name: &str, error: impl Into<String>) -> Self {
        Self { error: Some(error.into()), validity: Validity::Unknown, ..Self::new(name) }
    }

    /// Whether this verdict is unknown only because the run gave the checker nothing to
    /// judge (its error says "nothing to check"), not because something went unproven
    /// (a panic, a queue it could not read, a drain it could not count).
    pub fn nothing_to_check(&self) -> bool {
        self.validity == Validity::Unknown && self.error.as_deref().is_some_and(|e| e.starts_with(NOTHING_TO_CHECK))
    }

    /// Count one violation against every cause in `tags` (each at most once).
    fn blame(&mut self, tags: impl IntoIterator<Item = String>) {
        self.violations += 1;
        let tags: std::collections::BTreeSet<String> = tags.into_iter().collect();
        for t in tags {
            *self.culprits.entry(t).or_default() += 1;
        }
    }

    /// Whether every violation points at `cause` (and there was at least one).
    pub fn all_point_at(&self, cause: &str) -> bool {
        self.violations > 0 && self.culprits.get(cause).copied().unwrap_or(0) == self.violations
    }

    fn count(&mut self, key: &str, n: usize) {
        self.counts.insert(key.into(), n as u64);
    }

    /// The verdict of a checker that counts violations: invalid with any; else unknown,
    /// saying `why`, when there was `nothing` to check; else valid.
    fn settle(mut self, nothing: bool, why: &str) -> Self {
        self.validity = if self.violations > 0 {
            Validity::Invalid
        } else if nothing {
            self.error = Some(why.into());
            Validity::Unknown
        } else {
            Validity::Valid
        };
        self
    }

    fn witness(&mut self, w: String) {
        if self.witnesses.len() < MAX_WITNESSES {
            self.witnesses.push(w);
        }
    }
}

/// How a checker's error begins when the run had nothing for it to judge.
pub const NOTHING_TO_CHECK: &str = "nothing to check";

pub const INVARIANTS: &[&str] = &[
    "no_loss",
    "no_phantom",
    "effect_once",
    "liveness",
    "dlq_occurrence_once",
    "threshold_crossing_once",
    "fencing",
    "retention_safety",
    "sentinel_integrity",
];
/// Checkers that blame every violation on a replica and its compat mode
/// ([`Verdict::culprits`]), so a scenario can name the cause it must be violated for.
pub const ATTRIBUTING: &[&str] =
    &["no_loss", "no_phantom", "effect_once", "dlq_occurrence_once", "threshold_crossing_once", "fencing", "retention_safety", "sentinel_integrity"];

/// Run one checker by name (None: no such checker).
pub fn check(name: &str, h: &History) -> Option<Verdict> {
    let f: fn(&History) -> Verdict = match name {
        "no_loss" => no_loss,
        "no_phantom" => no_phantom,
        "effect_once" => effect_once,
        "liveness" => liveness,
        "dlq_occurrence_once" => dlq_occurrence_once,
        "threshold_crossing_once" => threshold_crossing_once,
        "fencing" => fencing,
        "retention_safety" => retention_safety,
        "sentinel_integrity" => sentinel_integrity,
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
    /// envelope → (effect time, replica that ran it) in order
    by_envelope: BTreeMap<Uuid, Vec<(u64, Option<String>)>>,
    total: usize,
}

fn effects(h: &History) -> Effects {
    let mut e = Effects { by_referral: HashMap::new(), by_envelope: BTreeMap::new(), total: 0 };
    for entry in h.iter() {
        if let Event::Effect { envelope, referral, replica, .. } = &entry.event {
            e.total += 1;
            e.by_envelope.entry(*envelope).or_default().push((entry.t_ms, replica.clone()));
            if let Some(r) = referral {
                e.by_referral.entry(*r).or_insert(entry.t_ms);
            }
        }
    }
    e
}

/// `cases` of `cases-1`.
pub(super) fn service_of(replica: &str) -> &str {
    replica.rsplit_once('-').map_or(replica, |(s, _)| s)
}

/// The replica a fault tag (`fault:<kind> <target>`) acts on: `cases-1` of `fault:crash
/// cases-1` and of `fault:toxic cases-1->broker`; `None` for a server (`broker`, `database`).
pub(super) fn fault_replica(tag: &str) -> Option<&str> {
    let target = tag.split_once(' ')?.1;
    let replica = target.split("->").next()?;
    (replica.contains('-') && !matches!(replica, "broker" | "database")).then_some(replica)
}

/// What a dead-letter violation was, as a cause tag (`kind:<name>`) a twin can name, so a
/// twin is red for its documented cause and not for any violation of the same checker.
pub const VIOLATION_KINDS: &[&str] =
    &["lost", "doubled", "unexplained", "completed_and_dead_lettered", "re_emitted", "missed_crossing", "spurious_crossing", "misattributed", "double_post", "conflicting_events", "terminal_flip", "pruned_pending", "replay_past_window",
      "executed_twice", "emptied_body", "wrong_live", "wrong_replay", "false_sentinel", "no_retry_after", "unexpected_status", "captured", "pruned_dedup", "never_answered", "unmatched_side_effect", "unexpected_dead_letter", "unstaged", "phantom", "refused_committed", "lost_acknowledged", "phantom_event", "forgotten_transmission", "forgotten_evaluation"];

/// Which faults can cause a dead-letter violation of a kind, by the fault tag.
#[derive(Clone, Copy)]
pub(super) enum Through {
    /// Losing a record: the recorder itself (crash, kill, pause) or its database.
    Database,
    /// Recording twice: a DLQ ack that failed: the recorder itself or its broker.
    Broker,
    /// Nothing but the behaviour that ran.
    Nothing,
}

/// The cause tags of a dead-letter violation of `kind`: the kind; every replica of
/// `service` with the compat it ran last (the audit row does not say which replica wrote
/// it); and the faults that can cause that kind ([`Through`]) on that service's replicas,
/// their links, or the server in question, whose window reaches past `since` (issue 22.8: a
/// fault over before the harm could begin caused none of it; 0 where no moment is known).
pub(super) fn dead_letter_tags(h: &History, kind: &str, service: &str, through: Through, since: u64) -> Vec<String> {
    debug_assert!(VIOLATION_KINDS.contains(&kind));
    let mut tags = vec![format!("kind:{kind}")];
    tags.extend(service_culprits(h, service));
    let server = match through {
        Through::Database => "database",
        Through::Broker => "broker",
        Through::Nothing => return tags,
    };
    tags.extend(h.fault_windows().into_iter().filter(|(_, _, to)| to.saturating_add(WINDOW_SLACK_MS) >= since).map(|(tag, ..)| tag).filter(|tag| {
        let target = tag.split_once(' ').map_or("", |(_, t)| t);
        match fault_replica(tag) {
            None => target == server,
            Some(r) => service_of(r) == service && (target == r || target.ends_with(&format!("->{server}"))),
        }
    }));
    tags
}

/// Every replica of `service` with the compat it ran last: the culprits of harm no record
/// attributes to one replica.
pub(super) fn service_culprits(h: &History, service: &str) -> Vec<String> {
    let end = h.iter().last().map_or(0, |e| e.t_ms);
    let mut tags = Vec::new();
    let mut seen = HashSet::new();
    for e in h.iter() {
        if let Event::Started { replica, .. } = &e.event {
            if service_of(replica) == service && seen.insert(replica.clone()) {
                tags.extend(culprit_tags(replica, h.compat_at(replica, end)));
            }
        }
    }
    // A test-only mutant on one of them is the behaviour it ran, as a compat mode is.
    tags.extend(h.fault_windows().into_iter().map(|(tag, ..)| tag).filter(|tag| {
        tag.strip_prefix("fault:mutant ").is_some_and(|r| service_of(r) == service)
    }));
    tags
}

mod no_loss;
mod no_phantom;
mod effect_once;
mod dlq_occurrence_once;
mod threshold_crossing_once;
mod fencing;
mod retention_safety;
mod sentinel_integrity;
mod liveness;
pub use no_loss::*;
pub use no_phantom::*;
pub use effect_once::*;
pub use dlq_occurrence_once::*;
pub use threshold_crossing_once::*;
pub use fencing::*;
pub use retention_safety::*;
pub use sentinel_integrity::*;
pub use liveness::*;

#[cfg(test)]
mod tests;
