//! Baseline schedulers the paper compares against (§5.1), behind the same
//! [`AdaptScheduler`] interface as [`super::twin::TwinBufferScheduler`].
//!
//! * [`QueueScheduler::ams`]: AMS-like round-robin GPU sharing — least recently served first.
//! * [`QueueScheduler::recl`]: RECL-like accuracy-first time slices — the tasks with the largest
//!   last accuracy gain (unmeasured first) hold the GPU for `slice_cycles` cycles.
//! * [`QueueScheduler::fifo`]: arrival order, run to completion; used for isolated adaptation
//!   and MoE-SE, whose differences are in execution (per-task model copies, sequential experts),
//!   which the caller models (see [`super::sim::Strategy`]).
//!
//! None preloads; all complete tasks at their target or epoch cap like the twin scheduler.

use super::TaskId;
use super::sched::{AdaptScheduler, CycleLimits, SchedAction, TaskSpec, TaskTable};
use crate::Micros;

/// How a [`QueueScheduler`] orders tasks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum QueueKind {
    /// Least recently served first (AMS).
    RoundRobin,
    /// Largest last gain first, kept for `slice_cycles` cycles (RECL).
    AccuracyFirst {
        /// Cycles a chosen set keeps the GPU.
        slice_cycles: u32,
    },
    /// Arrival order (isolated adaptation, MoE-SE).
    Fifo,
}

/// A single-queue cycle scheduler (see the module doc).
#[derive(Debug, Clone)]
pub struct QueueScheduler {
    kind: QueueKind,
    name: &'static str,
    table: TaskTable,
    slice: Vec<TaskId>,
    slice_left: u32,
}

impl QueueScheduler {
    /// A scheduler of the given kind.
    pub fn new(kind: QueueKind, name: &'static str, limits: CycleLimits) -> Self {
        QueueScheduler { kind, name, table: TaskTable::new(limits), slice: Vec::new(), slice_left: 0 }
    }

    /// AMS-like round robin.
    pub fn ams(limits: CycleLimits) -> Self {
        Self::new(QueueKind::RoundRobin, "ams-rr", limits)
    }

    /// RECL-like accuracy-first time slices of `slice_cycles` cycles.
    pub fn recl(limits: CycleLimits, slice_cycles: u32) -> Self {
        Self::new(QueueKind::AccuracyFirst { slice_cycles: slice_cycles.max(1) }, "recl-af", limits)
    }

    /// Arrival order.
    pub fn fifo(limits: CycleLimits, name: &'static str) -> Self {
        Self::new(QueueKind::Fifo, name, limits)
    }

    fn order(&self) -> Vec<TaskId> {
        let mut ids: Vec<TaskId> = self.table.tasks.keys().copied().collect();
        let tasks = &self.table.tasks;
        match self.kind {
            QueueKind::RoundRobin => ids.sort_by_key(|id| (tasks[id].last_cycle, tasks[id].arrived, *id)),
            QueueKind::AccuracyFirst { .. } => ids.sort_by(|a, b| {
                let ga = tasks[a].last_gain.unwrap_or(f64::INFINITY);
                let gb = tasks[b].last_gain.unwrap_or(f64::INFINITY);
                gb.total_cmp(&ga).then(a.cmp(b))
            }),
            QueueKind::Fifo => ids.sort_by_key(|id| (tasks[id].arrived, *id)),
        }
        ids
    }

    fn plan(&mut self, now: Micros) {
        if !self.table.cycle_idle() {
            return;
        }
        let chosen = match self.kind {
            QueueKind::AccuracyFirst { slice_cycles } => {
                self.slice.retain(|id| self.table.tasks.contains_key(id));
                if self.slice_left == 0 || self.slice.is_empty() {
                    self.slice = self.table.fill(&self.order());
                    self.slice_left = slice_cycles;
                }
                self.slice_left -= 1;
                self.slice.clone()
            }
            _ => self.table.fill(&self.order()),
        };
        self.table.dispatch(now, &chosen);
    }
}

impl AdaptScheduler for QueueScheduler {
    fn name(&self) -> &'static str {
        self.name
    }

    fn handle_arrival(&mut self, now: Micros, task: TaskSpec) {
        if self.table.admit(now, task) {
            self.plan(now);
        }
    }

    fn handle_epoch_done(&mut self, now: Micros, task: TaskId, accuracy: f64) {
        let _ = self.table.record_epoch(task, accuracy);
        if self.table.cycle_idle() {
            self.plan(now);
        }
    }

    fn handle_timeout(&mut self, _now: Micros) {}

    fn handle_cycle_start(&mut self, now: Micros) {
        self.table.restart_cycle(now);
    }

    fn poll_action(&mut self) -> Option<SchedAction> {
        self.table.actions.pop_front()
    }

    fn poll_timeout(&self) -> Option<Micros> {
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::adapt::{ExpertId, ModelId};

    fn spec(id: u32) -> TaskSpec {
        TaskSpec {
            id: TaskId(id),
            model: ModelId(id),
            experts: vec![ExpertId(id)],
            accuracy: 0.5,
            target: 0.9,
            footprint: 10,
            deadline: None,
        }
    }

    fn limits() -> CycleLimits {
        CycleLimits { memory_budget: 10, max_epochs: 100 }
    }

    fn run(s: &mut dyn AdaptScheduler, gains: &[f64], cycles: usize) -> Vec<TaskId> {
        let mut acc = [0.5; 3];
        let mut served = Vec::new();
        let mut now = 0;
        for i in 0..3 {
            s.handle_arrival(Micros(0), spec(i));
        }
        for _ in 0..cycles {
            let runs: Vec<TaskId> = std::iter::from_fn(|| s.poll_action())
                .filter_map(|a| match a {
                    SchedAction::RunEpoch { task } => Some(task),
                    _ => None,
                })
                .collect();
            now += 1;
            for t in runs {
                served.push(t);
                acc[t.0 as usize] += gains[t.0 as usize];
                s.handle_epoch_done(Micros(now), t, acc[t.0 as usize]);
            }
        }
        served
    }

    #[test]
    fn round_robin_rotates() {
        let mut s = QueueScheduler::ams(limits());
        let ids: Vec<u32> = run(&mut s, &[0.01, 0.02, 0.03], 6).iter().map(|t| t.0).collect();
        assert_eq!(ids, vec![0, 1, 2, 0, 1, 2]);
    }

    #[test]
    fn accuracy_first_keeps_the_best_gainer() {
        let mut s = QueueScheduler::recl(limits(), 2);
        let ids: Vec<u32> = run(&mut s, &[0.01, 0.02, 0.03], 8).iter().map(|t| t.0).collect();
        // Unmeasured first (0, then 1, then 2, two cycles each), then task 2 (gain 0.03) wins.
        assert_eq!(ids, vec![0, 0, 1, 1, 2, 2, 2, 2]);
    }

    #[test]
    fn fifo_runs_to_completion() {
        let mut s = QueueScheduler::fifo(limits(), "fifo");
        let ids: Vec<u32> = run(&mut s, &[0.25, 0.25, 0.25], 6).iter().map(|t| t.0).collect();
        assert_eq!(ids, vec![0, 0, 1, 1, 2, 2]);
    }
}
