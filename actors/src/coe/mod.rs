//! Workload `coe`: CoServe-style Collaboration-of-Experts serving with real ONNX experts.
//!
//! The decisions come from `troupe_policy::coe` (request scheduling, two-stage eviction); this
//! module holds the shells that carry them out for real:
//!
//! - [`app`]: the application generator (`troupe coe gen`): experts as ONNX files in a tiered
//!   weight store, a manifest and a trace whose selections come from the real experts.
//! - [`train`]: what the generated experts train on (seeded split, coarse class groups, rows);
//!   [`accuracy`]: the CoE's held-out accuracy beside a same-bytes single model (`accuracy.txt`).
//! - [`appfile`]: users' own applications (`troupe coe serve --app FILE`): an app file naming
//!   each expert's ONNX file, the dependency edges and the usage probabilities.
//! - [`executor`]: one executor (its own weight store, device budget in a `MemoryPool`, a
//!   budgeted host tier experts are demoted to and promoted from, ONNX sessions); a load is a
//!   promotion from the host tier or an `O_DIRECT` read, plus session creation.
//! - [`runner`]: what executors are told and answer, and local runs over executor threads.
//! - [`serve`]: the scheduler actor (durable acceptance, warm restart, restoration) that drives
//!   the policy's `RequestScheduler` in local runs and in the distributed job alike.
//! - [`requests`]: the scheduler as a service (`serve = true` in the `coe` job): clients'
//!   requests over QUIC (`troupe coe request`, [`requests::CoeClient`]), bounded, busy when full.
//! - [`sim_compute`]: `SimCompute`, the executor actor's deterministic compute stand-in on a
//!   simulated cluster (simulation only): hashed outputs, modelled costs on tokio's clock.
//! - [`profiler`]: `troupe coe profile`: batch latency per size class, load bandwidth per tier,
//!   memory split; the profile file the scheduler reads, tied to this machine's fingerprint.

pub mod accuracy;
pub mod app;
pub mod appfile;
pub mod exec_wire;
pub mod executor;
pub mod link;
pub mod profiler;
pub mod remote;
pub mod requests;
pub mod runner;
pub mod serve;
pub mod sim_compute;
pub mod train;

use std::path::{Path, PathBuf};

/// What went wrong in the CoE workload. Each variant names the file or expert concerned.
#[derive(Debug, thiserror::Error)]
pub enum CoeError {
    /// A file (manifest, trace, profile) is missing, too big or malformed.
    #[error("{path}: {problem}")]
    BadFile {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        problem: String,
    },
    /// An OS error on a file.
    #[error("{action} {path}: {source}")]
    Io {
        /// What was being done.
        action: &'static str,
        /// The file.
        path: PathBuf,
        /// The OS error.
        source: std::io::Error,
    },
    /// The weight store refused (corrupt expert blob, tier full, ...).
    #[error("weight store: {0}")]
    Store(#[from] troupe_kernels::KernelError),
    /// ONNX Runtime refused (bad model, run failure, ...).
    #[error("onnx: {0}")]
    Onnx(#[from] troupe_kernels::onnx::OnnxError),
    /// The setup assets (digits, ONNX Runtime) are missing.
    #[error("assets: {0}")]
    Assets(#[from] troupe_kernels::assets::AssetError),
    /// The scheduler refused an event.
    #[error("scheduler: {0}")]
    Scheduler(#[from] troupe_policy::coe::SchedulerError),
    /// An executor was asked to break its budget or its one-thing-at-a-time rule.
    #[error("executor {executor}: {problem}")]
    Executor {
        /// The executor's name.
        executor: String,
        /// What was wrong.
        problem: String,
    },
    /// Something inconsistent (a bug or a mismatched trace).
    #[error("{0}")]
    Invalid(String),
}

impl CoeError {
    /// Shorthand for [`CoeError::Io`].
    pub fn io(action: &'static str, path: &Path, source: std::io::Error) -> Self {
        CoeError::Io { action, path: path.to_path_buf(), source }
    }
}
