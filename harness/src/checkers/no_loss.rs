//! `no_loss`, ADR-022 §D1/§D3 at-least-once: every acknowledged write's event produces its effect, every published dead letter reaches `craig.dlx`. An acknowledged write cases' database no longer holds is `kind:lost_acknowledged` (issue 26), with the asynchronous failover that can have forgotten it (`fault:failover database`, `replication:async`) where one did. Excused: nothing; blame needs the system's own word (who stamped, who rejected). Where a confirmed event was lost is named from the database (issue 25): `lost_at:consumer` when a consumer's inbox recorded it processed, `lost_at:broker` when the current behaviour stamped it (after a confirm), no consumer recorded it and a broker node lost its data after the stamp; counted per consumer queue (`confirmed`, `confirmed_never_delivered`: the outbox's record of confirms, not the broker's).

use super::*;

/// Every acknowledged write's event reached the consumer (took effect at least once).
/// Unknown-outcome writes that show up are `recovered`, never `lost`.
pub fn no_loss(h: &History) -> Verdict {
    let mut v = Verdict::new("no_loss");
    let fx = effects(h);
    // referral → its envelopes; envelope → who stamped it published, with the behaviour
    // that replica ran then.
    let windows = h.fault_windows();
    let mut envelopes: HashMap<Uuid, Vec<Uuid>> = HashMap::new();
    // Cases' own outbox rows per aggregate: the event a committed domain row must have
    // staged in its transaction (§D1). Another producer's row naming it (financial's
    // payment.created) does not make it staged.
    let mut staged_by_cases: HashSet<Uuid> = HashSet::new();
    // ... and those rows themselves: the events a consumer queue carries for the aggregate
    // (a consumer's own later events naming it, rules' for instance, are not).
    let mut cases_envelopes: HashMap<Uuid, Vec<Uuid>> = HashMap::new();
    let mut published: HashSet<Uuid> = HashSet::new();
    // Issue 26: when a consumer said it committed an envelope's effect (its own log line).
    let mut created: HashMap<Uuid, Vec<(u64, &str)>> = HashMap::new();
    let mut stamps: HashMap<Uuid, Vec<(u64, &str, &[String])>> = HashMap::new();
    for e in h.iter() {
        match &e.event {
            Event::Staged { envelope, referral: Some(r), published: p, service, .. } => {
                envelopes.entry(*r).or_default().push(*envelope);
                if service == "cases" {
                    staged_by_cases.insert(*r);
                    cases_envelopes.entry(*r).or_default().push(*envelope);
                }
                if *p {
                    published.insert(*envelope);
                }
            }
            Event::Stamped { envelope, replica, compat } => {
                stamps.entry(*envelope).or_default().push((e.t_ms, replica.as_str(), compat.as_slice()))
            }
            Event::PaymentCreated { envelope, replica } => created.entry(*envelope).or_default().push((e.t_ms, replica.as_str())),
            _ => {}
        }
    }
    let evaluated = evaluations(h);
    // Broker nodes that lost their data (issue 25): an event stamped published (the broker
    // confirmed it) before such a loss and never delivered may be the broker's loss, and the
    // queue type that let it happen is named with it — but only as far as the loss can
    // explain: an effect's consumer queue was among the queues only that node held, and no
    // more events are lost, stamped before it, than those queues held ready when the node
    // was killed (the broker's count, read by the harness before the kill). Past that bound
    // something else lost them too, and no loss is put on the broker.
    let consumer_queues = [craig_mq::topology::consumer_queue("rules"), craig_mq::topology::consumer_queue("financial")];
    let last_stamp = |referral: &Uuid| -> Option<u64> {
        envelopes.get(referral).into_iter().flatten().filter_map(|env| stamps.get(env)).flatten().map(|(t, ..)| *t).max()
    };
    let stamped_lost: Vec<u64> = h
        .iter()
        .filter_map(|e| match &e.event {
            Event::Write { referral, outcome: Outcome::Ok, .. } if !fx.by_referral.contains_key(referral) => last_stamp(referral),
            _ => None,
        })
        .collect();
    // (when, node, queue type, the consumer queues it held ready messages of)
    let data_lost: Vec<(u64, &str, &str, Vec<&str>)> = h
        .iter()
        .filter_map(|e| match &e.event {
            Event::BrokerDataLost { node, queue_type, queues } => {
                let held: u64 = queues.iter().filter(|(q, _)| consumer_queues.contains(q)).map(|(_, m)| *m).sum();
                let explained = stamped_lost.iter().filter(|t| **t <= e.t_ms).count() as u64;
                let on: Vec<&str> = queues.iter().filter(|(q, m)| consumer_queues.contains(q) && *m > 0).map(|(q, _)| q.as_str()).collect();
                (held > 0 && explained <= held).then_some((e.t_ms, node.as_str(), queue_type.as_str(), on))
            }
            _ => None,
        })
        .collect();
    // Issue 25: what the consumers recorded (their §D2 inbox rows, read at the end, and
    // rows a retention prune deleted), and what the harness's own tap saw dead-lettered.
    // The inbox row is the consumer's first commit for a delivery, so an envelope with none
    // was never delivered to a consumer that kept it.
    let mut inboxed: HashSet<Uuid> = HashSet::new();
    // ... of those, the rows the consumer stamped processed (its handler returned success).
    let mut processed: HashSet<Uuid> = HashSet::new();
    let mut tapped: HashSet<Uuid> = HashSet::new();
    let mut queue_of: HashMap<Uuid, String> = HashMap::new();
    let mut inboxless: HashSet<String> = HashSet::new();
    for e in h.iter() {
        match &e.event {
            Event::Inboxed { envelope, processed: p, .. } => {
                inboxed.insert(*envelope);
                if *p {
                    processed.insert(*envelope);
                }
            }
            // A retention delete: the row existed (delivered); whether it was stamped is
            // not recorded, so it is never taken as handled.
            Event::InboxPruned { envelope, .. } => {
                inboxed.insert(*envelope);
            }
            Event::DeadLettered { envelope: Some(env), .. } => {
                tapped.insert(*env);
            }
            // The queue an aggregate's event is consumed from: a referral's by rules, an
            // active placement's by financial.
            Event::Committed { aggregate, table } => {
                let svc = if table == "placements" { "financial" } else { "rules" };
                queue_of.insert(*aggregate, craig_mq::topology::consumer_queue(svc));
            }
            // A consumer without the inbox (compat pre-d2) records nothing: where its
            // service consumed, "no inbox row" says nothing about the broker.
            Event::Started { replica, compat } if compat.iter().any(|c| c == "pre-d2") => {
                inboxless.insert(craig_mq::topology::consumer_queue(service_of(replica)));
            }
            _ => {}
        }
    }
    // Per consumer queue: acknowledged writes whose event the broker confirmed (published in
    // the outbox, stamped by the current behaviour), and of those, the ones no consumer's
    // inbox ever recorded and that took no effect.
    // Issue 26: what cases' database holds committed at the end (read by the harness), and
    // when each aggregate's write was first sent.
    let committed_now: HashSet<Uuid> =
        h.iter().filter_map(|e| if let Event::Committed { aggregate, .. } = &e.event { Some(*aggregate) } else { None }).collect();
    let read = h.iter().any(|e| matches!(e.event, Event::CommittedRead));
    let mut first_sent: HashMap<Uuid, u64> = HashMap::new();
    for e in h.iter() {
        if let Event::Write { referral, .. } = &e.event {
            first_sent.entry(*referral).or_insert(e.t_ms);
        }
    }
    let commit_seen = commit_seen_by(h);
    let mut per_queue: BTreeMap<String, (u64, u64)> = BTreeMap::new();
    let (mut attempted, mut acknowledged, mut ok, mut lost, mut recovered, mut unknown, mut failed) = (0, 0, 0, 0, 0, 0, 0);
    for entry in h.iter() {
        let Event::Write { referral, outcome, replica, answered_ms, .. } = &entry.event else { continue };
        attempted += 1;
        let delivered = fx.by_referral.contains_key(referral);
        let envs = envelopes.get(referral).map(Vec::as_slice).unwrap_or(&[]);
        let queued = cases_envelopes.get(referral).map(Vec::as_slice).unwrap_or(&[]);
        let seen = queued.iter().any(|e| inboxed.contains(e));
        let handled = queued.iter().any(|e| processed.contains(e));
        let dead_lettered = queued.iter().any(|e| tapped.contains(e));
        // Confirmed: cases' row published in the outbox, and the stamp of it that stood ran
        // the current behaviour, which stamps only after the broker's confirm (a pre-1128
        // stamp had none).
        let confirmed = queued.iter().any(|e| published.contains(e))
            && queued.iter().filter_map(|e| stamps.get(e)).flatten().max_by_key(|(t, ..)| *t).is_some_and(|(.., c)| c.is_empty());
        if *outcome == Outcome::Ok && confirmed {
            let q = per_queue.entry(queue_of.get(referral).cloned().unwrap_or_else(|| "unknown queue".to_owned())).or_default();
            q.0 += 1;
            q.1 += u64::from(!seen && !delivered && !dead_lettered);
        }
        match outcome {
            Outcome::Ok => {
                acknowledged += 1;
                if read && !committed_now.contains(referral) {
                    // Issue 26: the client heard it committed, and cases' database does not
                    // hold it: acknowledged and gone (whether or not its event took effect
                    // first). An asynchronous failover that can have forgotten it (its standby
                    // behind the answer, the event's stamp and effect) is named.
                    lost += 1;
                    let compat = h.compat_at(replica, entry.t_ms);
                    let mut tags = vec!["kind:lost_acknowledged".to_owned()];
                    tags.extend(culprit_tags(replica, compat));
                    // A failover is named only where it can have forgotten the write (below),
                    // never for being in force near it.
                    tags.extend(faults_on(&windows, replica, entry.t_ms).into_iter().filter(|t| !t.starts_with("fault:failover ")));
                    let from = first_sent.get(referral).copied().unwrap_or(entry.t_ms);
                    // The commit came before the answer, its event's stamp and its effect.
                    let to = [*answered_ms, commit_seen.get(referral).copied()].into_iter().flatten().min();
                    let (failover, said) = failover_forgot(h, from, to);
                    tags.extend(failover);
                    v.blame(tags);
                    v.witness(format!(
                        "referral {referral} acknowledged by {} @{}ms{} is not in cases' database: acknowledged and gone{}{said}; {}",
                        running(replica, compat),
                        entry.t_ms,
                        answered_ms.map(|a| format!(" (answered @{a}ms)")).unwrap_or_default(),
                        if delivered { " (its event took effect)" } else { "" },
                        h.fault_near(entry.t_ms)
                    ));
                } else if delivered {
                    ok += 1;
                } else {
                    lost += 1;
                    // Blame whoever stamped its event published (it vouched for a delivery
                    // that never happened); with no stamp, the replica that acknowledged it.
                    let mut stamped: Vec<&(u64, &str, &[String])> = envs.iter().filter_map(|env| stamps.get(env)).flatten().collect();
                    stamped.sort_by_key(|(t, ..)| *t);
                    let by = if let Some((failover, said)) = forgotten_effect(h, queued, &created) {
                        // A consumer's own word that it committed the effect, gone from its
                        // database after the broker had its ack (no redelivery brings it
                        // back), and an asynchronous failover that can have forgotten it.
                        let mut tags = vec!["kind:lost".to_owned(), "lost_at:consumer".to_owned()];
                        tags.extend(failover);
                        v.blame(tags);
                        format!("its effect was committed and is gone{said}")
                    } else if let Some((tags, said)) = forgotten_evaluation(h, queued, &evaluated, first_sent.get(referral).copied().unwrap_or(entry.t_ms)) {
                        v.blame(tags);
                        said
                    } else {
                        match stamped.last() {
                        // The stamp that stood (the last): that replica vouched for a delivery
                        // that never happened, under the behaviour it ran and the faults on
                        // its own links or servers at the time.
                        Some((t, r, c)) => {
                            let mut tags = vec!["kind:lost".to_owned()];
                            tags.extend(culprit_tags(r, Some(c)));
                            tags.extend(faults_on(&windows, r, *t));
                            // A node that lost its data after the stamp, holding ready
                            // messages of this event's own consumer queue (where the
                            // committed row names it; else any consumer queue it held).
                            let own = queue_of.get(referral).map(String::as_str);
                            let after: Vec<&(u64, &str, &str, Vec<&str>)> =
                                data_lost.iter().filter(|(at, .., on)| at >= t && own.is_none_or(|q| on.contains(&q))).collect();
                            for (_, node, queue_type, _) in &after {
                                tags.extend([format!("fault:kill {node}"), format!("queue:{queue_type}")]);
                            }
                            // Where it was lost (issue 25), by the consumers' inboxes: handled
                            // by a consumer (its inbox row stamped processed) and lost after;
                            // or confirmed (cases' row, stamped by the current behaviour, which
                            // stamps only after a confirm), recorded by no consumer, not seen
                            // dead-lettered by the harness's tap, AND a broker node lost its
                            // data after the stamp (the broker's own loss, recorded by the
                            // harness): lost at the broker. Anything else names no place: a
                            // compat stamp may have had no confirm behind it, an unstamped
                            // inbox row went back to the broker, and without a recorded data
                            // loss "never delivered" could be a consumer's doing.
                            let place = if handled {
                                tags.push("lost_at:consumer".to_owned());
                                "; a consumer's inbox recorded it processed, so it was lost after delivery"
                            } else if confirmed
                                && !seen
                                && !dead_lettered
                                && !after.is_empty()
                                && queue_of.get(referral).is_some_and(|q| !inboxless.contains(q))
                            {
                                tags.push("lost_at:broker".to_owned());
                                "; no consumer's inbox recorded it: confirmed by the broker and lost with its data"
                            } else {
                                ""
                            };
                            v.blame(tags);
                            let who: Vec<String> = stamped.iter().map(|(t, r, c)| format!("{} @{t}ms", running(r, Some(c)))).collect();
                            let lost_on: Vec<String> = after.iter().map(|(at, node, qt, _)| format!("; then {node} lost its data @{at}ms ({qt} queues)")).collect();
                            format!("its event was stamped published by {}{}{place}", who.join(", "), lost_on.concat())
                        }
                        // Stamped, but no replica said so: no attribution evidence.
                        None if envs.iter().any(|e| published.contains(e)) => {
                            v.blame(["kind:lost".to_owned(), "replica:unknown".to_owned(), "compat:unknown".to_owned()]);
                            "its event is stamped published but no replica logged the stamp (no attribution evidence)".to_owned()
                        }
                        None => {
                            let compat = h.compat_at(replica, entry.t_ms);
                            let mut tags = vec!["kind:lost".to_owned()];
                            tags.extend(culprit_tags(replica, compat));
                            tags.extend(faults_on(&windows, replica, entry.t_ms));
                            v.blame(tags);
                            format!("its event was never stamped published ({} acknowledged it)", running(replica, compat))
                        }
                        }
                    };
                    v.witness(format!(
                        "referral {referral} acknowledged by {replica} @{}ms never took effect: {by}; {}",
                        entry.t_ms,
                        h.fault_near(entry.t_ms)
                    ));
                }
            }
            Outcome::Unknown => {
                unknown += 1;
                if delivered {
                    recovered += 1;
                }
            }
            Outcome::Failed => failed += 1,
        }
    }
    let (committed, unacknowledged_lost) = committed_lost(h, &mut v, &fx.by_referral, (&staged_by_cases, &cases_envelopes), &windows, (&created, &evaluated));
    lost += unacknowledged_lost;
    let (dead_staged, dead_lost) = dead_letters_lost(h, &mut v);
    for (k, n) in [
        ("attempted", attempted),
        ("acknowledged", acknowledged),
        ("ok", ok),
        ("lost", lost),
        ("recovered", recovered),
        ("unknown", unknown),
        ("failed", failed),
        ("committed", committed),
        ("committed_unacknowledged_lost", unacknowledged_lost),
        ("dead_letters_published", dead_staged),
        ("dead_letters_lost", dead_lost),
    ] {
        v.count(k, n);
    }
    // Issue 26: how long the database was out for writers across a failover: from the old
    // primary's kill to the first answer that acknowledged a write sent after it.
    for kill in h.iter().filter(|e| matches!(e.event, Event::Failover { .. })).map(|e| e.t_ms) {
        let first = h
            .iter()
            .filter_map(|e| match &e.event {
                Event::Write { outcome: Outcome::Ok, answered_ms: Some(a), .. } if e.t_ms >= kill => Some(*a),
                _ => None,
            })
            .min();
        if let Some(a) = first {
            v.count("failover_to_first_acknowledged_write_ms", a.saturating_sub(kill) as usize);
        }
    }
    for (queue, (confirmed, never_seen)) in per_queue {
        v.count(&format!("confirmed {queue}"), confirmed as usize);
        v.count(&format!("confirmed_never_delivered {queue}"), never_seen as usize);
    }
    v.validity = if lost > 0 || dead_lost > 0 {
        Validity::Invalid
    } else if acknowledged == 0 && committed == 0 {
        v.error = Some("nothing to check: no acknowledged writes".into());
        Validity::Unknown
    } else {
        Validity::Valid
    };
    v
}

/// Issue 22.2: the database is the ground truth, not the HTTP answer. Every aggregate cases'
/// database holds committed (`Event::Committed`) whose write the client did not hear
/// acknowledged (an unknown outcome: a 5xx, a reset) must still have its event and its
/// effect: one without either is lost. With no row for it in cases' outbox, the domain row
/// committed without its event (a §D1 violation, `kind:unstaged`), blamed on the replica
/// that took the write, with its behaviour and the faults on it then. Acknowledged writes
/// are judged above. Returns (committed, lost here).
fn committed_lost(
    h: &History,
    v: &mut Verdict,
    delivered: &HashMap<Uuid, u64>,
    (staged_by_cases, cases_envelopes): (&HashSet<Uuid>, &HashMap<Uuid, Vec<Uuid>>),
    windows: &[(String, u64, u64)],
    (created, evaluated): (&HashMap<Uuid, Vec<(u64, &str)>>, &Evaluations),
) -> (usize, usize) {
    let mut writes: HashMap<Uuid, Vec<(u64, &str, Outcome)>> = HashMap::new();
    for e in h.iter() {
        if let Event::Write { referral, replica, outcome, .. } = &e.event {
            writes.entry(*referral).or_default().push((e.t_ms, replica.as_str(), *outcome));
        }
    }
    let (mut committed, mut lost) = (0, 0);
    for e in h.iter() {
        let Event::Committed { aggregate, table } = &e.event else { continue };
        committed += 1;
        let tries = writes.get(aggregate).map(Vec::as_slice).unwrap_or(&[]);
        // Acknowledged: judged as a write above. Never asked for: no_phantom's.
        if tries.is_empty() || tries.iter().any(|(.., o)| *o == Outcome::Ok) || delivered.contains_key(aggregate) {
            continue;
        }
        lost += 1;
        let (t, replica, outcome) = tries[tries.len() - 1];
        let compat = h.compat_at(replica, t);
        let unstaged = !staged_by_cases.contains(aggregate);
        let queued = cases_envelopes.get(aggregate).map(Vec::as_slice).unwrap_or(&[]);
        let forgotten = forgotten_effect(h, queued, created);
        let why = if let Some((failover, said)) = forgotten {
            // Issue 26: a consumer committed its effect and the database forgot it.
            let mut tags = vec!["kind:lost".to_owned(), "lost_at:consumer".to_owned()];
            tags.extend(failover);
            v.blame(tags);
            format!("its effect was committed and is gone{said}")
        } else if let Some((tags, said)) = forgotten_evaluation(h, queued, evaluated, tries[0].0) {
            v.blame(tags);
            said
        } else {
            let mut tags = vec![format!("kind:{}", if unstaged { "unstaged" } else { "lost" })];
            tags.extend(culprit_tags(replica, compat));
            tags.extend(faults_on(windows, replica, t));
            v.blame(tags);
            if unstaged { "no event was ever staged for it (the domain row committed without its event, §D1)" } else { "its event never took effect" }.to_owned()
        };
        v.witness(format!(
            "{table} row {aggregate} is committed though {} heard {outcome:?} @{t}ms: {why}; {}",
            running(replica, compat),
            h.fault_near(t)
        ));
    }
    (committed, lost)
}

/// Issue 26: an effect a consumer said it committed (`financial.payment_created`, logged
/// after the commit) for one of `envelopes`, which its database no longer holds, while the
/// broker had its ack: nothing brings it back. Put on an asynchronous failover only where
/// one can have forgotten it: its standby had not applied up to the earliest such line
/// (the commit came before it), and every line came before the database address led to the
/// promoted standby (+ the clocks' slack: from the kill to then nothing could commit, and a
/// commit the promoted database made it would still hold), so a line logged late, after
/// the kill, of a commit made before it still counts; and financial's inbox row for it is
/// not held stamped processed before the kill (that stamp commits after the payment: one
/// made on the old primary that survived means the payment survived too; one made after,
/// on the promoted server by the inbox's stamp retry, says nothing of it). The failover's
/// tags and words; `None` where no consumer said so (a
/// consumer that never committed it is judged as before) or no failover explains it.
fn forgotten_effect(h: &History, envelopes: &[Uuid], created: &HashMap<Uuid, Vec<(u64, &str)>>) -> Option<(Vec<String>, String)> {
    let lines: Vec<(u64, &str)> = envelopes.iter().filter_map(|e| created.get(e)).flatten().copied().collect();
    let (first, by) = lines.iter().min_by_key(|(t, _)| *t).copied()?;
    // financial stamps its inbox row processed in a commit after the payment's, and a
    // standby applies commits in order: a row the surviving database holds stamped before
    // the kill means it held the payment too, so no failover forgot it. (A stamp without
    // its time, from an older history, is taken as made at the payment's line: before.)
    let stamped: Vec<u64> = h
        .iter()
        .filter_map(|e| match &e.event {
            Event::Inboxed { envelope, service, processed: true, processed_ms } if service == "financial" && envelopes.contains(envelope) => {
                Some(processed_ms.unwrap_or(first))
            }
            _ => None,
        })
        .collect();
    let last = lines.iter().map(|(t, _)| *t).max().unwrap_or(first);
    h.iter().find_map(|e| {
        let Event::Failover { replayed_until_ms, mode, promoted_ms } = &e.event else { return None };
        // (Only a stamp after the payment's line: one before it is of another delivery.)
        if stamped.iter().any(|p| p + FAILOVER_CLOCK_SLACK_MS < e.t_ms && p + FAILOVER_CLOCK_SLACK_MS >= first) {
            return None;
        }
        let behind = replayed_until_ms.is_none_or(|r| first + FAILOVER_CLOCK_SLACK_MS > r);
        let before = last <= promoted_ms.unwrap_or(e.t_ms) + FAILOVER_CLOCK_SLACK_MS;
        (mode == "async" && behind && before).then(|| {
            (
                vec!["fault:failover database".to_owned(), "replication:async".to_owned()],
                format!(
                    " ({by} logged committing it @{first}ms, financial.payment_created); the database failed over @{}ms (async replication), its standby having applied commits up to {}",
                    e.t_ms,
                    replayed_until_ms.map_or("none".to_owned(), |r| format!("@{r}ms"))
                ),
            )
        })
    })
}

/// Issue 26, rules' side: one evaluation the harness's own tap of `rule.evaluated` holds.
#[derive(Clone, Copy)]
struct Evaluation {
    envelope: Uuid,
    /// Its `occurred_at` (rules' own, set before its commit).
    occurred: u64,
    /// The first and the last time a replica logged claiming it from its outbox
    /// (`outbox.claimed`) or stamping it published (`outbox.stamped`); None: none did.
    lines: Option<(u64, u64)>,
}

/// Per source envelope (cases' event), the evaluations of it the tap holds.
type Evaluations = HashMap<Uuid, Vec<Evaluation>>;

fn evaluations(h: &History) -> Evaluations {
    let lines = claim_or_stamp_lines(h);
    let mut out: Evaluations = HashMap::new();
    for e in h.iter() {
        if let Event::EvaluationPublished { envelope, source, .. } = &e.event {
            let runs = out.entry(*source).or_default();
            if !runs.iter().any(|r| r.envelope == *envelope) {
                runs.push(Evaluation { envelope: *envelope, occurred: e.t_ms, lines: lines.get(envelope).copied() });
            }
        }
    }
    out
}

/// Issue 26, rules' side: an effect rules committed for one of `envelopes` (cases' events of
/// an aggregate whose effect rules' database does not hold at the end) by the harness's own
/// record: its tap holds a `rule.evaluated` of it, which rules' outbox publishes only from a
/// committed row (§D1), and rules acked the delivery, so nothing brings it back. Put on an
/// asynchronous failover ([`failover_forgot_before`]) only where one can have forgotten every
/// such evaluation:
/// - it came no earlier than every evaluation occurred (less 10 ms of clock slack), nor
///   than `from`, the aggregate's first write (rules' `occurred_at` is held to it: one
///   earlier is impossible and excuses nothing);
/// - its standby had not applied up to the first `outbox.claimed` or `outbox.stamped` line
///   of each evaluation (the latest its commit can have been: a claim finds only a committed
///   row, and the stamp follows the confirm, which follows the claim; the primary can die
///   between the confirm and the stamp). Never up to `occurred_at`, which rules sets before
///   its commit. An evaluation no replica logged claiming or stamping has nothing that
///   corroborates a late commit: no excuse;
/// - no claim or stamp line came after the database address led to the promoted standby
///   (each is logged only for a row its UPDATE found, so the promoted server held the row).
///
/// Otherwise rules published an effect its database does not hold: blamed on rules'
/// replicas. The tags (`kind:lost`, `lost_at:consumer`, and the failover's or rules') and the
/// witness's words; None where the tap holds no evaluation.
fn forgotten_evaluation(h: &History, envelopes: &[Uuid], evaluated: &Evaluations, from: u64) -> Option<(Vec<String>, String)> {
    let runs: Vec<Evaluation> = envelopes.iter().filter_map(|e| evaluated.get(e)).flatten().copied().collect();
    let first = runs.iter().map(|r| r.occurred).min()?;
    let latest = runs.iter().map(|r| r.occurred).max()?;
    let stamps: Option<Vec<(u64, u64)>> = runs.iter().map(|r| r.lines).collect();
    let possible = first + FAILOVER_CLOCK_SLACK_MS >= from;
    let (failover, said) = match stamps.filter(|_| possible) {
        Some(stamps) => {
            let to = stamps.iter().map(|(first, _)| *first).min();
            let last = stamps.iter().map(|(_, last)| *last).max();
            // Every evaluation committed on the old primary, so before its kill.
            failover_forgot_before(h, from.max(latest.saturating_sub(FAILOVER_CLOCK_SLACK_MS)), to, last)
        }
        None => (vec![], String::new()),
    };
    let mut tags = vec!["kind:lost".to_owned(), "lost_at:consumer".to_owned()];
    if failover.is_empty() {
        tags.extend(service_culprits(h, "rules"));
    } else {
        tags.extend(failover);
    }
    let ids: Vec<String> = runs
        .iter()
        .map(|r| format!("{} occurred @{}ms{}", r.envelope, r.occurred, r.lines.map(|(t, _)| format!(", claimed or stamped @{t}ms")).unwrap_or_else(|| ", never claimed nor stamped".to_owned())))
        .collect();
    Some((
        tags,
        format!("rules published its evaluation ({}; the harness's own tap of rule.evaluated) and its database holds none{said}", ids.join("; ")),
    ))
}

/// §D3: a dead letter the harness staged (`DeadLetterStaged`, for its consumer to refuse)
/// that was published must reach `craig.dlx` — the tap saw it — or have been handled after
/// all. One that did neither vanished: a consumer queue without dead-letter arguments drops
/// what its consumer rejects (compat `pre-d3`). Blamed on the replicas that said they
/// rejected it, with the behaviour each ran then. Returns (published, lost).
pub(super) fn dead_letters_lost(h: &History, v: &mut Verdict) -> (usize, usize) {
    let staged: Vec<(Uuid, &str)> = h
        .iter()
        .filter_map(|e| if let Event::DeadLetterStaged { envelope, service } = &e.event { Some((*envelope, service.as_str())) } else { None })
        .collect();
    if staged.is_empty() {
        return (0, 0);
    }
    let mut published: HashSet<Uuid> = HashSet::new();
    let mut first_stamp: HashMap<Uuid, u64> = HashMap::new();
    let mut reached: HashSet<Uuid> = HashSet::new();
    let mut rejected: HashMap<Uuid, Vec<(u64, &str, &[String])>> = HashMap::new();
    for e in h.iter() {
        match &e.event {
            Event::Staged { envelope, published: true, .. } => {
                published.insert(*envelope);
            }
            Event::Rejected { envelope, replica, compat } => {
                rejected.entry(*envelope).or_default().push((e.t_ms, replica, compat));
            }
            Event::Stamped { envelope, .. } => {
                let t = first_stamp.entry(*envelope).or_insert(e.t_ms);
                *t = (*t).min(e.t_ms);
            }
            Event::DeadLettered { envelope: Some(env), .. } | Event::Effect { envelope: env, .. } => {
                reached.insert(*env);
            }
            _ => {}
        }
    }
    let (mut n, mut lost) = (0, 0);
    for (env, consumer) in staged {
        if !published.contains(&env) {
            continue; // still pending: liveness's to judge, not a loss
        }
        let stamp = first_stamp.get(&env).copied();
        n += 1;
        if reached.contains(&env) {
            continue;
        }
        lost += 1;
        // Corroborated by the system: the consumer that said it rejected the message to the
        // broker, with the behaviour it ran then. None said so: nobody to blame on evidence.
        let mut tags = vec!["kind:lost".to_owned()];
        let by = match rejected.get(&env) {
            Some(rs) => format!("rejected by {}", each_culprit(rs, None, &mut tags)),
            None => {
                tags.extend(["replica:unknown".to_owned(), "compat:unknown".to_owned()]);
                "no consumer reported rejecting it".to_owned()
            }
        };
        v.blame(tags);
        v.witness(format!(
            "dead letter {env} (staged for {consumer} to refuse) was published{}, {by}, and never reached {} nor took effect",
            stamp.map(|t| format!(" @{t}ms")).unwrap_or_default(),
            craig_mq::topology::DLX_EXCHANGE,
        ));
    }
    (n, lost)
}
