//! How the scheduler reaches one executor: [`ExecLink`], the handle the job's
//! [`crate::typed::Links`] queue calls through (one ordered queue per executor, one generation
//! rule), whether the executor is a thread of this process ([`super::runner`]) or a typed actor on
//! another node ([`super::remote::CoeExecutor`]).

use std::time::Duration;

use tokio::sync::{mpsc, oneshot};

use super::CoeError;
use super::exec_wire::{self, Evict, Load, Reply, Reset};
use super::remote::CoeExecutor;
use super::runner::{Cmd, Event};
use crate::typed::{ActorError, ActorHandle};

/// One command to an executor thread, and where its result goes.
pub type LocalCall = (Cmd, oneshot::Sender<Result<Option<Event>, CoeError>>);

/// The handle the scheduler's link to one executor calls through.
#[derive(Clone)]
pub enum ExecLink {
    /// An executor thread of this process.
    Local(mpsc::UnboundedSender<LocalCall>),
    /// A typed executor actor on a member, each call bounded by `timeout`.
    Remote {
        /// The executor.
        handle: ActorHandle<CoeExecutor>,
        /// How long one command may take before the executor counts as lost.
        timeout: Duration,
    },
}

impl crate::typed::queue::LinkHandle for ExecLink {
    fn incarnation(&self) -> Option<u64> {
        match self {
            ExecLink::Local(_) => None,
            ExecLink::Remote { handle, .. } => handle.incarnation(),
        }
    }
}

impl ExecLink {
    /// Carries out `cmd` on executor `exec`: its event (none for an eviction; `Event::Failed`
    /// for the executor's own failure or a reply that does not fit), or `PeerLost` when the
    /// executor is gone or silent past the timeout (the scheduler requeues its work).
    pub async fn run(self, exec: usize, cmd: Cmd) -> Result<Option<Event>, ActorError> {
        match self {
            ExecLink::Local(tx) => {
                let gone = |why: &str| ActorError::PeerLost {
                    actor: format!("executor {exec}"),
                    reason: why.into(),
                };
                let (reply, answer) = oneshot::channel();
                tx.send((cmd, reply)).map_err(|_| gone("its thread has ended"))?;
                match answer.await {
                    Ok(Ok(ev)) => Ok(ev),
                    Ok(Err(e)) => Ok(Some(Event::Failed(e))),
                    Err(_) => Err(gone("its thread ended before answering")),
                }
            }
            ExecLink::Remote { handle, timeout } => {
                let reply = match &cmd {
                    Cmd::Load(e) => handle.call(Load { expert: e.0 }, timeout).await.map(Reply::Loaded),
                    Cmd::Evict(e) => {
                        handle.call(Evict { expert: e.0 }, timeout).await.map(|()| Reply::Evicted)
                    }
                    Cmd::Reset => handle.call(Reset, timeout).await.map(Reply::Reset),
                    Cmd::Run { batch, expert, requests } => handle
                        .call(exec_wire::run_of(*batch, *expert, requests), timeout)
                        .await
                        .map(Reply::Ran),
                };
                match reply {
                    Ok(r) => {
                        Ok(exec_wire::event_of(exec, &cmd, r).unwrap_or_else(|e| Some(Event::Failed(e))))
                    }
                    // a silent executor is as good as gone: its work goes to the others
                    Err(ActorError::Timeout { actor, timeout, .. }) => {
                        Err(ActorError::PeerLost { actor, reason: format!("no answer within {timeout:?}") })
                    }
                    Err(e) if e.is_lost() => Err(e),
                    Err(e) => Ok(Some(Event::Failed(CoeError::Invalid(format!("remote executor: {e}"))))),
                }
            }
        }
    }
}
