//! `fencing`, ADR-022 #1185 send-queue fencing: no transmission POSTed twice while a lease was live, no job with both outcomes, no terminal flip but `failed -> pending`. Excused: a fenced retry after a 500, a re-send after the lease (at-least-once) and a re-send of a claim an async failover forgot (issue 26, corroborated by the senders and the database: the generation issued again).

use super::*;

/// The send-jobs claim lease (#1185): a second POST of one transmission sooner than this
/// after an accepted one was made while the first claim's lease was live. (A run that
/// shortened it says so with `Event::SendQueue`.)
pub const SEND_LEASE_MS: u64 = craig_fleet::send_jobs::CLAIM_LEASE_SECS * 1000;
/// The per-send transport cap: a POST the partner never answered ends for its sender then.
pub const SEND_CAP_MS: u64 = craig_fleet::send_jobs::SEND_TIMEOUT_SECS * 1000;

/// The send queue's fencing (§ Amendment #1185), from the partner's record, financial's
/// staged events and the transaction status changes:
/// - no transmission POSTed twice while a lease was live (unless the first POST's sender
///   logged its fenced retry in between, `send_jobs.finalized` failed + applied: its claim was
///   over, whenever the partner recorded the POST; excused only where financial's database
///   also shows that claim generation put back in the queue as a retry in that span): a
///   POST answered 409 (it arrived
///   while the partner was still processing the same `craig_correlation_id`), or one sooner
///   than [`SEND_LEASE_MS`] after the same transmission was accepted (or sooner than
///   [`SEND_CAP_MS`] after a POST the partner never answered), each POST held against the
///   last one not refused as a duplicate. A POST after one answered
///   500 is the sender's fenced retry, never a violation; a re-send after the lease expired
///   is the ADR's at-least-once, never a violation; so is a re-send of a claim an async
///   failover forgot (issue 26: the failover between the two POSTs, its standby behind the
///   first, both senders current and finalizing the same claim generation before the
///   failover and after it, and the surviving database holding that generation's claim made
///   after the failover only; counted `resent_after_forgotten_claim`);
/// - no send job with both `exchange.sent` and `exchange.failed`;
/// - no transaction leaving a terminal status (`sent`, `failed`) other than
///   `failed → pending`.
///
/// Double POSTs are blamed on both senders (the `craig-replica` header) with the behaviour
/// each ran then and the faults on the re-sender; conflicting events on the replicas that
/// staged them; a flip (the trigger cannot say who wrote it) on every financial replica.
pub fn fencing(h: &History) -> Verdict {
    let mut v = Verdict::new("fencing");
    let windows = h.fault_windows();
    let mut posts: BTreeMap<Uuid, Vec<(u64, Option<&str>, u16)>> = BTreeMap::new();
    // POSTs the partner took whose sender never got the answer (status 0 below): like a hung
    // one, their sender's next POST is its retry once its cap ran out.
    let mut unanswered: HashMap<Uuid, Vec<u64>> = HashMap::new();
    // The senders' own word: a failed send whose fenced retry applied ended that claim;
    // and the database's: the job went back from in_flight to pending then.
    let mut retried: HashMap<Uuid, Vec<(u64, &str, Option<i64>)>> = HashMap::new();
    let mut released_at: HashMap<Uuid, Vec<(u64, i64)>> = HashMap::new();
    // Every finalize a sender logged with its claim generation and result, every claim the
    // surviving database holds (from and to which generation), and every async failover
    // (issue 26): a claim the promoted standby never applied is forgotten, and the next claim
    // of the job is issued the same generation again.
    let mut finalized: HashMap<Uuid, Vec<(u64, &str, i64, &str)>> = HashMap::new();
    let mut claimed: HashMap<Uuid, Vec<(u64, i64, i64)>> = HashMap::new();
    let failovers: Vec<(u64, Option<u64>, u64)> = h
        .iter()
        .filter_map(|e| match &e.event {
            Event::Failover { replayed_until_ms, mode, promoted_ms } if mode == "async" => Some((e.t_ms, *replayed_until_ms, promoted_ms.unwrap_or(e.t_ms))),
            _ => None,
        })
        .collect();
    for e in h.iter() {
        if let Event::SendFinalized { correlation, replica, applied: true, generation: Some(g), result } = &e.event {
            finalized.entry(*correlation).or_default().push((e.t_ms, replica.as_str(), *g, result.as_str()));
        }
        if let Event::SendClaimed { correlation, from_generation, generation } = &e.event {
            claimed.entry(*correlation).or_default().push((e.t_ms, *from_generation, *generation));
        }
        match &e.event {
            Event::PartnerUnanswered { correlation } => unanswered.entry(*correlation).or_default().push(e.t_ms),
            Event::SendFinalized { correlation, replica, result, applied: true, generation } if result == "failed" => {
                retried.entry(*correlation).or_default().push((e.t_ms, replica.as_str(), *generation))
            }
            Event::SendReleased { correlation, generation } => released_at.entry(*correlation).or_default().push((e.t_ms, *generation)),
            _ => {}
        }
    }
    let mut all_posts = 0;
    let mut outcomes: BTreeMap<Uuid, Vec<(&str, Option<&str>, u64)>> = BTreeMap::new();
    let mut flips = 0;
    for e in h.iter() {
        match &e.event {
            Event::PartnerPost { correlation, replica, status } => {
                all_posts += 1;
                if let Some(c) = correlation {
                    posts.entry(*c).or_default().push((e.t_ms, replica.as_deref(), *status));
                }
            }
            Event::Exchanged { job, outcome, replica, .. } => outcomes.entry(*job).or_default().push((outcome.as_str(), replica.as_deref(), e.t_ms)),
            Event::TransactionStatus { transaction, from, to } => {
                let terminal = |s: &str| s == "sent" || s == "failed";
                if terminal(from) && !(from == "failed" && to == "pending") {
                    flips += 1;
                    let mut tags = vec!["kind:terminal_flip".to_owned()];
                    tags.extend(service_culprits(h, "financial"));
                    v.blame(tags);
                    v.witness(format!("transaction {transaction} went {from} -> {to} @{}ms: a terminal status left other than failed -> pending", e.t_ms));
                }
            }
            _ => {}
        }
    }
    // The send queue's timing in this run (production's unless the scenario shortened it).
    let (lease_ms, cap_ms) = h
        .iter()
        .find_map(|e| if let Event::SendQueue { lease_ms, cap_ms } = e.event { Some((lease_ms, cap_ms)) } else { None })
        .unwrap_or((SEND_LEASE_MS, SEND_CAP_MS));
    let (mut double, mut resent_after_lease, mut resent_after_forgotten_claim) = (0, 0, 0);
    // Issue 26: the second POST re-sent a claim an async failover forgot. The failover came
    // after the first POST, the second came after the promotion (no claim is made before
    // it), the standby had not applied up to the first POST (a claim precedes its POST), and
    // both the senders and the database corroborate it: the first sender (current
    // behaviour, which bumps the generation at each claim) finalized its send accepted
    // under generation g before the failover, the second (current too) finalized under the
    // same g after its POST, and the database that survived holds that claim to g, made
    // after the failover from g - 1, and no claim to g before it. To the database the job
    // was never claimed: an identical re-send (§ #1185 at-least-once, deduplicated by
    // `craig_correlation_id`), not two workers inside one lease. Nothing is excused with
    // synchronous replication, a 409 or an older sender.
    let current = |r: Option<&str>, t: u64| r.is_some_and(|r| h.compat_at(r, t).is_some_and(<[String]>::is_empty));
    let forgotten_claim = |c: &Uuid, (t1, r1): (u64, Option<&str>), (t2, r2, s2): (u64, Option<&str>, u16)| {
        if s2 == 409 || !current(r1, t1) || !current(r2, t2) {
            return false;
        }
        let fs = finalized.get(c).map(Vec::as_slice).unwrap_or_default();
        let cs = claimed.get(c).map(Vec::as_slice).unwrap_or_default();
        failovers.iter().any(|&(tf, replayed, promoted)| {
            let reissued = |g: i64| {
                cs.iter().any(|&(tc, from, to)| to == g && from == g - 1 && tc + FAILOVER_CLOCK_SLACK_MS >= tf && tc <= t2 + FAILOVER_CLOCK_SLACK_MS)
                    && !cs.iter().any(|&(tc, _, to)| to == g && tc + FAILOVER_CLOCK_SLACK_MS < tf)
            };
            t1 < tf
                && promoted <= t2
                && replayed.is_none_or(|r| t1 + FAILOVER_CLOCK_SLACK_MS > r)
                && fs.iter().any(|&(ta, ra, ga, result)| {
                    Some(ra) == r1
                        && result == "accepted"
                        && ta >= t1
                        && ta < tf
                        && fs.iter().any(|&(tb, rb, gb, _)| Some(rb) == r2 && tb >= t2 && gb == ga)
                        && reissued(ga)
                })
        })
    };
    for (correlation, ps) in &posts {
        // Each POST against the last one that was not itself refused as a duplicate.
        let mut last: Option<(u64, Option<&str>, u16)> = None;
        // When the POST before `last` was made: a retry logged after it belongs to `last`'s
        // claim (a partner starved in a loaded harness may record a POST after its sender's
        // cap already ended it).
        let mut since = 0;
        for &(t2, r2, s2) in ps {
            let Some((t1, r1, mut s1)) = last else {
                last = Some((t2, r2, s2));
                continue;
            };
            if s1 == 200 && unanswered.get(correlation).is_some_and(|ts| ts.iter().any(|t| (t1..=t2).contains(t))) {
                s1 = 0;
            }
            // 409: the partner was still processing an earlier POST, whose sender (the
            // partner answers well inside the send cap) was still waiting on its claim. The
            // lease runs from the claim, a little before the partner saw the POST: slack.
            // The first claim ended for its sender when it logged its fenced retry (a send that
            // timed out or failed) between the two POSTs: the second is its retry, on its own
            // word — however late the partner (in a loaded harness) recorded the first.
            // Issue 22.8: on its word only where the database agrees: the job went back to
            // the queue within the same span (the sender logs just after its update commits).
            // The release must be the claim the sender says it retried: same generation.
            let until = t2.saturating_add(WINDOW_SLACK_MS);
            let db_released = |g: Option<i64>| {
                released_at.get(correlation).into_iter().flatten().any(|(d, dg)| g.is_none_or(|g| g == *dg) && d + WINDOW_SLACK_MS > since && *d <= until)
            };
            let released = retried
                .get(correlation)
                .into_iter()
                .flatten()
                .any(|(t, r, g)| Some(*r) == r1 && *t > since && *t <= until && db_released(*g));
            let live = !released
                && (s2 == 409 || (s1 == 200 && t2 + WINDOW_SLACK_MS < t1 + lease_ms) || (s1 == 0 && t2 + WINDOW_SLACK_MS < t1 + cap_ms));
            if s2 != 409 {
                since = t1;
                last = Some((t2, r2, s2));
            }
            if live && forgotten_claim(correlation, (t1, r1), (t2, r2, s2)) {
                resent_after_forgotten_claim += 1;
                continue;
            }
            if !live {
                if s1 != 500 {
                    // The ADR's at-least-once: accepted (or unanswered), re-sent once the
                    // claim's lease (or the sender's cap) was over.
                    resent_after_lease += 1;
                }
                continue;
            }
            double += 1;
            let mut tags = vec!["kind:double_post".to_owned()];
            for (r, t) in [(r1, t1), (r2, t2)] {
                match r {
                    Some(r) => tags.extend(culprit_tags(r, h.compat_at(r, t))),
                    None => tags.extend(["replica:unknown".to_owned(), "compat:unknown".to_owned()]),
                }
            }
            if let Some(r) = r2 {
                tags.extend(faults_on(&windows, r, t2));
            }
            v.blame(tags);
            let who = |r: Option<&str>, t: u64| r.map_or_else(|| "an unnamed sender".to_owned(), |r| running(r, h.compat_at(r, t)));
            v.witness(format!(
                "transmission {correlation} POSTed by {} @{t1}ms (answered {s1}) and again by {} @{t2}ms (answered {s2}) while the first claim's lease was live; {}",
                who(r1, t1),
                who(r2, t2),
                h.fault_near(t2)
            ));
        }
    }
    let mut conflicting = 0;
    for (job, os) in &outcomes {
        if os.iter().any(|o| o.0 == "sent") && os.iter().any(|o| o.0 == "failed") {
            conflicting += 1;
            let mut tags = vec!["kind:conflicting_events".to_owned()];
            for (_, r, t) in os {
                match r {
                    Some(r) => tags.extend(culprit_tags(r, h.compat_at(r, *t))),
                    None => tags.extend(service_culprits(h, "financial")),
                }
            }
            v.blame(tags);
            let staged: Vec<String> = os.iter().map(|(o, r, t)| format!("exchange.{o} by {} @{t}ms", r.unwrap_or("?"))).collect();
            v.witness(format!("send job {job} staged both outcomes: {}", staged.join(", ")));
        }
    }
    v.count("posts", all_posts);
    v.count("transmissions", posts.len());
    v.count("double_posts", double);
    v.count("resent_after_lease", resent_after_lease);
    v.count("resent_after_forgotten_claim", resent_after_forgotten_claim);
    v.count("jobs_finalized", outcomes.len());
    v.count("conflicting_events", conflicting);
    v.count("terminal_flips", flips);
    v.settle(all_posts == 0 && outcomes.is_empty(), "nothing to check: the partner got no POST and no send job was finalized")
}
