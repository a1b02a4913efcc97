//! Discrete-event simulator: replays a pipeline job on simulated workers driven by [`Foreman`].
//!
//! Each worker has a speed factor (`1.0` = reference); stage `k` of any input takes
//! `compute_k / speed` on it. A load takes `warm_load_k` when the stage file is on the worker's
//! disk and `download_k + warm_load_k` otherwise (a `SendStage` started earlier shortens the wait).
//! A task whose upstream output was computed on another worker (or that is a stage-0 task, fed by
//! the foreman) first pays `hop` for the tensor transfer. Workers can crash at given times; the
//! simulator then reports the loss to the foreman and, if asked, still delivers the crashed
//! worker's in-flight completion later, to exercise the "late completion is ignored" path.
//!
//! Bounds, from per-stage compute times `t_k` at speed 1 and the worker speeds `s_w` (loads and
//! transfers are left out: they are the overheads scheduling tries to hide):
//! - [`ideal_pipeline_bound`] `= max(sum_k t_k / s_max, N * sum_k t_k / sum_w s_w)`: one input
//!   must cross every stage, at best on the fastest worker; and all `N x S` tasks' work must be
//!   done by the crowd's aggregate speed. It is a true lower bound for any schedule.
//! - [`ideal_pipeline_bound_with_loads`] counts loads too. With `L_k` the cheapest load of stage
//!   `k` over the crowd (`warm_load_k` on a worker with the file, `download_k + warm_load_k`
//!   otherwise), `L_min = min_k L_k`, and `S_m` the sum of the `m` largest speeds:
//!   `max(L_0 + sum_k t_k / s_max, min_{m=1..W} max(L_min + N sum_k t_k / S_m,
//!   (sum_k w_k + N sum_k t_k / s_max) / m))`, `w_k = warm_load_k`. The first term: stage 0 must
//!   be loaded before any input starts. In the second, `m` is the number of workers the schedule
//!   uses (unknown, so the minimum over it): each used worker loads at least one stage before it
//!   computes, so the crowd computes at most `S_m (T - L_min)`; and the used workers' busy time,
//!   at most `m T`, holds every stage's session creation at least once (a download can overlap
//!   other work, so only `w_k` counts) plus all compute at the best speed. A lower bound for
//!   any schedule.
//! - [`classic_pipeline_bound`] `= sum_k t_k / s_max + (N - 1) * max_k t_k / s_max`: the textbook
//!   one-worker-per-stage pipeline (fill, then one input per bottleneck-stage time). With more
//!   workers than stages it is not a lower bound (a stage can run on several workers at once).
//!
//! Streaming vs barrier: with one speed across the crowd and no transfer cost, streaming was
//! never slower in thousands of random instances (a property test). With heterogeneous speeds
//! and transfers, greedy online dispatch shows list-scheduling anomalies: streaming lost in about
//! 2% of random instances, by at most ~1.3x (the policy does not know worker speeds, so the
//! fastest worker can sit idle while a slow one runs a whole chain).

use std::cmp::Reverse;
use std::collections::{BTreeMap, BTreeSet, BinaryHeap};

use thiserror::Error;

use super::affinity::Telemetry;
use super::chain::{Chain, ChainError, DType, StageSignature, TensorSig, check_chain};
use super::foreman::{Action, Foreman, ForemanConfig, ForemanError, Job, WorkerReport};
use super::{Mode, TaskId, WorkerId};
use crate::Micros;

/// Most events one simulation may process (a guard against a policy that never finishes).
pub const MAX_EVENTS: usize = 5_000_000;

/// Per-stage costs at reference speed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StageCost {
    /// Compute time of one task of the stage on a speed-1.0 worker.
    pub compute: Micros,
    /// Time to download the stage file to a worker (the cold part of a cold load).
    pub download: Micros,
    /// Time to create the session from the file on disk (a warm load).
    pub warm_load: Micros,
}

/// A simulated worker.
#[derive(Clone, Debug, PartialEq)]
pub struct SimWorker {
    /// Its id.
    pub id: WorkerId,
    /// Speed factor (> 0, finite); compute time is divided by it.
    pub speed: f64,
    /// The telemetry it reports (fixed during the run).
    pub telemetry: Telemetry,
    /// Stages whose files are on its disk at the start.
    pub cached: Vec<usize>,
}

/// A simulation scenario.
#[derive(Clone, Debug, PartialEq)]
pub struct SimSetup {
    /// The job's stages.
    pub chain: Chain,
    /// Costs per stage (same length as the chain).
    pub costs: Vec<StageCost>,
    /// The crowd.
    pub workers: Vec<SimWorker>,
    /// Number of inputs `N`.
    pub inputs: usize,
    /// Streaming or barrier.
    pub mode: Mode,
    /// Tensor transfer time between two different workers (or from the foreman).
    pub hop: Micros,
    /// Runtime overhead every task pays on its worker on top of compute and transfer (dispatch,
    /// reply, encode/decode), not scaled by speed: what the bench measures as `task_overhead_ms`.
    pub task_overhead: Micros,
    /// Warm loads are CPU work on the worker: `warm_load / speed` (what a quota'd worker pays;
    /// the bound of [`super::bound`] counts them so). False: `warm_load` on any worker.
    pub loads_are_cpu: bool,
    /// Workers that crash, and when.
    pub crashes: Vec<(WorkerId, Micros)>,
    /// Deliver a crashed worker's in-flight completion anyway (it must be ignored).
    pub deliver_late_completions: bool,
    /// Foreman settings.
    pub foreman: ForemanConfig,
}

/// What a timeline span is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SpanKind {
    /// Running a task.
    Compute(TaskId),
    /// Receiving a task's input tensor.
    Transfer(TaskId),
    /// Loading a stage's session; `cold` when the file had to be downloaded.
    Load {
        /// The stage.
        stage: usize,
        /// Downloaded (true) or from disk (false).
        cold: bool,
    },
}

/// One bar of a Gantt chart.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Span {
    /// The worker.
    pub worker: WorkerId,
    /// What it did.
    pub kind: SpanKind,
    /// Start time.
    pub start: Micros,
    /// End time (the crash time when cut short).
    pub end: Micros,
    /// False when a crash cut it short.
    pub completed: bool,
}

/// The outcome of a simulation.
#[derive(Clone, Debug, PartialEq, Default)]
pub struct SimReport {
    /// Time of `JobDone`, if the job finished.
    pub makespan: Option<Micros>,
    /// Gantt timeline.
    pub spans: Vec<Span>,
    /// Every foreman action with the time it was emitted.
    pub log: Vec<(Micros, Action)>,
    /// Per task: completions by alive workers (each must be exactly 1).
    pub completions: BTreeMap<TaskId, u32>,
    /// Per input: `InputDone` count (each must be exactly 1).
    pub answers: Vec<u32>,
    /// Loads that arrived at a worker with a session already live or loading (must be 0).
    pub residency_violations: usize,
    /// Cold and warm loads performed.
    pub loads: (usize, usize),
}

impl SimReport {
    /// Actions of one kind, e.g. the `Reassigned` log.
    pub fn actions_matching(&self, f: impl Fn(&Action) -> bool) -> Vec<(Micros, Action)> {
        self.log.iter().filter(|(_, a)| f(a)).cloned().collect()
    }
}

/// Why a simulation could not run.
#[derive(Clone, Debug, PartialEq, Error)]
pub enum SimError {
    /// A worker's speed is not a positive finite number.
    #[error("worker {0} has a speed that is not positive and finite")]
    BadSpeed(WorkerId),
    /// Costs and chain lengths differ.
    #[error("{costs} stage costs for a chain of {stages} stages")]
    CostsMismatch {
        /// Number of costs given.
        costs: usize,
        /// Number of stages.
        stages: usize,
    },
    /// Two workers with one id.
    #[error("worker {0} listed twice")]
    DuplicateWorker(WorkerId),
    /// The foreman refused.
    #[error(transparent)]
    Foreman(#[from] ForemanError),
    /// More than [`MAX_EVENTS`] events.
    #[error("simulation exceeded {MAX_EVENTS} events")]
    TooManyEvents,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Event {
    Crash(WorkerId),
    BlobArrived(WorkerId, usize),
    LoadDone(WorkerId, usize),
    TaskDone(WorkerId, TaskId),
}

#[derive(Clone, Debug, Default)]
struct SimWorkerState {
    alive: bool,
    speed: f64,
    live: Option<usize>,
    loading: Option<usize>,
    disk: BTreeSet<usize>,
    arriving: BTreeMap<usize, Micros>,
    busy_until: Micros,
}

struct Sim<'a> {
    setup: &'a SimSetup,
    foreman: Foreman,
    workers: BTreeMap<WorkerId, SimWorkerState>,
    events: BinaryHeap<Reverse<(Micros, u64, Event)>>,
    seq: u64,
    computed_on: BTreeMap<TaskId, WorkerId>,
    report: SimReport,
}

fn scaled(t: Micros, speed: f64) -> Micros {
    let v = (t.0 as f64 / speed).round();
    if v.is_finite() && v >= 0.0 { Micros(v.min(u64::MAX as f64) as u64) } else { Micros(u64::MAX) }
}

impl Sim<'_> {
    fn push(&mut self, at: Micros, e: Event) {
        self.seq += 1;
        self.events.push(Reverse((at, self.seq, e)));
    }

    fn drain(&mut self, now: Micros) {
        while let Some(a) = self.foreman.poll_action() {
            self.perform(now, &a);
            self.report.log.push((now, a));
        }
    }

    fn perform(&mut self, now: Micros, a: &Action) {
        let costs = &self.setup.costs;
        match *a {
            Action::SendStage { worker, stage } => {
                let Some(w) = self.workers.get_mut(&worker) else {
                    return;
                };
                let Some(c) = costs.get(stage) else { return };
                if !w.disk.contains(&stage) && !w.arriving.contains_key(&stage) {
                    let at = now + c.download;
                    w.arriving.insert(stage, at);
                    self.push(at, Event::BlobArrived(worker, stage));
                }
            }
            Action::Unload { worker } => {
                if let Some(w) = self.workers.get_mut(&worker) {
                    w.live = None;
                }
            }
            Action::Load { worker, stage } => {
                let Some(w) = self.workers.get_mut(&worker) else {
                    return;
                };
                let Some(c) = costs.get(stage) else { return };
                if w.live.is_some() || w.loading.is_some() {
                    self.report.residency_violations += 1;
                }
                w.live = None;
                w.loading = Some(stage);
                let start = now.max(w.busy_until);
                let (from, cold) = if w.disk.contains(&stage) {
                    (start, false)
                } else if let Some(&at) = w.arriving.get(&stage) {
                    (start.max(at), true)
                } else {
                    (start + c.download, true)
                };
                let end =
                    from + if self.setup.loads_are_cpu { scaled(c.warm_load, w.speed) } else { c.warm_load };
                w.busy_until = end;
                if cold {
                    self.report.loads.0 += 1;
                } else {
                    self.report.loads.1 += 1;
                }
                self.report.spans.push(Span {
                    worker,
                    kind: SpanKind::Load { stage, cold },
                    start,
                    end,
                    completed: true,
                });
                self.push(end, Event::LoadDone(worker, stage));
            }
            Action::Assign { task, worker, .. } => {
                let hop = match task.stage {
                    0 => self.setup.hop,
                    k => match self.computed_on.get(&TaskId::new(task.input, k - 1)) {
                        Some(&w) if w == worker => Micros::ZERO,
                        _ => self.setup.hop,
                    },
                };
                let Some(w) = self.workers.get_mut(&worker) else {
                    return;
                };
                let Some(c) = costs.get(task.stage) else {
                    return;
                };
                let start = now.max(w.busy_until);
                let compute_start = start + hop;
                let end = compute_start + scaled(c.compute, w.speed) + self.setup.task_overhead;
                w.busy_until = end;
                if hop > Micros::ZERO {
                    self.report.spans.push(Span {
                        worker,
                        kind: SpanKind::Transfer(task),
                        start,
                        end: compute_start,
                        completed: true,
                    });
                }
                self.report.spans.push(Span {
                    worker,
                    kind: SpanKind::Compute(task),
                    start: compute_start,
                    end,
                    completed: true,
                });
                self.push(end, Event::TaskDone(worker, task));
            }
            Action::InputDone { input } => {
                if let Some(n) = self.report.answers.get_mut(input) {
                    *n += 1;
                }
            }
            Action::JobDone if self.report.makespan.is_none() => {
                self.report.makespan = Some(now);
            }
            _ => {}
        }
    }

    fn crash(&mut self, now: Micros, id: WorkerId) {
        let Some(w) = self.workers.get_mut(&id) else {
            return;
        };
        if !w.alive {
            return;
        }
        w.alive = false;
        for s in self.report.spans.iter_mut().filter(|s| s.worker == id) {
            if s.end > now {
                s.end = now.max(s.start);
                s.completed = false;
            }
        }
        self.foreman.handle_worker_lost(now, id);
    }

    fn step(&mut self, now: Micros, e: Event) {
        match e {
            Event::Crash(id) => self.crash(now, id),
            Event::BlobArrived(id, stage) => {
                if let Some(w) = self.workers.get_mut(&id) {
                    w.arriving.remove(&stage);
                    w.disk.insert(stage);
                }
            }
            Event::LoadDone(id, stage) => {
                let Some(w) = self.workers.get_mut(&id).filter(|w| w.alive) else {
                    return;
                };
                w.loading = None;
                w.live = Some(stage);
                w.disk.insert(stage);
                self.foreman.handle_stage_loaded(now, id, stage, true);
            }
            Event::TaskDone(id, task) => {
                let alive = self.workers.get(&id).is_some_and(|w| w.alive);
                if alive {
                    *self.report.completions.entry(task).or_insert(0) += 1;
                    self.computed_on.insert(task, id);
                    self.foreman.handle_task_done(now, id, task, true);
                } else if self.setup.deliver_late_completions {
                    self.foreman.handle_task_done(now, id, task, true);
                }
            }
        }
    }
}

/// Runs the scenario to completion (or until nothing is left to happen).
pub fn simulate(setup: &SimSetup) -> Result<SimReport, SimError> {
    simulate_on(setup, Foreman::new(setup.foreman)).map(|(r, _)| r)
}

/// [`simulate`] on a given foreman (which may remember costs from an earlier job: the workers
/// join it again, fresh), handing it back after the job, e.g. for the next job of a series.
pub fn simulate_on(setup: &SimSetup, foreman: Foreman) -> Result<(SimReport, Foreman), SimError> {
    if setup.costs.len() != setup.chain.len() {
        return Err(SimError::CostsMismatch { costs: setup.costs.len(), stages: setup.chain.len() });
    }
    let mut sim = Sim {
        setup,
        foreman,
        workers: BTreeMap::new(),
        events: BinaryHeap::new(),
        seq: 0,
        computed_on: BTreeMap::new(),
        report: SimReport { answers: vec![0; setup.inputs], ..SimReport::default() },
    };
    // A foreman that ran an earlier job has a clock of its own: this job starts there (its
    // durations are measured on that clock), and the report counts from this job's start.
    let origin = sim.foreman.now();
    let now = origin;
    for w in &setup.workers {
        if !(w.speed.is_finite() && w.speed > 0.0) {
            return Err(SimError::BadSpeed(w.id));
        }
        if sim.workers.contains_key(&w.id) {
            return Err(SimError::DuplicateWorker(w.id));
        }
        let disk: BTreeSet<usize> = w.cached.iter().copied().filter(|&k| k < setup.chain.len()).collect();
        let hashes = disk.iter().filter_map(|&k| setup.chain.stage(k).map(|s| s.sha256.clone())).collect();
        sim.workers
            .insert(w.id, SimWorkerState { alive: true, speed: w.speed, disk, ..SimWorkerState::default() });
        sim.foreman.handle_worker_joined(
            now,
            w.id,
            WorkerReport { telemetry: w.telemetry, live: None, cached: hashes },
        )?;
    }
    for &(id, at) in &setup.crashes {
        sim.push(origin + at, Event::Crash(id));
    }
    sim.foreman
        .submit_job(now, Job { chain: setup.chain.clone(), inputs: setup.inputs, mode: setup.mode })?;
    sim.drain(now);
    let mut processed = 0usize;
    while sim.report.makespan.is_none() {
        let Some(Reverse((at, _, e))) = sim.events.pop() else {
            break;
        };
        processed += 1;
        if processed > MAX_EVENTS {
            return Err(SimError::TooManyEvents);
        }
        sim.step(at, e);
        sim.drain(at);
    }
    let mut report = sim.report;
    let since = |t: Micros| Micros(t.0.saturating_sub(origin.0));
    report.makespan = report.makespan.map(since);
    for span in &mut report.spans {
        (span.start, span.end) = (since(span.start), since(span.end));
    }
    for (t, _) in &mut report.log {
        *t = since(*t);
    }
    Ok((report, sim.foreman))
}

fn speeds_summary(speeds: &[f64]) -> (f64, f64) {
    let good = speeds.iter().copied().filter(|s| s.is_finite() && *s > 0.0);
    let max = good.clone().fold(0.0, f64::max);
    let sum = good.sum();
    (max, sum)
}

fn micros_of(x: f64) -> Micros {
    if x.is_finite() && x >= 0.0 { Micros(x.round().min(u64::MAX as f64) as u64) } else { Micros(u64::MAX) }
}

/// `max(sum_k t_k / s_max, N * sum_k t_k / sum_w s_w)`, compute only; a lower bound on makespan.
pub fn ideal_pipeline_bound(costs: &[StageCost], speeds: &[f64], inputs: usize) -> Micros {
    let (max, sum) = speeds_summary(speeds);
    if max <= 0.0 {
        return Micros(u64::MAX);
    }
    let total: f64 = costs.iter().map(|c| c.compute.0 as f64).sum();
    micros_of((total / max).max(inputs as f64 * total / sum))
}

/// Lower bound on makespan counting loads (formula in the module doc).
pub fn ideal_pipeline_bound_with_loads(costs: &[StageCost], workers: &[SimWorker], inputs: usize) -> Micros {
    let mut speeds: Vec<f64> =
        workers.iter().map(|w| w.speed).filter(|s| s.is_finite() && *s > 0.0).collect();
    speeds.sort_by(|a, b| b.total_cmp(a));
    let Some(&s_max) = speeds.first() else {
        return Micros(u64::MAX);
    };
    if costs.is_empty() {
        return Micros::ZERO;
    }
    let load = |k: usize, c: &StageCost| -> f64 {
        let cached = workers.iter().any(|w| w.cached.contains(&k));
        let warm = c.warm_load.0 as f64;
        if cached { warm } else { warm + c.download.0 as f64 }
    };
    let loads: Vec<f64> = costs.iter().enumerate().map(|(k, c)| load(k, c)).collect();
    let total: f64 = costs.iter().map(|c| c.compute.0 as f64).sum();
    let work = inputs as f64 * total;
    let l_min = loads.iter().copied().fold(f64::INFINITY, f64::min);
    let l_sum: f64 = costs.iter().map(|c| c.warm_load.0 as f64).sum();
    let path = loads[0] + total / s_max;
    let mut crowd = f64::INFINITY;
    let mut s_m = 0.0;
    for (i, s) in speeds.iter().enumerate() {
        s_m += s;
        let m = (i + 1) as f64;
        crowd = crowd.min((l_min + work / s_m).max((l_sum + work / s_max) / m));
    }
    // Less one µs per task: the simulator rounds each scaled compute time to the µs.
    let rounding = inputs.saturating_mul(costs.len()) as f64;
    micros_of((path.max(crowd) - rounding).max(0.0))
}

/// `sum_k t_k / s_max + (N - 1) * max_k t_k / s_max`: the one-worker-per-stage pipeline time.
pub fn classic_pipeline_bound(costs: &[StageCost], speeds: &[f64], inputs: usize) -> Micros {
    let (max, _) = speeds_summary(speeds);
    if max <= 0.0 {
        return Micros(u64::MAX);
    }
    let total: f64 = costs.iter().map(|c| c.compute.0 as f64).sum();
    let slowest = costs.iter().map(|c| c.compute.0).max().unwrap_or(0) as f64;
    micros_of((total + inputs.saturating_sub(1) as f64 * slowest) / max)
}

/// A chain of stages `s0..` with the given file sizes, for simulations and benchmarks: stage `k`
/// reads `h{k}` (f32, rank 3) plus the job's `mask` (i64, rank 2) and writes `h{k+1}`; the
/// stage hash is `k + 1` written as 64 hex digits.
pub fn synthetic_chain(sizes: &[u64]) -> Result<Chain, ChainError> {
    let stages: Vec<StageSignature> = sizes
        .iter()
        .enumerate()
        .map(|(k, &size)| StageSignature {
            name: format!("s{k}"),
            sha256: format!("{:064x}", k + 1),
            size_bytes: size,
            inputs: vec![
                TensorSig::new(&format!("h{k}"), DType::F32, 3),
                TensorSig::new("mask", DType::I64, 2),
            ],
            outputs: vec![TensorSig::new(&format!("h{}", k + 1), DType::F32, 3)],
        })
        .collect();
    check_chain(&stages, &[TensorSig::new("h0", DType::F32, 3), TensorSig::new("mask", DType::I64, 2)])
}
