//! The `hello` topology's actors: experts that answer questions over the cluster, and a
//! scheduler that finds them and asks each over QUIC.
//!
//! The `hello` job goes through the role-checked service path like every workload
//! ([`SERVICE_PREFIX`]`NODE`, method [`ASK`], rkyv bodies read with checked access, found by
//! service announcements). The expert also answers [`HelloExpertMsg::Ask`] as a ractor_cluster
//! message: `troupe bench transport` measures remote actor calls through it.

use std::time::Duration;

use ractor::{Actor, ActorProcessingErr, ActorRef, RpcReplyPort};
use ractor_cluster::RactorClusterMessage;
use troupe_transport::{NodeId, Role};

use crate::service::{Allow, Handler, ServiceSpec, Services, to_body, with_archived};

/// Services of hello experts are named `hello-expert/NODE`.
pub const SERVICE_PREFIX: &str = "hello-expert/";
/// The method that answers a question.
pub const ASK: &str = "ask";
/// Longest question accepted, bytes.
pub const MAX_QUESTION: usize = 4096;

/// Process group the hello experts join (visible cluster-wide).
pub const EXPERTS_GROUP: &str = "hello-experts";

/// Messages of a hello expert (serialisable: they cross nodes).
#[derive(RactorClusterMessage)]
pub enum HelloExpertMsg {
    /// Answers a question.
    #[rpc]
    Ask(String, RpcReplyPort<String>),
}

/// An expert that answers with facts it computes about the question.
pub struct HelloExpert;

/// What the expert says about `question` (a pure function, so tests can check the answer).
pub fn answer(node: &str, question: &str) -> String {
    let words = question.split_whitespace().count();
    let letters = question.chars().filter(|c| c.is_alphabetic()).count();
    let reversed: String = question.chars().rev().collect();
    format!("{node}: {words} words, {letters} letters, reversed \"{reversed}\"")
}

/// What a hello expert starts with: the node it answers as, and the router it serves on
/// (`None`: ractor messages only, as the transport bench's peer runs it).
#[derive(Clone)]
pub struct HelloArgs {
    /// The node name it answers as.
    pub node: String,
    /// The node's service router.
    pub services: Option<Services>,
}

fn handler(node: String) -> Handler {
    std::sync::Arc::new(move |_caller, _method, body| {
        let node = node.clone();
        Box::pin(async move {
            let question = with_archived::<String, _>(&body, |q| {
                if q.len() > MAX_QUESTION {
                    return Err(format!("a question of {} bytes exceeds {MAX_QUESTION}", q.len()));
                }
                Ok(q.as_str().to_owned())
            })?;
            to_body(&answer(&node, &question))
        })
    })
}

impl Actor for HelloExpert {
    type Msg = HelloExpertMsg;
    type State = String;
    type Arguments = HelloArgs;

    async fn pre_start(
        &self,
        me: ActorRef<Self::Msg>,
        args: HelloArgs,
    ) -> Result<String, ActorProcessingErr> {
        ractor::pg::join(EXPERTS_GROUP.to_string(), vec![me.get_cell()]);
        if let Some(services) = &args.services {
            let spec = ServiceSpec::new().method(ASK, Allow::role(Role::Scheduler));
            services.register(&format!("{SERVICE_PREFIX}{}", args.node), spec, handler(args.node.clone()));
        }
        Ok(args.node)
    }

    async fn handle(
        &self,
        _me: ActorRef<Self::Msg>,
        msg: Self::Msg,
        node: &mut String,
    ) -> Result<(), ActorProcessingErr> {
        match msg {
            HelloExpertMsg::Ask(q, reply) => {
                let _ = reply.send(answer(node, &q));
            }
        }
        Ok(())
    }
}

/// Waits (woken by service announcements, at most `timeout`) until `count` hello experts are
/// announced; their nodes and services, sorted by node. `Err(found)` when too few came.
pub async fn find_experts(
    services: &Services,
    count: usize,
    timeout: Duration,
) -> Result<Vec<(NodeId, String)>, usize> {
    services
        .wait_for(timeout, |s| {
            let found = s.services_with_prefix(SERVICE_PREFIX);
            (found.len() >= count).then_some(found)
        })
        .await
        .ok_or_else(|| services.services_with_prefix(SERVICE_PREFIX).len())
}

/// Asks each expert the same question through the service path; answers in order.
pub async fn ask_each(
    services: &Services,
    experts: &[(NodeId, String)],
    question: &str,
    timeout: Duration,
) -> Result<Vec<String>, String> {
    let body = to_body(&question.to_string())?;
    let mut answers = Vec::new();
    for (peer, service) in experts {
        let reply =
            services.call(peer, service, ASK, body.clone(), timeout).await.map_err(|e| e.to_string())?;
        answers.push(with_archived::<String, _>(&reply, |a| Ok(a.as_str().to_owned()))?);
    }
    Ok(answers)
}
