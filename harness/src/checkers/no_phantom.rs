//! `no_phantom`, ADR-022 No effect without a committed write: an effect of a failed, rolled-back or never-attempted write is a phantom. Excused: nothing.

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
