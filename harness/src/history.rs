//! The history of one scenario run: every attempted domain write and its outcome, every
//! staged envelope, every side effect, every fault and crash, and periodic samples —
//! timestamped in milliseconds since the run started, one JSON object a line
//! (`history.jsonl`).
//!
//! Pure data: no I/O here beyond (de)serializing lines; checkers read it without a clock.

use serde::{Deserialize, Serialize};
use uuid::Uuid;

/// How a write's caller saw it end (Jepsen's ok / fail / info).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Outcome {
    /// Acknowledged: the service said it committed (HTTP 201).
    Ok,
    /// Definitely not committed (rejected before any write, or rolled back by us).
    Failed,
    /// Unknown: a timeout, a reset or a 5xx — it may or may not have committed.
    Unknown,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum Event {
    /// The first line: the seed every random choice of the run was drawn from.
    Seed { seed: u64, scenario: String },
    /// A domain write attempted through a replica: `referral` is the id of the aggregate the
    /// harness chose (a referral, or a placement for `kind = "placements"`), which its
    /// effect carries back.
    Write {
        referral: Uuid,
        replica: String,
        outcome: Outcome,
        status: Option<u16>,
        /// When the request ended (run ms: its answer, or the refused connection or timeout
        /// that ended it; the event's own time is when the request went out).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        answered_ms: Option<u64>,
    },
    /// An aggregate cases' database holds committed at the end (a `referrals` row, an active
    /// `placements` row; issue 22.2), read by the harness whatever the client heard.
    Committed { aggregate: Uuid, table: String },
    /// The harness read cases' committed aggregates at the end (pushed after every
    /// [`Event::Committed`], none or many): without it, "not committed" is not known.
    CommittedRead,
    /// Redelivered arrivals in `service`'s database, as the harness's own triggers counted
    /// them (issue 22.1; installed only where a floor asks): deliveries of an envelope its
    /// §D2 inbox already held processed, and arrivals of a dead letter its audit already
    /// recorded with the same facts (#1181). The floors read these, never a node's counter.
    Redelivered {
        service: String,
        inbox: u64,
        dead_letters: u64,
        /// For each inbox arrival the harness's trigger recorded, when the record it met was
        /// stamped processed (run time, from the database's clock). Issue 26: after a failover
        /// the floor counts only records stamped before it, the ones the failover kept.
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        inbox_met_processed_ms: Vec<u64>,
    },
    /// A write staged in a transaction the harness rolled back on purpose.
    RolledBack { referral: Uuid },
    /// An outbox row found at the end of the run.
    Staged {
        envelope: Uuid,
        referral: Option<Uuid>,
        service: String,
        published: bool,
        attempts: i32,
        /// The worker's last refusal reason (`malformed: …`, `nacked: …`), if any.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        last_error: Option<String>,
    },
    /// A counted side effect (a `rule_evaluations` row on rules, a `payments` row on
    /// financial; `referral` is the aggregate id it names): the DB's time of it converted to the
    /// run's clock, and the replica that ran it (when it said).
    Effect {
        envelope: Uuid,
        referral: Option<Uuid>,
        service: String,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        replica: Option<String>,
    },
    /// The inbox of `replica` reported re-running an envelope it had recorded but never
    /// stamped (`inbox.reprocessed`, the #1180 window): the system's own corroboration.
    Reprocessed { envelope: Uuid, replica: String },
    /// The inbox of `replica` ran `envelope`'s handler and its `processed_at` stamp failed and
    /// is being tried again (`inbox.stamp_retry`): the stamp was still pending then, so the
    /// #1180 window of that run reaches this far (the system's own word).
    StampRetry { envelope: Uuid, replica: String },
    /// financial's arbiter absorbed a replay of `envelope` (its `financial.payment_replay_absorbed`
    /// line, #1179): the stored payment's facts matched, nothing was written.
    PaymentAbsorbed { envelope: Uuid, replica: String },
    /// financial committed a payment for `envelope` (its `financial.payment_created` line,
    /// logged after the commit): the consumer's own word that the effect was committed,
    /// which an asynchronous failover can then forget with its inbox record (issue 26).
    PaymentCreated { envelope: Uuid, replica: String },
    /// A replica (re)started running `compat` (empty: current behaviour). Every start is
    /// recorded — first start, late start, restart after a crash or kill, upgrade — so the
    /// checkers know which behaviour ran an execution at its time.
    Started { replica: String, compat: Vec<String> },
    /// A consume session of `replica` started handling up to `concurrency` deliveries at once
    /// (its `subscriber.started` line): how many envelopes one crash of it can leave inside
    /// the #1180 window.
    ConsumerStarted { replica: String, concurrency: usize },
    /// A replica's outbox stamped `envelope` published (its `outbox.stamped` log line),
    /// while running `compat`: who to blame when a stamped event never arrives.
    Stamped { envelope: Uuid, replica: String, compat: Vec<String> },
    /// A replica's outbox claimed `envelope` (its `outbox.claimed` log line, the #1128
    /// path only): the row was committed in that outbox by then. Issue 26: bounds a commit
    /// an asynchronous failover forgot where its stamp never came (the primary died between
    /// the confirm and the stamp).
    Claimed { envelope: Uuid, replica: String },
    /// Every fault has healed and every crashed replica is back: the after-heal writes
    /// start here.
    Healed,
    /// Dead letters at the end of the run: still in the DLQ plus already audited.
    DeadLetters { count: u32 },
    /// Deliveries left in `craig-security.dlq.capture` at the end of the run (acked off the
    /// DLQ without an audit row; issue 21.1), read by the harness itself (passive declare).
    CaptureLeft { count: u32 },
    /// A dead letter as the harness's own tap on `craig.dlx` saw it (a copy bound `dlq.#`;
    /// the system's path is untouched): the occurrence it names, read exactly as the DLQ
    /// consumer reads it (`craig_mq::dlq::DeadLetterDelivery`). `key` is a digest of the
    /// routing key and body, which the audit row keeps byte for byte.
    DeadLettered {
        key: String,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        token: Option<String>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        envelope: Option<Uuid>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        queue: Option<String>,
        /// The event type by the tap's own copy: the envelope's, else the routing key it was
        /// first published with (the oldest `x-death` entry's `routing-keys`), read here.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        event_type: Option<String>,
    },
    /// A `dead_letter_audit` row (§D3), read at the end: `key` as for
    /// [`Event::DeadLettered`]; times in epoch ms on the database's clock (the window's).
    Audited {
        key: String,
        disposition: String,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        token: Option<String>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        envelope: Option<Uuid>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        event_type: Option<String>,
        received_epoch_ms: i64,
        /// `LEAST(COALESCE(occurred_at, dlq_received_at), dlq_received_at)` (#1181 R5/R8).
        window_epoch_ms: i64,
        /// The transaction that wrote the row (`xmin`), read from the database.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        tx: Option<String>,
    },
    /// A `security.dlq.threshold_exceeded` event the security service staged (#1156), with
    /// the transaction that staged it (`xmin`): the row whose arrival it announces is the
    /// one written in the same transaction.
    ThresholdExceeded {
        event_type: String,
        count: i64,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        tx: Option<String>,
    },
    /// A fault began or ended.
    Fault { kind: String, target: String, phase: Phase },
    /// A broker node lost its data (a `kill` with `wipe`, issue 25): what its queues held
    /// there is gone unless replicated (`queue_type`: `classic` or `quorum`, the run's).
    /// `queues`: the queues only that node held, with the ready messages the broker counted
    /// in each just before the kill (the most a loss there can explain).
    BrokerDataLost {
        node: String,
        queue_type: String,
        #[serde(default)]
        queues: Vec<(String, u64)>,
    },
    /// The database's standby streaming (issue 26), as the primary reported it before the
    /// load began: `mode` `sync` or `async` (its `pg_stat_replication.sync_state`).
    Replication { mode: String, state: String },
    /// The database failed over (issue 26), at the old primary's death by its backend's
    /// word (the SIGKILL of its process group; a container's exit as the engine recorded
    /// it, up to a second before `docker kill` returns): the standby was
    /// promoted having applied every commit up to `replayed_until_ms` (run time, converted
    /// from the commit timestamp of the last transaction it replayed; None: none since it
    /// started) and nothing after. `mode` is the replication's (`sync`, `async`).
    Failover {
        #[serde(default, skip_serializing_if = "Option::is_none")]
        replayed_until_ms: Option<u64>,
        mode: String,
        /// When the database address led to the promoted standby (None: not recorded).
        /// From the kill to then nothing could commit anywhere.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        promoted_ms: Option<u64>,
    },
    /// A replica process died (crash point, kill). `consumer` is true for consuming services.
    Crash { replica: String, consumer: bool, how: String },
    /// Periodic sample for the timeline.
    Sample { outbox_pending: i64, published: i64, effects: i64, lag_ms: f64 },
    /// After faults healed: how long until nothing was pending (None: not within the bound).
    Drained {
        after_ms: Option<u64>,
        bound_ms: u64,
        pending: i64,
        /// The broker could not say how many deliveries were unacked when the rest was
        /// quiet: the drain is not proven.
        #[serde(default, skip_serializing_if = "std::ops::Not::not")]
        unacked_unknown: bool,
    },
    /// A malformed outbox row the harness wrote by hand before the workload: it must stay
    /// pending (never stamped, never deleted) and be refused by the worker.
    Poison { envelope: Uuid, service: String },
    /// Security acked a DLQ delivery without a committed audit row (`security.dlq.log_and_ack`,
    /// compat `pre-1197`), running `compat`: `key` names the delivery's bytes as
    /// [`Event::DeadLettered`] does.
    AckedUnrecorded { key: String, replica: String, compat: Vec<String> },
    /// A consumer replica refused `envelope` for good and rejected it to the broker
    /// (`subscriber.permanent_failure`, running `compat`): the system's own word that it
    /// handed the message to dead-lettering.
    Rejected { envelope: Uuid, replica: String, compat: Vec<String> },
    /// An envelope the harness staged through cases' outbox for `service` (its consumer) to
    /// refuse for good (`[workload] dead_letters`, `placement_dead_letters`,
    /// `app_dead_letters`): published, it must reach `craig.dlx` (§D3) from that service's
    /// queue.
    DeadLetterStaged {
        envelope: Uuid,
        #[serde(default = "rules")]
        service: String,
    },
    /// The partner received a POST of a transmission (#1185 send queue): its
    /// `craig_correlation_id` (None: the body named none), the replica that sent it, and the
    /// answer the partner chose at receipt (200, 500, 409 for a concurrent duplicate; 0: it
    /// hung).
    PartnerPost {
        #[serde(default, skip_serializing_if = "Option::is_none")]
        correlation: Option<Uuid>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        replica: Option<String>,
        status: u16,
    },
    /// The partner's own record of what a new transmission was about (issue 26): the
    /// placement and period its body's `payload` names, at its first receipt. A second
    /// correlation for one placement period is a second payment of it at the partner,
    /// whatever the sender's database still holds.
    PartnerTransmission { correlation: Uuid, placement: Uuid, period: String },
    /// The correlation id of every send job financial's database holds at the end (issue
    /// 26): a transmission the partner got that is not among them is one the database forgot.
    SendJobsHeld { correlations: Vec<Uuid> },
    /// The partner got a transmission and its sender never got the answer (it hung, or the
    /// sender timed out or died first): the sender's next POST of it is its retry.
    PartnerUnanswered { correlation: Uuid },
    /// The harness's own copy of a `rule.evaluated` rules published (issue 26; the
    /// evaluations tap, read at the end, placed at the envelope's `occurred_at`): the
    /// evaluation envelope, the source envelope it evaluated and the referral it is about.
    /// An effect by the harness's own record, whatever rules' database still holds.
    EvaluationPublished { envelope: Uuid, source: Uuid, referral: Uuid },
    /// A send-queue replica's own word on how one send of a transmission ended
    /// (`send_jobs.finalized`): `result` accepted | refused | failed, and whether its fenced
    /// transition applied (a failed send applied is the fenced retry: the claim is over).
    SendFinalized {
        correlation: Uuid,
        replica: String,
        result: String,
        applied: bool,
        /// The claim generation the sender finalized (the line's `generation`).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        generation: Option<i64>,
    },
    /// financial's database put a claimed send job back in the queue as a retry (`in_flight
    /// -> pending` with `attempts + 1`, the fenced retry; not a boot sweep), by the harness's
    /// own trigger: the database's word on what `SendFinalized` says, with the claim
    /// generation it ended.
    SendReleased { correlation: Uuid, generation: i64 },
    /// financial's database claimed a send job (`-> in_flight`), moving its claim generation
    /// from `from_generation` to `generation` (issue 26; a pre-#1185 claim moves none), by
    /// the harness's own trigger, read at the end from the database that survived: a claim
    /// an asynchronous failover forgot has no row there.
    SendClaimed { correlation: Uuid, from_generation: i64, generation: i64 },
    /// The send queue's timing in this run (#1185): the claim lease and the per-send cap
    /// the financial replicas were given.
    SendQueue { lease_ms: u64, cap_ms: u64 },
    /// financial staged `exchange.<outcome>` (sent | failed) for a send job, by `replica`
    /// (from the event's payload), read from its outbox at the end.
    Exchanged {
        job: Uuid,
        transaction: Uuid,
        outcome: String,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        replica: Option<String>,
    },
    /// An `exchange_transactions` status change, recorded by a trigger the harness installs
    /// (every writer's change, an old replica's bare-id UPDATE included).
    TransactionStatus { transaction: Uuid, from: String, to: String },
    /// A referral the harness wrote "long ago" (`[workload] backdated`): its event pending
    /// and past the outbox window, for the prune to keep.
    Backdated { referral: Uuid },
    /// A pending outbox row was deleted (a trigger the harness installs in every service
    /// database records each DELETE of a row with `published_at IS NULL`).
    PrunedPending { envelope: Uuid, service: String },
    /// What financial's database holds per placement period (issue 22.3), read at the end:
    /// payments, `payment.created` outbox rows and partner transmissions. Each side effect
    /// is staged iff its payment was inserted: one of each per payment.
    PaymentLedger { placement: Uuid, period: String, payments: u32, created_events: u32, transmissions: u32 },
    /// A dedup record the harness staged at the edge of the inbox window (issue 22.6), its
    /// age when staged.
    InboxEdge { envelope: Uuid, service: String, age_ms: u64 },
    /// An `event_inbox` row of consuming service `service` (rules, financial), read at the
    /// end (issue 25): the consumer recorded this envelope, in its own commit before its
    /// handler ran (§D2), so the broker delivered it. `no_loss` tells a confirmed event the
    /// broker never delivered from one a consumer took and lost by these.
    Inboxed {
        envelope: Uuid,
        service: String,
        /// Its `processed_at` is set: the consumer's handler succeeded and the inbox stamped it.
        #[serde(default)]
        processed: bool,
        /// When it was stamped processed (run ms, from the database's `processed_at`).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        processed_ms: Option<u64>,
    },
    /// A DELETE of an `event_inbox` row, recorded by a harness trigger with the row's age
    /// then, and the inbox window the service runs with.
    InboxPruned { envelope: Uuid, service: String, age_ms: u64, window_ms: u64 },
    /// A replica's retention prune ran a cycle (`retention.cycle`) and how many pending rows
    /// older than the grace it saw and kept (`retention.outbox_unpublished_beyond_grace`).
    PruneCycle {
        replica: String,
        #[serde(default)]
        kept_pending: i64,
    },
    /// An admin replay the workload asked of `replica`: its window's start `from_age_ms`
    /// before the request, the outbox window it must respect, and the answer.
    Replay { replica: String, from_age_ms: u64, window_ms: u64, status: Option<u16>, restaged: Option<i64> },
    /// A row still claimed past its lease at the end.
    Stuck { envelope: Uuid, service: String, claimed_ms_ago: i64 },
    /// One request of the exports workload (§D5): the key and size asked for, the replica,
    /// the answer (None: no answer), whether it was a replay or the too-large sentinel, and
    /// the bytes received (their sha256, unless the client went away on purpose, `cancelled`).
    HttpExchange {
        key: String,
        size: u64,
        replica: String,
        status: Option<u16>,
        replayed: bool,
        too_large: bool,
        body_len: u64,
        body_sha256: Option<String>,
        cancelled: bool,
        /// A 409's `Retry-After`, in seconds.
        #[serde(default)]
        retry_after: Option<u64>,
    },
    /// One execution of the exports handler (an `exports` row, collected at the end): the
    /// key, cache key and claim generation it ran under, the sha256 of what it produced.
    ExportRun {
        key: Option<String>,
        cache_key: Option<String>,
        size: u64,
        generation: Option<i64>,
        body_sha256: Option<String>,
        #[serde(default)]
        replica: Option<String>,
    },
    /// One version of a cases `idempotency_responses` row, as the harness's trigger recorded
    /// it when it was written (`chaos_claim_versions`): a claim (`processing`, with its
    /// expiry) or a finalize, under `generation`.
    ClaimVersion { cache_key: String, generation: i64, status: String, claim_expires_ms: Option<u64> },
    /// A cases `idempotency_responses` row at the end.
    IdempotencyRow { cache_key: String, status: String, status_code: Option<i16>, body_len: Option<i64>, body_too_large: bool, generation: i64 },
}

impl Event {
    /// An exports request to `replica` with no answer yet (the fields a reply fills in).
    pub fn unanswered_exchange(key: &str, size: u64, replica: &str) -> Event {
        Event::HttpExchange {
            key: key.to_owned(),
            size,
            replica: replica.to_owned(),
            status: None,
            replayed: false,
            too_large: false,
            body_len: 0,
            body_sha256: None,
            cancelled: false,
            retry_after: None,
        }
    }
}

fn rules() -> String {
    "rules".into()
}

/// The identity of one dead-letter delivery's bytes: a digest of its routing key and body,
/// which the tap sees and the audit row keeps (`routing_key`, `raw_body`) byte for byte.
pub fn dead_letter_key(routing_key: &str, body: &[u8]) -> String {
    format!("{:016x}", craig_mq::dlq::delivery_digest(routing_key, body))
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Phase {
    Start,
    End,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Entry {
    pub t_ms: u64,
    #[serde(flatten)]
    pub event: Event,
}

/// A whole history, in time order.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct History {
    pub entries: Vec<Entry>,
}

impl History {
    pub fn push(&mut self, t_ms: u64, event: Event) {
        self.entries.push(Entry { t_ms, event });
    }

    /// Sort by time (stable: same-time entries keep insertion order).
    pub fn sort(&mut self) {
        self.entries.sort_by_key(|e| e.t_ms);
    }

    pub fn iter(&self) -> impl Iterator<Item = &Entry> {
        self.entries.iter()
    }

    /// The compat modes `replica` ran at time `t` (its last start at or before `t`; its
    /// first start when `t` precedes them all). None: the replica was never started.
    pub fn compat_at(&self, replica: &str, t: u64) -> Option<&[String]> {
        let mut found: Option<&[String]> = None;
        for e in &self.entries {
            if let Event::Started { replica: r, compat } = &e.event {
                if r == replica && (e.t_ms <= t || found.is_none()) {
                    found = Some(compat);
                }
            }
        }
        found
    }

    /// Every fault's window `(cause tag, from, to)`: `fault:<kind> <target>` with the
    /// target as the scenario names it (`fault:toxic cases-1->broker`, `fault:kill broker`,
    /// `fault:crash cases-1`); a window still open at the end runs to `u64::MAX`.
    pub fn fault_windows(&self) -> Vec<(String, u64, u64)> {
        self.fault_spans().into_iter().map(|(tag, _, from, to)| (tag, from, to)).collect()
    }

    /// [`History::fault_windows`] with each window's report label (its start's `target`,
    /// e.g. `cases-1->database (timeout downstream)`): what the fault did, where the cause
    /// tag says only where.
    pub fn fault_spans(&self) -> Vec<(String, String, u64, u64)> {
        let mut out: Vec<(String, String, u64, u64)> = Vec::new();
        // (tag, label, index) of every window still open.
        let mut open: Vec<(String, String, usize)> = Vec::new();
        for e in &self.entries {
            let Event::Fault { kind, target, phase } = &e.event else { continue };
            let base = target.split(" (").next().unwrap_or(target);
            let base = base.split(" at ").next().unwrap_or(base);
            let base = base.split(" to ").next().unwrap_or(base);
            let base = base.strip_suffix(" restarted").unwrap_or(base);
            let tag = format!("fault:{kind} {base}");
            match phase {
                Phase::Start => {
                    open.push((tag.clone(), target.clone(), out.len()));
                    out.push((tag, target.clone(), e.t_ms, u64::MAX));
                }
                Phase::End => {
                    // The window its own label opened first (two toxics on one link are two
                    // windows, each closed by its own end), else the first of its tag (a
                    // crash ends as "<replica> restarted").
                    let k = open.iter().position(|(t, l, _)| *t == tag && l == target).or_else(|| open.iter().position(|(t, ..)| *t == tag));
                    if let Some(k) = k {
                        let (.., i) = open.remove(k);
                        out[i].3 = e.t_ms;
                    }
                }
            }
        }
        out
    }

    pub fn to_jsonl(&self) -> String {
        let mut out = String::new();
        for e in &self.entries {
            out.push_str(&serde_json::to_string(e).expect("history entries serialize"));
            out.push('\n');
        }
        out
    }

    pub fn from_jsonl(text: &str) -> Result<Self, (usize, serde_json::Error)> {
        let mut h = History::default();
        for (i, line) in text.lines().enumerate().filter(|(_, l)| !l.trim().is_empty()) {
            h.entries.push(serde_json::from_str(line).map_err(|e| (i + 1, e))?);
        }
        Ok(h)
    }

    fn faults(&self) -> impl DoubleEndedIterator<Item = (u64, String)> + '_ {
        self.entries.iter().filter_map(|e| match &e.event {
            Event::Fault { kind, target, phase: Phase::Start } => Some((e.t_ms, format!("{kind} {target} @{}ms", e.t_ms))),
            Event::Crash { replica, how, .. } => Some((e.t_ms, format!("crash {replica} ({how}) @{}ms", e.t_ms))),
            _ => None,
        })
    }

    /// The last fault that started at or before `t_ms`, as "kind target @t".
    pub fn fault_before(&self, t_ms: u64) -> Option<String> {
        self.faults().filter(|(t, _)| *t <= t_ms).map(|(_, f)| f).next_back()
    }

    /// For a witness: the last fault at or before `t_ms`, else the first one after it
    /// (an operation can be hurt by a fault that begins while it is still in flight).
    pub fn fault_near(&self, t_ms: u64) -> String {
        match self.fault_before(t_ms) {
            Some(f) => format!("last fault before it: {f}"),
            None => match self.faults().find(|(t, _)| *t > t_ms) {
                Some((_, f)) => format!("no fault before it; next fault: {f}"),
                None => "no fault in the run".into(),
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn compat_at_is_the_behaviour_of_the_last_start() {
        let mut h = History::default();
        let start = |h: &mut History, t, c: &[&str]| {
            h.push(t, Event::Started { replica: "cases-1".into(), compat: c.iter().map(|s| s.to_string()).collect() })
        };
        start(&mut h, 0, &["pre-1128"]);
        start(&mut h, 1500, &[]);
        start(&mut h, 4000, &["pre-1128"]);
        let at = |t| h.compat_at("cases-1", t).map(|c| c.join(","));
        assert_eq!((at(0), at(1499), at(1500), at(3999), at(9000)), (
            Some("pre-1128".into()), Some("pre-1128".into()), Some(String::new()), Some(String::new()), Some("pre-1128".into())
        ));
        assert_eq!(h.compat_at("cases-2", 10), None);
    }

    /// Two toxics on one link are two windows, each closed by its own end (a checker reads
    /// the label: a timeout's window must not stay open on a latency's end), and a crash's
    /// window is closed by its restart.
    #[test]
    fn each_window_is_closed_by_its_own_end() {
        let mut h = History::default();
        let fault = |h: &mut History, t, kind: &str, target: &str, phase| h.push(t, Event::Fault { kind: kind.into(), target: target.into(), phase });
        fault(&mut h, 10, "toxic", "cases-1->database (latency 100ms downstream)", Phase::Start);
        fault(&mut h, 20, "toxic", "cases-1->database (timeout upstream)", Phase::Start);
        fault(&mut h, 30, "toxic", "cases-1->database (timeout upstream)", Phase::End);
        fault(&mut h, 40, "crash", "rules-1 at inbox::after_handler_before_stamp", Phase::Start);
        fault(&mut h, 50, "toxic", "cases-1->database (latency 100ms downstream)", Phase::End);
        fault(&mut h, 60, "crash", "rules-1 restarted", Phase::End);
        let tag = "fault:toxic cases-1->database".to_owned();
        assert_eq!(h.fault_spans(), vec![
            (tag.clone(), "cases-1->database (latency 100ms downstream)".into(), 10, 50),
            (tag, "cases-1->database (timeout upstream)".into(), 20, 30),
            ("fault:crash rules-1".into(), "rules-1 at inbox::after_handler_before_stamp".into(), 40, 60),
        ]);
    }

    #[test]
    fn jsonl_round_trip_is_flat_and_typed() {
        let mut h = History::default();
        h.push(0, Event::Seed { seed: 7, scenario: "s".into() });
        h.push(5, Event::Write { referral: Uuid::nil(), replica: "cases-1".into(), outcome: Outcome::Unknown, status: None, answered_ms: None });
        let text = h.to_jsonl();
        assert!(text.lines().nth(1).unwrap().starts_with(r#"{"t_ms":5,"type":"write","#), "{text}");
        assert_eq!(History::from_jsonl(&text).unwrap(), h);
        assert_eq!(History::from_jsonl("{}\n").unwrap_err().0, 1);
    }

    #[test]
    fn fault_before_names_the_latest_preceding_fault() {
        let mut h = History::default();
        h.push(10, Event::Fault { kind: "kill".into(), target: "broker".into(), phase: Phase::Start });
        h.push(20, Event::Crash { replica: "rules-1".into(), consumer: true, how: "SIGABRT".into() });
        assert_eq!(h.fault_before(5), None);
        assert_eq!(h.fault_before(15).as_deref(), Some("kill broker @10ms"));
        assert_eq!(h.fault_before(25).as_deref(), Some("crash rules-1 (SIGABRT) @20ms"));
    }
}
