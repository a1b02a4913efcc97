//! The foreman: the pipeline's scheduler policy (sans-IO).
//!
//! A job of `N` inputs over a checked [`Chain`] of `S` stages becomes `N x S` tasks. The foreman
//! decides which worker loads which stage and runs which task, under these rules:
//! - Single-partition residency: a worker holds at most one live session. Running another stage
//!   means an explicit [`Action::Unload`] then [`Action::Load`] (Tier 4); a stage being loaded
//!   counts as live.
//! - Broadcast + JIT: at job start the smallest stage's file is sent to every worker whose budget
//!   fits it (and, if it is stage 0, loaded there at once, as the paper does with `cell_a`). Any
//!   other load happens only to run a ready task, so stage `k > 0` is first loaded only after some
//!   stage `k-1` task completed.
//! - Readiness per [`Mode`]: streaming (1:1) or barrier (1:N).
//! - RAM budget: a stage whose session RSS estimate ([`RssModel`]) exceeds a worker's budget is
//!   never sent, loaded or assigned there.
//! - A worker runs one task at a time; completed outputs are held by the foreman's shell, so a lost
//!   worker loses only what it was running, loading for, or had pinned.
//! - Failure: [`Foreman::handle_worker_lost`] re-plans the lost worker's tasks with
//!   [`replan::plan_reassignment`] (logged as [`Action::Reassigned`]); completions from lost
//!   workers or for tasks not assigned to the sender are ignored and logged, so no task is done
//!   twice and no input is answered twice ([`Action::InputDone`] is emitted once per input).
//!
//! Calling protocol: register workers with [`Foreman::handle_worker_joined`], then
//! [`Foreman::submit_job`]; feed events (`handle_*`) as they happen, each with the caller's `now`;
//! after every call drain [`Foreman::poll_action`] until `None` and perform the actions in order
//! (per worker, in that order: a `SendStage` must land before the `Load` that follows it). Report
//! each `Load` back with [`Foreman::handle_stage_loaded`] and each `Assign` with
//! [`Foreman::handle_task_done`]. The foreman has no timers ([`Foreman::poll_timeout`] is always
//! `None`): loss detection comes from the membership layer.

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::fmt;

use thiserror::Error;

use super::affinity::{self, DispatchInput, ReadyTask, StageFlow, Telemetry, Tier, WorkerCosts, WorkerView};
use super::chain::{Chain, is_sha256_hex};
use super::costs::CostModel;
use super::plan::{self, PlanWorker};
use super::replan::{self, ReplanWeights, SurvivorView};
use super::start;
use super::{Mode, TaskId, WorkerId};
use crate::Micros;

/// Most workers the foreman tracks.
pub const MAX_WORKERS: usize = 4096;
/// Most tasks (`N x S`) one job may have.
pub const MAX_TASKS: usize = 1 << 22;
/// Most cached stage hashes kept per worker report.
pub const MAX_CACHED_REPORTED: usize = 1024;
/// A stage plan is made only with at least this many unclaimed tasks per stage and worker
/// (`sum_k U_k >= PLAN_MIN_TASKS * S * W`): below that there is no steady state to balance, and
/// the tail rules do better on their own.
pub const PLAN_MIN_TASKS: usize = 2;
/// Stage index standing for a live session that is not a stage of the current job.
pub const FOREIGN_STAGE: usize = usize::MAX;

/// Session RSS estimate of a stage: `size * num / den + fixed_bytes`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RssModel {
    /// Numerator of the per-byte factor.
    pub num: u64,
    /// Denominator of the per-byte factor (0 is read as 1).
    pub den: u64,
    /// Fixed runtime overhead per session, bytes.
    pub fixed_bytes: u64,
}

impl Default for RssModel {
    /// 1.5 x the file size plus 16 MiB of runtime overhead.
    fn default() -> Self {
        RssModel { num: 3, den: 2, fixed_bytes: 16 << 20 }
    }
}

impl RssModel {
    /// Estimated session RSS for a stage file of `size_bytes`.
    pub fn estimate(&self, size_bytes: u64) -> u64 {
        let scaled = u128::from(size_bytes) * u128::from(self.num) / u128::from(self.den.max(1));
        u64::try_from(scaled).unwrap_or(u64::MAX).saturating_add(self.fixed_bytes)
    }
}

/// Foreman settings.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ForemanConfig {
    /// How a stage's session RSS is estimated from its file size.
    pub rss: RssModel,
    /// Failure planner weights.
    pub replan: ReplanWeights,
    /// Attempts (task runs or loads for it that failed) after which the job fails.
    pub max_attempts: u32,
    /// Cost-aware dispatch (learned task and load times; rules 1 and 2 of
    /// [`affinity::two_phase_dispatch`]). Off: tier and rank only, as before.
    pub cost_aware: bool,
    /// Streaming jobs with cost-aware dispatch: once every alive worker's speed is measured (or
    /// remembered), give each a home stage ([`super::plan::plan_stages`]) it keeps while that
    /// stage has unclaimed tasks (rule 4 of [`affinity::two_phase_dispatch`]).
    pub stage_plan: bool,
    /// With a stage plan: a free worker whose home stage is not live loads it at once, before a
    /// task of it is ready (eager). Off (the default): just in time, as the paper does.
    pub eager_loads: bool,
    /// Keep the learned task and load times from one job to the next job of the same stage
    /// sizes (and those given with [`Foreman::remember_costs`]). Off: each job starts from the
    /// priors.
    pub remember_costs: bool,
    /// With a stage plan: when every worker's costs are known as a streaming job starts, choose
    /// the homes by replaying each plan ([`super::start::start_plan`]) and load them at once.
    pub start_plan: bool,
}

impl Default for ForemanConfig {
    fn default() -> Self {
        ForemanConfig {
            rss: RssModel::default(),
            replan: ReplanWeights::default(),
            max_attempts: 3,
            cost_aware: true,
            stage_plan: true,
            eager_loads: false,
            remember_costs: true,
            start_plan: true,
        }
    }
}

/// A job: a checked chain run over `inputs` inputs in one [`Mode`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Job {
    /// The stages.
    pub chain: Chain,
    /// Number of inputs `N`.
    pub inputs: usize,
    /// Streaming or barrier dependencies.
    pub mode: Mode,
}

/// What a worker says about itself when it joins.
#[derive(Clone, Debug, PartialEq, Default)]
pub struct WorkerReport {
    /// First telemetry.
    pub telemetry: Telemetry,
    /// SHA-256 of its live session's stage file, if any.
    pub live: Option<String>,
    /// SHA-256 of the stage files on its disk.
    pub cached: Vec<String>,
}

/// Why an ignored completion was ignored.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum IgnoreReason {
    /// The worker was declared lost; its tasks went elsewhere.
    WorkerLost,
    /// The task is already done.
    AlreadyDone,
    /// The task is not assigned to that worker (or no such task/worker/job).
    NotAssigned,
}

/// A decision or log event of the foreman, in the order it must be performed.
#[derive(Clone, Debug, PartialEq)]
pub enum Action {
    /// Make stage file `stage` (by its hash) available on the worker's disk.
    SendStage {
        /// Target worker.
        worker: WorkerId,
        /// Stage index in the job's chain.
        stage: usize,
    },
    /// Create the stage's session on the worker (it has nothing live).
    Load {
        /// Target worker.
        worker: WorkerId,
        /// Stage index.
        stage: usize,
    },
    /// Drop the worker's live session, whatever it is.
    Unload {
        /// Target worker.
        worker: WorkerId,
    },
    /// Run the task on the worker, whose live session is the task's stage.
    Assign {
        /// The task.
        task: TaskId,
        /// The worker.
        worker: WorkerId,
        /// The worker's tier when the task was dispatched.
        tier: Tier,
    },
    /// Log: a lost worker's task was given to a survivor.
    Reassigned {
        /// The task.
        task: TaskId,
        /// The lost worker.
        from: WorkerId,
        /// The survivor.
        to: WorkerId,
    },
    /// Log: a lost worker's task went back to ready with no survivor fitting it yet.
    Requeued {
        /// The task.
        task: TaskId,
        /// The lost worker.
        from: WorkerId,
    },
    /// Log: a completion report was ignored.
    IgnoredCompletion {
        /// The task reported.
        task: TaskId,
        /// The reporting worker.
        worker: WorkerId,
        /// Why.
        reason: IgnoreReason,
    },
    /// A stage has ready tasks but no alive worker whose budget fits it.
    Stalled {
        /// The stage.
        stage: usize,
    },
    /// Every stage of this input is done: its final output can be answered (once).
    InputDone {
        /// The input.
        input: usize,
    },
    /// Every task is done.
    JobDone,
    /// A task failed `max_attempts` times; the job is abandoned.
    JobFailed {
        /// The task.
        task: TaskId,
    },
}

impl fmt::Display for Action {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Action::SendStage { worker, stage } => write!(f, "send s{stage} -> {worker}"),
            Action::Load { worker, stage } => write!(f, "load s{stage} on {worker}"),
            Action::Unload { worker } => write!(f, "unload {worker}"),
            Action::Assign { task, worker, tier } => {
                write!(f, "assign {task} -> {worker} ({tier})")
            }
            Action::Reassigned { task, from, to } => write!(f, "reassigned {task} {from} -> {to}"),
            Action::Requeued { task, from } => write!(f, "requeued {task} from {from}"),
            Action::IgnoredCompletion { task, worker, reason } => {
                write!(f, "ignored completion {task} from {worker} ({reason:?})")
            }
            Action::Stalled { stage } => write!(f, "stalled s{stage}"),
            Action::InputDone { input } => write!(f, "input {input} done"),
            Action::JobDone => f.write_str("job done"),
            Action::JobFailed { task } => write!(f, "job failed at {task}"),
        }
    }
}

/// Why the foreman refused a request.
#[derive(Clone, Debug, PartialEq, Eq, Error)]
pub enum ForemanError {
    /// A job is still running.
    #[error("a job is already in progress")]
    JobInProgress,
    /// The job has no inputs.
    #[error("job has no inputs")]
    NoInputs,
    /// `N x S` is above [`MAX_TASKS`].
    #[error("job has {tasks} tasks, more than the limit {MAX_TASKS}")]
    TooManyTasks {
        /// `N x S` (saturated).
        tasks: usize,
    },
    /// More than [`MAX_WORKERS`] workers.
    #[error("more than {MAX_WORKERS} workers")]
    TooManyWorkers,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum TaskState {
    Waiting,
    Ready,
    Pinned(WorkerId),
    Loading(WorkerId),
    Running(WorkerId),
    Done,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Loading {
    stage: usize,
    task: Option<(TaskId, Tier)>,
    /// When the load was decided (start of the measured load time).
    since: Micros,
    /// The stage file was sent for this load.
    cold: bool,
}

#[derive(Clone, Debug)]
struct WorkerState {
    telemetry: Telemetry,
    live: Option<String>,
    loading: Option<Loading>,
    cached: BTreeSet<String>,
    running: Option<TaskId>,
    /// When `running` was assigned (start of the measured task time).
    running_since: Micros,
    pinned: VecDeque<TaskId>,
    ok: u32,
    failed: u32,
}

impl WorkerState {
    fn is_free(&self) -> bool {
        self.running.is_none() && self.loading.is_none()
    }
}

#[derive(Clone, Debug)]
struct JobState {
    chain: Chain,
    inputs: usize,
    mode: Mode,
    rss: Vec<u64>,
    states: Vec<TaskState>,
    attempts: Vec<u32>,
    ready: BTreeSet<TaskId>,
    unclaimed: Vec<usize>,
    in_flight: Vec<usize>,
    done_by: Vec<Option<WorkerId>>,
    done_per_stage: Vec<usize>,
    done: usize,
    stalled: BTreeSet<usize>,
    finished: bool,
    costs: CostModel,
    /// Home stage per worker under the stage plan (empty: no plan yet or none used).
    plan: BTreeMap<WorkerId, usize>,
    /// Under a start plan, the stage a worker moves on to once its home is all claimed.
    then: BTreeMap<WorkerId, usize>,
}

impl JobState {
    fn stages(&self) -> usize {
        self.chain.len()
    }
    fn index(&self, t: TaskId) -> Option<usize> {
        (t.input < self.inputs && t.stage < self.stages()).then(|| t.input * self.stages() + t.stage)
    }
    fn state(&self, t: TaskId) -> Option<TaskState> {
        self.index(t).map(|i| self.states[i])
    }
    /// The one place task states change; keeps the ready set and counters in step.
    fn set(&mut self, t: TaskId, new: TaskState) {
        let Some(i) = self.index(t) else { return };
        let old = self.states[i];
        let unclaimed = |s: TaskState| matches!(s, TaskState::Waiting | TaskState::Ready);
        if unclaimed(old) {
            self.unclaimed[t.stage] -= 1;
        }
        if unclaimed(new) {
            self.unclaimed[t.stage] += 1;
        }
        let active =
            |s: TaskState| matches!(s, TaskState::Pinned(_) | TaskState::Loading(_) | TaskState::Running(_));
        if active(old) {
            self.in_flight[t.stage] -= 1;
        }
        if active(new) {
            self.in_flight[t.stage] += 1;
        }
        if let (TaskState::Running(w), TaskState::Done) = (old, new) {
            self.done_by[i] = Some(w);
        }
        if old == TaskState::Ready {
            self.ready.remove(&t);
        }
        if new == TaskState::Ready {
            self.ready.insert(t);
        }
        if new == TaskState::Done && old != TaskState::Done {
            self.done += 1;
            self.done_per_stage[t.stage] += 1;
        }
        if old == TaskState::Done && new != TaskState::Done {
            self.done -= 1;
            self.done_per_stage[t.stage] -= 1;
        }
        self.states[i] = new;
    }
}

/// The pipeline scheduler policy; see the module doc for the calling protocol.
#[derive(Clone, Debug)]
pub struct Foreman {
    config: ForemanConfig,
    workers: BTreeMap<WorkerId, WorkerState>,
    lost: BTreeSet<WorkerId>,
    job: Option<JobState>,
    actions: VecDeque<Action>,
    /// The latest `now` a handler was given (monotone).
    now: Micros,
    /// Costs to start the next job from ([`ForemanConfig::remember_costs`]).
    memory: Option<CostModel>,
}

impl Foreman {
    /// A foreman with no workers and no job.
    pub fn new(config: ForemanConfig) -> Self {
        Foreman {
            config,
            workers: BTreeMap::new(),
            lost: BTreeSet::new(),
            job: None,
            actions: VecDeque::new(),
            now: Micros::ZERO,
            memory: None,
        }
    }

    /// Learned costs to start the next job from (a foreman of an earlier job, e.g. in another
    /// incarnation of the shell, learned them); used when the job's stage sizes match.
    pub fn remember_costs(&mut self, costs: CostModel) {
        self.memory = Some(costs);
    }

    /// The latest time the foreman was given (its clock: every later call must pass a time at
    /// or after it, or durations it measures come out short).
    pub fn now(&self) -> Micros {
        self.now
    }

    /// The costs learned so far: the current (or last) job's, else those remembered.
    pub fn learned_costs(&self) -> Option<CostModel> {
        self.job.as_ref().map(|j| j.costs.clone()).or_else(|| self.memory.clone())
    }

    /// Home stage per worker under the current job's stage plan (empty when there is none).
    pub fn stage_plan(&self) -> Vec<(WorkerId, usize)> {
        self.job.as_ref().map_or_else(Vec::new, |j| j.plan.iter().map(|(&w, &k)| (w, k)).collect())
    }

    /// The next decision or log event, in order.
    #[must_use]
    pub fn poll_action(&mut self) -> Option<Action> {
        self.actions.pop_front()
    }

    /// Always `None`: the foreman needs no timer.
    #[must_use]
    pub fn poll_timeout(&self) -> Option<Micros> {
        None
    }

    /// A worker joined (or rejoined after being lost: it starts fresh).
    pub fn handle_worker_joined(
        &mut self,
        now: Micros,
        id: WorkerId,
        report: WorkerReport,
    ) -> Result<(), ForemanError> {
        self.now = self.now.max(now);
        if !self.workers.contains_key(&id) && self.workers.len() >= MAX_WORKERS {
            return Err(ForemanError::TooManyWorkers);
        }
        self.lost.remove(&id);
        let live = report.live.filter(|h| is_sha256_hex(h));
        let cached = Self::clean_hashes(report.cached);
        let now = self.now;
        let state = WorkerState {
            telemetry: report.telemetry,
            live,
            loading: None,
            cached,
            running: None,
            running_since: now,
            pinned: VecDeque::new(),
            ok: 0,
            failed: 0,
        };
        // A rejoin under the same id abandons whatever the old incarnation held; the fresh
        // incarnation is itself a candidate for those tasks.
        let orphans = match self.workers.remove(&id) {
            Some(old) => Self::held_tasks(&old),
            None => Vec::new(),
        };
        self.workers.insert(id, state);
        if let Some(job) = self.job.as_mut() {
            job.plan.clear();
            job.then.clear();
        }
        if let Some(job) = &self.job
            && !job.finished
        {
            let smallest = job.chain.smallest_stage();
            self.broadcast_to(id, smallest);
        }
        self.replan(id, &orphans);
        self.dispatch();
        Ok(())
    }

    /// New telemetry from a worker (unknown workers are ignored).
    pub fn handle_telemetry(&mut self, now: Micros, id: WorkerId, telemetry: Telemetry) {
        self.now = self.now.max(now);
        if let Some(w) = self.workers.get_mut(&id) {
            w.telemetry = telemetry;
        } else {
            return;
        }
        self.dispatch();
    }

    /// A worker's report of the stage files on its disk (replaces what the foreman believed).
    pub fn handle_residency(&mut self, now: Micros, id: WorkerId, cached: Vec<String>) {
        self.now = self.now.max(now);
        if let Some(w) = self.workers.get_mut(&id) {
            w.cached = Self::clean_hashes(cached);
        }
    }

    /// Submits a job; its first decisions are queued for [`Foreman::poll_action`].
    pub fn submit_job(&mut self, now: Micros, job: Job) -> Result<(), ForemanError> {
        self.now = self.now.max(now);
        if self.job.as_ref().is_some_and(|j| !j.finished) {
            return Err(ForemanError::JobInProgress);
        }
        if job.inputs == 0 {
            return Err(ForemanError::NoInputs);
        }
        let s = job.chain.len();
        let tasks = job.inputs.saturating_mul(s);
        if tasks > MAX_TASKS {
            return Err(ForemanError::TooManyTasks { tasks });
        }
        let rss = job.chain.stages().iter().map(|st| self.config.rss.estimate(st.size_bytes)).collect();
        let sizes: Vec<u64> = job.chain.stages().iter().map(|st| st.size_bytes).collect();
        if let Some(old) = self.job.take() {
            self.memory = Some(old.costs);
        }
        let costs = match self.memory.take() {
            Some(c) if self.config.remember_costs && c.sizes() == sizes.as_slice() => c,
            other => {
                self.memory = other;
                CostModel::new(&sizes)
            }
        };
        let mut state = JobState {
            chain: job.chain,
            inputs: job.inputs,
            mode: job.mode,
            rss,
            states: vec![TaskState::Waiting; tasks],
            attempts: vec![0; tasks],
            ready: BTreeSet::new(),
            unclaimed: vec![0; s],
            in_flight: vec![0; s],
            done_by: vec![None; tasks],
            done_per_stage: vec![0; s],
            done: 0,
            stalled: BTreeSet::new(),
            finished: false,
            costs,
            plan: BTreeMap::new(),
            then: BTreeMap::new(),
        };
        state.unclaimed[..].fill(job.inputs);
        for i in 0..job.inputs {
            state.set(TaskId::new(i, 0), TaskState::Ready);
        }
        let smallest = state.chain.smallest_stage();
        self.job = Some(state);
        // a start plan loads each worker's home before the broadcast would load stage 0
        self.make_plan();
        let ids: Vec<WorkerId> = self.workers.keys().copied().collect();
        for id in ids {
            self.broadcast_to(id, smallest);
        }
        self.dispatch();
        Ok(())
    }

    /// A `Load` finished (`ok`) or failed on a worker.
    pub fn handle_stage_loaded(&mut self, now: Micros, id: WorkerId, stage: usize, ok: bool) {
        self.now = self.now.max(now);
        let Some(job) = self.job.as_mut() else { return };
        let Some(w) = self.workers.get_mut(&id) else {
            return;
        };
        let Some(loading) = w.loading.filter(|l| l.stage == stage) else {
            return;
        };
        let Some(hash) = job.chain.stage(stage).map(|s| s.sha256.clone()) else {
            return;
        };
        w.loading = None;
        if ok {
            let took = now.0.saturating_sub(loading.since.0) as f64;
            job.costs.observe_worker_load(id, stage, loading.cold, took);
            w.live = Some(hash.clone());
            w.cached.insert(hash);
            if let Some((task, tier)) = loading.task {
                w.running = Some(task);
                w.running_since = now;
                job.set(task, TaskState::Running(id));
                self.actions.push_back(Action::Assign { task, worker: id, tier });
            }
        } else {
            w.failed = w.failed.saturating_add(1);
            w.cached.remove(&hash);
            if let Some((task, _)) = loading.task {
                self.retry_or_fail(task);
            }
        }
        self.dispatch();
    }

    /// A worker reports that `task` finished (`ok`) or failed.
    pub fn handle_task_done(&mut self, now: Micros, id: WorkerId, task: TaskId, ok: bool) {
        self.now = self.now.max(now);
        let Some(job) = self.job.as_mut() else { return };
        let Some(state) = job.state(task) else {
            self.ignore(task, id, IgnoreReason::NotAssigned);
            return;
        };
        let Some(w) = self.workers.get_mut(&id).filter(|w| w.running == Some(task)) else {
            let reason = if self.lost.contains(&id) {
                IgnoreReason::WorkerLost
            } else if state == TaskState::Done {
                IgnoreReason::AlreadyDone
            } else {
                IgnoreReason::NotAssigned
            };
            self.ignore(task, id, reason);
            return;
        };
        w.running = None;
        if !ok {
            w.failed = w.failed.saturating_add(1);
            self.retry_or_fail(task);
            self.dispatch();
            return;
        }
        w.ok = w.ok.saturating_add(1);
        let took = now.0.saturating_sub(w.running_since.0) as f64;
        job.costs.observe_task(id, task.stage, took);
        job.set(task, TaskState::Done);
        let next = task.stage + 1;
        if next < job.stages() {
            match job.mode {
                // only a waiting task becomes ready: after lost outputs were made again, the next
                // task may already be in flight or done
                Mode::Streaming => {
                    let t = TaskId::new(task.input, next);
                    if job.state(t) == Some(TaskState::Waiting) {
                        job.set(t, TaskState::Ready);
                    }
                }
                Mode::Barrier => {
                    if job.done_per_stage[task.stage] == job.inputs {
                        for i in 0..job.inputs {
                            let t = TaskId::new(i, next);
                            if job.state(t) == Some(TaskState::Waiting) {
                                job.set(t, TaskState::Ready);
                            }
                        }
                    }
                }
            }
        } else {
            self.actions.push_back(Action::InputDone { input: task.input });
        }
        if job.done == job.states.len() && !job.finished {
            job.finished = true;
            self.actions.push_back(Action::JobDone);
        }
        self.dispatch();
    }

    /// The outputs of done `task` are gone (they were kept on a worker lost before the next
    /// stage read them; when earlier stages' outputs went with them, `task` is the earliest of
    /// those): `task` is ready again, and the later tasks of its input that were ready wait for
    /// it. One in flight is left to finish or fail (a failed one then waits too).
    pub fn handle_outputs_lost(&mut self, now: Micros, task: TaskId) {
        self.now = self.now.max(now);
        let Some(job) = self.job.as_mut() else { return };
        if job.finished || job.state(task) != Some(TaskState::Done) {
            return;
        }
        job.set(task, TaskState::Ready);
        for s in task.stage + 1..job.stages() {
            let t = TaskId::new(task.input, s);
            if matches!(job.state(t), Some(TaskState::Done | TaskState::Ready)) {
                job.set(t, TaskState::Waiting);
            }
        }
        self.dispatch();
    }

    /// `task` could not read its inputs on worker `id`: the worker that made them no longer has
    /// them (it restarted) and not even the foreman can fetch them. The producing task runs
    /// again and `task` waits for it; the worker is not blamed. The attempt still counts against
    /// `task`, so inputs lost again and again end the job as failures do.
    pub fn handle_inputs_lost(&mut self, now: Micros, id: WorkerId, task: TaskId) {
        if task.stage == 0 {
            // the first stage's inputs come from the foreman: nothing to make again
            self.handle_task_done(now, id, task, false);
            return;
        }
        self.now = self.now.max(now);
        let Some(job) = self.job.as_mut() else { return };
        let Some(w) = self.workers.get_mut(&id).filter(|w| w.running == Some(task)) else {
            let reason =
                if self.lost.contains(&id) { IgnoreReason::WorkerLost } else { IgnoreReason::NotAssigned };
            self.ignore(task, id, reason);
            return;
        };
        w.running = None;
        if job.index(task).is_none() || self.out_of_attempts(task) {
            return;
        }
        if let Some(job) = self.job.as_mut() {
            job.set(task, TaskState::Waiting);
        }
        // the producer's outputs are gone: it runs again (and `task` becomes ready after it)
        self.handle_outputs_lost(now, TaskId::new(task.input, task.stage - 1));
        self.dispatch();
    }

    /// A worker is gone: its tasks are re-planned onto survivors and logged.
    pub fn handle_worker_lost(&mut self, now: Micros, id: WorkerId) {
        self.now = self.now.max(now);
        let Some(w) = self.workers.remove(&id) else {
            return;
        };
        self.lost.insert(id);
        if let Some(job) = self.job.as_mut() {
            job.plan.clear();
            job.then.clear();
        }
        self.replan(id, &Self::held_tasks(&w));
        self.dispatch();
    }

    /// The stage live (or loading) on a worker, [`FOREIGN_STAGE`] for a session outside the job.
    pub fn live_stage(&self, id: WorkerId) -> Option<usize> {
        let w = self.workers.get(&id)?;
        match &self.job {
            Some(job) => Self::live_index(job, w),
            None => w.live.as_ref().map(|_| FOREIGN_STAGE),
        }
    }

    /// Ids of the workers currently alive.
    pub fn workers(&self) -> Vec<WorkerId> {
        self.workers.keys().copied().collect()
    }

    /// Tasks of the current job ready to be assigned and tasks in flight (pinned, loading or
    /// running on a worker); `(0, 0)` with no job. Read-only, for the node's queue figures.
    pub fn task_queue(&self) -> (usize, usize) {
        self.job.as_ref().map_or((0, 0), |j| (j.ready.len(), j.in_flight.iter().sum()))
    }

    /// Tasks done so far in the current job.
    pub fn tasks_done(&self) -> usize {
        self.job.as_ref().map_or(0, |j| j.done)
    }

    /// Whether the current job has finished (all tasks done).
    pub fn is_job_done(&self) -> bool {
        self.job.as_ref().is_some_and(|j| j.finished)
    }

    /// Predicted task and load times of every stage on worker `id` (µs, as dispatch sees them).
    pub fn predicted_costs(&self, id: WorkerId) -> Option<WorkerCosts> {
        let job = self.job.as_ref()?;
        Some(Self::worker_costs(job, id, self.workers.get(&id)?))
    }

    /// Session RSS estimate of stage `k` of the current job.
    pub fn stage_rss(&self, k: usize) -> Option<u64> {
        self.job.as_ref().and_then(|j| j.rss.get(k).copied())
    }

    /// Tasks a worker was running, loading for, or had pinned.
    fn held_tasks(w: &WorkerState) -> Vec<TaskId> {
        let mut held: Vec<TaskId> = w.running.into_iter().collect();
        held.extend(w.loading.and_then(|l| l.task).map(|(t, _)| t));
        held.extend(w.pinned.iter().copied());
        held
    }

    /// Gives the orphaned tasks of worker `from` to the workers now registered, logging each move.
    fn replan(&mut self, from: WorkerId, orphans: &[TaskId]) {
        let Some(job) = self.job.as_mut() else { return };
        if job.finished || orphans.is_empty() {
            return;
        }
        let candidates: Vec<SurvivorView> = self
            .workers
            .iter()
            .map(|(&sid, s)| SurvivorView {
                id: sid,
                ok: s.ok,
                failed: s.failed,
                free_ram_bytes: s.telemetry.free_ram_bytes,
                battery_pct: s.telemetry.battery_pct,
                live: Self::live_index(job, s),
                cached: Self::cached_flags(job, s),
                fits: Self::fit_flags(job, s),
                queued: usize::from(!s.is_free()) + s.pinned.len(),
            })
            .collect();
        let moves = replan::plan_reassignment(from, orphans, &candidates, &self.config.replan);
        for m in moves {
            match m.to {
                Some(to) => {
                    job.set(m.task, TaskState::Pinned(to));
                    if let Some(target) = self.workers.get_mut(&to) {
                        target.pinned.push_back(m.task);
                    }
                    self.actions.push_back(Action::Reassigned { task: m.task, from, to });
                }
                None => {
                    job.set(m.task, TaskState::Ready);
                    self.actions.push_back(Action::Requeued { task: m.task, from });
                }
            }
        }
    }

    fn clean_hashes(hashes: Vec<String>) -> BTreeSet<String> {
        hashes.into_iter().take(MAX_CACHED_REPORTED).filter(|h| is_sha256_hex(h)).collect()
    }

    fn live_index(job: &JobState, w: &WorkerState) -> Option<usize> {
        if let Some(l) = w.loading {
            return Some(l.stage);
        }
        w.live.as_ref().map(|h| job.chain.stage_by_hash(h).unwrap_or(FOREIGN_STAGE))
    }

    fn cached_flags(job: &JobState, w: &WorkerState) -> Vec<bool> {
        job.chain.stages().iter().map(|s| w.cached.contains(&s.sha256)).collect()
    }

    fn worker_costs(job: &JobState, id: WorkerId, w: &WorkerState) -> WorkerCosts {
        let stages = job.chain.stages().iter().enumerate();
        WorkerCosts {
            task_us: (0..job.stages()).map(|k| job.costs.task(id, k)).collect(),
            load_us: stages.map(|(k, st)| job.costs.load_on(id, k, w.cached.contains(&st.sha256))).collect(),
        }
    }

    fn fit_flags(job: &JobState, w: &WorkerState) -> Vec<bool> {
        job.rss.iter().map(|&r| r <= w.telemetry.ram_budget_bytes).collect()
    }

    fn ignore(&mut self, task: TaskId, worker: WorkerId, reason: IgnoreReason) {
        self.actions.push_back(Action::IgnoredCompletion { task, worker, reason });
    }

    /// Sends the broadcast stage to a worker at job start (or when it joins mid-job); loads it too
    /// when it is stage 0 and the worker has nothing live.
    fn broadcast_to(&mut self, id: WorkerId, stage: usize) {
        let Some(job) = self.job.as_ref() else { return };
        let Some(w) = self.workers.get_mut(&id) else {
            return;
        };
        let Some(sig) = job.chain.stage(stage) else {
            return;
        };
        if job.rss[stage] > w.telemetry.ram_budget_bytes {
            return;
        }
        let cold = !w.cached.contains(&sig.sha256);
        if cold {
            w.cached.insert(sig.sha256.clone());
            self.actions.push_back(Action::SendStage { worker: id, stage });
        }
        if stage == 0 && w.live.is_none() && w.is_free() && job.unclaimed[0] > 0 {
            w.loading = Some(Loading { stage, task: None, since: self.now, cold });
            self.actions.push_back(Action::Load { worker: id, stage });
        }
    }

    /// Counts one more attempt of `task`; at `max_attempts` the task waits and the job fails
    /// (once). Returns whether the task is out of attempts.
    fn out_of_attempts(&mut self, task: TaskId) -> bool {
        let Some(job) = self.job.as_mut() else { return true };
        let Some(i) = job.index(task) else { return true };
        job.attempts[i] = job.attempts[i].saturating_add(1);
        if job.attempts[i] < self.config.max_attempts {
            return false;
        }
        job.set(task, TaskState::Waiting);
        if !job.finished {
            job.finished = true;
            self.actions.push_back(Action::JobFailed { task });
        }
        true
    }

    fn retry_or_fail(&mut self, task: TaskId) {
        if self.out_of_attempts(task) {
            return;
        }
        let Some(job) = self.job.as_mut() else { return };
        if task.stage > 0 && job.state(TaskId::new(task.input, task.stage - 1)) != Some(TaskState::Done) {
            // its inputs are being made again (see `handle_outputs_lost`)
            job.set(task, TaskState::Waiting);
        } else {
            job.set(task, TaskState::Ready);
        }
    }

    /// Starts `task` on free worker `id`: assign at once if resident, else unload/send/load.
    fn start(&mut self, id: WorkerId, task: TaskId, tier: Tier) {
        let Some(job) = self.job.as_mut() else { return };
        let Some(w) = self.workers.get_mut(&id) else {
            return;
        };
        let Some(sig) = job.chain.stage(task.stage) else {
            return;
        };
        if Self::live_index(job, w) == Some(task.stage) {
            w.running = Some(task);
            w.running_since = self.now;
            job.set(task, TaskState::Running(id));
            self.actions.push_back(Action::Assign { task, worker: id, tier });
            return;
        }
        if w.live.take().is_some() {
            self.actions.push_back(Action::Unload { worker: id });
        }
        let cold = !w.cached.contains(&sig.sha256);
        if cold {
            w.cached.insert(sig.sha256.clone());
            self.actions.push_back(Action::SendStage { worker: id, stage: task.stage });
        }
        w.loading = Some(Loading { stage: task.stage, task: Some((task, tier)), since: self.now, cold });
        job.set(task, TaskState::Loading(id));
        self.actions.push_back(Action::Load { worker: id, stage: task.stage });
    }

    /// Runs after every event: pinned tasks first, then two-phase dispatch, then stall detection.
    fn dispatch(&mut self) {
        let Some(job) = self.job.as_ref() else { return };
        if job.finished {
            return;
        }
        // Pinned (re-planned) tasks go to their planned worker as soon as it is free.
        let pinned: Vec<(WorkerId, TaskId)> = self
            .workers
            .iter_mut()
            .filter(|(_, w)| w.is_free())
            .filter_map(|(&id, w)| w.pinned.pop_front().map(|t| (id, t)))
            .collect();
        let pinned: Vec<(WorkerId, TaskId, Tier)> =
            pinned.into_iter().map(|(id, t)| (id, t, self.workers_tier(job, id, t.stage))).collect();
        for (id, t, tier) in pinned {
            self.start(id, t, tier);
        }

        self.move_on();
        self.make_plan();
        let Some(job) = self.job.as_ref() else { return };
        if !job.ready.is_empty() {
            let alive: Vec<(&WorkerId, &WorkerState)> = self.workers.iter().collect();
            let telemetry: Vec<Telemetry> = alive.iter().map(|(_, w)| w.telemetry).collect();
            let (scores, _) = affinity::rank_telemetry(&telemetry);
            let mut holders = vec![0usize; job.stages()];
            let mut rate = vec![0.0f64; job.stages()];
            let mut wait = vec![f64::INFINITY; job.stages()];
            let mut next_rate = vec![0.0f64; job.stages()];
            let mut next_load = vec![0.0f64; job.stages()];
            let mut measured = vec![true; job.stages()];
            let mut task_sum = vec![0.0f64; job.stages()];
            let mut fastest = vec![f64::INFINITY; job.stages()];
            let mut busy: Vec<Vec<(f64, f64)>> = vec![Vec::new(); job.stages()];
            let mut bound_elsewhere = vec![false; job.stages()];
            for &(&id, w) in &alive {
                if let Some(k) = Self::live_index(job, w).filter(|&k| k < job.stages()) {
                    holders[k] += 1;
                    bound_elsewhere[k] |= job
                        .plan
                        .get(&id)
                        .is_some_and(|&h| h != k && job.unclaimed.get(h).is_some_and(|&u| u > 0));
                    // A task running longer than predicted bounds the worker's task time from below
                    // (the first completions come from the fastest workers, so unseen workers are
                    // otherwise guessed too fast).
                    let running = match w.running {
                        Some(t) if t.stage == k => self.now.0.saturating_sub(w.running_since.0) as f64,
                        _ => 0.0,
                    };
                    let tau = job.costs.task(id, k).max(running);
                    rate[k] += 1.0 / tau;
                    task_sum[k] += tau;
                    fastest[k] = fastest[k].min(tau);
                    let left = match w.loading {
                        Some(l) => {
                            let spent = self.now.0.saturating_sub(l.since.0) as f64;
                            (job.costs.load_on(id, k, !l.cold) - spent).max(0.0)
                        }
                        None => 0.0,
                    };
                    if !w.is_free() {
                        let until_free = match w.loading {
                            Some(l) if l.task.is_some() => left + tau,
                            Some(_) => left,
                            None => (tau - running).max(0.0),
                        };
                        busy[k].push((until_free, tau));
                    }
                    measured[k] &= job.costs.measured(id, k);
                    if let Some(next) = job.chain.stage(k + 1) {
                        next_rate[k] += 1.0 / job.costs.task(id, k + 1);
                        next_load[k] += job.costs.load_on(id, k + 1, w.cached.contains(&next.sha256));
                    }
                    wait[k] = wait[k].min(left);
                }
            }
            for x in &mut wait {
                if !x.is_finite() {
                    *x = 0.0;
                }
            }
            for (l, &h) in next_load.iter_mut().zip(&holders) {
                *l /= h.max(1) as f64;
            }
            let flow = self.config.cost_aware.then_some(StageFlow {
                rate,
                wait,
                next_rate,
                next_load,
                measured,
                task_sum,
                fastest,
                busy,
                bound_elsewhere,
            });
            let views: Vec<WorkerView> = alive
                .iter()
                .zip(&scores)
                .filter(|((_, w), _)| w.is_free() && w.pinned.is_empty())
                .map(|(&(&id, w), &score)| WorkerView {
                    id,
                    live: Self::live_index(job, w),
                    cached: Self::cached_flags(job, w),
                    fits: Self::fit_flags(job, w),
                    score,
                    costs: self.config.cost_aware.then(|| Self::worker_costs(job, id, w)),
                    home: job.plan.get(&id).copied(),
                })
                .collect();
            if !views.is_empty() {
                let ready = job
                    .ready
                    .iter()
                    .map(|&task| ReadyTask {
                        task,
                        input_on: task
                            .stage
                            .checked_sub(1)
                            .and_then(|k| job.index(TaskId::new(task.input, k)))
                            .and_then(|i| job.done_by[i]),
                    })
                    .collect();
                let input = DispatchInput {
                    workers: views,
                    ready,
                    backlog: job.unclaimed.clone(),
                    in_flight: job.in_flight.clone(),
                    holders,
                    flow,
                };
                for c in affinity::two_phase_dispatch(&input) {
                    self.start(c.worker, c.task, c.tier);
                }
            }
        }

        // Stall detection: ready work that no alive worker can ever hold.
        let Some(job) = self.job.as_mut() else { return };
        let waiting_stages: BTreeSet<usize> = job.ready.iter().map(|t| t.stage).collect();
        let mut stalled_now = BTreeSet::new();
        for s in waiting_stages {
            let fits_any = self.workers.values().any(|w| job.rss[s] <= w.telemetry.ram_budget_bytes);
            if !fits_any {
                stalled_now.insert(s);
                if !job.stalled.contains(&s) {
                    self.actions.push_back(Action::Stalled { stage: s });
                }
            }
        }
        job.stalled = stalled_now;
    }

    /// The stage plan ([`ForemanConfig::stage_plan`]): made once every alive worker's speed is
    /// known (again after a join or a loss) and, with just-in-time loads, every worker holds a
    /// stage (live or loading), from the unclaimed tasks and predicted costs then;
    /// with [`ForemanConfig::eager_loads`], free workers then load their home stage at once.
    fn make_plan(&mut self) {
        let config = self.config;
        let Some(job) = self.job.as_mut() else { return };
        if !(config.stage_plan && config.cost_aware)
            || job.mode != Mode::Streaming
            || job.finished
            || !job.plan.is_empty()
            || self.workers.is_empty()
        {
            return;
        }
        // the start plan needs each worker's speed from a task or a load of an earlier job
        let fresh = job.unclaimed.iter().all(|&u| u == job.inputs)
            && self.workers.iter().all(|(&id, w)| w.is_free() && w.pinned.is_empty() && job.costs.seen(id));
        if config.start_plan && fresh && self.start_plan() {
            return;
        }
        let Some(job) = self.job.as_mut() else { return };
        if !self.workers.keys().all(|&id| job.costs.knows(id))
            || job.unclaimed.iter().sum::<usize>() < PLAN_MIN_TASKS * job.stages() * self.workers.len()
            // With no more workers than stages each stage gets one worker at most: a stage of
            // little work then idles a worker the others need.
            || self.workers.len() <= job.stages()
            // Just in time, a worker holding nothing takes the first tasks there are (stage 0)
            // rather than wait idle for its home stage's first input: plan once all hold one.
            || (!config.eager_loads && self.workers.values().any(|w| Self::live_index(job, w).is_none()))
        {
            return;
        }
        let ids: Vec<WorkerId> = self.workers.keys().copied().collect();
        let views = Self::plan_views(job, &self.workers);
        let Some(plan) = plan::plan_stages(&views, &job.unclaimed, !config.eager_loads) else { return };
        job.plan = ids.into_iter().zip(plan).collect();
        if config.eager_loads {
            self.load_homes();
        }
    }

    /// Each worker as the planners see it: predicted task and load times (no load for its live
    /// stage), what fits, its live stage.
    fn plan_views(job: &JobState, workers: &BTreeMap<WorkerId, WorkerState>) -> Vec<PlanWorker> {
        workers
            .iter()
            .map(|(&id, w)| {
                let live = Self::live_index(job, w);
                let costs = Self::worker_costs(job, id, w);
                PlanWorker {
                    task_us: costs.task_us,
                    load_us: costs
                        .load_us
                        .iter()
                        .enumerate()
                        .map(|(k, &l)| if live == Some(k) { 0.0 } else { l })
                        .collect(),
                    fits: Self::fit_flags(job, w),
                    live: live.filter(|&k| k < job.stages()),
                }
            })
            .collect()
    }

    /// The start plan ([`ForemanConfig::start_plan`]): homes by replay, loaded at once; false
    /// when there is none (the search is too large, or no plan covers the stages).
    fn start_plan(&mut self) -> bool {
        let Some(job) = self.job.as_mut() else { return false };
        let mut views = Self::plan_views(job, &self.workers);
        for (v, &id) in views.iter_mut().zip(self.workers.keys()) {
            v.task_us = (0..job.stages()).map(|k| job.costs.task_guess(id, k)).collect();
        }
        let Some(plan) = start::start_plan(&views, job.inputs) else { return false };
        // a worker that runs nothing in the replay is left out: it loads nothing
        let ids: Vec<(WorkerId, usize, usize)> = self
            .workers
            .keys()
            .zip(plan.homes.iter().zip(&plan.then).zip(&plan.runs))
            .filter(|(_, (_, runs))| **runs > 0)
            .map(|(&id, ((&h, &t), _))| (id, h, t))
            .collect();
        job.plan = ids.iter().map(|&(id, h, _)| (id, h)).collect();
        job.then = ids.iter().filter(|&&(_, h, t)| h != t).map(|&(id, _, t)| (id, t)).collect();
        self.load_homes();
        true
    }

    /// Under a start plan, each free worker whose home is all claimed takes the stage it moves on
    /// to as its home and loads it ([`Self::load_homes`]), before the dispatch could give it
    /// other work.
    fn move_on(&mut self) {
        let Some(job) = self.job.as_mut() else { return };
        let due: Vec<(WorkerId, usize)> = job
            .then
            .iter()
            .filter(|&(id, _)| {
                job.plan.get(id).is_some_and(|&h| job.unclaimed.get(h).is_some_and(|&u| u == 0))
                    && self.workers.get(id).is_some_and(|w| w.is_free() && w.pinned.is_empty())
            })
            .map(|(&id, &t)| (id, t))
            .collect();
        if due.is_empty() {
            return;
        }
        for (id, t) in due {
            job.then.remove(&id);
            job.plan.insert(id, t);
        }
        self.load_homes();
    }

    /// Each free worker whose home stage is not live (and has work) loads it now.
    fn load_homes(&mut self) {
        let Some(job) = self.job.as_mut() else { return };
        let eager: Vec<(WorkerId, usize)> = job
            .plan
            .iter()
            .filter(|&(id, &k)| {
                job.unclaimed[k] > 0
                    && self.workers.get(id).is_some_and(|w| {
                        w.is_free() && w.pinned.is_empty() && Self::live_index(job, w) != Some(k)
                    })
            })
            .map(|(&id, &k)| (id, k))
            .collect();
        for (id, k) in eager {
            let Some(w) = self.workers.get_mut(&id) else { continue };
            let Some(sig) = job.chain.stage(k) else { continue };
            if w.live.take().is_some() {
                self.actions.push_back(Action::Unload { worker: id });
            }
            let cold = !w.cached.contains(&sig.sha256);
            if cold {
                w.cached.insert(sig.sha256.clone());
                self.actions.push_back(Action::SendStage { worker: id, stage: k });
            }
            w.loading = Some(Loading { stage: k, task: None, since: self.now, cold });
            self.actions.push_back(Action::Load { worker: id, stage: k });
        }
    }

    fn workers_tier(&self, job: &JobState, id: WorkerId, stage: usize) -> Tier {
        match self.workers.get(&id) {
            Some(w) => affinity::classify(
                Self::live_index(job, w),
                job.chain.stage(stage).is_some_and(|s| w.cached.contains(&s.sha256)),
                stage,
            ),
            None => Tier::Swap,
        }
    }
}
