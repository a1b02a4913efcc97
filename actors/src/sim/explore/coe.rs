//! The `coe` workload of the fault explorer (simulation only): a client node submits numbered
//! requests through the real request service to the real coe scheduler, which runs them on two
//! executor nodes on the [`SimCompute`](crate::coe::sim_compute::SimCompute) stand-in
//! ([`crate::sim::coe`]).
//!
//! Every node but the client's may crash, the scheduler's too. What each node runs at start
//! ([`SimWorkload::prepare`], at the first start and every restart) is what its `troupe node`
//! does: an executor node spawns its executor actor; the scheduler node opens its journal (a
//! real file in the run's own folder: that node's disk), reports a torn tail, finds the
//! executors, starts the scheduler under its root supervisor (which resumes the accepted work),
//! follows its executors' nodes ([`follow_executors`]) and serves requests.
//!
//! Process and storage faults ([`with_process_faults`]): each crash of the scheduler node leaves
//! a seeded [`Tear`] on its disk — part of an unacknowledged append or a compaction's temp file
//! — and seeded panics go off in the scheduler through the fault switch, at a site of the run's
//! own ([`crate::fault::install_site`]).
//!
//! Why no storage seam: [`crate::journal`] acknowledges an append only after `fdatasync`, and
//! a compaction renames a synced temp file, so all a crash can leave unsynced is the append in
//! progress (never acknowledged) or that temp file; the explorer writes exactly those into the
//! node's real journal folder before its restart. An in-memory file system behind a trait would
//! model no state this does not.
//!
//! Clock skew: nothing in this workload compares times across nodes — heartbeats carry only a
//! sequence number, membership times silence on the receiver's clock, the scheduler's decisions
//! and acceptance times are on its job clock, and no record or message carries a time — so a
//! per-node clock offset cannot change a decision here, and none is modelled. (The typed
//! layer's placement generations are wall-clock micros compared across nodes: skew matters
//! there, for the workloads that place children remotely.)
//!
//! The client retries a request only when the runtime says it was not answered (a failed or
//! timed-out call, busy): a retry is a new request to the scheduler (client requests carry no
//! key), so the client keeps one answer, the output digest, per number. Beyond the explorer's
//! checks, [`SimWorkload::check`] asks: did a restart lose anything acknowledged (an accepted
//! request, an answer's digest), and was every request the scheduler accepted answered?

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::task::{JoinHandle, JoinSet};
use troupe_policy::coe::admission::AdmissionLimits;
use troupe_policy::coe::{ExpertId, LatencyModel, SchedulerConfig};
use troupe_policy::sim::faults::{ProcessSpace, Tear, with_process_faults};
use troupe_policy::sim::{FaultSchedule, SimFault};
use troupe_transport::{NodeId, Role, RoleSet};

use super::{Answers, ExploreConfig, SimWorkload, schedule_for};
use crate::coe::app::{App, INPUT_WIDTH};
use crate::coe::remote::follow_executors;
use crate::coe::requests::{REQUEST, REQUEST_SERVICE, WireCoeRequest, decode_answer, serve_requests};
use crate::coe::serve::CoeShared;
use crate::membership::MembershipConfig;
use crate::service::to_body;
use crate::sim::coe::{sim_app, start_executor, start_scheduler};
use crate::sim::{SimNode, SimNodeSpec};

/// The seed of the app every run serves (outputs depend on it, not on the run's seed).
const APP_SEED: u64 = 3;
/// One client call's timeout.
const CALL: Duration = Duration::from_secs(3);
/// The pause after a failed try.
const BACKOFF: Duration = Duration::from_millis(250);
/// How long the client keeps trying a request before it gives up (past any schedule's faults;
/// counted in time, not tries: a call to a node still starting fails at once).
const GIVE_UP: Duration = Duration::from_secs(90);
/// How long the scheduler node waits for its executors at start, and its calls to them.
const FIND: Duration = Duration::from_secs(30);
const EXEC_CALL: Duration = Duration::from_secs(2);
/// How long the client waits, once answered, for the scheduler to finish what it accepted.
const SETTLE: Duration = Duration::from_secs(30);

/// The workload: `requests` requests, one every `stagger`; `panics` scheduler panics per seed.
pub struct CoeWorkload {
    /// How many requests.
    pub requests: u64,
    /// Virtual time between two requests' starts.
    pub stagger: Duration,
    /// Scheduler panics drawn per seed.
    pub panics: usize,
    app: Arc<App>,
    latency: LatencyModel,
    runs: Arc<Mutex<BTreeMap<String, Run>>>,
}

/// One run's state outside the nodes: the scheduler node's disk and incarnation, and what the
/// workload saw go wrong.
struct Run {
    disk: PathBuf,
    /// The scheduler node's current incarnation's job, and its start task.
    shared: Option<Arc<CoeShared>>,
    tasks: Vec<JoinHandle<()>>,
    /// What the crashed incarnation had acknowledged: accepted requests and answers' digests.
    acknowledged: Option<BTreeMap<u64, Option<u64>>>,
    violations: Vec<String>,
}

impl Drop for Run {
    fn drop(&mut self) {
        self.tasks.iter().for_each(JoinHandle::abort);
        let _ = std::fs::remove_dir_all(&self.disk);
    }
}

impl CoeWorkload {
    /// `requests` requests, one every `stagger`, `panics` scheduler panics per seed.
    pub fn new(requests: u64, stagger: Duration, panics: usize) -> Result<Self, crate::coe::CoeError> {
        let (app, latency) = sim_app(APP_SEED)?;
        Ok(Self { requests, stagger, panics, app, latency, runs: Arc::default() })
    }

    /// The run the explorer's CI and `troupe sim` use: 12 requests 0.4 s apart, one scheduler
    /// panic per seed.
    pub fn standard() -> Result<Self, crate::coe::CoeError> {
        Self::new(12, Duration::from_millis(400), 1)
    }

    /// The schedule of `seed` for this workload: the explorer's network and node faults, a tear
    /// after each crash of the scheduler node, and the scheduler panics.
    pub fn schedule(&self, tag: &str, seed: u64, config: &ExploreConfig) -> FaultSchedule {
        let nodes = self.nodes(tag);
        let sched = scheduler_node(tag);
        let space = ProcessSpace {
            seed,
            disks: vec![sched.clone()],
            schedulers: vec![sched],
            panics: self.panics,
            horizon: config.horizon,
        };
        with_process_faults(&schedule_for(seed, &nodes, config), &space)
    }

    fn run<T>(&self, tag: &str, f: impl FnOnce(&mut Run) -> T) -> Option<T> {
        let mut runs = self.runs.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        runs.get_mut(tag).map(f)
    }

    /// Request `i`'s entry expert and input.
    fn request(&self, i: u64) -> (ExpertId, Vec<f32>) {
        let roots: Vec<ExpertId> = self.app.trace.model.roots().map(|e| e.id).collect();
        let root = roots.get(i as usize % roots.len().max(1)).copied().unwrap_or(ExpertId(0));
        let pixels = (0..INPUT_WIDTH).map(|j| ((i as usize * 31 + j * 7) % 17) as f32 / 16.0).collect();
        (root, pixels)
    }

    /// The scheduler node's start: open the journal on its disk, then (in a task) find the
    /// executors, start the scheduler, follow the executors' nodes and serve requests.
    fn start_scheduler_node(&self, tag: &str, node: &SimNode) {
        let mut runs = self.runs.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        let Some(run) = runs.get_mut(tag) else { return };
        run.tasks.drain(..).for_each(|t| t.abort());
        let journal = run.disk.join("coe.journal");
        let opened =
            CoeShared::open(self.app.clone(), self.latency.clone(), SchedulerConfig::ours(), Some(&journal));
        let (shared, damage) = match opened {
            Ok(o) => o,
            Err(e) => {
                run.violations.push(format!("the scheduler node's journal did not open: {e}"));
                return;
            }
        };
        if let Some(d) = damage {
            tracing::debug!(%tag, "coe journal tail cut at restart: {d}");
        }
        if let Some(before) = run.acknowledged.take() {
            for (id, digest) in before {
                let now = shared.accepted().contains(&id).then(|| shared.answer_of(id));
                match (digest, now) {
                    (_, None) => run.violations.push(format!("request {id}: accepted, lost by a restart")),
                    (Some(d), Some(got)) if got != Some(d) => run
                        .violations
                        .push(format!("request {id}: answered {d:016x}, after a restart {got:?}")),
                    _ => {}
                }
            }
        }
        shared.set_fault_site(&fault_site(tag));
        run.shared = Some(shared.clone());
        let members = node.subscribe_membership();
        let (actors, supervisor, services) =
            (node.actors.clone(), node.supervisor.clone(), node.services.clone());
        let limits = AdmissionLimits { per_node: 64, per_peer: 64 };
        let runs_tag = tag.to_string();
        let started = tokio::spawn(async move {
            match start_scheduler(&actors, &supervisor, &shared, FIND, EXEC_CALL).await {
                Ok(found) => {
                    let nodes = found.into_iter().map(|x| x.node).collect();
                    serve_requests(&services, shared.clone(), limits, CALL);
                    follow_executors(shared, actors, members, nodes, EXEC_CALL, |_| {}).await;
                }
                Err(e) => tracing::warn!(tag = %runs_tag, "the coe scheduler did not start: {e}"),
            }
        });
        run.tasks.push(started);
    }

    /// What `tear` leaves on the crashed scheduler node's disk.
    fn tear(&self, tag: &str, tear: Tear) -> Result<bool, String> {
        self.run(tag, |run| {
            // what the crashed incarnation acknowledged, to hold its restart to
            if let Some(shared) = run.shared.take() {
                run.acknowledged =
                    Some(shared.accepted().into_iter().map(|id| (id, shared.answer_of(id))).collect());
            }
            super::disk::tear_journal(&run.disk.join("coe.journal"), tear)
        })
        .unwrap_or(Ok(false))
    }
}

/// The scheduler node's name in run `tag`.
fn scheduler_node(tag: &str) -> String {
    format!("{tag}-sched")
}

/// The scheduler's fault-switch site in run `tag`.
fn fault_site(tag: &str) -> String {
    format!("{}/{tag}", crate::coe::serve::FAULT_SITE)
}

fn spec(name: &str, role: Role) -> SimNodeSpec {
    SimNodeSpec::new(name, RoleSet::only(role)).membership(MembershipConfig {
        heartbeat: Duration::from_millis(100),
        timeout: Duration::from_millis(1000),
    })
}

/// A folder for one run's disks: in memory where the box has one (the journal's syncs stay
/// real, and cheap).
fn disk_for(tag: &str) -> PathBuf {
    let shm = PathBuf::from("/dev/shm");
    let base = if shm.is_dir() { shm } else { std::env::temp_dir() };
    base.join(format!("troupe-sim-{tag}-{}", std::process::id()))
}

impl SimWorkload for CoeWorkload {
    fn name(&self) -> &'static str {
        "coe"
    }

    fn nodes(&self, tag: &str) -> Vec<SimNodeSpec> {
        let mut nodes =
            vec![spec(&format!("{tag}-client"), Role::Client), spec(&scheduler_node(tag), Role::Scheduler)];
        nodes.extend((0..self.latency.executors()).map(|e| spec(&format!("{tag}-exec{e}"), Role::Executor)));
        nodes
    }

    fn begin(&self, tag: &str) {
        let disk = disk_for(tag);
        let mut runs = self.runs.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        runs.remove(tag);
        let _ = std::fs::remove_dir_all(&disk);
        let mut violations = Vec::new();
        if let Err(e) = std::fs::create_dir_all(&disk) {
            violations.push(format!("no disk for the scheduler node at {}: {e}", disk.display()));
        }
        super::arm_scheduler_panic(&fault_site(tag), false);
        runs.insert(
            tag.to_string(),
            Run { disk, shared: None, tasks: Vec::new(), acknowledged: None, violations },
        );
    }

    fn prepare(&self, node: &SimNode) {
        let name = node.name.as_str();
        let Some((tag, role)) = name.rsplit_once('-') else { return };
        if role == "sched" {
            self.start_scheduler_node(tag, node);
        } else if let Some(e) = role.strip_prefix("exec").and_then(|e| e.parse::<usize>().ok()) {
            let (app, latency) = (self.app.clone(), self.latency.clone());
            let (actors, name) = (node.actors.clone(), node.name.clone());
            // what the executor node's job does at start: its executor actor, under its profile name
            tokio::spawn(async move {
                if let Err(err) = start_executor(&actors, &app, &latency, e).await {
                    tracing::warn!(node = %name, "the coe executor did not start: {err}");
                }
            });
        }
    }

    fn client(&self, tag: &str, node: &SimNode) -> impl Future<Output = Answers> + Send + 'static {
        let services = node.services.clone();
        let sched = NodeId::new(scheduler_node(tag));
        let bodies: Vec<Option<Vec<u8>>> = (0..self.requests)
            .map(|i| {
                let (root, pixels) = self.request(i);
                to_body(&WireCoeRequest { root: Some(root.0), pixels }).ok()
            })
            .collect();
        let stagger = self.stagger;
        let (runs, tag) = (self.runs.clone(), tag.to_string());
        let job: JobOf = Box::new(move || {
            let runs = runs.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
            runs.get(&tag).and_then(|r| r.shared.clone())
        });
        async move {
            let mut calls = JoinSet::new();
            for (i, body) in (0u64..).zip(bodies) {
                let (services, sched) = (services.clone(), sched.clone());
                calls.spawn(async move {
                    tokio::time::sleep(stagger * u32::try_from(i).unwrap_or(u32::MAX)).await;
                    let Some(body) = body else { return (i, None) };
                    let until = crate::clock::timer_now() + GIVE_UP;
                    while crate::clock::timer_now() < until {
                        match services.call(&sched, REQUEST_SERVICE, REQUEST, body.clone(), CALL).await {
                            Ok(answer) => return (i, decode_answer(&answer).ok().map(|a| a.digest)),
                            Err(_) => tokio::time::sleep(BACKOFF).await,
                        }
                    }
                    (i, None)
                });
            }
            let mut answers = Answers::default();
            while let Some(done) = calls.join_next().await {
                match done {
                    Ok((i, Some(digest))) => answers.answers.entry(i).or_default().push(digest),
                    Ok((i, None)) => answers.given_up.push(i),
                    Err(_) => {}
                }
            }
            answers.given_up.sort_unstable();
            settle(job).await;
            answers
        }
    }

    fn process_fault(&self, tag: &str, fault: &SimFault) -> Result<usize, String> {
        match fault {
            SimFault::Tear(_, tear) => self.tear(tag, *tear).map(usize::from),
            SimFault::Panic(_) => {
                super::arm_scheduler_panic(&fault_site(tag), true);
                Ok(0)
            }
            _ => Ok(0),
        }
    }

    fn check(&self, tag: &str) -> Vec<String> {
        let mut runs = self.runs.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        let Some(mut run) = runs.remove(tag) else { return vec!["the run was never begun".into()] };
        super::arm_scheduler_panic(&fault_site(tag), false);
        let mut out = std::mem::take(&mut run.violations);
        match &run.shared {
            Some(shared) => {
                let open = shared.pending();
                if !open.is_empty() {
                    out.push(format!("requests accepted and never answered by the scheduler: {open:?}"));
                }
            }
            None => out.push("the scheduler node ended the run without a job".into()),
        }
        out
    }
}

/// Where the client finds the scheduler node's current job (the test's view, not a node's).
type JobOf = Box<dyn Fn() -> Option<Arc<CoeShared>> + Send + Sync>;

/// Waits (within [`SETTLE`] of virtual time) until the scheduler's current job has answered
/// everything it accepted: retries leave requests whose client stopped waiting, and the
/// scheduler still owes them an answer.
async fn settle(job: JobOf) {
    let until = crate::clock::timer_now() + SETTLE;
    while crate::clock::timer_now() < until {
        if let Some(shared) = job() {
            let mut answered = shared.answered();
            let done = tokio::time::timeout(
                Duration::from_secs(1),
                answered.wait_for(|_| shared.pending().is_empty()),
            );
            if matches!(done.await, Ok(Ok(_))) {
                return;
            }
        } else {
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
}
