//! The fault explorer (simulation only): runs a workload on a fresh [`SimCluster`] under one
//! seed's fault schedule ([`troupe_policy::sim::faults`]) and checks the run's invariants.
//!
//! One seed is one run: a new current-thread runtime with paused time, the workload's nodes on
//! a hub seeded by the seed, the workload's client started on its own node (never faulted), and
//! the schedule's crashes, restarts, partitions, heals and loss/delay bursts performed at their
//! virtual times while the client works. The verdict lists what broke:
//!
//! - **answered exactly once**: every request the client submitted has exactly one answer;
//!   none was given up on;
//! - **outputs**: each answer equals the fault-free run's (the same workload, no faults);
//! - **bounded queues**: the frames in flight on the net never pass [`MAX_IN_FLIGHT`] (sampled
//!   at every fault and at the end);
//! - **the run ends**: the client is done within [`RUN_DEADLINE`] of virtual time.
//!
//! A workload with a disk or a fault site of its own adds process and storage faults to the
//! schedule ([`troupe_policy::sim::faults::with_process_faults`]: a torn journal tail after a
//! crash, a scheduler panic through the fault switch) and performs them
//! ([`SimWorkload::process_fault`]); its own end-of-run invariants come back through
//! [`SimWorkload::check`].
//!
//! The verdict carries a hash of the run's event log, so a replay of its seed can be checked
//! byte for byte. A workload plugs in through [`SimWorkload`]: its nodes, what every fresh
//! incarnation of a node registers, and a client that returns its answers by request number.
//! The coe, pipeline and coadapt workloads fit the same shape once their shells run on a
//! simulated node: their client submits requests, inputs or uploads and returns each one's
//! output digest.

pub mod coadapt;
#[cfg(feature = "onnx")]
pub mod coe;
pub mod disk;
#[cfg(feature = "onnx")]
pub mod pipeline;
pub mod typed;

use std::collections::BTreeMap;
use std::future::Future;
use std::time::Duration;

use troupe_policy::Micros;
use troupe_policy::sim::faults::{
    self, FaultSchedule, FaultSpace, ProcessSpace, SimFault, with_process_faults,
};
use troupe_transport::{NodeId, SimConfig};

use super::{SimCluster, SimNode, SimNodeSpec};

/// The longest a run may take in virtual time: its faults end by then, and its client too.
pub const RUN_DEADLINE: Duration = Duration::from_secs(120);

/// The most frames that may be in flight on the net at once.
pub const MAX_IN_FLIGHT: usize = 4096;

/// What the client got: every answer per request number (more than one is a violation), and
/// the requests it gave up on.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Answers {
    /// Answers (output digests) by request number.
    pub answers: BTreeMap<u64, Vec<u64>>,
    /// Requests never answered (the client's retries ran out).
    pub given_up: Vec<u64>,
}

/// A workload the explorer can run (see the module docs).
pub trait SimWorkload: Sync {
    /// Its name on the command line and in figures.
    fn name(&self) -> &'static str;
    /// Its nodes, the client's first (never faulted); names start with `tag`, as ractor's
    /// registry is process-wide.
    fn nodes(&self, tag: &str) -> Vec<SimNodeSpec>;
    /// What every start of a node does before anything else runs (register its kinds).
    fn prepare(&self, node: &SimNode);
    /// The client, run on the client node: submits the workload and returns what came back.
    fn client(&self, tag: &str, node: &SimNode) -> impl Future<Output = Answers> + Send + 'static;
    /// Nodes of run `tag` that keep a journal: in [`sweep`]'s schedules each crash of one is
    /// followed by a seeded [`SimFault::Tear`] ([`with_process_faults`]), which
    /// [`SimWorkload::process_fault`] leaves on its journal ([`disk::tear_journal`]). None by
    /// default.
    fn disks(&self, _tag: &str) -> Vec<String> {
        Vec::new()
    }
    /// Nodes of run `tag` whose scheduler runs behind a fault-switch site of the run's own: in
    /// [`sweep`]'s schedules one seeded [`SimFault::Panic`] goes to one of them, which
    /// [`SimWorkload::process_fault`] arms. None by default.
    fn schedulers(&self, _tag: &str) -> Vec<String> {
        Vec::new()
    }
    /// A run under `tag` starts (before its nodes): forget what an earlier one left.
    fn begin(&self, _tag: &str) {}
    /// Performs a process or storage fault ([`SimFault::Tear`], [`SimFault::Panic`]) on the
    /// workload's own state (its disks, its fault sites); how many files it left torn (workloads
    /// without them ignore it).
    fn process_fault(&self, _tag: &str, _fault: &SimFault) -> Result<usize, String> {
        Ok(0)
    }
    /// The workload's own invariants at the end of a run (after its client is done).
    fn check(&self, _tag: &str) -> Vec<String> {
        Vec::new()
    }
}

/// How the explorer draws a seed's network and faults.
#[derive(Clone, Copy, Debug)]
pub struct ExploreConfig {
    /// Faults drawn per seed.
    pub faults: usize,
    /// Faults start within this much virtual time.
    pub horizon: Micros,
    /// Longest outage (crash to restart, partition to heal, burst).
    pub outage_max: Micros,
    /// Clock skew between nodes: each faultable node's clock runs at a rate within this
    /// fraction of true time, so its heartbeat period and failure timeout stretch or shrink by
    /// it (what a node's clock decides on its own; no decision compares clocks across nodes).
    pub max_clock_skew: f64,
}

impl Default for ExploreConfig {
    fn default() -> Self {
        Self {
            faults: 6,
            horizon: Micros::from_secs(8),
            outage_max: Micros::from_secs(4),
            max_clock_skew: 0.2,
        }
    }
}

/// One seed's result.
#[derive(Clone, Debug)]
pub struct Verdict {
    /// The workload.
    pub workload: &'static str,
    /// The seed.
    pub seed: u64,
    /// What broke (empty: the run held every invariant).
    pub violations: Vec<String>,
    /// Lines in the event log.
    pub events: usize,
    /// blake3 of the event log (one seed, one hash).
    pub log_hash: String,
    /// The client's answers.
    pub answers: Answers,
    /// The event log (for a replay's `--log`).
    pub log: Vec<String>,
}

/// The schedule of `seed` for a workload's nodes (the first is the client's).
pub fn schedule_for(seed: u64, nodes: &[SimNodeSpec], config: &ExploreConfig) -> FaultSchedule {
    let faultable: Vec<String> = nodes.iter().skip(1).map(|n| n.name.to_string()).collect();
    faults::schedule(&FaultSpace {
        seed,
        client: nodes.first().map(|n| n.name.to_string()).unwrap_or_default(),
        max_down: faultable.len().saturating_sub(1),
        nodes: faultable,
        faults: config.faults,
        horizon: config.horizon,
        outage_min: Micros::from_millis(100),
        outage_max: config.outage_max,
        max_loss: 0.2,
        max_delay: Micros::from_millis(200),
        max_clock_skew: config.max_clock_skew,
    })
}

/// The network of `seed` outside bursts.
pub fn net_for(seed: u64) -> SimConfig {
    SimConfig { seed, min_delay: Micros::from_millis(1), max_delay: Micros::from_millis(20), loss: 0.0 }
}

/// Runs `workload` once under `schedule` on a fresh one-thread paused-time runtime.
/// `reference` (the fault-free answers) is checked against when given. Names start with `tag`.
pub fn run_seed<W: SimWorkload>(
    workload: &W,
    tag: &str,
    seed: u64,
    schedule: &FaultSchedule,
    reference: Option<&Answers>,
) -> Verdict {
    let rt = match tokio::runtime::Builder::new_current_thread().enable_all().start_paused(true).build() {
        Ok(rt) => rt,
        Err(e) => return failed(workload, seed, format!("no runtime: {e}")),
    };
    let (mut violations, answers, log) = rt.block_on(run(workload, tag, seed, schedule));
    if let Some(reference) = reference {
        violations.extend(compare(&answers, reference));
    }
    let events = log.len();
    let log_hash = blake3::hash(log.join("\n").as_bytes()).to_hex().to_string();
    Verdict { workload: workload.name(), seed, violations, events, log_hash, answers, log }
}

fn failed<W: SimWorkload>(workload: &W, seed: u64, why: String) -> Verdict {
    Verdict {
        workload: workload.name(),
        seed,
        violations: vec![why],
        events: 0,
        log_hash: String::new(),
        answers: Answers::default(),
        log: Vec::new(),
    }
}

/// The run: (violations found during it, the answers, the event log).
async fn run<W: SimWorkload>(
    workload: &W,
    tag: &str,
    seed: u64,
    schedule: &FaultSchedule,
) -> (Vec<String>, Answers, Vec<String>) {
    let mut violations = Vec::new();
    workload.begin(tag);
    let specs = skewed(workload.nodes(tag), schedule);
    let mut cluster = match SimCluster::start(net_for(seed), specs.clone()).await {
        Ok(c) => c,
        Err(e) => return (vec![format!("the cluster did not start: {e}")], Answers::default(), Vec::new()),
    };
    for (node, rate) in &schedule.clock_rates {
        cluster.note(&format!("test runs {node}'s clock at {rate:.4}x true time"));
    }
    for spec in &specs {
        if let Some(node) = cluster.node(spec.name.as_str()) {
            workload.prepare(node);
        }
    }
    let Some(client_node) = specs.first().and_then(|s| cluster.node(s.name.as_str())) else {
        return (vec!["the workload has no client node".into()], Answers::default(), cluster.log());
    };
    let mut client = tokio::spawn(workload.client(tag, client_node));
    let origin = crate::clock::timer_now();
    let deadline = origin + RUN_DEADLINE;
    let mut done = None;
    for f in &schedule.faults {
        tokio::select! {
            biased;
            r = &mut client => { done = Some(r); break; }
            () = tokio::time::sleep_until(origin + Duration::from_micros(f.at.0)) => {}
        }
        if let Err(e) = apply(workload, tag, &mut cluster, &f.fault).await {
            violations.push(format!("at {}: {e}", f.at));
        }
        check_in_flight(&cluster, &mut violations);
    }
    let answers = match done {
        Some(r) => r.ok(),
        None => match tokio::time::timeout_at(deadline, &mut client).await {
            Ok(r) => r.ok(),
            Err(_) => {
                violations.push(format!("the run did not end within {RUN_DEADLINE:?} of virtual time"));
                client.abort();
                None
            }
        },
    };
    check_in_flight(&cluster, &mut violations);
    let answers = answers.unwrap_or_else(|| {
        if violations.is_empty() {
            violations.push("the client panicked".into());
        }
        Answers::default()
    });
    for (id, got) in &answers.answers {
        if got.len() != 1 {
            violations.push(format!("request {id} answered {} times", got.len()));
        }
    }
    if !answers.given_up.is_empty() {
        violations.push(format!("requests never answered: {:?}", answers.given_up));
    }
    violations.extend(workload.check(tag));
    let log = cluster.log();
    cluster.shutdown().await;
    (violations, answers, log)
}

/// `specs` with each node's clock skewed as `schedule` says: a clock running at rate `r` ends
/// its heartbeat periods and failure timeouts after `1/r` of their true length (its restarts
/// keep the rate: the clock is the machine's).
fn skewed(mut specs: Vec<SimNodeSpec>, schedule: &FaultSchedule) -> Vec<SimNodeSpec> {
    for spec in &mut specs {
        let rate = schedule.clock_rate(spec.name.as_str());
        if rate > 0.0 && (rate - 1.0).abs() > f64::EPSILON {
            let m = &mut spec.membership;
            m.heartbeat = m.heartbeat.div_f64(rate);
            m.timeout = m.timeout.div_f64(rate);
        }
    }
    specs
}

/// Performs one fault on the cluster.
async fn apply<W: SimWorkload>(
    workload: &W,
    tag: &str,
    cluster: &mut SimCluster,
    fault: &SimFault,
) -> Result<(), String> {
    match fault {
        SimFault::Crash(n) => {
            cluster.crash(n).await;
        }
        SimFault::Restart(n) => {
            if let Some(node) = cluster.restart(n).await.map_err(|e| format!("restarting {n}: {e}"))? {
                workload.prepare(node);
            }
        }
        SimFault::Partition(n) | SimFault::Heal(n) => {
            let cut = matches!(fault, SimFault::Partition(_));
            // every other node, running or crashed: a heal that skipped a node down at the time
            // left that pair cut off for good once it restarted (seed 23 of the coe, pipeline and
            // coadapt workloads alike)
            let others: Vec<NodeId> = cluster.specs.keys().filter(|k| k.as_str() != n).cloned().collect();
            let me = NodeId::new(n);
            cluster.note(&format!("test {} {n}", if cut { "cuts off" } else { "heals" }));
            cluster.hub.with_net(|net, now| {
                for o in &others {
                    if cut { net.partition(now, &me, o) } else { net.heal(now, &me, o) }
                }
            });
        }
        SimFault::Impair { loss, max_delay } => {
            cluster.hub.with_net(|net, now| net.set_impairment(now, *loss, *max_delay));
        }
        SimFault::Unimpair => {
            let base = cluster.hub.with_net(|net, _| net.config().seed);
            let base = net_for(base);
            cluster.hub.with_net(|net, now| net.set_impairment(now, base.loss, base.max_delay));
        }
        SimFault::Tear(..) | SimFault::Panic(_) => {
            let files = workload.process_fault(tag, fault)?;
            cluster.note(&format!("test {fault:?} ({files} files left torn)"));
        }
    }
    Ok(())
}

fn check_in_flight(cluster: &SimCluster, violations: &mut Vec<String>) {
    let n = cluster.hub.with_net(|net, _| net.in_flight());
    if n > MAX_IN_FLIGHT {
        violations.push(format!("{n} frames in flight (bound {MAX_IN_FLIGHT})"));
    }
}

/// Where `got` differs from the fault-free `reference`.
pub fn compare(got: &Answers, reference: &Answers) -> Vec<String> {
    let mut out = Vec::new();
    for (id, want) in &reference.answers {
        match got.answers.get(id) {
            Some(g) if g.first() == want.first() => {}
            Some(g) => out.push(format!("request {id}: output {g:?}, the fault-free run's {want:?}")),
            None if got.given_up.contains(id) => {}
            None => out.push(format!("request {id}: never submitted")),
        }
    }
    out
}

/// A sweep over consecutive seeds of one workload.
#[derive(Clone, Debug)]
pub struct Sweep {
    /// The workload.
    pub workload: &'static str,
    /// Seeds run.
    pub seeds: u64,
    /// The verdicts with violations (the fault-free reference run's too, if it had any).
    pub failed: Vec<Verdict>,
    /// Event-log lines over every run.
    pub events: u64,
    /// Wall time of the sweep (the reference run included).
    pub wall: Duration,
}

impl Sweep {
    /// Seeds per minute of wall time.
    pub fn seeds_per_min(&self) -> f64 {
        self.seeds as f64 * 60.0 / self.wall.as_secs_f64().max(1e-9)
    }

    /// Event-log lines per second of wall time.
    pub fn events_per_s(&self) -> f64 {
        self.events as f64 / self.wall.as_secs_f64().max(1e-9)
    }
}

/// Runs `workload` fault-free once (the reference outputs), then under the schedules of seeds
/// `from..from + seeds`, calling `each` with every verdict. Names start with the workload's
/// name, so one sweep per workload may run in a process at a time.
pub fn sweep<W: SimWorkload>(
    workload: &W,
    from: u64,
    seeds: u64,
    config: &ExploreConfig,
    each: impl FnMut(&Verdict),
) -> Sweep {
    let tag = workload.name();
    let nodes = workload.nodes(tag);
    let (disks, schedulers) = (workload.disks(tag), workload.schedulers(tag));
    let schedule = |_: &str, seed| schedule_with_process_faults(seed, &nodes, &disks, &schedulers, config);
    sweep_with(workload, from, seeds, schedule, each)
}

/// [`schedule_for`] with a seeded [`SimFault::Tear`] after each crash of a node in `disks` and
/// one [`SimFault::Panic`] of a scheduler on a node of `schedulers`, if any
/// ([`with_process_faults`], its own random stream: the network faults stay `seed`'s).
pub fn schedule_with_process_faults(
    seed: u64,
    nodes: &[SimNodeSpec],
    disks: &[String],
    schedulers: &[String],
    config: &ExploreConfig,
) -> FaultSchedule {
    let schedule = schedule_for(seed, nodes, config);
    if disks.is_empty() && schedulers.is_empty() {
        return schedule;
    }
    let space = ProcessSpace {
        seed,
        disks: disks.to_vec(),
        schedulers: schedulers.to_vec(),
        panics: usize::from(!schedulers.is_empty()),
        horizon: config.horizon,
    };
    with_process_faults(&schedule, &space)
}

/// Arms one panic of the scheduler behind fault-switch site `site` at its next input (a
/// [`SimFault::Panic`]); `arm` false disarms the site (a run's start).
pub fn arm_scheduler_panic(site: &str, arm: bool) {
    let plan = if arm {
        troupe_policy::FaultPlan::new(0).with_site(site, troupe_policy::SiteRule::once_at(1))
    } else {
        troupe_policy::FaultPlan::default()
    };
    crate::fault::install_site(site, plan);
}

/// [`sweep`] with each seed's schedule drawn by `schedule(tag, seed)` (a workload that adds
/// process and storage faults to [`schedule_for`]'s).
pub fn sweep_with<W: SimWorkload>(
    workload: &W,
    from: u64,
    seeds: u64,
    schedule: impl Fn(&str, u64) -> FaultSchedule,
    mut each: impl FnMut(&Verdict),
) -> Sweep {
    // wall time of the sweep (outside any runtime: the monotonic clock), a figure only
    let started = crate::clock::Clock::start();
    let tag = workload.name();
    let reference = run_seed(workload, tag, from, &FaultSchedule::default(), None);
    let mut out = Sweep { workload: tag, seeds: 0, failed: Vec::new(), events: 0, wall: Duration::ZERO };
    if !reference.violations.is_empty() {
        out.failed.push(reference.clone());
    }
    for seed in from..from.saturating_add(seeds) {
        let v = run_seed(workload, tag, seed, &schedule(tag, seed), Some(&reference.answers));
        each(&v);
        out.seeds += 1;
        out.events += v.events as u64;
        if !v.violations.is_empty() {
            out.failed.push(v);
        }
    }
    out.wall = started.elapsed();
    out
}

/// The one command that replays `seed` of `workload`.
pub fn replay_command(workload: &str, seed: u64) -> String {
    format!("troupe sim --workload {workload} --seeds 1 --from {seed}")
}
