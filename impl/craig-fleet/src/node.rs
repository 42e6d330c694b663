//! One `craig-node` process: HTTP routes, the outbox worker and the service's consumers,
//! all stopped by one cancellation token (SIGTERM → drain → exit 0).

use std::net::SocketAddr;
use std::time::Duration;

use anyhow::Context as _;
use axum::extract::FromRef;
use axum::routing::get;
use axum::{Json, Router};
use craig_api::JwtKey;
use craig_mq::dlq::{DlqConsumerConfig, subscribe_dlq};
use craig_mq::subscriber::{SubscriberConfig, run_subscriber};
use craig_mq::topology::{QueueSpec, QueueType, consumer_queue};
use craig_mq::{DrainMode, OutboxWorker, ServiceSettings};
use serde_json::json;
use sqlx::PgPool;
use sqlx::postgres::PgPoolOptions;
use tokio_util::sync::CancellationToken;

use crate::compat::{Compat, CompatSet};
use crate::service::Service;
use crate::{cases, financial, rules, security};

#[derive(Clone)]
pub struct AppState {
    pub service: Service,
    pub pool: PgPool,
    pub key: JwtKey,
    pub compat: CompatSet,
    /// Only under compat `pre-d1`.
    pub direct: Option<std::sync::Arc<crate::compat::DirectPublisher>>,
}

impl FromRef<AppState> for JwtKey {
    fn from_ref(s: &AppState) -> JwtKey {
        s.key.clone()
    }
}

pub struct NodeOptions {
    pub service: Service,
    pub http: SocketAddr,
    pub compat: CompatSet,
    pub settings: ServiceSettings,
    pub jwt_secret: String,
}

/// A lazily connecting pool: the node starts (and serves `/healthz`) while its database is
/// still down, and every user of the pool retries on its own schedule.
///
/// Sized [`pool_size`]: a connection for each handler the consumer may run at once, plus
/// room for the outbox worker (its pipelined claim, publish and stamp), the HTTP routes and
/// the prune, so a busy consumer never starves a stamp into its lease.
pub fn pool(url: &str, connections: u32) -> anyhow::Result<PgPool> {
    PgPoolOptions::new()
        .max_connections(connections)
        .acquire_timeout(Duration::from_secs(5))
        .connect_lazy(url)
        .map_err(|e| anyhow::anyhow!("{}", redact_error(&e.to_string(), url)))
        .with_context(|| format!("bad DATABASE_URL {:?}", craig_mq::settings::redact(url)))
}

/// Connections of a node's pool: 10 besides the consumer's `concurrency` handlers.
pub fn pool_size(consumer_concurrency: u16) -> u32 {
    10 + u32::from(consumer_concurrency)
}

/// An error text with `url`'s passwords removed (both forms), should the driver have echoed them.
fn redact_error(text: &str, url: &str) -> String {
    craig_mq::settings::redact_text(text, url)
}

/// Apply `service`'s migrations, retrying the connection for up to `wait`.
pub async fn migrate(service: Service, url: &str, wait: Duration) -> anyhow::Result<()> {
    migrate_for(service, url, wait, &CompatSet::default()).await
}

/// Apply the schema a fleet running `compat` had ([`Service::schema`]: the current one
/// without the migrations of the amendments the modes revert).
pub async fn migrate_for(service: Service, url: &str, wait: Duration, compat: &CompatSet) -> anyhow::Result<()> {
    let deadline = tokio::time::Instant::now() + wait;
    let pool = loop {
        // Each attempt bounded (sqlx's own default retries a refused connection for 30 s),
        // so `--wait` is what the caller waits.
        let left = deadline.saturating_duration_since(tokio::time::Instant::now());
        let attempt = left.clamp(Duration::from_secs(1), Duration::from_secs(5));
        match PgPoolOptions::new().max_connections(1).acquire_timeout(attempt).connect(url).await {
            Ok(p) => break p,
            Err(e) if tokio::time::Instant::now() < deadline => {
                tracing::warn!(event = "node.migrate_waiting", error = %redact_error(&e.to_string(), url));
                tokio::time::sleep(Duration::from_millis(250)).await;
            }
            Err(e) => {
                return Err(anyhow::anyhow!("{}", redact_error(&e.to_string(), url)))
                    .with_context(|| format!("connecting to {} to migrate {service}", craig_mq::settings::redact(url)));
            }
        }
    };
    service.schema(compat).run(&pool).await.with_context(|| format!("applying migrations/{service}"))?;
    pool.close().await;
    Ok(())
}

/// The whole fleet's broker topology (CONTRACT § fleet, `craig-node topology`): both
/// exchanges, the DLQ and its binding, and every service's consumer queue with its
/// bindings and DLX arguments (ADR-022 §D3). Idempotent. This is the deploy step before any
/// node starts: publishes are `mandatory`, so an event whose consumer queue does not exist
/// yet stays pending (unroutable) until it does — and once security's `#` audit queue
/// exists, an event routes there even when its real consumer's queue is still missing.
/// Returns the queues declared.
/// Every queue is of `queue_type` (`CRAIG_QUEUE_TYPE`, issue 25).
pub async fn declare_topology(amqp_url: &str, with_dlx: bool, queue_type: QueueType) -> anyhow::Result<Vec<QueueSpec>> {
    let conn = craig_mq::publisher::connect(amqp_url, 10, "craig-topology").await.context("connecting to AMQP_URL")?;
    let ch = conn.create_channel().await?;
    // The operator's part first (#1202): services only check that the exchanges exist.
    craig_mq::topology::declare_exchanges(&ch, queue_type).await.context("declaring the exchanges and the DLQ (needs the operator's credential)")?;
    let mut declared = Vec::new();
    for service in crate::service::ALL {
        if let Some(spec) = queue_spec(service, with_dlx, queue_type) {
            craig_mq::topology::declare_consumer_queue(&ch, &spec)
                .await
                .with_context(|| format!("declaring {}", spec.queue))?;
            declared.push(spec);
        }
    }
    let _ = tokio::time::timeout(Duration::from_secs(2), conn.close(200, "declared".into())).await;
    Ok(declared)
}

/// `service`'s consumer queue as deployed (`None` for a service that consumes nothing).
pub fn queue_spec(service: Service, with_dlx: bool, queue_type: QueueType) -> Option<QueueSpec> {
    let bindings = service.queue_bindings();
    (!bindings.is_empty()).then(|| QueueSpec {
        queue: consumer_queue(service.name()),
        bindings: bindings.iter().map(|s| s.to_string()).collect(),
        with_dlx,
        queue_type,
    })
}

/// The process's Prometheus recorder (CONTRACT § Metrics), installed once; `None` when
/// another recorder was installed first.
fn metrics_handle() -> Option<&'static metrics_exporter_prometheus::PrometheusHandle> {
    use metrics_exporter_prometheus::{Matcher, PrometheusBuilder};
    static HANDLE: std::sync::OnceLock<Option<metrics_exporter_prometheus::PrometheusHandle>> = std::sync::OnceLock::new();
    HANDLE
        .get_or_init(|| {
            // Buckets around ADR-022's LISTEN/NOTIFY trigger (publish lag p95 > 5 s).
            let lag = [0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0];
            let handle = PrometheusBuilder::new()
                .set_buckets_for_metric(Matcher::Full(craig_mq::metrics::OUTBOX_PUBLISH_LAG.into()), &lag)
                .ok()?
                .install_recorder()
                .ok()?;
            craig_mq::metrics::describe();
            craig_api::idempotency::describe_metrics();
            Some(handle)
        })
        .as_ref()
}

/// `GET /metrics`: Prometheus text.
async fn render_metrics() -> axum::response::Response {
    use axum::response::IntoResponse;
    match metrics_handle() {
        Some(h) => ([(axum::http::header::CONTENT_TYPE, "text/plain; version=0.0.4")], h.render()).into_response(),
        None => (axum::http::StatusCode::SERVICE_UNAVAILABLE, "no metrics recorder in this process").into_response(),
    }
}

/// The §D5 layer for this node's idempotent routes: the shared table, or under compat
/// `pre-d5` a map in this process; the claim's life `CRAIG_IDEMPOTENCY_CLAIM_SECS` (1..=30,
/// 30 in production; a harness shortens it to see a claim expire).
fn idempotency_layer(opts: &NodeOptions, service: Service, pool: &PgPool) -> anyhow::Result<craig_api::idempotency::IdempotencyLayer> {
    use craig_api::idempotency::{Config, IdempotencyLayer, Store};
    let claim_secs = claim_secs(std::env::var("CRAIG_IDEMPOTENCY_CLAIM_SECS").ok().as_deref())?;
    let mut cfg = Config::new(JwtKey::new(&opts.jwt_secret), service.audience());
    cfg.claim_ttl = Duration::from_secs(claim_secs);
    // CRAIG_IDEMPOTENCY_TTL_HOURS decides a row's life (issue 21.6); 0 only switches its
    // prune off (§ Retention policy), the life staying the default 24 h.
    cfg.response_ttl = match opts.settings.retention.idempotency_hours {
        0 => craig_api::idempotency::RESPONSE_TTL,
        h => Duration::from_secs(u64::from(h) * 3600),
    };
    cfg.pre_1183 = opts.compat.has(Compat::Pre1183);
    cfg.pre_1184 = opts.compat.has(Compat::Pre1184);
    let store = if opts.compat.has(Compat::PreD5) { Store::memory() } else { Store::postgres(pool.clone()) };
    Ok(IdempotencyLayer::new(cfg, store))
}

/// `CRAIG_IDEMPOTENCY_CLAIM_SECS` (`value`; unset: §D5's 30 s): a whole number of seconds,
/// 1..=30. A claim may be shortened for a harness to see it expire, never lengthened past
/// the ADR's 30 s nor set to 0 (every claim expired at birth: a live winner's key re-claimed
/// by the next request, its handler run twice).
fn claim_secs(value: Option<&str>) -> anyhow::Result<u64> {
    use craig_api::idempotency::CLAIM_TTL;
    let Some(v) = value else { return Ok(CLAIM_TTL.as_secs()) };
    match v.trim().parse::<u64>() {
        Ok(n) if (1..=CLAIM_TTL.as_secs()).contains(&n) => Ok(n),
        _ => anyhow::bail!("CRAIG_IDEMPOTENCY_CLAIM_SECS={v:?} must be a whole number of seconds, 1..={}", CLAIM_TTL.as_secs()),
    }
}

/// Run until `shutdown` is cancelled, then drain and return.
pub async fn run(opts: NodeOptions, shutdown: CancellationToken) -> anyhow::Result<()> {
    let service = opts.service;
    metrics_handle();
    let pool = pool(&opts.settings.database_url, pool_size(opts.settings.consumer_concurrency))?;
    let direct = opts.compat.has(Compat::PreD1).then(|| {
        std::sync::Arc::new(crate::compat::DirectPublisher::new(&opts.settings.amqp_url, opts.settings.publisher))
    });
    let state = AppState {
        service,
        pool: pool.clone(),
        key: JwtKey::new(&opts.jwt_secret),
        compat: opts.compat.clone(),
        direct,
    };

    let mut app = Router::new()
        .route("/healthz", get(|| async { Json(json!({ "status": "ok" })) }))
        .route("/metrics", get(render_metrics));
    if service == Service::Cases {
        app = app.merge(cases::router(idempotency_layer(&opts, service, &pool)?));
    }
    // §D4: every service's admin replay, refused past the outbox retention (#965/#1129).
    let replay = craig_api::replay::router(craig_api::replay::ReplayState {
        pool: pool.clone(),
        key: JwtKey::new(&opts.jwt_secret),
        service: service.name().to_owned(),
        retention: opts.settings.retention,
    });
    let listener = tokio::net::TcpListener::bind(opts.http).await.with_context(|| format!("binding {}", opts.http))?;
    let addr = listener.local_addr()?;
    // One stdout line a supervisor can wait for (the port may have been 0).
    println!("craig-node {service} listening on {addr}");
    tracing::info!(event = "node.started", %service, %addr);

    let mut tasks = tokio::task::JoinSet::new();
    let http_stop = shutdown.clone();
    tasks.spawn(async move {
        let served = axum::serve(listener, app.with_state(state).merge(replay)).with_graceful_shutdown(http_stop.cancelled_owned()).await;
        if let Err(e) = served {
            tracing::error!(event = "node.http_failed", error = %e);
        }
    });

    let mode = if opts.compat.has(Compat::Pre1128) { DrainMode::Pre1128 } else { DrainMode::ClaimLease };
    // The retention prune runs inside the worker (#965/#1129; compat pre-965: the prune that
    // deleted pending rows and windowed the inbox like the outbox).
    let prune = craig_mq::retention::PruneConfig { pre_965: opts.compat.has(Compat::Pre965), ..opts.settings.prune };
    let worker = OutboxWorker::new(pool.clone(), &opts.settings.amqp_url, opts.settings.publisher, opts.settings.outbox)
        .with_mode(mode)
        .with_notify(opts.settings.outbox_notify)
        .with_prune(prune);
    craig_mq::outbox::notify::set_staging_notifies(opts.settings.outbox_notify);
    // The outbox stops last: whatever the other tasks stage while they drain (financial's
    // send queue finishing its sends stages exchange.*) is still published.
    let outbox_stop = CancellationToken::new();
    tasks.spawn(worker.run(outbox_stop.clone()));
    let mut before_outbox: Vec<tokio::sync::oneshot::Receiver<()>> = Vec::new();

    let own_queue = queue_spec(service, !opts.compat.has(Compat::PreD3), opts.settings.queue_type);
    // Every service with a queue consumes it (`service::tests`): its subscriber declares it.
    if let (Some(spec), false) = (own_queue, service.consumes().is_empty()) {
        let queue = spec.queue.clone();
        let cfg = SubscriberConfig {
            amqp_url: opts.settings.amqp_url.clone(),
            spec,
            prefetch: craig_mq::settings::CONSUMER_PREFETCH,
            concurrency: opts.settings.consumer_concurrency,
            heartbeat_secs: opts.settings.publisher.heartbeat_secs,
            retry_delay: Duration::from_millis(500),
            reconnect_delay: Duration::from_secs(1),
        };
        let use_inbox = !opts.compat.has(Compat::PreD2);
        // The inbox-backed consumers (rules, financial): the inbox, its retry cap and the
        // app dead-letter path keyed by their own queue (§D3, #1196).
        let inbox_consumer = |queue: String| {
            let app_path = use_inbox.then(|| {
                let mode = craig_mq::inbox::SurfaceMode {
                    producer_keyed: opts.compat.has(Compat::Pre1196),
                    token_per_call: opts.compat.has(Compat::Pre1181),
                };
                let surface = craig_mq::inbox::Surface::new(&opts.settings.amqp_url, opts.settings.publisher, mode);
                (craig_mq::inbox::RetryCap::new(opts.settings.inbox_retry_cap), surface)
            });
            std::sync::Arc::new(crate::consumer::Consumer {
                queue,
                use_inbox,
                replica: std::env::var("CRAIG_REPLICA").ok().filter(|r| !r.is_empty()),
                app_path,
            })
        };
        match service {
            Service::Rules => {
                let consumer = inbox_consumer(queue);
                let pool = pool.clone();
                let handler = move |env| {
                    let (pool, consumer) = (pool.clone(), consumer.clone());
                    async move { rules::on_referral_created(&pool, &consumer, env).await }
                };
                tasks.spawn(run_subscriber(cfg, handler, shutdown.clone()));
            }
            Service::Financial => {
                // #1185: the partner send queue, where the node knows its partner.
                if let Some(partner_url) = std::env::var("CRAIG_PARTNER_URL").ok().filter(|u| !u.is_empty()) {
                    let (send_timeout, lease) = crate::send_jobs::SendConfig::timing_from_env(|k| std::env::var(k).ok())
                        .map_err(|why| anyhow::anyhow!(why))?;
                    let send = crate::send_jobs::SendConfig {
                        partner_url,
                        poll: opts.settings.outbox.poll_interval,
                        batch: 20,
                        send_timeout,
                        lease,
                        pre_1185: opts.compat.has(Compat::Pre1185),
                        replica: std::env::var("CRAIG_REPLICA").ok().filter(|r| !r.is_empty()),
                    };
                    let (done, drained) = tokio::sync::oneshot::channel();
                    before_outbox.push(drained);
                    let (pool, stop) = (pool.clone(), shutdown.clone());
                    tasks.spawn(async move {
                        crate::send_jobs::run(pool, send, stop).await;
                        let _ = done.send(());
                    });
                } else {
                    tracing::info!(event = "send_jobs.disabled", "CRAIG_PARTNER_URL is not set: transmissions wait in exchange_send_jobs");
                }
                // #1179: the arbiter-backed payment consumer (compat pre-1179: without it).
                let consumer = inbox_consumer(queue);
                let arbiter = !opts.compat.has(Compat::Pre1179);
                let pool = pool.clone();
                let handler = move |env| {
                    let (pool, consumer) = (pool.clone(), consumer.clone());
                    async move { financial::on_placement_activated(&pool, &consumer, arbiter, env).await }
                };
                tasks.spawn(run_subscriber(cfg, handler, shutdown.clone()));
            }
            Service::Security => {
                let queue = std::sync::Arc::new(queue);
                let pool = pool.clone();
                let handler = move |env| {
                    let (pool, queue) = (pool.clone(), queue.clone());
                    async move { security::on_any_event(&pool, &queue, use_inbox, env).await }
                };
                tasks.spawn(run_subscriber(cfg, handler, shutdown.clone()));
            }
            Service::Cases => unreachable!("{service} consumes nothing in this build"),
        }
    }
    if service == Service::Security {
        // §D3: the DLQ consumer (#1181 occurrence idempotency, #1197 no log-and-ack).
        let mode = security::RecorderMode {
            pre_1156: opts.compat.has(Compat::Pre1156),
            pre_1181: opts.compat.has(Compat::Pre1181),
        };
        let cfg = DlqConsumerConfig {
            amqp_url: opts.settings.amqp_url.clone(),
            prefetch: 32,
            heartbeat_secs: opts.settings.publisher.heartbeat_secs,
            reconnect_delay: Duration::from_secs(1),
            retry: opts.settings.dlq_retry,
            log_and_ack: opts.compat.has(Compat::Pre1197),
            queue_type: opts.settings.queue_type,
        };
        let pool = pool.clone();
        let handler = move |d| {
            let pool = pool.clone();
            async move { security::on_dead_letter(&pool, d, mode).await }
        };
        // Issue 21.1: the capture queue is not a dead end; security re-reads it on a cadence
        // and records what the database now takes (the occurrence token arbitrates).
        if let Some(every) = opts.settings.dlq_redrive.filter(|_| !opts.compat.has(Compat::Pre1197)) {
            let (url, hb, stop, handler) = (opts.settings.amqp_url.clone(), opts.settings.publisher.heartbeat_secs, shutdown.clone(), handler.clone());
            let queue_type = opts.settings.queue_type;
            tasks.spawn(async move {
                loop {
                    tokio::select! {
                        _ = stop.cancelled() => return,
                        _ = tokio::time::sleep(every) => {}
                    }
                    match craig_mq::dlq::redrive_capture(&url, hb, queue_type, &handler, &stop).await {
                        Ok(r) if r.redriven + r.kept > 0 => tracing::info!(event = "security.dlq.redrive_pass", redriven = r.redriven, kept = r.kept, unreachable = r.unreachable),
                        Ok(_) => {}
                        Err(e) => tracing::warn!(event = "security.dlq.redrive_failed", error = %craig_mq::settings::redact_text(&e.to_string(), &url)),
                    }
                }
            });
        }
        tasks.spawn(subscribe_dlq(cfg, handler, shutdown.clone()));
    }

    let stop = shutdown.clone();
    tasks.spawn(async move {
        stop.cancelled().await;
        for drained in before_outbox {
            let _ = drained.await;
        }
        outbox_stop.cancel();
    });
    while let Some(done) = tasks.join_next().await {
        if let Err(e) = done {
            // A panicking task is a bug; stop the others and report it.
            shutdown.cancel();
            anyhow::bail!("node task failed: {e}");
        }
    }
    pool.close().await;
    tracing::info!(event = "node.stopped", %service);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::claim_secs;

    /// §D5's claim life: unset is 30 s; 1..=30 may be set; 0, past 30 and anything not a
    /// whole number of seconds refuse to start, naming the variable and the range.
    #[test]
    fn the_claim_life_is_one_to_thirty_seconds_or_the_node_refuses_to_start() {
        assert_eq!(claim_secs(None).unwrap(), 30);
        assert_eq!(claim_secs(Some("1")).unwrap(), 1);
        assert_eq!(claim_secs(Some(" 30 ")).unwrap(), 30);
        for bad in ["0", "31", "18446744073709551616", "-1", "2.5", "", "thirty"] {
            let e = claim_secs(Some(bad)).unwrap_err().to_string();
            assert!(e.contains("CRAIG_IDEMPOTENCY_CLAIM_SECS") && e.contains("1..=30"), "{bad:?}: {e}");
        }
    }
}
