//! Real `craig-node` processes on a sandbox (own databases + own vhost).
#![allow(dead_code)]

use std::os::unix::process::ExitStatusExt;
use std::process::{ExitStatus, Stdio};
use std::time::Duration;

use craig_api::{Claims, JwtKey};
use craig_fleet::Service;
use craig_mq::topology::{self, QueueSpec};
pub use craig_mq::topology::QueueType;
use craig_sandbox::Sandbox;
use sqlx::PgPool;
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};

pub const SECRET: &str = "test-secret";

pub struct Fleet {
    pub sandbox: Sandbox,
    /// Per-service AMQP URLs once [`Fleet::least_privilege`] made the accounts; until
    /// then every node logs in as the sandbox's admin.
    pub accounts: std::collections::BTreeMap<&'static str, String>,
}

impl Fleet {
    pub async fn new(label: &str, services: &[Service]) -> Self {
        Self::with_schema(label, services, &craig_fleet::CompatSet::default()).await
    }

    /// A fleet whose databases have the schema a fleet on `compat` had
    /// (`craig-node migrate --compat …`).
    pub async fn with_schema(label: &str, services: &[Service], compat: &craig_fleet::CompatSet) -> Self {
        Self::typed(label, services, compat, QueueType::Classic).await
    }

    /// A fleet whose queues are all of `queue_type` (`CRAIG_QUEUE_TYPE`, issue 25): the
    /// sandbox's DLQ as deployed, every node started with it, [`Fleet::declare_queue`]'s.
    pub async fn typed(label: &str, services: &[Service], compat: &craig_fleet::CompatSet, queue_type: QueueType) -> Self {
        let names: Vec<&str> = services.iter().map(|s| s.name()).collect();
        let sandbox = Sandbox::create_typed(&format!("craig-fleet::{label}"), &names, queue_type).await.expect("sandbox");
        for s in services {
            craig_fleet::node::migrate_for(*s, sandbox.database_url(s.name()), Duration::from_secs(5), compat).await.expect("migrate");
        }
        Self { sandbox, accounts: Default::default() }
    }

    /// Give every service its own least-privilege account (ADR-022 #1202,
    /// `craig_fleet::access`); nodes started afterwards log in with it.
    pub async fn least_privilege(&mut self) {
        let accounts: Vec<craig_sandbox::Account> = craig_fleet::access::accounts()
            .into_iter()
            .map(|(_, user, p)| craig_sandbox::Account { name: user, configure: p.configure, write: p.write, read: p.read })
            .collect();
        let urls = self.sandbox.add_users(&accounts).await.expect("service accounts");
        for (s, url) in craig_fleet::service::ALL.into_iter().zip(urls) {
            self.accounts.insert(s.name(), url);
        }
    }

    /// The AMQP URL `s` logs in with.
    pub fn amqp_url(&self, s: Service) -> &str {
        self.accounts.get(s.name()).map(String::as_str).unwrap_or(self.sandbox.amqp_url())
    }

    pub async fn pool(&self, s: Service) -> PgPool {
        self.sandbox.pool(s.name()).await.unwrap()
    }

    /// Start `craig-node --service s` with extra environment and args.
    pub async fn start(&self, s: Service, env: &[(&str, &str)], args: &[&str]) -> Node {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_craig-node"));
        cmd.args(["--service", s.name(), "--http", "127.0.0.1:0"])
            .args(args)
            .env("DATABASE_URL", self.sandbox.database_url(s.name()))
            .env("AMQP_URL", self.amqp_url(s))
            .env("CRAIG_JWT_SECRET", SECRET)
            .env("CRAIG_OUTBOX_POLL_MS", "100")
            .env("CRAIG_QUEUE_TYPE", self.sandbox.queue_type().as_str())
            .env("RUST_LOG", "info,sqlx=warn,lapin=warn,lapin::returned_messages=error")
            .envs(env.iter().copied())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .kill_on_drop(true);
        let mut child = cmd.spawn().expect("spawn craig-node");
        let stdout = child.stdout.take().unwrap();
        let mut lines = BufReader::new(stdout).lines();
        let line = tokio::time::timeout(Duration::from_secs(15), lines.next_line())
            .await
            .expect("craig-node printed its address in time")
            .unwrap()
            .expect("craig-node stdout open");
        let addr = line.rsplit(' ').next().unwrap().to_owned();
        tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });
        Node { child, base: format!("http://{addr}") }
    }

    pub async fn channel(&self) -> (lapin::Connection, lapin::Channel) {
        let conn = craig_mq::publisher::connect(self.sandbox.amqp_url(), 5, "test").await.expect("amqp");
        let ch = conn.create_channel().await.expect("channel");
        (conn, ch)
    }

    pub async fn declare_queue(&self, queue: &str, binding: &str) {
        let (conn, ch) = self.channel().await;
        let spec = QueueSpec { queue: queue.into(), bindings: vec![binding.into()], with_dlx: true, queue_type: self.sandbox.queue_type() };
        topology::declare_consumer_queue(&ch, &spec).await.expect("declare");
        let _ = conn.close(200, "bye".into()).await;
    }

    pub async fn depth(&self, queue: &str) -> u32 {
        let (conn, ch) = self.channel().await;
        let n = topology::queue_depth(&ch, queue).await.expect("passive declare");
        let _ = conn.close(200, "bye".into()).await;
        n
    }

    /// A queue's depth, or `None` while it does not exist (the passive declare is refused).
    pub async fn depth_if_declared(&self, queue: &str) -> Option<u32> {
        let (conn, ch) = self.channel().await;
        let n = topology::queue_depth(&ch, queue).await.ok();
        let _ = conn.close(200, "bye".into()).await;
        n
    }

    /// Consumers on `queue` by passive declare; `None` while it is not declared.
    async fn consumers_if_declared(&self, queue: &str) -> Option<u32> {
        let (conn, ch) = self.channel().await;
        let q = lapin::options::QueueDeclareOptions { passive: true, ..Default::default() };
        let n = ch.queue_declare(queue.into(), q, lapin::types::FieldTable::default()).await.ok().map(|q| q.consumer_count());
        let _ = conn.close(200, "bye".into()).await;
        n
    }

    /// Wait until a node consumes every queue in `queues`. A node declares its queue, then
    /// binds it, then consumes, so a consumer means the bindings are in place too; a queue
    /// that merely exists may not be bound yet, and a publish in that gap skips it (seen in
    /// CI: the security queue missed the event the test then waited 20 s for).
    pub async fn wait_for_queues(&self, queues: &[&str]) {
        eventually(Duration::from_secs(15), &format!("queues {queues:?} declared, bound and consumed"), || async {
            for q in queues {
                if self.consumers_if_declared(q).await.unwrap_or(0) == 0 {
                    return false;
                }
            }
            true
        })
        .await;
    }

    pub async fn take_all(&self, queue: &str) -> Vec<String> {
        let (conn, ch) = self.channel().await;
        let mut ids = Vec::new();
        while let Some(m) =
            ch.basic_get(queue.into(), lapin::options::BasicGetOptions { no_ack: true }).await.expect("basic.get")
        {
            ids.push(m.delivery.properties.message_id().as_ref().map(|s| s.to_string()).unwrap_or_default());
        }
        let _ = conn.close(200, "bye".into()).await;
        ids
    }

    pub async fn finish(self) {
        self.sandbox.destroy().await.expect("destroy sandbox");
    }
}

pub struct Node {
    pub child: Child,
    pub base: String,
}

impl Node {
    pub fn pid(&self) -> i32 {
        self.child.id().expect("running") as i32
    }

    pub async fn wait(&mut self, limit: Duration) -> ExitStatus {
        tokio::time::timeout(limit, self.child.wait()).await.expect("node exited in time").unwrap()
    }

    /// SIGTERM, then the exit status.
    pub async fn stop(mut self) -> ExitStatus {
        nix::sys::signal::kill(nix::unistd::Pid::from_raw(self.pid()), nix::sys::signal::Signal::SIGTERM).unwrap();
        self.wait(Duration::from_secs(20)).await
    }
}

pub fn killed_by(status: ExitStatus) -> Option<i32> {
    status.signal()
}

pub fn token(aud: &str, scope: &str) -> String {
    let claims = Claims {
        sub: uuid::Uuid::now_v7(),
        aud: vec![aud.to_owned()],
        scope: scope.to_owned(),
        exp: chrono::Utc::now().timestamp() + 600,
    };
    JwtKey::new(SECRET).sign(&claims)
}

/// Poll `f` every 100 ms until it returns true or `limit` passes.
pub async fn eventually<F, Fut>(limit: Duration, what: &str, mut f: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = tokio::time::Instant::now() + limit;
    loop {
        if f().await {
            return;
        }
        assert!(tokio::time::Instant::now() < deadline, "timed out waiting for: {what}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

pub async fn count(pool: &PgPool, sql: &'static str) -> i64 {
    sqlx::query_scalar(sql).fetch_one(pool).await.unwrap()
}
