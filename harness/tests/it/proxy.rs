//! The fault proxy against real sockets, driven only through its Toxiproxy HTTP API.
//! Every toxic in both directions, on a connection made before the toxic (live) and after
//! it (new). Delays are asserted as lower bounds only: a toxic must have delayed at least
//! this much; nothing here asserts speed.
//!
//! The API server is `chaos proxy --api` (issue 24: the Toxiproxy-API server the containers
//! backend runs, always: the official image keeps no counters), a process of its own, so the
//! client's whole toxic set runs against the server mode; `api_errors_and_reset_follow_toxiproxy`
//! also runs against the in-process server the runner uses.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use craig_chaos::proxy::{FaultProxy, Stream, Toxic, ToxicKind, ToxiproxyClient, api};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::net::tcp::OwnedWriteHalf;

/// A server whose side of each connection the test drives: it records what arrives (and
/// when) and writes on request.
struct Server {
    addr: String,
    conns: Arc<Mutex<Vec<ServerConn>>>,
}

#[derive(Clone)]
struct ServerConn {
    received: Arc<Mutex<Vec<u8>>>,
    reads: Arc<Mutex<usize>>,
    last_at: Arc<Mutex<Option<Instant>>>,
    ended: Arc<Mutex<Option<Result<(), std::io::ErrorKind>>>>,
    writer: Arc<tokio::sync::Mutex<OwnedWriteHalf>>,
}

impl Server {
    async fn start() -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        let conns: Arc<Mutex<Vec<ServerConn>>> = Arc::default();
        let registry = conns.clone();
        tokio::spawn(async move {
            while let Ok((sock, _)) = listener.accept().await {
                let (mut r, w) = sock.into_split();
                let conn = ServerConn {
                    received: Arc::default(),
                    reads: Arc::default(),
                    last_at: Arc::default(),
                    ended: Arc::default(),
                    writer: Arc::new(tokio::sync::Mutex::new(w)),
                };
                registry.lock().unwrap().push(conn.clone());
                tokio::spawn(async move {
                    let mut buf = [0u8; 4096];
                    loop {
                        match r.read(&mut buf).await {
                            Ok(0) => {
                                *conn.ended.lock().unwrap() = Some(Ok(()));
                                break;
                            }
                            Ok(n) => {
                                conn.received.lock().unwrap().extend_from_slice(&buf[..n]);
                                *conn.reads.lock().unwrap() += 1;
                                *conn.last_at.lock().unwrap() = Some(Instant::now());
                            }
                            Err(e) => {
                                *conn.ended.lock().unwrap() = Some(Err(e.kind()));
                                break;
                            }
                        }
                    }
                });
            }
        });
        Self { addr, conns }
    }

    async fn conn(&self, i: usize) -> ServerConn {
        wait_for(|| self.conns.lock().unwrap().len() > i).await;
        self.conns.lock().unwrap()[i].clone()
    }
}

impl ServerConn {
    async fn send(&self, bytes: &[u8]) -> std::io::Result<()> {
        self.writer.lock().await.write_all(bytes).await
    }
    async fn close(&self) {
        let _ = self.writer.lock().await.shutdown().await;
    }
    fn received(&self) -> Vec<u8> {
        self.received.lock().unwrap().clone()
    }
}

async fn wait_for(mut f: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while !f() {
        assert!(Instant::now() < deadline, "condition not reached within 10 s");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

struct Rig {
    api: ToxiproxyClient,
    listen: String,
    server: Server,
    /// `chaos proxy --api`, killed with the rig (None: the in-process server).
    _process: Option<tokio::process::Child>,
}

/// `chaos proxy --api 127.0.0.1:0 --seed 7` as a child process; its API address, read
/// from its readiness line (Toxiproxy's own words, which the containers backend waits for).
async fn server_mode() -> (String, tokio::process::Child) {
    use tokio::io::AsyncBufReadExt as _;
    let mut child = tokio::process::Command::new(env!("CARGO_BIN_EXE_chaos"))
        .args(["proxy", "--api", "127.0.0.1:0", "--seed", "7"])
        .stdout(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .expect("spawning chaos proxy");
    let mut lines = tokio::io::BufReader::new(child.stdout.take().unwrap()).lines();
    let line = tokio::time::timeout(Duration::from_secs(30), lines.next_line()).await.expect("readiness line in time").unwrap().expect("a line");
    let addr = line
        .strip_prefix("Starting Toxiproxy HTTP server on ")
        .and_then(|rest| rest.split_whitespace().next())
        .unwrap_or_else(|| panic!("unexpected readiness line {line:?}"))
        .to_owned();
    (addr, child)
}

async fn new_rig() -> Rig {
    let (api_addr, process) = server_mode().await;
    rig_on(api_addr, Some(process)).await
}

async fn in_process_rig() -> Rig {
    let (api_addr, _task) = api::serve(FaultProxy::new(7), "127.0.0.1:0".parse().unwrap()).await.unwrap();
    rig_on(api_addr.to_string(), None).await
}

async fn rig_on(api_addr: String, process: Option<tokio::process::Child>) -> Rig {
    let api = ToxiproxyClient::new(format!("http://{api_addr}"));
    let server = Server::start().await;
    let info = api.create_proxy("svc", &format!("127.0.0.1:{}", listen_port()), &server.addr).await.unwrap();
    Rig { api, listen: info.listen, server, _process: process }
}

/// A free port for the proxy's listener OUTSIDE the kernel's ephemeral range (as the local
/// backend's servers): a disabled proxy re-listens on its port when enabled or reset, and
/// while it is closed any outgoing connection on the machine may draw an ephemeral port as
/// its source port (seen: "Address already in use" at reset, beside other tests).
fn listen_port() -> u16 {
    craig_chaos::backend::local::free_port().expect("a free port outside the ephemeral range")
}

#[derive(Debug, Clone, Copy)]
enum When {
    /// Connection made before the toxic is added.
    Live,
    /// Connection made after.
    New,
}

/// Connect through the proxy with the toxic added at `when`; return the client stream and
/// the server side of the connection.
async fn connect_with(rig: &Rig, toxic: Toxic, when: When) -> (TcpStream, ServerConn) {
    let index = rig.server.conns.lock().unwrap().len();
    let mut client = None;
    if let When::Live = when {
        let c = TcpStream::connect(&rig.listen).await.unwrap();
        client = Some(c);
    }
    rig.api.add_toxic("svc", &toxic).await.unwrap();
    let client = match client {
        Some(c) => c,
        None => TcpStream::connect(&rig.listen).await.unwrap(),
    };
    let server = rig.server.conn(index).await;
    (client, server)
}

async fn read_exact_n(c: &mut TcpStream, n: usize) -> Vec<u8> {
    let mut buf = vec![0u8; n];
    tokio::time::timeout(Duration::from_secs(10), c.read_exact(&mut buf)).await.expect("data in time").unwrap();
    buf
}

/// Read until EOF or error; returns (bytes, how it ended).
async fn read_to_end(c: &mut TcpStream) -> (Vec<u8>, Result<(), std::io::ErrorKind>) {
    let mut out = Vec::new();
    let mut buf = [0u8; 4096];
    loop {
        match tokio::time::timeout(Duration::from_secs(10), c.read(&mut buf)).await.expect("end in time") {
            Ok(0) => return (out, Ok(())),
            Ok(n) => out.extend_from_slice(&buf[..n]),
            Err(e) => return (out, Err(e.kind())),
        }
    }
}

const BOTH: [When; 2] = [When::Live, When::New];

#[tokio::test]
async fn latency_delays_only_its_direction() {
    for when in BOTH {
        let rig = new_rig().await;
        let t = Toxic::new(Stream::Upstream, ToxicKind::Latency { latency: 300, jitter: 0 });
        let (mut c, s) = connect_with(&rig, t, when).await;
        let sent = Instant::now();
        c.write_all(b"up").await.unwrap();
        wait_for(|| s.received() == b"up").await;
        let up = s.last_at.lock().unwrap().unwrap() - sent;
        assert!(up >= Duration::from_millis(300), "{when:?}: upstream arrived after {up:?}");
        // Downstream is not delayed by an upstream toxic: both directions are checked by the
        // downstream case below; here, the server's reply still arrives intact.
        s.send(b"down").await.unwrap();
        assert_eq!(read_exact_n(&mut c, 4).await, b"down");

        let rig = new_rig().await;
        let t = Toxic::new(Stream::Downstream, ToxicKind::Latency { latency: 300, jitter: 50 });
        let (mut c, s) = connect_with(&rig, t, when).await;
        c.write_all(b"up").await.unwrap();
        wait_for(|| s.received() == b"up").await;
        let sent = Instant::now();
        s.send(b"down").await.unwrap();
        assert_eq!(read_exact_n(&mut c, 4).await, b"down");
        assert!(sent.elapsed() >= Duration::from_millis(250), "{when:?}: downstream after {:?}", sent.elapsed());
    }
}

#[tokio::test]
async fn bandwidth_limits_only_its_direction() {
    for when in BOTH {
        for dir in [Stream::Upstream, Stream::Downstream] {
            let rig = new_rig().await;
            let t = Toxic::new(dir, ToxicKind::Bandwidth { rate: 10 });
            let (mut c, s) = connect_with(&rig, t, when).await;
            let payload = vec![7u8; 5 * 1024];
            let started = Instant::now();
            match dir {
                Stream::Upstream => {
                    c.write_all(&payload).await.unwrap();
                    wait_for(|| s.received().len() == payload.len()).await;
                }
                Stream::Downstream => {
                    s.send(&payload).await.unwrap();
                    assert_eq!(read_exact_n(&mut c, payload.len()).await, payload);
                }
            }
            // 5 KiB at 10 KiB/s: at least 0.4 s (the first 100 ms piece goes at once).
            assert!(started.elapsed() >= Duration::from_millis(400), "{when:?} {dir:?}: {:?}", started.elapsed());
            assert_eq!(s.received().len() + if dir == Stream::Downstream { payload.len() } else { 0 }, payload.len());
        }
    }
}

#[tokio::test]
async fn slow_close_delays_the_close_in_its_direction() {
    for when in BOTH {
        // Downstream: the server closes; the client sees EOF only after the delay.
        let rig = new_rig().await;
        let t = Toxic::new(Stream::Downstream, ToxicKind::SlowClose { delay: 300 });
        let (mut c, s) = connect_with(&rig, t, when).await;
        s.send(b"bye").await.unwrap();
        let closed = Instant::now();
        s.close().await;
        let (bytes, end) = read_to_end(&mut c).await;
        assert_eq!((bytes.as_slice(), end), (&b"bye"[..], Ok(())));
        assert!(closed.elapsed() >= Duration::from_millis(300), "{when:?}: {:?}", closed.elapsed());

        // Upstream: the client half-closes; the server sees EOF only after the delay.
        let rig = new_rig().await;
        let t = Toxic::new(Stream::Upstream, ToxicKind::SlowClose { delay: 300 });
        let (mut c, s) = connect_with(&rig, t, when).await;
        c.write_all(b"bye").await.unwrap();
        let closed = Instant::now();
        c.shutdown().await.unwrap();
        wait_for(|| s.ended.lock().unwrap().is_some()).await;
        assert!(closed.elapsed() >= Duration::from_millis(300), "{when:?}: {:?}", closed.elapsed());
        assert_eq!(s.received(), b"bye");
    }
}

#[tokio::test]
async fn timeout_zero_black_holes_one_direction_until_removed() {
    for when in BOTH {
        for dir in [Stream::Upstream, Stream::Downstream] {
            let rig = new_rig().await;
            let t = Toxic::new(dir, ToxicKind::Timeout { timeout: 0 });
            let name = t.name.clone();
            let (mut c, s) = connect_with(&rig, t, when).await;
            // The blocked direction drops data; the other flows.
            c.write_all(b"up1").await.unwrap();
            s.send(b"dn1").await.unwrap();
            match dir {
                Stream::Upstream => {
                    assert_eq!(read_exact_n(&mut c, 3).await, b"dn1");
                    tokio::time::sleep(Duration::from_millis(200)).await;
                    assert_eq!(s.received(), b"", "{when:?}: upstream data must be dropped");
                }
                Stream::Downstream => {
                    wait_for(|| s.received() == b"up1").await;
                    let mut one = [0u8; 1];
                    let r = tokio::time::timeout(Duration::from_millis(200), c.read(&mut one)).await;
                    assert!(r.is_err(), "{when:?}: downstream data must be dropped, got {r:?}");
                }
            }
            // The proxy reports what the toxic acted on: the fault's evidence.
            let a = rig.api.proxy("svc").await.unwrap().affected[&name];
            assert_eq!((a.bytes, a.connections), (3, 1), "{when:?} {dir:?}");
            // Removing the toxic heals the live connection; dropped data stays dropped.
            rig.api.remove_toxic("svc", &name).await.unwrap();
            assert!(rig.api.proxy("svc").await.unwrap().affected.is_empty());
            c.write_all(b"up2").await.unwrap();
            s.send(b"dn2").await.unwrap();
            assert_eq!(read_exact_n(&mut c, 3).await, if dir == Stream::Upstream { *b"dn2" } else { *b"dn2" });
            wait_for(|| s.received().ends_with(b"up2")).await;
            let expect_up: &[u8] = if dir == Stream::Upstream { b"up2" } else { b"up1up2" };
            assert_eq!(s.received(), expect_up, "{when:?} {dir:?}");
        }
    }
}

#[tokio::test]
async fn timeout_with_a_deadline_closes_the_connection() {
    for when in BOTH {
        for dir in [Stream::Upstream, Stream::Downstream] {
            let rig = new_rig().await;
            let t = Toxic::new(dir, ToxicKind::Timeout { timeout: 200 });
            let (mut c, s) = connect_with(&rig, t, when).await;
            let started = Instant::now();
            let (bytes, _) = read_to_end(&mut c).await;
            assert!(bytes.is_empty());
            assert!(started.elapsed() >= Duration::from_millis(150), "{when:?} {dir:?}: {:?}", started.elapsed());
            wait_for(|| s.ended.lock().unwrap().is_some()).await;
        }
    }
}

#[tokio::test]
async fn reset_peer_resets_on_data_in_its_direction() {
    for when in BOTH {
        // Downstream: the server's data triggers an RST to the client.
        let rig = new_rig().await;
        let (mut c, s) = connect_with(&rig, Toxic::new(Stream::Downstream, ToxicKind::ResetPeer { timeout: 0 }), when).await;
        c.write_all(b"fine").await.unwrap();
        wait_for(|| s.received() == b"fine").await; // upstream unaffected
        s.send(b"boom").await.unwrap();
        let (bytes, end) = read_to_end(&mut c).await;
        assert!(bytes.is_empty(), "{when:?}: no data before the reset");
        assert_eq!(end, Err(std::io::ErrorKind::ConnectionReset), "{when:?}");

        // Upstream: the client's data triggers the reset, after the toxic's timeout.
        let rig = new_rig().await;
        let (mut c, s) = connect_with(&rig, Toxic::new(Stream::Upstream, ToxicKind::ResetPeer { timeout: 200 }), when).await;
        s.send(b"fine").await.unwrap();
        assert_eq!(read_exact_n(&mut c, 4).await, b"fine"); // downstream unaffected
        let sent = Instant::now();
        c.write_all(b"boom").await.unwrap();
        let (_, end) = read_to_end(&mut c).await;
        assert_eq!(end, Err(std::io::ErrorKind::ConnectionReset), "{when:?}");
        assert!(sent.elapsed() >= Duration::from_millis(200));
        assert_eq!(s.received(), b"", "{when:?}: the triggering data is not delivered");
    }
}

#[tokio::test]
async fn slicer_cuts_data_into_small_pieces_intact() {
    for when in BOTH {
        let payload: Vec<u8> = (0..2000u32).map(|i| (i % 251) as u8).collect();
        let rig = new_rig().await;
        let t = Toxic::new(Stream::Upstream, ToxicKind::Slicer { average_size: 10, size_variation: 5, delay: 10_000 });
        let (mut c, s) = connect_with(&rig, t, when).await;
        c.write_all(&payload).await.unwrap();
        wait_for(|| s.received().len() == payload.len()).await;
        assert_eq!(s.received(), payload);
        // At most 15 bytes a piece: at least 134 pieces; reads may coalesce a few. 10 ms
        // apart, so a reader that lags (a loaded CI machine: 2 ms apart gave 29 reads once)
        // still sees them apart.
        assert!(*s.reads.lock().unwrap() >= 40, "{when:?}: {} reads", s.reads.lock().unwrap());

        let rig = new_rig().await;
        let t = Toxic::new(Stream::Downstream, ToxicKind::Slicer { average_size: 10, size_variation: 5, delay: 10_000 });
        let (mut c, s) = connect_with(&rig, t, when).await;
        s.send(&payload).await.unwrap();
        let mut got = Vec::new();
        let mut reads = 0;
        let mut buf = [0u8; 4096];
        while got.len() < payload.len() {
            let n = c.read(&mut buf).await.unwrap();
            assert!(n > 0);
            got.extend_from_slice(&buf[..n]);
            reads += 1;
        }
        assert_eq!(got, payload);
        assert!(reads >= 40, "{when:?}: {reads} reads");
    }
}

#[tokio::test]
async fn limit_data_closes_after_exactly_the_limit() {
    for when in BOTH {
        let rig = new_rig().await;
        let (mut c, s) = connect_with(&rig, Toxic::new(Stream::Upstream, ToxicKind::LimitData { bytes: 10 }), when).await;
        c.write_all(b"0123456789abcdefghij").await.unwrap();
        let (_, _) = read_to_end(&mut c).await; // the proxy closes the connection
        wait_for(|| s.ended.lock().unwrap().is_some()).await;
        assert_eq!(s.received(), b"0123456789", "{when:?}");

        let rig = new_rig().await;
        let (mut c, s) = connect_with(&rig, Toxic::new(Stream::Downstream, ToxicKind::LimitData { bytes: 10 }), when).await;
        c.write_all(b"up").await.unwrap();
        wait_for(|| s.received() == b"up").await;
        s.send(b"0123456789abcdefghij").await.unwrap();
        let (bytes, _) = read_to_end(&mut c).await;
        assert_eq!(bytes, b"0123456789", "{when:?}");
    }
}

#[tokio::test]
async fn toxicity_zero_never_applies() {
    let rig = new_rig().await;
    let t = Toxic::new(Stream::Downstream, ToxicKind::LimitData { bytes: 1 }).toxicity(0.0);
    let name = t.name.clone();
    let (mut c, s) = connect_with(&rig, t, When::New).await;
    s.send(b"all of it").await.unwrap();
    assert_eq!(read_exact_n(&mut c, 9).await, b"all of it");
    // A toxic that applied to nothing has no evidence of taking effect.
    assert_eq!(rig.api.proxy("svc").await.unwrap().affected[&name], Default::default());
}

#[tokio::test]
async fn disabling_cuts_live_connections_and_refuses_new_ones_until_enabled() {
    let rig = new_rig().await;
    let mut live = TcpStream::connect(&rig.listen).await.unwrap();
    let s = rig.server.conn(0).await;
    live.write_all(b"hi").await.unwrap();
    wait_for(|| s.received() == b"hi").await;

    assert_eq!(rig.api.proxy("svc").await.unwrap().cut_connections, Some(0));
    let down = rig.api.set_enabled("svc", false).await.unwrap();
    assert_eq!(down.cut_connections, Some(1), "the down fault's evidence: the live connection it cut");
    let (_, _) = read_to_end(&mut live).await;
    assert!(TcpStream::connect(&rig.listen).await.is_err(), "a disabled proxy does not listen");

    let info = rig.api.set_enabled("svc", true).await.unwrap();
    assert_eq!(info.listen, rig.listen, "re-enabled on the same address");
    let mut again = TcpStream::connect(&rig.listen).await.unwrap();
    let s2 = rig.server.conn(1).await;
    s2.send(b"back").await.unwrap();
    assert_eq!(read_exact_n(&mut again, 4).await, b"back");
}

/// Issue 26: a failover moves the database address by a proxy's upstream (Toxiproxy's
/// `POST /proxies/{name}` with `upstream`): the connection to the old server is cut, every
/// new one reaches the new server, on the same address. Both the server mode and in process.
#[tokio::test]
async fn a_new_upstream_cuts_live_connections_and_leads_new_ones_there() {
    for rig in [new_rig().await, in_process_rig().await] {
        let mut live = TcpStream::connect(&rig.listen).await.unwrap();
        let old = rig.server.conn(0).await;
        live.write_all(b"old").await.unwrap();
        wait_for(|| old.received() == b"old").await;

        let promoted = Server::start().await;
        let info = rig.api.set_upstream("svc", &promoted.addr).await.unwrap();
        assert_eq!((info.upstream.as_str(), info.listen.as_str(), info.enabled), (promoted.addr.as_str(), rig.listen.as_str(), true), "{info:?}");
        assert_eq!(info.cut_connections, Some(1), "the connection to the old upstream is cut");
        let (_, _) = read_to_end(&mut live).await;

        let mut again = TcpStream::connect(&rig.listen).await.unwrap();
        again.write_all(b"new").await.unwrap();
        let s = promoted.conn(0).await;
        wait_for(|| s.received() == b"new").await;
        assert_eq!(rig.server.conns.lock().unwrap().len(), 1, "nothing new reached the old upstream");
        let missing = rig.api.set_upstream("nope", &promoted.addr).await.unwrap_err();
        assert!(missing.to_string().contains("404"), "{missing}");
        let empty = rig.api.set_upstream("svc", "").await.unwrap_err();
        assert!(empty.to_string().contains("400"), "{empty}");
    }
}

/// Disabled means closed by the time the answer comes (Toxiproxy closes its listener before
/// it answers): the accept task's abort used to drop the listener only when the runtime next
/// polled it, and a connect right after "disabled" was accepted (CI, 38ba52f). Many cycles,
/// in both the server process and in process, so the window is hit if it is there.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_disabled_or_deleted_proxy_is_closed_when_the_answer_comes() {
    for rig in [new_rig().await, in_process_rig().await] {
        for cycle in 0..100 {
            rig.api.set_enabled("svc", false).await.unwrap();
            assert!(TcpStream::connect(&rig.listen).await.is_err(), "cycle {cycle}: connected to a disabled proxy");
            rig.api.set_enabled("svc", true).await.unwrap();
        }
        rig.api.delete_proxy("svc").await.unwrap();
        assert!(TcpStream::connect(&rig.listen).await.is_err(), "connected to a deleted proxy");
    }
}

#[tokio::test]
async fn api_errors_and_reset_follow_toxiproxy() {
    for rig in [new_rig().await, in_process_rig().await] {
        api_errors_and_reset(rig).await;
    }
}

async fn api_errors_and_reset(rig: Rig) {
    assert_eq!(rig.api.version().await.unwrap(), api::VERSION);
    let dup = rig.api.create_proxy("svc", "127.0.0.1:0", &rig.server.addr).await.unwrap_err();
    assert!(dup.to_string().contains("409"), "{dup}");
    let missing = rig.api.proxy("nope").await.unwrap_err();
    assert!(missing.to_string().contains("404"), "{missing}");
    let t = Toxic::new(Stream::Downstream, ToxicKind::Latency { latency: 1, jitter: 0 });
    rig.api.add_toxic("svc", &t).await.unwrap();
    assert!(rig.api.add_toxic("svc", &t).await.unwrap_err().to_string().contains("409"));
    rig.api.set_enabled("svc", false).await.unwrap();
    rig.api.reset().await.unwrap();
    let info = rig.api.proxy("svc").await.unwrap();
    assert!(info.enabled && info.toxics.is_empty(), "{info:?}");
}

/// The server mode ends cleanly on SIGTERM (a container's stop), and a taken address is a
/// clear error with exit 2, not a panic.
#[tokio::test]
async fn server_mode_stops_on_sigterm_and_refuses_a_taken_address() {
    let (addr, mut child) = server_mode().await;
    let taken = std::process::Command::new(env!("CARGO_BIN_EXE_chaos")).args(["proxy", "--api", &addr]).output().unwrap();
    assert_eq!(taken.status.code(), Some(2), "{taken:?}");
    assert!(String::from_utf8_lossy(&taken.stderr).contains(&format!("cannot listen on {addr}")), "{taken:?}");
    let pid = child.id().unwrap().to_string();
    assert!(std::process::Command::new("kill").args(["-TERM", &pid]).status().unwrap().success());
    let status = tokio::time::timeout(Duration::from_secs(10), child.wait()).await.expect("exit in time").unwrap();
    assert_eq!(status.code(), Some(0));
}
