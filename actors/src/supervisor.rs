//! OTP-style supervisor: one-for-one restarts under a restart intensity (at most R restarts in
//! P seconds); one more failure inside the window escalates by failing the supervisor itself,
//! so its own supervisor (or the node) decides. The decision is `troupe_policy::RestartIntensity`.

use std::collections::HashMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use ractor::{
    Actor, ActorCell, ActorId, ActorProcessingErr, ActorRef, RpcReplyPort, SpawnErr, SupervisionEvent,
};
use ractor_cluster::RactorMessage;
use tokio::sync::broadcast;
use tracing::{debug, error, warn};
use troupe_policy::{Micros, RestartDecision, RestartIntensity};

use crate::clock::Clock;

type StartFuture = Pin<Box<dyn Future<Output = Result<ActorCell, SpawnErr>> + Send>>;

/// How to (re)start one child, linked to the supervisor cell it is given.
#[derive(Clone)]
pub struct ChildSpec {
    /// The child's name (registered with ractor, so it must be unique on the node).
    pub name: String,
    start: Arc<dyn Fn(ActorCell) -> StartFuture + Send + Sync>,
}

impl ChildSpec {
    /// A child made by `make` each time it (re)starts.
    pub fn new<A, F>(name: impl Into<String>, make: F) -> Self
    where
        A: Actor,
        F: Fn() -> (A, A::Arguments) + Send + Sync + 'static,
    {
        let name = name.into();
        let reg = name.clone();
        let make = Arc::new(make);
        Self {
            name,
            start: Arc::new(move |sup: ActorCell| {
                let (actor, args) = make();
                let reg = reg.clone();
                Box::pin(async move {
                    let (r, _h) = Actor::spawn_linked(Some(reg), actor, args, sup).await?;
                    Ok(r.get_cell())
                })
            }),
        }
    }
}

impl std::fmt::Debug for ChildSpec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChildSpec").field("name", &self.name).finish()
    }
}

/// Restart intensity: at most `max_restarts` in any `period`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Intensity {
    /// Restarts allowed in the window.
    pub max_restarts: u32,
    /// Window length.
    pub period: Duration,
}

impl Default for Intensity {
    fn default() -> Self {
        Self { max_restarts: 3, period: Duration::from_secs(5) }
    }
}

/// What a supervisor did, for observers (logs, tests, status).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum SupervisorEvent {
    /// A child failed and was started again.
    Restarted {
        /// Supervisor name.
        supervisor: String,
        /// Child name.
        child: String,
        /// Restarts of this supervisor's children in the current window.
        in_window: usize,
        /// The child's failure.
        reason: String,
    },
    /// A child failed past the intensity: the supervisor fails too.
    Escalated {
        /// Supervisor name.
        supervisor: String,
        /// Child name.
        child: String,
        /// The child's failure.
        reason: String,
    },
}

/// Start arguments of a [`Supervisor`].
pub struct SupervisorArgs {
    /// Name used in events and logs.
    pub name: String,
    /// Children, started in order.
    pub children: Vec<ChildSpec>,
    /// Restart intensity.
    pub intensity: Intensity,
    /// Where events go (any number of subscribers).
    pub events: broadcast::Sender<SupervisorEvent>,
}

/// Queries a supervisor answers.
#[derive(RactorMessage)]
pub enum SupervisorMsg {
    /// The running children by name.
    Children(RpcReplyPort<Vec<(String, ActorCell)>>),
    /// Starts one more child under this supervisor's restart intensity (a job's scheduler);
    /// replies with its cell, or why it could not start.
    StartChild(ChildSpec, RpcReplyPort<Result<ActorCell, String>>),
}

/// The supervisor actor.
pub struct Supervisor;

/// Supervisor state: the specs, which cell runs which spec, and the restart policy.
pub struct SupervisorState {
    name: String,
    specs: Vec<ChildSpec>,
    running: HashMap<ActorId, usize>,
    cells: Vec<Option<ActorCell>>,
    intensity: RestartIntensity,
    clock: Clock,
    events: broadcast::Sender<SupervisorEvent>,
}

impl SupervisorState {
    async fn start_child(&mut self, idx: usize, me: &ActorCell) -> Result<(), ActorProcessingErr> {
        let spec = &self.specs[idx];
        let cell = (spec.start)(me.clone()).await?;
        self.running.insert(cell.get_id(), idx);
        self.cells[idx] = Some(cell);
        Ok(())
    }
}

impl Actor for Supervisor {
    type Msg = SupervisorMsg;
    type State = SupervisorState;
    type Arguments = SupervisorArgs;

    async fn pre_start(
        &self,
        me: ActorRef<Self::Msg>,
        args: SupervisorArgs,
    ) -> Result<Self::State, ActorProcessingErr> {
        let n = args.children.len();
        let mut st = SupervisorState {
            name: args.name,
            specs: args.children,
            running: HashMap::new(),
            cells: vec![None; n],
            intensity: RestartIntensity::new(
                args.intensity.max_restarts,
                Micros::from_duration(args.intensity.period),
            ),
            clock: Clock::start(),
            events: args.events,
        };
        for i in 0..n {
            st.start_child(i, &me.get_cell()).await?;
        }
        Ok(st)
    }

    async fn handle(
        &self,
        me: ActorRef<Self::Msg>,
        msg: Self::Msg,
        st: &mut Self::State,
    ) -> Result<(), ActorProcessingErr> {
        match msg {
            SupervisorMsg::Children(reply) => {
                let list = st
                    .specs
                    .iter()
                    .zip(&st.cells)
                    .filter_map(|(s, c)| c.clone().map(|c| (s.name.clone(), c)))
                    .collect();
                let _ = reply.send(list);
            }
            SupervisorMsg::StartChild(spec, reply) => {
                let idx = match st.specs.iter().position(|s| s.name == spec.name) {
                    Some(i) if st.cells[i].is_some() => {
                        let _ = reply.send(Err(format!("a child named {} is already running", spec.name)));
                        return Ok(());
                    }
                    Some(i) => {
                        st.specs[i] = spec;
                        i
                    }
                    None => {
                        st.specs.push(spec);
                        st.cells.push(None);
                        st.specs.len() - 1
                    }
                };
                let started = st.start_child(idx, &me.get_cell()).await;
                let _ = reply.send(match started {
                    Ok(()) => st.cells[idx].clone().ok_or_else(|| "child did not start".to_string()),
                    Err(e) => Err(e.to_string()),
                });
            }
        }
        Ok(())
    }

    async fn handle_supervisor_evt(
        &self,
        me: ActorRef<Self::Msg>,
        evt: SupervisionEvent,
        st: &mut Self::State,
    ) -> Result<(), ActorProcessingErr> {
        match evt {
            SupervisionEvent::ActorFailed(cell, err) => {
                let Some(idx) = st.running.remove(&cell.get_id()) else { return Ok(()) };
                st.cells[idx] = None;
                let child = st.specs[idx].name.clone();
                let reason = err.to_string();
                match st.intensity.handle_failure(st.clock.now()) {
                    RestartDecision::Restart => {
                        warn!(supervisor = %st.name, %child, %reason, "child failed; restarting");
                        st.start_child(idx, &me.get_cell()).await?;
                        let _ = st.events.send(SupervisorEvent::Restarted {
                            supervisor: st.name.clone(),
                            child,
                            in_window: st.intensity.restarts_in_window(),
                            reason,
                        });
                    }
                    RestartDecision::Escalate => {
                        error!(supervisor = %st.name, %child, %reason, "restart intensity exceeded; escalating");
                        let _ = st.events.send(SupervisorEvent::Escalated {
                            supervisor: st.name.clone(),
                            child: child.clone(),
                            reason: reason.clone(),
                        });
                        return Err(format!(
                            "supervisor {}: child {child} exceeded its restart intensity: {reason}",
                            st.name
                        )
                        .into());
                    }
                }
            }
            SupervisionEvent::ActorTerminated(cell, _, reason) => {
                if let Some(idx) = st.running.remove(&cell.get_id()) {
                    debug!(supervisor = %st.name, child = %st.specs[idx].name, ?reason, "child stopped");
                    st.cells[idx] = None;
                }
            }
            _ => {}
        }
        Ok(())
    }
}

/// Child spec for a nested supervisor (its failures escalate to the parent).
pub fn supervisor_child(
    args: impl Fn() -> SupervisorArgs + Send + Sync + 'static,
    name: impl Into<String>,
) -> ChildSpec {
    ChildSpec::new(name, move || (Supervisor, args()))
}
