//! What a foreman job reports: its outputs, log, Gantt spans, per-worker summaries and byte
//! counts, and the progress events observers (tests) watch while it runs.

use troupe_kernels::onnx::NamedTensor;
use troupe_policy::pipeline::TaskId;
use troupe_policy::pipeline::costs::CostModel;

use super::super::wire::{EncodeTally, RunTimes, TelemetrySample, WorkerStats};

/// What a Gantt bar shows.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SpanKind {
    /// Pulling a stage file.
    Fetch(usize),
    /// Creating a session; `cold` when the file was pulled in this job.
    Load {
        /// Stage.
        stage: usize,
        /// Pulled (true) or from the disk cache (false).
        cold: bool,
        /// The load's CPU as the worker read it on its thread clock, µs (0 where not measured).
        cpu_micros: u64,
    },
    /// Running a task.
    Run(TaskId),
}

/// One bar of the Gantt chart, times in seconds from job start (as the foreman saw them).
#[derive(Clone, Debug, PartialEq)]
pub struct Span {
    /// Worker index.
    pub worker: usize,
    /// What.
    pub kind: SpanKind,
    /// Start, seconds.
    pub start: f64,
    /// End, seconds.
    pub end: f64,
}

/// A worker as the outcome reports it.
#[derive(Clone, Debug, Default)]
pub struct WorkerSummary {
    /// Node name.
    pub node: String,
    /// OS process id it reported.
    pub pid: u32,
    /// How it is slowed, in words.
    pub straggler: String,
    /// Declared lost during the job.
    pub lost: bool,
    /// Tasks it completed.
    pub tasks: usize,
    /// Its own counters at the end (None when lost).
    pub stats: Option<WorkerStats>,
    /// Last telemetry.
    pub telemetry: TelemetrySample,
    /// Its RSS when it joined holding no session (the idle floor: runtime and ONNX Runtime
    /// loaded, no stage), bytes; `None` when it joined with a live session or not at all.
    pub idle_rss_bytes: Option<u64>,
    /// Last RTT QUIC measured to it, ms.
    pub rtt_ms: f64,
    /// Times it was put back in service after being lost.
    pub rejoined: usize,
    /// Tasks it completed since it was last put back in service.
    pub tasks_since_rejoin: usize,
}

/// The result of a completed job.
#[derive(Clone, Debug, Default)]
pub struct JobOutcome {
    /// Per input, the last stage's outputs.
    pub outputs: Vec<Vec<NamedTensor>>,
    /// Submission to the last answer, seconds.
    pub makespan_s: f64,
    /// Every policy action and event, time-stamped.
    pub log: Vec<String>,
    /// The `Reassigned` / `Requeued` lines: which task moved where.
    pub moves: Vec<String>,
    /// Gantt bars.
    pub spans: Vec<Span>,
    /// The workers.
    pub workers: Vec<WorkerSummary>,
    /// f32 activations sent, both directions.
    pub tally: EncodeTally,
    /// Per stage, median ONNX Runtime compute time of its tasks, seconds, per worker.
    pub compute_s: Vec<(usize, usize, f64)>,
    /// The journal that held the job, if it had one: remove it once the outputs are out, so
    /// that the next run of the same job starts afresh.
    pub journal: Option<std::path::PathBuf>,
    /// Per completed task, where its time went.
    pub task_times: Vec<TaskTimes>,
    /// Where the activation bytes went (counted as they moved).
    pub activations: ActivationBytes,
    /// What the policy learned of task and load times (for [`super::ShellSettings::prior_costs`]).
    pub learned_costs: Option<CostModel>,
    /// Home stage per worker index under the policy's stage plan, as the job ended (empty: none).
    pub stage_plan: Vec<(usize, usize)>,
}

/// One completed task's times, seconds: as the foreman saw it and as the worker reported it.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct TaskTimes {
    /// The task.
    pub task: TaskId,
    /// Worker index.
    pub worker: usize,
    /// The foreman's Run span (request sent to outputs in hand).
    pub span_s: f64,
    /// The call alone (request serialised and sent, answer received and read).
    pub call_s: f64,
    /// ONNX Runtime time the worker measured.
    pub compute_s: f64,
    /// The worker's own account of the rest.
    pub reported: RunTimes,
}

/// Counters of the bytes of intermediate activations (one stage's f32 outputs for the next
/// stage), read off the messages and pulls as they happen; a job's answers (last-stage outputs,
/// which the foreman must receive) are counted apart.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ActivationBytes {
    /// Activation bytes the foreman received (in answers or pulled) or sent inline in requests.
    pub via_foreman: u64,
    /// Activation bytes workers pulled from other workers.
    pub worker_to_worker: u64,
    /// Activation bytes a worker read from its own shelf (the next stage ran where the last did).
    pub same_worker: u64,
    /// Final outputs the foreman received, bytes.
    pub outputs_to_foreman: u64,
}

impl ActivationBytes {
    /// The foreman's share of the activation bytes that moved between nodes (NaN when none did).
    pub fn foreman_share(&self) -> f64 {
        let all = self.via_foreman + self.worker_to_worker;
        if all == 0 { f64::NAN } else { self.via_foreman as f64 / all as f64 }
    }
}

/// Progress events for observers (tests use them to kill a worker mid-job).
#[derive(Clone, Debug, PartialEq)]
pub enum Progress {
    /// A task was sent to a worker.
    Assigned {
        /// The task.
        task: TaskId,
        /// Node name of the worker.
        node: String,
    },
    /// A task completed.
    Done {
        /// The task.
        task: TaskId,
    },
    /// A worker was declared lost.
    Lost {
        /// Its node.
        node: String,
    },
    /// A lost worker was put back in service.
    Rejoined {
        /// Its node.
        node: String,
    },
}
