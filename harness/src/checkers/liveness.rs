//! `liveness`, ADR-022 Everything drains within the bound after the heal and no claim outlives its lease. Excused: only the harness's own poison rows, while the worker refuses them as malformed.

use super::*;

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
    let mut unacked_unknown_seen = false;
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
            Event::Drained { after_ms, bound_ms, pending, unacked_unknown } => {
                drained = Some((*after_ms, *bound_ms, *pending));
                unacked_unknown_seen = *unacked_unknown;
            }
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
            v.validity = if after.is_none() && pending == 0 && stuck == 0 && poison_published == 0 && unacked_unknown_seen {
                // Quiet by every sign the harness could read, but the unacked deliveries never
                // could be counted within the bound: unknown, not a violation.
                v.error = Some("the broker never reported its unacked deliveries within the bound: the drain is not proven".into());
                Validity::Unknown
            } else if after.is_none() || stuck > 0 || poison_published > 0 {
                Validity::Invalid
            } else if poison_untouched > 0 {
                v.error = Some("a poison row was never claimed: the fault did not fire".into());
                Validity::Unknown
            } else if unacked_unknown_seen {
                v.error = Some("the broker could not count unacked deliveries: the drain is not proven".into());
                Validity::Unknown
            } else {
                Validity::Valid
            };
        }
    }
    v
}
