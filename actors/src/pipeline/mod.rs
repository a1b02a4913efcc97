//! The pipeline workload (CROWDio) over the cluster: a foreman shell driving
//! `troupe_policy::pipeline::Foreman`, and phone-class workers that run one stage at a time.
//!
//! - [`job`]: stage files (SHA-256, tensor signatures) and the checks that refuse a broken job.
//! - [`wire`]: foreman <-> worker messages (typed rkyv messages, one per command), tensor
//!   encoding, blobs.
//! - [`ledger`]: the job's accepted inputs and answers, journaled on the foreman's node.
//! - [`service`]: the foreman as a long-lived service taking jobs from clients over QUIC.
//! - [`worker`]: the worker, a typed actor (single live session, disk cache of stage files).
//! - [`foreman`]: the foreman shell (discovery, per-worker [`crate::typed::Links`], telemetry,
//!   failures).
//! - [`telemetry`]: CPU/RSS from the OS, the simulated device model, real and emulated stragglers.

pub mod foreman;
pub mod job;
pub mod ledger;
pub mod service;
pub mod sim_stage;
pub mod telemetry;
pub mod wire;
pub mod worker;

pub use foreman::{
    AcceptedJob, ActivationBytes, FAULT_SITE, JobOutcome, Progress, ShellError, ShellSettings, Span,
    SpanKind, TaskTimes, WorkerSummary, run_pipeline_job,
};
pub use job::{JobError, PipelineJob, StageFile, build_job};
pub use ledger::{Ledger, LedgerError, Resumed, job_digest};
pub use wire::BlobShelf;
pub use worker::{PipelineWorker, WorkerSettings, worker_name};
