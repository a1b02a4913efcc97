//! What a foreman job is given: its settings, the job with its ledger, and why it can fail.

use std::time::Duration;

use troupe_policy::pipeline::ForemanConfig;
use troupe_policy::pipeline::costs::CostModel;

use super::super::job::PipelineJob;
use super::super::ledger::{Ledger, Resumed};

/// Foreman settings.
#[derive(Clone, Debug)]
pub struct ShellSettings {
    /// Workers to wait for before submitting.
    pub workers: usize,
    /// How long to wait for them.
    pub join_timeout: Duration,
    /// Telemetry period.
    pub telemetry_period: Duration,
    /// Longest a single request may take (a stage pull, a load or a task).
    pub rpc_timeout: Duration,
    /// Policy settings.
    pub policy: ForemanConfig,
    /// Drop every worker's live session before the job (jobs then start alike, e.g. when
    /// comparing modes); when false the policy is told what each worker holds (Tier 1 reuse):
    /// residency across jobs.
    pub fresh_start: bool,
    /// Task and load times learned by an earlier job ([`super::JobOutcome::learned_costs`]) for the
    /// policy to start from (used when the stage sizes match and `policy.remember_costs`).
    pub prior_costs: Option<CostModel>,
    /// The foreman's fault-switch site ([`super::FAULT_SITE`] unless a simulation names one per
    /// run, so runs sharing a process never share the switch).
    pub fault_site: String,
}

impl Default for ShellSettings {
    fn default() -> Self {
        ShellSettings {
            workers: 1,
            join_timeout: Duration::from_secs(30),
            telemetry_period: Duration::from_millis(500),
            rpc_timeout: Duration::from_secs(60),
            policy: ForemanConfig::default(),
            fresh_start: true,
            prior_costs: None,
            fault_site: super::FAULT_SITE.into(),
        }
    }
}

/// Why a job did not complete.
#[derive(Debug, thiserror::Error)]
pub enum ShellError {
    /// Not enough workers joined.
    #[error("only {found} of {wanted} pipeline workers joined within {secs} s")]
    TooFewWorkers {
        /// Joined.
        found: usize,
        /// Wanted.
        wanted: usize,
        /// Waited.
        secs: u64,
    },
    /// The policy refused the job.
    #[error("foreman refused the job: {0}")]
    Refused(String),
    /// A task failed too often.
    #[error("job failed at task {task}: {detail}")]
    Failed {
        /// The task.
        task: String,
        /// The last error seen.
        detail: String,
    },
    /// Every worker was lost.
    #[error("every worker was lost")]
    NoWorkers,
    /// The job's journal could not be opened, replayed or appended to.
    #[error("{0}")]
    Journal(String),
}

/// A job together with its ledger: what it has accepted and answered (journaled or in memory).
#[derive(Debug)]
pub struct AcceptedJob {
    pub(super) job: PipelineJob,
    pub(super) ledger: Ledger,
}

impl AcceptedJob {
    /// Accepts `job` durably: with `journal`, the acceptance is journaled (synced) before this
    /// returns, or an earlier run's acceptance and answers are replayed from it.
    pub fn open(job: PipelineJob, journal: Option<&std::path::Path>) -> Result<(Self, Resumed), ShellError> {
        match journal {
            None => Ok((job.into(), Resumed::default())),
            Some(path) => {
                let (ledger, resumed) =
                    Ledger::open(path, &job).map_err(|e| ShellError::Journal(e.to_string()))?;
                Ok((AcceptedJob { job, ledger }, resumed))
            }
        }
    }
}

/// A job accepted in memory only.
impl From<PipelineJob> for AcceptedJob {
    fn from(job: PipelineJob) -> Self {
        let ledger = Ledger::in_memory(job.inputs.len());
        AcceptedJob { job, ledger }
    }
}
