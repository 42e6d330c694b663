//! One proxied connection: two pumps (upstream = client → server, downstream = server →
//! client), each applying only the toxics of its own direction, re-read live whenever the
//! proxy's toxic set changes. Both legs run with TCP_NODELAY.
//!
//! A pump never sleeps outside its `select!`: delays are due times on queued pieces, so a
//! toxic added or removed takes effect on a live connection at once.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::time::Duration;

use rand::{RngExt, SeedableRng};
use rand_chacha::ChaCha8Rng;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::sync::watch;
use tokio::time::{Instant, sleep_until};
use tokio_util::sync::CancellationToken;

use super::toxic::{Stream, Toxic, ToxicKind};

pub type ToxicSet = Arc<Vec<Toxic>>;

/// How a pump ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum End {
    /// Source closed; sink half-closed after any slow_close delay.
    Eof,
    /// A toxic closed the whole connection (timeout, limit_data) or a socket failed.
    Close,
    /// reset_peer: close both sockets with RST.
    Reset,
    /// The other pump or the proxy ended the connection.
    Aborted,
}

/// Run one proxied connection to completion.
pub(crate) async fn run(
    client: TcpStream,
    upstream: String,
    toxics: watch::Receiver<ToxicSet>,
    seed: u64,
    kill: CancellationToken,
    stats: Arc<super::Stats>,
) {
    // A connection still reaching its upstream is cut like a live one (a `down`, a delete, a
    // new upstream): a connect to a server that died without a reset (a killed container's
    // address) would otherwise hold the client for the kernel's whole SYN retry, minutes.
    let connect = tokio::select! {
        r = TcpStream::connect(&upstream) => r,
        () = kill.cancelled() => return,
    };
    let server = match connect {
        Ok(s) => s,
        Err(e) => {
            tracing::debug!(event = "proxy.upstream_unreachable", %upstream, error = %e);
            return;
        }
    };
    let _ = client.set_nodelay(true);
    let _ = server.set_nodelay(true);
    let (mut cr, mut cw) = client.into_split();
    let (mut sr, mut sw) = server.into_split();
    let stop = kill.child_token();
    // Counted live while both sides are connected (a `down` cuts what is live).
    struct Live(Arc<super::Stats>);
    impl Drop for Live {
        fn drop(&mut self) {
            self.0.live.fetch_sub(1, std::sync::atomic::Ordering::Relaxed);
        }
    }
    stats.live.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let _live = Live(stats.clone());
    let up = Pump::new(Stream::Upstream, toxics.clone(), seed, stats.clone());
    let down = Pump::new(Stream::Downstream, toxics, seed ^ 0x9e37_79b9_7f4a_7c15, stats);
    let (a, b) = tokio::join!(
        async {
            let end = up.run(&mut cr, &mut sw, &stop).await;
            if end != End::Eof {
                stop.cancel();
            }
            end
        },
        async {
            let end = down.run(&mut sr, &mut cw, &stop).await;
            if end != End::Eof {
                stop.cancel();
            }
            end
        }
    );
    if a == End::Reset || b == End::Reset {
        // Dropping a write half sends FIN first; reunite so the close is a bare RST.
        for (r, w) in [(cr, cw), (sr, sw)] {
            if let Ok(stream) = r.reunite(w) {
                let _ = socket2::SockRef::from(&stream).set_linger(Some(Duration::ZERO));
            }
        }
    }
}

/// Max queued chunks before the pump stops reading (back-pressure).
const QUEUE_CAP: usize = 64;

struct Pump {
    dir: Stream,
    ctl: watch::Receiver<ToxicSet>,
    rng: ChaCha8Rng,
    /// Per-connection toxicity draw, once per toxic name (Toxiproxy's model).
    drawn: HashMap<String, (f32, bool)>,
    active: Vec<ToxicKind>,
    queue: VecDeque<(Instant, Vec<u8>)>,
    last_due: Instant,
    written: u64,
    /// limit_data: bytes written when the toxic became active on this connection.
    limit_base: Option<u64>,
    timeout_at: Option<Instant>,
    reset_at: Option<Instant>,
    stats: Arc<super::Stats>,
}

impl Pump {
    fn new(dir: Stream, ctl: watch::Receiver<ToxicSet>, seed: u64, stats: Arc<super::Stats>) -> Self {
        let mut p = Self {
            dir,
            ctl,
            rng: ChaCha8Rng::seed_from_u64(seed),
            drawn: HashMap::new(),
            active: Vec::new(),
            queue: VecDeque::new(),
            last_due: Instant::now(),
            written: 0,
            limit_base: None,
            timeout_at: None,
            reset_at: None,
            stats,
        };
        p.refresh();
        p
    }

    fn has(&self, f: impl Fn(&ToxicKind) -> bool) -> bool {
        self.active.iter().any(f)
    }

    /// Re-read the toxic set: keep this connection's toxicity draws, arm or disarm the
    /// timers, flush queued data when no delaying toxic is left.
    fn refresh(&mut self) {
        let set = self.ctl.borrow_and_update().clone();
        let before_timeout = self.has(|k| matches!(k, ToxicKind::Timeout { .. }));
        let before_limit = self.has(|k| matches!(k, ToxicKind::LimitData { .. }));
        self.active.clear();
        let mut seen = Vec::new();
        for t in set.iter().filter(|t| t.stream == self.dir) {
            seen.push(t.name.clone());
            let applies = match self.drawn.get(&t.name) {
                Some((p, applies)) if *p == t.toxicity => *applies,
                _ => {
                    let applies = t.toxicity >= 1.0 || self.rng.random::<f32>() < t.toxicity;
                    self.drawn.insert(t.name.clone(), (t.toxicity, applies));
                    if applies {
                        self.stats.charge(&t.name, 0, 1);
                    }
                    applies
                }
            };
            if applies {
                self.active.push(t.kind.clone());
            }
        }
        self.drawn.retain(|name, _| seen.contains(name));
        let now = Instant::now();
        let timeout = self.active.iter().find_map(|k| match k {
            ToxicKind::Timeout { timeout } => Some(*timeout),
            _ => None,
        });
        match timeout {
            Some(0) => self.timeout_at = None,
            Some(ms) if !before_timeout => self.timeout_at = Some(now + Duration::from_millis(ms)),
            Some(_) => {}
            None => self.timeout_at = None,
        }
        if !self.has(|k| matches!(k, ToxicKind::ResetPeer { .. })) {
            self.reset_at = None;
        }
        let limit = self.has(|k| matches!(k, ToxicKind::LimitData { .. }));
        if limit && !before_limit {
            self.limit_base = Some(self.written);
        } else if !limit {
            self.limit_base = None;
        }
        let delaying = self.has(|k| {
            matches!(k, ToxicKind::Latency { .. } | ToxicKind::Bandwidth { .. } | ToxicKind::Slicer { .. })
        });
        if !delaying {
            for (due, _) in self.queue.iter_mut() {
                *due = now;
            }
            self.last_due = now;
        }
    }

    /// Take in a chunk read from the source: drop it, or queue it in timed pieces.
    fn ingest(&mut self, chunk: &[u8]) {
        let now = Instant::now();
        for (name, (_, applies)) in &self.drawn {
            if *applies {
                self.stats.charge_chunk(name, chunk);
            }
        }
        if let Some(ms) = self.active.iter().find_map(|k| match k {
            ToxicKind::ResetPeer { timeout } => Some(*timeout),
            _ => None,
        }) {
            if self.reset_at.is_none() {
                self.reset_at = Some(now + Duration::from_millis(ms));
            }
            return;
        }
        if let Some(ms) = self.active.iter().find_map(|k| match k {
            ToxicKind::Timeout { timeout } => Some(*timeout),
            _ => None,
        }) {
            if ms > 0 {
                self.timeout_at = Some(now + Duration::from_millis(ms));
            }
            return;
        }
        let mut delay = Duration::ZERO;
        let mut piece_sizes: Option<(usize, usize, Duration)> = None;
        let mut rate: Option<u64> = None;
        for k in &self.active {
            match *k {
                ToxicKind::Latency { latency, jitter } => {
                    let j = if jitter > 0 { self.rng.random_range(0..=2 * jitter) as i64 - jitter as i64 } else { 0 };
                    delay += Duration::from_millis((latency as i64 + j).max(0) as u64);
                }
                ToxicKind::Slicer { average_size, size_variation, delay } => {
                    piece_sizes = Some((average_size.max(1), size_variation, Duration::from_micros(delay)));
                }
                ToxicKind::Bandwidth { rate: r } => rate = Some(r),
                _ => {}
            }
        }
        let mut due = (now + delay).max(self.last_due);
        let mut rest = chunk;
        while !rest.is_empty() {
            let mut len = rest.len();
            let mut gap = Duration::ZERO;
            if let Some((avg, var, d)) = piece_sizes {
                let var = var.min(avg - 1);
                len = len.min(self.rng.random_range(avg - var..=avg + var).max(1));
                gap = d;
            }
            if let Some(r) = rate {
                // 100 ms worth of data per piece; spacing = piece / rate.
                let bytes_per_sec = (r.max(1) * 1024) as usize;
                len = len.min((bytes_per_sec / 10).max(1));
                gap = gap.max(Duration::from_secs_f64(len as f64 / bytes_per_sec as f64));
            }
            let (piece, tail) = rest.split_at(len);
            self.queue.push_back((due, piece.to_vec()));
            due += gap;
            rest = tail;
        }
        self.last_due = due;
    }

    async fn run(mut self, src: &mut OwnedReadHalf, dst: &mut OwnedWriteHalf, stop: &CancellationToken) -> End {
        let mut buf = vec![0u8; 32 * 1024];
        let mut eof = false;
        loop {
            if eof && self.queue.is_empty() {
                let delay = self.active.iter().find_map(|k| match k {
                    ToxicKind::SlowClose { delay } => Some(*delay),
                    _ => None,
                });
                if let Some(ms) = delay {
                    tokio::select! {
                        _ = stop.cancelled() => return End::Aborted,
                        _ = tokio::time::sleep(Duration::from_millis(ms)) => {}
                    }
                }
                let _ = dst.shutdown().await;
                return End::Eof;
            }
            let next_due = self.queue.front().map(|(d, _)| *d);
            let far = Instant::now() + Duration::from_secs(86_400);
            tokio::select! {
                biased;
                _ = stop.cancelled() => return End::Aborted,
                changed = self.ctl.changed() => match changed {
                    Ok(()) => self.refresh(),
                    Err(_) => return End::Aborted, // proxy deleted
                },
                _ = sleep_until(self.reset_at.unwrap_or(far)), if self.reset_at.is_some() => return End::Reset,
                _ = sleep_until(self.timeout_at.unwrap_or(far)), if self.timeout_at.is_some() => return End::Close,
                _ = sleep_until(next_due.unwrap_or(far)), if next_due.is_some() => {
                    let (_, piece) = self.queue.pop_front().expect("due piece");
                    match self.write(dst, &piece).await {
                        Ok(true) => {}
                        Ok(false) => return End::Close,
                        Err(_) => return End::Close,
                    }
                }
                read = src.read(&mut buf), if !eof && self.queue.len() < QUEUE_CAP => match read {
                    Ok(0) | Err(_) => eof = true,
                    Ok(n) => self.ingest(&buf[..n]),
                },
            }
        }
    }

    /// Write a piece, honouring limit_data. `Ok(false)`: the limit is reached, close.
    async fn write(&mut self, dst: &mut OwnedWriteHalf, piece: &[u8]) -> std::io::Result<bool> {
        let limit = self.active.iter().find_map(|k| match k {
            ToxicKind::LimitData { bytes } => Some(*bytes),
            _ => None,
        });
        if let (Some(limit), Some(base)) = (limit, self.limit_base) {
            let left = (base + limit).saturating_sub(self.written) as usize;
            let n = left.min(piece.len());
            dst.write_all(&piece[..n]).await?;
            self.written += n as u64;
            return Ok(self.written < base + limit);
        }
        dst.write_all(piece).await?;
        self.written += piece.len() as u64;
        Ok(true)
    }
}
