//! An in-process TCP fault proxy with Toxiproxy's model and HTTP API.
//!
//! The harness drives it ONLY through the HTTP API ([`client::ToxiproxyClient`]), so the
//! real Toxiproxy server (the `containers` backend runs `ghcr.io/shopify/toxiproxy`) is a
//! drop-in replacement. Supported: proxies with enable/disable ("down": listener closed and
//! live connections cut), and the toxics latency (+jitter), bandwidth, slow_close, timeout,
//! reset_peer, slicer and limit_data, each per direction with toxicity. Adding or removing
//! a toxic acts on live connections, in exactly the direction asked.
//!
//! Beyond Toxiproxy: `listen` may use port 0; the reply carries the bound address.

pub mod api;
pub mod client;
mod link;
pub mod toxic;

use std::collections::{BTreeMap, HashMap};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use serde::{Deserialize, Serialize};
use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

pub use client::ToxiproxyClient;
use link::ToxicSet;
pub use toxic::{Stream, Toxic, ToxicKind};

/// A proxy as the API shows it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ProxyInfo {
    pub name: String,
    pub listen: String,
    pub upstream: String,
    pub enabled: bool,
    #[serde(default)]
    pub toxics: Vec<Toxic>,
    /// What each present toxic has acted on so far (this proxy's extension of Toxiproxy's
    /// API; absent from a real Toxiproxy): a fault's evidence that it took effect.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub affected: BTreeMap<String, Affected>,
    /// Live connections cut by disabling the proxy or by a new upstream, over its lifetime
    /// (this proxy's extension too): a `down` fault's evidence (the difference across it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cut_connections: Option<u64>,
}

/// Bytes a toxic took in (dropped, delayed, sliced…) and connections it applied to;
/// `payload_bytes` leaves out chunks that are nothing but AMQP heartbeat frames (issue
/// 22.9: heartbeats alone would otherwise prove a toxic "acted").
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Affected {
    pub bytes: u64,
    pub connections: u64,
    #[serde(default)]
    pub payload_bytes: u64,
}

/// An AMQP 0-9-1 heartbeat frame: type 8, channel 0, size 0, frame end 0xCE.
const HEARTBEAT_FRAME: [u8; 8] = [8, 0, 0, 0, 0, 0, 0, 0xCE];

/// Whether `chunk` is one or more AMQP heartbeat frames and nothing else.
pub(crate) fn only_heartbeats(chunk: &[u8]) -> bool {
    !chunk.is_empty() && chunk.len() % 8 == 0 && chunk.chunks(8).all(|f| f == HEARTBEAT_FRAME)
}

/// Per-toxic counters of one proxy, shared with its connections' pumps, and its live and
/// cut connections.
#[derive(Default)]
pub(crate) struct Stats {
    by_toxic: Mutex<HashMap<String, Affected>>,
    pub(crate) live: AtomicU64,
    cut: AtomicU64,
}

impl Stats {
    pub(crate) fn charge(&self, toxic: &str, bytes: u64, connections: u64) {
        let mut m = self.by_toxic.lock().unwrap();
        let a = m.entry(toxic.to_owned()).or_default();
        a.bytes += bytes;
        a.connections += connections;
    }
    /// A chunk the toxic took in: counted as payload unless it is only heartbeats.
    pub(crate) fn charge_chunk(&self, toxic: &str, chunk: &[u8]) {
        let mut m = self.by_toxic.lock().unwrap();
        let a = m.entry(toxic.to_owned()).or_default();
        a.bytes += chunk.len() as u64;
        if !only_heartbeats(chunk) {
            a.payload_bytes += chunk.len() as u64;
        }
    }
    fn reset(&self, toxic: &str) {
        self.by_toxic.lock().unwrap().remove(toxic);
    }
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ProxyError {
    #[error("proxy {0} already exists")]
    Exists(String),
    #[error("proxy {0} not found")]
    NoProxy(String),
    #[error("toxic {0} not found")]
    NoToxic(String),
    #[error("toxic {0} already exists")]
    ToxicExists(String),
    #[error("bad request: {0}")]
    Bad(String),
    #[error("cannot listen on {addr}: {why}")]
    Listen { addr: String, why: String },
}

struct Proxy {
    listen: SocketAddr,
    upstream: String,
    enabled: bool,
    toxics: Vec<Toxic>,
    tx: watch::Sender<ToxicSet>,
    accept: Option<JoinHandle<()>>,
    /// Cancelling it cuts every live connection of this proxy.
    conns: CancellationToken,
    stats: Arc<Stats>,
}

impl Proxy {
    fn info(&self, name: &str) -> ProxyInfo {
        ProxyInfo {
            name: name.to_owned(),
            listen: self.listen.to_string(),
            upstream: self.upstream.clone(),
            enabled: self.enabled,
            toxics: self.toxics.clone(),
            affected: {
                let m = self.stats.by_toxic.lock().unwrap();
                self.toxics.iter().map(|t| (t.name.clone(), m.get(&t.name).copied().unwrap_or_default())).collect()
            },
            cut_connections: Some(self.stats.cut.load(Ordering::Relaxed)),
        }
    }

    fn publish(&self) {
        self.tx.send_replace(Arc::new(self.toxics.clone()));
    }

    /// Stops accepting and cuts live connections. The listener closes when the returned
    /// accept task has ended: await it (see [`closed`]) before answering, so a client told
    /// "disabled" or "deleted" can no longer connect (Toxiproxy closes its listener before
    /// it answers).
    #[must_use = "the listener is open until the accept task has ended"]
    fn stop(&mut self) -> Option<JoinHandle<()>> {
        let accept = self.accept.take();
        if let Some(h) = &accept {
            h.abort();
        }
        self.stats.cut.fetch_add(self.stats.live.load(Ordering::Relaxed), Ordering::Relaxed);
        self.conns.cancel();
        self.conns = CancellationToken::new();
        accept
    }
}

/// A proxy dropped with its registry (the API server stopped at the end of a run) stops
/// accepting and cuts its connections: its accept task would otherwise keep the listener
/// (and a file descriptor) for the life of the process.
impl Drop for Proxy {
    fn drop(&mut self) {
        if let Some(h) = self.accept.take() {
            h.abort();
        }
        self.conns.cancel();
    }
}

/// The proxy registry behind the HTTP API.
#[derive(Clone)]
pub struct FaultProxy {
    proxies: Arc<Mutex<HashMap<String, Proxy>>>,
    seed: u64,
    next_conn: Arc<AtomicU64>,
}

impl FaultProxy {
    /// `seed` drives jitter, slicing and toxicity draws (each connection gets a child seed).
    pub fn new(seed: u64) -> Self {
        Self { proxies: Arc::default(), seed, next_conn: Arc::default() }
    }

    pub fn list(&self) -> Vec<ProxyInfo> {
        let map = self.proxies.lock().unwrap();
        let mut v: Vec<_> = map.iter().map(|(n, p)| p.info(n)).collect();
        v.sort_by(|a, b| a.name.cmp(&b.name));
        v
    }

    pub fn get(&self, name: &str) -> Result<ProxyInfo, ProxyError> {
        let map = self.proxies.lock().unwrap();
        map.get(name).map(|p| p.info(name)).ok_or_else(|| ProxyError::NoProxy(name.into()))
    }

    pub async fn create(&self, name: &str, listen: &str, upstream: &str, enabled: bool) -> Result<ProxyInfo, ProxyError> {
        if name.is_empty() || upstream.is_empty() {
            return Err(ProxyError::Bad("name and upstream are required".into()));
        }
        if self.proxies.lock().unwrap().contains_key(name) {
            return Err(ProxyError::Exists(name.into()));
        }
        let listener = bind(listen).await?;
        let addr = listener.local_addr().map_err(|e| ProxyError::Listen { addr: listen.into(), why: e.to_string() })?;
        let (tx, _) = watch::channel(Arc::new(Vec::new()));
        let mut proxy = Proxy {
            listen: addr,
            upstream: upstream.to_owned(),
            enabled,
            toxics: Vec::new(),
            tx,
            accept: None,
            conns: CancellationToken::new(),
            stats: Arc::default(),
        };
        if enabled {
            proxy.accept = Some(self.spawn_accept(listener, &proxy));
        }
        let raced = {
            let mut map = self.proxies.lock().unwrap();
            if map.contains_key(name) {
                Err(proxy.stop())
            } else {
                let info = proxy.info(name);
                map.insert(name.to_owned(), proxy);
                Ok(info)
            }
        };
        match raced {
            Ok(info) => Ok(info),
            Err(accept) => {
                closed(accept).await;
                Err(ProxyError::Exists(name.into()))
            }
        }
    }

    pub async fn delete(&self, name: &str) -> Result<(), ProxyError> {
        let mut p = self.proxies.lock().unwrap().remove(name).ok_or_else(|| ProxyError::NoProxy(name.into()))?;
        closed(p.stop()).await;
        Ok(())
    }

    /// Enable or disable ("down"): disabling closes the listener and cuts live connections.
    pub async fn set_enabled(&self, name: &str, enabled: bool) -> Result<ProxyInfo, ProxyError> {
        let (listen, stopped) = {
            let mut map = self.proxies.lock().unwrap();
            let p = map.get_mut(name).ok_or_else(|| ProxyError::NoProxy(name.into()))?;
            if p.enabled == enabled {
                return Ok(p.info(name));
            }
            if enabled {
                (p.listen, None)
            } else {
                let accept = p.stop();
                p.enabled = false;
                (p.listen, Some((p.info(name), accept)))
            }
        };
        if let Some((info, accept)) = stopped {
            closed(accept).await;
            return Ok(info);
        }
        let listener = bind(&listen.to_string()).await?;
        let mut map = self.proxies.lock().unwrap();
        let p = map.get_mut(name).ok_or_else(|| ProxyError::NoProxy(name.into()))?;
        if !p.enabled {
            p.accept = Some(self.spawn_accept(listener, p));
            p.enabled = true;
        }
        Ok(p.info(name))
    }

    pub fn add_toxic(&self, proxy: &str, toxic: Toxic) -> Result<Toxic, ProxyError> {
        let toxic = toxic.normalized().map_err(ProxyError::Bad)?;
        let mut map = self.proxies.lock().unwrap();
        let p = map.get_mut(proxy).ok_or_else(|| ProxyError::NoProxy(proxy.into()))?;
        if p.toxics.iter().any(|t| t.name == toxic.name) {
            return Err(ProxyError::ToxicExists(toxic.name));
        }
        p.stats.reset(&toxic.name);
        p.toxics.push(toxic.clone());
        p.publish();
        tracing::info!(event = "proxy.toxic_added", proxy, toxic = %toxic.name, kind = toxic.kind.type_name(), stream = toxic.stream.as_str());
        Ok(toxic)
    }

    /// Replace a toxic's attributes (and toxicity), keeping its name, type and stream.
    pub fn update_toxic(&self, proxy: &str, name: &str, toxicity: Option<f32>, attributes: Option<serde_json::Value>) -> Result<Toxic, ProxyError> {
        let mut map = self.proxies.lock().unwrap();
        let p = map.get_mut(proxy).ok_or_else(|| ProxyError::NoProxy(proxy.into()))?;
        let t = p.toxics.iter_mut().find(|t| t.name == name).ok_or_else(|| ProxyError::NoToxic(name.into()))?;
        let mut updated = t.clone();
        if let Some(attrs) = attributes {
            let mut merged = serde_json::to_value(&updated).map_err(|e| ProxyError::Bad(e.to_string()))?;
            if let (Some(old), Some(new)) = (merged["attributes"].as_object_mut(), attrs.as_object()) {
                for (k, v) in new {
                    old.insert(k.clone(), v.clone());
                }
            }
            updated = serde_json::from_value(merged).map_err(|e| ProxyError::Bad(e.to_string()))?;
        }
        if let Some(p) = toxicity {
            updated.toxicity = p;
        }
        let updated = updated.normalized().map_err(ProxyError::Bad)?;
        *t = updated.clone();
        p.publish();
        Ok(updated)
    }

    pub fn remove_toxic(&self, proxy: &str, name: &str) -> Result<(), ProxyError> {
        let mut map = self.proxies.lock().unwrap();
        let p = map.get_mut(proxy).ok_or_else(|| ProxyError::NoProxy(proxy.into()))?;
        let before = p.toxics.len();
        p.toxics.retain(|t| t.name != name);
        if p.toxics.len() == before {
            return Err(ProxyError::NoToxic(name.into()));
        }
        p.publish();
        tracing::info!(event = "proxy.toxic_removed", proxy, toxic = name);
        Ok(())
    }

    /// A new upstream, as Toxiproxy's `POST /proxies/{name}` with `upstream`: an enabled
    /// proxy restarts (its listener closed and opened again, its live connections cut), so
    /// every connection from then on goes to the new upstream. Issue 26: how a failover
    /// moves the database address on the containers backend.
    pub async fn set_upstream(&self, name: &str, upstream: &str) -> Result<ProxyInfo, ProxyError> {
        if upstream.is_empty() {
            return Err(ProxyError::Bad("upstream is required".into()));
        }
        let enabled = {
            let mut map = self.proxies.lock().unwrap();
            let p = map.get_mut(name).ok_or_else(|| ProxyError::NoProxy(name.into()))?;
            if p.upstream == upstream {
                return Ok(p.info(name));
            }
            p.upstream = upstream.to_owned();
            p.enabled
        };
        if enabled {
            self.set_enabled(name, false).await?;
            return self.set_enabled(name, true).await;
        }
        self.get(name)
    }

    /// Toxiproxy's `/reset`: every proxy enabled, every toxic removed.
    pub async fn reset(&self) -> Result<(), ProxyError> {
        let names: Vec<String> = self.proxies.lock().unwrap().keys().cloned().collect();
        for name in names {
            {
                let mut map = self.proxies.lock().unwrap();
                if let Some(p) = map.get_mut(&name) {
                    p.toxics.clear();
                    p.publish();
                }
            }
            self.set_enabled(&name, true).await?;
        }
        Ok(())
    }

    fn spawn_accept(&self, listener: TcpListener, proxy: &Proxy) -> JoinHandle<()> {
        let upstream = proxy.upstream.clone();
        let rx = proxy.tx.subscribe();
        let conns = proxy.conns.clone();
        let stats = proxy.stats.clone();
        let seed = self.seed;
        let counter = self.next_conn.clone();
        tokio::spawn(async move {
            loop {
                let sock = match listener.accept().await {
                    Ok((sock, _)) => sock,
                    Err(_) => {
                        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
                        continue;
                    }
                };
                let n = counter.fetch_add(1, Ordering::Relaxed);
                let conn_seed = seed.wrapping_add(n.wrapping_mul(0x9e37_79b9_7f4a_7c15));
                tokio::spawn(link::run(sock, upstream.clone(), rx.clone(), conn_seed, conns.clone(), stats.clone()));
            }
        })
    }
}

/// Waits until a stopped accept task has ended, and with it its listener (an aborted task's
/// future is dropped when the runtime next polls it, which may be after abort returns).
async fn closed(accept: Option<JoinHandle<()>>) {
    if let Some(h) = accept {
        let _ = h.await;
    }
}

async fn bind(listen: &str) -> Result<TcpListener, ProxyError> {
    let err = |e: std::io::Error| ProxyError::Listen { addr: listen.into(), why: e.to_string() };
    let addr: SocketAddr = listen.parse().map_err(|_| ProxyError::Bad(format!("listen {listen:?} is not host:port")))?;
    let sock = if addr.is_ipv4() { tokio::net::TcpSocket::new_v4() } else { tokio::net::TcpSocket::new_v6() }.map_err(err)?;
    // Re-enabling must re-bind the same port while old connections drain.
    sock.set_reuseaddr(true).map_err(err)?;
    sock.bind(addr).map_err(err)?;
    sock.listen(1024).map_err(err)
}

#[cfg(test)]
mod heartbeat_tests {
    use super::{HEARTBEAT_FRAME, Stats, only_heartbeats};

    /// Issue 22.9: a toxic that only ever saw heartbeats acted on no payload.
    #[test]
    fn heartbeats_are_not_payload() {
        assert!(only_heartbeats(&HEARTBEAT_FRAME));
        assert!(only_heartbeats(&[HEARTBEAT_FRAME, HEARTBEAT_FRAME].concat()));
        assert!(!only_heartbeats(b""));
        assert!(!only_heartbeats(&[HEARTBEAT_FRAME.as_slice(), b"\x01\x00\x01"].concat()));
        let stats = Stats::default();
        stats.charge_chunk("t", &HEARTBEAT_FRAME);
        stats.charge_chunk("t", &HEARTBEAT_FRAME);
        let a = stats.by_toxic.lock().unwrap()["t"];
        assert_eq!((a.bytes, a.payload_bytes), (16, 0));
        stats.charge_chunk("t", b"\x01\x00\x01\x00\x00\x00\x05hello\xce");
        assert_eq!(stats.by_toxic.lock().unwrap()["t"].payload_bytes, 13);
    }
}
