//! `dlq_occurrence_once`, ADR-022 §D3 with #1181/#1197: every occurrence that reached `craig.dlx` (the harness's own tap and derivation) has exactly one audit row, nothing is left captured, completed XOR dead-lettered, the consumer queue named (#1196), and nothing reaches it that the harness did not stage as a dead letter (`kind:unexpected_dead_letter`: a consumer gave up an event it should have handled). Excused: tokenless extra rows (#1181's bound), counted.

use super::*;

/// The causes of a lost dead letter that no replica said it acked unrecorded (issue 22.8):
/// no compat mode (nothing corroborates one), and only the faults on the recorder's
/// path (the database, the broker, a security replica, its link to the database) whose
/// window reaches past `since`, when the delivery reached `craig.dlx`.
/// A broker-path dead letter's time is its `x-death` entry's, in whole seconds: up to this
/// much earlier than it happened.
const XDEATH_ROUNDING_MS: u64 = 1_000;

pub(super) fn uncorroborated_loss(windows: &[(String, u64, u64)], since: u64) -> Vec<String> {
    let mut tags = vec!["kind:lost".to_owned(), "replica:unknown".to_owned(), "compat:unknown".to_owned()];
    tags.extend(
        windows
            .iter()
            .filter(|(tag, _, to)| {
                let target = tag.split_once(' ').map_or("", |(_, t)| t);
                // The broker too: classic-queue dead-lettering is at-most-once, so a broker
                // fault can lose a letter the tap saw and the DLQ never got.
                let on_path = match fault_replica(tag) {
                    None => target == "database" || target == "broker",
                    Some(r) => service_of(r) == "security" && (target == r || target.ends_with("->database")),
                };
                on_path && to.saturating_add(WINDOW_SLACK_MS) >= since
            })
            .map(|(tag, ..)| tag.clone()),
    );
    tags
}

/// Every dead-lettered occurrence has exactly one audit row (§D3 with #1181): none lost,
/// none doubled. The truth is the harness's tap on `craig.dlx` (`Event::DeadLettered`):
/// - a tokened occurrence (one token, however many deliveries carried it: a retried
///   surface, a DLQ redelivery) needs exactly one row: the row with its token, or one
///   tokenless/quarantine row of one of its deliveries' bytes;
/// - a tokenless delivery needs at least one row of its bytes (tokenless publishes keep
///   pre-C2 duplicate rows by the ADR's own bound: extras are counted, not violations);
/// - an audit row of bytes that never reached `craig.dlx` is a violation (a record of
///   nothing);
/// - completed XOR dead-lettered: an envelope that took effect on a consumer (rules,
///   financial) must not also be dead-lettered from that consumer's queue after it took
///   effect, unless the #1180 window shows: a replica of that consumer died after the
///   effect, and then one of its replicas re-ran the envelope (`inbox.reprocessed`) or gave
///   it up, before the dead letter (dead-lettered first and handled after is a replay);
/// - #1196: a dead letter names the consumer queue of the replica that gave it up (its
///   reject or app-path surface, from the replica's own log), on either path.
pub fn dlq_occurrence_once(h: &History) -> Verdict {
    let mut v = Verdict::new("dlq_occurrence_once");
    let mut taps_by_token: BTreeMap<String, HashSet<String>> = BTreeMap::new();
    let mut tokenless_taps: BTreeMap<String, usize> = BTreeMap::new();
    let mut tapped_keys: HashSet<String> = HashSet::new();
    // Each dead-lettered envelope and the consumer queues it was dead-lettered from.
    let mut dead_from: HashMap<Uuid, HashMap<&str, u64>> = HashMap::new();
    let mut taps = 0;
    let mut rows: Vec<(&str, Option<&str>, &str)> = Vec::new();
    // Who handed each envelope to dead-lettering (a reject, an app-path surface).
    let mut gave_up: HashMap<Uuid, Vec<(u64, &str, &[String])>> = HashMap::new();
    for e in h.iter() {
        if let Event::Rejected { envelope, replica, compat } = &e.event {
            gave_up.entry(*envelope).or_default().push((e.t_ms, replica, compat));
        }
    }
    let windows = h.fault_windows();
    let acked_unrecorded: Vec<(u64, &str, &str, &[String])> = h
        .iter()
        .filter_map(|e| match &e.event {
            Event::AckedUnrecorded { key, replica, compat } => Some((e.t_ms, key.as_str(), replica.as_str(), compat.as_slice())),
            _ => None,
        })
        .collect();
    let staged_for: HashMap<Uuid, &str> = h
        .iter()
        .filter_map(|e| if let Event::DeadLetterStaged { envelope, service } = &e.event { Some((*envelope, service.as_str())) } else { None })
        .collect();
    let mut misattributed = 0;
    // Issue 22.1: what reached craig.dlx that the harness never staged as a dead letter
    // (an envelope, or bytes naming none), each once.
    let mut unexpected: BTreeMap<String, (u64, Option<Uuid>, Option<&str>)> = BTreeMap::new();
    // When the tap first saw each delivery's bytes.
    let mut tapped_at: HashMap<&str, u64> = HashMap::new();
    for e in h.iter() {
        match &e.event {
            Event::DeadLettered { key, token, envelope, queue, .. } => {
                // #1196: a dead letter names the CONSUMER queue that failed it, on either
                // path (x-death's queue, the wrapper's original_queue).
                let mut named_wrong = false;
                if let (Some(env), Some(q)) = (envelope, queue.as_deref()) {
                    // A dead letter the harness staged for a consumer, with no replica's word on
                    // who gave it up: it still belongs to that consumer's queue.
                    if let Some(consumer) = staged_for.get(env).filter(|c| !gave_up.contains_key(env) && q != craig_mq::topology::consumer_queue(c)) {
                        named_wrong = true;
                        misattributed += 1;
                        v.blame(dead_letter_tags(h, "misattributed", consumer, Through::Nothing, 0));
                        v.witness(format!(
                            "dead letter of envelope {env} names queue {q}, but the harness staged it for {consumer} ({}); no replica logged giving it up",
                            craig_mq::topology::consumer_queue(consumer)
                        ));
                    }
                    if let Some(by) = gave_up.get(env) {
                        // (Several consumers may give one fanned-out envelope up, each from
                        // its own queue: named wrong only when none of them consumes `q`.)
                        let wrong: Vec<&(u64, &str, &[String])> =
                            by.iter().filter(|(_, r, _)| craig_mq::topology::consumer_queue(service_of(r)) != q).collect();
                        if wrong.len() == by.len() {
                            named_wrong = true;
                            misattributed += 1;
                            let mut tags = vec!["kind:misattributed".to_owned()];
                            let mut who = Vec::new();
                            for (t, r, c) in &wrong {
                                tags.extend(culprit_tags(r, Some(c)));
                                who.push(format!("{} @{t}ms", running(r, Some(c))));
                            }
                            v.blame(tags);
                            v.witness(format!(
                                "dead letter of envelope {env} names queue {q}, but {} gave it up consuming {}",
                                who.join(", "),
                                craig_mq::topology::consumer_queue(service_of(wrong[0].1))
                            ));
                        }
                    }
                }
                // Expected only from the queue of the consumer it was staged for (or with no
                // queue named): the same envelope given up by another consumer that should
                // have handled it is unexpected. One already counted as misattributed (its
                // queue named wrong) is not counted twice.
                let staged = named_wrong
                    || envelope.and_then(|env| staged_for.get(&env)).is_some_and(|c| {
                        queue.as_deref().is_none_or(|q| q == craig_mq::topology::consumer_queue(c))
                    });
                if !staged {
                    let id = envelope.map_or_else(|| format!("bytes {key}"), |env| env.to_string());
                    unexpected.entry(id).or_insert((e.t_ms, *envelope, queue.as_deref()));
                }
                taps += 1;
                tapped_keys.insert(key.clone());
                tapped_at.entry(key.as_str()).or_insert(e.t_ms);
                match token {
                    Some(t) => {
                        taps_by_token.entry(t.clone()).or_default().insert(key.clone());
                    }
                    None => *tokenless_taps.entry(key.clone()).or_default() += 1,
                }
                if let (Some(env), Some(q)) = (envelope, queue.as_deref()) {
                    dead_from.entry(*env).or_default().entry(q).or_insert(e.t_ms);
                }
            }
            Event::Audited { key, token, disposition, .. } => rows.push((key.as_str(), token.as_deref(), disposition.as_str())),
            _ => {}
        }
    }
    for (id, (t, env, queue)) in &unexpected {
        let mut tags = vec!["kind:unexpected_dead_letter".to_owned()];
        // The replicas that said they gave the envelope up from this queue (another consumer
        // giving up its own copy correctly is not to blame), with the behaviour they ran then.
        let from_queue: Option<Vec<(u64, &str, &[String])>> = env.and_then(|env| gave_up.get(&env)).map(|by| {
            by.iter().filter(|(_, r, _)| queue.is_none_or(|q| craig_mq::topology::consumer_queue(service_of(r)) == q)).copied().collect()
        });
        let by = match from_queue.filter(|by| !by.is_empty()) {
            Some(by) => format!("given up by {}", each_culprit(&by, Some(&windows), &mut tags)),
            None => {
                tags.extend(["replica:unknown".to_owned(), "compat:unknown".to_owned()]);
                "no replica logged giving it up".to_owned()
            }
        };
        v.blame(tags);
        v.witness(format!(
            "{id} reached craig.dlx @{t}ms from {} and the harness never staged it as a dead letter: {by}",
            queue.unwrap_or("an unnamed queue")
        ));
    }
    let mut used = vec![false; rows.len()];
    let (mut lost, mut doubled) = (0, 0);
    for (token, keys) in &taps_by_token {
        let mine: Vec<usize> = (0..rows.len())
            .filter(|&i| !used[i] && (rows[i].1 == Some(token.as_str()) || (rows[i].1.is_none() && keys.contains(rows[i].0))))
            .collect();
        for &i in &mine {
            used[i] = true;
        }
        match mine.len() {
            1 => {}
            0 => {
                lost += 1;
                // Corroborated where the system says so: the replica that acked one of its
                // deliveries unrecorded, with its behaviour and the faults on its own links
                // or servers at that moment. Otherwise every security replica and fault.
                let by: Vec<&(u64, &str, &str, &[String])> = acked_unrecorded.iter().filter(|(_, k, ..)| keys.contains(*k)).collect();
                if by.is_empty() {
                    // Issue 22.8: no replica's word on acking it unrecorded, so no compat mode is
                    // corroborated; only the faults on the recorder's database path in force
                    // from the moment it reached craig.dlx.
                    let since = keys.iter().filter_map(|k| tapped_at.get(k.as_str()).copied()).min().unwrap_or(0);
                    v.blame(uncorroborated_loss(&windows, since));
                    v.witness(format!("occurrence {token} reached craig.dlx and has no audit row (lost); no replica logged acking it unrecorded"));
                } else {
                    let mut tags = vec!["kind:lost".to_owned()];
                    let mut who = Vec::new();
                    for (t, _, r, c) in &by {
                        tags.extend(culprit_tags(r, Some(c)));
                        tags.extend(faults_on(&windows, r, *t));
                        who.push(format!("{} @{t}ms", running(r, Some(c))));
                    }
                    v.blame(tags);
                    v.witness(format!(
                        "occurrence {token} reached craig.dlx and has no audit row (lost): acked unrecorded by {}",
                        who.join(", ")
                    ));
                }
            }
            n => {
                doubled += 1;
                // Recorded twice only after it reached craig.dlx: a fault over before then
                // (a crash, a broker fault) did not do it.
                let since = keys.iter().filter_map(|k| tapped_at.get(k.as_str()).copied()).min().unwrap_or(0);
                v.blame(dead_letter_tags(h, "doubled", "security", Through::Broker, since));
                let dispositions: Vec<&str> = mine.iter().map(|&i| rows[i].2).collect();
                v.witness(format!("occurrence {token} has {n} audit rows ({}): one occurrence recorded more than once", dispositions.join(", ")));
            }
        }
    }
    let mut tokenless_extra = 0;
    for (key, n) in &tokenless_taps {
        let mine: Vec<usize> = (0..rows.len()).filter(|&i| !used[i] && rows[i].1.is_none() && rows[i].0 == key).collect();
        for &i in &mine {
            used[i] = true;
        }
        if mine.len() < *n {
            lost += 1;
            let acked: Vec<&(u64, &str, &str, &[String])> = acked_unrecorded.iter().filter(|(_, k, ..)| *k == key.as_str()).collect();
            if acked.is_empty() {
                v.blame(uncorroborated_loss(&windows, tapped_at.get(key.as_str()).copied().unwrap_or(0)));
            } else {
                let mut tags = vec!["kind:lost".to_owned()];
                for (t, _, r, c) in &acked {
                    tags.extend(culprit_tags(r, Some(c)));
                    tags.extend(faults_on(&windows, r, *t));
                }
                v.blame(tags);
            }
            v.witness(format!("tokenless dead letter {key} reached craig.dlx {n} time(s) and has {} audit row(s) (lost)", mine.len()));
        } else {
            tokenless_extra += mine.len() - n;
        }
    }
    let mut unexplained = 0;
    for (i, (key, token, disposition)) in rows.iter().enumerate() {
        if !used[i] {
            unexplained += 1;
            v.blame(dead_letter_tags(h, "unexplained", "security", Through::Nothing, 0));
            let what = token.map_or_else(|| format!("bytes {key}"), |t| format!("token {t}"));
            let why = if tapped_keys.contains(*key) { "a further row of a delivery already recorded" } else { "nothing with these bytes reached craig.dlx" };
            v.witness(format!("audit row ({disposition}) of {what}: {why}"));
        }
    }
    // Completed XOR dead-lettered.
    let mut both = 0;
    // The #1180 window as the system reports it: which replica re-ran or gave up which
    // envelope, and when each replica died (the harness saw the exit).
    let mut reran: HashMap<Uuid, Vec<(u64, &str)>> = HashMap::new();
    let crashes: Vec<(u64, &str)> =
        h.iter().filter_map(|e| if let Event::Crash { replica, .. } = &e.event { Some((e.t_ms, replica.as_str())) } else { None }).collect();
    // Which consumer queue each envelope took effect behind, when it first did, and the
    // replica that ran it (when it said).
    let mut effected: BTreeMap<Uuid, BTreeMap<String, (u64, Option<&str>)>> = BTreeMap::new();
    for e in h.iter() {
        match &e.event {
            Event::Reprocessed { envelope, replica } | Event::Rejected { envelope, replica, .. } => {
                reran.entry(*envelope).or_default().push((e.t_ms, replica))
            }
            Event::Effect { envelope, service, replica, .. } => {
                effected.entry(*envelope).or_default().entry(craig_mq::topology::consumer_queue(service)).or_insert((e.t_ms, replica.as_deref()));
            }
            _ => {}
        }
    }
    for (env, queues) in &effected {
        let Some(dead) = dead_from.get(env) else { continue };
        for (q, (effect_at, ran_on)) in queues {
            let Some(&dead_at) = dead.get(q.as_str()) else { continue };
            // The tap's time of a broker-path dead letter is x-death's, whole seconds: up to
            // a second early.
            let dead_by = dead_at.saturating_add(XDEATH_ROUNDING_MS + WINDOW_SLACK_MS);
            if *effect_at > dead_by {
                // Dead-lettered first, then handled: a replay or redrive (§D4), not this.
                continue;
            }
            let service = q.strip_prefix("craig-").and_then(|r| r.strip_suffix(".events")).unwrap_or(q);
            // Excused only by the #1180 window as the system shows it: the replica that ran
            // it (any of this consumer's, where the effect names none) died within the stamp's
            // due time after the effect committed (its stamp or ack lost), and then a replica
            // of it re-ran the envelope (`inbox.reprocessed`) or gave it up for good, before
            // the dead letter. Never for an arbiter-backed consumer (#1179): its arbiter
            // absorbs a re-run, it does not dead-letter it.
            let window = !super::effect_once::ARBITER_BACKED.contains(&service) && crashes.iter().any(|(c, r)| {
                service_of(r) == service
                    && ran_on.is_none_or(|ran| ran == *r)
                    && effect_at.saturating_sub(WINDOW_SLACK_MS) <= *c
                    && *c <= effect_at.saturating_add(super::effect_once::STAMP_DUE_MS)
                    && *c <= dead_by
                    && reran.get(env).is_some_and(|runs| {
                        runs.iter().any(|(t, by)| service_of(by) == service && c.saturating_sub(WINDOW_SLACK_MS) <= *t && *t <= dead_by)
                    })
            });
            if !window {
                both += 1;
                v.blame(dead_letter_tags(h, "completed_and_dead_lettered", service, Through::Nothing, 0));
                v.witness(format!(
                    "envelope {env} took effect on {service} @{effect_at}ms AND was dead-lettered from {q} @{dead_at}ms, with no crash and redelivery in between"
                ));
            }
        }
    }
    v.count("dead_lettered", taps);
    v.count("occurrences", taps_by_token.len() + tokenless_taps.values().sum::<usize>());
    v.count("audit_rows", rows.len());
    v.count("lost", lost);
    v.count("doubled", doubled);
    v.count("unexplained_rows", unexplained);
    v.count("tokenless_extra_rows", tokenless_extra);
    v.count("completed_and_dead_lettered", both);
    v.count("misattributed", misattributed);
    v.count("unexpected_dead_letters", unexpected.len());
    // Issue 21.1: a delivery in the capture queue was acked off the DLQ with no audit row;
    // the harness read the queue itself. One it could not read leaves the verdict open.
    let captured = h.iter().find_map(|e| if let Event::CaptureLeft { count } = e.event { Some(count) } else { None });
    // A captured delivery reached craig.dlx first: faults over before the first tap did not do it.
    let first_tap = tapped_at.values().copied().min().unwrap_or(0);
    let mut unread_capture = false;
    match captured {
        Some(u32::MAX) => unread_capture = true,
        Some(n) if n > 0 => {
            for _ in 0..n {
                v.blame(dead_letter_tags(h, "captured", "security", Through::Database, first_tap));
            }
            v.witness(format!(
                "{n} dead letter(s) left in {}: acked off the DLQ and never recorded in dead_letter_audit",
                craig_mq::dlq::CAPTURE_QUEUE
            ));
            v.count("captured", n as usize);
        }
        _ => v.count("captured", 0),
    }
    let v = v.settle(taps == 0, "nothing to check: no dead letter reached craig.dlx");
    if unread_capture && v.validity == Validity::Valid {
        return Verdict { validity: Validity::Unknown, error: Some(format!("{} could not be read at the end", craig_mq::dlq::CAPTURE_QUEUE)), ..v };
    }
    v
}
