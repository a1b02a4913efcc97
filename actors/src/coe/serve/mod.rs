//! The coe scheduler as a supervised actor: the policy's [`troupe_policy::coe::RequestScheduler`] inside the
//! runtime's one [`SchedulerActor`] shell, with the work it has accepted kept apart from it.
//!
//! - **Acceptance is durable.** A request is accepted by [`CoeShared::accept`]: it is appended to
//!   the job's [`Journal`] (fsynced) before the scheduler hears of it. An answer (a request's
//!   output digest) is journaled before it counts, and a request is answered at most once: a
//!   second answer is an error naming the request.
//! - **Warm restart.** On every start [`CoeScheduler`]'s `recover` builds a fresh policy from the
//!   accepted-but-unanswered requests and sends each executor [`super::runner::Cmd::Reset`]. Links are FIFO, so
//!   every event an executor sends before its reset's answer belongs to the dead incarnation and
//!   is dropped; after it, the executor is empty, as the fresh policy believes.
//! - **Restoration.** A link is (re)installed with [`CoeShared::install_link`] under a new
//!   generation (the runtime's [`Links`]: one ordered queue per executor, one generation rule);
//!   the scheduler puts that executor back in service (reset first), so an executor node that
//!   comes back under its name serves again within the same job. Events carry the generation of
//!   the link they came from; older ones are dropped.
//!
//! - **Client requests.** Beside the trace's requests, [`CoeShared::submit`] accepts a client's
//!   own (an entry expert and [`INPUT_WIDTH`] floats): journaled with its input, so a restarted
//!   scheduler reschedules it; it takes the next id after the trace, its selections are whatever
//!   its experts' outputs select, and its answer ([`ClientAnswer`]) goes to the waiting client
//!   once journaled (see [`super::requests`]).
//!
//! - **Bounded journal.** Once the journal is past [`CompactionRule`]'s threshold (64 MiB by
//!   default, [`CoeShared::set_compaction`]) and twice its size after the last rewrite, an answer
//!   is followed by a compaction ([`Journal::compact`]) to what a restart needs: every trace
//!   acceptance and answer (bounded by the trace; `accept` skips what was accepted, the report
//!   needs every digest), each client request not yet answered (with its id and input), and the
//!   next client id. Answered client requests are forgotten, journal and memory alike: a client
//!   request carries no key a retry could repeat (a retry is a new request with a new id), so
//!   nothing deduplicates against them; they can never run again (their acceptance goes with
//!   their answer), ids are never reused, and they still count as answered ([`CoeShared::answered`]).
//!
//! The same actor serves local runs ([`super::runner::run_local`], executor threads) and the
//! distributed `coe` job (executor nodes over QUIC).

use std::collections::{BTreeMap, BTreeSet, HashMap, VecDeque};
use std::path::Path;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use ractor::ActorRef;
use rkyv::rancor;
use rkyv::{Archive, Deserialize, Serialize};
use tokio::sync::watch;
use troupe_policy::Micros;
use troupe_policy::coe::{ExpertId, LatencyModel, SchedulerConfig, belady_min_loads};
use troupe_policy::compaction::CompactionRule;
use troupe_policy::stats::quantile;

use super::CoeError;
use super::app::{App, INPUT_WIDTH};
use super::executor::ExecutorCounters;
use super::link::ExecLink;
use super::runner::{Event, RunReport};
use crate::clock::Clock;
use crate::journal::{Journal, TailDamage};
use crate::kinds::scheduler::{SchedulerActor, SchedulerArgs, SchedulerMsg};
use crate::supervisor::ChildSpec;
use crate::typed::{Links, Outcome, Sink};

mod scheduler;
pub use scheduler::CoeScheduler;

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
    /// The next client request takes this id (written by a compaction: the ids of the answered
    /// client requests it dropped are never reused).
    NextClient(u64),
    /// This many answered client requests were dropped by compactions (they count as answered).
    Forgotten(u64),
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
    /// Digest of its outputs, as a local run computes it ([`super::app::output_digest`]).
    pub digest: u64,
    /// Each expert it ran and that expert's quantised output ([`super::app::quantise`]).
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

/// The job's links to its executors: one ordered queue each, with the runtime's one generation
/// rule ([`Links`]).
type ExecLinks = Links<usize, ExecLink, Option<Event>>;

/// Most answer latencies kept for the report's quantiles (8 MiB of samples).
pub const MAX_LATENCY_SAMPLES: usize = 1 << 20;

/// Most batches per executor whose expert the meter keeps for the Belady count (4 MiB per executor).
pub const MAX_SERVED_ORDER: usize = 1 << 20;

/// Appends `item`, dropping the oldest first so that `q` holds at most `cap` items.
fn push_bounded<T>(q: &mut VecDeque<T>, item: T, cap: usize) {
    while q.len() >= cap.max(1) {
        q.pop_front();
    }
    q.push_back(item);
}

/// Measurements that survive scheduler restarts (they describe the run, not decisions).
#[derive(Default)]
struct Meter {
    counters: Vec<ExecutorCounters>,
    /// Per executor, the experts of its latest [`MAX_SERVED_ORDER`] batches, in order: the
    /// input of the Belady count (a trace run's whole order; a long serve's recent window).
    served: Vec<VecDeque<ExpertId>>,
    /// When each open request was accepted, on the job's clock.
    accepted_at: HashMap<u64, Micros>,
    /// Accept-to-answer times of the latest [`MAX_LATENCY_SAMPLES`] answers (a long-serving
    /// scheduler's report covers its recent window, not its whole life).
    latencies: VecDeque<Duration>,
    restorations: usize,
    /// Requests completed on an executor after it was put back in service.
    completed_after_restore: usize,
    /// Time inside the policy's `RequestScheduler` calls, every incarnation.
    scheduling: Duration,
}

/// The durable part: journal, accepted and answered requests, and where the scheduler is.
struct Store {
    journal: Option<Journal>,
    accepted: Vec<u64>,
    accepted_set: BTreeSet<u64>,
    answered: BTreeMap<u64, u64>,
    /// Client requests not yet answered, by id.
    clients: BTreeMap<u64, ClientRequest>,
    /// The id the next client request takes.
    next_client: u64,
    /// Answered client requests dropped by compactions (counted as answered).
    forgotten: u64,
    /// How much of `accepted` the scheduler incarnation has been fed.
    fed: usize,
    /// When the journal is rewritten.
    compaction: CompactionRule,
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
    links: ExecLinks,
    answered_tx: watch::Sender<usize>,
    /// Executors whose link lost a call (their node may well be up: see [`Self::subscribe_link_lost`]).
    link_lost_tx: tokio::sync::broadcast::Sender<usize>,
    /// The job's clock: the scheduler shell's in every incarnation, acceptance times, the
    /// makespan.
    clock: Clock,
    /// The scheduler's fault-switch site ([`FAULT_SITE`] unless a simulation names its own).
    fault_site: Mutex<String>,
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

/// Where request `id` enters and its input: a trace request's, or an open client's.
fn request_of(app: &App, clients: &BTreeMap<u64, ClientRequest>, id: u64) -> Option<(ExpertId, Vec<f32>)> {
    match app.trace.requests.get(usize::try_from(id).ok()?) {
        Some(r) => Some((r.root, app.input(r.input))),
        None => clients.get(&id).map(|c| (c.root, c.pixels.clone())),
    }
}

/// Where request `id` enters: a trace request's root, or an open client's.
fn root_of(app: &App, clients: &BTreeMap<u64, ClientRequest>, id: u64) -> Option<ExpertId> {
    match app.trace.requests.get(usize::try_from(id).ok()?) {
        Some(r) => Some(r.root),
        None => clients.get(&id).map(|c| c.root),
    }
}

impl Store {
    /// Requests answered, forgotten ones included.
    fn answered_count(&self) -> usize {
        self.answered.len().saturating_add(usize::try_from(self.forgotten).unwrap_or(usize::MAX))
    }

    /// Whether request `id` is accepted and not answered.
    fn is_open(&self, id: u64) -> bool {
        self.accepted_set.contains(&id) && !self.answered.contains_key(&id)
    }

    /// The records a restart needs (see the module docs), in replay order; `n` is the trace's
    /// length.
    fn live_records(&self, n: u64) -> Result<Vec<Vec<u8>>, CoeError> {
        let mut out = Vec::new();
        let forgetting = self.answered.range(n..).count() as u64;
        let forgotten = self.forgotten.saturating_add(forgetting);
        if forgotten > 0 {
            out.push(encode(&CoeRecord::Forgotten(forgotten))?);
        }
        let trace: Vec<u64> = self.accepted_set.range(..n).copied().collect();
        for chunk in trace.chunks(ACCEPT_CHUNK) {
            out.push(encode(&CoeRecord::Accepted(chunk.to_vec()))?);
        }
        for (&request, &digest) in self.answered.range(..n) {
            out.push(encode(&CoeRecord::Answered { request, digest })?);
        }
        let mut next = n;
        for (&id, c) in &self.clients {
            if id != next {
                out.push(encode(&CoeRecord::NextClient(id))?);
            }
            out.push(encode(&CoeRecord::Submitted { root: c.root.0, pixels: c.pixels.clone() })?);
            next = id + 1;
        }
        if next != self.next_client {
            out.push(encode(&CoeRecord::NextClient(self.next_client))?);
        }
        Ok(out)
    }

    /// Rewrites the journal to [`Store::live_records`] and forgets, in memory too, the answered
    /// client requests it dropped. Memory is pruned only once the rewrite is wholly done: after a
    /// failed one it still holds those requests (answered, so never run; the next compaction's
    /// `Forgotten` count includes them).
    fn compact(&mut self, n: u64) -> Result<(), CoeError> {
        let live = self.live_records(n)?;
        let Some(j) = self.journal.as_mut() else { return Ok(()) };
        j.compact(&live).map_err(|e| CoeError::Invalid(e.to_string()))?;
        let done: Vec<u64> = self.answered.range(n..).map(|(&id, _)| id).collect();
        for id in &done {
            self.answered.remove(id);
            self.accepted_set.remove(id);
        }
        self.forgotten = self.forgotten.saturating_add(done.len() as u64);
        // keep only open work in the feed list, and where the scheduler is in it
        let fed =
            self.accepted[..self.fed.min(self.accepted.len())].iter().filter(|&&i| self.is_open(i)).count();
        let open: Vec<u64> = self.accepted.iter().copied().filter(|&i| self.is_open(i)).collect();
        self.accepted = open;
        self.fed = fed;
        Ok(())
    }

    /// Compacts when the rule says so (after an answer, at open); a failed compaction is logged
    /// and the journal, old or new, stays valid.
    fn maybe_compact(&mut self, n: u64) {
        let Some(j) = self.journal.as_ref() else { return };
        if !self.compaction.due(j.bytes(), j.compacted_bytes()) {
            return;
        }
        let (path, before) = (j.path().display().to_string(), j.bytes());
        match self.compact(n) {
            Ok(()) => {
                let after = self.journal.as_ref().map_or(0, Journal::bytes);
                tracing::info!(journal = %path, before, after, "coe journal compacted");
            }
            Err(e) => tracing::warn!(journal = %path, "coe journal compaction failed: {e}"),
        }
    }
}

impl CoeShared {
    /// A job over `app` with `config`; with `journal`, accepted and answered requests are
    /// replayed from that file and appended to it (see the module docs), and the journal is
    /// compacted at once if the default [`CompactionRule`] says it is due. Returns the damaged
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
            clients: BTreeMap::new(),
            next_client: n,
            forgotten: 0,
            fed: 0,
            compaction: CompactionRule::default(),
            waiters: HashMap::new(),
            scheduler: None,
            meter: Meter {
                counters: vec![ExecutorCounters::default(); latency.executors()],
                served: vec![VecDeque::new(); latency.executors()],
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
                        store.clients.remove(&request);
                    }
                    CoeRecord::Submitted { root, pixels } => {
                        let client = check_client(&app, ExpertId(root), pixels)
                            .map_err(|e| CoeError::Invalid(format!("journal {}: {e}", path.display())))?;
                        let id = store.next_client;
                        store.next_client += 1;
                        store.clients.insert(id, client);
                        store.accepted_set.insert(id);
                        store.accepted.push(id);
                    }
                    CoeRecord::NextClient(id) => {
                        if id < store.next_client {
                            return Err(CoeError::Invalid(format!(
                                "journal {}: next client id {id} goes back (ids up to {} taken)",
                                path.display(),
                                store.next_client
                            )));
                        }
                        store.next_client = id;
                    }
                    CoeRecord::Forgotten(k) => store.forgotten = store.forgotten.saturating_add(k),
                }
            }
            damage = replay.damage;
            store.journal = Some(j);
            store.maybe_compact(n);
        }
        let answered = store.answered_count();
        publish_queues(&store);
        let shared = Arc::new_cyclic(|me: &std::sync::Weak<Self>| {
            let me = me.clone();
            // a link's outcomes go to the scheduler tagged with the link's generation
            let sink: Sink<usize, Option<Event>> = Arc::new(move |exec, generation, outcome| {
                let Some(shared) = me.upgrade() else { return };
                let event = match outcome {
                    Outcome::Done(None) => return,
                    Outcome::Done(Some(event)) => event,
                    Outcome::Failed(e) => Event::Failed(CoeError::Invalid(format!("executor {exec}: {e}"))),
                    Outcome::Lost(e) => {
                        let _ = shared.link_lost_tx.send(exec);
                        Event::Lost { exec, why: format!("call failed: {e}") }
                    }
                };
                shared.tell(CoeInput::Exec { exec, generation, event });
            });
            Self {
                app,
                latency,
                config,
                store: Mutex::new(store),
                links: Links::new(sink),
                answered_tx: watch::channel(answered).0,
                link_lost_tx: tokio::sync::broadcast::channel(64).0,
                clock: Clock::start(),
                fault_site: Mutex::new(FAULT_SITE.to_string()),
            }
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

    /// Executors in the profile.
    pub fn executors(&self) -> usize {
        self.latency.executors()
    }

    /// Requests in the trace.
    pub fn total(&self) -> usize {
        self.app.trace.requests.len()
    }

    /// Requests accepted so far (replayed ones included; answered client requests a compaction
    /// dropped are not).
    pub fn accepted(&self) -> BTreeSet<u64> {
        lock(&self.store).accepted_set.clone()
    }

    /// Requests accepted and not yet answered: the work a restart resumes.
    pub fn pending(&self) -> BTreeSet<u64> {
        let st = lock(&self.store);
        st.accepted_set.iter().copied().filter(|&i| st.is_open(i)).collect()
    }

    /// The id the next client request takes.
    pub fn next_client_id(&self) -> u64 {
        lock(&self.store).next_client
    }

    /// Names the scheduler's fault-switch site from its next start on (a simulated cluster gives
    /// each run its own, so runs in one process never share the switch's hit counts).
    pub fn set_fault_site(&self, site: &str) {
        *lock(&self.fault_site) = site.to_string();
    }

    /// Sets when the journal is compacted, and compacts now if that rule says it is due.
    pub fn set_compaction(&self, rule: CompactionRule) {
        let mut st = lock(&self.store);
        st.compaction = rule;
        st.maybe_compact(self.total() as u64);
    }

    /// The journal's size in bytes (0 without one).
    pub fn journal_bytes(&self) -> u64 {
        lock(&self.store).journal.as_ref().map_or(0, Journal::bytes)
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
        let now = self.clock.now();
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
        let id = st.next_client;
        st.next_client += 1;
        st.clients.insert(id, client);
        st.accepted_set.insert(id);
        st.accepted.push(id);
        st.meter.accepted_at.insert(id, self.clock.now());
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

    /// Installs a (new) link to executor `exec` through `handle` and tells the scheduler; the
    /// link's outcomes carry the returned generation.
    pub fn install_link(&self, exec: usize, handle: ExecLink) -> u64 {
        if exec >= self.latency.executors() {
            return 0;
        }
        let generation = self.links.attach(exec, handle);
        self.tell(CoeInput::Restored { exec });
        generation
    }

    /// Executors (by index) whose link lost a call from now on: the scheduler takes them out of
    /// service, and whoever follows the executors links them again once found
    /// ([`super::remote::follow_executors`]), as when their node rejoins.
    pub fn subscribe_link_lost(&self) -> tokio::sync::broadcast::Receiver<usize> {
        self.link_lost_tx.subscribe()
    }

    /// Gives executor `exec` a new link generation through its live link (`None`: it has
    /// none): commands an earlier scheduler incarnation queued are dropped, and the outcome of
    /// one in flight is no longer current, so a new incarnation never takes it as its own.
    pub fn renew_link(&self, exec: usize) -> Option<u64> {
        self.links.renew(&exec)
    }

    /// Current generation of executor `exec`'s link.
    pub fn link_generation(&self, exec: usize) -> u64 {
        self.links.generation(&exec)
    }

    /// Sends an input to the current scheduler incarnation (dropped while none is running:
    /// a new incarnation rebuilds from the store and resets executors).
    pub fn tell(&self, input: CoeInput) {
        let scheduler = lock(&self.store).scheduler.clone();
        if let Some(s) = scheduler {
            let _ = SchedulerMsg::tell(&s, input);
        }
    }

    /// The child spec that runs this job's scheduler under a supervisor.
    pub fn child_spec(self: &Arc<Self>) -> ChildSpec {
        let shared = self.clone();
        ChildSpec::new(SCHEDULER, move || {
            (
                SchedulerActor::<CoeScheduler>::default(),
                SchedulerArgs {
                    scheduler: CoeScheduler::new(shared.clone()),
                    fault_site: lock(&shared.fault_site).clone(),
                },
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
        (st.meter.restorations, st.meter.completed_after_restore)
    }

    /// Drops every link (local executor threads then end).
    pub fn close_links(&self) {
        for exec in 0..self.latency.executors() {
            self.links.detach(&exec);
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
            let order: Vec<ExpertId> = s.iter().copied().collect();
            belady += belady_min_loads(&order, |e| model.size_of(e), self.latency.expert_budget(x))
                .map_err(|e| CoeError::Invalid(e.to_string()))?;
        }
        let makespan_s = self.clock.now().as_secs_f64();
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

impl CoeShared {
    /// Records request `id`'s answer: journaled (synced) before it counts, then handed to its
    /// waiting client, if any; the journal is compacted after it when due. Refused for a request
    /// not open (answered already, or never accepted).
    fn settle(&self, id: u64, digest: u64, outputs: BTreeMap<ExpertId, Vec<i32>>) -> Result<(), CoeError> {
        let count = {
            let mut st = lock(&self.store);
            if !st.is_open(id) {
                return Err(CoeError::Invalid(format!(
                    "request {id} would be answered twice (or was never accepted)"
                )));
            }
            if let Some(j) = st.journal.as_mut() {
                let body = encode(&CoeRecord::Answered { request: id, digest })?;
                j.append(&[&body]).map_err(|e| CoeError::Invalid(e.to_string()))?;
            }
            st.answered.insert(id, digest);
            st.clients.remove(&id);
            if let Some(waiter) = st.waiters.remove(&id) {
                // a client that gave up has dropped its receiver: nothing to deliver
                let _ = waiter.send(ClientAnswer { request: id, digest, outputs });
            }
            if let Some(at) = st.meter.accepted_at.remove(&id) {
                let latency = Duration::from_micros((self.clock.now() - at).0);
                push_bounded(&mut st.meter.latencies, latency, MAX_LATENCY_SAMPLES);
            }
            st.maybe_compact(self.total() as u64);
            publish_queues(&st);
            st.answered_count()
        };
        self.answered_tx.send_replace(count);
        Ok(())
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
    let start = crate::clock::timer_now();
    let give_up = start + deadline;
    let at = |i: u64| start + Duration::from_micros((arrival(i) - base).max(0.0) as u64);
    let mut answered = shared.answered();
    let mut next = 0usize;
    loop {
        let now = crate::clock::timer_now();
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
                if crate::clock::timer_now() >= give_up {
                    return Err(CoeError::Invalid(format!(
                        "run did not finish: {done} of {n} requests answered at the deadline"
                    )));
                }
            }
        }
    }
}

#[cfg(test)]
mod meter_tests {
    use super::*;

    #[test]
    fn the_latency_window_keeps_the_latest_samples_up_to_its_cap() {
        let mut q = VecDeque::new();
        for i in 0..10u64 {
            push_bounded(&mut q, i, 4);
        }
        assert_eq!(q.iter().copied().collect::<Vec<_>>(), vec![6, 7, 8, 9]);
    }
}

#[cfg(test)]
mod journal_tests;
