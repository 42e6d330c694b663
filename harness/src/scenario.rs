//! Scenario files: one TOML file per scenario under `scenarios/`. Unknown keys and bad
//! values are rejected with the file, the line and the reason ([`ScenarioError`]).
//!
//! ```toml
//! name = "crash-claim-stamp"
//! amendment = "#1128"
//! description = "A cases replica aborts after the broker ACKed and before the stamp."
//!
//! [fleet]
//! cases = { replicas = 1 }
//! rules = { replicas = 1, compat = ["pre-d2"], start_after_ms = 3000 }  # starts late
//! # a mixed fleet: one table per replica ({} = current behaviour)
//! # cases = { replicas = [ { compat = ["pre-1128"] }, {} ] }
//!
//! [deploy]                  # optional; what exists before any replica starts
//! topology = true           # run `craig-node topology` first (the deploy step, docs/operations.md);
//!                           # without it each node declares only its own queue at start
//!
//! [settings]                # optional; worker knobs passed to every replica
//! claim_lease_secs = 4      # must be >= 2 x confirm_timeout_ms + connect_timeout_ms
//! inbox_retry_cap = 10      # also poll_ms, confirm_timeout_ms, heartbeat_secs,
//!                           # connect_timeout_ms, backoff_base_ms, backoff_max_ms,
//!                           # retention_interval_secs (the prune's cadence, #965),
//!                           # send_timeout_secs / send_lease_secs (#1185 send queue),
//!                           # idempotency_claim_secs (§D5 claim, 1..=30),
//!                           # outbox_notify = true (the LISTEN/NOTIFY wake-up),
//!                           # consumer_concurrency (1..=32, default 32: the prefetch),
//!                           # dlq_park_ms / dlq_max_parks (security's DLQ park, 2000, and
//!                           # the parks a refused delivery may cause before capture, 30),
//!                           # dlq_redrive_secs (security's capture redrive; 0 = off, the
//!                           # default here, so a capture stays visible),
//!                           # queue_type = "classic" | "quorum" (CRAIG_QUEUE_TYPE, issue 25:
//!                           # every consumer queue, the DLQ and the capture queue)
//!
//! [workload]
//! kind = "referrals"        # referrals (POST /v1/cases/referrals, counted in rules'
//!                           # rule_evaluations) | placements (POST /v1/cases/placements/
//!                           # {id}/activate, counted in financial's payments, #1179)
//!                           # | exports (POST /v1/cases/exports?size=N, §D5: checked by
//!                           # sentinel_integrity; export_sizes = [..], race = true,
//!                           # cancel_share = 0.2, requery_share = 0.2; the after_heal
//!                           # requests retry the first ones' keys)
//! writes = 200              # HTTP writes through the cases replicas
//! rate = 100                # per second
//! rollback_share = 0.1      # extra writes the harness stages and rolls back
//! poison_rows = 1           # malformed cases outbox rows, older than everything, written
//!                           # by hand before the workload: they must stay pending, refused
//! dead_letters = 30         # envelopes staged in cases' outbox that rules refuses for good
//!                           # (no referral_id): each is dead-lettered to craig.dlx (§D3)
//! app_dead_letters = 5      # … whose evaluation fails transiently until rules' retry cap
//!                           # surfaces them on the app path (#1196)
//! placement_dead_letters = 15  # placement.activated envelopes (no placement_id) that
//!                           # financial refuses for good: a second event type
//! send_jobs = 30            # transmissions staged in financial's send queue, already
//! send_overdue_ms = 300000  # this far past next_attempt_at (a backlog, #1185)
//! backdated = 10            # referrals written 30 d 1 h ago, events still pending
//! replay = true             # admin replays just inside and just past the outbox window
//! after_heal = 20           # writes made once every fault has healed (default 20)
//!
//! [partner]                 # the partner server financial POSTs to (#1185); optional
//! delay_ms = 1500           # each accepted POST answers this late
//! fail_share = 0.1          # new transmissions answered 500
//! hang_share = 0.0          # new transmissions accepted and never answered
//!
//! [[faults]]
//! kind = "crash"            # crash | kill | pause | partition | toxic | down | queue_limit | upgrade
//!                           # | downgrade | mutant | refuse_staging | failover
//!                           # | replication_lag (target "standby->database", lag_ms = N)
//!                           # | terminate (target "database": pg_terminate_backend on every
//!                           # backend named application_name, default craig-outbox-listener,
//!                           # every 250 ms for duration_ms)
//! target = "cases-1"        # a replica, "broker", "database", or a link "cases-1->broker"
//! failpoint = "outbox::after_publish_before_stamp"
//! at = { failpoint_hit = 3 }  # or { after_ms = N }, { after_writes = N }, { after_published = N }
//!                           # delay_ms = N (not on a crash or mutant): an event trigger's
//!                           # fault fires N ms after its event
//! restart_after_ms = 500
//!
//! [[faults]]                # a reject-publish length limit (a policy) on a consumer queue:
//! kind = "queue_limit"      # the broker Nacks publishes routed to it while it is full
//! target = "broker"
//! queue = "craig-rules.events"
//! max_length = 20
//! at = { after_ms = 1000 }
//! duration_ms = 8000
//!
//! [[faults]]                # one step of a rolling upgrade: SIGTERM (the node drains),
//! kind = "upgrade"          # then start again on `compat` (default: current behaviour);
//! target = "cases-1"        # "downgrade" names the older modes
//! at = { after_writes = 100 }
//!
//! [[faults]]                # staging itself fails: a trigger on the service's event_outbox
//! kind = "refuse_staging"   # refuses every N-th insert (SQLSTATE 40001) while it lasts
//! target = "database"
//! service = "cases"
//! every = 3
//! at = { after_ms = 500 }
//! duration_ms = 4000
//!
//! [[faults]]                # a test-only mutant (craig_mq::crash::MUTANTS) armed on a
//! kind = "mutant"           # replica from its start: the bug a twin must go red for
//! target = "cases-1"
//! failpoint = "cases::stage_after_commit"
//! at = { after_ms = 0 }
//!
//! [expect]
//! min_acknowledged = 150    # floors (default: half the writes; 0 redeliveries, 0 dead
//! min_redeliveries = 1      # letters, 0 crossings): a run below one is inconclusive
//! min_crossings = 2         # threshold events staged (#1156)
//! min_dlq_duplicates = 1    # arrivals of a dead letter already in the audit (#1181)
//! min_lease_resends = 1     # transmissions re-sent after their claim ended (#1185)
//! min_replays = 1           # §D5 replays served (Idempotent-Replayed)
//! min_sentinels = 1         # §D5 too-large sentinels: stored on over-cap, replayed
//! min_payments_absorbed = 1 # replays the #1179 arbiter absorbed (financial's own log)
//! no_loss = "hold"          # hold | violate (bare only where no cause is attributed:
//!                           # liveness, no_phantom)
//! effect_once = { violate = "compat:pre-d2" }  # violated, and every witness points at
//!                                              # that cause (or "replica:<name>", or
//!                                              # "kind:<what>" of a dead-letter violation:
//!                                              # lost, doubled, unexplained, re_emitted, …)
//! ```

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde::Deserialize;
use toml::Spanned;

use crate::proxy::{Stream, ToxicKind};

#[derive(Debug, thiserror::Error)]
#[error("{file}:{line}: {reason}")]
pub struct ScenarioError {
    pub file: String,
    pub line: usize,
    pub reason: String,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Scenario {
    pub name: String,
    pub amendment: String,
    #[serde(default)]
    pub description: String,
    /// Fixed seed for this scenario (else derived from the run's seed and the name).
    #[serde(default)]
    pub seed: Option<u64>,
    pub fleet: BTreeMap<String, Spanned<FleetEntry>>,
    #[serde(default)]
    pub deploy: Deploy,
    #[serde(default)]
    pub settings: Settings,
    pub workload: Workload,
    /// The partner HTTP server financial's send queue POSTs to (#1185): run by the harness
    /// when present, and given to every financial replica as `CRAIG_PARTNER_URL`.
    #[serde(default)]
    pub partner: Option<PartnerSpec>,
    #[serde(default)]
    pub faults: Vec<Spanned<Fault>>,
    /// `[expect]` as written: invariants and `min_*` floors (split by [`parse`]).
    #[serde(rename = "expect")]
    expect_raw: BTreeMap<String, Spanned<toml::Value>>,
    /// What each invariant is expected to do.
    #[serde(skip)]
    pub expect: BTreeMap<String, Spanned<Expectation>>,
    /// The least activity a run must show to prove anything (`min_*` keys of `[expect]`).
    #[serde(skip)]
    pub floor: Floor,
    /// How long everything may take to drain after the faults heal.
    #[serde(default = "default_bound")]
    pub liveness_bound_ms: u64,
    #[serde(skip)]
    pub path: PathBuf,
    /// The broker's nodes (`[fleet] broker = { nodes = N }`, 1..=5; default 1). A cluster
    /// runs on the local backend; every replica gets a link to each node (`<replica>->broker`
    /// for node 1, `<replica>->broker-N` for the others) and the list of them (`AMQP_URL`),
    /// replica i's starting at node ((i - 1) mod N) + 1.
    #[serde(skip)]
    pub broker_nodes: u8,
    /// The database's streaming standby (`[fleet] database = { standby = true, sync = true }`,
    /// issue 26; local and containers backends): None without one. Its replication connection is the fault
    /// proxy's link `standby->database`, a target for `toxic`, `down` and `replication_lag`; `failover` kills the
    /// primary and promotes it.
    #[serde(skip)]
    pub standby: Option<StandbySpec>,
}

/// A standby of the database server (issue 26).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StandbySpec {
    /// Synchronous (`synchronous_commit = remote_apply`, the standby named in
    /// `synchronous_standby_names`): a commit returns once the standby applied it.
    /// Asynchronous: a commit returns at once, and a failover forgets what the standby
    /// had not applied yet.
    pub sync: bool,
}

/// The standby's replication link, a fault target (issue 26).
pub const REPLICATION_LINK: &str = "standby->database";

fn default_bound() -> u64 {
    60_000
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FleetEntry {
    /// A count (`replicas = 2`, every replica on the service's `compat`), or one table per
    /// replica (`replicas = [ { compat = ["pre-1128"] }, {} ]`): a mixed fleet, where
    /// `{}` is a replica on current behaviour.
    #[serde(default)]
    pub replicas: Replicas,
    /// Compat modes of every replica of the service (with a count only).
    #[serde(default)]
    pub compat: Vec<String>,
    /// Start this service's replicas this long after the workload begins (a late consumer).
    #[serde(default)]
    pub start_after_ms: Option<u64>,
    /// `[fleet] broker = { nodes = 3 }` only (issue 25): the broker's node count, taken out of
    /// the fleet by [`parse`] into [`Scenario::broker_nodes`].
    #[serde(default)]
    pub nodes: Option<u8>,
    /// `[fleet] database = { standby = true, sync = true|false }` only (issue 26), taken out
    /// of the fleet by [`parse`] into [`Scenario::standby`].
    #[serde(default)]
    pub standby: Option<bool>,
    #[serde(default)]
    pub sync: Option<bool>,
}

#[derive(Debug, Clone)]
pub enum Replicas {
    Count(u32),
    Each(Vec<ReplicaEntry>),
}

/// `replicas = 2` or `replicas = [ { compat = [...] }, {} ]`, refused in those words (an
/// untagged enum would answer "data did not match any variant").
impl<'de> Deserialize<'de> for Replicas {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> serde::de::Visitor<'de> for V {
            type Value = Replicas;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("a replica count (replicas = 2) or one table per replica (replicas = [ { compat = [\"pre-1128\"] }, {} ])")
            }
            fn visit_i64<E: serde::de::Error>(self, n: i64) -> Result<Replicas, E> {
                u32::try_from(n).map(Replicas::Count).map_err(|_| E::invalid_value(serde::de::Unexpected::Signed(n), &self))
            }
            fn visit_u64<E: serde::de::Error>(self, n: u64) -> Result<Replicas, E> {
                u32::try_from(n).map(Replicas::Count).map_err(|_| E::invalid_value(serde::de::Unexpected::Unsigned(n), &self))
            }
            fn visit_seq<A: serde::de::SeqAccess<'de>>(self, mut seq: A) -> Result<Replicas, A::Error> {
                let mut each = Vec::new();
                while let Some(r) = seq.next_element::<ReplicaEntry>()? {
                    each.push(r);
                }
                Ok(Replicas::Each(each))
            }
        }
        d.deserialize_any(V)
    }
}

impl Default for Replicas {
    fn default() -> Self {
        Replicas::Count(1)
    }
}

/// One replica of a mixed fleet.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ReplicaEntry {
    #[serde(default)]
    pub compat: Vec<String>,
}

impl FleetEntry {
    /// How many replicas the service runs.
    pub fn count(&self) -> u32 {
        match &self.replicas {
            Replicas::Count(n) => *n,
            Replicas::Each(list) => list.len() as u32,
        }
    }

    /// The compat modes replica `index` (1-based) starts with.
    pub fn compat_of(&self, index: u32) -> Vec<String> {
        match &self.replicas {
            Replicas::Count(_) => self.compat.clone(),
            Replicas::Each(list) => list.get(index as usize - 1).map(|r| r.compat.clone()).unwrap_or_default(),
        }
    }
}

/// What a deployment has before any replica starts. The default is the least: nothing but
/// what each node declares for itself.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Deploy {
    /// Run `craig-node topology` first (every exchange, consumer queue, binding, the DLQ).
    #[serde(default)]
    pub topology: bool,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Settings {
    #[serde(default = "lease")]
    pub claim_lease_secs: u64,
    #[serde(default = "poll")]
    pub poll_ms: u64,
    #[serde(default = "confirm")]
    pub confirm_timeout_ms: u64,
    #[serde(default = "heartbeat")]
    pub heartbeat_secs: u64,
    #[serde(default = "connect")]
    pub connect_timeout_ms: u64,
    /// Outbox backoff (worker-wide for broker failures, per row for refusals). Short by
    /// default so scenarios heal fast; a scenario about backoff sets production's 1000/60000.
    #[serde(default = "backoff_base")]
    pub backoff_base_ms: u64,
    #[serde(default = "backoff_max")]
    pub backoff_max_ms: u64,
    /// Rules' inbox retry cap (`CRAIG_INBOX_RETRY_CAP`, §D3 #1196): transient failures of
    /// one envelope before it is surfaced on the app path.
    #[serde(default = "retry_cap")]
    pub inbox_retry_cap: u32,
    /// The retention prune's cadence (`CRAIG_RETENTION_INTERVAL_SECS`, #965/#1129); the
    /// production hour by default, so a scenario prunes only when it asks to.
    #[serde(default = "retention_interval")]
    pub retention_interval_secs: u64,
    /// financial's send queue (#1185): the per-send transport cap and the claim lease
    /// (`CRAIG_SEND_TIMEOUT_SECS`, `CRAIG_SEND_CLAIM_LEASE_SECS`; production's 30 / 90 by
    /// default). A scenario shortens both, lease >= 3 x cap, to see a lease expire.
    #[serde(default = "send_timeout")]
    pub send_timeout_secs: u64,
    #[serde(default = "send_lease")]
    pub send_lease_secs: u64,
    /// The §D5 claim's life (`CRAIG_IDEMPOTENCY_CLAIM_SECS`, 1..=30; production 30).
    #[serde(default = "idempotency_claim")]
    pub idempotency_claim_secs: u64,
    /// The LISTEN/NOTIFY wake-up (`CRAIG_OUTBOX_NOTIFY`; default off, as in production).
    #[serde(default)]
    pub outbox_notify: bool,
    /// Deliveries a consumer handles at once (`CRAIG_CONSUMER_CONCURRENCY`, 1..=32; default
    /// the prefetch, 32).
    #[serde(default = "consumer_concurrency")]
    pub consumer_concurrency: u16,
    /// Security's DLQ park (`CRAIG_DLQ_PARK_MS`, 200..=600000; production 2000) and the parks
    /// a delivery the database keeps refusing may cause before it is captured
    /// (`CRAIG_DLQ_MAX_PARKS`, 1..=10000; production 30; #1197, issue 21.1).
    #[serde(default = "dlq_park")]
    pub dlq_park_ms: u64,
    #[serde(default = "dlq_max_parks")]
    pub dlq_max_parks: u32,
    /// Security's own capture redrive (`CRAIG_DLQ_REDRIVE_SECS`; production 60). Off (0) by
    /// default here, so a dead letter that was captured stays visible to
    /// `dlq_occurrence_once` (kind:captured) instead of being healed behind the run's back.
    #[serde(default)]
    pub dlq_redrive_secs: u64,
    /// The type of every queue the deploy and the nodes declare (`CRAIG_QUEUE_TYPE`, issue
    /// 25): `classic` (default, the ADR's topology) or `quorum`.
    #[serde(default, deserialize_with = "queue_type")]
    pub queue_type: craig_mq::topology::QueueType,
}

fn queue_type<'de, D: serde::Deserializer<'de>>(d: D) -> Result<craig_mq::topology::QueueType, D::Error> {
    let s = String::deserialize(d)?;
    s.parse().map_err(serde::de::Error::custom)
}

fn dlq_park() -> u64 {
    craig_mq::dlq::DlqRetryConfig::default().park_delay().as_millis() as u64
}

fn dlq_max_parks() -> u32 {
    craig_mq::dlq::DEFAULT_MAX_PARKS
}

fn consumer_concurrency() -> u16 {
    craig_mq::settings::CONSUMER_PREFETCH
}

fn idempotency_claim() -> u64 {
    craig_api::idempotency::CLAIM_TTL.as_secs()
}

fn send_timeout() -> u64 {
    craig_fleet::send_jobs::SEND_TIMEOUT_SECS
}

fn send_lease() -> u64 {
    craig_fleet::send_jobs::CLAIM_LEASE_SECS
}

fn retry_cap() -> u32 {
    10
}

fn retention_interval() -> u64 {
    3600
}

fn backoff_base() -> u64 {
    100
}
fn backoff_max() -> u64 {
    1000
}

fn lease() -> u64 {
    4
}
fn connect() -> u64 {
    1000
}
fn poll() -> u64 {
    100
}
fn confirm() -> u64 {
    1500
}
fn heartbeat() -> u64 {
    2
}

impl Default for Settings {
    fn default() -> Self {
        Self {
            claim_lease_secs: lease(),
            poll_ms: poll(),
            confirm_timeout_ms: confirm(),
            heartbeat_secs: heartbeat(),
            connect_timeout_ms: connect(),
            inbox_retry_cap: retry_cap(),
            backoff_base_ms: backoff_base(),
            backoff_max_ms: backoff_max(),
            retention_interval_secs: retention_interval(),
            send_timeout_secs: send_timeout(),
            send_lease_secs: send_lease(),
            idempotency_claim_secs: idempotency_claim(),
            outbox_notify: false,
            consumer_concurrency: consumer_concurrency(),
            dlq_park_ms: dlq_park(),
            dlq_max_parks: dlq_max_parks(),
            dlq_redrive_secs: 0,
            queue_type: Default::default(),
        }
    }
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Workload {
    /// What each write is (default: referrals).
    #[serde(default)]
    pub kind: WorkloadKind,
    pub writes: u32,
    pub rate: f64,
    #[serde(default)]
    pub rollback_share: f64,
    /// Malformed outbox rows written by hand into cases' outbox before the workload.
    #[serde(default)]
    pub poison_rows: u32,
    /// Envelopes staged in cases' outbox (through the outbox, as cases would) that the rules
    /// handler refuses permanently: each is nacked and dead-lettered (§D3 broker path).
    #[serde(default)]
    pub dead_letters: u32,
    /// Referral envelopes staged in cases' outbox whose evaluation the harness makes fail
    /// TRANSIENTLY in rules' database (a trigger on `rule_evaluations`): rules retries each
    /// up to its inbox retry cap, then surfaces it on the app path (§D3, #1196).
    #[serde(default)]
    pub app_dead_letters: u32,
    /// `placement.activated` envelopes staged in cases' outbox without the `placement_id`
    /// the financial handler needs: financial refuses each permanently and the broker
    /// dead-letters it under `dlq.craig-financial.events` (a second event type, §D3).
    #[serde(default)]
    pub placement_dead_letters: u32,
    /// Transmissions (transaction + send job) staged in financial's database before any
    /// replica starts, already `send_overdue_ms` past their `next_attempt_at`: a backlog for
    /// the send queue (#1185).
    #[serde(default)]
    pub send_jobs: u32,
    #[serde(default = "send_overdue_ms")]
    pub send_overdue_ms: u64,
    /// Referrals written "long ago" straight into cases' database before any replica starts:
    /// created 30 days and an hour in the past, their events still pending (backing off,
    /// due 3 s into the run) — past the outbox window, so only a prune that touches pending
    /// rows (compat `pre-965`) can delete them. Recorded as acknowledged writes.
    #[serde(default)]
    pub backdated: u32,
    /// At the end (after the after-heal writes): one admin replay of a window just inside
    /// the outbox retention (accepted: everything re-published, absorbed by inbox dedup) and
    /// one reaching just past it (must be refused), through a cases replica (§D4, #965).
    #[serde(default)]
    pub replay: bool,
    /// Writes made once every fault has healed (and every crashed replica is back), at
    /// `rate`: the run must show the system working again, not only surviving. At least 1
    /// when the scenario has faults.
    #[serde(default = "after_heal")]
    pub after_heal: u32,
    /// `kind = "exports"`: the response sizes, taken in turn (default 1000 bytes).
    #[serde(default = "export_sizes")]
    pub export_sizes: Vec<u64>,
    /// `kind = "exports"`: each first attempt goes to two cases replicas at once.
    #[serde(default)]
    pub race: bool,
    /// `kind = "exports"`: share of first attempts whose client goes away after the first
    /// chunk of the body.
    #[serde(default)]
    pub cancel_share: f64,
    /// `kind = "exports"`: share of requests that reuse the previous key with another size
    /// (another query: another request under #1184).
    #[serde(default)]
    pub requery_share: f64,
}

fn export_sizes() -> Vec<u64> {
    vec![1000]
}

fn after_heal() -> u32 {
    20
}

fn send_overdue_ms() -> u64 {
    300_000
}

/// `[partner]`: how the harness's partner server behaves.
#[derive(Debug, Clone, Copy, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PartnerSpec {
    /// How long each accepted POST takes to answer.
    #[serde(default)]
    pub delay_ms: u64,
    /// Share of new transmissions answered 500 (the sender retries).
    #[serde(default)]
    pub fail_share: f64,
    /// Share of new transmissions accepted and then never answered.
    #[serde(default)]
    pub hang_share: f64,
}

/// The writes a workload makes through the cases replicas, and where their effect lands.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum WorkloadKind {
    /// `POST /v1/cases/referrals` (201) → `case.referral_created` → one `rule_evaluations`
    /// row on rules (behind the inbox alone).
    #[default]
    Referrals,
    /// `POST /v1/cases/placements/{id}/activate` (200) → `placement.activated` → one
    /// `payments` row on financial (the #1179 arbiter).
    Placements,
    /// The HTTP workload (§D5): `POST /v1/cases/exports?size=N` with an `Idempotency-Key`,
    /// one `exports` row per execution; raced across replicas, cancelled mid-download,
    /// re-queried, and retried after the faults (`sentinel_integrity`).
    Exports,
}

impl WorkloadKind {
    /// The service whose side effect counts each write.
    pub fn consumer(self) -> &'static str {
        match self {
            WorkloadKind::Referrals => "rules",
            WorkloadKind::Placements => "financial",
            WorkloadKind::Exports => "cases",
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum FaultKind {
    /// A crash point aborts the replica (feature `failpoints`); restarted after `restart_after_ms`.
    Crash,
    /// SIGKILL a replica, the broker or the database; restarted after `duration_ms`.
    Kill,
    /// SIGSTOP for `duration_ms`, then SIGCONT.
    Pause,
    /// The broker or the database cut off at the network for `duration_ms`: nothing
    /// refused, nothing arrives, what was sent waits for the heal (containers: `docker
    /// network disconnect`; local and external: every replica's link to it held in the
    /// fault proxy). Issue 24.
    Partition,
    /// A Toxiproxy toxic on a link for `duration_ms`.
    Toxic,
    /// A link disabled ("down") for `duration_ms`.
    Down,
    /// A `reject-publish` length limit on `queue` (a broker policy) for `duration_ms`.
    #[serde(rename = "queue_limit")]
    QueueLimit,
    /// Stop a replica gracefully (SIGTERM, its drain) and start it again on `compat`
    /// (default: current behaviour): one step of a rolling upgrade. One replica at a time:
    /// an upgrade due while another is still restarting waits for it.
    Upgrade,
    /// Like `upgrade`, onto an older behaviour: `compat` names at least one mode.
    Downgrade,
    /// `pg_terminate_backend` on every backend of the database server whose
    /// `application_name` is `application_name` (default `craig-outbox-listener`, the
    /// LISTEN/NOTIFY connection), swept every 250 ms for `duration_ms`: the server itself
    /// cuts exactly those connections, again each time they come back.
    Terminate,
    /// A test-only mutant (`craig_mq::crash::MUTANTS`, named by `failpoint`) armed on a
    /// replica from its start: the one-line bug a checker must go red for (issue 22).
    Mutant,
    /// Staging itself fails (issue 22.2): a trigger on `service`'s `event_outbox` refuses
    /// every `every`-th insert (a serialization failure, so the writer's transaction rolls
    /// back) for `duration_ms`. Targets `database`.
    #[serde(rename = "refuse_staging")]
    RefuseStaging,
    /// Issue 26: the database primary SIGKILLed, its standby promoted and the database
    /// address moved to it (`[fleet] database = { standby = true, ... }`). Once; targets
    /// `database`; nothing heals (the old primary stays gone).
    Failover,
    /// Issue 26: the standby's replication link (`standby->database`) delays what the
    /// primary sends by `lag_ms` for `duration_ms`, so that a failover can land while the
    /// standby is behind.
    #[serde(rename = "replication_lag")]
    ReplicationLag,
}

impl FaultKind {
    /// The word scenario files and reports use.
    pub fn name(self) -> &'static str {
        match self {
            FaultKind::Crash => "crash",
            FaultKind::Kill => "kill",
            FaultKind::Pause => "pause",
            FaultKind::Partition => "partition",
            FaultKind::Toxic => "toxic",
            FaultKind::Down => "down",
            FaultKind::QueueLimit => "queue_limit",
            FaultKind::Upgrade => "upgrade",
            FaultKind::Downgrade => "downgrade",
            FaultKind::Terminate => "terminate",
            FaultKind::Mutant => "mutant",
            FaultKind::RefuseStaging => "refuse_staging",
            FaultKind::Failover => "failover",
            FaultKind::ReplicationLag => "replication_lag",
        }
    }
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Fault {
    pub kind: FaultKind,
    pub target: String,
    #[serde(default)]
    pub failpoint: Option<String>,
    pub at: Trigger,
    /// With an event trigger (`after_writes`, `after_published`, `failpoint_hit` on an
    /// upgrade): the fault fires this long after its event, so that two faults keep their
    /// distance on a slow machine as on a fast one (`after_ms` counts from the run's start).
    #[serde(default)]
    pub delay_ms: Option<u64>,
    #[serde(default)]
    pub duration_ms: Option<u64>,
    #[serde(default)]
    pub restart_after_ms: Option<u64>,
    /// For `kind = "toxic"`: `{ type = "latency", stream = "downstream", attributes = {...} }`.
    #[serde(default)]
    pub toxic: Option<ToxicSpec>,
    /// For `kind = "queue_limit"`: the consumer queue and its length limit.
    #[serde(default)]
    pub queue: Option<String>,
    #[serde(default)]
    pub max_length: Option<u32>,
    /// For `kind = "upgrade"` / `"downgrade"`: the compat modes the replica restarts with.
    #[serde(default)]
    pub compat: Option<Vec<String>>,
    /// For `kind = "terminate"`: whose backends (default `craig-outbox-listener`).
    #[serde(default)]
    pub application_name: Option<String>,
    /// For `kind = "refuse_staging"`: whose outbox, and which share of its inserts (every
    /// N-th) is refused.
    #[serde(default)]
    pub service: Option<String>,
    #[serde(default)]
    pub every: Option<u32>,
    /// For `kind = "refuse_staging"`: the table whose inserts are refused, the service's
    /// `event_outbox` (default: staging fails) or cases' `referrals` or `placements` (the
    /// domain write fails after anything staged outside its transaction was committed: a
    /// phantom's window).
    #[serde(default)]
    pub table: Option<String>,
    /// For `kind = "kill"` of a node of a broker cluster (`broker-N`, issue 25): the node's
    /// data directory is removed while it is down (disk loss); at the heal it starts empty
    /// and is joined to the cluster again, as an operator replaces a node
    /// (`forget_cluster_node`, then `join_cluster`, then the deploy step's
    /// `craig-node topology` again).
    #[serde(default)]
    pub wipe: bool,
    /// For `kind = "replication_lag"`: how long the replication link delays what the primary
    /// sends, in ms.
    #[serde(default)]
    pub lag_ms: Option<u64>,
}

/// The tables a `refuse_staging` fault may refuse inserts into, per service.
pub fn refusable_tables(service: &str) -> &'static [&'static str] {
    match service {
        "cases" => &["event_outbox", "referrals", "placements"],
        _ => &["event_outbox"],
    }
}

impl Fault {
    /// The table a `refuse_staging` fault refuses inserts into.
    pub fn refused_table(&self) -> &str {
        self.table.as_deref().unwrap_or("event_outbox")
    }
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ToxicSpec {
    #[serde(default)]
    pub stream: Stream,
    #[serde(default = "full")]
    pub toxicity: f32,
    #[serde(flatten)]
    pub kind: ToxicKind,
}

fn full() -> f32 {
    1.0
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "snake_case")]
pub enum Trigger {
    AfterMs(u64),
    AfterWrites(u32),
    FailpointHit(u32),
    /// Once the target replica (or the link's replica) has stamped N outbox rows published: its
    /// publisher is live (a fault meant for a connected publisher never races its start). A
    /// fault on a server (or the standby's replication link): once the fleet has, together.
    AfterPublished(u32),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Expect {
    Hold,
    Violate,
}

/// What one invariant is expected to do: `"hold"`, `"violate"`, or
/// `{ violate = "compat:pre-1128" }` / `{ violate = ["compat:pre-1128", "fault:toxic cases-1->broker"] }`:
/// violated, and every violation must point at every cause named — a compat mode the
/// harming replica ran at the time (`compat:<mode>`), a replica (`replica:<name>`), or a
/// fault of the scenario in force then (`fault:<kind> <target>`). A twin is red for its
/// documented reason, not for any reason.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Expectation {
    pub expect: Expect,
    pub cause: Vec<String>,
}

impl TryFrom<toml::Value> for Expectation {
    type Error = String;
    fn try_from(v: toml::Value) -> Result<Self, String> {
        const SHAPE: &str =
            "expected \"hold\", \"violate\" or { violate = \"<cause>\" | [\"<cause>\", ...] } with causes compat:<mode>, replica:<name>, fault:<kind> <target>, kind:<violation kind>, queue:<classic|quorum>, lost_at:<broker|consumer>, replication:async";
        let cause_ok = |c: &str| {
            c.strip_prefix("compat:").is_some_and(|m| m.parse::<craig_fleet::Compat>().is_ok())
                || c.strip_prefix("replica:").is_some_and(|r| !r.is_empty())
                || c.strip_prefix("fault:").is_some_and(|f| f.split_once(' ').is_some_and(|(k, t)| !k.is_empty() && !t.is_empty()))
                || c.strip_prefix("kind:").is_some_and(|k| crate::checkers::VIOLATION_KINDS.contains(&k))
                || c.strip_prefix("queue:").is_some_and(|q| q.parse::<craig_mq::topology::QueueType>().is_ok())
                // A synchronous failover excuses nothing (issue 26): replication:sync is never blamed.
                || matches!(c, "lost_at:broker" | "lost_at:consumer" | "replication:async")
        };
        match v {
            toml::Value::String(w) => match w.as_str() {
                "hold" => Ok(Self { expect: Expect::Hold, cause: vec![] }),
                "violate" => Ok(Self { expect: Expect::Violate, cause: vec![] }),
                other => Err(format!("unknown expectation {other:?}; {SHAPE}")),
            },
            toml::Value::Table(t) => {
                let causes: Vec<String> = match (t.len(), t.get("violate")) {
                    (1, Some(toml::Value::String(c))) => vec![c.clone()],
                    (1, Some(toml::Value::Array(a))) if !a.is_empty() => {
                        a.iter().map(|c| c.as_str().map(str::to_owned).ok_or_else(|| SHAPE.to_owned())).collect::<Result<_, _>>()?
                    }
                    _ => return Err(SHAPE.into()),
                };
                match causes.iter().find(|c| !cause_ok(c)) {
                    Some(bad) => Err(format!("unknown cause {bad:?}; {SHAPE}")),
                    None => Ok(Self { expect: Expect::Violate, cause: causes }),
                }
            }
            _ => Err(SHAPE.into()),
        }
    }
}

/// Minimum activity (`[expect]` keys `min_acknowledged`, `min_redeliveries`,
/// `min_dead_letters`, `min_crossings`): a run below any of them is inconclusive — it exercised too little
/// to be trusted, whatever its verdicts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Floor {
    /// Writes the service acknowledged (HTTP 201). Default: half the planned writes.
    pub acknowledged: u64,
    /// Deliveries of an envelope an inbox already held processed, as the harness's trigger
    /// counted them in the databases (issue 22.1; never a node's counter).
    pub redeliveries: u64,
    /// Messages dead-lettered to the DLQ by the end of the run.
    pub dead_letters: u64,
    /// `security.dlq.threshold_exceeded` events staged (#1156): a scenario that shows one
    /// crossing per type must show them, not only agree that none was due.
    pub crossings: u64,
    /// Arrivals of a dead letter the audit already recorded with the same facts (what the
    /// #1181 arbiter absorbs), as the harness's trigger counted them in security's
    /// database: proof that a DLQ ack failed.
    pub dlq_duplicates: u64,
    /// Transmissions re-sent after their first claim ended (the lease expired, the sender's
    /// cap ran out): proof the send queue's recovery ran (#1185).
    pub lease_resends: u64,
    /// §D5 replays the exports clients received (`Idempotent-Replayed: true`).
    pub replays: u64,
    /// §D5 too-large sentinels replayed (`Idempotency-Body-Too-Large: true`).
    pub sentinels: u64,
    /// Payment replays the #1179 arbiter absorbed (`financial.payment_replay_absorbed` in
    /// the financial replicas' logs): proof the absorb path ran (issue 22.1).
    pub payments_absorbed: u64,
}

const FLOORS: &[&str] =
    &["min_acknowledged", "min_redeliveries", "min_dead_letters", "min_crossings", "min_dlq_duplicates", "min_lease_resends", "min_replays", "min_sentinels", "min_payments_absorbed"];

impl Default for Floor {
    fn default() -> Self {
        Self { acknowledged: 1, redeliveries: 0, dead_letters: 0, crossings: 0, dlq_duplicates: 0, lease_resends: 0, replays: 0, sentinels: 0, payments_absorbed: 0 }
    }
}

/// Invariants this build can check: every one CONTRACT names.
pub const CHECKABLE: &[&str] = crate::checkers::INVARIANTS;
const CONTRACT_INVARIANTS: &[&str] = &[
    "no_loss",
    "no_phantom",
    "effect_once",
    "sentinel_integrity",
    "fencing",
    "dlq_occurrence_once",
    "threshold_crossing_once",
    "retention_safety",
    "liveness",
];
const SERVICES: &[&str] = &["cases", "financial", "rules", "security"];

/// What a fault's target names.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FaultTarget {
    Replica(String),
    Broker,
    /// `broker-N`: node N of a broker cluster (`[fleet] broker = { nodes = N }`, issue 25).
    BrokerNode(u8),
    Database,
    /// `<replica>-><broker|database>`: the replica's own proxied connection.
    Link { replica: String, to: crate::backend::Target },
}

impl Scenario {
    pub fn replica_names(&self) -> Vec<String> {
        self.fleet
            .iter()
            .flat_map(|(svc, e)| (1..=e.get_ref().count()).map(move |i| format!("{svc}-{i}")))
            .collect()
    }

    pub fn parse_target(&self, t: &str) -> Option<FaultTarget> {
        let names = self.replica_names();
        // `broker-N` names a node of a cluster, 1..=N.
        let node = |t: &str| t.strip_prefix("broker-").and_then(|n| n.parse::<u8>().ok()).filter(|n| (1..=self.broker_nodes).contains(n) && self.broker_nodes > 1);
        match t {
            "broker" => Some(FaultTarget::Broker),
            "database" => Some(FaultTarget::Database),
            REPLICATION_LINK if self.standby.is_some() => Some(FaultTarget::Link { replica: "standby".into(), to: crate::backend::Target::Database }),
            _ if node(t).is_some() => node(t).map(FaultTarget::BrokerNode),
            _ => match t.split_once("->") {
                Some((r, to)) if names.iter().any(|n| n == r) => {
                    let to = match to {
                        "broker" => crate::backend::Target::Broker,
                        "database" => crate::backend::Target::Database,
                        // Node 1's link is `<replica>->broker`.
                        _ => match node(to) {
                            Some(1) => crate::backend::Target::Broker,
                            Some(n) => crate::backend::Target::BrokerNode(n),
                            None => return None,
                        },
                    };
                    Some(FaultTarget::Link { replica: r.to_owned(), to })
                }
                Some(_) => None,
                None => names.iter().any(|n| n == t).then(|| FaultTarget::Replica(t.to_owned())),
            },
        }
    }

    /// Compat modes named by the fleet or an upgrade/downgrade, for the report (`"-"` when
    /// none).
    pub fn compat_summary(&self) -> String {
        let mut modes: Vec<String> = self
            .fleet
            .values()
            .flat_map(|e| {
                let e = e.get_ref();
                (1..=e.count()).flat_map(|i| e.compat_of(i)).collect::<Vec<_>>()
            })
            .chain(self.faults.iter().flat_map(|f| f.get_ref().compat.clone().unwrap_or_default()))
            .collect();
        modes.sort();
        modes.dedup();
        if modes.is_empty() { "-".into() } else { modes.join(",") }
    }
}

fn line_of(text: &str, offset: usize) -> usize {
    text[..offset.min(text.len())].bytes().filter(|&b| b == b'\n').count() + 1
}

/// The section of `docs/scenarios.md` that documents what is written at `line`: the table
/// whose header last opened at or above it (`[fleet]`, `[[faults]]`, …), else the top-level
/// keys. Its anchor is the header's name, as the doc's headings are the tables' own.
fn doc_section(text: &str, line: usize) -> String {
    let header = text
        .lines()
        .take(line.max(1))
        .filter_map(|l| {
            let l = l.trim();
            let name = l.strip_prefix("[[").and_then(|r| r.split_once("]]")).or_else(|| l.strip_prefix('[').and_then(|r| r.split_once(']')));
            name.map(|(n, _)| n.trim().split('.').next().unwrap_or("").to_owned())
        })
        .last();
    match header.as_deref() {
        Some(h @ ("fleet" | "deploy" | "settings" | "workload" | "partner" | "expect")) => format!("docs/scenarios.md#{h}, [{h}]"),
        Some("faults") => "docs/scenarios.md#faults, [[faults]]".to_owned(),
        _ => "docs/scenarios.md#top-level-keys".to_owned(),
    }
}

/// serde's type names in a scenario author's words: a count is "a whole number >= 0", not
/// "u64"; the rest of the message (the value found, the field's name) is kept.
fn in_our_words(message: &str) -> String {
    let mut m = message.to_owned();
    for (serde, ours) in [
        ("expected u64", "expected a whole number >= 0"),
        ("expected u32", "expected a whole number >= 0"),
        ("expected u16", "expected a whole number >= 0"),
        ("expected f64", "expected a number"),
        ("expected a sequence", "expected a list, [ ... ]"),
        ("expected a boolean", "expected true or false"),
    ] {
        m = m.replace(serde, ours);
    }
    m
}

/// Whether `line` writes `key` (`key = …`) or opens table `key` (`[table]`): a word in a
/// description, or a longer key that starts with it (`attributes` for `at`), is not it.
fn writes_key(line: &str, key: &str) -> bool {
    line.trim_start().strip_prefix(key).is_some_and(|rest| key.starts_with('[') || rest.trim_start().starts_with('='))
}

/// Parse and validate one scenario file.
pub fn parse(path: &Path, text: &str) -> Result<Scenario, ScenarioError> {
    let file = path.display().to_string();
    let err = |span: Option<std::ops::Range<usize>>, reason: String| {
        let line = span.map(|s| line_of(text, s.start)).unwrap_or(1);
        ScenarioError { file: file.clone(), line, reason: format!("{reason} (see {})", doc_section(text, line)) }
    };
    let mut s: Scenario = toml::from_str(text).map_err(|e| err(e.span(), in_our_words(e.message())))?;
    s.path = path.to_path_buf();
    // The line a key (`key =`) or a table header (`[table]`) is written on, so a word in the
    // description is never taken for the key; else the needle's first mention.
    let at = |needle: &str| {
        let mut off = 0;
        for l in text.split_inclusive('\n') {
            if writes_key(l, needle) {
                let o = off + (l.len() - l.trim_start().len());
                return Some(o..o);
            }
            off += l.len();
        }
        text.find(needle).map(|o| o..o)
    };
    // The line of `key =` inside a table's span (falls back to the table's first line).
    let key_in = |span: std::ops::Range<usize>, key: &str| {
        // A table's span may cover only its header: read on to the next header.
        let body = &text[span.start.min(text.len())..];
        let found = body.lines().scan(0usize, |off, l| {
            let here = *off;
            *off += l.len() + 1;
            Some((here, l))
        });
        let hit = found
            .take_while(|(o, l)| *o == 0 || !l.trim_start().starts_with('['))
            .filter(|(_, l)| writes_key(l, key))
            .map(|(o, _)| span.start + o)
            .next();
        Some(hit.map(|o| o..o).unwrap_or(span))
    };
    if s.name.trim().is_empty() {
        return Err(err(at("name"), "name must not be empty".into()));
    }
    s.broker_nodes = 1;
    if let Some(broker) = s.fleet.remove("broker") {
        let b = broker.get_ref();
        if b.count() != 1 || !b.compat.is_empty() || b.start_after_ms.is_some() || matches!(b.replicas, Replicas::Each(_)) {
            return Err(err(Some(broker.span()), "broker takes only nodes (broker = { nodes = 3 })".into()));
        }
        match b.nodes {
            Some(n @ 1..=5) => s.broker_nodes = n,
            other => return Err(err(Some(broker.span()), format!("broker nodes must be 1..=5, not {}", other.map_or("missing".into(), |n| n.to_string())))),
        }
    }
    s.standby = None;
    if let Some(db) = s.fleet.remove("database") {
        let d = db.get_ref();
        if d.count() != 1 || !d.compat.is_empty() || d.start_after_ms.is_some() || matches!(d.replicas, Replicas::Each(_)) || d.nodes.is_some() {
            return Err(err(Some(db.span()), "database takes only standby and sync (database = { standby = true, sync = true })".into()));
        }
        match (d.standby, d.sync) {
            (Some(true), Some(sync)) => s.standby = Some(StandbySpec { sync }),
            (Some(true), None) => {
                return Err(err(Some(db.span()), "a standby is synchronous or not: say which (sync = true: a commit waits for the standby; sync = false: it does not)".into()))
            }
            (Some(false) | None, Some(_)) => return Err(err(Some(db.span()), "sync belongs to a standby (database = { standby = true, sync = ... })".into())),
            (Some(false) | None, None) => {}
        }
    }
    for (svc, entry) in &s.fleet {
        if entry.get_ref().standby.is_some() || entry.get_ref().sync.is_some() {
            return Err(err(Some(entry.span()), format!("{svc}: standby and sync are the database's (database = {{ standby = true, sync = true }})")));
        }
    }
    for (svc, entry) in &s.fleet {
        if entry.get_ref().nodes.is_some() {
            return Err(err(Some(entry.span()), format!("{svc}: nodes is the broker's (broker = {{ nodes = 3 }}); a service has replicas")));
        }
    }
    for (svc, entry) in &s.fleet {
        if !SERVICES.contains(&svc.as_str()) {
            return Err(err(Some(entry.span()), format!("unknown service {svc:?}; expected one of {}", SERVICES.join(", "))));
        }
        let e = entry.get_ref();
        if e.count() == 0 || e.count() > 8 {
            return Err(err(Some(entry.span()), format!("{svc}: replicas must be 1..=8, not {}", e.count())));
        }
        if matches!(e.replicas, Replicas::Each(_)) && !e.compat.is_empty() {
            return Err(err(
                Some(entry.span()),
                format!("{svc}: give compat per replica (replicas = [ {{ compat = [...] }}, {{}} ]) or for the service, not both"),
            ));
        }
        for mode in (1..=e.count()).flat_map(|i| e.compat_of(i)) {
            if let Err(why) = mode.parse::<craig_fleet::Compat>() {
                return Err(err(Some(entry.span()), format!("{svc}: {why}")));
            }
        }
    }
    if !s.fleet.contains_key("cases") {
        return Err(err(at("[fleet]"), "the fleet needs a cases service: the workload writes through it".into()));
    }
    let w = &s.workload;
    if w.writes == 0 || !(w.rate > 0.0 && w.rate <= 5000.0) || !(0.0..=1.0).contains(&w.rollback_share) {
        return Err(err(at("[workload]"), "workload needs writes > 0, 0 < rate <= 5000, 0 <= rollback_share <= 1".into()));
    }
    if w.kind == WorkloadKind::Exports {
        if w.export_sizes.is_empty() || w.export_sizes.iter().any(|n| *n > craig_fleet::cases::EXPORT_MAX) {
            return Err(err(at("[workload]"), format!("export_sizes needs 1 or more sizes, each <= {} bytes", craig_fleet::cases::EXPORT_MAX)));
        }
        if !(0.0..=1.0).contains(&w.cancel_share) || !(0.0..=1.0).contains(&w.requery_share) {
            return Err(err(at("[workload]"), "cancel_share and requery_share are shares: 0..=1".into()));
        }
    } else if w.race || w.cancel_share > 0.0 || w.requery_share > 0.0 || w.export_sizes != export_sizes() {
        return Err(err(at("[workload]"), "export_sizes, race, cancel_share and requery_share belong to kind = \"exports\"".into()));
    }
    if !(1..=craig_mq::settings::CONSUMER_PREFETCH).contains(&s.settings.consumer_concurrency) {
        return Err(err(at("[settings]"), format!("consumer_concurrency must be 1..={} (the prefetch)", craig_mq::settings::CONSUMER_PREFETCH)));
    }
    if !(1..=craig_api::idempotency::CLAIM_TTL.as_secs()).contains(&s.settings.idempotency_claim_secs) {
        return Err(err(at("[settings]"), format!("idempotency_claim_secs must be 1..={} (the ADR's claim)", craig_api::idempotency::CLAIM_TTL.as_secs())));
    }
    for (needed, service, why) in [
        (w.kind == WorkloadKind::Placements, "financial", "kind = \"placements\": financial consumes placement.activated"),
        (w.placement_dead_letters > 0, "financial", "placement_dead_letters: financial refuses them"),
        (w.dead_letters > 0, "rules", "dead_letters: rules refuses them"),
        (w.app_dead_letters > 0, "rules", "app_dead_letters: rules' retry cap surfaces them"),
        (w.send_jobs > 0, "financial", "send_jobs: financial's send queue sends them"),
        (s.partner.is_some(), "financial", "[partner]: financial's send queue POSTs to it"),
    ] {
        if needed && !s.fleet.contains_key(service) {
            return Err(err(at("[workload]"), format!("{why}, so the fleet needs {service}")));
        }
    }
    // The node's own rule for the send queue's timing, said here with the line.
    let timing = craig_fleet::send_jobs::SendConfig::timing_from_env(|k| match k {
        "CRAIG_SEND_TIMEOUT_SECS" => Some(s.settings.send_timeout_secs.to_string()),
        "CRAIG_SEND_CLAIM_LEASE_SECS" => Some(s.settings.send_lease_secs.to_string()),
        _ => None,
    });
    if let Err(why) = timing {
        return Err(err(at("[settings]"), format!("settings a node would refuse: {why}")));
    }
    if let Some(p) = &s.partner {
        // A partner that answers near the sender's transport cap races its own fenced retry
        // (a late answer reads like a second, live claim): keep it to half the cap.
        let cap_ms = s.settings.send_timeout_secs * 1000;
        if !(0.0..=1.0).contains(&p.fail_share) || !(0.0..=1.0).contains(&p.hang_share) || p.delay_ms * 2 > cap_ms {
            return Err(err(
                at("[partner]"),
                format!("[partner] needs 0 <= fail_share, hang_share <= 1 and delay_ms at most half the send timeout ({} ms)", cap_ms / 2),
            ));
        }
    }
    if w.send_jobs > 0 && s.partner.is_none() {
        return Err(err(at("send_jobs"), "send_jobs need a [partner] to be sent to".into()));
    }
    if w.after_heal == 0 && !s.faults.is_empty() {
        return Err(err(at("after_heal"), "after_heal must be at least 1: the workload writes again after every fault heals".into()));
    }
    if s.settings.claim_lease_secs == 0 || s.settings.poll_ms == 0 || s.settings.retention_interval_secs == 0 {
        return Err(err(at("[settings]"), "claim_lease_secs, poll_ms and retention_interval_secs must be positive".into()));
    }
    // The nodes would refuse these settings at start; say so here, with the line.
    let st = &s.settings;
    let outbox = craig_mq::OutboxConfig {
        poll_interval: std::time::Duration::from_millis(st.poll_ms),
        claim_lease: std::time::Duration::from_secs(st.claim_lease_secs),
        backoff_base: std::time::Duration::from_millis(st.backoff_base_ms),
        backoff_max: std::time::Duration::from_millis(st.backoff_max_ms),
        ..Default::default()
    };
    let publisher = craig_mq::PublisherConfig {
        confirm_timeout: std::time::Duration::from_millis(st.confirm_timeout_ms),
        connect_timeout: std::time::Duration::from_millis(st.connect_timeout_ms),
        ..Default::default()
    };
    if let Err(why) = craig_mq::settings::check_protocol(&outbox, &publisher) {
        return Err(err(at("[settings]"), format!("settings a node would refuse: {why}")));
    }
    let dlq = craig_mq::dlq::DlqRetryConfig::default();
    let parked = craig_mq::dlq::DlqRetryConfig::new(dlq.max_attempts(), dlq.retry_delay(), std::time::Duration::from_millis(st.dlq_park_ms))
        .and_then(|c| c.with_max_parks(st.dlq_max_parks));
    if let Err(why) = parked {
        let key = if matches!(why, craig_mq::dlq::DlqConfigError::Parks(_)) { "dlq_max_parks" } else { "dlq_park_ms" };
        return Err(err(at(key), format!("settings a node would refuse: {why}")));
    }
    if st.dlq_redrive_secs > 86_400 {
        return Err(err(at("dlq_redrive_secs"), "dlq_redrive_secs must be 0 (off) up to 86400".into()));
    }
    for f in &s.faults {
        let span = Some(f.span());
        let fault = f.get_ref();
        let target = s
            .parse_target(&fault.target)
            .ok_or_else(|| err(key_in(f.span(), "target"), format!("unknown fault target {:?}; replicas here: {}", fault.target, s.replica_names().join(", "))))?;
        match (fault.kind, &target) {
            (FaultKind::Crash, FaultTarget::Replica(_)) => {
                let fp = fault.failpoint.as_deref().ok_or_else(|| err(span.clone(), "a crash needs a failpoint".into()))?;
                if !craig_mq::crash::CRASH_POINTS.contains(&fp) {
                    return Err(err(key_in(f.span(), "failpoint"), format!("unknown failpoint {fp:?}; known: {}", craig_mq::crash::CRASH_POINTS.join(", "))));
                }
                if !matches!(fault.at, Trigger::FailpointHit(n) if n >= 1) {
                    return Err(err(span, "a crash fires on a failpoint hit: at = { failpoint_hit = N } (N >= 1)".into()));
                }
            }
            (FaultKind::Crash, _) => return Err(err(span, "a crash targets a replica".into())),
            (FaultKind::Mutant, FaultTarget::Replica(r)) => {
                let fp = fault.failpoint.as_deref().ok_or_else(|| err(span.clone(), "a mutant names one: failpoint = \"<mutant>\"".into()))?;
                if !craig_mq::crash::MUTANTS.contains(&fp) {
                    return Err(err(key_in(f.span(), "failpoint"), format!("unknown mutant {fp:?}; known: {}", craig_mq::crash::MUTANTS.join(", "))));
                }
                let service = r.rsplit_once('-').map_or(r.as_str(), |(s, _)| s);
                if !fp.starts_with(&format!("{service}::")) {
                    return Err(err(key_in(f.span(), "target"), format!("mutant {fp} lives in another service than {r}'s")));
                }
                // The replica runs with its mutant from its first start to the end (the
                // verdict's window is the whole run): a later `at` or a heal would be a lie.
                if fault.at != Trigger::AfterMs(0) || fault.duration_ms.is_some() {
                    return Err(err(span, "a mutant is in the replica from its start to the end: at = { after_ms = 0 } and no duration_ms".into()));
                }
            }
            (FaultKind::Mutant, _) => return Err(err(span, "a mutant targets a replica".into())),
            (FaultKind::RefuseStaging, FaultTarget::Database) => {
                let svc = fault.service.as_deref().unwrap_or("");
                if !s.fleet.contains_key(svc) {
                    return Err(err(span, format!("refuse_staging needs service = one of the fleet's: {}", s.fleet.keys().cloned().collect::<Vec<_>>().join(", "))));
                }
                if !refusable_tables(svc).contains(&fault.refused_table()) {
                    return Err(err(
                        key_in(f.span(), "table"),
                        format!("refuse_staging on {svc} refuses inserts into one of: {}, not {:?}", refusable_tables(svc).join(", "), fault.refused_table()),
                    ));
                }
                if !fault.every.is_some_and(|n| (1..=1_000_000).contains(&n)) {
                    return Err(err(span, "refuse_staging needs every = N (1..=1000000): every N-th insert is refused".into()));
                }
                // One trigger and one sequence per service's database: a second would clobber it.
                let same = s.faults.iter().filter(|g| g.get_ref().kind == FaultKind::RefuseStaging && g.get_ref().service.as_deref() == Some(svc)).count();
                if same > 1 {
                    return Err(err(span, format!("one refuse_staging fault per service ({svc} has {same})")));
                }
            }
            (FaultKind::RefuseStaging, _) => return Err(err(span, "refuse_staging targets \"database\"".into())),
            (FaultKind::Failover, FaultTarget::Database) => {
                if s.standby.is_none() {
                    return Err(err(span, "a failover promotes the database's standby: [fleet] database = { standby = true, sync = true|false }".into()));
                }
                if fault.duration_ms.is_some() || fault.restart_after_ms.is_some() {
                    return Err(err(span, "a failover has no duration: the old primary stays gone".into()));
                }
                if s.faults.iter().filter(|g| g.get_ref().kind == FaultKind::Failover).count() > 1 {
                    return Err(err(span, "one failover per scenario (there is one standby)".into()));
                }
            }
            (FaultKind::Failover, _) => return Err(err(span, "a failover targets \"database\"".into())),
            (FaultKind::ReplicationLag, FaultTarget::Link { replica, .. }) if replica == "standby" => {
                if !fault.lag_ms.is_some_and(|l| (1..=30_000).contains(&l)) {
                    return Err(err(span, "a replication_lag needs lag_ms = N (1..=30000): how long the link delays what the primary sends (well under PostgreSQL's wal_receiver_timeout, 60 s, past which the standby drops the link: another fault)".into()));
                }
            }
            (FaultKind::ReplicationLag, _) => {
                return Err(err(span, format!("a replication_lag targets the standby's replication link, \"{REPLICATION_LINK}\" ([fleet] database = {{ standby = true, sync = ... }})")));
            }
            (FaultKind::Upgrade | FaultKind::Downgrade, FaultTarget::Replica(_)) => {
                let modes = fault.compat.clone().unwrap_or_default();
                if fault.kind == FaultKind::Downgrade && modes.is_empty() {
                    return Err(err(span, "a downgrade names the older behaviour: compat = [\"pre-1128\"]".into()));
                }
                for mode in &modes {
                    if let Err(why) = mode.parse::<craig_fleet::Compat>() {
                        return Err(err(key_in(f.span(), "compat"), why.to_string()));
                    }
                }
            }
            // A graceful restart of a cluster node (issue 25): drained, stopped, started, revived.
            (FaultKind::Upgrade, FaultTarget::BrokerNode(_)) if fault.compat.is_none() && fault.failpoint.is_none() => {}
            (FaultKind::Upgrade | FaultKind::Downgrade, _) => {
                return Err(err(span, "upgrade and downgrade target a replica like \"cases-1\" (an upgrade also a node of a broker cluster, \"broker-2\", with no compat or failpoint: a graceful restart)".into()));
            }
            (FaultKind::Kill, target) if fault.wipe && !matches!(target, FaultTarget::BrokerNode(_)) => {
                return Err(err(key_in(f.span(), "wipe"), "wipe = true takes a node of a broker cluster (target = \"broker-2\", [fleet] broker = { nodes = 3 })".into()));
            }
            (kind, _) if fault.wipe && kind != FaultKind::Kill => {
                return Err(err(key_in(f.span(), "wipe"), "wipe = true belongs to a kill of a broker node".into()));
            }
            (FaultKind::Kill | FaultKind::Pause, FaultTarget::Link { .. }) => {
                return Err(err(span, "kill and pause target a replica, the broker or the database, not a link".into()));
            }
            (FaultKind::Partition, FaultTarget::Broker) if s.broker_nodes > 1 => {
                return Err(err(span, "on a broker cluster a partition cuts one node off from its peers: target = \"broker-N\" (\"broker\" would cut node 1's links only, and replicas move to the others)".into()));
            }
            (FaultKind::Partition, FaultTarget::Broker | FaultTarget::Database | FaultTarget::BrokerNode(_)) => {}
            (FaultKind::Partition, _) => {
                return Err(err(span, "a partition cuts off \"broker\", \"database\" or a node of a broker cluster (\"broker-N\")".into()));
            }
            (FaultKind::Toxic | FaultKind::Down, FaultTarget::Link { .. }) => {}
            (FaultKind::Toxic | FaultKind::Down, _) => {
                return Err(err(span, "toxic and down target a link like \"cases-1->broker\"".into()));
            }
            _ => {}
        }
        if fault.compat.is_some() && !matches!(fault.kind, FaultKind::Upgrade | FaultKind::Downgrade) {
            return Err(err(key_in(f.span(), "compat"), "compat belongs to an upgrade or downgrade fault".into()));
        }
        let marker = matches!(fault.kind, FaultKind::Upgrade | FaultKind::Downgrade);
        if fault.kind != FaultKind::Crash && !marker && matches!(fault.at, Trigger::FailpointHit(_)) {
            return Err(err(span, "failpoint_hit triggers only a crash, an upgrade or a downgrade".into()));
        }
        if marker {
            match (fault.failpoint.as_deref(), fault.at) {
                (Some(fp), Trigger::FailpointHit(n)) if n >= 1 => {
                    if !craig_mq::crash::CRASH_POINTS.contains(&fp) {
                        return Err(err(key_in(f.span(), "failpoint"), format!("unknown failpoint {fp:?}; known: {}", craig_mq::crash::CRASH_POINTS.join(", "))));
                    }
                    // (A mutant's failpoint is no timing point: it shares a replica with one.)
                    let taken = s
                        .faults
                        .iter()
                        .filter(|g| g.get_ref().target == fault.target && g.get_ref().failpoint.is_some() && g.get_ref().kind != FaultKind::Mutant)
                        .count();
                    if taken > 1 {
                        return Err(err(span, format!("{}: one failpoint-timed fault per replica", fault.target)));
                    }
                }
                (Some(_), _) => return Err(err(span, "a failpoint here times the fault: at = { failpoint_hit = N } (N >= 1)".into())),
                (None, Trigger::FailpointHit(_)) => return Err(err(span, "failpoint_hit needs failpoint = \"<crash point>\"".into())),
                (None, _) => {}
            }
        } else if !matches!(fault.kind, FaultKind::Crash | FaultKind::Mutant) && fault.failpoint.is_some() {
            return Err(err(key_in(f.span(), "failpoint"), "failpoint belongs to a crash, mutant, upgrade or downgrade".into()));
        }
        if (fault.service.is_some() || fault.every.is_some() || fault.table.is_some()) && fault.kind != FaultKind::RefuseStaging {
            return Err(err(span, "service, every and table belong to a refuse_staging fault".into()));
        }
        if fault.lag_ms.is_some() && fault.kind != FaultKind::ReplicationLag {
            return Err(err(key_in(f.span(), "lag_ms"), "lag_ms belongs to a replication_lag fault".into()));
        }
        if fault.kind == FaultKind::Toxic && fault.toxic.is_none() {
            return Err(err(span, "a toxic fault needs toxic = { type = ..., stream = ..., attributes = {...} }".into()));
        }
        if fault.kind == FaultKind::QueueLimit {
            if target != FaultTarget::Broker {
                return Err(err(span, "a queue_limit targets \"broker\"".into()));
            }
            let queues: Vec<String> = s.fleet.keys().map(|svc| craig_mq::topology::consumer_queue(svc)).collect();
            match (&fault.queue, fault.max_length) {
                (Some(q), Some(_)) if queues.contains(q) => {}
                (Some(q), Some(_)) => {
                    return Err(err(key_in(f.span(), "queue"), format!("unknown queue {q:?}; this fleet's queues: {}", queues.join(", "))));
                }
                _ => return Err(err(span, "a queue_limit needs queue = \"craig-<service>.events\" and max_length = N".into())),
            }
        } else if fault.queue.is_some() || fault.max_length.is_some() {
            return Err(err(span, "queue and max_length belong to a queue_limit fault".into()));
        }
        if fault.kind == FaultKind::Terminate {
            if target != FaultTarget::Database {
                return Err(err(span, "a terminate fault targets \"database\" (the server whose backends it terminates)".into()));
            }
        } else if fault.application_name.is_some() {
            return Err(err(key_in(f.span(), "application_name"), "application_name belongs to a terminate fault".into()));
        }
        if matches!(
            fault.kind,
            FaultKind::Pause | FaultKind::Partition | FaultKind::Toxic | FaultKind::Down | FaultKind::QueueLimit | FaultKind::Terminate | FaultKind::RefuseStaging | FaultKind::ReplicationLag
        ) && fault.duration_ms.is_none()
        {
            return Err(err(span, "this fault needs duration_ms (when it heals)".into()));
        }
        if fault.delay_ms.is_some() {
            if matches!(fault.kind, FaultKind::Crash | FaultKind::Mutant) {
                return Err(err(key_in(f.span(), "delay_ms"), format!("a {} is armed in the replica and fires at its trigger: no delay_ms", fault.kind.name())));
            }
            if matches!(fault.at, Trigger::AfterMs(_)) {
                return Err(err(key_in(f.span(), "delay_ms"), "delay_ms follows an event trigger; after_ms already counts from the run's start (add the two)".into()));
            }
        }
        if let Trigger::AfterPublished(n) = fault.at {
            if n == 0 {
                return Err(err(
                    key_in(f.span(), "at"),
                    "after_published = N (N >= 1) times a fault on a replica or its link by that replica's published outbox rows, on a server by the fleet's".into(),
                ));
            }
        }
        // A fault that would not fire when the file says: say so here.
        if let Trigger::AfterWrites(n) = fault.at {
            if n > s.workload.writes {
                return Err(err(
                    key_in(f.span(), "at"),
                    format!("after_writes = {n} is past the workload's writes = {}: the fault would fire only when the writes end, not after write {n}", s.workload.writes),
                ));
            }
        }
        if let Some(t) = &fault.toxic {
            if !(0.0..=1.0).contains(&t.toxicity) {
                return Err(err(key_in(f.span(), "toxic"), format!("toxicity is a share of the link's connections: 0..=1, not {}", t.toxicity)));
            }
        }
        // The runner restarts a crashed replica once: a second crash of it would never fire.
        // (Counted among the faults before this one: the error is on the second's line.)
        let earlier = s.faults.iter().take_while(|g| !std::ptr::eq(*g, f));
        if fault.kind == FaultKind::Crash && earlier.filter(|g| g.get_ref().kind == FaultKind::Crash && g.get_ref().target == fault.target).count() > 0 {
            return Err(err(span, format!("{}: one crash per replica (a crashed replica is restarted once)", fault.target)));
        }
    }
    s.floor.acknowledged = (u64::from(s.workload.writes) / 2).max(1);
    for (key, raw) in std::mem::take(&mut s.expect_raw) {
        let span = raw.span();
        if FLOORS.contains(&key.as_str()) {
            let n = raw.get_ref().as_integer().filter(|n| *n >= 0).ok_or_else(|| err(Some(span.clone()), format!("{key} is a count: {key} = N (N >= 0)")))?
                as u64;
            match key.as_str() {
                "min_acknowledged" => s.floor.acknowledged = n,
                "min_redeliveries" => s.floor.redeliveries = n,
                "min_crossings" => s.floor.crossings = n,
                "min_dlq_duplicates" => s.floor.dlq_duplicates = n,
                "min_lease_resends" => s.floor.lease_resends = n,
                "min_replays" => s.floor.replays = n,
                "min_sentinels" => s.floor.sentinels = n,
                "min_payments_absorbed" => s.floor.payments_absorbed = n,
                _ => s.floor.dead_letters = n,
            }
            continue;
        }
        if key.starts_with("min_") {
            return Err(err(Some(span), format!("unknown floor {key:?}; known: {}", FLOORS.join(", "))));
        }
        let e = Expectation::try_from(raw.get_ref().clone()).map_err(|why| err(Some(span.clone()), why))?;
        s.expect.insert(key, Spanned::new(span, e));
    }
    if s.expect.is_empty() {
        return Err(err(at("[expect]"), "expect names at least one invariant".into()));
    }
    for (name, e) in &s.expect {
        // A twin of a checker that attributes its violations must say what it is red for:
        // a bare "violate" would be met by a violation of any cause.
        if e.get_ref().expect == Expect::Violate && e.get_ref().cause.is_empty() && crate::checkers::ATTRIBUTING.contains(&name.as_str()) {
            return Err(err(
                Some(e.span()),
                format!(
                    "{name} attributes its violations: name the cause this twin must be red for, e.g. {name} = {{ violate = [\"compat:<mode>\", \"fault:<kind> <target>\"] }}"
                ),
            ));
        }
        if !e.get_ref().cause.is_empty() && !crate::checkers::ATTRIBUTING.contains(&name.as_str()) {
            return Err(err(
                Some(e.span()),
                format!("{name} does not attribute its violations; a cause can be named for {}", crate::checkers::ATTRIBUTING.join(", ")),
            ));
        }
        for c in &e.get_ref().cause {
            if let Some(replica) = c.strip_prefix("replica:") {
                if !s.replica_names().iter().any(|n| n == replica) {
                    return Err(err(Some(e.span()), format!("cause names replica {replica:?}; replicas here: {}", s.replica_names().join(", "))));
                }
            }
            if let Some(fault) = c.strip_prefix("fault:") {
                let known: Vec<String> = s.faults.iter().map(|f| format!("{} {}", f.get_ref().kind.name(), f.get_ref().target)).collect();
                if !known.iter().any(|k| k == fault) {
                    return Err(err(Some(e.span()), format!("cause names fault {fault:?}; faults here: {}", known.join(", "))));
                }
            }
        }
        if !CONTRACT_INVARIANTS.contains(&name.as_str()) {
            return Err(err(Some(e.span()), format!("unknown invariant {name:?}; known: {}", CONTRACT_INVARIANTS.join(", "))));
        }
        if !CHECKABLE.contains(&name.as_str()) {
            return Err(err(Some(e.span()), format!("invariant {name} is not checked by this build yet")));
        }
    }
    Ok(s)
}

/// Scenario files under `paths` (folders: their `*.toml`, sorted).
pub fn discover(paths: &[PathBuf]) -> Result<Vec<PathBuf>, ScenarioError> {
    let roots = if paths.is_empty() { vec![PathBuf::from("scenarios")] } else { paths.to_vec() };
    let mut out = Vec::new();
    for root in roots {
        let io = |e: std::io::Error| ScenarioError { file: root.display().to_string(), line: 0, reason: e.to_string() };
        if root.is_dir() {
            for entry in std::fs::read_dir(&root).map_err(io)? {
                let p = entry.map_err(io)?.path();
                if p.extension().is_some_and(|e| e == "toml") {
                    out.push(p);
                }
            }
        } else if root.exists() {
            out.push(root);
        } else {
            return Err(io(std::io::Error::new(std::io::ErrorKind::NotFound, "no such file or folder")));
        }
    }
    out.sort();
    Ok(out)
}

/// Read and parse every scenario; the first bad file stops with its error.
pub fn load(paths: &[PathBuf]) -> Result<Vec<Scenario>, ScenarioError> {
    let mut out = Vec::new();
    for p in discover(paths)? {
        let text = std::fs::read_to_string(&p)
            .map_err(|e| ScenarioError { file: p.display().to_string(), line: 0, reason: e.to_string() })?;
        out.push(parse(&p, &text)?);
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    const GOOD: &str = r##"name = "t"
amendment = "#1128"

[fleet]
cases = { replicas = 2 }
rules = { compat = ["pre-d2"] }

[workload]
writes = 10
rate = 50

[[faults]]
kind = "crash"
target = "cases-2"
failpoint = "outbox::after_claim"
at = { failpoint_hit = 2 }

[[faults]]
kind = "toxic"
target = "rules-1->broker"
at = { after_ms = 100 }
duration_ms = 500
toxic = { type = "latency", stream = "upstream", attributes = { latency = 50 } }

[expect]
no_loss = "hold"
effect_once = { violate = "compat:pre-d2" }
"##;

    fn parse_str(text: &str) -> Result<Scenario, ScenarioError> {
        parse(Path::new("scenarios/t.toml"), text)
    }

    #[test]
    fn parses_a_full_scenario() {
        let s = parse_str(GOOD).unwrap();
        assert_eq!(s.replica_names(), ["cases-1", "cases-2", "rules-1"]);
        assert_eq!(s.faults.len(), 2);
        assert_eq!(s.faults[0].get_ref().at, Trigger::FailpointHit(2));
        assert_eq!(s.parse_target("rules-1->broker"), Some(FaultTarget::Link { replica: "rules-1".into(), to: crate::backend::Target::Broker }));
        assert_eq!(s.expect["effect_once"].get_ref().expect, Expect::Violate);
        assert_eq!(s.compat_summary(), "pre-d2");
        assert_eq!(s.settings.claim_lease_secs, 4);
        assert!(!s.deploy.topology, "no deploy step unless the scenario asks for it");
    }

    fn rejected(text: &str) -> ScenarioError {
        parse_str(text).unwrap_err()
    }

    /// A fault that could never fire is refused with its line: a write count past the
    /// workload's, a toxicity outside 0..=1, a second crash of one replica.
    #[test]
    fn faults_that_could_never_fire_are_refused_with_their_line() {
        let e = rejected(&GOOD.replace("at = { after_ms = 100 }", "at = { after_writes = 11 }"));
        assert_eq!(e.line, 21, "{e}");
        assert!(e.reason.starts_with("after_writes = 11 is past the workload's writes = 10"), "{e}");
        parse_str(&GOOD.replace("at = { after_ms = 100 }", "at = { after_writes = 10 }")).unwrap();
        let s = parse_str(&GOOD.replace("at = { after_ms = 100 }", "at = { after_published = 5 }")).unwrap();
        assert_eq!(s.faults[1].get_ref().at, Trigger::AfterPublished(5));
        let e = rejected(&GOOD.replace("at = { after_ms = 100 }", "at = { after_published = 0 }"));
        assert!(e.reason.starts_with("after_published = N (N >= 1)"), "{e}");
        let s = parse_str(&GOOD.replace("at = { after_ms = 100 }", "at = { after_published = 5 }\ndelay_ms = 600")).unwrap();
        assert_eq!(s.faults[1].get_ref().delay_ms, Some(600));
        let e = rejected(&GOOD.replace("at = { after_ms = 100 }", "at = { after_ms = 100 }\ndelay_ms = 600"));
        assert_eq!(e.line, 22, "{e}");
        assert!(e.reason.starts_with("delay_ms follows an event trigger"), "{e}");
        let again = GOOD.replace("[expect]\n", "[[faults]]\nkind = \"crash\"\ntarget = \"cases-2\"\nfailpoint = \"outbox::after_publish_before_stamp\"\nat = { failpoint_hit = 5 }\ndelay_ms = 100\n\n[expect]\n");
        assert!(rejected(&again).reason.starts_with("a crash is armed in the replica and fires at its trigger: no delay_ms"));
        let mutant = GOOD.replace("[expect]\n", "[[faults]]\nkind = \"mutant\"\ntarget = \"cases-1\"\nfailpoint = \"cases::stage_after_commit\"\nat = { after_ms = 0 }\ndelay_ms = 100\n\n[expect]\n");
        assert!(rejected(&mutant).reason.starts_with("a mutant is armed in the replica and fires at its trigger: no delay_ms"));
        let e = rejected(&GOOD.replace("stream = \"upstream\",", "stream = \"upstream\", toxicity = 1.5,"));
        assert_eq!(e.line, 23, "{e}");
        assert!(e.reason.starts_with("toxicity is a share of the link's connections: 0..=1, not 1.5"), "{e}");
        let again = GOOD.replace("[expect]\n", "[[faults]]\nkind = \"crash\"\ntarget = \"cases-2\"\nfailpoint = \"outbox::after_publish_before_stamp\"\nat = { failpoint_hit = 5 }\n\n[expect]\n");
        let e = rejected(&again);
        assert!(e.reason.starts_with("cases-2: one crash per replica"), "{e}");
        assert_eq!(e.line, 25, "the second crash's line: {e}");
    }

    /// Issue 22: a mutant names one of the build's mutants in the target's own service; a
    /// refused staging names a fleet service and its share; each with the line.
    #[test]
    fn mutants_and_refused_staging_are_checked_with_their_line() {
        let with = |fault: &str| GOOD.replace("[expect]\n", &format!("[[faults]]\n{fault}\n[expect]\n"));
        let ok = parse_str(&with("kind = \"mutant\"\ntarget = \"cases-1\"\nfailpoint = \"cases::stage_after_commit\"\nat = { after_ms = 0 }")).unwrap();
        assert_eq!(ok.faults[2].get_ref().kind, FaultKind::Mutant);
        let e = rejected(&with("kind = \"mutant\"\ntarget = \"cases-1\"\nfailpoint = \"cases::nothing\"\nat = { after_ms = 0 }"));
        assert!(e.reason.contains("unknown mutant \"cases::nothing\"; known: financial::absorb_fails, cases::stage_after_commit, cases::activation_stage_after_commit, cases::stage_before_write, cases::activation_stage_before_write"), "{e}");
        let e = rejected(&with("kind = \"mutant\"\ntarget = \"rules-1\"\nfailpoint = \"cases::stage_after_commit\"\nat = { after_ms = 0 }"));
        assert!(e.reason.contains("lives in another service than rules-1's"), "{e}");
        for late in ["at = { after_ms = 5 }", "at = { after_writes = 3 }", "at = { after_ms = 0 }\nduration_ms = 100"] {
            let e = rejected(&with(&format!("kind = \"mutant\"\ntarget = \"cases-1\"\nfailpoint = \"cases::stage_after_commit\"\n{late}")));
            assert!(e.reason.contains("from its start to the end: at = { after_ms = 0 }"), "{late}: {e}");
        }
        // A mutant does not take the replica's one failpoint-timed fault.
        let both = with(
            "kind = \"mutant\"\ntarget = \"cases-1\"\nfailpoint = \"cases::stage_after_commit\"\nat = { after_ms = 0 }\n\n[[faults]]\nkind = \"upgrade\"\ntarget = \"cases-1\"\nfailpoint = \"outbox::after_publish_before_stamp\"\nat = { failpoint_hit = 2 }",
        );
        assert_eq!(parse_str(&both).unwrap().faults.len(), 4);
        let refuse = "kind = \"refuse_staging\"\ntarget = \"database\"\nservice = \"cases\"\nevery = 3\nat = { after_ms = 0 }\nduration_ms = 100";
        assert_eq!(parse_str(&with(refuse)).unwrap().faults[2].get_ref().every, Some(3));
        let e = rejected(&with(&refuse.replace("\"cases\"", "\"financial\"")));
        assert!(e.reason.contains("refuse_staging needs service = one of the fleet's: cases, rules"), "{e}");
        let e = rejected(&with(&format!("{refuse}\n\n[[faults]]\n{}", refuse.replace("after_ms = 0", "after_ms = 500"))));
        assert!(e.reason.contains("one refuse_staging fault per service (cases has 2)"), "{e}");
        let e = rejected(&with(&refuse.replace("every = 3", "every = 0")));
        assert!(e.reason.contains("every = N (1..=1000000)"), "{e}");
        let e = rejected(&with(&refuse.replace("target = \"database\"", "target = \"cases-1\"")));
        assert!(e.reason.contains("refuse_staging targets \"database\""), "{e}");
        let e = rejected(&with("kind = \"kill\"\ntarget = \"cases-1\"\nevery = 2\nat = { after_ms = 0 }\nduration_ms = 5"));
        assert!(e.reason.contains("service, every and table belong to a refuse_staging fault"), "{e}");
        // The domain write itself may be refused, on cases only.
        let referrals = parse_str(&with(&refuse.replace("every = 3", "every = 3\ntable = \"referrals\""))).unwrap();
        assert_eq!(referrals.faults[2].get_ref().refused_table(), "referrals");
        assert_eq!(parse_str(&with(refuse)).unwrap().faults[2].get_ref().refused_table(), "event_outbox");
        let e = rejected(&with(&refuse.replace("every = 3", "every = 3\ntable = \"payments\"")));
        assert!(e.reason.contains("refuse_staging on cases refuses inserts into one of: event_outbox, referrals, placements, not \"payments\""), "{e}");
    }

    #[test]
    fn an_unknown_key_is_rejected_with_its_line() {
        let e = rejected(&GOOD.replace("rate = 50", "rate = 50\nburst = 3"));
        assert_eq!(e.line, 11, "{e}");
        assert!(e.to_string().starts_with("scenarios/t.toml:11: unknown field `burst`"), "{e}");
    }

    #[test]
    fn bad_values_are_rejected_with_line_and_reason() {
        let e = rejected(&GOOD.replace(r#"no_loss = "hold""#, r#"no_loss = "maybe""#));
        assert_eq!(e.line, 26, "{e}");
        assert!(e.reason.contains("unknown expectation \"maybe\""), "{e}");

        let e = rejected(&GOOD.replace(r#"target = "cases-2""#, r#"target = "cases-9""#));
        assert_eq!(e.line, 14, "{e}");
        assert!(e.reason.contains("unknown fault target \"cases-9\""), "{e}");

        let e = rejected(&GOOD.replace("outbox::after_claim", "outbox::nowhere"));
        assert_eq!(e.line, 15, "{e}");
        assert!(e.reason.contains("unknown failpoint"), "{e}");

        let e = rejected(&GOOD.replace(r#"compat = ["pre-d2"]"#, r#"compat = ["pre-nope"]"#));
        assert_eq!(e.line, 6, "{e}");
        assert!(e.reason.contains("unknown compat mode \"pre-nope\""), "{e}");

        assert!(CONTRACT_INVARIANTS.iter().all(|n| CHECKABLE.contains(n)), "every contract invariant is checked");
        let e = rejected(&GOOD.replace("no_loss", "no_such_invariant"));
        assert!(e.reason.contains("no_such_invariant"), "{e}");

        let e = rejected(&GOOD.replace("writes = 10", "writes = -1"));
        assert_eq!(e.line, 9, "{e}");
    }

    #[test]
    fn a_partition_cuts_off_a_server_for_a_while() {
        let partition = |target: &str, hold: &str| {
            GOOD.replace("[expect]", &format!("[[faults]]\nkind = \"partition\"\ntarget = \"{target}\"\nat = {{ after_ms = 100 }}\n{hold}\n[expect]"))
        };
        for target in ["broker", "database"] {
            let s = parse_str(&partition(target, "duration_ms = 500\n")).unwrap();
            assert_eq!(s.faults[2].get_ref().kind.name(), "partition");
        }
        for target in ["cases-1", "rules-1->broker"] {
            let e = rejected(&partition(target, "duration_ms = 500\n"));
            assert_eq!(e.line, 25, "{e}: the fault's own line");
            assert!(e.reason.contains("a partition cuts off \"broker\", \"database\" or a node of a broker cluster"), "{e}");
        }
        let e = rejected(&partition("broker", ""));
        assert!(e.reason.contains("needs duration_ms"), "{e}");
    }

    #[test]
    fn settings_a_node_would_refuse_are_rejected_here() {
        let e = rejected(&GOOD.replace("[workload]", "[settings]\nclaim_lease_secs = 2\n\n[workload]"));
        assert!(e.reason.contains("CRAIG_OUTBOX_CLAIM_LEASE_SECS=2s is refused"), "{e}");
    }

    #[test]
    fn a_queue_limit_names_a_fleet_queue_and_a_length() {
        let fault = "[[faults]]\nkind = \"queue_limit\"\ntarget = \"broker\"\nqueue = \"craig-rules.events\"\nmax_length = 5\nat = { after_ms = 1 }\nduration_ms = 10\n\n[expect]";
        let s = parse_str(&GOOD.replace("[expect]", fault)).unwrap();
        assert_eq!(s.faults[2].get_ref().max_length, Some(5));
        let e = rejected(&GOOD.replace("[expect]", &fault.replace("craig-rules.events", "craig-nope.events")));
        assert!(e.reason.contains("unknown queue \"craig-nope.events\""), "{e}");
        let e = rejected(&GOOD.replace("[expect]", &fault.replace("max_length = 5\n", "")));
        assert!(e.reason.contains("needs queue"), "{e}");
    }

    #[test]
    fn a_mixed_fleet_gives_each_replica_its_compat() {
        let s = parse_str(&GOOD.replace("cases = { replicas = 2 }", r#"cases = { replicas = [ { compat = ["pre-1128"] }, {} ] }"#)).unwrap();
        let cases = s.fleet["cases"].get_ref();
        assert_eq!(cases.count(), 2);
        assert_eq!((cases.compat_of(1), cases.compat_of(2)), (vec!["pre-1128".to_owned()], vec![]));
        assert_eq!(s.compat_summary(), "pre-1128,pre-d2");
        let short = parse_str(GOOD).unwrap();
        assert_eq!(short.fleet["rules"].get_ref().compat_of(1), ["pre-d2"], "the short form stays");

        let e = rejected(&GOOD.replace("cases = { replicas = 2 }", r#"cases = { replicas = [ {}, {} ], compat = ["pre-d1"] }"#));
        assert_eq!(e.line, 5, "{e}");
        assert!(e.reason.contains("per replica") && e.reason.contains("not both"), "{e}");
        let e = rejected(&GOOD.replace("cases = { replicas = 2 }", r#"cases = { replicas = [ { compat = ["pre-nope"] }, {} ] }"#));
        assert!(e.reason.contains("unknown compat mode \"pre-nope\""), "{e}");
    }

    #[test]
    fn upgrades_and_downgrades_target_a_replica_with_valid_modes() {
        let up = "[[faults]]\nkind = \"upgrade\"\ntarget = \"cases-1\"\nat = { after_writes = 5 }\n\n[expect]";
        let s = parse_str(&GOOD.replace("[expect]", up)).unwrap();
        assert_eq!((s.faults[2].get_ref().kind, s.faults[2].get_ref().compat.clone()), (FaultKind::Upgrade, None));
        let down = up.replace("\"upgrade\"", "\"downgrade\"");
        let e = rejected(&GOOD.replace("[expect]", &down));
        assert!(e.reason.contains("a downgrade names the older behaviour"), "{e}");
        let s = parse_str(&GOOD.replace("[expect]", &down.replace("at = ", "compat = [\"pre-1128\"]\nat = "))).unwrap();
        assert_eq!(s.faults[2].get_ref().compat.as_deref(), Some(&["pre-1128".to_owned()][..]));
        assert_eq!(s.compat_summary(), "pre-1128,pre-d2", "a downgrade's modes count as the scenario's");
        let e = rejected(&GOOD.replace("[expect]", &up.replace("cases-1", "broker")));
        assert!(e.reason.contains("target a replica"), "{e}");
        let e = rejected(&GOOD.replace("[expect]", &up.replace("at = ", "compat = [\"pre-x\"]\nat = ")));
        assert!(e.reason.contains("unknown compat mode"), "{e}");
        let e = rejected(&GOOD.replace("duration_ms = 500", "duration_ms = 500\ncompat = []"));
        assert!(e.reason.contains("compat belongs to an upgrade or downgrade"), "{e}");
        // Timed by a failpoint marker: the Nth hit of a crash point on the target.
        let at_hit = up.replace("at = { after_writes = 5 }", "failpoint = \"outbox::after_claim\"\nat = { failpoint_hit = 3 }");
        let s = parse_str(&GOOD.replace("[expect]", &at_hit)).unwrap();
        assert_eq!(s.faults[2].get_ref().at, Trigger::FailpointHit(3));
        let e = rejected(&GOOD.replace("[expect]", &at_hit.replace("outbox::after_claim", "outbox::nowhere")));
        assert!(e.reason.contains("unknown failpoint"), "{e}");
        let e = rejected(&GOOD.replace("[expect]", &at_hit.replace("failpoint = \"outbox::after_claim\"\n", "")));
        assert!(e.reason.contains("failpoint_hit needs failpoint"), "{e}");
        let e = rejected(&GOOD.replace("[expect]", &at_hit.replace("cases-1", "cases-2")));
        assert!(e.reason.contains("one failpoint-timed fault per replica"), "{e}");
    }

    #[test]
    fn a_twin_may_name_the_cause_its_violations_must_point_at() {
        let s = parse_str(&GOOD.replace(r#"effect_once = { violate = "compat:pre-d2" }"#, r#"effect_once = { violate = "compat:pre-d2" }"#)).unwrap();
        let e = s.expect["effect_once"].get_ref();
        assert_eq!((e.expect, e.cause.clone()), (Expect::Violate, vec!["compat:pre-d2".to_owned()]));
        let s = parse_str(&GOOD.replace(r#"effect_once = { violate = "compat:pre-d2" }"#, r#"effect_once = { violate = "replica:rules-1" }"#)).unwrap();
        assert_eq!(s.expect["effect_once"].get_ref().cause, ["replica:rules-1"]);
        let s = parse_str(&GOOD.replace(r#"effect_once = { violate = "compat:pre-d2" }"#, r#"effect_once = { violate = ["compat:pre-d2", "fault:crash cases-2"] }"#)).unwrap();
        assert_eq!(s.expect["effect_once"].get_ref().cause, ["compat:pre-d2", "fault:crash cases-2"]);
        let e = rejected(&GOOD.replace(r#"effect_once = { violate = "compat:pre-d2" }"#, r#"effect_once = { violate = ["fault:kill broker"] }"#));
        assert!(e.reason.contains("cause names fault \"kill broker\"; faults here: crash cases-2, toxic rules-1->broker"), "{e}");
        for (bad, why) in [
            (r#"{ violate = "compat:pre-nope" }"#, "unknown cause \"compat:pre-nope\""),
            (r#"{ violate = "weather" }"#, "unknown cause"),
            (r#"{ violate = "lost_at:disk" }"#, "unknown cause \"lost_at:disk\""),
            (r#"{ hold = "compat:pre-d2" }"#, "expected \"hold\", \"violate\""),
            (r#"{ violate = "replica:rules-9" }"#, "cause names replica \"rules-9\""),
        ] {
            let e = rejected(&GOOD.replace(r#"effect_once = { violate = "compat:pre-d2" }"#, &format!("effect_once = {bad}")));
            assert_eq!(e.line, 27, "{e}");
            assert!(e.reason.contains(why), "{bad}: {e}");
        }
        let e = rejected(&GOOD.replace(r#"effect_once = { violate = "compat:pre-d2" }"#, "liveness = { violate = \"compat:pre-d2\" }"));
        assert!(e.reason.contains("liveness does not attribute its violations"), "{e}");
        // A bare "violate" of an attributing checker is refused: any cause would meet it.
        let e = rejected(&GOOD.replace(r#"effect_once = { violate = "compat:pre-d2" }"#, r#"effect_once = "violate""#));
        assert_eq!(e.line, 27, "{e}");
        assert!(e.reason.contains("effect_once attributes its violations: name the cause"), "{e}");
    }

    /// Issue 25: `[fleet] broker = { nodes = N }` is the broker's, out of the fleet; `broker-N`
    /// names a node of a cluster (and its links), nothing past the cluster's size.
    #[test]
    fn a_broker_cluster_is_the_fleets_broker_entry_and_its_nodes_are_targets() {
        let with = |broker: &str| GOOD.replace("[fleet]\n", &format!("[fleet]\n{broker}\n"));
        let s = parse_str(&with("broker = { nodes = 3 }")).unwrap();
        assert_eq!((s.broker_nodes, s.fleet.contains_key("broker")), (3, false));
        assert_eq!(s.parse_target("broker-3"), Some(FaultTarget::BrokerNode(3)));
        assert_eq!(s.parse_target("broker-4"), None);
        assert_eq!(s.parse_target("rules-1->broker-2"), Some(FaultTarget::Link { replica: "rules-1".into(), to: crate::backend::Target::BrokerNode(2) }));
        assert_eq!(s.parse_target("rules-1->broker-1"), Some(FaultTarget::Link { replica: "rules-1".into(), to: crate::backend::Target::Broker }));
        let one = parse_str(GOOD).unwrap();
        assert_eq!((one.broker_nodes, one.parse_target("broker-1")), (1, None), "one node: plain broker only");
        for (bad, says) in [
            ("broker = { nodes = 6 }", "broker nodes must be 1..=5, not 6"),
            ("broker = { replicas = 2 }", "broker takes only nodes"),
            ("broker = {}", "broker nodes must be 1..=5, not missing"),
        ] {
            let e = rejected(&with(bad));
            assert!(e.reason.contains(says) && e.line == with(bad).lines().position(|l| l.starts_with("broker")).unwrap() + 1, "{bad}: {e}");
        }
        let e = rejected(&GOOD.replace("cases = { replicas = 2 }", "cases = { replicas = 2, nodes = 3 }"));
        assert!(e.reason.contains("cases: nodes is the broker's"), "{e}");
    }

    /// Issue 26: `[fleet] database = { standby = true, sync = ... }` is the database's, out
    /// of the fleet; with it the replication link is a target and a failover is allowed, once
    /// and without a duration; without it, a failover is refused with what to write.
    #[test]
    fn a_database_standby_is_the_fleets_database_entry_and_a_failover_needs_it() {
        let with = |db: &str, faults: &str| GOOD.replace("[fleet]\n", &format!("[fleet]\n{db}\n")).replace("[expect]", &format!("{faults}[expect]"));
        let failover = "[[faults]]\nkind = \"failover\"\ntarget = \"database\"\nat = { after_ms = 100 }\n\n";
        let s = parse_str(&with("database = { standby = true, sync = false }", failover)).unwrap();
        assert_eq!((s.standby, s.fleet.contains_key("database")), (Some(StandbySpec { sync: false }), false));
        assert_eq!(s.parse_target(REPLICATION_LINK), Some(FaultTarget::Link { replica: "standby".into(), to: crate::backend::Target::Database }));
        assert_eq!(parse_str(GOOD).unwrap().parse_target(REPLICATION_LINK), None, "no standby, no replication link");
        for (db, faults, says) in [
            ("database = { standby = true }", "", "a standby is synchronous or not: say which"),
            ("database = { sync = true }", "", "sync belongs to a standby"),
            ("database = { replicas = 2, standby = true, sync = true }", "", "database takes only standby and sync"),
            ("", failover, "a failover promotes the database's standby: [fleet] database = { standby = true, sync = true|false }"),
        ] {
            let e = rejected(&with(db, faults));
            assert!(e.reason.contains(says), "{db} {faults}: {e}");
        }
        let twice = format!("{failover}{failover}");
        assert!(rejected(&with("database = { standby = true, sync = true }", &twice)).reason.contains("one failover per scenario"));
        let held = failover.replace("at = { after_ms = 100 }", "at = { after_ms = 100 }\nduration_ms = 500");
        assert!(rejected(&with("database = { standby = true, sync = true }", &held)).reason.contains("a failover has no duration"));
        let e = rejected(&GOOD.replace("cases = { replicas = 2 }", "cases = { replicas = 2, standby = true }"));
        assert!(e.reason.contains("cases: standby and sync are the database's"), "{e}");
        // A synchronous failover excuses nothing, so no twin can be red for replication:sync.
        let named = |cause: &str| with("database = { standby = true, sync = false }", failover).replace("no_loss = \"hold\"", &format!("no_loss = {{ violate = [\"{cause}\"] }}"));
        assert!(parse_str(&named("replication:async")).is_ok());
        assert!(rejected(&named("replication:sync")).reason.contains("unknown cause \"replication:sync\""));
    }

    /// Issue 26: `replication_lag` slows the standby's replication link: it takes that link
    /// only, a `lag_ms` in 1..=30000 and a `duration_ms`; `lag_ms` belongs to it alone.
    #[test]
    fn a_replication_lag_slows_the_standbys_link_by_lag_ms() {
        let standby = |faults: &str| GOOD.replace("[fleet]\n", "[fleet]\ndatabase = { standby = true, sync = false }\n").replace("[expect]", &format!("{faults}[expect]"));
        let lag = |target: &str, rest: &str| format!("[[faults]]\nkind = \"replication_lag\"\ntarget = \"{target}\"\nat = {{ after_ms = 100 }}\n{rest}\n");
        let s = parse_str(&standby(&lag(REPLICATION_LINK, "lag_ms = 800\nduration_ms = 500"))).unwrap();
        let f = s.faults.last().unwrap().get_ref();
        assert_eq!((f.kind.name(), f.lag_ms), ("replication_lag", Some(800)));
        for (faults, says) in [
            (lag(REPLICATION_LINK, "duration_ms = 500"), "a replication_lag needs lag_ms = N (1..=30000)"),
            (lag(REPLICATION_LINK, "lag_ms = 0\nduration_ms = 500"), "a replication_lag needs lag_ms = N (1..=30000)"),
            (lag(REPLICATION_LINK, "lag_ms = 30001\nduration_ms = 500"), "a replication_lag needs lag_ms = N (1..=30000)"),
            (lag(REPLICATION_LINK, "lag_ms = 800"), "this fault needs duration_ms"),
            (lag("cases-1->database", "lag_ms = 800\nduration_ms = 500"), "a replication_lag targets the standby's replication link, \"standby->database\""),
            (lag("database", "lag_ms = 800\nduration_ms = 500"), "a replication_lag targets the standby's replication link"),
            (
                "[[faults]]\nkind = \"down\"\ntarget = \"standby->database\"\nlag_ms = 5\nat = { after_ms = 100 }\nduration_ms = 500\n\n".to_owned(),
                "lag_ms belongs to a replication_lag fault",
            ),
        ] {
            let e = rejected(&standby(&faults));
            assert!(e.reason.contains(says), "{faults}: {e}");
        }
        // Without a standby there is no replication link to slow.
        let e = rejected(&GOOD.replace("[expect]", &format!("{}[expect]", lag(REPLICATION_LINK, "lag_ms = 800\nduration_ms = 500"))));
        assert!(e.reason.contains("unknown fault target \"standby->database\""), "{e}");
    }

    /// Issue 25: on a cluster a partition cuts one node off from its peers (`broker-N`); a
    /// partition of `broker` is refused there with what to write instead.
    #[test]
    fn a_partition_on_a_broker_cluster_names_a_node() {
        let with = |target: &str| {
            GOOD.replace("[fleet]\n", "[fleet]\nbroker = { nodes = 3 }\n")
                .replace("[expect]", &format!("[[faults]]\nkind = \"partition\"\ntarget = \"{target}\"\nat = {{ after_ms = 100 }}\nduration_ms = 500\n\n[expect]"))
        };
        let s = parse_str(&with("broker-1")).unwrap();
        assert_eq!(s.faults.last().map(|f| f.get_ref().kind.name()), Some("partition"));
        assert_eq!(s.parse_target("broker-1"), Some(FaultTarget::BrokerNode(1)));
        let e = rejected(&with("broker"));
        assert!(e.reason.contains("on a broker cluster a partition cuts one node off from its peers: target = \"broker-N\""), "{e}");
        let kind_line = with("broker").lines().position(|l| l == "kind = \"partition\"").unwrap() + 1;
        assert!((kind_line - 1..=kind_line + 3).contains(&e.line), "the partition's own lines: {e}");
    }

    /// Issue 25: an upgrade of a cluster's node is a graceful restart (drain, stop, start,
    /// revive): no compat (a broker node runs no craig behaviour) and no failpoint; a
    /// downgrade of one is refused.
    #[test]
    fn an_upgrade_of_a_broker_node_is_a_graceful_restart_without_compat() {
        let with = |kind: &str, extra: &str| {
            GOOD.replace("[fleet]\n", "[fleet]\nbroker = { nodes = 3 }\n")
                .replace("[expect]", &format!("[[faults]]\nkind = \"{kind}\"\ntarget = \"broker-2\"\nat = {{ after_ms = 100 }}\n{extra}\n[expect]"))
        };
        let s = parse_str(&with("upgrade", "")).unwrap();
        let f = s.faults.last().unwrap().get_ref();
        assert_eq!((f.kind, s.parse_target(&f.target)), (FaultKind::Upgrade, Some(FaultTarget::BrokerNode(2))));
        for (kind, extra) in [("upgrade", "compat = [\"pre-1128\"]\n"), ("downgrade", "compat = [\"pre-1128\"]\n")] {
            let e = rejected(&with(kind, extra));
            assert!(e.reason.contains("an upgrade also a node of a broker cluster, \"broker-2\", with no compat or failpoint"), "{kind}: {e}");
        }
    }

    #[test]
    fn the_queue_type_is_classic_unless_quorum_and_a_typo_names_its_line() {
        assert_eq!(parse_str(GOOD).unwrap().settings.queue_type, craig_mq::topology::QueueType::Classic);
        let with = |v: &str| GOOD.replace("[workload]\n", &format!("[settings]\nqueue_type = \"{v}\"\n\n[workload]\n"));
        assert_eq!(parse_str(&with("quorum")).unwrap().settings.queue_type, craig_mq::topology::QueueType::Quorum);
        let e = parse_str(&with("mirrored")).unwrap_err().to_string();
        let line = with("mirrored").lines().position(|l| l.starts_with("queue_type")).unwrap() + 1;
        assert!(e.starts_with(&format!("scenarios/t.toml:{line}:")) && e.contains("\"mirrored\" is not a queue type (classic or quorum)"), "{e}");
    }

    #[test]
    fn the_send_queue_timing_and_the_partner_are_held_to_the_nodes_rules() {
        let with = |settings: &str, partner: &str| {
            GOOD.replace("[workload]\n", &format!("[settings]\n{settings}\n\n[workload]\nkind = \"placements\"\n"))
                .replace("[fleet]\n", "[fleet]\nfinancial = { replicas = 1 }\n")
                .replacen("[[faults]]", &format!("[partner]\n{partner}\n\n[[faults]]"), 1)
        };
        let s = parse_str(&with("send_timeout_secs = 2\nsend_lease_secs = 6", "delay_ms = 1000")).unwrap();
        assert_eq!((s.settings.send_lease_secs, s.partner.unwrap().delay_ms), (6, 1000));
        let e = rejected(&with("send_timeout_secs = 2\nsend_lease_secs = 5", "delay_ms = 1000"));
        assert!(e.reason.contains("CRAIG_SEND_CLAIM_LEASE_SECS=5 must be at least 3 x CRAIG_SEND_TIMEOUT_SECS (6)"), "{e}");
        let e = rejected(&with("send_timeout_secs = 2\nsend_lease_secs = 6", "delay_ms = 1001"));
        assert!(e.reason.contains("delay_ms at most half the send timeout (1000 ms)"), "{e}");
        let e = rejected(&GOOD.replace("[workload]\n", "[workload]\nsend_jobs = 3\n").replace("[fleet]\n", "[fleet]\nfinancial = { replicas = 1 }\n"));
        assert!(e.reason.contains("send_jobs need a [partner]"), "{e}");
    }

    #[test]
    fn a_workload_needs_the_consumer_that_counts_or_refuses_it() {
        let s = parse_str(&GOOD.replace("[workload]\n", "[workload]\nkind = \"placements\"\n").replace("[fleet]\n", "[fleet]\nfinancial = { replicas = 1 }\n")).unwrap();
        assert_eq!((s.workload.kind, s.workload.kind.consumer()), (WorkloadKind::Placements, "financial"));
        let e = rejected(&GOOD.replace("[workload]\n", "[workload]\nkind = \"placements\"\n"));
        assert!(e.reason.contains("financial consumes placement.activated, so the fleet needs financial"), "{e}");
        let e = rejected(&GOOD.replace("[workload]\n", "[workload]\nplacement_dead_letters = 3\n"));
        assert!(e.reason.contains("placement_dead_letters: financial refuses them, so the fleet needs financial"), "{e}");
        let e = rejected(&GOOD.replace("[workload]\n", "[workload]\nkind = \"payments\"\n"));
        assert!(e.reason.contains("unknown variant `payments`"), "{e}");
    }

    #[test]
    fn floors_are_counts_in_expect_with_defaults() {
        let s = parse_str(GOOD).unwrap();
        assert_eq!(s.floor, Floor { acknowledged: 5, redeliveries: 0, dead_letters: 0, crossings: 0, dlq_duplicates: 0, lease_resends: 0, replays: 0, sentinels: 0, payments_absorbed: 0 });
        assert_eq!(s.workload.after_heal, 20);
        let x = parse_str(&GOOD.replace("[expect]\n", "[expect]\nmin_replays = 3\nmin_sentinels = 1\n")).unwrap();
        assert_eq!((x.floor.replays, x.floor.sentinels), (3, 1));
        let s = parse_str(&GOOD.replace("[expect]\n", "[expect]\nmin_acknowledged = 8\nmin_redeliveries = 2\nmin_dead_letters = 1\nmin_crossings = 2\n")).unwrap();
        assert_eq!(s.floor, Floor { acknowledged: 8, redeliveries: 2, dead_letters: 1, crossings: 2, dlq_duplicates: 0, lease_resends: 0, replays: 0, sentinels: 0, payments_absorbed: 0 });
        assert_eq!(s.expect.len(), 2, "floors are not invariants");
        let e = rejected(&GOOD.replace("[expect]\n", "[expect]\nmin_redeliveries = \"many\"\n"));
        assert_eq!(e.line, 26, "{e}");
        assert!(e.reason.contains("min_redeliveries is a count"), "{e}");
        let e = rejected(&GOOD.replace("[expect]\n", "[expect]\nmin_effects = 3\n"));
        assert!(e.reason.contains("unknown floor \"min_effects\""), "{e}");
        let e = rejected(&GOOD.replace("rate = 50", "rate = 50\nafter_heal = 0"));
        assert!(e.reason.contains("after_heal must be at least 1"), "{e}");
    }

    /// Issue 23: an error says what was expected in the scenario's own words and points at
    /// the section of docs/scenarios.md that documents the key.
    #[test]
    fn errors_say_what_was_expected_and_where_it_is_documented() {
        let e = rejected(&GOOD.replace("cases = { replicas = 2 }", r#"cases = { replicas = "two" }"#));
        assert_eq!(e.line, 5, "{e}");
        assert!(!e.reason.contains("untagged"), "{e}");
        assert!(e.reason.contains(r#"invalid type: string "two", expected a replica count (replicas = 2) or one table per replica"#), "{e}");
        assert!(e.reason.ends_with("(see docs/scenarios.md#fleet, [fleet])"), "{e}");
        let e = rejected(&GOOD.replace("writes = 10", "writes = -1"));
        assert!(e.reason.contains("expected a whole number >= 0") && e.reason.ends_with("(see docs/scenarios.md#workload, [workload])"), "{e}");
        let e = rejected(&GOOD.replace(r#"target = "cases-2""#, r#"target = "cases-9""#));
        assert!(e.reason.ends_with("(see docs/scenarios.md#faults, [[faults]])"), "{e}");
        let e = rejected(&GOOD.replace(r#"no_loss = "hold""#, r#"no_loss = "maybe""#));
        assert!(e.reason.ends_with("(see docs/scenarios.md#expect, [expect])"), "{e}");
        let e = rejected(&GOOD.replace("name = ", "nmae = "));
        assert!(e.reason.ends_with("(see docs/scenarios.md#top-level-keys)"), "{e}");
        // A key named in the description is not taken for the key: the line is the key's.
        let described = GOOD
            .replacen("\n", "\ndescription = \"\"\"\nwhat after_heal means:\nafter_heal writes come once every fault healed\"\"\"\n", 1)
            .replace("rate = 50", "rate = 50\nafter_heal = 0");
        let e = rejected(&described);
        assert!(e.reason.contains("after_heal must be at least 1"), "{e}");
        assert_eq!(described.lines().nth(e.line - 1).map(str::trim), Some("after_heal = 0"), "{e}");
        let e = rejected(&GOOD.replace("cases = { replicas = 2 }", "cases = { replicas = 4294967296 }"));
        assert!(e.reason.contains("expected a replica count"), "{e}");
        // The doc has every section an error can point at.
        let doc = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../docs/scenarios.md")).expect("docs/scenarios.md");
        for heading in ["## Top-level keys", "## [fleet]", "## [deploy]", "## [settings]", "## [workload]", "## [partner]", "## [[faults]]", "## [expect]"] {
            assert!(doc.lines().any(|l| l.trim() == heading), "docs/scenarios.md lacks {heading}");
        }
    }

    #[test]
    fn syntax_errors_carry_the_line() {
        let e = rejected("name = \"t\"\namendment = \"x\"\n[fleet\n");
        assert_eq!(e.line, 3, "{e}");
    }
}
