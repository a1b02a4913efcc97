//! The edge's adaptation executor: a co-adaptation scheduler ([`TwinBufferScheduler`] or a
//! baseline) decides, the real [`CoAdaptPool`] executes. Synchronous and `Send`, so the edge actor
//! runs it on a blocking thread and the benchmark drives it directly.
//!
//! Calling protocol: [`EdgeEngine::submit`] a job whenever one arrives (the teacher has labelled
//! its samples); call [`EdgeEngine::run_cycle`] while [`EdgeEngine::busy`]. A job with an SLO may
//! wait to be admitted (its starting accuracy measured, the scheduler told) while the scheduler
//! has work due earlier that is on time (`AdaptScheduler::defers_admission`); a cycle admits it
//! once none is left, or when nothing else would run. One cycle = every
//! `RunEpoch` the scheduler emitted together; their steps are interleaved on the pool (co-adapted),
//! then each epoch is reported with its validation exact match. A task leaves with its adapted
//! model when the scheduler completes it. Device memory is the pool's budget: a model is merged in
//! when the scheduler first runs or preloads it, and when the pool refuses memory the policy
//! ([`troupe_policy::adapt::evict`]) says which model to unload (adapted weights kept on the host,
//! optimiser state dropped), whether to split a slice, or to give up.
//!
//! With [`Mechanisms::grouping`] on, each step of the cycle is planned by the policy's knapsack
//! ([`troupe_policy::adapt::plan`]): the experts of every member are packed into time slices under
//! the pool's free bytes, `M_tmp` from the estimator fitted on this pool's measurements, and each
//! slice runs as one [`CoAdaptPool::train_slice`] (its experts train, the rest are frozen). Before
//! the plan, models outside the cycle are unloaded, idlest first, when the free bytes could not
//! train the cycle's largest task whole ([`troupe_policy::adapt::evict::make_room`]): a task split
//! over slices pays a forward and backward per slice. Off, each member takes a whole-model step in
//! turn, as before.
//!
//! With [`Mechanisms::preload`] on, a scheduler's `Preload` starts [`CoAdaptPool::prepare_load`]
//! (copies and hashes) on a background thread; the result is committed into the pool between
//! slices and steps when the running cycle's step still fits after it
//! ([`troupe_policy::adapt::evict::preload_fits`]), or claimed by the task's own cycle.
//!
//! With [`Mechanisms::reuse`] on, the pool's reuse cache ([`troupe_kernels::vmoe::reuse`]) serves
//! every step's stem tokens (decisions from `troupe_policy::adapt::reuse`); with grouping on, the
//! next slice's first batch is named to the pool so its disk entries are read while the current
//! slice computes (whole-model steps draw their batch at the step, so their reads are not hidden).
//! [`EdgeEngine::reuse_stats`] reports hits, misses, spills, prefetches and the hidden share.

use std::collections::{BTreeMap, VecDeque};

use rand::SeedableRng;
use rand::rngs::SmallRng;
use rand::seq::SliceRandom;
use rand::seq::index::sample;
use troupe_kernels::vmoe::pool::step_plan;
use troupe_kernels::vmoe::reuse::ReuseSetup;

use super::throttle::{StorageThrottle, throttle_reads};
pub use troupe_kernels::vmoe::reuse::ReuseStats;
use troupe_kernels::vmoe::train::{Dataset, TrainScope, Trainer, predict_all};
use troupe_kernels::vmoe::{CoAdaptPool, ModelId as PoolModel, VMoe, VMoeConfig, VMoeError, exact_match};
use troupe_policy::Micros;
use troupe_policy::adapt::baselines::QueueScheduler;
use troupe_policy::adapt::evict::{OnRefusal, Refused, Resident, on_refusal};
use troupe_policy::adapt::memory::MemoryModel;
use troupe_policy::adapt::sched::{AdaptScheduler, CycleLimits, SchedAction, TaskSpec};
use troupe_policy::adapt::twin::{TwinBufferScheduler, TwinConfig};
use troupe_policy::adapt::{ExpertId, ModelId, TaskId};

mod preload;
mod slices;

pub use preload::PreloadStats;
use preload::{Preparing, join_prepared};
use slices::run_planned;
pub use slices::{
    EXPERT_ID_STRIDE, PLAN_ETA_PER_SEC, PlanRecord, RECORDS_KEPT, SliceRecord, ThreadRecord, expert_id,
    expert_of,
};

/// Which scheduler the edge runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SchedulerChoice {
    /// AdaSprite's twin-buffer scheduler.
    Twin,
    /// AMS-like round robin.
    RoundRobin,
    /// RECL-like accuracy-first time slices.
    AccuracyFirst,
    /// Arrival order, run to completion (the isolated / MoE-SE scheduler).
    Fifo,
}

impl SchedulerChoice {
    /// Every choice, ours first.
    pub const ALL: [SchedulerChoice; 4] = [Self::Twin, Self::RoundRobin, Self::AccuracyFirst, Self::Fifo];

    /// Parses `twin`, `ams`, `recl` or `fifo`.
    pub fn parse(name: &str) -> Option<Self> {
        match name {
            "twin" => Some(Self::Twin),
            "ams" => Some(Self::RoundRobin),
            "recl" => Some(Self::AccuracyFirst),
            "fifo" => Some(Self::Fifo),
            _ => None,
        }
    }

    /// The config name.
    pub fn name(self) -> &'static str {
        match self {
            Self::Twin => "twin",
            Self::RoundRobin => "ams",
            Self::AccuracyFirst => "recl",
            Self::Fifo => "fifo",
        }
    }
}

/// AdaSprite's mechanisms the executor runs; each can be turned off alone for the ablation.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Mechanisms {
    /// Knapsack grouping: which experts' training steps share a time slice under the pool budget.
    pub grouping: bool,
    /// Fill-clamp-refill: how many threads each expert gets. On, the experts of every block run
    /// concurrently, each on the threads the policy gives it from its routed rows; off, one after
    /// another on the executor's thread.
    pub threads: bool,
    /// The reuse cache of stem tokens (the residual stream entering block 0's MoE, frozen in
    /// adaptation) under [`EngineConfig::reuse_budget`] bytes carved from the pool, backed by disk
    /// through the weight store; the policy (`troupe_policy::adapt::reuse`, λ = 0.55) decides what
    /// stays, what is spilled and what is dropped, and (grouping on) the next slice's disk entries
    /// are prefetched while the current slice computes. Steps start from the cached tokens, skipping the patch
    /// embedding and block 0's attention; results are bit-identical. Off: every step runs the full
    /// forward pass and nothing is carved from the pool. See [`EdgeEngine::reuse_stats`].
    pub reuse: bool,
    /// Preloading the next task's models on a background thread while the current one computes,
    /// merged into the pool between slices and steps. Off, `Preload` actions are ignored and a model
    /// is merged synchronously when its cycle starts.
    pub preload: bool,
    /// The lifespan-ordered pool (`troupe_policy::adapt::layout`, §3.2.1 and §3.3): models and
    /// their optimiser state (allocated when a model is loaded) first-fit from the low end, the
    /// reuse tier at the top, each step's temporaries in a region of contiguous slots placed low to
    /// high by execution order just below it. Off: best fit for everything, optimiser state on a
    /// model's first step, as the baselines run ([`CoAdaptPool::set_ordered`]).
    pub region: bool,
}

impl Mechanisms {
    /// Every mechanism on (the default).
    pub const ALL: Self = Self { grouping: true, threads: true, reuse: true, preload: true, region: true };
    /// Every mechanism off (the baselines).
    pub const NONE: Self =
        Self { grouping: false, threads: false, reuse: false, preload: false, region: false };
    /// Their names, as [`Mechanisms::without`] takes them.
    pub const NAMES: [&'static str; 5] = ["grouping", "threads", "reuse", "preload", "region"];

    /// These mechanisms with `name` turned off; `None` for an unknown name.
    pub fn without(self, name: &str) -> Option<Self> {
        let mut m = self;
        match name {
            "grouping" => m.grouping = false,
            "threads" => m.threads = false,
            "reuse" => m.reuse = false,
            "preload" => m.preload = false,
            "region" => m.region = false,
            _ => return None,
        }
        Some(m)
    }
}

impl Default for Mechanisms {
    fn default() -> Self {
        Self::ALL
    }
}

/// Knobs of the executor.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct EngineConfig {
    /// Pool budget in bytes (the device memory given to co-adaptation).
    pub budget: u64,
    /// The scheduler.
    pub scheduler: SchedulerChoice,
    /// Most tasks per cycle (twin-buffer seats). On the CPU a cycle holds one task while tasks
    /// carry deadlines (`troupe_policy::adapt::twin::TwinConfig::side_by_side`).
    pub seats: usize,
    /// Optimiser steps per epoch.
    pub steps_per_epoch: usize,
    /// Images per step.
    pub batch: usize,
    /// Adaptation learning rate.
    pub lr: f32,
    /// Epoch cap per task.
    pub max_epochs: u32,
    /// Exact-match gain over the task's start at which it completes.
    pub target_gain: f64,
    /// Share of each job's samples held out to measure its accuracy after each epoch.
    pub val_fraction: f64,
    /// Seeds the split and the batch order.
    pub seed: u64,
    /// Most tasks admitted and not yet finished (each holds a model and its samples); a job
    /// submitted past it is refused with [`EngineError::Full`], back to its sender.
    pub max_tasks: usize,
    /// Which of AdaSprite's mechanisms run.
    pub mechanisms: Mechanisms,
    /// Threads the experts of a block share when [`Mechanisms::threads`] is on (0: this machine's
    /// parallelism).
    pub threads: usize,
    /// With [`Mechanisms::threads`] on, a block's experts run on threads only when their work
    /// pays for them ([`troupe_policy::adapt::threads::threads_pay`]: at least two threads' worth of
    /// this many multiply-adds); 0: always on threads.
    pub thread_min_macs: u64,
    /// Whether the models' identical frozen parts are stored once in the pool (merging) or each task
    /// holds its own copy (isolated adaptation).
    pub share_backbone: bool,
    /// Bytes of the pool carved for the reuse cache's memory tier when [`Mechanisms::reuse`] is on;
    /// 0 (the default): [`reuse_default_bytes`], already part of [`reserved_bytes`]. Bytes above
    /// that are also kept out of the scheduler's budget.
    pub reuse_budget: u64,
    /// Most bytes of cached tokens the reuse cache keeps on disk. The disk tier is a fresh
    /// directory under the OS temp dir (or the one given to [`EdgeEngine::with_reuse_dir`]),
    /// removed when the engine drops.
    pub reuse_disk_budget: u64,
    /// Where the tasks' training steps run (opened when the engine is made; a GPU that cannot be
    /// used is an error naming why).
    pub device: troupe_kernels::DeviceKind,
    /// The reuse cache's disk reads throttled to this many bytes per second (an edge board's
    /// storage; [`super::throttle`]); 0: unthrottled. A throttle that cannot be set is an error.
    pub storage_read_bps: u64,
    /// The reuse cache FoggyCache-like: reuse without prefetch or residency, each reuse a disk
    /// read the step waits for (the bench's I/O-stall ablation; `troupe_policy::adapt::storage`).
    pub reuse_on_demand: bool,
}

impl Default for EngineConfig {
    fn default() -> Self {
        Self {
            budget: 64 << 20,
            scheduler: SchedulerChoice::Twin,
            seats: 4,
            steps_per_epoch: 8,
            batch: 32,
            lr: 3e-3,
            max_epochs: 30,
            target_gain: 0.10,
            val_fraction: 0.25,
            seed: 7,
            max_tasks: 64,
            mechanisms: Mechanisms::ALL,
            threads: 0,
            thread_min_macs: troupe_policy::adapt::threads::MIN_MACS_PER_THREAD,
            share_backbone: true,
            reuse_budget: 0,
            reuse_disk_budget: 64 << 20,
            device: troupe_kernels::DeviceKind::Cpu,
            storage_read_bps: 0,
            reuse_on_demand: false,
        }
    }
}

/// Why the executor failed.
#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    /// The pool or a model failed (including memory refused with nothing left to evict).
    #[error(transparent)]
    VMoe(#[from] VMoeError),
    /// A job cannot be used.
    #[error("invalid job: {0}")]
    Invalid(String),
    /// The storage read throttle asked for cannot be had.
    #[error(transparent)]
    Throttle(#[from] super::throttle::ThrottleError),
    /// The executor already holds its most tasks ([`EngineConfig::max_tasks`]).
    #[error("the edge already holds {live} adaptation tasks, its cap ({cap}); try again later")]
    Full {
        /// Tasks admitted and not finished.
        live: usize,
        /// The cap.
        cap: usize,
    },
}

/// An adaptation job: a camera's model and its uploaded samples labelled by the teacher.
#[derive(Clone, Debug)]
pub struct AdaptJob {
    /// Name (the camera).
    pub name: String,
    /// The model as the camera runs it.
    pub model: VMoe,
    /// Uploaded images with teacher labels.
    pub samples: Dataset,
    /// The job's objective: exact-match gain at which it completes (`None`: the configured one).
    pub target_gain: Option<f64>,
    /// Its SLO: that gain within this long of submission (`None`: no SLO). The twin-buffer
    /// scheduler serves the tasks that can still meet theirs first; the baselines ignore it.
    pub slo_within: Option<Micros>,
}

/// A task that left the executor.
#[derive(Clone, Debug)]
pub struct Finished {
    /// Task id.
    pub task: TaskId,
    /// Job name.
    pub name: String,
    /// The adapted model.
    pub model: VMoe,
    /// Validation exact match against the teacher at arrival.
    pub before: f64,
    /// The same when it left.
    pub after: f64,
    /// Epochs trained.
    pub epochs: u32,
    /// Whether it reached its target gain.
    pub reached: bool,
    /// Arrival time.
    pub arrived: Micros,
    /// Completion time.
    pub done: Micros,
    /// Processor time spent on its own training steps and validations, and on its admission when
    /// a cycle admitted it (a deferred one; one admitted by [`EdgeEngine::submit`] is the
    /// caller's to time), on the clock [`EdgeEngine::run_cycle`] was given: its work, without the
    /// executor's overhead (loads, preloads, scheduling). A grouped step's time is split evenly
    /// over the tasks in it.
    pub work: Micros,
}

/// Lifespan assumed for an expert before its task has been measured, in microseconds.
const DEFAULT_EXPERT_US: u64 = 1000;

struct LiveTask {
    name: String,
    config: VMoeConfig,
    /// Measured step time per trained expert (microseconds), the lifespan estimate.
    expert_us: u64,
    train: Dataset,
    val: Dataset,
    resident: Option<PoolModel>,
    stash: Option<VMoe>,
    before: f64,
    accuracy: f64,
    epochs: u32,
    arrived: Micros,
    last_cycle: u64,
    /// Processor time of its own steps and validations so far (see [`Finished::work`]).
    work: Micros,
    /// Draws this task's validation split and batches: seeded by the engine seed and the task's
    /// admission order, so a task trains on the same batches whichever scheduler runs it.
    rng: SmallRng,
}

/// A job accepted by [`EdgeEngine::submit`] and not admitted yet: its samples split, its random
/// stream drawn, so it trains on the same batches whenever it is admitted.
struct Pending {
    id: TaskId,
    arrived: Micros,
    job: AdaptJob,
    train: Dataset,
    val: Dataset,
    rng: SmallRng,
}

impl Pending {
    /// Its SLO deadline: the gain due `slo_within` after it arrived.
    fn deadline(&self) -> Option<Micros> {
        self.job.slo_within.map(|d| self.arrived + d)
    }

    /// Its model's exact match on its validation split, before any training.
    fn accuracy_before(&self) -> Result<f64, EngineError> {
        Ok(exact_match(&predict_all(&self.job.model, &self.val)?, &self.val.labels))
    }
}

/// The random stream of the `nth` task admitted by an engine seeded with `seed`.
fn task_rng(seed: u64, nth: u32) -> SmallRng {
    SmallRng::seed_from_u64(task_stream(seed, nth))
}

fn task_stream(seed: u64, nth: u32) -> u64 {
    seed ^ u64::from(nth).wrapping_add(1).wrapping_mul(0x9E37_79B9_7F4A_7C15)
}

/// The engine seed under which the first task admitted draws the same validation split and
/// batches as the `nth` task of an engine seeded `seed`: so one task can be rerun alone on exactly
/// the work it had among others (the bench's oracle measures each task's work this way).
pub fn seed_for_nth(seed: u64, nth: u32) -> u64 {
    task_stream(seed, nth) ^ task_stream(0, 0)
}

/// The executor (see the module doc).
pub struct EdgeEngine {
    cfg: EngineConfig,
    pool: CoAdaptPool,
    sched: Box<dyn AdaptScheduler + Send>,
    tasks: BTreeMap<TaskId, LiveTask>,
    queued: Vec<TaskId>,
    /// Accepted jobs not admitted yet, in arrival order (see the module doc).
    pending: std::collections::VecDeque<Pending>,
    finished: Vec<Finished>,
    next_id: u32,
    cycle: u64,
    steps: u64,
    evictions: u64,
    estimator: Option<MemoryModel>,
    preparing: BTreeMap<TaskId, Preparing>,
    preload_stats: PreloadStats,
    threads_total: u32,
    thread_log: VecDeque<ThreadRecord>,
    plans: VecDeque<PlanRecord>,
    slices: VecDeque<SliceRecord>,
    /// Bytes the running cycle's step needs free (its workspace and largest task's experts); a
    /// preload is merged mid-cycle only if they stay free.
    step_need: u64,
    /// The reuse cache's storage read throttle, if one was asked for.
    throttle: Option<StorageThrottle>,
}

/// Bytes only one adapting model holds: experts, projector and head, and their AdamW state.
pub fn task_footprint(c: &VMoeConfig) -> u64 {
    let weights = (c.blocks * c.experts * c.expert_params() + c.projector_params()) * 4;
    weights as u64
        + Trainer::state_bytes(c, TrainScope::ExpertsAndProjector)
        + 256 * (c.blocks * c.experts + 2) as u64
}

/// Bytes of one copy of a model's frozen shared parts (embeddings, norms, routers) in the pool.
pub fn shared_bytes(c: &VMoeConfig) -> u64 {
    (c.shared_params() * 4 + 256 * (3 + 3 * c.blocks + 2)) as u64
}

/// The reuse cache's default memory tier ([`EngineConfig::reuse_budget`] 0): one batch of stem
/// tokens of the widest expected config (`batch * tokens * dim` f32), 256-byte aligned.
pub fn reuse_default_bytes(expected: &[VMoeConfig], batch: usize) -> u64 {
    let widest = expected.iter().map(|c| c.tokens_per_image() * c.dim * 4).max().unwrap_or(0);
    ((batch * widest) as u64).div_ceil(256) * 256
}

/// Bytes kept out of the scheduler's budget: the merged shared parts of each expected config, the
/// largest step's activations and temporaries, and the reuse cache's default memory tier
/// ([`reuse_default_bytes`]; kept out with reuse off too, so the ablation gives the scheduler the
/// same room and only the cache differs).
pub fn reserved_bytes(expected: &[VMoeConfig], batch: usize) -> u64 {
    let shared: u64 = expected.iter().map(shared_bytes).sum();
    let step = expected
        .iter()
        .map(|c| step_plan(c, batch).iter().map(|(_, b)| b.div_ceil(256) * 256).sum::<u64>())
        .max()
        .unwrap_or(0);
    shared + step + reuse_default_bytes(expected, batch)
}

/// The co-adaptation scheduler `cfg` asks for, over `limits` (the policy deciding which task
/// runs its next epoch; the engine and its simulated stand-in drive the same one).
pub fn adapt_scheduler(cfg: &EngineConfig, limits: CycleLimits) -> Box<dyn AdaptScheduler + Send> {
    match cfg.scheduler {
        SchedulerChoice::Twin => Box::new(TwinBufferScheduler::new(TwinConfig {
            limits,
            seats: cfg.seats,
            side_by_side: cfg.device.runs_tasks_side_by_side(),
            ..TwinConfig::default()
        })),
        SchedulerChoice::RoundRobin => Box::new(QueueScheduler::ams(limits)),
        SchedulerChoice::AccuracyFirst => Box::new(QueueScheduler::recl(limits, 3)),
        SchedulerChoice::Fifo => Box::new(QueueScheduler::fifo(limits, "fifo")),
    }
}

impl EdgeEngine {
    /// An executor over a fresh pool; `expected` are the model configs it will see (their shared
    /// parts and step temporaries are kept out of the scheduler's budget).
    pub fn new(cfg: EngineConfig, expected: &[VMoeConfig]) -> Result<Self, EngineError> {
        Self::with_reuse_dir(cfg, expected, &std::env::temp_dir())
    }

    /// [`Self::new`] with the reuse cache's disk tier in a fresh directory under `reuse_parent`
    /// (unused when [`Mechanisms::reuse`] is off).
    pub fn with_reuse_dir(
        cfg: EngineConfig,
        expected: &[VMoeConfig],
        reuse_parent: &std::path::Path,
    ) -> Result<Self, EngineError> {
        let throttle = match cfg.storage_read_bps {
            0 => None,
            bps => {
                std::fs::create_dir_all(reuse_parent).map_err(|source| VMoeError::Io {
                    context: "creating",
                    path: reuse_parent.to_path_buf(),
                    source,
                })?;
                Some(throttle_reads(reuse_parent, bps, "coadapt-reuse")?)
            }
        };
        let mut pool = CoAdaptPool::new("coadapt-edge", cfg.budget)?;
        pool.set_device(cfg.device.open().map_err(VMoeError::from)?)?;
        pool.set_sharing(cfg.share_backbone);
        pool.set_ordered(cfg.mechanisms.region)?;
        let mut kept_out = reserved_bytes(expected, cfg.batch);
        if !cfg.share_backbone {
            // Without merging no copy of the shared parts is common to all tasks: each task's
            // footprint carries its own (see `submit`).
            kept_out -= expected.iter().map(shared_bytes).sum::<u64>();
        }
        if cfg.mechanisms.reuse {
            let default = reuse_default_bytes(expected, cfg.batch);
            let budget = if cfg.reuse_budget == 0 { default } else { cfg.reuse_budget.div_ceil(256) * 256 };
            let setup = ReuseSetup {
                idle_batches: troupe_policy::adapt::reuse::idle_batches(budget, default),
                on_demand: cfg.reuse_on_demand,
                disk_thread_cgroup: throttle.as_ref().and_then(StorageThrottle::thread_tasks),
                ..ReuseSetup::new(budget, cfg.reuse_disk_budget, reuse_parent)
            };
            pool.enable_reuse(&setup)?;
            // A memory tier above the default comes out of the scheduler's room.
            kept_out += budget.saturating_sub(default);
        }
        let limits =
            CycleLimits { memory_budget: cfg.budget.saturating_sub(kept_out), max_epochs: cfg.max_epochs };
        let sched = adapt_scheduler(&cfg, limits);
        Ok(Self {
            cfg,
            pool,
            sched,
            tasks: BTreeMap::new(),
            queued: Vec::new(),
            pending: std::collections::VecDeque::new(),
            finished: Vec::new(),
            next_id: 0,
            cycle: 0,
            steps: 0,
            evictions: 0,
            estimator: None,
            preparing: BTreeMap::new(),
            preload_stats: PreloadStats::default(),
            threads_total: match cfg.threads {
                0 => std::thread::available_parallelism().map_or(1, |n| n.get() as u32),
                n => u32::try_from(n).unwrap_or(u32::MAX),
            },
            thread_log: VecDeque::new(),
            plans: VecDeque::new(),
            slices: VecDeque::new(),
            step_need: 0,
            throttle,
        })
    }

    /// The storage read throttle in force (`None`: unthrottled).
    pub fn storage_throttle(&self) -> Option<&StorageThrottle> {
        self.throttle.as_ref()
    }

    /// The scheduler's name.
    pub fn scheduler_name(&self) -> &'static str {
        self.sched.name()
    }

    /// The pool (budget, peak, fragmentation samples, temporaries).
    pub fn pool(&self) -> &CoAdaptPool {
        &self.pool
    }

    /// The clock that stamps the pool's fragmentation samples ([`CoAdaptPool::set_clock`]).
    pub fn set_pool_clock(&mut self, clock: fn() -> u64) {
        self.pool.set_clock(clock);
    }

    /// Whether tasks are live or finished ones wait to be collected.
    pub fn busy(&self) -> bool {
        !self.tasks.is_empty() || !self.finished.is_empty() || !self.pending.is_empty()
    }

    /// Optimiser steps run so far.
    pub fn steps(&self) -> u64 {
        self.steps
    }

    /// Models unloaded to make room so far.
    pub fn evictions(&self) -> u64 {
        self.evictions
    }

    /// The newest slice plans (grouping on), oldest first, at most [`RECORDS_KEPT`].
    pub fn plan_records(&self) -> &VecDeque<PlanRecord> {
        &self.plans
    }

    /// The newest slices run (grouping on), oldest first, at most [`RECORDS_KEPT`].
    pub fn slice_records(&self) -> &VecDeque<SliceRecord> {
        &self.slices
    }

    /// The newest expert thread splits (threads on), oldest first, at most [`RECORDS_KEPT`].
    pub fn thread_records(&self) -> &VecDeque<ThreadRecord> {
        &self.thread_log
    }

    /// Threads the executor gives the experts of a block (this machine's parallelism).
    pub fn threads_total(&self) -> u32 {
        self.threads_total
    }

    /// What the background preloading did so far.
    pub fn preload_stats(&self) -> PreloadStats {
        self.preload_stats
    }

    /// What the reuse cache did: hits, misses, spills, prefetches, the share of prefetch time hidden
    /// behind compute, bytes in memory and on disk, its budgets. All zero with [`Mechanisms::reuse`]
    /// off.
    pub fn reuse_stats(&self) -> ReuseStats {
        self.pool.reuse_stats().unwrap_or_default()
    }

    /// The reuse cache's disk directory (`None` with [`Mechanisms::reuse`] off).
    pub fn reuse_dir(&self) -> Option<&std::path::Path> {
        self.pool.reuse_dir()
    }

    /// The `M_tmp` estimator fitted on this pool's measurements (refitted every cycle), if any.
    pub fn estimator(&self) -> Option<&MemoryModel> {
        self.estimator.as_ref()
    }

    /// Jobs accepted and not admitted yet (see the module doc).
    pub fn waiting(&self) -> usize {
        self.pending.len()
    }

    /// Whether a job submitted now would be refused as [`EngineError::Full`].
    pub fn is_full(&self) -> bool {
        self.tasks.len() + self.pending.len() >= self.cfg.max_tasks
    }

    /// Accepts a job: splits its samples (validation share held out), then admits it (measures
    /// its starting exact match, hands it to the scheduler), or, when the scheduler defers the
    /// admission, keeps it for a later cycle (see the module doc).
    pub fn submit(&mut self, now: Micros, job: AdaptJob) -> Result<TaskId, EngineError> {
        let live = self.tasks.len() + self.pending.len();
        if live >= self.cfg.max_tasks {
            return Err(EngineError::Full { live, cap: self.cfg.max_tasks });
        }
        let n = job.samples.len();
        let n_val =
            ((n as f64 * self.cfg.val_fraction).round() as usize).clamp(1, n.saturating_sub(1).max(1));
        if n < 2 * self.cfg.batch.min(8) {
            return Err(EngineError::Invalid(format!("{}: {n} samples are too few", job.name)));
        }
        let mut rng = task_rng(self.cfg.seed, self.next_id);
        let mut idx: Vec<usize> = (0..n).collect();
        idx.shuffle(&mut rng);
        let val = job.samples.subset(&idx[..n_val])?;
        let train = job.samples.subset(&idx[n_val..])?;
        let id = TaskId(self.next_id);
        self.next_id += 1;
        let p = Pending { id, arrived: now, job, train, val, rng };
        // behind any job still waiting: admissions go in arrival order
        if !self.pending.is_empty() || self.sched.defers_admission(now, p.deadline()) {
            self.pending.push_back(p);
        } else {
            let before = p.accuracy_before()?;
            self.admit(p, before, now)?;
        }
        Ok(id)
    }

    /// Hands a job to the scheduler at `now`, `before` its starting exact match.
    fn admit(&mut self, p: Pending, before: f64, now: Micros) -> Result<(), EngineError> {
        let deadline = p.deadline();
        let Pending { id, arrived, job, train, val, rng } = p;
        let c = job.model.config;
        let per_model = (c.blocks * c.experts) as u32;
        let spec = TaskSpec {
            id,
            model: ModelId(id.0),
            experts: (0..per_model).map(|e| ExpertId(id.0 * EXPERT_ID_STRIDE + e)).collect(),
            accuracy: before,
            target: before + job.target_gain.unwrap_or(self.cfg.target_gain),
            // Isolated adaptation: the task also holds its own copy of the frozen parts.
            footprint: task_footprint(&c) + if self.cfg.share_backbone { 0 } else { shared_bytes(&c) },
            deadline,
        };
        self.tasks.insert(
            id,
            LiveTask {
                name: job.name,
                config: c,
                expert_us: DEFAULT_EXPERT_US,
                train,
                val,
                resident: None,
                stash: Some(job.model),
                before,
                accuracy: before,
                epochs: 0,
                arrived,
                last_cycle: 0,
                work: Micros(0),
                rng,
            },
        );
        self.sched.handle_arrival(now, spec);
        self.drain(now)
    }

    /// Admits the waiting jobs the scheduler no longer defers, in arrival order (all of them when
    /// `all`), each admission's processor time charged to its task's work. A job whose starting
    /// accuracy cannot be measured was accepted, so it is not dropped: it leaves unadapted, as a
    /// finished task that did not reach its target, and the reason is logged.
    fn admit_pending(&mut self, clock: &dyn Fn() -> Micros, all: bool) -> Result<(), EngineError> {
        while let Some(p) = self.pending.front() {
            if !all && self.sched.defers_admission(clock(), p.deadline()) {
                break;
            }
            let Some(p) = self.pending.pop_front() else { break };
            let (id, start) = (p.id, clock());
            match p.accuracy_before() {
                Ok(before) => {
                    self.admit(p, before, start)?;
                    self.charge(&[id], clock().saturating_sub(start));
                }
                Err(e) => {
                    tracing::warn!(job = %p.job.name, error = %e, "a waiting job could not be admitted; it leaves unadapted");
                    self.finished.push(Finished {
                        task: id,
                        name: p.job.name,
                        model: p.job.model,
                        before: 0.0,
                        after: 0.0,
                        epochs: 0,
                        reached: false,
                        arrived: p.arrived,
                        done: start,
                        work: Micros(0),
                    });
                }
            }
        }
        Ok(())
    }

    /// Tasks that left since the last call.
    pub fn take_finished(&mut self) -> Vec<Finished> {
        std::mem::take(&mut self.finished)
    }

    /// Runs one cycle (see the module doc); `clock` gives the current time.
    pub fn run_cycle(&mut self, clock: &dyn Fn() -> Micros) -> Result<(), EngineError> {
        self.admit_pending(clock, false)?;
        self.drain(clock())?;
        if self.queued.is_empty() && !self.pending.is_empty() {
            // nothing dispatched would run ahead of them: admit every waiting job
            self.admit_pending(clock, true)?;
            self.drain(clock())?;
        }
        let runs = std::mem::take(&mut self.queued);
        if runs.is_empty() {
            return Ok(());
        }
        self.cycle += 1;
        self.sched.handle_cycle_start(clock());
        // Until a grouped step plans with the estimator: the analytic bytes of the widest
        // member's whole step.
        self.step_need = runs
            .iter()
            .filter_map(|t| self.tasks.get(t))
            .map(|l| step_plan(&l.config, self.cfg.batch).iter().map(|(_, b)| b.div_ceil(256) * 256).sum())
            .max()
            .unwrap_or(0);
        for t in &runs {
            self.ensure_resident(*t, &runs)?;
        }
        if self.cfg.mechanisms.grouping {
            self.refit_estimator();
        }
        for step in 0..self.cfg.steps_per_epoch {
            if self.cfg.mechanisms.grouping {
                let start = clock();
                self.grouped_step(&runs, step)?;
                self.charge(&runs, clock().saturating_sub(start));
            } else {
                for t in &runs {
                    let start = clock();
                    self.adapt_step(*t, &runs)?;
                    self.charge(std::slice::from_ref(t), clock().saturating_sub(start));
                    self.commit_ready(&runs)?;
                }
            }
            if self.sched.poll_timeout().is_some_and(|due| clock() >= due) {
                self.sched.handle_timeout(clock());
                self.drain(clock())?;
            }
        }
        for t in &runs {
            let start = clock();
            let acc = self.validate(*t)?;
            self.charge(std::slice::from_ref(t), clock().saturating_sub(start));
            if let Some(task) = self.tasks.get_mut(t) {
                task.accuracy = acc;
                task.epochs += 1;
            }
            self.sched.handle_epoch_done(clock(), *t, acc);
        }
        self.drain(clock())
    }

    /// Adds `spent` to the work of `tasks`, split evenly (see [`Finished::work`]).
    fn charge(&mut self, tasks: &[TaskId], spent: Micros) {
        let share = Micros(spent.0 / tasks.len().max(1) as u64);
        for t in tasks {
            if let Some(task) = self.tasks.get_mut(t) {
                task.work = task.work + share;
            }
        }
    }

    fn validate(&self, t: TaskId) -> Result<f64, EngineError> {
        let Some(task) = self.tasks.get(&t) else { return Ok(0.0) };
        let preds = match (task.resident, &task.stash) {
            (Some(id), _) => self.pool.predict(id, &task.val)?,
            (None, Some(m)) => predict_all(m, &task.val)?,
            (None, None) => return Err(EngineError::Invalid(format!("task {} has no model", t.0))),
        };
        Ok(exact_match(&preds, &task.val.labels))
    }

    fn adapt_step(&mut self, t: TaskId, keep: &[TaskId]) -> Result<(), EngineError> {
        // A cycle member may have been unloaded to let another one step (fragmentation).
        self.ensure_resident(t, keep)?;
        let (images, labels, id) = {
            let Some(task) = self.tasks.get_mut(&t) else { return Ok(()) };
            let Some(id) = task.resident else {
                return Err(EngineError::Invalid(format!("task {} is not resident", t.0)));
            };
            let n = task.train.len();
            let idx = sample(&mut task.rng, n, self.cfg.batch.min(n)).into_vec();
            let labels: Vec<usize> = idx.iter().map(|&i| task.train.labels[i]).collect();
            (task.train.batch(&idx)?, labels, id)
        };
        let (mut id, mut reloaded) = (id, false);
        loop {
            let threads = self.expert_threads(&[t]);
            let lr = self.cfg.lr;
            let result = run_planned(&mut self.pool, threads, &mut self.thread_log, self.cycle, |p| {
                p.adapt_step(id, &images, &labels, lr)
            });
            match result {
                Ok(_) => {
                    self.steps += 1;
                    return Ok(());
                }
                Err(e) => {
                    let refused = Refused::Slice { tasks: &[t], experts: 1, reloaded };
                    match on_refusal(&self.residents(keep), &refused) {
                        OnRefusal::Evict(v) => self.unload_task(v)?,
                        OnRefusal::Reload(v) => {
                            self.unload_task(v)?;
                            self.ensure_resident(v, keep)?;
                            reloaded = true;
                            id = self.resident_id(t)?;
                        }
                        OnRefusal::Split | OnRefusal::GiveUp => return Err(e.into()),
                    }
                }
            }
        }
    }

    /// Allocates the task's optimiser state, unloading models as the policy decides while refused.
    fn ensure_trainer(&mut self, t: TaskId, keep: &[TaskId]) -> Result<(), EngineError> {
        loop {
            let Some(id) = self.tasks.get(&t).and_then(|l| l.resident) else { return Ok(()) };
            match self.pool.ensure_trainer(id, self.cfg.lr) {
                Ok(()) => return Ok(()),
                Err(e) => match on_refusal(&self.residents(keep), &Refused::Load(t)) {
                    OnRefusal::Evict(v) => self.unload_task(v)?,
                    OnRefusal::Split | OnRefusal::Reload(_) | OnRefusal::GiveUp => return Err(e.into()),
                },
            }
        }
    }

    /// The pool id of a task's resident model.
    fn resident_id(&self, t: TaskId) -> Result<PoolModel, EngineError> {
        self.tasks
            .get(&t)
            .and_then(|l| l.resident)
            .ok_or_else(|| EngineError::Invalid(format!("task {} is not resident", t.0)))
    }

    /// Resident models as the eviction policy sees them.
    fn residents(&self, cycle: &[TaskId]) -> Vec<Resident> {
        self.tasks
            .iter()
            .filter(|(_, t)| t.resident.is_some())
            .map(|(id, t)| Resident { task: *id, last_cycle: t.last_cycle, in_cycle: cycle.contains(id) })
            .collect()
    }

    /// Unloads a task's model (adapted weights kept on the host, optimiser state dropped).
    fn unload_task(&mut self, v: TaskId) -> Result<(), EngineError> {
        if let Some(task) = self.tasks.get_mut(&v)
            && let Some(id) = task.resident.take()
        {
            task.stash = Some(self.pool.unload(id)?);
            self.evictions += 1;
        }
        Ok(())
    }

    /// Merges the task's model into the pool, unloading idle models while the pool refuses.
    /// A preload under way in the background is waited for and committed.
    fn ensure_resident(&mut self, t: TaskId, keep: &[TaskId]) -> Result<(), EngineError> {
        let cycle = self.cycle;
        let Some(task) = self.tasks.get_mut(&t) else { return Ok(()) };
        task.last_cycle = cycle;
        if task.resident.is_some() {
            return Ok(());
        }
        let mut prepared = match self.preparing.remove(&t) {
            Some(handle) => {
                if !handle.is_finished() {
                    self.preload_stats.waited += 1;
                }
                self.preload_stats.claimed += 1;
                join_prepared(handle)?
            }
            None => {
                let Some(model) = task.stash.take() else {
                    return Err(EngineError::Invalid(format!("task {} has no model", t.0)));
                };
                CoAdaptPool::prepare_load(&task.name, model)?
            }
        };
        loop {
            match self.pool.commit_load(prepared) {
                Ok(id) => {
                    if let Some(task) = self.tasks.get_mut(&t) {
                        task.resident = Some(id);
                    }
                    return Ok(());
                }
                Err(refused) => match on_refusal(&self.residents(keep), &Refused::Load(t)) {
                    OnRefusal::Evict(v) => {
                        self.unload_task(v)?;
                        prepared = refused.1;
                    }
                    OnRefusal::Split | OnRefusal::Reload(_) | OnRefusal::GiveUp => {
                        let (e, back) = *refused;
                        if let Some(task) = self.tasks.get_mut(&t) {
                            task.stash = Some(back.into_model());
                        }
                        return Err(e.into());
                    }
                },
            }
        }
    }

    fn drain(&mut self, now: Micros) -> Result<(), EngineError> {
        while let Some(a) = self.sched.poll_action() {
            match a {
                SchedAction::RunEpoch { task } => self.queued.push(task),
                SchedAction::Preload { .. } if !self.cfg.mechanisms.preload => {}
                // Best effort: a refused preload is merged when the task's cycle starts.
                SchedAction::Preload { task, .. } => self.start_preload(task),
                SchedAction::Complete { task, reached } => {
                    if let Some(handle) = self.preparing.remove(&task)
                        && let Some(t) = self.tasks.get_mut(&task)
                    {
                        t.stash = Some(join_prepared(handle)?.into_model());
                        self.preload_stats.dropped += 1;
                    }
                    let Some(mut t) = self.tasks.remove(&task) else { continue };
                    let model = match (t.resident.take(), t.stash.take()) {
                        (Some(id), _) => self.pool.unload(id)?,
                        (None, Some(m)) => m,
                        (None, None) => continue,
                    };
                    self.finished.push(Finished {
                        task,
                        name: t.name,
                        model,
                        before: t.before,
                        after: t.accuracy,
                        epochs: t.epochs,
                        reached,
                        arrived: t.arrived,
                        done: now,
                        work: t.work,
                    });
                }
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_task_rerun_alone_draws_what_it_drew_among_others() {
        use rand::Rng;
        for (seed, nth) in [(7u64, 0u32), (7, 5), (u64::MAX, 11)] {
            let mut among = task_rng(seed, nth);
            let mut alone = task_rng(seed_for_nth(seed, nth), 0);
            assert_eq!(among.random::<u64>(), alone.random::<u64>());
        }
        assert_ne!(seed_for_nth(7, 1), seed_for_nth(7, 2));
    }
}
