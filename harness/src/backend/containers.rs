//! `containers`: PostgreSQL and RabbitMQ from testcontainers' modules, and a Toxiproxy
//! image as a generic image, on one Docker network. Runs only where a Docker engine answers
//! (ci/test starts the containers, restarts one and removes them where one does; scenario
//! runs on it are not wired yet: `runner::drive` refuses them).
//!
//! Images are settings (issue 24): `CHAOS_POSTGRES_IMAGE`, `CHAOS_RABBITMQ_IMAGE`,
//! `CHAOS_TOXIPROXY_IMAGE` (`name[:tag]`), the official images by default. Where no registry
//! answers, `ci/images/build` builds stand-ins that honour the interface used here (ports,
//! trust auth, the readiness lines) and prints these settings.
//!
//! Faults: kill = `docker stop -t 0` (SIGKILL), restart = `docker start` on the same
//! container (data kept), pause = `docker pause`. The host ports of a restarted container
//! can change; [`ContainersBackend::endpoints`] always reports the current ones.

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
/// Ports the Toxiproxy container exposes for proxies: database, broker.
pub const TOXIPROXY_DB_PORT: u16 = 8666;
pub const TOXIPROXY_BROKER_PORT: u16 = 8667;
/// Container names on the run's network (Toxiproxy's upstreams).
pub const POSTGRES_HOST: &str = "craig-postgres";
pub const RABBITMQ_HOST: &str = "craig-rabbitmq";

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

/// Whether a Docker engine answers (`DOCKER_HOST` or `/var/run/docker.sock`).
pub async fn probe() -> Result<(), String> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let host = std::env::var("DOCKER_HOST").unwrap_or_else(|_| "unix:///var/run/docker.sock".into());
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
        Ok(Ok(buf)) if String::from_utf8_lossy(&buf).contains("OK") => Ok(()),
        Ok(Ok(_)) => Err(format!("the Docker engine at {host} did not answer /_ping with OK")),
        Ok(Err(e)) => Err(format!("no Docker engine at {host} ({e}); install and start Docker to use this backend")),
        Err(_) => Err(format!("the Docker engine at {host} did not answer within 3 s")),
    }
}

pub fn postgres_request(network: &str, image: &ImageRef) -> ContainerRequest<Postgres> {
    Postgres::default()
        .with_host_auth()
        .with_name(image.name.clone())
        .with_tag(image.tag.clone())
        .with_network(network)
        .with_container_name(format!("{POSTGRES_HOST}-{network}"))
        .with_startup_timeout(Duration::from_secs(60))
}

pub fn rabbitmq_request(network: &str, image: &ImageRef) -> ContainerRequest<RabbitMq> {
    RabbitMq::default()
        .with_name(image.name.clone())
        .with_tag(image.tag.clone())
        .with_network(network)
        .with_container_name(format!("{RABBITMQ_HOST}-{network}"))
        .with_startup_timeout(Duration::from_secs(90))
}

/// The official Toxiproxy image, or `craig-chaos/toxiproxy-api` (`chaos proxy --api
/// 0.0.0.0:8474` as its entrypoint): the same API, ports and readiness line.
pub fn toxiproxy_request(network: &str, image: &ImageRef) -> ContainerRequest<GenericImage> {
    GenericImage::new(image.name.clone(), image.tag.clone())
        .with_exposed_port(TOXIPROXY_API_PORT.tcp())
        .with_exposed_port(TOXIPROXY_DB_PORT.tcp())
        .with_exposed_port(TOXIPROXY_BROKER_PORT.tcp())
        .with_wait_for(WaitFor::message_on_either_std("Starting Toxiproxy HTTP server"))
        .with_network(network)
        .with_container_name(format!("craig-toxiproxy-{network}"))
        .with_startup_timeout(Duration::from_secs(60))
}

pub struct ContainersBackend {
    network: String,
    postgres: ContainerAsync<Postgres>,
    rabbitmq: ContainerAsync<RabbitMq>,
    toxiproxy: ContainerAsync<GenericImage>,
    services: Vec<String>,
    pg_port: u16,
    amqp_port: u16,
}

fn tc(what: &str) -> impl Fn(testcontainers::TestcontainersError) -> BackendError + '_ {
    move |e| BackendError::failed(what.to_owned(), e)
}

impl ContainersBackend {
    pub async fn start(services: &[&str]) -> Result<Self, BackendError> {
        let images = Images::from_env()?;
        let network = format!("craig-chaos-{}", std::process::id());
        let postgres = postgres_request(&network, &images.postgres).start().await.map_err(tc("starting the postgres container"))?;
        let rabbitmq = rabbitmq_request(&network, &images.rabbitmq).start().await.map_err(tc("starting the rabbitmq container"))?;
        let toxiproxy = toxiproxy_request(&network, &images.toxiproxy).start().await.map_err(tc("starting the toxiproxy container"))?;
        let mut b = Self {
            network,
            postgres,
            rabbitmq,
            toxiproxy,
            services: services.iter().map(|s| s.to_string()).collect(),
            pg_port: 0,
            amqp_port: 0,
        };
        b.refresh_ports().await?;
        super::create_databases(b.pg_port, &b.services).await?;
        Ok(b)
    }

    async fn refresh_ports(&mut self) -> Result<(), BackendError> {
        self.pg_port = self.postgres.get_host_port_ipv4(5432).await.map_err(tc("postgres port"))?;
        self.amqp_port = self.rabbitmq.get_host_port_ipv4(5672).await.map_err(tc("rabbitmq port"))?;
        Ok(())
    }

    pub fn endpoints(&self) -> Endpoints {
        // Toxiproxy reaches the servers by container name on the run's network.
        let db = format!("{POSTGRES_HOST}-{}:5432", self.network);
        let mq = format!("{RABBITMQ_HOST}-{}:5672", self.network);
        Endpoints::loopback(&self.services, self.pg_port, self.amqp_port, db, mq)
    }

    /// The run's Docker network (`craig-chaos-<pid>`); every container's name ends with it.
    pub fn network(&self) -> &str {
        &self.network
    }

    /// The Toxiproxy API base URL on the host.
    pub async fn toxiproxy_api(&self) -> Result<String, BackendError> {
        let port = self.toxiproxy.get_host_port_ipv4(TOXIPROXY_API_PORT).await.map_err(tc("toxiproxy port"))?;
        Ok(format!("http://127.0.0.1:{port}"))
    }

    async fn container_op(&self, t: Target, op: &'static str) -> Result<(), BackendError> {
        let what = format!("{op} the {t} container");
        let r = match (t, op) {
            (Target::Database, "kill") => self.postgres.stop_with_timeout(Some(0)).await,
            (Target::Broker, "kill") => self.rabbitmq.stop_with_timeout(Some(0)).await,
            (Target::Database, "start") => self.postgres.start().await,
            (Target::Broker, "start") => self.rabbitmq.start().await,
            (Target::Database, "pause") => self.postgres.pause().await,
            (Target::Broker, "pause") => self.rabbitmq.pause().await,
            (Target::Database, _) => self.postgres.unpause().await,
            (Target::Broker, _) => self.rabbitmq.unpause().await,
        };
        r.map_err(|e| BackendError::failed(what, e))
    }

    pub async fn kill(&mut self, t: Target) -> Result<(), BackendError> {
        self.container_op(t, "kill").await
    }

    pub async fn restart(&mut self, t: Target) -> Result<(), BackendError> {
        self.container_op(t, "start").await?;
        self.refresh_ports().await
    }

    pub async fn pause(&mut self, t: Target, paused: bool) -> Result<(), BackendError> {
        self.container_op(t, if paused { "pause" } else { "unpause" }).await
    }

    pub async fn stop(self) -> Result<(), BackendError> {
        let a = self.toxiproxy.rm().await;
        let b = self.rabbitmq.rm().await;
        let c = self.postgres.rm().await;
        a.and(b).and(c).map_err(|e| BackendError::failed("removing containers", e))
    }
}

#[cfg(test)]
mod tests {
    use testcontainers::Image;

    use super::*;

    #[test]
    fn postgres_wiring() {
        let r = postgres_request("net1", &Images::default().postgres);
        assert_eq!(r.image().name(), "postgres");
        assert_eq!(r.descriptor(), format!("postgres:{POSTGRES_TAG}"));
        assert_eq!(r.network().as_deref(), Some("net1"));
        assert_eq!(r.container_name().as_deref(), Some("craig-postgres-net1"));
        let env: Vec<_> = r.env_vars().map(|(k, v)| (k.into_owned(), v.into_owned())).collect();
        assert!(env.contains(&("POSTGRES_HOST_AUTH_METHOD".into(), "trust".into())), "{env:?}");
        assert!(format!("{:?}", r.ready_conditions()).contains("ready to accept connections"));
    }

    #[test]
    fn rabbitmq_wiring() {
        let r = rabbitmq_request("net1", &Images::default().rabbitmq);
        assert_eq!(r.descriptor(), format!("rabbitmq:{RABBITMQ_TAG}"));
        assert_eq!(r.container_name().as_deref(), Some("craig-rabbitmq-net1"));
        assert!(format!("{:?}", r.ready_conditions()).contains("Server startup complete"));
    }

    #[test]
    fn toxiproxy_wiring() {
        let r = toxiproxy_request("net1", &Images::default().toxiproxy);
        assert_eq!(r.descriptor(), format!("{TOXIPROXY_IMAGE}:{TOXIPROXY_TAG}"));
        let ports: Vec<u16> = r.expose_ports().iter().map(|p| p.as_u16()).collect();
        assert_eq!(ports, [TOXIPROXY_API_PORT, TOXIPROXY_DB_PORT, TOXIPROXY_BROKER_PORT]);
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
        let r = postgres_request("net1", &stand_ins.postgres);
        assert_eq!(r.descriptor(), "craig-chaos/postgres:15");
        assert_eq!(toxiproxy_request("net1", &stand_ins.toxiproxy).descriptor(), "craig-chaos/toxiproxy-api:dev");
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
