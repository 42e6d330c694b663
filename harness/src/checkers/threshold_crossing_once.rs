//! `threshold_crossing_once`, ADR-022 #1156 exact crossing: one `security.dlq.threshold_exceeded` per crossing from 10 to 11 per event type in the sliding hour, by the harness's own count and types, each event matched to the row of its own transaction. Excused: a divergent 11th (R7 alert-inert).

use super::*;

/// Exactly one `security.dlq.threshold_exceeded` per crossing per event type (§D3 #1156,
/// re-keyed by #1181 R5/R8), judged on the harness's own count (issue 22.4):
/// - each row's event type is the one the harness's tap read from its own copy of the dead
///   letter (the envelope's, else the routing key it was first published with), the row's
///   column only where the tap saw nothing of it;
/// - the crossings are re-derived from the audit rows, one per occurrence (the first row of
///   the token the tap saw its bytes carry, else of its own token; a duplicate row is
///   `dlq_occurrence_once`'s finding, and must not make a crossing here): taken in order of
///   receipt, a row in the window (its key `LEAST(COALESCE(occurred_at, received),
///   received)` within the hour before its receipt) that brings its type's in-window count
///   to exactly 11 is a crossing — unless it is a divergent quarantine row, alert-inert on
///   its own turn (R7);
/// - each event is matched to the audit row written in the SAME transaction (the harness
///   records the staging transaction with a trigger; audit rows are append-only, so their
///   `xmin` is theirs), never to the count it reports: an event whose row is not a crossing
///   of the event's type was emitted at the wrong arrival (kind:re_emitted), or, where
///   counting every row (a redelivery recorded twice, #1181) would make that row a
///   crossing, is a spurious crossing; a crossing with no event is missed. An event
///   without a known transaction (an old history) is taken by its reported count.
pub fn threshold_crossing_once(h: &History) -> Verdict {
    const HOUR_MS: i64 = 3_600_000;
    const CROSSING: usize = 11;
    type Row<'a> = (i64, i64, &'a str, &'a str, Option<&'a str>);
    let mut v = Verdict::new("threshold_crossing_once");
    let mut seen_tokens: HashSet<&str> = HashSet::new();
    // (received, window key, event type, disposition, transaction) of every row, and of the
    // first row of each occurrence.
    let mut rows: Vec<Row> = Vec::new();
    let mut every_row: Vec<Row> = Vec::new();
    // The occurrence a row records is the one the harness's tap saw its bytes carry (a
    // recorder that mints its own token per delivery, pre-1181, cannot hide a redelivery
    // behind a fresh token); without the tap's word, the row's own token.
    // One key (the bytes' digest) can carry several occurrences: an envelope replayed and
    // dead-lettered again has the same bytes and a new x-death (issue 22.5).
    let mut tapped: HashMap<&str, Vec<&str>> = HashMap::new();
    for e in h.iter() {
        if let Event::DeadLettered { key, token: Some(t), .. } = &e.event {
            tapped.entry(key.as_str()).or_default().push(t.as_str());
        }
    }
    let tapped_type: HashMap<&str, &str> = h
        .iter()
        .filter_map(|e| match &e.event {
            Event::DeadLettered { key, event_type: Some(t), .. } => Some((key.as_str(), t.as_str())),
            _ => None,
        })
        .collect();
    // When each occurrence was first recorded, and per type the spans (first row → a further
    // row of the same occurrence) in which something recorded twice.
    let mut first_row: HashMap<&str, u64> = HashMap::new();
    let mut doubled_spans: BTreeMap<&str, Vec<(u64, u64)>> = BTreeMap::new();
    let mut relabelled = 0;
    for e in h.iter() {
        if let Event::Audited { key, token, disposition, event_type, received_epoch_ms, window_epoch_ms, tx, .. } = &e.event {
            let Some(et) = tapped_type.get(key.as_str()).copied().or(event_type.as_deref()) else { continue };
            if event_type.as_deref().is_some_and(|col| col != et) {
                relabelled += 1;
            }
            let row = (*received_epoch_ms, *window_epoch_ms, et, disposition.as_str(), tx.as_deref());
            every_row.push(row);
            // A divergent quarantine row (R7) is a row of its own in the window whatever
            // token its bytes carry.
            // The row's own token where the tap saw it on these bytes; else the first of the
            // tap's tokens for these bytes not yet counted (a recorder minting its own
            // tokens, pre-1181, cannot hide a redelivery behind them); else its own.
            let taps = tapped.get(key.as_str()).map(Vec::as_slice).unwrap_or(&[]);
            let occurrence = token
                .as_deref()
                .filter(|t| taps.contains(t))
                .or_else(|| taps.iter().copied().find(|t| !seen_tokens.contains(t)))
                .or_else(|| taps.first().copied())
                .or(token.as_deref())
                .filter(|_| disposition != "divergent");
            if let Some(t) = occurrence {
                if !seen_tokens.insert(t) {
                    doubled_spans.entry(et).or_default().push((first_row.get(t).copied().unwrap_or(0), e.t_ms));
                    continue;
                }
                first_row.insert(t, e.t_ms);
            }
            rows.push(row);
        }
    }
    let all_rows = every_row.len();
    // The crossings of a row sequence, per type, taken in order of receipt: the transaction
    // of each crossing row; and the in-window count at every row's arrival.
    let crossings = |rows: &mut Vec<Row<'_>>| {
        rows.sort_by_key(|r| r.0);
        let mut found: BTreeMap<String, Vec<Option<String>>> = BTreeMap::new();
        let mut count_at: HashMap<String, usize> = HashMap::new();
        let mut keys_of: BTreeMap<&str, Vec<i64>> = BTreeMap::new();
        for (received, window, et, disposition, tx) in rows.iter() {
            let keys = keys_of.entry(*et).or_default();
            keys.push(*window);
            let n = found.entry(et.to_string()).or_default();
            if *window > received - HOUR_MS {
                let count = keys.iter().filter(|k| **k > received - HOUR_MS).count();
                if let Some(tx) = tx {
                    count_at.insert(tx.to_string(), count);
                }
                if count == CROSSING && *disposition != "divergent" {
                    n.push(tx.map(str::to_owned));
                }
            }
        }
        (found, count_at)
    };
    let (expected, count_at) = crossings(&mut rows);
    // What a recorder counting every row (a redelivery recorded twice included) would see
    // cross: an announcement at such a row is a spurious crossing, not a re-emit.
    let (inflated, _) = crossings(&mut every_row);
    let mut per_type: BTreeMap<&str, usize> = BTreeMap::new();
    for (.., et, _, _) in &rows {
        *per_type.entry(*et).or_default() += 1;
    }
    let row_type: HashMap<&str, &str> = every_row.iter().filter_map(|r| Some((r.4?, r.2))).collect();
    let spurious_tags = |et: &str| {
        let spans = doubled_spans.get(et).map(Vec::as_slice).unwrap_or(&[]);
        let windows = h.fault_windows();
        let mut tags = dead_letter_tags(h, "spurious_crossing", "security", Through::Broker, 0);
        tags.retain(|tag| {
            !tag.starts_with("fault:")
                || windows.iter().any(|(w, from, to)| {
                    w == tag && spans.iter().any(|(a, b)| from.saturating_sub(WINDOW_SLACK_MS) <= *b && to.saturating_add(WINDOW_SLACK_MS) >= *a)
                })
        });
        tags
    };
    // Events matched to their transaction's row; events without a known transaction, by
    // their reported count.
    let mut matched: BTreeMap<String, usize> = BTreeMap::new();
    let mut by_count: BTreeMap<String, usize> = BTreeMap::new();
    let (mut wrong_arrival, mut spurious, mut events) = (0, 0, 0);
    for e in h.iter() {
        let Event::ThresholdExceeded { event_type, count, tx } = &e.event else { continue };
        events += 1;
        let Some(tx) = tx.as_deref() else {
            if *count == CROSSING as i64 {
                *by_count.entry(event_type.clone()).or_default() += 1;
            } else {
                wrong_arrival += 1;
                v.blame(dead_letter_tags(h, "re_emitted", "security", Through::Nothing, 0));
                v.witness(format!("{event_type}: a threshold event was emitted at in-window count {count}, not at the crossing from 10 to 11"));
            }
            continue;
        };
        let crossed = |of: &BTreeMap<String, Vec<Option<String>>>| of.get(event_type).is_some_and(|txs| txs.iter().any(|t| t.as_deref() == Some(tx)));
        let ours = count_at.get(tx).copied();
        if crossed(&expected) {
            *matched.entry(event_type.clone()).or_default() += 1;
        } else if crossed(&inflated) {
            spurious += 1;
            v.blame(spurious_tags(event_type));
            v.witness(format!(
                "{event_type}: a threshold event announces an arrival that crosses only when {} row(s) that are no occurrence of their own are counted",
                all_rows_of(&every_row, event_type) - per_type.get(event_type.as_str()).copied().unwrap_or(0)
            ));
        } else {
            wrong_arrival += 1;
            v.blame(dead_letter_tags(h, "re_emitted", "security", Through::Nothing, 0));
            let at = match (row_type.get(tx), ours) {
                (Some(et), Some(n)) => format!("the arrival of a {et} dead letter at in-window count {n} by the harness's own count"),
                (Some(et), None) => format!("the arrival of a {et} dead letter outside the window"),
                (None, _) => "no audit row at all".to_owned(),
            };
            v.witness(format!("{event_type}: a threshold event (reporting count {count}) was staged with {at}, not at a crossing from 10 to 11"));
        }
    }
    let types: std::collections::BTreeSet<String> = expected.keys().cloned().chain(matched.keys().cloned()).chain(by_count.keys().cloned()).collect();
    let mut missed = 0;
    for et in &types {
        let want = expected.get(et).map_or(0, Vec::len);
        let got = matched.get(et).copied().unwrap_or(0) + by_count.get(et).copied().unwrap_or(0);
        let could = inflated.get(et).map_or(0, Vec::len);
        let occurrences = per_type.get(et.as_str()).copied().unwrap_or(0);
        if got > want && got <= could {
            // Announced (by count) at a crossing only rows that are no occurrence of their own
            // (a redelivery recorded twice, #1181) could reach.
            spurious += got - want;
            v.blame(spurious_tags(et));
            v.witness(format!(
                "{et}: {occurrences} recorded occurrence(s) cross the threshold {want} time(s), but {got} threshold event(s) were emitted: a crossing the occurrences never made, reached only by counting {} row(s) that are no occurrence of their own",
                all_rows_of(&every_row, et) - occurrences
            ));
        } else if got != want {
            if got < want {
                missed += want - got;
            }
            v.blame(dead_letter_tags(h, if got > want { "re_emitted" } else { "missed_crossing" }, "security", Through::Nothing, 0));
            v.witness(format!(
                "{et}: {occurrences} recorded occurrence(s) cross the threshold {want} time(s), but {got} threshold event(s) were emitted at a crossing{}",
                if got > want { " (re-emitted during a sustained breach)" } else { " (a crossing went unannounced)" }
            ));
        }
    }
    v.count("audit_rows", all_rows);
    v.count("occurrences", rows.len());
    v.count("crossings", expected.values().map(Vec::len).sum());
    v.count("threshold_events", events);
    v.count("off_crossing_events", wrong_arrival);
    v.count("spurious_events", spurious);
    v.count("missed_crossings", missed);
    v.count("rows_typed_otherwise_by_the_tap", relabelled);
    v.settle(rows.is_empty(), "nothing to check: no dead letter was audited")
}

/// How many of `rows` are of event type `et`.
pub(super) fn all_rows_of(rows: &[(i64, i64, &str, &str, Option<&str>)], et: &str) -> usize {
    rows.iter().filter(|r| r.2 == et).count()
}
