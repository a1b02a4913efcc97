//! The coe scheduler as a supervised actor: the policy's [`RequestScheduler`] inside the
//! runtime's one [`SchedulerActor`] shell, with the work it has accepted kept apart from it.
//!
//! - **Acceptance is durable.** A request is accepted by [`CoeShared::accept`]: it is appended to
//!   the job's [`Journal`] (fsynced) before the scheduler hears of it. An answer (a request's
//!   output digest) is journaled before it counts, and a request is answered at most once: a
//!   second answer is an error naming the request.
//! - **Warm restart.** On every start [`CoeScheduler::recover`] builds a fresh policy from the
//!   accepted-but-unanswered requests and sends each executor [`Cmd::Reset`]. Links are FIFO, so
//!   every event an executor sends before its reset's answer belongs to the dead incarnation and
//!   is dropped; after it, the executor is empty, as the fresh policy believes.
//! - **Restoration.** A link is (re)installed with [`CoeShared::install_link`] under a new
//!   generation; the scheduler puts that executor back in service (reset first), so an executor
//!   node that comes back under its name serves again within the same job. Events carry the
//!   generation of the link they came from; older ones are dropped.
//!
//! - **Client requests.** Beside the trace's requests, [`CoeShared::submit`] accepts a client's
//!   own (an entry expert and [`INPUT_WIDTH`] floats): journaled with its input, so a restarted
//!   scheduler reschedules it; it takes the next id after the trace, its selections are whatever
//!   its experts' outputs select, and its answer ([`ClientAnswer`]) goes to the waiting client
//!   once journaled (see [`super::requests`]).
//!
//! The same actor serves local runs ([`super::runner::run_local`], executor threads) and the
//! distributed `coe` job (executor nodes over QUIC).

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::path::Path;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use ractor::{ActorProcessingErr, ActorRef};
use rkyv::rancor;
use rkyv::{Archive, Deserialize, Serialize};
use tokio::sync::watch;
use troupe_policy::Micros;
use troupe_policy::coe::{
    Action, ExecutorId, ExpertId, LatencyModel, Request, RequestId, RequestScheduler, SchedulerConfig,
    belady_min_loads,
};
use troupe_policy::stats::quantile;

use super::CoeError;
use super::app::{App, INPUT_WIDTH, output_digest, quantise, select_children};
use super::executor::ExecutorCounters;
use super::runner::{Cmd, Event, RunReport};
use crate::journal::{Journal, TailDamage};
use crate::kinds::scheduler::{Scheduler, SchedulerActor, SchedulerArgs, SchedulerMsg};
use crate::supervisor::ChildSpec;

/// Name of the coe scheduler actor under a node's root supervisor.
pub const SCHEDULER: &str = "coe-scheduler";
/// Fault-switch site hit once per scheduler input.
pub const FAULT_SITE: &str = "coe.scheduler";
/// Most requests one journal record accepts (a record stays far below the journal's cap).
const ACCEPT_CHUNK: usize = 4096;

/// One journal record of a coe job.
#[derive(Archive, Serialize, Deserialize, Clone, Debug, PartialEq)]
enum CoeRecord {
    /// These requests (trace indices) were accepted.
    Accepted(Vec<u64>),
    /// This request was answered with this output digest.
    Answered {
        /// Trace index.
        request: u64,
        /// Its output digest.
        digest: u64,
    },
    /// A client's request was accepted; it takes the next id after the trace and the client
    /// requests before it.
    Submitted {
        /// The entry expert.
        root: u32,
        /// Its input ([`INPUT_WIDTH`] floats).
        pixels: Vec<f32>,
    },
}

/// A client's request as accepted: where it enters and its input.
#[derive(Clone, Debug, PartialEq)]
pub struct ClientRequest {
    /// The preliminary expert it enters at.
    pub root: ExpertId,
    /// Its input, [`INPUT_WIDTH`] floats.
    pub pixels: Vec<f32>,
}

/// What a client's request was answered with.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ClientAnswer {
    /// Its id in this job.
    pub request: u64,
    /// Digest of its outputs, as a local run computes it ([`output_digest`]).
    pub digest: u64,
    /// Each expert it ran and that expert's quantised output ([`quantise`]).
    pub outputs: BTreeMap<ExpertId, Vec<i32>>,
}

/// What the coe scheduler is told.
#[derive(Debug)]
pub enum CoeInput {
    /// More requests were accepted (the scheduler reads them from the store).
    Accepted,
    /// An executor's event, tagged with the link it came through.
    Exec {
        /// Executor index (in the profile).
        exec: usize,
        /// Generation of the link that carried it.
        generation: u64,
        /// The event.
        event: Event,
    },
    /// The executor's node is down (membership).
    Down {
        /// Executor index.
        exec: usize,
        /// Generation of the link it concerns.
        generation: u64,
        /// Why.
        why: String,
    },
    /// A newer link for this executor was installed.
    Restored {
        /// Executor index.
        exec: usize,
    },
}

type SchedulerRef = ActorRef<SchedulerMsg<CoeInput>>;

/// One executor's link as installed.
struct LinkSlot {
    sender: Option<tokio::sync::mpsc::UnboundedSender<Cmd>>,
    generation: u64,
}

/// Measurements that survive scheduler restarts (they describe the run, not decisions).
#[derive(Default)]
struct Meter {
    counters: Vec<ExecutorCounters>,
    served: Vec<Vec<ExpertId>>,
    accepted_at: HashMap<u64, Instant>,
    latencies: Vec<Duration>,
    restorations: usize,
    completed_after_restore: Vec<u64>,
    /// Time inside the policy's `RequestScheduler` calls, every incarnation.
    scheduling: Duration,
}

/// The durable part: journal, accepted and answered requests, and where the scheduler is.
struct Store {
    journal: Option<Journal>,
    accepted: Vec<u64>,
    accepted_set: BTreeSet<u64>,
    answered: BTreeMap<u64, u64>,
    /// Client requests, ids `trace length + index` (inputs dropped once answered).
    clients: Vec<ClientRequest>,
    /// Clients waiting for their answer, by request id (an answer with no waiter is dropped).
    waiters: HashMap<u64, tokio::sync::oneshot::Sender<ClientAnswer>>,
    scheduler: Option<SchedulerRef>,
    meter: Meter,
}

/// Everything a coe job shares between the scheduler's incarnations, the feeder and the links.
pub struct CoeShared {
    app: Arc<App>,
    latency: LatencyModel,
    config: SchedulerConfig,
    store: Mutex<Store>,
    links: Mutex<Vec<LinkSlot>>,
    answered_tx: watch::Sender<usize>,
    started: Instant,
}

/// Mirrors the store's queue lengths into [`crate::live`]: requests accepted and not yet
/// answered (`outstanding`), and clients waiting for an answer (`waiting-clients`).
fn publish_queues(st: &Store) {
    let outstanding = st.accepted_set.len().saturating_sub(st.answered.len());
    crate::live::set_queue("coe", "outstanding", outstanding as u64);
    crate::live::set_queue("coe", "waiting-clients", st.waiters.len() as u64);
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

fn encode(record: &CoeRecord) -> Result<Vec<u8>, CoeError> {
    rkyv::to_bytes::<rancor::Error>(record)
        .map(|b| b.to_vec())
        .map_err(|e| CoeError::Invalid(format!("encoding a journal record: {e}")))
}

fn decode(bytes: &[u8]) -> Result<CoeRecord, CoeError> {
    crate::decode::decode(
        "coe journal record",
        bytes,
        crate::journal::MAX_RECORD,
        &mut crate::decode::plain_budget(),
    )
    .map_err(|e| CoeError::Invalid(format!("journal record does not decode: {e}")))
}

/// Checks a client request against the app: its root is a preliminary expert and its input is
/// [`INPUT_WIDTH`] finite floats.
pub fn check_client(app: &App, root: ExpertId, pixels: Vec<f32>) -> Result<ClientRequest, CoeError> {
    let expert = app
        .trace
        .model
        .expert(root)
        .ok_or_else(|| CoeError::Invalid(format!("root {root} is not an expert of this app")))?;
    if expert.preliminary().is_some() {
        return Err(CoeError::Invalid(format!("root {root} is not a preliminary (entry) expert")));
    }
    if pixels.len() != INPUT_WIDTH {
        return Err(CoeError::Invalid(format!(
            "an input has {INPUT_WIDTH} floats, this one has {}",
            pixels.len()
        )));
    }
    if let Some(i) = pixels.iter().position(|v| !v.is_finite()) {
        return Err(CoeError::Invalid(format!("input float {i} is not finite")));
    }
    Ok(ClientRequest { root, pixels })
}

/// Where request `id` enters and its input: a trace request's, or a client's (from `clients`).
fn request_of(app: &App, clients: &[ClientRequest], id: u64) -> Option<(ExpertId, Vec<f32>)> {
    let n = app.trace.requests.len() as u64;
    if id < n {
        let r = &app.trace.requests[id as usize];
        Some((r.root, app.input(r.input)))
    } else {
        let c = clients.get(usize::try_from(id - n).ok()?)?;
        Some((c.root, c.pixels.clone()))
    }
}

/// Drops the input of client request `k` (answered: it never runs again), so a long-serving
/// scheduler keeps a few bytes per answered request, not its 64 floats.
fn forget_input(clients: &mut [ClientRequest], k: u64) {
    if let Some(c) = usize::try_from(k).ok().and_then(|k| clients.get_mut(k)) {
        c.pixels = Vec::new();
    }
}

/// Where request `id` enters: a trace request's root, or a client's.
fn root_of(app: &App, clients: &[ClientRequest], id: u64) -> Option<ExpertId> {
    let n = app.trace.requests.len() as u64;
    match app.trace.requests.get(usize::try_from(id).ok()?) {
        Some(r) => Some(r.root),
        None => clients.get(usize::try_from(id - n).ok()?).map(|c| c.root),
    }
}

impl CoeShared {
    /// A job over `app` with `config`; with `journal`, accepted and answered requests are
    /// replayed from that file and appended to it (see the module docs). Returns the damaged
    /// tail the journal had, if any (reported, not replayed).
    pub fn open(
        app: Arc<App>,
        latency: LatencyModel,
        config: SchedulerConfig,
        journal: Option<&Path>,
    ) -> Result<(Arc<Self>, Option<TailDamage>), CoeError> {
        let n = app.trace.requests.len() as u64;
        let mut store = Store {
            journal: None,
            accepted: Vec::new(),
            accepted_set: BTreeSet::new(),
            answered: BTreeMap::new(),
            clients: Vec::new(),
            waiters: HashMap::new(),
            scheduler: None,
            meter: Meter {
                counters: vec![ExecutorCounters::default(); latency.executors()],
                served: vec![Vec::new(); latency.executors()],
                ..Meter::default()
            },
        };
        let mut damage = None;
        if let Some(path) = journal {
            let (j, replay) = Journal::open(path).map_err(|e| CoeError::Invalid(e.to_string()))?;
            for body in &replay.records {
                match decode(body)? {
                    CoeRecord::Accepted(ids) => {
                        for id in ids {
                            if id >= n || !store.accepted_set.insert(id) {
                                return Err(CoeError::Invalid(format!(
                                    "journal {}: request {id} accepted twice or not in the trace",
                                    path.display()
                                )));
                            }
                            store.accepted.push(id);
                        }
                    }
                    CoeRecord::Answered { request, digest } => {
                        if !store.accepted_set.contains(&request)
                            || store.answered.insert(request, digest).is_some()
                        {
                            return Err(CoeError::Invalid(format!(
                                "journal {}: request {request} answered twice or never accepted",
                                path.display()
                            )));
                        }
                    }
                    CoeRecord::Submitted { root, pixels } => {
                        let client = check_client(&app, ExpertId(root), pixels)
                            .map_err(|e| CoeError::Invalid(format!("journal {}: {e}", path.display())))?;
                        let id = n + store.clients.len() as u64;
                        store.clients.push(client);
                        store.accepted_set.insert(id);
                        store.accepted.push(id);
                    }
                }
            }
            damage = replay.damage;
            for (&id, _) in store.answered.range(n..) {
                forget_input(&mut store.clients, id - n);
            }
            store.journal = Some(j);
        }
        let answered = store.answered.len();
        publish_queues(&store);
        let links = (0..latency.executors()).map(|_| LinkSlot { sender: None, generation: 0 }).collect();
        let shared = Arc::new(Self {
            app,
            latency,
            config,
            store: Mutex::new(store),
            links: Mutex::new(links),
            answered_tx: watch::channel(answered).0,
            started: Instant::now(),
        });
        Ok((shared, damage))
    }

    /// The app being served.
    pub fn app(&self) -> &App {
        &self.app
    }

    /// Executor `exec`'s name in the profile.
    pub fn executor_name(&self, exec: usize) -> &str {
        self.latency.name(exec)
    }

    /// Requests in the trace.
    pub fn total(&self) -> usize {
        self.app.trace.requests.len()
    }

    /// Trace indices accepted so far (replayed ones included).
    pub fn accepted(&self) -> BTreeSet<u64> {
        lock(&self.store).accepted_set.clone()
    }

    /// Watches the number of answered requests.
    pub fn answered(&self) -> watch::Receiver<usize> {
        self.answered_tx.subscribe()
    }

    /// Accepts requests (trace indices): journaled and synced first, then the scheduler is told.
    /// Requests already accepted are skipped.
    pub fn accept(&self, ids: &[u64]) -> Result<(), CoeError> {
        let mut st = lock(&self.store);
        let n = self.total() as u64;
        let fresh: Vec<u64> =
            ids.iter().copied().filter(|i| *i < n && !st.accepted_set.contains(i)).collect();
        if fresh.is_empty() {
            return Ok(());
        }
        if let Some(j) = st.journal.as_mut() {
            let bodies = fresh
                .chunks(ACCEPT_CHUNK)
                .map(|c| encode(&CoeRecord::Accepted(c.to_vec())))
                .collect::<Result<Vec<_>, _>>()?;
            let refs: Vec<&[u8]> = bodies.iter().map(Vec::as_slice).collect();
            j.append(&refs).map_err(|e| CoeError::Invalid(e.to_string()))?;
        }
        let now = Instant::now();
        for id in fresh {
            st.accepted_set.insert(id);
            st.accepted.push(id);
            st.meter.accepted_at.insert(id, now);
        }
        publish_queues(&st);
        if let Some(s) = &st.scheduler {
            // A dead incarnation's ref fails here; its successor reads the store when it starts.
            let _ = SchedulerMsg::tell(s, CoeInput::Accepted);
        }
        Ok(())
    }

    /// Accepts a client's request: checked ([`check_client`]), journaled and synced, then the
    /// scheduler is told. Returns its id and where its answer will arrive.
    pub fn submit(
        &self,
        root: ExpertId,
        pixels: Vec<f32>,
    ) -> Result<(u64, tokio::sync::oneshot::Receiver<ClientAnswer>), CoeError> {
        let client = check_client(&self.app, root, pixels)?;
        let mut st = lock(&self.store);
        if let Some(j) = st.journal.as_mut() {
            let body = encode(&CoeRecord::Submitted { root: root.0, pixels: client.pixels.clone() })?;
            j.append(&[&body]).map_err(|e| CoeError::Invalid(e.to_string()))?;
        }
        let id = self.total() as u64 + st.clients.len() as u64;
        st.clients.push(client);
        st.accepted_set.insert(id);
        st.accepted.push(id);
        st.meter.accepted_at.insert(id, Instant::now());
        let (tx, rx) = tokio::sync::oneshot::channel();
        st.waiters.insert(id, tx);
        publish_queues(&st);
        if let Some(s) = &st.scheduler {
            let _ = SchedulerMsg::tell(s, CoeInput::Accepted);
        }
        Ok((id, rx))
    }

    /// The entry expert a client request takes when it names none: the first preliminary.
    pub fn default_root(&self) -> Option<ExpertId> {
        self.app.trace.model.roots().next().map(|e| e.id)
    }

    /// Installs a (new) link to executor `exec` and tells the scheduler; events the link sends
    /// must be tagged with the returned generation.
    pub fn install_link(&self, exec: usize, sender: tokio::sync::mpsc::UnboundedSender<Cmd>) -> u64 {
        let generation = {
            let mut links = lock(&self.links);
            let Some(slot) = links.get_mut(exec) else { return 0 };
            slot.generation += 1;
            slot.sender = Some(sender);
            slot.generation
        };
        self.tell(CoeInput::Restored { exec });
        generation
    }

    /// Current generation of executor `exec`'s link.
    pub fn link_generation(&self, exec: usize) -> u64 {
        lock(&self.links).get(exec).map_or(0, |s| s.generation)
    }

    /// Sends an input to the current scheduler incarnation (dropped while none is running:
    /// a new incarnation rebuilds from the store and resets executors).
    pub fn tell(&self, input: CoeInput) {
        let scheduler = lock(&self.store).scheduler.clone();
        if let Some(s) = scheduler {
            let _ = SchedulerMsg::tell(&s, input);
        }
    }

    /// Forwards the events of one link (made for executor `exec` at `generation`) to the
    /// scheduler, on a thread of its own, until the link closes.
    pub fn forward_events(
        self: &Arc<Self>,
        exec: usize,
        generation: u64,
        events: std::sync::mpsc::Receiver<Event>,
    ) {
        let shared = self.clone();
        let spawned = std::thread::Builder::new().name(format!("coe-link-{exec}")).spawn(move || {
            for event in events {
                shared.tell(CoeInput::Exec { exec, generation, event });
            }
        });
        if let Err(e) = spawned {
            tracing::error!(exec, "cannot start the event forwarder: {e}");
        }
    }

    /// The child spec that runs this job's scheduler under a supervisor.
    pub fn child_spec(self: &Arc<Self>) -> ChildSpec {
        let shared = self.clone();
        ChildSpec::new(SCHEDULER, move || {
            (
                SchedulerActor::<CoeScheduler>::default(),
                SchedulerArgs { scheduler: CoeScheduler::new(shared.clone()), fault_site: FAULT_SITE.into() },
            )
        })
    }

    /// Per-request results in trace order (`None` where not answered yet).
    pub fn digests(&self) -> Vec<Option<u64>> {
        let st = lock(&self.store);
        (0..self.total() as u64).map(|i| st.answered.get(&i).copied()).collect()
    }

    /// The output digest request `id` (a trace's or a client's) was answered with, if it was.
    pub fn answer_of(&self, id: u64) -> Option<u64> {
        lock(&self.store).answered.get(&id).copied()
    }

    /// How often an executor was put back in service, and how many requests completed on an
    /// executor after it was.
    pub fn restorations(&self) -> (usize, usize) {
        let st = lock(&self.store);
        (st.meter.restorations, st.meter.completed_after_restore.len())
    }

    /// Drops every link (local executor threads then end).
    pub fn close_links(&self) {
        for slot in lock(&self.links).iter_mut() {
            slot.sender = None;
        }
    }

    /// Detaches the journal (after the job's results are written, so a rerun starts afresh).
    pub fn finish_journal(&self) -> Option<std::path::PathBuf> {
        lock(&self.store).journal.take().map(|j| j.path().to_path_buf())
    }

    /// What the run measured, once every request is answered.
    pub fn report(&self, label: &'static str, lost: Vec<String>) -> Result<RunReport, CoeError> {
        let st = lock(&self.store);
        let model = &self.app.trace.model;
        let n = self.total();
        let mut latencies_ms: Vec<f64> = st.meter.latencies.iter().map(|d| d.as_secs_f64() * 1e3).collect();
        // No request answered: report 0 rather than NaN (the JSON report has no NaN).
        let mut pct = |q: f64| if latencies_ms.is_empty() { 0.0 } else { quantile(&mut latencies_ms, q) };
        let mut belady = 0;
        for (x, s) in st.meter.served.iter().enumerate() {
            belady += belady_min_loads(s, |e| model.size_of(e), self.latency.expert_budget(x))
                .map_err(|e| CoeError::Invalid(e.to_string()))?;
        }
        let makespan_s = self.started.elapsed().as_secs_f64();
        let c = &st.meter.counters;
        Ok(RunReport {
            label,
            requests: n,
            makespan_s,
            throughput_rps: n as f64 / makespan_s.max(1e-9),
            p50_ms: pct(0.5),
            p99_ms: pct(0.99),
            loads: c.iter().map(|c| c.loads).sum(),
            belady_loads: belady,
            switch_s: c.iter().map(|c| c.load_seconds).sum(),
            busy_s: c.iter().map(|c| c.load_seconds + c.run_seconds).sum(),
            scheduling_s: st.meter.scheduling.as_secs_f64(),
            digests: (0..n as u64).map(|i| st.answered.get(&i).copied().unwrap_or(0)).collect(),
            executors: (0..c.len()).map(|x| (self.latency.name(x).to_string(), c[x])).collect(),
            budgets: (0..c.len()).map(|x| self.latency.expert_budget(x)).collect(),
            lost,
        })
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Busy {
    Idle,
    Loading(ExpertId),
    Running(ExpertId),
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Health {
    /// Reset sent; events before its answer are a dead incarnation's.
    Syncing,
    Ready,
    Lost,
}

#[derive(Clone, Copy, Debug)]
struct ExecView {
    generation: u64,
    health: Health,
    busy: Busy,
    restored: bool,
}

/// Decision state of one scheduler incarnation (rebuilt by `recover`).
struct Live {
    policy: RequestScheduler,
    views: Vec<ExecView>,
    /// Position in the store's accepted list fed to the policy so far.
    cursor: usize,
    outputs: HashMap<u64, BTreeMap<ExpertId, Vec<i32>>>,
    /// Time inside policy calls not yet added to the meter.
    decide: Duration,
}

/// Runs `f` (a policy call), adding its duration to `clock`.
fn timed<T>(clock: &mut Duration, f: impl FnOnce() -> T) -> T {
    let start = Instant::now();
    let out = f();
    *clock += start.elapsed();
    out
}

/// The coe workload half of the scheduler shell.
pub struct CoeScheduler {
    shared: Arc<CoeShared>,
    live: Option<Live>,
}

impl CoeScheduler {
    /// A scheduler over the shared job state (its decision state is built in `recover`).
    pub fn new(shared: Arc<CoeShared>) -> Self {
        Self { shared, live: None }
    }
}

fn fail(e: impl std::fmt::Display) -> ActorProcessingErr {
    e.to_string().into()
}

impl Live {
    fn send(&mut self, shared: &CoeShared, x: usize, cmd: Cmd) -> bool {
        let links = lock(&shared.links);
        let ok = links.get(x).is_some_and(|s| {
            s.generation == self.views[x].generation && s.sender.as_ref().is_some_and(|t| t.send(cmd).is_ok())
        });
        drop(links);
        ok
    }

    fn lose(&mut self, now: Micros, x: usize, why: &str) -> Result<(), ActorProcessingErr> {
        if self.views[x].health == Health::Lost {
            return Ok(());
        }
        tracing::warn!(executor = %x, %why, "executor lost: requeueing its work");
        self.views[x].health = Health::Lost;
        self.views[x].busy = Busy::Idle;
        timed(&mut self.decide, || self.policy.handle_executor_lost(now, ExecutorId(x as u16))).map_err(fail)
    }

    /// Feeds requests accepted since the last look (skipping answered ones).
    fn feed_accepted(&mut self, shared: &CoeShared, now: Micros) -> Result<(), ActorProcessingErr> {
        let fresh: Vec<(u64, Option<ExpertId>)> = {
            let st = lock(&shared.store);
            let ids = st.accepted[self.cursor..]
                .iter()
                .copied()
                .filter(|i| !st.answered.contains_key(i))
                .map(|i| (i, root_of(&shared.app, &st.clients, i)))
                .collect();
            self.cursor = st.accepted.len();
            ids
        };
        for (i, found) in fresh {
            let root = found.ok_or_else(|| fail(format!("accepted request {i} is unknown")))?;
            timed(&mut self.decide, || self.policy.handle_arrival(now, Request { id: RequestId(i), root }))
                .map_err(fail)?;
        }
        Ok(())
    }

    /// Adopts a newer link for `x`: reset it, then it serves again.
    fn adopt(&mut self, shared: &CoeShared, now: Micros, x: usize) -> Result<(), ActorProcessingErr> {
        let generation = shared.link_generation(x);
        if generation <= self.views[x].generation {
            return Ok(());
        }
        let was = self.views[x].health;
        if was != Health::Lost {
            // Its old link's work will never be answered: requeue it first.
            self.lose(now, x, "replaced by a newer link")?;
        }
        self.views[x] = ExecView { generation, health: Health::Syncing, busy: Busy::Idle, restored: true };
        if !self.send(shared, x, Cmd::Reset) {
            return self.lose(now, x, "link closed before its reset");
        }
        lock(&shared.store).meter.restorations += 1;
        tracing::info!(executor = shared.latency.name(x), generation, "executor back in service");
        timed(&mut self.decide, || self.policy.handle_executor_restored(now, ExecutorId(x as u16)))
            .map_err(fail)
    }

    fn on_event(
        &mut self,
        shared: &CoeShared,
        now: Micros,
        x: usize,
        generation: u64,
        event: Event,
    ) -> Result<(), ActorProcessingErr> {
        let Some(view) = self.views.get(x).copied() else { return Ok(()) };
        if generation != view.generation || view.health == Health::Lost {
            return Ok(()); // an older link's, or a lost executor's late result
        }
        if view.health == Health::Syncing
            && !matches!(event, Event::Reset { .. } | Event::Lost { .. } | Event::Failed(_))
        {
            return Ok(()); // a dead incarnation's command finishing before the reset
        }
        let trace = &shared.app.trace;
        match event {
            Event::Reset { evicted, host_budget, host, .. } => {
                tracing::debug!(
                    executor = shared.latency.name(x),
                    evicted,
                    host = host.len(),
                    "executor reset"
                );
                self.views[x].health = Health::Ready;
                // Loads are planned from the tier an expert is in: take the executor's word for
                // its host tier, unless it cannot be true (then plan as from a fresh one).
                if let Err(e) = self.policy.handle_host_report(ExecutorId(x as u16), host_budget, &host) {
                    tracing::warn!(executor = shared.latency.name(x), "{e}");
                }
            }
            Event::Loaded { expert, seconds, resident, .. } => {
                self.views[x].busy = Busy::Idle;
                {
                    let mut st = lock(&shared.store);
                    let c = &mut st.meter.counters[x];
                    c.peak_bytes = c.peak_bytes.max(resident);
                    c.loads += 1;
                    c.load_seconds += seconds;
                }
                timed(&mut self.decide, || self.policy.handle_load_done(now, ExecutorId(x as u16), expert))
                    .map_err(fail)?;
            }
            Event::Ran { batch, expert, rows, seconds, .. } => {
                self.views[x].busy = Busy::Idle;
                {
                    let mut st = lock(&shared.store);
                    let c = &mut st.meter.counters[x];
                    c.batches += 1;
                    c.tasks += rows.len() as u64;
                    c.run_seconds += seconds;
                    if view.restored {
                        st.meter.completed_after_restore.extend(rows.iter().map(|(r, _)| r.0));
                    }
                }
                timed(&mut self.decide, || self.policy.handle_batch_done(now, ExecutorId(x as u16), batch))
                    .map_err(fail)?;
                let children = trace.model.expert(expert).map(|e| e.children.clone()).unwrap_or_default();
                let clients = lock(&shared.store).clients.len() as u64;
                for (request, probs) in rows {
                    // a trace request's walk is recorded; a client's is whatever its outputs select
                    let req = trace.requests.get(request.0 as usize);
                    if req.is_none() && request.0 >= trace.requests.len() as u64 + clients {
                        return Err(fail(format!("executor answered unknown {request}")));
                    }
                    self.outputs.entry(request.0).or_default().insert(expert, quantise(&probs));
                    if children.is_empty() {
                        continue;
                    }
                    let chosen = select_children(&shared.app.child_scores(expert, &probs), &children);
                    if let Some(req) = req
                        && req.selection(expert) != Some(chosen.as_slice())
                    {
                        return Err(fail(format!(
                            "{request}: {expert} selected {chosen:?}, the trace recorded {:?} (trace not made for this app?)",
                            req.selection(expert)
                        )));
                    }
                    timed(&mut self.decide, || {
                        self.policy.handle_preliminary_done(now, request, expert, &chosen)
                    })
                    .map_err(fail)?;
                }
            }
            Event::Lost { why, .. } => self.lose(now, x, &why)?,
            Event::Failed(e) => {
                crate::work::COE.failed();
                return Err(fail(e));
            }
        }
        Ok(())
    }

    /// Carries out the policy's decisions, refereeing each (busy executors, evictions of what
    /// runs), and journals answers.
    fn perform(&mut self, shared: &CoeShared, now: Micros) -> Result<(), ActorProcessingErr> {
        while let Some(action) = timed(&mut self.decide, || self.policy.poll_action()) {
            match action {
                Action::Enqueue { .. } => {}
                Action::Evict { executor, expert } => {
                    let x = executor.index();
                    let busy = self.views[x].busy;
                    if busy == Busy::Loading(expert) || busy == Busy::Running(expert) {
                        return Err(fail(format!("evict of {expert} while {executor} uses it")));
                    }
                    if !self.send(shared, x, Cmd::Evict(expert)) {
                        self.lose(now, x, "link closed")?;
                    }
                }
                Action::Load { executor, expert, .. } => {
                    let x = executor.index();
                    if self.views[x].busy != Busy::Idle || self.views[x].health == Health::Lost {
                        return Err(fail(format!("load of {expert} on busy or lost {executor}")));
                    }
                    self.views[x].busy = Busy::Loading(expert);
                    if !self.send(shared, x, Cmd::Load(expert)) {
                        self.lose(now, x, "link closed")?;
                    }
                }
                Action::RunBatch { executor, batch, expert, requests } => {
                    let x = executor.index();
                    if self.views[x].busy != Busy::Idle || self.views[x].health == Health::Lost {
                        return Err(fail(format!("batch of {expert} on busy or lost {executor}")));
                    }
                    self.views[x].busy = Busy::Running(expert);
                    lock(&shared.store).meter.served[x].push(expert);
                    let inputs = {
                        let st = lock(&shared.store);
                        requests
                            .iter()
                            .map(|r| {
                                let (_, pixels) = request_of(&shared.app, &st.clients, r.0)
                                    .ok_or_else(|| fail(format!("unknown {r}")))?;
                                Ok((*r, pixels))
                            })
                            .collect::<Result<Vec<_>, ActorProcessingErr>>()?
                    };
                    if !self.send(shared, x, Cmd::Run { batch, expert, requests: inputs }) {
                        self.lose(now, x, "link closed")?;
                    }
                }
                Action::Complete { request } => self.answer(shared, request)?,
            }
        }
        Ok(())
    }

    fn answer(&mut self, shared: &CoeShared, request: RequestId) -> Result<(), ActorProcessingErr> {
        let outputs = self.outputs.remove(&request.0).unwrap_or_default();
        let digest = output_digest(&outputs);
        let count = {
            let mut st = lock(&shared.store);
            if st.answered.contains_key(&request.0) {
                return Err(fail(format!("{request} would be answered twice")));
            }
            if let Some(j) = st.journal.as_mut() {
                let body = encode(&CoeRecord::Answered { request: request.0, digest }).map_err(fail)?;
                j.append(&[&body]).map_err(fail)?;
            }
            st.answered.insert(request.0, digest);
            if let Some(k) = request.0.checked_sub(shared.total() as u64) {
                forget_input(&mut st.clients, k);
            }
            if let Some(waiter) = st.waiters.remove(&request.0) {
                // a client that gave up has dropped its receiver: nothing to deliver
                let _ = waiter.send(ClientAnswer { request: request.0, digest, outputs });
            }
            if let Some(at) = st.meter.accepted_at.remove(&request.0) {
                st.meter.latencies.push(at.elapsed());
            }
            publish_queues(&st);
            st.answered.len()
        };
        shared.answered_tx.send_replace(count);
        crate::work::COE.done();
        Ok(())
    }
}

impl Scheduler for CoeScheduler {
    type Input = CoeInput;

    async fn recover(&mut self, me: &SchedulerRef, now: Micros) -> Result<(), ActorProcessingErr> {
        let shared = self.shared.clone();
        let policy =
            RequestScheduler::new(shared.app.trace.model.clone(), shared.latency.clone(), shared.config)
                .map_err(fail)?;
        let n_exec = shared.latency.executors();
        let mut live = Live {
            policy,
            views: vec![
                ExecView { generation: 0, health: Health::Lost, busy: Busy::Idle, restored: false };
                n_exec
            ],
            cursor: 0,
            outputs: HashMap::new(),
            decide: Duration::ZERO,
        };
        // From here on, acceptances and link changes reach this incarnation; what happened
        // before is read from the store and the links below.
        lock(&shared.store).scheduler = Some(me.clone());
        let generations: Vec<u64> = (0..n_exec).map(|x| shared.link_generation(x)).collect();
        for (x, g) in generations.into_iter().enumerate() {
            live.views[x] =
                ExecView { generation: g, health: Health::Syncing, busy: Busy::Idle, restored: false };
            if g == 0 || !live.send(&shared, x, Cmd::Reset) {
                live.lose(now, x, "no link")?;
            }
        }
        live.feed_accepted(&shared, now)?;
        live.perform(&shared, now)?;
        let pending = {
            let st = lock(&shared.store);
            st.accepted.len() - st.answered.len()
        };
        tracing::info!(pending, "coe scheduler started: rebuilt from the accepted requests");
        lock(&shared.store).meter.scheduling += std::mem::take(&mut live.decide);
        self.live = Some(live);
        Ok(())
    }

    async fn handle(
        &mut self,
        _me: &SchedulerRef,
        now: Micros,
        input: CoeInput,
    ) -> Result<(), ActorProcessingErr> {
        let shared = self.shared.clone();
        let live = self.live.as_mut().ok_or_else(|| fail("coe scheduler used before recover"))?;
        match input {
            CoeInput::Accepted => live.feed_accepted(&shared, now)?,
            CoeInput::Exec { exec, generation, event } => {
                live.on_event(&shared, now, exec, generation, event)?
            }
            CoeInput::Down { exec, generation, why } => {
                if live.views.get(exec).is_some_and(|v| v.generation == generation) {
                    live.lose(now, exec, &why)?;
                }
            }
            CoeInput::Restored { exec } => {
                if exec < live.views.len() {
                    live.adopt(&shared, now, exec)?;
                }
            }
        }
        let done = live.perform(&shared, now);
        lock(&shared.store).meter.scheduling += std::mem::take(&mut live.decide);
        done
    }
}

/// Feeds the trace's requests not yet accepted at their arrival times (scaled by
/// `arrival_scale`, counted from now, so a resumed job does not wait for times already past)
/// and waits until every request is answered. Fails when the scheduler's supervisor reports an
/// escalation, or at `deadline`.
pub async fn serve_trace(
    shared: &Arc<CoeShared>,
    arrival_scale: f64,
    deadline: Duration,
    mut failures: tokio::sync::broadcast::Receiver<crate::supervisor::SupervisorEvent>,
) -> Result<(), CoeError> {
    let n = shared.total();
    let accepted = shared.accepted();
    let order: Vec<u64> = (0..n as u64).filter(|i| !accepted.contains(i)).collect();
    let arrival = |i: u64| shared.app.trace.requests[i as usize].arrival.0 as f64 * arrival_scale.max(0.0);
    let base = order.first().map_or(0.0, |&i| arrival(i));
    let start = tokio::time::Instant::now();
    let give_up = start + deadline;
    let at = |i: u64| start + Duration::from_micros((arrival(i) - base).max(0.0) as u64);
    let mut answered = shared.answered();
    let mut next = 0usize;
    loop {
        let now = tokio::time::Instant::now();
        let due_end = order[next..].iter().position(|&i| at(i) > now).map_or(order.len(), |p| next + p);
        if due_end > next {
            shared.accept(&order[next..due_end])?;
            next = due_end;
        }
        let done = *answered.borrow_and_update();
        if done >= n {
            return Ok(());
        }
        let wake = order.get(next).map_or(give_up, |&i| at(i).min(give_up));
        tokio::select! {
            changed = answered.changed() => {
                if changed.is_err() {
                    return Err(CoeError::Invalid("the coe job state was dropped".into()));
                }
            }
            ev = failures.recv() => match ev {
                Ok(crate::supervisor::SupervisorEvent::Escalated { child, reason, .. }) => {
                    return Err(CoeError::Invalid(format!("{child} failed past its restart intensity: {reason}")));
                }
                Ok(crate::supervisor::SupervisorEvent::Restarted { child, reason, .. }) => {
                    tracing::warn!(%child, %reason, "coe scheduler restarted");
                }
                Err(tokio::sync::broadcast::error::RecvError::Lagged(_)) => {}
                Err(tokio::sync::broadcast::error::RecvError::Closed) => {
                    return Err(CoeError::Invalid("the scheduler's supervisor stopped".into()));
                }
            },
            () = tokio::time::sleep_until(wake) => {
                if tokio::time::Instant::now() >= give_up {
                    return Err(CoeError::Invalid(format!(
                        "run did not finish: {done} of {n} requests answered at the deadline"
                    )));
                }
            }
        }
    }
}
