//! Work finished in this process, per workload, for the node's metrics: counters only, bumped
//! where each workload records an outcome (a coe request answered, a pipeline input answered or
//! a task failed, an adaptation done or refused). No decision reads them.

use std::sync::atomic::{AtomicU64, Ordering};

/// Done and failed counts of one workload.
#[derive(Debug, Default)]
pub struct WorkCounters {
    done: AtomicU64,
    failed: AtomicU64,
}

impl WorkCounters {
    const fn new() -> Self {
        WorkCounters { done: AtomicU64::new(0), failed: AtomicU64::new(0) }
    }

    /// One unit of work finished.
    pub fn done(&self) {
        self.done.fetch_add(1, Ordering::Relaxed);
    }

    /// One unit of work failed (it may be retried: this counts attempts that failed).
    pub fn failed(&self) {
        self.failed.fetch_add(1, Ordering::Relaxed);
    }

    /// (done, failed) so far.
    pub fn get(&self) -> (u64, u64) {
        (self.done.load(Ordering::Relaxed), self.failed.load(Ordering::Relaxed))
    }
}

/// coe: requests answered; failed executor runs.
pub static COE: WorkCounters = WorkCounters::new();
/// pipeline: inputs answered; stage tasks that failed.
pub static PIPELINE: WorkCounters = WorkCounters::new();
/// coadapt: adaptation tasks finished; tasks refused.
pub static COADAPT: WorkCounters = WorkCounters::new();

/// Every workload's counters with its name.
pub fn all() -> [(&'static str, &'static WorkCounters); 3] {
    [("coe", &COE), ("pipeline", &PIPELINE), ("coadapt", &COADAPT)]
}
