//! A UDP socket for quinn that applies a link's delay, jitter and loss in user space
//! ([`LinkImpairment`]), for kernels without the `netem` qdisc.
//!
//! Why inside the transport rather than a relay between nodes: a relay needs an address per
//! link and direction, rewrites every peer address (so a node sees the relay, not its peer,
//! as the remote end) and is one more process to start, supervise and clean up. Wrapping the
//! socket keeps every address real (a node in a namespace is reached on its own address by
//! peers and by `troupe status`), and quinn's own RTT estimate then measures the impairment.
//! It is built only when `[links]` is set; otherwise the endpoint uses quinn's socket directly
//! and no datagram passes through here.
//!
//! Each outgoing datagram gets its verdict from [`LinkImpairment::verdict`]; delayed ones wait
//! in a bounded queue ([`MAX_QUEUED`], past it they are dropped like a full router queue) on a
//! task that sends them when due. Received datagrams pass through untouched: the peer's end
//! delays what it sends.

use std::collections::BinaryHeap;
use std::fmt;
use std::io::{self, IoSliceMut};
use std::net::{IpAddr, SocketAddr};
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::task::{Context, Poll};

use quinn::udp::{EcnCodepoint, RecvMeta, Transmit};
use quinn::{AsyncUdpSocket, UdpPoller};
use tokio::sync::mpsc;
use tokio::time::Instant;
use troupe_policy::{LinkImpairment, Verdict};

/// Most datagrams waiting for their send time; more are dropped.
pub const MAX_QUEUED: usize = 8192;

/// A datagram waiting for its send time.
struct Delayed {
    due: Instant,
    seq: u64,
    destination: SocketAddr,
    ecn: Option<EcnCodepoint>,
    src_ip: Option<IpAddr>,
    contents: Vec<u8>,
}

impl PartialEq for Delayed {
    fn eq(&self, other: &Self) -> bool {
        (self.due, self.seq) == (other.due, other.seq)
    }
}
impl Eq for Delayed {}
impl PartialOrd for Delayed {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}
impl Ord for Delayed {
    /// Reversed, so that the max-heap yields the earliest due (then the first sent) first.
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        (other.due, other.seq).cmp(&(self.due, self.seq))
    }
}

/// Counters of what the impairment did, for tests and logs.
#[derive(Debug, Default)]
pub struct ImpairStats {
    /// Datagrams handed to the socket.
    pub sent: AtomicU64,
    /// Datagrams lost by the loss draw.
    pub lost: AtomicU64,
    /// Datagrams lost because the delay queue was full.
    pub overflowed: AtomicU64,
}

/// quinn's socket wrapped with a link impairment (see the module docs).
pub struct ImpairedSocket {
    inner: Arc<dyn AsyncUdpSocket>,
    impairment: LinkImpairment,
    seq: AtomicU64,
    queue: mpsc::Sender<Delayed>,
    stats: Arc<ImpairStats>,
}

impl fmt::Debug for ImpairedSocket {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ImpairedSocket").field("impairment", &self.impairment).finish_non_exhaustive()
    }
}

impl ImpairedSocket {
    /// Wraps `inner` and starts the task sending delayed datagrams (it ends when the socket is
    /// dropped). Must be called inside a tokio runtime.
    pub fn new(inner: Arc<dyn AsyncUdpSocket>, impairment: LinkImpairment) -> Self {
        let (queue, rx) = mpsc::channel(MAX_QUEUED);
        let stats = Arc::new(ImpairStats::default());
        tokio::spawn(send_when_due(inner.clone(), rx, stats.clone()));
        Self { inner, impairment, seq: AtomicU64::new(0), queue, stats }
    }

    /// What the impairment did so far.
    pub fn stats(&self) -> Arc<ImpairStats> {
        self.stats.clone()
    }

    /// Draws one datagram's verdict and queues it unless lost.
    fn submit(&self, t: &Transmit<'_>, contents: &[u8]) {
        self.stats.sent.fetch_add(1, Ordering::Relaxed);
        let seq = self.seq.fetch_add(1, Ordering::Relaxed);
        let delay = match self.impairment.verdict(seq) {
            Verdict::Drop => {
                self.stats.lost.fetch_add(1, Ordering::Relaxed);
                return;
            }
            Verdict::Delay(d) => d,
        };
        let d = Delayed {
            due: Instant::now() + delay,
            seq,
            destination: t.destination,
            ecn: t.ecn,
            src_ip: t.src_ip,
            contents: contents.to_vec(),
        };
        if self.queue.try_send(d).is_err() {
            self.stats.overflowed.fetch_add(1, Ordering::Relaxed);
        }
    }
}

impl AsyncUdpSocket for ImpairedSocket {
    fn create_io_poller(self: Arc<Self>) -> Pin<Box<dyn UdpPoller>> {
        Box::pin(AlwaysWritable)
    }

    /// Never blocks: each datagram (a GSO batch is split) is lost or queued.
    fn try_send(&self, transmit: &Transmit<'_>) -> io::Result<()> {
        match transmit.segment_size {
            Some(size) if size > 0 && size < transmit.contents.len() => {
                for chunk in transmit.contents.chunks(size) {
                    self.submit(transmit, chunk);
                }
            }
            _ => self.submit(transmit, transmit.contents),
        }
        Ok(())
    }

    fn poll_recv(
        &self,
        cx: &mut Context<'_>,
        bufs: &mut [IoSliceMut<'_>],
        meta: &mut [RecvMeta],
    ) -> Poll<io::Result<usize>> {
        self.inner.poll_recv(cx, bufs, meta)
    }

    fn local_addr(&self) -> io::Result<SocketAddr> {
        self.inner.local_addr()
    }

    /// One datagram per transmit, so each gets its own verdict.
    fn max_transmit_segments(&self) -> usize {
        1
    }

    fn max_receive_segments(&self) -> usize {
        self.inner.max_receive_segments()
    }

    fn may_fragment(&self) -> bool {
        self.inner.may_fragment()
    }
}

/// The wrapper accepts every send at once, so it is always writable.
#[derive(Debug)]
struct AlwaysWritable;

impl UdpPoller for AlwaysWritable {
    fn poll_writable(self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Poll::Ready(Ok(()))
    }
}

/// Sends queued datagrams at their due times until the socket is dropped.
async fn send_when_due(
    inner: Arc<dyn AsyncUdpSocket>,
    mut rx: mpsc::Receiver<Delayed>,
    stats: Arc<ImpairStats>,
) {
    let mut poller = inner.clone().create_io_poller();
    let mut heap: BinaryHeap<Delayed> = BinaryHeap::new();
    loop {
        let next = heap.peek().map(|d| d.due);
        let wait = async move {
            match next {
                Some(due) => tokio::time::sleep_until(due).await,
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            got = rx.recv() => match got {
                Some(d) => heap.push(d),
                None => return,
            },
            () = wait => {
                let now = Instant::now();
                while heap.peek().is_some_and(|d| d.due <= now) {
                    let Some(d) = heap.pop() else { break };
                    send_one(&*inner, &mut poller, &d, &stats).await;
                }
            }
        }
    }
}

/// Sends one datagram, waiting while the socket is full; an I/O error loses it (as quinn's own
/// send path does).
async fn send_one(
    inner: &dyn AsyncUdpSocket,
    poller: &mut Pin<Box<dyn UdpPoller>>,
    d: &Delayed,
    stats: &ImpairStats,
) {
    let t = Transmit {
        destination: d.destination,
        ecn: d.ecn,
        contents: &d.contents,
        segment_size: None,
        src_ip: d.src_ip,
    };
    loop {
        match inner.try_send(&t) {
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                if std::future::poll_fn(|cx| poller.as_mut().poll_writable(cx)).await.is_err() {
                    stats.overflowed.fetch_add(1, Ordering::Relaxed);
                    return;
                }
            }
            Ok(()) | Err(_) => return,
        }
    }
}
