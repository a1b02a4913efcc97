//! The foreman as a long-lived service: a node hosting a `pipeline-foreman` actor takes jobs
//! from clients over QUIC ([`FOREMAN_SERVICE`], method [`SUBMIT`], client role only) and
//! answers each with its outputs.
//!
//! - **What travels.** A [`Submission`] names each stage file by its BLAKE3 and size; the
//!   foreman pulls the bytes from the client's blob shelf (capped at the stage-file cap before
//!   anything is allocated), checks the chain and the inputs exactly as a local job is checked,
//!   and only then accepts the job. Outputs come back in the answer (large tensors by reference
//!   from the foreman's shelf, as between workers).
//! - **One job at a time, a bounded queue.** Jobs run in arrival order over the cluster's
//!   workers; a job that finds [`MAX_QUEUED_JOBS`] waiting is refused with `busy` (backpressure),
//!   never queued without bound.
//! - **Durable acceptance.** Each job is journaled on the foreman's node under its digest
//!   (`JOURNAL_DIR/<digest>.journal`): a client that resubmits the same job after the foreman's
//!   node died gets the answers journaled before the crash without recomputing them.
//! - **Workers.** Each job waits for the configured number of workers (woken by service
//!   announcements), so a worker that joined since the last job is used by the next.

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use ractor::{Actor, ActorProcessingErr, ActorRef};
use rkyv::{Archive, Deserialize, Serialize};
use tokio::sync::Semaphore;
use troupe_kernels::onnx::NamedTensor;
use troupe_policy::pipeline::Mode;
use troupe_transport::codec::DecodeBudget;
use troupe_transport::{NodeId, NodeLink, Role};

use super::foreman::{AcceptedJob, ShellSettings, run_pipeline_job};
use super::job::{MAX_INPUTS, StageFile, build_job};
use super::ledger::job_digest;
use super::sim_stage::SimStage;
use super::wire::{
    BlobShelf, EncodeTally, MAX_MESSAGE_DECODED_BYTES, WireError, WireNamed, decode_tensors, encode_tensors,
    from_bytes, to_bytes,
};
use super::worker::MAX_STAGE_BYTES;
use crate::MembershipEvents;
use crate::service::{Allow, CallError, Handler, ServiceSpec, Services};
use crate::typed::Actors;

/// The service a `pipeline-foreman` actor serves.
pub const FOREMAN_SERVICE: &str = "pipeline-foreman";
/// Its one method: run a job, answer with the outputs.
pub const SUBMIT: &str = "submit";
/// Jobs waiting behind the running one before new ones are refused as busy.
pub const MAX_QUEUED_JOBS: usize = 4;
/// Most stages one submitted job may have.
pub const MAX_STAGES: usize = 32;
/// Most stage-file bytes one submitted job may make the foreman pull and hold.
pub const MAX_JOB_STAGE_BYTES: u64 = 2 << 30;

/// One stage file of a submission: pulled from the client by its BLAKE3.
#[derive(Archive, Serialize, Deserialize, Clone, Debug, PartialEq)]
pub struct StageRef {
    /// The stage's name (for messages).
    pub name: String,
    /// BLAKE3 of the file: the blob id on the client's shelf.
    pub blob: [u8; 32],
    /// Its size in bytes.
    pub size: u64,
}

/// A job as a client submits it.
#[derive(Archive, Serialize, Deserialize, Debug)]
pub struct Submission {
    /// The stage files, in chain order.
    pub stages: Vec<StageRef>,
    /// Per input, its tensors.
    pub inputs: Vec<Vec<WireNamed>>,
    /// Streaming (true) or barrier dependencies.
    pub streaming: bool,
    /// Send activations as bf16 (lossy).
    pub lossy_bf16: bool,
}

/// What the foreman answers a submission with.
#[derive(Archive, Serialize, Deserialize, Debug)]
pub struct SubmitReply {
    /// Per input, the last stage's outputs.
    pub outputs: Vec<Vec<WireNamed>>,
    /// Submission to the last answer, seconds.
    pub makespan_s: f64,
    /// Inputs answered from the journal of an earlier run of this job.
    pub resumed: u32,
    /// The workers that ran it.
    pub workers: Vec<String>,
}

/// Settings of a foreman service.
#[derive(Clone, Debug)]
pub struct ServiceSettings {
    /// How each job runs (workers to wait for, timeouts, policy).
    pub job: ShellSettings,
    /// Where job journals go.
    pub journal_dir: PathBuf,
}

/// Why a submission failed, on the client's side.
#[derive(Debug, thiserror::Error)]
pub enum SubmitError {
    /// The job could not be encoded, or the answer decoded.
    #[error(transparent)]
    Wire(#[from] WireError),
    /// The foreman refused or failed the job, or could not be reached.
    #[error(transparent)]
    Call(#[from] CallError),
    /// No connection to the foreman's node.
    #[error("connecting to the foreman: {0}")]
    Connect(String),
}

/// What a client gets back.
#[derive(Debug)]
pub struct Answer {
    /// Per input, the last stage's outputs.
    pub outputs: Vec<Vec<NamedTensor>>,
    /// Submission to the last answer, as the foreman measured it, seconds.
    pub makespan_s: f64,
    /// Inputs answered from the foreman's journal.
    pub resumed: u32,
    /// The workers that ran it.
    pub workers: Vec<String>,
}

/// The foreman service's state shared by its calls.
struct Foreman {
    link: NodeLink,
    actors: Actors,
    membership: MembershipEvents,
    shelf: BlobShelf,
    settings: ServiceSettings,
    running: Semaphore,
    waiting: AtomicUsize,
    /// Task and load times learned by the last job, for the next (the policy's
    /// `ForemanConfig::remember_costs`): the crowd outlives its jobs.
    costs: std::sync::Mutex<Option<troupe_policy::pipeline::costs::CostModel>>,
    /// Set when the service actor stops: the jobs it admitted end with it (their calls'
    /// tasks would otherwise outlive it, and a restarted service resumes them from the journal).
    stopped: tokio::sync::watch::Receiver<bool>,
}

impl Foreman {
    /// Admits one submission from `client` (a bounded number wait; past it: busy), then pulls,
    /// checks and runs it. Admission comes before the pulls, so at most the admitted jobs'
    /// stage files are ever held.
    async fn submit(&self, client: &NodeId, body: &[u8]) -> Result<Vec<u8>, String> {
        let sub: Submission = from_bytes("submission", body).map_err(|e| e.to_string())?;
        // the running job counts as one of `waiting`
        if self.waiting.fetch_add(1, Ordering::SeqCst) > MAX_QUEUED_JOBS {
            self.waiting.fetch_sub(1, Ordering::SeqCst);
            return Err(format!(
                "busy: {MAX_QUEUED_JOBS} jobs already wait for this foreman; submit again later"
            ));
        }
        let mut stopped = self.stopped.clone();
        let result = tokio::select! {
            r = self.admitted(client, sub) => r,
            _ = stopped.wait_for(|s| *s) => Err("the foreman service stopped".into()),
        };
        self.waiting.fetch_sub(1, Ordering::SeqCst);
        result
    }

    async fn admitted(&self, client: &NodeId, sub: Submission) -> Result<Vec<u8>, String> {
        if sub.stages.is_empty() || sub.stages.len() > MAX_STAGES {
            return Err(format!("a job needs 1..={MAX_STAGES} stages, this one has {}", sub.stages.len()));
        }
        if sub.inputs.is_empty() || sub.inputs.len() > MAX_INPUTS {
            return Err(format!("a job needs 1..={MAX_INPUTS} inputs, this one has {}", sub.inputs.len()));
        }
        let total: u64 = sub.stages.iter().map(|s| s.size).fold(0, u64::saturating_add);
        if total > MAX_JOB_STAGE_BYTES {
            return Err(format!(
                "the stage files total {total} bytes, above the {MAX_JOB_STAGE_BYTES}-byte cap"
            ));
        }
        let mut stages = Vec::with_capacity(sub.stages.len());
        for s in &sub.stages {
            if s.size > MAX_STAGE_BYTES {
                return Err(format!(
                    "stage {}: {} bytes is above the {MAX_STAGE_BYTES}-byte cap",
                    s.name, s.size
                ));
            }
            let cap = u32::try_from(s.size).map_err(|_| format!("stage {}: {} bytes", s.name, s.size))?;
            let bytes = self
                .link
                .fetch_blob(client, s.blob, cap)
                .await
                .map_err(|e| format!("pulling stage {} from {client}: {e}", s.name))?;
            if *blake3::hash(&bytes).as_bytes() != s.blob || bytes.len() as u64 != s.size {
                return Err(format!("stage {}: the pulled bytes do not match its BLAKE3 and size", s.name));
            }
            let origin = format!("{client}:{}", s.name);
            // a simulated node's stages are the stand-in's files, read without ONNX Runtime
            let stage = match &self.link {
                NodeLink::Sim(_) => SimStage::from_file(&bytes)
                    .map(|sim| StageFile { origin: origin.clone(), ..sim.stage_file() })
                    .map_err(|e| format!("stage {}: {e}", s.name))?,
                NodeLink::Quic(_) => {
                    StageFile::from_bytes(&s.name, &origin, bytes).map_err(|e| e.to_string())?
                }
            };
            stages.push(stage);
        }
        let mut budget = DecodeBudget::new(MAX_MESSAGE_DECODED_BYTES);
        let mut inputs = Vec::with_capacity(sub.inputs.len());
        for tensors in sub.inputs {
            inputs.push(
                decode_tensors(tensors, &self.link, client.as_str(), &mut budget)
                    .await
                    .map_err(|e| format!("inputs: {e}"))?,
            );
        }
        let mode = if sub.streaming { Mode::Streaming } else { Mode::Barrier };
        let job = build_job(stages, inputs, mode, sub.lossy_bf16).map_err(|e| e.to_string())?;

        // one job runs at a time, in arrival order
        match self.running.acquire().await {
            Ok(_turn) => self.run(client, job).await,
            Err(e) => Err(format!("the foreman is shutting down: {e}")),
        }
    }

    async fn run(&self, client: &NodeId, job: super::job::PipelineJob) -> Result<Vec<u8>, String> {
        let digest = job_digest(&job);
        let stage_ids: Vec<[u8; 32]> =
            job.stages.iter().map(|s| *blake3::hash(&s.bytes).as_bytes()).collect();
        let hex: String = digest.iter().take(12).map(|b| format!("{b:02x}")).collect();
        let journal = self.settings.journal_dir.join(format!("{hex}.journal"));
        let (n, s) = (job.inputs.len(), job.stages.len());
        let (accepted, resumed) = AcceptedJob::open(job, Some(&journal)).map_err(|e| e.to_string())?;
        tracing::info!(%client, job = %hex, inputs = n, stages = s, resumed = resumed.answered, "pipeline job accepted");
        let mut settings = self.settings.job.clone();
        settings.prior_costs = self.costs.lock().ok().and_then(|c| c.clone());
        let outcome = run_pipeline_job(
            &self.actors,
            &self.shelf,
            self.membership.subscribe(),
            accepted,
            settings,
            None,
        )
        .await;
        if let (Ok(o), Ok(mut c)) = (&outcome, self.costs.lock())
            && o.learned_costs.is_some()
        {
            c.clone_from(&o.learned_costs);
        }
        for id in &stage_ids {
            self.shelf.unpin(id);
        }
        let outcome = outcome.map_err(|e| e.to_string())?;
        let mut tally = EncodeTally::default();
        let outputs = outcome
            .outputs
            .iter()
            .map(|o| encode_tensors(o, false, &self.shelf, &mut tally))
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| e.to_string())?;
        let reply = SubmitReply {
            outputs,
            makespan_s: outcome.makespan_s,
            resumed: resumed.answered as u32,
            workers: outcome.workers.iter().map(|w| w.node.clone()).collect(),
        };
        let bytes = to_bytes("answer", &reply).map_err(|e| e.to_string())?;
        // answered: the journal has done its job
        if let Some(path) = &outcome.journal
            && let Err(e) = std::fs::remove_file(path)
        {
            tracing::warn!(path = %path.display(), error = %e, "could not remove a finished job's journal");
        }
        tracing::info!(%client, job = %hex, makespan_s = outcome.makespan_s, "pipeline job answered");
        Ok(bytes)
    }
}

/// Arguments of the foreman service actor.
#[derive(Clone)]
pub struct ForemanServiceArgs {
    /// The node's typed-actor registry (its link and service router with it): the workers are
    /// reached through it.
    pub actors: Actors,
    /// The node's membership events.
    pub membership: MembershipEvents,
    /// The service's settings.
    pub settings: ServiceSettings,
}

/// The actor that serves [`FOREMAN_SERVICE`] while it runs (registers it on start; a restart
/// registers it again). Jobs run on the calls' own tasks, each under its own supervised
/// foreman ([`run_pipeline_job`]).
pub struct ForemanServiceActor;

impl Actor for ForemanServiceActor {
    type Msg = ();
    type State = (Arc<ForemanServiceArgs>, tokio::sync::watch::Sender<bool>);
    type Arguments = ForemanServiceArgs;

    async fn pre_start(
        &self,
        _me: ActorRef<Self::Msg>,
        args: ForemanServiceArgs,
    ) -> Result<Self::State, ActorProcessingErr> {
        let shelf = BlobShelf::default();
        let link = args.actors.link().clone();
        link.set_blob_server(Arc::new(shelf.clone()));
        let (stop, stopped) = tokio::sync::watch::channel(false);
        let foreman = Arc::new(Foreman {
            stopped,
            link,
            actors: args.actors.clone(),
            membership: args.membership.clone(),
            shelf,
            settings: args.settings.clone(),
            running: Semaphore::new(1),
            waiting: AtomicUsize::new(0),
            costs: std::sync::Mutex::new(None),
        });
        let handler: Handler = Arc::new(move |caller, _method, body| {
            let foreman = foreman.clone();
            Box::pin(async move { foreman.submit(&caller.node, &body).await })
        });
        args.actors.services().register(
            FOREMAN_SERVICE,
            ServiceSpec::new().method(SUBMIT, Allow::role(Role::Client)),
            handler,
        );
        Ok((Arc::new(args), stop))
    }

    async fn post_stop(
        &self,
        _me: ActorRef<Self::Msg>,
        (args, stop): &mut Self::State,
    ) -> Result<(), ActorProcessingErr> {
        args.actors.services().unregister(FOREMAN_SERVICE);
        stop.send_replace(true);
        Ok(())
    }
}

/// A client of a foreman service: its own QUIC endpoint (not a cluster member), or a simulated
/// node's link; a service router for the answers and a blob shelf the foreman pulls stage files
/// from.
pub struct ForemanClient {
    link: NodeLink,
    services: Services,
    shelf: BlobShelf,
    foreman: NodeId,
}

impl ForemanClient {
    /// Connects to the foreman's node at `addr` as `identity` (a certificate of the cluster
    /// with the client role: submitting a job needs no right to command workers).
    pub async fn connect(
        identity: &troupe_transport::NodeIdentity,
        addr: std::net::SocketAddr,
    ) -> Result<Self, SubmitError> {
        let shelf = BlobShelf::default();
        let client = crate::service::ServiceClient::connect(identity, addr, Some(Arc::new(shelf.clone())))
            .await
            .map_err(|e| SubmitError::Connect(e.to_string()))?;
        let crate::service::ServiceClient { link, services, server: foreman } = client;
        Ok(ForemanClient { link: NodeLink::from(link), services, shelf, foreman })
    }

    /// A client on a node's own `actors` (a simulated cluster's client node) calling the
    /// foreman on `foreman`: installs a fresh blob shelf as the node's blob server.
    pub fn on_node(actors: &Actors, foreman: NodeId) -> Self {
        let shelf = BlobShelf::default();
        let link = actors.link().clone();
        link.set_blob_server(Arc::new(shelf.clone()));
        ForemanClient { link, services: actors.services().clone(), shelf, foreman }
    }

    /// The foreman's node.
    pub fn foreman(&self) -> &NodeId {
        &self.foreman
    }

    /// Submits a job and waits for its outputs (at most `timeout`).
    pub async fn submit(
        &self,
        stages: &[StageFile],
        inputs: &[Vec<NamedTensor>],
        mode: Mode,
        timeout: Duration,
    ) -> Result<Answer, SubmitError> {
        let stage_refs: Vec<StageRef> = stages
            .iter()
            .map(|s| StageRef {
                name: s.signature.name.clone(),
                blob: self.shelf.pin(s.bytes.clone()),
                size: s.bytes.len() as u64,
            })
            .collect();
        let ids: Vec<[u8; 32]> = stage_refs.iter().map(|s| s.blob).collect();
        let result = self.call(stage_refs, inputs, mode, timeout).await;
        for id in &ids {
            self.shelf.unpin(id);
        }
        result
    }

    async fn call(
        &self,
        stages: Vec<StageRef>,
        inputs: &[Vec<NamedTensor>],
        mode: Mode,
        timeout: Duration,
    ) -> Result<Answer, SubmitError> {
        let mut tally = EncodeTally::default();
        let inputs = inputs
            .iter()
            .map(|t| encode_tensors(t, false, &self.shelf, &mut tally))
            .collect::<Result<Vec<_>, _>>()?;
        let sub = Submission { stages, inputs, streaming: mode == Mode::Streaming, lossy_bf16: false };
        let body = to_bytes("submission", &sub)?;
        let answer = self.services.call(&self.foreman, FOREMAN_SERVICE, SUBMIT, body, timeout).await?;
        let reply: SubmitReply = from_bytes("answer", &answer)?;
        let mut budget = DecodeBudget::new(MAX_MESSAGE_DECODED_BYTES);
        let mut outputs = Vec::with_capacity(reply.outputs.len());
        for o in reply.outputs {
            outputs.push(decode_tensors(o, &self.link, self.foreman.as_str(), &mut budget).await?);
        }
        Ok(Answer { outputs, makespan_s: reply.makespan_s, resumed: reply.resumed, workers: reply.workers })
    }

    /// Closes the connection.
    pub async fn close(self) {
        if let Some(q) = self.link.quic() {
            q.shutdown().await;
        }
    }
}
