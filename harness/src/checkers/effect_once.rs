//! `effect_once`, ADR-022 #1180 effect-once behind the inbox: a re-run is excused only inside the ADR's window (a consumer crash or its database fault between run and stamp, corroborated by `inbox.reprocessed`, at most the session's concurrency per crash); #1179 arbiter-backed consumers are excused nothing, each payment has exactly one `payment.created` and one transmission, and the partner, by its own record, gets one transmission of a placement period (a second whose job financial's database forgot is `kind:forgotten_transmission`, issue 26), and, by the harness's own tap of `rule.evaluated`, a source envelope evaluated again after rules' database forgot the first evaluation is `kind:forgotten_evaluation` (issue 26).

use super::*;

/// How long after an effect's transaction began its `processed_at` stamp is due: the
/// handler commits and the inbox stamps within milliseconds, so a fault starting later than
/// this cannot have come between the two. It narrows the window; it never excuses alone.
pub const STAMP_DUE_MS: u64 = 2_000;

/// How long a stamp the inbox reported still pending (`inbox.stamp_retry`) may take from
/// its first such report: the inbox gives up [`craig_mq::inbox::STAMP_RETRY_FOR`] after its
/// first attempt began, which was before that report.
pub const STAMP_PENDING_MS: u64 = craig_mq::inbox::STAMP_RETRY_FOR.as_millis() as u64;

/// When the stamp of `envelope`'s run at `t` on `replica` was due: [`STAMP_DUE_MS`] after
/// it, or, where that replica's inbox reported the stamp still pending before `until`
/// (`Event::StampRetry`), [`STAMP_PENDING_MS`] after its first such report at or after `t`
/// (the system's own word that the window was still open; never timing alone). The first,
/// not the last: a later run's retries cannot stretch an earlier run's window.
fn stamp_due(retries: &HashMap<Uuid, Vec<(u64, String)>>, envelope: &Uuid, t: u64, until: u64, replica: Option<&str>) -> u64 {
    let first = retries.get(envelope).and_then(|rs| {
        rs.iter().filter(|(at, r)| (t..=until).contains(at) && replica.is_none_or(|x| x == r)).map(|(at, _)| *at).min()
    });
    (t + STAMP_DUE_MS).max(first.map_or(0, |f| f + STAMP_PENDING_MS))
}

/// Consumers whose side effect carries its own arbiter (ADR-022 #1179: financial's
/// `payments_one_perdiem_per_placement_period`): the #1180 window excuses nothing for them —
/// a re-run must be absorbed by the arbiter, so any second effect is a violation.
pub const ARBITER_BACKED: &[&str] = &["financial"];

/// Re-executions one fault can excuse per consumer replica: as many envelopes as the
/// replica's consume session handled at once (`CRAIG_CONSUMER_CONCURRENCY`, at most the
/// prefetch), in the replica's own word: the `concurrency` of its last `subscriber.started`
/// before the first run ([`Event::ConsumerStarted`]); 1 when it said nothing.
pub(super) fn handler_concurrency(h: &History, replica: Option<&str>, t: u64) -> usize {
    let Some(replica) = replica else { return 1 };
    h.iter()
        .take_while(|e| e.t_ms <= t)
        .filter_map(|e| match &e.event {
            Event::ConsumerStarted { replica: r, concurrency } if r == replica => Some(*concurrency),
            _ => None,
        })
        .last()
        .unwrap_or(1)
        .max(1)
}

/// What can open the #1180 window of an execution on replica R: R crashing, the database
/// killed, paused or failed over, R's own database link cut, or, under synchronous
/// replication (issue 26), the standby's replication link cut (every commit, the stamp's
/// included, waits for the standby, and dies with the primary) — while the stamp was due.
#[derive(Debug)]
pub(super) enum Opener {
    Crash { replica: String },
    Database,
    Link { replica: String },
}

pub(super) struct WindowFault {
    opener: Opener,
    from: u64,
    to: u64,
    label: String,
    /// Where the stamp is lost only at a later moment (a stalled synchronous commit, at the
    /// failover's kill): a re-run before it is not this fault's.
    lost_at: Option<u64>,
    /// Whose budget of excused re-runs it spends: its own index, or, for a stalled
    /// synchronous commit, the failover's that killed it (one incident, one budget).
    budget: usize,
    /// False for a replication cut no failover came in: the stall only delayed the stamp.
    live: bool,
}

impl WindowFault {
    /// Whether this fault could have stopped the stamp of an execution at `t1` on `replica`,
    /// its stamp due by `due` ([`stamp_due`]).
    fn opens(&self, t1: u64, due: u64, replica: Option<&str>) -> bool {
        let applies = match &self.opener {
            Opener::Database => true,
            Opener::Crash { replica: r } | Opener::Link { replica: r } => replica == Some(r.as_str()),
        };
        self.live && applies && self.from <= due && self.to >= t1
    }
}

pub(super) fn window_faults(h: &History) -> Vec<WindowFault> {
    let mut out: Vec<WindowFault> = Vec::new();
    let mut open: HashMap<(String, String), usize> = HashMap::new();
    // The standby's streaming as the primary reported it before the load (issue 26).
    let mut synchronous = false;
    // A stamp a broken synchronous replication link stalled lands once the link is back:
    // only a failover while it was broken loses it. Those cuts, judged at the end.
    let mut stalls: Vec<usize> = Vec::new();
    for e in h.iter() {
        match &e.event {
            Event::Replication { mode, .. } => synchronous = mode == "sync",
            // Issue 26: an asynchronous failover forgets every commit after the last one its
            // standby applied (`replayed_until_ms`, the promoted server's own word). A first
            // run whose effect was applied by then (it ran at most the clocks' slack after it)
            // and whose stamp was due after it can have lost only its stamp: the #1180 window,
            // with the failover as its fault. Only a re-run after the failover is its, and it
            // spends the failover fault's own budget (one incident). A standby that had
            // applied nothing since it started kept no effect of the run: no window.
            Event::Failover { replayed_until_ms: Some(r), mode, .. } if mode == "async" => {
                let budget = open.get(&("failover".to_owned(), "database".to_owned())).copied().unwrap_or(out.len());
                out.push(WindowFault {
                    opener: Opener::Database,
                    from: *r,
                    to: r + crate::checkers::FAILOVER_CLOCK_SLACK_MS,
                    label: format!("asynchronous failover of the database @{}ms (its standby had applied commits up to @{r}ms)", e.t_ms),
                    lost_at: Some(e.t_ms),
                    budget,
                    live: true,
                });
            }
            Event::Crash { replica, how, .. } => out.push(WindowFault {
                opener: Opener::Crash { replica: replica.clone() },
                from: e.t_ms,
                to: e.t_ms,
                label: format!("crash {replica} ({how}) @{}ms", e.t_ms),
                lost_at: None,
                budget: out.len(),
                live: true,
            }),
            Event::Fault { kind, target, phase } => {
                // A toxic's label is "<replica>->database (<type> <stream>)".
                let link = target.split(" (").next().unwrap_or(target);
                // Only a toxic that can break the stamp's statement opens the window: one that
                // drops, stalls or cuts the link (a latency, bandwidth or slicer toxic delays
                // the stamp but it still lands).
                let toxic_type = target.split_once(" (").and_then(|(_, t)| t.split_whitespace().next()).unwrap_or("");
                let breaks = kind == "down" || matches!(toxic_type, "timeout" | "reset_peer" | "limit_data");
                let opener = match (kind.as_str(), link) {
                    // A failover (issue 26) kills the primary: the stamp can be lost with it.
                    ("kill" | "pause" | "partition" | "failover", "database") => Opener::Database,
                    // Under synchronous replication (`remote_apply`) a commit returns only once
                    // the standby applied it: with the replication link broken, the stamp's
                    // commit waits, and a failover kills the primary under it.
                    ("down" | "toxic", crate::scenario::REPLICATION_LINK) if breaks && synchronous => {
                        if *phase == Phase::Start {
                            stalls.push(out.len());
                        }
                        Opener::Database
                    }
                    ("down" | "toxic", l) if breaks => match l.strip_suffix("->database") {
                        Some(r) if r != "standby" => Opener::Link { replica: r.to_owned() },
                        _ => continue,
                    },
                    _ => continue,
                };
                let key = (kind.clone(), target.clone());
                match phase {
                    Phase::Start => {
                        open.insert(key, out.len());
                        let sync = if stalls.last() == Some(&out.len()) { " (synchronous replication: commits waited for the standby)" } else { "" };
                        let (lost_at, budget, live) = (None, out.len(), true);
                        out.push(WindowFault { opener, from: e.t_ms, to: u64::MAX, label: format!("{kind} {target} @{}ms{sync}", e.t_ms), lost_at, budget, live });
                    }
                    Phase::End => {
                        if let Some(i) = open.remove(&key) {
                            out[i].to = e.t_ms;
                        }
                    }
                }
            }
            _ => {}
        }
    }
    // A stalled stamp is lost at the first synchronous failover while the link was cut: the
    // window ends there (after it the promoted server has no standby to wait for), a re-run
    // before it is not the cut's, and the cut spends that failover's budget. A cut no such
    // failover came in only delayed the stamp: it opens nothing.
    let failovers: Vec<u64> =
        h.iter().filter(|e| matches!(&e.event, Event::Failover { mode, .. } if mode == "sync")).map(|e| e.t_ms).collect();
    for i in stalls {
        let Some(at) = failovers.iter().copied().find(|t| (out[i].from..=out[i].to).contains(t)) else {
            out[i].live = false;
            continue;
        };
        out[i].to = at;
        out[i].lost_at = Some(at);
        // The failover's own window (recorded from its start, before the kill).
        if let Some(j) = (0..out.len()).find(|&j| out[j].label.starts_with("failover database") && out[j].from <= at && at <= out[j].to) {
            out[i].budget = j;
        }
    }
    out
}

/// Each envelope's effect at most once — except a re-execution inside exactly the documented
/// #1180 window, counted as `crash_window_reexecutions` and attributed, never silently
/// allowed. A re-execution is excused only when ALL hold:
/// - a fault could have stopped the FIRST execution's stamp: a crash of the replica that ran
///   it, a kill/pause/failover of the database, a cut of that replica's own database link, or
///   under synchronous replication a cut of the standby's replication link with a failover
///   while it was cut (issue 26: the stamp's commit waited for the standby), or an
///   asynchronous failover whose standby had applied commits up to at least the first
///   execution (10 ms of slack) but not up to its stamp (the re-run after the failover,
///   on the failover's budget), in force
///   within [`STAMP_DUE_MS`] after the first execution (and before the second), or until
///   [`STAMP_PENDING_MS`] after that replica's inbox first reported the stamp still pending
///   (`inbox.stamp_retry`, before the second);
/// - that fault has not already excused as many re-executions of that replica as its consume
///   session ran handlers at once (its own `subscriber.started concurrency=N`, else 1);
/// - the system corroborates it: the inbox reported reprocessing that envelope
///   (`Event::Reprocessed`, from `inbox.reprocessed`) — logged by the replica that ran the
///   re-execution, within [`STAMP_DUE_MS`] after it (or [`STAMP_PENDING_MS`] after its own
///   first `inbox.stamp_retry`), each report excusing one re-run.
///   Timing alone never excuses;
/// - the consumer is not arbiter-backed ([`ARBITER_BACKED`]): one that is must absorb the
///   re-run itself (#1179), so its second effect is never excused.
pub fn effect_once(h: &History) -> Verdict {
    let mut v = Verdict::new("effect_once");
    let fx = effects(h);
    let faults = window_faults(h);
    let windows = h.fault_windows();
    // The inbox's own word, per envelope: (time, replica, already used for an excuse).
    let mut reprocessed: HashMap<Uuid, Vec<(u64, String, bool)>> = HashMap::new();
    // And its word that a stamp was still pending (retried).
    let mut retries: HashMap<Uuid, Vec<(u64, String)>> = HashMap::new();
    for e in h.iter() {
        match &e.event {
            Event::Reprocessed { envelope, replica } => reprocessed.entry(*envelope).or_default().push((e.t_ms, replica.clone(), false)),
            Event::StampRetry { envelope, replica } => retries.entry(*envelope).or_default().push((e.t_ms, replica.clone())),
            _ => {}
        }
    }
    // For blaming a duplicate on the producer side: when each referral was written, and
    // which replica stamped each envelope.
    let mut written: HashMap<Uuid, u64> = HashMap::new();
    let mut referral_of: HashMap<Uuid, Uuid> = HashMap::new();
    let mut stampers: HashMap<Uuid, Vec<(u64, String)>> = HashMap::new();
    // Issue 26: when a replica's claim or stamp found each envelope's row committed.
    let lines = claim_or_stamp_lines(h);
    for e in h.iter() {
        match &e.event {
            Event::Write { referral, .. } => {
                written.entry(*referral).or_insert(e.t_ms);
            }
            Event::Effect { envelope, referral: Some(r), .. } => {
                referral_of.insert(*envelope, *r);
            }
            Event::Stamped { envelope, replica, .. } => stampers.entry(*envelope).or_default().push((e.t_ms, replica.clone())),
            _ => {}
        }
    }
    let arbitered: HashSet<Uuid> = h
        .iter()
        .filter_map(|e| match &e.event {
            Event::Effect { envelope, service, .. } if ARBITER_BACKED.contains(&service.as_str()) => Some(*envelope),
            _ => None,
        })
        .collect();
    let republish = republishers(h);
    let mut republished: HashSet<(Uuid, usize)> = HashSet::new();
    let mut used: HashMap<(usize, Option<String>), usize> = HashMap::new();
    let (mut duplicated, mut attributed, mut unattributed) = (0, 0, 0);
    for (envelope, runs) in &fx.by_envelope {
        if runs.len() < 2 {
            continue;
        }
        duplicated += 1;
        for pair in runs.windows(2) {
            let ((t1, r1), (t2, _)) = (&pair[0], &pair[1]);
            let on = r1.as_deref().unwrap_or("an unnamed replica");
            let due = stamp_due(&retries, envelope, *t1, *t2, r1.as_deref());
            let candidates: Vec<usize> = (0..faults.len())
                .filter(|&i| faults[i].opens(*t1, due, r1.as_deref()) && faults[i].from <= *t2 && faults[i].lost_at.is_none_or(|l| l <= *t2))
                .collect();
            let arbiter = arbitered.contains(envelope);
            let bound = handler_concurrency(h, r1.as_deref(), *t1);
            let free = candidates
                .iter()
                .copied()
                .filter(|_| !arbiter)
                .find(|&i| used.get(&(faults[i].budget, r1.clone())).copied().unwrap_or(0) < bound);
            // Corroboration of THIS re-run: the replica that ran it logged `inbox.reprocessed`
            // for the envelope right after it (the line follows the stamp), once per re-run.
            let r2 = pair[1].1.as_deref();
            // (The line follows the re-run's own stamp, which may have been retried.)
            let reported_by = stamp_due(&retries, envelope, *t2, u64::MAX, r2);
            let report = reprocessed.get(envelope).and_then(|reports| {
                reports.iter().position(|(t, r, spent)| {
                    !spent && r2.is_none_or(|r2| r2 == r) && (t2.saturating_sub(WINDOW_SLACK_MS)..=reported_by).contains(t)
                })
            });
            let corroborated = report.is_some();
            match (free, corroborated) {
                (Some(i), true) => {
                    *used.entry((faults[i].budget, r1.clone())).or_default() += 1;
                    reprocessed.get_mut(envelope).expect("found above")[report.expect("corroborated")].2 = true;
                    attributed += 1;
                    v.witness(format!(
                        "envelope {envelope} ran on {on} @{t1}ms and again @{t2}ms after {}; the inbox reported the reprocess (#1180 window)",
                        faults[i].label
                    ));
                }
                (free, corroborated) => {
                    unattributed += 1;
                    let second = &pair[1];
                    // Whose duplicate: the second run's replica alone when it keeps an inbox
                    // and an earlier run of this envelope went through an inbox too (its own
                    // dedup failed); otherwise both runs' replicas (one skipped the inbox).
                    let with_inbox = |r: &Option<String>, t: u64| {
                        r.as_deref().and_then(|r| h.compat_at(r, t)).is_some_and(|c| !c.iter().any(|m| m == "pre-d2"))
                    };
                    let earlier_inbox = runs.iter().take_while(|(t, _)| t < &second.0).any(|(t, r)| with_inbox(r, *t));
                    let runs_blamed: Vec<(&Option<String>, u64)> = if with_inbox(&second.1, second.0) && earlier_inbox {
                        vec![(&second.1, second.0)]
                    } else {
                        vec![(r1, *t1), (&second.1, second.0)]
                    };
                    let mut tags = Vec::new();
                    for (r, t) in runs_blamed {
                        if let Some(r) = r.as_deref() {
                            tags.extend(culprit_tags(r, h.compat_at(r, t)));
                        }
                    }
                    // And every fault in force at some point between the two runs that can
                    // make the broker redeliver to the first run's replica: one of that
                    // replica (a crash or cut before its ack) or of a server. Another
                    // replica's fault is not a cause.
                    tags.extend(
                        windows
                            .iter()
                            .filter(|(tag, from, to)| {
                                *from <= second.0
                                    && to.saturating_add(WINDOW_SLACK_MS) >= *t1
                                    && fault_replica(tag).is_none_or(|f| Some(f) == r1.as_deref())
                            })
                            .map(|(tag, ..)| tag.clone()),
                    );
                    // And a fault of the PRODUCING service's replicas (the crash between
                    // publish and stamp that re-published it) that began after the write and
                    // before the second run: when the consumer lags, the first run comes after
                    // that fault has healed.
                    // Only a fault that can re-publish (see `republishers`), and only one
                    // that began before the envelope's first stamp: once stamped, the outbox
                    // never publishes it again.
                    let first_stamp = stampers.get(envelope).and_then(|s| s.first());
                    let since = referral_of.get(envelope).and_then(|r| written.get(r)).copied();
                    if let (Some((stamped, by)), Some(since)) = (first_stamp, since) {
                        let producer = service_of(by);
                        let until = second.0.min(stamped.saturating_add(WINDOW_SLACK_MS));
                        // One re-publish is one extra delivery: a fault explains at most one
                        // duplicate of an envelope.
                        for (i, (tag, from)) in republish.iter().enumerate() {
                            if (since..=until).contains(from)
                                && fault_replica(tag).is_some_and(|r| service_of(r) == producer)
                                && republished.insert((*envelope, i))
                            {
                                tags.push(tag.clone());
                            }
                        }
                    }
                    v.blame(tags);
                    let why = if arbiter {
                        "an arbiter-backed consumer (#1179) must absorb every re-run itself: the #1180 window excuses nothing here".to_owned()
                    } else if candidates.is_empty() {
                        format!("no crash of {on}, database kill/pause/partition/failover, cut of its database link, or cut of the standby's replication link under synchronous replication with a failover during it, while the first run's stamp was due ({STAMP_DUE_MS} ms after it, or {STAMP_PENDING_MS} ms after its inbox's first inbox.stamp_retry)")
                    } else if free.is_none() {
                        format!("the only fault in its window ({}) already excused {bound} re-execution(s) of {on}, its consume session's concurrency", faults[faults[candidates[0]].budget].label)
                    } else {
                        debug_assert!(!corroborated);
                        "the inbox reported no reprocess of it (not a re-run of an unstamped envelope)".to_owned()
                    };
                    let again = match second.1.as_deref() {
                        Some(r) => format!("again on {} @{t2}ms", running(r, h.compat_at(r, *t2))),
                        None => format!("again @{t2}ms"),
                    };
                    let first = match r1.as_deref() {
                        Some(r) => running(r, h.compat_at(r, *t1)),
                        None => on.to_owned(),
                    };
                    v.witness(format!("envelope {envelope} took effect on {first} @{t1}ms and {again}: {why}; {}", h.fault_near(*t2)));
                }
            }
        }
    }
    // Issue 22.3: every side effect, not only the one the arbiter guards. Per placement
    // period, financial's payment.created rows and partner transmissions are staged iff a
    // payment was inserted: exactly as many of each as payments. (A doubled PAYMENT is the
    // arbiter's finding above; this is what an absorb path staging again leaves.)
    let mut ledger_mismatches = 0;
    for e in h.iter() {
        if let Event::PaymentLedger { placement, period, payments, created_events, transmissions } = &e.event {
            for (what, n) in [("payment.created event(s)", created_events), ("partner transmission(s)", transmissions)] {
                if n != payments {
                    ledger_mismatches += 1;
                    unattributed += 1;
                    let mut tags = vec!["kind:unmatched_side_effect".to_owned()];
                    tags.extend(service_culprits(h, "financial"));
                    v.blame(tags);
                    v.witness(format!("placement {placement} period {period}: {payments} payment(s) but {n} {what} staged (each is staged iff its payment was inserted)"));
                }
            }
        }
    }
    v.count("ledger_mismatches", ledger_mismatches);
    // Issue 26: the partner's own record. A placement period the partner got two
    // transmissions of (two correlation ids: two payments of one per-diem) where financial's
    // database no longer holds one of them: the database forgot a job it had sent, and the
    // redelivery re-ran the payment (its inbox record forgotten with it). Where the database
    // holds every one, the doubled payment or the extra job is in the ledger above.
    let held: Option<HashSet<Uuid>> = h.iter().find_map(|e| match &e.event {
        Event::SendJobsHeld { correlations } => Some(correlations.iter().copied().collect()),
        _ => None,
    });
    let mut forgotten_transmissions = 0;
    if let Some(held) = held {
        // The send queue's transport cap: a job the database forgot was claimed before the
        // failover (after it, there was no row to claim), and its POST ends within the cap.
        let cap_ms = h.iter().find_map(|e| if let Event::SendQueue { cap_ms, .. } = e.event { Some(cap_ms) } else { None });
        let mut at_partner: BTreeMap<(Uuid, &str), Vec<(u64, Uuid)>> = BTreeMap::new();
        for e in h.iter() {
            if let Event::PartnerTransmission { correlation, placement, period } = &e.event {
                let sent = at_partner.entry((*placement, period.as_str())).or_default();
                if !sent.iter().any(|(_, c)| c == correlation) {
                    sent.push((e.t_ms, *correlation));
                }
            }
        }
        for ((placement, period), sent) in &at_partner {
            if sent.len() < 2 {
                continue;
            }
            for (t, correlation) in sent.iter().filter(|(_, c)| !held.contains(c)) {
                forgotten_transmissions += 1;
                unattributed += 1;
                // Its job committed before the partner got it: a failover can have lost it
                // only if the standby had not applied up to that POST, and only a failover
                // at most the send cap before it (the job was claimed before the failover).
                let from = t.saturating_sub(cap_ms.unwrap_or(SEND_CAP_MS) + FAILOVER_CLOCK_SLACK_MS);
                let (failover, said) = failover_forgot(h, from, Some(*t));
                let mut tags = vec!["kind:forgotten_transmission".to_owned()];
                if failover.is_empty() {
                    tags.extend(service_culprits(h, "financial"));
                } else {
                    tags.extend(failover);
                }
                v.blame(tags);
                v.witness(format!(
                    "placement {placement} period {period}: the partner got {} transmissions (correlations {}); {correlation}, received @{t}ms, is a send job financial's database no longer holds{said}",
                    sent.len(),
                    sent.iter().map(|(_, c)| c.to_string()).collect::<Vec<_>>().join(", ")
                ));
            }
        }
    }
    v.count("forgotten_transmissions", forgotten_transmissions);
    // Issue 26, rules' side: the harness's own copy of every rule.evaluated (the
    // evaluations tap). A source envelope evaluated twice where rules' database no longer
    // holds one evaluation's outbox row: the database forgot an evaluation it had published
    // (its rule_evaluations row and inbox record with it), and the redelivery ran the rule
    // again, which rule_evaluations alone (one row) cannot show. Where the database holds
    // both, the doubled row is the duplicate above.
    let mut evaluated: BTreeMap<Uuid, Vec<(u64, Uuid, Uuid)>> = BTreeMap::new();
    let mut rules_staged: HashSet<Uuid> = HashSet::new();
    for e in h.iter() {
        match &e.event {
            Event::EvaluationPublished { envelope, source, referral } => {
                let runs = evaluated.entry(*source).or_default();
                // One envelope published twice (an outbox re-publish) is one evaluation.
                if !runs.iter().any(|(_, x, _)| x == envelope) {
                    runs.push((e.t_ms, *envelope, *referral));
                }
            }
            Event::Staged { envelope, service, .. } if service == "rules" => {
                rules_staged.insert(*envelope);
            }
            _ => {}
        }
    }
    let mut forgotten_evaluations = 0;
    for (source, runs) in &evaluated {
        if runs.len() < 2 {
            continue;
        }
        for (t, envelope, referral) in runs.iter().filter(|(_, x, _)| !rules_staged.contains(x)) {
            forgotten_evaluations += 1;
            unattributed += 1;
            // It committed on the primary before the failover (else the promoted server
            // would hold it), no earlier than it occurred and no later than a replica logged
            // claiming it from its outbox or stamping it published (the claim finds only a
            // committed row; the stamp follows the confirm, which follows the claim: the
            // primary can die between the confirm and the stamp, so the claim alone
            // corroborates too; with neither line nothing corroborates a late commit, and
            // nothing is excused): a failover forgot it only if it came after the first and
            // its standby had not applied up to the second. Never up to
            // `occurred_at` alone: rules sets it before its commit, which can land much later
            // on a loaded machine. rules' own time, so held to the harness's own record:
            // never before the referral's first write was sent (an impossible time, or one
            // of a referral the harness never wrote, excuses nothing).
            let possible = written.get(referral).is_some_and(|w| *t + FAILOVER_CLOCK_SLACK_MS >= *w);
            // And no stamp or claim line after the promoted standby took the address: each is
            // logged only for a row its UPDATE found, so the promoted server held it.
            let (committed_by, last_line) = lines.get(envelope).copied().unzip();
            let (failover, said) = if let Some(by) = committed_by.filter(|_| possible) {
                failover_forgot_before(h, t.saturating_sub(FAILOVER_CLOCK_SLACK_MS), Some(by), last_line)
            } else {
                (vec![], String::new())
            };
            let mut tags = vec!["kind:forgotten_evaluation".to_owned()];
            if failover.is_empty() {
                tags.extend(service_culprits(h, "rules"));
            } else {
                tags.extend(failover);
            }
            v.blame(tags);
            v.witness(format!(
                "source envelope {source} was evaluated {} times by the harness's own record (rule.evaluated {}); {envelope}, occurred @{t}ms, is an evaluation rules' database no longer holds{said}",
                runs.len(),
                runs.iter().map(|(_, x, _)| x.to_string()).collect::<Vec<_>>().join(", ")
            ));
        }
    }
    v.count("forgotten_evaluations", forgotten_evaluations);
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

/// Faults of a producer replica that can make its outbox publish an envelope a second time
/// (ADR #1128: published, not stamped, re-claimed after the lease): a crash at
/// `outbox::after_publish_before_stamp` (a crash at another point cannot: before the publish
/// nothing went out, the inbox points are the consumer's), a kill or pause at any point, a
/// cut or toxic on its links (a lost confirm, a failed stamp). As `(culprit tag, start)`.
pub(super) fn republishers(h: &History) -> Vec<(String, u64)> {
    h.iter()
        .filter_map(|e| match &e.event {
            Event::Fault { kind, target, phase: Phase::Start } => {
                let can = match kind.as_str() {
                    "crash" => target.split_once(" at ").is_none_or(|(_, p)| p == "outbox::after_publish_before_stamp"),
                    "kill" | "pause" | "toxic" | "down" => true,
                    _ => false,
                };
                let base = target.split(" (").next().unwrap_or(target);
                let base = base.split(" at ").next().unwrap_or(base);
                let tag = format!("fault:{kind} {base}");
                (can && fault_replica(&tag).is_some()).then_some((tag, e.t_ms))
            }
            _ => None,
        })
        .collect()
}
