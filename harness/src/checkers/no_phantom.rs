//! `no_phantom`, ADR-022 No effect without a committed write: an effect of a failed, rolled-back or never-attempted write, or of an aggregate cases' database does not hold (issue 22.2), is a phantom, as is a committed aggregate whose write was refused. Excused: nothing.

use super::*;

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
        v.witness(format!("aggregate {referral} is committed in cases' database but its write was {why}"));
    }
    let mut referrals: Vec<(&Uuid, &u64)> = fx.by_referral.iter().collect();
    referrals.sort();
    for (referral, t) in referrals {
        let why = match must_not.get(referral) {
            Some(why) => Some(*why),
            None if !may_exist.contains(referral) => Some("never attempted"),
            None if read && !committed.contains(referral) => Some("never committed (cases' database has no such aggregate)"),
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
