//! The distributed shells: a `coe-executor` actor on each executor node, served as the
//! role-checked service `coe-executor/NAME` on the data plane ([`crate::service`]), and the
//! links the scheduler node drives them through.
//!
//! Load, evict and run may be called only by a certificate with the `scheduler` role; hello by
//! any member (wire types and rules: [`super::exec_wire`]). A failed or timed-out call, or the
//! executor's node going down in the membership view, becomes [`Event::Lost`]: the scheduler
//! requeues that executor's queued and in-flight work on the survivors.

use std::path::PathBuf;
use std::sync::{Arc, mpsc};
use std::time::{Duration, Instant};

use ractor::{Actor, ActorProcessingErr, ActorRef, RpcReplyPort};
use ractor_cluster::RactorMessage;
use troupe_policy::coe::LatencyModel;
use troupe_transport::NodeId;

use super::CoeError;
use super::app::App;
use super::exec_wire::{self, HELLO, HelloReply, WireOutcome, service_name};
use super::executor::ExpertExecutor;
use super::profiler::load_profile;
use super::runner::{Cmd, Event, TierOptions, execute};
use crate::mailbox::{CountedSend, Queued};
use crate::service::{Handler, Services, to_body, with_archived};

pub use super::exec_wire::{MAX_BATCH_WIRE, MAX_ROW_WIRE};

/// Messages of a `coe-executor` actor (local: calls reach it through its service handler).
#[derive(RactorMessage)]
pub enum CoeExecMsg {
    /// Carry out a command; replies with its outcome or the error that stopped it. Counted in
    /// the actor's mailbox depth ([`crate::mailbox`]).
    Call(Cmd, Queued, RpcReplyPort<Result<WireOutcome, String>>),
}

/// Arguments of the executor actor.
#[derive(Clone, Debug)]
pub struct ExecutorArgs {
    /// The app folder (manifest, store, trace, profile).
    pub dir: PathBuf,
    /// The executor's name in the profile.
    pub executor: String,
    /// This node's name.
    pub node: String,
    /// The node's service router (the actor registers `coe-executor/NAME` there).
    pub services: Services,
}

/// State of a running executor actor.
pub struct ExecutorState {
    args: ExecutorArgs,
    executor: ExpertExecutor,
}

/// The executor actor: owns an [`ExpertExecutor`] and serves [`CoeExecMsg`].
pub struct CoeExecutorActor;

/// Open the app and the executor named `args.executor` with the profile's budget.
pub fn open_executor(args: &ExecutorArgs) -> Result<ExecutorState, CoeError> {
    let app = App::open(&args.dir, None)?;
    let profile = load_profile(&args.dir.join("profile.txt"))?;
    let latency = LatencyModel::from_profile(&profile).map_err(|e| CoeError::Invalid(e.to_string()))?;
    let index = (0..latency.executors())
        .find(|&i| latency.name(i) == args.executor)
        .ok_or_else(|| CoeError::Invalid(format!("executor {} is not in the profile", args.executor)))?;
    let options = TierOptions::default().executor(&latency, index, &app.trace.model);
    let executor = ExpertExecutor::open_with(
        &args.executor,
        &app.store_dir(),
        &app.manifest,
        &app.trace.model,
        options,
    )?;
    Ok(ExecutorState { args: args.clone(), executor })
}

/// The service handler: hello answered here, commands carried to the actor.
fn handler(actor: ActorRef<CoeExecMsg>, hello: HelloReply) -> Handler {
    Arc::new(move |_caller, method, body| {
        let (actor, hello) = (actor.clone(), hello.clone());
        Box::pin(async move {
            if method == HELLO {
                return to_body(&hello);
            }
            let cmd = exec_wire::decode_cmd(&method, &body)?;
            let outcome = actor
                .call_counted(|queued, reply| CoeExecMsg::Call(cmd, queued, reply))
                .await
                .map_err(|e| format!("executor {} is not running: {e}", hello.executor))??;
            to_body(&outcome)
        })
    })
}

impl Actor for CoeExecutorActor {
    type Msg = CoeExecMsg;
    type State = ExecutorState;
    type Arguments = ExecutorArgs;

    async fn pre_start(
        &self,
        me: ActorRef<Self::Msg>,
        args: ExecutorArgs,
    ) -> Result<ExecutorState, ActorProcessingErr> {
        crate::mailbox::track(&me);
        let state = tokio::task::block_in_place(|| open_executor(&args))?;
        let hello = HelloReply { executor: args.executor.clone(), node: args.node.clone() };
        args.services.register(&service_name(&args.executor), exec_wire::spec(), handler(me, hello));
        tracing::info!(executor = %args.executor, node = %args.node, "coe executor ready");
        Ok(state)
    }

    async fn post_stop(
        &self,
        _me: ActorRef<Self::Msg>,
        state: &mut ExecutorState,
    ) -> Result<(), ActorProcessingErr> {
        state.args.services.unregister(&service_name(&state.args.executor));
        Ok(())
    }

    async fn handle(
        &self,
        _me: ActorRef<Self::Msg>,
        msg: Self::Msg,
        state: &mut ExecutorState,
    ) -> Result<(), ActorProcessingErr> {
        match msg {
            CoeExecMsg::Call(cmd, queued, reply) => {
                queued.taken();
                let outcome = tokio::task::block_in_place(|| execute(0, &mut state.executor, cmd));
                if let Err(e) = &outcome {
                    tracing::error!(executor = %state.args.executor, "{e}");
                }
                let _ = reply.send(outcome.map(exec_wire::outcome).map_err(|e| e.to_string()));
            }
        }
        Ok(())
    }
}

// ---- scheduler side ----------------------------------------------------------------------

/// A remote executor the scheduler found: its profile name, its node, its service.
#[derive(Clone, Debug)]
pub struct RemoteExecutor {
    /// Name in the profile.
    pub name: String,
    /// Node it runs on.
    pub node: String,
    /// The node's id on the link.
    pub peer: NodeId,
    /// Its service name.
    pub service: String,
}

async fn hello(services: &Services, peer: &NodeId, service: &str) -> Option<HelloReply> {
    let body = services.call(peer, service, HELLO, Vec::new(), Duration::from_secs(2)).await.ok()?;
    with_archived::<HelloReply, _>(&body, |a| {
        Ok(HelloReply { executor: a.executor.as_str().to_string(), node: a.node.as_str().to_string() })
    })
    .ok()
}

/// Wait until every executor in `names` has announced its service and answered hello. Woken
/// by service announcements (sent when a node joins or registers a service), not by polling.
pub async fn find_executors(
    services: &Services,
    names: &[String],
    deadline: Instant,
) -> Result<Vec<RemoteExecutor>, CoeError> {
    let mut announcements = services.subscribe_announcements();
    let mut found: Vec<Option<RemoteExecutor>> = vec![None; names.len()];
    loop {
        for (i, name) in names.iter().enumerate() {
            if found[i].is_some() {
                continue;
            }
            let service = service_name(name);
            for peer in services.providers(&service) {
                if let Some(h) = hello(services, &peer, &service).await
                    && h.executor == *name
                {
                    found[i] = Some(RemoteExecutor { name: h.executor, node: h.node, peer, service });
                    break;
                }
            }
        }
        if found.iter().all(Option::is_some) {
            return Ok(found.into_iter().flatten().collect());
        }
        let left = deadline.saturating_duration_since(Instant::now());
        let missing = || -> Vec<&String> {
            names.iter().zip(&found).filter(|(_, f)| f.is_none()).map(|(n, _)| n).collect()
        };
        if left.is_zero() {
            return Err(CoeError::Invalid(format!(
                "executors {:?} did not join within the deadline",
                missing()
            )));
        }
        // woken by an announcement (or a lag, or the deadline): look again
        if let Ok(Err(tokio::sync::broadcast::error::RecvError::Closed)) =
            tokio::time::timeout(left, announcements.recv()).await
        {
            return Err(CoeError::Invalid(format!(
                "service router stopped; executors {:?} missing",
                missing()
            )));
        }
    }
}

/// Start one link task per executor: commands go out in order as service calls; results,
/// failures and timeouts come back as events. Returns the senders the driver uses.
pub fn spawn_links(
    services: &Services,
    executors: &[RemoteExecutor],
    events: mpsc::Sender<Event>,
    call_timeout: Duration,
) -> Vec<tokio::sync::mpsc::UnboundedSender<Cmd>> {
    let mut senders = Vec::with_capacity(executors.len());
    for (exec, x) in executors.iter().enumerate() {
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<Cmd>();
        let (services, x, events) = (services.clone(), x.clone(), events.clone());
        tokio::spawn(async move {
            while let Some(cmd) = rx.recv().await {
                let outcome = match exec_wire::request(&cmd) {
                    Err(e) => Err(CoeError::Invalid(e)),
                    Ok((method, body)) => {
                        match services.call(&x.peer, &x.service, method, body, call_timeout).await {
                            Ok(bytes) => exec_wire::decode_outcome(exec, &cmd, &bytes),
                            Err(e) if e.is_lost() => {
                                let _ = events.send(Event::Lost { exec, why: format!("call failed: {e}") });
                                return;
                            }
                            Err(e) => Err(CoeError::Invalid(format!("remote executor: {e}"))),
                        }
                    }
                };
                let sent = match outcome {
                    Ok(Some(ev)) => events.send(ev),
                    Ok(None) => Ok(()),
                    Err(e) => events.send(Event::Failed(e)),
                };
                if sent.is_err() {
                    return;
                }
            }
        });
        senders.push(tx);
    }
    senders
}
