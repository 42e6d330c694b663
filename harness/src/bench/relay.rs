//! The outbox side of `chaos bench`: relay throughput against raw lapin, the pre-#1128
//! drain, parallel workers, publish lag with polling and with LISTEN/NOTIFY, and the claim
//! query's plan.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::Context as _;
use craig_mq::outbox::{DrainMode, OutboxConfig, OutboxWorker, lease, notify};
use craig_mq::publisher::PublisherConfig;
use craig_mq::topology::EVENTS_EXCHANGE;
use craig_mq::EventEnvelope;
use futures_util::StreamExt as _;
use lapin::options::{BasicConsumeOptions, BasicPublishOptions, ConfirmSelectOptions, QueueBindOptions, QueueDeclareOptions, QueuePurgeOptions};
use lapin::types::{FieldTable, ShortString};
use lapin::{BasicProperties, Channel, Confirmation};
use serde_json::json;
use sqlx::PgPool;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

use super::{BenchOptions, CpuSplit, Env, Explain, Figure, cpu_mark, percentile, progress, throughput};

pub(super) const EVENT_TYPE: &str = "case.referral_created";
const RELAY_QUEUE: &str = "bench.relay";

/// `n` referral envelopes as cases stages them.
pub(super) fn envelopes(n: usize) -> Vec<EventEnvelope> {
    (0..n)
        .map(|i| {
            let referral = Uuid::now_v7();
            EventEnvelope::new(EVENT_TYPE, "cases", Some(referral), json!({ "referral_id": referral, "subject": format!("bench referral {i}") }))
                .expect("valid envelope")
        })
        .collect()
}

/// Stage a backlog straight into the outbox (not timed): 5,000 rows a statement.
async fn stage(pool: &PgPool, envs: &[EventEnvelope]) -> anyhow::Result<()> {
    for chunk in envs.chunks(5_000) {
        let ids: Vec<Uuid> = chunk.iter().map(|e| e.id).collect();
        let aggs: Vec<Option<Uuid>> = chunk.iter().map(|e| e.aggregate_id).collect();
        let types: Vec<String> = chunk.iter().map(|e| e.event_type.clone()).collect();
        let bodies: Vec<serde_json::Value> = chunk.iter().map(|e| serde_json::to_value(e).expect("envelope json")).collect();
        sqlx::query(
            "INSERT INTO event_outbox (id, aggregate_id, event_type, envelope) \
             SELECT * FROM unnest($1::uuid[], $2::uuid[], $3::text[], $4::jsonb[])",
        )
        .bind(&ids)
        .bind(&aggs)
        .bind(&types)
        .bind(&bodies)
        .execute(pool)
        .await?;
    }
    Ok(())
}

async fn reset(pool: &PgPool, ch: &Channel, queue: &str) -> anyhow::Result<()> {
    sqlx::query("TRUNCATE event_outbox").execute(pool).await?;
    ch.queue_purge(queue.into(), QueuePurgeOptions::default()).await?;
    Ok(())
}

/// A durable classic queue on `craig.events` for the bench's events.
pub(super) async fn bench_queue(ch: &Channel, queue: &str) -> anyhow::Result<()> {
    ch.queue_declare(queue.into(), QueueDeclareOptions { durable: true, ..Default::default() }, FieldTable::default()).await?;
    ch.queue_bind(queue.into(), EVENTS_EXCHANGE.into(), EVENT_TYPE.into(), QueueBindOptions::default(), FieldTable::default()).await?;
    Ok(())
}

async fn depth(ch: &Channel, queue: &str) -> anyhow::Result<u32> {
    Ok(craig_mq::topology::queue_depth(ch, queue).await?)
}

async fn pending(pool: &PgPool) -> anyhow::Result<i64> {
    Ok(craig_mq::outbox::pending_count(pool).await?)
}

fn props(env: &EventEnvelope) -> BasicProperties {
    BasicProperties::default()
        .with_message_id(ShortString::from(env.id.to_string()))
        .with_content_type(ShortString::from("application/json"))
        .with_delivery_mode(2)
        .with_type(ShortString::from(env.event_type.as_str()))
        .with_timestamp(env.occurred_at.timestamp().max(0) as u64)
}

/// Raw lapin, no database: every envelope published with confirms fully pipelined on one
/// channel (all frames, then all confirms), as the worker publishes them (mandatory,
/// persistent, the same properties). Returns the elapsed time.
pub(super) async fn raw_publish(ch: &Channel, envs: &[EventEnvelope]) -> anyhow::Result<Duration> {
    let t = Instant::now();
    let mut confirms = Vec::with_capacity(envs.len());
    for env in envs {
        let c = ch
            .basic_publish(
                EVENTS_EXCHANGE.into(),
                env.event_type.as_str().into(),
                BasicPublishOptions { mandatory: true, immediate: false },
                &env.to_vec(),
                props(env),
            )
            .await?;
        confirms.push(c);
    }
    for c in confirms {
        match c.await? {
            Confirmation::Ack(None) => {}
            other => anyhow::bail!("raw publish not confirmed: {other:?}"),
        }
    }
    Ok(t.elapsed())
}

pub(super) async fn confirm_channel(amqp_url: &str, name: &str) -> anyhow::Result<(lapin::Connection, Channel)> {
    let conn = craig_mq::publisher::connect(amqp_url, 30, name).await?;
    let ch = conn.create_channel().await?;
    ch.confirm_select(ConfirmSelectOptions::default()).await?;
    Ok((conn, ch))
}

fn worker(pool: &PgPool, amqp_url: &str, cfg: OutboxConfig) -> OutboxWorker {
    OutboxWorker::new(pool.clone(), amqp_url, PublisherConfig::default(), cfg)
}

/// The worker's settings: production's, with `--batch` if given.
fn outbox_cfg(opts: &BenchOptions) -> OutboxConfig {
    OutboxConfig { batch_size: opts.batch, ..OutboxConfig::default() }
}

/// Drain until nothing is pending; the elapsed time.
async fn drain_all(w: &mut OutboxWorker, pool: &PgPool) -> anyhow::Result<Duration> {
    let t = Instant::now();
    loop {
        let r = w.drain().await?;
        if r.broker_failed > 0 {
            anyhow::bail!("the relay met a broker failure: {r:?}");
        }
        if pending(pool).await? == 0 {
            return Ok(t.elapsed());
        }
        if r.published == 0 {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }
}

/// Relay throughput (raw lapin vs the worker), the pre-#1128 drain, and the claim's plan.
pub(super) async fn relay(env: &Env, opts: &BenchOptions) -> anyhow::Result<(Vec<Figure>, Vec<String>, Option<Explain>)> {
    let (_conn, ch) = confirm_channel(&env.amqp_url, "bench-relay").await?;
    bench_queue(&ch, RELAY_QUEUE).await?;
    let pool = &env.cases;
    let n = opts.backlog;
    let (mut raw, mut relay, mut old) = (Vec::new(), Vec::new(), Vec::new());
    let mut failures = Vec::new();
    let mut explain = None;
    let mut cpu: Option<CpuSplit> = None;
    if !opts.wants("relay") {
        // `--only explain`: a drained backlog and its plan, no throughput rounds.
        reset(pool, &ch, RELAY_QUEUE).await?;
        stage(pool, &envelopes(n)).await?;
        let mut w = worker(pool, &env.amqp_url, outbox_cfg(opts));
        drain_all(&mut w, pool).await?;
        explain = Some(explain_claim(pool, &mut failures).await?);
        ch.queue_delete(RELAY_QUEUE.into(), lapin::options::QueueDeleteOptions::default()).await?;
        return Ok((Vec::new(), failures, explain));
    }
    for round in 1..=opts.rounds {
        // Baseline: the broker's own limit for these envelopes.
        let envs = envelopes(n);
        reset(pool, &ch, RELAY_QUEUE).await?;
        let t = raw_publish(&ch, &envs).await?;
        raw.push(n as f64 / t.as_secs_f64());
        // Subject: the same number of envelopes through the outbox.
        reset(pool, &ch, RELAY_QUEUE).await?;
        stage(pool, &envs).await?;
        let mut w = worker(pool, &env.amqp_url, outbox_cfg(opts));
        let mark = cpu_mark();
        let t = drain_all(&mut w, pool).await?;
        cpu.get_or_insert(mark.split());
        relay.push(n as f64 / t.as_secs_f64());
        let got = depth(&ch, RELAY_QUEUE).await?;
        if got as usize != n {
            failures.push(format!("relay round {round}: {n} rows drained, {got} messages in the queue (expected exactly one each)"));
        }
        if explain.is_none() && opts.wants("explain") {
            // As the outbox lives: the backlog published, a few rows pending.
            explain = Some(explain_claim(pool, &mut failures).await?);
        }
        // pre-#1128 on the same backlog, with its tick (the poll interval, 1 s): the rate it
        // sustains over a few ticks.
        reset(pool, &ch, RELAY_QUEUE).await?;
        stage(pool, &envs).await?;
        let window = if opts.smoke { Duration::from_secs(2) } else { Duration::from_secs(4) };
        let stop = CancellationToken::new();
        let w = worker(pool, &env.amqp_url, OutboxConfig::default()).with_mode(DrainMode::Pre1128);
        let t = Instant::now();
        let task = tokio::spawn(w.run(stop.clone()));
        tokio::time::sleep(window).await;
        let done = n as i64 - pending(pool).await?;
        let secs = t.elapsed().as_secs_f64();
        stop.cancel();
        let _ = task.await;
        old.push(done as f64 / secs);
        progress(format!(
            "relay round {round}/{}: raw lapin {:.0}/s, worker {:.0}/s, pre-1128 {:.0}/s",
            opts.rounds,
            raw.last().unwrap_or(&0.0),
            relay.last().unwrap_or(&0.0),
            old.last().unwrap_or(&0.0)
        ));
        reset(pool, &ch, RELAY_QUEUE).await?;
    }
    ch.queue_delete(RELAY_QUEUE.into(), lapin::options::QueueDeleteOptions::default()).await?;
    let mut figures = Vec::new();
    if !relay.is_empty() {
        let mut details = BTreeMap::new();
        details.insert("backlog".into(), json!(n));
        details.insert("batch".into(), json!(opts.batch));
        if let Some(c) = cpu {
            details.insert("cpu_first_round".into(), serde_json::to_value(c)?);
        }
        figures.push(throughput(
            "relay",
            "events/s draining a backlog into a durable queue",
            "events/s",
            ("outbox worker", relay.clone()),
            ("raw lapin pipelined", raw),
            Some((">= 0.6", 0.6)),
            details,
        ));
        let mut details = BTreeMap::new();
        details.insert("tick".into(), json!("1 s poll, 100 rows a tick"));
        figures.push(throughput(
            "pre_1128",
            "the #1128 drain against the pre-#1128 drain on the same backlog",
            "events/s",
            ("#1128 drain", relay),
            ("pre-1128 drain", old),
            None,
            details,
        ));
    }
    Ok((figures, failures, explain))
}


/// The claim statement's plan on an outbox as it lives (the backlog published, 1,000 rows
/// pending): it must use the partial index, or the bench fails.
async fn explain_claim(pool: &PgPool, failures: &mut Vec<String>) -> anyhow::Result<Explain> {
    stage(pool, &envelopes(1_000)).await?;
    sqlx::query("ANALYZE event_outbox").execute(pool).await?;
    let mut tx = pool.begin().await?;
    let plan: Vec<String> = sqlx::query_scalar(sqlx::AssertSqlSafe(format!("EXPLAIN {}", lease::CLAIM_SQL)))
        .bind(60.0_f64)
        .bind(100_i64)
        .fetch_all(&mut *tx)
        .await
        .context("EXPLAIN of the claim")?;
    tx.rollback().await?;
    let uses = plan.iter().any(|l| l.contains("idx_event_outbox_pending"));
    progress(format!("claim plan {} the partial index", if uses { "uses" } else { "does NOT use" }));
    if !uses {
        failures.push(format!("the claim does not use idx_event_outbox_pending: {}", plan.join(" / ")));
    }
    sqlx::query("TRUNCATE event_outbox").execute(pool).await?;
    Ok(Explain { query: lease::CLAIM_SQL.split_whitespace().collect::<Vec<_>>().join(" "), plan, uses_partial_index: uses })
}

/// 1, 2 and 4 workers on one backlog; no row may be published twice while leases hold.
pub(super) async fn parallel(env: &Env, opts: &BenchOptions) -> anyhow::Result<(Vec<Figure>, Vec<String>)> {
    let (_conn, ch) = confirm_channel(&env.amqp_url, "bench-parallel").await?;
    bench_queue(&ch, RELAY_QUEUE).await?;
    let pool = &env.cases;
    let n = opts.backlog;
    let mut rates: BTreeMap<usize, Vec<f64>> = BTreeMap::new();
    let mut failures = Vec::new();
    // One round: the figure is secondary to its check (nothing published twice).
    {
        for k in [1usize, 2, 4] {
            reset(pool, &ch, RELAY_QUEUE).await?;
            stage(pool, &envelopes(n)).await?;
            let t = Instant::now();
            let mut tasks = Vec::new();
            let cfg = outbox_cfg(opts);
            for _ in 0..k {
                let (pool, url) = (pool.clone(), env.amqp_url.clone());
                tasks.push(tokio::spawn(async move {
                    let mut w = worker(&pool, &url, cfg);
                    drain_all(&mut w, &pool).await
                }));
            }
            for task in tasks {
                task.await??;
            }
            let secs = t.elapsed().as_secs_f64();
            rates.entry(k).or_default().push(n as f64 / secs);
            // Every row was stamped, so each is in the queue at least once; exactly `n`
            // messages means none twice.
            let got = depth(&ch, RELAY_QUEUE).await? as usize;
            if got != n {
                failures.push(format!("parallel drain, {k} workers: {n} rows, {got} messages (published twice: {})", got.saturating_sub(n)));
            }
            progress(format!("parallel: {k} worker(s) {:.0}/s, {got} messages for {n} rows", n as f64 / secs));
        }
    }
    reset(pool, &ch, RELAY_QUEUE).await?;
    ch.queue_delete(RELAY_QUEUE.into(), lapin::options::QueueDeleteOptions::default()).await?;
    let one = rates.get(&1).cloned().unwrap_or_default();
    let mut figures = Vec::new();
    for k in [2usize, 4] {
        let mut details = BTreeMap::new();
        details.insert("backlog".into(), json!(n));
        details.insert("published_twice".into(), json!(failures.iter().filter(|f| f.contains(&format!("{k} workers"))).count()));
        figures.push(throughput(
            &format!("parallel_{k}"),
            &format!("{k} workers on one backlog against one"),
            "events/s",
            (&format!("{k} workers"), rates.get(&k).cloned().unwrap_or_default()),
            ("1 worker", one.clone()),
            None,
            details,
        ));
    }
    Ok((figures, failures))
}

/// Receipt times by message id, from a consumer on `queue` (auto-ack).
async fn receipts(amqp_url: &str, queue: &str) -> anyhow::Result<(lapin::Connection, Arc<Mutex<HashMap<Uuid, Instant>>>)> {
    let conn = craig_mq::publisher::connect(amqp_url, 30, "bench-lag-consumer").await?;
    let ch = conn.create_channel().await?;
    let mut consumer = ch
        .basic_consume(queue.into(), "".into(), BasicConsumeOptions { no_ack: true, ..Default::default() }, FieldTable::default())
        .await?;
    let seen: Arc<Mutex<HashMap<Uuid, Instant>>> = Arc::default();
    let into = seen.clone();
    tokio::spawn(async move {
        while let Some(Ok(d)) = consumer.next().await {
            let now = Instant::now();
            if let Some(id) = d.properties.message_id().as_ref().and_then(|m| m.as_str().parse::<Uuid>().ok()) {
                into.lock().expect("receipts").entry(id).or_insert(now);
            }
        }
    });
    Ok((conn, seen))
}

/// Lags in ms, commit (or direct publish) → receipt, sorted.
fn lags(sent: &HashMap<Uuid, Instant>, seen: &HashMap<Uuid, Instant>) -> (Vec<f64>, usize) {
    let mut v: Vec<f64> = sent.iter().filter_map(|(id, t)| seen.get(id).map(|r| r.saturating_duration_since(*t).as_secs_f64() * 1000.0)).collect();
    v.sort_by(|a, b| a.total_cmp(b));
    let missing = sent.len() - v.len();
    (v, missing)
}

async fn wait_all(sent: usize, seen: &Mutex<HashMap<Uuid, Instant>>, within: Duration) {
    let until = Instant::now() + within;
    while seen.lock().expect("receipts").len() < sent && Instant::now() < until {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// One lag run through the outbox: a producer staging `rate` events/s, one per
/// transaction, for `secs`; the worker polling every 1 s (production), with NOTIFY or not.
async fn outbox_lag(env: &Env, opts: &BenchOptions, with_notify: bool, queue: &str) -> anyhow::Result<(Vec<f64>, usize, f64)> {
    let pool = &env.cases;
    sqlx::query("TRUNCATE event_outbox").execute(pool).await?;
    let (conn, seen) = receipts(&env.amqp_url, queue).await?;
    notify::set_staging_notifies(with_notify);
    let stop = CancellationToken::new();
    let w = worker(pool, &env.amqp_url, OutboxConfig::default()).with_notify(with_notify);
    let task = tokio::spawn(w.run(stop.clone()));
    // Let the worker connect and the listener listen before the clock starts.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let mut sent: HashMap<Uuid, Instant> = HashMap::new();
    let total = opts.lag_rate as u64 * opts.lag_secs;
    let start = tokio::time::Instant::now();
    for (i, e) in envelopes(total as usize).into_iter().enumerate() {
        tokio::time::sleep_until(start + Duration::from_secs_f64(i as f64 / f64::from(opts.lag_rate))).await;
        let mut tx = pool.begin().await?;
        craig_mq::publish_in_tx(&mut tx, &e).await?;
        tx.commit().await?;
        sent.insert(e.id, Instant::now());
    }
    let achieved = total as f64 / start.elapsed().as_secs_f64();
    wait_all(sent.len(), &seen, Duration::from_secs(5)).await;
    stop.cancel();
    let _ = task.await;
    notify::set_staging_notifies(false);
    // Closed, not dropped: a lapin connection outlives its handle, and a consumer left behind
    // would take half of the next run's deliveries.
    let _ = conn.close(200, "bye".into()).await;
    let seen = seen.lock().expect("receipts").clone();
    let (v, missing) = lags(&sent, &seen);
    Ok((v, missing, achieved))
}

/// The baseline: the same rate published straight to the broker (no database), publish →
/// receipt.
async fn direct_lag(env: &Env, opts: &BenchOptions, queue: &str) -> anyhow::Result<(Vec<f64>, usize, f64)> {
    let (publisher, ch) = confirm_channel(&env.amqp_url, "bench-lag-direct").await?;
    let (conn, seen) = receipts(&env.amqp_url, queue).await?;
    let mut sent: HashMap<Uuid, Instant> = HashMap::new();
    let total = opts.lag_rate as u64 * opts.lag_secs;
    let start = tokio::time::Instant::now();
    let mut confirms = Vec::new();
    for (i, e) in envelopes(total as usize).into_iter().enumerate() {
        tokio::time::sleep_until(start + Duration::from_secs_f64(i as f64 / f64::from(opts.lag_rate))).await;
        sent.insert(e.id, Instant::now());
        confirms.push(
            ch.basic_publish(EVENTS_EXCHANGE.into(), EVENT_TYPE.into(), BasicPublishOptions { mandatory: true, immediate: false }, &e.to_vec(), props(&e))
                .await?,
        );
    }
    let achieved = total as f64 / start.elapsed().as_secs_f64();
    for c in confirms {
        c.await?;
    }
    wait_all(sent.len(), &seen, Duration::from_secs(5)).await;
    let _ = conn.close(200, "bye".into()).await;
    let _ = publisher.close(200, "bye".into()).await;
    let seen = seen.lock().expect("receipts").clone();
    let (v, missing) = lags(&sent, &seen);
    Ok((v, missing, achieved))
}

/// Publish lag at a steady rate for `lag_secs` per mode (one steady run each, as the issue
/// asks: percentiles, not ratios of medians): polling and LISTEN/NOTIFY against a direct
/// publish. A producer that fell more than 5 % behind its rate fails the bench.
pub(super) async fn lag(env: &Env, opts: &BenchOptions) -> anyhow::Result<(Vec<Figure>, Vec<String>)> {
    let queue = "bench.lag";
    let (conn, ch) = confirm_channel(&env.amqp_url, "bench-lag").await?;
    bench_queue(&ch, queue).await?;
    ch.queue_purge(queue.into(), QueuePurgeOptions::default()).await?;
    let mut failures = Vec::new();
    let mut runs: BTreeMap<&str, (Vec<f64>, f64)> = BTreeMap::new();
    for mode in ["direct", "poll", "notify"] {
        let (mut v, missing, achieved) = match mode {
            "direct" => direct_lag(env, opts, queue).await?,
            "poll" => outbox_lag(env, opts, false, queue).await?,
            _ => outbox_lag(env, opts, true, queue).await?,
        };
        v.sort_by(|a, b| a.total_cmp(b));
        if missing > 0 {
            failures.push(format!("lag ({mode}): {missing} events never arrived"));
        }
        if achieved < 0.95 * f64::from(opts.lag_rate) {
            failures.push(format!("lag ({mode}): the producer reached {achieved:.0} events/s of {}", opts.lag_rate));
        }
        progress(format!(
            "lag {mode}: p50 {:.1} ms, p95 {:.1} ms, p99 {:.1} ms over {} events at {achieved:.0}/s",
            percentile(&v, 50.0),
            percentile(&v, 95.0),
            percentile(&v, 99.0),
            v.len()
        ));
        runs.insert(mode, (v, achieved));
    }
    ch.queue_delete(queue.into(), lapin::options::QueueDeleteOptions::default()).await?;
    let _ = conn.close(200, "bye".into()).await;
    let pcts = |(v, achieved): &(Vec<f64>, f64)| {
        json!({ "p50_ms": percentile(v, 50.0), "p95_ms": percentile(v, 95.0), "p99_ms": percentile(v, 99.0), "events": v.len(), "achieved_rate": achieved })
    };
    let direct = &runs["direct"];
    let figure = |id: &str, what: &str, label: &str, run: &(Vec<f64>, f64), goal: String, met: bool| {
        let mut details = BTreeMap::new();
        details.insert("subject".into(), pcts(run));
        details.insert("baseline".into(), pcts(direct));
        details.insert("rate".into(), json!(opts.lag_rate));
        details.insert("seconds".into(), json!(opts.lag_secs));
        let p99 = percentile(&run.0, 99.0);
        Figure {
            id: id.into(),
            what: what.into(),
            unit: "ms p99".into(),
            subject_label: label.into(),
            subject: p99,
            subject_rounds: vec![p99],
            baseline_label: "direct publish".into(),
            baseline: percentile(&direct.0, 99.0),
            baseline_rounds: vec![percentile(&direct.0, 99.0)],
            ratio: p99 / percentile(&direct.0, 99.0),
            goal: Some(goal),
            met: Some(met),
            details,
        }
    };
    let (poll, notified) = (&runs["poll"], &runs["notify"]);
    let poll_met = percentile(&poll.0, 99.0) <= 1100.0;
    let (n50, n99) = (percentile(&notified.0, 50.0), percentile(&notified.0, 99.0));
    Ok((
        vec![
            figure("lag_poll", "commit → receipt at a steady rate, 1 s polling", "1 s polling", poll, "p99 <= 1100 ms".into(), poll_met),
            figure(
                "lag_notify",
                "commit → receipt at a steady rate, LISTEN/NOTIFY",
                "LISTEN/NOTIFY",
                notified,
                format!("p50 <= 10 ms (p50 {n50:.1} ms), p99 <= 50 ms"),
                n50 <= 10.0 && n99 <= 50.0,
            ),
        ],
        failures,
    ))
}

/// What the NOTIFY costs the producers: PostgreSQL takes a global lock on its notification
/// queue at every notifying commit. Eight concurrent producers staging one event per
/// transaction for a few seconds, NOTIFY off (baseline) and on (subject), alternating.
pub(super) async fn staging_cost(env: &Env, opts: &BenchOptions) -> anyhow::Result<Figure> {
    const PRODUCERS: usize = 8;
    let secs = if opts.smoke { 1.0 } else { 3.0 };
    let (mut off, mut on) = (Vec::new(), Vec::new());
    for round in 1..=opts.rounds {
        for notifying in [false, true] {
            sqlx::query("TRUNCATE event_outbox").execute(&env.cases).await?;
            notify::set_staging_notifies(notifying);
            let until = Instant::now() + Duration::from_secs_f64(secs);
            let t = Instant::now();
            let mut tasks = Vec::new();
            for _ in 0..PRODUCERS {
                let pool = env.cases.clone();
                tasks.push(tokio::spawn(async move {
                    let mut n = 0u64;
                    while Instant::now() < until {
                        let mut tx = pool.begin().await?;
                        craig_mq::publish_in_tx(&mut tx, &envelopes(1)[0]).await?;
                        tx.commit().await?;
                        n += 1;
                    }
                    Ok::<u64, sqlx::Error>(n)
                }));
            }
            let mut total = 0;
            for task in tasks {
                total += task.await??;
            }
            let rate = total as f64 / t.elapsed().as_secs_f64();
            if notifying { on.push(rate) } else { off.push(rate) }
        }
        notify::set_staging_notifies(false);
        progress(format!("staging round {round}/{}: {PRODUCERS} producers {:.0} commits/s without NOTIFY, {:.0} with", opts.rounds, off.last().unwrap_or(&0.0), on.last().unwrap_or(&0.0)));
    }
    sqlx::query("TRUNCATE event_outbox").execute(&env.cases).await?;
    let mut details = BTreeMap::new();
    details.insert("producers".into(), json!(PRODUCERS));
    Ok(throughput(
        "notify_staging",
        "staging commits/s of 8 concurrent producers with the NOTIFY against without (its cost to producers)",
        "commits/s",
        ("with NOTIFY", on),
        ("without NOTIFY", off),
        None,
        details,
    ))
}

