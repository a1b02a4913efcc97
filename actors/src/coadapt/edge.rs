//! The edge: receives uploads from cameras (typed messages to its front, the [`EdgeActor`]
//! named [`EDGE_ACTOR`]: [`Upload`] and [`Report`], for the `camera` role only), labels them
//! with the teacher, co-adapts in the [`EdgeEngine`] cycle by cycle on a blocking thread, and answers each camera with its
//! adapted parameters. Uploads are admitted as they arrive, between cycles (an upload's
//! `Accepted` input queues behind the cycle running, the next `Cycle` behind it), so a camera
//! that drifts late or joins late joins the tasks already adapting rather than waiting for a
//! batch. Cameras' progress reports (accuracy over time, adaptations, stream ended) are kept
//! per camera for the job, which is answered once every camera it expects is done.
//!
//! The scheduler runs in the runtime's one [`SchedulerActor`] shell under the node's supervisor,
//! and the work it has accepted lives apart from it in [`EdgeShared`], which the front holds
//! (so the front outlives scheduler restarts, and a restarted front holds the same store). The
//! front accepts an upload in its turn and answers it later ([`Reply::Later`]): its mailbox goes
//! on to the next camera's upload or report while the adaptation runs: an upload is accepted
//! into the store (with the camera's reply channel) before the scheduler hears of it, camera
//! reports and summary waiters are kept there too. A restarted scheduler rebuilds its engine
//! and admits every accepted upload not yet answered again, so a panic loses no adaptation and
//! answers none twice (a reply channel is consumed once). Uploads accepted while no incarnation
//! runs wait in the store.
//!
//! A camera restarted (its node killed and started again) streams from its first frame again and
//! uploads the same drift phases again (the same adaptation index at the same drift frame). Each
//! adapted phase's answer is kept per camera, and [`troupe_policy::adapt::replay::classify`]
//! decides what an upload is: a repeat of a phase under way waits for that adaptation's answer,
//! a repeat of an answered phase gets the kept answer again, so each phase of each camera is
//! adapted once and counted once (`tasks_done`), and the restarted camera's own report, which
//! replaces its old one, lists each phase once.
//!
//! Durable acceptance (the `edge_journal` module): with a journal, an upload is accepted, and a
//! report acknowledged, only once it is on the edge node's disk, and every answer is journaled
//! before it is sent. An edge node killed and started again replays the journal: the uploads it
//! held are adapted again (a camera whose call was lost asks again and waits for that
//! adaptation), answered phases keep their replies and count once, cameras' progress is known.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, Weak};

use ractor::{ActorProcessingErr, ActorRef, RpcReplyPort};
use rkyv::{Archive, Deserialize, Serialize};
use tokio::sync::oneshot;
use troupe_kernels::vmoe::pool::{monotonic_us, time_weighted_fragmentation};
use troupe_kernels::vmoe::train::{Dataset, predict_all};
use troupe_kernels::vmoe::{FragSample, VMoe};
use troupe_policy::Micros;
use troupe_policy::adapt::TaskId;
use troupe_policy::adapt::online::{CameraProgress, Completion, completion};
use troupe_policy::adapt::replay::{Phase, Seen, UploadKind, classify};
use troupe_transport::Role;

use super::edge_journal::{EdgeJournal, EdgeRecord};
use super::engine::{AdaptJob, EdgeEngine, EngineConfig, Finished};
use super::params::{install_trainable, trainable_params};
use super::sim_compute::{SimAdaptSpec, SimEdge, SimFinished};
use super::wire::{
    AdaptReply, DecodeBudget, EdgeSummary, MAX_ADAPTATIONS, MAX_DECODED_BYTES, StreamReport, UploadRequest,
    decode, encode,
};
use super::{EDGE_ACTOR, digits, student_config, zoo_student, zoo_teacher};
use crate::clock::Clock;
use crate::kinds::scheduler::{Scheduler, SchedulerActor, SchedulerArgs, SchedulerMsg};
use crate::service::Allow;
use crate::supervisor::ChildSpec;
use crate::typed::{
    ActorContext, ActorFailure, Actors, Handles, Protocol, RemoteMessage, Reply, SpawnError, TypedActor,
};

mod scheduler;

pub use scheduler::EdgeScheduler;

/// Fault-switch site hit once per edge scheduler input.
pub const FAULT_SITE: &str = "coadapt.scheduler";
/// Most cameras the edge keeps progress for; reports of further cameras are refused (logged).
pub const MAX_CAMERAS: usize = 256;
/// Most callers waiting for a summary at once; later ones are refused.
pub const MAX_WAITERS: usize = 64;
/// Most uploads one camera may have accepted and unanswered at once (a camera waits for one
/// adaptation before asking the next; the second slot covers a phase the camera gave up waiting
/// for). Past it the camera is refused, so one peer cannot take every task slot of the edge. A
/// restarted camera's repeat of a phase under way takes no slot: it waits for that phase's
/// answer (see [`MAX_CALLERS_PER_PHASE`]).
pub const MAX_UPLOADS_PER_CAMERA: usize = 2;
/// Most callers waiting for one phase's answer: the camera's upload and the repeats of
/// incarnations restarted while it is adapted (a dead incarnation's call still waits: its
/// handler runs until the answer).
pub const MAX_CALLERS_PER_PHASE: usize = 4;
/// Most bytes of adapted answers the edge keeps (to answer a restarted camera's repeated
/// uploads); past it new phases are refused until the job ends.
pub const MAX_KEPT_BYTES: usize = 64 << 20;

/// What the edge answers an upload with.
#[derive(Archive, Serialize, Deserialize, Clone, Debug, PartialEq)]
pub enum AdaptOutcome {
    /// Adapted.
    Adapted(AdaptReply),
    /// Refused, with the reason.
    Refused(String),
}

/// A camera's upload to the edge ([`EDGE_ACTOR`]): adapt its model to the frames it sent,
/// answered with the [`AdaptOutcome`] once adapted (or refused). Cameras only.
#[derive(Archive, Serialize, Deserialize, Clone, Debug, PartialEq)]
pub struct Upload(pub UploadRequest);

impl RemoteMessage for Upload {
    const NAME: &'static str = "upload";
    type Reply = AdaptOutcome;
}

/// A camera's progress so far ([`StreamReport`], replacing its previous one), to the edge.
/// Cameras only.
#[derive(Archive, Serialize, Deserialize, Clone, Debug, PartialEq)]
pub struct Report(pub StreamReport);

impl RemoteMessage for Report {
    const NAME: &'static str = "report";
    type Reply = ();
}

/// The edge's front: the typed actor cameras reach by name ([`EDGE_ACTOR`]), holding the
/// edge's [`EdgeShared`] store. Started by [`EdgeShared::children`].
pub struct EdgeActor {
    shared: Arc<EdgeShared>,
}

/// The edges of this process by key ([`EdgeActor`]'s start arguments: its store stays in this
/// process, so it is named, not sent).
static EDGES: Mutex<BTreeMap<u64, Weak<EdgeShared>>> = Mutex::new(BTreeMap::new());
/// The next key in [`EDGES`].
static NEXT_EDGE: AtomicU64 = AtomicU64::new(1);

impl TypedActor for EdgeActor {
    const KIND: &'static str = "coadapt-edge";
    /// The key of its [`EdgeShared`] in this process.
    type Args = u64;

    fn protocol(p: &mut Protocol<Self>) {
        p.request::<Upload>(Allow::role(Role::Camera)).request::<Report>(Allow::role(Role::Camera));
    }

    async fn start(key: u64, _: &ActorContext) -> Result<Self, ActorFailure> {
        let edges = EDGES.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        let shared = edges.get(&key).and_then(Weak::upgrade);
        shared
            .map(|shared| Self { shared })
            .ok_or_else(|| ActorFailure::msg(format!("no coadapt edge {key} in this process")))
    }
}

/// The node that sent the message being handled, by name.
fn sender(ctx: &ActorContext) -> &str {
    ctx.sender.as_ref().map_or("", |n| n.0.as_str())
}

impl Handles<Upload> for EdgeActor {
    async fn handle(&mut self, msg: Upload, ctx: &ActorContext) -> Result<AdaptOutcome, ActorFailure> {
        self.turn(msg, ctx).await?.wait().await
    }

    /// Checks and accepts the upload in the actor's turn; its answer comes once adapted.
    async fn turn(
        &mut self,
        Upload(request): Upload,
        ctx: &ActorContext,
    ) -> Result<Reply<AdaptOutcome>, ActorFailure> {
        if let Err(e) = request.check() {
            tracing::warn!(error = %e, "refusing an upload");
            return Ok(Reply::Now(AdaptOutcome::Refused(e.to_string())));
        }
        let camera = request.camera.clone();
        // an upload is charged to the camera that sent it: a node uploads only for itself
        if camera != sender(ctx) {
            let why = format!("node {} may not upload for camera {camera:?}", sender(ctx));
            tracing::warn!(%why, "refusing an upload");
            return Ok(Reply::Now(AdaptOutcome::Refused(why)));
        }
        match self.shared.accept(request) {
            Ok(rx) => Ok(Reply::Later(Box::pin(async move {
                let bytes = rx.await.map_err(|_| ActorFailure::msg("the edge dropped the upload"))?;
                Ok(decode::<AdaptOutcome>(
                    "adapt outcome",
                    &bytes,
                    &mut DecodeBudget::new(MAX_DECODED_BYTES),
                )?)
            }))),
            Err(why) => {
                tracing::warn!(%camera, %why, "refusing an upload");
                Ok(Reply::Now(AdaptOutcome::Refused(why)))
            }
        }
    }
}

impl Handles<Report> for EdgeActor {
    async fn handle(&mut self, Report(r): Report, ctx: &ActorContext) -> Result<(), ActorFailure> {
        if let Err(e) = r.check() {
            tracing::warn!(error = %e, "ignoring a camera report");
            return Err(e.into());
        }
        // a report replaces its camera's progress: a node reports only for itself
        if r.camera != sender(ctx) {
            let why = format!("node {} may not report for camera {:?}", sender(ctx), r.camera);
            tracing::warn!(%why, "ignoring a camera report");
            return Err(ActorFailure::msg(why));
        }
        self.shared.report(r).map_err(ActorFailure::msg)
    }
}

/// What the edge scheduler is told.
#[derive(Debug)]
pub enum EdgeInput {
    /// More uploads were accepted (read from the store).
    Accepted,
    /// A camera report or a summary waiter arrived (answer the waiters that can be).
    Reported,
    /// Run the next adaptation cycle (sent to itself).
    Cycle,
}

type EdgeRef = ActorRef<SchedulerMsg<EdgeInput>>;

/// Settings of the edge.
#[derive(Clone, Debug)]
pub struct EdgeArgs {
    /// Executor settings (pool budget, scheduler, epochs, target gain).
    pub engine: EngineConfig,
    /// Student sizes the cameras run (their shared parts and step buffers are reserved).
    pub expected: Vec<String>,
    /// What adapts: the real engine, or the simulation's stand-in.
    pub compute: EdgeCompute,
}

/// What the edge adapts on.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum EdgeCompute {
    /// The real engine: teacher labels, V-MoE pool, training steps on kernels.
    #[default]
    Real,
    /// The deterministic stand-in of a simulated cluster ([`SimEdge`]).
    Sim(SimAdaptSpec),
}

struct Accepted {
    request: UploadRequest,
    /// Every caller waiting for this phase's answer: the camera's upload, and a restarted
    /// camera's repeat of it.
    replies: Vec<oneshot::Sender<Vec<u8>>>,
}

fn phase_of(r: &UploadRequest) -> Phase {
    Phase { adaptation: r.adaptation, drift_frame: r.drift_frame }
}

/// An adapted phase's answer, kept for a restarted camera's repeat of the upload.
struct Kept {
    phase: Phase,
    reply: Vec<u8>,
}

#[derive(Default)]
struct Store {
    next: u64,
    accepted: BTreeMap<u64, Accepted>,
    /// Each camera's latest progress, in the order cameras were first heard from.
    cameras: Vec<StreamReport>,
    /// (cameras expected, reply): answered once every expected camera is done.
    waiters: Vec<(u32, RpcReplyPort<Vec<u8>>)>,
    /// Per camera, the answers of its adapted phases.
    kept: BTreeMap<String, Vec<Kept>>,
    /// Bytes in `kept`.
    kept_bytes: usize,
    done: u32,
    peak_used: u64,
    scheduler: Option<EdgeRef>,
    journal: Option<EdgeJournal>,
}

/// What an edge resumed from its journal ([`EdgeShared::open`]).
#[derive(Debug, Default)]
pub struct Resumed {
    /// Uploads accepted and not answered (adapted again).
    pub pending: usize,
    /// Phases adapted and answered.
    pub answered: u32,
    /// Cameras whose progress was known.
    pub cameras: usize,
    /// A damaged tail or a cut-short append: named, not replayed.
    pub damage: Vec<String>,
}

impl Store {
    /// Applies one journal record (checking it as peer input).
    fn replay(&mut self, record: EdgeRecord) -> Result<(), String> {
        match record {
            EdgeRecord::Accepted { key, request } => {
                let request = UploadRequest::decode(&request, &mut DecodeBudget::new(MAX_DECODED_BYTES))
                    .map_err(|e| e.to_string())?;
                self.next = self.next.max(key.saturating_add(1));
                if self.accepted.insert(key, Accepted { request, replies: Vec::new() }).is_some() {
                    return Err(format!("upload {key} accepted twice"));
                }
            }
            EdgeRecord::Answered { key } => {
                self.accepted
                    .remove(&key)
                    .ok_or_else(|| format!("upload {key} answered but never accepted"))?;
            }
            EdgeRecord::Kept { camera, adaptation, drift_frame, reply, peak_used } => {
                self.kept_bytes += reply.len();
                self.kept
                    .entry(camera)
                    .or_default()
                    .push(Kept { phase: Phase { adaptation, drift_frame }, reply });
                self.done += 1;
                self.peak_used = self.peak_used.max(peak_used);
            }
            EdgeRecord::Report { report } => {
                let r = StreamReport::decode(&report, &mut DecodeBudget::new(MAX_DECODED_BYTES))
                    .map_err(|e| e.to_string())?;
                let full = self.cameras.len() >= MAX_CAMERAS;
                match self.cameras.iter_mut().find(|c| c.camera == r.camera) {
                    Some(c) => *c = r,
                    None if full => return Err("more cameras than the edge keeps".into()),
                    None => self.cameras.push(r),
                }
            }
        }
        Ok(())
    }

    /// What a restart needs: the open uploads, the kept answers, each camera's latest report.
    fn live_records(&self) -> Vec<EdgeRecord> {
        let mut live: Vec<EdgeRecord> = self
            .accepted
            .iter()
            .map(|(&key, a)| EdgeRecord::Accepted { key, request: encode(&a.request) })
            .collect();
        for (camera, kept) in &self.kept {
            live.extend(kept.iter().map(|k| EdgeRecord::Kept {
                camera: camera.clone(),
                adaptation: k.phase.adaptation,
                drift_frame: k.phase.drift_frame,
                reply: k.reply.clone(),
                peak_used: self.peak_used,
            }));
        }
        live.extend(self.cameras.iter().map(|c| EdgeRecord::Report { report: encode(c) }));
        live
    }

    /// Journals `records` (nothing without a journal), compacting when due.
    fn journal(&mut self, records: &[EdgeRecord]) -> Result<(), String> {
        let Some(j) = self.journal.as_mut() else { return Ok(()) };
        j.append(records).map_err(|e| format!("journaling: {e}"))?;
        if j.due() {
            let live = self.live_records();
            if let Some(j) = self.journal.as_mut()
                && let Err(e) = j.compact(&live)
            {
                tracing::warn!(journal = %j.path().display(), "coadapt journal compaction failed: {e}");
            }
        }
        Ok(())
    }
}

/// The edge's accepted work, shared by its front ([`EdgeActor`]) and every scheduler incarnation.
pub struct EdgeShared {
    args: EdgeArgs,
    store: Mutex<Store>,
    /// The scheduler's fault-switch site ([`FAULT_SITE`] unless a simulation names one per run).
    fault_site: Mutex<String>,
}

fn lock(m: &Mutex<Store>) -> MutexGuard<'_, Store> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

fn refused(why: impl Into<String>) -> Vec<u8> {
    encode(&AdaptOutcome::Refused(why.into()))
}

impl EdgeShared {
    /// The edge's shared state; start its [`EdgeShared::children`].
    pub fn new(args: EdgeArgs) -> Arc<Self> {
        Arc::new(Self {
            args,
            store: Mutex::new(Store::default()),
            fault_site: Mutex::new(FAULT_SITE.into()),
        })
    }

    /// Like [`EdgeShared::new`], with the journal at `path`: what it holds is replayed (see the
    /// module docs), and from now on every acceptance and answer is journaled first. A journal
    /// that is corrupt (not just torn at its end) is refused, naming the problem.
    pub fn open(args: EdgeArgs, path: &Path) -> Result<(Arc<Self>, Resumed), String> {
        let reopened = EdgeJournal::open(path)?;
        let mut st = Store::default();
        let n = reopened.records.len();
        for (i, r) in reopened.records.into_iter().enumerate() {
            st.replay(r).map_err(|e| format!("journal {}: record {i} of {n}: {e}", path.display()))?;
        }
        let resumed = Resumed {
            pending: st.accepted.len(),
            answered: st.done,
            cameras: st.cameras.len(),
            damage: reopened.damage,
        };
        st.journal = Some(reopened.journal);
        Ok((
            Arc::new(Self { args, store: Mutex::new(st), fault_site: Mutex::new(FAULT_SITE.into()) }),
            resumed,
        ))
    }

    /// Closes the journal once the job is done; its path, for the caller to remove.
    pub fn finish_journal(&self) -> Option<PathBuf> {
        lock(&self.store).journal.take().map(|j| j.path())
    }

    /// The edge's children, in start order: its front, the [`EdgeActor`] named [`EDGE_ACTOR`]
    /// on `actors` (it outlives scheduler restarts), and its scheduler named `name`
    /// ([`EdgeShared::child_spec`]).
    pub fn children(self: &Arc<Self>, actors: &Actors, name: &str) -> Result<Vec<ChildSpec>, SpawnError> {
        let key = NEXT_EDGE.fetch_add(1, Ordering::Relaxed);
        {
            let mut edges = EDGES.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
            edges.retain(|_, e| e.strong_count() > 0);
            edges.insert(key, Arc::downgrade(self));
        }
        Ok(vec![actors.child_spec::<EdgeActor>(EDGE_ACTOR, key)?, self.child_spec(name)])
    }

    /// Names the scheduler's fault-switch site from its next start on (a simulated cluster gives
    /// each run its own, so runs in one process never share the switch's hit counts).
    pub fn set_fault_site(&self, site: &str) {
        *self.fault_site.lock().unwrap_or_else(std::sync::PoisonError::into_inner) = site.to_string();
    }

    /// The child spec running the edge scheduler under a supervisor.
    pub fn child_spec(self: &Arc<Self>, name: &str) -> ChildSpec {
        let shared = self.clone();
        ChildSpec::new(name, move || {
            let fault_site =
                shared.fault_site.lock().unwrap_or_else(std::sync::PoisonError::into_inner).clone();
            (
                SchedulerActor::<EdgeScheduler>::default(),
                SchedulerArgs { scheduler: EdgeScheduler::new(shared.clone()), fault_site },
            )
        })
    }

    /// Registers a caller waiting for the summary once `cameras` cameras are done: heard from,
    /// streamed to their end, every adaptation they asked for answered (see
    /// [`troupe_policy::adapt::online::completion`]).
    pub fn wait_summary(&self, cameras: u32, reply: RpcReplyPort<Vec<u8>>) -> Result<(), String> {
        {
            let mut st = lock(&self.store);
            if st.waiters.len() >= MAX_WAITERS {
                return Err(format!("{MAX_WAITERS} callers already wait for the summary"));
            }
            st.waiters.push((cameras, reply));
        }
        self.tell(EdgeInput::Reported);
        Ok(())
    }

    fn tell(&self, input: EdgeInput) {
        let scheduler = lock(&self.store).scheduler.clone();
        if let Some(s) = scheduler {
            let _ = SchedulerMsg::tell(&s, input);
        }
    }

    /// Accepts an upload. A repeat of one of the camera's phases (it restarted) is answered with
    /// that phase's adaptation, under way or kept, and a conflicting claim is refused (see
    /// [`classify`]). A fresh phase is refused (backpressure) past the engine's task cap, the
    /// camera's share of it ([`MAX_UPLOADS_PER_CAMERA`]) or [`MAX_KEPT_BYTES`], else kept with
    /// its reply channel until a scheduler answers it.
    fn accept(&self, request: UploadRequest) -> Result<oneshot::Receiver<Vec<u8>>, String> {
        let (tx, rx) = oneshot::channel();
        {
            let mut st = lock(&self.store);
            let upload = phase_of(&request);
            let camera = request.camera.as_str();
            let mut known: Vec<(Phase, Seen)> = st
                .accepted
                .values()
                .filter(|a| a.request.camera == camera)
                .map(|a| (phase_of(&a.request), Seen::Pending))
                .collect();
            known.extend(st.kept.get(camera).into_iter().flatten().map(|k| (k.phase, Seen::Answered)));
            match classify(&known, upload, MAX_ADAPTATIONS as u32) {
                UploadKind::Refused(why) => return Err(format!("camera {camera:?}: {why}")),
                UploadKind::Replay => {
                    let kept = st.kept.get(camera).into_iter().flatten().find(|k| k.phase == upload);
                    if let Some(k) = kept {
                        tracing::info!(
                            %camera, adaptation = upload.adaptation, drift_frame = upload.drift_frame,
                            "repeated upload (the camera restarted): answered again with the adaptation already made"
                        );
                        let _ = tx.send(k.reply.clone());
                        return Ok(rx);
                    }
                }
                UploadKind::InFlight => {
                    let under_way = st
                        .accepted
                        .values_mut()
                        .find(|a| a.request.camera == camera && phase_of(&a.request) == upload);
                    if let Some(a) = under_way {
                        a.replies.retain(|r| !r.is_closed());
                        if a.replies.len() >= MAX_CALLERS_PER_PHASE {
                            return Err(format!(
                                "camera {camera:?} already has {} callers waiting for adaptation {} \
                                 (at most {MAX_CALLERS_PER_PHASE})",
                                a.replies.len(),
                                upload.adaptation
                            ));
                        }
                        a.replies.push(tx);
                        tracing::info!(
                            %camera, adaptation = upload.adaptation, drift_frame = upload.drift_frame,
                            "repeated upload (the camera restarted): waits for the adaptation under way"
                        );
                        return Ok(rx);
                    }
                }
                UploadKind::Fresh => {}
            }
            if st.kept_bytes >= MAX_KEPT_BYTES {
                return Err(format!(
                    "the edge keeps {} bytes of answers, the most it keeps ({MAX_KEPT_BYTES})",
                    st.kept_bytes
                ));
            }
            let mine = st.accepted.values().filter(|a| a.request.camera == request.camera).count();
            if mine >= MAX_UPLOADS_PER_CAMERA {
                return Err(format!(
                    "camera {:?} already has {mine} adaptations waiting (at most {MAX_UPLOADS_PER_CAMERA}); \
                     try again once one is answered",
                    request.camera
                ));
            }
            if st.accepted.len() >= self.args.engine.max_tasks {
                return Err(format!(
                    "the edge already holds {} adaptation tasks; try again later",
                    st.accepted.len()
                ));
            }
            let key = st.next;
            st.journal(&[EdgeRecord::Accepted { key, request: encode(&request) }])
                .map_err(|e| format!("the edge could not accept the upload: {e}"))?;
            tracing::info!(camera = %request.camera, adaptation = request.adaptation, key, "upload accepted");
            st.next += 1;
            st.accepted.insert(key, Accepted { request, replies: vec![tx] });
            crate::live::set_queue("coadapt", "uploads", st.accepted.len() as u64);
        }
        self.tell(EdgeInput::Accepted);
        Ok(rx)
    }

    /// Where the job stands with `expected` cameras now (for a timeout message).
    pub fn progress(&self, expected: u32) -> Completion {
        completion(expected, &progress_of(&lock(&self.store).cameras))
    }

    /// The cameras' streams so far, summed over the cameras heard from (for a progress bar).
    pub fn streamed(&self) -> Streamed {
        let st = lock(&self.store);
        let mut s = Streamed { cameras: st.cameras.len(), ..Streamed::default() };
        for c in &st.cameras {
            s.frame += c.frame;
            s.frames += c.frames;
            s.requested += u64::from(c.requested);
            s.answered += c.adaptations.len() as u64;
        }
        s
    }

    fn report(&self, r: StreamReport) -> Result<(), String> {
        {
            let mut st = lock(&self.store);
            let full = st.cameras.len() >= MAX_CAMERAS;
            let known = st.cameras.iter().any(|c| c.camera == r.camera);
            if full && !known {
                tracing::warn!(camera = %r.camera, cap = MAX_CAMERAS, "refusing a camera report: the edge holds its most cameras");
                return Err(format!("the edge already keeps {MAX_CAMERAS} cameras"));
            }
            st.journal(&[EdgeRecord::Report { report: encode(&r) }])?;
            match st.cameras.iter_mut().find(|c| c.camera == r.camera) {
                Some(c) => *c = r,
                None => {
                    tracing::info!(camera = %r.camera, frames = r.frames, "camera heard from");
                    st.cameras.push(r);
                }
            }
        }
        self.tell(EdgeInput::Reported);
        Ok(())
    }

    /// Answers accepted upload `key` (once: its reply channels are consumed), keeping the
    /// answer of an adapted phase (`adapted`) for a restarted camera's repeat of it.
    fn answer(&self, key: u64, bytes: Vec<u8>, adapted: bool) {
        let taken = {
            let mut st = lock(&self.store);
            let mut records = vec![EdgeRecord::Answered { key }];
            if adapted && let Some(a) = st.accepted.get(&key) {
                records.push(EdgeRecord::Kept {
                    camera: a.request.camera.clone(),
                    adaptation: a.request.adaptation,
                    drift_frame: a.request.drift_frame,
                    reply: bytes.clone(),
                    peak_used: st.peak_used,
                });
            }
            // answered even when the journal fails: the camera has its answer, a restart would
            // only adapt the phase again
            // (a key no longer held was answered already: nothing to journal)
            if st.accepted.contains_key(&key)
                && let Err(e) = st.journal(&records)
            {
                tracing::error!(key, error = %e, "the answer could not be journaled");
            }
            let taken = st.accepted.remove(&key);
            if adapted && let Some(a) = &taken {
                st.kept_bytes += bytes.len();
                let kept = Kept { phase: phase_of(&a.request), reply: bytes.clone() };
                st.kept.entry(a.request.camera.clone()).or_default().push(kept);
            }
            crate::live::set_queue("coadapt", "uploads", st.accepted.len() as u64);
            taken
        };
        for reply in taken.into_iter().flat_map(|a| a.replies) {
            let _ = reply.send(bytes.clone());
        }
    }
}

/// The cameras' streams so far ([`EdgeShared::streamed`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Streamed {
    /// Cameras heard from.
    pub cameras: usize,
    /// Frames streamed, all cameras together.
    pub frame: u64,
    /// Frames their streams have in all.
    pub frames: u64,
    /// Adaptations asked for.
    pub requested: u64,
    /// Adaptations answered.
    pub answered: u64,
}

/// What the completion policy needs of each camera's report.
fn progress_of(cameras: &[StreamReport]) -> Vec<CameraProgress> {
    cameras
        .iter()
        .map(|c| CameraProgress {
            name: c.camera.clone(),
            frame: c.frame,
            ended: c.ended,
            requested: c.requested,
            answered: c.adaptations.len() as u32,
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::coadapt::wire::PIXELS;

    fn upload(camera: &str) -> UploadRequest {
        UploadRequest {
            camera: camera.into(),
            model: "tiny".into(),
            params: Vec::new(),
            train_images: vec![0.5; PIXELS],
            eval_images: vec![0.5; PIXELS],
            adaptation: 0,
            drift_frame: 1,
            target_gain: 0.1,
        }
    }

    #[test]
    fn one_camera_cannot_take_every_task_slot() {
        let edge = EdgeShared::new(EdgeArgs {
            engine: EngineConfig::default(),
            expected: Vec::new(),
            compute: EdgeCompute::Real,
        });
        let mut held = Vec::new();
        // distinct drift phases (a repeat of one would wait for it and take no slot)
        let phase =
            |k: u32| UploadRequest { adaptation: k, drift_frame: 1 + u64::from(k), ..upload("cam-1") };
        for k in 0..MAX_UPLOADS_PER_CAMERA as u32 {
            held.push(edge.accept(phase(k)).expect("within the camera's share"));
        }
        let why = edge.accept(phase(MAX_UPLOADS_PER_CAMERA as u32)).expect_err("past the camera's share");
        assert!(why.contains("cam-1") && why.contains(&MAX_UPLOADS_PER_CAMERA.to_string()), "{why}");
        held.push(edge.accept(upload("cam-2")).expect("another camera is still served"));
        assert_eq!(lock(&edge.store).accepted.len(), MAX_UPLOADS_PER_CAMERA + 1);
    }

    #[test]
    fn a_restarted_cameras_repeated_upload_is_answered_by_the_one_adaptation() {
        let edge = EdgeShared::new(EdgeArgs {
            engine: EngineConfig::default(),
            expected: Vec::new(),
            compute: EdgeCompute::Real,
        });
        let mut first = edge.accept(upload("cam-1")).expect("a fresh phase");
        // the camera restarted while its phase was being adapted: it waits for that adaptation
        let mut repeat = edge.accept(upload("cam-1")).expect("a repeat of the phase under way");
        assert_eq!(lock(&edge.store).accepted.len(), 1, "one adaptation task for the phase");
        // the callers waiting on one phase are bounded too
        let more: Vec<_> = (2..MAX_CALLERS_PER_PHASE)
            .map(|_| edge.accept(upload("cam-1")).expect("within the callers one phase may have"))
            .collect();
        let why = edge.accept(upload("cam-1")).expect_err("past the callers one phase may have");
        assert!(why.contains("callers waiting for adaptation 0"), "{why}");
        let key = *lock(&edge.store).accepted.keys().next().unwrap();
        edge.answer(key, b"adapted".to_vec(), true);
        assert_eq!(first.try_recv().unwrap(), b"adapted");
        assert_eq!(repeat.try_recv().unwrap(), b"adapted");
        for mut m in more {
            assert_eq!(m.try_recv().unwrap(), b"adapted");
        }
        // restarted again after the answer: the kept answer, with nothing admitted
        let mut again = edge.accept(upload("cam-1")).expect("a repeat of the answered phase");
        assert_eq!(again.try_recv().unwrap(), b"adapted");
        assert!(lock(&edge.store).accepted.is_empty());
        // the same phase claimed at another drift frame is refused by name
        let why = edge.accept(UploadRequest { drift_frame: 7, ..upload("cam-1") }).unwrap_err();
        assert!(why.contains("cam-1") && why.contains("drift frame 1"), "{why}");
        // another camera's phase 0 is its own
        let _other = edge.accept(upload("cam-2")).expect("another camera's first phase");
        assert_eq!(lock(&edge.store).accepted.len(), 1);
        // a refused adaptation is not kept: asking again adapts it
        let key = *lock(&edge.store).accepted.keys().next().unwrap();
        edge.answer(key, refused("no memory"), false);
        let _retry = edge.accept(upload("cam-2")).expect("a refused phase may be asked again");
        assert_eq!(lock(&edge.store).accepted.len(), 1);
    }
}
