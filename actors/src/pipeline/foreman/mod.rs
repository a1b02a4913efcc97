//! The foreman shell: carries out the decisions of `troupe_policy::pipeline::Foreman` over the
//! cluster.
//!
//! It finds the workers (members announcing a typed [`super::PipelineWorker`] actor named
//! [`super::worker_name`]`(NODE)`; each message is role-checked, for the `scheduler` role only), asks
//! each to join, submits the job to the policy and then loops: policy actions become calls on
//! the worker's link, one ordered queue per worker ([`crate::typed::Links`]: performed in
//! order, one call at a time, so a `Fetch` lands before the `Load` after it); outcomes come back
//! tagged with the link's generation (an outcome of a generation since replaced or ended is
//! ignored), and with telemetry (polled every `telemetry_period` by a direct typed call, RTT
//! from QUIC) and membership events they go back into the policy. Completed outputs are held
//! here, so a lost worker loses only what it was doing. A worker is declared lost when
//! membership says it is down, when a call to it finds its incarnation gone or gets no answer
//! within the timeout (`ActorError::PeerLost`, `ActorError::Timeout`: its link ends), or when
//! its telemetry answers with another pid than the one that joined (its node was killed and
//! started again before membership noticed: the calls out to the dead process would otherwise
//! wait out the call timeout, as the replaced connection never reports the peer gone); its
//! tasks are re-planned by the policy and each move is logged. A refused message or a worker's
//! own failure (`Forbidden`, `BadMessage`, `Failed`) is a problem with the request, not a lost
//! worker.
//!
//! Shape, stated plainly: the foreman is a [`crate::SchedulerActor`] under a supervisor of its
//! own in the foreman node's process (not the node's root supervisor: a job owns it), and a
//! restart resubmits the inputs not answered yet. Answers live in the job's [`super::Ledger`]: with a
//! journal (the `pipeline` job's default), the acceptance and every answer are synced to disk
//! before they count, so a foreman node killed with `kill -9` and started again resumes the job
//! with the unanswered inputs only (see [`AcceptedJob::open`]); telemetry is pulled (one RPC per worker per period) rather than
//! pushed. Activations go from the producing worker to the consuming one: a worker running an
//! intermediate stage keeps its outputs on its blob shelf and answers with references
//! ([`super::wire::TensorBody::At`]); the foreman passes those references on in the next stage's `Run`, and
//! that worker pulls the bytes from the producer over the QUIC blob stream (or reads its own
//! shelf when it made them). The foreman carries control, job inputs and the last stage's
//! answers only; the bytes are counted as they move ([`ActivationBytes`]). Outputs kept on a
//! worker that is lost before the next stage read them are made again (the policy's
//! `handle_outputs_lost`). A lost worker whose node comes back (its worker actor announced again)
//! is joined again under its old id and put back in service, on a new link, within the same job.

//!
//! Layout: `settings` and `outcome` are what a job is given and reports; `calls` are the
//! calls made on workers (off the actor); `shell` is one incarnation's state and how it carries
//! out decisions (who is in service is the policy's [`troupe_policy::roster::Roster`]);
//! `shared` is what a job's incarnations share; `incarnation` is the scheduler half (joining,
//! the timer, the end).

mod calls;
mod incarnation;
mod outcome;
mod settings;
mod shared;
mod shell;

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use tokio::sync::{broadcast, mpsc};
use tracing::warn;
use troupe_policy::MembershipEvent;
use troupe_transport::NodeId;

use super::wire::BlobShelf;
use super::worker::WORKER_PREFIX;
use crate::clock::Clock;
use crate::kinds::scheduler::{SchedulerActor, SchedulerArgs};
use crate::service::Services;
use crate::supervisor::{ChildSpec, Intensity, Supervisor, SupervisorArgs, SupervisorEvent};
use crate::typed::{Actors, Links, Outcome, service_name};
use calls::{Event, EventKind, Step, WorkerLinks};
use incarnation::ForemanScheduler;
pub use outcome::{ActivationBytes, JobOutcome, Progress, Span, SpanKind, TaskTimes, WorkerSummary};
pub use settings::{AcceptedJob, ShellError, ShellSettings};
use shared::{ForemanInput, ForemanShared};

/// Fault-switch site hit once per foreman input.
pub const FAULT_SITE: &str = "pipeline.scheduler";

/// A member's worker: its node and its typed-actor name.
pub(super) type Target = (NodeId, String);

/// Waits for `settings.workers` remote pipeline workers (members that announced a worker
/// actor; woken by announcements, not polling) and returns them sorted by node name.
async fn discover(services: &Services, settings: &ShellSettings) -> Result<Vec<Target>, ShellError> {
    let prefix = service_name(WORKER_PREFIX);
    let at = service_name("");
    let named = |found: Vec<(NodeId, String)>| -> Vec<Target> {
        found
            .into_iter()
            .filter_map(|(peer, service)| {
                let name = service.strip_prefix(at.as_str())?.to_owned();
                Some((peer, name))
            })
            .collect()
    };
    let wanted = settings.workers;
    match services
        .wait_for(settings.join_timeout, |s| {
            let found = s.services_with_prefix(&prefix);
            (found.len() >= wanted).then_some(found)
        })
        .await
    {
        Some(found) => Ok(named(found)),
        None => Err(ShellError::TooFewWorkers {
            found: services.services_with_prefix(&prefix).len(),
            wanted,
            secs: settings.join_timeout.as_secs(),
        }),
    }
}

/// A job's foreman supervisor and event forwarder, stopped when dropped: a job whose caller is
/// gone (its future dropped, as when the foreman service stops) ends with it.
struct JobGuard {
    sup: ractor::ActorCell,
    forwarder: tokio::task::AbortHandle,
}

impl Drop for JobGuard {
    fn drop(&mut self) {
        self.forwarder.abort();
        self.sup.stop(None);
    }
}

/// Distinguishes the registered names of foreman actors of concurrent jobs in one process.
static FOREMAN_JOBS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// Runs one job over the workers of the cluster and returns its outputs and metrics.
///
/// The foreman runs as a [`crate::SchedulerActor`] under a supervisor of its own (restart
/// intensity: 3 in 60 s); what it has answered lives outside it, so a panic (for instance
/// through the fault switch, site [`FAULT_SITE`]) restarts it and the new incarnation
/// resubmits only the unanswered inputs. `actors` (the typed-actor registry, through which the
/// workers are reached) and `membership` are the foreman node's; `shelf` must be installed as
/// its blob server.
pub async fn run_pipeline_job(
    actors: &Actors,
    shelf: &BlobShelf,
    mut membership: broadcast::Receiver<MembershipEvent<NodeId>>,
    job: impl Into<AcceptedJob>,
    settings: ShellSettings,
    progress: Option<mpsc::UnboundedSender<Progress>>,
) -> Result<JobOutcome, ShellError> {
    let AcceptedJob { job, ledger } = job.into();
    let link = actors.link();
    let services = actors.services();
    let targets = discover(services, &settings).await?;
    for s in &job.stages {
        shelf.pin(s.bytes.clone());
    }
    let (done_tx, done_rx) = tokio::sync::oneshot::channel();
    // the links' outcomes, tagged with worker and generation, go to the live incarnation
    let (steps_tx, mut steps) = mpsc::unbounded_channel::<Event>();
    let links: WorkerLinks = Links::new(Arc::new(move |worker, generation, outcome| {
        let ev = match outcome {
            Outcome::Done(Step { start, end, kind }) => Event { worker, generation, start, end, kind },
            Outcome::Failed(e) | Outcome::Lost(e) => {
                Event { worker, generation, start: 0.0, end: 0.0, kind: EventKind::Lost(e.to_string()) }
            }
        };
        let _ = steps_tx.send(ev);
    }));
    let shared = Arc::new(ForemanShared {
        link: link.clone(),
        services: services.clone(),
        actors: actors.clone(),
        links,
        shelf: shelf.clone(),
        job: Arc::new(job),
        settings,
        progress,
        targets,
        clock: Clock::start(),
        ledger: std::sync::Mutex::new(ledger),
        finished: std::sync::Mutex::new(Some(done_tx)),
        scheduler: std::sync::Mutex::new(None),
        incarnations: std::sync::atomic::AtomicUsize::new(0),
        ending: std::sync::atomic::AtomicBool::new(false),
    });
    let name = format!("pipeline-foreman-{}", FOREMAN_JOBS.fetch_add(1, Ordering::Relaxed));
    let spec = {
        let shared = shared.clone();
        ChildSpec::new(name.clone(), move || {
            (
                SchedulerActor::<ForemanScheduler>::default(),
                SchedulerArgs {
                    scheduler: ForemanScheduler::new(shared.clone()),
                    fault_site: shared.settings.fault_site.clone(),
                },
            )
        })
    };
    let (sup_events, mut failures) = broadcast::channel(16);
    let args = SupervisorArgs {
        name: format!("{name}-supervisor"),
        children: vec![spec],
        intensity: Intensity { max_restarts: 3, period: Duration::from_secs(60) },
        events: sup_events,
    };
    let (sup, sup_handle) = ractor::Actor::spawn(None, Supervisor, args)
        .await
        .map_err(|e| ShellError::Refused(format!("starting the foreman: {e}")))?;
    let mut announcements = services.subscribe_announcements();
    let forwarder = {
        let shared = shared.clone();
        tokio::spawn(async move {
            loop {
                tokio::select! {
                    m = membership.recv() => match m {
                        Ok(MembershipEvent::Down { member, .. }) => shared.tell(ForemanInput::Down(member.as_str().to_owned())),
                        Ok(MembershipEvent::Up { .. }) => shared.tell(ForemanInput::Announced),
                        Err(broadcast::error::RecvError::Lagged(_)) => {}
                        Err(broadcast::error::RecvError::Closed) => return,
                    },
                    a = announcements.recv() => match a {
                        Ok(_) | Err(broadcast::error::RecvError::Lagged(_)) => shared.tell(ForemanInput::Announced),
                        Err(broadcast::error::RecvError::Closed) => return,
                    },
                    ev = steps.recv() => match ev {
                        Some(ev) => shared.tell(ForemanInput::Event(ev)),
                        None => return,
                    },
                }
            }
        })
    };
    let _guard = JobGuard { sup: sup.get_cell(), forwarder: forwarder.abort_handle() };
    let mut done_rx = done_rx;
    let result = loop {
        tokio::select! {
            r = &mut done_rx => break r.unwrap_or(Err(ShellError::Refused("the foreman stopped".into()))),
            ev = failures.recv() => match ev {
                Ok(SupervisorEvent::Escalated { reason, .. }) => {
                    break Err(ShellError::Refused(format!("the foreman failed past its restart intensity: {reason}")));
                }
                Ok(SupervisorEvent::Restarted { reason, .. }) => warn!(%reason, "pipeline foreman restarted"),
                Err(broadcast::error::RecvError::Lagged(_)) => {}
                Err(broadcast::error::RecvError::Closed) => {
                    break Err(ShellError::Refused("the foreman's supervisor stopped".into()));
                }
            },
        }
    };
    forwarder.abort();
    sup.stop(None);
    let _ = sup_handle.await;
    // every link ends with the job (its queue task with it)
    for i in 0..shared.targets.len() {
        shared.links.detach(&i);
    }
    let journal = shared.ledger.lock().unwrap_or_else(std::sync::PoisonError::into_inner).finish();
    result.map(|outcome| JobOutcome { journal, ..outcome })
}
