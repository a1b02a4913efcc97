//! A typed handle to an actor by name: `call` (a reply or an [`ActorError`]) and `tell`.
//!
//! The handle resolves the name once and keeps the incarnation it found. A local incarnation is
//! given the message as it is (no encoding); a remote one gets it through the service router,
//! addressed to that incarnation, so a message never reaches a replacement the caller did not
//! resolve. When the incarnation is gone (its node left or was declared down, it restarted or
//! stopped) the call fails once with [`ActorError::PeerLost`] and the handle forgets it: the
//! next call resolves the name again, waiting up to its timeout for a replacement.

use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use tokio::sync::oneshot;
use troupe_transport::NodeId;
use troupe_transport::service::FaultKind;

use super::actor::{Binding, Handles, Protocol, TypedActor, local_job};
use super::error::ActorError;
use super::registry::{Actors, INCARNATION_PREFIX, service_name};
use super::wire::{RemoteMessage, Wire};
use crate::service::CallError;

/// Where a resolved name lives.
pub(crate) enum Target<A> {
    /// On this node.
    Local(Arc<Binding<A>>),
    /// On a member.
    Remote {
        /// The member.
        peer: NodeId,
        /// The incarnation resolved.
        incarnation: u64,
    },
}

impl<A> Clone for Target<A> {
    fn clone(&self) -> Self {
        match self {
            Target::Local(b) => Target::Local(b.clone()),
            Target::Remote { peer, incarnation } => {
                Target::Remote { peer: peer.clone(), incarnation: *incarnation }
            }
        }
    }
}

/// Most remote tells one handle (with its clones) sends past the last one it knows the actor
/// has taken, in windows of at most this many: see [`ActorHandle::tell`].
pub const MAX_TELL_WINDOW: u64 = 1024;
/// How long a tell waits for the actor to take the window before the last one.
pub const TELL_FLOW_TIMEOUT: Duration = Duration::from_secs(60);

/// A handle's flow control of remote tells: how many it sent, and the marker of the window in
/// flight (a tell sent as a call, answered once the actor has taken it and every tell before it).
#[derive(Default)]
struct TellFlow {
    sent: u64,
    marker: Option<tokio::task::JoinHandle<Result<(), ActorError>>>,
}

/// A handle to the actor named `name` of kind `A`. Cheap to clone; clones share what they
/// resolved.
pub struct ActorHandle<A> {
    name: Arc<str>,
    service: Arc<str>,
    actors: Actors,
    target: Arc<Mutex<Option<Target<A>>>>,
    flow: Arc<Mutex<TellFlow>>,
    window: u64,
}

impl<A> Clone for ActorHandle<A> {
    fn clone(&self) -> Self {
        Self {
            name: self.name.clone(),
            service: self.service.clone(),
            actors: self.actors.clone(),
            target: self.target.clone(),
            flow: self.flow.clone(),
            window: self.window,
        }
    }
}

impl<A> std::fmt::Debug for ActorHandle<A> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ActorHandle").field("name", &self.name).finish_non_exhaustive()
    }
}

impl<A: TypedActor> ActorHandle<A> {
    pub(crate) fn resolved(name: &str, actors: Actors, target: Target<A>) -> Self {
        Self::new(name, actors, Some(target))
    }

    /// A handle that resolves `name` on its first use (no lookup now).
    pub fn by_name(actors: &Actors, name: &str) -> Self {
        Self::new(name, actors.clone(), None)
    }

    fn new(name: &str, actors: Actors, target: Option<Target<A>>) -> Self {
        // two windows in flight stay within half the kind's mailbox bound (the same code runs
        // on both ends, so the bound is known here)
        let bound = Protocol::<A>::of().mailbox_bound() as u64;
        Self {
            name: name.into(),
            service: service_name(name).into(),
            actors,
            target: Arc::new(Mutex::new(target)),
            flow: Arc::default(),
            window: (bound / 4).clamp(1, MAX_TELL_WINDOW),
        }
    }

    /// The actor's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The node the handle addresses now (`None` until resolved, or after the incarnation was
    /// lost).
    pub fn node(&self) -> Option<NodeId> {
        match self.current()? {
            Target::Local(_) => Some(self.actors.node().clone()),
            Target::Remote { peer, .. } => Some(peer),
        }
    }

    /// The incarnation the handle addresses now.
    pub fn incarnation(&self) -> Option<u64> {
        match self.current()? {
            Target::Local(b) => Some(b.incarnation),
            Target::Remote { incarnation, .. } => Some(incarnation),
        }
    }

    fn current(&self) -> Option<Target<A>> {
        self.target.lock().unwrap_or_else(PoisonError::into_inner).clone()
    }

    /// Forgets `lost` (and only it: a clone may have resolved a newer one meanwhile).
    fn forget(&self, lost: &Target<A>) {
        let mut g = self.target.lock().unwrap_or_else(PoisonError::into_inner);
        let same = match (&*g, lost) {
            (Some(Target::Local(a)), Target::Local(b)) => a.incarnation == b.incarnation,
            (Some(Target::Remote { incarnation: a, .. }), Target::Remote { incarnation: b, .. }) => a == b,
            _ => false,
        };
        if same {
            *g = None;
        }
    }

    async fn target(&self, wait: Option<Duration>) -> Result<Target<A>, ActorError> {
        if let Some(t) = self.current() {
            return Ok(t);
        }
        let t = match wait {
            Some(d) => self.actors.resolve_within::<A>(&self.name, d).await?,
            None => self.actors.resolve::<A>(&self.name).await?,
        };
        *self.target.lock().unwrap_or_else(PoisonError::into_inner) = Some(t.clone());
        Ok(t)
    }

    fn lost(&self, target: &Target<A>, reason: impl Into<String>) -> ActorError {
        self.forget(target);
        ActorError::PeerLost { actor: self.name.to_string(), reason: reason.into() }
    }

    /// Sends `msg` and waits up to `timeout` (resolving the name first, if needed, within the
    /// same time) for its reply.
    pub async fn call<M>(&self, msg: M, timeout: Duration) -> Result<M::Reply, ActorError>
    where
        M: RemoteMessage,
        A: Handles<M>,
    {
        let deadline = crate::clock::timer_now() + timeout;
        let target = self.target(Some(timeout)).await?;
        let left = deadline.saturating_duration_since(crate::clock::timer_now());
        match &target {
            Target::Local(b) => {
                let (tx, rx) = oneshot::channel();
                b.enqueue(local_job::<A, M>(msg, Some(tx))).map_err(|e| self.on_local_error(&target, e))?;
                match tokio::time::timeout(left, rx).await {
                    Err(_) => Err(self.timeout::<M>(timeout)),
                    Ok(Err(_)) => Err(self.lost(&target, "the actor stopped before replying")),
                    Ok(Ok(Ok(reply))) => Ok(reply),
                    Ok(Ok(Err(f))) => Err(ActorError::Failed {
                        actor: self.name.to_string(),
                        message: M::NAME,
                        detail: f.to_string(),
                    }),
                }
            }
            Target::Remote { peer, incarnation } => {
                let body = self.body::<M>(&msg, *incarnation)?;
                let out = self.actors.services().call(peer, &self.service, M::NAME, body, left).await;
                match out {
                    Ok(bytes) => M::Reply::from_wire(M::NAME, &bytes).map_err(|e| ActorError::BadMessage {
                        actor: self.name.to_string(),
                        message: M::NAME,
                        detail: format!("its reply: {e}"),
                    }),
                    Err(CallError::Timeout { .. }) => Err(self.timeout::<M>(timeout)),
                    Err(e) => Err(self.remote_error::<M>(&target, e)),
                }
            }
        }
    }

    /// Sends `msg` without waiting for a reply: `Ok` once it is queued (locally) or handed to
    /// the link (remotely). A local refusal (busy, gone) is returned; a remote refusal (role,
    /// busy, gone) is logged by the callee.
    ///
    /// Remote tells are flow-controlled, so a loop of tells never overruns the actor's mailbox:
    /// every window's last tell (a window is a quarter of the kind's mailbox bound, at most
    /// [`MAX_TELL_WINDOW`]) goes as a call, and the tell that closes the next window first waits
    /// (up to [`TELL_FLOW_TIMEOUT`]) until the actor has taken that one, and so every tell
    /// before it: at most two windows are in flight. An error it learns then (the incarnation
    /// lost, the actor busy with other senders' messages, its failure on that tell) is returned
    /// by the tell that waited.
    pub async fn tell<M>(&self, msg: M) -> Result<(), ActorError>
    where
        M: RemoteMessage,
        A: Handles<M>,
    {
        let target = self.target(None).await?;
        match &target {
            Target::Local(b) => {
                b.enqueue(local_job::<A, M>(msg, None)).map_err(|e| self.on_local_error(&target, e))
            }
            Target::Remote { peer, incarnation } => {
                let closes_window = {
                    let mut flow = self.flow.lock().unwrap_or_else(PoisonError::into_inner);
                    flow.sent += 1;
                    flow.sent.is_multiple_of(self.window)
                };
                let body = self.body::<M>(&msg, *incarnation)?;
                if closes_window {
                    return self.tell_as_marker::<M>(&target, peer, body).await;
                }
                self.actors
                    .services()
                    .send_one_way(peer, &self.service, M::NAME, body)
                    .await
                    .map_err(|e| self.remote_error::<M>(&target, e))
            }
        }
    }

    /// Sends `body` as the marker of a window (a call whose answer is awaited in the
    /// background; the request itself goes now, in order), after waiting for the previous
    /// window's marker.
    async fn tell_as_marker<M>(
        &self,
        target: &Target<A>,
        peer: &NodeId,
        body: Vec<u8>,
    ) -> Result<(), ActorError>
    where
        M: RemoteMessage,
        A: Handles<M>,
    {
        let previous = self.flow.lock().unwrap_or_else(PoisonError::into_inner).marker.take();
        let waited = match previous {
            Some(marker) => marker.await.unwrap_or_else(|e| {
                Err(ActorError::Failed {
                    actor: self.name.to_string(),
                    message: M::NAME,
                    detail: format!("the flow-control marker of the previous window failed: {e}"),
                })
            }),
            None => Ok(()),
        };
        let call = self
            .actors
            .services()
            .start_call(peer, &self.service, M::NAME, body)
            .await
            .map_err(|e| self.remote_error::<M>(target, e))?;
        let (handle, target) = (self.clone(), target.clone());
        let marker = tokio::spawn(async move {
            call.answer(TELL_FLOW_TIMEOUT).await.map(drop).map_err(|e| handle.remote_error::<M>(&target, e))
        });
        self.flow.lock().unwrap_or_else(PoisonError::into_inner).marker = Some(marker);
        waited
    }

    fn body<M: RemoteMessage>(&self, msg: &M, incarnation: u64) -> Result<Vec<u8>, ActorError> {
        let archived = msg.to_wire().map_err(|detail| ActorError::BadMessage {
            actor: self.name.to_string(),
            message: M::NAME,
            detail,
        })?;
        let mut body = Vec::with_capacity(INCARNATION_PREFIX + archived.len());
        body.extend_from_slice(&incarnation.to_le_bytes());
        body.extend_from_slice(&archived);
        Ok(body)
    }

    fn timeout<M: RemoteMessage>(&self, timeout: Duration) -> ActorError {
        ActorError::Timeout { actor: self.name.to_string(), message: M::NAME, timeout }
    }

    fn on_local_error(&self, target: &Target<A>, e: ActorError) -> ActorError {
        if e.is_lost() {
            self.forget(target);
        }
        e
    }

    fn remote_error<M: RemoteMessage>(&self, target: &Target<A>, e: CallError) -> ActorError {
        let actor = self.name.to_string();
        match e {
            CallError::Remote { kind, message: detail, .. } => match kind {
                FaultKind::Forbidden => ActorError::Forbidden { actor, message: M::NAME, detail },
                FaultKind::Busy => ActorError::Busy { actor, detail },
                FaultKind::BadRequest | FaultKind::UnknownMethod => {
                    ActorError::BadMessage { actor, message: M::NAME, detail }
                }
                FaultKind::Failed => ActorError::Failed { actor, message: M::NAME, detail },
                FaultKind::Gone | FaultKind::UnknownService => self.lost(target, detail),
            },
            CallError::Timeout { timeout, .. } => ActorError::Timeout { actor, message: M::NAME, timeout },
            CallError::PeerLeft { reason, .. } => self.lost(target, format!("its node left: {reason}")),
            CallError::Send { detail, .. } => self.lost(target, format!("sending failed: {detail}")),
            CallError::TooManyOutstanding(n) => {
                ActorError::Busy { actor, detail: format!("{n} calls outstanding on this node, its bound") }
            }
            CallError::Encode(e) => ActorError::BadMessage { actor, message: M::NAME, detail: e.to_string() },
        }
    }
}
