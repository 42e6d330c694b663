//! One `craig-node` process: HTTP routes, the outbox worker and the service's consumers,
//! all stopped by one cancellation token (SIGTERM → drain → exit 0).

use std::net::SocketAddr;
use std::time::Duration;

use anyhow::Context as _;
use axum::extract::FromRef;
use axum::routing::get;
use axum::{Json, Router};
use craig_api::JwtKey;
use craig_mq::subscriber::{SubscriberConfig, run_subscriber};
use craig_mq::topology::{QueueSpec, consumer_queue};
use craig_mq::{DrainMode, OutboxWorker, ServiceSettings};
use serde_json::json;
use sqlx::PgPool;
use sqlx::postgres::PgPoolOptions;
use tokio_util::sync::CancellationToken;

use crate::compat::{Compat, CompatSet};
use crate::service::Service;
use crate::{cases, rules};

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
pub fn pool(url: &str) -> anyhow::Result<PgPool> {
    PgPoolOptions::new()
        .max_connections(10)
        .acquire_timeout(Duration::from_secs(5))
        .connect_lazy(url)
        .with_context(|| format!("bad DATABASE_URL {url:?}"))
}

/// Apply `service`'s migrations, retrying the connection for up to `wait`.
pub async fn migrate(service: Service, url: &str, wait: Duration) -> anyhow::Result<()> {
    let deadline = tokio::time::Instant::now() + wait;
    let pool = loop {
        match PgPoolOptions::new().max_connections(1).connect(url).await {
            Ok(p) => break p,
            Err(e) if tokio::time::Instant::now() < deadline => {
                tracing::warn!(event = "node.migrate_waiting", error = %e);
                tokio::time::sleep(Duration::from_millis(250)).await;
            }
            Err(e) => return Err(e).with_context(|| format!("connecting to {url} to migrate {service}")),
        }
    };
    service.migrator().run(&pool).await.with_context(|| format!("applying migrations/{service}"))?;
    pool.close().await;
    Ok(())
}

/// Run until `shutdown` is cancelled, then drain and return.
pub async fn run(opts: NodeOptions, shutdown: CancellationToken) -> anyhow::Result<()> {
    let service = opts.service;
    let pool = pool(&opts.settings.database_url)?;
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

    let mut app = Router::new().route("/healthz", get(|| async { Json(json!({ "status": "ok" })) }));
    if service == Service::Cases {
        app = app.merge(cases::router());
    }
    let listener = tokio::net::TcpListener::bind(opts.http).await.with_context(|| format!("binding {}", opts.http))?;
    let addr = listener.local_addr()?;
    // One stdout line a supervisor can wait for (the port may have been 0).
    println!("craig-node {service} listening on {addr}");
    tracing::info!(event = "node.started", %service, %addr);

    let mut tasks = tokio::task::JoinSet::new();
    let http_stop = shutdown.clone();
    tasks.spawn(async move {
        let served = axum::serve(listener, app.with_state(state)).with_graceful_shutdown(http_stop.cancelled_owned()).await;
        if let Err(e) = served {
            tracing::error!(event = "node.http_failed", error = %e);
        }
    });

    let mode = if opts.compat.has(Compat::Pre1128) { DrainMode::Pre1128 } else { DrainMode::ClaimLease };
    let worker =
        OutboxWorker::new(pool.clone(), &opts.settings.amqp_url, opts.settings.publisher, opts.settings.outbox).with_mode(mode);
    tasks.spawn(worker.run(shutdown.clone()));

    let bindings = service.consumes();
    if !bindings.is_empty() {
        let queue = consumer_queue(service.name());
        let cfg = SubscriberConfig {
            amqp_url: opts.settings.amqp_url.clone(),
            spec: QueueSpec {
                queue: queue.clone(),
                bindings: bindings.iter().map(|s| s.to_string()).collect(),
                with_dlx: !opts.compat.has(Compat::PreD3),
            },
            prefetch: 32,
            heartbeat_secs: opts.settings.publisher.heartbeat_secs,
            retry_delay: Duration::from_millis(500),
            reconnect_delay: Duration::from_secs(1),
        };
        let use_inbox = !opts.compat.has(Compat::PreD2);
        let pool = pool.clone();
        let handler = move |env| {
            let pool = pool.clone();
            let queue = queue.clone();
            async move { rules::on_referral_created(&pool, &queue, env, use_inbox).await }
        };
        tasks.spawn(run_subscriber(cfg, handler, shutdown.clone()));
    }

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
