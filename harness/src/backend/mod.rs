//! Where PostgreSQL and RabbitMQ come from for a run (CONTRACT § Configuration,
//! `CHAOS_BACKEND`).
//!
//! | kind | servers | destructive faults |
//! |---|---|---|
//! | `local` | private child processes in a temp dir, on leased free ports | kill, pause, restart (data kept) |
//! | `external` | `DATABASE_URL` / `AMQP_URL`, one fresh database per service and one vhost per run | none: the servers are shared |
//! | `containers` | testcontainers (postgres, rabbitmq; Toxiproxy as a generic image) | kill/start, pause, partition (network disconnect) |
//!
//! A `partition` on `local` and `external` holds the replicas' links in the fault proxy
//! instead (`runner::faults::partition`).
//!
//! `auto` picks local, then containers, then external, and says why.

pub mod containers;
pub mod external;
pub mod local;

use std::fmt;
use std::str::FromStr;

/// `host:port` of a URL like `scheme://user:pass@host:port/path`.
pub fn external_authority(url: &str) -> String {
    external::authority(url)
}

/// A server a destructive fault can target.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Target {
    Database,
    /// The broker: a one-node broker, or node 1 of a cluster.
    Broker,
    /// Node N (1-based) of a broker cluster (issue 25), `broker-N`.
    BrokerNode(u8),
}

impl Target {
    /// The broker node this target is (1 for `broker`), None for the database.
    pub fn broker_node(self) -> Option<usize> {
        match self {
            Target::Database => None,
            Target::Broker => Some(1),
            Target::BrokerNode(n) => Some(usize::from(n)),
        }
    }
}

impl fmt::Display for Target {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Target::Database => f.write_str("database"),
            Target::Broker => f.write_str("broker"),
            Target::BrokerNode(n) => write!(f, "broker-{n}"),
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BackendKind {
    Auto,
    Local,
    External,
    Containers,
}

impl BackendKind {
    pub fn name(self) -> &'static str {
        match self {
            BackendKind::Auto => "auto",
            BackendKind::Local => "local",
            BackendKind::External => "external",
            BackendKind::Containers => "containers",
        }
    }
}

impl fmt::Display for BackendKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for BackendKind {
    type Err = BackendError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "auto" | "" => Ok(BackendKind::Auto),
            "local" => Ok(BackendKind::Local),
            "external" => Ok(BackendKind::External),
            "containers" => Ok(BackendKind::Containers),
            other => Err(BackendError::Unknown(other.to_owned())),
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum BackendError {
    #[error("unknown backend {0:?}; expected auto, local, external or containers")]
    Unknown(String),
    #[error("backend {backend} is not available here: {why}")]
    Unavailable { backend: &'static str, why: String },
    /// A backend setting (an environment variable) that cannot be used as written.
    #[error("{var} is not usable: {why}")]
    Setting { var: &'static str, why: String },
    #[error("backend {backend} cannot {fault} the {target}: {why}")]
    Unsupported { backend: &'static str, fault: &'static str, target: Target, why: &'static str },
    #[error("{what}: {why}")]
    Failed { what: String, why: String },
}

impl BackendError {
    pub(crate) fn failed(what: impl Into<String>, why: impl fmt::Display) -> Self {
        BackendError::Failed { what: what.into(), why: why.to_string() }
    }
}

/// What `auto` found, and why it chose what it chose.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Choice {
    pub kind: BackendKind,
    pub reason: String,
}

/// Resolve `requested` (from `--backend` or `CHAOS_BACKEND`) to a concrete backend.
/// `local_probe` and `docker_probe` say why a backend is unusable (`Err`) or confirm it.
pub fn choose(requested: BackendKind, local_probe: Result<(), String>, docker_probe: Result<(), String>) -> Result<Choice, BackendError> {
    match requested {
        BackendKind::Local => local_probe
            .map(|()| Choice { kind: BackendKind::Local, reason: "requested".into() })
            .map_err(|why| BackendError::Unavailable { backend: "local", why }),
        BackendKind::Containers => docker_probe
            .map(|()| Choice { kind: BackendKind::Containers, reason: "requested".into() })
            .map_err(|why| BackendError::Unavailable { backend: "containers", why }),
        BackendKind::External => Ok(Choice { kind: BackendKind::External, reason: "requested".into() }),
        BackendKind::Auto => match (local_probe, docker_probe) {
            (Ok(()), _) => Ok(Choice {
                kind: BackendKind::Local,
                reason: "PostgreSQL and RabbitMQ server binaries found; private nodes allow kill/pause/restart".into(),
            }),
            (Err(l), Ok(())) => Ok(Choice { kind: BackendKind::Containers, reason: format!("local unavailable ({l}); a Docker engine answers") }),
            (Err(l), Err(d)) => Ok(Choice {
                kind: BackendKind::External,
                reason: format!("local unavailable ({l}); containers unavailable ({d}); using DATABASE_URL/AMQP_URL"),
            }),
        },
    }
}

/// Endpoints a run's nodes and checkers use.
#[derive(Debug, Clone)]
pub struct Endpoints {
    /// `(service, database url)` for each service of the run.
    pub databases: Vec<(String, String)>,
    pub amqp_url: String,
    /// `host:port` of the database server and the broker (what a fault proxy forwards to).
    pub database_addr: String,
    pub broker_addr: String,
    /// `host:port` of every broker node, node 1 (`broker_addr`) first (issue 25).
    pub broker_nodes: Vec<String>,
}

impl Endpoints {
    /// Servers reachable on 127.0.0.1 (`local`, `containers` with published ports): one
    /// database per service on `pg_port`, the default vhost on `amqp_port`. The `*_addr`
    /// fields are what a fault proxy forwards to (they differ for containers).
    pub fn loopback(services: &[String], pg_port: u16, amqp_port: u16, database_addr: String, broker_addr: String) -> Self {
        Endpoints {
            databases: services.iter().map(|s| (s.clone(), format!("postgres://postgres@127.0.0.1:{pg_port}/{s}"))).collect(),
            amqp_url: format!("amqp://guest:guest@127.0.0.1:{amqp_port}/%2f"),
            database_addr,
            broker_nodes: vec![broker_addr.clone()],
            broker_addr,
        }
    }

    pub fn database_url(&self, service: &str) -> Option<&str> {
        self.databases.iter().find(|(s, _)| s == service).map(|(_, u)| u.as_str())
    }
}

/// The fleet's broker accounts, one per service (ADR-022 #1202), in `craig_fleet::service::ALL`'s order.
pub(crate) fn fleet_accounts() -> Vec<craig_sandbox::Account> {
    craig_fleet::access::accounts()
        .into_iter()
        .map(|(_, user, p)| craig_sandbox::Account { name: user, configure: p.configure, write: p.write, read: p.read })
        .collect()
}

/// `CREATE DATABASE` for each service on a fresh server (admin database `postgres`).
pub(crate) async fn create_databases(pg_port: u16, services: &[String]) -> Result<(), BackendError> {
    use sqlx::Connection as _;
    let admin = format!("postgres://postgres@127.0.0.1:{pg_port}/postgres");
    let mut conn = sqlx::PgConnection::connect(&admin).await.map_err(|e| BackendError::failed("connecting to PostgreSQL", e))?;
    for s in services {
        sqlx::query(sqlx::AssertSqlSafe(format!("CREATE DATABASE \"{s}\"")))
            .execute(&mut conn)
            .await
            .map_err(|e| BackendError::failed(format!("creating database {s}"), e))?;
    }
    let _ = conn.close().await;
    Ok(())
}

/// A started backend.
pub enum Backend {
    Local(local::LocalBackend),
    External(external::ExternalBackend),
    Containers(containers::ContainersBackend),
}

impl Backend {
    /// Start `kind` (resolving `auto`) with one database per service. Prints the choice.
    pub async fn start(requested: BackendKind, run_label: &str, services: &[&str]) -> Result<(Backend, Choice), BackendError> {
        let choice = Self::resolve(requested).await?;
        Self::start_chosen(choice, run_label, services).await
    }

    /// Which backend `requested` means here (`auto` resolved by probing), nothing started.
    pub async fn resolve(requested: BackendKind) -> Result<Choice, BackendError> {
        let local_probe = local::probe();
        let docker_probe = if matches!(requested, BackendKind::Containers)
            || (matches!(requested, BackendKind::Auto) && local_probe.is_err())
        {
            containers::probe().await
        } else {
            Err("not probed".into())
        };
        choose(requested, local_probe, docker_probe)
    }

    /// Start the backend [`resolve`](Self::resolve) chose.
    pub async fn start_chosen(choice: Choice, run_label: &str, services: &[&str]) -> Result<(Backend, Choice), BackendError> {
        Self::start_chosen_with(choice, run_label, services, 1).await
    }

    /// [`start_chosen`](Self::start_chosen) with a broker of `broker_nodes` nodes (issue 25:
    /// the local backend only; the runner refuses a cluster elsewhere before this).
    pub async fn start_chosen_with(choice: Choice, run_label: &str, services: &[&str], broker_nodes: usize) -> Result<(Backend, Choice), BackendError> {
        let backend = match choice.kind {
            BackendKind::Local => Backend::Local(local::LocalBackend::start_cluster(services, broker_nodes).await?),
            BackendKind::External => Backend::External(external::ExternalBackend::start(run_label, services).await?),
            BackendKind::Containers => Backend::Containers(containers::ContainersBackend::start(services).await?),
            BackendKind::Auto => unreachable!("choose resolves auto"),
        };
        Ok((backend, choice))
    }

    pub fn kind(&self) -> BackendKind {
        match self {
            Backend::Local(_) => BackendKind::Local,
            Backend::External(_) => BackendKind::External,
            Backend::Containers(_) => BackendKind::Containers,
        }
    }

    pub fn endpoints(&self) -> Endpoints {
        match self {
            Backend::Local(b) => b.endpoints(),
            Backend::External(b) => b.endpoints(),
            Backend::Containers(b) => b.endpoints(),
        }
    }

    /// SIGKILL (or container kill) the target, and wait until it is really gone.
    /// SIGKILL the target; the evidence that it took effect (the pid that died, the
    /// container killed), or None when nothing was running to kill.
    pub async fn kill(&mut self, target: Target) -> Result<Option<String>, BackendError> {
        match self {
            Backend::Local(b) => Ok(b.kill(target).await?.map(|pid| format!("pid {pid} (and its process group) died"))),
            Backend::External(_) => Err(external::unsupported("kill", target)),
            Backend::Containers(b) => b.kill(target).await,
        }
    }

    /// Issue 26: a streaming standby of the database server, and one database address for
    /// every client (the local and containers backends; the external one refuses).
    pub async fn add_standby(&mut self, sync: bool) -> Result<(), BackendError> {
        match self {
            Backend::Local(b) => b.add_standby(sync).await,
            Backend::Containers(b) => b.add_standby(sync).await,
            b => Err(BackendError::Unavailable { backend: b.kind().name(), why: "the database servers are shared: no standby of them runs here (issue 26)".into() }),
        }
    }

    /// Where the standby's replication link must listen and what it forwards to.
    pub fn replication_link(&self) -> Option<(String, String)> {
        match self {
            Backend::Local(b) => b.replication_link(),
            Backend::Containers(b) => b.replication_link(),
            Backend::External(_) => None,
        }
    }

    /// The standby streaming in its mode, caught up: the primary's word for it.
    pub async fn start_replication(&self) -> Result<String, BackendError> {
        match self {
            Backend::Local(b) => b.start_replication().await,
            Backend::Containers(b) => b.start_replication().await,
            b => Err(BackendError::Unavailable { backend: b.kind().name(), why: "no database standby".into() }),
        }
    }

    /// Issue 26: a watch on how far behind the primary reports its standby; None where no
    /// standby streams.
    pub fn replication_watch(&self) -> Option<local::ReplicationWatch> {
        match self {
            Backend::Local(b) => b.replication_watch(),
            Backend::Containers(b) => b.replication_watch(),
            Backend::External(_) => None,
        }
    }

    /// Issue 26: the primary killed, the standby promoted, the database address moved.
    pub async fn failover(&mut self) -> Result<local::Failover, BackendError> {
        match self {
            Backend::Local(b) => b.failover().await,
            Backend::Containers(b) => b.failover().await,
            b => Err(BackendError::Unsupported {
                backend: b.kind().name(),
                fault: "failover",
                target: Target::Database,
                why: "the database servers are shared: no standby of them runs here",
            }),
        }
    }

    /// Disk loss of a killed broker node (issue 25: a cluster on the local backend); the
    /// evidence, what was removed.
    pub fn wipe(&mut self, target: Target) -> Result<String, BackendError> {
        match (self, target.broker_node()) {
            (Backend::Local(b), Some(n)) if b.broker_nodes() > 1 => {
                b.wipe_broker_node(n)?;
                Ok(format!("node {n}'s data directory removed"))
            }
            (b, _) => Err(BackendError::Unsupported {
                backend: b.kind().name(),
                fault: "kill with wipe",
                target,
                why: "only a node of a broker cluster on the local backend loses its disk here",
            }),
        }
    }

    /// On a broker cluster (the local backend's), every queue as node `ask` reports it and
    /// the Erlang name of each node, node 1 first; None for a one-node broker. With `homes`,
    /// a classic queue's node is known where `ask` is its home.
    pub async fn queue_placement(&self, ask: usize, homes: bool) -> Result<Option<(Vec<local::QueuePlacement>, Vec<String>)>, BackendError> {
        match self {
            Backend::Local(b) if b.broker_nodes() > 1 => Ok(Some((b.queue_placement(ask, homes).await?, b.broker_node_names()))),
            _ => Ok(None),
        }
    }

    /// On a broker cluster (the local backend's), wait until node `target`, restarted, is
    /// online in every quorum queue it is a member of, as it reports them (bounded by
    /// `within`; the queues still without it otherwise). Nothing to wait for elsewhere.
    pub async fn await_members_online(&self, target: Target, within: std::time::Duration) -> Result<(), BackendError> {
        match (self, target.broker_node()) {
            (Backend::Local(b), Some(n)) if b.broker_nodes() > 1 => b.await_members_online(n, within).await,
            _ => Ok(()),
        }
    }

    /// A node of a broker cluster cut off from the other nodes at the distribution layer
    /// (issue 25; the local backend's cluster, packet-filter rules): the cut's own words.
    pub async fn cut_node(&mut self, target: Target) -> Result<String, BackendError> {
        match (self, target) {
            (Backend::Local(b), Target::BrokerNode(n)) if b.broker_nodes() > 1 => b.cut_node(usize::from(n)).await,
            (b, _) => Err(BackendError::Unsupported {
                backend: b.kind().name(),
                fault: "partition",
                target,
                why: "only a node of a broker cluster on the local backend is cut off from its peers here",
            }),
        }
    }

    /// The cut of [`Backend::cut_node`] healed: the packets it dropped, per peer node.
    pub async fn heal_cut(&mut self, target: Target) -> Result<Vec<(usize, u64)>, BackendError> {
        match (self, target) {
            (Backend::Local(b), Target::BrokerNode(n)) => b.heal_cut(usize::from(n)).await,
            (b, _) => Err(BackendError::Unsupported { backend: b.kind().name(), fault: "partition", target, why: "no cut here" }),
        }
    }

    /// A wiped broker node back in its cluster, as an operator replaces one: the survivors
    /// forget it, it starts empty and joins them.
    pub async fn rejoin(&mut self, target: Target) -> Result<(), BackendError> {
        match (self, target.broker_node()) {
            (Backend::Local(b), Some(n)) => b.rejoin_broker_node(n).await,
            (b, _) => Err(BackendError::Unsupported { backend: b.kind().name(), fault: "kill with wipe", target, why: "no cluster here" }),
        }
    }

    /// A broker cluster's node drained (issue 25, the local backend's): `rabbitmq-upgrade
    /// drain`, the first step of a graceful restart; [`Backend::stop_gracefully`] next.
    pub async fn drain(&mut self, target: Target) -> Result<(), BackendError> {
        match (self, target.broker_node()) {
            (Backend::Local(b), Some(n)) if b.broker_nodes() > 1 => b.drain_broker_node(n).await,
            (b, _) => Err(BackendError::Unsupported {
                backend: b.kind().name(),
                fault: "upgrade",
                target,
                why: "only a node of a broker cluster on the local backend is drained and restarted here",
            }),
        }
    }

    /// Whether broker node `ask` reports the target node under maintenance (drained).
    pub async fn under_maintenance(&self, ask: usize, target: Target) -> Result<bool, BackendError> {
        match (self, target.broker_node()) {
            (Backend::Local(b), Some(n)) => b.under_maintenance(ask, n).await,
            (b, _) => Err(BackendError::Unsupported { backend: b.kind().name(), fault: "upgrade", target, why: "no cluster here" }),
        }
    }

    /// The drained node stopped by SIGTERM: its exit status; None when it did not stop by
    /// itself within 60 s (killed).
    pub async fn stop_gracefully(&mut self, target: Target) -> Result<Option<std::process::ExitStatus>, BackendError> {
        match (self, target.broker_node()) {
            (Backend::Local(b), Some(n)) => b.stop_broker_node(n).await,
            (b, _) => Err(BackendError::Unsupported { backend: b.kind().name(), fault: "upgrade", target, why: "no cluster here" }),
        }
    }

    /// The node of [`Backend::drain`] out of maintenance mode once restarted.
    pub async fn revive(&mut self, target: Target) -> Result<(), BackendError> {
        match (self, target.broker_node()) {
            (Backend::Local(b), Some(n)) => b.revive_broker_node(n).await,
            (b, _) => Err(BackendError::Unsupported { backend: b.kind().name(), fault: "upgrade", target, why: "no cluster here" }),
        }
    }

    /// Start a killed target again on its old data and wait until it serves.
    pub async fn restart(&mut self, target: Target) -> Result<(), BackendError> {
        match self {
            Backend::Local(b) => b.restart(target).await,
            Backend::External(_) => Err(external::unsupported("restart", target)),
            Backend::Containers(b) => b.restart(target).await,
        }
    }

    /// Freeze (SIGSTOP / docker pause) or thaw the target; on a freeze, the evidence that
    /// it took effect (the kernel reports the server's process stopped, the container
    /// paused), None when nothing shows it did.
    pub async fn pause(&mut self, target: Target, paused: bool) -> Result<Option<String>, BackendError> {
        match self {
            Backend::Local(b) => b.pause(target, paused).await,
            Backend::External(_) => Err(external::unsupported(if paused { "pause" } else { "resume" }, target)),
            Backend::Containers(b) => b.pause(target, paused).await,
        }
    }

    /// Partition the target's server from the network (`cut`), or heal it: the containers
    /// backend's `docker network disconnect`/`connect`. The local servers listen on the
    /// host's loopback, with no network to take them off, and external's are shared: the
    /// `partition` fault holds the replicas' links in the fault proxy there instead
    /// (`runner::faults::partition`).
    pub async fn partition(&mut self, target: Target, cut: bool) -> Result<Option<String>, BackendError> {
        match self {
            Backend::Containers(b) => b.partition(target, cut).await,
            Backend::Local(_) | Backend::External(_) => Err(BackendError::Unsupported {
                backend: self.kind().name(),
                fault: "partition",
                target,
                why: "no network to take its servers off (local: the host's loopback; external: shared); the fault proxy holds the links instead",
            }),
        }
    }

    /// One least-privilege broker account per service (ADR-022 #1202, permissions from
    /// `craig_fleet::access`), in `craig_fleet::service::ALL` order: each one's AMQP URL.
    /// The admin URL of [`endpoints`](Self::endpoints) stays the operator's.
    pub async fn service_accounts(&mut self) -> Result<Vec<(String, String)>, BackendError> {
        let accounts = fleet_accounts();
        let urls = match self {
            Backend::Local(b) => b.accounts(&accounts).await?,
            Backend::External(b) => b.accounts(&accounts).await?,
            Backend::Containers(b) => b.accounts(&accounts).await?,
        };
        Ok(craig_fleet::service::ALL.iter().map(|s| s.name().to_owned()).zip(urls).collect())
    }

    /// Set a RabbitMQ queue policy (`definition`: the policy JSON) on the run's broker.
    pub async fn set_policy(&mut self, name: &str, pattern: &str, definition: &serde_json::Value) -> Result<(), BackendError> {
        match self {
            Backend::Local(b) => b.set_policy(name, pattern, definition).await,
            Backend::External(b) => b.set_policy(name, pattern, definition).await,
            Backend::Containers(b) => b.set_policy(name, pattern, definition).await,
        }
    }

    /// Deliveries of `queues` handed to consumers and not yet acked; None where this
    /// backend cannot count them.
    pub async fn unacked(&self, queues: &[String]) -> Result<Option<u64>, BackendError> {
        match self {
            Backend::Local(b) => b.unacked(queues).await.map(Some),
            Backend::External(b) => b.unacked(queues).await.map(Some),
            Backend::Containers(b) => b.unacked(queues).await.map(Some),
        }
    }

    /// The Toxiproxy API the run's links go through when the backend runs one (the
    /// containers backend's Toxiproxy container); None: the harness serves its own.
    pub fn toxiproxy_api(&self) -> Option<String> {
        match self {
            Backend::Containers(b) => Some(b.toxiproxy_api()),
            _ => None,
        }
    }

    /// Where the next replica link's proxy listens, and where a replica reaches it: in the
    /// Toxiproxy container, a published slot; None: on loopback, any free port (the
    /// harness's own proxy).
    pub fn proxy_listen(&mut self) -> Result<Option<(String, String)>, BackendError> {
        match self {
            Backend::Containers(b) => b.proxy_listen().map(Some),
            _ => Ok(None),
        }
    }

    pub async fn clear_policy(&mut self, name: &str) -> Result<(), BackendError> {
        match self {
            Backend::Local(b) => b.clear_policy(name).await,
            Backend::External(b) => b.clear_policy(name).await,
            Backend::Containers(b) => b.clear_policy(name).await,
        }
    }

    /// Tear everything down (databases, vhosts, processes, temp dirs, containers).
    pub async fn stop(self) -> Result<(), BackendError> {
        match self {
            Backend::Local(b) => b.stop().await,
            Backend::External(b) => b.stop().await,
            Backend::Containers(b) => b.stop().await,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn auto_prefers_local_then_containers_then_external() {
        let ok = || Ok(());
        let no = |w: &str| Err(w.to_owned());
        assert_eq!(choose(BackendKind::Auto, ok(), ok()).unwrap().kind, BackendKind::Local);
        let c = choose(BackendKind::Auto, no("no initdb"), ok()).unwrap();
        assert_eq!(c.kind, BackendKind::Containers);
        assert!(c.reason.contains("no initdb"));
        let e = choose(BackendKind::Auto, no("no initdb"), no("no docker")).unwrap();
        assert_eq!(e.kind, BackendKind::External);
        assert!(e.reason.contains("no initdb") && e.reason.contains("no docker"), "{}", e.reason);
    }

    #[test]
    fn an_explicit_choice_that_cannot_start_says_why() {
        let err = choose(BackendKind::Containers, Ok(()), Err("no Docker engine at /var/run/docker.sock".into())).unwrap_err();
        assert_eq!(err.to_string(), "backend containers is not available here: no Docker engine at /var/run/docker.sock");
        assert_eq!("bogus".parse::<BackendKind>().unwrap_err().to_string(), "unknown backend \"bogus\"; expected auto, local, external or containers");
    }
}
