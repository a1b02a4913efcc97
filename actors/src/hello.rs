//! The `hello` topology's actors: experts that answer questions over the cluster, and a
//! scheduler that finds them through a process group and asks each over QUIC.

use std::time::Duration;

use ractor::{Actor, ActorCell, ActorProcessingErr, ActorRef, RpcReplyPort};
use ractor_cluster::RactorClusterMessage;

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

impl Actor for HelloExpert {
    type Msg = HelloExpertMsg;
    type State = String;
    type Arguments = String;

    async fn pre_start(&self, me: ActorRef<Self::Msg>, node: String) -> Result<String, ActorProcessingErr> {
        ractor::pg::join(EXPERTS_GROUP.to_string(), vec![me.get_cell()]);
        Ok(node)
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

/// Remote expert members currently known in the process group.
pub fn remote_experts() -> Vec<ActorCell> {
    let mut v: Vec<ActorCell> = ractor::pg::get_members(&EXPERTS_GROUP.to_string())
        .into_iter()
        .filter(|c| !c.get_id().is_local())
        .collect();
    v.sort_by_key(|c| c.get_id().to_string());
    v
}

/// Asks every expert in `experts` the same question over the cluster; answers in order.
pub async fn ask_all(
    experts: &[ActorCell],
    question: &str,
    timeout: Duration,
) -> Result<Vec<String>, String> {
    let mut answers = Vec::new();
    for cell in experts {
        let expert: ActorRef<HelloExpertMsg> = cell.clone().into();
        let ms = u64::try_from(timeout.as_millis()).unwrap_or(u64::MAX);
        let a = ractor::call_t!(expert, HelloExpertMsg::Ask, ms, question.to_string())
            .map_err(|e| format!("asking {}: {e}", cell.get_id()))?;
        answers.push(a);
    }
    Ok(answers)
}
