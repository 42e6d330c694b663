//! Process control of fleet replicas: crash points that fire on the Nth hit, pause and
//! resume, restart, and per-replica logs.

use std::os::unix::process::ExitStatusExt;
use std::time::{Duration, Instant};

use craig_chaos::process::{NodeProgram, Replica, ReplicaSpec};
use craig_sandbox::Sandbox;
use serde_json::json;

const SECRET: &str = "replica-test";

async fn post(base: &str) -> u16 {
    let token = craig_api::JwtKey::new(SECRET).sign(&craig_api::Claims {
        sub: uuid::Uuid::now_v7(),
        aud: vec!["craig-cases".into()],
        scope: String::new(),
        exp: chrono::Utc::now().timestamp() + 600,
    });
    reqwest::Client::new()
        .post(format!("http://{base}/v1/cases/referrals"))
        .header("idempotency-key", uuid::Uuid::now_v7().to_string())
        .bearer_auth(token)
        .json(&json!({"subject": "s"}))
        .send()
        .await
        .map(|r| r.status().as_u16())
        .unwrap_or(0)
}

async fn count(pool: &sqlx::PgPool, sql: &'static str) -> i64 {
    sqlx::query_scalar(sql).fetch_one(pool).await.unwrap()
}

async fn eventually<F, Fut>(what: &str, mut f: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = Instant::now() + Duration::from_secs(20);
    while !f().await {
        assert!(Instant::now() < deadline, "timed out waiting for: {what}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

struct Rig {
    sandbox: Sandbox,
    pool: sqlx::PgPool,
    logs: std::path::PathBuf,
}

async fn rig(label: &str) -> Rig {
    let sandbox = Sandbox::create(&format!("chaos-replicas::{label}"), &["cases"]).await.unwrap();
    craig_fleet::node::migrate(craig_fleet::Service::Cases, sandbox.database_url("cases"), Duration::from_secs(5)).await.unwrap();
    let pool = sandbox.pool("cases").await.unwrap();
    // The deploy step: publishes are mandatory and need their queues.
    craig_fleet::node::declare_topology(sandbox.amqp_url(), true, Default::default()).await.unwrap();
    let logs = std::env::temp_dir().join(format!("chaos-replica-logs-{label}-{}", std::process::id()));
    std::fs::create_dir_all(&logs).unwrap();
    Rig { sandbox, pool, logs }
}

fn spec(rig: &Rig, failpoints: Option<&str>) -> ReplicaSpec {
    let mut s = ReplicaSpec::new("cases", 1);
    s.failpoints = failpoints.map(str::to_owned);
    s.env = vec![
        ("DATABASE_URL".into(), rig.sandbox.database_url("cases").into()),
        ("AMQP_URL".into(), rig.sandbox.amqp_url().into()),
        ("CRAIG_JWT_SECRET".into(), SECRET.into()),
        ("CRAIG_OUTBOX_POLL_MS".into(), "50".into()),
    ];
    s
}

#[tokio::test]
async fn a_crash_point_fires_on_the_third_hit() {
    let rig = rig("nth_hit").await;
    let mut node = Replica::new(
        spec(&rig, Some("outbox::after_claim=2*off->return(abort)")),
        NodeProgram::harness(env!("CARGO_BIN_EXE_chaos")),
        &rig.logs,
    );
    node.start().await.unwrap();
    let base = node.addr.clone().unwrap();
    for published in 1..=2 {
        assert_eq!(post(&base).await, 201);
        eventually("published", || async {
            count(&rig.pool, "SELECT count(*) FROM event_outbox WHERE published_at IS NOT NULL").await == published
        })
        .await;
    }
    assert!(node.exited().is_none(), "two hits pass");
    // The third write's answer may be lost with the process: the worker can claim its row
    // and abort before the response is written (seen under load: no answer). The abort is
    // what this test is about.
    let third = post(&base).await;
    assert!(third == 201 || third == 0, "the third write: {third}");
    let status = node.wait_exit(Duration::from_secs(20)).await.unwrap();
    assert_eq!(status.signal(), Some(nix::sys::signal::Signal::SIGABRT as i32));
    assert_eq!(count(&rig.pool, "SELECT count(*) FROM event_outbox WHERE published_at IS NULL AND claimed_at IS NOT NULL").await, 1);
    let log = std::fs::read_to_string(node.log_path()).unwrap();
    assert!(log.contains("crash point outbox::after_claim fired"), "{log}");
    rig.pool.close().await;
    rig.sandbox.destroy().await.unwrap();
}

#[tokio::test]
async fn a_paused_replica_holds_requests_until_resumed_and_restarts_keep_one_log() {
    let rig = rig("pause_restart").await;
    let mut node = Replica::new(spec(&rig, None), NodeProgram::harness(env!("CARGO_BIN_EXE_chaos")), &rig.logs);
    node.start().await.unwrap();
    let base = node.addr.clone().unwrap();

    node.pause().unwrap();
    let request = tokio::spawn({
        let base = base.clone();
        async move { post(&base).await }
    });
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(!request.is_finished(), "a stopped process answers nothing");
    assert_eq!(count(&rig.pool, "SELECT count(*) FROM referrals").await, 0);
    node.resume().unwrap();
    assert_eq!(request.await.unwrap(), 201);

    let first_pid = node.pid().unwrap();
    node.restart().await.unwrap();
    assert_ne!(node.pid().unwrap(), first_pid);
    assert!(
        matches!(nix::sys::signal::kill(nix::unistd::Pid::from_raw(first_pid), None), Err(nix::errno::Errno::ESRCH)),
        "the old pid is gone once restart returns"
    );
    assert_eq!(post(node.addr.as_deref().unwrap()).await, 201);
    let status = node.stop(Duration::from_secs(20)).await.unwrap();
    assert_eq!(status.code(), Some(0));

    let log = std::fs::read_to_string(node.log_path()).unwrap();
    assert!(log.contains("--- start 1 of cases-1 (compat -) ---") && log.contains("--- start 2 of cases-1 (compat -) ---"), "{log}");
    assert_eq!(log.matches("node.started").count(), 2, "{log}");
    rig.pool.close().await;
    rig.sandbox.destroy().await.unwrap();
}
