//! The workload: what the harness asks of the system, with every attempt and its outcome
//! in the history. One interface, [`Writer::write`]; a new workload kind is a new arm here,
//! not a change to the runner's sequence.

use std::sync::Arc;
use std::time::Duration;

use rand::{RngExt, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde_json::json;
use sqlx::PgPool;
use tokio::sync::{Mutex, watch};
use tokio::time::Instant;
use uuid::Uuid;

use super::{COLLECT, Log, PROBE, Replicas, bounded};
use crate::history::{Event, Outcome};
use crate::process::Replica;
use crate::scenario::{Scenario, WorkloadKind};

/// What the workload stages straight into the databases, around the replicas' start: a
/// new staged kind is a field and a line here, never a change to the runner's sequence.
pub(super) struct Staged {
    /// Malformed outbox rows (`[workload] poison_rows`), staged before any replica starts.
    pub poison: Vec<Uuid>,
    /// Referrals written "long ago" (`[workload] backdated`), recorded once the clock runs.
    pub backdated: Vec<Uuid>,
    /// Dedup records at the edge of an inbox window: (service, envelope, age ms).
    pub edges: Vec<(String, Uuid, u64)>,
}

impl Staged {
    /// Before the replicas start: the poison rows, older than anything the workload writes;
    /// in financial's database, the transition recorder and the send-queue backlog.
    pub(super) async fn before_start(s: &Scenario, pools: &std::collections::BTreeMap<String, PgPool>) -> anyhow::Result<Self> {
        use anyhow::Context as _;
        let cases = pools.get("cases").context("fleet has no cases")?;
        for pool in pools.values() {
            record_pending_deletes(pool).await?;
        }
        // Issue 22.1: the redelivery floors count on the database's word, not the nodes'
        // counters (a counter that lies would make a run conclusive that never redelivered).
        let fails_over = s.faults.iter().any(|f| f.get_ref().kind == crate::scenario::FaultKind::Failover);
        if s.floor.redeliveries > 0 {
            for pool in pools.values() {
                count_inbox_redeliveries(pool, !fails_over).await?;
            }
        }
        if s.floor.dlq_duplicates > 0 && fails_over {
            anyhow::bail!(
                "min_dlq_duplicates with a failover: the dead-letter counter is an unlogged sequence, which a promoted PostgreSQL 15 standby can hold without its row (seen on 15.18), and then every audit insert would fail"
            );
        }
        if s.floor.dlq_duplicates > 0 {
            if let Some(security) = pools.get("security") {
                count_dead_letter_redeliveries(security).await?;
            }
        }
        // Only an exports run has §D5 rows for sentinel_integrity to read the versions of:
        // elsewhere the recorder would be one more insert on the system's path, for nothing.
        if s.workload.kind == WorkloadKind::Exports {
            record_claim_versions(cases).await?;
        }
        if let Some(security) = pools.get("security") {
            record_staging_transactions(security).await?;
        }
        if let Some(financial) = pools.get("financial") {
            record_transaction_transitions(financial).await?;
            record_send_job_releases(financial).await?;
            stage_send_jobs(financial, s.workload.send_jobs, s.workload.send_overdue_ms).await?;
        }
        let backdated = stage_backdated(cases, s.workload.backdated).await?;
        // Issue 22.6: where the run prunes (backdated rows ask for it), every consumer's
        // inbox gets dedup records half a day inside and half a day past its window, and a
        // recorder of every inbox DELETE with the row's age.
        let mut edges = Vec::new();
        if s.workload.backdated > 0 {
            let consumes = |svc: &str| svc.parse::<craig_fleet::Service>().is_ok_and(|x| !x.consumes().is_empty());
            for (svc, pool) in pools.iter().filter(|(svc, _)| consumes(svc)) {
                edges.extend(stage_inbox_edges(svc, pool).await?);
            }
        }
        Ok(Self { poison: stage_poison_rows(cases, s.workload.poison_rows).await?, backdated, edges })
    }

    /// Once the run's clock started (and the dead-letter tap is bound): record the poison
    /// rows, then stage the dead letters of both paths and record each.
    pub(super) async fn after_start(&self, s: &Scenario, log: &Log, pools: &std::collections::BTreeMap<String, PgPool>) -> anyhow::Result<()> {
        use anyhow::Context as _;
        let cases = pools.get("cases").context("fleet has no cases")?;
        for envelope in &self.poison {
            log.push(Event::Poison { envelope: *envelope, service: "cases".into() });
        }
        for (service, envelope, age_ms) in &self.edges {
            log.push_at(0, Event::InboxEdge { envelope: *envelope, service: service.clone(), age_ms: *age_ms });
        }
        for referral in &self.backdated {
            // Acknowledged long ago by a cases replica of this fleet.
            log.push_at(0, Event::Write { referral: *referral, replica: "cases-1".into(), outcome: Outcome::Ok, status: Some(201), answered_ms: None });
            log.push_at(0, Event::Backdated { referral: *referral });
        }
        for (event_type, n, service) in [
            (craig_fleet::cases::REFERRAL_CREATED, s.workload.dead_letters, "rules"),
            (craig_fleet::cases::PLACEMENT_ACTIVATED, s.workload.placement_dead_letters, "financial"),
        ] {
            for envelope in stage_dead_letters(cases, event_type, n).await? {
                log.push(Event::DeadLetterStaged { envelope, service: service.into() });
            }
        }
        if s.workload.app_dead_letters > 0 {
            let rules = pools.get("rules").context("app_dead_letters needs rules in the fleet")?;
            for envelope in stage_app_dead_letters(cases, rules, s.workload.app_dead_letters).await? {
                log.push(Event::DeadLetterStaged { envelope, service: "rules".into() });
            }
        }
        Ok(())
    }
}

/// What a workload writes through.
pub(super) struct Writer<'a> {
    pub s: &'a Scenario,
    pub log: &'a Log,
    pub replicas: &'a Replicas,
    pub cases: &'a PgPool,
    pub secret: &'a str,
    /// `kind = "exports"`: the (key, size) of each first-phase request, which the after-heal
    /// phase retries.
    pub exports: std::sync::Mutex<Vec<(String, u64)>>,
}

impl Writer<'_> {
    /// `count` operations at the scenario's rate, numbered from `first` (so a replica
    /// rotation goes on across phases), drawn from `seed`; `done` counts completions.
    pub(super) async fn write(&self, seed: u64, range: (u32, u32), done: watch::Sender<u32>) {
        // HTTP writes through the cases replicas (plus rolled-back writes): referrals or
        // placement activations; or the §D5 exports workload.
        match self.s.workload.kind {
            WorkloadKind::Exports => export_requests(self, seed, range, done).await,
            _ => http_writes(self, seed, range, done).await,
        }
    }
}

impl Writer<'_> {
    /// Two admin replays through a cases replica (§D4, #965/#1129): a window starting an
    /// hour inside the outbox retention (accepted), and one starting an hour past it
    /// (must be refused with 422). Each recorded with its answer.
    pub(super) async fn replays(&self) {
        const DAY_MS: u64 = 86_400_000;
        let window_ms = 30 * DAY_MS;
        let key = craig_api::JwtKey::new(self.secret);
        let token = key.sign(&craig_api::Claims {
            sub: Uuid::now_v7(),
            aud: vec!["craig-cases".into()],
            scope: "cases.admin".into(),
            exp: chrono::Utc::now().timestamp() + 3600,
        });
        let http = reqwest::Client::builder().timeout(Duration::from_secs(10)).build().expect("http client");
        for from_age_ms in [window_ms - 3_600_000, window_ms + 3_600_000] {
            let Some((name, addr)) = self.any_cases_replica().await else { continue };
            let now = chrono::Utc::now();
            let from = now - chrono::Duration::milliseconds(from_age_ms as i64);
            let rfc = |t: chrono::DateTime<chrono::Utc>| t.to_rfc3339_opts(chrono::SecondsFormat::Millis, true);
            let url = format!("http://{addr}/v1/cases/admin/events/replay?from={}&to={}", rfc(from), rfc(now + chrono::Duration::seconds(1)));
            let answer = http.post(url).bearer_auth(&token).send().await;
            let (status, restaged) = match answer {
                Ok(r) => {
                    let status = r.status().as_u16();
                    let body: Option<serde_json::Value> = r.json().await.ok();
                    (Some(status), body.and_then(|b| b.get("restaged").and_then(|n| n.as_i64())))
                }
                Err(_) => (None, None),
            };
            self.log.push(Event::Replay { replica: name, from_age_ms, window_ms, status, restaged });
        }
    }

    /// The first cases replica that is up, with its address.
    async fn any_cases_replica(&self) -> Option<(String, String)> {
        for (name, r) in self.replicas.iter().filter(|(n, _)| n.starts_with("cases-")) {
            if let Some(addr) = r.lock().await.addr.clone() {
                return Some((name.clone(), addr));
            }
        }
        None
    }
}

/// One write of the workload's kind: the path, the body and the status that acknowledges
/// it, for the aggregate `id` the harness chose (its referral or placement id).
fn request(kind: WorkloadKind, id: Uuid, rng: &mut ChaCha8Rng) -> (String, serde_json::Value, u16) {
    use fake::Fake;
    match kind {
        WorkloadKind::Referrals => {
            let subject: String = fake::faker::name::en::Name().fake_with_rng(rng);
            ("/v1/cases/referrals".into(), json!({ "id": id, "subject": subject }), 201)
        }
        WorkloadKind::Placements => {
            let care_level = if rng.random_bool(0.5) { "standard" } else { "enhanced" };
            (format!("/v1/cases/placements/{id}/activate"), json!({ "care_level": care_level }), 200)
        }
        WorkloadKind::Exports => unreachable!("exports go through export_requests"),
    }
}

/// The cases replicas that are up (their lock free, an address known), starting the round
/// robin at `i`: like a load balancer, a replica down or being restarted is skipped.
fn up_replicas(replicas: &Replicas, i: usize) -> Vec<(String, String)> {
    let cases: Vec<(&String, &Arc<Mutex<Replica>>)> = replicas.iter().filter(|(n, _)| n.starts_with("cases-")).collect();
    let n = cases.len();
    (0..n)
        .filter_map(|k| {
            let (name, r) = cases[(i + k) % n];
            let r = r.try_lock().ok()?;
            r.addr.clone().map(|a| (name.clone(), a))
        })
        .collect()
}

/// The §D5 HTTP workload: `count` requests to `POST /v1/cases/exports?size=N`, each with an
/// `Idempotency-Key`. In the first phase each request is a new key (or, `requery_share`, the
/// previous key with another size), sent to one replica or, `race`, to two at once; a
/// `cancel_share` of them go away after the first chunk. In the after-heal phase request i
/// retries the first phase's request i, and every request of the first phase is retried. A 409 is retried every second (sooner than its
/// `Retry-After`, the claim's whole remaining life) until the claim must have expired. Every exchange is recorded ([`Event::HttpExchange`]).
async fn export_requests(w: &Writer<'_>, seed: u64, (first, count): (u32, u32), done: watch::Sender<u32>) {
    let s = w.s;
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let http = reqwest::Client::builder().timeout(Duration::from_secs(15)).build().expect("http client");
    // One user for the whole run (both phases): the key space is per `sub`.
    let digest = craig_api::idempotency::body_fingerprint(w.secret.as_bytes());
    let sub = Uuid::from_u64_pair(0xc4a0_5eed, u64::from_str_radix(&digest[..16], 16).expect("hex digest"));
    let token = craig_api::JwtKey::new(w.secret).sign(&craig_api::Claims {
        sub,
        aud: vec!["craig-cases".into()],
        scope: String::new(),
        exp: chrono::Utc::now().timestamp() + 24 * 3600,
    });
    let retrying = first >= s.workload.writes;
    let claim_secs = s.settings.idempotency_claim_secs;
    let gap = Duration::from_secs_f64(1.0 / s.workload.rate);
    let began = Instant::now();
    let inflight = Arc::new(tokio::sync::Semaphore::new(64));
    let done = Arc::new(done);
    let completed = Arc::new(std::sync::atomic::AtomicU32::new(0));
    let mut tasks = tokio::task::JoinSet::new();
    let sizes = &s.workload.export_sizes;
    // After the faults every key asked for is retried (issue 22.6: each must end with a
    // judged 200), however few after-heal writes the scenario names.
    let count = if retrying { count.max(w.exports.lock().expect("export plan").len() as u32) } else { count };
    for k in 0..count {
        let i = first + k;
        tokio::time::sleep_until(began + gap * k).await;
        let (key, size) = {
            let mut plan = w.exports.lock().expect("export plan");
            if retrying {
                match plan.get(k as usize % plan.len().max(1)) {
                    Some(op) => op.clone(),
                    None => break,
                }
            } else {
                let op = match plan.last() {
                    Some((key, size)) if rng.random_bool(s.workload.requery_share) => {
                        let other = sizes.iter().copied().find(|n| n != size).unwrap_or(size + 1);
                        (key.clone(), other)
                    }
                    _ => (format!("chaos-{seed:x}-{i}"), sizes[i as usize % sizes.len()]),
                };
                plan.push(op.clone());
                op
            }
        };
        let cancel = !retrying && rng.random_bool(s.workload.cancel_share);
        let mut up = up_replicas(w.replicas, i as usize);
        // After the heal every key must get its answer (issue 22.6): a replica whose lock
        // is held for a moment is waited for (up to 5 s), never recorded as "none up".
        if retrying {
            for _ in 0..50 {
                if !up.is_empty() {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
                up = up_replicas(w.replicas, i as usize);
            }
        }
        let targets: Vec<(String, String)> = if s.workload.race && !retrying { up.into_iter().take(2).collect() } else { up.into_iter().take(1).collect() };
        let permit = inflight.clone().acquire_owned().await.expect("semaphore open");
        let (http, token, log, done, completed) = (http.clone(), token.clone(), w.log.clone(), done.clone(), completed.clone());
        tasks.spawn(async move {
            if targets.is_empty() {
                // No replica up: nothing was sent.
                log.push(Event::unanswered_exchange(&key, size, "none"));
            } else {
                let sends = targets.into_iter().enumerate().map(|(n, (name, addr))| {
                    let (http, token, log, key) = (http.clone(), token.clone(), log.clone(), key.clone());
                    // The race's second client cancels never: one of them reads the body.
                    async move { export_exchange(&http, &log, &token, (&name, &addr), (&key, size), cancel && n == 0, claim_secs + 3).await }
                });
                futures_util::future::join_all(sends).await;
            }
            let n = completed.fetch_add(1, std::sync::atomic::Ordering::Relaxed) + 1;
            done.send_replace(n);
            drop(permit);
        });
    }
    while tasks.join_next().await.is_some() {}
}

/// One client's exchange for (`key`, `size`) with `replica`, 409s retried after their
/// `Retry-After`; each attempt recorded.
async fn export_exchange(
    http: &reqwest::Client,
    log: &Log,
    token: &str,
    (replica, addr): (&str, &str),
    (key, size): (&str, u64),
    cancel: bool,
    attempts: u64,
) {
    for _attempt in 0..attempts {
        let t = log.now();
        let sent = http
            .post(format!("http://{addr}/v1/cases/exports?size={size}"))
            .header(craig_api::idempotency::IDEMPOTENCY_KEY, key)
            .bearer_auth(token)
            .json(&json!({ "format": "chaos" }))
            .send()
            .await;
        let mut ex = Event::unanswered_exchange(key, size, replica);
        let mut wait = None;
        if let (Ok(mut resp), Event::HttpExchange { status, replayed, too_large, body_len, body_sha256, cancelled, retry_after, .. }) = (sent, &mut ex) {
            let h = resp.headers();
            *status = Some(resp.status().as_u16());
            *replayed = h.contains_key(craig_api::idempotency::REPLAYED_HEADER);
            *too_large = h.contains_key(craig_api::idempotency::BODY_TOO_LARGE_HEADER);
            if resp.status() == reqwest::StatusCode::CONFLICT {
                *retry_after = h.get("retry-after").and_then(|v| v.to_str().ok()?.parse::<u64>().ok());
                // The claim's remaining life bounds the wait; a client may poll sooner, this one
                // after at most a second.
                wait = Some(Duration::from_secs(1));
            }
            if cancel && resp.status().is_success() {
                // Read the first chunk, then go away.
                if let Ok(Some(chunk)) = resp.chunk().await {
                    *body_len = chunk.len() as u64;
                }
                *cancelled = true;
            } else if let Ok(bytes) = resp.bytes().await {
                *body_len = bytes.len() as u64;
                *body_sha256 = Some(craig_api::idempotency::body_fingerprint(&bytes));
            }
        }
        log.push_at(t, ex);
        match wait {
            Some(pause) => tokio::time::sleep(pause).await,
            None => return,
        }
    }
}

/// `count` writes at the scenario's rate through the cases replicas (round robin), numbered
/// from `first` (so the replica rotation goes on across phases); `done` counts completions.
async fn http_writes(
    Writer { s, log, replicas, cases, secret, .. }: &Writer<'_>,
    seed: u64,
    (first, count): (u32, u32),
    done: watch::Sender<u32>,
) {
    let (s, log, replicas, cases, secret) = (*s, *log, *replicas, *cases, *secret);
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let cases_replicas: Vec<Arc<Mutex<Replica>>> =
        replicas.iter().filter(|(n, _)| n.starts_with("cases-")).map(|(_, r)| r.clone()).collect();
    let http = reqwest::Client::builder().timeout(Duration::from_secs(5)).build().expect("http client");
    let key = craig_api::JwtKey::new(secret);
    let token = key.sign(&craig_api::Claims {
        sub: Uuid::now_v7(),
        aud: vec!["craig-cases".into()],
        scope: String::new(),
        exp: chrono::Utc::now().timestamp() + 24 * 3600,
    });
    let gap = Duration::from_secs_f64(1.0 / s.workload.rate);
    let began = Instant::now();
    let inflight = Arc::new(tokio::sync::Semaphore::new(64));
    let completed = Arc::new(std::sync::atomic::AtomicU32::new(0));
    let done = Arc::new(done);
    let mut tasks = tokio::task::JoinSet::new();
    for k in 0..count {
        let i = first + k;
        tokio::time::sleep_until(began + gap * k).await;
        if rng.random_bool(s.workload.rollback_share) {
            // Bounded: a paused database must not stall the workload's schedule.
            let _ = tokio::time::timeout(PROBE, rolled_back_write(log, cases)).await;
        }
        let referral = Uuid::now_v7();
        let (path, body, acked) = request(s.workload.kind, referral, &mut rng);
        // Round robin, like a load balancer: a replica that is down or being restarted
        // (its lock held by a fault) is skipped for the next one that is up.
        let n = cases_replicas.len();
        let mut pick = (i as usize % n, None);
        for k in 0..n {
            let j = (i as usize + k) % n;
            if let Ok(r) = cases_replicas[j].try_lock() {
                if let Some(addr) = r.addr.clone() {
                    pick = (j, Some(addr));
                    break;
                }
            }
        }
        let (j, addr) = pick;
        let permit = inflight.clone().acquire_owned().await.expect("semaphore open");
        let (http, token, log, completed, done) = (http.clone(), token.clone(), log.clone(), completed.clone(), done.clone());
        let replica_name = format!("cases-{}", j + 1);
        tasks.spawn(async move {
            let t = log.now();
            let (outcome, status) = match addr {
                None => (Outcome::Failed, None), // replica down: nothing was sent
                Some(addr) => {
                    // §D5: every write names its key (the aggregate id the harness chose).
                    let sent = http
                        .post(format!("http://{addr}{path}"))
                        .header(craig_api::idempotency::IDEMPOTENCY_KEY, referral.to_string())
                        .bearer_auth(&token)
                        .json(&body)
                        .send()
                        .await;
                    match sent {
                        Ok(resp) => {
                            let code = resp.status().as_u16();
                            let o = match code {
                                c if c == acked => Outcome::Ok,
                                400..=499 => Outcome::Failed,
                                _ => Outcome::Unknown,
                            };
                            (o, Some(code))
                        }
                        Err(e) if e.is_connect() => (Outcome::Failed, None),
                        Err(_) => (Outcome::Unknown, None),
                    }
                }
            };
            // When the client heard its answer (issue 26: a failover's excuse needs to know
            // whether the commit can have come after what the standby applied).
            let answered_ms = Some(log.now());
            log.push_at(t, Event::Write { referral, replica: replica_name, outcome, status, answered_ms });
            let n = completed.fetch_add(1, std::sync::atomic::Ordering::Relaxed) + 1;
            done.send_replace(n);
            drop(permit);
        });
    }
    while tasks.join_next().await.is_some() {}
}

/// A write staged in a transaction the harness rolls back: its event must never appear.
async fn rolled_back_write(log: &Log, cases: &PgPool) {
    let referral = Uuid::now_v7();
    let Ok(env) = craig_mq::EventEnvelope::new(
        craig_fleet::cases::REFERRAL_CREATED,
        "cases",
        Some(referral),
        json!({ "referral_id": referral, "subject": "rolled back" }),
    ) else {
        return;
    };
    let Ok(mut tx) = cases.begin().await else { return };
    let staged = sqlx::query("INSERT INTO referrals (id, subject, created_by) VALUES ($1, 'rolled back', $1)")
        .bind(referral)
        .execute(&mut *tx)
        .await
        .is_ok()
        && craig_mq::publish_in_tx(&mut tx, &env).await.is_ok();
    if staged && tx.rollback().await.is_ok() {
        log.push(Event::RolledBack { referral });
    }
}

/// `n` envelopes of `event_type` staged through cases' outbox (their ids returned), valid but
/// without the aggregate id their consumer needs (`referral_id` for rules, `placement_id`
/// for financial): the consumer refuses each permanently and the broker dead-letters it
/// under `dlq.<its consumer queue>` (§D3 broker path).
async fn stage_dead_letters(cases: &PgPool, event_type: &str, n: u32) -> anyhow::Result<Vec<Uuid>> {
    if n == 0 {
        return Ok(Vec::new());
    }
    let mut ids = Vec::new();
    let mut tx = bounded(COLLECT, "staging dead letters", cases.begin()).await?;
    for i in 0..n {
        let payload = json!({ "subject": format!("chaos dead letter {i}"), "care_level": "standard", "days": 1 });
        let env = craig_mq::EventEnvelope::new(event_type, "cases", None, payload)?;
        bounded(COLLECT, "staging a dead letter", craig_mq::publish_in_tx(&mut tx, &env)).await?;
        ids.push(env.id);
    }
    bounded(COLLECT, "staging dead letters", tx.commit()).await?;
    Ok(ids)
}

/// Malformed rows written straight into the outbox (by hand, or by an older replica),
/// older than anything the workload stages. Returns their ids.
async fn stage_poison_rows(cases: &PgPool, n: u32) -> anyhow::Result<Vec<Uuid>> {
    let mut ids = Vec::new();
    for i in 0..n {
        let id: Uuid = bounded(
            COLLECT,
            "writing a poison row",
            sqlx::query_scalar(
                "INSERT INTO event_outbox (event_type, envelope, created_at) \
                 VALUES ('case.referral_created', $1, now() - interval '1 hour') RETURNING id",
            )
            .bind(json!({ "poison": i, "note": "not an envelope: written by hand" }))
            .fetch_one(cases),
        )
        .await?;
        ids.push(id);
    }
    Ok(ids)
}

/// `n` referral envelopes staged through cases' outbox whose evaluation fails TRANSIENTLY:
/// a trigger on rules' `rule_evaluations` raises (SQLSTATE P0001, no constraint, which the
/// rules handler classifies transient) for every referral listed in
/// `chaos_failing_referrals`. Only rules' inbox retry cap ends it, on the app path (§D3,
/// #1196). Their envelope ids returned.
async fn stage_app_dead_letters(cases: &PgPool, rules: &PgPool, n: u32) -> anyhow::Result<Vec<Uuid>> {
    execute_all(rules, "installing the failing-evaluation trigger in rules' database", &[
        "CREATE TABLE IF NOT EXISTS chaos_failing_referrals (referral_id uuid PRIMARY KEY)",
        "CREATE OR REPLACE FUNCTION chaos_fail_evaluation() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN \
           IF EXISTS (SELECT 1 FROM chaos_failing_referrals WHERE referral_id = NEW.referral_id) THEN \
             RAISE EXCEPTION 'chaos: injected transient failure for referral %', NEW.referral_id; \
           END IF; RETURN NEW; END $$",
        "DROP TRIGGER IF EXISTS chaos_fail ON rule_evaluations",
        "CREATE TRIGGER chaos_fail BEFORE INSERT ON rule_evaluations FOR EACH ROW EXECUTE FUNCTION chaos_fail_evaluation()",
    ])
    .await?;
    let mut ids = Vec::new();
    let mut tx = bounded(COLLECT, "staging app-path dead letters", cases.begin()).await?;
    for i in 0..n {
        let referral = Uuid::now_v7();
        bounded(
            COLLECT,
            "listing a failing referral",
            sqlx::query("INSERT INTO chaos_failing_referrals (referral_id) VALUES ($1)").bind(referral).execute(rules),
        )
        .await?;
        let env = craig_mq::EventEnvelope::new(
            "case.referral_created",
            "cases",
            Some(referral),
            json!({ "referral_id": referral, "subject": format!("chaos app-path dead letter {i}") }),
        )?;
        bounded(COLLECT, "staging an app-path dead letter", craig_mq::publish_in_tx(&mut tx, &env)).await?;
        ids.push(env.id);
    }
    bounded(COLLECT, "staging app-path dead letters", tx.commit()).await?;
    Ok(ids)
}

/// A trigger on financial's `exchange_transactions` that records every status change into
/// `chaos_transaction_transitions` (#1185: the harness sees an old replica's bare-id UPDATE
/// as well as a current one's guarded one).
async fn record_transaction_transitions(financial: &PgPool) -> anyhow::Result<()> {
    execute_all(financial, "installing the transition recorder in financial's database", &[
        "CREATE TABLE IF NOT EXISTS chaos_transaction_transitions (id bigserial PRIMARY KEY, transaction_id uuid NOT NULL, \
           from_status text NOT NULL, to_status text NOT NULL, at timestamptz NOT NULL DEFAULT clock_timestamp())",
        "CREATE OR REPLACE FUNCTION chaos_record_transition() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN \
           IF NEW.status IS DISTINCT FROM OLD.status THEN \
             INSERT INTO chaos_transaction_transitions (transaction_id, from_status, to_status) VALUES (NEW.id, OLD.status, NEW.status); \
           END IF; RETURN NEW; END $$",
        "DROP TRIGGER IF EXISTS chaos_transition ON exchange_transactions",
        "CREATE TRIGGER chaos_transition AFTER UPDATE ON exchange_transactions FOR EACH ROW EXECUTE FUNCTION chaos_record_transition()",
    ])
    .await
}

/// The sequence `min_redeliveries` reads (issue 22.1): a trigger before every insert into
/// the service's §D2 `event_inbox` counts the deliveries of an envelope the inbox already
/// holds processed. The inbox's `INSERT … ON CONFLICT DO NOTHING` fires it for a proposed
/// row that then conflicts, and a sequence keeps its count whatever the transaction does.
/// Unlogged: a logged sequence may come back from a crash of its server up to 32 ahead of
/// its true count (PostgreSQL logs sequences ahead), an unlogged one comes back at zero, so
/// a count can only fall short, never meet a floor with arrivals that never happened.
/// It counts arrivals; whether the handler then stayed skipped is `effect_once`'s to judge.
///
/// Beside the count, each arrival's record: when the inbox row it met was stamped processed
/// (`chaos_inbox_redelivery_hits`, unlogged too, written in the inbox's own transaction, so
/// a rolled-back arrival leaves no row: it can only fall short; the row gives the arrival's
/// transaction an id, so where it also wrote WAL its commit waits for a synchronous standby,
/// as every other write does, where `nextval` alone did not). After a failover both start
/// at zero on the promoted server, and the floor counts only the arrivals that met a record
/// stamped before the failover: an inbox record the failover kept, not one made after it.
///
/// Where the scenario fails over (`sequence` false), only the records are kept, and the
/// floor reads nothing else: PostgreSQL 15.18 (the containers backend's stand-in image) left
/// an unlogged sequence created after the base backup without its row on the promoted
/// standby, and `nextval` there fails ("bad magic number in sequence"), which would have
/// failed the inbox insert itself, the system under test's write (15.20 keeps the row).
async fn count_inbox_redeliveries(pool: &PgPool, sequence: bool) -> anyhow::Result<()> {
    let count = if sequence {
        "CREATE OR REPLACE FUNCTION chaos_count_inbox_redelivery() RETURNS trigger LANGUAGE plpgsql AS $$ \
         DECLARE stamped timestamptz; BEGIN \
           SELECT processed_at INTO stamped FROM event_inbox WHERE envelope_id = NEW.envelope_id AND processed_at IS NOT NULL LIMIT 1; \
           IF FOUND THEN \
             PERFORM nextval('chaos_inbox_redeliveries'); \
             INSERT INTO chaos_inbox_redelivery_hits (processed_at) VALUES (stamped); \
           END IF; RETURN NEW; END $$"
    } else {
        "CREATE OR REPLACE FUNCTION chaos_count_inbox_redelivery() RETURNS trigger LANGUAGE plpgsql AS $$ \
         DECLARE stamped timestamptz; BEGIN \
           SELECT processed_at INTO stamped FROM event_inbox WHERE envelope_id = NEW.envelope_id AND processed_at IS NOT NULL LIMIT 1; \
           IF FOUND THEN \
             INSERT INTO chaos_inbox_redelivery_hits (processed_at) VALUES (stamped); \
           END IF; RETURN NEW; END $$"
    };
    let sequence = if sequence { "CREATE UNLOGGED SEQUENCE IF NOT EXISTS chaos_inbox_redeliveries" } else { "SELECT 1" };
    execute_all(pool, "installing the inbox redelivery counter", &[
        sequence,
        "CREATE UNLOGGED TABLE IF NOT EXISTS chaos_inbox_redelivery_hits (processed_at timestamptz NOT NULL)",
        count,
        "DROP TRIGGER IF EXISTS chaos_inbox_redelivery ON event_inbox",
        "CREATE TRIGGER chaos_inbox_redelivery BEFORE INSERT ON event_inbox FOR EACH ROW EXECUTE FUNCTION chaos_count_inbox_redelivery()",
    ])
    .await
}

/// The sequence `min_dlq_duplicates` reads (issue 22.1): a trigger before every insert into
/// security's `dead_letter_audit` counts the arrivals of an occurrence already recorded with
/// the same immutable facts (#1181 R7: what the arbiter absorbs as a phantom). The phantom's
/// transaction rolls back; the sequence keeps the count (unlogged, as above). It counts
/// arrivals; one audit row per occurrence is `dlq_occurrence_once`'s to judge.
async fn count_dead_letter_redeliveries(security: &PgPool) -> anyhow::Result<()> {
    execute_all(security, "installing the dead-letter redelivery counter in security's database", &[
        "CREATE UNLOGGED SEQUENCE IF NOT EXISTS chaos_dead_letter_redeliveries",
        "CREATE OR REPLACE FUNCTION chaos_count_dead_letter_redelivery() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN \
           IF NEW.occurrence_token IS NOT NULL AND EXISTS (SELECT 1 FROM dead_letter_audit a \
               WHERE a.occurrence_token = NEW.occurrence_token AND a.envelope_id IS NOT DISTINCT FROM NEW.envelope_id \
                 AND a.original_queue IS NOT DISTINCT FROM NEW.original_queue AND a.event_type IS NOT DISTINCT FROM NEW.event_type \
                 AND a.envelope IS NOT DISTINCT FROM NEW.envelope) THEN \
             PERFORM nextval('chaos_dead_letter_redeliveries'); \
           END IF; RETURN NEW; END $$",
        "DROP TRIGGER IF EXISTS chaos_dead_letter_redelivery ON dead_letter_audit",
        "CREATE TRIGGER chaos_dead_letter_redelivery BEFORE INSERT ON dead_letter_audit FOR EACH ROW \
           EXECUTE FUNCTION chaos_count_dead_letter_redelivery()",
    ])
    .await
}

/// A trigger on cases' `idempotency_responses` that records every version of every §D5 row
/// (`chaos_claim_versions`: its claim generation, status and claim expiry, when it was
/// written), so `sentinel_integrity` excuses a re-run on the database's word: the first
/// run's generation never left `processing` (its finalize never applied), and the next
/// generation was claimed only once that claim had expired.
async fn record_claim_versions(cases: &PgPool) -> anyhow::Result<()> {
    execute_all(cases, "installing the claim recorder in cases' database", &[
        "CREATE TABLE IF NOT EXISTS chaos_claim_versions (id bigserial PRIMARY KEY, cache_key text NOT NULL, \
           claim_generation bigint NOT NULL, status text NOT NULL, claim_expires_at timestamptz, \
           at timestamptz NOT NULL DEFAULT clock_timestamp())",
        "CREATE OR REPLACE FUNCTION chaos_record_claim_version() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN \
           INSERT INTO chaos_claim_versions (cache_key, claim_generation, status, claim_expires_at) \
             VALUES (NEW.cache_key, NEW.claim_generation, NEW.status, NEW.claim_expires_at); \
           RETURN NEW; END $$",
        "DROP TRIGGER IF EXISTS chaos_claim_version ON idempotency_responses",
        "CREATE TRIGGER chaos_claim_version AFTER INSERT OR UPDATE ON idempotency_responses FOR EACH ROW EXECUTE FUNCTION chaos_record_claim_version()",
    ])
    .await
}

/// A trigger on financial's `exchange_send_jobs` that records every claim the database saw
/// end back in the queue as a retry (`in_flight -> pending` with `attempts + 1`: the
/// sender's fenced retry, issue 22.8; a pre-#1185 boot sweep touches no `attempts`), with
/// the claim generation it ended, so `fencing` excuses a re-send on the database's word as
/// well as the sender's log line. Also every claim with the generation it moved from and
/// to (issue 26: what the database that survived a failover still holds of them).
async fn record_send_job_releases(financial: &PgPool) -> anyhow::Result<()> {
    execute_all(financial, "installing the send-job release recorder in financial's database", &[
        "CREATE TABLE IF NOT EXISTS chaos_send_job_releases (id bigserial PRIMARY KEY, correlation_id uuid NOT NULL, \
           claim_generation bigint NOT NULL, at timestamptz NOT NULL DEFAULT clock_timestamp())",
        "CREATE OR REPLACE FUNCTION chaos_record_send_job_release() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN \
           IF OLD.status = 'in_flight' AND NEW.status = 'pending' AND NEW.attempts = OLD.attempts + 1 THEN \
             INSERT INTO chaos_send_job_releases (correlation_id, claim_generation) VALUES (OLD.correlation_id, OLD.claim_generation); \
           END IF; RETURN NEW; END $$",
        "DROP TRIGGER IF EXISTS chaos_send_job_release ON exchange_send_jobs",
        "CREATE TRIGGER chaos_send_job_release AFTER UPDATE ON exchange_send_jobs FOR EACH ROW EXECUTE FUNCTION chaos_record_send_job_release()",
        // Issue 26: every claim, with the generation it moved from and to.
        "CREATE TABLE IF NOT EXISTS chaos_send_job_claims (id bigserial PRIMARY KEY, correlation_id uuid NOT NULL, \
           from_generation bigint NOT NULL, claim_generation bigint NOT NULL, at timestamptz NOT NULL DEFAULT clock_timestamp())",
        "CREATE OR REPLACE FUNCTION chaos_record_send_job_claim() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN \
           IF NEW.status = 'in_flight' AND (OLD.status IS DISTINCT FROM 'in_flight' OR NEW.claim_generation IS DISTINCT FROM OLD.claim_generation) THEN \
             INSERT INTO chaos_send_job_claims (correlation_id, from_generation, claim_generation) VALUES (NEW.correlation_id, OLD.claim_generation, NEW.claim_generation); \
           END IF; RETURN NEW; END $$",
        "DROP TRIGGER IF EXISTS chaos_send_job_claim ON exchange_send_jobs",
        "CREATE TRIGGER chaos_send_job_claim AFTER UPDATE ON exchange_send_jobs FOR EACH ROW EXECUTE FUNCTION chaos_record_send_job_claim()",
    ])
    .await
}

/// `n` transmissions (transaction + send job) in financial's send queue, already
/// `overdue_ms` past their `next_attempt_at`: a backlog (#1185).
async fn stage_send_jobs(financial: &PgPool, n: u32, overdue_ms: u64) -> anyhow::Result<()> {
    if n == 0 {
        return Ok(());
    }
    let mut tx = bounded(COLLECT, "staging send jobs", financial.begin()).await?;
    let mut transactions = Vec::new();
    for i in 0..n {
        let payload = json!({ "chaos_backlog": i, "amount_cents": 1000 + i });
        transactions.push(bounded(COLLECT, "staging a send job", craig_fleet::send_jobs::stage_in_tx(&mut tx, None, &payload)).await?);
    }
    bounded(
        COLLECT,
        "backdating the send jobs",
        sqlx::query("UPDATE exchange_send_jobs SET next_attempt_at = now() - make_interval(secs => $1) WHERE transaction_id = ANY($2)")
            .bind(overdue_ms as f64 / 1000.0)
            .bind(&transactions)
            .execute(&mut *tx),
    )
    .await?;
    bounded(COLLECT, "staging send jobs", tx.commit()).await?;
    Ok(())
}

/// A trigger on security's `event_outbox` that records which transaction staged each row
/// (`chaos_outbox_tx`, as `xmin` spells it): the stamp rewrites the row's own `xmin`, and
/// `threshold_crossing_once` matches a threshold event to the `dead_letter_audit` row
/// written in the same transaction (issue 22.4), never to the count the event reports.
async fn record_staging_transactions(security: &PgPool) -> anyhow::Result<()> {
    execute_all(security, "installing the staging-transaction recorder in security's database", &[
        "CREATE TABLE IF NOT EXISTS chaos_outbox_tx (envelope_id uuid PRIMARY KEY, tx text NOT NULL)",
        "CREATE OR REPLACE FUNCTION chaos_record_outbox_tx() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN \
           INSERT INTO chaos_outbox_tx (envelope_id, tx) VALUES (NEW.id, (pg_current_xact_id()::text::bigint % 4294967296)::text) \
           ON CONFLICT DO NOTHING; RETURN NEW; END $$",
        "DROP TRIGGER IF EXISTS chaos_outbox_tx ON event_outbox",
        "CREATE TRIGGER chaos_outbox_tx AFTER INSERT ON event_outbox FOR EACH ROW EXECUTE FUNCTION chaos_record_outbox_tx()",
    ])
    .await
}

/// The inbox window every node of a run prunes with (the harness leaves
/// `CRAIG_INBOX_RETENTION_DAYS` at its default).
pub(super) const INBOX_WINDOW_MS: u64 = 31 * 86_400_000;

/// Two processed dedup records in `svc`'s inbox, half a day inside and half a day past the
/// inbox window, and a trigger recording every inbox DELETE with the row's age then
/// (`chaos_inbox_deletes`): the prune may take only the second (issue 22.6).
async fn stage_inbox_edges(svc: &str, pool: &PgPool) -> anyhow::Result<Vec<(String, Uuid, u64)>> {
    execute_all(pool, "installing the inbox-delete recorder", &[
        "CREATE TABLE IF NOT EXISTS chaos_inbox_deletes (envelope_id uuid NOT NULL, age_ms int8 NOT NULL, \
           at timestamptz NOT NULL DEFAULT clock_timestamp())",
        "CREATE OR REPLACE FUNCTION chaos_record_inbox_delete() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN \
           INSERT INTO chaos_inbox_deletes (envelope_id, age_ms) \
             VALUES (OLD.envelope_id, (EXTRACT(EPOCH FROM (clock_timestamp() - OLD.received_at)) * 1000)::int8); \
           RETURN OLD; END $$",
        "DROP TRIGGER IF EXISTS chaos_inbox_delete ON event_inbox",
        "CREATE TRIGGER chaos_inbox_delete BEFORE DELETE ON event_inbox FOR EACH ROW EXECUTE FUNCTION chaos_record_inbox_delete()",
    ])
    .await?;
    let half_day = 43_200_000u64;
    let mut out = Vec::new();
    for age_ms in [INBOX_WINDOW_MS - half_day, INBOX_WINDOW_MS + half_day] {
        let envelope = Uuid::now_v7();
        bounded(
            COLLECT,
            "staging an inbox edge record",
            sqlx::query(
                "INSERT INTO event_inbox (envelope_id, source_service, event_type, received_at, processed_at) \
                 VALUES ($1, 'chaos', 'chaos.inbox_edge', now() - make_interval(secs => $2), now() - make_interval(secs => $2))",
            )
            .bind(envelope)
            .bind(age_ms as f64 / 1000.0)
            .execute(pool),
        )
        .await?;
        out.push((svc.to_owned(), envelope, age_ms));
    }
    Ok(out)
}

/// A trigger on `event_outbox` that records every DELETE of a PENDING row into
/// `chaos_pruned_pending`: the only code that deletes outbox rows is the prune, and it must
/// never take a pending one (#965/#1129).
async fn record_pending_deletes(pool: &PgPool) -> anyhow::Result<()> {
    execute_all(pool, "installing the pending-delete recorder", &[
        "CREATE TABLE IF NOT EXISTS chaos_pruned_pending (envelope_id uuid NOT NULL, at timestamptz NOT NULL DEFAULT clock_timestamp())",
        "CREATE OR REPLACE FUNCTION chaos_record_pending_delete() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN \
           IF OLD.published_at IS NULL THEN INSERT INTO chaos_pruned_pending (envelope_id) VALUES (OLD.id); END IF; \
           RETURN OLD; END $$",
        "DROP TRIGGER IF EXISTS chaos_pending_delete ON event_outbox",
        "CREATE TRIGGER chaos_pending_delete BEFORE DELETE ON event_outbox FOR EACH ROW EXECUTE FUNCTION chaos_record_pending_delete()",
    ])
    .await
}

/// `n` referrals written 30 days and an hour ago, their events still pending: they failed
/// to publish back then and back off until 3 s from now (`attempts`, `last_error`,
/// `next_attempt_at` as the worker leaves a refused row). Their referral ids returned.
async fn stage_backdated(cases: &PgPool, n: u32) -> anyhow::Result<Vec<Uuid>> {
    let mut ids = Vec::new();
    if n == 0 {
        return Ok(ids);
    }
    let mut tx = bounded(COLLECT, "staging backdated writes", cases.begin()).await?;
    for i in 0..n {
        let referral = Uuid::now_v7();
        bounded(
            COLLECT,
            "writing a backdated referral",
            sqlx::query("INSERT INTO referrals (id, subject, created_by, created_at) VALUES ($1, $2, $1, now() - interval '30 days 1 hour')")
                .bind(referral)
                .bind(format!("backdated {i}"))
                .execute(&mut *tx),
        )
        .await?;
        let env = craig_mq::EventEnvelope::new(
            craig_fleet::cases::REFERRAL_CREATED,
            "cases",
            Some(referral),
            json!({ "referral_id": referral, "subject": format!("backdated {i}") }),
        )?;
        bounded(COLLECT, "staging a backdated event", craig_mq::publish_in_tx(&mut tx, &env)).await?;
        ids.push(referral);
    }
    bounded(
        COLLECT,
        "backdating the events",
        sqlx::query(
            "UPDATE event_outbox SET created_at = now() - interval '30 days 1 hour', attempts = 3, \
             last_error = 'connection: broker unreachable (backdated by the harness)', next_attempt_at = now() + interval '3 seconds' \
             WHERE aggregate_id = ANY($1)",
        )
        .bind(&ids)
        .execute(&mut *tx),
    )
    .await?;
    bounded(COLLECT, "staging backdated writes", tx.commit()).await?;
    Ok(ids)
}

/// Run `statements` in order on `pool`, each bounded: the harness's own scaffolding (the
/// triggers that record or inject what a scenario needs).
async fn execute_all(pool: &PgPool, what: &str, statements: &[&'static str]) -> anyhow::Result<()> {
    for sql in statements {
        bounded(COLLECT, what, sqlx::query(*sql).execute(pool)).await?;
    }
    Ok(())
}
