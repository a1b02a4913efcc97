//! The edge's adaptation executor: a co-adaptation scheduler ([`TwinBufferScheduler`] or a
//! baseline) decides, the real [`CoAdaptPool`] executes. Synchronous and `Send`, so the edge actor
//! runs it on a blocking thread and the benchmark drives it directly.
//!
//! Calling protocol: [`EdgeEngine::submit`] a job whenever one arrives (the teacher has labelled
//! its samples); call [`EdgeEngine::run_cycle`] while [`EdgeEngine::busy`]. One cycle = every
//! `RunEpoch` the scheduler emitted together; their steps are interleaved on the pool (co-adapted),
//! then each epoch is reported with its validation exact match. A task leaves with its adapted
//! model when the scheduler completes it. Device memory is the pool's budget: a model is merged in
//! when the scheduler first runs or preloads it, and models idle longest are unloaded (their
//! adapted weights kept on the host, optimiser state dropped) when the pool refuses memory.

use std::collections::BTreeMap;

use rand::SeedableRng;
use rand::rngs::SmallRng;
use rand::seq::SliceRandom;
use rand::seq::index::sample;
use troupe_kernels::vmoe::pool::step_plan;
use troupe_kernels::vmoe::train::{Dataset, TrainScope, Trainer, predict_all};
use troupe_kernels::vmoe::{CoAdaptPool, ModelId as PoolModel, VMoe, VMoeConfig, VMoeError, exact_match};
use troupe_policy::Micros;
use troupe_policy::adapt::baselines::QueueScheduler;
use troupe_policy::adapt::sched::{AdaptScheduler, CycleLimits, SchedAction, TaskSpec};
use troupe_policy::adapt::twin::{TwinBufferScheduler, TwinConfig};
use troupe_policy::adapt::{ExpertId, ModelId, TaskId};

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
    /// Fill-clamp-refill: how many threads each expert of a slice gets.
    pub threads: bool,
    /// The reuse cache of expert outputs under a byte budget, backed by disk.
    pub reuse: bool,
    /// Preloading the next task's models while the current one computes.
    pub preload: bool,
}

impl Mechanisms {
    /// Every mechanism on (the default).
    pub const ALL: Self = Self { grouping: true, threads: true, reuse: true, preload: true };
    /// Their names, as [`Mechanisms::without`] takes them.
    pub const NAMES: [&'static str; 4] = ["grouping", "threads", "reuse", "preload"];

    /// These mechanisms with `name` turned off; `None` for an unknown name.
    pub fn without(self, name: &str) -> Option<Self> {
        let mut m = self;
        match name {
            "grouping" => m.grouping = false,
            "threads" => m.threads = false,
            "reuse" => m.reuse = false,
            "preload" => m.preload = false,
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
    /// Most tasks per cycle (twin-buffer seats).
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
    /// Whether the models' identical frozen parts are stored once in the pool (merging) or each task
    /// holds its own copy (isolated adaptation).
    pub share_backbone: bool,
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
            share_backbone: true,
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
}

struct LiveTask {
    name: String,
    train: Dataset,
    val: Dataset,
    resident: Option<PoolModel>,
    stash: Option<VMoe>,
    before: f64,
    accuracy: f64,
    epochs: u32,
    arrived: Micros,
    last_cycle: u64,
}

/// The executor (see the module doc).
pub struct EdgeEngine {
    cfg: EngineConfig,
    pool: CoAdaptPool,
    sched: Box<dyn AdaptScheduler + Send>,
    tasks: BTreeMap<TaskId, LiveTask>,
    queued: Vec<TaskId>,
    finished: Vec<Finished>,
    next_id: u32,
    cycle: u64,
    rng: SmallRng,
    steps: u64,
    evictions: u64,
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

/// Bytes kept out of the scheduler's budget: the merged shared parts of each expected config and the
/// largest step's activations and temporaries.
pub fn reserved_bytes(expected: &[VMoeConfig], batch: usize) -> u64 {
    let shared: u64 = expected.iter().map(shared_bytes).sum();
    let step = expected
        .iter()
        .map(|c| step_plan(c, batch).iter().map(|(_, b)| b.div_ceil(256) * 256).sum::<u64>())
        .max()
        .unwrap_or(0);
    shared + step
}

impl EdgeEngine {
    /// An executor over a fresh pool; `expected` are the model configs it will see (their shared
    /// parts and step temporaries are kept out of the scheduler's budget).
    pub fn new(cfg: EngineConfig, expected: &[VMoeConfig]) -> Result<Self, EngineError> {
        let mut pool = CoAdaptPool::new("coadapt-edge", cfg.budget)?;
        pool.set_sharing(cfg.share_backbone);
        // Without merging no copy of the shared parts is common to all tasks: each task's footprint
        // carries its own (see `submit`), so only the step's buffers stay out of the budget.
        let reserved = if cfg.share_backbone {
            reserved_bytes(expected, cfg.batch)
        } else {
            reserved_bytes(expected, cfg.batch) - expected.iter().map(shared_bytes).sum::<u64>()
        };
        let limits =
            CycleLimits { memory_budget: cfg.budget.saturating_sub(reserved), max_epochs: cfg.max_epochs };
        let sched: Box<dyn AdaptScheduler + Send> = match cfg.scheduler {
            SchedulerChoice::Twin => Box::new(TwinBufferScheduler::new(TwinConfig {
                limits,
                seats: cfg.seats,
                ..TwinConfig::default()
            })),
            SchedulerChoice::RoundRobin => Box::new(QueueScheduler::ams(limits)),
            SchedulerChoice::AccuracyFirst => Box::new(QueueScheduler::recl(limits, 3)),
            SchedulerChoice::Fifo => Box::new(QueueScheduler::fifo(limits, "fifo")),
        };
        Ok(Self {
            cfg,
            pool,
            sched,
            tasks: BTreeMap::new(),
            queued: Vec::new(),
            finished: Vec::new(),
            next_id: 0,
            cycle: 0,
            rng: SmallRng::seed_from_u64(cfg.seed),
            steps: 0,
            evictions: 0,
        })
    }

    /// The scheduler's name.
    pub fn scheduler_name(&self) -> &'static str {
        self.sched.name()
    }

    /// The pool (budget, peak, fragmentation samples, temporaries).
    pub fn pool(&self) -> &CoAdaptPool {
        &self.pool
    }

    /// Whether tasks are live or finished ones wait to be collected.
    pub fn busy(&self) -> bool {
        !self.tasks.is_empty() || !self.finished.is_empty()
    }

    /// Optimiser steps run so far.
    pub fn steps(&self) -> u64 {
        self.steps
    }

    /// Models unloaded to make room so far.
    pub fn evictions(&self) -> u64 {
        self.evictions
    }

    /// Whether a job submitted now would be refused as [`EngineError::Full`].
    pub fn is_full(&self) -> bool {
        self.tasks.len() >= self.cfg.max_tasks
    }

    /// Admits a job: splits its samples (validation share held out), measures its starting exact
    /// match, hands it to the scheduler.
    pub fn submit(&mut self, now: Micros, job: AdaptJob) -> Result<TaskId, EngineError> {
        if self.tasks.len() >= self.cfg.max_tasks {
            return Err(EngineError::Full { live: self.tasks.len(), cap: self.cfg.max_tasks });
        }
        let n = job.samples.len();
        let n_val =
            ((n as f64 * self.cfg.val_fraction).round() as usize).clamp(1, n.saturating_sub(1).max(1));
        if n < 2 * self.cfg.batch.min(8) {
            return Err(EngineError::Invalid(format!("{}: {n} samples are too few", job.name)));
        }
        let mut idx: Vec<usize> = (0..n).collect();
        idx.shuffle(&mut self.rng);
        let val = job.samples.subset(&idx[..n_val])?;
        let train = job.samples.subset(&idx[n_val..])?;
        let before = exact_match(&predict_all(&job.model, &val)?, &val.labels);
        let id = TaskId(self.next_id);
        self.next_id += 1;
        let c = job.model.config;
        let per_model = (c.blocks * c.experts) as u32;
        let spec = TaskSpec {
            id,
            model: ModelId(id.0),
            experts: (0..per_model).map(|e| ExpertId(id.0 * 1024 + e)).collect(),
            accuracy: before,
            target: before + job.target_gain.unwrap_or(self.cfg.target_gain),
            // Isolated adaptation: the task also holds its own copy of the frozen parts.
            footprint: task_footprint(&c) + if self.cfg.share_backbone { 0 } else { shared_bytes(&c) },
        };
        self.tasks.insert(
            id,
            LiveTask {
                name: job.name,
                train,
                val,
                resident: None,
                stash: Some(job.model),
                before,
                accuracy: before,
                epochs: 0,
                arrived: now,
                last_cycle: 0,
            },
        );
        self.sched.handle_arrival(now, spec);
        self.drain(now)?;
        Ok(id)
    }

    /// Tasks that left since the last call.
    pub fn take_finished(&mut self) -> Vec<Finished> {
        std::mem::take(&mut self.finished)
    }

    /// Runs one cycle (see the module doc); `clock` gives the current time.
    pub fn run_cycle(&mut self, clock: &dyn Fn() -> Micros) -> Result<(), EngineError> {
        self.drain(clock())?;
        let runs = std::mem::take(&mut self.queued);
        if runs.is_empty() {
            return Ok(());
        }
        self.cycle += 1;
        for t in &runs {
            self.ensure_resident(*t, &runs)?;
        }
        for _ in 0..self.cfg.steps_per_epoch {
            for t in &runs {
                self.adapt_step(*t, &runs)?;
            }
            if self.sched.poll_timeout().is_some_and(|due| clock() >= due) {
                self.sched.handle_timeout(clock());
                self.drain(clock())?;
            }
        }
        for t in &runs {
            let acc = self.validate(*t)?;
            if let Some(task) = self.tasks.get_mut(t) {
                task.accuracy = acc;
                task.epochs += 1;
            }
            self.sched.handle_epoch_done(clock(), *t, acc);
        }
        self.drain(clock())
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
            let Some(task) = self.tasks.get(&t) else { return Ok(()) };
            let Some(id) = task.resident else {
                return Err(EngineError::Invalid(format!("task {} is not resident", t.0)));
            };
            let n = task.train.len();
            let idx = sample(&mut self.rng, n, self.cfg.batch.min(n)).into_vec();
            let labels: Vec<usize> = idx.iter().map(|&i| task.train.labels[i]).collect();
            (task.train.batch(&idx)?, labels, id)
        };
        loop {
            match self.pool.adapt_step(id, &images, &labels, self.cfg.lr) {
                Ok(_) => {
                    self.steps += 1;
                    return Ok(());
                }
                Err(e) => {
                    if !self.evict_one(keep, t)? {
                        return Err(e.into());
                    }
                }
            }
        }
    }

    /// Merges the task's model into the pool, unloading idle models while the pool refuses.
    fn ensure_resident(&mut self, t: TaskId, keep: &[TaskId]) -> Result<(), EngineError> {
        let cycle = self.cycle;
        let Some(task) = self.tasks.get_mut(&t) else { return Ok(()) };
        task.last_cycle = cycle;
        if task.resident.is_some() {
            return Ok(());
        }
        let Some(model) = task.stash.take() else {
            return Err(EngineError::Invalid(format!("task {} has no model", t.0)));
        };
        let name = task.name.clone();
        loop {
            match self.pool.load(&name, &model) {
                Ok(id) => {
                    if let Some(task) = self.tasks.get_mut(&t) {
                        task.resident = Some(id);
                    }
                    return Ok(());
                }
                Err(e) => {
                    if !self.evict_one(keep, t)? {
                        if let Some(task) = self.tasks.get_mut(&t) {
                            task.stash = Some(model);
                        }
                        return Err(e.into());
                    }
                }
            }
        }
    }

    /// Unloads a resident model other than `needed` to make room: the one idle longest outside
    /// `prefer_keep` (the current cycle), else the one idle longest (free space can be too
    /// fragmented for the cycle's own models to fit together). False when there is none.
    fn evict_one(&mut self, prefer_keep: &[TaskId], needed: TaskId) -> Result<bool, EngineError> {
        let pick = |outside_keep: bool| {
            self.tasks
                .iter()
                .filter(|(id, t)| t.resident.is_some() && **id != needed)
                .filter(|(id, _)| !outside_keep || !prefer_keep.contains(id))
                .min_by_key(|(id, t)| (t.last_cycle, **id))
                .map(|(id, _)| *id)
        };
        let Some(v) = pick(true).or_else(|| pick(false)) else { return Ok(false) };
        if let Some(task) = self.tasks.get_mut(&v)
            && let Some(id) = task.resident.take()
        {
            task.stash = Some(self.pool.unload(id)?);
            self.evictions += 1;
        }
        Ok(true)
    }

    fn drain(&mut self, now: Micros) -> Result<(), EngineError> {
        while let Some(a) = self.sched.poll_action() {
            match a {
                SchedAction::RunEpoch { task } => self.queued.push(task),
                SchedAction::Preload { .. } if !self.cfg.mechanisms.preload => {}
                SchedAction::Preload { task, .. } => {
                    let mut keep = self.queued.clone();
                    keep.push(task);
                    // Best effort: a refused preload is retried when the task's cycle starts.
                    if let Err(e) = self.ensure_resident(task, &keep) {
                        tracing::debug!(task = task.0, error = %e, "preload refused");
                    }
                }
                SchedAction::Complete { task, reached } => {
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
                    });
                }
            }
        }
        Ok(())
    }
}
