//! Fleet replicas as real child processes: start with their own `--compat` modes and
//! `FAILPOINTS`, capture logs per replica, SIGKILL / SIGSTOP / SIGCONT / SIGTERM, restart.
//! A killed replica is reaped before anything reuses its slot, so "gone" means gone.
//!
//! The node program is the harness binary itself (`chaos craig-node …`, the same code as
//! `craig-node`, built with crash points), or `CRAIG_NODE_BIN` when set.

use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::{ExitStatus, Stdio};
use std::time::Duration;

use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::process::{Child, Command};

#[derive(Debug, thiserror::Error)]
pub enum ProcessError {
    #[error("replica {replica}: {what}: {why}")]
    Failed { replica: String, what: &'static str, why: String },
    #[error("replica {replica} is not running")]
    NotRunning { replica: String },
}

/// How to launch a node.
#[derive(Debug, Clone)]
pub struct NodeProgram {
    pub program: PathBuf,
    pub prefix: Vec<String>,
}

impl NodeProgram {
    /// `CRAIG_NODE_BIN`, else this executable with the `craig-node` subcommand.
    pub fn from_env() -> std::io::Result<Self> {
        match std::env::var_os("CRAIG_NODE_BIN") {
            Some(p) => Ok(Self { program: p.into(), prefix: vec![] }),
            None => Ok(Self { program: std::env::current_exe()?, prefix: vec!["craig-node".into()] }),
        }
    }

    /// A specific harness binary (tests use `CARGO_BIN_EXE_chaos`).
    pub fn harness(path: impl Into<PathBuf>) -> Self {
        Self { program: path.into(), prefix: vec!["craig-node".into()] }
    }
}

/// What one replica runs.
#[derive(Debug, Clone)]
pub struct ReplicaSpec {
    pub service: String,
    pub index: u32,
    pub compat: Vec<String>,
    /// `fail` crate grammar, e.g. `outbox::after_claim=return(abort)`.
    pub failpoints: Option<String>,
    pub env: Vec<(String, String)>,
}

impl ReplicaSpec {
    pub fn new(service: impl Into<String>, index: u32) -> Self {
        Self { service: service.into(), index, compat: vec![], failpoints: None, env: vec![] }
    }

    pub fn name(&self) -> String {
        format!("{}-{}", self.service, self.index)
    }
}

/// One running (or stopped) replica.
pub struct Replica {
    pub spec: ReplicaSpec,
    program: NodeProgram,
    log: PathBuf,
    child: Option<Child>,
    /// `host:port` of its HTTP listener, once started.
    pub addr: Option<String>,
    pub starts: u32,
}

impl Replica {
    pub fn new(spec: ReplicaSpec, program: NodeProgram, log_dir: &Path) -> Self {
        let log = log_dir.join(format!("{}.log", spec.name()));
        Self { spec, program, log, child: None, addr: None, starts: 0 }
    }

    pub fn name(&self) -> String {
        self.spec.name()
    }

    pub fn log_path(&self) -> &Path {
        &self.log
    }

    pub fn pid(&self) -> Option<i32> {
        self.child.as_ref().and_then(|c| c.id()).map(|p| p as i32)
    }

    fn err(&self, what: &'static str, why: impl std::fmt::Display) -> ProcessError {
        ProcessError::Failed { replica: self.name(), what, why: why.to_string() }
    }

    /// Spawn and wait until it prints its HTTP address (or dies trying).
    pub async fn start(&mut self) -> Result<(), ProcessError> {
        if self.child.is_some() {
            return Err(self.err("start", "already running"));
        }
        self.starts += 1;
        let mut log = std::fs::OpenOptions::new().create(true).append(true).open(&self.log).map_err(|e| self.err("opening log", e))?;
        use std::io::Write as _;
        let compat = if self.spec.compat.is_empty() { "-".to_owned() } else { self.spec.compat.join(",") };
        // The collector reads which behaviour each incarnation ran from this line.
        let _ = writeln!(log, "--- start {} of {} (compat {compat}) ---", self.starts, self.name());
        let mut cmd = Command::new(&self.program.program);
        cmd.args(&self.program.prefix)
            .args(["--service", &self.spec.service, "--http", "127.0.0.1:0"]);
        for c in &self.spec.compat {
            cmd.args(["--compat", c]);
        }
        cmd.envs(self.spec.env.iter().map(|(k, v)| (k, v)))
            .env_remove("FAILPOINTS")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(log.try_clone().map_err(|e| self.err("log", e))?)
            .kill_on_drop(true);
        if let Some(fp) = &self.spec.failpoints {
            cmd.env("FAILPOINTS", fp);
        }
        // SAFETY: prctl is async-signal-safe; see backend::local for the thread caveat.
        unsafe {
            cmd.pre_exec(|| {
                nix::sys::prctl::set_pdeathsig(Signal::SIGKILL).map_err(std::io::Error::from)?;
                Ok(())
            });
        }
        let mut child = cmd.spawn().map_err(|e| self.err("spawn", format!("{}: {e}", self.program.program.display())))?;
        let stdout = child.stdout.take().expect("piped stdout");
        let (tx, rx) = tokio::sync::oneshot::channel();
        let mut file = tokio::fs::File::from_std(log);
        tokio::spawn(async move {
            let mut lines = BufReader::new(stdout).lines();
            let mut tx = Some(tx);
            while let Ok(Some(line)) = lines.next_line().await {
                if let Some(addr) = line.strip_prefix("craig-node ").and_then(|l| l.split(" listening on ").nth(1)) {
                    if let Some(tx) = tx.take() {
                        let _ = tx.send(addr.to_owned());
                    }
                }
                let _ = file.write_all(format!("{line}\n").as_bytes()).await;
            }
        });
        self.child = Some(child);
        match tokio::time::timeout(Duration::from_secs(30), rx).await {
            Ok(Ok(addr)) => {
                self.addr = Some(addr);
                Ok(())
            }
            _ => {
                let status = self.kill().await.ok();
                Err(self.err("start", format!("no address printed (exit: {status:?}); see {}", self.log.display())))
            }
        }
    }

    pub fn signal(&self, sig: Signal) -> Result<(), ProcessError> {
        let pid = self.pid().ok_or_else(|| ProcessError::NotRunning { replica: self.name() })?;
        kill(Pid::from_raw(pid), sig).map_err(|e| self.err("signal", e))
    }

    /// SIGKILL and reap: when this returns, the pid is gone.
    pub async fn kill(&mut self) -> Result<ExitStatus, ProcessError> {
        let mut child = self.child.take().ok_or_else(|| ProcessError::NotRunning { replica: self.name() })?;
        let _ = child.start_kill();
        let status = child.wait().await.map_err(|e| self.err("wait", e))?;
        self.addr = None;
        Ok(status)
    }

    pub fn pause(&self) -> Result<(), ProcessError> {
        self.signal(Signal::SIGSTOP)
    }

    pub fn resume(&self) -> Result<(), ProcessError> {
        self.signal(Signal::SIGCONT)
    }

    /// SIGTERM, then wait up to `grace` for it to drain and exit; SIGKILL after that.
    pub async fn stop(&mut self, grace: Duration) -> Result<ExitStatus, ProcessError> {
        if self.child.is_none() {
            return Err(ProcessError::NotRunning { replica: self.name() });
        }
        let _ = self.signal(Signal::SIGCONT); // a paused process cannot handle SIGTERM
        self.signal(Signal::SIGTERM)?;
        match self.wait_exit(grace).await {
            Ok(status) => Ok(status),
            Err(_) => self.kill().await,
        }
    }

    /// Wait for the process to exit by itself (a crash point firing, say).
    pub async fn wait_exit(&mut self, limit: Duration) -> Result<ExitStatus, ProcessError> {
        let child = self.child.as_mut().ok_or_else(|| ProcessError::NotRunning { replica: self.spec.name() })?;
        match tokio::time::timeout(limit, child.wait()).await {
            Ok(Ok(status)) => {
                self.child = None;
                self.addr = None;
                Ok(status)
            }
            Ok(Err(e)) => Err(self.err("wait", e)),
            Err(_) => Err(self.err("wait", format!("still running after {limit:?}"))),
        }
    }

    /// Whether it exited on its own (without being waited for yet).
    pub fn exited(&mut self) -> Option<ExitStatus> {
        let status = self.child.as_mut()?.try_wait().ok().flatten()?;
        self.child = None;
        self.addr = None;
        Some(status)
    }

    /// Kill if running, then start again (same spec, same log file).
    pub async fn restart(&mut self) -> Result<(), ProcessError> {
        if self.child.is_some() {
            self.kill().await?;
        }
        self.start().await
    }
}

/// "exit 0", "killed by SIGABRT", … for logs and reports.
pub fn describe(status: ExitStatus) -> String {
    match (status.code(), status.signal()) {
        (Some(c), _) => format!("exit {c}"),
        (None, Some(s)) => Signal::try_from(s).map(|s| format!("killed by {s}")).unwrap_or_else(|_| format!("signal {s}")),
        _ => "unknown".into(),
    }
}

/// The kernel's word that `pid` is stopped (state `T` or `t` in `/proc/<pid>/stat`).
pub fn is_stopped(pid: i32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|st| st.rsplit_once(") ").and_then(|(_, rest)| rest.chars().next()))
        .is_some_and(|c| c == 'T' || c == 't')
}

/// Wait up to one second for SIGSTOP to land on `pid` (it lands asynchronously): the
/// evidence a pause fault took effect.
pub async fn wait_stopped(pid: i32) -> bool {
    for _ in 0..50 {
        if is_stopped(pid) {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    false
}

#[cfg(test)]
mod stopped_tests {
    use super::*;

    #[tokio::test]
    async fn a_stopped_process_is_seen_stopped_and_a_running_one_is_not() {
        let mut child = Command::new("sleep").arg("30").kill_on_drop(true).spawn().unwrap();
        let pid = child.id().unwrap() as i32;
        assert!(!is_stopped(pid));
        kill(Pid::from_raw(pid), Signal::SIGSTOP).unwrap();
        assert!(wait_stopped(pid).await);
        kill(Pid::from_raw(pid), Signal::SIGCONT).unwrap();
        child.kill().await.unwrap();
        assert!(!wait_stopped(i32::MAX).await, "no such process: never stopped");
    }
}
