//! A seeded, deterministic in-memory network for whole-cluster tests.
//!
//! [`SimNet`] is the step-driven core: the caller sends frames at a virtual time, the net draws a
//! delay and a loss decision from a seeded `SmallRng`, applies partitions and crashes, and hands
//! deliveries back in virtual-time order from [`SimNet::next_delivery`]. Frames of one
//! (from, to, channel) flow are delivered in order even though delays are random (a frame is never
//! delivered before the one sent ahead of it on its flow). Every send, drop (with its reason) and
//! delivery is written to a text event log, so two runs with one seed can be compared byte for
//! byte.
//!
//! [`SimHub`] wraps a `SimNet` for async code: each node gets a [`SimLink`] (the [`Link`] trait),
//! and the test or driver releases deliveries by advancing virtual time with
//! [`SimHub::advance_to`]. Nothing here reads a clock or sleeps.

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::fmt;
use std::sync::{Arc, Mutex, MutexGuard};

use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use tokio::sync::Notify;
use troupe_policy::Micros;

use crate::budget::Held;
use crate::frame::Frame;
use crate::frame::FrameKind;
use crate::link::{Channel, Delivery, Link, LinkError, NodeId};
use crate::roles::RoleSet;
use crate::runtime_link::DeliverySink;

mod blobs;
mod view;

pub use blobs::SIM_BLOB_BYTES_PER_US;

/// Network behaviour of a simulation.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SimConfig {
    /// Seed of the network's RNG (delays and losses).
    pub seed: u64,
    /// Smallest one-way delay.
    pub min_delay: Micros,
    /// Largest one-way delay (inclusive).
    pub max_delay: Micros,
    /// Probability that a frame is lost, in [0, 1] (clamped; NaN counts as 0).
    pub loss: f64,
}

impl Default for SimConfig {
    fn default() -> Self {
        Self { seed: 0, min_delay: Micros::from_millis(1), max_delay: Micros::from_millis(10), loss: 0.0 }
    }
}

/// Why the net dropped a frame.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DropReason {
    /// Random loss.
    Lost,
    /// The two nodes are partitioned (at send or at delivery time).
    Partitioned,
    /// The sender is crashed.
    SenderCrashed,
    /// The receiver is crashed.
    ReceiverCrashed,
    /// An endpoint crashed while the frame was in flight.
    CrashedInFlight,
    /// Nobody listens for the receiver (a [`SimHub`] without a link for it).
    NoLink,
}

impl fmt::Display for DropReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            DropReason::Lost => "lost",
            DropReason::Partitioned => "partitioned",
            DropReason::SenderCrashed => "sender-crashed",
            DropReason::ReceiverCrashed => "receiver-crashed",
            DropReason::CrashedInFlight => "crashed-in-flight",
            DropReason::NoLink => "no-link",
        })
    }
}

/// What happened to a sent frame.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SendOutcome {
    /// Queued for delivery at `at` (unless a partition or crash intervenes).
    Queued {
        /// Delivery time.
        at: Micros,
        /// The frame's sequence number (in the log as `#seq`).
        seq: u64,
    },
    /// Dropped at once.
    Dropped {
        /// Why.
        reason: DropReason,
        /// The frame's sequence number.
        seq: u64,
    },
}

/// Counters over a run.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SimStats {
    /// Frames handed to `send`.
    pub sent: u64,
    /// Frames delivered.
    pub delivered: u64,
    /// Frames dropped for any reason.
    pub dropped: u64,
}

struct InFlight {
    seq: u64,
    from: NodeId,
    to: NodeId,
    channel: Channel,
    frame: Frame,
}

/// The deterministic network core (see the module docs).
///
/// Calling protocol: `send(now, ..)` with non-decreasing `now` (earlier times are treated as the
/// latest time seen); pop deliveries with [`Self::next_delivery`] or
/// [`Self::next_delivery_until`]; fault verbs ([`Self::partition`], [`Self::crash`], ...) take
/// effect at the time given. [`Self::peek_time`] says when the next delivery is due.
pub struct SimNet {
    config: SimConfig,
    rng: SmallRng,
    now: Micros,
    next_seq: u64,
    queue: BTreeMap<(Micros, u64), InFlight>,
    /// Latest delivery time per (from, to, channel): keeps each flow FIFO.
    flows: BTreeMap<(NodeId, NodeId, Channel), Micros>,
    /// Unordered pairs stored as (smaller, larger).
    partitions: BTreeSet<(NodeId, NodeId)>,
    crashed: BTreeSet<NodeId>,
    log: Vec<String>,
    stats: SimStats,
}

impl SimNet {
    /// A network with the given behaviour; a reversed delay range is swapped.
    pub fn new(mut config: SimConfig) -> Self {
        if config.min_delay > config.max_delay {
            std::mem::swap(&mut config.min_delay, &mut config.max_delay);
        }
        config.loss = if config.loss.is_nan() { 0.0 } else { config.loss.clamp(0.0, 1.0) };
        Self {
            rng: SmallRng::seed_from_u64(config.seed),
            config,
            now: Micros::ZERO,
            next_seq: 0,
            queue: BTreeMap::new(),
            flows: BTreeMap::new(),
            partitions: BTreeSet::new(),
            crashed: BTreeSet::new(),
            log: Vec::new(),
            stats: SimStats::default(),
        }
    }

    /// The configuration in use.
    pub fn config(&self) -> &SimConfig {
        &self.config
    }

    /// The latest virtual time seen (a send, a fault or a delivery).
    pub fn now(&self) -> Micros {
        self.now
    }

    /// Counters so far.
    pub fn stats(&self) -> SimStats {
        self.stats
    }

    /// Frames queued and not yet delivered or dropped.
    pub fn in_flight(&self) -> usize {
        self.queue.len()
    }

    /// Sends a frame at `now`: drawn delay and loss, then partitions and crashes apply.
    pub fn send(
        &mut self,
        now: Micros,
        from: &NodeId,
        to: &NodeId,
        channel: Channel,
        frame: Frame,
    ) -> SendOutcome {
        let now = self.advance(now);
        let seq = self.next_seq;
        self.next_seq += 1;
        self.stats.sent += 1;
        // Always draw both, so a fault elsewhere does not shift the random stream of this send.
        let lost = self.rng.random_bool(self.config.loss);
        let delay = Micros(self.rng.random_range(self.config.min_delay.0..=self.config.max_delay.0));
        self.log.push(format!(
            "{now} send {from}->{to} {channel:?} {kind:?} {len}B #{seq}",
            kind = frame.kind,
            len = frame.body.len()
        ));
        let reason = if self.crashed.contains(from) {
            Some(DropReason::SenderCrashed)
        } else if self.crashed.contains(to) {
            Some(DropReason::ReceiverCrashed)
        } else if self.is_partitioned(from, to) {
            Some(DropReason::Partitioned)
        } else if lost {
            Some(DropReason::Lost)
        } else {
            None
        };
        if let Some(reason) = reason {
            self.log_drop(now, from, to, channel, seq, reason);
            return SendOutcome::Dropped { reason, seq };
        }
        let flow = (from.clone(), to.clone(), channel);
        let earliest = self.flows.get(&flow).copied().unwrap_or(Micros::ZERO);
        let at = (now + delay).max(earliest);
        self.flows.insert(flow, at);
        self.queue.insert((at, seq), InFlight { seq, from: from.clone(), to: to.clone(), channel, frame });
        SendOutcome::Queued { at, seq }
    }

    /// When the earliest queued frame is due (it may still be dropped by a partition).
    #[must_use]
    pub fn peek_time(&self) -> Option<Micros> {
        self.queue.keys().next().map(|(t, _)| *t)
    }

    /// Pops the earliest delivery (ties in time go by send order), dropping frames whose
    /// endpoints are partitioned at delivery time.
    #[must_use]
    pub fn next_delivery(&mut self) -> Option<(Micros, NodeId, Delivery)> {
        self.next_delivery_until(Micros(u64::MAX))
    }

    /// Like [`Self::next_delivery`] but only frames due at or before `limit`.
    #[must_use]
    pub fn next_delivery_until(&mut self, limit: Micros) -> Option<(Micros, NodeId, Delivery)> {
        loop {
            let (&key, _) = self.queue.first_key_value()?;
            if key.0 > limit {
                return None;
            }
            let msg = self.queue.remove(&key)?;
            let at = self.advance(key.0);
            if self.is_partitioned(&msg.from, &msg.to) {
                self.log_drop(at, &msg.from, &msg.to, msg.channel, msg.seq, DropReason::Partitioned);
                continue;
            }
            self.stats.delivered += 1;
            self.log.push(format!("{at} deliver {}->{} {:?} #{}", msg.from, msg.to, msg.channel, msg.seq));
            return Some((
                at,
                msg.to,
                Delivery { from: msg.from, channel: msg.channel, frame: msg.frame, held: Held::default() },
            ));
        }
    }

    /// Cuts the link between `a` and `b` (both directions) from `now` on.
    pub fn partition(&mut self, now: Micros, a: &NodeId, b: &NodeId) {
        let now = self.advance(now);
        let (x, y) = pair(a, b);
        let line = format!("{now} partition {x}|{y}");
        if self.partitions.insert((x, y)) {
            self.log.push(line);
        }
    }

    /// Cuts every link between a node of `left` and a node of `right`.
    pub fn partition_groups(&mut self, now: Micros, left: &[NodeId], right: &[NodeId]) {
        for a in left {
            for b in right {
                self.partition(now, a, b);
            }
        }
    }

    /// Restores the link between `a` and `b`.
    pub fn heal(&mut self, now: Micros, a: &NodeId, b: &NodeId) {
        let now = self.advance(now);
        let (x, y) = pair(a, b);
        let line = format!("{now} heal {x}|{y}");
        if self.partitions.remove(&(x, y)) {
            self.log.push(line);
        }
    }

    /// Restores every link.
    pub fn heal_all(&mut self, now: Micros) {
        let cut: Vec<_> = self.partitions.iter().cloned().collect();
        for (a, b) in cut {
            self.heal(now, &a, &b);
        }
    }

    /// Changes the loss probability and the largest delay from `now` on (a burst of loss or
    /// delay, or its end); the smallest delay stays, as the driver's step is sized by it. Logged.
    pub fn set_impairment(&mut self, now: Micros, loss: f64, max_delay: Micros) {
        let now = self.advance(now);
        self.config.loss = if loss.is_nan() { 0.0 } else { loss.clamp(0.0, 1.0) };
        self.config.max_delay = max_delay.max(self.config.min_delay);
        self.log
            .push(format!("{now} impair loss {:.3} max-delay {}", self.config.loss, self.config.max_delay));
    }

    /// True when `a` and `b` cannot reach each other.
    pub fn is_partitioned(&self, a: &NodeId, b: &NodeId) -> bool {
        self.partitions.contains(&pair(a, b))
    }

    /// Crashes a node: everything in flight to or from it is discarded, and frames to or from it
    /// are dropped until [`Self::restart`].
    pub fn crash(&mut self, now: Micros, node: &NodeId) {
        let now = self.advance(now);
        if !self.crashed.insert(node.clone()) {
            return;
        }
        self.log.push(format!("{now} crash {node}"));
        let doomed: Vec<_> =
            self.queue.iter().filter(|(_, m)| &m.from == node || &m.to == node).map(|(k, _)| *k).collect();
        for key in doomed {
            if let Some(m) = self.queue.remove(&key) {
                self.log_drop(now, &m.from, &m.to, m.channel, m.seq, DropReason::CrashedInFlight);
            }
        }
        self.flows.retain(|(f, t, _), _| f != node && t != node);
    }

    /// Brings a crashed node back (a fresh process: nothing of its old traffic survives).
    pub fn restart(&mut self, now: Micros, node: &NodeId) {
        let now = self.advance(now);
        if self.crashed.remove(node) {
            self.log.push(format!("{now} restart {node}"));
        }
    }

    /// True while `node` is crashed.
    pub fn is_crashed(&self, node: &NodeId) -> bool {
        self.crashed.contains(node)
    }

    /// Appends a line of the caller's own (e.g. a node's decision) to the event log.
    pub fn note(&mut self, now: Micros, text: &str) {
        let now = self.advance(now);
        self.log.push(format!("{now} {text}"));
    }

    /// The event log so far, one line per event.
    pub fn log(&self) -> &[String] {
        &self.log
    }

    /// Takes the event log, leaving it empty.
    pub fn take_log(&mut self) -> Vec<String> {
        std::mem::take(&mut self.log)
    }

    fn advance(&mut self, now: Micros) -> Micros {
        self.now = self.now.max(now);
        self.now
    }

    fn log_drop(
        &mut self,
        now: Micros,
        from: &NodeId,
        to: &NodeId,
        channel: Channel,
        seq: u64,
        reason: DropReason,
    ) {
        self.stats.dropped += 1;
        self.log.push(format!("{now} drop {from}->{to} {channel:?} #{seq} {reason}"));
    }
}

fn pair(a: &NodeId, b: &NodeId) -> (NodeId, NodeId) {
    if a <= b { (a.clone(), b.clone()) } else { (b.clone(), a.clone()) }
}

struct HubState {
    net: SimNet,
    now: Micros,
    inboxes: BTreeMap<NodeId, VecDeque<Delivery>>,
    notifies: BTreeMap<NodeId, Arc<Notify>>,
    /// Each node's roles (the table given at build time: [`SimHub::set_roles`]).
    roles: BTreeMap<NodeId, RoleSet>,
    /// `(to, from)`: something from `from` was released to `to` since `to` last looked.
    heard: BTreeSet<(NodeId, NodeId)>,
    /// Where each node's service frames go instead of its inbox.
    sinks: BTreeMap<NodeId, DeliverySink>,
    /// Each node's blob server (see `blobs.rs`).
    blobs: BTreeMap<NodeId, Arc<dyn crate::quic::BlobServer>>,
    /// Each node's restarts: a link of an older incarnation is its crashed process's, and can
    /// neither send nor receive (coadapt seed 703: a crashed camera's announcement, still retried
    /// by its old process, was answered into the new one's call of the same id).
    incarnations: BTreeMap<NodeId, u64>,
}

/// A [`SimNet`] shared by async code: hands out [`SimLink`]s and releases deliveries into their
/// inboxes when the driver advances virtual time.
#[derive(Clone)]
pub struct SimHub {
    state: Arc<Mutex<HubState>>,
    /// Unique in the process (see [`SimHub::id`]).
    id: u64,
}

impl SimHub {
    /// A hub over a fresh network.
    pub fn new(config: SimConfig) -> Self {
        static HUBS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
        Self {
            id: HUBS.fetch_add(1, std::sync::atomic::Ordering::Relaxed),
            state: Arc::new(Mutex::new(HubState {
                net: SimNet::new(config),
                now: Micros::ZERO,
                inboxes: BTreeMap::new(),
                notifies: BTreeMap::new(),
                roles: BTreeMap::new(),
                heard: BTreeSet::new(),
                sinks: BTreeMap::new(),
                blobs: BTreeMap::new(),
                incarnations: BTreeMap::new(),
            })),
        }
    }

    /// This hub's number, unique in the process: it names what one simulated world keeps
    /// outside the hub (its nodes' folders), never anything in its event log.
    pub fn id(&self) -> u64 {
        self.id
    }

    fn lock(&self) -> MutexGuard<'_, HubState> {
        // A panic while holding the lock leaves plain data behind; keep going with it.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The link of node `id` (one receiver per node: a second link for the same id shares the
    /// inbox).
    pub fn link(&self, id: NodeId) -> SimLink {
        let mut s = self.lock();
        s.inboxes.entry(id.clone()).or_default();
        let notify = s.notifies.entry(id.clone()).or_insert_with(|| Arc::new(Notify::new())).clone();
        let incarnation = s.incarnations.get(&id).copied().unwrap_or(0);
        SimLink { id, hub: self.clone(), notify, incarnation }
    }

    /// The hub's virtual time.
    pub fn now(&self) -> Micros {
        self.lock().now
    }

    /// When the next queued frame is due.
    pub fn next_event_time(&self) -> Option<Micros> {
        self.lock().net.peek_time()
    }

    /// Moves virtual time to `t` (never backwards), releasing every delivery due by then into
    /// its receiver's inbox in time order; returns how many were released.
    pub fn advance_to(&self, t: Micros) -> usize {
        let mut s = self.lock();
        let mut released = 0;
        while let Some((at, to, d)) = s.net.next_delivery_until(t) {
            match s.inboxes.get_mut(&to) {
                Some(inbox) => {
                    let heard = (to.clone(), d.from.clone());
                    inbox.push_back(d);
                    s.heard.insert(heard);
                    if let Some(n) = s.notifies.get(&to) {
                        n.notify_one();
                    }
                    released += 1;
                }
                None => {
                    let line = format!("drop {}->{to} {:?} {}", d.from, d.channel, DropReason::NoLink);
                    s.net.note(at, &line);
                }
            }
        }
        s.now = s.now.max(t);
        released
    }

    /// Advances to the next due frame's time and releases what is due then; `None` when nothing
    /// is in flight (the network is idle).
    pub fn step(&self) -> Option<Micros> {
        let t = self.next_event_time()?;
        self.advance_to(t);
        Some(t)
    }

    /// Moves virtual time forward by `d`.
    pub fn advance_by(&self, d: Micros) -> usize {
        let t = self.now() + d;
        self.advance_to(t)
    }

    /// Runs `f` on the network (partitions, notes, stats) at the hub's current time.
    pub fn with_net<R>(&self, f: impl FnOnce(&mut SimNet, Micros) -> R) -> R {
        let mut s = self.lock();
        let now = s.now;
        f(&mut s.net, now)
    }

    /// Crashes a node now: the network drops its traffic and its undelivered inbox is discarded.
    pub fn crash(&self, node: &NodeId) {
        let mut s = self.lock();
        let now = s.now;
        s.net.crash(now, node);
        if let Some(inbox) = s.inboxes.get_mut(node) {
            inbox.clear();
        }
        drop(s);
        self.drop_blob_server(node);
    }

    /// Restarts a crashed node now.
    pub fn restart(&self, node: &NodeId) {
        let mut s = self.lock();
        let now = s.now;
        s.net.restart(now, node);
        *s.incarnations.entry(node.clone()).or_default() += 1;
    }

    /// A copy of the event log.
    pub fn log(&self) -> Vec<String> {
        self.lock().net.log().to_vec()
    }
}

/// One node's [`Link`] over a [`SimHub`]. A frame lost at random, or later in flight, is still
/// `Ok` (the log says why); a send to a crashed or cut-off peer fails at once with
/// `LinkError::PeerDown`, as a QUIC send with no connection does; a crashed sender gets
/// `LinkError::Closed`.
/// `recv` waits until the driver advances time past a delivery for this node. Clones share the
/// node's inbox.
#[derive(Clone)]
pub struct SimLink {
    id: NodeId,
    hub: SimHub,
    notify: Arc<Notify>,
    /// The node's incarnation this link belongs to (see `HubState::incarnations`).
    incarnation: u64,
}

impl SimLink {
    /// The hub this link belongs to.
    pub fn hub(&self) -> &SimHub {
        &self.hub
    }

    /// A delivery already released to this node, without waiting (none for a link of a
    /// crashed incarnation).
    pub fn try_recv(&self) -> Option<Delivery> {
        let mut s = self.hub.lock();
        if s.incarnations.get(&self.id).copied().unwrap_or(0) != self.incarnation {
            return None;
        }
        s.inboxes.get_mut(&self.id)?.pop_front()
    }
}

impl Link for SimLink {
    fn local_id(&self) -> &NodeId {
        &self.id
    }

    async fn send(&self, to: &NodeId, channel: Channel, frame: Frame) -> Result<(), LinkError> {
        let mut s = self.hub.lock();
        let current = s.incarnations.get(&self.id).copied().unwrap_or(0);
        if s.net.is_crashed(&self.id) || current != self.incarnation {
            return Err(LinkError::Closed);
        }
        let now = s.now;
        match s.net.send(now, &self.id, to, channel, frame) {
            // as a QUIC send with no connection to the peer fails at once
            SendOutcome::Dropped {
                reason: reason @ (DropReason::ReceiverCrashed | DropReason::Partitioned),
                ..
            } => Err(LinkError::PeerDown(to.clone(), reason.to_string())),
            _ => Ok(()),
        }
    }

    async fn recv(&self) -> Result<Delivery, LinkError> {
        loop {
            // Register interest before looking, so a release in between is not missed.
            let notified = self.notify.notified();
            if let Some(d) = self.try_recv() {
                if d.frame.kind == FrameKind::Service
                    && let Some(sink) = self.service_sink()
                {
                    sink(d);
                    continue;
                }
                return Ok(d);
            }
            notified.await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::frame::FrameKind;
    use std::pin::pin;
    use std::task::{Context, Poll, Waker};

    fn id(s: &str) -> NodeId {
        NodeId::new(s)
    }

    fn frame(n: u64) -> Frame {
        Frame::from_bytes(FrameKind::Message, 0, &n.to_le_bytes())
    }

    fn payload(f: &Frame) -> u64 {
        let mut b = [0u8; 8];
        b.copy_from_slice(&f.body[..8]);
        u64::from_le_bytes(b)
    }

    fn net(seed: u64, loss: f64) -> SimNet {
        SimNet::new(SimConfig { seed, min_delay: Micros(100), max_delay: Micros(10_000), loss })
    }

    #[test]
    fn flows_stay_fifo_under_random_delay() {
        let mut n = net(7, 0.0);
        let (a, b, c) = (id("a"), id("b"), id("c"));
        for i in 0..200u64 {
            let t = Micros(i * 50);
            assert!(matches!(n.send(t, &a, &b, Channel::Data, frame(i)), SendOutcome::Queued { .. }));
            let _ = n.send(t, &c, &b, Channel::Data, frame(1000 + i));
            let _ = n.send(t, &a, &b, Channel::Control, frame(2000 + i));
        }
        let mut last: BTreeMap<(String, Channel), u64> = BTreeMap::new();
        let mut prev_t = Micros::ZERO;
        let mut send_order = Vec::new();
        while let Some((t, to, d)) = n.next_delivery() {
            assert_eq!(to, b);
            assert!(t >= prev_t, "deliveries come in time order");
            prev_t = t;
            let v = payload(&d.frame);
            if let Some(p) = last.insert((d.from.0.clone(), d.channel), v) {
                assert!(v > p, "flow {}/{:?} reordered: {p} then {v}", d.from, d.channel);
            }
            // Global send index: three sends per step i.
            send_order.push(3 * (v % 1000) + v / 1000);
        }
        assert_eq!(send_order.len(), 600);
        assert!(
            send_order.windows(2).any(|w| w[0] > w[1]),
            "random delays do reorder across flows, so per-flow order is not trivial"
        );
        assert_eq!(n.stats(), SimStats { sent: 600, delivered: 600, dropped: 0 });
    }

    #[test]
    fn delays_are_drawn_from_the_range_and_seeded() {
        let run = |seed| {
            let mut n = net(seed, 0.0);
            let mut times = Vec::new();
            for i in 0..50 {
                // A separate flow per message, so FIFO does not stretch delays.
                let to = id(&format!("n{i}"));
                if let SendOutcome::Queued { at, .. } =
                    n.send(Micros(0), &id("a"), &to, Channel::Data, frame(i))
                {
                    times.push(at.0);
                }
            }
            times
        };
        let t = run(1);
        assert!(t.iter().all(|&x| (100..=10_000).contains(&x)), "{t:?}");
        assert!(t.iter().collect::<BTreeSet<_>>().len() > 40, "delays vary");
        assert_eq!(t, run(1));
        assert_ne!(t, run(2));
    }

    #[test]
    fn loss_rate_is_roughly_the_configured_one() {
        let mut n = net(3, 0.25);
        let mut lost = 0;
        for i in 0..4000 {
            if let SendOutcome::Dropped { reason: DropReason::Lost, .. } =
                n.send(Micros(i), &id("a"), &id("b"), Channel::Data, frame(i))
            {
                lost += 1;
            }
        }
        // Binomial(4000, 0.25): mean 1000, sd ~27.
        assert!((850..1150).contains(&lost), "{lost}");
    }

    #[test]
    fn partitions_drop_both_ways_and_in_flight_frames() {
        let mut n = net(1, 0.0);
        let (a, b) = (id("a"), id("b"));
        let _ = n.send(Micros(0), &a, &b, Channel::Data, frame(1));
        n.partition(Micros(50), &b, &a);
        assert!(n.is_partitioned(&a, &b));
        assert!(matches!(
            n.send(Micros(60), &b, &a, Channel::Data, frame(2)),
            SendOutcome::Dropped { reason: DropReason::Partitioned, .. }
        ));
        assert!(n.next_delivery().is_none(), "in-flight frame dropped at delivery");
        n.heal(Micros(20_000), &a, &b);
        let _ = n.send(Micros(20_000), &a, &b, Channel::Data, frame(3));
        let (_, to, d) = n.next_delivery().unwrap();
        assert_eq!((to, payload(&d.frame)), (b.clone(), 3));
        let log = n.log().join("\n");
        assert!(log.contains("50us partition a|b"), "{log}");
        assert!(log.contains("drop a->b Data #0 partitioned"), "{log}");
        assert_eq!(n.stats().dropped, 2);
        assert!(log.contains("drop b->a Data #1 partitioned"), "{log}");
        assert!(log.contains("20000us heal a|b"), "{log}");
    }

    #[test]
    fn crash_discards_queued_frames_until_restart() {
        let mut n = net(1, 0.0);
        let (a, b, c) = (id("a"), id("b"), id("c"));
        let _ = n.send(Micros(0), &a, &b, Channel::Data, frame(1));
        let _ = n.send(Micros(0), &b, &c, Channel::Data, frame(2));
        let _ = n.send(Micros(0), &a, &c, Channel::Data, frame(3));
        n.crash(Micros(10), &b);
        assert_eq!(n.in_flight(), 1, "only a->c survives");
        assert!(matches!(
            n.send(Micros(20), &a, &b, Channel::Data, frame(4)),
            SendOutcome::Dropped { reason: DropReason::ReceiverCrashed, .. }
        ));
        assert!(matches!(
            n.send(Micros(20), &b, &a, Channel::Data, frame(5)),
            SendOutcome::Dropped { reason: DropReason::SenderCrashed, .. }
        ));
        let (_, to, _) = n.next_delivery().unwrap();
        assert_eq!(to, c);
        n.restart(Micros(30_000), &b);
        let _ = n.send(Micros(30_000), &a, &b, Channel::Data, frame(6));
        let (t, to, d) = n.next_delivery().unwrap();
        assert!(t >= Micros(30_100));
        assert_eq!((to, payload(&d.frame)), (b, 6));
        assert_eq!(n.log().iter().filter(|l| l.contains("crashed-in-flight")).count(), 2);
    }

    fn poll_once<F: std::future::Future>(f: std::pin::Pin<&mut F>) -> Poll<F::Output> {
        f.poll(&mut Context::from_waker(Waker::noop()))
    }

    #[test]
    fn sim_links_deliver_when_time_advances() {
        let hub = SimHub::new(SimConfig {
            seed: 9,
            min_delay: Micros::from_millis(1),
            max_delay: Micros::from_millis(5),
            loss: 0.0,
        });
        let a = hub.link(id("a"));
        let b = hub.link(id("b"));
        assert!(poll_once(pin!(a.send(&id("b"), Channel::Control, frame(42)))).is_ready());
        let mut recv = pin!(b.recv());
        assert!(poll_once(recv.as_mut()).is_pending(), "nothing before time moves");
        assert_eq!(hub.advance_to(Micros::from_millis(1) - Micros(1)), 0);
        assert!(poll_once(recv.as_mut()).is_pending());
        assert_eq!(hub.advance_to(Micros::from_millis(5)), 1);
        let Poll::Ready(Ok(d)) = poll_once(recv.as_mut()) else {
            panic!("delivery released");
        };
        assert_eq!((d.from, payload(&d.frame)), (id("a"), 42));

        // A crashed node cannot send and loses what was waiting in its inbox.
        assert!(poll_once(pin!(a.send(&id("b"), Channel::Control, frame(43)))).is_ready());
        assert_eq!(hub.advance_by(Micros::from_millis(10)), 1);
        hub.crash(&id("b"));
        assert!(b.try_recv().is_none());
        let Poll::Ready(Err(LinkError::PeerDown(to, why))) =
            poll_once(pin!(a.send(&id("b"), Channel::Control, frame(44))))
        else {
            panic!("a send to a crashed peer fails at once");
        };
        assert_eq!((to, why.as_str()), (id("b"), "receiver-crashed"));
        let Poll::Ready(Err(LinkError::Closed)) =
            poll_once(pin!(b.send(&id("a"), Channel::Control, frame(0))))
        else {
            panic!("crashed sender refused");
        };
        hub.restart(&id("b"));
        assert_eq!(b.local_id(), &id("b"));
        assert!(hub.log().iter().any(|l| l.contains("restart b")));
    }

    /// Three tasks gossip counters over lossy sim links; the driver only advances virtual time.
    fn gossip_log(seed: u64) -> Vec<String> {
        let rt = tokio::runtime::Builder::new_current_thread().build().unwrap();
        rt.block_on(async {
            let hub = SimHub::new(SimConfig { seed, loss: 0.2, ..SimConfig::default() });
            let names = ["a", "b", "c"];
            for n in names {
                let link = hub.link(id(n));
                tokio::spawn(async move {
                    while let Ok(d) = link.recv().await {
                        let v = payload(&d.frame);
                        if v >= 12 {
                            continue;
                        }
                        for to in names.iter().filter(|m| **m != n) {
                            if link.send(&id(to), Channel::Data, frame(v + 1)).await.is_err() {
                                return;
                            }
                        }
                    }
                });
            }
            let start = hub.link(id("driver"));
            start.send(&id("a"), Channel::Data, frame(0)).await.unwrap();
            let mut steps = 0;
            loop {
                // Let every woken task drain its inbox, then release the next due frame(s).
                for _ in 0..4 {
                    tokio::task::yield_now().await;
                }
                if hub.step().is_none() {
                    break;
                }
                steps += 1;
                assert!(steps < 100_000, "gossip does not settle");
            }
            hub.log()
        })
    }

    #[test]
    fn async_tasks_over_sim_links_replay_exactly() {
        let first = gossip_log(5);
        assert!(first.len() > 100, "{} lines", first.len());
        assert!(first.iter().any(|l| l.ends_with(" lost")));
        assert_eq!(first, gossip_log(5));
        assert_ne!(first, gossip_log(6));
    }

    #[tokio::test(flavor = "current_thread")]
    async fn async_ping_pong_over_sim_links() {
        let hub = SimHub::new(SimConfig::default());
        let a = hub.link(id("a"));
        let b = hub.link(id("b"));
        let echo = tokio::spawn(async move {
            for _ in 0..3 {
                let d = b.recv().await?;
                let v = payload(&d.frame);
                b.send(&d.from, d.channel, frame(v + 1)).await?;
            }
            Ok::<_, LinkError>(())
        });
        let mut got = Vec::new();
        for i in 0..3u64 {
            a.send(&id("b"), Channel::Data, frame(i * 10)).await.unwrap();
            // Release due frames in time order and let the echo task run until the pong is back.
            let mut rounds = 0;
            let reply = loop {
                if let Some(d) = a.try_recv() {
                    break d;
                }
                let _ = hub.step();
                tokio::task::yield_now().await;
                rounds += 1;
                assert!(rounds < 1000, "no reply");
            };
            got.push(payload(&reply.frame));
        }
        echo.await.unwrap().unwrap();
        assert_eq!(got, vec![1, 11, 21]);
        assert!(hub.now() >= Micros::from_millis(6), "three round trips of >= 2 ms");
    }
}
