//! Ordered calls to peers, with one generation rule: the one way a scheduler shell drives the
//! actors it schedules on (coe executors, pipeline workers).
//!
//! [`Links`] keeps one queue per key (an executor's index, a worker's). [`Links::attach`] gives
//! the key a handle and a new generation; calls submitted for the key run one at a time, in the
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

type CallFuture<E> = Pin<Box<dyn Future<Output = Result<E, ActorError>> + Send>>;
/// One queued call: what to send through the handle, and how to map its reply.
type Call<A, E> = Box<dyn FnOnce(ActorHandle<A>) -> CallFuture<E> + Send>;
/// Where outcomes go: `(key, generation, outcome)`.
pub type Sink<K, E> = Arc<dyn Fn(K, u64, Outcome<E>) + Send + Sync>;

struct Slot<A, E> {
    generation: u64,
    tx: Option<mpsc::UnboundedSender<Call<A, E>>>,
    /// The incarnation the last link addressed, and the turn its calls take: held during each
    /// call, shared by every generation linked to that incarnation.
    incarnation: Option<u64>,
    turn: Arc<tokio::sync::Mutex<()>>,
}

fn fresh_slot<A, E>() -> Slot<A, E> {
    Slot { generation: 0, tx: None, incarnation: None, turn: Arc::default() }
}

/// Per-key ordered call queues with generations (see the module doc). Cheap to clone.
pub struct Links<K, A, E> {
    slots: Arc<Mutex<HashMap<K, Slot<A, E>>>>,
    sink: Sink<K, E>,
}

impl<K, A, E> Clone for Links<K, A, E> {
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
}

impl<K, A, E> Links<K, A, E>
where
    K: Clone + Eq + Hash + Send + Sync + 'static,
    A: TypedActor,
    E: Send + 'static,
{
    /// Queues whose outcomes go to `sink`.
    pub fn new(sink: Sink<K, E>) -> Self {
        Self { slots: Arc::new(Mutex::new(HashMap::new())), sink }
    }

    fn slots(&self) -> std::sync::MutexGuard<'_, HashMap<K, Slot<A, E>>> {
        self.slots.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Gives `key` a new link through `handle` (ending the previous one, whose queued calls are
    /// dropped); the new generation. When `handle` addresses the incarnation the previous link
    /// did, the previous link's call in flight finishes before the new link's first call.
    pub fn attach(&self, key: K, handle: ActorHandle<A>) -> u64 {
        let (tx, mut rx) = mpsc::unbounded_channel::<Call<A, E>>();
        let incarnation = handle.incarnation();
        let (generation, turn) = {
            let mut slots = self.slots();
            let slot = slots.entry(key.clone()).or_insert_with(fresh_slot);
            if incarnation.is_none() || slot.incarnation != incarnation {
                slot.turn = Arc::default();
            }
            slot.incarnation = incarnation;
            slot.generation += 1;
            slot.tx = Some(tx);
            (slot.generation, slot.turn.clone())
        };
        let (sink, slots) = (self.sink.clone(), self.slots.clone());
        tokio::spawn(async move {
            while let Some(call) = rx.recv().await {
                let _turn = turn.lock().await;
                // replaced or detached while this call waited: it and the rest are dropped
                let current = slots
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner)
                    .get(&key)
                    .is_some_and(|s| s.generation == generation);
                if !current {
                    return;
                }
                match call(handle.clone()).await {
                    Ok(e) => sink(key.clone(), generation, Outcome::Done(e)),
                    Err(e) if e.is_lost() => {
                        // end this link (unless a newer one replaced it already), then report
                        if let Some(slot) = slots.lock().unwrap_or_else(PoisonError::into_inner).get_mut(&key)
                            && slot.generation == generation
                        {
                            slot.tx = None;
                        }
                        sink(key, generation, Outcome::Lost(e));
                        return;
                    }
                    Err(e) => sink(key.clone(), generation, Outcome::Failed(e)),
                }
            }
        });
        generation
    }

    /// Ends `key`'s link: queued calls are dropped; outcomes of its generation are no longer
    /// current.
    pub fn detach(&self, key: &K) {
        if let Some(slot) = self.slots().get_mut(key) {
            slot.generation += 1;
            slot.tx = None;
        }
    }

    /// Ends `key`'s link if `generation` is still its current one (a shell ending its own links
    /// never ends a newer shell's); true when it did.
    pub fn detach_generation(&self, key: &K, generation: u64) -> bool {
        match self.slots().get_mut(key) {
            Some(slot) if slot.generation == generation => {
                slot.generation += 1;
                slot.tx = None;
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

    /// Queues any call through the handle (several messages, a tell then a call) as one step.
    pub fn submit(
        &self,
        key: &K,
        call: impl FnOnce(ActorHandle<A>) -> CallFuture<E> + Send + 'static,
    ) -> Result<u64, NotQueued> {
        let slots = self.slots();
        let slot = slots.get(key);
        let generation = slot.map_or(0, |s| s.generation);
        match slot.and_then(|s| s.tx.as_ref()) {
            Some(tx) if tx.send(Box::new(call)).is_ok() => Ok(generation),
            _ => Err(NotQueued::NoLink(generation)),
        }
    }
}
