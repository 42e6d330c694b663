//! The consumer side of `chaos bench`: the rules consumer (the node's own handler, through
//! `run_subscriber`) on a backlog in its queue — with the §D2 inbox against without it, and
//! at concurrency N against concurrency 1 (the old one-at-a-time consumer).

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use craig_fleet::consumer::Consumer;
use craig_mq::subscriber::{SubscriberConfig, run_subscriber};
use craig_mq::topology::{QueueSpec, consumer_queue};
use lapin::options::QueuePurgeOptions;
use serde_json::json;
use sqlx::PgPool;
use tokio_util::sync::CancellationToken;

use super::relay::{EVENT_TYPE, confirm_channel, envelopes, raw_publish};
use super::{BenchOptions, Env, Figure, cpu_mark, progress, throughput};

async fn reset(pool: &PgPool) -> anyhow::Result<()> {
    sqlx::query("TRUNCATE rule_evaluations, event_inbox, event_outbox").execute(pool).await?;
    Ok(())
}

/// Publish `n` referral events into rules' queue, then let the consumer drain them; the
/// events/s from its start to the last effect.
/// (events/s, CPU split, effects beyond one per event).
async fn run_once(env: &Env, spec: &QueueSpec, n: usize, use_inbox: bool, concurrency: u16) -> anyhow::Result<(f64, super::CpuSplit, usize)> {
    // The node's own pool size for this concurrency (craig_fleet::node::pool_size).
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(craig_fleet::node::pool_size(concurrency))
        .acquire_timeout(Duration::from_secs(5))
        .connect(&env.rules_url)
        .await?;
    reset(&pool).await?;
    let (conn, ch) = confirm_channel(&env.amqp_url, "bench-consumer-backlog").await?;
    ch.queue_purge(spec.queue.as_str().into(), QueuePurgeOptions::default()).await?;
    raw_publish(&ch, &envelopes(n)).await?;
    let cfg = SubscriberConfig {
        amqp_url: env.amqp_url.clone(),
        spec: spec.clone(),
        prefetch: craig_mq::settings::CONSUMER_PREFETCH,
        concurrency,
        heartbeat_secs: 30,
        retry_delay: Duration::from_millis(500),
        reconnect_delay: Duration::from_secs(1),
    };
    let consumer = Arc::new(Consumer { queue: spec.queue.clone(), use_inbox, replica: None, app_path: None });
    let handler = {
        let pool = pool.clone();
        move |e| {
            let (pool, consumer) = (pool.clone(), consumer.clone());
            async move { craig_fleet::rules::on_referral_created(&pool, &consumer, e).await }
        }
    };
    let stop = CancellationToken::new();
    let mark = cpu_mark();
    let t = Instant::now();
    let task = tokio::spawn(run_subscriber(cfg, handler, stop.clone()));
    let deadline = Instant::now() + Duration::from_secs(600);
    loop {
        let done: i64 = sqlx::query_scalar("SELECT count(*) FROM rule_evaluations").fetch_one(&pool).await?;
        if done as usize >= n {
            break;
        }
        if Instant::now() > deadline {
            stop.cancel();
            anyhow::bail!("the consumer made {done} of {n} effects in 600 s");
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let secs = t.elapsed().as_secs_f64();
    let cpu = mark.split();
    stop.cancel();
    let _ = task.await;
    let _ = conn.close(200, "bye".into()).await;
    // No fault ran: every event has exactly one effect.
    let (effects, distinct): (i64, i64) =
        sqlx::query_as("SELECT count(*), count(DISTINCT envelope_id) FROM rule_evaluations").fetch_one(&pool).await?;
    pool.close().await;
    let extra = (effects - distinct).max(0) as usize + (distinct as usize).saturating_sub(n);
    Ok((n as f64 / secs, cpu, extra))
}

pub(super) async fn consumer(env: &Env, opts: &BenchOptions) -> anyhow::Result<(Vec<Figure>, Vec<String>)> {
    let service = craig_fleet::Service::Rules;
    let spec = QueueSpec { queue: consumer_queue("rules"), bindings: service.queue_bindings().iter().map(|s| s.to_string()).collect(), with_dlx: true, queue_type: Default::default() };
    debug_assert!(spec.bindings.iter().any(|b| b == EVENT_TYPE));
    {
        let (_conn, ch) = confirm_channel(&env.amqp_url, "bench-consumer-setup").await?;
        craig_mq::topology::declare_consumer_queue(&ch, &spec).await?;
    }
    let n = opts.consumer_backlog;
    let seq_n = opts.sequential_backlog.min(n);
    let c = opts.consumer_concurrency;
    let (mut with, mut without, mut sequential) = (Vec::new(), Vec::new(), Vec::new());
    let mut cpu = BTreeMap::new();
    let mut failures = Vec::new();
    for round in 1..=opts.rounds {
        for (label, count, inbox, conc) in [("concurrency 1", seq_n, true, 1), ("with inbox", n, true, c), ("without inbox", n, false, c)] {
            let (r, split, extra) = run_once(env, &spec, count, inbox, conc).await?;
            if extra > 0 {
                failures.push(format!("consumer ({label}) round {round}: {extra} effects beyond one per event, with no fault"));
            }
            let (all, key) = match label {
                "concurrency 1" => (&mut sequential, "concurrency_1"),
                "with inbox" => (&mut with, "with_inbox"),
                _ => (&mut without, "without_inbox"),
            };
            all.push(r);
            cpu.entry(key).or_insert(split);
        }
        progress(format!(
            "consumer round {round}/{}: concurrency 1 {:.0}/s, concurrency {c} with inbox {:.0}/s, without {:.0}/s",
            opts.rounds,
            sequential.last().unwrap_or(&0.0),
            with.last().unwrap_or(&0.0),
            without.last().unwrap_or(&0.0)
        ));
    }
    reset(&env.rules).await?;
    let mut details = BTreeMap::new();
    details.insert("backlog".into(), json!(n));
    details.insert("concurrency".into(), json!(c));
    details.insert("cpu_first_round".into(), serde_json::to_value(&cpu)?);
    let inbox = throughput(
        "inbox",
        "the rules consumer with handle_idempotently against the same handler without the inbox",
        "events/s",
        (&format!("with inbox, concurrency {c}"), with.clone()),
        (&format!("without inbox, concurrency {c}"), without),
        Some((">= 0.5", 0.5)),
        details.clone(),
    );
    details.insert("sequential_backlog".into(), json!(seq_n));
    let concurrent = throughput(
        "consumer",
        "backlog → effects with the inbox, concurrency N against the one-at-a-time consumer",
        "events/s",
        (&format!("concurrency {c}"), with),
        ("concurrency 1", sequential),
        Some((">= 3", 3.0)),
        details,
    );
    Ok((vec![inbox, concurrent], failures))
}
