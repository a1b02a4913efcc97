//! The fault explorer's schedule (simulation only): from a seed and a description of the
//! simulated cluster, a deterministic list of timed faults — node crashes and restarts,
//! partitions and heals, bursts of loss and delay — that the explorer performs on a
//! `troupe_actors::sim::SimCluster`.
//!
//! Caps keep every run one that can end: the node the workload's client runs on is never
//! faulted; at most `max_down` of the faultable nodes are crashed or cut off at once (a fault
//! that would pass the cap is drawn as a burst instead); every crash is followed by its node's
//! restart, every partition by its heal and every burst by its end, within `outage_max`, so
//! after `horizon + outage_max` the cluster is whole again. Pure: the seed is the only
//! randomness and times are virtual.

use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

use crate::time::Micros;

/// What a schedule is drawn over.
#[derive(Clone, Debug, PartialEq)]
pub struct FaultSpace {
    /// The seed: the same space gives the same schedule.
    pub seed: u64,
    /// The node the workload's client runs on (never crashed nor cut off).
    pub client: String,
    /// The nodes that may be crashed or cut off from the rest.
    pub nodes: Vec<String>,
    /// At most this many of `nodes` down (crashed or cut off) at once.
    pub max_down: usize,
    /// How many faults to draw.
    pub faults: usize,
    /// Faults start within `[0, horizon)`.
    pub horizon: Micros,
    /// Shortest crash-to-restart, partition-to-heal or burst length.
    pub outage_min: Micros,
    /// Longest one (inclusive).
    pub outage_max: Micros,
    /// The largest random loss probability a burst draws.
    pub max_loss: f64,
    /// The largest one-way delay a burst draws.
    pub max_delay: Micros,
    /// Each of `nodes` runs its clock at a rate drawn in `[1 - max_clock_skew, 1 + max_clock_skew]`
    /// of true time (0: every clock exact).
    pub max_clock_skew: f64,
}

/// One fault (or its repair).
#[derive(Clone, Debug, PartialEq)]
pub enum SimFault {
    /// Crash `node`: its traffic is dropped and its actors stop, with no goodbye.
    Crash(String),
    /// Start a fresh incarnation of the crashed `node`.
    Restart(String),
    /// Cut `node` off from every other node.
    Partition(String),
    /// Reconnect `node` and the others.
    Heal(String),
    /// From now on lose frames with probability `loss` and delay them up to `max_delay`
    /// (frames of different flows overtake each other: the reordering the transport allows).
    Impair {
        /// Loss probability.
        loss: f64,
        /// Largest one-way delay.
        max_delay: Micros,
    },
    /// Back to the run's baseline network.
    Unimpair,
    /// Right after `node`'s crash: what the crash left on its disk ([`with_process_faults`]).
    Tear(String, Tear),
    /// Arm a panic at `node`'s scheduler fault site: its next input panics there, through the
    /// node's fault switch ([`with_process_faults`]).
    Panic(String),
}

/// What a crash left of the append in progress on the crashed node's disk. A journal append is
/// acknowledged only after `fdatasync`, so a crash can lose nothing acknowledged: what it can
/// leave is part of the one append nobody was told of, or a compaction's temp file never
/// renamed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Tear {
    /// No append was in progress.
    Clean,
    /// A record header cut after this many of its 12 bytes (1..=11).
    Header(u8),
    /// A whole header and this many per mille of the body it announces (0..1000).
    Body(u16),
    /// A whole record whose checksum fails (its body's last sector never reached the disk).
    BadChecksum,
    /// A compaction's temp file, written but never renamed over the journal.
    Compacting,
}

/// Which nodes keep a journal (torn on their crashes) and whose scheduler may be made to panic.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ProcessSpace {
    /// The seed (the same one the schedule was drawn from).
    pub seed: u64,
    /// Nodes with a journal: each of their crashes is followed by a [`SimFault::Tear`].
    pub disks: Vec<String>,
    /// Nodes running a scheduler with a fault site.
    pub schedulers: Vec<String>,
    /// Panics to draw.
    pub panics: usize,
    /// Panics are armed within `[0, horizon)`.
    pub horizon: Micros,
}

/// `schedule` with the process and storage faults of `space` added: a [`SimFault::Tear`] right
/// after each crash of a node with a disk, and `space.panics` [`SimFault::Panic`]s at drawn times.
/// Drawn from a stream of their own, so the network faults of a seed stay the ones
/// [`schedule`] draws; pure, like it.
pub fn with_process_faults(schedule: &FaultSchedule, space: &ProcessSpace) -> FaultSchedule {
    let mut rng = SmallRng::seed_from_u64(space.seed ^ 0x7e47_d15c_0000_0001);
    let mut out = Vec::with_capacity(schedule.faults.len());
    for f in &schedule.faults {
        out.push(f.clone());
        if let SimFault::Crash(n) = &f.fault
            && space.disks.contains(n)
        {
            let tear = match rng.random_range(0..5u32) {
                0 => Tear::Clean,
                1 => Tear::Header(rng.random_range(1..12u8)),
                2 => Tear::Body(rng.random_range(0..1000u16)),
                3 => Tear::BadChecksum,
                _ => Tear::Compacting,
            };
            out.push(TimedFault { at: f.at, fault: SimFault::Tear(n.clone(), tear) });
        }
    }
    if !space.schedulers.is_empty() {
        for _ in 0..space.panics {
            let at = Micros(rng.random_range(0..space.horizon.0.max(1)));
            let node = space.schedulers[rng.random_range(0..space.schedulers.len())].clone();
            // after every fault at the same time, so a crash's tear stays right after it
            let i = out.partition_point(|f| f.at <= at);
            out.insert(i, TimedFault { at, fault: SimFault::Panic(node) });
        }
    }
    FaultSchedule { faults: out, clock_rates: schedule.clock_rates.clone() }
}

/// A fault at a virtual time since the run's start.
#[derive(Clone, Debug, PartialEq)]
pub struct TimedFault {
    /// When.
    pub at: Micros,
    /// What.
    pub fault: SimFault,
}

/// A run's faults in time order (ties in drawing order).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct FaultSchedule {
    /// The faults.
    pub faults: Vec<TimedFault>,
    /// Clock skew between nodes: the rate each node's clock runs at (1.0: true time), for the
    /// nodes not listed 1.0. Its periods and timeouts stretch by it.
    pub clock_rates: Vec<(String, f64)>,
}

impl FaultSchedule {
    /// The rate `node`'s clock runs at (1.0 unless [`FaultSchedule::clock_rates`] skews it).
    pub fn clock_rate(&self, node: &str) -> f64 {
        self.clock_rates.iter().find(|(n, _)| n == node).map_or(1.0, |(_, r)| *r)
    }
}

impl FaultSchedule {
    /// When the last fault (always a repair) happens; zero when there are none.
    pub fn end(&self) -> Micros {
        self.faults.last().map_or(Micros::ZERO, |f| f.at)
    }
}

/// What kind of outage a fault is, while drawing.
#[derive(Clone, Copy)]
enum Kind {
    Crash,
    Partition,
    Burst,
}

/// Draws the schedule of `space` (see the module docs for the caps).
pub fn schedule(space: &FaultSpace) -> FaultSchedule {
    let mut rng = SmallRng::seed_from_u64(space.seed);
    let mut starts: Vec<Micros> =
        (0..space.faults).map(|_| Micros(rng.random_range(0..space.horizon.0.max(1)))).collect();
    starts.sort();
    let (lo, hi) = (space.outage_min.0.min(space.outage_max.0), space.outage_min.0.max(space.outage_max.0));
    // (node, until) of the nodes down now, and until when a burst lasts
    let mut down: Vec<(usize, Micros)> = Vec::new();
    let mut burst_until = Micros::ZERO;
    let mut out: Vec<(Micros, usize, SimFault)> = Vec::new();
    for at in starts {
        down.retain(|(_, until)| *until > at);
        let length = Micros(rng.random_range(lo..=hi));
        let drawn = match rng.random_range(0..10u32) {
            0..4 => Kind::Crash,
            4..7 => Kind::Partition,
            _ => Kind::Burst,
        };
        let node = rng.random_range(0..space.nodes.len().max(1));
        let (loss, delay) =
            (rng.random_range(0.0..=space.max_loss.max(0.0)), rng.random_range(0..=space.max_delay.0));
        let free =
            down.len() < space.max_down && !space.nodes.is_empty() && !down.iter().any(|(n, _)| *n == node);
        let kind = if free { drawn } else { Kind::Burst };
        let seq = out.len();
        match kind {
            Kind::Crash | Kind::Partition => {
                let name = space.nodes[node].clone();
                down.push((node, at + length));
                let (hit, fix) = if matches!(kind, Kind::Crash) {
                    (SimFault::Crash(name.clone()), SimFault::Restart(name))
                } else {
                    (SimFault::Partition(name.clone()), SimFault::Heal(name))
                };
                out.push((at, seq, hit));
                out.push((at + length, seq + 1, fix));
            }
            Kind::Burst if burst_until <= at => {
                burst_until = at + length;
                out.push((at, seq, SimFault::Impair { loss, max_delay: Micros(delay) }));
                out.push((at + length, seq + 1, SimFault::Unimpair));
            }
            Kind::Burst => {}
        }
    }
    out.sort_by_key(|(at, seq, _)| (*at, *seq));
    // clock rates from a stream of their own: the faults stay those the seed drew before
    let mut clocks = SmallRng::seed_from_u64(space.seed ^ 0xc10c_5e3d_0000_0002);
    let skew = space.max_clock_skew.clamp(0.0, 0.9);
    let clock_rates = if skew > 0.0 {
        space.nodes.iter().map(|n| (n.clone(), clocks.random_range(1.0 - skew..=1.0 + skew))).collect()
    } else {
        Vec::new()
    };
    FaultSchedule {
        faults: out.into_iter().map(|(at, _, fault)| TimedFault { at, fault }).collect(),
        clock_rates,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn space(seed: u64) -> FaultSpace {
        FaultSpace {
            seed,
            client: "client".into(),
            nodes: vec!["w1".into(), "w2".into(), "w3".into()],
            max_down: 2,
            faults: 8,
            horizon: Micros::from_secs(5),
            outage_min: Micros::from_millis(200),
            outage_max: Micros::from_secs(3),
            max_loss: 0.1,
            max_delay: Micros::from_millis(50),
            max_clock_skew: 0.0,
        }
    }

    #[test]
    fn clock_rates_stay_within_the_skew_and_leave_the_faults_as_drawn() {
        let skewed = FaultSpace { max_clock_skew: 0.2, ..space(4) };
        let s = schedule(&skewed);
        assert_eq!(s.faults, schedule(&space(4)).faults, "skew draws from its own stream");
        assert_eq!(s.clock_rates.len(), 3);
        assert!(s.clock_rates.iter().all(|(_, r)| (0.8..=1.2).contains(r)), "{:?}", s.clock_rates);
        assert!(s.clock_rates.iter().any(|(_, r)| (*r - 1.0).abs() > 1e-6));
        assert_eq!(s.clock_rate("client"), 1.0, "the client's clock is exact");
        assert_eq!(s, schedule(&skewed), "one seed, one schedule");
        assert!(schedule(&space(4)).clock_rates.is_empty());
    }

    #[test]
    fn one_seed_gives_one_schedule_and_seeds_differ() {
        assert_eq!(schedule(&space(9)), schedule(&space(9)));
        let distinct: std::collections::BTreeSet<String> =
            (0..20).map(|s| format!("{:?}", schedule(&space(s)))).collect();
        assert!(distinct.len() > 15, "seeds draw different schedules: {}", distinct.len());
    }

    /// Over many seeds: the client is never faulted, at most `max_down` nodes are down at once,
    /// every outage is repaired within `outage_max` and the run's faults end by
    /// `horizon + outage_max`; crashes, partitions and bursts all occur.
    #[test]
    fn caps_hold_and_every_outage_is_repaired_in_time() {
        let mut kinds = [0usize; 3];
        for seed in 0..500 {
            let sp = space(seed);
            let s = schedule(&sp);
            assert!(s.faults.windows(2).all(|w| w[0].at <= w[1].at), "time order");
            assert!(s.end() <= sp.horizon + sp.outage_max, "seed {seed}: ends at {}", s.end());
            let mut down: Vec<(String, Micros)> = Vec::new();
            let mut impaired: Option<Micros> = None;
            for f in &s.faults {
                match &f.fault {
                    SimFault::Crash(n) | SimFault::Partition(n) => {
                        assert!(n != &sp.client && sp.nodes.contains(n));
                        assert!(!down.iter().any(|(d, _)| d == n), "seed {seed}: {n} down twice");
                        down.push((n.clone(), f.at));
                        assert!(down.len() <= sp.max_down, "seed {seed}: {} down at {}", down.len(), f.at);
                        kinds[usize::from(matches!(f.fault, SimFault::Partition(_)))] += 1;
                    }
                    SimFault::Restart(n) | SimFault::Heal(n) => {
                        let i = down.iter().position(|(d, _)| d == n).expect("repairs what is down");
                        let (_, since) = down.remove(i);
                        assert!(f.at.saturating_sub(since) <= sp.outage_max);
                    }
                    SimFault::Impair { loss, max_delay } => {
                        assert!(impaired.is_none(), "seed {seed}: one burst at a time");
                        assert!(*loss <= sp.max_loss && *max_delay <= sp.max_delay);
                        impaired = Some(f.at);
                        kinds[2] += 1;
                    }
                    SimFault::Unimpair => {
                        let since = impaired.take().expect("ends a burst");
                        assert!(f.at.saturating_sub(since) <= sp.outage_max);
                    }
                    SimFault::Tear(..) | SimFault::Panic(_) => panic!("schedule draws no process faults"),
                }
            }
            assert!(down.is_empty() && impaired.is_none(), "seed {seed}: the cluster ends whole");
        }
        assert!(kinds.iter().all(|k| *k > 100), "crashes, partitions, bursts: {kinds:?}");
    }

    /// Process faults leave the network faults as drawn, tear every crash of a node with a disk
    /// right after it (and no other node's), draw every kind of tear, and arm the panics asked for.
    #[test]
    fn process_faults_tear_each_crash_of_a_disk_and_keep_the_network_faults() {
        let mut tears = std::collections::BTreeSet::new();
        for seed in 0..300 {
            let base = schedule(&space(seed));
            let ps = ProcessSpace {
                seed,
                disks: vec!["w1".into()],
                schedulers: vec!["w1".into()],
                panics: 2,
                horizon: Micros::from_secs(5),
            };
            let s = with_process_faults(&base, &ps);
            assert_eq!(with_process_faults(&base, &ps), s, "pure");
            assert!(s.faults.windows(2).all(|w| w[0].at <= w[1].at), "time order");
            let network: Vec<_> = s
                .faults
                .iter()
                .filter(|f| !matches!(f.fault, SimFault::Tear(..) | SimFault::Panic(_)))
                .collect();
            assert_eq!(network, base.faults.iter().collect::<Vec<_>>());
            assert_eq!(s.faults.iter().filter(|f| matches!(f.fault, SimFault::Panic(_))).count(), 2);
            for (i, f) in s.faults.iter().enumerate() {
                let torn = s.faults.get(i + 1).and_then(|n| match &n.fault {
                    SimFault::Tear(node, t) => Some((node.clone(), *t)),
                    _ => None,
                });
                match &f.fault {
                    SimFault::Crash(n) if n == "w1" => {
                        let (node, t) = torn.expect("a crash of w1 is torn right after");
                        assert_eq!(node, "w1");
                        tears.insert(format!("{:?}", t).chars().take(4).collect::<String>());
                    }
                    SimFault::Crash(_) => assert!(torn.is_none(), "seed {seed}: only disks tear"),
                    _ => {}
                }
            }
        }
        assert_eq!(tears.len(), 5, "every kind of tear: {tears:?}");
    }

    #[test]
    fn no_faultable_nodes_gives_only_bursts() {
        let sp = FaultSpace { nodes: Vec::new(), ..space(3) };
        assert!(
            schedule(&sp)
                .faults
                .iter()
                .all(|f| matches!(f.fault, SimFault::Impair { .. } | SimFault::Unimpair))
        );
    }
}
