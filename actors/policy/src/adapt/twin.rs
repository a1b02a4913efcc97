//! Twin-buffer scheduler (paper §3.4.1) driven by online AGE prediction (§3.4.2).
//!
//! * Buffer α holds tasks whose accuracy is below `α` or whose predicted accuracy gain per epoch
//!   (AGE) is below `Δ`; it is served shortest-job-first by predicted epochs to the task's next
//!   milestone (`α`, or the target once above `α`), with a maximum slice `τ`: a task that has
//!   not reached `α` after `τ` of GPU time goes behind the others (time-slice rotation).
//! * Buffer β holds the rest and is served by fastest AGE (unmeasured tasks first, to measure them).
//! * Cycles interleave the buffers (β first: the high-priority pipeline), taking tasks while
//!   their resident state fits the memory budget.
//! * Before the current cycle is expected to end (`preload_lead` early), the tasks entering the
//!   next cycle are preloaded: their inactive experts loaded, experts nobody needs dropped.
//! * Fallback: when the smoothed relative AGE error exceeds `age_error_threshold`, β is served
//!   round-robin and α by remaining accuracy gap (approximate SJF), until the error recovers.
//! * SLO deadlines (an extension; the paper's scheduler has none): when tasks carry a deadline
//!   and a cycle has been timed, the tasks that can still meet theirs go first, in Moore–Hodgson
//!   order ([`super::slo`]), then the twin-buffer order above for the rest; a cycle holds only as
//!   many of them as stay on time sharing it ([`super::slo::cycle_size`]). A task's remaining
//!   work is its AGE-predicted epochs to target (the mean of finished tasks' epochs before its
//!   curve is fitted) times the measured processor time of one task-epoch.
//!
//! The calling protocol is the one in [`super::sched`].

use std::collections::{BTreeMap, BTreeSet, VecDeque};

use super::age::AgeModel;
use super::sched::{AdaptScheduler, CycleLimits, SchedAction, TaskSpec, TaskTable};
use super::slo::{SloTask, cycle_size, moore_hodgson};
use super::{ExpertId, TaskId};
use crate::Micros;

/// Knobs of the twin-buffer scheduler.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct TwinConfig {
    /// Memory budget per cycle and epoch cap per task.
    pub limits: CycleLimits,
    /// `α`: accuracy below which a task belongs to buffer α.
    pub alpha: f64,
    /// `Δ`: predicted AGE below which a task belongs to buffer α.
    pub delta: f64,
    /// `τ`: most GPU time an α task keeps its turn without reaching `α`.
    pub tau: Micros,
    /// Smoothed relative AGE error above which the scheduler falls back.
    pub age_error_threshold: f64,
    /// Weight of the newest error in the smoothed error (0..1).
    pub error_smoothing: f64,
    /// How long before the expected end of a cycle the next one is preloaded.
    pub preload_lead: Micros,
    /// Most tasks per cycle: the pipelines time-share the GPU rather than co-running every
    /// task at once (processor sharing would finish every task late together under overload).
    pub seats: usize,
    /// Whether the device runs a cycle's tasks side by side (a GPU's streams). On one that does
    /// not (the CPU, whose clock charges co-running tasks their sum), a cycle holds one task while
    /// tasks carry deadlines: sharing the processor finishes no member sooner and makes the head
    /// of the SLO order finish later, so every deadline is as easy or easier met serially.
    pub side_by_side: bool,
}

impl Default for TwinConfig {
    fn default() -> Self {
        TwinConfig {
            limits: CycleLimits::default(),
            alpha: 0.45,
            delta: 0.005,
            tau: Micros::from_secs(60),
            age_error_threshold: 0.5,
            error_smoothing: 0.3,
            preload_lead: Micros::from_secs(2),
            seats: 4,
            side_by_side: true,
        }
    }
}

/// Tasks whose epochs to target the prior remembers.
pub const EPOCHS_REMEMBERED: usize = 256;

/// Epochs a task that has trained `done` epochs without reaching its target still needs, before
/// its own AGE curve is fitted: the median, over the remembered tasks that took more than `done`
/// epochs, of what they took beyond `done`; 1 when none did. A median, not a mean: epochs to a
/// gain are skewed (most tasks reach it in one or two, a few take the whole budget), and a mean
/// rounded up would predict every fresh task twice its likely work, so the SLO order would give
/// up on tasks that were on time.
pub fn prior_remaining(reached_epochs: &VecDeque<u32>, done: u32) -> u32 {
    let mut beyond: Vec<u32> = reached_epochs.iter().filter(|&&e| e > done).map(|&e| e - done).collect();
    if beyond.is_empty() {
        return 1;
    }
    beyond.sort_unstable();
    beyond[(beyond.len() - 1) / 2]
}

/// Which buffer a task is in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Buffer {
    /// Low accuracy or low predicted gain: SJF with max slice τ.
    Alpha,
    /// The rest: fastest AGE first.
    Beta,
}

#[derive(Debug, Clone, Default)]
struct TwinTask {
    age: AgeModel,
    slice_start: Option<Micros>,
    rotations: u32,
}

/// The twin-buffer scheduler (see the module doc).
#[derive(Debug, Clone)]
pub struct TwinBufferScheduler {
    cfg: TwinConfig,
    table: TaskTable,
    extra: BTreeMap<TaskId, TwinTask>,
    err_ewma: Option<f64>,
    cycle_ewma: Option<Micros>,
    /// Processor time of one task-epoch (a cycle's duration over its members), smoothed.
    epoch_ewma: Option<Micros>,
    /// Epochs each of the latest tasks that reached their target took (at most
    /// [`EPOCHS_REMEMBERED`]), the prior for tasks without a fitted AGE curve.
    reached_epochs: VecDeque<u32>,
    /// The latest time a `handle_*` call brought.
    now: Micros,
    preload_at: Option<Micros>,
    current: Vec<TaskId>,
    preloaded: BTreeSet<TaskId>,
    resident: BTreeSet<ExpertId>,
}

impl TwinBufferScheduler {
    /// A scheduler with no tasks.
    pub fn new(cfg: TwinConfig) -> Self {
        TwinBufferScheduler {
            table: TaskTable::new(cfg.limits),
            cfg,
            extra: BTreeMap::new(),
            err_ewma: None,
            cycle_ewma: None,
            epoch_ewma: None,
            reached_epochs: VecDeque::new(),
            now: Micros(0),
            preload_at: None,
            current: Vec::new(),
            preloaded: BTreeSet::new(),
            resident: BTreeSet::new(),
        }
    }

    /// The processor time one task-epoch takes (a cycle's duration, from when it started
    /// running, over its members; smoothed), once a cycle has been timed.
    pub fn task_epoch_time(&self) -> Option<Micros> {
        self.epoch_ewma
    }

    /// Whether the AGE-error fallback (round-robin / approximate SJF) is active.
    pub fn in_fallback(&self) -> bool {
        self.err_ewma.is_some_and(|e| e > self.cfg.age_error_threshold)
    }

    /// The smoothed relative AGE error.
    pub fn age_error(&self) -> Option<f64> {
        self.err_ewma
    }

    /// Buffer of a live task.
    pub fn buffer_of(&self, task: TaskId) -> Option<Buffer> {
        let t = self.table.tasks.get(&task)?;
        let low_gain =
            self.extra.get(&task).and_then(|x| x.age.predicted_age()).is_some_and(|g| g < self.cfg.delta);
        Some(if t.accuracy < self.cfg.alpha || low_gain { Buffer::Alpha } else { Buffer::Beta })
    }

    /// Predicted AGE of a live task.
    pub fn predicted_age(&self, task: TaskId) -> Option<f64> {
        self.extra.get(&task)?.age.predicted_age()
    }

    /// The service order for the next cycle: with SLO deadlines, the tasks that can meet theirs
    /// first (see the module doc); then β and α interleaved, β first.
    pub fn service_order(&self) -> Vec<TaskId> {
        let twin = self.twin_order();
        match self.slo_tasks(&twin) {
            Some(slo) => {
                let (on_time, late) = moore_hodgson(self.now, &slo);
                on_time.into_iter().chain(late).collect()
            }
            None => twin,
        }
    }

    /// `order` as the SLO order sees it; `None` when no task has a deadline or no cycle has been
    /// timed yet (then the twin-buffer order stands alone).
    fn slo_tasks(&self, order: &[TaskId]) -> Option<Vec<SloTask>> {
        let epoch = self.epoch_ewma?;
        if !self.table.tasks.values().any(|t| t.spec.deadline.is_some()) {
            return None;
        }
        let slo = order
            .iter()
            .filter_map(|id| {
                let t = self.table.tasks.get(id)?;
                let epochs = u64::from(self.remaining_epochs(*id));
                Some(SloTask {
                    id: *id,
                    deadline: t.spec.deadline,
                    work: Micros(epoch.0.saturating_mul(epochs)),
                })
            })
            .collect();
        Some(slo)
    }

    /// Predicted epochs a live task still needs to reach its target (at least 1, at most its
    /// epoch budget): its AGE curve's, else [`prior_remaining`] from the tasks that reached
    /// theirs.
    pub fn remaining_epochs(&self, id: TaskId) -> u32 {
        let Some(t) = self.table.tasks.get(&id) else { return 0 };
        let budget = self.cfg.limits.max_epochs.saturating_sub(t.epochs).max(1);
        let age = self.extra.get(&id).map(|x| &x.age);
        let predicted = match age {
            Some(a) if a.curve().is_some() => a.epochs_to(t.spec.target, budget).unwrap_or(budget),
            _ => prior_remaining(&self.reached_epochs, t.epochs),
        };
        predicted.clamp(1, budget)
    }

    /// The twin-buffer order alone: β and α interleaved, β first.
    fn twin_order(&self) -> Vec<TaskId> {
        let fallback = self.in_fallback();
        let (mut beta, mut alpha): (Vec<TaskId>, Vec<TaskId>) =
            self.table.tasks.keys().partition(|id| self.buffer_of(**id) == Some(Buffer::Beta));
        if fallback {
            beta.sort_by_key(|id| (self.table.tasks[id].last_cycle, *id));
        } else {
            beta.sort_by(|a, b| {
                // Unmeasured tasks first (to measure them), least recently served among ties.
                let ga = self.predicted_age(*a).unwrap_or(f64::INFINITY);
                let gb = self.predicted_age(*b).unwrap_or(f64::INFINITY);
                let (la, lb) = (self.table.tasks[a].last_cycle, self.table.tasks[b].last_cycle);
                gb.total_cmp(&ga).then(la.cmp(&lb)).then(a.cmp(b))
            });
        }
        alpha.sort_by_key(|id| {
            let rot = self.extra.get(id).map_or(0, |x| x.rotations);
            (rot, self.sjf_key(*id, fallback), *id)
        });
        let mut order = Vec::with_capacity(beta.len() + alpha.len());
        let (mut b, mut a) = (beta.into_iter(), alpha.into_iter());
        loop {
            let nb = b.next();
            let na = a.next();
            if nb.is_none() && na.is_none() {
                break;
            }
            order.extend(nb);
            order.extend(na);
        }
        order
    }

    /// SJF key: predicted epochs to the next milestone (scaled gap when unpredicted or in fallback).
    fn sjf_key(&self, id: TaskId, fallback: bool) -> u64 {
        let Some(t) = self.table.tasks.get(&id) else {
            return u64::MAX;
        };
        let milestone = self.milestone(t.accuracy, t.spec.target);
        let gap = (milestone - t.accuracy).max(0.0);
        let by_gap = (gap * 1000.0).ceil() as u64;
        if fallback {
            return by_gap;
        }
        match self.extra.get(&id).and_then(|x| x.age.epochs_to(milestone, self.cfg.limits.max_epochs)) {
            Some(e) => e as u64 * 1000,
            None if self.extra.get(&id).and_then(|x| x.age.curve()).is_some() => u64::MAX / 2,
            None => by_gap,
        }
    }

    /// Most tasks a cycle may hold: `seats`, or one while tasks carry deadlines on a device that
    /// does not run a cycle's tasks side by side ([`TwinConfig::side_by_side`]).
    fn seats(&self) -> usize {
        let under_deadlines = self.table.tasks.values().any(|t| t.spec.deadline.is_some());
        if under_deadlines && !self.cfg.side_by_side { 1 } else { self.cfg.seats.max(1) }
    }

    /// The tasks of the next cycle: the service order filled into memory, at most the seats
    /// ([`TwinConfig::seats`], one under deadlines without [`TwinConfig::side_by_side`]; with
    /// SLO deadlines, at most as many as stay on time sharing the cycle).
    pub fn next_set(&self) -> Vec<TaskId> {
        let mut set = self.table.fill(&self.service_order());
        let seats = match self.slo_tasks(&set) {
            Some(slo) => cycle_size(self.now, &slo, self.seats()),
            None => self.seats(),
        };
        set.truncate(seats);
        set
    }

    fn milestone(&self, accuracy: f64, target: f64) -> f64 {
        if accuracy < self.cfg.alpha { self.cfg.alpha.min(target) } else { target }
    }

    fn plan(&mut self, now: Micros) {
        if !self.table.cycle_idle() {
            return;
        }
        let chosen = self.next_set();
        for id in &chosen {
            if self.buffer_of(*id) == Some(Buffer::Alpha)
                && let Some(x) = self.extra.get_mut(id)
            {
                x.slice_start.get_or_insert(now);
            }
            if let Some(t) = self.table.tasks.get(id) {
                self.resident.extend(t.spec.experts.iter().copied());
            }
        }
        self.table.dispatch(now, &chosen);
        self.current = chosen;
        self.preloaded.clear();
        self.preload_at = match (self.current.is_empty(), self.cycle_ewma) {
            (false, Some(d)) => Some(now + d.saturating_sub(self.cfg.preload_lead)),
            _ => None,
        };
    }

    /// The tasks to preload while the current cycle computes: the service order without the
    /// current tasks, filled into memory, at most the seats (as in [`Self::next_set`]). Mid-cycle
    /// nothing the order depends on has changed yet (epochs are reported when the cycle ends), so
    /// [`Self::next_set`] would name the current tasks again; the twin buffer's other half is the
    /// tasks waiting behind them.
    pub fn preload_set(&self) -> Vec<TaskId> {
        let waiting: Vec<TaskId> =
            self.service_order().into_iter().filter(|id| !self.current.contains(id)).collect();
        let mut set = self.table.fill(&waiting);
        set.truncate(self.seats());
        set
    }

    fn preload_next(&mut self) {
        let next = self.preload_set();
        let needed: BTreeSet<ExpertId> = self
            .current
            .iter()
            .chain(&next)
            .filter_map(|id| self.table.tasks.get(id))
            .flat_map(|t| t.spec.experts.iter().copied())
            .collect();
        let mut unload: Vec<ExpertId> = self.resident.difference(&needed).copied().collect();
        for id in next {
            if self.current.contains(&id) || !self.preloaded.insert(id) {
                continue;
            }
            let Some(t) = self.table.tasks.get(&id) else {
                continue;
            };
            let load: Vec<ExpertId> =
                t.spec.experts.iter().filter(|e| !self.resident.contains(e)).copied().collect();
            for e in &unload {
                self.resident.remove(e);
            }
            self.resident.extend(load.iter().copied());
            self.table.actions.push_back(SchedAction::Preload {
                task: id,
                load,
                unload: std::mem::take(&mut unload),
            });
        }
    }
}

impl AdaptScheduler for TwinBufferScheduler {
    fn name(&self) -> &'static str {
        "twin-buffer"
    }

    /// With deadlines, an arrival waits while a task due no later than it is on time in the SLO
    /// order: admitting it first would spend the processor ahead of earlier deadlines (EDF).
    /// Before a cycle has been timed there is no estimate of anyone's work, and every task whose
    /// deadline has not passed counts as on time.
    fn defers_admission(&self, now: Micros, deadline: Option<Micros>) -> bool {
        let Some(due) = deadline else { return false };
        let now = now.max(self.now);
        let due_first = |id: &TaskId| {
            self.table.tasks.get(id).and_then(|t| t.spec.deadline).is_some_and(|d| d <= due && d > now)
        };
        match self.slo_tasks(&self.twin_order()) {
            Some(slo) => moore_hodgson(now, &slo).0.iter().any(due_first),
            None => self.table.tasks.keys().any(due_first),
        }
    }

    fn handle_arrival(&mut self, now: Micros, task: TaskSpec) {
        self.now = self.now.max(now);
        let (id, acc) = (task.id, task.accuracy);
        if self.table.admit(now, task) {
            let mut x = TwinTask::default();
            let _ = x.age.observe(0.0, acc);
            self.extra.insert(id, x);
            self.plan(now);
        }
    }

    fn handle_epoch_done(&mut self, now: Micros, task: TaskId, accuracy: f64) {
        self.now = self.now.max(now);
        let epochs_before = self.table.tasks.get(&task).map(|t| t.epochs);
        let live = self.table.record_epoch(task, accuracy).map(|t| (t.epochs, t.accuracy, t.spec.target));
        match live {
            Some((epochs, acc, target)) => {
                let alpha = self.cfg.alpha;
                let milestone = self.milestone(acc, target);
                if let Some(x) = self.extra.get_mut(&task) {
                    if let Some(err) = x.age.observe(epochs as f64, acc) {
                        let w = self.cfg.error_smoothing;
                        self.err_ewma = Some(match self.err_ewma {
                            Some(prev) => (1.0 - w) * prev + w * err,
                            None => err,
                        });
                    }
                    if let Some(start) = x.slice_start {
                        if acc >= alpha || acc >= milestone {
                            x.slice_start = None;
                        } else if now.saturating_sub(start) >= self.cfg.tau {
                            x.slice_start = None;
                            x.rotations += 1;
                        }
                    }
                }
            }
            // Completed (or never admitted): drop its AGE model. An epoch for a task that is not
            // in the current cycle is ignored and changes nothing.
            None if !self.table.tasks.contains_key(&task) => {
                self.extra.remove(&task);
                let reached = self
                    .table
                    .actions
                    .iter()
                    .rev()
                    .any(|a| matches!(a, SchedAction::Complete { task: t, reached: true } if *t == task));
                if let (Some(e), true) = (epochs_before, reached) {
                    if self.reached_epochs.len() == EPOCHS_REMEMBERED {
                        self.reached_epochs.pop_front();
                    }
                    self.reached_epochs.push_back(e.saturating_add(1));
                }
            }
            None => {}
        }
        if self.table.cycle_idle() {
            let dur = now.saturating_sub(self.table.cycle_started);
            self.cycle_ewma = Some(match self.cycle_ewma {
                Some(p) => Micros((p.0 + dur.0) / 2),
                None => dur,
            });
            let per_epoch = Micros(dur.0 / self.current.len().max(1) as u64);
            self.epoch_ewma = Some(match self.epoch_ewma {
                Some(p) => Micros((p.0 + per_epoch.0) / 2),
                None => per_epoch,
            });
            self.plan(now);
        }
    }

    fn handle_timeout(&mut self, now: Micros) {
        self.now = self.now.max(now);
        if self.preload_at.is_some_and(|t| t <= now) {
            self.preload_at = None;
            self.preload_next();
        }
    }

    fn handle_cycle_start(&mut self, now: Micros) {
        let dispatched = self.table.cycle_started;
        self.table.restart_cycle(now);
        // the preload moves with the cycle it leads (by nothing when no cycle was running)
        let moved = self.table.cycle_started.saturating_sub(dispatched);
        self.preload_at = self.preload_at.map(|t| t + moved);
    }

    fn poll_action(&mut self) -> Option<SchedAction> {
        self.table.actions.pop_front()
    }

    fn poll_timeout(&self) -> Option<Micros> {
        self.preload_at
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::adapt::ModelId;

    fn spec(id: u32, acc: f64, footprint: u64) -> TaskSpec {
        TaskSpec {
            id: TaskId(id),
            model: ModelId(id),
            experts: vec![ExpertId(10 * id), ExpertId(10 * id + 1)],
            accuracy: acc,
            target: acc + 0.2,
            footprint,
            deadline: None,
        }
    }

    fn cfg(budget: u64) -> TwinConfig {
        TwinConfig { limits: CycleLimits { memory_budget: budget, max_epochs: 50 }, ..TwinConfig::default() }
    }

    fn drain(s: &mut TwinBufferScheduler) -> Vec<SchedAction> {
        std::iter::from_fn(|| s.poll_action()).collect()
    }

    #[test]
    fn buffers_split_by_alpha_and_beta_is_served_by_age() {
        let mut s = TwinBufferScheduler::new(cfg(10));
        s.handle_arrival(Micros(0), spec(1, 0.30, 10));
        assert_eq!(drain(&mut s), vec![SchedAction::RunEpoch { task: TaskId(1) }]);
        s.handle_arrival(Micros(1), spec(2, 0.50, 10));
        s.handle_arrival(Micros(1), spec(3, 0.55, 10));
        assert!(drain(&mut s).is_empty(), "cycle still running");
        assert_eq!(s.buffer_of(TaskId(1)), Some(Buffer::Alpha));
        assert_eq!(s.buffer_of(TaskId(2)), Some(Buffer::Beta));
        // Unmeasured β tasks tie at +inf AGE: id order. β first, then α.
        assert_eq!(s.service_order(), vec![TaskId(2), TaskId(1), TaskId(3)]);
        s.handle_epoch_done(Micros::from_secs(5), TaskId(1), 0.33);
        assert_eq!(drain(&mut s), vec![SchedAction::RunEpoch { task: TaskId(2) }]);
    }

    #[test]
    fn fills_the_budget_and_completes_at_target() {
        let mut s = TwinBufferScheduler::new(cfg(25));
        s.handle_arrival(Micros(0), spec(1, 0.5, 10));
        let _ = drain(&mut s);
        s.handle_arrival(Micros(0), spec(2, 0.5, 10));
        s.handle_arrival(Micros(0), spec(3, 0.5, 10));
        s.handle_epoch_done(Micros(10), TaskId(1), 0.71);
        let acts = drain(&mut s);
        assert_eq!(
            acts,
            vec![
                SchedAction::Complete { task: TaskId(1), reached: true },
                SchedAction::RunEpoch { task: TaskId(2) },
                SchedAction::RunEpoch { task: TaskId(3) },
            ]
        );
    }

    #[test]
    fn preloads_the_next_cycle_before_it_starts() {
        // Budget for one task per cycle; three unmeasured tasks take turns.
        let mut s = TwinBufferScheduler::new(cfg(10));
        for i in 1..=3 {
            s.handle_arrival(Micros(0), spec(i, 0.5, 10));
        }
        assert_eq!(drain(&mut s), vec![SchedAction::RunEpoch { task: TaskId(1) }]);
        assert_eq!(s.poll_timeout(), None, "no cycle estimate yet");
        s.handle_epoch_done(Micros::from_secs(10), TaskId(1), 0.52);
        assert_eq!(drain(&mut s), vec![SchedAction::RunEpoch { task: TaskId(2) }]);
        // Cycle estimate 10 s, lead 2 s: preload at 10 + 8 = 18 s.
        assert_eq!(s.poll_timeout(), Some(Micros::from_secs(18)));
        s.handle_timeout(Micros::from_secs(18));
        // Next is task 3 (never served): load its experts, drop task 1's (not needed next).
        assert_eq!(
            drain(&mut s),
            vec![SchedAction::Preload {
                task: TaskId(3),
                load: vec![ExpertId(30), ExpertId(31)],
                unload: vec![ExpertId(10), ExpertId(11)],
            }]
        );
        s.handle_epoch_done(Micros::from_secs(20), TaskId(2), 0.52);
        assert_eq!(drain(&mut s), vec![SchedAction::RunEpoch { task: TaskId(3) }]);
    }

    #[test]
    fn with_deadlines_the_tasks_that_can_meet_them_go_first_and_alone_when_tight() {
        let mut s = TwinBufferScheduler::new(cfg(100));
        let deadlines = [None, Some(25), Some(28)];
        for (i, d) in deadlines.iter().enumerate() {
            let spec = TaskSpec { deadline: d.map(Micros::from_secs), ..spec(i as u32 + 1, 0.5, 10) };
            s.handle_arrival(Micros(0), spec);
        }
        // Task 1 arrived to an idle scheduler: it runs alone, which times one task-epoch (10 s).
        assert_eq!(drain(&mut s), vec![SchedAction::RunEpoch { task: TaskId(1) }]);
        s.handle_epoch_done(Micros::from_secs(10), TaskId(1), 0.52);
        // One epoch left each for 2 and 3 (no curve, no finished task yet). From 10 s: 2 ends at
        // 20 <= 25, 3 at 30 > 28 leaves for the end; 1 has no deadline: after the on-time ones.
        assert_eq!(s.remaining_epochs(TaskId(3)), 1);
        assert_eq!(s.service_order(), vec![TaskId(2), TaskId(1), TaskId(3)]);
        // Sharing the cycle would end task 2 near 30 > 25: it runs alone.
        assert_eq!(drain(&mut s), vec![SchedAction::RunEpoch { task: TaskId(2) }]);
    }

    #[test]
    fn tasks_without_a_curve_are_expected_to_need_what_finished_ones_needed() {
        let mut s = TwinBufferScheduler::new(TwinConfig { seats: 1, ..cfg(100) });
        s.handle_arrival(Micros(0), spec(1, 0.5, 10));
        assert_eq!(s.remaining_epochs(TaskId(1)), 1, "nothing finished yet");
        for (t, acc) in [(10, 0.55), (20, 0.71)] {
            let _ = drain(&mut s);
            s.handle_epoch_done(Micros::from_secs(t), TaskId(1), acc);
        }
        assert!(drain(&mut s).contains(&SchedAction::Complete { task: TaskId(1), reached: true }));
        s.handle_arrival(Micros::from_secs(20), spec(2, 0.5, 10));
        assert_eq!(s.remaining_epochs(TaskId(2)), 2);
    }

    #[test]
    fn the_prior_is_the_median_beyond_what_a_task_has_done() {
        let seen: VecDeque<u32> = [1, 1, 1, 2, 8].into_iter().collect();
        // A fresh task: the median of 1, 1, 1, 2, 8 (a rounded-up mean would say 3).
        assert_eq!(prior_remaining(&seen, 0), 1);
        // One epoch done without the gain: those that took more took 2 and 8, 1 and 7 beyond it;
        // the lower median.
        assert_eq!(prior_remaining(&seen, 1), 1);
        assert_eq!(prior_remaining(&seen, 2), 6);
        // Past every task seen, or nothing seen: one more epoch.
        assert_eq!(prior_remaining(&seen, 8), 1);
        assert_eq!(prior_remaining(&VecDeque::new(), 0), 1);
    }

    #[test]
    fn a_cycle_is_timed_from_when_it_starts_running() {
        let mut s = TwinBufferScheduler::new(cfg(1_000));
        s.handle_arrival(Micros(0), spec(1, 0.5, 10));
        assert_eq!(drain(&mut s), vec![SchedAction::RunEpoch { task: TaskId(1) }]);
        // The executor admitted arrivals for 900 µs before it ran the cycle.
        s.handle_cycle_start(Micros(900));
        s.handle_epoch_done(Micros(1_000), TaskId(1), 0.55);
        assert_eq!(s.task_epoch_time(), Some(Micros(100)));
        // Without the call, the cycle counts from its dispatch.
        let _ = drain(&mut s);
        s.handle_epoch_done(Micros(1_500), TaskId(1), 0.6);
        assert_eq!(s.task_epoch_time(), Some(Micros((100 + 500) / 2)));
    }

    #[test]
    fn a_cycle_never_takes_more_than_its_seats() {
        let mut s = TwinBufferScheduler::new(TwinConfig { seats: 2, ..cfg(1_000) });
        for i in 1..=5 {
            s.handle_arrival(Micros(0), spec(i, 0.5, 10));
        }
        let _ = drain(&mut s); // task 1 alone (the others arrived during its cycle)
        s.handle_epoch_done(Micros(10), TaskId(1), 0.52);
        let runs = drain(&mut s);
        assert_eq!(
            runs,
            vec![SchedAction::RunEpoch { task: TaskId(2) }, SchedAction::RunEpoch { task: TaskId(3) },]
        );
    }

    #[test]
    fn one_processor_under_deadlines_runs_one_task_per_cycle() {
        let with_deadline = |i: u32| TaskSpec { deadline: Some(Micros::from_secs(100)), ..spec(i, 0.5, 10) };
        let cycle_after_first = |side_by_side: bool, deadlines: bool| {
            let mut s = TwinBufferScheduler::new(TwinConfig { seats: 3, side_by_side, ..cfg(1_000) });
            for i in 1..=5 {
                s.handle_arrival(Micros(0), if deadlines { with_deadline(i) } else { spec(i, 0.5, 10) });
            }
            let _ = drain(&mut s); // task 1 alone (the others arrived during its cycle)
            s.handle_epoch_done(Micros(10), TaskId(1), 0.52);
            let runs = drain(&mut s).iter().filter(|a| matches!(a, SchedAction::RunEpoch { .. })).count();
            (runs, s.preload_set().len())
        };
        // Every task on time alone and sharing: side by side, the cycle fills its seats.
        assert_eq!(cycle_after_first(true, true).0, 3);
        // On one processor the same tasks run one after another, and one is preloaded.
        assert_eq!(cycle_after_first(false, true), (1, 1));
        // Without deadlines the seats hold on either device.
        assert_eq!(cycle_after_first(false, false).0, 3);
        assert_eq!(cycle_after_first(true, false).0, 3);
    }

    #[test]
    fn an_arrival_waits_while_a_task_due_no_later_is_on_time() {
        let due = |s: u64| Some(Micros::from_secs(s));
        let mut s = TwinBufferScheduler::new(TwinConfig { side_by_side: false, ..cfg(1_000) });
        s.handle_arrival(Micros(0), TaskSpec { deadline: due(100), ..spec(1, 0.5, 10) });
        // no cycle timed yet: every task whose deadline has not passed counts as on time
        assert!(s.defers_admission(Micros(0), due(110)));
        assert!(!s.defers_admission(Micros(0), due(90)));
        assert!(!s.defers_admission(Micros::from_secs(100), due(110)));
        let _ = drain(&mut s);
        s.handle_cycle_start(Micros(0));
        s.handle_epoch_done(Micros::from_secs(10), TaskId(1), 0.52);
        let _ = drain(&mut s);
        // task 1 (due at 100) is on time: a task due later waits, one due sooner or never does not
        assert!(s.defers_admission(Micros::from_secs(10), due(110)));
        assert!(s.defers_admission(Micros::from_secs(10), due(100)));
        assert!(!s.defers_admission(Micros::from_secs(10), due(50)));
        assert!(!s.defers_admission(Micros::from_secs(10), None));
        // once task 1 can no longer make its deadline, nothing on time is ahead of an arrival
        assert!(!s.defers_admission(Micros::from_secs(95), due(110)));
    }

    #[test]
    fn an_alpha_task_that_misses_alpha_within_tau_yields() {
        let mut s =
            TwinBufferScheduler::new(TwinConfig { tau: Micros::from_secs(10), seats: 1, ..cfg(1_000) });
        s.handle_arrival(Micros(0), spec(1, 0.30, 10));
        s.handle_arrival(Micros(0), spec(2, 0.31, 10));
        assert_eq!(drain(&mut s), vec![SchedAction::RunEpoch { task: TaskId(1) }]);
        // t=6: same gap to alpha (0.14) for both, no rotation yet: task 1 keeps its slice.
        s.handle_epoch_done(Micros::from_secs(6), TaskId(1), 0.31);
        assert_eq!(drain(&mut s), vec![SchedAction::RunEpoch { task: TaskId(1) }]);
        // t=12: 12 s >= tau since its slice began at 0 and 0.32 < alpha: it goes behind task 2.
        s.handle_epoch_done(Micros::from_secs(12), TaskId(1), 0.32);
        assert_eq!(drain(&mut s), vec![SchedAction::RunEpoch { task: TaskId(2) }]);
    }

    #[test]
    fn large_age_errors_switch_to_round_robin() {
        let mut s = TwinBufferScheduler::new(TwinConfig { age_error_threshold: 0.2, ..cfg(10) });
        s.handle_arrival(Micros(0), spec(1, 0.5, 10));
        let _ = drain(&mut s);
        // A noisy curve: gains alternate in sign, so predictions keep missing.
        let accs = [0.55, 0.51, 0.58, 0.52, 0.60, 0.53];
        for (i, a) in accs.iter().enumerate() {
            s.handle_epoch_done(Micros(i as u64 + 1), TaskId(1), *a);
            let _ = drain(&mut s);
        }
        assert!(s.in_fallback(), "error {:?}", s.age_error());
    }
}
