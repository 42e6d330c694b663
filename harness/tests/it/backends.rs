//! Each backend available here, with a real `craig-node` on top: kill and restart the
//! broker and the database under it and show the node recover (the outbox drains; nothing
//! stays pending). The containers backend needs a Docker engine: where one answers, its
//! containers start, keep data across a restart and leave nothing; where none does, the
//! refusal is explained.

use std::time::{Duration, Instant};

use craig_chaos::backend::{Backend, BackendError, BackendKind, Target};
use craig_chaos::process::{NodeProgram, Replica, ReplicaSpec, describe};
use craig_mq::topology::{self, QueueSpec};
use serde_json::json;
use sqlx::PgPool;

const SECRET: &str = "backend-test";

fn token() -> String {
    craig_api::JwtKey::new(SECRET).sign(&craig_api::Claims {
        sub: uuid::Uuid::now_v7(),
        aud: vec!["craig-cases".into()],
        scope: String::new(),
        exp: chrono::Utc::now().timestamp() + 600,
    })
}

async fn eventually<F, Fut>(limit: Duration, what: &str, mut f: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = Instant::now() + limit;
    while !f().await {
        assert!(Instant::now() < deadline, "timed out waiting for: {what}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

async fn pending(pool: &PgPool) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM event_outbox WHERE published_at IS NULL").fetch_one(pool).await.unwrap_or(-1)
}

async fn declare_rules_queue(amqp: &str) {
    let conn = craig_mq::publisher::connect(amqp, 5, "test").await.unwrap();
    let ch = conn.create_channel().await.unwrap();
    // The operator's part first (#1202): no service account may declare the exchanges.
    topology::declare_exchanges(&ch, Default::default()).await.unwrap();
    let spec = QueueSpec { queue: "craig-rules.events".into(), bindings: vec!["case.referral_created".into()], with_dlx: true, queue_type: Default::default() };
    topology::declare_consumer_queue(&ch, &spec).await.unwrap();
    let _ = conn.close(200, "bye".into()).await;
}

async fn queue_depth(amqp: &str) -> u32 {
    let conn = craig_mq::publisher::connect(amqp, 5, "test").await.unwrap();
    let ch = conn.create_channel().await.unwrap();
    let n = topology::queue_depth(&ch, "craig-rules.events").await.unwrap();
    let _ = conn.close(200, "bye".into()).await;
    n
}

async fn post_referrals(base: &str, n: usize) -> Vec<u16> {
    let http = reqwest::Client::builder().timeout(Duration::from_secs(15)).build().unwrap();
    let mut codes = Vec::new();
    for i in 0..n {
        let r = http
            .post(format!("http://{base}/v1/cases/referrals"))
            .header("idempotency-key", uuid::Uuid::now_v7().to_string())
            .bearer_auth(token())
            .json(&json!({ "subject": format!("s{i}") }))
            .send()
            .await;
        codes.push(r.map(|r| r.status().as_u16()).unwrap_or(0));
    }
    codes
}

#[tokio::test]
async fn local_backend_survives_broker_and_database_kills_under_a_running_node() {
    let t0 = Instant::now();
    let (mut backend, choice) = Backend::start(BackendKind::Local, "local-kill-test", &["cases"]).await.expect("local backend");
    let started = t0.elapsed();
    assert_eq!(choice.kind, BackendKind::Local);
    let ep = backend.endpoints();
    let db_url = ep.database_url("cases").unwrap().to_owned();
    craig_fleet::node::migrate(craig_fleet::Service::Cases, &db_url, Duration::from_secs(10)).await.unwrap();
    declare_rules_queue(&ep.amqp_url).await;
    // The node logs in with cases' own least-privilege account (#1202), through every kill.
    let accounts = backend.service_accounts().await.expect("service accounts on the private broker");
    let cases_url = accounts.iter().find(|(s, _)| s == "cases").map(|(_, u)| u.clone()).expect("an account for cases");
    assert!(cases_url.starts_with("amqp://craig-cases:"), "{cases_url}");

    let logs = tempdir();
    let mut spec = ReplicaSpec::new("cases", 1);
    spec.env = vec![
        ("DATABASE_URL".into(), db_url.clone()),
        ("AMQP_URL".into(), cases_url),
        ("CRAIG_JWT_SECRET".into(), SECRET.into()),
        ("CRAIG_OUTBOX_POLL_MS".into(), "100".into()),
        ("CRAIG_OUTBOX_BACKOFF_BASE_MS".into(), "100".into()),
        ("CRAIG_OUTBOX_BACKOFF_MAX_MS".into(), "500".into()),
        ("CRAIG_AMQP_HEARTBEAT_SECS".into(), "1".into()),
        ("CRAIG_PUBLISH_CONFIRM_TIMEOUT_MS".into(), "1000".into()),
    ];
    let mut node = Replica::new(spec, NodeProgram::harness(env!("CARGO_BIN_EXE_chaos")), &logs);
    node.start().await.expect("node starts");
    let base = node.addr.clone().unwrap();
    let pool = sqlx::postgres::PgPoolOptions::new().max_connections(2).connect(&db_url).await.unwrap();

    assert_eq!(post_referrals(&base, 5).await, [201; 5]);
    eventually(Duration::from_secs(20), "first 5 published", || async { pending(&pool).await == 0 }).await;

    // Broker killed: writes still commit; their events wait in the outbox.
    let t = Instant::now();
    backend.kill(Target::Broker).await.unwrap();
    let broker_kill = t.elapsed();
    assert_eq!(post_referrals(&base, 20).await, [201; 20]);
    eventually(Duration::from_secs(20), "failed publish attempts recorded", || async {
        sqlx::query_scalar::<_, i64>("SELECT count(*) FROM event_outbox WHERE published_at IS NULL AND attempts > 0")
            .fetch_one(&pool)
            .await
            .unwrap()
            == 20
    })
    .await;
    let t = Instant::now();
    backend.restart(Target::Broker).await.unwrap();
    let broker_restart = t.elapsed();
    eventually(Duration::from_secs(60), "outbox drained after the broker returned", || async { pending(&pool).await == 0 }).await;
    // The 5 messages published before the kill survived it (durable queue, persistent).
    assert_eq!(queue_depth(&backend.endpoints().amqp_url).await, 25);
    assert!(node.exited().is_none(), "the node rode out the broker kill");

    // Database killed: requests fail cleanly (503), the node stays up, and recovers.
    let t = Instant::now();
    backend.kill(Target::Database).await.unwrap();
    let db_kill = t.elapsed();
    let codes = post_referrals(&base, 3).await;
    assert!(codes.iter().all(|&c| c == 503), "{codes:?}");
    let t = Instant::now();
    backend.restart(Target::Database).await.unwrap();
    let db_restart = t.elapsed();
    eventually(Duration::from_secs(30), "writes accepted again", || async { post_referrals(&base, 1).await == [201] }).await;
    let pool = sqlx::postgres::PgPoolOptions::new().max_connections(2).connect(&db_url).await.unwrap();
    eventually(Duration::from_secs(30), "outbox drained after the database returned", || async { pending(&pool).await == 0 }).await;
    assert!(node.exited().is_none(), "the node rode out the database kill");

    // Paused broker: publishes stall, then drain on resume.
    let evidence = backend.pause(Target::Broker, true).await.unwrap();
    assert!(evidence.as_deref().is_some_and(|e| e.ends_with("(and its process group) stopped")), "{evidence:?}");
    assert_eq!(post_referrals(&base, 2).await, [201; 2]);
    assert_eq!(backend.pause(Target::Broker, false).await.unwrap(), None, "a thaw claims nothing");
    eventually(Duration::from_secs(60), "outbox drained after the broker resumed", || async { pending(&pool).await == 0 }).await;

    let status = node.stop(Duration::from_secs(20)).await.unwrap();
    assert_eq!(status.code(), Some(0), "{}", describe(status));
    pool.close().await;
    let t = Instant::now();
    backend.stop().await.unwrap();
    eprintln!(
        "local backend: start {:.2}s, broker kill {:.3}s, broker restart {:.2}s, db kill {:.3}s, db restart {:.2}s, stop {:.2}s",
        started.as_secs_f64(),
        broker_kill.as_secs_f64(),
        broker_restart.as_secs_f64(),
        db_kill.as_secs_f64(),
        db_restart.as_secs_f64(),
        t.elapsed().as_secs_f64()
    );
}

#[tokio::test]
async fn local_backend_removes_everything_when_dropped() {
    let (backend, _) = Backend::start(BackendKind::Local, "local-drop-test", &["cases"]).await.unwrap();
    let Backend::Local(local) = &backend else { panic!("local") };
    let root = local.root().to_path_buf();
    let broker = backend.endpoints().broker_addr;
    assert!(root.exists());
    drop(backend); // as on a panic
    assert!(!root.exists(), "temp dir removed");
    assert!(std::net::TcpStream::connect(&broker).is_err(), "broker gone");
}

#[tokio::test]
async fn external_backend_isolates_a_run_and_refuses_destructive_faults() {
    let t0 = Instant::now();
    let (mut backend, choice) = Backend::start(BackendKind::External, "external-test", &["cases", "rules"]).await.unwrap();
    let started = t0.elapsed();
    assert_eq!(choice.kind, BackendKind::External);
    let ep = backend.endpoints();
    for svc in ["cases", "rules"] {
        let url = ep.database_url(svc).unwrap();
        craig_fleet::node::migrate(svc.parse().unwrap(), url, Duration::from_secs(5)).await.unwrap();
    }
    declare_rules_queue(&ep.amqp_url).await;
    let accounts = backend.service_accounts().await.expect("service accounts on the run's vhost");
    let names: Vec<&str> = accounts.iter().map(|(s, _)| s.as_str()).collect();
    assert_eq!(names, ["cases", "financial", "rules", "security"]);
    let err = backend.kill(Target::Broker).await.unwrap_err();
    assert!(matches!(err, BackendError::Unsupported { backend: "external", .. }), "{err}");
    assert!(err.to_string().contains("CHAOS_BACKEND=local"), "{err}");

    let db_name = ep.database_url("cases").unwrap().rsplit('/').next().unwrap().to_owned();
    let t = Instant::now();
    backend.stop().await.unwrap();
    let stopped = t.elapsed();
    let admin = sqlx::postgres::PgPoolOptions::new()
        .max_connections(1)
        .connect(&std::env::var("DATABASE_URL").unwrap_or_else(|_| craig_sandbox::DEFAULT_DATABASE_URL.into()))
        .await
        .unwrap();
    let left: i64 = sqlx::query_scalar("SELECT count(*) FROM pg_database WHERE datname = $1").bind(&db_name).fetch_one(&admin).await.unwrap();
    assert_eq!(left, 0, "the run's database is dropped");
    eprintln!("external backend: start {:.2}s, stop {:.2}s", started.as_secs_f64(), stopped.as_secs_f64());
}

#[tokio::test]
async fn containers_backend_explains_why_it_cannot_start_without_docker() {
    if craig_chaos::backend::containers::probe().await.is_ok() {
        eprintln!("a Docker engine answers here; this test covers machines without one");
        return;
    }
    let err = match Backend::start(BackendKind::Containers, "containers-test", &["cases"]).await {
        Err(e) => e,
        Ok(_) => panic!("started without Docker"),
    };
    let msg = err.to_string();
    assert!(msg.starts_with("backend containers is not available here:"), "{msg}");
    assert!(msg.contains("Docker"), "{msg}");
}

/// Where a Docker engine answers (ci/test starts one where it can, with the stand-in images
/// of `ci/images/build` in `CHAOS_*_IMAGE`; elsewhere the official images): the three
/// containers start through testcontainers' own readiness waits, the service databases
/// answer on the host, the broker takes the admin's AMQP login, a killed and restarted
/// database keeps its data, and nothing of the run is left after stop.
#[tokio::test]
async fn containers_backend_starts_keeps_data_across_a_restart_and_leaves_nothing() {
    if let Err(why) = craig_chaos::backend::containers::probe().await {
        eprintln!("no Docker engine here ({why}); containers_backend_explains_why_it_cannot_start_without_docker covers it");
        return;
    }
    if !images_set() {
        return;
    }
    let (mut backend, _) = Backend::start(BackendKind::Containers, "containers-test", &["cases"]).await.unwrap();
    let ep = backend.endpoints();
    let url = ep.database_url("cases").unwrap().to_owned();
    let pool = sqlx::postgres::PgPoolOptions::new().max_connections(1).connect(&url).await.unwrap();
    sqlx::raw_sql("CREATE TABLE IF NOT EXISTS kept (n int); INSERT INTO kept VALUES (42)").execute(&pool).await.unwrap();
    pool.close().await;
    let amqp = lapin::Connection::connect(&ep.amqp_url, lapin::ConnectionProperties::default()).await.unwrap();
    amqp.close(200, "bye".into()).await.unwrap();

    // The Toxiproxy container (official or stand-in) answers its API.
    if let Backend::Containers(c) = &backend {
        let api = craig_chaos::proxy::ToxiproxyClient::new(c.toxiproxy_api());
        let version = api.version().await.unwrap();
        assert!(version.contains("2.12.0"), "Toxiproxy API version {version:?}");
    }

    backend.kill(Target::Database).await.unwrap();
    backend.restart(Target::Database).await.unwrap();
    let url = backend.endpoints().database_url("cases").unwrap().to_owned();
    // Crash recovery first: as long as the container start itself may take (60 s).
    let mut kept = None;
    let deadline = Instant::now() + Duration::from_secs(60);
    while Instant::now() < deadline {
        if let Ok(pool) = sqlx::postgres::PgPoolOptions::new().max_connections(1).connect(&url).await {
            kept = sqlx::query_scalar::<_, i32>("SELECT n FROM kept").fetch_optional(&pool).await.ok().flatten();
            break;
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    assert_eq!(kept, Some(42), "the restarted database kept the row written before the kill");

    let network = match &backend {
        Backend::Containers(c) => c.network().to_owned(),
        _ => unreachable!("started as containers"),
    };
    backend.stop().await.unwrap();
    // Nothing of the run is left: no container on its network, no network.
    let containers: Vec<String> = docker(&["ps", "-a", "--format", "{{.Names}}"]).into_iter().filter(|n| n.ends_with(&format!("-{network}"))).collect();
    assert!(containers.is_empty(), "containers of the run left behind: {containers:?}");
    let networks: Vec<String> = docker(&["network", "ls", "--format", "{{.Name}}"]).into_iter().filter(|n| *n == network).collect();
    assert!(networks.is_empty(), "the run's network left behind");
}

/// `docker ARGS` through the CLI (a Docker engine answers where this is called): its
/// stdout's lines; a failed command fails the test.
/// The containers tests run where the images are set up (`eval "$(ci/images/build)"`, as
/// `ci/test` does, sets `CHAOS_TOXIPROXY_IMAGE` and the others), as the `containers::`
/// scenario tests do: an engine that answers is not enough where the official images cannot
/// be pulled.
fn images_set() -> bool {
    let set = std::env::var_os("CHAOS_TOXIPROXY_IMAGE").is_some();
    if !set {
        eprintln!("skipped: CHAOS_TOXIPROXY_IMAGE is not set (eval \"$(ci/images/build)\" first, as ci/test does)");
    }
    set
}

fn docker<S: AsRef<std::ffi::OsStr> + std::fmt::Debug>(args: &[S]) -> Vec<String> {
    let out = std::process::Command::new("docker").args(args).output().expect("the docker CLI (a Docker engine answers here)");
    assert!(out.status.success(), "docker {args:?}: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8_lossy(&out.stdout).lines().map(str::to_owned).collect()
}

fn tempdir() -> std::path::PathBuf {
    let d = std::env::temp_dir().join(format!("chaos-test-logs-{}", std::process::id()));
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// Issue 24's newcomer: Docker and no PostgreSQL or RabbitMQ server binaries (the local
/// backend's settings point at nothing, as on a machine without them). `auto` picks the
/// containers backend, and a scenario runs there and meets its expectations (broker-kill:
/// no link fault, so the official images do too). Skipped where no Docker engine answers.
#[tokio::test]
async fn a_newcomer_with_docker_and_no_server_binaries_runs_on_containers() {
    if craig_chaos::backend::containers::probe().await.is_err() {
        eprintln!("skipped: no Docker engine answers");
        return;
    }
    if !images_set() {
        return;
    }
    let empty = tempdir().join("no-servers");
    std::fs::create_dir_all(&empty).unwrap();
    let report = tempdir().join("newcomer-report");
    let scenario = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../scenarios/broker-kill.toml");
    let out = tokio::process::Command::new(env!("CARGO_BIN_EXE_chaos"))
        .args(["run", scenario.to_str().unwrap(), "--seed", "7", "--report", report.to_str().unwrap()])
        .env_remove("CHAOS_BACKEND")
        .env("CHAOS_PG_BINDIR", &empty)
        .env("CHAOS_RABBITMQ_SERVER", empty.join("rabbitmq-server"))
        .output()
        .await
        .unwrap();
    let said = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert_eq!(out.status.code(), Some(0), "{said}");
    let json: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(report.join("report.json")).unwrap()).unwrap();
    let backends: Vec<&str> = json["scenarios"].as_array().unwrap().iter().map(|r| r["backend"].as_str().unwrap_or("?")).collect();
    assert_eq!(backends, ["containers"], "{said}");
}

/// What the containers backend cannot do is refused before any container starts, naming why:
/// a link fault with the official Toxiproxy (no counters, so it could never prove it fired),
/// and a fleet with more links than the Toxiproxy container publishes.
#[tokio::test]
async fn containers_refuse_what_they_cannot_do_before_anything_starts() {
    if craig_chaos::backend::containers::probe().await.is_err() {
        eprintln!("skipped: no Docker engine answers");
        return;
    }
    let dir = tempdir().join("refusals");
    std::fs::create_dir_all(&dir).unwrap();
    let shipped = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../scenarios");
    let big = std::fs::read_to_string(shipped.join("broker-kill.toml")).unwrap();
    let big = big.replacen("cases = { replicas = 1 }", "cases = { replicas = 7 }", 1).replacen("rules = { replicas = 1 }", "rules = { replicas = 6 }", 1);
    assert!(big.contains("replicas = 7") && big.contains("replicas = 6"), "broker-kill's fleet changed; adjust this test");
    std::fs::write(dir.join("big.toml"), big).unwrap();
    let run = |scenario: std::path::PathBuf, toxiproxy: &str| {
        let toxiproxy = toxiproxy.to_owned();
        let report = dir.join(format!("report-{}", scenario.file_stem().unwrap().to_string_lossy()));
        async move {
            let out = tokio::process::Command::new(env!("CARGO_BIN_EXE_chaos"))
                .args(["run", scenario.to_str().unwrap(), "--seed", "7", "--backend", "containers", "--report", report.to_str().unwrap()])
                .env("CHAOS_TOXIPROXY_IMAGE", toxiproxy)
                .output()
                .await
                .unwrap();
            assert_ne!(out.status.code(), Some(0));
            format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr))
        }
    };
    let said = run(shipped.join("broker-down-outbox.toml"), "ghcr.io/shopify/toxiproxy:2.12.0").await;
    assert!(said.contains("is the official Toxiproxy") && said.contains("could never prove they fired"), "{said}");
    let said = run(dir.join("big.toml"), "craig-chaos/toxiproxy-api:never-pulled").await;
    assert!(said.contains("publishes 24 links (two a replica)") && said.contains("this fleet has 13 replicas"), "{said}");
}

/// Issue 24's clean-up: a `chaos run` on containers killed with SIGKILL (no chance to clean
/// up) leaves its containers behind, labelled with its run; the next containers start
/// removes them and their network. Skipped where no Docker engine answers.
#[tokio::test]
async fn a_killed_runs_containers_are_reaped_by_the_next_start() {
    if craig_chaos::backend::containers::probe().await.is_err() {
        eprintln!("skipped: no Docker engine answers");
        return;
    }
    if !images_set() {
        return;
    }
    let report = tempdir().join("killed-run-report");
    let scenario = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../scenarios/broker-kill.toml");
    let mut run = tokio::process::Command::new(env!("CARGO_BIN_EXE_chaos"))
        .args(["run", scenario.to_str().unwrap(), "--backend", "containers", "--report", report.to_str().unwrap()])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    use craig_chaos::backend::containers::{PID_LABEL, RUN_LABEL};
    let pid = run.id().unwrap();
    // (container, its run's network) of the run's containers, by the pid it labels them with.
    let of_run = || {
        docker(&["ps".into(), "-a".into(), "--filter".into(), format!("label={PID_LABEL}={pid}"), "--format".into(), format!("{{{{.Names}}}} {{{{.Label \"{RUN_LABEL}\"}}}}")])
    };
    let deadline = Instant::now() + Duration::from_secs(120);
    while of_run().len() < 3 {
        assert!(Instant::now() < deadline, "the run never had its three containers up");
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    run.start_kill().unwrap();
    run.wait().await.unwrap();
    let left = of_run();
    assert_eq!(left.len(), 3, "a SIGKILLed run leaves its containers behind");
    let network = left[0].split_once(' ').map(|(_, n)| n.to_owned()).unwrap();

    let (backend, _) = Backend::start(BackendKind::Containers, "reaper", &["cases"]).await.unwrap();
    assert!(of_run().is_empty(), "the next start removed the killed run's containers");
    let networks = docker(&["network", "ls", "--format", "{{.Name}}"]);
    assert!(!networks.contains(&network), "and its network");
    backend.stop().await.unwrap();
}
