//! The CoE request scheduler: which executor runs each expert task, in what order, in which
//! batches, and which experts to load and evict for it.
//!
//! A request is a tree walk: its preliminary (root) expert runs first; when a batch finishes, the
//! shell reports which subsequent experts each request's output selected, and those tasks are
//! queued then. Two scheduling policies share the code:
//!
//! - **Dependency-aware** (ours, after CoServe): each task goes to the executor queue whose
//!   estimated finish time after adding it is smallest under the [`LatencyModel`] (queued batches,
//!   loads of non-resident experts, the running operation), which balances CPU and GPU queues.
//!   Within a window, a task joins the queued group for its expert, so requests needing the same
//!   expert are adjacent and the expert is loaded once for the group; groups run in order, split
//!   into batches of at most the executor's max batch.
//! - **FCFS** (the Samba-CoE baseline): one shared queue in request-arrival order; the first free
//!   executor takes the head task, batched only with the tasks right behind it that need the same
//!   expert.
//!
//! Each executor does one thing at a time: load an expert, or run a batch of one expert. Eviction
//! is delegated to an [`ExpertManager`] per executor (two-stage or LRU).
//!
//! # Calling protocol
//!
//! 1. Feed events as they happen, with a non-decreasing `now`:
//!    [`handle_arrival`](RequestScheduler::handle_arrival) for a new request,
//!    [`handle_load_done`](RequestScheduler::handle_load_done) when a [`Action::Load`] finished,
//!    [`handle_batch_done`](RequestScheduler::handle_batch_done) when a [`Action::RunBatch`]
//!    finished, and then, for every request of that batch whose expert has subsequent experts,
//!    [`handle_preliminary_done`](RequestScheduler::handle_preliminary_done) with the experts
//!    its output selected (possibly none).
//! 2. After each `handle_*` call, drain [`poll_action`](RequestScheduler::poll_action) until
//!    `None` and perform the actions in order: evictions always come before the load that needs
//!    their room.
//! 3. [`poll_timeout`](RequestScheduler::poll_timeout) is always `None` today: the scheduler only
//!    reacts to events. It is kept for the uniform policy shape.
//! 4. When an executor is lost (crash, node gone), call
//!    [`handle_executor_lost`](RequestScheduler::handle_executor_lost): its queued, loading and
//!    running work is queued again on the survivors (a batch that was running runs again, so the
//!    shell must drop any late result from the lost executor; the scheduler refuses its events).
//!    [`handle_executor_restored`](RequestScheduler::handle_executor_restored) brings it back
//!    empty.

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::fmt;

use super::latency::LatencyModel;
use super::memory::{EvictionContext, EvictionPolicy, ExpertManager, MemoryError};
use super::model::{CoeModel, ExpertId, Request, RequestId, Tier};
use super::tiers::{HostCandidate, HostTier};
use crate::Micros;

/// Most executors a scheduler drives.
pub const MAX_EXECUTORS: usize = 64;
/// How many shared-queue tasks FCFS looks at to tell eviction what is queued.
const FCFS_LOOKAHEAD: usize = 4096;

/// Identifies an executor: its index in the profile.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ExecutorId(pub u16);

impl ExecutorId {
    /// Index into the profile's executors.
    pub fn index(self) -> usize {
        usize::from(self.0)
    }
}

impl fmt::Display for ExecutorId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "x{}", self.0)
    }
}

/// Identifies one batch run (unique per scheduler).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct BatchId(pub u64);

impl fmt::Display for BatchId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "b{}", self.0)
    }
}

/// Which queue a task was put in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum QueueRef {
    /// An executor's own queue (dependency-aware scheduling).
    Executor(ExecutorId),
    /// The shared FCFS queue.
    Shared,
}

/// A decision for the shell to carry out.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Action {
    /// A task (request, expert) was queued (informational; the shell may mirror its queues).
    Enqueue {
        /// The request.
        request: RequestId,
        /// The expert it needs next.
        expert: ExpertId,
        /// Where it was queued.
        queue: QueueRef,
    },
    /// Drop an expert from an executor's memory (done at once; no completion event).
    Evict {
        /// The executor.
        executor: ExecutorId,
        /// The expert.
        expert: ExpertId,
    },
    /// Load an expert onto an executor; report [`RequestScheduler::handle_load_done`] when done.
    Load {
        /// The executor.
        executor: ExecutorId,
        /// The expert.
        expert: ExpertId,
        /// The tier to read it from.
        from: Tier,
    },
    /// Run one batch; report [`RequestScheduler::handle_batch_done`] when done.
    RunBatch {
        /// The executor.
        executor: ExecutorId,
        /// The batch's id.
        batch: BatchId,
        /// The expert to run.
        expert: ExpertId,
        /// The requests in the batch (each at most once).
        requests: Vec<RequestId>,
    },
    /// Every expert the request needed has run: answer it.
    Complete {
        /// The request.
        request: RequestId,
    },
}

impl fmt::Display for Action {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Action::Enqueue { request, expert, queue } => match queue {
                QueueRef::Executor(e) => write!(f, "enqueue {request} {expert} -> {e}"),
                QueueRef::Shared => write!(f, "enqueue {request} {expert} -> shared"),
            },
            Action::Evict { executor, expert } => write!(f, "evict {executor} {expert}"),
            Action::Load { executor, expert, from } => {
                write!(f, "load {executor} {expert} from {from}")
            }
            Action::RunBatch { executor, batch, expert, requests } => {
                write!(f, "run {executor} {batch} {expert} [")?;
                for (i, r) in requests.iter().enumerate() {
                    if i > 0 {
                        f.write_str(" ")?;
                    }
                    write!(f, "{r}")?;
                }
                f.write_str("]")
            }
            Action::Complete { request } => write!(f, "complete {request}"),
        }
    }
}

/// Which request-scheduling policy to run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Scheduling {
    /// Ours: least-finish-time executor assignment, grouping within a window, max-batch split.
    DependencyAware,
    /// Baseline: one shared queue in arrival order, first free executor.
    Fcfs,
}

/// A policy combination and its knobs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SchedulerConfig {
    /// Request scheduling policy.
    pub scheduling: Scheduling,
    /// Expert eviction policy.
    pub eviction: EvictionPolicy,
    /// Reordering window: a task joins the queued group for its expert only if that group was
    /// opened within the last `window_tasks` tasks queued on that executor (so no task is
    /// overtaken by more than this many later ones per group ahead of it).
    pub window_tasks: u64,
}

impl SchedulerConfig {
    /// Default reordering window, in tasks.
    pub const DEFAULT_WINDOW: u64 = 16_384;

    /// Ours: dependency-aware scheduling and two-stage eviction with queue lookahead.
    pub fn ours() -> Self {
        SchedulerConfig {
            scheduling: Scheduling::DependencyAware,
            eviction: EvictionPolicy::TwoStageLookahead,
            window_tasks: Self::DEFAULT_WINDOW,
        }
    }

    /// The paper's combination: dependency-aware scheduling and the plain two stages (no queue
    /// lookahead in eviction).
    pub fn paper_two_stage() -> Self {
        SchedulerConfig { eviction: EvictionPolicy::TwoStage, ..Self::ours() }
    }

    /// The Samba-CoE baseline: FCFS and LRU.
    pub fn fcfs_lru() -> Self {
        SchedulerConfig { scheduling: Scheduling::Fcfs, eviction: EvictionPolicy::Lru, ..Self::ours() }
    }

    /// Ablation: our scheduling with LRU eviction.
    pub fn scheduling_only() -> Self {
        SchedulerConfig { eviction: EvictionPolicy::Lru, ..Self::ours() }
    }

    /// Ablation: FCFS scheduling with our eviction (two stages with lookahead in the FCFS queue).
    pub fn eviction_only() -> Self {
        SchedulerConfig { scheduling: Scheduling::Fcfs, ..Self::ours() }
    }

    /// The four combinations the ablation compares, baseline first, ours last.
    pub fn combinations() -> [SchedulerConfig; 4] {
        [Self::fcfs_lru(), Self::scheduling_only(), Self::eviction_only(), Self::ours()]
    }

    /// Every scheduling and eviction pair (each has its own [`label`](Self::label)).
    pub fn all() -> [SchedulerConfig; 6] {
        let fcfs = |eviction| SchedulerConfig { eviction, ..Self::fcfs_lru() };
        [
            Self::fcfs_lru(),
            Self::scheduling_only(),
            Self::eviction_only(),
            Self::ours(),
            Self::paper_two_stage(),
            fcfs(EvictionPolicy::TwoStage),
        ]
    }

    /// This combination with another eviction policy (its label changes with it).
    pub fn with_eviction(self, eviction: EvictionPolicy) -> Self {
        SchedulerConfig { eviction, ..self }
    }

    /// Short label: `ours`, `fcfs+lru`, `sched-only`, `evict-only`, `paper-two-stage` (our
    /// scheduling, the paper's plain two stages) or `fcfs+two-stage`.
    pub fn label(&self) -> &'static str {
        match (self.scheduling, self.eviction) {
            (Scheduling::DependencyAware, EvictionPolicy::TwoStageLookahead) => "ours",
            (Scheduling::DependencyAware, EvictionPolicy::TwoStage) => "paper-two-stage",
            (Scheduling::Fcfs, EvictionPolicy::Lru) => "fcfs+lru",
            (Scheduling::DependencyAware, EvictionPolicy::Lru) => "sched-only",
            (Scheduling::Fcfs, EvictionPolicy::TwoStageLookahead) => "evict-only",
            (Scheduling::Fcfs, EvictionPolicy::TwoStage) => "fcfs+two-stage",
        }
    }
}

/// Why an input was refused (a caller bug or a bad event; the scheduler state is unchanged).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum SchedulerError {
    /// The latency model has no executors, or more than [`MAX_EXECUTORS`].
    #[error("need 1..={MAX_EXECUTORS} executors, the latency model has {0}")]
    BadExecutorCount(usize),
    /// An expert is bigger than every executor's expert memory.
    #[error("{expert} ({size} bytes) fits in no executor's expert memory")]
    FitsNowhere {
        /// The expert.
        expert: ExpertId,
        /// Its size.
        size: u64,
    },
    /// No such executor.
    #[error("executor {0} does not exist")]
    UnknownExecutor(ExecutorId),
    /// No such expert in the model.
    #[error("{0} does not exist in the model")]
    UnknownExpert(ExpertId),
    /// A request must enter at a preliminary expert.
    #[error("{0} is not a preliminary (entry) expert")]
    NotARoot(ExpertId),
    /// The request id is already in flight.
    #[error("{0} is already in flight")]
    DuplicateRequest(RequestId),
    /// The request is not in flight.
    #[error("{0} is not in flight")]
    UnknownRequest(RequestId),
    /// No selection was expected from this expert for this request.
    #[error("{request} is not waiting for a selection from {expert}")]
    UnexpectedSelection {
        /// The request.
        request: RequestId,
        /// The expert named.
        expert: ExpertId,
    },
    /// A selected expert does not depend on the preliminary that selected it.
    #[error("{child} is not a subsequent expert of {parent}")]
    NotAChild {
        /// The preliminary.
        parent: ExpertId,
        /// The expert selected.
        child: ExpertId,
    },
    /// The same expert was selected twice in one event.
    #[error("{expert} selected twice for {request}")]
    DuplicateSelection {
        /// The request.
        request: RequestId,
        /// The expert.
        expert: ExpertId,
    },
    /// The executor is not loading that expert.
    #[error("executor {executor} is not loading {expert}")]
    NotLoading {
        /// The executor.
        executor: ExecutorId,
        /// The expert named.
        expert: ExpertId,
    },
    /// The executor is not running that batch.
    #[error("executor {executor} is not running batch {batch}")]
    NotRunning {
        /// The executor.
        executor: ExecutorId,
        /// The batch named.
        batch: BatchId,
    },
    /// An executor's report of its host tier cannot be true.
    #[error("executor {executor} reports a host tier that cannot be: {problem}")]
    BadHostReport {
        /// The executor.
        executor: ExecutorId,
        /// What is wrong with it.
        problem: String,
    },
    /// Residency bookkeeping refused an operation (an internal invariant broke).
    #[error("expert memory: {0}")]
    Memory(#[from] MemoryError),
}

/// A queued run of tasks that all need one expert.
#[derive(Clone, Debug)]
struct Group {
    id: u64,
    expert: ExpertId,
    tasks: VecDeque<RequestId>,
    /// The executor's enqueue counter when the group was opened (for the window).
    opened_at: u64,
}

/// One executor's queue of groups, with running totals for its backlog estimate.
#[derive(Clone, Debug, Default)]
struct ExecQueue {
    /// Groups in opening order (ascending ids), served from the front.
    groups: VecDeque<Group>,
    /// Youngest group per expert (the only one a new task may join).
    youngest: BTreeMap<ExpertId, u64>,
    /// Groups per expert.
    groups_of: BTreeMap<ExpertId, u32>,
    /// Tasks ever queued here.
    enqueued: u64,
    next_group: u64,
    /// Sum over groups of the time to run their tasks.
    batch_cost: u64,
    /// Sum over groups of the time to load their expert.
    load_cost: u64,
}

impl ExecQueue {
    fn group_mut(&mut self, id: u64) -> Option<&mut Group> {
        let index = self.groups.binary_search_by_key(&id, |g| g.id).ok()?;
        self.groups.get_mut(index)
    }

    fn tasks(&self) -> usize {
        self.groups.iter().map(|g| g.tasks.len()).sum()
    }

    /// Take up to `max` tasks from group `id` if it is `expert`'s, keeping the running totals
    /// right (`cost(n)`: time to run n tasks; `load`: time to load the expert).
    fn take_batch(
        &mut self,
        id: u64,
        expert: ExpertId,
        max: usize,
        cost: impl Fn(usize) -> u64,
        load: u64,
    ) -> Vec<RequestId> {
        let Ok(index) = self.groups.binary_search_by_key(&id, |g| g.id) else {
            return Vec::new();
        };
        let Some(group) = self.groups.get_mut(index).filter(|g| g.expert == expert) else {
            return Vec::new();
        };
        let before = group.tasks.len();
        let take = before.min(max);
        let requests: Vec<RequestId> = group.tasks.drain(..take).collect();
        let after = group.tasks.len();
        self.batch_cost = self.batch_cost.saturating_sub(cost(before).saturating_sub(cost(after)));
        if after == 0 {
            self.groups.remove(index);
            self.load_cost = self.load_cost.saturating_sub(load);
            if self.youngest.get(&expert) == Some(&id) {
                self.youngest.remove(&expert);
            }
            if let Some(count) = self.groups_of.get_mut(&expert) {
                *count -= 1;
                if *count == 0 {
                    self.groups_of.remove(&expert);
                }
            }
        }
        requests
    }
}

/// Where a batch's requests come from.
#[derive(Clone, Debug)]
enum Source {
    /// Taken from the shared queue at dispatch (FCFS).
    Reserved(Vec<RequestId>),
    /// The head of this group of the executor's queue, taken when the batch starts (ours).
    Group(u64),
}

#[derive(Clone, Debug)]
enum ExecState {
    Idle,
    Loading { expert: ExpertId, until: Micros, source: Source },
    Running { batch: BatchId, expert: ExpertId, requests: Vec<RequestId>, until: Micros },
}

#[derive(Clone, Debug)]
struct Executor {
    state: ExecState,
    queue: ExecQueue,
    memory: ExpertManager,
    /// Its host tier as the executor keeps it (loads are planned from it).
    host: HostTier,
    /// False after the executor was reported lost (until restored).
    alive: bool,
}

#[derive(Clone, Debug)]
struct RequestState {
    arrival_seq: u64,
    /// Tasks queued or running.
    open_tasks: u32,
    /// Experts that ran and whose selection has not been reported yet.
    awaiting: BTreeSet<ExpertId>,
}

/// The CoE request scheduler and expert manager (see the module docs for the calling protocol).
#[derive(Clone, Debug)]
pub struct RequestScheduler {
    model: CoeModel,
    latency: LatencyModel,
    config: SchedulerConfig,
    executors: Vec<Executor>,
    /// FCFS queue: (request arrival order, task order) -> task.
    shared: BTreeMap<(u64, u64), (RequestId, ExpertId)>,
    requests: BTreeMap<RequestId, RequestState>,
    actions: VecDeque<Action>,
    arrivals: u64,
    tasks_created: u64,
    next_batch: u64,
    /// Tasks no live executor can hold (every one that could is lost), in order: placed again
    /// when an executor is restored.
    parked: VecDeque<(RequestId, ExpertId)>,
}

impl RequestScheduler {
    /// A scheduler for `model` on the executors of `latency`, running `config`. Refuses a model
    /// with an expert that fits in no executor's expert memory.
    pub fn new(
        model: CoeModel,
        latency: LatencyModel,
        config: SchedulerConfig,
    ) -> Result<Self, SchedulerError> {
        let n = latency.executors();
        if n == 0 || n > MAX_EXECUTORS {
            return Err(SchedulerError::BadExecutorCount(n));
        }
        for expert in model.experts() {
            if (0..n).all(|e| latency.expert_budget(e) < expert.size_bytes) {
                return Err(SchedulerError::FitsNowhere { expert: expert.id, size: expert.size_bytes });
            }
        }
        let host_budget = HostTier::default_budget(&model);
        let executors = (0..n)
            .map(|e| Executor {
                state: ExecState::Idle,
                queue: ExecQueue::default(),
                memory: ExpertManager::new(latency.expert_budget(e), config.eviction),
                host: HostTier::new(&model, host_budget),
                alive: true,
            })
            .collect();
        Ok(RequestScheduler {
            model,
            latency,
            config,
            executors,
            shared: BTreeMap::new(),
            requests: BTreeMap::new(),
            actions: VecDeque::new(),
            arrivals: 0,
            tasks_created: 0,
            next_batch: 0,
            parked: VecDeque::new(),
        })
    }

    /// The policy combination this scheduler runs.
    pub fn config(&self) -> SchedulerConfig {
        self.config
    }

    /// The application model.
    pub fn model(&self) -> &CoeModel {
        &self.model
    }

    /// The latency model.
    pub fn latency(&self) -> &LatencyModel {
        &self.latency
    }

    /// Expert residency of executor `e`, if it exists.
    pub fn memory(&self, e: ExecutorId) -> Option<&ExpertManager> {
        self.executors.get(e.index()).map(|x| &x.memory)
    }

    /// Tasks waiting (not yet running) in all queues.
    pub fn queued_tasks(&self) -> usize {
        self.shared.len() + self.executors.iter().map(|e| e.queue.tasks()).sum::<usize>()
    }

    /// Requests accepted and not yet completed.
    pub fn in_flight(&self) -> usize {
        self.requests.len()
    }

    /// Next decision, if any; drain after every `handle_*` call and perform in order.
    #[must_use]
    pub fn poll_action(&mut self) -> Option<Action> {
        self.actions.pop_front()
    }

    /// When the scheduler wants to be woken without an event: never (it is purely reactive).
    pub fn poll_timeout(&self) -> Option<Micros> {
        None
    }

    /// Every executor's host tier gets `bytes` (the executors must be opened with the same
    /// budget; without this call it is [`HostTier::default_budget`], the executors' default).
    /// Call before the first event.
    pub fn with_host_budget(mut self, bytes: u64) -> Self {
        for exec in &mut self.executors {
            exec.host = HostTier::new(&self.model, bytes);
        }
        self
    }

    /// The experts executor `e`'s host tier holds now, as the scheduler tracks it.
    pub fn host_resident(&self, e: ExecutorId) -> Vec<ExpertId> {
        self.executors.get(e.index()).map_or_else(Vec::new, |x| x.host.resident())
    }

    /// A new request entering at its preliminary expert.
    pub fn handle_arrival(&mut self, now: Micros, request: Request) -> Result<(), SchedulerError> {
        let root = self.model.expert(request.root).ok_or(SchedulerError::UnknownExpert(request.root))?;
        if root.preliminary().is_some() {
            return Err(SchedulerError::NotARoot(request.root));
        }
        if self.requests.contains_key(&request.id) {
            return Err(SchedulerError::DuplicateRequest(request.id));
        }
        self.requests.insert(
            request.id,
            RequestState { arrival_seq: self.arrivals, open_tasks: 0, awaiting: BTreeSet::new() },
        );
        self.arrivals += 1;
        self.create_task(now, request.id, request.root);
        self.dispatch_idle(now)
    }

    /// A [`Action::Load`] finished: the expert is usable on the executor.
    pub fn handle_load_done(
        &mut self,
        now: Micros,
        executor: ExecutorId,
        expert: ExpertId,
    ) -> Result<(), SchedulerError> {
        let exec =
            self.executors.get_mut(executor.index()).ok_or(SchedulerError::UnknownExecutor(executor))?;
        let source = match &mut exec.state {
            ExecState::Loading { expert: loading, source, .. } if *loading == expert => {
                std::mem::replace(source, Source::Reserved(Vec::new()))
            }
            _ => return Err(SchedulerError::NotLoading { executor, expert }),
        };
        // The expert was pinned when its load started; the pin carries over to the batch.
        self.start_batch(now, executor.index(), expert, source, false)
    }

    /// A [`Action::RunBatch`] finished. Report selections next, for each of its requests whose
    /// expert has subsequent experts.
    pub fn handle_batch_done(
        &mut self,
        now: Micros,
        executor: ExecutorId,
        batch: BatchId,
    ) -> Result<(), SchedulerError> {
        let exec =
            self.executors.get_mut(executor.index()).ok_or(SchedulerError::UnknownExecutor(executor))?;
        let (expert, requests) = match &exec.state {
            ExecState::Running { batch: running, expert, requests, .. } if *running == batch => {
                (*expert, requests.clone())
            }
            _ => return Err(SchedulerError::NotRunning { executor, batch }),
        };
        exec.memory.unpin(expert)?;
        exec.memory.touch(expert);
        exec.state = ExecState::Idle;
        let has_children = self.model.expert(expert).is_some_and(|e| e.has_children());
        for r in requests {
            if let Some(state) = self.requests.get_mut(&r) {
                state.open_tasks = state.open_tasks.saturating_sub(1);
                if has_children {
                    state.awaiting.insert(expert);
                }
            }
            self.complete_if_done(r);
        }
        self.dispatch_idle(now)
    }

    /// The preliminary `expert` ran for `request` and its output selected `selected` (each a
    /// subsequent expert of it; empty when none applies). Their tasks are queued now.
    pub fn handle_preliminary_done(
        &mut self,
        now: Micros,
        request: RequestId,
        expert: ExpertId,
        selected: &[ExpertId],
    ) -> Result<(), SchedulerError> {
        let state = self.requests.get(&request).ok_or(SchedulerError::UnknownRequest(request))?;
        if !state.awaiting.contains(&expert) {
            return Err(SchedulerError::UnexpectedSelection { request, expert });
        }
        let mut seen = BTreeSet::new();
        for &child in selected {
            if !self.model.is_child_of(child, expert) {
                return Err(SchedulerError::NotAChild { parent: expert, child });
            }
            if !seen.insert(child) {
                return Err(SchedulerError::DuplicateSelection { request, expert: child });
            }
        }
        if let Some(state) = self.requests.get_mut(&request) {
            state.awaiting.remove(&expert);
        }
        for &child in selected {
            self.create_task(now, request, child);
        }
        self.complete_if_done(request);
        self.dispatch_idle(now)
    }

    /// Executor `executor` is gone: its queued, loading and running tasks are queued again on
    /// the live executors, and its later events are refused. A task no live executor can hold
    /// (the last one that could is lost: every executor's node down or cut off) is parked until
    /// one is restored ([`Self::handle_executor_restored`]), not refused: a scheduler must ride
    /// out a whole-cluster outage of its executors.
    pub fn handle_executor_lost(&mut self, now: Micros, executor: ExecutorId) -> Result<(), SchedulerError> {
        let e = executor.index();
        let exec = self.executors.get(e).ok_or(SchedulerError::UnknownExecutor(executor))?;
        if !exec.alive {
            return Ok(());
        }
        let budget = self.latency.expert_budget(e);
        let exec = &mut self.executors[e];
        let mut orphans: Vec<(RequestId, ExpertId)> = Vec::new();
        match std::mem::replace(&mut exec.state, ExecState::Idle) {
            ExecState::Running { expert, requests, .. } => {
                orphans.extend(requests.into_iter().map(|r| (r, expert)))
            }
            ExecState::Loading { expert, source: Source::Reserved(requests), .. } => {
                orphans.extend(requests.into_iter().map(|r| (r, expert)))
            }
            ExecState::Loading { .. } | ExecState::Idle => {}
        }
        for group in std::mem::take(&mut exec.queue).groups {
            orphans.extend(group.tasks.into_iter().map(|r| (r, group.expert)));
        }
        exec.memory = ExpertManager::new(budget, self.config.eviction);
        // A lost executor's host memory is gone; it comes back filled as at start.
        exec.host = HostTier::new(&self.model, exec.host.budget());
        exec.alive = false;
        for (request, expert) in orphans {
            self.place_task(now, request, expert);
        }
        self.dispatch_idle(now)
    }

    /// A lost executor is back, empty; it takes work again, the parked tasks first (in order).
    pub fn handle_executor_restored(
        &mut self,
        now: Micros,
        executor: ExecutorId,
    ) -> Result<(), SchedulerError> {
        let exec =
            self.executors.get_mut(executor.index()).ok_or(SchedulerError::UnknownExecutor(executor))?;
        exec.host = HostTier::new(&self.model, exec.host.budget());
        exec.alive = true;
        for (request, expert) in std::mem::take(&mut self.parked) {
            self.place_task(now, request, expert);
        }
        self.dispatch_idle(now)
    }

    /// Executor `executor` reports its host tier: its `budget` and what it holds (after a
    /// reset: a restarted scheduler, or an executor back under a new link, finds the host tier
    /// as the executor's history left it). Refused, changing nothing, when it names an unknown
    /// expert, one twice, or more bytes than the budget.
    pub fn handle_host_report(
        &mut self,
        executor: ExecutorId,
        budget: u64,
        host: &[ExpertId],
    ) -> Result<(), SchedulerError> {
        let tier = HostTier::from_resident(&self.model, budget, host)
            .map_err(|problem| SchedulerError::BadHostReport { executor, problem })?;
        let exec =
            self.executors.get_mut(executor.index()).ok_or(SchedulerError::UnknownExecutor(executor))?;
        exec.host = tier;
        Ok(())
    }

    fn complete_if_done(&mut self, request: RequestId) {
        let done = self.requests.get(&request).is_some_and(|s| s.open_tasks == 0 && s.awaiting.is_empty());
        if done {
            self.requests.remove(&request);
            self.actions.push_back(Action::Complete { request });
        }
    }

    fn create_task(&mut self, now: Micros, request: RequestId, expert: ExpertId) {
        let Some(state) = self.requests.get_mut(&request) else {
            return;
        };
        state.open_tasks += 1;
        self.place_task(now, request, expert);
    }

    /// Put an open task into a queue (first time, or again after its executor was lost).
    fn place_task(&mut self, now: Micros, request: RequestId, expert: ExpertId) {
        let Some(arrival_seq) = self.requests.get(&request).map(|s| s.arrival_seq) else {
            return;
        };
        self.tasks_created += 1;
        let queue = match self.config.scheduling {
            Scheduling::Fcfs => {
                self.shared.insert((arrival_seq, self.tasks_created), (request, expert));
                QueueRef::Shared
            }
            Scheduling::DependencyAware => {
                let Some(e) = self.choose_executor(now, expert) else {
                    self.parked.push_back((request, expert));
                    return;
                };
                self.enqueue_on(e, request, expert);
                QueueRef::Executor(ExecutorId(e as u16))
            }
        };
        self.actions.push_back(Action::Enqueue { request, expert, queue });
    }

    fn size(&self, expert: ExpertId) -> u64 {
        self.model.size_of(expert)
    }

    /// Where a load of `expert` on executor `e` comes from now: its host tier or disk.
    fn source(&self, e: usize, expert: ExpertId) -> Tier {
        self.executors.get(e).map_or(Tier::Ssd, |x| x.host.source_of(expert))
    }

    fn load_time(&self, e: usize, expert: ExpertId) -> Micros {
        self.latency.load_time(e, self.size(expert), self.source(e, expert))
    }

    /// `expert` as the host tier ranks it.
    fn candidate(&self, expert: ExpertId) -> HostCandidate {
        let usage_prob = self.model.expert(expert).map_or(0.0, |x| x.usage_prob);
        HostCandidate { id: expert, size_bytes: self.size(expert), usage_prob }
    }

    /// The group a new task for `expert` may join on executor `e`, with its current size.
    fn joinable(&self, e: usize, expert: ExpertId) -> Option<(u64, usize)> {
        let queue = &self.executors[e].queue;
        let id = *queue.youngest.get(&expert)?;
        let front = queue.groups.front()?.id;
        let group = queue.groups.get(usize::try_from(id.checked_sub(front)?).ok()?)?;
        (queue.enqueued - group.opened_at <= self.config.window_tasks).then_some((id, group.tasks.len()))
    }

    /// Estimated time until executor `e` has worked off everything it holds now.
    fn backlog(&self, now: Micros, e: usize) -> u64 {
        let exec = &self.executors[e];
        let current = match &exec.state {
            ExecState::Idle => Micros::ZERO,
            ExecState::Loading { until, .. } | ExecState::Running { until, .. } => *until - now,
        };
        // Groups whose expert is resident need no load (one group's worth is discounted).
        let discount: u64 = exec
            .memory
            .resident()
            .filter(|x| exec.queue.groups_of.contains_key(x))
            .map(|x| self.load_time(e, x).0)
            .sum();
        current.0 + exec.queue.batch_cost + exec.queue.load_cost.saturating_sub(discount)
    }

    /// Extra time executor `e` needs if a task for `expert` is added to it.
    fn added_cost(&self, e: usize, expert: ExpertId) -> u64 {
        let size = self.size(expert);
        match self.joinable(e, expert) {
            Some((_, len)) => {
                let before = self.latency.group_latency(e, size, len);
                (self.latency.group_latency(e, size, len + 1) - before).0
            }
            None => {
                let load = if self.executors[e].memory.is_resident(expert) {
                    Micros::ZERO
                } else {
                    self.load_time(e, expert)
                };
                (self.latency.batch_latency(e, size, 1) + load).0
            }
        }
    }

    /// The executor with the earliest estimated finish after taking a task for `expert`.
    fn choose_executor(&self, now: Micros, expert: ExpertId) -> Option<usize> {
        let size = self.size(expert);
        let mut best: Option<(u64, usize)> = None;
        for e in 0..self.executors.len() {
            if !self.executors[e].alive || self.latency.expert_budget(e) < size {
                continue;
            }
            let finish = self.backlog(now, e).saturating_add(self.added_cost(e, expert));
            if best.is_none_or(|(b, _)| finish < b) {
                best = Some((finish, e));
            }
        }
        // `new` keeps every expert fitting some executor; none live that fits: the task parks
        best.map(|(_, e)| e)
    }

    fn enqueue_on(&mut self, e: usize, request: RequestId, expert: ExpertId) {
        let size = self.size(expert);
        let load = self.load_time(e, expert).0;
        let joinable = self.joinable(e, expert);
        let one = self.latency.batch_latency(e, size, 1).0;
        let delta = joinable.map(|(_, len)| {
            (self.latency.group_latency(e, size, len + 1) - self.latency.group_latency(e, size, len)).0
        });
        let queue = &mut self.executors[e].queue;
        match (joinable, delta) {
            (Some((id, _)), Some(delta)) => {
                if let Some(group) = queue.group_mut(id) {
                    group.tasks.push_back(request);
                }
                queue.batch_cost += delta;
            }
            _ => {
                let id = queue.next_group;
                queue.next_group += 1;
                queue.groups.push_back(Group {
                    id,
                    expert,
                    tasks: VecDeque::from([request]),
                    opened_at: queue.enqueued,
                });
                queue.youngest.insert(expert, id);
                *queue.groups_of.entry(expert).or_insert(0) += 1;
                queue.batch_cost += one;
                queue.load_cost += load;
            }
        }
        queue.enqueued += 1;
    }

    fn dispatch_idle(&mut self, now: Micros) -> Result<(), SchedulerError> {
        for e in 0..self.executors.len() {
            let exec = &self.executors[e];
            if exec.alive && matches!(exec.state, ExecState::Idle) {
                match self.config.scheduling {
                    Scheduling::DependencyAware => self.dispatch_own_queue(now, e)?,
                    Scheduling::Fcfs => self.dispatch_shared(now, e)?,
                }
            }
        }
        Ok(())
    }

    /// Ours: serve the head group of executor `e`'s queue.
    fn dispatch_own_queue(&mut self, now: Micros, e: usize) -> Result<(), SchedulerError> {
        let exec = &self.executors[e];
        let Some(head) = exec.queue.groups.front() else {
            return Ok(());
        };
        if exec.memory.is_resident(head.expert) {
            let (id, expert) = (head.id, head.expert);
            return self.start_batch(now, e, expert, Source::Group(id), true);
        }
        let (id, expert) = (head.id, head.expert);
        self.start_load(now, e, expert, Source::Group(id))
    }

    /// FCFS: take the first shared task executor `e` can hold, with the same-expert tasks right
    /// behind it.
    fn dispatch_shared(&mut self, now: Micros, e: usize) -> Result<(), SchedulerError> {
        let budget = self.latency.expert_budget(e);
        let Some((&first_key, &(_, expert))) = self.shared.iter().find(|(_, (_, x))| self.size(*x) <= budget)
        else {
            return Ok(());
        };
        let max = self.latency.max_batch(e);
        let keys: Vec<(u64, u64)> = self
            .shared
            .range(first_key..)
            .take_while(|(_, (_, x))| *x == expert)
            .take(max)
            .map(|(k, _)| *k)
            .collect();
        let resident = self.executors[e].memory.is_resident(expert);
        if !resident && !self.can_load(e, expert) {
            return Ok(());
        }
        let batch: Vec<RequestId> =
            keys.iter().filter_map(|k| self.shared.remove(k)).map(|(r, _)| r).collect();
        if resident {
            self.start_batch(now, e, expert, Source::Reserved(batch), true)
        } else {
            self.start_load(now, e, expert, Source::Reserved(batch))
        }
    }

    /// Where each expert is next needed by queued work on executor `e` (for eviction).
    fn next_uses(&self, e: usize) -> BTreeMap<ExpertId, u64> {
        let mut next = BTreeMap::new();
        if !self.config.eviction.uses_queue_hints() {
            return next;
        }
        match self.config.scheduling {
            Scheduling::DependencyAware => {
                for (pos, g) in self.executors[e].queue.groups.iter().enumerate() {
                    next.entry(g.expert).or_insert(pos as u64);
                }
            }
            Scheduling::Fcfs => {
                for (pos, (_, x)) in self.shared.values().take(FCFS_LOOKAHEAD).enumerate() {
                    next.entry(*x).or_insert(pos as u64);
                }
            }
        }
        next
    }

    fn plan_room(&self, e: usize, expert: ExpertId) -> Result<Vec<ExpertId>, MemoryError> {
        let memory = &self.executors[e].memory;
        if memory.free_bytes() >= self.size(expert) && !memory.is_resident(expert) {
            return Ok(Vec::new()); // fits already: no need to rank victims
        }
        let next = self.next_uses(e);
        let executors = &self.executors;
        let is_resident = |x: ExpertId| executors.iter().any(|ex| ex.memory.is_resident(x));
        let next_use = |x: ExpertId| next.get(&x).copied();
        let resident_elsewhere =
            |x: ExpertId| executors.iter().enumerate().any(|(i, ex)| i != e && ex.memory.is_resident(x));
        let ctx = EvictionContext {
            model: &self.model,
            is_resident: &is_resident,
            resident_elsewhere: &resident_elsewhere,
            next_use: &next_use,
        };
        self.executors[e].memory.plan_eviction(expert, self.size(expert), &ctx)
    }

    fn can_load(&self, e: usize, expert: ExpertId) -> bool {
        self.plan_room(e, expert).is_ok()
    }

    /// Evict what is needed, admit and pin `expert`, and start loading it on `e`. Leaves the
    /// executor idle (to retry on the next event) when pinned experts hold the room.
    fn start_load(
        &mut self,
        now: Micros,
        e: usize,
        expert: ExpertId,
        source: Source,
    ) -> Result<(), SchedulerError> {
        let victims = match self.plan_room(e, expert) {
            Ok(v) => v,
            Err(MemoryError::NoRoom { .. }) => return Ok(()),
            Err(other) => return Err(other.into()),
        };
        let executor = ExecutorId(e as u16);
        let size = self.size(expert);
        // The victims leave first, as the executor carries it out: a demotion may push a colder
        // expert out of the host tier, even the one about to load, so its source is known only
        // after them.
        for victim in victims {
            let leaving = self.candidate(victim);
            let exec = &mut self.executors[e];
            exec.memory.evict(victim)?;
            exec.host.demote(&leaving);
            self.actions.push_back(Action::Evict { executor, expert: victim });
        }
        let from = self.source(e, expert);
        let until = now + self.load_time(e, expert);
        let exec = &mut self.executors[e];
        exec.host.promote(expert);
        exec.memory.admit(expert, size)?;
        exec.memory.pin(expert)?;
        exec.state = ExecState::Loading { expert, until, source };
        self.actions.push_back(Action::Load { executor, expert, from });
        Ok(())
    }

    /// Run a batch of `expert` on `e` from `source`. Pins the expert unless the load already did.
    fn start_batch(
        &mut self,
        now: Micros,
        e: usize,
        expert: ExpertId,
        source: Source,
        pin: bool,
    ) -> Result<(), SchedulerError> {
        let max = self.latency.max_batch(e);
        let size = self.size(expert);
        let load = self.load_time(e, expert).0;
        let requests = match source {
            Source::Reserved(requests) => requests,
            Source::Group(id) => {
                let latency = &self.latency;
                let cost = |n: usize| latency.group_latency(e, size, n).0;
                self.executors[e].queue.take_batch(id, expert, max, cost, load)
            }
        };
        let exec = &mut self.executors[e];
        if requests.is_empty() {
            // Nothing left to run (cannot happen while queues are consistent): release the
            // load's pin and go idle rather than run an empty batch.
            if !pin {
                exec.memory.unpin(expert)?;
            }
            exec.state = ExecState::Idle;
            return Ok(());
        }
        if pin {
            exec.memory.pin(expert)?;
        }
        exec.memory.touch(expert);
        let batch = BatchId(self.next_batch);
        self.next_batch += 1;
        let until = now + self.latency.batch_latency(e, size, requests.len());
        exec.state = ExecState::Running { batch, expert, requests: requests.clone(), until };
        self.actions.push_back(Action::RunBatch { executor: ExecutorId(e as u16), batch, expert, requests });
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::coe::model::ExpertSpec;
    use crate::coe::synth::synthetic_edge_profile;

    /// e0 root -> e1, e2; e3 root. 1 MB each.
    fn scheduler(config: SchedulerConfig) -> RequestScheduler {
        let spec = |p: f64, parent: Option<u32>| ExpertSpec {
            size_bytes: 1 << 20,
            select_prob: p,
            home: Tier::Ssd,
            parent: parent.map(ExpertId),
        };
        let model =
            CoeModel::new(vec![spec(0.5, None), spec(0.5, Some(0)), spec(0.5, Some(0)), spec(0.5, None)])
                .unwrap();
        let latency = LatencyModel::from_profile(&synthetic_edge_profile("t", 4 << 20, 2 << 20)).unwrap();
        RequestScheduler::new(model, latency, config).unwrap()
    }

    fn drain(s: &mut RequestScheduler) -> Vec<Action> {
        std::iter::from_fn(|| s.poll_action()).collect()
    }

    #[test]
    fn refuses_bad_inputs_without_changing_state() {
        let mut s = scheduler(SchedulerConfig::ours());
        let t = Micros::ZERO;
        let r0 = Request { id: RequestId(0), root: ExpertId(0) };
        assert_eq!(
            s.handle_arrival(t, Request { id: RequestId(1), root: ExpertId(1) }),
            Err(SchedulerError::NotARoot(ExpertId(1)))
        );
        assert_eq!(
            s.handle_arrival(t, Request { id: RequestId(1), root: ExpertId(9) }),
            Err(SchedulerError::UnknownExpert(ExpertId(9)))
        );
        s.handle_arrival(t, r0).unwrap();
        assert_eq!(s.handle_arrival(t, r0), Err(SchedulerError::DuplicateRequest(RequestId(0))));
        let actions = drain(&mut s);
        assert_eq!(actions.len(), 2, "{actions:?}"); // enqueue + load
        let x0 = ExecutorId(0);
        assert_eq!(
            s.handle_load_done(t, x0, ExpertId(3)),
            Err(SchedulerError::NotLoading { executor: x0, expert: ExpertId(3) })
        );
        assert_eq!(
            s.handle_preliminary_done(t, RequestId(0), ExpertId(0), &[ExpertId(1)]),
            Err(SchedulerError::UnexpectedSelection { request: RequestId(0), expert: ExpertId(0) })
        );
        s.handle_load_done(t, x0, ExpertId(0)).unwrap();
        let Some(Action::RunBatch { batch, .. }) = s.poll_action() else { panic!("no run") };
        assert_eq!(
            s.handle_batch_done(t, x0, BatchId(batch.0 + 1)),
            Err(SchedulerError::NotRunning { executor: x0, batch: BatchId(batch.0 + 1) })
        );
        assert_eq!(
            s.handle_batch_done(t, ExecutorId(7), batch),
            Err(SchedulerError::UnknownExecutor(ExecutorId(7)))
        );
        s.handle_batch_done(t, x0, batch).unwrap();
        assert_eq!(s.poll_action(), None); // r0 now waits for e0's selection
        assert_eq!(
            s.handle_preliminary_done(t, RequestId(0), ExpertId(0), &[ExpertId(3)]),
            Err(SchedulerError::NotAChild { parent: ExpertId(0), child: ExpertId(3) })
        );
        assert_eq!(
            s.handle_preliminary_done(t, RequestId(0), ExpertId(0), &[ExpertId(1), ExpertId(1)]),
            Err(SchedulerError::DuplicateSelection { request: RequestId(0), expert: ExpertId(1) })
        );
        // An empty selection ends the request.
        s.handle_preliminary_done(t, RequestId(0), ExpertId(0), &[]).unwrap();
        assert_eq!(drain(&mut s), vec![Action::Complete { request: RequestId(0) }]);
        assert_eq!(s.in_flight(), 0);
        assert_eq!(s.poll_timeout(), None);
    }

    #[test]
    fn lost_executor_work_moves_to_the_survivors() {
        let mut s = scheduler(SchedulerConfig::ours());
        let t = Micros::ZERO;
        let (x0, x1) = (ExecutorId(0), ExecutorId(1));
        s.handle_arrival(t, Request { id: RequestId(0), root: ExpertId(0) }).unwrap();
        assert!(drain(&mut s).contains(&Action::Load { executor: x0, expert: ExpertId(0), from: Tier::Ssd }));
        s.handle_executor_lost(t, x0).unwrap();
        assert_eq!(
            drain(&mut s),
            vec![
                Action::Enqueue { request: RequestId(0), expert: ExpertId(0), queue: QueueRef::Executor(x1) },
                Action::Load { executor: x1, expert: ExpertId(0), from: Tier::Ssd },
            ]
        );
        // A late completion from the lost executor is refused; new work avoids it.
        assert!(s.handle_load_done(t, x0, ExpertId(0)).is_err());
        s.handle_arrival(t, Request { id: RequestId(1), root: ExpertId(3) }).unwrap();
        assert!(
            drain(&mut s)
                .iter()
                .all(|a| !matches!(a, Action::Enqueue { queue: QueueRef::Executor(e), .. } if *e == x0))
        );
        s.handle_load_done(t, x1, ExpertId(0)).unwrap();
        assert!(matches!(s.poll_action(), Some(Action::RunBatch { executor, .. }) if executor == x1));
        // Restored, x0 takes work again (it is idle and r1's e3 waits behind e0 on x1).
        s.handle_executor_restored(t, x0).unwrap();
        s.handle_arrival(t, Request { id: RequestId(2), root: ExpertId(3) }).unwrap();
        let actions = drain(&mut s);
        assert!(
            actions.contains(&Action::Enqueue {
                request: RequestId(2),
                expert: ExpertId(3),
                queue: QueueRef::Executor(x0)
            }),
            "{actions:?}"
        );
    }

    /// Found by the fault explorer (coe seed 1): the scheduler node cut off from both executors
    /// lost them one after the other, the policy refused to lose the last, and the scheduler
    /// failed. Losing every executor parks the work; a restored one takes it, in order, and the
    /// request completes.
    #[test]
    fn losing_every_executor_parks_the_work_until_one_is_restored() {
        let mut s = scheduler(SchedulerConfig::ours());
        let t = Micros::ZERO;
        let (x0, x1) = (ExecutorId(0), ExecutorId(1));
        s.handle_arrival(t, Request { id: RequestId(0), root: ExpertId(0) }).unwrap();
        drain(&mut s);
        s.handle_executor_lost(t, x0).unwrap();
        drain(&mut s);
        s.handle_executor_lost(t, x1).unwrap();
        assert!(drain(&mut s).is_empty(), "no live executor: nothing to do");
        s.handle_arrival(t, Request { id: RequestId(1), root: ExpertId(0) }).unwrap();
        assert!(drain(&mut s).is_empty(), "an arrival parks too");
        s.handle_executor_restored(t, x1).unwrap();
        let actions = drain(&mut s);
        assert!(
            actions.contains(&Action::Load { executor: x1, expert: ExpertId(0), from: Tier::Ssd }),
            "{actions:?}"
        );
        s.handle_load_done(t, x1, ExpertId(0)).unwrap();
        let Some(Action::RunBatch { executor, batch, requests, .. }) = s.poll_action() else {
            panic!("the parked tasks run once x1 is back")
        };
        assert_eq!((executor, requests), (x1, vec![RequestId(0), RequestId(1)]));
        s.handle_batch_done(t, x1, batch).unwrap();
        for r in [RequestId(0), RequestId(1)] {
            s.handle_preliminary_done(t, r, ExpertId(0), &[]).unwrap();
        }
        let done = drain(&mut s);
        assert!(done.contains(&Action::Complete { request: RequestId(0) }), "{done:?}");
        assert!(done.contains(&Action::Complete { request: RequestId(1) }), "{done:?}");
    }

    /// Drive `s` through `roots` (one request each, arriving one at a time, every batch and
    /// load finishing at once, no subsequent experts selected) and return each load's source.
    fn loads_of(s: &mut RequestScheduler, roots: &[u32]) -> Vec<(ExpertId, Tier)> {
        let mut loads = Vec::new();
        let t = Micros::ZERO;
        for (i, &root) in roots.iter().enumerate() {
            s.handle_arrival(t, Request { id: RequestId(i as u64), root: ExpertId(root) }).unwrap();
            while let Some(action) = s.poll_action() {
                match action {
                    Action::Load { executor, expert, from } => {
                        loads.push((expert, from));
                        s.handle_load_done(t, executor, expert).unwrap();
                    }
                    Action::RunBatch { executor, batch, .. } => {
                        s.handle_batch_done(t, executor, batch).unwrap()
                    }
                    _ => {}
                }
            }
        }
        loads
    }

    /// An expert evicted from the device is demoted to the host tier when it has room, so its
    /// next load is planned from the host (at host bandwidth), not from its home on disk; with
    /// no host tier every load reads the disk.
    #[test]
    fn a_demoted_expert_is_loaded_from_the_host_tier() {
        let spec = |p: f64| ExpertSpec { size_bytes: 1 << 20, select_prob: p, home: Tier::Ssd, parent: None };
        let model = CoeModel::new((0..6).map(|i| spec(0.1 + f64::from(i) / 10.0)).collect()).unwrap();
        // One expert at a time per executor, so every other root evicts one.
        let latency = LatencyModel::from_profile(&synthetic_edge_profile("t", 1 << 20, 1 << 20)).unwrap();
        let roots: Vec<u32> = (0..24).map(|i| i % 6).collect();
        let mut none = RequestScheduler::new(model.clone(), latency.clone(), SchedulerConfig::ours())
            .unwrap()
            .with_host_budget(0);
        assert!(loads_of(&mut none, &roots).iter().all(|(_, from)| *from == Tier::Ssd));
        let mut s =
            RequestScheduler::new(model, latency, SchedulerConfig::ours()).unwrap().with_host_budget(8 << 20);
        let loads = loads_of(&mut s, &roots);
        let mut seen = BTreeSet::new();
        for (expert, from) in &loads {
            // Room for all six in the host tier: only an expert's first load reads the disk.
            let first = seen.insert(*expert);
            assert_eq!(*from, if first { Tier::Ssd } else { Tier::Host }, "{expert} in {loads:?}");
        }
        assert!(loads.len() > seen.len(), "some expert was loaded twice: {loads:?}");
        let held: usize = (0..2).map(|e| s.host_resident(ExecutorId(e)).len()).sum();
        assert!(held > 0, "evicted experts wait in the host tiers");
        // An executor's report replaces the tracked tier, unless it cannot be true.
        let x0 = ExecutorId(0);
        let before = s.host_resident(x0);
        for (budget, bad) in [
            (8 << 20, vec![ExpertId(9)]),
            (8 << 20, vec![ExpertId(1), ExpertId(1)]),
            (1 << 20, vec![ExpertId(1), ExpertId(2)]),
        ] {
            let err = s.handle_host_report(x0, budget, &bad).unwrap_err();
            assert!(matches!(err, SchedulerError::BadHostReport { .. }), "{err}");
            assert_eq!(s.host_resident(x0), before);
        }
        s.handle_host_report(x0, 1 << 20, &[ExpertId(5)]).unwrap();
        assert_eq!(s.host_resident(x0), vec![ExpertId(5)]);
    }

    #[test]
    fn refuses_an_expert_that_fits_nowhere() {
        let model = CoeModel::new(vec![ExpertSpec {
            size_bytes: 8 << 20,
            select_prob: 1.0,
            home: Tier::Ssd,
            parent: None,
        }])
        .unwrap();
        let latency = LatencyModel::from_profile(&synthetic_edge_profile("t", 4 << 20, 2 << 20)).unwrap();
        assert!(matches!(
            RequestScheduler::new(model, latency, SchedulerConfig::ours()),
            Err(SchedulerError::FitsNowhere { .. })
        ));
    }

    #[test]
    fn subsequent_work_is_queued_when_the_preliminary_finishes() {
        let mut s = scheduler(SchedulerConfig::fcfs_lru());
        let t = Micros::ZERO;
        s.handle_arrival(t, Request { id: RequestId(0), root: ExpertId(0) }).unwrap();
        let _ = drain(&mut s);
        s.handle_load_done(t, ExecutorId(0), ExpertId(0)).unwrap();
        let Some(Action::RunBatch { batch, .. }) = s.poll_action() else { panic!("no run") };
        s.handle_batch_done(t, ExecutorId(0), batch).unwrap();
        assert_eq!(s.queued_tasks(), 0);
        s.handle_preliminary_done(t, RequestId(0), ExpertId(0), &[ExpertId(1), ExpertId(2)]).unwrap();
        let actions = drain(&mut s);
        let enqueued: Vec<ExpertId> = actions
            .iter()
            .filter_map(|a| match a {
                Action::Enqueue { expert, queue: QueueRef::Shared, .. } => Some(*expert),
                _ => None,
            })
            .collect();
        assert_eq!(enqueued, vec![ExpertId(1), ExpertId(2)]);
        assert_eq!(s.in_flight(), 1);
    }
}
