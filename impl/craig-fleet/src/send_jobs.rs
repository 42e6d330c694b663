//! Send-jobs — ADR-022 Amendment #1185: the partner HTTP send queue with the #1128 claim
//! lease ported and generation fencing on every transition.
//!
//! - **The lease:** a claim stamps `claimed_at` and bumps `claim_generation`; recovery is
//!   folded into the claim's WHERE (`claimed_at IS NULL OR claimed_at < now() -
//!   CLAIM_LEASE`), so an expired lease re-admits the row on the ordinary poll — there is no
//!   boot-time sweep. [`CLAIM_LEASE_SECS`] = 90, compile-time floor-asserted at three times
//!   the per-send transport cap [`SEND_TIMEOUT_SECS`] = 30.
//! - **The generation CAS:** every terminal and retry transition carries `AND status =
//!   'in_flight' AND claim_generation = $n` and reports [`Fence::Applied`] or
//!   [`Fence::Stale`]; on Stale the worker rolls back: no transaction stamp, no events.
//!   `exchange.sent` / `exchange.failed` are staged only after Applied, in the same
//!   transaction, so conflicting events cannot both be staged.
//! - **Transaction-side defense in depth:** [`update_transaction_status`] refuses a terminal
//!   target on an already-terminal row; [`retry_failed`] (`failed → pending`) is the only
//!   legal exit from a terminal status. (The transition spec's `Failed → Retry → Pending`
//!   drift the ADR annotates does not exist here: production goes `failed → pending`.)
//! - **At-least-once, stated:** a crash after the partner accepted and before the finalize
//!   re-sends after the lease expires: a duplicate, identical POST (and possibly a duplicate
//!   `exchange.sent`). `craig_correlation_id`, sent with every POST, is the partner-side
//!   dedup boundary. A poison job that kills workers mid-send re-claims indefinitely
//!   (`MAX_ATTEMPTS` counts adapter errors only), as the ADR accepts.
//!
//! Compat `pre-1185` is the send queue before the amendment: a boot-time sweep keyed on
//! `next_attempt_at` (scheduled eligibility, untouched at claim, so a job claimed out of a
//! backlog more than 60 s overdue looks stuck at once), a claim with no timestamp and no
//! generation, finalizers that UPDATE by bare id, and no terminal guard on the transaction.
//! Mixed-fleet deploys must drain old replicas first (an old replica's in-flight rows carry
//! no `claimed_at`, so a current replica re-admits them at once).

use std::time::Duration;

use serde_json::json;
use sqlx::PgPool;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

/// The verified per-send transport cap (the client's whole-request timeout).
pub const SEND_TIMEOUT_SECS: u64 = 30;
/// The send-jobs claim lease: three times the transport cap (the outbox's 60 s is too
/// tight for a full partner send).
pub const CLAIM_LEASE_SECS: u64 = 90;
const _: () = assert!(CLAIM_LEASE_SECS >= 3 * SEND_TIMEOUT_SECS, "the send-jobs lease must cover three full sends (#1185)");
/// Adapter errors (transport failures, 5xx) before a job is failed for good.
pub const MAX_ATTEMPTS: i32 = 5;
/// The pre-#1185 sweep's notion of "stuck": in flight and this far past `next_attempt_at`.
const PRE_1185_STUCK_SECS: i64 = 60;

pub const EXCHANGE_SENT: &str = "exchange.sent";
pub const EXCHANGE_FAILED: &str = "exchange.failed";

/// The outcome of a fenced transition.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fence {
    /// This worker's claim still held the row: the transition happened.
    Applied,
    /// The row is no longer this claim's (reclaimed after the lease, or finalized by
    /// another worker): nothing changed, and the caller must roll back.
    Stale,
}

/// A transaction status (`exchange_transactions.status`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TxStatus {
    Pending,
    Sent,
    Failed,
}

impl TxStatus {
    pub fn as_str(self) -> &'static str {
        match self {
            TxStatus::Pending => "pending",
            TxStatus::Sent => "sent",
            TxStatus::Failed => "failed",
        }
    }
}

/// What [`update_transaction_status`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Transition {
    Applied,
    /// A terminal target on an already-terminal row (or no such row): refused, unchanged.
    Refused,
}

/// One claimed job.
#[derive(Debug, Clone)]
pub struct Claimed {
    pub id: Uuid,
    pub transaction_id: Uuid,
    pub generation: i64,
    pub correlation_id: Uuid,
    pub payload: serde_json::Value,
    pub attempts: i32,
}

/// Stage a transmission (transaction + job) in the caller's transaction: the payment
/// handler calls it on a real insert only (#1179 staged-iff-inserted).
pub async fn stage_in_tx(
    tx: &mut sqlx::Transaction<'_, sqlx::Postgres>,
    payment_id: Option<Uuid>,
    payload: &serde_json::Value,
) -> Result<Uuid, sqlx::Error> {
    let transaction: Uuid =
        sqlx::query_scalar("INSERT INTO exchange_transactions (payment_id) VALUES ($1) RETURNING id").bind(payment_id).fetch_one(&mut **tx).await?;
    sqlx::query("INSERT INTO exchange_send_jobs (transaction_id, payload) VALUES ($1, $2)")
        .bind(transaction)
        .bind(payload)
        .execute(&mut **tx)
        .await?;
    Ok(transaction)
}

type Row = (Uuid, Uuid, i64, Uuid, serde_json::Value, i32);

fn claimed(rows: Vec<Row>) -> Vec<Claimed> {
    rows.into_iter()
        .map(|(id, transaction_id, generation, correlation_id, payload, attempts)| Claimed {
            id,
            transaction_id,
            generation,
            correlation_id,
            payload,
            attempts,
        })
        .collect()
}

/// Claim up to `n` due jobs: pending ones, and in-flight ones whose lease expired
/// (`lease`: [`CLAIM_LEASE_SECS`] in production; tests pass their own).
pub async fn claim(pool: &PgPool, n: i64, lease: Duration) -> Result<Vec<Claimed>, sqlx::Error> {
    let rows: Vec<Row> = sqlx::query_as(
        "UPDATE exchange_send_jobs j SET status = 'in_flight', claimed_at = now(), claim_generation = j.claim_generation + 1 \
         WHERE j.id IN (SELECT id FROM exchange_send_jobs \
                        WHERE status IN ('pending', 'in_flight') AND next_attempt_at <= now() \
                          AND (claimed_at IS NULL OR claimed_at < now() - make_interval(secs => $2)) \
                        ORDER BY next_attempt_at LIMIT $1 FOR UPDATE SKIP LOCKED) \
         RETURNING j.id, j.transaction_id, j.claim_generation, j.correlation_id, j.payload, j.attempts",
    )
    .bind(n)
    .bind(lease.as_secs_f64())
    .fetch_all(pool)
    .await?;
    Ok(claimed(rows))
}

/// Compat `pre-1185`: claim pending due jobs only, with no timestamp and no generation.
pub async fn claim_pre_1185(pool: &PgPool, n: i64) -> Result<Vec<Claimed>, sqlx::Error> {
    let rows: Vec<Row> = sqlx::query_as(
        "UPDATE exchange_send_jobs j SET status = 'in_flight' \
         WHERE j.id IN (SELECT id FROM exchange_send_jobs WHERE status = 'pending' AND next_attempt_at <= now() \
                        ORDER BY next_attempt_at LIMIT $1 FOR UPDATE SKIP LOCKED) \
         RETURNING j.id, j.transaction_id, j.claim_generation, j.correlation_id, j.payload, j.attempts",
    )
    .bind(n)
    .fetch_all(pool)
    .await?;
    Ok(claimed(rows))
}

/// Compat `pre-1185`: the bootstrap-only recovery sweep, keyed on `next_attempt_at`.
pub async fn recover_at_boot_pre_1185(pool: &PgPool) -> Result<u64, sqlx::Error> {
    let n = sqlx::query(
        "UPDATE exchange_send_jobs SET status = 'pending' \
         WHERE status = 'in_flight' AND next_attempt_at < now() - make_interval(secs => $1)",
    )
    .bind(PRE_1185_STUCK_SECS as f64)
    .execute(pool)
    .await?
    .rows_affected();
    Ok(n)
}

/// Move a transaction to `to`. Guarded (current): a terminal target on an already-terminal
/// row is refused; `failed → pending` goes through [`retry_failed`] only. Unguarded is
/// compat `pre-1185` (bare id).
pub async fn update_transaction_status(
    tx: &mut sqlx::Transaction<'_, sqlx::Postgres>,
    id: Uuid,
    to: TxStatus,
    guarded: bool,
) -> Result<Transition, sqlx::Error> {
    let sql = if guarded {
        "UPDATE exchange_transactions SET status = $2, updated_at = now() WHERE id = $1 AND status = 'pending'"
    } else {
        "UPDATE exchange_transactions SET status = $2, updated_at = now() WHERE id = $1"
    };
    let n = sqlx::query(sql).bind(id).bind(to.as_str()).execute(&mut **tx).await?.rows_affected();
    Ok(if n == 1 { Transition::Applied } else { Transition::Refused })
}

/// The only legal exit from a terminal status: a failed transaction back to pending, its
/// job re-pended (unclaimed, due now, attempts reset) for another round of sends.
pub async fn retry_failed(pool: &PgPool, transaction: Uuid) -> Result<Transition, sqlx::Error> {
    let mut tx = pool.begin().await?;
    let n = sqlx::query("UPDATE exchange_transactions SET status = 'pending', updated_at = now() WHERE id = $1 AND status = 'failed'")
        .bind(transaction)
        .execute(&mut *tx)
        .await?
        .rows_affected();
    if n != 1 {
        return Ok(Transition::Refused);
    }
    let jobs = sqlx::query(
        "UPDATE exchange_send_jobs SET status = 'pending', claimed_at = NULL, attempts = 0, next_attempt_at = now(), finished_at = NULL \
         WHERE transaction_id = $1 AND status = 'failed'",
    )
    .bind(transaction)
    .execute(&mut *tx)
    .await?
    .rows_affected();
    if jobs == 0 {
        // No failed job to re-send: a pending transaction would never be sent. Unchanged.
        tx.rollback().await?;
        return Ok(Transition::Refused);
    }
    tx.commit().await?;
    Ok(Transition::Applied)
}

/// How a send ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Sent {
    /// 2xx: the partner has it.
    Accepted,
    /// 4xx: the partner refused it for good.
    Refused(String),
    /// Transport error, timeout or 5xx: retried until [`MAX_ATTEMPTS`].
    Failed(String),
}

/// The terminal or retry transition for `job` after `sent`, fenced by its claim (unfenced
/// under `pre_1185`), with the transaction stamp and the event staged in the same
/// transaction only on Applied.
pub async fn finalize(pool: &PgPool, job: &Claimed, sent: &Sent, replica: Option<&str>, pre_1185: bool) -> Result<Fence, sqlx::Error> {
    let fence = if pre_1185 { "" } else { " AND status = 'in_flight' AND claim_generation = $3" };
    let (job_sql, outcome): (String, Option<TxStatus>) = match sent {
        Sent::Accepted => (format!("UPDATE exchange_send_jobs SET status = 'sent', finished_at = now(), last_error = $2 WHERE id = $1{fence}"), Some(TxStatus::Sent)),
        Sent::Refused(_) => (format!("UPDATE exchange_send_jobs SET status = 'failed', finished_at = now(), last_error = $2 WHERE id = $1{fence}"), Some(TxStatus::Failed)),
        // `attempts` counts adapter errors only (a lease re-claim after a crash spends none).
        Sent::Failed(_) if job.attempts + 1 >= MAX_ATTEMPTS => (
            format!("UPDATE exchange_send_jobs SET status = 'failed', attempts = attempts + 1, finished_at = now(), last_error = $2 WHERE id = $1{fence}"),
            Some(TxStatus::Failed),
        ),
        Sent::Failed(_) => (
            // Retry: back to pending, unclaimed, due after a capped exponential backoff.
            format!(
                "UPDATE exchange_send_jobs SET status = 'pending', claimed_at = NULL, last_error = $2, attempts = attempts + 1, \
                 next_attempt_at = now() + make_interval(secs => LEAST(60, 2 ^ (attempts + 1))) WHERE id = $1{fence}"
            ),
            None,
        ),
    };
    let error = match sent {
        Sent::Accepted => None,
        Sent::Refused(e) | Sent::Failed(e) => Some(e.as_str()),
    };
    let mut tx = pool.begin().await?;
    let mut q = sqlx::query(sqlx::AssertSqlSafe(job_sql)).bind(job.id).bind(error);
    if !pre_1185 {
        q = q.bind(job.generation);
    }
    if q.execute(&mut *tx).await?.rows_affected() != 1 {
        tx.rollback().await?;
        tracing::warn!(event = "send_jobs.finalize_stale", job_id = %job.id, generation = job.generation, "the claim no longer holds the job; nothing stamped, no event");
        return Ok(Fence::Stale);
    }
    if let Some(to) = outcome {
        if update_transaction_status(&mut tx, job.transaction_id, to, !pre_1185).await? == Transition::Refused {
            // Defense in depth: the transaction is already terminal. Its transaction is not
            // touched and no event is staged; the job is closed (so it is never re-sent) with
            // the reason.
            tx.rollback().await?;
            tracing::error!(event = "send_jobs.terminal_flip_refused", job_id = %job.id, transaction_id = %job.transaction_id, to = to.as_str());
            let closed = sqlx::query(
                "UPDATE exchange_send_jobs SET status = 'failed', finished_at = now(), \
                 last_error = 'refused: its transaction is already terminal' \
                 WHERE id = $1 AND status = 'in_flight' AND claim_generation = $2",
            )
            .bind(job.id)
            .bind(job.generation)
            .execute(pool)
            .await?
            .rows_affected();
            tracing::warn!(event = "send_jobs.closed_on_terminal_transaction", job_id = %job.id, closed = closed == 1);
            return Ok(Fence::Stale);
        }
        let event_type = if to == TxStatus::Sent { EXCHANGE_SENT } else { EXCHANGE_FAILED };
        let env = craig_mq::EventEnvelope::new(
            event_type,
            "financial",
            Some(job.transaction_id),
            json!({
                "job_id": job.id,
                "transaction_id": job.transaction_id,
                "craig_correlation_id": job.correlation_id,
                "claim_generation": job.generation,
                "replica": replica,
                "error": error,
            }),
        )
        .expect("static event type and service name are valid");
        craig_mq::publish_in_tx(&mut tx, &env).await?;
    }
    tx.commit().await?;
    Ok(Fence::Applied)
}

/// The send worker's settings.
#[derive(Debug, Clone)]
pub struct SendConfig {
    /// Where the partner takes POSTs (`CRAIG_PARTNER_URL`).
    pub partner_url: String,
    pub poll: Duration,
    pub batch: i64,
    /// The per-send transport cap (`CRAIG_SEND_TIMEOUT_SECS`, at most [`SEND_TIMEOUT_SECS`]).
    pub send_timeout: Duration,
    /// The claim lease (`CRAIG_SEND_CLAIM_LEASE_SECS`, default [`CLAIM_LEASE_SECS`]): at least
    /// three times `send_timeout`, checked by [`SendConfig::timing_from_env`].
    pub lease: Duration,
    pub pre_1185: bool,
    pub replica: Option<String>,
}

impl SendConfig {
    /// The production timing (30 s cap, 90 s lease) unless the environment shortens it
    /// (a test harness does, to see a lease expire in seconds); the #1185 floor holds either
    /// way.
    pub fn timing_from_env(lookup: impl Fn(&str) -> Option<String>) -> Result<(Duration, Duration), String> {
        let secs = |name: &str, default: u64| -> Result<u64, String> {
            lookup(name).map_or(Ok(default), |v| v.trim().parse().map_err(|_| format!("{name}={v:?} is not a whole number of seconds")))
        };
        let timeout = secs("CRAIG_SEND_TIMEOUT_SECS", SEND_TIMEOUT_SECS)?;
        let lease = secs("CRAIG_SEND_CLAIM_LEASE_SECS", CLAIM_LEASE_SECS)?;
        if timeout == 0 || timeout > SEND_TIMEOUT_SECS {
            return Err(format!("CRAIG_SEND_TIMEOUT_SECS={timeout} must be 1..={SEND_TIMEOUT_SECS} (the verified transport cap)"));
        }
        if lease < 3 * timeout {
            return Err(format!(
                "CRAIG_SEND_CLAIM_LEASE_SECS={lease} must be at least 3 x CRAIG_SEND_TIMEOUT_SECS ({}): a shorter lease re-admits a job whose send is still running (#1185)",
                3 * timeout
            ));
        }
        Ok((Duration::from_secs(timeout), Duration::from_secs(lease)))
    }
}

/// POST one job to the partner, with `craig_correlation_id` in the body and as a header.
async fn send(http: &reqwest::Client, cfg: &SendConfig, job: &Claimed) -> Sent {
    let body = json!({ "craig_correlation_id": job.correlation_id, "transaction_id": job.transaction_id, "payload": job.payload });
    let mut req = http.post(&cfg.partner_url).header("craig-correlation-id", job.correlation_id.to_string()).json(&body);
    if let Some(r) = &cfg.replica {
        req = req.header("craig-replica", r);
    }
    match req.send().await {
        Ok(resp) if resp.status().is_success() => Sent::Accepted,
        // A 4xx is the partner's final answer on this transmission (a 409: it is processing
        // the same craig_correlation_id from another POST, which only a second sender inside
        // a live lease can cause).
        Ok(resp) if resp.status().is_client_error() => Sent::Refused(format!("partner answered {}", resp.status())),
        Ok(resp) => Sent::Failed(format!("partner answered {}", resp.status())),
        Err(e) => Sent::Failed(format!("transport: {e}")),
    }
}

/// The send worker: claim, POST every claimed job concurrently, finalize each; until
/// `shutdown`, then finish the sends in flight (a graceful stop drains its claims). The node
/// stops its outbox worker only after this returns, so the last `exchange.*` events staged
/// are published before the node exits.
pub async fn run(pool: PgPool, cfg: SendConfig, shutdown: CancellationToken) {
    let http = match reqwest::Client::builder().timeout(cfg.send_timeout).build() {
        Ok(c) => c,
        Err(e) => {
            tracing::error!(event = "send_jobs.client_failed", error = %e);
            return;
        }
    };
    if cfg.pre_1185 {
        match recover_at_boot_pre_1185(&pool).await {
            Ok(n) => tracing::info!(event = "send_jobs.boot_sweep", reset = n, "pre-1185: in-flight jobs past next_attempt_at + 60 s reset to pending"),
            Err(e) => tracing::warn!(event = "send_jobs.boot_sweep_failed", error = %e),
        }
    }
    tracing::info!(event = "send_jobs.started", partner = %cfg.partner_url, lease_secs = cfg.lease.as_secs(), send_timeout_secs = cfg.send_timeout.as_secs());
    while !shutdown.is_cancelled() {
        let jobs = if cfg.pre_1185 { claim_pre_1185(&pool, cfg.batch).await } else { claim(&pool, cfg.batch, cfg.lease).await };
        let jobs = match jobs {
            Ok(j) => j,
            Err(e) => {
                tracing::warn!(event = "send_jobs.claim_failed", error = %e);
                Vec::new()
            }
        };
        let full = jobs.len() as i64 == cfg.batch;
        let sends = jobs.iter().map(|job| async {
            tracing::debug!(event = "send_jobs.claimed", job_id = %job.id, generation = job.generation, correlation_id = %job.correlation_id);
            let sent = send(&http, &cfg, job).await;
            if sent == Sent::Accepted {
                // The at-least-once window: the partner has it, the job is not finalized.
                craig_mq::crash::hit("send_jobs::after_post_before_finalize");
            }
            match finalize(&pool, job, &sent, cfg.replica.as_deref(), cfg.pre_1185).await {
                Ok(fence) => {
                    let result = match sent {
                        Sent::Accepted => "accepted",
                        Sent::Refused(_) => "refused",
                        Sent::Failed(_) => "failed",
                    };
                    let fence = if fence == Fence::Applied { "applied" } else { "stale" };
                    tracing::info!(
                        event = "send_jobs.finalized",
                        job_id = %job.id,
                        correlation_id = %job.correlation_id,
                        generation = job.generation,
                        result,
                        fence,
                        outcome = ?sent,
                    );
                }
                // The lease re-admits the job; the partner's correlation id dedups a resend.
                Err(e) => tracing::warn!(event = "send_jobs.finalize_failed", job_id = %job.id, error = %e),
            }
        });
        futures_util::future::join_all(sends).await;
        if !full {
            tokio::select! {
                _ = shutdown.cancelled() => {}
                _ = tokio::time::sleep(cfg.poll) => {}
            }
        }
    }
}
