//! Pipeline workload (CROWDio): one model cut into stages, run over a crowd of phone-class workers.
//!
//! - [`bound`]: B*(N), the makespan bound with loads and per-task runtime CPU as CPU work.
//! - [`chain`]: job submission check (linear DAG of stage signatures).
//! - [`affinity`]: 4-tier residency affinity, entropy-weighted ranking, two-phase dispatch.
//! - [`coding`]: whether activations are compressed on the wire (by where the crowd runs).
//! - [`costs`]: per-stage task and load times learned online from completions.
//! - [`plan`]: home stages for a streaming job's steady state (pipeline balancing by speed).
//! - [`start`]: home stages at a streaming job's start, chosen by replaying each candidate.
//! - [`replan`]: failure planner for a lost worker's tasks.
//! - [`foreman`]: the scheduler policy (sans-IO) tying them together.
//! - [`sim`]: a discrete-event simulator driving the foreman over heterogeneous workers.

use std::fmt;

pub mod affinity;
pub mod bound;
pub mod chain;
pub mod coding;
pub mod costs;
pub mod foreman;
pub mod plan;
pub mod replan;
pub mod sim;
pub mod start;

#[cfg(test)]
mod golden;
#[cfg(test)]
mod tests;

pub use affinity::{Telemetry, Tier};
pub use chain::{Chain, ChainError, DType, StageSignature, TensorSig, check_chain};
pub use foreman::{Action, Foreman, ForemanConfig, ForemanError, Job, WorkerReport};

/// A worker (phone-class node) of the crowd.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct WorkerId(pub u32);

impl fmt::Display for WorkerId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "w{}", self.0)
    }
}

/// One task: stage `stage` of job input `input`. Ordered by input, then stage.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct TaskId {
    /// Job input index, 0..N.
    pub input: usize,
    /// Stage index, 0..S.
    pub stage: usize,
}

impl TaskId {
    /// Convenience constructor.
    pub const fn new(input: usize, stage: usize) -> Self {
        TaskId { input, stage }
    }
}

impl fmt::Display for TaskId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "i{}/s{}", self.input, self.stage)
    }
}

/// How stage `k` tasks wait for stage `k-1`, chosen per job.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Mode {
    /// 1:1 dependencies: stage `k` of input `i` waits only for stage `k-1` of input `i`.
    Streaming,
    /// 1:N dependencies: stage `k` of any input waits for all of stage `k-1`.
    Barrier,
}

impl fmt::Display for Mode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Mode::Streaming => "streaming",
            Mode::Barrier => "barrier",
        })
    }
}
