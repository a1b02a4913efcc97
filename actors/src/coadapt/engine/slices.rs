//! The executor's time slices: the records of what the grouping planned and what the pool trained,
//! the pool-wide expert ids, and the grouped step itself (plan by the policy, run on the pool).

use std::cell::RefCell;
use std::collections::{BTreeMap, VecDeque};
use std::rc::Rc;

use rand::seq::index::sample;

use troupe_kernels::Tensor;
use troupe_kernels::ops::with_expert_threads;
use troupe_kernels::vmoe::pool::{SliceTask, expert_tmp_bytes, plan_bytes, step_plan};
use troupe_kernels::vmoe::{CoAdaptPool, VMoeConfig};
use troupe_policy::Micros;
use troupe_policy::adapt::evict::{Idle, OnRefusal, Refused, make_room, on_refusal};
use troupe_policy::adapt::memory::{ExpertShape, MemorySample};
use troupe_policy::adapt::plan::{
    PlanExpert, PlanMemory, SlicePlan, fit_estimator, plan_slices, whole_task_bytes,
};
use troupe_policy::adapt::threads::{block_threads, threads_pay};
use troupe_policy::adapt::{ExpertId, TaskId};

use super::{EdgeEngine, EngineError};

/// One time slice the executor ran (grouping on).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SliceRecord {
    /// The cycle.
    pub cycle: u64,
    /// The step within the cycle's epoch.
    pub step: usize,
    /// Index of the planned slice it carried out (a refused slice split in two gives two records
    /// with the same index).
    pub slice: usize,
    /// `(task, block, expert)` whose weights the pool's optimiser updated, ascending.
    pub trained: Vec<(TaskId, usize, usize)>,
}

/// The slice plan of one step (grouping on), as the policy made it.
#[derive(Clone, Debug, PartialEq)]
pub struct PlanRecord {
    /// The cycle.
    pub cycle: u64,
    /// The step within the cycle's epoch.
    pub step: usize,
    /// Models outside the cycle unloaded before the plan so the largest task trains whole
    /// ([`make_room`]), in the order unloaded.
    pub evicted: Vec<TaskId>,
    /// The bytes [`make_room`] was asked to free: the workspace and the largest task's experts.
    pub need_bytes: u64,
    /// The plan, with everything it was computed from.
    pub plan: SlicePlan,
}

/// The thread split of one block's experts in one forward or backward pass (threads on).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ThreadRecord {
    /// The cycle.
    pub cycle: u64,
    /// Rows (routed tokens) of each expert of the block.
    pub rows: Vec<usize>,
    /// Threads the executor had.
    pub total: u32,
    /// Threads each expert ran on (what the kernels used; 0 for an expert without rows); empty
    /// when the block's work did not pay for threads and its experts ran in turn on the
    /// executor's thread ([`threads_pay`]).
    pub split: Vec<u32>,
}

/// Most [`SliceRecord`]s and [`PlanRecord`]s kept (the newest).
pub const RECORDS_KEPT: usize = 4096;

/// Experts of one task per [`ExpertId`] block: `ExpertId(task * EXPERT_ID_STRIDE + b * experts + e)`.
pub const EXPERT_ID_STRIDE: u32 = 1024;

/// The pool-wide expert id of `(block, expert)` of `task`.
pub fn expert_id(task: TaskId, c: &VMoeConfig, block: usize, expert: usize) -> ExpertId {
    ExpertId(task.0 * EXPERT_ID_STRIDE + (block * c.experts + expert) as u32)
}

/// `(task, block, expert)` of a pool-wide expert id made by [`expert_id`].
pub fn expert_of(id: ExpertId, c: &VMoeConfig) -> (TaskId, usize, usize) {
    let local = (id.0 % EXPERT_ID_STRIDE) as usize;
    (TaskId(id.0 / EXPERT_ID_STRIDE), local / c.experts, local % c.experts)
}

/// The knapsack's `η` (per second of expert lifespan) the executor plans with.
pub const PLAN_ETA_PER_SEC: f64 = 0.01;
impl EdgeEngine {
    /// Refits the `M_tmp` estimator on the pool's temporary-memory measurements.
    pub(super) fn refit_estimator(&mut self) {
        let samples: Vec<MemorySample> = self
            .pool
            .tmp_samples()
            .iter()
            .rev()
            .take(troupe_policy::adapt::memory::MAX_FIT_SAMPLES)
            .map(|s| MemorySample {
                shape: ExpertShape { tokens: s.tokens as u64, d_k: s.dim as u64 },
                measured_bytes: s.bytes as f64,
            })
            .collect();
        self.estimator = fit_estimator(&samples);
    }

    /// One step of every cycle member, its experts grouped into time slices by the policy's
    /// knapsack ([`plan_slices`]); each slice runs on the pool as one [`CoAdaptPool::train_slice`].
    pub(super) fn grouped_step(&mut self, runs: &[TaskId], step: usize) -> Result<(), EngineError> {
        for t in runs {
            self.ensure_resident(*t, runs)?;
            self.ensure_trainer(*t, runs)?;
        }
        // One batch per task for the whole step, whichever slices its experts land in.
        let mut batches: BTreeMap<TaskId, (Tensor, Vec<usize>)> = BTreeMap::new();
        let mut experts = Vec::new();
        let mut workspace = 0u64;
        for t in runs {
            let Some(task) = self.tasks.get_mut(t) else { continue };
            let n = task.train.len();
            let b = self.cfg.batch.min(n);
            let idx = sample(&mut task.rng, n, b).into_vec();
            let labels: Vec<usize> = idx.iter().map(|&i| task.train.labels[i]).collect();
            batches.insert(*t, (task.train.batch(&idx)?, labels));
            let c = task.config;
            let tokens = b * c.tokens_per_image();
            let cap = c.capacity(tokens).min(tokens);
            let dense: Vec<_> = step_plan(&c, b).into_iter().filter(|(w, _)| *w != "expert tmp").collect();
            workspace = workspace.max(plan_bytes(&dense, 256));
            for block in 0..c.blocks {
                for e in 0..c.experts {
                    experts.push(PlanExpert {
                        task: *t,
                        expert: expert_id(*t, &c, block, e),
                        shape: ExpertShape { tokens: cap as u64, d_k: c.dim as u64 },
                        bound_bytes: expert_tmp_bytes(&c, cap),
                        lifespan: Micros(task.expert_us),
                    });
                }
            }
        }
        // Idle models (outside the cycle) go before a task is split over slices (the policy's
        // rule, `troupe_policy::adapt::evict::make_room`).
        let need = whole_task_bytes(&experts, self.estimator.as_ref(), workspace, 256);
        self.step_need = need;
        let idle: Vec<Idle> = self
            .tasks
            .iter()
            .filter(|(id, _)| !runs.contains(id))
            .filter_map(|(id, t)| {
                let bytes = self.pool.exclusive_memory_bytes(t.resident?)?;
                Some(Idle { task: *id, last_cycle: t.last_cycle, bytes })
            })
            .collect();
        let evicted = make_room(&idle, self.pool.stats().free, need);
        for v in &evicted {
            self.unload_task(*v)?;
        }
        let memory = PlanMemory {
            free_bytes: self.pool.stats().free,
            workspace_bytes: workspace,
            align: 256,
            eta_per_sec: PLAN_ETA_PER_SEC,
        };
        let seed = self.cfg.seed ^ (self.cycle << 16) ^ step as u64;
        let plan = plan_slices(&experts, self.estimator.as_ref(), memory, seed);
        let mut work: VecDeque<(usize, Vec<ExpertId>)> = plan.slices.iter().cloned().enumerate().collect();
        push_capped(&mut self.plans, PlanRecord { cycle: self.cycle, step, evicted, need_bytes: need, plan });
        let mut stepped: Vec<TaskId> = Vec::new();
        let mut reloaded = false;
        while let Some((k, slice)) = work.pop_front() {
            let mut by_task: Vec<(TaskId, Vec<(usize, usize)>)> = Vec::new();
            for id in &slice {
                let t = TaskId(id.0 / EXPERT_ID_STRIDE);
                let Some(task) = self.tasks.get(&t) else { continue };
                let (_, b, e) = expert_of(*id, &task.config);
                match by_task.iter_mut().find(|(x, _)| *x == t) {
                    Some((_, v)) => v.push((b, e)),
                    None => by_task.push((t, vec![(b, e)])),
                }
            }
            let members: Vec<TaskId> = by_task.iter().map(|(t, _)| *t).collect();
            // A member may have been unloaded to let an earlier slice run (fragmentation).
            for t in &members {
                self.ensure_resident(*t, runs)?;
                self.ensure_trainer(*t, runs)?;
            }
            let mut parts = Vec::with_capacity(by_task.len());
            for (t, ex) in &by_task {
                let (Some(id), Some((x, y))) = (self.tasks.get(t).and_then(|l| l.resident), batches.get(t))
                else {
                    return Err(EngineError::Invalid(format!("task {} is not resident", t.0)));
                };
                parts.push(SliceTask { model: id, images: x, labels: y, experts: ex });
            }
            // The reuse cache prefetches the next slice's first batch while this one computes.
            if let Some((t, x)) = work
                .front()
                .and_then(|(_, next)| next.first())
                .map(|id| TaskId(id.0 / EXPERT_ID_STRIDE))
                .and_then(|t| self.tasks.get(&t).and_then(|l| l.resident).zip(batches.get(&t)))
                .map(|(id, (x, _))| (id, x))
            {
                self.pool.reuse_expect(t, x);
            }
            let threads = self.expert_threads(&members);
            let lr = self.cfg.lr;
            let result = run_planned(&mut self.pool, threads, &mut self.thread_log, self.cycle, |p| {
                p.train_slice(&parts, lr)
            });
            match result {
                Ok(report) => {
                    let mut trained = Vec::new();
                    for ((t, _), m) in by_task.iter().zip(&report.models) {
                        trained.extend(m.trained.iter().map(|&(b, e)| (*t, b, e)));
                        if let Some(task) = self.tasks.get_mut(t)
                            && !m.trained.is_empty()
                        {
                            task.expert_us = (m.elapsed_us / m.trained.len() as u64).max(1);
                        }
                        if !stepped.contains(t) {
                            stepped.push(*t);
                        }
                    }
                    trained.sort_unstable();
                    reloaded = false;
                    self.commit_ready(runs)?;
                    push_capped(&mut self.slices, SliceRecord { cycle: self.cycle, step, slice: k, trained });
                }
                Err(e) => {
                    let refused = Refused::Slice { tasks: &members, experts: slice.len(), reloaded };
                    match on_refusal(&self.residents(runs), &refused) {
                        OnRefusal::Evict(v) => {
                            self.unload_task(v)?;
                            work.push_front((k, slice));
                        }
                        OnRefusal::Reload(v) => {
                            // Merged back in (and its optimiser state) at the top of the loop.
                            self.unload_task(v)?;
                            reloaded = true;
                            work.push_front((k, slice));
                        }
                        OnRefusal::Split => {
                            let (a, b) = slice.split_at(slice.len() / 2);
                            work.push_front((k, b.to_vec()));
                            work.push_front((k, a.to_vec()));
                        }
                        OnRefusal::GiveUp => return Err(e.into()),
                    }
                }
            }
        }
        self.steps += stepped.len() as u64;
        Ok(())
    }
}

/// What the threads mechanism runs a call with: the executor's threads, the multiply-adds one
/// routed row costs an expert (the widest model of the call) and the least per thread
/// ([`super::EngineConfig::thread_min_macs`]).
#[derive(Clone, Copy, Debug)]
pub(super) struct ExpertThreads {
    total: u32,
    row_macs: u64,
    min_macs: u64,
}

impl EdgeEngine {
    /// The threads mechanism for a call stepping `tasks` (`None` when it is off).
    pub(super) fn expert_threads(&self, tasks: &[TaskId]) -> Option<ExpertThreads> {
        // An expert's forward is two matmuls of `dim x hidden` per row (its backward twice that).
        let row_macs = tasks
            .iter()
            .filter_map(|t| self.tasks.get(t))
            .map(|l| 2 * (l.config.dim * l.config.hidden) as u64)
            .max();
        self.cfg.mechanisms.threads.then(|| ExpertThreads {
            total: self.threads_total,
            row_macs: row_macs.unwrap_or(0),
            min_macs: self.cfg.thread_min_macs,
        })
    }
}

/// Runs `f` on the pool with, when `threads` is set, the policy deciding for every block whether
/// its experts' work pays for threads ([`threads_pay`]) and if so fill-clamp-refill
/// ([`block_threads`]) deciding the threads of each expert; logs each decision.
pub(super) fn run_planned<R>(
    pool: &mut CoAdaptPool,
    threads: Option<ExpertThreads>,
    log: &mut VecDeque<ThreadRecord>,
    cycle: u64,
    f: impl FnOnce(&mut CoAdaptPool) -> R,
) -> R {
    let Some(ExpertThreads { total, row_macs, min_macs }) = threads else { return f(pool) };
    let seen: Rc<RefCell<Vec<ThreadRecord>>> = Rc::default();
    let sink = Rc::clone(&seen);
    let planner = Rc::new(move |rows: &[usize]| {
        // The experts of a block share one shape, so any positive per-row time gives this split.
        let split = if threads_pay(rows, row_macs, min_macs) {
            block_threads(rows, 1.0, total).0
        } else {
            Vec::new()
        };
        sink.borrow_mut().push(ThreadRecord { cycle, rows: rows.to_vec(), total, split: split.clone() });
        split
    });
    let out = with_expert_threads(planner, || f(pool));
    for r in seen.take() {
        push_capped(log, r);
    }
    out
}

/// Appends `r`, dropping the oldest past [`RECORDS_KEPT`].
pub(super) fn push_capped<T>(q: &mut VecDeque<T>, r: T) {
    if q.len() == RECORDS_KEPT {
        q.pop_front();
    }
    q.push_back(r);
}
