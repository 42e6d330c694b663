//! `retention_safety`, ADR-022 #965/#1129 retention: no pending outbox row pruned, no dedup record pruned inside the inbox window, a past-window replay refused with 422 only. Excused: nothing.

use super::*;

/// Retention never costs an undelivered event or a dedup record a replay relies on
/// (§ Retention policy, #965/#1129):
/// - no pending outbox row is ever deleted (the harness's trigger records every such
///   DELETE): blamed on every replica of that service, the prune's advisory lock leaves no
///   record of which one ran it;
/// - no admin replay whose window starts before the outbox window is accepted: blamed on
///   the replica that accepted it.
///
/// Corroborated by the system, or unknown: a prune cycle logged (`retention.cycle`), or a
/// replay asked; a replay inside the outbox window answered anything but 200 re-staged
/// nothing, and leaves it unproven. A run that staged pending rows for the prune to keep must show a cycle that
/// saw and kept them (`retention.outbox_unpublished_beyond_grace`) or deleted them.
pub fn retention_safety(h: &History) -> Verdict {
    let mut v = Verdict::new("retention_safety");
    let (mut cycles, mut kept, mut pruned) = (0, 0i64, 0);
    let edges: HashSet<Uuid> =
        h.iter().filter_map(|e| if let Event::InboxEdge { envelope, .. } = &e.event { Some(*envelope) } else { None }).collect();
    let (mut inbox_deletes, mut edge_deletes) = (0, 0);
    let (mut accepted, mut refused, mut past_accepted) = (0, 0, 0);
    // Inside the window a replay must be accepted; one answered otherwise (or not at all)
    // re-staged nothing, so what the scenario built on it was never tested.
    let mut in_window_unaccepted: Vec<String> = Vec::new();
    for e in h.iter() {
        match &e.event {
            Event::PruneCycle { kept_pending, .. } => {
                cycles += 1;
                kept = kept.max(*kept_pending);
            }
            Event::PrunedPending { envelope, service } => {
                pruned += 1;
                let mut tags = vec!["kind:pruned_pending".to_owned()];
                tags.extend(service_culprits(h, service));
                v.blame(tags);
                v.witness(format!("pending outbox row {envelope} of {service} was deleted @{}ms: the only evidence of an undelivered event", e.t_ms));
            }
            Event::InboxPruned { envelope, service, age_ms, window_ms } => {
                inbox_deletes += 1;
                if edges.contains(envelope) {
                    edge_deletes += 1;
                }
                if age_ms < window_ms {
                    let mut tags = vec!["kind:pruned_dedup".to_owned()];
                    tags.extend(service_culprits(h, service));
                    v.blame(tags);
                    v.witness(format!(
                        "{service} deleted the dedup record of {envelope} at {:.1} d, inside its {} d inbox window @{}ms: a redelivery would re-execute",
                        *age_ms as f64 / 86_400_000.0,
                        window_ms / 86_400_000,
                        e.t_ms
                    ));
                }
            }
            Event::Replay { replica, from_age_ms, window_ms, status, .. } if from_age_ms > window_ms && *status != Some(422) => {
                // Issue 22.6: past the window the only right answer is 422 (nothing re-staged);
                // anything else, no answer included, is a violation.
                if *status == Some(200) {
                    accepted += 1;
                }
                past_accepted += 1;
                let mut tags = vec!["kind:replay_past_window".to_owned()];
                tags.extend(culprit_tags(replica, h.compat_at(replica, e.t_ms)));
                v.blame(tags);
                v.witness(format!(
                    "{} answered {} to a replay starting {} h back, past the {} h outbox window @{}ms (only 422 refuses it)",
                    running(replica, h.compat_at(replica, e.t_ms)),
                    status.map_or_else(|| "nothing".to_owned(), |s| s.to_string()),
                    from_age_ms / 3_600_000,
                    window_ms / 3_600_000,
                    e.t_ms
                ));
            }
            // Inside the window (a past-window one not refused 422 is the arm above).
            Event::Replay { replica, status, from_age_ms, window_ms, .. } => {
                if *status == Some(200) {
                    accepted += 1;
                } else {
                    refused += 1;
                    // A past-window one here was refused with 422, as it must be.
                    if from_age_ms <= window_ms {
                        in_window_unaccepted.push(format!(
                            "{replica} answered {} @{}ms",
                            status.map_or_else(|| "nothing".to_owned(), |s| s.to_string()),
                            e.t_ms
                        ));
                    }
                }
            }
            _ => {}
        }
    }
    let staged_pending = h.iter().any(|e| matches!(e.event, Event::Backdated { .. }));
    v.count("prune_cycles", cycles);
    v.count("pending_kept_by_a_cycle", kept as usize);
    v.count("pending_pruned", pruned);
    v.count("replays_accepted", accepted);
    v.count("replays_refused", refused);
    v.count("replays_past_window_accepted", past_accepted);
    v.count("inbox_deletes", inbox_deletes);
    v.count("inbox_edge_records", edges.len());
    v.count("inbox_edge_records_deleted", edge_deletes);
    // Each half proves itself: staged pending rows need a cycle that saw them (kept or
    // deleted them); without them, a cycle or a replay is something to check.
    // Issue 22.6 (audit): dedup records staged at the inbox edge need a prune that reached
    // them (the one past the window deleted), or the inbox rule was never tested.
    let inbox_proven = edges.is_empty() || edge_deletes > 0;
    let proven = inbox_proven && if staged_pending { cycles > 0 && (kept > 0 || pruned > 0) } else { cycles > 0 || accepted + refused > 0 };
    if !in_window_unaccepted.is_empty() {
        let why = format!(
            "unproven: the admin replay inside the outbox window was not accepted ({}): nothing was re-staged",
            in_window_unaccepted.join("; ")
        );
        return v.settle(true, &why);
    }
    // Rows staged for the prune that no cycle reached are a test that did not happen, not
    // "nothing to check": an unlisted retention_safety then makes the run inconclusive.
    let why = if staged_pending || !edges.is_empty() {
        "unproven: the rows staged for the prune (backdated pending rows, inbox edge records) were never reached by a prune cycle"
    } else {
        "nothing to check: no prune cycle ran and no replay was asked"
    };
    v.settle(!proven, why)
}
