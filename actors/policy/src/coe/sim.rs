//! A pure discrete-event simulator: replays a [`Trace`] through a [`RequestScheduler`] with load
//! and batch times from a [`LatencyModel`], checks every decision against the rules a real shell
//! would enforce, and reports throughput, latency, loads and switching.
//!
//! The simulator is also the independent referee of the policy's invariants: an eviction of an
//! expert that is loading or executing, a load past the memory budget, a batch above the max
//! batch size or on a busy executor, a task run before its preliminary or twice, a request
//! completed early or twice: each is reported as [`SimError::Violation`]. Expert outputs are
//! simulated as a hash chain (a subsequent expert's input is its preliminary's output), so a
//! request's output is the same under every correct policy.

use std::cmp::Reverse;
use std::collections::{BTreeMap, BTreeSet, BinaryHeap};
use std::fmt::Write as _;

use super::latency::LatencyModel;
use super::memory::belady_min_loads;
use super::model::{CoeModel, ExpertId, Request, RequestId};
use super::scheduler::{Action, BatchId, ExecutorId, RequestScheduler, SchedulerConfig, SchedulerError};
use super::tiers::{HostCandidate, HostTier};
use super::trace::{Trace, TraceError};
use crate::Micros;

/// Knobs of one simulation run.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SimOptions {
    /// Keep a line per event and decision in [`SimReport::decisions`] (for golden files).
    pub record_decisions: bool,
    /// Stop with [`SimError::Stuck`] after this many events (catches livelock).
    pub max_events: u64,
    /// Lose one executor during the run (its in-flight work is lost and redone elsewhere).
    pub fault: Option<ExecutorFault>,
}

/// An executor crash injected into a simulation.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ExecutorFault {
    /// Index of the executor.
    pub executor: usize,
    /// When it is lost.
    pub at: Micros,
    /// How long until it is back (empty); `None` for never.
    pub back_after: Option<Micros>,
}

impl Default for SimOptions {
    fn default() -> Self {
        SimOptions { record_decisions: false, max_events: 50_000_000, fault: None }
    }
}

/// What a run measured.
#[derive(Clone, Debug, PartialEq)]
pub struct SimReport {
    /// The policy combination's label.
    pub label: &'static str,
    /// Requests completed (all of the trace).
    pub requests: usize,
    /// From the first arrival to the last completion.
    pub makespan: Micros,
    /// Requests per second over the makespan.
    pub throughput_rps: f64,
    /// Median request latency (arrival to completion).
    pub latency_p50: Micros,
    /// 99th percentile request latency.
    pub latency_p99: Micros,
    /// Expert loads, all executors.
    pub loads: u64,
    /// Bytes loaded, all executors.
    pub loaded_bytes: u64,
    /// Batches run.
    pub batches: u64,
    /// Tasks (request, expert) run.
    pub tasks: u64,
    /// Time executors spent loading or running, summed.
    pub busy: Micros,
    /// Time executors spent loading experts, summed.
    pub switching: Micros,
    /// `switching / busy`.
    pub switch_share: f64,
    /// Per executor: the expert of each batch, in the order served.
    pub served: Vec<Vec<ExpertId>>,
    /// Loads Belady's MIN needs on the served order, per executor budget, summed.
    pub belady_loads: u64,
    /// Per request (by index): the simulated output.
    pub outputs: Vec<u64>,
    /// Per request (by index): completion time.
    pub completions: Vec<Micros>,
    /// Highest bytes of resident experts seen per executor.
    pub peak_bytes: Vec<u64>,
    /// Per-executor breakdown.
    pub per_executor: Vec<ExecutorStats>,
    /// Event and decision log, when asked for.
    pub decisions: Vec<String>,
}

impl SimReport {
    /// Loads over Belady's MIN loads on the same served order.
    pub fn loads_over_belady(&self) -> f64 {
        self.loads as f64 / self.belady_loads.max(1) as f64
    }

    /// Mean tasks per batch.
    pub fn mean_batch(&self) -> f64 {
        self.tasks as f64 / self.batches.max(1) as f64
    }
}

/// What one executor did during a run.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ExecutorStats {
    /// Expert loads.
    pub loads: u64,
    /// Batches run.
    pub batches: u64,
    /// Tasks run.
    pub tasks: u64,
    /// Time spent loading.
    pub switching: Micros,
    /// Time spent loading or running.
    pub busy: Micros,
}

/// Why a simulation stopped.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
pub enum SimError {
    /// The trace is inconsistent.
    #[error(transparent)]
    Trace(#[from] TraceError),
    /// The scheduler refused an input.
    #[error("scheduler: {0}")]
    Scheduler(#[from] SchedulerError),
    /// The policy broke a rule.
    #[error("at {at}: {what}")]
    Violation {
        /// Simulated time.
        at: Micros,
        /// The rule broken.
        what: String,
    },
    /// Events ran out (or the event cap was hit) before every request completed.
    #[error("stuck: {completed} of {total} requests completed")]
    Stuck {
        /// Requests completed.
        completed: usize,
        /// Requests in the trace.
        total: usize,
    },
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Event {
    Arrival(usize),
    /// Executor, expert, executor epoch when started.
    LoadDone(usize, ExpertId, u64),
    /// Executor, batch, executor epoch when started.
    BatchDone(usize, BatchId, u64),
    Lose(usize),
    Restore(usize),
}

#[derive(Clone, Debug)]
struct ExecSim {
    resident: BTreeMap<ExpertId, u64>,
    /// The executor's host tier, moved by the same rules as a real executor's.
    host: HostTier,
    used: u64,
    peak: u64,
    loading: Option<ExpertId>,
    running: Option<(BatchId, ExpertId, Vec<RequestId>)>,
    /// Bumped when the executor is lost; events from an older epoch are late results, dropped.
    epoch: u64,
}

impl ExecSim {
    fn new(model: &CoeModel) -> ExecSim {
        ExecSim {
            resident: BTreeMap::new(),
            host: HostTier::new(model, HostTier::default_budget(model)),
            used: 0,
            peak: 0,
            loading: None,
            running: None,
            epoch: 0,
        }
    }
}

#[derive(Clone, Debug, Default)]
struct RequestSim {
    /// Output of each expert that finished for this request.
    outputs: BTreeMap<ExpertId, u64>,
    /// Output of each expert running for this request (committed when its batch finishes).
    pending: BTreeMap<ExpertId, u64>,
    completed: Option<Micros>,
}

/// A 64-bit mixer (splitmix64 finaliser) standing in for "run the expert on this input".
fn mix(a: u64, b: u64) -> u64 {
    let mut z = a ^ b.rotate_left(29) ^ 0x9e37_79b9_7f4a_7c15;
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

struct Sim<'a> {
    trace: &'a Trace,
    latency: &'a LatencyModel,
    scheduler: RequestScheduler,
    now: Micros,
    events: BinaryHeap<Reverse<(Micros, u64, Event)>>,
    seq: u64,
    execs: Vec<ExecSim>,
    reqs: Vec<RequestSim>,
    report: SimReport,
    record: bool,
}

/// Replay `trace` through `config` on the executors of `latency`.
pub fn simulate(
    trace: &Trace,
    latency: &LatencyModel,
    config: SchedulerConfig,
    options: &SimOptions,
) -> Result<SimReport, SimError> {
    trace.validate()?;
    let scheduler = RequestScheduler::new(trace.model.clone(), latency.clone(), config)?;
    let n_exec = latency.executors();
    let n_req = trace.requests.len();
    let mut sim = Sim {
        trace,
        latency,
        scheduler,
        now: Micros::ZERO,
        events: BinaryHeap::new(),
        seq: 0,
        execs: vec![ExecSim::new(&trace.model); n_exec],
        reqs: vec![RequestSim::default(); n_req],
        report: SimReport {
            label: config.label(),
            requests: n_req,
            makespan: Micros::ZERO,
            throughput_rps: 0.0,
            latency_p50: Micros::ZERO,
            latency_p99: Micros::ZERO,
            loads: 0,
            loaded_bytes: 0,
            batches: 0,
            tasks: 0,
            busy: Micros::ZERO,
            switching: Micros::ZERO,
            switch_share: 0.0,
            served: vec![Vec::new(); n_exec],
            belady_loads: 0,
            outputs: vec![0; n_req],
            completions: vec![Micros::ZERO; n_req],
            peak_bytes: vec![0; n_exec],
            per_executor: vec![ExecutorStats::default(); n_exec],
            decisions: Vec::new(),
        },
        record: options.record_decisions,
    };
    for (i, r) in trace.requests.iter().enumerate() {
        sim.push(r.arrival, Event::Arrival(i));
    }
    if let Some(fault) = options.fault {
        if fault.executor >= n_exec {
            return Err(SimError::Violation {
                at: fault.at,
                what: format!("fault names executor {} of {n_exec}", fault.executor),
            });
        }
        sim.push(fault.at, Event::Lose(fault.executor));
        if let Some(after) = fault.back_after {
            sim.push(fault.at + after, Event::Restore(fault.executor));
        }
    }
    let mut processed = 0u64;
    while let Some(Reverse((at, _, event))) = sim.events.pop() {
        processed += 1;
        if processed > options.max_events {
            break;
        }
        sim.now = at;
        sim.step(event)?;
    }
    sim.finish()
}

impl Sim<'_> {
    fn push(&mut self, at: Micros, event: Event) {
        self.seq += 1;
        self.events.push(Reverse((at, self.seq, event)));
    }

    fn violation(&self, what: String) -> SimError {
        SimError::Violation { at: self.now, what }
    }

    fn log(&mut self, line: impl FnOnce() -> String) {
        if self.record {
            let text = line();
            self.report.decisions.push(format!("t={} {text}", self.now.0));
        }
    }

    fn step(&mut self, event: Event) -> Result<(), SimError> {
        let now = self.now;
        match event {
            Event::Arrival(i) => {
                let r = &self.trace.requests[i];
                let request = Request { id: r.id, root: r.root };
                self.log(|| format!("arrive {} {}", request.id, request.root));
                self.scheduler.handle_arrival(now, request)?;
                self.drain()
            }
            Event::LoadDone(e, _, epoch) | Event::BatchDone(e, _, epoch) if epoch != self.execs[e].epoch => {
                self.log(|| format!("late result from lost x{e} dropped"));
                Ok(())
            }
            Event::Lose(e) => {
                let x = &mut self.execs[e];
                x.epoch += 1;
                x.resident.clear();
                x.host = HostTier::new(&self.trace.model, HostTier::default_budget(&self.trace.model));
                x.used = 0;
                x.loading = None;
                if let Some((_, expert, requests)) = x.running.take() {
                    for r in requests {
                        if let Some(req) = self.reqs.get_mut(r.0 as usize) {
                            req.pending.remove(&expert);
                        }
                    }
                }
                self.log(|| format!("lost x{e}"));
                self.scheduler.handle_executor_lost(now, ExecutorId(e as u16))?;
                self.drain()
            }
            Event::Restore(e) => {
                self.log(|| format!("restored x{e}"));
                self.scheduler.handle_executor_restored(now, ExecutorId(e as u16))?;
                self.drain()
            }
            Event::LoadDone(e, expert, _) => {
                if self.execs[e].loading != Some(expert) {
                    return Err(self.violation(format!("x{e} finished loading {expert} it never started")));
                }
                self.execs[e].loading = None;
                self.log(|| format!("loaded x{e} {expert}"));
                self.scheduler.handle_load_done(now, ExecutorId(e as u16), expert)?;
                self.drain()
            }
            Event::BatchDone(e, batch, _) => {
                let Some((running, expert, requests)) = self.execs[e].running.take() else {
                    return Err(self.violation(format!("x{e} finished {batch} while idle")));
                };
                if running != batch {
                    return Err(self.violation(format!("x{e} finished {batch} but runs {running}")));
                }
                for r in &requests {
                    if let Some(req) = self.reqs.get_mut(r.0 as usize)
                        && let Some(v) = req.pending.remove(&expert)
                    {
                        req.outputs.insert(expert, v);
                    }
                }
                self.log(|| format!("done x{e} {batch}"));
                self.scheduler.handle_batch_done(now, ExecutorId(e as u16), batch)?;
                self.drain()?;
                let has_children = self.trace.model.expert(expert).is_some_and(|x| x.has_children());
                if has_children {
                    for r in requests {
                        let Some(tr) = self.trace.requests.get(r.0 as usize) else {
                            continue;
                        };
                        let selected = tr.selection(expert).unwrap_or(&[]).to_vec();
                        self.log(|| {
                            let names: Vec<String> = selected.iter().map(|s| s.to_string()).collect();
                            format!("select {r} {expert} -> [{}]", names.join(" "))
                        });
                        self.scheduler.handle_preliminary_done(now, r, expert, &selected)?;
                        self.drain()?;
                    }
                }
                Ok(())
            }
        }
    }

    fn drain(&mut self) -> Result<(), SimError> {
        while let Some(action) = self.scheduler.poll_action() {
            if self.record {
                self.report.decisions.push(format!("  {action}"));
            }
            self.perform(action)?;
        }
        Ok(())
    }

    fn perform(&mut self, action: Action) -> Result<(), SimError> {
        let now = self.now;
        match action {
            Action::Enqueue { request, .. } => {
                let known = self.reqs.get(request.0 as usize).is_some_and(|r| r.completed.is_none());
                if !known {
                    return Err(self.violation(format!("enqueue for {request}, not in flight")));
                }
            }
            Action::Evict { executor, expert } => {
                let e = executor.index();
                let x = &self.execs[e];
                if x.loading == Some(expert) || x.running.as_ref().is_some_and(|r| r.1 == expert) {
                    return Err(self.violation(format!("{executor} evicted {expert} while it is in use")));
                }
                let Some(size) = self.execs[e].resident.remove(&expert) else {
                    return Err(self.violation(format!("{executor} evicted {expert}, not resident")));
                };
                self.execs[e].used -= size;
                let usage_prob = self.trace.model.expert(expert).map_or(0.0, |x| x.usage_prob);
                self.execs[e].host.demote(&HostCandidate { id: expert, size_bytes: size, usage_prob });
            }
            Action::Load { executor, expert, from } => {
                let e = executor.index();
                let model_expert = self.trace.model.expert(expert);
                let size = model_expert.map_or(0, |x| x.size_bytes);
                let now_in = self.execs[e].host.source_of(expert);
                if now_in != from {
                    return Err(self.violation(format!("{expert} loaded from {from}, it is in {now_in}")));
                }
                let x = &self.execs[e];
                if x.loading.is_some() || x.running.is_some() {
                    return Err(self.violation(format!("{executor} told to load while busy")));
                }
                if x.resident.contains_key(&expert) {
                    return Err(self.violation(format!("{executor} loads {expert} again")));
                }
                let budget = self.latency.expert_budget(e);
                if x.used + size > budget {
                    return Err(self.violation(format!(
                        "{executor} would hold {} bytes, budget {budget}",
                        x.used + size
                    )));
                }
                let x = &mut self.execs[e];
                x.host.promote(expert);
                x.resident.insert(expert, size);
                x.used += size;
                x.peak = x.peak.max(x.used);
                x.loading = Some(expert);
                let t = self.latency.load_time(e, size, from);
                self.report.loads += 1;
                self.report.loaded_bytes += size;
                self.report.switching = self.report.switching + t;
                self.report.busy = self.report.busy + t;
                let stats = &mut self.report.per_executor[e];
                stats.loads += 1;
                stats.switching = stats.switching + t;
                stats.busy = stats.busy + t;
                let epoch = self.execs[e].epoch;
                self.push(now + t, Event::LoadDone(e, expert, epoch));
            }
            Action::RunBatch { executor, batch, expert, requests } => {
                self.run_batch(executor.index(), batch, expert, requests)?;
            }
            Action::Complete { request } => {
                let i = request.0 as usize;
                let Some(tr) = self.trace.requests.get(i) else {
                    return Err(self.violation(format!("completed unknown {request}")));
                };
                if self.reqs[i].completed.is_some() {
                    return Err(self.violation(format!("{request} completed twice")));
                }
                let needed = tr.experts();
                if needed.iter().any(|x| !self.reqs[i].outputs.contains_key(x)) {
                    return Err(self.violation(format!("{request} completed before all experts ran")));
                }
                let output =
                    self.reqs[i].outputs.iter().fold(tr.input, |acc, (x, v)| mix(acc ^ v, u64::from(x.0)));
                self.reqs[i].completed = Some(now);
                self.report.outputs[i] = output;
                self.report.completions[i] = now;
            }
        }
        Ok(())
    }

    fn run_batch(
        &mut self,
        e: usize,
        batch: BatchId,
        expert: ExpertId,
        requests: Vec<RequestId>,
    ) -> Result<(), SimError> {
        let x = &self.execs[e];
        if x.loading.is_some() || x.running.is_some() {
            return Err(self.violation(format!("x{e} told to run {batch} while busy")));
        }
        if !x.resident.contains_key(&expert) {
            return Err(self.violation(format!("x{e} runs {expert}, not resident")));
        }
        if requests.is_empty() || requests.len() > self.latency.max_batch(e) {
            return Err(self.violation(format!("{batch} has {} requests", requests.len())));
        }
        let parent = self.trace.model.expert(expert).and_then(|m| m.preliminary());
        let mut seen = BTreeSet::new();
        for &r in &requests {
            let i = r.0 as usize;
            let Some(tr) = self.trace.requests.get(i) else {
                return Err(self.violation(format!("{batch} runs unknown {r}")));
            };
            let req = &self.reqs[i];
            if !seen.insert(r) || req.outputs.contains_key(&expert) || req.pending.contains_key(&expert) {
                return Err(self.violation(format!("{r} runs {expert} twice")));
            }
            // The input is the request's own data for a root, else the preliminary's output,
            // which must exist and must have selected this expert.
            let input = match parent {
                None if tr.root == expert => tr.input,
                None => return Err(self.violation(format!("{r} runs root {expert}, not its root"))),
                Some(p) => {
                    let selected = tr.selection(p).is_some_and(|s| s.contains(&expert));
                    match self.reqs[i].outputs.get(&p) {
                        Some(v) if selected => *v,
                        _ => {
                            return Err(self.violation(format!("{r} runs {expert} before {p} selected it")));
                        }
                    }
                }
            };
            self.reqs[i].pending.insert(expert, mix(input, u64::from(expert.0)));
        }
        let size = self.trace.model.size_of(expert);
        let t = self.latency.batch_latency(e, size, requests.len());
        self.report.batches += 1;
        self.report.tasks += requests.len() as u64;
        self.report.busy = self.report.busy + t;
        let stats = &mut self.report.per_executor[e];
        stats.batches += 1;
        stats.tasks += requests.len() as u64;
        stats.busy = stats.busy + t;
        self.report.served[e].push(expert);
        self.execs[e].running = Some((batch, expert, requests));
        let epoch = self.execs[e].epoch;
        self.push(self.now + t, Event::BatchDone(e, batch, epoch));
        Ok(())
    }

    fn finish(mut self) -> Result<SimReport, SimError> {
        let total = self.trace.requests.len();
        let completed = self.reqs.iter().filter(|r| r.completed.is_some()).count();
        if completed != total || self.scheduler.in_flight() != 0 {
            return Err(SimError::Stuck { completed, total });
        }
        let report = &mut self.report;
        let first = self.trace.requests.first().map_or(Micros::ZERO, |r| r.arrival);
        let last = report.completions.iter().copied().max().unwrap_or(Micros::ZERO);
        report.makespan = last - first;
        report.throughput_rps = total as f64 / report.makespan.as_secs_f64().max(1e-9);
        let mut latencies: Vec<u64> =
            self.trace.requests.iter().zip(&report.completions).map(|(r, c)| (*c - r.arrival).0).collect();
        latencies.sort_unstable();
        let rank = |p: f64| -> Micros {
            if latencies.is_empty() {
                return Micros::ZERO;
            }
            let idx = ((p * latencies.len() as f64).ceil() as usize).clamp(1, latencies.len()) - 1;
            Micros(latencies[idx])
        };
        report.latency_p50 = rank(0.50);
        report.latency_p99 = rank(0.99);
        report.switch_share = report.switching.0 as f64 / report.busy.0.max(1) as f64;
        let model = &self.trace.model;
        let mut belady = 0;
        for (e, served) in report.served.iter().enumerate() {
            let budget = self.latency.expert_budget(e);
            belady += belady_min_loads(served, |x| model.size_of(x), budget)
                .map_err(|err| SimError::Violation { at: self.now, what: err.to_string() })?;
        }
        report.belady_loads = belady;
        report.peak_bytes = self.execs.iter().map(|x| x.peak).collect();
        Ok(self.report)
    }
}

/// One line per report, for printing comparisons (`label thr ratio loads ...`).
pub fn summary_line(report: &SimReport, baseline: &SimReport) -> String {
    let mut s = String::new();
    let _ = write!(
        s,
        "{:<11} thr {:>8.1} req/s ({:>5.2}x)  loads {:>6} ({:>4.2}x belady)  switch {:>5.1}%  \
         batch {:>5.1}  p50 {:>8.1} ms  p99 {:>8.1} ms",
        report.label,
        report.throughput_rps,
        report.throughput_rps / baseline.throughput_rps.max(1e-9),
        report.loads,
        report.loads_over_belady(),
        report.switch_share * 100.0,
        report.mean_batch(),
        report.latency_p50.0 as f64 / 1e3,
        report.latency_p99.0 as f64 / 1e3,
    );
    s
}
