//! `sentinel_integrity`, ADR-022 §D5 with #1182/#1183/#1184/#1194: one handler run per key and query, no emptied rows, every byte a client read is its request's, every key answered after the heal. Excused: the claim-expiry residue (a winner that crashed, or whose finalize failed under a fault cutting it off its database), only as the harness and the database record it (the crash or the fault, the attempt it served, a generation that never left `processing` and one re-claimed only after that claim expired).

use super::*;

/// Whether fault `tag` (labelled `label` in the report, in force at the answer) leaves
/// `replica` without its database: the server killed or paused, this replica's own link to it
/// down, or a toxic on that link that breaks its connections (`timeout`, `reset_peer`,
/// `limit_data`) or slows every answer (`latency`, `bandwidth`: each request then holds its
/// pooled connection longer, and under load the requests queued behind outwait the node's
/// 5 s acquire timeout and honestly answer 503; how much load that takes is the machine's,
/// so no delay is too small to excuse). A toxic that leaves the answers' timing alone
/// (`slicer`, which only cuts the bytes into pieces, `slow_close`, which only delays a
/// close), a fault that leaves the server answering (`refuse_staging`, which refuses inserts
/// an export never makes; `terminate`, which cuts only the connections its
/// `application_name` names, never the request pool's) or one on another replica's link
/// excuses no 503.
fn cuts_off_database(tag: &str, label: &str, replica: &str) -> bool {
    let own_link = |link: &str| link.strip_prefix(replica) == Some("->database");
    match tag.strip_prefix("fault:").and_then(|t| t.split_once(' ')) {
        Some(("kill" | "pause" | "partition", "database")) => true,
        Some(("down", link)) => own_link(link),
        Some(("toxic", link)) if own_link(link) => {
            let what = label.split_once(" (").map_or("", |(_, rest)| rest.trim_end_matches(')'));
            matches!(what.split_whitespace().next(), Some("timeout" | "reset_peer" | "limit_data" | "latency" | "bandwidth"))
        }
        _ => false,
    }
}

/// Whether fault `tag` can lose the answer to a statement `replica` had already sent, so
/// that its work committed though the handler heard an error: the database killed (after the
/// commit, before the answer) or partitioned (on containers its connections are aborted; on
/// local the links are held, which loses nothing, but the verdict does not know the backend), this
/// replica's own link down, or a toxic on it that breaks its connections (`timeout`,
/// `reset_peer`, `limit_data`). A pause or a slowed link delivers the answer late, never
/// loses it: a 503 under one is a pool that gave no connection, and
/// nothing was sent.
fn loses_answers(tag: &str, label: &str, replica: &str) -> bool {
    let own_link = |link: &str| link.strip_prefix(replica) == Some("->database");
    match tag.strip_prefix("fault:").and_then(|t| t.split_once(' ')) {
        Some(("kill" | "partition", "database")) => true,
        Some(("down", link)) => own_link(link),
        Some(("toxic", link)) if own_link(link) => {
            let what = label.split_once(" (").map_or("", |(_, rest)| rest.trim_end_matches(')'));
            matches!(what.split_whitespace().next(), Some("timeout" | "reset_peer" | "limit_data"))
        }
        _ => false,
    }
}

/// Whether a fault of `spans` (`History::fault_spans`) cut `replica` off its database at
/// `t` (`cuts_off_database`, with the windows' slack).
fn cut_off_at(spans: &[(String, String, u64, u64)], replica: &str, t: u64) -> bool {
    spans.iter().any(|(tag, label, from, to)| {
        from.saturating_sub(WINDOW_SLACK_MS) <= t && t <= to.saturating_add(WINDOW_SLACK_MS) && cuts_off_database(tag, label, replica)
    })
}

/// One attempt of a key and size to a replica: when it was sent, whether it got no
/// (complete) answer, and whether a handler run could have served it (no answer at all, or
/// a live 200: a replay whose body was cut is unanswered, yet no run served it).
struct Attempt {
    sent: u64,
    no_answer: bool,
    servable: bool,
}

/// §D5 as the clients and the database saw it (`kind = "exports"`):
///
/// - **runs**: the handler ran at most once per key and query (`exports` rows by key and
///   size). The one excuse is the ADR's residue: a winner that died after its handler
///   committed leaves its claim to expire, and the retry re-claims and runs again. A re-run
///   is excused only as the system itself records it: the earlier run's replica (the
///   `exports` row names it) crashed between the two runs, an attempt of this very request
///   (key, size) to that replica, sent before the run committed and before the crash, got
///   no answer (one re-run excused per key, size and replica), and
///   the later run holds a newer claim generation, the one the row ended on. §D5's other
///   residue, a sentinel finalize that itself fails, is excused the same way when a fault
///   cut the run's replica off its database at the run's commit (`cut_off_at`) and an
///   attempt it could have served (unanswered; a live 200, since a failed finalize still
///   relays the body; or a 503 under a fault that loses answers (`loses_answers`), since an
///   INSERT whose acknowledgement was lost committed all the same) went out before the run. Both only as the database recorded it
///   (`Event::ClaimVersion`, the harness's trigger): the first run's generation never left
///   `processing`, and the re-run's was claimed no sooner than that claim expired.
///   Anything else is `kind:executed_twice`.
/// - **rows**: no `succeeded` row has an empty body unless its handler's body was empty
///   (`kind:emptied_body`, #1183's poisoned rows).
/// - **answers**: every 200 a client read whole carries exactly the bytes the handler
///   produces for ITS request (`size`): the live winner's full body (`kind:wrong_live`),
///   a replay's stored body (`kind:wrong_replay`; #1184's wrong cached response shows
///   here), or the sentinel (`Idempotency-Body-Too-Large`, empty) only on a replay of an
///   over-cap body (`kind:false_sentinel`). Clients that went away on purpose are not
///   judged on bytes; a 409 must carry `Retry-After` (`kind:no_retry_after`), a 503 is
///   excused only inside the window of a fault that cuts the replica off its database (the
///   server killed, paused or partitioned, the replica's own link down or toxic; counted), and any other
///   status than 200 or 409 is `kind:unexpected_status`.
pub fn sentinel_integrity(h: &History) -> Verdict {
    let mut v = Verdict::new("sentinel_integrity");
    let cap = craig_api::idempotency::RESPONSE_BODY_CAP as u64;
    let mut expected: HashMap<u64, String> = HashMap::new();
    let mut hash_of = |n: u64| {
        expected.entry(n).or_insert_with(|| craig_api::idempotency::body_fingerprint(&craig_fleet::cases::export_body(n as usize))).clone()
    };
    let (mut judged, mut live, mut replays, mut sentinels, mut cancelled, mut unanswered, mut in_flight) = (0, 0, 0, 0, 0, 0, 0);
    // A 503 is the honest answer while the replica's database is out of reach (killed,
    // paused, its link cut: `cuts_off_database`): excused only inside such a fault's window, by the harness's
    // own record of it; the key must still end answered (`never_answered` below).
    let spans = h.fault_spans();
    let mut unavailable = 0;
    // (key, size, replica) of every attempt that went unanswered or that a handler run
    // could have served ([`Attempt`]). Servable: no answer at all (the client gone or not),
    // a live (not replayed) 200, or a 503 while a fault cut the replica off its database. A finalize that fails after the handler committed
    // still serves the live answer (the middleware logs `idempotency.finalize_unknown` and
    // relays the body), so §D5's finalize residue may follow an answered attempt; a crash's
    // residue asks for an unanswered one.
    let mut attempts: HashMap<(&str, u64, &str), Vec<Attempt>> = HashMap::new();
    for e in h.iter() {
        let Event::HttpExchange { key, size, replica, status, replayed, too_large, body_len, body_sha256, cancelled: gone, retry_after } = &e.event
        else {
            continue;
        };
        let compat = h.compat_at(replica, e.t_ms);
        let no_answer = (status.is_none() || (*status == Some(200) && body_sha256.is_none())) && !*gone;
        // A 503 under a fault that loses answers may have been served too: the handler's
        // INSERT can commit with its acknowledgement lost, and the handler then answers 503
        // marked `OutcomeUnknown`, which keeps the claim `processing` (`loses_answers`).
        let loses = spans.iter().any(|(tag, label, from, to)| {
            from.saturating_sub(WINDOW_SLACK_MS) <= e.t_ms && e.t_ms <= to.saturating_add(WINDOW_SLACK_MS) && loses_answers(tag, label, replica)
        });
        let servable = status.is_none() || (*status == Some(200) && !*replayed) || (*status == Some(503) && loses);
        if replica != "none" && (no_answer || servable) {
            attempts.entry((key.as_str(), *size, replica.as_str())).or_default().push(Attempt { sent: e.t_ms, no_answer, servable });
        }
        let kind = match (status, body_sha256) {
            (None, _) if replica == "none" => continue,
            (None, _) | (Some(200), None) if !*gone => {
                unanswered += 1;
                continue;
            }
            (Some(409), _) => {
                in_flight += 1;
                if retry_after.is_some() {
                    continue;
                }
                "no_retry_after"
            }
            (Some(200), _) if *gone => {
                cancelled += 1;
                continue;
            }
            (Some(200), Some(got)) => {
                judged += 1;
                if *too_large {
                    if *replayed && *body_len == 0 && *size > cap {
                        sentinels += 1;
                        replays += 1;
                        continue;
                    }
                    "false_sentinel"
                } else {
                    if *replayed {
                        replays += 1;
                    } else {
                        live += 1;
                    }
                    if *got == hash_of(*size) {
                        continue;
                    }
                    if *replayed { "wrong_replay" } else { "wrong_live" }
                }
            }
            (Some(503), _) if cut_off_at(&spans, replica, e.t_ms) =>
            {
                unavailable += 1;
                continue;
            }
            (Some(_), _) => "unexpected_status",
            (None, _) => continue,
        };
        let mut tags = vec![format!("kind:{kind}")];
        tags.extend(culprit_tags(replica, compat));
        v.blame(tags);
        v.witness(match kind {
            "no_retry_after" => format!("{} answered key {key} 409 without Retry-After @{}ms", running(replica, compat), e.t_ms),
            "unexpected_status" => format!("{} answered key {key} (size={size}) {} @{}ms", running(replica, compat), status.unwrap_or(0), e.t_ms),
            _ => format!(
                "{} answered key {key} (size={size}) @{}ms with {body_len} bytes ({}{}), not the {size} bytes its handler produces ({kind})",
                running(replica, compat),
                e.t_ms,
                if *replayed { "replayed" } else { "live" },
                if *too_large { ", as the too-large sentinel" } else { "" },
            ),
        });
    }
    // The generation each cache key's row ended on, and the runs per (key, size).
    let final_generation: HashMap<&str, i64> = h
        .iter()
        .filter_map(|e| if let Event::IdempotencyRow { cache_key, generation, .. } = &e.event { Some((cache_key.as_str(), *generation)) } else { None })
        .collect();
    let mut runs: BTreeMap<(&str, u64), Vec<(u64, Option<i64>, Option<&str>, Option<&str>)>> = BTreeMap::new();
    let mut size_of_cache_key: HashMap<&str, u64> = HashMap::new();
    for e in h.iter() {
        if let Event::ExportRun { key: Some(key), cache_key, size, generation, replica, .. } = &e.event {
            runs.entry((key.as_str(), *size)).or_default().push((e.t_ms, *generation, replica.as_deref(), cache_key.as_deref()));
            if let Some(ck) = cache_key {
                size_of_cache_key.insert(ck.as_str(), *size);
            }
        }
    }
    // Every claim generation of every cache key as the database wrote it (the harness's
    // trigger, `Event::ClaimVersion`): when it was claimed, when that claim expires, and
    // whether a finalize ever applied to it (any version under it not `processing`).
    let mut claims: HashMap<(&str, i64), (u64, Option<u64>, bool)> = HashMap::new();
    for e in h.iter() {
        if let Event::ClaimVersion { cache_key, generation, status, claim_expires_ms } = &e.event {
            let c = claims.entry((cache_key.as_str(), *generation)).or_insert((e.t_ms, *claim_expires_ms, false));
            if status == "processing" {
                if e.t_ms < c.0 {
                    (c.0, c.1) = (e.t_ms, *claim_expires_ms);
                }
            } else {
                c.2 = true;
            }
        }
    }
    let crashes: Vec<(u64, &str)> =
        h.iter().filter_map(|e| if let Event::Crash { replica, .. } = &e.event { Some((e.t_ms, replica.as_str())) } else { None }).collect();
    let (mut total_runs, mut excused) = (0, 0);
    let mut used: HashSet<(&str, u64, &str)> = HashSet::new();
    for ((key, size), list) in &mut runs {
        list.sort_by_key(|r| r.0);
        total_runs += list.len();
        for pair in list.windows(2) {
            let ((t1, g1, r1, ck), (t2, g2, ..)) = (pair[0], pair[1]);
            // The residue, as the system records it: the first run's replica crashed between
            // the two runs, an attempt of this very request to it got no answer, and the
            // second run holds a newer claim generation that the row ended on (or newer).
            // The unanswered attempt is the one this run served: sent before the run
            // committed and before the crash (one sent to the replica while it was down was
            // refused, and says nothing about a lost answer).
            //
            // §D5's other residue ("if the sentinel finalize ITSELF fails the row stays
            // processing and claim-expiry recovery can still re-execute"): the run committed
            // while a fault cut its replica off the database (the finalize follows the commit
            // at once), and the attempt it served went out before the run (answered live or
            // not: a failed finalize still relays the handler's body).
            //
            // Either way the database must say so too: the first run's generation never
            // left `processing` (no finalize applied to it: the winner died, or its finalize
            // failed), and the re-run's generation was claimed no sooner than that claim
            // expired (a sooner re-claim is a fencing bug, never the residue).
            let stranded = ck.is_some_and(|c| match (g1.and_then(|g| claims.get(&(c, g))), g2.and_then(|g| claims.get(&(c, g)))) {
                (Some((_, Some(expires), finalized)), Some((reclaimed, ..))) => !finalized && reclaimed >= expires,
                _ => false,
            });
            let sent_by = |r: &str, which: fn(&Attempt) -> bool, before: u64| {
                attempts.get(&(*key, *size, r)).is_some_and(|sent| {
                    sent.iter().any(|a| which(a) && a.sent <= t1.saturating_add(WINDOW_SLACK_MS) && a.sent <= before)
                })
            };
            let unanswered_by = |r: &str, before: u64| sent_by(r, |a| a.no_answer, before);
            let served_by = |r: &str| sent_by(r, |a| a.servable, u64::MAX);
            let residue = r1.is_some_and(|r| {
                let crashed = crashes.iter().any(|(t, c)| *c == r && t1 <= t.saturating_add(WINDOW_SLACK_MS) && *t <= t2 && unanswered_by(r, *t));
                let cut_off = cut_off_at(&spans, r, t1) && served_by(r);
                (crashed || cut_off) && !used.contains(&(*key, *size, r))
            }) && stranded
                && matches!((g1, g2), (Some(a), Some(b)) if b > a)
                && ck.and_then(|c| final_generation.get(c)).is_none_or(|f| Some(*f) >= g2);
            if residue {
                excused += 1;
                used.insert((*key, *size, r1.expect("checked")));
                continue;
            }
            let mut tags = vec!["kind:executed_twice".to_owned()];
            tags.extend(service_culprits(h, "cases"));
            v.blame(tags);
            v.witness(format!(
                "the export handler ran again for key {key} (size={size}) @{t2}ms, after a run @{t1}ms on {} (claim generations {:?} then {:?}): a retry re-executed committed work",
                r1.unwrap_or("?"),
                g1,
                g2
            ));
        }
    }
    let mut emptied = 0;
    for e in h.iter() {
        if let Event::IdempotencyRow { cache_key, status, body_len: Some(0), body_too_large: false, .. } = &e.event {
            if let Some(size) = size_of_cache_key.get(cache_key.as_str()).filter(|n| **n > 0 && status == "succeeded") {
                emptied += 1;
                let mut tags = vec!["kind:emptied_body".to_owned()];
                tags.extend(service_culprits(h, "cases"));
                v.blame(tags);
                v.witness(format!("row {cache_key} is succeeded with an EMPTY body, its handler produced {size} bytes (not the sentinel)"));
            }
        }
    }
    // Issue 22.6: no answer is not "held". Every (key, size) the clients asked for must end
    // with a 200 read whole after the faults healed (the workload retries each one then);
    // a key kept at 409 (a claim that never expires, a row stuck `processing`) or never
    // answered is a violation.
    let healed = h.iter().find(|e| matches!(e.event, Event::Healed)).map_or(0, |e| e.t_ms);
    let mut asked: BTreeMap<(&str, u64), bool> = BTreeMap::new();
    for e in h.iter() {
        let Event::HttpExchange { key, size, replica, status, body_sha256, cancelled: gone, .. } = &e.event else { continue };
        let answered = asked.entry((key.as_str(), *size)).or_default();
        if replica != "none" && e.t_ms >= healed && *status == Some(200) && body_sha256.is_some() && !*gone {
            *answered = true;
        }
    }
    let mut never = 0;
    for ((key, size), answered) in &asked {
        if !answered {
            never += 1;
            let mut tags = vec!["kind:never_answered".to_owned()];
            tags.extend(service_culprits(h, "cases"));
            v.blame(tags);
            v.witness(format!("key {key} (size={size}) never got a 200 read whole after every fault healed"));
        }
    }
    v.count("never_answered", never);
    v.count("answers_judged", judged);
    v.count("live", live);
    v.count("replays", replays);
    v.count("sentinels_replayed", sentinels);
    v.count("cancelled", cancelled);
    v.count("unanswered", unanswered);
    v.count("unavailable_during_database_fault", unavailable);
    v.count("in_flight_409", in_flight);
    v.count("handler_runs", total_runs);
    v.count("reexecuted_after_claim_expiry", excused);
    v.count("emptied_rows", emptied);
    v.settle(judged == 0, "nothing to check: no client read an export answer whole (kind = \"exports\" makes them)")
}
