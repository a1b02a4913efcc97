//! Serve a trace for real in one process: the policy's [`RequestScheduler`] decides, one thread
//! per executor carries out loads, evictions and batches on real ONNX sessions, and the real
//! outputs of preliminary experts pick the subsequent experts.
//!
//! The runner is also a referee: it refuses a load or batch sent to a busy executor, an eviction
//! of the expert an executor is loading or running, a selection that differs from the trace's
//! recorded one, and (through each executor's own accounting) any load past a memory budget.
//! Every request's outputs are folded into a digest ([`super::app::output_digest`]) so runs under
//! different policies can be compared.

use std::collections::{BTreeMap, VecDeque};
use std::sync::mpsc;
use std::thread;
use std::time::{Duration, Instant};

use troupe_policy::Micros;
use troupe_policy::coe::{
    Action, BatchId, ExecutorId, ExpertId, LatencyModel, Request, RequestId, RequestScheduler,
    SchedulerConfig, belady_min_loads,
};

use super::CoeError;
use super::app::{App, image_floats, output_digest, quantise, select_children};
use super::executor::{ExecutorCounters, ExpertExecutor};
use std::fmt::Write as _;
use troupe_kernels::assets::Digits;

/// Knobs of a real run.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RunOptions {
    /// The policy combination.
    pub config: SchedulerConfig,
    /// Trace arrival times are multiplied by this (0 = everything arrives at once).
    pub arrival_scale: f64,
    /// Give up after this long.
    pub deadline: Duration,
}

impl RunOptions {
    /// Saturating arrivals (the trace's times), a 10-minute deadline.
    pub fn new(config: SchedulerConfig) -> Self {
        RunOptions { config, arrival_scale: 1.0, deadline: Duration::from_secs(600) }
    }
}

/// What a real run measured.
#[derive(Clone, Debug, PartialEq)]
pub struct RunReport {
    /// The policy combination.
    pub label: &'static str,
    /// Requests served.
    pub requests: usize,
    /// First arrival to last completion, seconds.
    pub makespan_s: f64,
    /// Requests per second over the makespan.
    pub throughput_rps: f64,
    /// Median latency, ms.
    pub p50_ms: f64,
    /// 99th percentile latency, ms.
    pub p99_ms: f64,
    /// Expert loads.
    pub loads: u64,
    /// Belady's MIN loads on the same served order and budgets.
    pub belady_loads: u64,
    /// Seconds executors spent loading, summed.
    pub switch_s: f64,
    /// Seconds executors spent loading or running, summed.
    pub busy_s: f64,
    /// Per request (by id): digest of its outputs.
    pub digests: Vec<u64>,
    /// Per executor: its counters.
    pub executors: Vec<(String, ExecutorCounters)>,
    /// Per executor: its budget.
    pub budgets: Vec<u64>,
    /// Executors lost during the run.
    pub lost: Vec<String>,
}

impl RunReport {
    /// Loads over Belady's MIN.
    pub fn loads_over_belady(&self) -> f64 {
        self.loads as f64 / self.belady_loads.max(1) as f64
    }

    /// Share of busy time spent switching experts.
    pub fn switch_share(&self) -> f64 {
        if self.busy_s > 0.0 { self.switch_s / self.busy_s } else { 0.0 }
    }
}

/// What the driver asks an executor to do (carried to a thread, or over the cluster).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Cmd {
    /// Load an expert.
    Load(ExpertId),
    /// Evict an expert.
    Evict(ExpertId),
    /// Run one batch: (request, digit image index) pairs.
    Run {
        /// The batch.
        batch: BatchId,
        /// The expert.
        expert: ExpertId,
        /// The requests and their input images.
        requests: Vec<(RequestId, u64)>,
    },
}

/// What an executor reports back to the driver.
#[derive(Debug)]
pub enum Event {
    /// A load finished, taking `seconds`.
    Loaded {
        /// Executor index.
        exec: usize,
        /// The expert.
        expert: ExpertId,
        /// Time it took.
        seconds: f64,
        /// Bytes of experts the executor holds after the load (its own accounting).
        resident: u64,
    },
    /// A batch finished, taking `seconds`; one output row per request.
    Ran {
        /// Executor index.
        exec: usize,
        /// The batch.
        batch: BatchId,
        /// The expert.
        expert: ExpertId,
        /// Output rows.
        rows: Vec<(RequestId, Vec<f32>)>,
        /// Time it took.
        seconds: f64,
    },
    /// The executor is gone (process killed, node down, call failed): its work is redone.
    Lost {
        /// Executor index.
        exec: usize,
        /// Why.
        why: String,
    },
    /// A fatal error (a bug, a corrupt file).
    Failed(CoeError),
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Busy {
    Idle,
    Loading(ExpertId),
    Running(ExpertId),
}

/// Carry out one command on a local executor; the event to report (none for an eviction).
pub fn execute(
    exec: usize,
    executor: &mut ExpertExecutor,
    app_digits: &Digits,
    cmd: Cmd,
) -> Result<Option<Event>, CoeError> {
    let result = match cmd {
        Cmd::Load(expert) => executor.load(expert).map(|took| {
            Some(Event::Loaded {
                exec,
                expert,
                seconds: took.as_secs_f64(),
                resident: executor.resident_bytes(),
            })
        }),
        Cmd::Evict(expert) => executor.evict(expert).map(|()| None),
        Cmd::Run { batch, expert, requests } => {
            let start = Instant::now();
            let inputs: Vec<Vec<f32>> =
                requests.iter().map(|(_, img)| image_floats(app_digits, *img as usize)).collect();
            executor.run_batch(expert, &inputs).map(|rows| {
                let rows = requests.iter().map(|(r, _)| *r).zip(rows).collect();
                Some(Event::Ran { exec, batch, expert, rows, seconds: start.elapsed().as_secs_f64() })
            })
        }
    }?;
    // The executor's own accounting: within budget, and equal to the sessions it holds.
    if executor.resident_bytes() > executor.budget() || executor.loaded_bytes() != executor.resident_bytes() {
        return Err(CoeError::Executor {
            executor: executor.name().to_string(),
            problem: format!(
                "memory accounting broken: {} resident, {} in sessions, budget {}",
                executor.resident_bytes(),
                executor.loaded_bytes(),
                executor.budget()
            ),
        });
    }
    Ok(result)
}

fn executor_thread(
    exec: usize,
    mut executor: ExpertExecutor,
    digits: Digits,
    cmds: mpsc::Receiver<Cmd>,
    events: mpsc::Sender<Event>,
) {
    for cmd in cmds {
        match execute(exec, &mut executor, &digits, cmd) {
            Ok(Some(ev)) => {
                if events.send(ev).is_err() {
                    return;
                }
            }
            Ok(None) => {}
            Err(e) => {
                let _ = events.send(Event::Failed(e));
                return;
            }
        }
    }
}

fn percentile_ms(sorted: &[Duration], q: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let i = ((sorted.len() as f64 * q).ceil() as usize).clamp(1, sorted.len()) - 1;
    sorted[i].as_secs_f64() * 1e3
}

/// Serve `app`'s trace with executors named and budgeted by `latency` (the profile), one
/// thread each, under `options`. Each executor opens its own store over the app's blobs.
pub fn run_local(app: &App, latency: &LatencyModel, options: &RunOptions) -> Result<RunReport, CoeError> {
    let n_exec = latency.executors();
    let (ev_tx, ev_rx) = mpsc::channel::<Event>();
    let mut cmd_tx = Vec::with_capacity(n_exec);
    let mut handles = Vec::with_capacity(n_exec);
    for e in 0..n_exec {
        let executor = ExpertExecutor::open(
            latency.name(e),
            &app.store_dir(),
            &app.manifest,
            &app.trace.model,
            latency.expert_budget(e),
        )?;
        let (tx, rx) = mpsc::channel::<Cmd>();
        let events = ev_tx.clone();
        let digits = app.digits.clone();
        handles.push(
            thread::Builder::new()
                .name(format!("coe-{}", latency.name(e)))
                .spawn(move || executor_thread(e, executor, digits, rx, events))
                .map_err(|err| CoeError::Invalid(format!("spawning executor thread: {err}")))?,
        );
        cmd_tx.push(tx);
    }
    drop(ev_tx);
    let mut send = |x: usize, cmd: Cmd| -> Result<(), CoeError> {
        cmd_tx[x].send(cmd).map_err(|_| CoeError::Invalid("an executor thread stopped".into()))
    };
    let report = drive(app, latency, options, &mut send, &ev_rx, &mut |_| {});
    drop(cmd_tx);
    for h in handles {
        let _ = h.join();
    }
    report
}

/// The event loop shared by local and distributed runs: feeds arrivals and executor events to
/// the scheduler, sends its decisions through `send`, checks every rule it can, and measures.
/// `progress` is called with the number of requests completed after each completion.
pub fn drive(
    app: &App,
    latency: &LatencyModel,
    options: &RunOptions,
    send: &mut dyn FnMut(usize, Cmd) -> Result<(), CoeError>,
    events: &mpsc::Receiver<Event>,
    progress: &mut dyn FnMut(usize),
) -> Result<RunReport, CoeError> {
    let trace = &app.trace;
    let model = &trace.model;
    let mut scheduler = RequestScheduler::new(model.clone(), latency.clone(), options.config)?;
    let n_exec = latency.executors();
    let deadline = Instant::now() + options.deadline;
    let n = trace.requests.len();
    let mut busy = vec![Busy::Idle; n_exec];
    let mut alive = vec![true; n_exec];
    let mut counters = vec![ExecutorCounters::default(); n_exec];
    let mut served: Vec<Vec<ExpertId>> = vec![Vec::new(); n_exec];
    let mut outputs: Vec<BTreeMap<ExpertId, Vec<i32>>> = vec![BTreeMap::new(); n];
    let mut completed: Vec<Option<Instant>> = vec![None; n];
    let mut done = 0usize;
    let mut pending: VecDeque<usize> = (0..n).collect();
    let start = Instant::now();
    let arrival_at = |i: usize| {
        let us = trace.requests[i].arrival.0 as f64 * options.arrival_scale.max(0.0);
        Duration::from_micros(us as u64)
    };
    let now_us = |at: Instant| Micros(at.duration_since(start).as_micros() as u64);
    let mut arrived: Vec<Instant> = vec![start; n];

    while done < n {
        let now = Instant::now();
        if now > deadline {
            return Err(CoeError::Invalid(format!(
                "run did not finish: {done} of {n} requests done at the deadline"
            )));
        }
        while let Some(&i) = pending.front() {
            if start + arrival_at(i) > now {
                break;
            }
            pending.pop_front();
            let r = &trace.requests[i];
            arrived[i] = now;
            scheduler.handle_arrival(now_us(now), Request { id: r.id, root: r.root })?;
        }
        // Carry out the decisions.
        while let Some(action) = scheduler.poll_action() {
            match action {
                Action::Enqueue { .. } => {}
                Action::Evict { executor, expert } => {
                    let x = executor.index();
                    if busy[x] == Busy::Loading(expert) || busy[x] == Busy::Running(expert) {
                        return Err(CoeError::Invalid(format!("evict of {expert} while {executor} uses it")));
                    }
                    send(x, Cmd::Evict(expert))?;
                }
                Action::Load { executor, expert, .. } => {
                    let x = executor.index();
                    if busy[x] != Busy::Idle || !alive[x] {
                        return Err(CoeError::Invalid(format!(
                            "load of {expert} on busy or lost {executor}"
                        )));
                    }
                    busy[x] = Busy::Loading(expert);
                    send(x, Cmd::Load(expert))?;
                }
                Action::RunBatch { executor, batch, expert, requests } => {
                    let x = executor.index();
                    if busy[x] != Busy::Idle || !alive[x] {
                        return Err(CoeError::Invalid(format!(
                            "batch of {expert} on busy or lost {executor}"
                        )));
                    }
                    busy[x] = Busy::Running(expert);
                    served[x].push(expert);
                    let inputs = requests
                        .iter()
                        .map(|r| {
                            let req = trace
                                .requests
                                .get(r.0 as usize)
                                .ok_or_else(|| CoeError::Invalid(format!("unknown {r}")))?;
                            Ok((*r, req.input))
                        })
                        .collect::<Result<Vec<_>, CoeError>>()?;
                    send(x, Cmd::Run { batch, expert, requests: inputs })?;
                }
                Action::Complete { request } => {
                    let i = request.0 as usize;
                    if completed.get(i).is_none_or(Option::is_some) {
                        return Err(CoeError::Invalid(format!("{request} completed twice or unknown")));
                    }
                    completed[i] = Some(Instant::now());
                    done += 1;
                    progress(done);
                }
            }
        }
        if done >= n {
            break;
        }
        let wait = pending.front().map_or(Duration::from_millis(200), |&i| {
            (start + arrival_at(i)).saturating_duration_since(Instant::now())
        });
        let event = match events.recv_timeout(wait) {
            Ok(ev) => ev,
            Err(mpsc::RecvTimeoutError::Timeout) => continue,
            Err(mpsc::RecvTimeoutError::Disconnected) => {
                return Err(CoeError::Invalid("executors stopped".into()));
            }
        };
        let at = now_us(Instant::now());
        match event {
            Event::Loaded { exec, .. } | Event::Ran { exec, .. }
                if !alive.get(exec).copied().unwrap_or(false) =>
            {
                // A late result from a lost executor: its work was requeued elsewhere.
            }
            Event::Loaded { exec, expert, seconds, resident } => {
                busy[exec] = Busy::Idle;
                counters[exec].peak_bytes = counters[exec].peak_bytes.max(resident);
                counters[exec].loads += 1;
                counters[exec].load_seconds += seconds;
                scheduler.handle_load_done(at, ExecutorId(exec as u16), expert)?;
            }
            Event::Ran { exec, batch, expert, rows, seconds } => {
                busy[exec] = Busy::Idle;
                counters[exec].batches += 1;
                counters[exec].tasks += rows.len() as u64;
                counters[exec].run_seconds += seconds;
                scheduler.handle_batch_done(at, ExecutorId(exec as u16), batch)?;
                let children = model.expert(expert).map(|e| e.children.clone()).unwrap_or_default();
                for (request, probs) in rows {
                    let req = trace
                        .requests
                        .get(request.0 as usize)
                        .ok_or_else(|| CoeError::Invalid(format!("unknown {request}")))?;
                    outputs[request.0 as usize].insert(expert, quantise(&probs));
                    if children.is_empty() {
                        continue;
                    }
                    let chosen = select_children(&probs, &children);
                    if req.selection(expert) != Some(chosen.as_slice()) {
                        return Err(CoeError::Invalid(format!(
                            "{request}: {expert} selected {chosen:?}, the trace recorded {:?} (trace not made for this app?)",
                            req.selection(expert)
                        )));
                    }
                    scheduler.handle_preliminary_done(at, request, expert, &chosen)?;
                }
            }
            Event::Lost { exec, why } => {
                if alive.get(exec).copied().unwrap_or(false) {
                    tracing::warn!(executor = latency.name(exec), %why, "executor lost: requeueing its work");
                    alive[exec] = false;
                    busy[exec] = Busy::Idle;
                    scheduler.handle_executor_lost(at, ExecutorId(exec as u16))?;
                }
            }
            Event::Failed(e) => return Err(e),
        }
    }
    let end = Instant::now();
    let mut latencies: Vec<Duration> = completed
        .iter()
        .zip(&arrived)
        .map(|(c, a)| c.map_or(Duration::ZERO, |c| c.duration_since(*a)))
        .collect();
    latencies.sort();
    let mut belady = 0;
    for (x, s) in served.iter().enumerate() {
        belady += belady_min_loads(s, |e| model.size_of(e), latency.expert_budget(x))
            .map_err(|e| CoeError::Invalid(e.to_string()))?;
    }
    let makespan_s = end.duration_since(start).as_secs_f64();
    Ok(RunReport {
        label: options.config.label(),
        requests: n,
        makespan_s,
        throughput_rps: n as f64 / makespan_s.max(1e-9),
        p50_ms: percentile_ms(&latencies, 0.5),
        p99_ms: percentile_ms(&latencies, 0.99),
        loads: counters.iter().map(|c| c.loads).sum(),
        belady_loads: belady,
        switch_s: counters.iter().map(|c| c.load_seconds).sum(),
        busy_s: counters.iter().map(|c| c.load_seconds + c.run_seconds).sum(),
        digests: outputs.iter().map(output_digest).collect(),
        executors: (0..n_exec).map(|x| (latency.name(x).to_string(), counters[x])).collect(),
        budgets: (0..n_exec).map(|x| latency.expert_budget(x)).collect(),
        lost: (0..n_exec).filter(|&x| !alive[x]).map(|x| latency.name(x).to_string()).collect(),
    })
}

/// The per-request results file: `request <id> digest <16 hex>` lines, in id order.
pub fn results_text(report: &RunReport) -> String {
    let mut out = String::new();
    for (i, d) in report.digests.iter().enumerate() {
        let _ = writeln!(out, "request {i} digest {d:016x}");
    }
    out
}
