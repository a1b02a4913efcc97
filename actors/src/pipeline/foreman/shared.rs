//! What every incarnation of one foreman job shares ([`ForemanShared`]: the job, the workers
//! found, the links, the ledger, the job's clock) and what an incarnation is told
//! ([`ForemanInput`]).

use std::sync::Arc;

use ractor::ActorRef;
use tokio::sync::mpsc;
use tracing::warn;
use troupe_kernels::onnx::NamedTensor;
use troupe_transport::NodeLink;

use super::super::job::PipelineJob;
use super::super::ledger::Ledger;
use super::super::wire::{BlobShelf, Joined};
use super::calls::{Event, WorkerHandle, WorkerLinks};
use super::{JobOutcome, Progress, ShellError, ShellSettings, Target};
use crate::clock::Clock;
use crate::kinds::scheduler::SchedulerMsg;
use crate::service::Services;
use crate::typed::Actors;

/// What the foreman scheduler is told.
pub(super) enum ForemanInput {
    /// An executor's answer, telemetry or a rejoin.
    Event(Event),
    /// Membership says this node is down.
    Down(String),
    /// A member came up or announced services: lost workers may be back.
    Announced,
    /// This incarnation's workers were looked up and joined (one per target, in order).
    Enlisted(Vec<Enlisted>),
}

/// What every foreman incarnation of one job shares: the job, the workers found, the answers
/// given so far (each input's last-stage outputs, answered at most once) and where the result
/// goes. A restarted incarnation submits only the inputs not answered yet.
pub(super) struct ForemanShared {
    pub(super) link: NodeLink,
    pub(super) services: Services,
    pub(super) actors: Actors,
    /// One ordered call queue per worker, across foreman incarnations.
    pub(super) links: WorkerLinks,
    pub(super) shelf: BlobShelf,
    pub(super) job: Arc<PipelineJob>,
    pub(super) settings: ShellSettings,
    pub(super) progress: Option<mpsc::UnboundedSender<Progress>>,
    pub(super) targets: Vec<Target>,
    /// The job's clock: every incarnation's scheduler shell reads it, so policy times, spans
    /// and the timer share one time base across restarts.
    pub(super) clock: Clock,
    pub(super) ledger: std::sync::Mutex<Ledger>,
    pub(super) finished:
        std::sync::Mutex<Option<tokio::sync::oneshot::Sender<Result<JobOutcome, ShellError>>>>,
    pub(super) scheduler: std::sync::Mutex<Option<ActorRef<SchedulerMsg<ForemanInput>>>>,
    pub(super) incarnations: std::sync::atomic::AtomicUsize,
    /// The job's end is decided (its stats are being gathered): a later incarnation starts nothing.
    pub(super) ending: std::sync::atomic::AtomicBool,
}

impl ForemanShared {
    /// Records an answer (journaled first when the job has a journal); a journal that cannot
    /// take it ends the job with the reason, since an answer that is not durable must not count.
    pub(super) fn answer(&self, input: usize, outputs: &[NamedTensor]) {
        let result =
            self.ledger.lock().unwrap_or_else(std::sync::PoisonError::into_inner).answer(input, outputs);
        match result {
            Ok(true) => crate::work::PIPELINE.done(),
            Ok(false) => warn!(input, "input already answered; the second answer is dropped"),
            Err(e) => self.finish(Err(ShellError::Journal(e.to_string()))),
        }
    }

    /// Each input's answer so far.
    pub(super) fn answers(&self) -> Vec<Option<Vec<NamedTensor>>> {
        self.ledger.lock().unwrap_or_else(std::sync::PoisonError::into_inner).answers().to_vec()
    }

    pub(super) fn finish(&self, result: Result<JobOutcome, ShellError>) {
        if let Some(tx) = self.finished.lock().ok().and_then(|mut f| f.take()) {
            let _ = tx.send(result);
        }
    }

    pub(super) fn tell(&self, input: ForemanInput) {
        let scheduler = self.scheduler.lock().ok().and_then(|s| s.clone());
        if let Some(s) = scheduler {
            let _ = SchedulerMsg::tell(&s, input);
        }
    }
}

/// One worker as an incarnation's join left it.
pub(super) struct Enlisted {
    /// The handle its link calls through.
    pub(super) actor: WorkerHandle,
    /// Its link's generation (0: no link).
    pub(super) generation: u64,
    /// Its join answer (`None`: not found, or it did not join).
    pub(super) joined: Option<Joined>,
}
