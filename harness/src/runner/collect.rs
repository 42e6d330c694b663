//! What the system says happened, read at the end: the outbox rows and counted effects
//! from the databases, `inbox.reprocessed` and `outbox.stamped` from the replicas' own
//! logs, and each replica's `/metrics`.

use std::collections::BTreeMap;
use std::path::Path;
use std::time::Duration;

use sqlx::PgPool;
use uuid::Uuid;

use super::{COLLECT, Log, bounded};
use crate::history::Event;

/// Where a consuming service's counted side effects live (CONTRACT § fleet): the table,
/// the column naming the aggregate the write created, and the row's time. rules'
/// `rule_evaluations` (only the inbox protects it), financial's `payments` (the #1179
/// arbiter).
pub(super) fn effect_source(svc: &str) -> Option<(&'static str, &'static str, &'static str)> {
    match svc {
        "rules" => Some(("rule_evaluations", "referral_id", "evaluated_at")),
        "financial" => Some(("payments", "placement_id", "created_at")),
        _ => None,
    }
}

/// How many counted side effects `pool` (service `svc`'s database) holds (0 for a service
/// that counts none).
pub(super) async fn effect_count(svc: &str, pool: &PgPool) -> Result<i64, sqlx::Error> {
    let Some((table, ..)) = effect_source(svc) else { return Ok(0) };
    sqlx::query_scalar(sqlx::AssertSqlSafe(format!("SELECT count(*) FROM {table}"))).fetch_one(pool).await
}

/// Issue 22.2: the aggregates cases' database holds committed (a referral; an active
/// placement), whatever its client heard: the ground truth `no_loss` and `no_phantom`
/// hold every event and effect to.
async fn collect_committed(log: &Log, pool: &PgPool) -> anyhow::Result<()> {
    let rows: Vec<(Uuid, String, i64)> = bounded(
        COLLECT,
        "reading the committed referrals and placements",
        sqlx::query_as(
            "SELECT id, 'referrals', (EXTRACT(EPOCH FROM created_at) * 1000)::int8 FROM referrals \
             UNION ALL SELECT id, 'placements', (EXTRACT(EPOCH FROM COALESCE(activated_at, created_at)) * 1000)::int8 \
             FROM placements WHERE status = 'active'",
        )
        .fetch_all(pool),
    )
    .await?;
    for (aggregate, table, at) in rows {
        log.push_at(log.rel_db(at), Event::Committed { aggregate, table });
    }
    log.push(Event::CommittedRead);
    Ok(())
}

/// What the harness's redelivery counters (installed where a floor asks:
/// `count_inbox_redeliveries`, `count_dead_letter_redeliveries`) hold in `svc`'s database.
async fn collect_redelivered(log: &Log, svc: &str, pool: &PgPool) -> anyhow::Result<()> {
    let mut counts = [0u64; 2];
    for (count, sequence) in counts.iter_mut().zip(["chaos_inbox_redeliveries", "chaos_dead_letter_redeliveries"]) {
        let installed: bool = bounded(
            COLLECT,
            "looking for the harness's redelivery counters",
            sqlx::query_scalar("SELECT to_regclass($1) IS NOT NULL").bind(sequence).fetch_one(pool),
        )
        .await?;
        if installed {
            let n: i64 = bounded(
                COLLECT,
                "reading the harness's redelivery counters",
                sqlx::query_scalar(sqlx::AssertSqlSafe(format!("SELECT CASE WHEN is_called THEN last_value ELSE 0 END FROM {sequence}")))
                    .fetch_one(pool),
            )
            .await?;
            *count = n.max(0) as u64;
        }
    }
    // When each counted inbox arrival's record was stamped processed (run time): a floor
    // after a failover counts only the records stamped before it.
    let mut inbox_met_processed_ms = Vec::new();
    let hits: bool = bounded(
        COLLECT,
        "looking for the harness's redelivery records",
        sqlx::query_scalar("SELECT to_regclass('chaos_inbox_redelivery_hits') IS NOT NULL").fetch_one(pool),
    )
    .await?;
    if hits {
        let stamped: Vec<i64> = bounded(
            COLLECT,
            "reading the harness's redelivery records",
            sqlx::query_scalar("SELECT (EXTRACT(EPOCH FROM processed_at) * 1000)::int8 FROM chaos_inbox_redelivery_hits ORDER BY 1")
                .fetch_all(pool),
        )
        .await?;
        inbox_met_processed_ms = stamped.into_iter().map(|at| log.rel_db(at)).collect();
    }
    if counts != [0, 0] || !inbox_met_processed_ms.is_empty() {
        log.push(Event::Redelivered { service: svc.to_owned(), inbox: counts[0], dead_letters: counts[1], inbox_met_processed_ms });
    }
    Ok(())
}

/// Read what the databases say happened: staged envelopes and counted side effects (and,
/// in an exports run, the claim versions the harness's recorder kept).
pub(super) async fn collect(log: &Log, pools: &BTreeMap<String, PgPool>, exports: bool) -> anyhow::Result<()> {
    for (svc, pool) in pools {
        let rows: Vec<(Uuid, Option<Uuid>, bool, i32, i64, Option<String>)> = bounded(
            COLLECT,
            "reading the outbox",
            sqlx::query_as(
                "SELECT id, aggregate_id, published_at IS NOT NULL, attempts, (EXTRACT(EPOCH FROM created_at) * 1000)::int8, \
                        last_error FROM event_outbox",
            )
            .fetch_all(pool),
        )
        .await?;
        let pruned: Vec<(Uuid, i64)> = bounded(
            COLLECT,
            "reading pending rows deleted",
            sqlx::query_as("SELECT envelope_id, (EXTRACT(EPOCH FROM at) * 1000)::int8 FROM chaos_pruned_pending").fetch_all(pool),
        )
        .await?;
        for (envelope, at) in pruned {
            log.push_at(log.rel_db(at), Event::PrunedPending { envelope, service: svc.clone() });
        }
        // Inbox deletes, where the run recorded them (issue 22.6).
        let recorded: bool = bounded(COLLECT, "looking for the inbox-delete recorder", sqlx::query_scalar("SELECT to_regclass('chaos_inbox_deletes') IS NOT NULL").fetch_one(pool)).await?;
        if recorded {
            let deletes: Vec<(Uuid, i64, i64)> = bounded(
                COLLECT,
                "reading inbox deletes",
                sqlx::query_as("SELECT envelope_id, age_ms, (EXTRACT(EPOCH FROM at) * 1000)::int8 FROM chaos_inbox_deletes").fetch_all(pool),
            )
            .await?;
            for (envelope, age, at) in deletes {
                log.push_at(
                    log.rel_db(at),
                    Event::InboxPruned { envelope, service: svc.clone(), age_ms: age.max(0) as u64, window_ms: super::workload::INBOX_WINDOW_MS },
                );
            }
        }
        for (envelope, referral, published, attempts, at, last_error) in rows {
            log.push_at(log.rel_db(at), Event::Staged { envelope, referral, service: svc.clone(), published, attempts, last_error });
        }
        collect_redelivered(log, svc, pool).await?;
        if svc == "security" {
            collect_dead_letters(log, pool).await?;
        }
        if svc == "financial" {
            collect_exchanges(log, pool).await?;
            collect_ledger(log, pool).await?;
        }
        if svc == "cases" {
            collect_idempotency(log, pool, exports).await?;
            collect_committed(log, pool).await?;
        }
        if let Some((table, aggregate, at)) = effect_source(svc) {
            // What the consumer recorded in its §D2 inbox (issue 25: delivered by the broker).
            let inboxed: Vec<(Uuid, i64, Option<i64>)> = bounded(
                COLLECT,
                "reading the inbox",
                sqlx::query_as(
                    "SELECT envelope_id, (EXTRACT(EPOCH FROM received_at) * 1000)::int8, (EXTRACT(EPOCH FROM processed_at) * 1000)::int8 FROM event_inbox",
                )
                .fetch_all(pool),
            )
            .await?;
            for (envelope, at, processed_at) in inboxed {
                let processed_ms = processed_at.map(|p| log.rel_db(p));
                log.push_at(log.rel_db(at), Event::Inboxed { envelope, service: svc.clone(), processed: processed_ms.is_some(), processed_ms });
            }
            let rows: Vec<(Uuid, Option<Uuid>, i64, Option<String>)> = bounded(
                COLLECT,
                "reading the counted side effects",
                sqlx::query_as(sqlx::AssertSqlSafe(format!(
                    "SELECT envelope_id, {aggregate}, (EXTRACT(EPOCH FROM {at}) * 1000)::int8, replica FROM {table}"
                )))
                .fetch_all(pool),
            )
            .await?;
            for (envelope, referral, at, replica) in rows {
                log.push_at(log.rel_db(at), Event::Effect { envelope, referral, service: svc.clone(), replica });
            }
        }
    }
    Ok(())
}

/// cases' exports (one row per handler execution), its §D5 rows, and every version of
/// them the harness's trigger recorded (`chaos_claim_versions`, installed in an exports run
/// only).
async fn collect_idempotency(log: &Log, pool: &PgPool, exports: bool) -> anyhow::Result<()> {
    let runs: Vec<(Option<String>, Option<String>, i64, Option<i64>, Option<String>, i64, Option<String>)> = bounded(
        COLLECT,
        "reading the exports",
        sqlx::query_as(
            "SELECT idempotency_key, cache_key, size_bytes, generation, body_sha256, (EXTRACT(EPOCH FROM created_at) * 1000)::int8, replica FROM exports",
        )
        .fetch_all(pool),
    )
    .await?;
    for (key, cache_key, size, generation, body_sha256, at, replica) in runs {
        log.push_at(log.rel_db(at), Event::ExportRun { key, cache_key, size: size as u64, generation, body_sha256, replica });
    }
    let rows: Vec<(String, String, Option<i16>, Option<i64>, bool, i64)> = bounded(
        COLLECT,
        "reading the idempotency rows",
        sqlx::query_as(
            "SELECT cache_key, status, status_code, length(body)::int8, body_too_large, claim_generation FROM idempotency_responses",
        )
        .fetch_all(pool),
    )
    .await?;
    for (cache_key, status, status_code, body_len, body_too_large, generation) in rows {
        log.push(Event::IdempotencyRow { cache_key, status, status_code, body_len, body_too_large, generation });
    }
    if !exports {
        return Ok(());
    }
    let versions: Vec<(String, i64, String, Option<i64>, i64)> = bounded(
        COLLECT,
        "reading the recorded claim versions",
        sqlx::query_as(
            "SELECT cache_key, claim_generation, status, (EXTRACT(EPOCH FROM claim_expires_at) * 1000)::int8, \
               (EXTRACT(EPOCH FROM at) * 1000)::int8 FROM chaos_claim_versions ORDER BY id",
        )
        .fetch_all(pool),
    )
    .await?;
    for (cache_key, generation, status, expires, at) in versions {
        log.push_at(log.rel_db(at), Event::ClaimVersion { cache_key, generation, status, claim_expires_ms: expires.map(|e| log.rel_db(e)) });
    }
    Ok(())
}

/// Financial's side effects per placement period (issue 22.3): the payments the arbiter
/// guards, and what must be staged with each (its `payment.created`, its transmission).
async fn collect_ledger(log: &Log, pool: &PgPool) -> anyhow::Result<()> {
    let rows: Vec<(Uuid, String, i64, i64, i64)> = bounded(
        COLLECT,
        "reading financial's ledger",
        sqlx::query_as(
            "WITH p AS (SELECT placement_id, period_start::text AS period, count(*) AS n FROM payments GROUP BY 1, 2), \
                  e AS (SELECT (envelope->'payload'->>'placement_id')::uuid AS placement_id, envelope->'payload'->>'period_start' AS period, \
                               count(*) AS n FROM event_outbox WHERE event_type = 'payment.created' GROUP BY 1, 2), \
                  t AS (SELECT pay.placement_id, pay.period_start::text AS period, count(*) AS n \
                        FROM exchange_transactions x JOIN payments pay ON pay.id = x.payment_id GROUP BY 1, 2) \
             SELECT k.placement_id, k.period, COALESCE(p.n, 0), COALESCE(e.n, 0), COALESCE(t.n, 0) \
             FROM (SELECT placement_id, period FROM p UNION SELECT placement_id, period FROM e WHERE placement_id IS NOT NULL) k \
             LEFT JOIN p USING (placement_id, period) LEFT JOIN e USING (placement_id, period) LEFT JOIN t USING (placement_id, period)",
        )
        .fetch_all(pool),
    )
    .await?;
    let n = |x: i64| u32::try_from(x).unwrap_or(u32::MAX);
    for (placement, period, payments, created, transmissions) in rows {
        log.push(Event::PaymentLedger { placement, period, payments: n(payments), created_events: n(created), transmissions: n(transmissions) });
    }
    Ok(())
}

async fn collect_exchanges(log: &Log, pool: &PgPool) -> anyhow::Result<()> {
    let events: Vec<(String, Option<Uuid>, Option<Uuid>, Option<String>, i64)> = bounded(
        COLLECT,
        "reading exchange events",
        sqlx::query_as(
            "SELECT event_type, (envelope->'payload'->>'job_id')::uuid, (envelope->'payload'->>'transaction_id')::uuid, \
                    envelope->'payload'->>'replica', (EXTRACT(EPOCH FROM created_at) * 1000)::int8 \
             FROM event_outbox WHERE event_type IN ('exchange.sent', 'exchange.failed')",
        )
        .fetch_all(pool),
    )
    .await?;
    for (event_type, job, transaction, replica, at) in events {
        let (Some(job), Some(transaction)) = (job, transaction) else { continue };
        let outcome = event_type.trim_start_matches("exchange.").to_owned();
        log.push_at(log.rel_db(at), Event::Exchanged { job, transaction, outcome, replica });
    }
    let flips: Vec<(Uuid, String, String, i64)> = bounded(
        COLLECT,
        "reading transaction transitions",
        sqlx::query_as(
            "SELECT transaction_id, from_status, to_status, (EXTRACT(EPOCH FROM at) * 1000)::int8 FROM chaos_transaction_transitions ORDER BY id",
        )
        .fetch_all(pool),
    )
    .await?;
    for (transaction, from, to, at) in flips {
        log.push_at(log.rel_db(at), Event::TransactionStatus { transaction, from, to });
    }
    let releases: Vec<(Uuid, i64, i64)> = bounded(
        COLLECT,
        "reading send-job releases",
        sqlx::query_as("SELECT correlation_id, claim_generation, (EXTRACT(EPOCH FROM at) * 1000)::int8 FROM chaos_send_job_releases ORDER BY id")
            .fetch_all(pool),
    )
    .await?;
    for (correlation, generation, at) in releases {
        log.push_at(log.rel_db(at), Event::SendReleased { correlation, generation });
    }
    let claims: Vec<(Uuid, i64, i64, i64)> = bounded(
        COLLECT,
        "reading send-job claims",
        sqlx::query_as("SELECT correlation_id, from_generation, claim_generation, (EXTRACT(EPOCH FROM at) * 1000)::int8 FROM chaos_send_job_claims ORDER BY id")
            .fetch_all(pool),
    )
    .await?;
    for (correlation, from_generation, generation, at) in claims {
        log.push_at(log.rel_db(at), Event::SendClaimed { correlation, from_generation, generation });
    }
    let correlations: Vec<Uuid> = bounded(
        COLLECT,
        "reading the send jobs' correlation ids",
        sqlx::query_scalar("SELECT correlation_id FROM exchange_send_jobs ORDER BY correlation_id").fetch_all(pool),
    )
    .await?;
    log.push(Event::SendJobsHeld { correlations });
    Ok(())
}

/// The security service's record (§D3): every `dead_letter_audit` row, keyed by its bytes
/// as the tap keys a delivery, and every staged `security.dlq.threshold_exceeded`.
async fn collect_dead_letters(log: &Log, pool: &PgPool) -> anyhow::Result<()> {
    type Row = (String, Vec<u8>, String, Option<String>, Option<Uuid>, Option<String>, i64, i64, String);
    let rows: Vec<Row> = bounded(
        COLLECT,
        "reading dead_letter_audit",
        sqlx::query_as(
            "SELECT routing_key, raw_body, disposition, occurrence_token, envelope_id, event_type, \
                    (EXTRACT(EPOCH FROM dlq_received_at) * 1000)::int8, \
                    (EXTRACT(EPOCH FROM LEAST(COALESCE(occurred_at, dlq_received_at), dlq_received_at)) * 1000)::int8, \
                    xmin::text \
             FROM dead_letter_audit ORDER BY dlq_received_at, id",
        )
        .fetch_all(pool),
    )
    .await?;
    for (routing_key, raw, disposition, token, envelope, event_type, received, window, tx) in rows {
        log.push_at(
            log.rel_db(received),
            Event::Audited {
                key: crate::history::dead_letter_key(&routing_key, &raw),
                disposition,
                token,
                envelope,
                event_type,
                received_epoch_ms: received,
                window_epoch_ms: window,
                tx: Some(tx),
            },
        );
    }
    let events: Vec<(Option<String>, Option<i64>, i64, String)> = bounded(
        COLLECT,
        "reading threshold events",
        sqlx::query_as(
            "SELECT envelope->'payload'->>'event_type', (envelope->'payload'->>'count')::int8, \
                    (EXTRACT(EPOCH FROM created_at) * 1000)::int8, \
                    COALESCE((SELECT t.tx FROM chaos_outbox_tx t WHERE t.envelope_id = o.id), '') \
             FROM event_outbox o WHERE event_type = 'security.dlq.threshold_exceeded'",
        )
        .fetch_all(pool),
    )
    .await?;
    for (event_type, count, at, tx) in events {
        log.push_at(
            log.rel_db(at),
            Event::ThresholdExceeded { event_type: event_type.unwrap_or_default(), count: count.unwrap_or(-1), tx: Some(tx).filter(|t| !t.is_empty()) },
        );
    }
    Ok(())
}

/// What the replicas' own logs say (each log holds all incarnations of its replica, each
/// after a `--- start N of R (compat M) ---` line):
/// - every `inbox.reprocessed`: the inbox's own word that a re-execution was of an envelope
///   recorded but never stamped;
/// - every `outbox.stamped`: which replica, running which compat modes, stamped an
///   envelope published.
/// - every `outbox.claimed`: a replica's claim found the envelope's row committed.
pub(super) fn collect_logs(log: &Log, logs_dir: &Path) {
    let Ok(dir) = std::fs::read_dir(logs_dir) else { return };
    for entry in dir.flatten() {
        let path = entry.path();
        let Some(replica) = path.file_stem().and_then(|s| s.to_str()).map(str::to_owned) else { continue };
        let Ok(text) = std::fs::read_to_string(&path) else { continue };
        for (at, event) in parse_replica_log(&replica, &text, |epoch_ms| log.rel(epoch_ms)) {
            log.push_at(at.unwrap_or_else(|| log.now()), event);
        }
    }
}

/// The events one replica log reports, with their times (`rel` converts the log's epoch ms
/// to run time; None when a line has no readable timestamp).
pub(super) fn parse_replica_log(replica: &str, text: &str, rel: impl Fn(i64) -> u64) -> Vec<(Option<u64>, Event)> {
    let mut out = Vec::new();
    let mut compat: Vec<String> = Vec::new();
    for line in text.lines() {
        if let Some(modes) = line.strip_prefix("--- start ").and_then(|l| l.split_once("(compat ")).map(|(_, m)| m) {
            let modes = modes.trim_end_matches(" ---").trim_end_matches(')');
            compat = if modes == "-" { vec![] } else { modes.split(',').map(str::to_owned).collect() };
            continue;
        }
        let at = || {
            line.split_whitespace()
                .next()
                .and_then(|ts| chrono::DateTime::parse_from_rfc3339(ts).ok())
                .map(|ts| rel(ts.timestamp_millis()))
        };
        if line.contains("event=\"security.dlq.log_and_ack\"") {
            if let Some(key) = line.split_once("digest=").and_then(|(_, rest)| rest.split_whitespace().next()) {
                out.push((at(), Event::AckedUnrecorded { key: key.to_owned(), replica: replica.to_owned(), compat: compat.clone() }));
            }
            continue;
        }
        if line.contains("event=\"send_jobs.finalized\"") {
            let field = |name: &str| {
                line.split_once(&format!(" {name}=")).and_then(|(_, r)| r.split_whitespace().next()).map(|v| v.trim_matches('"').to_owned())
            };
            if let (Some(correlation), Some(result), Some(fence)) =
                (field("correlation_id").and_then(|c| c.parse::<Uuid>().ok()), field("result"), field("fence"))
            {
                let generation = field("generation").and_then(|g| g.parse::<i64>().ok());
                out.push((at(), Event::SendFinalized { correlation, replica: replica.to_owned(), result, applied: fence == "applied", generation }));
            }
            continue;
        }
        if line.contains("event=\"retention.cycle\"") {
            out.push((at(), Event::PruneCycle { replica: replica.to_owned(), kept_pending: 0 }));
            continue;
        }
        if line.contains("event=\"retention.outbox_unpublished_beyond_grace\"") {
            let rows = line.split_once(" rows=").and_then(|(_, r)| r.split_whitespace().next()).and_then(|n| n.parse().ok()).unwrap_or(0);
            // The cycle just logged saw these pending rows and kept them.
            if let Some((_, Event::PruneCycle { kept_pending, .. })) = out.iter_mut().rev().find(|(_, e)| matches!(e, Event::PruneCycle { .. })) {
                *kept_pending = rows;
            }
            continue;
        }
        if line.contains("event=\"subscriber.started\"") {
            if let Some(n) = line.split_once(" concurrency=").and_then(|(_, r)| r.split_whitespace().next()).and_then(|n| n.parse().ok()) {
                out.push((at(), Event::ConsumerStarted { replica: replica.to_owned(), concurrency: n }));
            }
            continue;
        }
        let absorbed = line.contains("event=\"financial.payment_replay_absorbed\"");
        let created = line.contains("event=\"financial.payment_created\"");
        let reprocessed = line.contains("event=\"inbox.reprocessed\"");
        let stamp_retry = line.contains("event=\"inbox.stamp_retry\"");
        let stamped = line.contains("event=\"outbox.stamped\"");
        let claimed = line.contains("event=\"outbox.claimed\"");
        // A consumer handing a message to dead-lettering: the broker path's reject, or the
        // app path's confirmed surface to craig.dlx (#1196).
        let rejected = line.contains("event=\"subscriber.permanent_failure\"") || line.contains("event=\"inbox.surfaced_to_dlx\"");
        if !reprocessed && !stamp_retry && !stamped && !claimed && !rejected && !absorbed && !created {
            continue;
        }
        let Some(envelope) = line
            .split_once("envelope_id=")
            .and_then(|(_, rest)| rest.split_whitespace().next())
            .and_then(|id| id.parse::<Uuid>().ok())
        else {
            continue;
        };
        let at = at();
        let event = if absorbed {
            Event::PaymentAbsorbed { envelope, replica: replica.to_owned() }
        } else if created {
            Event::PaymentCreated { envelope, replica: replica.to_owned() }
        } else if reprocessed {
            Event::Reprocessed { envelope, replica: replica.to_owned() }
        } else if stamp_retry {
            Event::StampRetry { envelope, replica: replica.to_owned() }
        } else if rejected {
            Event::Rejected { envelope, replica: replica.to_owned(), compat: compat.clone() }
        } else if claimed {
            Event::Claimed { envelope, replica: replica.to_owned() }
        } else {
            Event::Stamped { envelope, replica: replica.to_owned(), compat: compat.clone() }
        };
        out.push((at, event));
    }
    out
}

/// The CONTRACT's series from a replica's `GET /metrics` (bounded; empty when it does not
/// answer). Histograms keep their `_count` and `_sum`.
pub(super) async fn scrape_metrics(addr: &str) -> BTreeMap<String, f64> {
    let wanted = ["outbox_", "inbox_", "dlq_", "idempotency_"];
    let text = async {
        let client = reqwest::Client::builder().timeout(Duration::from_secs(3)).build().ok()?;
        client.get(format!("http://{addr}/metrics")).send().await.ok()?.text().await.ok()
    }
    .await
    .unwrap_or_default();
    text.lines()
        .filter(|l| !l.starts_with('#') && wanted.iter().any(|w| l.starts_with(w)) && !l.contains("_bucket"))
        .filter_map(|l| {
            let (series, value) = l.rsplit_once(' ')?;
            Some((series.to_owned(), value.parse().ok()?))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn replica_logs_say_who_stamped_what_under_which_compat() {
        let env = Uuid::from_u128(7);
        let text = format!(
            "--- start 1 of cases-1 (compat pre-1128) ---\n\
             2026-11-30T16:00:00.100000Z DEBUG craig_mq::outbox: event=\"outbox.stamped\" envelope_id={env}\n\
             --- start 2 of cases-1 (compat -) ---\n\
             2026-11-30T16:00:00.900000Z DEBUG craig_mq::outbox: event=\"outbox.claimed\" envelope_id={env}\n\
             2026-11-30T16:00:01.000000Z DEBUG craig_mq::outbox: event=\"outbox.stamped\" envelope_id={env}\n\
             2026-11-30T16:00:01.500000Z  WARN craig_mq::inbox: event=\"inbox.reprocessed\" envelope_id={env} source=x\n\
             2026-11-30T16:00:01.600000Z  WARN craig_mq::inbox: the handler succeeded; processed_at not stamped yet, trying again event=\"inbox.stamp_retry\" envelope_id={env} queue=craig-rules.events error=pool timed out while waiting for an open connection backoff_ms=50\n\
             2026-11-30T16:00:01.700000Z ERROR craig_mq::subscriber: dead-lettering to craig.dlx event=\"subscriber.permanent_failure\" queue=\"craig-rules.events\" envelope_id={env} error=no referral_id\n\
             2026-11-30T16:00:01.800000Z  WARN craig_mq::dlq: event=\"security.dlq.log_and_ack\" digest=00ff00ff00ff00ff envelope_id={env} routing_key=dlq.x error=db\n\
             2026-11-30T16:00:01.950000Z  INFO craig_fleet::send_jobs: event=\"send_jobs.finalized\" job_id={env} correlation_id={env} generation=2 result=\"failed\" fence=\"applied\" outcome=Failed(\"transport: timed out\")\n\
             2026-11-30T16:00:01.900000Z  INFO craig_mq::retention: event=\"retention.cycle\" outbox=0 inbox=0 idempotency=0 pre_965=false\n\
             2026-11-30T16:00:01.900000Z  WARN craig_mq::retention: pending outbox rows older than the grace: kept event=\"retention.outbox_unpublished_beyond_grace\" rows=10 grace_secs=3600\n\
             2026-11-30T16:00:02.000000Z  INFO craig_mq::subscriber: event=\"subscriber.started\" queue=\"craig-rules.events\" concurrency=32\n\
             2026-11-30T16:00:02.100000Z  INFO craig_fleet::financial: event=\"financial.payment_replay_absorbed\" envelope_id={env} payment_id={env} first_envelope={env}\n\
             2026-11-30T16:00:02.200000Z  INFO craig_fleet::financial: event=\"financial.payment_created\" envelope_id={env} payment_id={env} placement_id={env} amount_cents=100\n\
             not a line of interest envelope_id={env}\n"
        );
        let origin = chrono::DateTime::parse_from_rfc3339("2026-11-30T16:00:00Z").unwrap().timestamp_millis();
        let events = parse_replica_log("cases-1", &text, |ms| (ms - origin) as u64);
        assert_eq!(
            events,
            vec![
                (Some(100), Event::Stamped { envelope: env, replica: "cases-1".into(), compat: vec!["pre-1128".into()] }),
                (Some(900), Event::Claimed { envelope: env, replica: "cases-1".into() }),
                (Some(1000), Event::Stamped { envelope: env, replica: "cases-1".into(), compat: vec![] }),
                (Some(1500), Event::Reprocessed { envelope: env, replica: "cases-1".into() }),
                (Some(1600), Event::StampRetry { envelope: env, replica: "cases-1".into() }),
                (Some(1700), Event::Rejected { envelope: env, replica: "cases-1".into(), compat: vec![] }),
                (Some(1800), Event::AckedUnrecorded { key: "00ff00ff00ff00ff".into(), replica: "cases-1".into(), compat: vec![] }),
                (Some(1950), Event::SendFinalized { correlation: env, replica: "cases-1".into(), result: "failed".into(), applied: true, generation: Some(2) }),
                (Some(1900), Event::PruneCycle { replica: "cases-1".into(), kept_pending: 10 }),
                (Some(2000), Event::ConsumerStarted { replica: "cases-1".into(), concurrency: 32 }),
                (Some(2100), Event::PaymentAbsorbed { envelope: env, replica: "cases-1".into() }),
                (Some(2200), Event::PaymentCreated { envelope: env, replica: "cases-1".into() }),
            ]
        );
    }

}
