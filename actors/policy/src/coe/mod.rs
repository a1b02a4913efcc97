//! CoServe-style Collaboration-of-Experts serving policy (workload `coe`).
//!
//! Hundreds of expert models that do not fit in an executor's memory are loaded on demand; most of
//! the time goes into switching experts, not computing. This module holds the pure decision cores
//! that cut that switching by exploiting expert dependency:
//!
//! - [`engine`]: which engine runs an executor's experts (CUDA, its CPU stand-in, ONNX Runtime).
//! - [`model`]: experts, their sizes and usage probabilities, and the preliminary -> subsequent graph.
//! - [`profile`] and [`latency`]: the per-device profile file and the latency model built from it.
//! - [`memory`]: per-executor expert residency with two-stage (dependency-aware) or LRU eviction,
//!   and Belady's MIN as a bound.
//! - [`scheduler`]: the request scheduler (dependency-aware or FCFS) that emits load / evict / run
//!   decisions.
//! - [`trace`] and [`synth`]: the trace file format and a seeded synthetic workload generator.
//! - [`sim`]: a discrete-event simulator that replays a trace through a policy and reports metrics.
//! - [`sweep`]: workload knobs (budgets, skew, rate) applied to a trace, and the sweep's figures.
//! - [`tiers`]: the host tier below each device budget: demotion, host eviction by usage
//!   probability, the start-up host set.
//! - [`text`]: the shared strict line parser behind the profile and trace formats.

pub mod admission;
pub mod engine;
pub mod latency;
pub mod memory;
pub mod model;
pub mod profile;
pub mod scheduler;
pub mod sim;
pub mod sweep;
pub mod synth;
pub mod text;
pub mod tiers;
pub mod trace;

#[cfg(test)]
mod tests;

pub use engine::{ExpertEngine, choose_engine};
pub use latency::LatencyModel;
pub use memory::{
    EvictionContext, EvictionPolicy, ExpertManager, MemoryError, UnknownEvictionPolicy, belady_min_loads,
};
pub use model::{CoeModel, Expert, ExpertId, ExpertKind, ExpertSpec, ModelError, Request, RequestId, Tier};
pub use profile::{
    ExecutorKind, ExecutorProfile, LatencyPoint, MemorySplit, Profile, ProfileError, SizeClass, SplitExpert,
    max_useful_batch, search_split, split_memory,
};
pub use scheduler::{
    Action, BatchId, ExecutorId, QueueRef, RequestScheduler, SchedulerConfig, SchedulerError, Scheduling,
};
pub use sim::{ExecutorFault, ExecutorStats, SimError, SimOptions, SimReport, simulate};
pub use text::ParseError;
pub use tiers::{Demotion, HostCandidate, HostTier, initial_host_set, plan_demotion};
pub use trace::{Trace, TraceError, TraceRequest};
