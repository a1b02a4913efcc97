//! Ordered calls to peers, with one generation rule: the one way a scheduler shell drives the
//! actors it schedules on (coe executors, pipeline workers).
//!
//! [`Links`] keeps one queue per key (an executor's index, a worker's). [`Links::attach`] gives
//! the key a handle (an [`ActorHandle`], or any handle a shell calls through, such as an
//! in-process executor's) and a new generation; calls submitted for the key run one at a time, in the
//! order submitted, and each outcome reaches the shell's sink tagged with its key and
//! generation. When a call finds the incarnation gone ([`ActorError::PeerLost`]), the queue
//! reports [`Outcome::Lost`] once and ends: the calls behind it are dropped, unsent. The rule
//! is [`Links::is_current`]: the shell acts on an outcome only while its generation is the
//! key's current one, so nothing from a link it replaced (or detached) is ever taken for news,
//! and a replaced or detached link sends nothing more (what was queued on it is dropped).
//! Calls to one incarnation never overlap across generations: a link attached again to the
//! incarnation it had (a restarted shell taking its peers over) waits for the call of the old
//! generation still in flight before its first; a link to another incarnation does not wait
//! for calls to a dead one.
//! The queues are tokio tasks: no thread per link, and no call awaits inside the shell.

use std::collections::HashMap;
use std::future::Future;
use std::hash::Hash;
use std::pin::Pin;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use tokio::sync::mpsc;

use super::actor::{Handles, TypedActor};
use super::error::ActorError;
use super::handle::ActorHandle;
use super::wire::RemoteMessage;

/// What one queued call produced.
#[derive(Debug)]
pub enum Outcome<E> {
    /// The call's result, as the submitter mapped it.
    Done(E),
    /// The call failed, but the incarnation is still there (refused, busy, timed out, the
    /// actor's own failure): the queue goes on.
    Failed(ActorError),
    /// The incarnation is gone: the queue ended and dropped the calls behind this one.
    Lost(ActorError),
}

/// What a queued call runs to.
pub type CallFuture<E> = Pin<Box<dyn Future<Output = Result<E, ActorError>> + Send>>;
/// One queued call: what to send through the handle, and how to map its reply.
type Call<H, E> = Box<dyn FnOnce(H) -> CallFuture<E> + Send>;
/// Where outcomes go: `(key, generation, outcome)`.
pub type Sink<K, E> = Arc<dyn Fn(K, u64, Outcome<E>) + Send + Sync>;

struct Slot<H, E> {
    generation: u64,
    tx: Option<mpsc::UnboundedSender<Call<H, E>>>,
    /// The link's handle: held here, not by its task, so a detach lets go of it at once (an
    /// in-process executor's thread ends when the last handle to it goes).
    handle: Option<H>,
    /// The queue's task, when it was attached outside a tokio runtime: started by the first
    /// call queued (which runs inside one).
    unstarted: Option<Pin<Box<dyn Future<Output = ()> + Send>>>,
    /// The incarnation the last link addressed, and the turn its calls take: held during each
    /// call, shared by every generation linked to that incarnation.
    incarnation: Option<u64>,
    turn: Arc<tokio::sync::Mutex<()>>,
}

/// A handle a link calls through: says which incarnation it addresses, if it knows.
pub trait LinkHandle: Clone + Send + 'static {
    /// The incarnation addressed (`None`: unknown, so never shared with another link).
    fn incarnation(&self) -> Option<u64> {
        None
    }
}

impl<A: TypedActor> LinkHandle for ActorHandle<A> {
    fn incarnation(&self) -> Option<u64> {
        ActorHandle::incarnation(self)
    }
}

/// Per-key ordered call queues with generations (see the module doc), calling through handles
/// of type `H`. Cheap to clone.
pub struct Links<K, H, E> {
    slots: Arc<Mutex<HashMap<K, Slot<H, E>>>>,
    sink: Sink<K, E>,
}

impl<K, H, E> Clone for Links<K, H, E> {
    fn clone(&self) -> Self {
        Self { slots: self.slots.clone(), sink: self.sink.clone() }
    }
}

/// Why a call was not queued.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum NotQueued {
    /// The key has no live link (never attached, detached, or its incarnation was lost).
    #[error("no live link for this peer (generation {0})")]
    NoLink(u64),
    /// The link was replaced since the generation the caller asked for.
    #[error("the link of generation {wanted} was replaced (now {current})")]
    Stale {
        /// The generation asked for.
        wanted: u64,
        /// The key's generation now.
        current: u64,
    },
}

impl<K, H, E> Links<K, H, E>
where
    K: Clone + Eq + Hash + Send + Sync + 'static,
    H: LinkHandle,
    E: Send + 'static,
{
    /// Queues whose outcomes go to `sink`.
    pub fn new(sink: Sink<K, E>) -> Self {
        Self { slots: Arc::new(Mutex::new(HashMap::new())), sink }
    }

    fn slots(&self) -> std::sync::MutexGuard<'_, HashMap<K, Slot<H, E>>> {
        self.slots.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Gives `key` a new link through `handle` (ending the previous one, whose queued calls are
    /// dropped); the new generation. When `handle` addresses the incarnation the previous link
    /// did, the previous link's call in flight finishes before the new link's first call.
    pub fn attach(&self, key: K, handle: H) -> u64 {
        self.attach_through(key, Some(handle)).unwrap_or_default()
    }

    /// Gives `key` a new link through the handle its live link has now: a new generation, so
    /// calls queued on the old one are dropped and their outcomes are no longer current. For a
    /// shell's new incarnation, which must never take what an earlier one asked for as its own.
    /// `None` when `key` has no live link.
    pub fn renew(&self, key: &K) -> Option<u64> {
        self.attach_through(key.clone(), None)
    }

    /// [`Links::attach`] through `handle`, or (`None`) through the live link's own handle,
    /// read under the same lock so a newer link attached meanwhile is never replaced by an
    /// older handle; `None` when there is neither.
    fn attach_through(&self, key: K, handle: Option<H>) -> Option<u64> {
        let (tx, mut rx) = mpsc::unbounded_channel::<Call<H, E>>();
        let (generation, turn) = {
            let mut slots = self.slots();
            let handle = match handle {
                Some(h) => h,
                None => slots.get(&key).filter(|s| s.tx.is_some()).and_then(|s| s.handle.clone())?,
            };
            let incarnation = handle.incarnation();
            let slot = slots.entry(key.clone()).or_insert_with(|| Slot {
                generation: 0,
                tx: None,
                handle: None,
                unstarted: None,
                incarnation: None,
                turn: Arc::default(),
            });
            if incarnation.is_none() || slot.incarnation != incarnation {
                slot.turn = Arc::default();
            }
            slot.incarnation = incarnation;
            slot.generation += 1;
            slot.tx = Some(tx);
            slot.handle = Some(handle);
            slot.unstarted = None;
            (slot.generation, slot.turn.clone())
        };
        let (sink, slots) = (self.sink.clone(), self.slots.clone());
        let task_key = key.clone();
        let task = Box::pin(async move {
            let key = task_key;
            while let Some(call) = rx.recv().await {
                let _turn = turn.lock().await;
                // replaced or detached while this call waited: it and the rest are dropped
                let handle = {
                    let slots = slots.lock().unwrap_or_else(PoisonError::into_inner);
                    slots.get(&key).filter(|s| s.generation == generation).and_then(|s| s.handle.clone())
                };
                // detached or replaced meanwhile: what is queued behind is dropped, unsent
                let Some(handle) = handle else { return };
                match call(handle).await {
                    Ok(e) => sink(key.clone(), generation, Outcome::Done(e)),
                    Err(e) if e.is_lost() => {
                        // end this link (unless a newer one replaced it already), then report
                        if let Some(slot) = slots.lock().unwrap_or_else(PoisonError::into_inner).get_mut(&key)
                            && slot.generation == generation
                        {
                            slot.tx = None;
                            slot.handle = None;
                        }
                        sink(key, generation, Outcome::Lost(e));
                        return;
                    }
                    Err(e) => sink(key.clone(), generation, Outcome::Failed(e)),
                }
            }
        });
        match tokio::runtime::Handle::try_current() {
            Ok(rt) => {
                rt.spawn(task);
            }
            Err(_) => {
                if let Some(slot) = self.slots().get_mut(&key)
                    && slot.generation == generation
                {
                    slot.unstarted = Some(task);
                }
            }
        }
        Some(generation)
    }

    /// Ends `key`'s link: queued calls are dropped; outcomes of its generation are no longer
    /// current.
    pub fn detach(&self, key: &K) {
        if let Some(slot) = self.slots().get_mut(key) {
            slot.generation += 1;
            slot.tx = None;
            slot.handle = None;
            slot.unstarted = None;
        }
    }

    /// Ends `key`'s link if `generation` is still its current one (a shell ending its own links
    /// never ends a newer shell's); true when it did.
    pub fn detach_generation(&self, key: &K, generation: u64) -> bool {
        match self.slots().get_mut(key) {
            Some(slot) if slot.generation == generation => {
                slot.generation += 1;
                slot.tx = None;
                slot.handle = None;
                slot.unstarted = None;
                true
            }
            _ => false,
        }
    }

    /// `key`'s current generation (0: never attached).
    pub fn generation(&self, key: &K) -> u64 {
        self.slots().get(key).map_or(0, |s| s.generation)
    }

    /// The one generation rule: whether an outcome of `generation` for `key` is still news.
    pub fn is_current(&self, key: &K, generation: u64) -> bool {
        self.generation(key) == generation
    }

    /// Whether `key` has a live link.
    pub fn is_live(&self, key: &K) -> bool {
        self.slots().get(key).is_some_and(|s| s.tx.is_some())
    }

    /// Queues any call through the handle (several messages, a tell then a call) as one step.
    pub fn submit(
        &self,
        key: &K,
        call: impl FnOnce(H) -> CallFuture<E> + Send + 'static,
    ) -> Result<u64, NotQueued> {
        self.submit_if(key, None, call)
    }

    /// [`Links::submit`] only while `key`'s link is still of `generation` (the one a shell
    /// believes in): a command meant for a link that was replaced never reaches its successor.
    pub fn submit_on(
        &self,
        key: &K,
        generation: u64,
        call: impl FnOnce(H) -> CallFuture<E> + Send + 'static,
    ) -> Result<u64, NotQueued> {
        self.submit_if(key, Some(generation), call)
    }

    fn submit_if(
        &self,
        key: &K,
        want: Option<u64>,
        call: impl FnOnce(H) -> CallFuture<E> + Send + 'static,
    ) -> Result<u64, NotQueued> {
        let mut slots = self.slots();
        let slot = slots.get_mut(key);
        let generation = slot.as_ref().map_or(0, |s| s.generation);
        if want.is_some_and(|g| g != generation) {
            return Err(NotQueued::Stale { wanted: want.unwrap_or_default(), current: generation });
        }
        let Some(slot) = slot else { return Err(NotQueued::NoLink(generation)) };
        if let Some(task) = slot.unstarted.take() {
            // queued calls run on the caller's runtime from here on
            tokio::spawn(task);
        }
        match slot.tx.as_ref() {
            Some(tx) if tx.send(Box::new(call)).is_ok() => Ok(generation),
            _ => Err(NotQueued::NoLink(generation)),
        }
    }
}

impl<K, A, E> Links<K, ActorHandle<A>, E>
where
    K: Clone + Eq + Hash + Send + Sync + 'static,
    A: TypedActor,
    E: Send + 'static,
{
    /// Queues `msg` for `key` behind the calls already queued; `map` turns its reply into the
    /// sink's event. Returns the generation it was queued on.
    pub fn call<M>(
        &self,
        key: &K,
        msg: M,
        timeout: Duration,
        map: impl FnOnce(M::Reply) -> E + Send + 'static,
    ) -> Result<u64, NotQueued>
    where
        M: RemoteMessage,
        A: Handles<M>,
    {
        self.submit(key, move |h: ActorHandle<A>| -> CallFuture<E> {
            Box::pin(async move { h.call(msg, timeout).await.map(map) })
        })
    }
}
