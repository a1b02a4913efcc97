//! The interface shared by the co-adaptation schedulers ([`super::twin`] and
//! [`super::baselines`]) and the bookkeeping they have in common.
//!
//! Calling protocol (every scheduler): feed arrivals with `handle_arrival`; drain `poll_action`
//! after every `handle_*` call. The scheduler works in *cycles*: it emits a batch of
//! [`SchedAction::RunEpoch`] (the tasks co-adapted together, whose resident state fits the
//! memory budget); the caller runs one epoch of each and reports each with `handle_epoch_done`.
//! The next cycle is planned once every epoch of the current one is reported. `Complete` means
//! the task left (target reached, or its epoch budget ran out). Call `handle_timeout` when `now`
//! reaches `poll_timeout` (the twin-buffer scheduler uses it to preload the next cycle). Call
//! `handle_cycle_start` when the executor starts running a dispatched cycle, so the cycle is
//! timed from then (the executor may admit arrivals in between).

use std::collections::{BTreeMap, BTreeSet, VecDeque};

use super::{ExpertId, ModelId, TaskId};
use crate::Micros;

/// An adaptation request.
#[derive(Debug, Clone, PartialEq)]
pub struct TaskSpec {
    /// Task id (unique).
    pub id: TaskId,
    /// The model being adapted.
    pub model: ModelId,
    /// Experts the task trains.
    pub experts: Vec<ExpertId>,
    /// Accuracy when the request arrives (0..1).
    pub accuracy: f64,
    /// Accuracy at which the task is complete (the paper's β).
    pub target: f64,
    /// Bytes the task must hold resident while it trains (experts and optimizer state in the
    /// co-adaptation pool; a whole model copy under isolated adaptation).
    pub footprint: u64,
    /// Latest completion that meets the task's SLO (`None`: no SLO). The twin-buffer scheduler
    /// orders tasks that carry one by [`super::slo`]; the baselines ignore it, as published.
    pub deadline: Option<Micros>,
}

/// A scheduling decision.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SchedAction {
    /// Train one epoch of `task` in the current cycle.
    RunEpoch {
        /// The task.
        task: TaskId,
    },
    /// Load `load` (and drop `unload`) now so the next cycle's `task` starts without a reload.
    Preload {
        /// The task about to enter.
        task: TaskId,
        /// Its inactive experts to load.
        load: Vec<ExpertId>,
        /// Resident experts no longer needed by the current or next cycle.
        unload: Vec<ExpertId>,
    },
    /// The task is done; return the model.
    Complete {
        /// The task.
        task: TaskId,
        /// Whether it reached its target (otherwise its epoch budget ran out or it cannot fit).
        reached: bool,
    },
}

/// What every scheduler exposes (see the module doc for the protocol).
pub trait AdaptScheduler {
    /// Short name for reports.
    fn name(&self) -> &'static str;
    /// A new adaptation request.
    fn handle_arrival(&mut self, now: Micros, task: TaskSpec);
    /// One epoch of `task` finished with this accuracy.
    fn handle_epoch_done(&mut self, now: Micros, task: TaskId, accuracy: f64);
    /// `now` reached the time returned by `poll_timeout`.
    fn handle_timeout(&mut self, now: Micros);
    /// The executor starts running the dispatched cycle now: its duration counts from here, not
    /// from the dispatch (time spent between them, e.g. admitting arrivals, is not the cycle's).
    fn handle_cycle_start(&mut self, now: Micros);
    /// Next decision, if any.
    #[must_use]
    fn poll_action(&mut self) -> Option<SchedAction>;
    /// When the scheduler next wants `handle_timeout`.
    fn poll_timeout(&self) -> Option<Micros>;
    /// Whether a task arriving at `now` with `deadline` should wait before it is admitted (its
    /// starting accuracy measured, `handle_arrival` called): admitting costs processor time, and
    /// spending it ahead of work due earlier can make that work late. Default: admit at once.
    fn defers_admission(&self, now: Micros, deadline: Option<Micros>) -> bool {
        let _ = (now, deadline);
        false
    }
}

/// Limits shared by all schedulers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CycleLimits {
    /// Bytes of resident task state one cycle may hold.
    pub memory_budget: u64,
    /// Epochs after which a task is returned even below target.
    pub max_epochs: u32,
}

impl Default for CycleLimits {
    fn default() -> Self {
        CycleLimits { memory_budget: 16 << 30, max_epochs: 40 }
    }
}

/// A live task as the schedulers track it.
#[derive(Debug, Clone, PartialEq)]
pub struct TaskState {
    /// The request.
    pub spec: TaskSpec,
    /// Latest accuracy.
    pub accuracy: f64,
    /// Epochs trained so far.
    pub epochs: u32,
    /// Arrival time.
    pub arrived: Micros,
    /// Accuracy gain of the latest epoch.
    pub last_gain: Option<f64>,
    /// Cycle number in which it last trained.
    pub last_cycle: Option<u64>,
}

/// Task table, cycle barrier and action queue shared by the schedulers.
#[derive(Debug, Clone, Default)]
pub struct TaskTable {
    /// Live tasks.
    pub tasks: BTreeMap<TaskId, TaskState>,
    /// Tasks whose epoch in the current cycle has not been reported yet.
    pub outstanding: BTreeSet<TaskId>,
    /// Cycles dispatched so far.
    pub cycle: u64,
    /// Start of the current cycle.
    pub cycle_started: Micros,
    /// Pending decisions.
    pub actions: VecDeque<SchedAction>,
    /// Limits.
    pub limits: CycleLimits,
}

impl TaskTable {
    /// An empty table.
    pub fn new(limits: CycleLimits) -> Self {
        TaskTable { limits, ..TaskTable::default() }
    }

    /// Adds a task; returns false when it is a duplicate of a live id (ignored), can never fit
    /// (completed as not reached) or is already at its target (completed as reached).
    pub fn admit(&mut self, now: Micros, spec: TaskSpec) -> bool {
        if self.tasks.contains_key(&spec.id) {
            return false;
        }
        if spec.footprint > self.limits.memory_budget {
            self.actions.push_back(SchedAction::Complete { task: spec.id, reached: false });
            return false;
        }
        if spec.accuracy >= spec.target {
            self.actions.push_back(SchedAction::Complete { task: spec.id, reached: true });
            return false;
        }
        self.tasks.insert(
            spec.id,
            TaskState {
                accuracy: spec.accuracy,
                spec,
                epochs: 0,
                arrived: now,
                last_gain: None,
                last_cycle: None,
            },
        );
        true
    }

    /// Records an epoch; returns the task's state if it is still live (not completed).
    pub fn record_epoch(&mut self, task: TaskId, accuracy: f64) -> Option<&TaskState> {
        if !self.outstanding.remove(&task) {
            return None;
        }
        let done = {
            let t = self.tasks.get_mut(&task)?;
            t.last_gain = Some(accuracy - t.accuracy);
            t.accuracy = accuracy;
            t.epochs += 1;
            if t.accuracy >= t.spec.target {
                Some(true)
            } else if t.epochs >= self.limits.max_epochs {
                Some(false)
            } else {
                None
            }
        };
        if let Some(reached) = done {
            self.tasks.remove(&task);
            self.actions.push_back(SchedAction::Complete { task, reached });
            return None;
        }
        self.tasks.get(&task)
    }

    /// Whether the current cycle is finished (no epochs outstanding).
    pub fn cycle_idle(&self) -> bool {
        self.outstanding.is_empty()
    }

    /// Greedily takes tasks in `order` whose footprints fit the budget together.
    pub fn fill(&self, order: &[TaskId]) -> Vec<TaskId> {
        let mut left = self.limits.memory_budget;
        let mut chosen = Vec::new();
        for id in order {
            if let Some(t) = self.tasks.get(id)
                && t.spec.footprint <= left
            {
                left -= t.spec.footprint;
                chosen.push(*id);
            }
        }
        chosen
    }

    /// Re-stamps the running cycle's start (see [`AdaptScheduler::handle_cycle_start`]); nothing
    /// when no cycle is running.
    pub fn restart_cycle(&mut self, now: Micros) {
        if !self.outstanding.is_empty() {
            self.cycle_started = self.cycle_started.max(now);
        }
    }

    /// Starts a cycle with `tasks` (emits one `RunEpoch` each).
    pub fn dispatch(&mut self, now: Micros, tasks: &[TaskId]) {
        if tasks.is_empty() {
            return;
        }
        self.cycle += 1;
        self.cycle_started = now;
        for id in tasks {
            if let Some(t) = self.tasks.get_mut(id) {
                t.last_cycle = Some(self.cycle);
                self.outstanding.insert(*id);
                self.actions.push_back(SchedAction::RunEpoch { task: *id });
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(id: u32, acc: f64, target: f64, footprint: u64) -> TaskSpec {
        TaskSpec {
            id: TaskId(id),
            model: ModelId(id),
            experts: vec![ExpertId(id)],
            accuracy: acc,
            target,
            footprint,
            deadline: None,
        }
    }

    #[test]
    fn table_admits_fills_and_completes() {
        let mut t = TaskTable::new(CycleLimits { memory_budget: 10, max_epochs: 2 });
        assert!(!t.admit(Micros(0), spec(9, 0.5, 0.6, 11)));
        assert!(t.admit(Micros(0), spec(1, 0.5, 0.6, 6)));
        assert!(!t.admit(Micros(0), spec(1, 0.1, 0.6, 6)), "duplicate id is ignored");
        assert!(!t.admit(Micros(0), spec(8, 0.7, 0.6, 6)), "already at target");
        assert!(t.admit(Micros(0), spec(2, 0.5, 0.6, 5)));
        assert!(t.admit(Micros(0), spec(3, 0.5, 0.6, 4)));
        assert_eq!(t.fill(&[TaskId(1), TaskId(2), TaskId(3)]), vec![TaskId(1), TaskId(3)]);
        t.dispatch(Micros(0), &[TaskId(1), TaskId(3)]);
        assert!(t.record_epoch(TaskId(2), 0.9).is_none(), "not in the cycle");
        assert!(t.record_epoch(TaskId(1), 0.61).is_none(), "reached target");
        assert!(t.record_epoch(TaskId(3), 0.52).is_some());
        assert!(t.cycle_idle());
        let acts: Vec<_> = t.actions.drain(..).collect();
        assert_eq!(acts[0], SchedAction::Complete { task: TaskId(9), reached: false });
        assert!(acts.contains(&SchedAction::Complete { task: TaskId(1), reached: true }));
    }
}
