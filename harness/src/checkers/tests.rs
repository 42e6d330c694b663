//! Literal-history tests of every checker.

use super::*;
use crate::history::Phase;

fn id(n: u128) -> Uuid {
    Uuid::from_u128(n)
}

fn write(h: &mut History, t: u64, n: u128, outcome: Outcome) {
    h.push(t, Event::Write { referral: id(n), replica: "cases-1".into(), outcome, status: None, answered_ms: None });
}

fn effect(h: &mut History, t: u64, env: u128, referral: u128) {
    h.push(t, Event::Effect { envelope: id(env), referral: Some(id(referral)), service: "rules".into(), replica: Some("rules-1".into()) });
}

fn started(h: &mut History, t: u64, replica: &str, compat: &[&str]) {
    h.push(t, Event::Started { replica: replica.into(), compat: compat.iter().map(|c| c.to_string()).collect() });
}

/// A dead letter the harness staged (for rules to refuse), seen by the tap: its envelope is
/// a digest of `key`'s first two bytes, so one key's copies name one envelope.
fn tapped(h: &mut History, key: &str, token: Option<&str>) {
    tapped_at(h, 10, key, token);
}

/// As [`tapped`], the tap seeing it at `t`.
fn tapped_at(h: &mut History, t: u64, key: &str, token: Option<&str>) {
    let env = key_envelope(key);
    h.push(1, Event::DeadLetterStaged { envelope: env, service: "rules".into() });
    h.push(t, Event::DeadLettered { key: key.into(), token: token.map(str::to_owned), envelope: Some(env), queue: None, event_type: None });
}

/// Fault `kind` on `target` in force from `from` to `to`.
fn window(h: &mut History, (from, to): (u64, u64), kind: &str, target: &str) {
    h.push(from, Event::Fault { kind: kind.into(), target: target.into(), phase: Phase::Start });
    h.push(to, Event::Fault { kind: kind.into(), target: target.into(), phase: Phase::End });
}

/// The tap saw envelope `env` dead-lettered from `queue` at `t` (as occurrence `key`,
/// `token`), and security recorded it.
fn dead_lettered(h: &mut History, t: u64, env: u128, queue: &str, key: &str, token: &str, event_type: &str) {
    h.push(t, Event::DeadLettered { key: key.into(), token: Some(token.into()), envelope: Some(id(env)), queue: Some(queue.into()), event_type: None });
    audited(h, key, Some(token), "recorded", event_type, t as i64);
}

/// `replica` gave envelope `env` up at `rejected`, and [`dead_lettered`] at `tapped`.
#[allow(clippy::too_many_arguments)]
fn given_up(h: &mut History, (rejected, tapped): (u64, u64), replica: &str, env: u128, queue: &str, key: &str, token: &str, event_type: &str) {
    h.push(rejected, Event::Rejected { envelope: id(env), replica: replica.into(), compat: vec![] });
    dead_lettered(h, tapped, env, queue, key, token, event_type);
}

fn key_envelope(key: &str) -> Uuid {
    id(0xdead_0000 + key.bytes().take(2).fold(0u128, |a, b| a * 256 + u128::from(b)))
}

fn audited(h: &mut History, key: &str, token: Option<&str>, disposition: &str, event_type: &str, received: i64) {
    h.push(
        20,
        Event::Audited {
            key: key.into(),
            disposition: disposition.into(),
            token: token.map(str::to_owned),
            envelope: None,
            event_type: Some(event_type.into()),
            received_epoch_ms: received,
            window_epoch_ms: received,
            tx: None,
        },
    );
}

/// Issue 21.1: a delivery left in the capture queue (acked off the DLQ, no audit row) is
/// a violation of its own kind, even when every tapped occurrence has its row; a
/// capture queue the harness could not read leaves the verdict open.
#[test]
fn dlq_occurrence_once_counts_what_was_left_captured() {
    let base = || {
        let mut h = History::default();
        started(&mut h, 0, "security-1", &[]);
        tapped(&mut h, "k1", Some("xdeath:1"));
        audited(&mut h, "k1", Some("xdeath:1"), "recorded", "a", 1);
        h
    };
    let mut h = base();
    h.push(30, Event::CaptureLeft { count: 2 });
    h.sort();
    let v = dlq_occurrence_once(&h);
    assert_eq!((v.validity, v.counts["captured"]), (Validity::Invalid, 2), "{v:?}");
    assert!(v.all_point_at("kind:captured"), "{:?}", v.culprits);
    let mut unread = base();
    unread.push(30, Event::CaptureLeft { count: u32::MAX });
    unread.sort();
    assert_eq!(dlq_occurrence_once(&unread).validity, Validity::Unknown);
    let mut clean = base();
    clean.sort();
    assert_eq!(dlq_occurrence_once(&clean).validity, Validity::Valid);
}

/// Issue 9: one row per occurrence holds; a DLQ redelivery recorded twice (pre-1181: no
/// token at the recorder, so a tokenless row of the same bytes) is doubled; a dead
/// letter with no row is lost (pre-1197's log-and-ack); a row of bytes that never
/// reached craig.dlx is unexplained. Each is blamed on the recorder's compat.
#[test]
fn dlq_occurrence_once_finds_lost_doubled_and_unexplained_rows() {
    let mut h = History::default();
    started(&mut h, 0, "security-1", &[]);
    tapped(&mut h, "k1", Some("xdeath:1"));
    tapped(&mut h, "k2", Some("dlxcap:2"));
    // A retried surface: the same token in other bytes (surfaced_at differs).
    tapped(&mut h, "k2b", Some("dlxcap:2"));
    tapped(&mut h, "k3", None);
    audited(&mut h, "k1", Some("xdeath:1"), "recorded", "a", 1);
    audited(&mut h, "k2", Some("dlxcap:2"), "recorded", "a", 2);
    audited(&mut h, "k3", None, "tokenless", "a", 3);
    h.sort();
    let v = dlq_occurrence_once(&h);
    assert_eq!(v.validity, Validity::Valid, "{v:?}");
    assert_eq!((v.counts["occurrences"], v.counts["audit_rows"]), (3, 3));

    let mut doubled = History::default();
    started(&mut doubled, 0, "security-1", &["pre-1181"]);
    tapped(&mut doubled, "k1", Some("xdeath:1"));
    audited(&mut doubled, "k1", None, "tokenless", "a", 1);
    audited(&mut doubled, "k1", None, "tokenless", "a", 2);
    doubled.sort();
    let v = dlq_occurrence_once(&doubled);
    assert_eq!((v.validity, v.counts["doubled"]), (Validity::Invalid, 1), "{v:?}");
    assert!(v.all_point_at("compat:pre-1181") && v.all_point_at("kind:doubled"), "{:?}", v.culprits);
    // Issue 22.8: a fault over before the occurrence reached craig.dlx did not record it
    // twice; one in force after it may have.
    let mut late = History::default();
    started(&mut late, 0, "security-1", &["pre-1181"]);
    late.push(100, Event::Fault { kind: "crash".into(), target: "security-1".into(), phase: Phase::Start });
    late.push(200, Event::Fault { kind: "crash".into(), target: "security-1 restarted".into(), phase: Phase::End });
    tapped_at(&mut late, 5_000, "k1", Some("xdeath:1"));
    window(&mut late, (6_000, 7_000), "kill", "broker");
    audited(&mut late, "k1", None, "tokenless", "a", 1);
    audited(&mut late, "k1", None, "tokenless", "a", 2);
    late.sort();
    let v = dlq_occurrence_once(&late);
    assert_eq!(v.counts["doubled"], 1, "{v:?}");
    assert!(v.all_point_at("fault:kill broker") && !v.culprits.contains_key("fault:crash security-1"), "{:?}", v.culprits);

    let mut lost = History::default();
    started(&mut lost, 0, "security-1", &["pre-1197"]);
    lost.push(5, Event::Fault { kind: "down".into(), target: "security-1->database".into(), phase: Phase::Start });
    lost.push(50, Event::Fault { kind: "down".into(), target: "security-1->database".into(), phase: Phase::End });
    lost.push(6, Event::Fault { kind: "kill".into(), target: "rules-1".into(), phase: Phase::Start });
    tapped(&mut lost, "k1", Some("xdeath:1"));
    tapped(&mut lost, "k2", Some("xdeath:2"));
    audited(&mut lost, "k2", Some("xdeath:2"), "recorded", "a", 2);
    audited(&mut lost, "zz", Some("xdeath:9"), "recorded", "a", 3);
    lost.sort();
    let v = dlq_occurrence_once(&lost);
    assert_eq!((v.counts["lost"], v.counts["unexplained_rows"]), (1, 1), "{v:?}");
    // Issue 22.8: nothing corroborates pre-1197 for this loss (no replica logged acking it
    // unrecorded): the loss names no compat mode, only the unknown recorder.
    assert_eq!(v.culprits.get("compat:pre-1197"), Some(&1), "only the unexplained row: {:?}", v.culprits);
    assert_eq!(v.culprits["replica:unknown"], 1, "{:?}", v.culprits);
    // Each violation carries its own kind; a twin naming `kind:lost` is not met by the
    // unexplained row, and the link cut is blamed for the loss only.
    assert_eq!((v.culprits["kind:lost"], v.culprits["kind:unexplained"]), (1, 1), "{:?}", v.culprits);
    assert_eq!(v.culprits["fault:down security-1->database"], 1, "{:?}", v.culprits);
    assert!(!v.all_point_at("kind:lost"));
    assert!(!v.culprits.contains_key("fault:kill rules-1"), "another service's fault is no cause: {:?}", v.culprits);

    assert_eq!(dlq_occurrence_once(&History::default()).validity, Validity::Unknown);

    // Issue 22.8: a fault that ended before the dead letter reached craig.dlx is no
    // cause of its loss; the replica that logged acking it unrecorded, with its compat,
    // is (corroborated).
    let mut late = History::default();
    started(&mut late, 0, "security-1", &["pre-1197"]);
    late.push(1, Event::Fault { kind: "down".into(), target: "security-1->database".into(), phase: Phase::Start });
    late.push(2, Event::Fault { kind: "down".into(), target: "security-1->database".into(), phase: Phase::End });
    late.push(1, Event::DeadLetterStaged { envelope: key_envelope("k1"), service: "rules".into() });
    late.push(5000, Event::DeadLettered { key: "k1".into(), token: Some("xdeath:1".into()), envelope: Some(key_envelope("k1")), queue: None, event_type: None });
    late.sort();
    let v = dlq_occurrence_once(&late);
    assert!(v.all_point_at("kind:lost") && v.all_point_at("replica:unknown"), "{:?}", v.culprits);
    assert!(!v.culprits.contains_key("fault:down security-1->database") && !v.culprits.contains_key("compat:pre-1197"), "{:?}", v.culprits);
    late.push(5100, Event::AckedUnrecorded { key: "k1".into(), replica: "security-1".into(), compat: vec!["pre-1197".into()] });
    late.sort();
    let v = dlq_occurrence_once(&late);
    assert!(v.all_point_at("compat:pre-1197") && v.all_point_at("kind:lost"), "{:?}", v.culprits);
}

/// Completed XOR dead-lettered: an envelope that took effect and was also dead-lettered
/// from the same consumer queue is a violation unless the inbox re-ran it in between.
#[test]
fn an_envelope_both_handled_and_dead_lettered_is_a_violation() {
    let mut h = History::default();
    started(&mut h, 0, "security-1", &[]);
    h.push(1, Event::Effect { envelope: id(1), referral: None, service: "rules".into(), replica: Some("rules-1".into()) });
    h.push(1, Event::DeadLetterStaged { envelope: id(1), service: "rules".into() });
    h.push(2, Event::DeadLettered { key: "k1".into(), token: Some("xdeath:1".into()), envelope: Some(id(1)), queue: Some("craig-rules.events".into()), event_type: None });
    audited(&mut h, "k1", Some("xdeath:1"), "recorded", "a", 1);
    h.sort();
    let v = dlq_occurrence_once(&h);
    assert_eq!(v.counts["completed_and_dead_lettered"], 1, "{v:?}");
    // Issue 22.8: only the #1180 window excuses it: this consumer's replica died after the
    // effect, then one of its replicas re-ran or gave the envelope up, before the dead letter
    // (x-death's time is whole seconds: up to 1 s early).
    let crashed = |h: &mut History, t: u64, replica: &str| h.push(t, Event::Crash { replica: replica.into(), consumer: true, how: "SIGKILL".into() });
    let gave_up = |h: &mut History, t: u64, replica: &str| h.push(t, Event::Rejected { envelope: id(1), replica: replica.into(), compat: vec![] });
    for (crash, by, rerun, why) in [
        (None, "rules-1", 1_000, "a re-run with no crash"),
        (Some(("security-1", 1)), "rules-1", 1_000, "another service's crash"),
        (Some(("rules-1", 1)), "security-1", 1_000, "another service's re-run"),
        (Some(("rules-1", 1)), "rules-1", 5_000, "a re-run after the dead letter"),
    ] {
        let mut other = h.clone();
        if let Some((r, t)) = crash {
            crashed(&mut other, t, r);
        }
        gave_up(&mut other, rerun, by);
        other.sort();
        assert_eq!(dlq_occurrence_once(&other).counts["completed_and_dead_lettered"], 1, "{why} excuses nothing");
    }
    // Handled after it was dead-lettered: a replay (§D4), not this violation.
    let mut replayed = h.clone();
    replayed.push(9_000, Event::Effect { envelope: id(1), referral: None, service: "security".into(), replica: Some("security-1".into()) });
    replayed.push(3_000, Event::DeadLettered { key: "k9".into(), token: Some("xdeath:9".into()), envelope: Some(id(1)), queue: Some("craig-security.events".into()), event_type: None });
    audited(&mut replayed, "k9", Some("xdeath:9"), "recorded", "a", 2);
    replayed.sort();
    assert_eq!(dlq_occurrence_once(&replayed).counts["completed_and_dead_lettered"], 1, "only the rules one: {:?}", dlq_occurrence_once(&replayed).witnesses);
    // A crash long after the effect (past the stamp's due time) is not the window.
    let due = |crash_at: u64| {
        let mut x = History::default();
        started(&mut x, 0, "security-1", &[]);
        x.push(1, Event::Effect { envelope: id(1), referral: None, service: "rules".into(), replica: Some("rules-1".into()) });
        x.push(1, Event::DeadLetterStaged { envelope: id(1), service: "rules".into() });
        x.push(crash_at, Event::Crash { replica: "rules-1".into(), consumer: true, how: "SIGKILL".into() });
        x.push(crash_at + 1, Event::Rejected { envelope: id(1), replica: "rules-1".into(), compat: vec![] });
        x.push(2_600, Event::DeadLettered { key: "k1".into(), token: Some("xdeath:1".into()), envelope: Some(id(1)), queue: Some("craig-rules.events".into()), event_type: None });
        audited(&mut x, "k1", Some("xdeath:1"), "recorded", "a", 1);
        x.sort();
        dlq_occurrence_once(&x).counts["completed_and_dead_lettered"]
    };
    assert_eq!((due(1_500), due(1 + STAMP_DUE_MS + 1)), (0, 1), "a crash past the stamp's due time is not the window");
    // The window: rules-1 died after the effect, then gave the envelope up (a failed re-run
    // logs no inbox.reprocessed, only its surface or reject).
    let mut failed_rerun = h.clone();
    crashed(&mut failed_rerun, 1, "rules-1");
    gave_up(&mut failed_rerun, 2, "rules-1");
    failed_rerun.sort();
    assert_eq!(dlq_occurrence_once(&failed_rerun).counts["completed_and_dead_lettered"], 0, "{:?}", dlq_occurrence_once(&failed_rerun).witnesses);
    // Never for an arbiter-backed consumer (#1179 absorbs, it does not dead-letter).
    let mut arbiter = History::default();
    started(&mut arbiter, 0, "security-1", &[]);
    arbiter.push(1, Event::Effect { envelope: id(2), referral: None, service: "financial".into(), replica: Some("financial-1".into()) });
    arbiter.push(1, Event::DeadLetterStaged { envelope: id(2), service: "financial".into() });
    arbiter.push(2, Event::Crash { replica: "financial-1".into(), consumer: true, how: "SIGABRT".into() });
    arbiter.push(3, Event::Rejected { envelope: id(2), replica: "financial-1".into(), compat: vec![] });
    arbiter.push(4, Event::DeadLettered { key: "k2".into(), token: Some("dlxcap:2".into()), envelope: Some(id(2)), queue: Some("craig-financial.events".into()), event_type: None });
    audited(&mut arbiter, "k2", Some("dlxcap:2"), "recorded", "a", 1);
    arbiter.sort();
    assert_eq!(dlq_occurrence_once(&arbiter).counts["completed_and_dead_lettered"], 1, "financial is arbiter-backed");
    crashed(&mut h, 1, "rules-1");
    h.push(3, Event::Reprocessed { envelope: id(1), replica: "rules-1".into() });
    h.sort();
    assert_eq!(dlq_occurrence_once(&h).validity, Validity::Valid);
}

/// Issue 22.1: anything on craig.dlx the harness did not stage as a dead letter is a
/// violation of its own kind, blamed on the replica that said it gave it up (the absorb
/// path of `payment-crash-window` failing into the DLQ); bytes naming no envelope too.
#[test]
fn a_dead_letter_nobody_staged_is_unexpected() {
    let mut h = History::default();
    started(&mut h, 0, "security-1", &[]);
    started(&mut h, 0, "financial-1", &[]);
    tapped(&mut h, "k1", Some("xdeath:1"));
    audited(&mut h, "k1", Some("xdeath:1"), "recorded", "a", 1);
    h.sort();
    assert_eq!(dlq_occurrence_once(&h).validity, Validity::Valid);
    given_up(&mut h, (40, 41), "financial-1", 9, "craig-financial.events", "k9", "dlxcap:9", "placement.activated");
    h.sort();
    let v = dlq_occurrence_once(&h);
    assert_eq!((v.validity, v.counts["unexpected_dead_letters"]), (Validity::Invalid, 1), "{v:?}");
    assert!(v.all_point_at("kind:unexpected_dead_letter") && v.all_point_at("replica:financial-1"), "{:?}", v.culprits);
    assert!(v.witnesses[0].contains("never staged it as a dead letter"), "{:?}", v.witnesses);
    h.push(50, Event::DeadLettered { key: "kx".into(), token: None, envelope: None, queue: None, event_type: None });
    audited(&mut h, "kx", None, "tokenless", "a", 50);
    h.sort();
    let v = dlq_occurrence_once(&h);
    assert_eq!((v.counts["unexpected_dead_letters"], v.culprits["replica:unknown"]), (2, 1), "{v:?}");
}

/// Issue 22 audit: a dead letter is expected only from the queue of the consumer it was
/// staged for; the same envelope given up by another consumer (which should have handled
/// it) is unexpected, blamed on that consumer; one whose queue is named wrong is counted
/// once, as misattributed.
#[test]
fn a_staged_dead_letter_given_up_by_another_consumer_is_unexpected() {
    let base = || {
        let mut h = History::default();
        started(&mut h, 0, "security-1", &[]);
        started(&mut h, 0, "rules-1", &[]);
        started(&mut h, 0, "financial-1", &[]);
        h.push(1, Event::DeadLetterStaged { envelope: id(1), service: "financial".into() });
        given_up(&mut h, (2, 2), "financial-1", 1, "craig-financial.events", "k1", "xdeath:1", "a");
        h
    };
    let mut h = base();
    h.sort();
    assert_eq!(dlq_occurrence_once(&h).validity, Validity::Valid);
    given_up(&mut h, (3, 4), "rules-1", 1, "craig-rules.events", "k2", "xdeath:2", "a");
    h.sort();
    let v = dlq_occurrence_once(&h);
    assert_eq!((v.validity, v.counts["unexpected_dead_letters"]), (Validity::Invalid, 1), "{v:?}");
    assert!(v.all_point_at("kind:unexpected_dead_letter") && v.all_point_at("replica:rules-1"), "{:?}", v.culprits);
    // Named wrong (financial-1 gave it up, the dead letter says rules'): misattributed,
    // not also unexpected.
    let mut h = base();
    dead_lettered(&mut h, 4, 1, "craig-rules.events", "k2", "xdeath:2", "a");
    h.sort();
    let v = dlq_occurrence_once(&h);
    assert_eq!((v.violations, v.counts["unexpected_dead_letters"]), (1, 0), "{v:?}");
    assert!(v.all_point_at("kind:misattributed"), "{:?}", v.culprits);
}

/// #1156: one event per crossing, counted over occurrences (not duplicate rows); a
/// re-emit during a sustained breach (pre-1156) and a missed crossing are violations;
/// a divergent row that is itself the 11th crosses silently (R7 alert-inert); rows an
/// hour apart cross again.
#[test]
fn threshold_crossing_once_counts_crossings_of_occurrences() {
    let hour = 3_600_000;
    let build = |events: usize, compat: &[&str], divergent_11th: bool| {
        let mut h = History::default();
        started(&mut h, 0, "security-1", compat);
        for i in 0..13i64 {
            let t = format!("xdeath:{i}");
            let disposition = if divergent_11th && i == 10 { "divergent" } else { "recorded" };
            audited(&mut h, &format!("k{i}"), Some(&t), disposition, "case.referral_created", 1_000 + i);
        }
        // A duplicate row of an occurrence already counted: not a crossing of its own.
        audited(&mut h, "k0", Some("xdeath:0"), "recorded", "case.referral_created", 2_000);
        for _ in 0..events {
            h.push(30, Event::ThresholdExceeded { event_type: "case.referral_created".into(), count: 11, tx: None });
        }
        h.sort();
        h
    };
    let v = threshold_crossing_once(&build(1, &[], false));
    assert_eq!((v.validity, v.counts["crossings"]), (Validity::Valid, 1), "{v:?}");
    let v = threshold_crossing_once(&build(3, &["pre-1156"], false));
    assert_eq!(v.validity, Validity::Invalid);
    assert!(v.all_point_at("compat:pre-1156") && v.all_point_at("kind:re_emitted"), "{:?}", v.culprits);
    let v = threshold_crossing_once(&build(0, &[], false));
    assert!(v.all_point_at("kind:missed_crossing"), "a missed crossing: {:?}", v.culprits);
    let v = threshold_crossing_once(&build(0, &[], true));
    assert_eq!((v.validity, v.counts["crossings"]), (Validity::Valid, 0), "the divergent 11th is alert-inert: {v:?}");
    // One event, but at the 12th arrival: not the crossing (the audit's word on that).
    let mut late = build(0, &[], false);
    late.push(40, Event::ThresholdExceeded { event_type: "case.referral_created".into(), count: 12, tx: None });
    late.sort();
    let v = threshold_crossing_once(&late);
    assert_eq!((v.validity, v.counts["off_crossing_events"]), (Validity::Invalid, 1), "{v:?}");
    assert!(v.witnesses.iter().any(|w| w.contains("emitted at in-window count 12, not at the crossing from 10 to 11")), "{:?}", v.witnesses);
    assert!(v.culprits.contains_key("kind:re_emitted") && v.culprits.contains_key("kind:missed_crossing"), "{:?}", v.culprits);

    // 11 in one hour, then 11 more two hours later: two crossings.
    let mut h = History::default();
    for i in 0..22i64 {
        let at = if i < 11 { i } else { 2 * hour + i };
        audited(&mut h, &format!("k{i}"), Some(&format!("xdeath:{i}")), "recorded", "t", at);
    }
    h.push(30, Event::ThresholdExceeded { event_type: "t".into(), count: 11, tx: None });
    let v = threshold_crossing_once(&h);
    assert_eq!((v.counts["crossings"], v.validity), (2, Validity::Invalid), "{v:?}");
}

/// Issue 22.4: the threshold checker keeps its own count. A recorder whose count leaves
/// out the arriving row fires at the 12th dead letter while reporting `count = 11`:
/// matched to its transaction's row (the 12th), it is an event at the wrong arrival and
/// the 11th's crossing is missed. Rows typed by the tap, not by the recorder's column:
/// unparseable dead letters the recorder left untyped still cross.
#[test]
fn threshold_crossing_once_matches_each_event_to_its_transactions_row() {
    let build = |fired_at: usize, column: Option<&str>| {
        let mut h = History::default();
        started(&mut h, 0, "security-1", &[]);
        for i in 0..13usize {
            h.push(10, Event::DeadLettered {
                key: format!("k{i}"),
                token: Some(format!("xdeath:{i}")),
                envelope: None,
                queue: None,
                event_type: Some("case.referral_created".into()),
            });
            h.push(20, Event::Audited {
                key: format!("k{i}"),
                disposition: "recorded".into(),
                token: Some(format!("xdeath:{i}")),
                envelope: None,
                event_type: column.map(str::to_owned),
                received_epoch_ms: 1_000 + i as i64,
                window_epoch_ms: 1_000 + i as i64,
                tx: Some(format!("{}", 500 + i)),
            });
        }
        // The event reports 11 whatever arrival staged it.
        h.push(30, Event::ThresholdExceeded { event_type: "case.referral_created".into(), count: 11, tx: Some(format!("{}", 500 + fired_at - 1)) });
        h.sort();
        h
    };
    let v = threshold_crossing_once(&build(11, Some("case.referral_created")));
    assert_eq!((v.validity, v.counts["crossings"]), (Validity::Valid, 1), "{v:?}");
    let v = threshold_crossing_once(&build(12, Some("case.referral_created")));
    assert_eq!(v.validity, Validity::Invalid, "fired at the 12th, reporting 11: {v:?}");
    assert!(v.culprits.contains_key("kind:re_emitted") && v.culprits.contains_key("kind:missed_crossing"), "{:?}", v.culprits);
    assert!(v.witnesses.iter().any(|w| w.contains("at in-window count 12 by the harness's own count")), "{:?}", v.witnesses);
    // Untyped by the recorder (an unparseable body), typed by the tap: still its crossing.
    let v = threshold_crossing_once(&build(11, None));
    assert_eq!((v.validity, v.counts["crossings"]), (Validity::Valid, 1), "{v:?}");
    // Typed otherwise by the recorder: the tap's type wins, and the relabelling is counted.
    let v = threshold_crossing_once(&build(11, Some("rule.evaluated")));
    assert_eq!((v.validity, v.counts["rows_typed_otherwise_by_the_tap"]), (Validity::Valid, 13), "{v:?}");
}

fn staged(h: &mut History, env: u128, referral: u128) {
    h.push(0, Event::Staged { envelope: id(env), referral: Some(id(referral)), service: "cases".into(), published: true, attempts: 1, last_error: None });
}

fn stamped(h: &mut History, t: u64, env: u128, replica: &str, compat: &[&str]) {
    h.push(t, Event::Stamped { envelope: id(env), replica: replica.into(), compat: compat.iter().map(|c| c.to_string()).collect() });
}

/// §D3: a staged dead letter that was published must reach craig.dlx (the tap) or take
/// effect; one that did neither vanished, blamed on rules' behaviour when it was
/// published (pre-d3: a queue without dead-letter arguments drops what it rejects).
#[test]
fn no_loss_follows_each_published_dead_letter_to_the_dead_letter_exchange() {
    let mut h = History::default();
    started(&mut h, 0, "cases-1", &[]);
    started(&mut h, 0, "rules-1", &["pre-d3"]);
    write(&mut h, 5, 1, Outcome::Ok);
    staged(&mut h, 11, 1);
    effect(&mut h, 50, 11, 1);
    let dead = |h: &mut History, env: u128, published: bool| {
        h.push(1, Event::DeadLetterStaged { envelope: id(env), service: "rules".into() });
        h.push(0, Event::Staged { envelope: id(env), referral: None, service: "cases".into(), published, attempts: 1, last_error: None });
    };
    dead(&mut h, 21, true); // reached craig.dlx
    h.push(40, Event::DeadLettered { key: "k21".into(), token: None, envelope: Some(id(21)), queue: Some("craig-rules.events".into()), event_type: None });
    dead(&mut h, 22, true); // rejected by rules (pre-d3), then vanished
    stamped(&mut h, 30, 22, "cases-1", &[]);
    h.push(35, Event::Rejected { envelope: id(22), replica: "rules-1".into(), compat: vec!["pre-d3".into()] });
    dead(&mut h, 23, false); // still pending: not a loss (liveness judges it)
    h.sort();
    let v = no_loss(&h);
    assert_eq!((v.validity, v.counts["dead_letters_published"], v.counts["dead_letters_lost"]), (Validity::Invalid, 2, 1), "{v:?}");
    assert!(v.all_point_at("kind:lost") && v.all_point_at("compat:pre-d3") && v.all_point_at("replica:rules-1"), "{:?}", v.culprits);
    assert!(v.witnesses[0].contains(&format!("dead letter {} ", id(22))), "{}", v.witnesses[0]);
    assert!(v.witnesses[0].contains("published @30ms, rejected by rules-1 (compat pre-d3) @35ms, and never reached craig.dlx"), "{}", v.witnesses[0]);

    // A loss no consumer reported rejecting is blamed on nothing the twin could name.
    let mut silent = History::default();
    for e in h.iter().filter(|e| !matches!(e.event, Event::Rejected { .. })) {
        silent.push(e.t_ms, e.event.clone());
    }
    let v = no_loss(&silent);
    assert_eq!(v.counts["dead_letters_lost"], 1);
    assert!(!v.all_point_at("compat:pre-d3") && v.all_point_at("compat:unknown"), "{:?}", v.culprits);
    assert!(v.witnesses[0].contains("no consumer reported rejecting it"), "{}", v.witnesses[0]);

    // The same run with current rules: every published dead letter reached craig.dlx.
    let mut ok = History::default();
    started(&mut ok, 0, "rules-1", &[]);
    write(&mut ok, 5, 1, Outcome::Ok);
    staged(&mut ok, 11, 1);
    effect(&mut ok, 50, 11, 1);
    dead(&mut ok, 22, true);
    ok.push(40, Event::DeadLettered { key: "k22".into(), token: None, envelope: Some(id(22)), queue: Some("craig-rules.events".into()), event_type: None });
    ok.sort();
    assert_eq!(no_loss(&ok).validity, Validity::Valid);
}

/// #1197: a lost occurrence the security replica reported acking unrecorded is blamed
/// on that replica, its compat and the faults on its own links at that moment only.
#[test]
fn a_lost_dead_letter_is_blamed_on_the_replica_that_acked_it_unrecorded() {
    let mut h = History::default();
    started(&mut h, 0, "security-1", &["pre-1197"]);
    h.push(0, Event::Fault { kind: "down".into(), target: "security-1->database".into(), phase: Phase::Start });
    h.push(8000, Event::Fault { kind: "down".into(), target: "security-1->database".into(), phase: Phase::End });
    h.push(9000, Event::Fault { kind: "kill".into(), target: "broker".into(), phase: Phase::Start });
    h.push(9500, Event::Fault { kind: "kill".into(), target: "broker".into(), phase: Phase::End });
    tapped(&mut h, "k1", Some("t1"));
    h.push(100, Event::AckedUnrecorded { key: "k1".into(), replica: "security-1".into(), compat: vec!["pre-1197".into()] });
    h.sort();
    let v = dlq_occurrence_once(&h);
    assert_eq!((v.validity, v.counts["lost"]), (Validity::Invalid, 1), "{v:?}");
    for c in ["kind:lost", "compat:pre-1197", "replica:security-1", "fault:down security-1->database"] {
        assert!(v.all_point_at(c), "{c}: {:?}", v.culprits);
    }
    assert!(!v.culprits.contains_key("fault:kill broker"), "not in force when it acked: {:?}", v.culprits);
    assert!(v.witnesses[0].contains("acked unrecorded by security-1 (compat pre-1197) @100ms"), "{}", v.witnesses[0]);
}

/// #1196: the app path of a pre-1196 replica keys the dead letter by the producer
/// (craig-cases) although rules' consumer gave it up: misattributed, blamed on it.
#[test]
fn a_dead_letter_naming_another_queue_than_its_consumer_is_misattributed() {
    let run = |queue: &str| {
        let mut h = History::default();
        started(&mut h, 0, "rules-1", &["pre-1196"]);
        h.push(1, Event::DeadLetterStaged { envelope: id(5), service: "rules".into() });
        h.push(20, Event::Rejected { envelope: id(5), replica: "rules-1".into(), compat: vec!["pre-1196".into()] });
        h.push(30, Event::DeadLettered { key: "k5".into(), token: Some("t5".into()), envelope: Some(id(5)), queue: Some(queue.into()), event_type: None });
        audited(&mut h, "k5", Some("t5"), "recorded", "case.referral_created", 1);
        h.sort();
        dlq_occurrence_once(&h)
    };
    let v = run("craig-cases");
    assert_eq!((v.validity, v.counts["misattributed"]), (Validity::Invalid, 1), "{v:?}");
    assert!(v.all_point_at("kind:misattributed") && v.all_point_at("compat:pre-1196"), "{:?}", v.culprits);
    assert!(v.witnesses[0].contains("names queue craig-cases, but rules-1 (compat pre-1196) @20ms gave it up consuming craig-rules.events"), "{}", v.witnesses[0]);
    let v = run("craig-rules.events");
    assert_eq!((v.validity, v.counts["misattributed"]), (Validity::Valid, 0), "{v:?}");

    // No replica logged giving it up, but the harness staged it for rules: still checked.
    let mut h = History::default();
    started(&mut h, 0, "rules-1", &["pre-1196"]);
    h.push(1, Event::DeadLetterStaged { envelope: id(6), service: "rules".into() });
    h.push(30, Event::DeadLettered { key: "k6".into(), token: Some("t6".into()), envelope: Some(id(6)), queue: Some("craig-cases".into()), event_type: None });
    audited(&mut h, "k6", Some("t6"), "recorded", "case.referral_created", 1);
    h.sort();
    let v = dlq_occurrence_once(&h);
    assert_eq!(v.counts["misattributed"], 1, "{v:?}");
    assert!(v.all_point_at("kind:misattributed") && v.all_point_at("compat:pre-1196"), "{:?}", v.culprits);
}

/// Issue 25: an event the broker confirmed (stamped published) and never delivered, when a
/// broker node lost its data AFTER the stamp, is the broker's loss: blamed on that node's
/// kill and the run's queue type. Only as far as the loss can explain: the consumer's queue
/// was held only there, and no more events were lost (stamped before it) than it held ready.
/// A loss stamped after the data loss is never the broker's.
#[test]
fn no_loss_blames_a_confirmed_event_lost_with_a_broker_nodes_disk_on_the_node_and_the_queue_type() {
    let history = |queues: Vec<(String, u64)>, lost_before: u128| {
        let mut h = History::default();
        started(&mut h, 0, "cases-1", &[]);
        for n in 1..=lost_before {
            write(&mut h, 100, n, Outcome::Ok);
            staged(&mut h, 10 + n, n);
            stamped(&mut h, 200, 10 + n, "cases-1", &[]);
        }
        h.push(1_500, Event::BrokerDataLost { node: "broker-1".into(), queue_type: "classic".into(), queues });
        write(&mut h, 5_000, 99, Outcome::Ok);
        staged(&mut h, 199, 99);
        stamped(&mut h, 5_100, 199, "cases-1", &[]);
        h.sort();
        no_loss(&h)
    };
    let rules = |m: u64| vec![("craig-rules.events".to_owned(), m)];
    let v = history(rules(1), 1);
    assert_eq!((v.validity, v.violations), (Validity::Invalid, 2));
    assert_eq!((v.culprits["fault:kill broker-1"], v.culprits["queue:classic"]), (1, 1), "{:?}", v.culprits);
    assert!(v.witnesses.iter().any(|w| w.contains("@200ms; then broker-1 lost its data @1500ms (classic queues)")), "{:?}", v.witnesses);
    // More lost than the queue held ready: something else lost them too; no broker blame.
    let v = history(rules(1), 2);
    assert!(!v.culprits.contains_key("fault:kill broker-1") && !v.culprits.contains_key("queue:classic"), "{:?}", v.culprits);
    // The consumer's queue was not held only there (another queue was): no broker blame.
    let v = history(vec![("craig-security.events".to_owned(), 50)], 1);
    assert!(!v.culprits.contains_key("fault:kill broker-1"), "{:?}", v.culprits);
}

/// Issue 25: where a confirmed event was lost, by the consumers' own inbox rows. Confirmed
/// (cases' row stamped published by the current behaviour, which stamps only after a
/// confirm), recorded by no consumer, and a broker node lost its data after the stamp:
/// `lost_at:broker`, and counted per consumer queue. Recorded processed by a consumer:
/// `lost_at:consumer`. No place is named for a stamp by pre-1128 (no confirm behind it), a
/// dead letter the tap saw, a consumer without the inbox (pre-d2), no committed row to name
/// its queue, an inbox row never stamped processed (the delivery went back to the broker),
/// or no data loss recorded (never delivered could then be a consumer's doing).
#[test]
fn no_loss_names_where_a_confirmed_event_was_lost_by_the_consumers_inboxes() {
    #[derive(Clone, Copy, PartialEq, Debug)]
    enum Then {
        DataLost,
        Handled,
        InboxedUnprocessed,
        Tapped,
        PreD2Consumer,
        NotCommitted,
        NoDataLoss,
        OtherQueueLost,
    }
    let run = |stamp_compat: &[&str], then: Then| {
        let mut h = History::default();
        started(&mut h, 0, "cases-1", stamp_compat);
        started(&mut h, 0, "rules-1", if then == Then::PreD2Consumer { &["pre-d2"] } else { &[] });
        // One delivered write, one lost.
        for n in [1, 2] {
            write(&mut h, 100, n, Outcome::Ok);
            staged(&mut h, 10 + n, n);
            stamped(&mut h, 200, 10 + n, "cases-1", stamp_compat);
            if then != Then::NotCommitted {
                h.push(90, Event::Committed { aggregate: id(n), table: "referrals".into() });
            }
        }
        h.push(300, Event::Inboxed { envelope: id(11), service: "rules".into(), processed: true, processed_ms: Some(300) });
        effect(&mut h, 310, 11, 1);
        if then != Then::NoDataLoss {
            // The node held rules' queue (or, for OtherQueueLost, only financial's).
            let q = if then == Then::OtherQueueLost { "craig-financial.events" } else { "craig-rules.events" };
            h.push(1_500, Event::BrokerDataLost { node: "broker-1".into(), queue_type: "classic".into(), queues: vec![(q.into(), 5)] });
        }
        match then {
            Then::Handled => h.push(400, Event::Inboxed { envelope: id(12), service: "rules".into(), processed: true, processed_ms: Some(400) }),
            Then::InboxedUnprocessed => h.push(400, Event::Inboxed { envelope: id(12), service: "rules".into(), processed: false, processed_ms: None }),
            Then::Tapped => h.push(
                400,
                Event::DeadLettered { key: "k".into(), token: None, envelope: Some(id(12)), queue: Some("craig-rules.events".into()), event_type: None },
            ),
            _ => {}
        }
        h.sort();
        no_loss(&h)
    };
    let v = run(&[], Then::DataLost);
    assert_eq!((v.validity, v.violations), (Validity::Invalid, 1));
    assert_eq!(v.culprits.get("lost_at:broker"), Some(&1), "{:?}", v.culprits);
    assert!(v.witnesses[0].contains("no consumer's inbox recorded it: confirmed by the broker and lost with its data"), "{:?}", v.witnesses);
    assert_eq!((v.counts["confirmed craig-rules.events"], v.counts["confirmed_never_delivered craig-rules.events"]), (2, 1), "{:?}", v.counts);
    let v = run(&[], Then::Handled);
    assert_eq!(v.culprits.get("lost_at:consumer"), Some(&1), "{:?}", v.culprits);
    assert!(!v.culprits.contains_key("lost_at:broker"), "{:?}", v.culprits);
    assert_eq!(v.counts["confirmed_never_delivered craig-rules.events"], 0, "{:?}", v.counts);
    for (compat, then) in [
        (&["pre-1128"][..], Then::DataLost),
        (&[][..], Then::InboxedUnprocessed),
        (&[][..], Then::Tapped),
        (&[][..], Then::PreD2Consumer),
        (&[][..], Then::NotCommitted),
        (&[][..], Then::NoDataLoss),
        (&[][..], Then::OtherQueueLost),
    ] {
        let v = run(compat, then);
        assert_eq!(v.violations, 1);
        assert!(!v.culprits.keys().any(|k| k.starts_with("lost_at:")), "{compat:?} {then:?}: {:?}", v.culprits);
    }
    // A node that held only another consumer's queue is not this loss's place or cause.
    let v = run(&[], Then::OtherQueueLost);
    assert!(!v.culprits.contains_key("fault:kill broker-1"), "{:?}", v.culprits);
    // Never delivered, as the outbox and the inboxes say, still counts without a data loss.
    let v = run(&[], Then::NoDataLoss);
    assert_eq!(v.counts["confirmed_never_delivered craig-rules.events"], 1, "{:?}", v.counts);
    // A dead letter the tap saw was delivered (and refused): not counted never delivered.
    let v = run(&[], Then::Tapped);
    assert_eq!(v.counts["confirmed_never_delivered craig-rules.events"], 0, "{:?}", v.counts);
    // A pre-1128 stamp had no confirm behind it: nothing counted as confirmed.
    let v = run(&["pre-1128"], Then::DataLost);
    assert!(!v.counts.keys().any(|k| k.starts_with("confirmed")), "{:?}", v.counts);
}

/// A rolling upgrade: cases-1 runs pre-1128 until 1000 ms, then current. Each loss is
/// blamed on whoever stamped it with the behaviour it ran then, and a loss nobody
/// stamped on the replica that acknowledged the write.
#[test]
fn no_loss_blames_each_loss_on_the_stamping_replica_and_its_compat_at_the_time() {
    let mut h = History::default();
    started(&mut h, 0, "cases-1", &["pre-1128"]);
    started(&mut h, 0, "cases-2", &["pre-1128"]);
    started(&mut h, 1000, "cases-1", &[]);
    write(&mut h, 100, 1, Outcome::Ok); // stamped by old cases-2, lost
    staged(&mut h, 11, 1);
    stamped(&mut h, 300, 11, "cases-2", &["pre-1128"]);
    write(&mut h, 200, 2, Outcome::Ok); // stamped by old cases-1, lost
    staged(&mut h, 12, 2);
    stamped(&mut h, 400, 12, "cases-1", &["pre-1128"]);
    write(&mut h, 300, 3, Outcome::Ok); // delivered
    staged(&mut h, 13, 3);
    effect(&mut h, 500, 13, 3);
    let v = no_loss(&h);
    assert_eq!((v.validity, v.violations), (Validity::Invalid, 2));
    assert!(v.all_point_at("compat:pre-1128"), "{:?}", v.culprits);
    assert_eq!((v.culprits["replica:cases-1"], v.culprits["replica:cases-2"]), (1, 1));
    assert!(v.witnesses[0].contains("stamped published by cases-2 (compat pre-1128) @300ms"), "{}", v.witnesses[0]);

    // After the upgrade, cases-1 (current) stamps an event that never arrives: a loss of
    // current behaviour, so the violations no longer all point at pre-1128.
    write(&mut h, 1500, 4, Outcome::Ok);
    staged(&mut h, 14, 4);
    stamped(&mut h, 1600, 14, "cases-1", &[]);
    h.sort();
    let v = no_loss(&h);
    assert_eq!(v.violations, 3);
    assert!(!v.all_point_at("compat:pre-1128"));
    assert_eq!(v.culprits["compat:current"], 1);

    // Never stamped: the replica that acknowledged it, with its compat at the time.
    let mut h = History::default();
    started(&mut h, 0, "cases-1", &["pre-d1"]);
    write(&mut h, 100, 1, Outcome::Ok);
    let v = no_loss(&h);
    assert!(v.all_point_at("compat:pre-d1") && v.all_point_at("replica:cases-1"), "{:?}", v.culprits);
    assert!(v.witnesses[0].contains("never stamped published (cases-1 (compat pre-d1) acknowledged it)"), "{}", v.witnesses[0]);
}

/// A twin's fault cause: a loss points at the faults in force on the stamping replica's
/// own links (or the servers) when it stamped; a stamp no replica logged points nowhere.
#[test]
fn no_loss_blames_the_faults_in_force_when_the_event_was_stamped() {
    let fault = |h: &mut History, t, phase| {
        h.push(t, Event::Fault { kind: "toxic".into(), target: "cases-1->broker (timeout upstream)".into(), phase })
    };
    let mut h = History::default();
    started(&mut h, 0, "cases-1", &["pre-1128"]);
    fault(&mut h, 400, Phase::Start);
    fault(&mut h, 2400, Phase::End);
    h.push(500, Event::Fault { kind: "down".into(), target: "cases-2->broker".into(), phase: Phase::Start });
    write(&mut h, 300, 1, Outcome::Ok);
    staged(&mut h, 11, 1);
    stamped(&mut h, 900, 11, "cases-1", &["pre-1128"]); // inside the black hole
    write(&mut h, 3000, 2, Outcome::Ok);
    staged(&mut h, 12, 2);
    stamped(&mut h, 3100, 12, "cases-1", &["pre-1128"]); // long after it healed
    h.sort();
    let v = no_loss(&h);
    assert_eq!(v.violations, 2);
    assert_eq!(v.culprits.get("fault:toxic cases-1->broker"), Some(&1));
    assert!(!v.culprits.contains_key("fault:down cases-2->broker"), "another replica's link is not this loss's cause");
    assert!(!v.all_point_at("fault:toxic cases-1->broker"));

    // Stamped published, but no `outbox.stamped` line: no attribution evidence.
    let mut h = History::default();
    started(&mut h, 0, "cases-1", &["pre-1128"]);
    write(&mut h, 100, 1, Outcome::Ok);
    staged(&mut h, 11, 1);
    let v = no_loss(&h);
    assert_eq!(v.culprits.get("compat:unknown"), Some(&1));
    assert!(!v.all_point_at("compat:pre-1128"));
}

/// current → pre-d2 → current: the last run is the current replica's own failed dedup
/// (an inbox had recorded it), not the old replica's doing.
#[test]
fn a_current_replicas_failed_dedup_is_its_own() {
    let run = |h: &mut History, t: u64, replica: &str| {
        h.push(t, Event::Effect { envelope: id(1), referral: Some(id(1)), service: "rules".into(), replica: Some(replica.into()) });
    };
    let mut h = History::default();
    started(&mut h, 0, "rules-1", &["pre-d2"]);
    started(&mut h, 0, "rules-2", &[]);
    h.push(50, Event::Write { referral: id(1), replica: "cases-1".into(), outcome: Outcome::Ok, status: Some(201), answered_ms: None });
    h.push(90, Event::Fault { kind: "crash".into(), target: "cases-1 at outbox::after_publish_before_stamp".into(), phase: Phase::Start });
    h.push(150, Event::Fault { kind: "crash".into(), target: "cases-1 restarted".into(), phase: Phase::End });
    h.push(300, Event::Stamped { envelope: id(1), replica: "cases-1".into(), compat: vec![] });
    run(&mut h, 100, "rules-2");
    run(&mut h, 420, "rules-1");
    run(&mut h, 500, "rules-2");
    h.sort();
    let v = effect_once(&h);
    assert_eq!(v.violations, 2);
    assert_eq!(v.culprits["compat:pre-d2"], 1, "{:?}", v.culprits);
    assert_eq!(v.culprits["compat:current"], 2);
    assert_eq!(v.culprits["fault:crash cases-1"], 1, "one re-publish explains one duplicate, the first");
    assert!(!v.all_point_at("compat:pre-d2"));
}

/// A mixed consumer fleet: a duplicate involving the pre-d2 replica points at pre-d2; one
/// between two current runs does not, and the twin's cause check then fails.
#[test]
fn effect_once_blames_both_runs_of_a_duplicate() {
    let run = |h: &mut History, t: u64, env: u128, replica: &str| {
        h.push(t, Event::Effect { envelope: id(env), referral: Some(id(env)), service: "rules".into(), replica: Some(replica.into()) });
    };
    let mut h = History::default();
    started(&mut h, 0, "rules-1", &["pre-d2"]);
    started(&mut h, 0, "rules-2", &[]);
    run(&mut h, 100, 1, "rules-2");
    run(&mut h, 900, 1, "rules-1");
    run(&mut h, 200, 2, "rules-1");
    run(&mut h, 950, 2, "rules-2");
    h.sort();
    let v = effect_once(&h);
    assert_eq!((v.validity, v.violations), (Validity::Invalid, 2));
    assert!(v.all_point_at("compat:pre-d2"), "{:?}", v.culprits);
    assert!(v.witnesses.iter().any(|w| w.contains("on rules-2 (current) @100ms and again on rules-1 (compat pre-d2) @900ms")), "{:?}", v.witnesses);
    run(&mut h, 300, 3, "rules-2");
    run(&mut h, 990, 3, "rules-2");
    h.sort();
    let v = effect_once(&h);
    assert_eq!(v.violations, 3);
    assert!(!v.all_point_at("compat:pre-d2"), "{:?}", v.culprits);
}

/// 20-seed run finding: a producer crash between publish and stamp re-publishes a batch;
/// when the consumer lags, BOTH runs come after the crash has healed. The duplicate is
/// still blamed on that crash (it began after the write, before the second run, on the
/// producing service), and not on a crash of another service or one before the write.
#[test]
fn a_duplicate_is_blamed_on_the_producer_crash_that_republished_it_even_when_the_consumer_lags() {
    let mut h = History::default();
    started(&mut h, 0, "rules-1", &["pre-d2"]);
    started(&mut h, 0, "cases-1", &[]);
    h.push(50, Event::Fault { kind: "crash".into(), target: "cases-1 at outbox::x".into(), phase: Phase::Start });
    h.push(60, Event::Fault { kind: "crash".into(), target: "cases-1 at outbox::x".into(), phase: Phase::End });
    h.push(100, Event::Write { referral: id(1), replica: "cases-1".into(), outcome: Outcome::Ok, status: Some(201), answered_ms: None });
    h.push(700, Event::Fault { kind: "crash".into(), target: "cases-1 at outbox::after_publish_before_stamp".into(), phase: Phase::Start });
    h.push(720, Event::Fault { kind: "kill".into(), target: "security-1".into(), phase: Phase::Start });
    h.push(1000, Event::Fault { kind: "crash".into(), target: "cases-1 at outbox::after_publish_before_stamp".into(), phase: Phase::End });
    h.push(1010, Event::Fault { kind: "kill".into(), target: "security-1".into(), phase: Phase::End });
    h.push(1340, Event::Effect { envelope: id(101), referral: Some(id(1)), service: "rules".into(), replica: Some("rules-1".into()) });
    h.push(4000, Event::Stamped { envelope: id(101), replica: "cases-1".into(), compat: vec![] });
    h.push(4750, Event::Effect { envelope: id(101), referral: Some(id(1)), service: "rules".into(), replica: Some("rules-1".into()) });
    h.sort();
    let v = effect_once(&h);
    assert_eq!((v.validity, v.violations), (Validity::Invalid, 1));
    assert!(v.all_point_at("compat:pre-d2"), "{:?}", v.culprits);
    assert!(v.all_point_at("fault:crash cases-1"), "{:?}", v.culprits);
    assert!(!v.all_point_at("fault:kill security-1"), "another service's fault is not a cause: {:?}", v.culprits);

    // Not a cause: a producer crash at a point before the publish, or one after the
    // envelope's first stamp (a stamped row is never published again).
    let mut h = History::default();
    started(&mut h, 0, "rules-1", &["pre-d2"]);
    started(&mut h, 0, "cases-1", &[]);
    h.push(100, Event::Write { referral: id(1), replica: "cases-1".into(), outcome: Outcome::Ok, status: Some(201), answered_ms: None });
    h.push(700, Event::Fault { kind: "crash".into(), target: "cases-1 at outbox::after_claim".into(), phase: Phase::Start });
    h.push(1000, Event::Fault { kind: "crash".into(), target: "cases-1 restarted".into(), phase: Phase::End });
    h.push(1340, Event::Effect { envelope: id(101), referral: Some(id(1)), service: "rules".into(), replica: Some("rules-1".into()) });
    h.push(2000, Event::Stamped { envelope: id(101), replica: "cases-1".into(), compat: vec![] });
    h.push(3000, Event::Fault { kind: "kill".into(), target: "cases-1".into(), phase: Phase::Start });
    h.push(3100, Event::Fault { kind: "kill".into(), target: "cases-1".into(), phase: Phase::End });
    h.push(4750, Event::Effect { envelope: id(101), referral: Some(id(1)), service: "rules".into(), replica: Some("rules-1".into()) });
    h.sort();
    let v = effect_once(&h);
    assert_eq!((v.validity, v.violations), (Validity::Invalid, 1));
    assert!(v.all_point_at("compat:pre-d2"), "{:?}", v.culprits);
    assert!(!v.all_point_at("fault:crash cases-1"), "a crash before the publish re-publishes nothing: {:?}", v.culprits);
    assert!(!v.all_point_at("fault:kill cases-1"), "a kill after the stamp re-publishes nothing: {:?}", v.culprits);
    assert_eq!(fault_replica("fault:toxic cases-1->broker"), Some("cases-1"));
    assert_eq!(fault_replica("fault:kill broker"), None);
}

#[test]
fn no_loss_classifies_ok_lost_and_recovered() {
    let mut h = History::default();
    write(&mut h, 1, 1, Outcome::Ok);
    write(&mut h, 2, 2, Outcome::Ok);
    write(&mut h, 3, 3, Outcome::Unknown);
    write(&mut h, 4, 4, Outcome::Unknown);
    write(&mut h, 5, 5, Outcome::Failed);
    h.push(6, Event::Fault { kind: "down".into(), target: "cases-1->broker".into(), phase: Phase::Start });
    effect(&mut h, 10, 101, 1);
    effect(&mut h, 11, 103, 3);
    let v = no_loss(&h);
    assert_eq!(v.validity, Validity::Invalid);
    let c = |k: &str| v.counts[k];
    assert_eq!(
        (c("attempted"), c("acknowledged"), c("ok"), c("lost"), c("recovered"), c("unknown"), c("failed")),
        (5, 2, 1, 1, 1, 2, 1)
    );
    assert_eq!(v.witnesses.len(), 1);
    assert!(v.witnesses[0].contains(&id(2).to_string()), "{:?}", v.witnesses);
    assert!(v.witnesses[0].ends_with("no fault before it; next fault: down cases-1->broker @6ms"), "{}", v.witnesses[0]);
}

#[test]
fn no_loss_names_the_fault_before_a_loss() {
    let mut h = History::default();
    h.push(1, Event::Fault { kind: "kill".into(), target: "broker".into(), phase: Phase::Start });
    write(&mut h, 2, 1, Outcome::Ok);
    let v = no_loss(&h);
    assert_eq!(v.validity, Validity::Invalid);
    assert!(v.witnesses[0].ends_with("last fault before it: kill broker @1ms"), "{}", v.witnesses[0]);
}

/// Issue 22.2: the database is the ground truth. A referral cases' database holds committed
/// whose client heard only a 503 still needs its event and its effect; with no outbox row
/// at all it was committed without its event (§D1): `kind:unstaged`, blamed on the replica
/// that took the write and what was in force on it (a mutant, the refused staging).
#[test]
fn a_committed_aggregate_the_client_never_heard_of_still_needs_its_effect() {
    let base = || {
        let mut h = History::default();
        started(&mut h, 0, "cases-1", &[]);
        h.push(0, Event::Fault { kind: "mutant".into(), target: "cases-1".into(), phase: Phase::Start });
        h.push(5, Event::Fault { kind: "refuse_staging".into(), target: "database".into(), phase: Phase::Start });
        h.push(50, Event::Fault { kind: "refuse_staging".into(), target: "database".into(), phase: Phase::End });
        write(&mut h, 1, 1, Outcome::Ok);
        staged(&mut h, 11, 1);
        effect(&mut h, 20, 11, 1);
        h.push(30, Event::Write { referral: id(2), replica: "cases-1".into(), outcome: Outcome::Unknown, status: Some(503), answered_ms: None });
        h.push(30, Event::Committed { aggregate: id(1), table: "referrals".into() });
        h.push(30, Event::Committed { aggregate: id(2), table: "referrals".into() });
        h.push(90, Event::Fault { kind: "mutant".into(), target: "cases-1".into(), phase: Phase::End });
        h
    };
    let mut h = base();
    h.sort();
    let v = no_loss(&h);
    assert_eq!((v.validity, v.counts["committed_unacknowledged_lost"], v.counts["committed"]), (Validity::Invalid, 1, 2), "{v:?}");
    for cause in ["kind:unstaged", "replica:cases-1", "fault:mutant cases-1", "fault:refuse_staging database"] {
        assert!(v.all_point_at(cause), "{cause}: {:?}", v.culprits);
    }
    assert!(v.witnesses[0].contains("committed though cases-1 (current) heard Unknown"), "{:?}", v.witnesses);
    // Staged but never delivered: lost, not unstaged.
    let mut pending = base();
    staged(&mut pending, 12, 2);
    pending.sort();
    let v = no_loss(&pending);
    assert!(v.all_point_at("kind:lost") && !v.culprits.contains_key("kind:unstaged"), "{:?}", v.culprits);
    // Its event took effect after all: recovered, whatever the client heard.
    let mut recovered = base();
    staged(&mut recovered, 12, 2);
    effect(&mut recovered, 40, 12, 2);
    recovered.sort();
    assert_eq!(no_loss(&recovered).validity, Validity::Valid);
    // No domain row for the 503: nothing committed, nothing owed.
    let mut h = base();
    h.entries.retain(|e| !matches!(&e.event, Event::Committed { aggregate, .. } if *aggregate == id(2)));
    h.sort();
    assert_eq!(no_loss(&h).validity, Validity::Valid);
}

/// Issue 22.2: an effect of an aggregate cases' database does not hold is a phantom, and so
/// is an aggregate committed although its write was refused for certain.
#[test]
fn no_phantom_holds_effects_to_the_committed_aggregates() {
    let mut h = History::default();
    write(&mut h, 1, 1, Outcome::Ok);
    write(&mut h, 2, 2, Outcome::Unknown);
    write(&mut h, 3, 3, Outcome::Failed);
    h.push(30, Event::Committed { aggregate: id(1), table: "referrals".into() });
    h.push(30, Event::CommittedRead);
    effect(&mut h, 10, 101, 1);
    h.sort();
    assert_eq!(no_phantom(&h).validity, Validity::Valid);
    effect(&mut h, 11, 102, 2);
    h.sort();
    let v = no_phantom(&h);
    assert_eq!(v.counts["unexpected"], 1, "{v:?}");
    assert!(v.witnesses[0].contains("never committed"), "{:?}", v.witnesses);
    h.push(31, Event::Committed { aggregate: id(2), table: "referrals".into() });
    h.push(31, Event::Committed { aggregate: id(3), table: "referrals".into() });
    h.sort();
    let v = no_phantom(&h);
    assert_eq!(v.counts["unexpected"], 1, "{v:?}");
    assert!(v.witnesses[0].contains("committed in cases' database but its write was failed"), "{:?}", v.witnesses);
}

/// Issue 22: a phantom is blamed on the replica that took its write, with the behaviour it
/// ran and the faults on it then, so a twin (mutant-stage-before-write) is red for its cause;
/// an effect nobody wrote has no replica to blame.
#[test]
fn no_phantom_blames_the_replica_that_took_the_write_and_its_faults() {
    let mut h = History::default();
    started(&mut h, 0, "cases-1", &[]);
    h.push(5, Event::Fault { kind: "mutant".into(), target: "cases-1".into(), phase: Phase::Start });
    h.push(100, Event::Fault { kind: "refuse_staging".into(), target: "database".into(), phase: Phase::Start });
    h.push(150, Event::Write { referral: id(2), replica: "cases-1".into(), outcome: Outcome::Unknown, status: Some(503), answered_ms: None });
    h.push(150, Event::Write { referral: id(4), replica: "cases-1".into(), outcome: Outcome::Ok, status: Some(201), answered_ms: None });
    h.push(900, Event::Fault { kind: "refuse_staging".into(), target: "database".into(), phase: Phase::End });
    h.push(1000, Event::Committed { aggregate: id(4), table: "referrals".into() });
    h.push(1000, Event::CommittedRead);
    effect(&mut h, 200, 102, 2);
    effect(&mut h, 201, 104, 4);
    h.sort();
    let v = no_phantom(&h);
    assert_eq!((v.validity, v.violations), (Validity::Invalid, 1), "{v:?}");
    for cause in ["kind:phantom", "replica:cases-1", "compat:current", "fault:mutant cases-1", "fault:refuse_staging database"] {
        assert!(v.all_point_at(cause), "{cause}: {:?}", v.culprits);
    }
    assert!(v.witnesses[0].contains("never committed") && v.witnesses[0].contains("its write went to cases-1 (current) @150ms"), "{:?}", v.witnesses);
    // An effect of a referral nobody wrote: unknown culprits, never a named replica.
    effect(&mut h, 202, 109, 9);
    h.sort();
    let v = no_phantom(&h);
    assert_eq!(v.violations, 2);
    assert!(!v.all_point_at("replica:cases-1") && v.culprits.get("replica:unknown") == Some(&1), "{:?}", v.culprits);
}

/// Issue 22 audit: an empty read of cases' database is still a read: every effect is then
/// of an aggregate it does not hold. No read at all decides nothing about commits.
#[test]
fn no_phantom_judges_an_empty_read_of_the_committed_aggregates() {
    let mut h = History::default();
    write(&mut h, 2, 2, Outcome::Unknown);
    effect(&mut h, 11, 102, 2);
    h.sort();
    assert_eq!(no_phantom(&h).validity, Validity::Valid, "not read: nothing known about commits");
    h.push(30, Event::CommittedRead);
    h.sort();
    let v = no_phantom(&h);
    assert_eq!((v.validity, v.counts["unexpected"]), (Validity::Invalid, 1), "{v:?}");
    assert!(v.witnesses[0].contains("never committed"), "{:?}", v.witnesses);
}

/// Issue 22 audit: "unstaged" means no row in cases' own outbox; another producer's row
/// naming the aggregate (financial's payment.created for a placement) does not stage it.
#[test]
fn only_cases_own_outbox_row_stages_a_committed_aggregate() {
    let mut h = History::default();
    started(&mut h, 0, "cases-1", &[]);
    h.push(30, Event::Write { referral: id(2), replica: "cases-1".into(), outcome: Outcome::Unknown, status: Some(503), answered_ms: None });
    h.push(31, Event::Committed { aggregate: id(2), table: "placements".into() });
    h.push(32, Event::Staged { envelope: id(12), referral: Some(id(2)), service: "financial".into(), published: true, attempts: 1, last_error: None });
    h.sort();
    let v = no_loss(&h);
    assert!(v.all_point_at("kind:unstaged"), "{:?}", v.culprits);
}

#[test]
fn no_loss_with_nothing_acknowledged_is_unknown_not_valid() {
    let mut h = History::default();
    write(&mut h, 1, 1, Outcome::Unknown);
    assert_eq!(no_loss(&h).validity, Validity::Unknown);
}

#[test]
fn no_phantom_flags_failed_rolled_back_and_unattempted_effects() {
    let mut h = History::default();
    write(&mut h, 1, 1, Outcome::Ok);
    write(&mut h, 2, 2, Outcome::Failed);
    h.push(3, Event::RolledBack { referral: id(3) });
    effect(&mut h, 10, 101, 1);
    let v = no_phantom(&h);
    assert_eq!((v.validity, v.counts["unexpected"]), (Validity::Valid, 0));

    effect(&mut h, 11, 102, 2);
    effect(&mut h, 12, 103, 3);
    effect(&mut h, 13, 109, 9);
    let v = no_phantom(&h);
    assert_eq!((v.validity, v.counts["unexpected"]), (Validity::Invalid, 3));
    let all = v.witnesses.join("\n");
    assert!(all.contains("was failed") && all.contains("was rolled back") && all.contains("was never attempted"), "{all}");
}

fn effect_on(h: &mut History, t: u64, env: u128, replica: &str) {
    let replica = Some(replica.to_owned());
    h.push(t, Event::Effect { envelope: id(env), referral: Some(id(env)), service: "rules".into(), replica });
}

fn crash(h: &mut History, t: u64, replica: &str) {
    h.push(t, Event::Crash { replica: replica.into(), consumer: replica.starts_with("rules"), how: "SIGABRT".into() });
}

fn reprocessed(h: &mut History, t: u64, env: u128, replica: &str) {
    h.push(t, Event::Reprocessed { envelope: id(env), replica: replica.into() });
}

#[test]
fn a_crash_of_the_first_runs_replica_in_its_window_excuses_one_corroborated_rerun() {
    let mut h = History::default();
    effect_on(&mut h, 10, 101, "rules-1");
    crash(&mut h, 15, "rules-1");
    reprocessed(&mut h, 900, 101, "rules-1");
    effect_on(&mut h, 900, 101, "rules-1");
    h.sort();
    let v = effect_once(&h);
    assert_eq!((v.validity, v.counts["crash_window_reexecutions"]), (Validity::Valid, 1), "{:?}", v.witnesses);
    assert!(v.witnesses[0].contains("after crash rules-1 (SIGABRT) @15ms; the inbox reported the reprocess"), "{:?}", v.witnesses);
}

/// A stamp the inbox retried (`inbox.stamp_retry`) was still pending: a crash 5 s after the
/// run, past the 2 s a stamp is otherwise due in, came between handler and stamp and excuses
/// the corroborated re-run; without the inbox's word it does not (timing alone never
/// excuses). The re-run's own `inbox.reprocessed`, logged after ITS retried stamp, still
/// corroborates it.
#[test]
fn a_stamp_the_inbox_retried_keeps_its_window_open_in_the_inboxs_word() {
    let history = |retried: bool| {
        let mut h = History::default();
        effect_on(&mut h, 10, 101, "rules-1");
        if retried {
            for t in [2_000, 3_500, 4_600] {
                h.push(t, Event::StampRetry { envelope: id(101), replica: "rules-1".into() });
            }
            // The re-run's own stamp was retried too, so its report comes late.
            h.push(9_000, Event::StampRetry { envelope: id(101), replica: "rules-1".into() });
        }
        crash(&mut h, 5_000, "rules-1");
        effect_on(&mut h, 7_000, 101, "rules-1");
        reprocessed(&mut h, 12_000, 101, "rules-1");
        h.sort();
        effect_once(&h)
    };
    let v = history(true);
    assert_eq!((v.validity, v.counts["crash_window_reexecutions"]), (Validity::Valid, 1), "{:?}", v.witnesses);
    let v = history(false);
    assert_eq!((v.validity, v.counts["unattributed"]), (Validity::Invalid, 1), "{:?}", v.witnesses);
}

/// The pending stamp's window runs from the inbox's FIRST `inbox.stamp_retry` for the run:
/// the inbox gives up `STAMP_RETRY_FOR` after its first attempt began, so later retry lines
/// do not stretch it. A crash 7.9 s after the first line is inside; 8.4 s after it is not.
#[test]
fn a_pending_stamps_window_ends_its_retry_time_after_the_first_report() {
    let history = |crash_at: u64| {
        let mut h = History::default();
        effect_on(&mut h, 10, 101, "rules-1");
        for t in [100, 4_000, 7_000] {
            h.push(t, Event::StampRetry { envelope: id(101), replica: "rules-1".into() });
        }
        crash(&mut h, crash_at, "rules-1");
        effect_on(&mut h, 9_000, 101, "rules-1");
        reprocessed(&mut h, 9_000, 101, "rules-1");
        h.sort();
        effect_once(&h)
    };
    assert_eq!(STAMP_PENDING_MS, craig_mq::inbox::STAMP_RETRY_FOR.as_millis() as u64);
    let v = history(100 + STAMP_PENDING_MS - 100);
    assert_eq!((v.validity, v.counts["crash_window_reexecutions"]), (Validity::Valid, 1), "{:?}", v.witnesses);
    let v = history(100 + STAMP_PENDING_MS + 300);
    assert_eq!((v.validity, v.counts["unattributed"]), (Validity::Invalid, 1), "{:?}", v.witnesses);
}

/// #1179: the same crash-window re-run on financial (arbiter-backed) is never excused:
/// its arbiter must absorb it. The second payment is blamed on the replica's compat
/// (pre-1179, no arbiter) and on the crash between the runs.
#[test]
fn a_rerun_of_an_arbiter_backed_consumer_is_never_excused() {
    let mut h = History::default();
    started(&mut h, 0, "financial-1", &["pre-1179"]);
    let pay = |h: &mut History, t| {
        h.push(t, Event::Effect { envelope: id(101), referral: Some(id(7)), service: "financial".into(), replica: Some("financial-1".into()) })
    };
    pay(&mut h, 10);
    crash(&mut h, 15, "financial-1");
    h.push(15, Event::Fault { kind: "crash".into(), target: "financial-1 at inbox::after_handler_before_stamp".into(), phase: Phase::Start });
    h.push(400, Event::Fault { kind: "crash".into(), target: "financial-1 restarted".into(), phase: Phase::End });
    reprocessed(&mut h, 900, 101, "financial-1");
    pay(&mut h, 900);
    h.sort();
    let v = effect_once(&h);
    assert_eq!((v.validity, v.counts["crash_window_reexecutions"], v.counts["unattributed"]), (Validity::Invalid, 0, 1), "{:?}", v.witnesses);
    assert!(v.witnesses[0].contains("an arbiter-backed consumer (#1179) must absorb every re-run itself"), "{:?}", v.witnesses);
    assert!(v.all_point_at("compat:pre-1179") && v.all_point_at("fault:crash financial-1"), "{:?}", v.culprits);
    // With the arbiter the re-run is absorbed: one payment, nothing to excuse.
    let mut current = History::default();
    started(&mut current, 0, "financial-1", &[]);
    pay(&mut current, 10);
    crash(&mut current, 15, "financial-1");
    reprocessed(&mut current, 900, 101, "financial-1");
    current.sort();
    let v = effect_once(&current);
    assert_eq!((v.validity, v.counts["duplicated"]), (Validity::Valid, 0), "{:?}", v.witnesses);
}

/// Issue 9: exactly 10 occurrences, one redelivered and recorded twice (pre-1181): the
/// recorder's count reached 11 and it announced a crossing the occurrences never made —
/// a spurious crossing, blamed on security's compat and the fault that redelivered.
/// With the occurrence arbiter (10 rows) nothing crosses and nothing is announced.
#[test]
fn a_crossing_reached_only_by_a_doubled_row_is_spurious() {
    let build = |compat: &[&str], doubled: bool, events: usize| {
        let mut h = History::default();
        started(&mut h, 0, "security-1", compat);
        h.push(5, Event::Fault { kind: "crash".into(), target: "security-1 at dlq::after_record_before_ack".into(), phase: Phase::Start });
        // The recorder under pre-1181 mints a token per delivery: its rows' tokens hide
        // nothing from the tap, which saw each delivery's bytes with its x-death token.
        for i in 0..10i64 {
            tapped(&mut h, &format!("k{i}"), Some(&format!("xdeath:{i}")));
            audited(&mut h, &format!("k{i}"), Some(&format!("minted:{i}")), "recorded", "case.referral_created", 1_000 + i);
        }
        if doubled {
            audited(&mut h, "k3", Some("minted:redelivery"), "recorded", "case.referral_created", 2_000);
        }
        for _ in 0..events {
            h.push(30, Event::ThresholdExceeded { event_type: "case.referral_created".into(), count: 11, tx: None });
        }
        h.sort();
        h
    };
    let v = threshold_crossing_once(&build(&[], false, 0));
    assert_eq!((v.validity, v.counts["crossings"], v.counts["threshold_events"]), (Validity::Valid, 0, 0), "{v:?}");
    let v = threshold_crossing_once(&build(&["pre-1181"], true, 1));
    assert_eq!((v.validity, v.counts["crossings"]), (Validity::Invalid, 0), "{v:?}");
    assert!(
        ["kind:spurious_crossing", "compat:pre-1181", "fault:crash security-1"].iter().all(|c| v.all_point_at(c)),
        "{:?}",
        v.culprits
    );
    assert!(v.witnesses[0].contains("a crossing the occurrences never made, reached only by counting 1 row(s)"), "{:?}", v.witnesses);
    assert!(!v.culprits.contains_key("kind:re_emitted"), "{:?}", v.culprits);
    // A fault long after the doubled row is not its cause.
    let mut late = build(&["pre-1181"], true, 1);
    late.push(50_000, Event::Fault { kind: "kill".into(), target: "security-1".into(), phase: Phase::Start });
    late.sort();
    let v = threshold_crossing_once(&late);
    assert!(!v.culprits.contains_key("fault:kill security-1") && v.all_point_at("fault:crash security-1"), "{:?}", v.culprits);
    // Two events where the inflated count crosses once: one spurious is explained, the
    // second is a re-emit.
    let v = threshold_crossing_once(&build(&["pre-1181"], true, 2));
    assert!(v.culprits.contains_key("kind:re_emitted"), "{:?}", v.culprits);
}

/// A dead letter staged for financial must come from craig-financial.events, and an
/// envelope that took effect on financial and was dead-lettered from its queue is
/// completed-and-dead-lettered, as for rules.
#[test]
fn dead_letters_of_a_second_consumer_are_held_to_its_own_queue() {
    let mut h = History::default();
    started(&mut h, 0, "financial-1", &[]);
    started(&mut h, 0, "security-1", &[]);
    h.push(1, Event::DeadLetterStaged { envelope: id(6), service: "financial".into() });
    h.push(1, Event::DeadLetterStaged { envelope: id(7), service: "financial".into() });
    h.push(10, Event::DeadLettered { key: "k6".into(), token: Some("xdeath:6".into()), envelope: Some(id(6)), queue: Some("craig-rules.events".into()), event_type: None });
    h.push(10, Event::DeadLettered { key: "k7".into(), token: Some("xdeath:7".into()), envelope: Some(id(7)), queue: Some("craig-financial.events".into()), event_type: None });
    audited(&mut h, "k6", Some("xdeath:6"), "recorded", "placement.activated", 1);
    audited(&mut h, "k7", Some("xdeath:7"), "recorded", "placement.activated", 2);
    h.push(30, Event::Effect { envelope: id(7), referral: Some(id(70)), service: "financial".into(), replica: Some("financial-1".into()) });
    h.sort();
    let v = dlq_occurrence_once(&h);
    assert_eq!((v.counts["misattributed"], v.counts["completed_and_dead_lettered"]), (1, 1), "{v:?}");
    assert!(v.witnesses.iter().any(|w| w.contains("staged it for financial (craig-financial.events)")), "{:?}", v.witnesses);
    assert!(v.witnesses.iter().any(|w| w.contains("took effect on financial @30ms AND was dead-lettered from craig-financial.events @10ms")), "{:?}", v.witnesses);
    assert_eq!(v.culprits.get("replica:financial-1"), Some(&2), "{:?}", v.culprits);
}

fn post(h: &mut History, t: u64, c: u128, replica: &str, status: u16) {
    h.push(t, Event::PartnerPost { correlation: Some(id(c)), replica: Some(replica.into()), status });
}

fn exchanged(h: &mut History, t: u64, job: u128, outcome: &str, replica: &str) {
    h.push(t, Event::Exchanged { job: id(job), transaction: id(job + 1000), outcome: outcome.into(), replica: Some(replica.into()) });
}

fn flip(h: &mut History, t: u64, tx: u128, from: &str, to: &str) {
    h.push(t, Event::TransactionStatus { transaction: id(tx), from: from.into(), to: to.into() });
}

/// #1185: what a fenced send queue may do — a retry after a 500, a re-send after a
/// hung POST's transport cap or after the lease expired, failed -> pending — holds.
#[test]
fn fencing_allows_fenced_retries_and_the_at_least_once_resend() {
    let mut h = History::default();
    started(&mut h, 0, "financial-1", &[]);
    post(&mut h, 10, 1, "financial-1", 500);
    post(&mut h, 2_010, 1, "financial-1", 200);
    post(&mut h, 100, 2, "financial-1", 0);
    post(&mut h, 100 + SEND_CAP_MS, 2, "financial-1", 200);
    post(&mut h, 50, 3, "financial-1", 200);
    post(&mut h, 50 + SEND_LEASE_MS, 3, "financial-1", 200);
    exchanged(&mut h, 3_000, 1, "sent", "financial-1");
    exchanged(&mut h, 4_000, 4, "failed", "financial-1");
    flip(&mut h, 3_000, 1, "pending", "sent");
    flip(&mut h, 4_000, 4, "pending", "failed");
    flip(&mut h, 5_000, 4, "failed", "pending");
    h.sort();
    // Recorded as accepted by a partner that ran late, but its sender had timed out and
    // logged its fenced retry: the next POST is that retry, not a second live claim.
    post(&mut h, 400, 6, "financial-2", 200);
    h.push(900, Event::SendFinalized { correlation: id(6), replica: "financial-2".into(), result: "failed".into(), applied: true, generation: Some(1) });
    post(&mut h, 1_500, 6, "financial-2", 200);
    // Accepted, but its sender timed out before the answer: the retry after the cap.
    post(&mut h, 200, 5, "financial-1", 200);
    h.push(200 + SEND_CAP_MS, Event::PartnerUnanswered { correlation: id(5) });
    post(&mut h, 300 + SEND_CAP_MS, 5, "financial-1", 200);
    h.sort();
    // Issue 22.8: the sender's word alone excuses nothing; its database must show the job
    // put back in the queue in that span.
    let v = fencing(&h);
    assert_eq!((v.validity, v.counts["double_posts"]), (Validity::Invalid, 1), "{v:?}");
    for (t, generation, why) in [(3_000, 1, "a release after the re-send"), (895, 2, "another claim's release")] {
        let mut other = h.clone();
        other.push(t, Event::SendReleased { correlation: id(6), generation });
        other.sort();
        assert_eq!(fencing(&other).counts["double_posts"], 1, "{why} excuses nothing");
    }
    h.push(895, Event::SendReleased { correlation: id(6), generation: 1 });
    h.sort();
    let v = fencing(&h);
    assert_eq!((v.validity, v.counts["transmissions"], v.counts["double_posts"]), (Validity::Valid, 5, 0), "{v:?}");
    assert_eq!(v.counts["resent_after_lease"], 4, "the hung, lease-expired, logged-retry and unanswered ones; not the retry after a 500");
    assert_eq!(fencing(&History::default()).validity, Validity::Unknown, "nothing to check");
}

/// #1185's bug, as the partner, the outbox and the trigger see it: a concurrent duplicate
/// (409), a re-send inside the lease of an accepted POST, both outcomes staged for one job
/// and sent -> failed. Every violation points at the old replica's compat.
#[test]
fn fencing_finds_double_posts_conflicting_events_and_terminal_flips() {
    let mut h = History::default();
    started(&mut h, 0, "financial-1", &["pre-1185"]);
    started(&mut h, 0, "financial-2", &[]);
    post(&mut h, 10, 1, "financial-2", 200);
    post(&mut h, 500, 1, "financial-1", 409);
    post(&mut h, 20, 2, "financial-1", 200);
    post(&mut h, 20 + SEND_LEASE_MS - WINDOW_SLACK_MS - 1, 2, "financial-1", 200);
    exchanged(&mut h, 1_000, 1, "failed", "financial-1");
    exchanged(&mut h, 1_500, 1, "sent", "financial-2");
    flip(&mut h, 1_000, 1001, "pending", "failed");
    flip(&mut h, 1_500, 1001, "failed", "sent");
    h.sort();
    let v = fencing(&h);
    assert_eq!(v.validity, Validity::Invalid);
    assert_eq!((v.counts["double_posts"], v.counts["conflicting_events"], v.counts["terminal_flips"]), (2, 1, 1), "{v:?}");
    assert!(v.all_point_at("compat:pre-1185"), "{:?}", v.culprits);
    assert_eq!(v.culprits.get("kind:double_post"), Some(&2));
    let all = v.witnesses.join("\n");
    assert!(all.contains("POSTed by financial-2 (current) @10ms (answered 200) and again by financial-1 (compat pre-1185) @500ms (answered 409)"), "{all}");
    assert!(all.contains("staged both outcomes: exchange.failed by financial-1 @1000ms, exchange.sent by financial-2 @1500ms"), "{all}");
    assert!(all.contains("went failed -> sent"), "{all}");

    // A 409 in between does not hide a third POST inside the first one's lease; a run
    // with a shortened lease is judged by it.
    let mut h = History::default();
    h.push(0, Event::SendQueue { lease_ms: 6_000, cap_ms: 2_000 });
    post(&mut h, 10, 9, "financial-1", 200);
    post(&mut h, 20, 9, "financial-2", 409);
    post(&mut h, 3_000, 9, "financial-2", 200);
    post(&mut h, 9_100, 9, "financial-2", 200);
    let v = fencing(&h);
    assert_eq!(v.counts["double_posts"], 2, "the 409 and the POST @3000ms, not the one after the 6 s lease: {v:?}");
}

/// Issue 26: an async failover forgot a claim (the standby had applied up to 786 ms, the
/// claim and its finalize came after): the job was re-claimed under the same generation and
/// re-sent inside what was the first claim's lease. Excused only so: the failover between
/// the two POSTs (the second after the promotion), the standby behind the first, async
/// replication, current senders finalizing the same generation before the failover and
/// after the second POST, and the surviving database holding that generation's claim made
/// after the failover only.
#[test]
fn fencing_excuses_a_resend_of_a_claim_an_async_failover_forgot_and_nothing_wider() {
    let fin = |h: &mut History, t: u64, generation: i64| {
        h.push(t, Event::SendFinalized { correlation: id(7), replica: "financial-1".into(), result: "accepted".into(), applied: true, generation: Some(generation) })
    };
    let claim = |h: &mut History, t: u64, from_generation: i64, generation: i64| h.push(t, Event::SendClaimed { correlation: id(7), from_generation, generation });
    let base = |mode: &str, replayed: u64, gen2: i64| {
        let mut h = History::default();
        started(&mut h, 0, "financial-1", &[]);
        post(&mut h, 920, 7, "financial-1", 200);
        fin(&mut h, 1_031, 1);
        h.push(2_000, Event::Failover { replayed_until_ms: Some(replayed), mode: mode.into(), promoted_ms: Some(2_100) });
        // What the promoted database holds: the claim made after the failover only.
        claim(&mut h, 2_410, gen2 - 1, gen2);
        post(&mut h, 2_418, 7, "financial-1", 200);
        fin(&mut h, 2_478, gen2);
        h.sort();
        h
    };
    let v = fencing(&base("async", 786, 1));
    assert_eq!((v.validity, v.counts["double_posts"], v.counts["resent_after_forgotten_claim"]), (Validity::Valid, 0, 1), "{v:?}");
    let refused = |h: &History, why: &str| assert_eq!(fencing(h).counts["double_posts"], 1, "{why}: {:?}", fencing(h));
    refused(&base("sync", 786, 1), "synchronous replication forgets no claim");
    refused(&base("async", 1_200, 1), "the standby had applied past the first POST: its claim was not forgotten");
    refused(&base("async", 786, 2), "a new generation: the database still held the first claim");
    // The database's word: it holds the first claim too (not forgotten); it holds none after
    // the failover; the claim it holds moved no generation (a pre-#1185 claim).
    let with = |f: &dyn Fn(&mut History)| {
        let mut h = base("async", 786, 1);
        f(&mut h);
        h.sort();
        h
    };
    refused(&with(&|h| claim(h, 900, 0, 1)), "the database still holds the first claim");
    refused(&with(&|h| h.entries.retain(|e| !matches!(e.event, Event::SendClaimed { .. }))), "no claim in the database after the failover");
    refused(
        &with(&|h| {
            h.entries.retain(|e| !matches!(e.event, Event::SendClaimed { .. }));
            claim(h, 2_410, 1, 1);
        }),
        "a claim that moved no generation",
    );
    // An older sender (its claim never bumps the generation: the same number proves nothing).
    let mut h = base("async", 786, 1);
    h.entries.retain(|e| !matches!(e.event, Event::Started { .. }));
    started(&mut h, 0, "financial-1", &["pre-1185"]);
    h.sort();
    refused(&h, "a pre-1185 sender");
    // The first finalize after the failover (the old primary was gone: not a claim it held),
    // a failover after both POSTs, a second POST before the promotion, a 409: nothing.
    let mut h = with(&|h| h.entries.retain(|e| !matches!(e.event, Event::SendFinalized { .. })));
    fin(&mut h, 2_050, 1);
    fin(&mut h, 2_478, 1);
    h.sort();
    refused(&h, "no finalize before the failover");
    let mut h = with(&|h| h.entries.retain(|e| !matches!(e.event, Event::Failover { .. })));
    h.push(3_000, Event::Failover { replayed_until_ms: Some(786), mode: "async".into(), promoted_ms: None });
    h.sort();
    refused(&h, "a failover after both POSTs");
    let mut h = with(&|h| h.entries.retain(|e| !matches!(e.event, Event::Failover { .. })));
    h.push(2_000, Event::Failover { replayed_until_ms: Some(786), mode: "async".into(), promoted_ms: Some(2_500) });
    h.sort();
    refused(&h, "a second POST before the promotion");
    let mut h = with(&|h| h.entries.retain(|e| !matches!(e.event, Event::PartnerPost { status: 200, .. }) || e.t_ms != 2_418));
    post(&mut h, 2_418, 7, "financial-1", 409);
    h.sort();
    refused(&h, "a concurrent duplicate (409)");
}

/// An exports answer of `body` for (key, size) from `replica`.
#[allow(clippy::too_many_arguments)]
fn answer(h: &mut History, t: u64, replica: &str, key: &str, size: u64, replayed: bool, too_large: bool, body: &[u8]) {
    h.push(t, Event::HttpExchange {
        key: key.into(),
        size,
        replica: replica.into(),
        status: Some(200),
        replayed,
        too_large,
        body_len: body.len() as u64,
        body_sha256: Some(craig_api::idempotency::body_fingerprint(body)),
        cancelled: false,
        retry_after: None,
    });
}

fn run(h: &mut History, t: u64, key: &str, size: u64, generation: i64) {
    h.push(t, Event::ExportRun {
        key: Some(key.into()),
        cache_key: Some(format!("ck-{key}-{size}")),
        size,
        generation: Some(generation),
        body_sha256: None,
        replica: Some("cases-1".into()),
    });
}

/// The harness's trigger saw the §D5 row of (`key`, `size`) written under `generation` with
/// `status` at `t`, its claim expiring at `expires` (`run`'s cache key).
fn claim(h: &mut History, t: u64, key: &str, size: u64, generation: i64, status: &str, expires: u64) {
    h.push(t, Event::ClaimVersion { cache_key: format!("ck-{key}-{size}"), generation, status: status.into(), claim_expires_ms: Some(expires) });
}

fn unanswered(h: &mut History, t: u64, key: &str, size: u64, replica: &str) {
    h.push(t, Event::unanswered_exchange(key, size, replica));
}

/// §D5: the current middleware's answers (live, replay, over-cap live, sentinel replay)
/// hold; the claim-expiry residue is excused only with a re-claim after the claim expired
/// and a generation never finalized (the database's record), a crash and an unanswered
/// attempt (or a fault cutting the replica off its database and an attempt it served),
/// once per replica; pre-1183's emptied bodies, pre-1184's wrong
/// replay, pre-d5's second run and a sentinel on a small body are violations of their kind.
#[test]
fn sentinel_integrity_judges_runs_rows_and_answers() {
    let cap = craig_api::idempotency::RESPONSE_BODY_CAP as u64;
    let body = |n: u64| craig_fleet::cases::export_body(n as usize);
    let mut h = History::default();
    started(&mut h, 0, "cases-1", &[]);
    run(&mut h, 10, "a", 10, 1);
    answer(&mut h, 11, "cases-1", "a", 10, false, false, &body(10));
    answer(&mut h, 20, "cases-1", "a", 10, true, false, &body(10));
    run(&mut h, 30, "big", cap + 1, 1);
    answer(&mut h, 31, "cases-1", "big", cap + 1, false, false, &body(cap + 1));
    answer(&mut h, 40, "cases-1", "big", cap + 1, true, true, b"");
    h.push(50, Event::IdempotencyRow { cache_key: "ck-a-10".into(), status: "succeeded".into(), status_code: Some(200), body_len: Some(10), body_too_large: false, generation: 1 });
    // The residue: cases-1 died after committing "r", the retry re-claimed (generation 2).
    // The database's record of it (the harness's trigger): generation 1 claimed with a 3 s
    // claim and never finalized, generation 2 claimed once it expired, then finalized.
    run(&mut h, 60, "r", 10, 1);
    unanswered(&mut h, 61, "r", 10, "cases-1");
    h.push(62, Event::Crash { replica: "cases-1".into(), consumer: false, how: "SIGABRT".into() });
    claim(&mut h, 59, "r", 10, 1, "processing", 3_059);
    claim(&mut h, 3_090, "r", 10, 2, "processing", 6_090);
    claim(&mut h, 3_150, "r", 10, 2, "succeeded", 6_090);
    run(&mut h, 3_100, "r", 10, 2);
    h.push(3_200, Event::IdempotencyRow { cache_key: "ck-r-10".into(), status: "succeeded".into(), status_code: Some(200), body_len: Some(10), body_too_large: false, generation: 2 });
    answer(&mut h, 3_101, "cases-2", "r", 10, false, false, &body(10));
    let v = sentinel_integrity(&h);
    assert_eq!(v.validity, Validity::Valid, "{v:?}");
    assert_eq!((v.counts["live"], v.counts["replays"], v.counts["sentinels_replayed"], v.counts["reexecuted_after_claim_expiry"]), (3, 2, 1, 1));

    // Not excused: an unanswered attempt at ANOTHER size, a re-run under the same
    // generation, a re-run before the crash, a third run for one unanswered attempt.
    let mut bad = h.clone();
    run(&mut bad, 70, "s", 10, 1);
    unanswered(&mut bad, 71, "s", 20, "cases-1");
    run(&mut bad, 3_200, "s", 10, 2);
    run(&mut bad, 70, "u", 10, 1);
    unanswered(&mut bad, 71, "u", 10, "cases-1");
    run(&mut bad, 3_200, "u", 10, 1);
    run(&mut bad, 20, "e", 10, 1);
    unanswered(&mut bad, 21, "e", 10, "cases-1");
    run(&mut bad, 40, "e", 10, 2);
    run(&mut bad, 5_000, "r", 10, 3);
    // Issue 22.8: the attempt that went unanswered was sent after the crash (refused by a
    // replica that was down): it is not the answer the first run lost.
    run(&mut bad, 60, "late", 10, 1);
    unanswered(&mut bad, 1_000, "late", 10, "cases-1");
    run(&mut bad, 3_100, "late", 10, 2);
    bad.sort();
    let v = sentinel_integrity(&bad);
    assert_eq!((v.validity, v.culprits.get("kind:executed_twice")), (Validity::Invalid, Some(&5)), "{v:?}");
    assert_eq!(v.counts["reexecuted_after_claim_expiry"], 1);
    // The database must say it too: a re-claim before generation 1's claim expired (a
    // fencing bug), a generation 1 that was finalized, or no record at all, excuses nothing.
    for (what, versions) in [
        ("re-claimed before the claim expired", vec![(59, 1, "processing", 3_059), (1_000, 2, "processing", 4_000)]),
        ("the first generation was finalized", vec![(59, 1, "processing", 3_059), (70, 1, "succeeded", 3_059), (3_090, 2, "processing", 6_090)]),
        ("no record", vec![]),
    ] {
        let mut db = History::default();
        started(&mut db, 0, "cases-1", &[]);
        run(&mut db, 60, "r", 10, 1);
        unanswered(&mut db, 61, "r", 10, "cases-1");
        db.push(62, Event::Crash { replica: "cases-1".into(), consumer: false, how: "SIGABRT".into() });
        for (t, g, status, expires) in versions {
            claim(&mut db, t, "r", 10, g, status, expires);
        }
        run(&mut db, 3_100, "r", 10, 2);
        db.sort();
        let v = sentinel_integrity(&db);
        assert_eq!((v.counts["reexecuted_after_claim_expiry"], v.culprits.get("kind:executed_twice")), (0, Some(&1)), "{what}: {v:?}");
    }
    // §D5's other residue (found by the property run: cases-1's database link down 6 ms
    // after the run): the finalize itself failed, so the row stayed processing and the
    // retry after the claim's expiry re-ran it. The failed finalize still relays the live
    // body, so the attempt it served may be answered (a replayed run at 7820b51's rule,
    // which asked for no answer, was red for it). Excused only with the cut in force at the
    // run's commit, that attempt sent before the run, and the database's record of a
    // generation 1 never finalized and a generation 2 claimed after it expired; a cut that
    // began later, one on another replica's link, a re-claim sooner, or an attempt answered
    // by a replay or a 409 only, excuses nothing.
    let residue = |cut: (u64, u64), link: &str, attempt: &str, rerun: u64| {
        let mut h = History::default();
        started(&mut h, 0, "cases-1", &[]);
        window(&mut h, cut, "down", link);
        claim(&mut h, 56, "f", 10, 1, "processing", 30_056);
        run(&mut h, 60, "f", 10, 1);
        match attempt {
            "live" => answer(&mut h, 55, "cases-1", "f", 10, false, false, &body(10)),
            "replayed" => answer(&mut h, 55, "cases-1", "f", 10, true, false, &body(10)),
            "503" => h.push(55, Event::HttpExchange { key: "f".into(), size: 10, replica: "cases-1".into(), status: Some(503), replayed: false, too_large: false, body_len: 0, body_sha256: None, cancelled: false, retry_after: None }),
            "409" => h.push(55, Event::HttpExchange { key: "f".into(), size: 10, replica: "cases-1".into(), status: Some(409), replayed: false, too_large: false, body_len: 0, body_sha256: None, cancelled: false, retry_after: Some(1) }),
            "after" => answer(&mut h, 400, "cases-1", "f", 10, false, false, &body(10)),
            // A replay whose body was cut: unanswered, yet no run served it.
            "replayed_cut" => h.push(55, Event::HttpExchange { key: "f".into(), size: 10, replica: "cases-1".into(), status: Some(200), replayed: true, too_large: false, body_len: 3, body_sha256: None, cancelled: false, retry_after: None }),
            _ => unanswered(&mut h, 55, "f", 10, "cases-1"),
        }
        claim(&mut h, rerun - 5, "f", 10, 2, "processing", rerun + 29_995);
        run(&mut h, rerun, "f", 10, 2);
        h.sort();
        let v = sentinel_integrity(&h);
        (v.counts["reexecuted_after_claim_expiry"], v.culprits.get("kind:executed_twice").copied())
    };
    let down = "cases-1->database";
    assert_eq!(residue((66, 1_162), down, "none", 30_778), (1, None), "cut just after the commit: the finalize failed");
    assert_eq!(residue((66, 1_162), down, "live", 30_778), (1, None), "the failed finalize relayed the live answer");
    // Found by the property run (the same schedule): the cut took the INSERT's
    // acknowledgement, so the handler answered 503 for an export that had committed (red
    // before 503s inside a cut were servable).
    assert_eq!(residue((56, 1_162), down, "503", 30_778), (1, None), "the cut lost the commit's acknowledgement: a 503 for committed work");
    assert_eq!(residue((56, 1_162), "cases-2->database", "503", 30_778), (0, Some(1)), "a 503 with another replica's link cut");
    assert_eq!(residue((56, 1_162), down, "503", 29_000), (0, Some(1)), "a 503, re-claimed before the claim expired");
    // A 503 to cases-1 under fault `kind` on `target`, its run under generation 1, and a re-run
    // under generation 2 once that claim expired.
    let answered_503_under = |kind: &str, target: &str| {
        let mut h = History::default();
        started(&mut h, 0, "cases-1", &[]);
        window(&mut h, (56, 1_162), kind, target);
        claim(&mut h, 56, "f", 10, 1, "processing", 30_056);
        run(&mut h, 60, "f", 10, 1);
        h.push(55, Event::HttpExchange { key: "f".into(), size: 10, replica: "cases-1".into(), status: Some(503), replayed: false, too_large: false, body_len: 0, body_sha256: None, cancelled: false, retry_after: None });
        claim(&mut h, 30_773, "f", 10, 2, "processing", 60_773);
        run(&mut h, 30_778, "f", 10, 2);
        h.sort();
        sentinel_integrity(&h)
    };
    // A killed or partitioned database (its connections aborted, on containers) or a
    // connection-breaking toxic on the replica's own link can lose the answer to a committed
    // INSERT: a 503 under one may have been served.
    for (kind, target) in [("kill", "database"), ("partition", "database"), ("toxic", "cases-1->database (reset_peer upstream)"), ("toxic", "cases-1->database (timeout downstream)")] {
        let v = answered_503_under(kind, target);
        assert_eq!((v.counts["reexecuted_after_claim_expiry"], v.culprits.get("kind:executed_twice").copied()), (1, None), "{kind} {target}: {v:?}");
    }
    // A pause or a slowed link loses no answer (what was sent waits, then arrives): a 503
    // under one sent nothing (the pool gave no connection), so it served no run, though it
    // is an excused 503.
    for (kind, target) in [("pause", "database"), ("toxic", "cases-1->database (latency downstream)")] {
        let v = answered_503_under(kind, target);
        assert_eq!((v.counts["reexecuted_after_claim_expiry"], v.culprits.get("kind:executed_twice").copied()), (0, Some(1)), "{kind} {target}: {v:?}");
        assert_eq!(v.counts["unavailable_during_database_fault"], 1, "{kind} {target}: the 503 itself is excused");
    }
    assert_eq!(residue((2_000, 3_000), down, "none", 30_778), (0, Some(1)), "a cut that began later");
    assert_eq!(residue((66, 1_162), "cases-2->database", "none", 30_778), (0, Some(1)), "another replica's link");
    assert_eq!(residue((66, 1_162), "cases-2->database", "live", 30_778), (0, Some(1)), "another replica's link, answered");
    assert_eq!(residue((66, 1_162), down, "live", 29_000), (0, Some(1)), "re-claimed before the claim expired");
    assert_eq!(residue((66, 1_162), down, "replayed", 30_778), (0, Some(1)), "a replay serves no run");
    assert_eq!(residue((66, 1_162), down, "409", 30_778), (0, Some(1)), "a 409 serves no run");
    assert_eq!(residue((66, 1_162), down, "replayed_cut", 30_778), (0, Some(1)), "a replay cut short serves no run either");
    assert_eq!(residue((66, 1_162), down, "after", 30_778), (0, Some(1)), "an attempt sent after the run");
    // A 409 without Retry-After, and an unexpected status.
    let mut answers = h.clone();
    for (status, retry_after) in [(409, None), (503, None)] {
        answers.push(80, Event::HttpExchange { key: "a".into(), size: 10, replica: "cases-1".into(), status: Some(status), replayed: false, too_large: false, body_len: 0, body_sha256: None, cancelled: false, retry_after });
    }
    let v = sentinel_integrity(&answers);
    assert_eq!((v.culprits.get("kind:no_retry_after"), v.culprits.get("kind:unexpected_status")), (Some(&1), Some(&1)), "{v:?}");
    // A 503 while the database is down (found by the property run: a database kill under
    // the exports workload) is the honest answer: excused inside the fault's window only,
    // and only for a fault on the database or this replica's link to it.
    let answered_503 = |h: &mut History, t: u64| {
        h.push(t, Event::HttpExchange { key: "a".into(), size: 10, replica: "cases-1".into(), status: Some(503), replayed: false, too_large: false, body_len: 0, body_sha256: None, cancelled: false, retry_after: None });
    };
    let mut down = h.clone();
    down.push(60, Event::Fault { kind: "kill".into(), target: "database".into(), phase: Phase::Start });
    down.push(90, Event::Fault { kind: "kill".into(), target: "database".into(), phase: Phase::End });
    answered_503(&mut down, 80);
    down.sort();
    let v = sentinel_integrity(&down);
    assert_eq!((v.validity, v.counts["unavailable_during_database_fault"]), (Validity::Valid, 1), "{v:?}");
    let mut broker = h.clone();
    broker.push(60, Event::Fault { kind: "kill".into(), target: "broker".into(), phase: Phase::Start });
    broker.push(90, Event::Fault { kind: "kill".into(), target: "broker".into(), phase: Phase::End });
    answered_503(&mut broker, 80);
    broker.sort();
    assert_eq!(sentinel_integrity(&broker).culprits.get("kind:unexpected_status"), Some(&1), "a broker fault excuses no 503 on an export");
    // Only a fault that cuts this replica off its database: one that leaves the server
    // answering exports (refuse_staging, terminate of the listener) or cuts another
    // replica's link excuses nothing.
    for (kind, target) in [("refuse_staging", "database"), ("terminate", "database"), ("down", "cases-2->database"), ("down", "cases-1->broker")] {
        let mut other = h.clone();
        window(&mut other, (60, 90), kind, target);
        answered_503(&mut other, 80);
        other.sort();
        assert_eq!(sentinel_integrity(&other).culprits.get("kind:unexpected_status"), Some(&1), "{kind} {target} excuses no 503");
    }
    let mut link = h.clone();
    window(&mut link, (60, 90), "toxic", "cases-1->database (reset_peer)");
    answered_503(&mut link, 80);
    link.sort();
    assert_eq!(sentinel_integrity(&link).counts["unavailable_during_database_fault"], 1, "its own link to the database");
    // A toxic on that link excuses a 503 only when it breaks the connections or slows every
    // answer (under load the pool then starves); one that only slices the bytes or delays a
    // close leaves the answers' timing alone, and a 503 then is the replica's own failure.
    for (label, excused) in [
        ("cases-1->database (timeout downstream)", true),
        ("cases-1->database (limit_data upstream)", true),
        ("cases-1->database (latency 1500ms downstream)", true),
        ("cases-1->database (latency 20ms downstream)", true),
        ("cases-1->database (bandwidth downstream)", true),
        ("cases-1->database (slicer upstream)", false),
        ("cases-1->database (slow_close downstream)", false),
    ] {
        let mut toxic = h.clone();
        window(&mut toxic, (60, 90), "toxic", label);
        answered_503(&mut toxic, 80);
        toxic.sort();
        let v = sentinel_integrity(&toxic);
        let got = (v.counts.get("unavailable_during_database_fault").copied().unwrap_or(0), v.culprits.get("kind:unexpected_status").copied());
        assert_eq!(got, if excused { (1, None) } else { (0, Some(1)) }, "{label}");
    }
    let mut later = down.clone();
    answered_503(&mut later, 2_000);
    later.sort();
    assert_eq!(sentinel_integrity(&later).culprits.get("kind:unexpected_status"), Some(&1), "outside the window");

    let mut old = History::default();
    started(&mut old, 0, "cases-1", &["pre-1183", "pre-1184", "pre-d5"]);
    // pre-1183: over-cap emptied live, stored empty, replayed empty.
    run(&mut old, 10, "big", cap + 1, 1);
    answer(&mut old, 11, "cases-1", "big", cap + 1, false, false, b"");
    answer(&mut old, 12, "cases-1", "big", cap + 1, true, false, b"");
    old.push(13, Event::IdempotencyRow { cache_key: format!("ck-big-{}", cap + 1), status: "succeeded".into(), status_code: Some(200), body_len: Some(0), body_too_large: false, generation: 1 });
    // pre-1184: same key, another size, the first size's answer replayed.
    run(&mut old, 20, "q", 5, 1);
    answer(&mut old, 21, "cases-1", "q", 9, true, false, &body(5));
    // pre-d5: after a restart the same key ran again, generation 1 both times.
    run(&mut old, 30, "d", 10, 1);
    run(&mut old, 40, "d", 10, 1);
    // A sentinel on a small body.
    answer(&mut old, 50, "cases-1", "a", 10, true, true, b"");
    let v = sentinel_integrity(&old);
    assert_eq!(v.validity, Validity::Invalid);
    for (kind, n) in [("wrong_live", 1), ("wrong_replay", 2), ("emptied_body", 1), ("executed_twice", 1), ("false_sentinel", 1)] {
        assert_eq!(v.culprits.get(&format!("kind:{kind}")), Some(&n), "{kind}: {:?}", v.culprits);
    }
    assert!(v.all_point_at("compat:pre-1183"), "{:?}", v.culprits);
    assert!(v.witnesses.iter().any(|w| w.contains("answered key q (size=9)") && w.contains("with 5 bytes (replayed)")), "{:?}", v.witnesses);

    assert_eq!(sentinel_integrity(&History::default()).validity, Validity::Unknown);
}

/// Issue 22.3: an absorb path that stages `payment.created` again (one payment, two
/// events) was green while only payments were counted; the ledger makes it a violation.
#[test]
fn effect_once_holds_each_payment_to_one_event_and_one_transmission() {
    let ledger = |payments, created_events, transmissions| {
        let mut h = History::default();
        started(&mut h, 0, "financial-1", &[]);
        h.push(10, Event::Effect { envelope: id(1), referral: None, service: "financial".into(), replica: Some("financial-1".into()) });
        h.push(20, Event::PaymentLedger { placement: id(9), period: "2026-12-01".into(), payments, created_events, transmissions });
        h.sort();
        effect_once(&h)
    };
    assert_eq!(ledger(1, 1, 1).validity, Validity::Valid);
    let v = ledger(1, 2, 1);
    assert_eq!((v.validity, v.counts["ledger_mismatches"]), (Validity::Invalid, 1), "{v:?}");
    assert!(v.all_point_at("kind:unmatched_side_effect") && v.all_point_at("replica:financial-1"), "{:?}", v.culprits);
    assert_eq!(ledger(1, 1, 0).validity, Validity::Invalid, "a payment without its transmission");
}

/// Issue 26, the consumer side: the partner's own record holds a placement period to one
/// transmission. Two correlations for one period, one of them a job financial's database no
/// longer holds (an asynchronous failover forgot the payment, its job and its inbox record,
/// and the republished activation paid again), is `kind:forgotten_transmission`, blamed on
/// the failover and its mode only where the standby had not applied up to the first POST;
/// never after a synchronous failover. Both held: the ledger judges it, not this.
#[test]
fn effect_once_counts_the_partners_transmissions_of_a_placement_period() {
    let run = |first_at: u64, mode: &str, held: &[u128]| {
        let mut h = History::default();
        started(&mut h, 0, "financial-1", &[]);
        h.push(0, Event::SendQueue { lease_ms: 6_000, cap_ms: 2_000 });
        h.push(10, Event::Effect { envelope: id(1), referral: None, service: "financial".into(), replica: Some("financial-1".into()) });
        for (t, c) in [(first_at, 21), (2_000, 22)] {
            h.push(t, Event::PartnerTransmission { correlation: id(c), placement: id(9), period: "2026-12-01".into() });
            h.push(t, Event::PartnerPost { correlation: Some(id(c)), replica: Some("financial-1".into()), status: 200 });
        }
        // Another period, once: never a finding.
        h.push(900, Event::PartnerTransmission { correlation: id(23), placement: id(8), period: "2026-12-01".into() });
        window(&mut h, (1000, 1100), "failover", "database");
        h.push(1000, Event::Failover { replayed_until_ms: Some(500), mode: mode.into(), promoted_ms: None });
        h.push(3000, Event::SendJobsHeld { correlations: held.iter().map(|n| id(*n)).collect() });
        h.sort();
        effect_once(&h)
    };
    assert_eq!(run(700, "async", &[21, 22, 23]).validity, Validity::Valid, "both held: the ledger's to judge");
    let v = run(700, "async", &[22, 23]);
    assert_eq!((v.validity, v.counts["forgotten_transmissions"]), (Validity::Invalid, 1), "{v:?}");
    for cause in ["kind:forgotten_transmission", "fault:failover database", "replication:async"] {
        assert!(v.all_point_at(cause), "{cause}: {:?}", v.culprits);
    }
    assert!(v.witnesses[0].contains("the partner got 2 transmissions") && v.witnesses[0].contains("@700ms"), "{:?}", v.witnesses);
    // POSTed before what the standby applied: its job was applied too, so not the failover's.
    let v = run(300, "async", &[22, 23]);
    assert!(v.all_point_at("kind:forgotten_transmission") && !v.culprits.contains_key("fault:failover database"), "{:?}", v.culprits);
    assert!(v.all_point_at("replica:financial-1"), "{:?}", v.culprits);
    // A synchronous failover forgets nothing anyone saw: never its blame.
    let v = run(700, "sync", &[22, 23]);
    assert!(v.all_point_at("kind:forgotten_transmission") && !v.culprits.contains_key("fault:failover database"), "{:?}", v.culprits);
    // Received more than the send cap (2 s) after the failover: its job was claimed after
    // it, on the new primary, so the failover did not forget it.
    let v = run(3_100, "async", &[22, 23]);
    assert!(v.all_point_at("kind:forgotten_transmission") && !v.culprits.contains_key("fault:failover database"), "{:?}", v.culprits);
    let v = run(2_900, "async", &[22, 23]);
    assert!(v.all_point_at("fault:failover database"), "within the cap: {:?}", v.culprits);
}

/// Issue 26, rules' side: the harness's own tap of `rule.evaluated` holds a source envelope
/// to one evaluation. Two evaluations of one source, one of them an envelope rules'
/// database no longer holds (an asynchronous failover forgot the evaluation, its row and its
/// inbox record, and the republished referral ran the rule again: one `rule_evaluations`
/// row, two published evaluations), is `kind:forgotten_evaluation`, blamed on the failover
/// and its mode only where the standby had not applied up to the evaluation; never after a
/// synchronous failover, nor one before the evaluation, nor on rules' stamp where the
/// harness's own record makes it impossible (before the referral's write was sent, or of a
/// referral never written). Both held: the doubled row's to judge.
#[test]
fn effect_once_counts_the_published_evaluations_of_a_source_envelope() {
    // `stamped_at`: when rules-1 logged stamping the first evaluation published; `again`, a
    // later stamp line of it. The database address moves to the promoted standby 300 ms
    // after the kill.
    let run_lines = |write_at: Option<u64>, (first_at, stamped_at, again): (u64, Option<u64>, Option<u64>), failover_at: u64, mode: &str, held: &[u128]| {
        let mut h = History::default();
        started(&mut h, 0, "rules-1", &[]);
        for t in [stamped_at, again].into_iter().flatten() {
            stamped(&mut h, t, 21, "rules-1", &[]);
        }
        stamped(&mut h, 1_510, 22, "rules-1", &[]);
        h.push(1_500, Event::Effect { envelope: id(1), referral: Some(id(9)), service: "rules".into(), replica: Some("rules-1".into()) });
        for (t, e) in [(first_at, 21), (1_500, 22)] {
            h.push(t, Event::EvaluationPublished { envelope: id(e), source: id(1), referral: id(9) });
        }
        // The same envelope published twice (an outbox re-publish) is one evaluation, and
        // another source evaluated once is never a finding, held or not.
        h.push(1_600, Event::EvaluationPublished { envelope: id(22), source: id(1), referral: id(9) });
        h.push(800, Event::EvaluationPublished { envelope: id(23), source: id(2), referral: id(8) });
        // The referral's write went out at `write_at` (the harness's own record), if at all.
        if let Some(w) = write_at {
            h.push(w, Event::Write { referral: id(9), replica: "cases-1".into(), outcome: Outcome::Ok, status: Some(201), answered_ms: Some(w + 10) });
        }
        window(&mut h, (failover_at, failover_at + 100), "failover", "database");
        h.push(failover_at, Event::Failover { replayed_until_ms: Some(500), mode: mode.into(), promoted_ms: Some(failover_at + 300) });
        for e in held {
            h.push(3_000, Event::Staged { envelope: id(*e), referral: Some(id(9)), service: "rules".into(), published: true, attempts: 1, last_error: None });
        }
        h.sort();
        effect_once(&h)
    };
    let run_stamped = |write_at, (first_at, stamped_at): (u64, Option<u64>), failover_at, mode, held: &[u128]| run_lines(write_at, (first_at, stamped_at, None), failover_at, mode, held);
    let run_after = |write_at, first_at: u64, failover_at, mode, held: &[u128]| run_stamped(write_at, (first_at, Some(first_at + 5)), failover_at, mode, held);
    let run = |first_at, failover_at, mode, held: &[u128]| run_after(Some(200), first_at, failover_at, mode, held);
    let v = run(700, 1_000, "async", &[21, 22, 23]);
    assert_eq!((v.validity, v.counts["forgotten_evaluations"]), (Validity::Valid, 0), "both held: {v:?}");
    let v = run(700, 1_000, "async", &[22]);
    assert_eq!((v.validity, v.counts["forgotten_evaluations"]), (Validity::Invalid, 1), "{v:?}");
    for cause in ["kind:forgotten_evaluation", "fault:failover database", "replication:async"] {
        assert!(v.all_point_at(cause), "{cause}: {:?}", v.culprits);
    }
    assert!(v.witnesses.iter().any(|w| w.contains("evaluated 2 times") && w.contains("@700ms")), "{:?}", v.witnesses);
    // Evaluated and stamped before what the standby applied: its row was applied too, so not
    // the failover's.
    let v = run(300, 1_000, "async", &[22, 23]);
    assert!(v.all_point_at("kind:forgotten_evaluation") && !v.culprits.contains_key("fault:failover database"), "{:?}", v.culprits);
    assert!(v.all_point_at("replica:rules-1"), "{:?}", v.culprits);
    // rules' `occurred_at` is set before its commit: occurred @300ms, stamped published only
    // @700ms (a loaded machine, a fresh-clone CI run), it can have committed after what the
    // standby applied (@500ms): the failover's. At the slack's edge, stamped @491ms still is,
    // @490ms is not. With no stamp line nothing corroborates a late commit: not excused.
    for (stamp, failover) in [(Some(700), true), (Some(491), true), (Some(490), false), (None, false)] {
        let v = run_stamped(Some(200), (300, stamp), 1_000, "async", &[22, 23]);
        assert_eq!(v.all_point_at("fault:failover database"), failover, "stamped {stamp:?}: {:?}", v.culprits);
        assert!(v.all_point_at("kind:forgotten_evaluation"), "{:?}", v.culprits);
    }
    // A stamp line after the database address led to the promoted standby (@1300ms, 10 ms of
    // slack): the line is logged only for a row the UPDATE found, so the promoted server held
    // it: not the failover's.
    for (again, failover) in [(1_310, true), (1_311, false)] {
        let v = run_lines(Some(200), (700, Some(705), Some(again)), 1_000, "async", &[22, 23]);
        assert_eq!(v.all_point_at("fault:failover database"), failover, "stamped again @{again}ms: {:?}", v.culprits);
    }
    // Issue 26: the primary can die between the confirm and the stamp, and rules' claim
    // line (`outbox.claimed`: the claim found the row committed) bounds the commit alone.
    // Claimed @700ms and never stamped: the failover's. Claimed @490ms, before what the
    // standby applied, stamped @700ms: the row was applied, not the failover's. Claimed
    // again after the promoted standby took the address (@1311ms): it held the row.
    for (claims, stamp, failover) in [(&[700][..], None, true), (&[490], Some(700), false), (&[705, 1_311], None, false), (&[705, 1_310], None, true)] {
        let mut h = History::default();
        started(&mut h, 0, "rules-1", &[]);
        for t in claims {
            h.push(*t, Event::Claimed { envelope: id(21), replica: "rules-1".into() });
        }
        if let Some(t) = stamp {
            stamped(&mut h, t, 21, "rules-1", &[]);
        }
        stamped(&mut h, 1_510, 22, "rules-1", &[]);
        h.push(1_500, Event::Effect { envelope: id(1), referral: Some(id(9)), service: "rules".into(), replica: Some("rules-1".into()) });
        for (t, e) in [(300, 21), (1_500, 22)] {
            h.push(t, Event::EvaluationPublished { envelope: id(e), source: id(1), referral: id(9) });
        }
        h.push(200, Event::Write { referral: id(9), replica: "cases-1".into(), outcome: Outcome::Ok, status: Some(201), answered_ms: Some(210) });
        window(&mut h, (1_000, 1_100), "failover", "database");
        h.push(1_000, Event::Failover { replayed_until_ms: Some(500), mode: "async".into(), promoted_ms: Some(1_300) });
        h.push(3_000, Event::Staged { envelope: id(22), referral: Some(id(9)), service: "rules".into(), published: true, attempts: 1, last_error: None });
        h.sort();
        let v = effect_once(&h);
        assert_eq!((v.validity, v.counts["forgotten_evaluations"]), (Validity::Invalid, 1), "{v:?}");
        assert_eq!(v.all_point_at("fault:failover database"), failover, "claimed {claims:?}, stamped {stamp:?}: {:?}", v.culprits);
    }
    // A synchronous failover forgets nothing anyone saw: never its blame.
    let v = run(700, 1_000, "sync", &[22, 23]);
    assert!(v.all_point_at("kind:forgotten_evaluation") && !v.culprits.contains_key("fault:failover database"), "{:?}", v.culprits);
    // Evaluated after the failover: it committed on the promoted server, which forgot nothing of it.
    let v = run(1_200, 1_000, "async", &[22, 23]);
    assert!(v.all_point_at("kind:forgotten_evaluation") && !v.culprits.contains_key("fault:failover database"), "{:?}", v.culprits);
    // rules' own stamp held to the harness's record: a stamp at 700 ms, after what the standby
    // applied, would make it the failover's, but its referral's write went out only at 800 ms,
    // so the stamp is impossible and excuses nothing.
    let v = run_after(Some(800), 700, 1_000, "async", &[22, 23]);
    assert!(v.all_point_at("replica:rules-1") && !v.culprits.contains_key("fault:failover database"), "{:?}", v.culprits);
    // At the clock slack's edge (10 ms): possible at exactly 10 ms before the write, not at 11.
    assert!(run_after(Some(710), 700, 1_000, "async", &[22, 23]).all_point_at("fault:failover database"));
    let v = run_after(Some(711), 700, 1_000, "async", &[22, 23]);
    assert!(!v.culprits.contains_key("fault:failover database"), "{:?}", v.culprits);
    // A referral the harness never wrote: nothing corroborates the stamp.
    let v = run_after(None, 700, 1_000, "async", &[22, 23]);
    assert!(!v.culprits.contains_key("fault:failover database"), "{:?}", v.culprits);
}

/// Issue 26: a payment financial said it committed (`financial.payment_created`, logged
/// after its commit) that its database no longer holds, after the broker had the ack: an
/// asynchronous failover whose standby had not applied up to that
/// line, and whose address moved only after it, forgot it. `kind:lost` + `lost_at:consumer` on the failover
/// and its mode, for an acknowledged activation (rule 1) and an unanswered committed one
/// (rule 2) alike; never without financial's line, before what the standby applied, after
/// the database address led to the promoted standby, or after a synchronous one.
#[test]
fn no_loss_puts_a_payment_financial_committed_and_the_failover_forgot_on_it() {
    // inboxed: financial's inbox row at the end, and when it was stamped processed.
    let run_full = |outcome: Outcome, created_at: Option<u64>, mode: &str, promoted_ms: Option<u64>, inboxed: Option<Option<u64>>| {
        let mut h = History::default();
        if let Some(processed_ms) = inboxed {
            h.push(2000, Event::Inboxed { envelope: id(11), service: "financial".into(), processed: processed_ms.is_some(), processed_ms });
        }
        started(&mut h, 0, "cases-1", &[]);
        started(&mut h, 0, "financial-1", &[]);
        h.push(90, Event::Write { referral: id(1), replica: "cases-1".into(), outcome, status: None, answered_ms: Some(100) });
        staged(&mut h, 11, 1);
        stamped(&mut h, 150, 11, "cases-1", &[]);
        if let Some(t) = created_at {
            h.push(t, Event::PaymentCreated { envelope: id(11), replica: "financial-1".into() });
        }
        window(&mut h, (1000, 1100), "failover", "database");
        h.push(1000, Event::Failover { replayed_until_ms: Some(500), mode: mode.into(), promoted_ms });
        // The activation is still committed; the payment is gone (no effect at the end).
        h.push(2000, Event::Committed { aggregate: id(1), table: "placements".into() });
        h.push(2000, Event::CommittedRead);
        h.sort();
        no_loss(&h)
    };
    let run_promoted = |outcome: Outcome, created_at: Option<u64>, mode: &str, promoted_ms: Option<u64>| run_full(outcome, created_at, mode, promoted_ms, None);
    let run_inboxed = |outcome: Outcome, created_at: Option<u64>, mode: &str, inboxed: Option<Option<u64>>| run_full(outcome, created_at, mode, None, inboxed);
    let run = |outcome: Outcome, created_at: Option<u64>, mode: &str| run_promoted(outcome, created_at, mode, None);
    for outcome in [Outcome::Ok, Outcome::Unknown] {
        let v = run(outcome, Some(700), "async");
        assert_eq!((v.validity, v.violations), (Validity::Invalid, 1), "{outcome:?}: {v:?}");
        for cause in ["kind:lost", "lost_at:consumer", "fault:failover database", "replication:async"] {
            assert!(v.all_point_at(cause), "{outcome:?} {cause}: {:?}", v.culprits);
        }
        assert!(v.witnesses[0].contains("financial-1 logged committing it @700ms"), "{:?}", v.witnesses);
        // No line of financial's, a line before what the standby applied, a line after the
        // failover, a synchronous failover: a loss the failover does not excuse.
        for (created, mode) in [(None, "async"), (Some(300), "async"), (Some(1200), "async"), (Some(700), "sync")] {
            let v = run(outcome, created, mode);
            assert_eq!(v.validity, Validity::Invalid, "{outcome:?} {created:?} {mode}");
            assert!(v.all_point_at("kind:lost") && !v.culprits.contains_key("fault:failover database"), "{outcome:?} {created:?} {mode}: {:?}", v.culprits);
        }
        // The database address led to the promoted standby @1300: a line logged @1200, late,
        // is of a commit made before the kill (nothing could commit in between, and what the
        // promoted database commits it holds); a line @1400 is not.
        let v = run_promoted(outcome, Some(1200), "async", Some(1300));
        assert!(v.all_point_at("fault:failover database") && v.all_point_at("lost_at:consumer"), "{outcome:?}: {:?}", v.culprits);
        let v = run_promoted(outcome, Some(1400), "async", Some(1300));
        assert!(v.all_point_at("kind:lost") && !v.culprits.contains_key("fault:failover database"), "{outcome:?}: {:?}", v.culprits);
        // financial's inbox row held stamped processed before the kill (a commit after the
        // payment's): the surviving database had the payment too, so no failover forgot it.
        let v = run_inboxed(outcome, Some(700), "async", Some(Some(750)));
        assert!(!v.culprits.contains_key("fault:failover database"), "{outcome:?}: {:?}", v.culprits);
        let v = run_inboxed(outcome, Some(700), "async", Some(None));
        assert!(v.all_point_at("fault:failover database"), "{outcome:?}: an unstamped inbox row: {:?}", v.culprits);
        // Stamped after the kill: the inbox's stamp retry reached the promoted server, which
        // never had the payment. Still the failover's.
        let v = run_inboxed(outcome, Some(700), "async", Some(Some(1200)));
        assert!(v.all_point_at("fault:failover database"), "{outcome:?}: stamped on the promoted server: {:?}", v.culprits);
        // Stamped before financial's line of the payment: another delivery's stamp, which
        // says nothing of this payment. Still the failover's.
        let v = run_inboxed(outcome, Some(700), "async", Some(Some(300)));
        assert!(v.all_point_at("fault:failover database"), "{outcome:?}: stamped before the payment: {:?}", v.culprits);
    }
}

/// Issue 26, rules' side: a referral whose evaluation rules published (the harness's own tap
/// of `rule.evaluated`) and whose effect its database no longer holds: rules committed it and
/// acked the delivery, and an asynchronous failover forgot it. `kind:lost` +
/// `lost_at:consumer` on the failover and its mode, for an acknowledged referral (rule 1)
/// and an unanswered committed one (rule 2), only where the standby had not applied up to
/// the evaluation's first stamp line (rules' `occurred_at`, set before its commit, bounds
/// nothing: here it is before what the standby applied, as a loaded fresh-clone CI run had
/// it). Never with an evaluation no replica stamped, a stamp before what the standby
/// applied (10 ms of slack), a stamp after the promoted standby took the address (it held
/// the row), an evaluation that occurred after the failover or before the referral's write
/// was sent, or a synchronous failover: then rules published an effect it does not hold,
/// and it is blamed. With nothing tapped the loss is judged by its event's stamp, as before.
#[test]
fn no_loss_puts_an_evaluation_rules_published_and_the_failover_forgot_on_it() {
    // Each evaluation: (envelope, occurred_at, first stamp line). The failover: the kill
    // @1000ms, the standby having applied up to @500ms, the address moved @1300ms.
    // `claims`: rules' `outbox.claimed` lines (envelope, time).
    let run_lines = |outcome: Outcome, evaluations: &[(u128, u64, Option<u64>)], claims: &[(u128, u64)], mode: &str| {
        let mut h = History::default();
        started(&mut h, 0, "cases-1", &[]);
        started(&mut h, 0, "rules-1", &[]);
        h.push(90, Event::Write { referral: id(1), replica: "cases-1".into(), outcome, status: None, answered_ms: Some(100) });
        staged(&mut h, 11, 1);
        stamped(&mut h, 150, 11, "cases-1", &[]);
        for (env, occurred, stamp) in evaluations {
            h.push(*occurred, Event::EvaluationPublished { envelope: id(*env), source: id(11), referral: id(1) });
            if let Some(t) = stamp {
                stamped(&mut h, *t, *env, "rules-1", &[]);
            }
        }
        for (env, t) in claims {
            h.push(*t, Event::Claimed { envelope: id(*env), replica: "rules-1".into() });
        }
        window(&mut h, (1000, 1100), "failover", "database");
        h.push(1000, Event::Failover { replayed_until_ms: Some(500), mode: mode.into(), promoted_ms: Some(1300) });
        // The referral is still committed; its evaluation is gone (no effect at the end).
        h.push(2000, Event::Committed { aggregate: id(1), table: "referrals".into() });
        h.push(2000, Event::CommittedRead);
        h.sort();
        no_loss(&h)
    };
    let run = |outcome: Outcome, evaluations: &[(u128, u64, Option<u64>)], mode: &str| run_lines(outcome, evaluations, &[], mode);
    let excused = |v: &Verdict| v.all_point_at("fault:failover database");
    // Issue 26: a claim line bounds the commit as a stamp does (the primary can die between
    // the confirm and the stamp): claimed @700ms, never stamped, is the failover's; claimed
    // @490ms (before what the standby applied) and stamped @700ms is not; claimed again after
    // the promoted standby took the address (@1311ms) is not either.
    assert!(excused(&run_lines(Outcome::Ok, &[(31, 300, None)], &[(31, 700)], "async")));
    assert!(!excused(&run_lines(Outcome::Ok, &[(31, 300, Some(700))], &[(31, 490)], "async")));
    assert!(!excused(&run_lines(Outcome::Ok, &[(31, 300, None)], &[(31, 700), (31, 1311)], "async")));
    assert!(excused(&run_lines(Outcome::Ok, &[(31, 300, None)], &[(31, 700), (31, 1310)], "async")));
    for outcome in [Outcome::Ok, Outcome::Unknown] {
        for stamp in [700, 501, 491, 1310] {
            let v = run(outcome, &[(31, 300, Some(stamp))], "async");
            assert_eq!((v.validity, v.violations), (Validity::Invalid, 1), "{outcome:?} {stamp}: {v:?}");
            for cause in ["kind:lost", "lost_at:consumer", "fault:failover database", "replication:async"] {
                assert!(v.all_point_at(cause), "{outcome:?} {stamp} {cause}: {:?}", v.culprits);
            }
            assert!(v.witnesses[0].contains(&format!("rules published its evaluation ({} occurred @300ms, claimed or stamped @{stamp}ms", id(31))), "{:?}", v.witnesses);
        }
        // Two evaluations of it, both gone: each must be one the failover can have forgotten.
        assert!(excused(&run(outcome, &[(31, 300, Some(700)), (32, 600, Some(650))], "async")));
        for (evaluations, mode) in [
            (&[(31, 300, Some(490))][..], "async"),
            (&[(31, 300, Some(400))], "async"),
            (&[(31, 300, None)], "async"),
            (&[(31, 300, Some(700)), (32, 600, None)], "async"),
            (&[(31, 300, Some(700)), (32, 350, Some(450))], "async"),
            (&[(31, 300, Some(1311))], "async"),
            (&[(31, 300, Some(700)), (32, 600, Some(1400))], "async"),
            (&[(31, 300, Some(700)), (32, 1050, Some(1305))], "async"),
            (&[(31, 1011, Some(1100))], "async"),
            (&[(31, 79, Some(700))], "async"),
            (&[(31, 300, Some(700))], "sync"),
        ] {
            let v = run(outcome, evaluations, mode);
            assert_eq!(v.validity, Validity::Invalid, "{outcome:?} {evaluations:?} {mode}");
            for cause in ["kind:lost", "lost_at:consumer", "replica:rules-1"] {
                assert!(v.all_point_at(cause), "{outcome:?} {evaluations:?} {mode} {cause}: {:?}", v.culprits);
            }
            assert!(!v.culprits.contains_key("fault:failover database"), "{outcome:?} {evaluations:?} {mode}: {:?}", v.culprits);
        }
        // At the clock slack's edge: occurred 10 ms after the kill, or 10 ms before the write.
        assert!(excused(&run(outcome, &[(31, 1010, Some(1100))], "async")));
        assert!(excused(&run(outcome, &[(31, 80, Some(700))], "async")));
        // Nothing tapped: not rules' effect to speak of; judged as before.
        let v = run(outcome, &[], "async");
        assert!(v.all_point_at("kind:lost") && !v.culprits.contains_key("lost_at:consumer") && !v.culprits.contains_key("replica:rules-1"), "{outcome:?}: {:?}", v.culprits);
    }
}

/// Issue 26: a transmission the partner got is an effect of its placement. A placement the
/// promoted server does not hold, paid at the partner after an asynchronous failover forgot
/// it (and, with it, the payment), is `kind:phantom_event` even though financial's tables
/// show nothing; held where the placement is committed.
#[test]
fn no_phantom_counts_the_partners_transmissions_as_effects() {
    let run = |committed: bool| {
        let mut h = History::default();
        started(&mut h, 0, "cases-1", &[]);
        h.push(700, Event::Write { referral: id(9), replica: "cases-1".into(), outcome: Outcome::Ok, status: Some(200), answered_ms: Some(710) });
        h.push(900, Event::PartnerTransmission { correlation: id(21), placement: id(9), period: "2026-12-01".into() });
        window(&mut h, (1000, 1100), "failover", "database");
        h.push(1000, Event::Failover { replayed_until_ms: Some(500), mode: "async".into(), promoted_ms: None });
        if committed {
            h.push(2000, Event::Committed { aggregate: id(9), table: "placements".into() });
        }
        h.push(2000, Event::CommittedRead);
        h.sort();
        no_phantom(&h)
    };
    assert_eq!(run(true).validity, Validity::Valid);
    let v = run(false);
    assert_eq!((v.validity, v.violations), (Validity::Invalid, 1), "{v:?}");
    for cause in ["kind:phantom_event", "fault:failover database", "replication:async"] {
        assert!(v.all_point_at(cause), "{cause}: {:?}", v.culprits);
    }
    assert!(v.witnesses[0].contains("took effect @900ms"), "{:?}", v.witnesses);
}

/// Issue 26: the harness's own copy of a published `rule.evaluated` is an effect too. An
/// evaluation of a referral the promoted server does not hold is a phantom event, though
/// rules' database forgot the evaluation with the referral (no `rule_evaluations` row).
#[test]
fn no_phantom_counts_the_tapped_evaluations_as_effects() {
    let run = |committed: bool| {
        let mut h = History::default();
        started(&mut h, 0, "cases-1", &[]);
        h.push(700, Event::Write { referral: id(9), replica: "cases-1".into(), outcome: Outcome::Ok, status: Some(201), answered_ms: Some(710) });
        h.push(900, Event::EvaluationPublished { envelope: id(21), source: id(20), referral: id(9) });
        window(&mut h, (1000, 1100), "failover", "database");
        h.push(1000, Event::Failover { replayed_until_ms: Some(500), mode: "async".into(), promoted_ms: None });
        if committed {
            h.push(2000, Event::Committed { aggregate: id(9), table: "referrals".into() });
        }
        h.push(2000, Event::CommittedRead);
        h.sort();
        no_phantom(&h)
    };
    assert_eq!(run(true).validity, Validity::Valid);
    let v = run(false);
    assert_eq!((v.validity, v.violations), (Validity::Invalid, 1), "{v:?}");
    for cause in ["kind:phantom_event", "fault:failover database", "replication:async"] {
        assert!(v.all_point_at(cause), "{cause}: {:?}", v.culprits);
    }
    assert!(v.witnesses[0].contains("took effect @900ms"), "{:?}", v.witnesses);
}

/// Issue 22.6: no answer is not "held". A key answered only before the faults healed
/// and kept at 409 after (a claim that never expires) never got its judged 200.
#[test]
fn sentinel_integrity_needs_a_judged_200_for_every_key_after_the_heal() {
    let body = |n: u64| craig_fleet::cases::export_body(n as usize);
    let mut h = History::default();
    started(&mut h, 0, "cases-1", &[]);
    run(&mut h, 10, "a", 10, 1);
    answer(&mut h, 11, "cases-1", "a", 10, false, false, &body(10));
    run(&mut h, 12, "b", 10, 1);
    answer(&mut h, 13, "cases-1", "b", 10, false, false, &body(10));
    h.push(100, Event::Healed);
    answer(&mut h, 110, "cases-1", "a", 10, true, false, &body(10));
    let stuck = |h: &mut History, t| {
        h.push(t, Event::HttpExchange { key: "b".into(), size: 10, replica: "cases-1".into(), status: Some(409), replayed: false, too_large: false, body_len: 0, body_sha256: None, cancelled: false, retry_after: Some(30) });
    };
    stuck(&mut h, 120);
    stuck(&mut h, 1_120);
    h.sort();
    let v = sentinel_integrity(&h);
    assert_eq!((v.validity, v.counts["never_answered"]), (Validity::Invalid, 1), "{v:?}");
    assert!(v.all_point_at("kind:never_answered"), "{:?}", v.culprits);
    assert!(v.witnesses.iter().any(|w| w.contains("key b (size=10) never got a 200")), "{:?}", v.witnesses);
    answer(&mut h, 2_000, "cases-1", "b", 10, true, false, &body(10));
    h.sort();
    assert_eq!(sentinel_integrity(&h).validity, Validity::Valid);
}

/// #965/#1129: a prune that kept the pending rows and a replay rule that refused the
/// window past retention hold; a pending row deleted, or a past-window replay accepted,
/// is a violation of its own kind; a run where nothing pruned or replayed proves nothing.
#[test]
fn retention_safety_holds_the_prune_and_the_replay_rule() {
    // Staged rows no prune cycle reached: unproven, which is not "nothing to check" (an
    // unlisted retention_safety must then make the run inconclusive, never drop out).
    let mut unproven = History::default();
    unproven.push(0, Event::Backdated { referral: id(1) });
    let v = retention_safety(&unproven);
    assert_eq!(v.validity, Validity::Unknown, "{v:?}");
    assert!(!v.nothing_to_check() && v.error.as_deref().is_some_and(|e| e.starts_with("unproven")), "{v:?}");
    assert!(retention_safety(&History::default()).nothing_to_check(), "no rows staged, no cycle, no replay");

    let day = 86_400_000;
    let replay = |h: &mut History, t, age, status| {
        h.push(t, Event::Replay { replica: "cases-1".into(), from_age_ms: age, window_ms: 30 * day, status: Some(status), restaged: None })
    };
    let mut h = History::default();
    started(&mut h, 0, "cases-1", &[]);
    h.push(0, Event::Backdated { referral: id(1) });
    h.push(900, Event::PruneCycle { replica: "cases-1".into(), kept_pending: 1 });
    replay(&mut h, 5_000, 30 * day - 3_600_000, 200);
    replay(&mut h, 5_100, 30 * day + 3_600_000, 422);
    let v = retention_safety(&h);
    assert_eq!((v.validity, v.counts["pending_kept_by_a_cycle"], v.counts["replays_refused"]), (Validity::Valid, 1, 1), "{v:?}");

    let mut bad = History::default();
    started(&mut bad, 0, "cases-1", &["pre-965"]);
    bad.push(0, Event::Backdated { referral: id(1) });
    bad.push(900, Event::PruneCycle { replica: "cases-1".into(), kept_pending: 0 });
    bad.push(900, Event::PrunedPending { envelope: id(2), service: "cases".into() });
    replay(&mut bad, 5_100, 30 * day + 3_600_000, 200);
    bad.sort();
    let v = retention_safety(&bad);
    assert_eq!((v.validity, v.counts["pending_pruned"], v.counts["replays_past_window_accepted"]), (Validity::Invalid, 1, 1), "{v:?}");
    assert!(v.all_point_at("compat:pre-965"), "{:?}", v.culprits);
    assert_eq!((v.culprits.get("kind:pruned_pending"), v.culprits.get("kind:replay_past_window")), (Some(&1), Some(&1)));
    assert!(v.witnesses[1].contains("answered 200 to a replay starting 721 h back, past the 720 h outbox window"), "{:?}", v.witnesses);

    // Issue 22.6: past the window only a 422 refuses; a 503 (or no answer) is no refusal.
    let mut unavailable = h.clone();
    replay(&mut unavailable, 5_200, 30 * day + 3_600_000, 503);
    unavailable.push(5_300, Event::Replay { replica: "cases-1".into(), from_age_ms: 30 * day + 3_600_000, window_ms: 30 * day, status: None, restaged: None });
    unavailable.sort();
    let v = retention_safety(&unavailable);
    assert_eq!((v.validity, v.culprits.get("kind:replay_past_window")), (Validity::Invalid, Some(&2)), "{v:?}");
    // Inside the window a replay must be accepted: one answered 503 (or nothing) re-staged
    // nothing, and a run built on it proves nothing (unproven, never held).
    for status in [Some(503), None] {
        let mut failed = History::default();
        started(&mut failed, 0, "cases-1", &[]);
        failed.push(5_000, Event::Replay { replica: "cases-1".into(), from_age_ms: 30 * day - 3_600_000, window_ms: 30 * day, status, restaged: None });
        replay(&mut failed, 5_100, 30 * day + 3_600_000, 422);
        let v = retention_safety(&failed);
        assert_eq!(v.validity, Validity::Unknown, "{v:?}");
        assert!(!v.nothing_to_check(), "{v:?}");
        assert!(v.error.as_deref().is_some_and(|e| e.contains("inside the outbox window was not accepted (cases-1 answered")), "{v:?}");
    }
    // ... and a dedup record deleted inside the 31 d inbox window is a violation; the one
    // past it is the prune's to take.
    let mut inbox = h.clone();
    started(&mut inbox, 0, "rules-1", &[]);
    inbox.push(0, Event::InboxEdge { envelope: id(7), service: "rules".into(), age_ms: 31 * day - day / 2 });
    inbox.push(0, Event::InboxEdge { envelope: id(8), service: "rules".into(), age_ms: 31 * day + day / 2 });
    inbox.push(950, Event::InboxPruned { envelope: id(8), service: "rules".into(), age_ms: 31 * day + day / 2, window_ms: 31 * day });
    inbox.sort();
    let v = retention_safety(&inbox);
    assert_eq!((v.validity, v.counts["inbox_edge_records_deleted"]), (Validity::Valid, 1), "{v:?}");
    inbox.push(960, Event::InboxPruned { envelope: id(7), service: "rules".into(), age_ms: 31 * day - day / 2, window_ms: 31 * day });
    inbox.sort();
    let v = retention_safety(&inbox);
    assert_eq!(v.validity, Validity::Invalid, "{v:?}");
    assert!(v.all_point_at("kind:pruned_dedup") && v.culprits.contains_key("replica:rules-1"), "{:?}", v.culprits);

    // Backdated rows staged, a cycle that never saw them: the fault never met the prune.
    let mut blind = History::default();
    blind.push(0, Event::Backdated { referral: id(1) });
    blind.push(900, Event::PruneCycle { replica: "cases-1".into(), kept_pending: 0 });
    assert_eq!(retention_safety(&blind).validity, Validity::Unknown);
    assert_eq!(retention_safety(&History::default()).validity, Validity::Unknown);
}

/// Issue 8.1: a duplicate beside an UNRELATED replica's crash is a violation.
#[test]
fn a_duplicate_beside_an_unrelated_replicas_crash_is_a_violation() {
    let mut h = History::default();
    effect_on(&mut h, 10, 101, "rules-1");
    crash(&mut h, 12, "rules-2");
    crash(&mut h, 13, "cases-1");
    reprocessed(&mut h, 40, 101, "rules-2");
    effect_on(&mut h, 40, 101, "rules-2");
    h.sort();
    let v = effect_once(&h);
    assert_eq!((v.validity, v.counts["unattributed"]), (Validity::Invalid, 1), "{:?}", v.witnesses);
    assert!(v.witnesses[0].contains("no crash of rules-1, database kill/pause/partition/failover, cut of its database link, or cut of the standby's replication link under synchronous replication with a failover during it, while the first run's stamp was due"), "{:?}", v.witnesses);
}

/// Issue 8.1: one crash of a sequential handler excuses ONE re-execution, not two.
#[test]
fn two_duplicates_excused_by_one_crash_of_a_sequential_handler_is_a_violation() {
    let mut h = History::default();
    effect_on(&mut h, 10, 101, "rules-1");
    effect_on(&mut h, 11, 102, "rules-1");
    crash(&mut h, 12, "rules-1");
    for env in [101, 102] {
        reprocessed(&mut h, 50, env, "rules-1");
        effect_on(&mut h, 50, env, "rules-1");
    }
    h.sort();
    let v = effect_once(&h);
    assert_eq!((v.validity, v.counts["crash_window_reexecutions"], v.counts["unattributed"]), (Validity::Invalid, 1, 1));
    assert!(v.witnesses.iter().any(|w| w.contains("already excused 1 re-execution(s) of rules-1")), "{:?}", v.witnesses);
}

/// Issue 12: a consume session that handles N deliveries at once can leave N envelopes in
/// the #1180 window, so one crash excuses up to N corroborated re-runs, in the replica's
/// own word (`subscriber.started concurrency=N`), and never N + 1.
#[test]
fn one_crash_excuses_as_many_reruns_as_the_replica_said_it_ran_at_once() {
    let run = |concurrency: Option<usize>| {
        let mut h = History::default();
        if let Some(n) = concurrency {
            h.push(1, Event::ConsumerStarted { replica: "rules-1".into(), concurrency: n });
        }
        for env in [101, 102, 103] {
            effect_on(&mut h, 10, env, "rules-1");
        }
        crash(&mut h, 12, "rules-1");
        for env in [101, 102, 103] {
            reprocessed(&mut h, 50, env, "rules-1");
            effect_on(&mut h, 50, env, "rules-1");
        }
        h.sort();
        let v = effect_once(&h);
        (v.validity, v.counts["crash_window_reexecutions"], v.counts["unattributed"])
    };
    assert_eq!(run(Some(3)), (Validity::Valid, 3, 0));
    assert_eq!(run(Some(2)), (Validity::Invalid, 2, 1));
    assert_eq!(run(None), (Validity::Invalid, 1, 2), "a replica that said nothing ran one at a time");
}

/// Audit finding: the inbox's report corroborates only the re-run it follows, on the
/// replica that ran it, and only once.
#[test]
fn a_reprocess_report_corroborates_only_its_own_rerun() {
    let base = |h: &mut History| {
        effect_on(h, 10, 101, "rules-1");
        crash(h, 15, "rules-1");
        effect_on(h, 900, 101, "rules-2");
    };
    for (t, replica, why) in [(905, "rules-1", "another replica's report"), (5, "rules-2", "a report before the re-run")] {
        let mut h = History::default();
        base(&mut h);
        reprocessed(&mut h, t, 101, replica);
        h.sort();
        assert_eq!(effect_once(&h).validity, Validity::Invalid, "{why} corroborates nothing");
    }
    let mut h = History::default();
    base(&mut h);
    reprocessed(&mut h, 905, 101, "rules-2");
    h.sort();
    assert_eq!(effect_once(&h).validity, Validity::Valid);
}

#[test]
fn timing_alone_never_excuses_and_a_late_fault_is_outside_the_window() {
    // The right crash, but the inbox never said it re-ran an unstamped envelope.
    let mut h = History::default();
    effect_on(&mut h, 10, 101, "rules-1");
    crash(&mut h, 15, "rules-1");
    effect_on(&mut h, 40, 101, "rules-1");
    h.sort();
    let v = effect_once(&h);
    assert_eq!(v.validity, Validity::Invalid);
    assert!(v.witnesses[0].contains("the inbox reported no reprocess"), "{:?}", v.witnesses);
    // Corroborated, but the crash came long after the stamp was due.
    let mut h = History::default();
    effect_on(&mut h, 10, 101, "rules-1");
    crash(&mut h, 10 + STAMP_DUE_MS + 1, "rules-1");
    reprocessed(&mut h, 9_000, 101, "rules-1");
    effect_on(&mut h, 9_000, 101, "rules-1");
    h.sort();
    assert_eq!(effect_once(&h).validity, Validity::Invalid);
}

/// Issue 26: under synchronous replication (`remote_apply`) a cut of the standby's
/// replication link stalls every commit, the inbox's processed stamp included, and a
/// failover while it is cut kills the primary under the waiting stamp: a fresh-clone CI run
/// saw rules' handler commit @643ms reach the standby, its stamp (due from about 650 ms)
/// stall from the cut @800ms, and the redelivery run again on the promoted server @3971ms.
/// That opens the #1180 window for the corroborated re-run; under asynchronous replication,
/// the failover opens it for a first run its standby had applied whose stamp was due after
/// that. Never for a cut healed before any
/// failover (the stamp lands when it heals), without the inbox's own report, for a re-run
/// before the failover (nothing was lost yet), or for a run after the failover (the promoted
/// server waits for no standby). The cut and its failover are one incident: one budget of
/// re-runs (the session's concurrency, 1 here) between them.
#[test]
fn a_cut_synchronous_replication_link_with_a_failover_in_it_opens_the_stamp_window() {
    // (first run, re-run, the inbox's report of it) per envelope.
    let run = |mode: &str, cut_until: u64, runs: &[(u64, u64, bool)]| {
        let mut h = History::default();
        h.push(0, Event::Replication { mode: mode.into(), state: "streaming".into() });
        window(&mut h, (800, cut_until), "down", "standby->database");
        window(&mut h, (2_990, 3_100), "failover", "database");
        h.push(3_000, Event::Failover { replayed_until_ms: Some(795), mode: mode.into(), promoted_ms: Some(3_400) });
        for (n, (first, again, report)) in runs.iter().enumerate() {
            let env = 101 + n as u128;
            effect_on(&mut h, *first, env, "rules-1");
            effect_on(&mut h, *again, env, "rules-1");
            if *report {
                reprocessed(&mut h, again + 4, env, "rules-1");
            }
        }
        h.sort();
        effect_once(&h)
    };
    let v = run("sync", 3_500, &[(643, 3_971, true)]);
    assert_eq!((v.validity, v.counts["crash_window_reexecutions"]), (Validity::Valid, 1), "{:?}", v.witnesses);
    assert!(v.witnesses[0].contains("after down standby->database @800ms (synchronous replication: commits waited for the standby)"), "{:?}", v.witnesses);
    // Asynchronous: the stamp commits on the primary alone, and the failover forgets what
    // its standby had not applied (@795ms): a first run up to then whose stamp was due after
    // it can have lost only its stamp (seen: 5 and 8 such re-runs in 2 of 10 runs of
    // failover-async-evaluates-twice, seeds 100..109). A first run after 795 ms was forgotten
    // whole.
    let v = run("async", 3_500, &[(643, 3_971, true)]);
    assert_eq!((v.validity, v.counts["crash_window_reexecutions"]), (Validity::Valid, 1), "{:?}", v.witnesses);
    assert!(v.witnesses[0].contains("after asynchronous failover of the database @3000ms (its standby had applied commits up to @795ms)"), "{:?}", v.witnesses);
    // The edge: a first run up to the clocks' slack (10 ms) after the last applied commit.
    assert_eq!(run("async", 3_500, &[(805, 3_971, true)]).counts["crash_window_reexecutions"], 1);
    // One incident, one budget (the session's concurrency, 1 here): the asynchronous window
    // and the failover fault's own share it.
    let v = run("async", 3_500, &[(643, 3_971, true), (2_995, 3_980, true)]);
    assert_eq!((v.counts["crash_window_reexecutions"], v.counts["unattributed"]), (1, 1), "{:?}", v.witnesses);
    for (mode, cut_until, runs) in [
        ("async", 3_500, &[(806, 3_971, true)][..]),
        ("async", 3_500, &[(900, 3_971, true)]),
        ("async", 3_500, &[(643, 2_900, true)]),
        ("async", 3_500, &[(643, 3_971, false)]),
        ("sync", 2_500, &[(643, 3_971, true)]),
        ("sync", 3_500, &[(643, 3_971, false)]),
        ("sync", 3_500, &[(643, 2_900, true)]),
        ("sync", 3_500, &[(3_200, 3_971, true)]),
    ] {
        let v = run(mode, cut_until, runs);
        assert_eq!((v.validity, v.counts["unattributed"]), (Validity::Invalid, 1), "{mode} {cut_until} {runs:?}: {:?}", v.witnesses);
    }
    // Two stalled stamps, one of them also inside the failover's own window: one budget.
    let v = run("sync", 3_500, &[(643, 3_971, true), (2_995, 3_980, true)]);
    assert_eq!((v.counts["crash_window_reexecutions"], v.counts["unattributed"]), (1, 1), "{:?}", v.witnesses);
}

#[test]
fn the_consumers_database_opens_the_window_a_producers_link_does_not() {
    let mut h = History::default();
    effect_on(&mut h, 10, 101, "rules-1");
    h.push(12, Event::Fault { kind: "kill".into(), target: "database".into(), phase: Phase::Start });
    h.push(900, Event::Fault { kind: "kill".into(), target: "database".into(), phase: Phase::End });
    effect_on(&mut h, 1_000, 101, "rules-1");
    effect_on(&mut h, 2_000, 102, "rules-1");
    h.push(2_010, Event::Fault { kind: "down".into(), target: "cases-1->database".into(), phase: Phase::Start });
    effect_on(&mut h, 3_000, 102, "rules-1");
    effect_on(&mut h, 4_000, 103, "rules-1");
    h.push(4_010, Event::Fault { kind: "toxic".into(), target: "rules-1->database (timeout downstream)".into(), phase: Phase::Start });
    effect_on(&mut h, 5_000, 103, "rules-1");
    for (env, t) in [(101, 1_000), (102, 3_000), (103, 5_000)] {
        reprocessed(&mut h, t + 5, env, "rules-1");
    }
    // A latency toxic on the link only delays the stamp: it opens no window.
    effect_on(&mut h, 6_000, 104, "rules-1");
    h.push(6_010, Event::Fault { kind: "toxic".into(), target: "rules-1->database (latency downstream)".into(), phase: Phase::Start });
    effect_on(&mut h, 7_000, 104, "rules-1");
    reprocessed(&mut h, 7_005, 104, "rules-1");
    h.sort();
    let v = effect_once(&h);
    assert_eq!((v.counts["crash_window_reexecutions"], v.counts["unattributed"]), (2, 2), "{:?}", v.witnesses);
    assert!(v.witnesses.iter().any(|w| w.contains("after kill database @12ms")), "{:?}", v.witnesses);
    assert!(v.witnesses.iter().any(|w| w.contains("after toxic rules-1->database (timeout downstream) @4010ms")), "{:?}", v.witnesses);
}

#[test]
fn liveness_needs_a_drain_within_the_bound_and_no_stuck_claims() {
    let mut h = History::default();
    assert_eq!(liveness(&h).validity, Validity::Unknown);
    h.push(100, Event::Drained { after_ms: Some(1200), bound_ms: 60_000, pending: 0, unacked_unknown: false });
    assert_eq!(liveness(&h).validity, Validity::Valid);
    // Quiet by every other sign, but the broker could not count unacked deliveries.
    let mut unproven = History::default();
    unproven.push(100, Event::Drained { after_ms: Some(1200), bound_ms: 60_000, pending: 0, unacked_unknown: true });
    assert_eq!(liveness(&unproven).validity, Validity::Unknown);
    // Issue 22.7: quiet but the count never came within the bound: unknown, not held.
    let mut never_counted = History::default();
    never_counted.push(100, Event::Drained { after_ms: None, bound_ms: 60_000, pending: 0, unacked_unknown: true });
    assert_eq!(liveness(&never_counted).validity, Validity::Unknown);
    h.push(101, Event::Stuck { envelope: id(7), service: "cases".into(), claimed_ms_ago: 90_000 });
    let v = liveness(&h);
    assert_eq!((v.validity, v.counts["stuck_claims"]), (Validity::Invalid, 1));
    let mut h = History::default();
    h.push(100, Event::Drained { after_ms: None, bound_ms: 60_000, pending: 12, unacked_unknown: false });
    let v = liveness(&h);
    assert_eq!(v.validity, Validity::Invalid);
    assert!(v.witnesses[0].starts_with("12 outbox rows still pending"));
}

fn poisoned(published: bool, attempts: i32) -> History {
    poisoned_with(published, attempts, "malformed: missing field `id`")
}

fn poisoned_with(published: bool, attempts: i32, last_error: &str) -> History {
    let mut h = History::default();
    h.push(0, Event::Poison { envelope: id(9), service: "cases".into() });
    let last_error = Some(last_error.to_owned());
    h.push(0, Event::Staged { envelope: id(9), referral: None, service: "cases".into(), published, attempts, last_error });
    h.push(100, Event::Drained { after_ms: Some(900), bound_ms: 60_000, pending: 0, unacked_unknown: false });
    h
}

#[test]
fn a_poison_row_is_excused_only_while_the_system_says_it_refused_it() {
    let v = liveness(&poisoned(false, 3));
    assert_eq!((v.validity, v.counts["poison_rows"], v.counts["poison_refusals"]), (Validity::Valid, 1, 3));
    let v = liveness(&poisoned(true, 1));
    assert_eq!(v.validity, Validity::Invalid);
    assert!(v.witnesses[0].contains("was stamped published"), "{:?}", v.witnesses);
    let v = liveness(&poisoned(false, 0));
    assert_eq!(v.validity, Validity::Unknown, "never claimed: the fault did not fire");
    // Attempts alone do not corroborate: a broker outage also counts attempts.
    let v = liveness(&poisoned_with(false, 2, "connection: broker unreachable"));
    assert_eq!(v.validity, Validity::Unknown, "not refused as malformed");
    let mut gone = History::default();
    gone.push(0, Event::Poison { envelope: id(9), service: "cases".into() });
    gone.push(100, Event::Drained { after_ms: Some(900), bound_ms: 60_000, pending: 0, unacked_unknown: false });
    assert_eq!(liveness(&gone).validity, Validity::Invalid, "a deleted poison row is a loss of evidence");
}

#[test]
fn witnesses_are_capped() {
    let mut h = History::default();
    for n in 0..50 {
        write(&mut h, n as u64, n, Outcome::Ok);
    }
    let v = no_loss(&h);
    assert_eq!((v.counts["lost"], v.witnesses.len()), (50, MAX_WITNESSES));
}

#[test]
fn a_panicking_checker_is_unknown_with_its_error() {
    assert!(check("nope", &History::default()).is_none());
    let v = Verdict { error: Some("boom".into()), validity: Validity::Unknown, ..Verdict::new("x") };
    assert_eq!(v.validity, Validity::Unknown);
    // check() itself wraps the real checkers; all return without panicking on empty input.
    for name in INVARIANTS {
        let v = check(name, &History::default()).unwrap();
        assert_ne!(v.validity, Validity::Invalid, "{name} on an empty history");
    }
}

mod properties {
    use proptest::prelude::*;

    use super::*;

    fn outcome() -> impl Strategy<Value = Outcome> {
        prop_oneof![Just(Outcome::Ok), Just(Outcome::Failed), Just(Outcome::Unknown)]
    }

    proptest! {
        /// Total-queue bookkeeping holds for any history: every acknowledged write is
        /// ok or lost, recovered writes are unknown ones that took effect, and the
        /// verdict is red exactly when something was lost.
        #[test]
        fn no_loss_accounting_is_exhaustive(writes in proptest::collection::vec((outcome(), any::<bool>()), 0..60)) {
            let mut h = History::default();
            for (n, (o, delivered)) in writes.iter().enumerate() {
                write(&mut h, n as u64, n as u128, *o);
                if *delivered && *o != Outcome::Failed {
                    effect(&mut h, 1000 + n as u64, 10_000 + n as u128, n as u128);
                }
            }
            let v = no_loss(&h);
            let c = |k: &str| v.counts[k];
            prop_assert_eq!(c("attempted") as usize, writes.len());
            prop_assert_eq!(c("ok") + c("lost"), c("acknowledged"));
            prop_assert!(c("recovered") <= c("unknown"));
            prop_assert_eq!(c("acknowledged") + c("unknown") + c("failed"), c("attempted"));
            let lost = writes.iter().filter(|(o, d)| *o == Outcome::Ok && !d).count() as u64;
            prop_assert_eq!(c("lost"), lost);
            prop_assert_eq!(v.validity == Validity::Invalid, lost > 0);
            prop_assert!(v.witnesses.len() <= MAX_WITNESSES);
        }

        /// effect_once: every duplicate run is either attributed to a corroborated crash of
        /// the first run's replica in its window, or counted as a violation — never dropped.
        #[test]
        fn effect_once_accounts_for_every_rerun(runs in proptest::collection::vec((1usize..4, any::<bool>()), 1..30)) {
            let mut h = History::default();
            let mut t = 0;
            let mut reruns = 0;
            for (env, (times, crash_between)) in runs.iter().enumerate() {
                for k in 0..*times {
                    if k > 0 {
                        reruns += 1;
                        if *crash_between {
                            t += 1;
                            h.push(t, Event::Crash { replica: "rules-1".into(), consumer: true, how: "SIGKILL".into() });
                            h.push(t, Event::Reprocessed { envelope: id(env as u128), replica: "rules-1".into() });
                        }
                    }
                    t += 1;
                    effect_on(&mut h, t, env as u128, "rules-1");
                }
            }
            let v = effect_once(&h);
            prop_assert_eq!(v.counts["crash_window_reexecutions"] + v.counts["unattributed"], reruns);
            let unattributed: u64 = runs.iter().filter(|(_, c)| !c).map(|(n, _)| *n as u64 - 1).sum();
            prop_assert_eq!(v.counts["unattributed"], unattributed);
            prop_assert_eq!(v.validity == Validity::Invalid, unattributed > 0);
        }
    }
}

/// Issue 22.1: the runner leaves an unlisted checker out only when it says "nothing to
/// check"; on an empty run every checker must say exactly that (any other unknown would
/// make every scenario that does not list it inconclusive).
#[test]
fn every_checker_on_an_empty_run_has_nothing_to_check() {
    for v in check_all(&History::default()) {
        assert!(v.nothing_to_check(), "{}: {:?}", v.name, v.error);
    }
}

/// Issue 26: after an asynchronous database failover, an acknowledged write the promoted
/// server does not hold is `kind:lost_acknowledged` (no_loss), and an effect of it
/// `kind:phantom_event` (no_phantom), each blamed on the failover and the replication mode —
/// but only where the standby had not applied up to the client's answer (or, unanswered, its
/// event's stamp), and only for a write sent before the old primary's kill; never after a
/// synchronous one. Anything else the new primary lacks is a loss the failover does not
/// excuse.
#[test]
fn a_failover_is_blamed_only_for_what_its_standby_had_not_applied() {
    // Referral 1 answered @100, before the standby's last applied commit (@500); 2 answered
    // @700, after it; 3 sent @1200, after the kill (@1000), so it went to the new primary.
    let base = |gone: &[u128]| {
        let mut h = History::default();
        started(&mut h, 0, "cases-1", &[]);
        for (t, n, a) in [(90, 1, 100), (690, 2, 700), (1200, 3, 1210)] {
            h.push(t, Event::Write { referral: id(n), replica: "cases-1".into(), outcome: Outcome::Ok, status: Some(201), answered_ms: Some(a) });
            staged(&mut h, 10 + n, n);
            effect(&mut h, 1500, 10 + n, n);
            if !gone.contains(&n) {
                h.push(2000, Event::Committed { aggregate: id(n), table: "referrals".into() });
            }
        }
        window(&mut h, (1000, 1100), "failover", "database");
        h.push(1000, Event::Failover { replayed_until_ms: Some(500), mode: "async".into(), promoted_ms: None });
        h.push(2000, Event::CommittedRead);
        h.sort();
        h
    };
    assert_eq!((no_loss(&base(&[])).validity, no_phantom(&base(&[])).validity), (Validity::Valid, Validity::Valid));
    // Referral 2 is gone, its event took effect: both kinds, on the failover and its mode.
    let h = base(&[2]);
    let (v, p) = (no_loss(&h), no_phantom(&h));
    assert_eq!((v.validity, v.violations, p.validity, p.violations), (Validity::Invalid, 1, Validity::Invalid, 1), "{v:?} {p:?}");
    for cause in ["kind:lost_acknowledged", "fault:failover database", "replication:async"] {
        assert!(v.all_point_at(cause), "{cause}: {:?}", v.culprits);
    }
    for cause in ["kind:phantom_event", "fault:failover database", "replication:async"] {
        assert!(p.all_point_at(cause), "{cause}: {:?}", p.culprits);
    }
    assert!(v.witnesses[0].contains("acknowledged and gone (its event took effect); the database failed over @1000ms (async replication)"), "{:?}", v.witnesses);
    // Referral 1 gone: the standby had applied past its answer, so the failover cannot have
    // forgotten it; referral 3 gone: sent after the kill. Neither is the failover's.
    for n in [1, 3] {
        let h = base(&[n]);
        let (v, p) = (no_loss(&h), no_phantom(&h));
        assert!(v.all_point_at("kind:lost_acknowledged") && !v.culprits.contains_key("fault:failover database"), "{n}: {:?}", v.culprits);
        assert!(p.all_point_at("kind:phantom") && !p.culprits.contains_key("replication:async"), "{n}: {:?}", p.culprits);
    }
    // A synchronous standby had every commit anyone saw: the same loss is never the failover's.
    let mut h = base(&[2]);
    for e in h.entries.iter_mut() {
        if let Event::Failover { mode, .. } = &mut e.event {
            *mode = "sync".into();
        }
    }
    let (v, p) = (no_loss(&h), no_phantom(&h));
    assert!(v.all_point_at("kind:lost_acknowledged") && !v.culprits.contains_key("fault:failover database"), "{:?}", v.culprits);
    assert!(p.all_point_at("kind:phantom") && !p.culprits.contains_key("replication:sync"), "{:?}", p.culprits);
    // A write no client heard answered: its commit came before its event's stamp, so a stamp
    // before what the standby applied (@500) bounds it there (not the failover's); one after
    // it does not. As after a real failover, cases' outbox row went with the commit: the
    // event is known by its effect.
    for (stamp, excused) in [(400, false), (600, true)] {
        let mut h = base(&[]);
        h.push(60, Event::Write { referral: id(4), replica: "cases-1".into(), outcome: Outcome::Unknown, status: None, answered_ms: Some(5000) });
        stamped(&mut h, stamp, 14, "cases-1", &[]);
        effect(&mut h, 1500, 14, 4);
        h.sort();
        let p = no_phantom(&h);
        assert_eq!((p.violations, p.all_point_at("kind:phantom_event")), (1, excused), "stamp @{stamp}: {:?}", p.culprits);
    }
    // Without a failover at all, an acknowledged write that is gone is still named.
    let mut h = base(&[2]);
    h.entries.retain(|e| !matches!(e.event, Event::Failover { .. }));
    let v = no_loss(&h);
    assert!(v.all_point_at("kind:lost_acknowledged") && !v.culprits.contains_key("fault:failover database"), "{:?}", v.culprits);
}
