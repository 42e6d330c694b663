//! Isolated PostgreSQL databases and RabbitMQ vhosts, one set per test or harness run
//! (sqlx's `testing` module, extended to vhosts).
//!
//! - Names are deterministic: `craig_<12 hex of sha256(label)>[_<service>]`, within
//!   Postgres' 63-byte limit; a re-run of the same label first drops what it left.
//! - A registry table (`craig_sandbox_registry` in the admin database) records each sandbox
//!   with its owner pid. [`Sandbox::create`] removes leftovers whose owner is gone, so a
//!   crashed or failed run is cleaned at the next start, never while its owner lives.
//! - [`Sandbox::destroy`] drops everything. A sandbox dropped without `destroy` (a failing
//!   test) is KEPT for debugging and says so on stderr.
//! - Vhosts are made through the management HTTP API (port 15672, or
//!   `RABBITMQ_MANAGEMENT_URL`), falling back to a local `rabbitmqctl`.

use std::fmt::Write as _;
use std::time::Duration;
pub use craig_mq::topology::QueueType;

use sha2::{Digest, Sha256};
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::{AssertSqlSafe, ConnectOptions, Connection, PgConnection, PgPool};

pub const DEFAULT_DATABASE_URL: &str = "postgres://postgres@127.0.0.1:5432/postgres";
pub const DEFAULT_AMQP_URL: &str = "amqp://guest:guest@127.0.0.1:5672/%2f";

#[derive(Debug, thiserror::Error)]
pub enum SandboxError {
    #[error("postgres at {}: {source}", craig_mq::settings::redact(url))]
    Postgres { url: String, source: sqlx::Error },
    #[error("RabbitMQ vhost {vhost}: {detail}")]
    Vhost { vhost: String, detail: String },
    #[error("bad URL {:?}: {why}", craig_mq::settings::redact(url))]
    BadUrl { url: String, why: &'static str },
}

/// One isolated set: a database per service and one vhost.
#[derive(Debug)]
pub struct Sandbox {
    pub name: String,
    admin_url: String,
    amqp_url: String,
    vhost: String,
    databases: Vec<(String, String)>,
    users: Vec<String>,
    queue_type: QueueType,
    destroyed: bool,
}

/// One broker account for [`Sandbox::add_users`]: a name (prefixed with the sandbox's)
/// and its permission regexes on the sandbox's vhost.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Account {
    pub name: String,
    pub configure: String,
    pub write: String,
    pub read: String,
}

impl Sandbox {
    /// Create databases `<name>_<service>` for each service and vhost `<name>` on the
    /// servers named by `DATABASE_URL` and `AMQP_URL` (or the defaults).
    /// Its DLQ is a classic queue (the ADR's topology); see [`Sandbox::create_typed`].
    pub async fn create(label: &str, services: &[&str]) -> Result<Self, SandboxError> {
        Self::create_typed(label, services, QueueType::Classic).await
    }

    /// [`Sandbox::create`] with the operator's DLQ of `queue_type` (issue 25): the fleet in
    /// it must declare its queues with the same type.
    pub async fn create_typed(label: &str, services: &[&str], queue_type: QueueType) -> Result<Self, SandboxError> {
        let admin_url = std::env::var("DATABASE_URL").unwrap_or_else(|_| DEFAULT_DATABASE_URL.into());
        let amqp_base = std::env::var("AMQP_URL").unwrap_or_else(|_| DEFAULT_AMQP_URL.into());
        Self::create_on(&admin_url, &amqp_base, label, services, queue_type).await
    }

    pub async fn create_on(admin_url: &str, amqp_base: &str, label: &str, services: &[&str], queue_type: QueueType) -> Result<Self, SandboxError> {
        let name = sandbox_name(label);
        let mut admin = admin_conn(admin_url).await?;
        let pg = |source| SandboxError::Postgres { url: admin_url.to_owned(), source };
        registry_lock(&mut admin).await.map_err(pg)?;
        let result = async {
            reap_leftovers(&mut admin, admin_url, amqp_base, &name).await?;
            drop_everything(&mut admin, admin_url, amqp_base, &name).await?;
            sqlx::query("INSERT INTO craig_sandbox_registry (name, pid) VALUES ($1, $2)")
                .bind(&name)
                .bind(std::process::id() as i32)
                .execute(&mut admin)
                .await
                .map_err(pg)?;
            let mut databases = Vec::new();
            for svc in services {
                let db = format!("{name}_{svc}");
                sqlx::query(AssertSqlSafe(format!("CREATE DATABASE \"{db}\""))).execute(&mut admin).await.map_err(pg)?;
                databases.push((svc.to_string(), replace_path(admin_url, &db)?));
            }
            vhost_create(amqp_base, &name).await?;
            deploy_exchanges(&replace_path(amqp_base, &name)?, &name, queue_type).await?;
            Ok(Self {
                queue_type,
                amqp_url: replace_path(amqp_base, &name)?,
                vhost: name.clone(),
                name: name.clone(),
                admin_url: admin_url.to_owned(),
                databases,
                users: Vec::new(),
                destroyed: false,
            })
        }
        .await;
        let _ = sqlx::query("SELECT pg_advisory_unlock($1)").bind(REGISTRY_LOCK).execute(&mut admin).await;
        let _ = admin.close().await;
        result
    }

    /// The database URL for `service`. Panics if the sandbox was not created with it:
    /// that is a bug in the caller, not a runtime condition.
    pub fn database_url(&self, service: &str) -> &str {
        self.databases
            .iter()
            .find(|(s, _)| s == service)
            .map(|(_, u)| u.as_str())
            .unwrap_or_else(|| panic!("sandbox {} has no database for service {service}", self.name))
    }

    /// The vhost with the admin's credential: the operator, who owns the exchanges.
    pub fn amqp_url(&self) -> &str {
        &self.amqp_url
    }

    /// Create broker accounts (`<sandbox>.<name>`, each with only its permissions on this
    /// sandbox's vhost: ADR-022 #1202) in ONE definitions import, wait until each can log
    /// in, and return each one's AMQP URL, in order. They are deleted by
    /// [`destroy`](Self::destroy); one left by a crashed run holds no permission once its
    /// vhost is gone, and the next run of the same label re-imports it.
    pub async fn add_users(&mut self, accounts: &[Account]) -> Result<Vec<String>, SandboxError> {
        let vhost = self.vhost.clone();
        let err = |detail: String| SandboxError::Vhost { vhost: vhost.clone(), detail };
        let named: Vec<Account> = accounts.iter().map(|a| Account { name: format!("{}.{}", self.name, a.name), ..a.clone() }).collect();
        let (defs, urls) = definitions(&named, &self.vhost, &self.amqp_url, |user| sandbox_name(&format!("{user}/password")))?;
        // Recorded before the import: a partial import is still deleted by destroy.
        self.users.extend(named.into_iter().map(|a| a.name));
        definitions_import(&self.amqp_url, &defs).await.map_err(&err)?;
        wait_logins(&urls).await.map_err(&err)?;
        Ok(urls)
    }

    pub fn vhost(&self) -> &str {
        &self.vhost
    }

    /// A small pool on `service`'s database (capped, as sqlx's test pools are).
    pub async fn pool(&self, service: &str) -> Result<PgPool, SandboxError> {
        let url = self.database_url(service);
        PgPoolOptions::new()
            .max_connections(8)
            .acquire_timeout(Duration::from_secs(10))
            .connect(url)
            .await
            .map_err(|source| SandboxError::Postgres { url: url.to_owned(), source })
    }

    /// Fault: delete the vhost. The broker force-closes every connection on it and refuses
    /// new ones until [`Sandbox::restore_vhost`]; queues and messages in it are gone.
    pub async fn drop_vhost(&self) -> Result<(), SandboxError> {
        vhost_delete(&self.amqp_url, &self.vhost).await
    }

    /// Re-create the vhost deleted by [`Sandbox::drop_vhost`]: empty but for the operator's
    /// part of a deploy (the exchanges and the DLQ, as [`Sandbox::create`] leaves it).
    /// Accounts made by [`add_users`](Self::add_users) lost their permissions with it.
    pub async fn restore_vhost(&self) -> Result<(), SandboxError> {
        vhost_create(&self.amqp_url, &self.vhost).await?;
        deploy_exchanges(&self.amqp_url, &self.vhost, self.queue_type).await
    }

    /// The type of the queues in this sandbox (its DLQ's, as deployed).
    pub fn queue_type(&self) -> QueueType {
        self.queue_type
    }

    /// Set (or replace) a queue policy in this sandbox's vhost: `definition` is RabbitMQ's
    /// policy JSON (e.g. `{"max-length": 20, "overflow": "reject-publish"}`), `pattern` a
    /// regex over queue names. Management API, else a local `rabbitmqctl`.
    pub async fn set_policy(&self, name: &str, pattern: &str, definition: &serde_json::Value) -> Result<(), SandboxError> {
        let m = management(&self.amqp_url)?;
        let err = |detail: String| SandboxError::Vhost { vhost: self.vhost.clone(), detail };
        let client = reqwest::Client::builder().timeout(Duration::from_secs(10)).build().expect("reqwest client");
        let body = serde_json::json!({"pattern": pattern, "definition": definition, "apply-to": "queues", "priority": 10});
        let url = format!("{}/api/policies/{}/{name}", m.base, self.vhost);
        match client.put(url).basic_auth(&m.user, Some(&m.pass)).json(&body).send().await {
            Ok(r) if r.status().is_success() => Ok(()),
            Ok(r) => Err(err(format!("management API answered HTTP {} to PUT /api/policies", r.status()))),
            Err(e) if e.is_connect() => rabbitmqctl(&[
                "set_policy", "-p", &self.vhost, "--apply-to", "queues", "--priority", "10", name, pattern, &definition.to_string(),
            ])
            .map_err(err),
            Err(e) => Err(err(e.to_string())),
        }
    }

    /// Remove a policy set by [`set_policy`](Self::set_policy) (absent is fine).
    pub async fn clear_policy(&self, name: &str) -> Result<(), SandboxError> {
        let m = management(&self.amqp_url)?;
        let err = |detail: String| SandboxError::Vhost { vhost: self.vhost.clone(), detail };
        let client = reqwest::Client::builder().timeout(Duration::from_secs(10)).build().expect("reqwest client");
        let url = format!("{}/api/policies/{}/{name}", m.base, self.vhost);
        match client.delete(url).basic_auth(&m.user, Some(&m.pass)).send().await {
            Ok(r) if r.status().is_success() || r.status() == reqwest::StatusCode::NOT_FOUND => Ok(()),
            Ok(r) => Err(err(format!("management API answered HTTP {} to DELETE /api/policies", r.status()))),
            Err(e) if e.is_connect() => rabbitmqctl(&["clear_policy", "-p", &self.vhost, name]).map_err(err),
            Err(e) => Err(err(e.to_string())),
        }
    }

    /// Deliveries of `queues` handed to a consumer and not yet acked (a passive declare
    /// counts only ready ones). Management API, else a local `rabbitmqctl`.
    pub async fn unacked(&self, queues: &[String]) -> Result<u64, SandboxError> {
        let m = management(&self.amqp_url)?;
        let err = |detail: String| SandboxError::Vhost { vhost: self.vhost.clone(), detail };
        let client = reqwest::Client::builder().timeout(Duration::from_secs(5)).build().expect("reqwest client");
        let url = format!("{}/api/queues/{}?columns=name,messages_unacknowledged", m.base, self.vhost);
        match client.get(url).basic_auth(&m.user, Some(&m.pass)).send().await {
            Ok(r) if r.status().is_success() => {
                let rows: Vec<serde_json::Value> = r.json().await.map_err(|e| err(e.to_string()))?;
                // A queue whose statistic the management plugin has not collected yet is
                // unknown, never 0 (issue 22.7).
                let mut total = 0;
                for q in rows.iter().filter(|q| queues.iter().any(|n| Some(n.as_str()) == q["name"].as_str())) {
                    match q["messages_unacknowledged"].as_u64() {
                        Some(n) => total += n,
                        None => return Err(err(format!("queue {}: messages_unacknowledged not reported yet", q["name"]))),
                    }
                }
                Ok(total)
            }
            Ok(r) => Err(err(format!("management API answered HTTP {} to GET /api/queues", r.status()))),
            Err(e) if e.is_connect() => {
                rabbitmqctl_output(&["list_queues", "-p", &self.vhost, "-s", "name", "messages_unacknowledged"])
                    .and_then(|out| sum_listed(&out, queues))
                    .map_err(err)
            }
            Err(e) => Err(err(e.to_string())),
        }
    }

    /// The broker's word for `queue`'s type (`classic`, `quorum`): the management API, or
    /// `rabbitmqctl list_queues` where it does not answer.
    pub async fn queue_type_of(&self, queue: &str) -> Result<String, SandboxError> {
        let m = management(&self.amqp_url)?;
        let err = |detail: String| SandboxError::Vhost { vhost: self.vhost.clone(), detail };
        let client = reqwest::Client::builder().timeout(Duration::from_secs(5)).build().expect("reqwest client");
        let url = format!("{}/api/queues/{}/{}", m.base, self.vhost, queue);
        match client.get(url).basic_auth(&m.user, Some(&m.pass)).send().await {
            Ok(r) if r.status().is_success() => {
                let q: serde_json::Value = r.json().await.map_err(|e| err(e.to_string()))?;
                q["type"].as_str().map(str::to_owned).ok_or_else(|| err(format!("queue {queue}: no type reported")))
            }
            Ok(r) => Err(err(format!("management API answered HTTP {} to GET /api/queues/…/{queue}", r.status()))),
            Err(e) if e.is_connect() => {
                let out = rabbitmqctl_output(&["list_queues", "-p", &self.vhost, "-s", "name", "type"]).map_err(err)?;
                out.lines()
                    .filter_map(|l| l.split_once('\t'))
                    .find(|(n, _)| *n == queue)
                    .map(|(_, t)| t.trim().to_owned())
                    .ok_or_else(|| err(format!("queue {queue} not listed")))
            }
            Err(e) => Err(err(e.to_string())),
        }
    }

    /// Drop the databases, the vhost and the users made by [`add_users`](Self::add_users),
    /// and forget the sandbox.
    pub async fn destroy(mut self) -> Result<(), SandboxError> {
        self.destroyed = true;
        for user in std::mem::take(&mut self.users) {
            user_delete(&self.amqp_url, &self.vhost, &user).await?;
        }
        let mut admin = admin_conn(&self.admin_url).await?;
        let amqp_base = self.amqp_url.clone();
        let res = drop_everything(&mut admin, &self.admin_url, &amqp_base, &self.name).await;
        let _ = admin.close().await;
        res
    }
}

impl Drop for Sandbox {
    fn drop(&mut self) {
        if !self.destroyed {
            eprintln!(
                "craig-sandbox: keeping sandbox {} (databases {:?}, vhost {}) for debugging; \
                 it is removed at the next start once this process has exited",
                self.name,
                self.databases.iter().map(|(_, u)| u.rsplit('/').next().unwrap_or("")).collect::<Vec<_>>(),
                self.vhost
            );
        }
    }
}

/// `craig_` + 12 hex digits of sha256(label).
pub fn sandbox_name(label: &str) -> String {
    let digest = Sha256::digest(label.as_bytes());
    let mut s = String::from("craig_");
    for b in &digest[..6] {
        let _ = write!(s, "{b:02x}");
    }
    s
}

/// Replace the path (database or vhost) of a `scheme://authority/path?query` URL.
pub fn replace_path(url: &str, new_path: &str) -> Result<String, SandboxError> {
    let bad = |why| SandboxError::BadUrl { url: url.to_owned(), why };
    let (scheme, rest) = url.split_once("://").ok_or_else(|| bad("no scheme"))?;
    let (before_query, query) = match rest.split_once('?') {
        Some((b, q)) => (b, Some(q)),
        None => (rest, None),
    };
    let authority = before_query.split('/').next().filter(|a| !a.is_empty()).ok_or_else(|| bad("no host"))?;
    let mut out = format!("{scheme}://{authority}/{new_path}");
    if let Some(q) = query {
        out.push('?');
        out.push_str(q);
    }
    Ok(out)
}

const REGISTRY_LOCK: i64 = 0x4352_4149_475f_5342; // "CRAIG_SB"

async fn admin_conn(admin_url: &str) -> Result<PgConnection, SandboxError> {
    let pg = |source| SandboxError::Postgres { url: admin_url.to_owned(), source };
    let opts: PgConnectOptions = admin_url.parse().map_err(pg)?;
    opts.connect().await.map_err(pg)
}

async fn registry_lock(admin: &mut PgConnection) -> Result<(), sqlx::Error> {
    sqlx::query("SELECT pg_advisory_lock($1)").bind(REGISTRY_LOCK).execute(&mut *admin).await?;
    sqlx::query(
        "CREATE TABLE IF NOT EXISTS craig_sandbox_registry (\
           name TEXT PRIMARY KEY, pid INT NOT NULL, created_at TIMESTAMPTZ NOT NULL DEFAULT now())",
    )
    .execute(&mut *admin)
    .await?;
    Ok(())
}

/// Remove sandboxes whose owner process no longer exists (a crashed or failed run).
async fn reap_leftovers(admin: &mut PgConnection, admin_url: &str, amqp_base: &str, except: &str) -> Result<(), SandboxError> {
    let pg = |source| SandboxError::Postgres { url: admin_url.to_owned(), source };
    let rows: Vec<(String, i32)> =
        sqlx::query_as("SELECT name, pid FROM craig_sandbox_registry").fetch_all(&mut *admin).await.map_err(pg)?;
    for (name, pid) in rows {
        if name != except && !pid_alive(pid) {
            eprintln!("craig-sandbox: removing leftover sandbox {name} (owner pid {pid} is gone)");
            drop_everything(admin, admin_url, amqp_base, &name).await?;
        }
    }
    Ok(())
}

fn pid_alive(pid: i32) -> bool {
    use nix::errno::Errno;
    match nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), None) {
        Ok(()) => true,
        Err(Errno::ESRCH) => false,
        Err(_) => true, // EPERM: exists, not ours
    }
}

async fn drop_everything(admin: &mut PgConnection, admin_url: &str, amqp_base: &str, name: &str) -> Result<(), SandboxError> {
    let pg = |source| SandboxError::Postgres { url: admin_url.to_owned(), source };
    let dbs: Vec<String> = sqlx::query_scalar("SELECT datname FROM pg_database WHERE datname LIKE $1 || '\\_%'")
        .bind(name)
        .fetch_all(&mut *admin)
        .await
        .map_err(pg)?;
    for db in dbs {
        sqlx::query(AssertSqlSafe(format!("DROP DATABASE IF EXISTS \"{db}\" WITH (FORCE)")))
            .execute(&mut *admin)
            .await
            .map_err(pg)?;
    }
    vhost_delete(amqp_base, name).await?;
    sqlx::query("DELETE FROM craig_sandbox_registry WHERE name = $1").bind(name).execute(&mut *admin).await.map_err(pg)?;
    Ok(())
}

struct Management {
    base: String,
    user: String,
    pass: String,
}

fn management(amqp_base: &str) -> Result<Management, SandboxError> {
    let bad = |why| SandboxError::BadUrl { url: amqp_base.to_owned(), why };
    let rest = amqp_base.split_once("://").ok_or_else(|| bad("no scheme"))?.1;
    let authority = rest.split(['/', '?']).next().unwrap_or("");
    let (creds, hostport) = authority.rsplit_once('@').unwrap_or(("guest:guest", authority));
    let (user, pass) = creds.split_once(':').unwrap_or((creds, ""));
    let host = hostport.rsplit_once(':').map(|(h, _)| h).unwrap_or(hostport);
    let base = std::env::var("RABBITMQ_MANAGEMENT_URL").unwrap_or_else(|_| format!("http://{host}:15672"));
    Ok(Management { base, user: user.to_owned(), pass: pass.to_owned() })
}

async fn vhost_create(amqp_base: &str, vhost: &str) -> Result<(), SandboxError> {
    let m = management(amqp_base)?;
    let client = reqwest::Client::builder().timeout(Duration::from_secs(10)).build().expect("reqwest client");
    let err = |detail: String| SandboxError::Vhost { vhost: vhost.to_owned(), detail };
    let put = client.put(format!("{}/api/vhosts/{vhost}", m.base)).basic_auth(&m.user, Some(&m.pass)).send().await;
    match put {
        Ok(r) if r.status().is_success() => {
            let perm = client
                .put(format!("{}/api/permissions/{vhost}/{}", m.base, m.user))
                .basic_auth(&m.user, Some(&m.pass))
                .json(&serde_json::json!({"configure": ".*", "write": ".*", "read": ".*"}))
                .send()
                .await
                .map_err(|e| err(e.to_string()))?;
            if !perm.status().is_success() {
                return Err(err(format!("set permissions: HTTP {}", perm.status())));
            }
            Ok(())
        }
        Ok(r) => Err(err(format!("management API answered HTTP {} to PUT /api/vhosts", r.status()))),
        Err(e) if e.is_connect() => {
            rabbitmqctl(&["add_vhost", vhost]).map_err(|d| err(format!("management API unreachable ({e}); {d}")))?;
            rabbitmqctl(&["set_permissions", "-p", vhost, &m.user, ".*", ".*", ".*"]).map_err(err)
        }
        Err(e) => Err(err(e.to_string())),
    }
}

async fn vhost_delete(amqp_base: &str, vhost: &str) -> Result<(), SandboxError> {
    delete_resource(amqp_base, vhost, &format!("/api/vhosts/{vhost}"), &["delete_vhost", vhost], "no_such_vhost").await
}

/// DELETE `api_path` through the management API (404: already gone), else `rabbitmqctl
/// ctl_args` (already gone: "does not exist" or `gone`); errors name `vhost`.
async fn delete_resource(amqp_base: &str, vhost: &str, api_path: &str, ctl_args: &[&str], gone: &str) -> Result<(), SandboxError> {
    let m = management(amqp_base)?;
    let client = reqwest::Client::builder().timeout(Duration::from_secs(10)).build().expect("reqwest client");
    let err = |detail: String| SandboxError::Vhost { vhost: vhost.to_owned(), detail };
    match client.delete(format!("{}{api_path}", m.base)).basic_auth(&m.user, Some(&m.pass)).send().await {
        Ok(r) if r.status().is_success() || r.status() == reqwest::StatusCode::NOT_FOUND => Ok(()),
        Ok(r) => Err(err(format!("management API answered HTTP {} to DELETE {api_path}", r.status()))),
        Err(e) if e.is_connect() => match rabbitmqctl(ctl_args) {
            Ok(()) => Ok(()),
            Err(d) if d.contains("does not exist") || d.contains(gone) => Ok(()),
            Err(d) => Err(err(d)),
        },
        Err(e) => Err(err(e.to_string())),
    }
}

/// The operator's part of a deploy on a fresh vhost (ADR-022 #1202): the exchanges and the
/// DLQ, which no service account may declare.
async fn deploy_exchanges(amqp_url: &str, vhost: &str, queue_type: QueueType) -> Result<(), SandboxError> {
    craig_mq::topology::deploy_operator_part(amqp_url, queue_type)
        .await
        .map_err(|e| SandboxError::Vhost { vhost: vhost.to_owned(), detail: format!("declaring the exchanges and the DLQ: {e}") })
}

/// RabbitMQ's `rabbit_password_hashing_sha256`: base64(salt ++ sha256(salt ++ password)),
/// the salt 4 bytes derived from the user name (a sandbox's accounts are reproducible).
pub fn password_hash(user: &str, password: &str) -> String {
    use base64::Engine as _;
    let salt: [u8; 4] = Sha256::digest(user.as_bytes())[..4].try_into().expect("4 bytes");
    let mut h = Sha256::new();
    h.update(salt);
    h.update(password.as_bytes());
    let mut out = salt.to_vec();
    out.extend_from_slice(&h.finalize());
    base64::engine::general_purpose::STANDARD.encode(out)
}

/// `url` (`scheme://[creds@]host…`) with `user:password` as its credentials.
pub fn with_credentials(url: &str, user: &str, password: &str) -> Result<String, SandboxError> {
    let (scheme, rest) = url.split_once("://").ok_or(SandboxError::BadUrl { url: url.to_owned(), why: "no scheme" })?;
    let host = rest.split_once('@').map(|(_, h)| h).unwrap_or(rest);
    Ok(format!("{scheme}://{user}:{password}@{host}"))
}

/// RabbitMQ definitions (users and their permissions on `vhost`) for `accounts`, each
/// with the password `password_of(name)`, and each account's AMQP URL (`base_url` with its
/// credentials). One import makes them all.
pub fn definitions(
    accounts: &[Account],
    vhost: &str,
    base_url: &str,
    password_of: impl Fn(&str) -> String,
) -> Result<(serde_json::Value, Vec<String>), SandboxError> {
    let (mut users, mut perms, mut urls) = (Vec::new(), Vec::new(), Vec::new());
    for a in accounts {
        let password = password_of(&a.name);
        users.push(serde_json::json!({
            "name": a.name,
            "password_hash": password_hash(&a.name, &password),
            "hashing_algorithm": "rabbit_password_hashing_sha256",
            "tags": [],
        }));
        perms.push(serde_json::json!({ "user": a.name, "vhost": vhost, "configure": a.configure, "write": a.write, "read": a.read }));
        urls.push(with_credentials(base_url, &a.name, &password)?);
    }
    Ok((serde_json::json!({ "users": users, "permissions": perms }), urls))
}

/// Wait until every URL's account logs in (a definitions import is asynchronous): 15 s
/// per account, each attempt bounded.
pub async fn wait_logins(urls: &[String]) -> Result<(), String> {
    for url in urls {
        let deadline = std::time::Instant::now() + Duration::from_secs(15);
        loop {
            match craig_mq::publisher::connect_within(url, 0, "login-check", Duration::from_secs(3)).await {
                Ok(c) => {
                    let _ = tokio::time::timeout(Duration::from_secs(2), c.close(200, "ok".into())).await;
                    break;
                }
                Err(e) if std::time::Instant::now() > deadline => return Err(format!("an imported account cannot log in after 15 s: {e}")),
                Err(_) => tokio::time::sleep(Duration::from_millis(100)).await,
            }
        }
    }
    Ok(())
}

/// Import RabbitMQ definitions (users, permissions): management API, else `rabbitmqctl
/// import_definitions` from a file the node can read.
async fn definitions_import(amqp_base: &str, defs: &serde_json::Value) -> Result<(), String> {
    let m = management(amqp_base).map_err(|e| e.to_string())?;
    let client = reqwest::Client::builder().timeout(Duration::from_secs(10)).build().expect("reqwest client");
    match client.post(format!("{}/api/definitions", m.base)).basic_auth(&m.user, Some(&m.pass)).json(defs).send().await {
        Ok(r) if r.status().is_success() => Ok(()),
        Ok(r) => Err(format!("management API answered HTTP {} to POST /api/definitions", r.status())),
        Err(e) if e.is_connect() => {
            use std::os::unix::fs::PermissionsExt as _;
            let path = std::env::temp_dir().join(format!("craig-sandbox-defs-{}-{}.json", std::process::id(), defs.to_string().len()));
            std::fs::write(&path, defs.to_string()).map_err(|e| format!("writing {}: {e}", path.display()))?;
            let _ = std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o644));
            let res = rabbitmqctl(&["import_definitions", path.to_str().unwrap_or_default()]);
            let _ = std::fs::remove_file(&path);
            res
        }
        Err(e) => Err(e.to_string()),
    }
}

async fn user_delete(amqp_base: &str, vhost: &str, user: &str) -> Result<(), SandboxError> {
    delete_resource(amqp_base, vhost, &format!("/api/users/{user}"), &["delete_user", user], "no_such_user").await
}

fn rabbitmqctl(args: &[&str]) -> Result<(), String> {
    rabbitmqctl_output(args).map(drop)
}

fn rabbitmqctl_output(args: &[&str]) -> Result<String, String> {
    let out = std::process::Command::new("rabbitmqctl")
        .args(args)
        .output()
        .map_err(|e| format!("rabbitmqctl not runnable ({e}); enable the management plugin: rabbitmq-plugins enable rabbitmq_management"))?;
    if out.status.success() {
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    } else {
        Err(format!("rabbitmqctl {}: {}", args.join(" "), String::from_utf8_lossy(&out.stderr).trim()))
    }
}

/// Sum of the second column over `rabbitmqctl list_queues -s name <counter>` lines whose
/// first column is one of `queues`. A listed queue whose counter is missing or not a number
/// (a statistic not collected yet) makes the sum unknown (`Err`), never 0; a queue not
/// listed at all does not exist and holds nothing.
pub fn sum_listed(listing: &str, queues: &[String]) -> Result<u64, String> {
    let mut total = 0;
    for l in listing.lines() {
        let mut cols = l.split_whitespace();
        let Some(name) = cols.next() else { continue };
        if !queues.iter().any(|q| q == name) {
            continue;
        }
        match cols.next().and_then(|n| n.parse::<u64>().ok()) {
            Some(n) => total += n,
            None => return Err(format!("queue {name}: no counter in {l:?}")),
        }
    }
    Ok(total)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// RabbitMQ's sha256 scheme (checked against Python's hashlib for the same salt).
    #[test]
    fn password_hashes_follow_rabbit_password_hashing_sha256() {
        assert_eq!(password_hash("craig_x.craig-rules", "secret"), "cUNg33/PulOPAqPTlxbtFlZdffwYRz5ulOu5mTX6nipuWMqI");
        assert_eq!(
            with_credentials("amqp://guest:guest@127.0.0.1:5672/v", "u", "p").unwrap(),
            "amqp://u:p@127.0.0.1:5672/v"
        );
        assert_eq!(with_credentials("amqp://h:1/v", "u", "p").unwrap(), "amqp://u:p@h:1/v");
    }

    #[test]
    fn listed_counts_sum_over_the_named_queues_only() {
        let out = "craig-rules.events\t3\ncraig-security.events\t2\nother\t9\nbad line\n";
        assert_eq!(sum_listed(out, &["craig-rules.events".into(), "craig-security.events".into()]), Ok(5));
        assert_eq!(sum_listed("", &["x".into()]), Ok(0));
        // Issue 22.7: a statistic not reported is unknown, never 0.
        assert!(sum_listed("craig-rules.events\t\ncraig-security.events\t2\n", &["craig-rules.events".into()]).is_err());
    }

    #[test]
    fn names_are_deterministic_and_short() {
        let a = sandbox_name("craig_mq::outbox::two_workers");
        assert_eq!(a, sandbox_name("craig_mq::outbox::two_workers"));
        assert_ne!(a, sandbox_name("craig_mq::outbox::other"));
        assert_eq!(a.len(), 18);
        assert!(format!("{a}_financial").len() <= 63);
    }

    #[test]
    fn replaces_url_paths() {
        assert_eq!(
            replace_path("postgres://postgres@127.0.0.1:5432/postgres", "x").unwrap(),
            "postgres://postgres@127.0.0.1:5432/x"
        );
        assert_eq!(
            replace_path("amqp://guest:guest@127.0.0.1:5672/%2f?heartbeat=5", "v").unwrap(),
            "amqp://guest:guest@127.0.0.1:5672/v?heartbeat=5"
        );
        assert_eq!(replace_path("postgres://h", "d").unwrap(), "postgres://h/d");
        assert!(replace_path("nonsense", "d").is_err());
    }

    #[test]
    fn management_endpoint_from_amqp_url() {
        let m = management("amqp://alice:s3cret@broker.local:5672/%2f").unwrap();
        assert_eq!((m.user.as_str(), m.pass.as_str()), ("alice", "s3cret"));
        if std::env::var("RABBITMQ_MANAGEMENT_URL").is_err() {
            assert_eq!(m.base, "http://broker.local:15672");
        }
    }
}
