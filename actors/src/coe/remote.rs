//! The distributed shells: a `coe-executor` typed actor on each executor node, named
//! `coe-executor/NAME` ([`exec_wire::actor_name`]), and how the scheduler node finds it.
//!
//! Load, evict, run and reset may be sent only by a certificate with the `scheduler` role; hello
//! by any member (messages and rules: [`super::exec_wire`]). The scheduler drives each executor
//! through the job's [`crate::typed::Links`] queue ([`super::link::ExecLink`]); a call that finds
//! the executor gone or silent, or its node going down in the membership view, becomes
//! [`super::runner::Event::Lost`]: the scheduler requeues that executor's queued and in-flight
//! work on the survivors.

use std::path::PathBuf;
use std::time::Duration;

use troupe_policy::coe::{ExpertId, LatencyModel};

use super::CoeError;
use super::app::App;
use super::exec_wire::{
    self, Evict, Hello, HelloReply, Load, Reset, WireLoaded, WireRan, WireReset, WireRow, WireRun,
};
use super::executor::ExpertExecutor;
use super::profiler::load_profile;
use super::runner::{Cmd, Event, TierOptions, execute};
use super::sim_compute::{SimCompute, SimComputeSpec};
use crate::typed::{
    ActorContext, ActorError, ActorFailure, ActorHandle, Actors, Handles, Protocol, TypedActor,
};

pub use super::exec_wire::{MAX_BATCH_WIRE, MAX_ROW_WIRE};

/// What an executor actor starts from: its app folder and its name in the profile, and which
/// compute it runs on.
#[derive(rkyv::Archive, rkyv::Serialize, rkyv::Deserialize, Clone, Debug, PartialEq, Eq)]
pub struct ExecutorSpec {
    /// The app folder (manifest, store, trace, profile); unused by a [`SimCompute`].
    pub dir: String,
    /// The executor's name in the profile.
    pub executor: String,
    /// `None`: the real executor, opened from `dir`. `Some`: the deterministic stand-in
    /// [`SimCompute`] (simulation only), which opens no file.
    pub sim: Option<SimComputeSpec>,
}

impl ExecutorSpec {
    /// The real executor `executor` of the app in `dir`.
    pub fn real(dir: impl Into<String>, executor: impl Into<String>) -> Self {
        ExecutorSpec { dir: dir.into(), executor: executor.into(), sim: None }
    }

    /// Executor `executor` on the [`SimCompute`] stand-in (simulation only).
    pub fn sim(executor: impl Into<String>, spec: SimComputeSpec) -> Self {
        ExecutorSpec { dir: String::new(), executor: executor.into(), sim: Some(spec) }
    }
}

/// The compute an executor actor carries commands out on: the seam between the shell (typed
/// actor, wire, role checks) and what runs the experts.
// One per executor actor, made once at its start: the real executor stays inline (no box, no
// extra indirection on its path) though the stand-in is much smaller.
#[allow(clippy::large_enum_variant)]
enum Compute {
    /// The real executor: weight store, ONNX Runtime or the MLP engine.
    Real(ExpertExecutor),
    /// The deterministic stand-in of a simulated cluster.
    Sim(SimCompute),
}

/// The executor actor: owns its compute and carries out the scheduler's commands.
pub struct CoeExecutor {
    name: String,
    node: String,
    compute: Compute,
}

/// Opens the app and the executor named `spec.executor` with the profile's budget.
pub fn open_executor(spec: &ExecutorSpec) -> Result<ExpertExecutor, CoeError> {
    let dir = PathBuf::from(&spec.dir);
    let app = App::open(&dir, None)?;
    let profile = load_profile(&dir.join("profile.txt"))?;
    let latency = LatencyModel::from_profile(&profile).map_err(|e| CoeError::Invalid(e.to_string()))?;
    let index = (0..latency.executors())
        .find(|&i| latency.name(i) == spec.executor)
        .ok_or_else(|| CoeError::Invalid(format!("executor {} is not in the profile", spec.executor)))?;
    let options = TierOptions::default().executor(&latency, index, &app.trace.model);
    ExpertExecutor::open_with(&spec.executor, &app.store_dir(), &app.manifest, &app.trace.model, options)
}

impl CoeExecutor {
    /// Carries out `cmd`: on the real executor on this thread (loads and batches are real
    /// work: off the async workers' hands), or on the stand-in after its modelled time on
    /// tokio's clock (no `block_in_place`, so it runs on a current-thread runtime). The
    /// executor's failure is logged and answered.
    async fn carry_out(&mut self, cmd: Cmd) -> Result<Option<Event>, ActorFailure> {
        let done = match &mut self.compute {
            Compute::Real(executor) => tokio::task::block_in_place(|| execute(0, executor, cmd)),
            Compute::Sim(sim) => {
                tokio::time::sleep(sim.cost(&cmd)).await;
                sim.execute(0, cmd)
            }
        };
        done.map_err(|e| {
            tracing::error!(executor = %self.name, "{e}");
            ActorFailure::msg(e)
        })
    }
}

fn unexpected(what: &str, ev: Option<Event>) -> ActorFailure {
    ActorFailure::msg(format!("the executor answered a {what} with {ev:?}"))
}

impl TypedActor for CoeExecutor {
    const KIND: &'static str = "coe-executor";
    type Args = ExecutorSpec;

    fn protocol(p: &mut Protocol<Self>) {
        p.request::<Load>(exec_wire::allow(exec_wire::LOAD))
            .request::<Evict>(exec_wire::allow(exec_wire::EVICT))
            .request::<WireRun>(exec_wire::allow(exec_wire::RUN))
            .request::<Reset>(exec_wire::allow(exec_wire::RESET))
            .request::<Hello>(exec_wire::allow(exec_wire::HELLO));
    }

    async fn start(spec: ExecutorSpec, ctx: &ActorContext) -> Result<Self, ActorFailure> {
        let compute = match &spec.sim {
            None => Compute::Real(tokio::task::block_in_place(|| open_executor(&spec))?),
            Some(sim) => Compute::Sim(SimCompute::new(&spec.executor, sim.clone())?),
        };
        tracing::info!(executor = %spec.executor, node = %ctx.actors.node(), "coe executor ready");
        Ok(CoeExecutor { name: spec.executor, node: ctx.actors.node().to_string(), compute })
    }
}

impl Handles<Load> for CoeExecutor {
    async fn handle(&mut self, m: Load, _: &ActorContext) -> Result<WireLoaded, ActorFailure> {
        match self.carry_out(Cmd::Load(ExpertId(m.expert))).await? {
            Some(Event::Loaded { seconds, resident, .. }) => Ok(WireLoaded { seconds, resident }),
            other => Err(unexpected("load", other)),
        }
    }
}

impl Handles<Evict> for CoeExecutor {
    async fn handle(&mut self, m: Evict, _: &ActorContext) -> Result<(), ActorFailure> {
        self.carry_out(Cmd::Evict(ExpertId(m.expert))).await.map(|_| ())
    }
}

impl Handles<WireRun> for CoeExecutor {
    async fn handle(&mut self, m: WireRun, _: &ActorContext) -> Result<WireRan, ActorFailure> {
        let cmd = exec_wire::check_run(m).map_err(ActorFailure::msg)?;
        match self.carry_out(cmd).await? {
            Some(Event::Ran { rows, seconds, .. }) => Ok(WireRan {
                seconds,
                rows: rows.into_iter().map(|(r, values)| WireRow { request: r.0, values }).collect(),
            }),
            other => Err(unexpected("batch", other)),
        }
    }
}

impl Handles<Reset> for CoeExecutor {
    async fn handle(&mut self, _: Reset, _: &ActorContext) -> Result<WireReset, ActorFailure> {
        match self.carry_out(Cmd::Reset).await? {
            Some(Event::Reset { evicted, host_budget, host, .. }) => Ok(WireReset {
                evicted: evicted as u64,
                host_budget,
                host: host.iter().map(|e| e.0).collect(),
            }),
            other => Err(unexpected("reset", other)),
        }
    }
}

impl Handles<Hello> for CoeExecutor {
    async fn handle(&mut self, _: Hello, _: &ActorContext) -> Result<HelloReply, ActorFailure> {
        Ok(HelloReply { executor: self.name.clone(), node: self.node.clone() })
    }
}

// ---- scheduler side ----------------------------------------------------------------------

/// A remote executor the scheduler found: its profile name, its node, its handle.
#[derive(Clone, Debug)]
pub struct RemoteExecutor {
    /// Name in the profile.
    pub name: String,
    /// Node it runs on.
    pub node: String,
    /// Its typed handle.
    pub handle: ActorHandle<CoeExecutor>,
}

/// Waits until every executor in `names` runs somewhere in the cluster and answered hello
/// (woken by the registry's announcements, not by polling). A hello that gets no reply is sent
/// again while time is left (one lost on a lossy net, or a peer busy restarting, must not fail
/// a scheduler's start).
pub async fn find_executors(
    actors: &Actors,
    names: &[String],
    wait: Duration,
) -> Result<Vec<RemoteExecutor>, CoeError> {
    /// The longest one hello waits for its reply.
    const HELLO: Duration = Duration::from_secs(2);
    /// The pause before trying again after a hello that failed at once.
    const HELLO_BACKOFF: Duration = Duration::from_millis(100);
    let until = crate::clock::timer_now() + wait;
    let mut found = Vec::with_capacity(names.len());
    for name in names {
        let left = || until.saturating_duration_since(crate::clock::timer_now());
        let missing = |e: ActorError| {
            CoeError::Invalid(format!("executor {name:?} did not join within the deadline: {e}"))
        };
        // each try resolves the name afresh: a handle to an incarnation since lost (its node
        // went down and came back) fails at once, every time
        let (handle, hello) = loop {
            let handle = actors
                .wait_for::<CoeExecutor>(&exec_wire::actor_name(name), left())
                .await
                .map_err(missing)?;
            match handle.call(Hello, left().clamp(Duration::from_millis(1), HELLO)).await {
                Ok(h) => break (handle, h),
                Err(e) if left().is_zero() => return Err(missing(e)),
                Err(_) => tokio::time::sleep(HELLO_BACKOFF.min(left())).await,
            }
        };
        if hello.executor != *name {
            return Err(CoeError::Invalid(format!(
                "actor for executor {name} answered as {}",
                hello.executor
            )));
        }
        found.push(RemoteExecutor { name: hello.executor, node: hello.node, handle });
    }
    Ok(found)
}

/// [`find_executors`] for a coe job's start: a job that must come back (`keep_searching`: it
/// resumes accepted work, or it serves requests, so its node restarted must serve again) keeps
/// searching past each missed `wait`, telling `missed` why, since giving up would leave work
/// unanswered (coe explorer seeds 527 and 812: an executor's node was down while the
/// scheduler's restarted; 3881 and 3991: the same with nothing pending, or at the first start);
/// a batch job with nothing accepted yet fails at the first.
pub async fn find_executors_for_job(
    actors: &Actors,
    names: &[String],
    wait: Duration,
    keep_searching: bool,
    mut missed: impl FnMut(&CoeError),
) -> Result<Vec<RemoteExecutor>, CoeError> {
    loop {
        match find_executors(actors, names, wait).await {
            Err(e) if keep_searching => missed(&e),
            done => return done,
        }
    }
}

/// What [`follow_executors`] did about one membership event.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ExecutorChange {
    /// Executor `name`'s node went down: its work was requeued on the others.
    Down {
        /// The executor's name in the profile.
        name: String,
        /// Its node.
        node: String,
    },
    /// Executor `name`'s node rejoined and the executor was found and linked again.
    Restored {
        /// The executor's name in the profile.
        name: String,
        /// Its node.
        node: String,
    },
    /// Executor `name`'s node rejoined but the executor was not found within the call timeout.
    NotFound {
        /// The executor's name in the profile.
        name: String,
        /// Why.
        error: String,
    },
}

/// The scheduler node's view of its executors' nodes, for as long as `members` runs: a node
/// that goes down has its executor's work requeued ([`CoeInput::Down`](super::serve::CoeInput));
/// one that rejoins has its executor found again and linked under a new generation (back in
/// service), tried again every `call_timeout` until found or the node goes down again (a hello
/// lost on a lossy net, or an executor not yet started, must not leave it out of service for
/// good). `nodes[exec]` is executor `exec`'s node; `report` hears of each change. Shared by the
/// `coe` job on a real node and the simulated cluster, so both restore executors alike.
pub async fn follow_executors(
    shared: std::sync::Arc<super::serve::CoeShared>,
    actors: Actors,
    mut members: tokio::sync::broadcast::Receiver<troupe_policy::MembershipEvent<troupe_transport::NodeId>>,
    nodes: Vec<String>,
    call_timeout: Duration,
    report: impl FnMut(ExecutorChange) + Send + 'static,
) {
    use tokio::sync::broadcast::error::RecvError;
    use troupe_policy::MembershipEvent;
    let report = std::sync::Arc::new(std::sync::Mutex::new(report));
    // per executor, the search for it since its node rejoined or its link lost a call
    let mut restoring: Vec<Option<tokio::task::JoinHandle<()>>> = nodes.iter().map(|_| None).collect();
    let mut down = vec![false; nodes.len()];
    let mut link_lost = shared.subscribe_link_lost();
    loop {
        let event = tokio::select! {
            ev = members.recv() => match ev {
                Ok(ev) => ev,
                Err(RecvError::Lagged(_)) => continue,
                Err(RecvError::Closed) => break,
            },
            lost = link_lost.recv() => {
                // a call lost with the node up (a lossy net, a slow executor): search for it again
                if let Ok(exec) = lost
                    && !down.get(exec).copied().unwrap_or(true)
                    && restoring[exec].as_ref().is_none_or(|t| t.is_finished())
                {
                    let node = nodes[exec].clone();
                    restoring[exec] = Some(tokio::spawn(restore(
                        shared.clone(), actors.clone(), report.clone(), exec, node, call_timeout,
                    )));
                }
                continue;
            }
        };
        for (exec, node) in nodes.iter().enumerate() {
            let name = shared.executor_name(exec).to_string();
            match &event {
                MembershipEvent::Down { member, .. } if member.as_str() == node => {
                    down[exec] = true;
                    if let Some(t) = restoring[exec].take() {
                        t.abort();
                    }
                    let generation = shared.link_generation(exec);
                    let why = format!("node {node} is down");
                    shared.tell(super::serve::CoeInput::Down { exec, generation, why });
                    tell(&report, ExecutorChange::Down { name, node: node.clone() });
                }
                MembershipEvent::Up { member, rejoined: true, .. } if member.as_str() == node => {
                    down[exec] = false;
                    if let Some(t) = restoring[exec].take() {
                        t.abort();
                    }
                    restoring[exec] = Some(tokio::spawn(restore(
                        shared.clone(),
                        actors.clone(),
                        report.clone(),
                        exec,
                        node.clone(),
                        call_timeout,
                    )));
                }
                _ => {}
            }
        }
    }
    restoring.into_iter().flatten().for_each(|t| t.abort());
}

/// Hands `change` to the reporter of [`follow_executors`].
fn tell<F: FnMut(ExecutorChange)>(report: &std::sync::Mutex<F>, change: ExecutorChange) {
    let mut r = report.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
    (*r)(change)
}

/// Searches for executor `exec` (on `node`) until found, then links it under a new generation;
/// tries again every `call_timeout`.
async fn restore<F: FnMut(ExecutorChange)>(
    shared: std::sync::Arc<super::serve::CoeShared>,
    actors: Actors,
    report: std::sync::Arc<std::sync::Mutex<F>>,
    exec: usize,
    node: String,
    call_timeout: Duration,
) {
    let name = shared.executor_name(exec).to_string();
    loop {
        match find_executors(&actors, std::slice::from_ref(&name), call_timeout).await {
            Ok(found) => {
                if let Some(x) = found.first() {
                    let link =
                        super::link::ExecLink::Remote { handle: x.handle.clone(), timeout: call_timeout };
                    shared.install_link(exec, link);
                    tell(&report, ExecutorChange::Restored { name, node });
                }
                return;
            }
            Err(e) => {
                tell(&report, ExecutorChange::NotFound { name: name.clone(), error: e.to_string() });
                tokio::time::sleep(call_timeout).await;
            }
        }
    }
}
