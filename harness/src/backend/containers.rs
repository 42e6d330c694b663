//! `containers`: PostgreSQL and RabbitMQ from testcontainers' modules, and a Toxiproxy
//! image as a generic image, on one Docker network. Runs only where a Docker engine answers.
//!
//! Images are settings (issue 24): `CHAOS_POSTGRES_IMAGE`, `CHAOS_RABBITMQ_IMAGE`,
//! `CHAOS_TOXIPROXY_IMAGE` (`name[:tag]`), the official images by default. Where no registry
//! answers, `ci/images/build` builds stand-ins that honour the interface used here (ports,
//! trust auth, the readiness lines, the management API) and prints these settings.
//!
//! A run's replicas are processes on the host; each of their links goes through the
//! Toxiproxy container (a published slot per link, [`HostPorts`]) to the servers by their
//! container names. Accounts, policies and the unacked count go through RabbitMQ's
//! management API. Every host port is fixed for the run, so a restarted container keeps
//! them.
//!
//! Faults: kill = `docker kill` (SIGKILL, no shutdown), restart = `docker start` on the same
//! container (data kept) and a wait until its server serves, pause = `docker pause`; each
//! with the engine's own word as evidence (`docker inspect`). Every container carries the
//! run's labels ([`RUN_LABEL`], [`HOST_LABEL`], [`PID_LABEL`]); those of a run of this
//! machine whose process is gone are removed before a run starts ([`reap_leftovers`]).
//!
//! A database standby (issue 26, [`ContainersBackend::add_standby`]) is a second container
//! of the database image, streaming from the primary through the link `standby->database`
//! in the Toxiproxy container; the run's database address is then a proxy there too
//! ([`DATABASE_ADDRESS_PROXY`]), whose upstream a failover moves to the promoted standby.

use std::time::Duration;

use testcontainers::core::{IntoContainerPort, WaitFor};
use testcontainers::runners::AsyncRunner;
use testcontainers::{ContainerAsync, ContainerRequest, GenericImage, ImageExt};
use testcontainers_modules::postgres::Postgres;
use testcontainers_modules::rabbitmq::RabbitMq;

use super::{BackendError, Endpoints, Target};

pub const POSTGRES_TAG: &str = "15-alpine";
pub const RABBITMQ_TAG: &str = "3.10-management-alpine";
pub const TOXIPROXY_IMAGE: &str = "ghcr.io/shopify/toxiproxy";
pub const TOXIPROXY_TAG: &str = "2.12.0";
pub const TOXIPROXY_API_PORT: u16 = 8474;
/// Container names on the run's network (Toxiproxy's upstreams).
pub const POSTGRES_HOST: &str = "craig-postgres";
pub const RABBITMQ_HOST: &str = "craig-rabbitmq";
/// Issue 26: the proxy in the Toxiproxy container that is the run's database address once
/// a standby runs (the virtual IP or DNS name an operator's failover moves): every client
/// reaches the primary of the moment through it, the harness on a published slot, each
/// replica's own link by the Toxiproxy container's name.
pub const DATABASE_ADDRESS_PROXY: &str = "database-address";
/// Issue 26: where the standby's replication connection goes inside the Toxiproxy container
/// (the link `standby->database`, made by the harness). Not published: only the standby, on
/// the run's network, connects to it.
pub const REPLICATION_PORT: u16 = 21_000;

/// One image: repository name and tag.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ImageRef {
    pub name: String,
    pub tag: String,
}

impl ImageRef {
    /// `name[:tag]` (no tag: `latest`). The name is `/`-separated lowercase components
    /// (`a-z0-9`, `.`, `_`, `-`), the first of which may be a registry `host[:port]`; the
    /// tag is 1..=128 of `A-Za-z0-9_.-`, not starting with `.` or `-`. No digest.
    pub fn parse(s: &str) -> Result<Self, String> {
        let s = s.trim();
        let refuse = |why: &str| Err(format!("{s:?} is not an image reference (name[:tag], no digest): {why}"));
        if s.contains('@') {
            return refuse("a digest is not supported");
        }
        // The tag follows the last ':' after the last '/' (a ':' before it is a registry port).
        let last_part = s.rsplit('/').next().unwrap_or(s);
        let (name, tag) = match last_part.rsplit_once(':') {
            Some((_, tag)) => (&s[..s.len() - tag.len() - 1], tag),
            None => (s, "latest"),
        };
        let tag_ok = !tag.is_empty()
            && tag.len() <= 128
            && tag.chars().all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '.' | '-'))
            && !tag.starts_with(['.', '-']);
        if !tag_ok {
            return refuse(&format!("tag {tag:?}"));
        }
        let mut parts: Vec<&str> = name.split('/').collect();
        // A registry host[:port] first, where there is more than one component.
        if parts.len() > 1 && (parts[0].contains([':', '.']) || parts[0] == "localhost") {
            let (host, port) = parts[0].split_once(':').map_or((parts[0], None), |(h, p)| (h, Some(p)));
            let host_ok = !host.is_empty() && host.chars().all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '-'));
            if !host_ok || port.is_some_and(|p| p.parse::<u16>().is_err()) {
                return refuse(&format!("registry {:?}", parts[0]));
            }
            parts.remove(0);
        }
        let component_ok = |c: &str| {
            !c.is_empty()
                && c.chars().all(|ch| ch.is_ascii_lowercase() || ch.is_ascii_digit() || matches!(ch, '.' | '_' | '-'))
                && c.starts_with(|ch: char| ch.is_ascii_alphanumeric())
                && c.ends_with(|ch: char| ch.is_ascii_alphanumeric())
        };
        if let Some(bad) = parts.iter().find(|c| !component_ok(c)) {
            return refuse(&format!("name component {bad:?}"));
        }
        Ok(Self { name: name.to_owned(), tag: tag.to_owned() })
    }
}

/// The run's images: the official ones, or what `CHAOS_*_IMAGE` names.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Images {
    pub postgres: ImageRef,
    pub rabbitmq: ImageRef,
    pub toxiproxy: ImageRef,
}

impl Default for Images {
    fn default() -> Self {
        let official = |name: &str, tag: &str| ImageRef { name: name.to_owned(), tag: tag.to_owned() };
        Self { postgres: official("postgres", POSTGRES_TAG), rabbitmq: official("rabbitmq", RABBITMQ_TAG), toxiproxy: official(TOXIPROXY_IMAGE, TOXIPROXY_TAG) }
    }
}

impl Images {
    /// From `CHAOS_POSTGRES_IMAGE`, `CHAOS_RABBITMQ_IMAGE`, `CHAOS_TOXIPROXY_IMAGE` (unset or
    /// empty: the official image); a value that is no image reference names the variable.
    pub fn from_env() -> Result<Self, BackendError> {
        Self::from_lookup(|k| std::env::var(k).ok())
    }

    pub fn from_lookup(get: impl Fn(&str) -> Option<String>) -> Result<Self, BackendError> {
        let mut images = Self::default();
        for (var, slot) in [
            ("CHAOS_POSTGRES_IMAGE", &mut images.postgres),
            ("CHAOS_RABBITMQ_IMAGE", &mut images.rabbitmq),
            ("CHAOS_TOXIPROXY_IMAGE", &mut images.toxiproxy),
        ] {
            if let Some(v) = get(var).filter(|v| !v.trim().is_empty()) {
                *slot = ImageRef::parse(&v).map_err(|why| BackendError::Setting { var, why })?;
            }
        }
        Ok(images)
    }
}

/// The engine this backend uses: `DOCKER_HOST`, else the default socket.
fn docker_host() -> String {
    std::env::var("DOCKER_HOST").unwrap_or_else(|_| "unix:///var/run/docker.sock".into())
}

/// Whether a Docker engine answers (`DOCKER_HOST` or `/var/run/docker.sock`), and the
/// `docker` CLI reaches it (the server faults and the reaper use it).
pub async fn probe() -> Result<(), String> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let host = docker_host();
    let reply = async {
        let mut buf = Vec::new();
        if let Some(path) = host.strip_prefix("unix://") {
            let mut s = tokio::net::UnixStream::connect(path).await?;
            s.write_all(b"GET /_ping HTTP/1.0\r\n\r\n").await?;
            s.read_to_end(&mut buf).await?;
        } else if let Some(addr) = host.strip_prefix("tcp://") {
            let mut s = tokio::net::TcpStream::connect(addr).await?;
            s.write_all(b"GET /_ping HTTP/1.0\r\n\r\n").await?;
            s.read_to_end(&mut buf).await?;
        } else {
            return Err(std::io::Error::other(format!("unsupported DOCKER_HOST {host}")));
        }
        Ok::<_, std::io::Error>(buf)
    };
    match tokio::time::timeout(Duration::from_secs(3), reply).await {
        Ok(Ok(buf)) if String::from_utf8_lossy(&buf).contains("OK") => {
            docker(&["version", "--format", "{{.Server.Version}}"]).await.map(drop).map_err(|e| format!("the engine at {host} answers, but the docker CLI does not reach it: {e}"))
        }
        Ok(Ok(_)) => Err(format!("the Docker engine at {host} did not answer /_ping with OK")),
        Ok(Err(e)) => Err(format!("no Docker engine at {host} ({e}); install and start Docker to use this backend")),
        Err(_) => Err(format!("the Docker engine at {host} did not answer within 3 s")),
    }
}

/// Host ports the run's containers publish, fixed for the run (outside the kernel's
/// ephemeral range, as the local backend's servers): a restarted container comes back on
/// the same ones, so the links and URLs made at start stay good.
#[derive(Debug, Clone)]
pub struct HostPorts {
    pub postgres: u16,
    pub amqp: u16,
    pub management: u16,
    pub toxiproxy_api: u16,
    /// (port inside the Toxiproxy container, host port): one per replica link.
    pub proxies: Vec<(u16, u16)>,
}

/// Links the Toxiproxy container can serve (two per replica, so twelve replicas): a larger
/// fleet (a scenario may ask for up to 8 replicas of each of 4 services) is refused before
/// anything starts (`runner::execute`).
pub const PROXY_SLOTS: u16 = 24;
/// The first port inside the Toxiproxy container a link listens on.
pub const PROXY_BASE_PORT: u16 = 20_000;

impl HostPorts {
    /// Picks the run's ports, each leased ([`super::local::PortLease`]) so no other run on
    /// the machine picks one while a killed container has let it go: hold the leases for
    /// the run.
    pub fn pick() -> Result<(Self, Vec<super::local::PortLease>), BackendError> {
        let mut leases = Vec::new();
        let mut free = || {
            let lease = super::local::lease_port_for_containers()?;
            let port = lease.port();
            leases.push(lease);
            Ok::<_, BackendError>(port)
        };
        let proxies = (0..PROXY_SLOTS).map(|i| Ok((PROXY_BASE_PORT + i, free()?))).collect::<Result<Vec<_>, BackendError>>()?;
        let ports = Self { postgres: free()?, amqp: free()?, management: free()?, toxiproxy_api: free()?, proxies };
        Ok((ports, leases))
    }
}

/// The labels every container of a run carries: the run's network, and the machine and PID
/// namespace (its boot id and namespace, [`host_id`]) and process that started it.
/// [`reap_leftovers`] removes only those of this machine and namespace whose process is
/// gone: an engine shared with other machines or PID namespaces (a remote `DOCKER_HOST`,
/// CI jobs in containers on one socket) keeps theirs.
pub const RUN_LABEL: &str = "craig-chaos.run";
pub const HOST_LABEL: &str = "craig-chaos.host";
pub const PID_LABEL: &str = "craig-chaos.pid";

/// This machine's boot id (`/proc/sys/kernel/random/boot_id`) and this process's PID
/// namespace (`/proc/self/ns/pid`): pids mean something only within both (CI jobs in
/// containers on one host share the boot id, not the namespace). None where either is
/// missing, and then nothing is ever reaped.
fn host_id() -> Option<String> {
    let boot = std::fs::read_to_string("/proc/sys/kernel/random/boot_id").ok().map(|s| s.trim().to_owned()).filter(|s| !s.is_empty())?;
    let ns = std::fs::read_link("/proc/self/ns/pid").ok()?;
    Some(format!("{boot}/{}", ns.display()))
}

/// A run's labels on a container request.
fn labelled<I: testcontainers::Image>(r: ContainerRequest<I>, network: &str) -> ContainerRequest<I> {
    r.with_label(RUN_LABEL, network)
        .with_label(HOST_LABEL, host_id().unwrap_or_else(|| "unknown".into()))
        .with_label(PID_LABEL, std::process::id().to_string())
}

/// The same labels as `KEY=VALUE`, for the docker CLI (the run's network).
fn labels(network: &str) -> [String; 3] {
    [
        format!("{RUN_LABEL}={network}"),
        format!("{HOST_LABEL}={}", host_id().unwrap_or_else(|| "unknown".into())),
        format!("{PID_LABEL}={}", std::process::id()),
    ]
}

pub fn postgres_request(network: &str, image: &ImageRef, ports: &HostPorts) -> ContainerRequest<Postgres> {
    let r = Postgres::default()
        .with_host_auth()
        .with_name(image.name.clone())
        .with_tag(image.tag.clone())
        .with_network(network)
        .with_container_name(format!("{POSTGRES_HOST}-{network}"))
        .with_mapped_port(ports.postgres, 5432.tcp())
        .with_startup_timeout(Duration::from_secs(60));
    labelled(r, network)
}

pub fn rabbitmq_request(network: &str, image: &ImageRef, ports: &HostPorts) -> ContainerRequest<RabbitMq> {
    let r = RabbitMq::default()
        .with_name(image.name.clone())
        .with_tag(image.tag.clone())
        .with_network(network)
        .with_container_name(format!("{RABBITMQ_HOST}-{network}"))
        .with_mapped_port(ports.amqp, 5672.tcp())
        .with_mapped_port(ports.management, 15672.tcp())
        // The management API's counts are samples, every 5 s by default: the drain's unacked
        // count must be fresher than its 1 s quiet window.
        .with_env_var("RABBITMQ_SERVER_ADDITIONAL_ERL_ARGS", format!("-rabbit collect_statistics_interval {STATS_INTERVAL_MS}"))
        .with_startup_timeout(Duration::from_secs(90));
    labelled(r, network)
}

/// How often the RabbitMQ container's management API samples its counts (ms).
pub const STATS_INTERVAL_MS: u64 = 250;

/// The official Toxiproxy image, or `craig-chaos/toxiproxy-api` (`chaos proxy --api
/// 0.0.0.0:8474` as its entrypoint): the same API, ports and readiness line. Every link
/// slot is published to its fixed host port.
pub fn toxiproxy_request(network: &str, image: &ImageRef, ports: &HostPorts) -> ContainerRequest<GenericImage> {
    let mut r = GenericImage::new(image.name.clone(), image.tag.clone())
        .with_exposed_port(TOXIPROXY_API_PORT.tcp())
        .with_wait_for(WaitFor::message_on_either_std("Starting Toxiproxy HTTP server"))
        .with_network(network)
        .with_container_name(format!("craig-toxiproxy-{network}"))
        .with_mapped_port(ports.toxiproxy_api, TOXIPROXY_API_PORT.tcp())
        .with_startup_timeout(Duration::from_secs(60));
    for (inside, host) in &ports.proxies {
        r = r.with_mapped_port(*host, inside.tcp());
    }
    labelled(r, network)
}

/// Issue 26: the standby's container, of the database image, run as `postgres` with a shell
/// as its entrypoint: on first boot it takes a base backup of the primary (`pg_basebackup`
/// with a replication slot, straight from the primary's container) and points its
/// replication connection at the link in the Toxiproxy container ([`REPLICATION_PORT`]);
/// then it runs the server as a hot standby (a restart keeps its data and takes no backup).
/// Ready once the server takes read-only connections.
pub fn standby_request(network: &str, image: &ImageRef, host_port: u16) -> ContainerRequest<GenericImage> {
    let name = super::local::STANDBY_NAME;
    let script = format!(
        r#"set -e
if [ ! -s "$PGDATA/PG_VERSION" ]; then
  chmod 700 "$PGDATA"
  pg_basebackup -h {POSTGRES_HOST}-{network} -p 5432 -U postgres -D "$PGDATA" -X stream -C -S {name} -R --checkpoint=fast
  printf '%s
' "primary_conninfo = 'host=craig-toxiproxy-{network} port={REPLICATION_PORT} user=postgres application_name={name}'" "primary_slot_name = '{name}'" >> "$PGDATA/postgresql.auto.conf"
fi
exec postgres -D "$PGDATA" -c listen_addresses='*' -c fsync=off -c wal_retrieve_retry_interval=100ms"#
    );
    let r = GenericImage::new(image.name.clone(), image.tag.clone())
        .with_entrypoint("sh")
        .with_exposed_port(5432.tcp())
        .with_wait_for(WaitFor::message_on_stderr("database system is ready to accept read-only connections"))
        .with_network(network)
        .with_container_name(format!("{POSTGRES_HOST}-standby-{network}"))
        .with_user("postgres")
        .with_mapped_port(host_port, 5432.tcp())
        .with_cmd(["-c".to_owned(), script])
        .with_startup_timeout(Duration::from_secs(50));
    labelled(r, network)
}

/// Containers and networks of runs of THIS machine whose process is gone (a SIGKILLed
/// `chaos run` leaves them), removed before a run starts, through the docker CLI; best
/// effort, each step bounded.
pub async fn reap_leftovers() {
    let Some(host) = host_id() else { return };
    let format = format!("{{{{.ID}}}} {{{{.Label \"{HOST_LABEL}\"}}}} {{{{.Label \"{PID_LABEL}\"}}}} {{{{.Label \"{RUN_LABEL}\"}}}}");
    let listed = docker(&["ps", "-a", "--filter", &format!("label={RUN_LABEL}"), "--format", &format]).await.unwrap_or_default();
    let mut dead_networks = std::collections::BTreeSet::new();
    for line in listed.lines() {
        let mut f = line.split(' ');
        let (Some(id), Some(on), Some(pid), Some(network)) = (f.next(), f.next(), f.next(), f.next()) else { continue };
        if on == host && pid.parse::<i32>().is_ok_and(process_gone) {
            let _ = docker(&["rm", "-f", "-v", id]).await;
            dead_networks.insert(network.to_owned());
        }
    }
    // Networks too, found by their own labels: a run killed before any container existed
    // left only its network.
    let format = format!("{{{{.Name}}}} {{{{.Label \"{HOST_LABEL}\"}}}} {{{{.Label \"{PID_LABEL}\"}}}}");
    let listed = docker(&["network", "ls", "--filter", &format!("label={RUN_LABEL}"), "--format", &format]).await.unwrap_or_default();
    for line in listed.lines() {
        let mut f = line.split(' ');
        let (Some(name), Some(on), Some(pid)) = (f.next(), f.next(), f.next()) else { continue };
        if on == host && pid.parse::<i32>().is_ok_and(process_gone) {
            dead_networks.insert(name.to_owned());
        }
    }
    for network in dead_networks {
        let _ = docker(&["network", "rm", &network]).await;
        tracing::info!(event = "chaos.containers_reaped", network = %network, "removed the containers of a run whose process is gone");
    }
}

/// Whether process `pid` of this machine is gone (never this process).
fn process_gone(pid: i32) -> bool {
    pid as u32 != std::process::id() && !std::path::Path::new(&format!("/proc/{pid}")).exists()
}

/// How often [`ContainersBackend::pause`] asks for a freeze the runtime gave up on.
const FREEZE_TRIES: u32 = 5;

/// `docker ARGS` through the CLI, bounded (30 s); its stdout, or why it failed.
async fn docker(args: &[&str]) -> Result<String, String> {
    let o = docker_output(args).await?;
    if o.status.success() {
        Ok(String::from_utf8_lossy(&o.stdout).into_owned())
    } else {
        Err(format!("docker {}: {}", args.join(" "), String::from_utf8_lossy(&o.stderr).trim()))
    }
}

/// The last lines a container wrote (both streams), for an error that needs them.
async fn logs_tail(id: &str, lines: u16) -> String {
    docker_output(&["logs", "--tail", &lines.to_string(), id])
        .await
        .map_or_else(|_| "(docker logs gave nothing)".to_owned(), |o| format!("{}{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr)))
}

/// `docker ARGS`, bounded (30 s), whatever its exit: both its streams.
async fn docker_output(args: &[&str]) -> Result<std::process::Output, String> {
    // The engine the probe asked (a CLI context could name another).
    let run = tokio::process::Command::new("docker").args(args).env("DOCKER_HOST", docker_host()).kill_on_drop(true).output();
    match tokio::time::timeout(Duration::from_secs(30), run).await {
        Ok(Ok(o)) => Ok(o),
        Ok(Err(e)) => Err(format!("docker CLI not runnable: {e}")),
        Err(_) => Err(format!("docker {}: no answer within 30 s", args.join(" "))),
    }
}

pub struct ContainersBackend {
    network: String,
    postgres: ContainerAsync<Postgres>,
    rabbitmq: ContainerAsync<RabbitMq>,
    toxiproxy: ContainerAsync<GenericImage>,
    services: Vec<String>,
    ports: HostPorts,
    /// Link slots handed out ([`ContainersBackend::proxy_listen`]).
    links: usize,
    /// The database's streaming standby and the run's database address (issue 26). Before
    /// the leases, so a backend dropped without `stop` removes it before its port is free.
    standby: Option<Standby>,
    _leases: Vec<super::local::PortLease>,
    /// The database image (a standby runs it too).
    postgres_image: ImageRef,
    /// Last, so it drops after the containers: a backend dropped without
    /// [`ContainersBackend::stop`] (a run that failed half way) still removes its network.
    network_guard: NetworkGuard,
}

/// The database's standby container and the run's database address (issue 26).
struct Standby {
    container: ContainerAsync<GenericImage>,
    /// The host port its 5432 is published on.
    host_port: u16,
    /// The database address ([`DATABASE_ADDRESS_PROXY`]): where replicas' links reach it
    /// (`craig-toxiproxy-<network>:<port>`), and its published host port.
    address: String,
    address_host_port: u16,
    sync: bool,
    promoted: bool,
}

/// Removes the run's network when dropped, unless [`ContainersBackend::stop`] did.
struct NetworkGuard(Option<String>);

impl Drop for NetworkGuard {
    fn drop(&mut self) {
        let Some(network) = self.0.take() else { return };
        let Ok(mut child) = std::process::Command::new("docker")
            .args(["network", "rm", &network])
            .env("DOCKER_HOST", docker_host())
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
        else {
            return;
        };
        // Bounded: an engine that hangs leaves it to the next start's reaper.
        for _ in 0..100 {
            if !matches!(child.try_wait(), Ok(None)) {
                return;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        let _ = child.kill();
        let _ = child.wait();
    }
}

fn tc(what: &str) -> impl Fn(testcontainers::TestcontainersError) -> BackendError + '_ {
    move |e| BackendError::failed(what.to_owned(), e)
}

impl ContainersBackend {
    pub async fn start(services: &[&str]) -> Result<Self, BackendError> {
        let images = Images::from_env()?;
        reap_leftovers().await;
        // The pid and a random part: unique on this machine and on an engine it shares.
        let network = format!("craig-chaos-{}-{}", std::process::id(), &uuid::Uuid::now_v7().simple().to_string()[24..]);
        let (ports, leases) = HostPorts::pick()?;
        // The network is ours, labelled as the containers are, so the reaper finds it even
        // when no container of the run was created (testcontainers would make it unlabelled).
        let labels = labels(&network);
        let mut create = vec!["network", "create"];
        for l in &labels {
            create.extend(["--label", l.as_str()]);
        }
        create.push(&network);
        docker(&create).await.map_err(|e| BackendError::failed("creating the run's network", e))?;
        let started = async {
            let postgres = postgres_request(&network, &images.postgres, &ports).start().await.map_err(tc("starting the postgres container"))?;
            let rabbitmq = rabbitmq_request(&network, &images.rabbitmq, &ports).start().await.map_err(tc("starting the rabbitmq container"))?;
            let toxiproxy =
                toxiproxy_request(&network, &images.toxiproxy, &ports).start().await.map_err(tc("starting the toxiproxy container"))?;
            Ok::<_, BackendError>((postgres, rabbitmq, toxiproxy))
        }
        .await;
        let (postgres, rabbitmq, toxiproxy) = match started {
            Ok(c) => c,
            Err(e) => {
                // What started was removed when it dropped; the network goes with it.
                let _ = docker(&["network", "rm", &network]).await;
                return Err(e);
            }
        };
        let network_guard = NetworkGuard(Some(network.clone()));
        let b = Self {
            network,
            postgres,
            rabbitmq,
            toxiproxy,
            services: services.iter().map(|s| s.to_string()).collect(),
            ports,
            links: 0,
            _leases: leases,
            postgres_image: images.postgres.clone(),
            standby: None,
            network_guard,
        };
        super::create_databases(b.ports.postgres, &b.services).await?;
        Ok(b)
    }

    pub fn endpoints(&self) -> Endpoints {
        // Toxiproxy reaches the servers by container name on the run's network.
        let mq = format!("{RABBITMQ_HOST}-{}:5672", self.network);
        match &self.standby {
            // Issue 26: every client reaches the database by its address, which a failover moves.
            Some(sb) => Endpoints::loopback(&self.services, sb.address_host_port, self.ports.amqp, sb.address.clone(), mq),
            None => Endpoints::loopback(&self.services, self.ports.postgres, self.ports.amqp, format!("{POSTGRES_HOST}-{}:5432", self.network), mq),
        }
    }

    /// The next link slot: where a proxy listens inside the Toxiproxy container, and where
    /// a replica on the host reaches it.
    pub fn proxy_listen(&mut self) -> Result<(String, String), BackendError> {
        let (inside, host) = self.next_slot()?;
        Ok((format!("0.0.0.0:{inside}"), format!("127.0.0.1:{host}")))
    }

    /// The next link slot: (port inside the Toxiproxy container, host port).
    fn next_slot(&mut self) -> Result<(u16, u16), BackendError> {
        let slot = *self.ports.proxies.get(self.links).ok_or_else(|| {
            BackendError::failed("wiring a replica's link", format!("the Toxiproxy container has {PROXY_SLOTS} link slots, all taken"))
        })?;
        self.links += 1;
        Ok(slot)
    }

    /// Issue 26: a streaming standby of the database, in a second container of the database
    /// image ([`standby_request`]), and the run's database address from now on
    /// ([`DATABASE_ADDRESS_PROXY`], a proxy in the Toxiproxy container on a published slot,
    /// leading to the primary). The primary first lets replication connections in (a
    /// `pg_hba.conf` line, reloaded). The standby streams once the harness has made its
    /// replication link ([`ContainersBackend::replication_link`],
    /// [`ContainersBackend::start_replication`]). Before any client connects.
    pub async fn add_standby(&mut self, sync: bool) -> Result<(), BackendError> {
        if self.standby.is_some() {
            return Ok(());
        }
        let primary = self.postgres.id().to_owned();
        docker(&["exec", &primary, "sh", "-c", r#"echo "host replication all all trust" >> "$PGDATA/pg_hba.conf""#])
            .await
            .map_err(|e| BackendError::failed("letting the standby replicate (pg_hba.conf of the primary)", e))?;
        let mut c = super::local::admin_conn(self.ports.postgres).await?;
        sqlx::query("SELECT pg_reload_conf()").execute(&mut c).await.map_err(|e| BackendError::failed("reloading the primary's pg_hba.conf", e))?;
        let _ = sqlx::Connection::close(c).await;
        let lease = super::local::lease_port_for_containers()?;
        let host_port = lease.port();
        self._leases.push(lease);
        let container =
            standby_request(&self.network, &self.postgres_image, host_port).start().await.map_err(tc("starting the standby's container"))?;
        let (inside, address_host_port) = self.next_slot()?;
        let toxi = crate::proxy::ToxiproxyClient::new(self.toxiproxy_api());
        toxi.create_proxy(DATABASE_ADDRESS_PROXY, &format!("0.0.0.0:{inside}"), &format!("{POSTGRES_HOST}-{}:5432", self.network))
            .await
            .map_err(|e| BackendError::failed("creating the database address (a proxy in the Toxiproxy container)", e))?;
        let address = format!("craig-toxiproxy-{}:{inside}", self.network);
        self.standby = Some(Standby { container, host_port, address, address_host_port, sync, promoted: false });
        Ok(())
    }

    /// The standby's replication link (issue 26): `(listen, upstream)` in the Toxiproxy
    /// container, where the link `standby->database` must listen and what it forwards to
    /// (the primary's container).
    pub fn replication_link(&self) -> Option<(String, String)> {
        self.standby.as_ref().filter(|s| !s.promoted).map(|_| (format!("0.0.0.0:{REPLICATION_PORT}"), format!("{POSTGRES_HOST}-{}:5432", self.network)))
    }

    /// Issue 26: once the replication link exists, the standby streaming in its mode, caught
    /// up, as the primary reports it ([`super::local::await_streaming`]).
    pub async fn start_replication(&self) -> Result<String, BackendError> {
        let sb = self.standby.as_ref().ok_or_else(|| BackendError::failed("starting replication", "the database has no standby"))?;
        let id = sb.container.id().to_owned();
        super::local::await_streaming(self.ports.postgres, sb.sync, async || logs_tail(&id, 15).await).await
    }

    /// Issue 26: a watch on how far behind the primary reports its standby, while one
    /// streams (None: none, or promoted).
    pub fn replication_watch(&self) -> Option<super::local::ReplicationWatch> {
        self.standby.as_ref().filter(|s| !s.promoted).map(|_| super::local::ReplicationWatch::on(self.ports.postgres))
    }

    /// Issue 26, a failover as an operator's tooling does it: the primary's container
    /// killed (`docker kill`), the standby promoted ([`super::local::promote`]), and the
    /// database address moved to it (the proxy's upstream, Toxiproxy's `POST /proxies`).
    /// The evidence is the engine's word that the primary's container is not running, and
    /// the promoted server's own (its timeline moved on, out of recovery). Once.
    pub async fn failover(&mut self) -> Result<super::local::Failover, BackendError> {
        let Some((port, sync)) = self.standby.as_ref().filter(|s| !s.promoted).map(|s| (s.host_port, s.sync)) else {
            return Err(BackendError::failed("failing over", "the database has no standby (left)"));
        };
        let primary = self.id(Target::Database).to_owned();
        let began = std::time::Instant::now();
        let killed = self.kill(Target::Database).await?.ok_or_else(|| BackendError::failed("failing over", "the engine does not say the primary's container stopped"))?;
        let dead_after = began.elapsed();
        // `docker kill` returns once the engine has cleaned up after the container (0.4 to
        // 1.2 s here); the engine's record of its exit is when writes stopped committing. With
        // no such record the failover fails: the kill's return would put the death up to a
        // second late, and every write sent in between would be the failover's to forget.
        let after_kill = |e: BackendError| BackendError::failed("failing over (the primary's container was killed)", e);
        let finished = docker(&["inspect", "-f", "{{.State.FinishedAt}}", &primary]).await.map_err(|e| after_kill(BackendError::failed("reading the primary's exit time", e)))?;
        let died_at_epoch_ms = chrono::DateTime::parse_from_rfc3339(finished.trim())
            .map_err(|e| after_kill(BackendError::failed(format!("reading the primary's exit time {:?}", finished.trim()), e)))?
            .timestamp_millis();
        let (timeline_before, timeline_after, replayed_until_db_ms) = super::local::promote(port).await.map_err(after_kill)?;
        let now_at = format!("{POSTGRES_HOST}-standby-{}:5432", self.network);
        let toxi = crate::proxy::ToxiproxyClient::new(self.toxiproxy_api());
        toxi.set_upstream(DATABASE_ADDRESS_PROXY, &now_at).await.map_err(|e| after_kill(BackendError::failed("moving the database address", e)))?;
        if let Some(sb) = self.standby.as_mut() {
            // The standby is the primary now: every later database fault is its.
            sb.promoted = true;
        }
        Ok(super::local::Failover { killed, dead_after, died_at_epoch_ms, timeline_before, timeline_after, replayed_until_db_ms, sync, now_at })
    }

    /// A call to the RabbitMQ container's management API, as the admin; a 404 is `None`.
    async fn management(&self, what: &str, method: reqwest::Method, path: &str, body: Option<&serde_json::Value>) -> Result<Option<reqwest::Response>, BackendError> {
        let client = reqwest::Client::builder().timeout(Duration::from_secs(10)).build().expect("reqwest client");
        let mut request = client.request(method, format!("http://127.0.0.1:{}/api{path}", self.ports.management)).basic_auth("guest", Some("guest"));
        if let Some(b) = body {
            request = request.json(b);
        }
        match request.send().await {
            Ok(r) if r.status() == reqwest::StatusCode::NOT_FOUND => Ok(None),
            Ok(r) if r.status().is_success() => Ok(Some(r)),
            Ok(r) => Err(BackendError::failed(what.to_owned(), format!("the management API answered HTTP {} to {path}", r.status()))),
            Err(e) => Err(BackendError::failed(what.to_owned(), e)),
        }
    }

    /// One account per service on the vhost `/` (ADR-022 #1202), in ONE definitions
    /// import through the management API, each checked to log in; their AMQP URLs.
    pub async fn accounts(&self, accounts: &[craig_sandbox::Account]) -> Result<Vec<String>, BackendError> {
        let what = "creating the service accounts";
        let admin = format!("amqp://guest:guest@127.0.0.1:{}/%2f", self.ports.amqp);
        let (defs, urls) = craig_sandbox::definitions(accounts, "/", &admin, |name| craig_sandbox::sandbox_name(&format!("{}/{name}", self.network)))
            .map_err(|e| BackendError::failed("service account URL", e))?;
        self.management(what, reqwest::Method::POST, "/definitions", Some(&defs)).await?.ok_or_else(|| BackendError::failed(what, "no /api/definitions"))?;
        craig_sandbox::wait_logins(&urls).await.map_err(|e| BackendError::failed(what, e))?;
        Ok(urls)
    }

    pub async fn set_policy(&self, name: &str, pattern: &str, definition: &serde_json::Value) -> Result<(), BackendError> {
        let what = "setting a queue policy";
        let body = serde_json::json!({"pattern": pattern, "definition": definition, "apply-to": "queues", "priority": 10});
        self.management(what, reqwest::Method::PUT, &format!("/policies/%2f/{name}"), Some(&body)).await?.ok_or_else(|| BackendError::failed(what, "HTTP 404"))?;
        Ok(())
    }

    /// Remove a policy (absent is fine).
    pub async fn clear_policy(&self, name: &str) -> Result<(), BackendError> {
        self.management("clearing a queue policy", reqwest::Method::DELETE, &format!("/policies/%2f/{name}"), None).await.map(drop)
    }

    /// Deliveries of `queues` handed to a consumer and not yet acked; a statistic not
    /// collected yet is unknown (an error), never 0.
    pub async fn unacked(&self, queues: &[String]) -> Result<u64, BackendError> {
        let what = "counting unacked deliveries";
        let Some(r) = self.management(what, reqwest::Method::GET, "/queues/%2f?columns=name,messages_unacknowledged", None).await? else {
            return Err(BackendError::failed(what, "HTTP 404"));
        };
        let rows: Vec<serde_json::Value> = r.json().await.map_err(|e| BackendError::failed(what, e))?;
        let mut total = 0;
        for q in rows.iter().filter(|q| queues.iter().any(|n| Some(n.as_str()) == q["name"].as_str())) {
            match q["messages_unacknowledged"].as_u64() {
                Some(n) => total += n,
                None => return Err(BackendError::failed(what, format!("queue {}: messages_unacknowledged not reported yet", q["name"]))),
            }
        }
        Ok(total)
    }

    /// The run's Docker network (`craig-chaos-<pid>-<random>`); every container's name ends
    /// with it.
    pub fn network(&self) -> &str {
        &self.network
    }

    /// The Toxiproxy API base URL on the host.
    pub fn toxiproxy_api(&self) -> String {
        format!("http://127.0.0.1:{}", self.ports.toxiproxy_api)
    }

    /// The container of `t`.
    fn id(&self, t: Target) -> &str {
        match t {
            Target::Database => match &self.standby {
                Some(sb) if sb.promoted => sb.container.id(),
                _ => self.postgres.id(),
            },
            // One broker container (a cluster is refused here before anything starts).
            Target::Broker | Target::BrokerNode(_) => self.rabbitmq.id(),
        }
    }

    /// `docker kill` (SIGKILL: no shutdown, as a crash) of the target's container; the
    /// evidence is the engine's own word that it is not running, with its exit code.
    pub async fn kill(&mut self, t: Target) -> Result<Option<String>, BackendError> {
        let id = self.id(t).to_owned();
        docker(&["kill", &id]).await.map_err(|e| BackendError::failed(format!("killing the {t} container"), e))?;
        let state = docker(&["inspect", "-f", "{{.State.Running}} {{.State.ExitCode}}", &id]).await.unwrap_or_default();
        Ok(match state.trim().split_once(' ') {
            Some(("false", code)) => Some(format!("container of the {t} killed (docker inspect: not running, exit {code})")),
            _ => None,
        })
    }

    /// `docker start` of the killed container (the same data and the same host ports),
    /// then wait until its server serves again, as the local backend does: a database out of
    /// crash recovery (60 s), a broker that takes a login (90 s).
    pub async fn restart(&mut self, t: Target) -> Result<(), BackendError> {
        let id = self.id(t).to_owned();
        docker(&["start", &id]).await.map_err(|e| BackendError::failed(format!("starting the {t} container"), e))?;
        let bound = Duration::from_secs(if t == Target::Database { 60 } else { 90 });
        let deadline = tokio::time::Instant::now() + bound;
        loop {
            // A container that exited again (its server refused its data, or crashed at boot)
            // will not serve: said at once, with its last log lines.
            if docker(&["inspect", "-f", "{{.State.Running}}", &id]).await.is_ok_and(|r| r.trim() == "false") {
                // Its server's output, both streams.
                let tail = logs_tail(&id, 20).await;
                return Err(BackendError::failed(format!("restarting the {t} container"), format!("it exited again; its log ends:\n{tail}")));
            }
            let serving = self.serving(t).await;
            if serving {
                return Ok(());
            }
            if tokio::time::Instant::now() > deadline {
                return Err(BackendError::failed(format!("restarting the {t} container"), format!("not serving within {bound:?}")));
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    /// `docker pause` / `unpause` (the cgroup freezer); on a pause, the evidence is the
    /// engine's own word that the container is paused.
    ///
    /// A freeze the runtime gave up on ("OCI runtime pause failed: unable to freeze", moby
    /// #48205: runc thaws the cgroup again when it does not settle, as with a server forking
    /// a backend for a new connection just then) is tried again, at most
    /// [`FREEZE_TRIES`] times 200 ms apart: the container is running, not paused, in
    /// between, so the pause starts that much later (seen once in CI, on the database
    /// under load). Any other error, or the last try's, fails the fault.
    pub async fn pause(&mut self, t: Target, paused: bool) -> Result<Option<String>, BackendError> {
        let id = self.id(t).to_owned();
        let op = if paused { "pause" } else { "unpause" };
        let mut tries = 0;
        loop {
            tries += 1;
            match docker(&[op, &id]).await {
                Ok(_) => break,
                Err(e) if paused && e.contains("unable to freeze") && tries < FREEZE_TRIES => {
                    tracing::warn!(event = "chaos.pause_retried", target = %t, tries, error = %e, "the runtime did not freeze the container; trying again");
                    tokio::time::sleep(Duration::from_millis(200)).await;
                }
                Err(e) => return Err(BackendError::failed(format!("{op} the {t} container"), e)),
            }
        }
        if !paused {
            return Ok(None);
        }
        let state = docker(&["inspect", "-f", "{{.State.Paused}}", &id]).await.unwrap_or_default();
        Ok((state.trim() == "true").then(|| format!("container of the {t} paused (docker inspect: paused)")))
    }

    /// Whether the target's server serves through its published port: a database that
    /// takes a connection, a broker that takes a login (3 s each).
    async fn serving(&self, t: Target) -> bool {
        match t {
            Target::Database => {
                use sqlx::Connection as _;
                let port = match &self.standby {
                    Some(sb) if sb.promoted => sb.host_port,
                    _ => self.ports.postgres,
                };
                let url = format!("postgres://postgres@127.0.0.1:{port}/postgres");
                match tokio::time::timeout(Duration::from_secs(3), sqlx::PgConnection::connect(&url)).await {
                    Ok(Ok(c)) => {
                        let _ = tokio::time::timeout(Duration::from_secs(2), c.close()).await;
                        true
                    }
                    _ => false,
                }
            }
            Target::Broker | Target::BrokerNode(_) => {
                let url = format!("amqp://guest:guest@127.0.0.1:{}/%2f", self.ports.amqp);
                match craig_mq::publisher::connect_within(&url, 0, "chaos-ready-check", Duration::from_secs(3)).await {
                    Ok(c) => {
                        let _ = tokio::time::timeout(Duration::from_secs(2), c.close(200, "ready".into())).await;
                        true
                    }
                    Err(_) => false,
                }
            }
        }
    }

    /// A network partition of the target's container (issue 24): `docker network
    /// disconnect` from the run's network, and `connect` again at the heal. The server keeps
    /// running; nothing reaches it and nothing it sends arrives (the Toxiproxy container's
    /// links and the published ports alike): open connections hang and are aborted, a new
    /// link fails at once (the container's name no longer resolves). The heal connects it
    /// again (perhaps at another address) and waits until it serves through its published
    /// port. The evidence is the engine's word that the container is off the run's network.
    pub async fn partition(&mut self, t: Target, cut: bool) -> Result<Option<String>, BackendError> {
        let id = self.id(t).to_owned();
        let op = if cut { "disconnect" } else { "connect" };
        docker(&["network", op, &self.network, &id]).await.map_err(|e| BackendError::failed(format!("network {op} of the {t} container"), e))?;
        let networks = docker(&["inspect", "-f", "{{range $k, $v := .NetworkSettings.Networks}}{{$k}} {{end}}", &id]).await.unwrap_or_default();
        let on = networks.split_whitespace().any(|n| n == self.network);
        if cut {
            return Ok((!on).then(|| format!("container of the {t} off the run's network (docker inspect: networks [{}])", networks.trim())));
        }
        if !on {
            return Err(BackendError::failed(format!("reconnecting the {t} container"), format!("docker inspect: networks [{}]", networks.trim())));
        }
        // Back on the network (perhaps at another address): healed once it serves again.
        let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
        while !self.serving(t).await {
            if tokio::time::Instant::now() > deadline {
                return Err(BackendError::failed(format!("reconnecting the {t} container"), "not serving within 30 s of docker network connect"));
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        Ok(None)
    }

    /// Remove the run's containers (and with the last of them its network: testcontainers
    /// removes a network it made once no container of it is left).
    pub async fn stop(mut self) -> Result<(), BackendError> {
        self.network_guard.0 = None;
        let a = self.toxiproxy.rm().await;
        let b = self.rabbitmq.rm().await;
        let c = self.postgres.rm().await;
        let d = match self.standby.take() {
            Some(sb) => sb.container.rm().await,
            None => Ok(()),
        };
        let removed = a.and(b).and(c).and(d).map_err(|e| BackendError::failed("removing containers", e));
        // The network is ours (created in start), so testcontainers leaves it.
        let net = docker(&["network", "rm", &self.network]).await.map(|_| ()).map_err(|e| BackendError::failed("removing the run's network", e));
        removed.and(net)
    }
}

#[cfg(test)]
mod tests {
    use testcontainers::Image;

    use super::*;

    fn ports() -> HostPorts {
        HostPorts { postgres: 11001, amqp: 11002, management: 11003, toxiproxy_api: 11004, proxies: vec![(20_000, 11010), (20_001, 11011)] }
    }

    /// (host, container) of every published port.
    fn published<I: Image>(r: &ContainerRequest<I>) -> Vec<(u16, u16)> {
        r.ports().map(|p| p.iter().map(|m| (m.host_port(), m.container_port().as_u16())).collect()).unwrap_or_default()
    }

    #[test]
    fn postgres_wiring() {
        let r = postgres_request("net1", &Images::default().postgres, &ports());
        assert_eq!(published(&r), [(11001, 5432)], "a fixed host port: a restart keeps it");
        assert_eq!(r.labels().get(RUN_LABEL).map(String::as_str), Some("net1"));
        assert_eq!(r.labels().get(PID_LABEL), Some(&std::process::id().to_string()));
        assert_eq!(r.labels().get(HOST_LABEL).cloned(), host_id().or(Some("unknown".into())));
        assert_eq!(r.image().name(), "postgres");
        assert_eq!(r.descriptor(), format!("postgres:{POSTGRES_TAG}"));
        assert_eq!(r.network().as_deref(), Some("net1"));
        assert_eq!(r.container_name().as_deref(), Some("craig-postgres-net1"));
        let env: Vec<_> = r.env_vars().map(|(k, v)| (k.into_owned(), v.into_owned())).collect();
        assert!(env.contains(&("POSTGRES_HOST_AUTH_METHOD".into(), "trust".into())), "{env:?}");
        assert!(format!("{:?}", r.ready_conditions()).contains("ready to accept connections"));
    }

    /// Issue 26: the standby is the database image run as `postgres` through a shell that
    /// backs up the primary by its container name once, streams through the replication
    /// link's port in the Toxiproxy container under its slot's name, and is ready when it
    /// takes read-only connections.
    #[test]
    fn standby_wiring() {
        let r = standby_request("net1", &Images::default().postgres, 11020);
        assert_eq!(published(&r), [(11020, 5432)], "a fixed host port: a restart keeps it");
        assert_eq!(r.descriptor(), format!("postgres:{POSTGRES_TAG}"));
        assert_eq!(r.container_name().as_deref(), Some("craig-postgres-standby-net1"));
        assert_eq!(r.network().as_deref(), Some("net1"));
        assert_eq!(r.user(), Some("postgres"), "the official image starts as root, which the server refuses");
        assert_eq!(r.labels().get(RUN_LABEL).map(String::as_str), Some("net1"));
        assert_eq!(r.entrypoint(), Some("sh"));
        let cmd: Vec<String> = r.cmd().map(|c| c.into()).collect();
        assert_eq!(cmd[0], "-c");
        let script = &cmd[1];
        for part in [
            "if [ ! -s \"$PGDATA/PG_VERSION\" ]",
            "pg_basebackup -h craig-postgres-net1 -p 5432 -U postgres -D \"$PGDATA\" -X stream -C -S standby -R",
            &format!("host=craig-toxiproxy-net1 port={REPLICATION_PORT} user=postgres application_name=standby"),
            "primary_slot_name = 'standby'",
            "exec postgres -D \"$PGDATA\" -c listen_addresses='*'",
        ] {
            assert!(script.contains(part), "{part:?} not in {script}");
        }
        assert!(format!("{:?}", r.ready_conditions()).contains("ready to accept read-only connections"));
    }

    #[test]
    fn rabbitmq_wiring() {
        let r = rabbitmq_request("net1", &Images::default().rabbitmq, &ports());
        assert_eq!(r.descriptor(), format!("rabbitmq:{RABBITMQ_TAG}"));
        assert_eq!(published(&r), [(11002, 5672), (11003, 15672)]);
        let env: Vec<_> = r.env_vars().map(|(k, v)| (k.into_owned(), v.into_owned())).collect();
        assert!(env.contains(&("RABBITMQ_SERVER_ADDITIONAL_ERL_ARGS".into(), format!("-rabbit collect_statistics_interval {STATS_INTERVAL_MS}"))), "{env:?}");
        assert_eq!(r.container_name().as_deref(), Some("craig-rabbitmq-net1"));
        assert!(format!("{:?}", r.ready_conditions()).contains("Server startup complete"));
    }

    #[test]
    fn toxiproxy_wiring() {
        let r = toxiproxy_request("net1", &Images::default().toxiproxy, &ports());
        assert_eq!(r.descriptor(), format!("{TOXIPROXY_IMAGE}:{TOXIPROXY_TAG}"));
        assert_eq!(published(&r), [(11004, TOXIPROXY_API_PORT), (11010, 20_000), (11011, 20_001)], "the API and every link slot");
        assert!(format!("{:?}", r.ready_conditions()).contains("Starting Toxiproxy HTTP server"));
        assert_eq!(r.network().as_deref(), Some("net1"));
    }

    #[test]
    fn images_are_settings() {
        let env = |pairs: &'static [(&'static str, &'static str)]| move |k: &str| pairs.iter().find(|(n, _)| *n == k).map(|(_, v)| v.to_string());
        assert_eq!(Images::from_lookup(env(&[])).unwrap(), Images::default());
        assert_eq!(Images::from_lookup(env(&[("CHAOS_POSTGRES_IMAGE", " ")])).unwrap(), Images::default());
        let stand_ins = Images::from_lookup(env(&[
            ("CHAOS_POSTGRES_IMAGE", "craig-chaos/postgres:15"),
            ("CHAOS_RABBITMQ_IMAGE", "registry.local:5000/mq/rabbitmq"),
            ("CHAOS_TOXIPROXY_IMAGE", "craig-chaos/toxiproxy-api:dev"),
        ]))
        .unwrap();
        assert_eq!(stand_ins.postgres, ImageRef { name: "craig-chaos/postgres".into(), tag: "15".into() });
        assert_eq!(stand_ins.rabbitmq, ImageRef { name: "registry.local:5000/mq/rabbitmq".into(), tag: "latest".into() });
        let r = postgres_request("net1", &stand_ins.postgres, &ports());
        assert_eq!(r.descriptor(), "craig-chaos/postgres:15");
        assert_eq!(toxiproxy_request("net1", &stand_ins.toxiproxy, &ports()).descriptor(), "craig-chaos/toxiproxy-api:dev");
        assert_eq!(ImageRef::parse("localhost:5000/pg").unwrap(), ImageRef { name: "localhost:5000/pg".into(), tag: "latest".into() });
        assert_eq!(ImageRef::parse("library/postgres:15.4-bookworm").unwrap().tag, "15.4-bookworm");
        for bad in ["postgres:", "a b", "pg@sha256:00", ":15", "pg:15:x", "Postgres:15", "pg:-x", "registry:x/pg", "pg//x", "pg/"] {
            let err = Images::from_lookup(move |k: &str| (k == "CHAOS_POSTGRES_IMAGE").then(|| bad.to_owned())).unwrap_err();
            assert!(matches!(err, BackendError::Setting { var: "CHAOS_POSTGRES_IMAGE", .. }), "{bad}: {err:?}");
            assert!(err.to_string().contains("CHAOS_POSTGRES_IMAGE") && err.to_string().contains("not an image reference"), "{bad}: {err}");
        }
    }

    #[tokio::test]
    async fn probe_explains_a_missing_engine() {
        // SAFETY: this test binary runs its tests in separate processes under nextest, and
        // nothing else here reads DOCKER_HOST concurrently.
        unsafe { std::env::set_var("DOCKER_HOST", "unix:///nonexistent/docker.sock") };
        let err = probe().await.unwrap_err();
        assert!(err.contains("no Docker engine at unix:///nonexistent/docker.sock"), "{err}");
    }
}
