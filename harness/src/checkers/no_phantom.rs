//! `no_phantom`, ADR-022 No effect without a committed write: an effect (in a consumer's tables, a transmission the partner got, or a `rule.evaluated` the harness's tap saw published) of a failed, rolled-back or never-attempted write, or of an aggregate cases' database does not hold (issue 22.2), is a phantom, as is a committed aggregate whose write was refused; after an asynchronous database failover that can have forgotten its commit, `kind:phantom_event` with `fault:failover database` and `replication:async` (issue 26). Excused: nothing. Blame: the replica that took the write, its behaviour and the faults on it then.

use super::*;

/// No effect without a write that may have committed.
///
/// Each phantom is blamed (issue 22) on the replica that took its last write attempt, with
/// the behaviour it ran then and the faults on it at the time (`kind:phantom`); a committed
/// aggregate whose write was refused for certain is `kind:refused_committed`, blamed the
/// same way. An effect of a write nobody attempted has no replica to blame
/// (`replica:unknown`).
pub fn no_phantom(h: &History) -> Verdict {
    let mut v = Verdict::new("no_phantom");
    let fx = effects(h);
    let windows = h.fault_windows();
    let mut may_exist: HashSet<Uuid> = HashSet::new();
    let mut must_not: HashMap<Uuid, &'static str> = HashMap::new();
    // Every write attempt of an aggregate: (t, replica), the last one taking the blame.
    let mut tries: HashMap<Uuid, (u64, &str)> = HashMap::new();
    // When each aggregate's write was first sent (issue 26: a failover after it can have
    // forgotten its commit).
    let mut first_sent: HashMap<Uuid, u64> = HashMap::new();
    // ... and when a client heard it committed (its commit came before that).
    let mut acknowledged: HashMap<Uuid, u64> = HashMap::new();
    for entry in h.iter() {
        match &entry.event {
            Event::Write { referral, outcome, replica, answered_ms, .. } => {
                tries.insert(*referral, (entry.t_ms, replica.as_str()));
                first_sent.entry(*referral).or_insert(entry.t_ms);
                if let (Outcome::Ok, Some(a)) = (outcome, answered_ms) {
                    let at = acknowledged.entry(*referral).or_insert(*a);
                    *at = (*at).min(*a);
                }
                if *outcome == Outcome::Failed {
                    must_not.insert(*referral, "failed");
                } else {
                    may_exist.insert(*referral);
                }
            }
            Event::RolledBack { referral } => {
                must_not.insert(*referral, "rolled back");
            }
            _ => {}
        }
    }
    // The latest each aggregate's commit can have been, by its event's stamp and effect (issue 26).
    let seen = super::commit_seen_by(h);
    let blame = |v: &mut Verdict, kind: &str, aggregate: &Uuid, more: Vec<String>| -> String {
        let mut tags = vec![format!("kind:{kind}")];
        tags.extend(more);
        match tries.get(aggregate) {
            Some(&(t, replica)) => {
                let compat = h.compat_at(replica, t);
                tags.extend(culprit_tags(replica, compat));
                // A failover is named only where it can have forgotten the commit (issue 26).
                tags.extend(faults_on(&windows, replica, t).into_iter().filter(|t| !t.starts_with("fault:failover ")));
                v.blame(tags);
                format!("its write went to {} @{t}ms; {}", running(replica, compat), h.fault_near(t))
            }
            None => {
                tags.extend(["replica:unknown".to_owned(), "compat:unknown".to_owned()]);
                v.blame(tags);
                "the harness never wrote it (a write of the harness's own rolled back, or none)".to_owned()
            }
        }
    };
    // Issue 22.2: what cases' database holds committed, when it was read.
    let committed: HashSet<Uuid> =
        h.iter().filter_map(|e| if let Event::Committed { aggregate, .. } = &e.event { Some(*aggregate) } else { None }).collect();
    // Read at all (an empty read is a read: every effect is then of an uncommitted write).
    let read = h.iter().any(|e| matches!(e.event, Event::CommittedRead));
    let mut unexpected = 0;
    // A write the service refused for certain that committed anyway.
    let mut refused: Vec<(&Uuid, &&str)> = must_not.iter().filter(|(r, _)| committed.contains(*r)).collect();
    refused.sort();
    for (referral, why) in refused {
        unexpected += 1;
        let by = blame(&mut v, "refused_committed", referral, vec![]);
        v.witness(format!("aggregate {referral} is committed in cases' database but its write was {why}: {by}"));
    }
    // Issue 26: the partner's own record is an effect too. A transmission of a placement
    // period (a payment of it, as the partner got it) needs that placement committed, whatever
    // financial's database still holds of the payment.
    let mut touched: BTreeMap<Uuid, u64> = fx.by_referral.iter().map(|(a, t)| (*a, *t)).collect();
    // Likewise the harness's own copy of every rule.evaluated published (the evaluations
    // tap): an evaluation of a referral needs that referral committed, whatever rules'
    // database still holds of the evaluation.
    for e in h.iter() {
        if let Event::PartnerTransmission { placement: aggregate, .. } | Event::EvaluationPublished { referral: aggregate, .. } = &e.event {
            let t = touched.entry(*aggregate).or_insert(e.t_ms);
            *t = (*t).min(e.t_ms);
        }
    }
    for (referral, t) in &touched {
        let gone = read && !committed.contains(referral);
        let why = match must_not.get(referral) {
            Some(why) => Some(*why),
            None if !may_exist.contains(referral) => Some("never attempted"),
            None if gone => Some("never committed (cases' database has no such aggregate)"),
            None => None,
        };
        if let Some(why) = why {
            unexpected += 1;
            // Issue 26: an effect of a write that may have committed, whose aggregate the
            // database no longer holds, after a failover that can have forgotten the commit
            // (asynchronous; the write was sent before the old primary's kill, and the standby
            // had not applied up to the latest its commit can have been: a client's answer,
            // its event's first stamp, its effect): delivered, its domain row gone.
            let (failover, said) = match first_sent.get(referral) {
                Some(&from) if gone && may_exist.contains(referral) && !must_not.contains_key(referral) => {
                    // The commit came before its answer, its event's stamp and its effect.
                    let to = [acknowledged.get(referral).copied(), seen.get(referral).copied(), Some(*t)].into_iter().flatten().min();
                    super::failover_forgot(h, from, to)
                }
                _ => (vec![], String::new()),
            };
            let kind = if failover.is_empty() { "phantom" } else { "phantom_event" };
            let by = blame(&mut v, kind, referral, failover);
            v.witness(format!("aggregate {referral} took effect @{t}ms but was {why}: {by}{said}"));
        }
    }
    v.count("effects", fx.total);
    v.count("rolled_back_or_failed", must_not.len());
    v.count("unexpected", unexpected);
    v.validity = if unexpected > 0 {
        Validity::Invalid
    } else if must_not.is_empty() && fx.total == 0 && touched.is_empty() {
        v.error = Some("nothing to check: no effects and no failed or rolled-back writes".into());
        Validity::Unknown
    } else {
        Validity::Valid
    };
    v
}
