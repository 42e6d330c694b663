//! `local`: a private PostgreSQL and a private RabbitMQ node as child processes, in a temp
//! dir, on free ports. Each server is its own process group, so a kill takes every backend
//! and helper with it — a real crash, by a real signal. Data survives a kill, so a restart
//! exercises crash recovery. Everything is removed on stop, on drop (panic) and, through
//! PR_SET_PDEATHSIG, when the harness itself dies.
//!
//! PostgreSQL runs as the `postgres` user when the harness is root (initdb refuses root).
//! `fsync=off`: a killed process loses nothing the OS already has, and no OS crash is
//! simulated here.

use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use nix::sys::signal::{Signal, killpg};
use nix::unistd::{Gid, Pid, Uid};
use sqlx::Connection;
use tokio::time::Instant;

use super::{BackendError, Endpoints, Target};

/// Why this machine cannot run the local backend (`Err`), or `Ok`.
pub fn probe() -> Result<(), String> {
    pg_bindir().map_err(|e| e.to_string())?;
    rabbitmq_script().map_err(|e| e.to_string())?;
    if Uid::effective().is_root() && nix::unistd::User::from_name("postgres").ok().flatten().is_none() {
        return Err("running as root but there is no `postgres` user to run initdb as".into());
    }
    Ok(())
}

/// Whether this backend can cut a broker node off from its peers ([`LocalBackend::cut_node`]):
/// packet-filter rules on the loopback, so root and an `iptables` on `PATH`.
pub fn can_cut_nodes() -> Result<(), &'static str> {
    use std::os::unix::fs::PermissionsExt;
    if !Uid::effective().is_root() {
        return Err("a partition between broker nodes needs root here (packet-filter rules on the loopback)");
    }
    let found = std::env::var_os("PATH").is_some_and(|path| {
        std::env::split_paths(&path).any(|dir| std::fs::metadata(dir.join("iptables")).is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0))
    });
    if !found {
        return Err("a partition between broker nodes needs root and iptables here, and no iptables is on PATH (ci/setup installs it)");
    }
    Ok(())
}

fn pg_bindir() -> Result<PathBuf, BackendError> {
    if let Ok(dir) = std::env::var("CHAOS_PG_BINDIR") {
        let dir = PathBuf::from(dir);
        if dir.join("initdb").exists() && dir.join("postgres").exists() {
            return Ok(dir);
        }
        return Err(BackendError::Unavailable { backend: "local", why: format!("CHAOS_PG_BINDIR={} holds no initdb and postgres", dir.display()) });
    }
    let mut found: Vec<(u32, PathBuf)> = std::fs::read_dir("/usr/lib/postgresql")
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| {
            let v: u32 = e.file_name().to_str()?.parse().ok()?;
            let bin = e.path().join("bin");
            (bin.join("initdb").exists() && bin.join("postgres").exists()).then_some((v, bin))
        })
        .collect();
    found.sort();
    if let Some((_, bin)) = found.pop() {
        return Ok(bin);
    }
    for dir in std::env::var("PATH").unwrap_or_default().split(':') {
        let p = Path::new(dir);
        if p.join("initdb").exists() && p.join("postgres").exists() {
            return Ok(p.to_path_buf());
        }
    }
    Err(BackendError::Unavailable {
        backend: "local",
        why: "no PostgreSQL server binaries (initdb, postgres) under /usr/lib/postgresql/*/bin or on PATH; \
              install postgresql or set CHAOS_PG_BINDIR"
            .into(),
    })
}

fn rabbitmq_script() -> Result<PathBuf, BackendError> {
    if let Ok(p) = std::env::var("CHAOS_RABBITMQ_SERVER") {
        let p = PathBuf::from(p);
        if p.is_file() {
            return Ok(p);
        }
        return Err(BackendError::Unavailable { backend: "local", why: format!("CHAOS_RABBITMQ_SERVER={} is no file", p.display()) });
    }
    // The Debian wrapper in /usr/sbin re-launches as the rabbitmq user via su, which would
    // make beam a grandchild; the real script keeps beam our direct child.
    let p = PathBuf::from("/usr/lib/rabbitmq/bin/rabbitmq-server");
    if p.exists() {
        return Ok(p);
    }
    Err(BackendError::Unavailable {
        backend: "local",
        why: "no /usr/lib/rabbitmq/bin/rabbitmq-server; install rabbitmq-server or set CHAOS_RABBITMQ_SERVER".into(),
    })
}

/// A free port for a private server, OUTSIDE the kernel's ephemeral range. The servers
/// bind it themselves, so it cannot be held for them; but while a killed server is down,
/// every outgoing connection (the replicas' proxies reconnecting, the readiness probe)
/// draws its source port from the ephemeral range, and one that drew the server's own port
/// would connect to itself (TCP simultaneous open) and keep the restart from binding. Out
/// of that range, only another listener can take the port, and every port this crate picks
/// is leased ([`PortLease`]), so no other run on the machine picks it meanwhile.
///
/// The lower half of that range: the containers backend publishes its many fixed ports from
/// the upper half ([`lease_port_for_containers`]).
pub fn lease_port() -> Result<PortLease, BackendError> {
    pick_port(false)
}

/// A leased free port from the upper half of the non-ephemeral range, for the containers
/// backend's published ports (see [`lease_port`]).
pub fn lease_port_for_containers() -> Result<PortLease, BackendError> {
    pick_port(true)
}

/// [`lease_port`] held for the rest of the process (tests' listeners).
pub fn free_port() -> Result<u16, BackendError> {
    let lease = lease_port()?;
    let port = lease.port();
    KEPT.lock().unwrap_or_else(|e| e.into_inner()).push(lease);
    Ok(port)
}

static KEPT: std::sync::Mutex<Vec<PortLease>> = std::sync::Mutex::new(Vec::new());

/// A port this process picked, reserved against every other process that picks ports here
/// (any run of this crate in this network namespace: nextest runs many at once) until
/// dropped: a Unix socket bound to the abstract name `craig-chaos-port-<N>`, which the
/// kernel releases when the socket closes or the process dies. No file, no directory, no
/// permission for one user to get wrong for another; the abstract namespace is per network
/// namespace, as the host's loopback ports are. (The containers backend's published ports
/// are bound by the Docker engine in its own namespace: a harness running in another one, in
/// a container of its own, leases them in the wrong place.) A port is free while its listener is closed (a server
/// killed, a proxy link down or partitioned, a container killed), and without the lease
/// another run could pick it then and keep it from coming back (seen: a connection to a
/// disabled proxy's port answered, CI at 38ba52f).
#[derive(Debug)]
pub struct PortLease {
    port: u16,
    _claim: std::os::unix::net::UnixListener,
}

impl PortLease {
    pub fn port(&self) -> u16 {
        self.port
    }
}

/// Leases `port` unless another process (or this one) holds it: `Ok(None)` then.
fn try_lease(port: u16) -> Result<Option<PortLease>, BackendError> {
    use std::os::linux::net::SocketAddrExt as _;
    let name = format!("craig-chaos-port-{port}");
    let addr = std::os::unix::net::SocketAddr::from_abstract_name(name.as_bytes())
        .map_err(|e| BackendError::failed("leasing a port", e))?;
    match std::os::unix::net::UnixListener::bind_addr(&addr) {
        Ok(claim) => Ok(Some(PortLease { port, _claim: claim })),
        Err(e) if e.kind() == std::io::ErrorKind::AddrInUse => Ok(None),
        Err(e) => Err(BackendError::failed("leasing a port", format!("binding the abstract socket {name}: {e}"))),
    }
}

fn pick_port(upper: bool) -> Result<PortLease, BackendError> {
    static NEXT: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
    let (lo, hi) = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|t| {
            let mut it = t.split_whitespace().map(|n| n.parse::<u32>().ok());
            Some((it.next()??, it.next()??))
        })
        .unwrap_or((32768, 60999));
    let (from, to) = non_ephemeral(lo, hi);
    let mid = from + (to - from) / 2;
    let (from, to) = if upper { (mid, to) } else { (from, mid) };
    let span = to - from;
    let start = (std::process::id().wrapping_mul(7919) + NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed) * 131) % span;
    for k in 0..span.min(2000) {
        let port = (from + (start + k) % span) as u16;
        // Leased first, so a port another run holds (its listener closed for a fault) is
        // never probed, let alone picked.
        let Some(lease) = try_lease(port)? else { continue };
        if std::net::TcpListener::bind(("127.0.0.1", port)).is_ok() {
            return Ok(lease);
        }
    }
    Err(BackendError::failed("finding a free port", format!("none free in {from}..{to} (outside the ephemeral range {lo}-{hi})")))
}

/// Whether a failed start says a port was already bound (PostgreSQL, RabbitMQ/Erlang).
fn port_taken(error: &str) -> bool {
    let e = error.to_ascii_lowercase();
    e.contains("address already in use") || e.contains("eaddrinuse")
}

/// The port range [from, to) to pick private servers' ports from, given the ephemeral
/// range `lo..=hi`: below it when there is room, else above it.
fn non_ephemeral(lo: u32, hi: u32) -> (u32, u32) {
    if lo >= 12_000 { (10_000, lo) } else if hi < 64_000 { (hi + 1, 65_536) } else { (1_024, lo.max(2_048)) }
}

#[cfg(test)]
mod port_tests {
    use super::*;

    /// A peer's `cluster_status` after `rabbitmq-upgrade drain` of node c (RabbitMQ 3.10,
    /// as captured here): only c is reported under maintenance.
    #[test]
    fn a_drained_node_is_read_from_a_peers_cluster_status() {
        let out = "\x1b[1mMaintenance status\x1b[0m\n\nNode: a@localhost, status: not under maintenance\n\
                   Node: c@localhost, status: \x1b[35mmarked for maintenance\x1b[0m\n\n\x1b[1mAlarms\x1b[0m\n";
        assert!(reports_maintenance(out, "c@localhost"));
        assert!(!reports_maintenance(out, "a@localhost"));
        assert!(!reports_maintenance(out, "b@localhost"));
    }

    #[test]
    fn a_taken_port_is_recognised_in_either_servers_words() {
        assert!(port_taken("LOG:  could not bind IPv4 address \"127.0.0.1\": Address already in use"));
        assert!(port_taken("{error,{listen_error,eaddrinuse}}"));
        assert!(!port_taken("not ready after 30s"));
    }

    /// A node that loads definitions at boot makes no default user: the boot file must hold
    /// the vhost, the admin the harness connects as, and every fleet account with the very
    /// password `accounts()` hands out (so it needs no import of its own).
    #[test]
    fn the_boot_definitions_hold_the_admin_and_every_fleet_account() {
        let root = Path::new("/tmp/craig-chaos-test-root");
        let defs = boot_definitions(root, 12345).unwrap();
        assert_eq!(defs["vhosts"], serde_json::json!([{ "name": "/" }]));
        let users = defs["users"].as_array().unwrap();
        assert_eq!(users[0]["name"], "guest");
        assert_eq!(users[0]["tags"], serde_json::json!(["administrator"]));
        assert_eq!(users[0]["password_hash"], craig_sandbox::password_hash("guest", "guest").as_str());
        let fleet = super::super::fleet_accounts();
        let (accounts, urls) = account_definitions(root, 12345, &fleet).unwrap();
        assert_eq!(&users[1..], accounts["users"].as_array().unwrap().as_slice());
        assert_eq!(defs["permissions"].as_array().unwrap().len(), fleet.len() + 1);
        assert_eq!(urls.len(), fleet.len());
        assert!(urls.iter().all(|u| u.ends_with("@127.0.0.1:12345/%2f")), "{urls:?}");
    }

    #[test]
    fn a_leased_port_is_never_picked_again_until_its_lease_is_dropped() {
        let held = lease_port().unwrap();
        // Free to bind (no listener), yet another picker skips it.
        assert!(std::net::TcpListener::bind(("127.0.0.1", held.port())).is_ok());
        assert!(try_lease(held.port()).unwrap().is_none(), "{} leased twice", held.port());
        let port = held.port();
        drop(held);
        assert_eq!(try_lease(port).unwrap().map(|l| l.port()), Some(port), "released with its lease");
    }

    #[test]
    fn private_server_ports_stay_out_of_the_ephemeral_range() {
        assert_eq!(non_ephemeral(32768, 60999), (10_000, 32768));
        assert_eq!(non_ephemeral(1024, 50000), (50001, 65_536));
        let p = u32::from(free_port().unwrap());
        let (lo, hi) = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
            .map(|t| {
                let v: Vec<u32> = t.split_whitespace().map(|n| n.parse().unwrap()).collect();
                (v[0], v[1])
            })
            .unwrap_or((32768, 60999));
        assert!(!(lo..=hi).contains(&p), "{p} is in the ephemeral range {lo}-{hi}");
        // Private servers and the containers' published ports never share a port.
        let (from, to) = non_ephemeral(lo, hi);
        let mid = from + (to - from) / 2;
        assert!((from..mid).contains(&p), "{p} not in the lower half {from}..{mid}");
        let c = u32::from(lease_port_for_containers().unwrap().port());
        assert!((mid..to).contains(&c), "{c} not in the upper half {mid}..{to}");
    }
}

fn log_tail(path: &Path) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(15)..].join("\n")
}

/// One server process (group) we start, kill, pause and restart.
struct Server {
    name: &'static str,
    program: PathBuf,
    args: Vec<String>,
    env: Vec<(String, String)>,
    cwd: PathBuf,
    run_as: Option<(Uid, Gid)>,
    log: PathBuf,
    child: Option<Child>,
    /// Its ports, leased for as long as it may be restarted on them.
    _ports: Vec<PortLease>,
}

impl Server {
    /// One of its environment variables (a broker node's name, HOME, data directory).
    fn var(&self, key: &str) -> Option<String> {
        self.env.iter().find(|(k, _)| k == key).map(|(_, v)| v.clone())
    }

    fn spawn(&mut self) -> Result<(), BackendError> {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.log)
            .map_err(|e| BackendError::failed(format!("opening {}", self.log.display()), e))?;
        let mut cmd = Command::new(&self.program);
        cmd.args(&self.args)
            .current_dir(&self.cwd)
            .envs(self.env.iter().map(|(k, v)| (k, v)))
            .stdin(Stdio::null())
            .stdout(log.try_clone().map_err(|e| BackendError::failed("log", e))?)
            .stderr(log)
            .process_group(0);
        if let Some((uid, gid)) = self.run_as {
            cmd.uid(uid.as_raw()).gid(gid.as_raw());
        }
        // SAFETY: prctl is async-signal-safe. The signal fires when the spawning THREAD
        // exits, so spawn only from runtime threads that live as long as the run.
        unsafe {
            cmd.pre_exec(|| {
                nix::sys::prctl::set_pdeathsig(Signal::SIGKILL).map_err(std::io::Error::from)?;
                Ok(())
            });
        }
        let child = cmd.spawn().map_err(|e| BackendError::failed(format!("starting {} ({})", self.name, self.program.display()), e))?;
        self.child = Some(child);
        Ok(())
    }

    fn pgid(&self) -> Option<Pid> {
        self.child.as_ref().map(|c| Pid::from_raw(c.id() as i32))
    }

    fn exited(&mut self) -> Option<std::process::ExitStatus> {
        self.child.as_mut().and_then(|c| c.try_wait().ok().flatten())
    }

    fn signal(&self, sig: Signal) -> Result<(), BackendError> {
        let pgid = self.pgid().ok_or_else(|| BackendError::failed(format!("signalling {}", self.name), "not running"))?;
        killpg(pgid, sig).map_err(|e| BackendError::failed(format!("{sig} to {}", self.name), e))
    }

    /// SIGKILL the whole group and wait until every process of it is gone.
    /// SIGKILL the group; the pid that died (None: nothing was running).
    async fn kill(&mut self) -> Result<Option<i32>, BackendError> {
        let Some(pgid) = self.pgid() else { return Ok(None) };
        let _ = killpg(pgid, Signal::SIGKILL);
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            let reaped = self.exited().is_some();
            let group_gone = matches!(killpg(pgid, None), Err(nix::errno::Errno::ESRCH));
            if reaped && group_gone {
                self.child = None;
                return Ok(Some(pgid.as_raw()));
            }
            if Instant::now() > deadline {
                return Err(BackendError::failed(format!("killing {}", self.name), "processes still alive after 20 s"));
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    fn kill_now(&mut self) {
        if let Some(pgid) = self.pgid() {
            let _ = killpg(pgid, Signal::SIGKILL);
            if let Some(c) = self.child.as_mut() {
                let _ = c.wait();
            }
            self.child = None;
        }
    }
}

/// A server never outlives its owner: a start cancelled before the backend holds it (a
/// bounded start timing out while initdb runs) kills it too.
impl Drop for Server {
    fn drop(&mut self) {
        self.kill_now();
    }
}

pub struct LocalBackend {
    root: PathBuf,
    pg: Server,
    pg_port: u16,
    rmq: Server,
    rmq_port: u16,
    /// A cluster's nodes 2..=N (issue 25), each with its AMQP port; empty for one node.
    peers: Vec<(Server, u16)>,
    /// Packet-filter rules in force (`iptables` arguments after the chain), each a node's
    /// cut from the others ([`LocalBackend::cut_node`]); removed at the heal, stop or drop.
    cuts: Vec<(usize, Vec<String>)>,
    services: Vec<String>,
    stopped: bool,
    /// A streaming standby of the database server and the address every client reaches
    /// the primary by (issue 26, `[fleet] database = { standby = true }`): None without one.
    standby: Option<Standby>,
    /// A primary a failover replaced: gone, kept for its Drop and its port lease.
    retired: Vec<Server>,
}

/// The database's streaming standby (issue 26) and the run's database address.
struct Standby {
    server: Server,
    port: u16,
    /// Where the standby's replication connection goes: a port the fault proxy's
    /// `standby->database` link listens on (the harness creates the link), so the link can
    /// be slowed or cut like any replica's.
    replication: PortLease,
    /// The one address every client of the run's database uses (the virtual IP or DNS
    /// name an operator's failover moves), forwarding to the primary of the moment.
    vip: Vip,
    sync: bool,
    promoted: bool,
}

/// What [`LocalBackend::failover`] did and saw (issue 26): its evidence.
#[derive(Debug, Clone)]
pub struct Failover {
    /// The old primary's end, in its backend's words (a process group killed, a container
    /// the engine says is not running).
    pub killed: String,
    /// From the call to the old primary gone by its backend's word (a process group
    /// reaped; a `docker kill` and its `inspect`, 0.4 to 1.2 s on containers here).
    pub dead_after: Duration,
    /// When the old primary died (epoch ms, this machine's clock), within `dead_after`: the
    /// SIGKILL of its process group (nothing of it runs after it), a container's exit as
    /// the engine recorded it (`State.FinishedAt`). Writes sent before then can have
    /// committed there.
    pub died_at_epoch_ms: i64,
    /// The standby's timeline before and the promoted server's after.
    pub timeline_before: i64,
    pub timeline_after: i64,
    /// The commit time (the database's clock, epoch ms) of the last transaction the standby
    /// applied before its recovery ended (read after the promotion, when it is final): every
    /// commit after it is gone. None when it had applied none since it started.
    pub replayed_until_db_ms: Option<i64>,
    /// Whether the primary waited for the standby (`synchronous_commit = remote_apply`).
    pub sync: bool,
    /// The promoted server's address, where the database address now leads.
    pub now_at: String,
}

/// Issue 26, shared by the backends that run a standby: once the replication link exists,
/// the primary on `port` waits for the standby on every commit where it is synchronous
/// (`synchronous_standby_names`, and `synchronous_commit = remote_apply`: a commit returns
/// once the standby has applied it), and this waits (30 s at most) until the primary reports
/// the standby streaming, caught up, in the mode asked for. The primary's own word: `state,
/// sync_state` of its `pg_stat_replication` row. `log` is the standby's last log lines.
pub(super) async fn await_streaming(port: u16, sync: bool, log: impl AsyncFn() -> String) -> Result<String, BackendError> {
    let mut c = admin_conn(port).await?;
    let sql = |q: &str| sqlx::query(sqlx::AssertSqlSafe(q.to_owned()));
    if sync {
        for q in [
            format!("ALTER SYSTEM SET synchronous_standby_names = '{STANDBY_NAME}'"),
            "ALTER SYSTEM SET synchronous_commit = 'remote_apply'".to_owned(),
            "SELECT pg_reload_conf()".to_owned(),
        ] {
            sql(&q).execute(&mut c).await.map_err(|e| BackendError::failed(format!("configuring replication ({q})"), e))?;
        }
    }
    let want = if sync { "sync" } else { "async" };
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut last = "no pg_stat_replication row for the standby".to_owned();
    loop {
        let row: Option<(String, String, i64)> = sqlx::query_as(
            "SELECT state, sync_state, COALESCE((pg_current_wal_lsn() - replay_lsn)::int8, 1) FROM pg_stat_replication WHERE application_name = $1",
        )
        .bind(STANDBY_NAME)
        .fetch_optional(&mut c)
        .await
        .map_err(|e| BackendError::failed("reading pg_stat_replication", e))?;
        if let Some((state, sync_state, behind)) = row {
            if state == "streaming" && sync_state == want && behind <= 0 {
                let _ = c.close().await;
                return Ok(format!("standby {state}, sync_state {sync_state}, caught up (the primary's pg_stat_replication)"));
            }
            last = format!("state {state}, sync_state {sync_state}, {behind} bytes behind");
        }
        if Instant::now() > deadline {
            return Err(BackendError::failed("starting replication", format!("the standby is not streaming {want} and caught up after 30 s: {last}; last log lines:\n{}", log().await)));
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Issue 26, shared by the backends that run a standby: the standby on `port` promoted
/// (`pg_promote`, which applies all it received before it ends recovery, and waits for
/// that), once its primary is gone. Its timeline before and after (it must have moved on),
/// out of recovery, and the commit time (the database's clock, epoch ms) of the last
/// transaction it applied, read after the promotion, when it is final.
pub(super) async fn promote(port: u16) -> Result<(i64, i64, Option<i64>), BackendError> {
    let mut c = admin_conn(port).await?;
    let fail = |what: &'static str| move |e: sqlx::Error| BackendError::failed(what, e);
    let timeline_before: i64 = sqlx::query_scalar("SELECT timeline_id::int8 FROM pg_control_checkpoint()").fetch_one(&mut c).await.map_err(fail("reading the standby's timeline"))?;
    let promoted: bool = sqlx::query_scalar("SELECT pg_promote(true, 60)").fetch_one(&mut c).await.map_err(fail("pg_promote"))?;
    let (in_recovery, timeline_after, replayed_until_db_ms): (bool, i64, Option<i64>) = sqlx::query_as(
        "SELECT pg_is_in_recovery(), ('x' || substr(pg_walfile_name(pg_current_wal_lsn()), 1, 8))::bit(32)::int8, \
                (EXTRACT(EPOCH FROM pg_last_xact_replay_timestamp()) * 1000)::int8",
    )
    .fetch_one(&mut c)
    .await
    .map_err(fail("reading the promoted server's timeline"))?;
    let _ = c.close().await;
    if !promoted || in_recovery || timeline_after <= timeline_before {
        return Err(BackendError::failed(
            "promoting the standby",
            format!("not promoted (pg_promote {promoted}, in recovery {in_recovery}, timeline {timeline_before} → {timeline_after})"),
        ));
    }
    Ok((timeline_before, timeline_after, replayed_until_db_ms))
}

/// A TCP forwarder with a movable upstream: the run's database address (issue 26). Each
/// accepted connection goes to the upstream of the moment; a connection to a server that
/// died ends with it, and the client reconnects to whatever the address leads to then.
struct Vip {
    port: u16,
    upstream: std::sync::Arc<std::sync::Mutex<String>>,
    task: tokio::task::JoinHandle<()>,
    _lease: PortLease,
}

impl Drop for Vip {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl Vip {
    async fn start(upstream: String) -> Result<Self, BackendError> {
        let lease = lease_port()?;
        let port = lease.port();
        let listener = tokio::net::TcpListener::bind(("127.0.0.1", port)).await.map_err(|e| BackendError::failed(format!("binding the database address 127.0.0.1:{port}"), e))?;
        let to = std::sync::Arc::new(std::sync::Mutex::new(upstream));
        let current = to.clone();
        let task = tokio::spawn(async move {
            loop {
                let mut client = match listener.accept().await {
                    Ok((c, _)) => c,
                    Err(_) => {
                        tokio::time::sleep(Duration::from_millis(20)).await;
                        continue;
                    }
                };
                let upstream = current.lock().unwrap().clone();
                tokio::spawn(async move {
                    if let Ok(mut server) = tokio::net::TcpStream::connect(&upstream).await {
                        let _ = (client.set_nodelay(true), server.set_nodelay(true));
                        let _ = tokio::io::copy_bidirectional(&mut client, &mut server).await;
                    }
                });
            }
        });
        Ok(Vip { port, upstream: to, task, _lease: lease })
    }
}

/// A connection to the server on `port` (admin database), bounded.
pub(super) async fn admin_conn(port: u16) -> Result<sqlx::PgConnection, BackendError> {
    let url = format!("postgres://postgres@127.0.0.1:{port}/postgres");
    match tokio::time::timeout(LocalBackend::PROBE_BOUND, sqlx::PgConnection::connect(&url)).await {
        Ok(Ok(c)) => Ok(c),
        Ok(Err(e)) => Err(BackendError::failed(format!("connecting to PostgreSQL on {port}"), e)),
        Err(_) => Err(BackendError::failed(format!("connecting to PostgreSQL on {port}"), "no answer within 3 s")),
    }
}

/// Issue 26: how far behind the primary reports its standby ([`LocalBackend::replication_watch`]).
pub struct ReplicationWatch {
    port: u16,
    conn: Option<sqlx::PgConnection>,
}

impl ReplicationWatch {
    /// A watch on the primary listening on `port` (of this host).
    pub(super) fn on(port: u16) -> Self {
        ReplicationWatch { port, conn: None }
    }

    /// The WAL bytes the primary has written that the standby has not yet applied
    /// (`pg_stat_replication`); None when the primary does not answer (killed, in a failover)
    /// or lists no standby. One connection, opened on first use and again after an error.
    pub async fn behind(&mut self) -> Option<i64> {
        if self.conn.is_none() {
            self.conn = admin_conn(self.port).await.ok();
        }
        let c = self.conn.as_mut()?;
        let row = sqlx::query_scalar::<_, i64>(
            "SELECT COALESCE((pg_current_wal_lsn() - replay_lsn)::int8, 0) FROM pg_stat_replication WHERE application_name = $1",
        )
        .bind(STANDBY_NAME)
        .fetch_optional(c)
        .await;
        match row {
            Ok(row) => row,
            Err(_) => {
                self.conn = None;
                None
            }
        }
    }
}

impl LocalBackend {
    /// Start both servers. Their ports are chosen free and then bound by the servers
    /// themselves (they cannot be handed a socket); if another process takes a port in
    /// between, the start is retried on fresh ports, up to three times.
    pub async fn start(services: &[&str]) -> Result<Self, BackendError> {
        Self::start_cluster(services, 1).await
    }

    /// [`LocalBackend::start`] with a broker of `broker_nodes` RabbitMQ nodes (issue 25): the
    /// peers boot at the same time as node 1, then each joins its cluster (`stop_app`,
    /// `reset`, `join_cluster`, `start_app`), one at a time.
    pub async fn start_cluster(services: &[&str], broker_nodes: usize) -> Result<Self, BackendError> {
        reap_leftovers();
        let mut tries = 0;
        loop {
            tries += 1;
            match Self::start_once(services, broker_nodes.max(1)).await {
                Err(e) if tries < 3 && port_taken(&e.to_string()) => {
                    tracing::warn!(event = "chaos.port_taken", error = %e, "a private server's port was taken; retrying on fresh ports");
                }
                other => return other,
            }
        }
    }

    async fn start_once(services: &[&str], broker_nodes: usize) -> Result<Self, BackendError> {
        let root = std::env::temp_dir().join(format!(
            "craig-chaos-{}-{}",
            std::process::id(),
            std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_nanos()).unwrap_or(0)
        ));
        let io = |what: &str, e: std::io::Error| BackendError::failed(format!("{what} in {}", root.display()), e);
        std::fs::create_dir_all(&root).map_err(|e| io("creating", e))?;
        let mut backend = None;
        let result = async {
            // RabbitMQ's start is the longest (seconds of Erlang boot, CPU-bound): it goes
            // first, with the run's accounts in its boot definitions, and PostgreSQL's
            // initdb (about a second) runs while it boots.
            let cookie = format!("CRAIGCHAOS{}", uuid::Uuid::now_v7().simple()).to_uppercase();
            let cluster = broker_nodes > 1;
            let (mut rmq, rmq_port) = rmq_server(&root, 1, &cookie, cluster)?;
            rmq.spawn()?;
            let mut peers = Vec::new();
            for node in 2..=broker_nodes {
                let (mut peer, port) = rmq_server(&root, node, &cookie, cluster)?;
                peer.spawn()?;
                peers.push((peer, port));
            }
            let initdb = {
                let root = root.clone();
                tokio::task::spawn_blocking(move || pg_server(&root)).await
            };
            let (pg, pg_port) = match initdb {
                Ok(Ok(pg)) => pg,
                // A dropped server (node 1 and the peers) is killed.
                Ok(Err(e)) => return Err(e),
                Err(e) => return Err(BackendError::failed("running initdb", e)),
            };
            let b = backend.insert(LocalBackend {
                pg_port,
                pg,
                rmq_port,
                rmq,
                peers,
                cuts: Vec::new(),
                root: root.clone(),
                services: services.iter().map(|s| s.to_string()).collect(),
                stopped: false,
                standby: None,
                retired: Vec::new(),
            });
            b.pg.spawn()?;
            b.wait_ready(Target::Database, Duration::from_secs(30)).await?;
            super::create_databases(b.pg_port, &b.services).await?;
            b.wait_ready(Target::Broker, Duration::from_secs(60)).await?;
            b.form_cluster().await?;
            Ok::<(), BackendError>(())
        }
        .await;
        match (result, backend) {
            (Ok(()), Some(b)) => Ok(b),
            (Err(e), Some(b)) => {
                drop(b); // kills and removes
                Err(e)
            }
            (Err(e), None) => {
                let _ = std::fs::remove_dir_all(&root);
                Err(e)
            }
            (Ok(()), None) => unreachable!("backend is set before Ok"),
        }
    }

    /// Set a queue policy on the private broker (`rabbitmqctl -n <node>`, same HOME so the
    /// same Erlang cookie), `definition` being RabbitMQ's policy JSON.
    pub async fn set_policy(&self, name: &str, pattern: &str, definition: &serde_json::Value) -> Result<(), BackendError> {
        self.rabbitmqctl(&["set_policy", "--apply-to", "queues", "--priority", "10", name, pattern, &definition.to_string()]).await.map(drop)
    }

    pub async fn clear_policy(&self, name: &str) -> Result<(), BackendError> {
        self.rabbitmqctl(&["clear_policy", name]).await.map(drop)
    }

    /// One account per service on the private broker's vhost (ADR-022 #1202), each checked
    /// to log in; their AMQP URLs. The fleet's own accounts were in the node's boot
    /// definitions (`rmq_server`); any others are made in ONE `rabbitmqctl
    /// import_definitions` (an Erlang VM of its own: about a second).
    pub async fn accounts(&self, accounts: &[craig_sandbox::Account]) -> Result<Vec<String>, BackendError> {
        let (defs, urls) = account_definitions(&self.root, self.rmq_port, accounts)?;
        if accounts != super::fleet_accounts().as_slice() {
            let file = self.root.join("accounts.json");
            std::fs::write(&file, defs.to_string()).map_err(|e| BackendError::failed(format!("writing {}", file.display()), e))?;
            self.rabbitmqctl(&["import_definitions", &file.display().to_string()]).await?;
        }
        craig_sandbox::wait_logins(&urls).await.map_err(|e| BackendError::failed("creating the service accounts", e))?;
        Ok(urls)
    }

    /// Deliveries of `queues` not yet acked by their consumers (the CLI has its own
    /// timeout, and the child dies with a caller's timeout that drops it).
    pub async fn unacked(&self, queues: &[String]) -> Result<u64, BackendError> {
        let out = self.rabbitmqctl(&["list_queues", "--timeout", "5", "-s", "name", "messages_unacknowledged"]).await?;
        craig_sandbox::sum_listed(&out, queues).map_err(|e| BackendError::failed("counting unacked deliveries", e))
    }

    /// How long one `rabbitmqctl` call may take (the CLI itself starts an Erlang VM: ~1 s).
    const CTL_BOUND: Duration = Duration::from_secs(30);

    /// `rabbitmqctl -n <node>` against the private broker (same HOME, so the same Erlang
    /// cookie), async, bounded and killed when dropped; its stdout.
    async fn rabbitmqctl(&self, args: &[&str]) -> Result<String, BackendError> {
        Self::rabbitmqctl_on(&self.rmq, args).await
    }

    /// `rabbitmqctl` against broker node `node` (1-based); its stdout (issue 25: evidence,
    /// `cluster_status`, a queue's leader).
    pub async fn rabbitmqctl_node(&self, node: usize, args: &[&str]) -> Result<String, BackendError> {
        Self::rabbitmqctl_on(self.broker_node_ref(node)?, args).await
    }

    async fn rabbitmqctl_on(server: &Server, args: &[&str]) -> Result<String, BackendError> {
        Self::rabbitmq_cli_on(server, "rabbitmqctl", args, Self::CTL_BOUND).await
    }

    /// A RabbitMQ CLI tool (`rabbitmqctl`, `rabbitmq-upgrade`) against `server`'s node,
    /// bounded by `bound` and killed when dropped; its stdout.
    async fn rabbitmq_cli_on(server: &Server, tool: &str, args: &[&str], bound: Duration) -> Result<String, BackendError> {
        let ctl = rabbitmq_script()?.with_file_name(tool);
        let run = tokio::process::Command::new(&ctl)
            .args(["-n", &server.var("RABBITMQ_NODENAME").unwrap_or_default()])
            .args(args)
            .env("HOME", server.var("HOME").unwrap_or_default())
            .stdin(Stdio::null())
            .kill_on_drop(true)
            .output();
        // Bounded: a paused or wedged node must not hang the run (the child dies on drop).
        let out = tokio::time::timeout(bound, run)
            .await
            .map_err(|_| BackendError::failed(format!("{tool} {}", args.join(" ")), format!("no answer within {bound:?}")))?
            .map_err(|e| BackendError::failed(format!("running {}", ctl.display()), e))?;
        if out.status.success() {
            Ok(String::from_utf8_lossy(&out.stdout).into_owned())
        } else {
            Err(BackendError::failed(
                format!("{tool} {}", args.join(" ")),
                String::from_utf8_lossy(&out.stderr).trim().to_owned(),
            ))
        }
    }

    /// The broker's node count (1 unless started with [`LocalBackend::start_cluster`]).
    pub fn broker_nodes(&self) -> usize {
        1 + self.peers.len()
    }

    /// The admin's AMQP URL of each broker node, node 1 first.
    pub fn broker_node_urls(&self) -> Vec<String> {
        std::iter::once(self.rmq_port).chain(self.peers.iter().map(|(_, p)| *p)).map(|p| format!("amqp://guest:guest@127.0.0.1:{p}/%2f")).collect()
    }

    /// Erlang node names, node 1 first (`rabbitmqctl cluster_status` names them so).
    pub fn broker_node_names(&self) -> Vec<String> {
        let name = |s: &Server| s.var("RABBITMQ_NODENAME").unwrap_or_default();
        std::iter::once(name(&self.rmq)).chain(self.peers.iter().map(|(s, _)| name(s))).collect()
    }

    fn broker_node_ref(&self, node: usize) -> Result<&Server, BackendError> {
        match node {
            1 => Ok(&self.rmq),
            n => self.peers.get(n.wrapping_sub(2)).map(|(s, _)| s).ok_or_else(|| no_node(n, self.broker_nodes())),
        }
    }

    /// Broker node `node` (1-based) as a server target, or the error naming the nodes
    /// there are.
    fn node_target(&self, node: usize) -> Result<Target, BackendError> {
        self.broker_node_ref(node)?;
        u8::try_from(node).map(Target::BrokerNode).map_err(|_| no_node(node, self.broker_nodes()))
    }

    /// Each peer joins node 1's cluster, one at a time; then every node reports the others
    /// running (`cluster_status`), or the start fails with what it said.
    async fn form_cluster(&mut self) -> Result<(), BackendError> {
        if self.peers.is_empty() {
            return Ok(());
        }
        let first = self.broker_node_names()[0].clone();
        for node in 2..=self.broker_nodes() {
            self.wait_ready(self.node_target(node)?, Duration::from_secs(60)).await?;
            self.join(node, &first).await?;
        }
        let status = self.rabbitmqctl(&["cluster_status", "--formatter", "json"]).await?;
        let running: Vec<String> = serde_json::from_str::<serde_json::Value>(&status)
            .ok()
            .and_then(|v| v["running_nodes"].as_array().map(|a| a.iter().filter_map(|n| n.as_str().map(str::to_owned)).collect()))
            .unwrap_or_default();
        let names = self.broker_node_names();
        if names.iter().any(|n| !running.contains(n)) {
            return Err(BackendError::failed("forming the broker cluster", format!("running nodes {running:?}, expected {names:?}")));
        }
        Ok(())
    }

    /// Running node `node` joins the cluster of node `to` (`stop_app`, `reset`,
    /// `join_cluster`, `start_app`) and takes a login again.
    async fn join(&mut self, node: usize, to: &str) -> Result<(), BackendError> {
        let server = self.broker_node_ref(node)?;
        for args in [&["stop_app"][..], &["reset"], &["join_cluster", to], &["start_app"]] {
            Self::rabbitmqctl_on(server, args).await.map_err(|e| BackendError::failed(format!("broker node {node} joining {to}"), e))?;
        }
        self.wait_ready(self.node_target(node)?, Duration::from_secs(60)).await
    }

    /// Every queue as broker node `ask` reports it (`rabbitmqctl list_queues`): its name,
    /// type, a quorum queue's leader and members, its ready messages, and for a classic
    /// queue, with `homes`, whether `ask` is its home (`--local`: a classic queue homed
    /// elsewhere has no known node here; without `homes`, one CLI call fewer and no
    /// classic queue has a node). Issue 25: what a node's loss takes with it, where
    /// leaders are.
    pub async fn queue_placement(&self, ask: usize, homes: bool) -> Result<Vec<QueuePlacement>, BackendError> {
        let json = |out: &str| -> Result<Vec<serde_json::Value>, BackendError> {
            serde_json::from_str(out).map_err(|e| BackendError::failed("reading list_queues", format!("{e}: {out}")))
        };
        let rows = json(&self.rabbitmqctl_node(ask, &["list_queues", "--timeout", "10", "name", "type", "leader", "members", "messages", "--formatter", "json"]).await?)?;
        let local = if homes {
            json(&self.rabbitmqctl_node(ask, &["list_queues", "--local", "--timeout", "10", "name", "--formatter", "json"]).await?)?
        } else {
            Vec::new()
        };
        let here = self.broker_node_names()[ask - 1].clone();
        Ok(rows
            .iter()
            .map(|r| {
                let s = |k: &str| r[k].as_str().unwrap_or_default().to_owned();
                let members: Vec<String> = r["members"].as_array().map(|a| a.iter().filter_map(|m| m.as_str().map(str::to_owned)).collect()).unwrap_or_default();
                let kind = s("type");
                let name = s("name");
                let nodes = if kind == "classic" {
                    if local.iter().any(|l| l["name"].as_str() == Some(name.as_str())) { vec![here.clone()] } else { Vec::new() }
                } else {
                    members
                };
                QueuePlacement { name, kind, nodes, leader: s("leader"), messages: r["messages"].as_u64().unwrap_or(0) }
            })
            .collect())
    }

    /// A wiped node (down, [`LocalBackend::wipe_broker_node`]) back in the cluster, as an
    /// operator replaces a node: a running node forgets it (`forget_cluster_node`, which
    /// also drops it from the quorum queues' members), it starts empty, and joins that node
    /// (`stop_app`, `reset`, `join_cluster`, `start_app`).
    pub async fn rejoin_broker_node(&mut self, node: usize) -> Result<(), BackendError> {
        let target = self.node_target(node)?;
        let names = self.broker_node_names();
        let survivor = (1..=self.broker_nodes()).find(|&k| k != node && self.broker_node_ref(k).is_ok_and(|s| s.child.is_some()));
        let Some(survivor) = survivor else { return Err(BackendError::failed(format!("rejoining broker node {node}"), "no other node runs")) };
        let forget = Self::rabbitmqctl_on(self.broker_node_ref(survivor)?, &["forget_cluster_node", &names[node - 1]]).await;
        // Already forgotten (a node never joined) is fine; anything else is the fault's error.
        if let Err(e) = &forget {
            if !e.to_string().contains("not_a_cluster_node") {
                return Err(BackendError::failed(format!("node {survivor} forgetting node {node}"), e));
            }
        }
        let server = self.server(target)?;
        // Empty, it must not serve the fleet's accounts on its own before it joins (a client
        // would log in to a broker with no exchanges): no boot definitions this time.
        if let Some(conf) = server.var("RABBITMQ_CONFIG_FILE").map(PathBuf::from) {
            let text = std::fs::read_to_string(&conf).unwrap_or_default();
            let kept: String = text.lines().filter(|l| !l.starts_with("load_definitions")).map(|l| format!("{l}\n")).collect();
            std::fs::write(&conf, kept).map_err(|e| BackendError::failed(format!("writing {}", conf.display()), e))?;
        }
        server.spawn()?;
        let joined = async {
            self.wait_ready(target, Duration::from_secs(60)).await?;
            self.join(node, &names[survivor - 1]).await
        }
        .await;
        if joined.is_err() {
            // Never left serving on its own.
            let _ = self.kill(target).await;
        }
        joined
    }

    /// Cut broker node `node` off from the other nodes at the distribution layer (issue 25).
    /// Every node of a cluster connects to its peers from its own loopback address
    /// ([`dist_source`]) and listens on its own distribution port, so packet-filter rules
    /// (`iptables`, OUTPUT chain, where loopback traffic passes) drop both directions of
    /// every connection between `node` and each other node, the ones it opened and the ones
    /// it accepted, and nothing else: clients still reach every node, and `rabbitmqctl`
    /// (from 127.0.0.1) still reaches them all. A node already cut is refused. The rules'
    /// own words; [`LocalBackend::heal_cut`] removes them.
    pub async fn cut_node(&mut self, node: usize) -> Result<String, BackendError> {
        self.node_target(node)?;
        if self.peers.is_empty() {
            return Err(BackendError::failed(format!("cutting broker node {node} off"), "one node has no peers to be cut off from"));
        }
        if self.cuts.iter().any(|(n, _)| *n == node) {
            return Err(BackendError::failed(format!("cutting broker node {node} off"), "it is cut off already (one partition of a node at a time)"));
        }
        let dist = |k: usize| self.broker_node_ref(k).ok().and_then(|s| s.var("RABBITMQ_DIST_PORT")).unwrap_or_default();
        let (me, my_port) = (dist_source(node), dist(node));
        let mut rules = Vec::new();
        for other in (1..=self.broker_nodes()).filter(|&k| k != node) {
            let (them, their_port) = (dist_source(other), dist(other));
            let tag = self.cut_tag(node, other);
            // The connection `node` opened to `other`, both ways; the one `other` opened to it.
            for (addr_flag, addr, port_flag, port) in [
                ("-s", me.as_str(), "--dport", their_port.as_str()),
                ("-d", me.as_str(), "--sport", their_port.as_str()),
                ("-s", them.as_str(), "--dport", my_port.as_str()),
                ("-d", them.as_str(), "--sport", my_port.as_str()),
            ] {
                rules.push(
                    [addr_flag, addr, "-p", "tcp", "-m", "tcp", port_flag, port, "-m", "comment", "--comment", tag.as_str(), "-j", "DROP"]
                        .map(str::to_owned)
                        .to_vec(),
                );
            }
        }
        for rule in rules {
            // Tracked before it is asked for: an insert that timed out may still be in. One
            // that was refused is not, and is no longer tracked.
            self.cuts.push((node, rule.clone()));
            if let Err(e) = iptables("-I", &rule).await {
                if !e.to_string().contains("no answer within") {
                    self.cuts.pop();
                }
                // Nothing half cut: the rules already in are taken out again.
                let _ = self.heal_cut(node).await;
                return Err(e);
            }
        }
        Ok(format!("node {node} cut off from its peers: its distribution port {my_port} and connections from {me} dropped both ways (iptables)"))
    }

    /// The packets `node`'s cut rules have dropped so far, per peer node (`iptables -L -v
    /// -x`, by each pair's comment); the cut stays.
    pub async fn cut_dropped(&self, node: usize) -> Result<Vec<(usize, u64)>, BackendError> {
        let out = iptables_output(&["-w", "5", "-L", "OUTPUT", "-v", "-x", "-n"]).await?;
        Ok((1..=self.broker_nodes())
            .filter(|&k| k != node)
            .map(|peer| {
                let tag = format!("/* {} */", self.cut_tag(node, peer));
                (peer, out.lines().filter(|l| l.contains(&tag)).filter_map(|l| l.split_whitespace().next()?.parse::<u64>().ok()).sum())
            })
            .collect())
    }

    /// The rules' comment for the cut between `node` and `peer`: the run's own directory
    /// name (`craig-chaos-<pid>-<nanos>`, so two runs in one process never share it) and the
    /// pair.
    fn cut_tag(&self, node: usize, peer: usize) -> String {
        let run = self.root.file_name().and_then(|n| n.to_str()).unwrap_or("craig-chaos-0");
        format!("{run}-node-{node}-peer-{peer}")
    }

    /// Heal `node`'s cut: the packets its rules dropped for each peer (read first: the
    /// evidence that the cut met real traffic on every pair), then every rule removed. A
    /// rule whose removal fails stays tracked, for the stop or drop to try again.
    pub async fn heal_cut(&mut self, node: usize) -> Result<Vec<(usize, u64)>, BackendError> {
        let dropped = self.cut_dropped(node).await;
        let mine: Vec<Vec<String>> = self.cuts.iter().filter(|(n, _)| *n == node).map(|(_, r)| r.clone()).collect();
        self.cuts.retain(|(n, _)| *n != node);
        let mut first = None;
        for rule in mine {
            if let Err(e) = iptables("-D", &rule).await {
                let e_text = e.to_string();
                let gone = ["does a matching rule exist", "No chain/target/match", "No such file or directory"].iter().any(|t| e_text.contains(t));
                if !gone {
                    self.cuts.push((node, rule));
                    first.get_or_insert(e);
                }
            }
        }
        match first {
            Some(e) => Err(e),
            None => dropped,
        }
    }

    /// Disk loss: remove broker node `node`'s data directory (its mnesia, message stores and
    /// quorum logs) while it is down. Refused while it runs.
    pub fn wipe_broker_node(&mut self, node: usize) -> Result<(), BackendError> {
        let server = self.server(self.node_target(node)?)?;
        if server.child.is_some() {
            return Err(BackendError::failed(format!("wiping broker node {node}"), "it is running; kill it first"));
        }
        let mnesia = server.var("RABBITMQ_MNESIA_BASE").map(PathBuf::from);
        let Some(mnesia) = mnesia else { return Err(BackendError::failed(format!("wiping broker node {node}"), "no data directory")) };
        std::fs::remove_dir_all(&mnesia)
            .and_then(|()| std::fs::create_dir_all(&mnesia))
            .map_err(|e| BackendError::failed(format!("wiping {}", mnesia.display()), e))
    }

    fn admin_url(&self) -> String {
        format!("postgres://postgres@127.0.0.1:{}/postgres", self.pg_port)
    }

    pub fn endpoints(&self) -> Endpoints {
        // With a standby (issue 26), every client reaches the primary by the database address.
        let db_port = self.standby.as_ref().map_or(self.pg_port, |s| s.vip.port);
        let (db, mq) = (format!("127.0.0.1:{db_port}"), format!("127.0.0.1:{}", self.rmq_port));
        let mut ep = Endpoints::loopback(&self.services, db_port, self.rmq_port, db, mq);
        ep.broker_nodes.extend(self.peers.iter().map(|(_, p)| format!("127.0.0.1:{p}")));
        ep
    }

    /// The temp dir holding data and logs (`pg.log`, `rabbitmq.log`).
    pub fn root(&self) -> &Path {
        &self.root
    }

    /// The server behind `t`; a broker node the broker does not have is an error (the
    /// scenario's parser holds broker-N to the cluster's nodes; a library caller may not).
    fn server(&mut self, t: Target) -> Result<&mut Server, BackendError> {
        let nodes = self.broker_nodes();
        match t.broker_node() {
            None => Ok(&mut self.pg),
            Some(1) => Ok(&mut self.rmq),
            Some(n) => self.peers.get_mut(n.wrapping_sub(2)).map(|(s, _)| s).ok_or_else(|| no_node(n, nodes)),
        }
    }

    /// How long one readiness attempt may take.
    const PROBE_BOUND: Duration = Duration::from_secs(3);

    async fn wait_ready(&mut self, t: Target, limit: Duration) -> Result<(), BackendError> {
        let deadline = Instant::now() + limit;
        self.server(t)?;
        let url = match t.broker_node() {
            None => self.admin_url(),
            Some(n) => self.broker_node_urls()[n - 1].clone(),
        };
        loop {
            let ready = match t {
                // Each attempt bounded: a server that accepts and never answers is not ready.
                Target::Database => match tokio::time::timeout(Self::PROBE_BOUND, sqlx::PgConnection::connect(&url)).await {
                    Ok(Ok(c)) => {
                        let _ = tokio::time::timeout(Self::PROBE_BOUND, c.close()).await;
                        true
                    }
                    _ => false,
                },
                Target::Broker | Target::BrokerNode(_) => match tokio::time::timeout(Self::PROBE_BOUND, craig_mq::publisher::connect(&url, 0, "chaos-probe")).await {
                    Ok(Ok(c)) => {
                        let _ = tokio::time::timeout(Self::PROBE_BOUND, c.close(200, "probe".into())).await;
                        true
                    }
                    _ => false,
                },
            };
            if ready {
                return Ok(());
            }
            let server = self.server(t)?;
            if let Some(status) = server.exited() {
                return Err(BackendError::failed(
                    format!("starting the private {} ({t})", server.name),
                    format!("it exited with {status}; last log lines:\n{}", log_tail(&server.log)),
                ));
            }
            if Instant::now() > deadline {
                return Err(BackendError::failed(
                    format!("starting the private {} ({t})", server.name),
                    format!("not ready after {limit:?}; last log lines:\n{}", log_tail(&server.log)),
                ));
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// The pid (group) that died; None when the server was not running.
    pub async fn kill(&mut self, t: Target) -> Result<Option<i32>, BackendError> {
        self.server(t)?.kill().await
    }

    pub async fn restart(&mut self, t: Target) -> Result<(), BackendError> {
        let s = self.server(t)?;
        if s.child.is_some() {
            s.kill().await?;
        }
        s.spawn()?;
        let limit = if t.broker_node().is_some() { Duration::from_secs(60) } else { Duration::from_secs(30) };
        self.wait_ready(t, limit).await
    }

    /// Issue 25: broker node `node` drained, as an operator's graceful rolling restart does
    /// it: `rabbitmq-upgrade drain` (maintenance mode: the quorum queues it leads hand their
    /// leadership to the other members, its client connections are closed and its listeners
    /// stopped; bounded, 120 s). It keeps running: [`LocalBackend::stop_broker_node`] next.
    pub async fn drain_broker_node(&self, node: usize) -> Result<(), BackendError> {
        Self::rabbitmq_cli_on(self.broker_node_ref(node)?, "rabbitmq-upgrade", &["drain"], Duration::from_secs(120)).await.map(drop)
    }

    /// Whether node `ask` reports broker node `node` under maintenance (`rabbitmqctl
    /// cluster_status`, "Maintenance status": "marked for maintenance"): a peer's word that a
    /// drain took effect.
    pub async fn under_maintenance(&self, ask: usize, node: usize) -> Result<bool, BackendError> {
        let name = self.broker_node_names().get(node - 1).cloned().ok_or_else(|| no_node(node, self.broker_nodes()))?;
        let out = self.rabbitmqctl_node(ask, &["cluster_status"]).await?;
        Ok(reports_maintenance(&out, &name))
    }

    /// SIGTERM to broker node `node` and a wait of at most 60 s for it to shut down by
    /// itself. Its exit status, or None when it had to be SIGKILLed (no graceful stop).
    /// Started again with [`LocalBackend::restart`], then [`LocalBackend::revive_broker_node`].
    pub async fn stop_broker_node(&mut self, node: usize) -> Result<Option<std::process::ExitStatus>, BackendError> {
        let s = self.server(Target::BrokerNode(node as u8))?;
        s.signal(Signal::SIGTERM)?;
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            if let Some(status) = s.exited() {
                // The rest of its group (the CLI helpers) goes with it.
                s.kill().await?;
                return Ok(Some(status));
            }
            if Instant::now() > deadline {
                s.kill().await?;
                return Ok(None);
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// Wait until broker node `node` is online in every quorum queue that lists it among its
    /// members (`rabbitmqctl list_queues name members online`, asked of that node every
    /// 250 ms; issue 25): a restarted node takes logins a while before its queue members
    /// are back. Bounded by `within`; the queues still without it otherwise.
    pub async fn await_members_online(&self, node: usize, within: Duration) -> Result<(), BackendError> {
        let me = self.broker_node_names().get(node - 1).cloned().ok_or_else(|| no_node(node, self.broker_nodes()))?;
        let deadline = Instant::now() + within;
        let mut last;
        loop {
            // Each listing bounded by what is left of `within` (at least a second).
            let left = deadline.saturating_duration_since(Instant::now()).max(Duration::from_secs(1));
            let listing = tokio::time::timeout(
                left,
                self.rabbitmqctl_node(node, &["list_queues", "--timeout", "10", "name", "type", "members", "online", "--formatter", "json"]),
            )
            .await
            .unwrap_or_else(|_| Err(BackendError::failed("list_queues", format!("no answer within {left:?}"))));
            match listing.map(|out| serde_json::from_str::<Vec<serde_json::Value>>(&out).map_err(|e| e.to_string())) {
                Ok(Ok(rows)) => {
                    let names = |v: &serde_json::Value| -> Vec<String> { v.as_array().map(|a| a.iter().filter_map(|m| m.as_str().map(str::to_owned)).collect()).unwrap_or_default() };
                    // Quorum queues only: a classic queue has no members to come back.
                    let missing: Vec<String> = rows
                        .iter()
                        .filter(|r| r["type"].as_str() == Some("quorum"))
                        .filter(|r| names(&r["members"]).contains(&me) && !names(&r["online"]).contains(&me))
                        .map(|r| r["name"].as_str().unwrap_or_default().to_owned())
                        .collect();
                    if missing.is_empty() {
                        return Ok(());
                    }
                    last = format!("not yet online in {}", missing.join(", "));
                }
                Ok(Err(e)) => last = format!("reading list_queues: {e}"),
                Err(e) => last = e.to_string(),
            }
            if Instant::now() > deadline {
                return Err(BackendError::failed(format!("broker node {node} back in its quorum queues within {within:?}"), last));
            }
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
    }

    /// `rabbitmq-upgrade revive` on broker node `node`, restarted after
    /// [`LocalBackend::drain_broker_node`]: out of maintenance mode (a no-op where the
    /// restart already brought it out).
    pub async fn revive_broker_node(&self, node: usize) -> Result<(), BackendError> {
        Self::rabbitmq_cli_on(self.broker_node_ref(node)?, "rabbitmq-upgrade", &["revive"], Self::CTL_BOUND).await.map(drop)
    }

    /// SIGSTOP / SIGCONT the server's process group; on a stop, the evidence: the kernel
    /// reports the group leader (postmaster, beam) stopped.
    pub async fn pause(&mut self, t: Target, paused: bool) -> Result<Option<String>, BackendError> {
        let s = self.server(t)?;
        s.signal(if paused { Signal::SIGSTOP } else { Signal::SIGCONT })?;
        let Some(pid) = s.pgid().map(Pid::as_raw).filter(|_| paused) else { return Ok(None) };
        Ok(crate::process::wait_stopped(pid).await.then(|| format!("pid {pid} (and its process group) stopped")))
    }

    /// Issue 26: a streaming standby of the database server, made from a base backup of
    /// the primary (`pg_basebackup` with a replication slot, as the `postgres` user), and the
    /// database address every client uses from now on ([`LocalBackend::endpoints`]). The
    /// standby's replication connection goes to the port [`LocalBackend::replication_link`]
    /// names, where the harness puts a fault-proxy link to the primary; it streams once
    /// that link exists ([`LocalBackend::start_replication`]). Before any client connects.
    pub async fn add_standby(&mut self, sync: bool) -> Result<(), BackendError> {
        if self.standby.is_some() {
            return Ok(());
        }
        let bindir = pg_bindir()?;
        let dir = self.root.join("pg-standby");
        std::fs::create_dir_all(&dir).map_err(|e| BackendError::failed("creating the standby's directory", e))?;
        let run_as = postgres_user()?;
        if let Some((uid, gid)) = run_as {
            nix::unistd::chown(&dir, Some(uid), Some(gid)).map_err(|e| BackendError::failed("chown the standby's directory", e))?;
        }
        let data = dir.join("data");
        let from = self.pg_port;
        let backup = {
            let (bindir, data, dir) = (bindir.clone(), data.clone(), dir.clone());
            tokio::task::spawn_blocking(move || base_backup(&bindir, run_as, from, &dir, &data)).await
        };
        match backup {
            Ok(r) => r?,
            Err(e) => return Err(BackendError::failed("running pg_basebackup", e)),
        }
        let replication = lease_port()?;
        // The base backup's own primary_conninfo points at the primary itself: the standby's
        // goes through the replication link instead.
        let auto = data.join("postgresql.auto.conf");
        let text = std::fs::read_to_string(&auto).map_err(|e| BackendError::failed(format!("reading {}", auto.display()), e))?;
        let mut kept: Vec<&str> = text.lines().filter(|l| !l.trim_start().starts_with("primary_conninfo") && !l.trim_start().starts_with("primary_slot_name")).collect();
        let conninfo = format!("primary_conninfo = 'host=127.0.0.1 port={} user=postgres application_name={STANDBY_NAME}'", replication.port());
        let slot = format!("primary_slot_name = '{STANDBY_NAME}'");
        kept.extend([conninfo.as_str(), slot.as_str()]);
        std::fs::write(&auto, kept.join("\n") + "\n").map_err(|e| BackendError::failed(format!("writing {}", auto.display()), e))?;
        let (mut server, port) = postgres_process("PostgreSQL standby", &bindir, run_as, &dir, &data, self.root.join("pg-standby.log"), &["wal_retrieve_retry_interval=100ms"])?;
        server.spawn()?;
        // A hot standby answers once it is consistent (the backup's own WAL takes it there).
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            if let Ok(c) = admin_conn(port).await {
                let _ = c.close().await;
                break;
            }
            if let Some(status) = server.exited() {
                return Err(BackendError::failed("starting the standby", format!("it exited with {status}; last log lines:\n{}", log_tail(&server.log))));
            }
            if Instant::now() > deadline {
                return Err(BackendError::failed("starting the standby", format!("not ready after 30 s; last log lines:\n{}", log_tail(&server.log))));
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let vip = Vip::start(format!("127.0.0.1:{}", self.pg_port)).await?;
        self.standby = Some(Standby { server, port, replication, vip, sync, promoted: false });
        Ok(())
    }

    /// The standby's replication link (issue 26): `(listen, upstream)`, where the fault
    /// proxy's `standby->database` link must listen and what it forwards to (the primary).
    pub fn replication_link(&self) -> Option<(String, String)> {
        self.standby.as_ref().filter(|s| !s.promoted).map(|s| (format!("127.0.0.1:{}", s.replication.port()), format!("127.0.0.1:{}", self.pg_port)))
    }

    /// Issue 26: once the replication link exists, the standby streaming in its mode, caught
    /// up, as the primary reports it ([`await_streaming`]).
    pub async fn start_replication(&self) -> Result<String, BackendError> {
        let sb = self.standby.as_ref().ok_or_else(|| BackendError::failed("starting replication", "the database has no standby"))?;
        await_streaming(self.pg_port, sb.sync, async || log_tail(&sb.server.log)).await
    }

    /// Issue 26: a watch on how far behind the primary reports its standby, while one
    /// streams (None: none, or promoted). It holds its own connection to the primary, so a
    /// sampler never needs the backend.
    pub fn replication_watch(&self) -> Option<ReplicationWatch> {
        self.standby.as_ref().filter(|s| !s.promoted).map(|_| ReplicationWatch::on(self.pg_port))
    }

    /// Issue 26, a failover as an operator's tooling does it: the primary SIGKILLed, the
    /// standby promoted (`pg_promote`, which applies all it received first), and the database
    /// address moved to it. The evidence is the servers' own: the old primary's process
    /// group gone, the standby's timeline before and the promoted server's after (it must
    /// have moved on), `pg_is_in_recovery()` false. Once: a second failover has no standby.
    pub async fn failover(&mut self) -> Result<Failover, BackendError> {
        let Some(sb) = self.standby.as_mut().filter(|s| !s.promoted) else {
            return Err(BackendError::failed("failing over", "the database has no standby (left)"));
        };
        let began = Instant::now();
        // `kill` sends the SIGKILL first, then waits until the group is reaped.
        let died_at_epoch_ms = chrono::Utc::now().timestamp_millis();
        let killed_pid = self.pg.kill().await?.ok_or_else(|| BackendError::failed("failing over", "the primary was not running"))?;
        let dead_after = began.elapsed();
        // Past the kill, a failure says so: the primary is gone and the standby may not be promoted.
        let after_kill = |e: BackendError| BackendError::failed(format!("failing over (the primary, pid {killed_pid}, was killed)"), e);
        let (timeline_before, timeline_after, replayed_until_db_ms) = promote(sb.port).await.map_err(after_kill)?;
        let now_at = format!("127.0.0.1:{}", sb.port);
        *sb.vip.upstream.lock().unwrap() = now_at.clone();
        sb.promoted = true;
        // The standby is the primary now: every later database fault and admin query is its.
        std::mem::swap(&mut self.pg, &mut sb.server);
        self.pg_port = sb.port;
        let old = std::mem::replace(
            &mut sb.server,
            Server { name: "PostgreSQL (replaced)", program: PathBuf::new(), args: vec![], env: vec![], cwd: self.root.clone(), run_as: None, log: self.root.join("pg.log"), child: None, _ports: vec![] },
        );
        self.retired.push(old);
        Ok(Failover { killed: format!("primary pid {killed_pid} (and its process group) died"), dead_after, died_at_epoch_ms, timeline_before, timeline_after, replayed_until_db_ms, sync: sb.sync, now_at })
    }

    pub async fn stop(mut self) -> Result<(), BackendError> {
        self.stopped = true;
        for (_, rule) in std::mem::take(&mut self.cuts) {
            let _ = iptables("-D", &rule).await;
        }
        let mut a = self.pg.kill().await.map(drop);
        if let Some(sb) = self.standby.as_mut() {
            a = a.and(sb.server.kill().await.map(drop));
        }
        let mut b = self.rmq.kill().await.map(drop);
        for (peer, _) in &mut self.peers {
            b = b.and(peer.kill().await.map(drop));
        }
        let c = std::fs::remove_dir_all(&self.root).map_err(|e| BackendError::failed(format!("removing {}", self.root.display()), e));
        a.and(b).and(c)
    }
}

impl Drop for LocalBackend {
    fn drop(&mut self) {
        for (_, rule) in std::mem::take(&mut self.cuts) {
            iptables_delete_now(&rule);
        }
        if !self.stopped {
            self.pg.kill_now();
            if let Some(sb) = self.standby.as_mut() {
                sb.server.kill_now();
            }
            self.rmq.kill_now();
            for (peer, _) in &mut self.peers {
                peer.kill_now();
            }
            let _ = std::fs::remove_dir_all(&self.root);
        }
    }
}

/// Where one queue's messages live (`LocalBackend::queue_placement`).
#[derive(Debug, Clone)]
pub struct QueuePlacement {
    pub name: String,
    /// `classic` or `quorum`.
    pub kind: String,
    /// The nodes holding its messages: a classic queue's one node, a quorum queue's members.
    pub nodes: Vec<String>,
    /// A quorum queue's leader (empty for classic).
    pub leader: String,
    pub messages: u64,
}

/// Whether `rabbitmqctl cluster_status` output reports node `name` under maintenance.
/// RabbitMQ 3.10 says "Node: <name>, status: marked for maintenance" (coloured) for a drained
/// node and "not under maintenance" for the others.
fn reports_maintenance(cluster_status: &str, name: &str) -> bool {
    cluster_status.lines().any(|l| {
        l.contains(&format!("Node: {name}, status:")) && (l.contains("marked for maintenance") || (l.contains("under maintenance") && !l.contains("not under")))
    })
}

fn no_node(node: usize, nodes: usize) -> BackendError {
    BackendError::failed(format!("broker node {node}"), format!("the broker has nodes 1..={nodes}"))
}

/// Remove `craig-chaos-<pid>-*` temp dirs whose harness process is gone (a run killed by
/// SIGKILL has no chance to clean up; its servers died with it through PDEATHSIG).
fn reap_leftovers() {
    reap_cuts();
    let Ok(entries) = std::fs::read_dir(std::env::temp_dir()) else { return };
    for e in entries.flatten() {
        let name = e.file_name();
        let Some(rest) = name.to_str().and_then(|n| n.strip_prefix("craig-chaos-")) else { continue };
        let Some(pid) = rest.split('-').next().and_then(|p| p.parse::<i32>().ok()) else { continue };
        if matches!(nix::sys::signal::kill(Pid::from_raw(pid), None), Err(nix::errno::Errno::ESRCH)) {
            let _ = std::fs::remove_dir_all(e.path());
        }
    }
}

/// `iptables -w <op> OUTPUT <rule>` (the partition of a cluster node), its error named.
async fn iptables(op: &str, rule: &[String]) -> Result<(), BackendError> {
    let mut args = vec!["-w".to_owned(), "5".to_owned(), op.to_owned(), "OUTPUT".to_owned()];
    args.extend(rule.iter().cloned());
    iptables_output(&args.iter().map(String::as_str).collect::<Vec<_>>()).await.map(drop)
}

async fn iptables_output(args: &[&str]) -> Result<String, BackendError> {
    let out = tokio::time::timeout(Duration::from_secs(10), tokio::process::Command::new("iptables").args(args).stdin(Stdio::null()).kill_on_drop(true).output())
        .await
        .map_err(|_| BackendError::failed(format!("iptables {}", args.join(" ")), "no answer within 10 s"))?
        .map_err(|e| BackendError::failed("running iptables (a partition between broker nodes needs it, as root)", e))?;
    if out.status.success() {
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    } else {
        Err(BackendError::failed(format!("iptables {}", args.join(" ")), String::from_utf8_lossy(&out.stderr).trim().to_owned()))
    }
}

/// `iptables -D OUTPUT <rule>`, blocking and best effort (a drop, the reaper): nothing to
/// report to.
fn iptables_delete_now<S: AsRef<std::ffi::OsStr>>(rule: impl IntoIterator<Item = S>) {
    let _ = Command::new("iptables").args(["-w", "5", "-D", "OUTPUT"]).args(rule).stdout(Stdio::null()).stderr(Stdio::null()).status();
}

/// Remove cut rules (`craig-chaos-<pid>-<nanos>-node-N-peer-M` comments) a run killed before its heal
/// left behind, where that run's process is gone.
fn reap_cuts() {
    let Ok(out) = Command::new("iptables").args(["-w", "5", "-S", "OUTPUT"]).stderr(Stdio::null()).output() else { return };
    for line in String::from_utf8_lossy(&out.stdout).lines() {
        let Some(at) = line.find("craig-chaos-") else { continue };
        let Some(pid) = line[at + "craig-chaos-".len()..].split('-').next().and_then(|p| p.parse::<i32>().ok()) else { continue };
        if !matches!(nix::sys::signal::kill(Pid::from_raw(pid), None), Err(nix::errno::Errno::ESRCH)) {
            continue;
        }
        let Some(rule) = line.strip_prefix("-A OUTPUT ") else { continue };
        iptables_delete_now(rule.split_whitespace());
    }
}

/// `initdb` into `data`, as `run_as`.
fn initdb(bindir: &Path, run_as: Option<(Uid, Gid)>, data: &Path) -> Result<(), BackendError> {
    let mut initdb = Command::new(bindir.join("initdb"));
    initdb.args(["-D", data.to_str().unwrap_or_default(), "-A", "trust", "-U", "postgres", "--no-sync", "-E", "UTF8"]);
    run_pg_tool(initdb, run_as, "initdb")
}

/// Run a PostgreSQL tool to its end as `run_as`; its stderr is the error where it fails.
fn run_pg_tool(mut cmd: Command, run_as: Option<(Uid, Gid)>, what: &str) -> Result<(), BackendError> {
    cmd.stdout(Stdio::null()).stderr(Stdio::piped());
    if let Some((uid, gid)) = run_as {
        cmd.uid(uid.as_raw()).gid(gid.as_raw());
    }
    let out = cmd.output().map_err(|e| BackendError::failed(format!("running {what}"), e))?;
    if !out.status.success() {
        return Err(BackendError::failed(what.to_owned(), String::from_utf8_lossy(&out.stderr)));
    }
    Ok(())
}

/// A fresh cluster in `data` (under `dir`, owned by `run_as`): a copy of one `initdb` made
/// once per machine (kept in the temp directory, keyed by the binaries' path, the `initdb`
/// binary's modification time, the user it runs as and the locale and time zone initdb
/// reads from the environment), since `initdb` is about 1.5 CPU-s of every scenario and its
/// output is the same each time; the copy is ~0.5 s. Without a template, this run's own
/// `initdb` (into `data`, before its server ever starts) is copied beside it, inside this
/// run's directory, and renamed into place: concurrent runs never see half of one, and a
/// run killed meanwhile leaves its part where the stale-run cleanup removes it. A template
/// that does not copy whole is moved aside and deleted, and this run falls back to `initdb`.
fn cluster_from_template(bindir: &Path, run_as: Option<(Uid, Gid)>, dir: &Path, data: &Path) -> Result<(), BackendError> {
    let key = {
        use std::hash::{Hash, Hasher};
        let mut h = std::collections::hash_map::DefaultHasher::new();
        bindir.hash(&mut h);
        std::fs::metadata(bindir.join("initdb")).and_then(|m| m.modified()).ok().hash(&mut h);
        run_as.map(|(u, g)| (u.as_raw(), g.as_raw())).hash(&mut h);
        Uid::effective().as_raw().hash(&mut h);
        let mut env: Vec<(String, String)> =
            std::env::vars().filter(|(k, _)| k == "LANG" || k == "TZ" || k.starts_with("LC_")).collect();
        env.sort();
        env.hash(&mut h);
        h.finish()
    };
    let template = std::env::temp_dir().join(format!("craig-chaos-initdb-template-{key:016x}"));
    let cp = |from: &Path, to: &Path| {
        // `cp -a` keeps the owner (the postgres user) and the data directory's 0700.
        Command::new("cp").arg("-a").arg(from).arg(to).stdout(Stdio::null()).stderr(Stdio::null()).status().is_ok_and(|s| s.success())
    };
    if template.join("data").join("PG_VERSION").exists() {
        if cp(&template.join("data"), dir) && data.join("PG_VERSION").exists() {
            return Ok(());
        }
        // A template that does not copy whole is no template.
        let _ = std::fs::remove_dir_all(data);
        discard(&template, dir);
        return initdb(bindir, run_as, data);
    }
    if template.exists() {
        // Left without its data (a temp cleaner, a hand): discarded so ours can take its place.
        discard(&template, dir);
    }
    initdb(bindir, run_as, data)?;
    let making = dir.join("template");
    if std::fs::create_dir(&making).is_ok() && cp(data, &making) && making.join("data").join("PG_VERSION").exists() {
        // Another run may have won the rename: its template is as good as ours.
        if std::fs::rename(&making, &template).is_ok() {
            return Ok(());
        }
    }
    let _ = std::fs::remove_dir_all(&making);
    Ok(())
}

/// A broken `template`, out of everyone's way first (a rename into this run's `dir` is
/// atomic), then deleted.
fn discard(template: &Path, dir: &Path) {
    let aside = dir.join("broken-template");
    if std::fs::rename(template, &aside).is_ok() {
        let _ = std::fs::remove_dir_all(&aside);
    }
}

/// The standby's name (issue 26): its `application_name`, its replication slot, and what
/// `synchronous_standby_names` lists when it is synchronous.
pub(super) const STANDBY_NAME: &str = "standby";

/// Who PostgreSQL runs as: the `postgres` user when the harness is root (initdb refuses root).
fn postgres_user() -> Result<Option<(Uid, Gid)>, BackendError> {
    if !Uid::effective().is_root() {
        return Ok(None);
    }
    let user = nix::unistd::User::from_name("postgres")
        .ok()
        .flatten()
        .ok_or_else(|| BackendError::Unavailable { backend: "local", why: "no postgres user".into() })?;
    Ok(Some((user.uid, user.gid)))
}

/// `pg_basebackup` of the server on `port` into `data` (issue 26): WAL streamed with it,
/// a replication slot created (the primary keeps the WAL the standby has yet to receive),
/// the standby's configuration written (`-R`), an immediate checkpoint.
fn base_backup(bindir: &Path, run_as: Option<(Uid, Gid)>, port: u16, cwd: &Path, data: &Path) -> Result<(), BackendError> {
    let mut c = Command::new(bindir.join("pg_basebackup"));
    c.args(["-h", "127.0.0.1", "-p", &port.to_string(), "-U", "postgres", "-D", data.to_str().unwrap_or_default()])
        .args(["-X", "stream", "-C", "-S", STANDBY_NAME, "-R", "--no-sync", "--checkpoint=fast"])
        .current_dir(cwd);
    run_pg_tool(c, run_as, "pg_basebackup")
}

fn pg_server(root: &Path) -> Result<(Server, u16), BackendError> {
    let bindir = pg_bindir()?;
    let dir = root.join("pg");
    std::fs::create_dir_all(&dir).map_err(|e| BackendError::failed("creating pg dir", e))?;
    let run_as = postgres_user()?;
    if let Some((uid, gid)) = run_as {
        nix::unistd::chown(&dir, Some(uid), Some(gid)).map_err(|e| BackendError::failed("chown pg dir", e))?;
    }
    let data = dir.join("data");
    cluster_from_template(&bindir, run_as, &dir, &data)?;
    postgres_process("PostgreSQL", &bindir, run_as, &dir, &data, root.join("pg.log"), &[])
}

/// A PostgreSQL server on `data` (sockets in `dir`, as `run_as`), on a leased port of its
/// own, not yet started: loopback only, `fsync=off` (module doc), plus `extra` settings.
fn postgres_process(
    name: &'static str,
    bindir: &Path,
    run_as: Option<(Uid, Gid)>,
    dir: &Path,
    data: &Path,
    log: PathBuf,
    extra: &[&str],
) -> Result<(Server, u16), BackendError> {
    let lease = lease_port()?;
    let port = lease.port();
    let mut args: Vec<String> = ["-D", data.to_str().unwrap_or_default(), "-p", &port.to_string(), "-k", dir.to_str().unwrap_or_default()]
        .iter()
        .map(|s| s.to_string())
        .collect();
    for setting in ["listen_addresses=127.0.0.1", "fsync=off", "max_connections=300", "shared_buffers=64MB"].iter().chain(extra) {
        args.extend(["-c".to_owned(), setting.to_string()]);
    }
    let server = Server {
        name,
        program: bindir.join("postgres"),
        args,
        env: vec![],
        cwd: dir.to_path_buf(),
        run_as,
        log,
        child: None,
        _ports: vec![lease],
    };
    Ok((server, port))
}

/// The definitions making `accounts` on the node under `root` listening on `port` (their
/// passwords derived from `root`), and their AMQP URLs.
fn account_definitions(root: &Path, port: u16, accounts: &[craig_sandbox::Account]) -> Result<(serde_json::Value, Vec<String>), BackendError> {
    let admin = format!("amqp://guest:guest@127.0.0.1:{port}/%2f");
    let root = root.display().to_string();
    craig_sandbox::definitions(accounts, "/", &admin, |name| craig_sandbox::sandbox_name(&format!("{root}/{name}")))
        .map_err(|e| BackendError::failed("service account URL", e))
}

/// What a fresh node holds before anything else connects (`load_definitions`): the vhost
/// `/`, the admin `guest` (a node that loads definitions at boot makes no default user)
/// and the fleet's service accounts (ADR-022 #1202), so no `rabbitmqctl` call (an Erlang VM
/// of its own) is needed to make them.
fn boot_definitions(root: &Path, port: u16) -> Result<serde_json::Value, BackendError> {
    let (accounts, _) = account_definitions(root, port, &super::fleet_accounts())?;
    let mut users = vec![serde_json::json!({
        "name": "guest",
        "password_hash": craig_sandbox::password_hash("guest", "guest"),
        "hashing_algorithm": "rabbit_password_hashing_sha256",
        "tags": ["administrator"],
    })];
    let mut permissions = vec![serde_json::json!({ "user": "guest", "vhost": "/", "configure": ".*", "write": ".*", "read": ".*" })];
    users.extend(accounts["users"].as_array().cloned().unwrap_or_default());
    permissions.extend(accounts["permissions"].as_array().cloned().unwrap_or_default());
    Ok(serde_json::json!({ "vhosts": [{ "name": "/" }], "users": users, "permissions": permissions }))
}

/// The node's plugins directory: RabbitMQ's own, without its optional plugins. The core
/// applications (rabbit, rabbit_common, rabbitmq_prelaunch and the libraries they use) share
/// that directory with ~50 plugins; the node enables none of them (`enabled_plugins` is
/// empty), yet at boot it reads every application there (their config schemas, their
/// modules' attributes), about 1.4 CPU-s of a 5-7 CPU-s boot measured here. A node whose
/// plugins are disabled runs the same code either way. None when the installation's layout
/// is not the one expected (then the node boots from the installation's own directory).
fn core_plugins_dir(script: &Path, dir: &Path) -> Option<PathBuf> {
    let installed = std::fs::canonicalize(script).ok()?.parent()?.parent()?.join("plugins");
    let entries = std::fs::read_dir(&installed).ok()?;
    let trimmed = dir.join("plugins");
    std::fs::create_dir_all(&trimmed).ok()?;
    let mut core = 0;
    for entry in entries.flatten() {
        let name = entry.file_name();
        let name = name.to_string_lossy();
        let plugin = name.starts_with("rabbitmq_") && !name.starts_with("rabbitmq_prelaunch-");
        if plugin || !entry.path().is_dir() {
            continue;
        }
        core += usize::from(name.starts_with("rabbit-") || name.starts_with("rabbit_common-") || name.starts_with("rabbitmq_prelaunch-"));
        let link = trimmed.join(&*name);
        if !link.exists() {
            std::os::unix::fs::symlink(entry.path(), &link).ok()?;
        }
    }
    (core == 3).then_some(trimmed)
}

/// Node `node` (1-based) of the run's broker: node 1 is the broker of a one-node run and the
/// node a cluster's peers join; it alone loads the boot definitions (the peers take the
/// cluster's users when they join). Every node of a run shares `cookie` (Erlang
/// distribution), written into its own HOME.
/// The loopback address broker node `index` of a cluster opens its distribution
/// connections from (`inet_dist_connect_options`), so a packet filter can tell the nodes
/// apart on one host ([`LocalBackend::cut_node`]): 127.0.0.(1 + index).
fn dist_source(index: usize) -> String {
    format!("127.0.0.{}", 1 + index)
}

fn rmq_server(root: &Path, index: usize, cookie: &str, cluster: bool) -> Result<(Server, u16), BackendError> {
    let script = rabbitmq_script()?;
    let dir = if index == 1 { root.join("rabbitmq") } else { root.join(format!("rabbitmq-{index}")) };
    for sub in ["mnesia", "log", "home"] {
        std::fs::create_dir_all(dir.join(sub)).map_err(|e| BackendError::failed("creating rabbitmq dirs", e))?;
    }
    let cookie_file = dir.join("home").join(".erlang.cookie");
    {
        use std::io::Write as _;
        use std::os::unix::fs::OpenOptionsExt as _;
        // Created owner-read-only: never readable by others, not even for a moment.
        std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o400)
            .open(&cookie_file)
            .and_then(|mut f| f.write_all(cookie.as_bytes()))
            .map_err(|e| BackendError::failed("writing the Erlang cookie", e))?;
    }
    let leases = vec![lease_port()?, lease_port()?];
    let (port, dist) = (leases[0].port(), leases[1].port());
    let conf = dir.join("rabbitmq.conf");
    let definitions = dir.join("definitions.json");
    let load = if index == 1 {
        std::fs::write(&definitions, boot_definitions(root, port)?.to_string()).map_err(|e| BackendError::failed("writing rabbitmq config", e))?;
        format!("load_definitions = {}\n", definitions.display())
    } else {
        String::new()
    };
    std::fs::write(&conf, format!("listeners.tcp.default = 127.0.0.1:{port}\nloopback_users = none\n{load}"))
        .and_then(|()| std::fs::write(dir.join("enabled_plugins"), "[].\n"))
        .and_then(|()| {
            // A cluster's node connects to its peers from its own loopback address.
            let kernel = if cluster { format!("{{kernel, [{{inet_dist_connect_options, [{{ip, {{127,0,0,{}}}}}]}}]}}", 1 + index) } else { String::new() };
            std::fs::write(dir.join("advanced.config"), format!("[{kernel}].\n"))
        })
        .and_then(|()| std::fs::write(dir.join("rabbitmq-env.conf"), ""))
        .map_err(|e| BackendError::failed("writing rabbitmq config", e))?;
    let p = |sub: &str| dir.join(sub).to_string_lossy().into_owned();
    let node = format!("chaos{}x{port}@localhost", std::process::id());
    let mut env: Vec<(String, String)> = vec![
        ("HOME".into(), p("home")),
        ("RABBITMQ_NODENAME".into(), node),
        ("RABBITMQ_NODE_PORT".into(), port.to_string()),
        ("RABBITMQ_DIST_PORT".into(), dist.to_string()),
        ("RABBITMQ_MNESIA_BASE".into(), p("mnesia")),
        ("RABBITMQ_LOG_BASE".into(), p("log")),
        ("RABBITMQ_CONFIG_FILE".into(), p("rabbitmq.conf")),
        ("RABBITMQ_ADVANCED_CONFIG_FILE".into(), p("advanced.config")),
        ("RABBITMQ_CONF_ENV_FILE".into(), p("rabbitmq-env.conf")),
        ("RABBITMQ_ENABLED_PLUGINS_FILE".into(), p("enabled_plugins")),
        ("RABBITMQ_PID_FILE".into(), p("rabbitmq.pid")),
        ("RUNNING_UNDER_SYSTEMD".into(), "true".into()),
    ];
    if let Some(plugins) = core_plugins_dir(&script, &dir) {
        env.push(("RABBITMQ_PLUGINS_DIR".into(), plugins.to_string_lossy().into_owned()));
    }
    let server = Server {
        name: "RabbitMQ",
        program: script,
        args: vec![],
        env,
        cwd: dir.clone(),
        run_as: None,
        log: if index == 1 { root.join("rabbitmq.log") } else { root.join(format!("rabbitmq-{index}.log")) },
        child: None,
        _ports: leases,
    };
    Ok((server, port))
}
