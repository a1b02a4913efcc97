//! Mailbox depths of the runtime's own actors, counted by the runtime: ractor 0.16 exposes no
//! mailbox length, so the depth is how many counted messages are alive between their send and
//! the moment their actor starts handling them.
//!
//! One mechanism: a counted message carries a [`Queued`] token, which only the counted send
//! path ([`CountedSend::cast_counted`], [`CountedSend::call_counted`]) can make. Making it adds
//! one to the receiving actor's depth; dropping it takes one off. The handler drops it first
//! thing (the message is then out of the mailbox), and every other end of a message drops it
//! too: a send refused because the actor is gone hands the message back in its error, and an
//! actor that stops or fails with messages still queued drops its mailbox with them. So the
//! depth is exactly the number of counted messages in flight, never negative and without drift.
//! Messages that carry no token (timers, a ractor_cluster peer's messages, supervision signals)
//! are simply not counted; a message type that takes a token in a variant cannot be built
//! without one, so a send site cannot forget to count.
//!
//! Actors covered: the scheduler shell ([`crate::kinds::scheduler::SchedulerActor`]: the coe
//! scheduler, the pipeline foreman, the coadapt edge; its inputs, not its timer ticks), the coe
//! executor actor. (Typed actors, the pipeline worker among them, bound their mailbox with
//! [`crate::typed::Protocol::mailbox`] instead.) The service router and its per-connection
//! handlers are tokio tasks, not actors; their queue is the admission count the request service
//! publishes in [`crate::live`].
//!
//! Depths are keyed by the actor's registered name (every supervised child has one; an unnamed
//! actor is keyed by its message type). An actor that is gone (no longer registered) and idle
//! (no token alive) is forgotten, so per-job actors do not pile up; past
//! [`MAX_STATUS_MAILBOXES`] live actors, messages to further ones are not counted, and the log
//! says so once.

use std::collections::BTreeMap;
use std::future::Future;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

use ractor::rpc::CallResult;
use ractor::{ActorRef, Message, MessagingErr, RactorErr, RpcReplyPort};

use crate::wire::{MAX_STATUS_MAILBOXES, MailboxView};

/// One actor's counts.
#[derive(Default)]
struct Slot {
    depth: AtomicU64,
    max_depth: AtomicU64,
}

static SLOTS: Mutex<BTreeMap<String, Arc<Slot>>> = Mutex::new(BTreeMap::new());
static OVER_CAP_LOGGED: AtomicBool = AtomicBool::new(false);

/// Forgets the slots of actors that are gone (no longer registered) and idle (no token alive),
/// so per-job actors (`pipeline-foreman-N`) do not pile up to the cap.
fn prune(slots: &mut BTreeMap<String, Arc<Slot>>) {
    slots.retain(|actor, s| {
        s.depth.load(Ordering::Relaxed) > 0
            || Arc::strong_count(s) > 1
            || ractor::registry::where_is(actor.clone()).is_some()
    });
}

/// The slot of `actor`, made on first use; `None` past the cap.
fn slot(actor: &str) -> Option<Arc<Slot>> {
    let mut slots = SLOTS.lock().unwrap_or_else(PoisonError::into_inner);
    if let Some(s) = slots.get(actor) {
        return Some(s.clone());
    }
    if slots.len() >= MAX_STATUS_MAILBOXES {
        prune(&mut slots);
    }
    if slots.len() >= MAX_STATUS_MAILBOXES {
        if !OVER_CAP_LOGGED.swap(true, Ordering::Relaxed) {
            tracing::warn!(
                cap = MAX_STATUS_MAILBOXES,
                %actor,
                "mailbox depths: more actors than a status carries; messages to further ones are not counted"
            );
        }
        return None;
    }
    let s = Arc::new(Slot::default());
    slots.insert(actor.to_string(), s.clone());
    Some(s)
}

/// A counted message's place in its actor's mailbox: one in the depth while it lives. Made
/// only by [`CountedSend`]; the receiving handler drops it (or calls [`Queued::taken`]) as it
/// starts on the message.
#[must_use = "dropping the token takes the message out of the mailbox depth"]
pub struct Queued(Option<Arc<Slot>>);

impl Queued {
    fn enter(actor: &str) -> Self {
        Self::in_slot(slot(actor))
    }

    fn in_slot(slot: Option<Arc<Slot>>) -> Self {
        if let Some(s) = &slot {
            let now = s.depth.fetch_add(1, Ordering::Relaxed) + 1;
            s.max_depth.fetch_max(now, Ordering::Relaxed);
        }
        Queued(slot)
    }

    /// The handler has taken the message out of the mailbox (the same as dropping the token;
    /// this names the moment at the top of a handler).
    pub fn taken(self) {}
}

impl Drop for Queued {
    fn drop(&mut self) {
        if let Some(s) = &self.0 {
            s.depth.fetch_sub(1, Ordering::Relaxed);
        }
    }
}

impl std::fmt::Debug for Queued {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Queued")
    }
}

/// The depth key of `actor`: its registered name, else its message type.
fn key<M: Message>(actor: &ActorRef<M>) -> String {
    actor.get_name().unwrap_or_else(|| std::any::type_name::<M>().to_string())
}

/// Lists `actor` from now on (depth 0 until a counted message reaches it): a counted actor
/// calls this as it starts, so its mailbox shows before the first message.
pub fn track<M: Message>(actor: &ActorRef<M>) {
    let _ = slot(&key(actor));
}

/// The counted send path: `make` builds the message around its [`Queued`] token.
pub trait CountedSend<M: Message> {
    /// Sends without waiting, like `cast`.
    fn cast_counted(&self, make: impl FnOnce(Queued) -> M) -> Result<(), MessagingErr<M>>;

    /// Sends and waits for the reply, like `ractor::call!` (no timeout).
    fn call_counted<R, F>(&self, make: F) -> impl Future<Output = Result<R, RactorErr<M>>> + Send
    where
        R: Send + 'static,
        F: FnOnce(Queued, RpcReplyPort<R>) -> M + Send;
}

impl<M: Message> CountedSend<M> for ActorRef<M> {
    fn cast_counted(&self, make: impl FnOnce(Queued) -> M) -> Result<(), MessagingErr<M>> {
        self.cast(make(Queued::enter(&key(self))))
    }

    fn call_counted<R, F>(&self, make: F) -> impl Future<Output = Result<R, RactorErr<M>>> + Send
    where
        R: Send + 'static,
        F: FnOnce(Queued, RpcReplyPort<R>) -> M + Send,
    {
        let queued = Queued::enter(&key(self));
        async move {
            match self.call(move |reply| make(queued, reply), None).await.map_err(RactorErr::from)? {
                CallResult::Success(value) => Ok(value),
                other => Err(RactorErr::from(other)),
            }
        }
    }
}

/// The counted mailbox of a typed actor, keyed by its name ([`crate::typed`]): listed from
/// when it is made, as long as it (or a message in it) lives.
#[derive(Clone)]
pub struct Mailbox(Option<Arc<Slot>>);

impl Mailbox {
    /// The mailbox of the actor named `name`.
    pub fn named(name: &str) -> Self {
        Mailbox(slot(name))
    }

    /// A token for one message entering it.
    pub fn enter(&self) -> Queued {
        Queued::in_slot(self.0.clone())
    }
}

/// Every counted actor's depth now, in name order (an actor that is gone and idle is no longer
/// listed).
pub fn depths() -> Vec<MailboxView> {
    let mut slots = SLOTS.lock().unwrap_or_else(PoisonError::into_inner);
    prune(&mut slots);
    slots
        .iter()
        .map(|(actor, s)| MailboxView {
            actor: actor.clone(),
            depth: s.depth.load(Ordering::Relaxed),
            max_depth: s.max_depth.load(Ordering::Relaxed),
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use ractor::{Actor, ActorProcessingErr};
    use tokio::sync::{Semaphore, mpsc};

    /// An actor whose counted `Work` waits for a permit after saying it started.
    struct Gated;

    enum GatedMsg {
        Work(Queued),
        Uncounted,
        Ping(Queued, RpcReplyPort<()>),
    }

    impl Message for GatedMsg {}

    struct GatedArgs {
        started: mpsc::UnboundedSender<()>,
        gate: Arc<Semaphore>,
    }

    impl Actor for Gated {
        type Msg = GatedMsg;
        type State = GatedArgs;
        type Arguments = GatedArgs;

        async fn pre_start(
            &self,
            me: ActorRef<GatedMsg>,
            a: GatedArgs,
        ) -> Result<GatedArgs, ActorProcessingErr> {
            track(&me);
            Ok(a)
        }

        async fn handle(
            &self,
            _me: ActorRef<GatedMsg>,
            msg: GatedMsg,
            st: &mut GatedArgs,
        ) -> Result<(), ActorProcessingErr> {
            match msg {
                GatedMsg::Work(q) => {
                    q.taken();
                    st.started.send(())?;
                    st.gate.acquire().await?.forget();
                }
                GatedMsg::Uncounted => {}
                GatedMsg::Ping(q, reply) => {
                    q.taken();
                    let _ = reply.send(());
                }
            }
            Ok(())
        }
    }

    fn depth_of(actor: &str) -> Option<(u64, u64)> {
        let live = crate::live::snapshot();
        live.mailboxes.iter().find(|m| m.actor == actor).map(|m| (m.depth, m.max_depth))
    }

    #[tokio::test]
    async fn depth_counts_queued_messages_and_returns_to_zero_when_handled_or_dropped() {
        const NAME: &str = "test-mailbox-gated";
        const N: u64 = 5;
        let (started_tx, mut started) = mpsc::unbounded_channel();
        let gate = Arc::new(Semaphore::new(0));
        let args = GatedArgs { started: started_tx, gate: gate.clone() };
        let (actor, handle) = Actor::spawn(Some(NAME.into()), Gated, args).await.unwrap();
        assert_eq!(depth_of(NAME), Some((0, 0)), "a tracked actor is listed from its start");

        // the first message is taken and blocks the handler
        actor.cast_counted(GatedMsg::Work).unwrap();
        started.recv().await.expect("the handler started");
        assert_eq!(depth_of(NAME), Some((0, 1)));
        for _ in 0..N {
            actor.cast_counted(GatedMsg::Work).unwrap();
        }
        // uncounted messages (as a timer's or a peer's) leave the depth alone
        actor.cast(GatedMsg::Uncounted).unwrap();
        assert_eq!(depth_of(NAME), Some((N, N)));

        // released, every message is handled (each says so), and the depth is back to 0
        gate.add_permits(N as usize + 1);
        for _ in 0..N {
            started.recv().await.expect("a queued message was handled");
        }
        assert_eq!(depth_of(NAME), Some((0, N)));
        actor.call_counted(GatedMsg::Ping).await.unwrap();
        assert_eq!(depth_of(NAME), Some((0, N)));

        // an actor killed with messages queued drops them, and they leave the depth
        actor.cast_counted(GatedMsg::Work).unwrap();
        started.recv().await.expect("the handler started");
        for _ in 0..3 {
            actor.cast_counted(GatedMsg::Work).unwrap();
        }
        assert_eq!(depth_of(NAME), Some((3, N)));
        actor.kill();
        handle.await.unwrap();
        assert_eq!(counts(NAME), Some((0, N)));
        // a send to a stopped actor is refused, and its token goes with the refused message
        assert!(actor.cast_counted(GatedMsg::Work).is_err());
        assert_eq!(counts(NAME), Some((0, N)));
        // gone and idle, it is no longer listed
        assert_eq!(depth_of(NAME), None);
        assert_eq!(counts(NAME), None);
    }

    /// The counts of `actor` as kept, without pruning.
    fn counts(actor: &str) -> Option<(u64, u64)> {
        let slots = SLOTS.lock().unwrap_or_else(PoisonError::into_inner);
        slots.get(actor).map(|s| (s.depth.load(Ordering::Relaxed), s.max_depth.load(Ordering::Relaxed)))
    }
}
