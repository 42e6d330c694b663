//! `external`: the servers named by `DATABASE_URL` and `AMQP_URL`, shared with whoever else
//! uses them. A run gets one fresh database per service and one fresh vhost (through
//! `craig-sandbox`), dropped at the end. Destructive faults are refused: killing a shared
//! server is not the harness's to do.

use craig_sandbox::Sandbox;

use super::{BackendError, Endpoints, Target};

pub struct ExternalBackend {
    sandbox: Sandbox,
    services: Vec<String>,
}

pub(crate) fn unsupported(fault: &'static str, target: Target) -> BackendError {
    BackendError::Unsupported {
        backend: "external",
        fault,
        target,
        why: "the servers are shared; use CHAOS_BACKEND=local (or containers) for destructive faults",
    }
}

impl ExternalBackend {
    pub async fn start(run_label: &str, services: &[&str]) -> Result<Self, BackendError> {
        let sandbox = Sandbox::create(&format!("chaos::{run_label}"), services)
            .await
            .map_err(|e| BackendError::Unavailable { backend: "external", why: e.to_string() })?;
        Ok(Self { sandbox, services: services.iter().map(|s| s.to_string()).collect() })
    }

    /// One account per service on the run's vhost (ADR-022 #1202); their AMQP URLs.
    pub async fn accounts(&mut self, accounts: &[craig_sandbox::Account]) -> Result<Vec<String>, BackendError> {
        self.sandbox.add_users(accounts).await.map_err(|e| BackendError::failed("creating the service accounts", e))
    }

    pub async fn set_policy(&self, name: &str, pattern: &str, definition: &serde_json::Value) -> Result<(), BackendError> {
        self.sandbox.set_policy(name, pattern, definition).await.map_err(|e| BackendError::failed("setting a queue policy", e))
    }

    pub async fn clear_policy(&self, name: &str) -> Result<(), BackendError> {
        self.sandbox.clear_policy(name).await.map_err(|e| BackendError::failed("clearing a queue policy", e))
    }

    pub async fn unacked(&self, queues: &[String]) -> Result<u64, BackendError> {
        self.sandbox.unacked(queues).await.map_err(|e| BackendError::failed("counting unacked deliveries", e))
    }

    pub fn endpoints(&self) -> Endpoints {
        let amqp = self.sandbox.amqp_url().to_owned();
        let db_addr = match self.services.first() {
            Some(s) => authority(self.sandbox.database_url(s)),
            None => authority(&std::env::var("DATABASE_URL").unwrap_or_else(|_| craig_sandbox::DEFAULT_DATABASE_URL.into())),
        };
        Endpoints {
            databases: self.services.iter().map(|s| (s.clone(), self.sandbox.database_url(s).to_owned())).collect(),
            broker_addr: authority(&amqp),
            broker_nodes: vec![authority(&amqp)],
            amqp_url: amqp,
            database_addr: db_addr,
        }
    }

    pub async fn stop(self) -> Result<(), BackendError> {
        self.sandbox.destroy().await.map_err(|e| BackendError::failed("removing the run's databases and vhost", e))
    }
}

/// `host:port` of a URL like `scheme://user:pass@host:port/path`.
pub(crate) fn authority(url: &str) -> String {
    let rest = url.split_once("://").map(|(_, r)| r).unwrap_or(url);
    let auth = rest.split(['/', '?']).next().unwrap_or(rest);
    auth.rsplit_once('@').map(|(_, h)| h).unwrap_or(auth).to_owned()
}

#[cfg(test)]
mod tests {
    #[test]
    fn authority_strips_credentials_and_path() {
        assert_eq!(super::authority("amqp://guest:guest@127.0.0.1:5672/v?heartbeat=5"), "127.0.0.1:5672");
        assert_eq!(super::authority("postgres://postgres@db:5432/x"), "db:5432");
    }
}
