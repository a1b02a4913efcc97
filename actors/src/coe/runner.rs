//! Serve a trace for real in one process: the coe scheduler actor ([`super::serve`]) decides
//! through the policy's `RequestScheduler`, one thread per executor carries out loads, evictions
//! and batches on real ONNX sessions, and the real outputs of preliminary experts pick the
//! subsequent experts. This module holds what executors are told ([`Cmd`]) and answer
//! ([`Event`]), how one executor carries a command out ([`execute`]), and the run's report.
//!
//! The scheduler is also a referee: it refuses a load or batch sent to a busy executor, an
//! eviction of the expert an executor is loading or running, a selection that differs from the
//! trace's recorded one, and (through each executor's own accounting) any load past a memory
//! budget. Every request's outputs are folded into a digest ([`super::app::output_digest`]) so
//! runs under different policies can be compared.

use std::fmt::Write as _;
use std::sync::Arc;
use std::thread;
use std::time::Duration;

use ractor::Actor;
use tokio::sync::broadcast;
use troupe_policy::coe::{
    BatchId, CoeModel, ExecutorKind, ExpertId, LatencyModel, RequestId, SchedulerConfig,
};

use super::CoeError;
use super::app::App;
use super::executor::{ExecutorCounters, ExecutorOptions, ExpertExecutor};
use super::link::{ExecLink, LocalCall};
use super::serve::{CoeShared, serve_trace};
use crate::clock::Clock;
use crate::supervisor::{Intensity, Supervisor, SupervisorArgs};

/// Knobs of a real run.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RunOptions {
    /// The policy combination.
    pub config: SchedulerConfig,
    /// Trace arrival times are multiplied by this (0 = everything arrives at once).
    pub arrival_scale: f64,
    /// Give up after this long.
    pub deadline: Duration,
    /// Executors' host tiers and threads.
    pub tiers: TierOptions,
}

/// Each local executor's host tier and ONNX Runtime threads.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct TierOptions {
    /// Host-tier budget as a fraction of all expert bytes (`None`: the host-homed experts' bytes).
    pub host_budget: Option<f64>,
    /// Intra-op threads of the CPU executor's sessions (0 = ONNX Runtime's default).
    pub cpu_threads: usize,
    /// Intra-op threads of the GPU executor's CPU stand-in's sessions.
    pub gpu_threads: usize,
    /// The CPU executor runs the MLP engine on the CPU instead of ONNX Runtime.
    pub cpu_mlp: bool,
}

impl Default for TierOptions {
    /// Host tier sized to the host-homed experts, one thread each, ONNX Runtime on the CPU.
    fn default() -> Self {
        TierOptions { host_budget: None, cpu_threads: 1, gpu_threads: 1, cpu_mlp: false }
    }
}

impl TierOptions {
    /// Executor `e`'s options under `latency` for `model`: its profiled budget, this host tier
    /// (the fraction of all of `model`'s expert bytes), its kind (which picks its engine) and
    /// its kind's thread count.
    pub fn executor(&self, latency: &LatencyModel, e: usize, model: &CoeModel) -> ExecutorOptions {
        let kind = latency.kind(e);
        let threads = match kind {
            ExecutorKind::Cpu => self.cpu_threads,
            ExecutorKind::Gpu => self.gpu_threads,
        };
        ExecutorOptions {
            budget: latency.expert_budget(e),
            host_budget: self.host_budget.map(|f| (f.clamp(0.0, 1.0) * model.total_bytes() as f64) as u64),
            threads,
            kind,
            mlp_on_cpu: self.cpu_mlp,
        }
    }
}

impl RunOptions {
    /// Saturating arrivals (the trace's times), a 10-minute deadline.
    pub fn new(config: SchedulerConfig) -> Self {
        RunOptions {
            config,
            arrival_scale: 1.0,
            deadline: Duration::from_secs(600),
            tiers: TierOptions::default(),
        }
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
    /// Seconds inside the policy's `RequestScheduler` calls (decisions), summed.
    pub scheduling_s: f64,
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

    /// Scheduling decisions' time as a share of executor busy time.
    pub fn scheduling_share(&self) -> f64 {
        if self.busy_s > 0.0 { self.scheduling_s / self.busy_s } else { 0.0 }
    }

    /// Expert-management time (the executors' own, see [`ExecutorCounters::management_seconds`])
    /// as a share of executor busy time.
    pub fn management_share(&self) -> f64 {
        let m: f64 = self.executors.iter().map(|(_, c)| c.management_seconds).sum();
        if self.busy_s > 0.0 { m / self.busy_s } else { 0.0 }
    }

    /// Time compacting the executors' device arenas as a share of executor busy time.
    pub fn compaction_share(&self) -> f64 {
        let m: f64 = self.executors.iter().map(|(_, c)| c.compaction_seconds).sum();
        if self.busy_s > 0.0 { m / self.busy_s } else { 0.0 }
    }

    /// Mean time per byte of a promotion from the host tier over that of a disk load, from the
    /// executors' tier-copy timings (session creation excluded); NaN when either never happened.
    pub fn host_promotion_over_disk_load(&self) -> f64 {
        let sum = |f: fn(&ExecutorCounters) -> f64| -> f64 { self.executors.iter().map(|(_, c)| f(c)).sum() };
        let promo = sum(|c| c.promotion_seconds) / sum(|c| c.promoted_bytes as f64);
        let disk = sum(|c| c.disk_load_seconds) / sum(|c| c.disk_load_bytes as f64);
        if promo.is_finite() && disk.is_finite() && disk > 0.0 { promo / disk } else { f64::NAN }
    }
}

/// What the driver asks an executor to do (carried to a thread, or over the cluster).
#[derive(Clone, Debug, PartialEq)]
pub enum Cmd {
    /// Load an expert.
    Load(ExpertId),
    /// Evict an expert.
    Evict(ExpertId),
    /// Evict every expert (a restarted scheduler starts from empty executors); answered by
    /// [`Event::Reset`] once every earlier command is done.
    Reset,
    /// Run one batch: (request, input) pairs; each input is [`super::app::INPUT_WIDTH`] floats
    /// (a trace's digit image, or a client's own input), so executors need no data set.
    Run {
        /// The batch.
        batch: BatchId,
        /// The expert.
        expert: ExpertId,
        /// The requests and their inputs.
        requests: Vec<(RequestId, Vec<f32>)>,
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
    /// A [`Cmd::Reset`] finished: the executor holds nothing now.
    Reset {
        /// Executor index.
        exec: usize,
        /// How many experts it evicted.
        evicted: usize,
        /// Its host tier's budget, bytes.
        host_budget: u64,
        /// What its host tier holds afterwards (the scheduler plans loads from it).
        host: Vec<ExpertId>,
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

/// Carry out one command on a local executor; the event to report (none for an eviction).
pub fn execute(exec: usize, executor: &mut ExpertExecutor, cmd: Cmd) -> Result<Option<Event>, CoeError> {
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
        Cmd::Reset => {
            let loaded = executor.loaded();
            loaded.iter().try_for_each(|e| executor.evict(*e)).map(|()| {
                Some(Event::Reset {
                    exec,
                    evicted: loaded.len(),
                    host_budget: executor.host_budget(),
                    host: executor.host_resident(),
                })
            })
        }
        Cmd::Run { batch, expert, requests } => {
            let start = Clock::start();
            let (ids, inputs): (Vec<RequestId>, Vec<Vec<f32>>) = requests.into_iter().unzip();
            executor.run_batch(expert, &inputs).map(|rows| {
                let rows = ids.into_iter().zip(rows).collect();
                Some(Event::Ran { exec, batch, expert, rows, seconds: start.elapsed().as_secs_f64() })
            })
        }
    }?;
    // The executor's own accounting: both tiers within budget, equal to what it holds.
    executor.check_accounting()?;
    publish(executor);
    Ok(result)
}

/// Mirrors what `executor` holds per tier, and its device arena, into [`crate::live`] (for the
/// node's status and metrics).
fn publish(executor: &ExpertExecutor) {
    crate::live::set_residency(crate::wire::ResidencyView {
        executor: executor.name().to_string(),
        device_experts: executor.loaded().len() as u64,
        device_bytes: executor.resident_bytes(),
        host_experts: executor.host_resident().len() as u64,
        host_bytes: executor.store_host_bytes(),
    });
    let pool = executor.device_pool();
    crate::live::set_pool(
        &format!("coe/{}/device", executor.name()),
        pool.budget,
        pool.used,
        pool.external_fragmentation,
    );
}

fn executor_thread(
    exec: usize,
    mut executor: ExpertExecutor,
    mut cmds: tokio::sync::mpsc::UnboundedReceiver<LocalCall>,
) -> ExecutorCounters {
    while let Some((cmd, reply)) = cmds.blocking_recv() {
        let outcome = execute(exec, &mut executor, cmd);
        let failed = outcome.is_err();
        let _ = reply.send(outcome);
        if failed {
            // a failed executor takes no more commands: its link then finds it gone
            break;
        }
    }
    executor.counters()
}

/// Starts one thread per executor of `latency` (the profile), each with its own store over the
/// app's blobs, and links them to `shared`. The threads end once the links are closed and
/// return their executor's counters.
pub fn start_local_executors(
    shared: &Arc<CoeShared>,
    app: &App,
    latency: &LatencyModel,
) -> Result<Vec<thread::JoinHandle<ExecutorCounters>>, CoeError> {
    start_local_executors_with(shared, app, latency, &TierOptions::default())
}

/// [`start_local_executors`] with each executor's host tier and threads from `tiers`.
pub fn start_local_executors_with(
    shared: &Arc<CoeShared>,
    app: &App,
    latency: &LatencyModel,
    tiers: &TierOptions,
) -> Result<Vec<thread::JoinHandle<ExecutorCounters>>, CoeError> {
    let mut handles = Vec::with_capacity(latency.executors());
    for e in 0..latency.executors() {
        let executor = ExpertExecutor::open_with(
            latency.name(e),
            &app.store_dir(),
            &app.manifest,
            &app.trace.model,
            tiers.executor(latency, e, &app.trace.model),
        )?;
        let (cmd_tx, cmd_rx) = tokio::sync::mpsc::unbounded_channel::<LocalCall>();
        handles.push(
            thread::Builder::new()
                .name(format!("coe-{}", latency.name(e)))
                .spawn(move || executor_thread(e, executor, cmd_rx))
                .map_err(|err| CoeError::Invalid(format!("spawning executor thread: {err}")))?,
        );
        shared.install_link(e, ExecLink::Local(cmd_tx));
    }
    Ok(handles)
}

/// Serve `app`'s trace with executors named and budgeted by `latency` (the profile), one
/// thread each, under `options`: the same scheduler actor as the distributed job
/// ([`super::serve`]), under a supervisor that allows no restart, so a failure ends the run.
pub fn run_local(
    app: &Arc<App>,
    latency: &LatencyModel,
    options: &RunOptions,
) -> Result<RunReport, CoeError> {
    run_local_watched(app, latency, options, |_, _| {})
}

/// [`run_local`], calling `answered(done, total)` each time more requests are answered (for a
/// progress bar; it runs on the run's own async thread, so it must not block).
pub fn run_local_watched(
    app: &Arc<App>,
    latency: &LatencyModel,
    options: &RunOptions,
    answered: impl Fn(usize, usize) + Send + 'static,
) -> Result<RunReport, CoeError> {
    let (shared, _) = CoeShared::open(app.clone(), latency.clone(), options.config, None)?;
    let handles = start_local_executors_with(&shared, app, latency, &options.tiers)?;
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| CoeError::Invalid(format!("starting the async runtime: {e}")))?;
    let served = runtime.block_on(async {
        let (events, failures) = broadcast::channel(16);
        let args = SupervisorArgs {
            name: "coe-local".into(),
            children: vec![shared.child_spec()],
            intensity: Intensity { max_restarts: 0, period: Duration::from_secs(1) },
            events,
        };
        let (sup, handle) = Actor::spawn(None, Supervisor, args)
            .await
            .map_err(|e| CoeError::Invalid(format!("starting the coe scheduler: {e}")))?;
        let (mut done, total) = (shared.answered(), shared.total());
        let watcher = tokio::spawn(async move {
            while done.changed().await.is_ok() {
                answered(*done.borrow_and_update(), total);
            }
        });
        let served = serve_trace(&shared, options.arrival_scale, options.deadline, failures).await;
        watcher.abort();
        sup.stop(None);
        let _ = handle.await;
        served
    });
    shared.close_links();
    let own: Vec<Option<ExecutorCounters>> = handles.into_iter().map(|h| h.join().ok()).collect();
    served?;
    let mut report = shared.report(options.config.label(), Vec::new())?;
    // The executors' own counters carry the tier figures the scheduler's events do not.
    for ((_, c), mine) in report.executors.iter_mut().zip(own) {
        if let Some(mine) = mine {
            *c = mine;
        }
    }
    Ok(report)
}

/// The per-request results file: `request <id> digest <16 hex>` lines, in id order.
pub fn results_text(report: &RunReport) -> String {
    let mut out = String::new();
    for (i, d) in report.digests.iter().enumerate() {
        let _ = writeln!(out, "request {i} digest {d:016x}");
    }
    out
}
