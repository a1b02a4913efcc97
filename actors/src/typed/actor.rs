//! A typed actor kind: its messages and who may send them ([`Protocol`]), its handlers
//! ([`Handles`]), and the ractor actor that hosts one incarnation of it ([`Host`]).

use std::collections::BTreeMap;
use std::future::Future;
use std::marker::PhantomData;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use ractor::{Actor, ActorProcessingErr, ActorRef};
use tokio::sync::oneshot;
use troupe_transport::NodeId;
use troupe_transport::service::FaultKind;

use super::error::{ActorError, ActorFailure};
use super::registry::Actors;
use super::wire::{RemoteMessage, Wire};
use crate::service::Allow;

/// Messages queued for one actor before further ones are refused as busy (the default of
/// [`Protocol::mailbox`]).
pub const DEFAULT_MAILBOX: usize = 4096;

/// An actor kind that other nodes reach through typed handles.
///
/// The kind names itself ([`TypedActor::KIND`]), declares every message it accepts and the
/// certificate roles that may send each ([`TypedActor::protocol`]), and says how an incarnation
/// starts from its arguments ([`TypedActor::start`]). Arguments are a [`Wire`] value, so a
/// supervisor on another node can start (and restart) the actor where it places it.
pub trait TypedActor: Sized + Send + 'static {
    /// The kind's name: in announcements, placement rules and errors.
    const KIND: &'static str;
    /// What an incarnation starts from (sent to the node that hosts it).
    type Args: Wire + Clone + Sync;
    /// Declares the messages and their senders: `p.request::<Add>(Allow::role(Role::Client))`,
    /// or with a role of the kind's own, `p.request_from::<Add>("my-app")`.
    fn protocol(p: &mut Protocol<Self>);
    /// Makes an incarnation. A failure here is a failed start (a placement refused, a spawn
    /// error), not a crash to restart.
    fn start(args: Self::Args, ctx: &ActorContext)
    -> impl Future<Output = Result<Self, ActorFailure>> + Send;
}

/// A handler of message `M`: its reply, or a failure the caller receives as
/// [`ActorError::Failed`]. A panic crashes the incarnation; its supervisor restarts it.
pub trait Handles<M: RemoteMessage>: TypedActor {
    /// Carries out `msg`.
    fn handle(
        &mut self,
        msg: M,
        ctx: &ActorContext,
    ) -> impl Future<Output = Result<M::Reply, ActorFailure>> + Send;

    /// What the runtime runs in the actor's turn for `msg`: by default [`Handles::handle`], its
    /// reply given now. A kind whose reply waits on work done elsewhere (a scheduler, another
    /// actor) overrides it to return [`Reply::Later`], so its mailbox goes on to the next
    /// message while that reply is awaited outside the actor; its `handle` is then this turn
    /// and the awaited reply ([`Reply::wait`]).
    fn turn(
        &mut self,
        msg: M,
        ctx: &ActorContext,
    ) -> impl Future<Output = Result<Reply<M::Reply>, ActorFailure>> + Send {
        async move { self.handle(msg, ctx).await.map(Reply::Now) }
    }
}

/// The future of a reply given later ([`Reply::Later`]).
pub type LaterReply<R> = Pin<Box<dyn Future<Output = Result<R, ActorFailure>> + Send>>;

/// What a handler's turn ([`Handles::turn`]) ends with.
pub enum Reply<R> {
    /// The reply, now.
    Now(R),
    /// The reply once this future resolves; for a call it runs outside the actor, which goes on
    /// with its mailbox (and is awaited even if the incarnation stops meanwhile), bounded by the
    /// router's admission of the waiting caller; for a tell it is awaited in the actor's turn.
    Later(LaterReply<R>),
}

impl<R> Reply<R> {
    /// The reply, awaited if it comes later.
    pub async fn wait(self) -> Result<R, ActorFailure> {
        match self {
            Reply::Now(r) => Ok(r),
            Reply::Later(f) => f.await,
        }
    }
}

/// What a running incarnation knows about itself and reaches others through.
#[derive(Clone)]
pub struct ActorContext {
    /// The name it is registered under.
    pub name: String,
    /// This incarnation's number (a new one at every start).
    pub incarnation: u64,
    /// How many times a supervisor has placed it (0 for an actor spawned in place).
    pub generation: u64,
    /// The node's actor registry: look up other actors by name.
    pub actors: Actors,
    /// The node that sent the message being handled (its certificate's name; this node's for a
    /// message from a local handle); `None` in [`TypedActor::start`].
    pub sender: Option<NodeId>,
}

impl ActorContext {
    /// This context while handling a message from `sender`.
    fn with_sender(&self, sender: NodeId) -> Self {
        Self { sender: Some(sender), ..self.clone() }
    }
}

type JobFuture<'a> = Pin<Box<dyn Future<Output = ()> + Send + 'a>>;
/// One message on its way into an incarnation: runs the handler on the actor's state.
pub(crate) type Job<A> = Box<dyn for<'a> FnOnce(&'a mut A, &'a ActorContext) -> JobFuture<'a> + Send>;
/// A remote call's reply: the archived reply, or the failure's class and message.
pub(crate) type WireReply = Result<Vec<u8>, (FaultKind, String)>;
type Dispatch<A> =
    fn(&[u8], Option<oneshot::Sender<WireReply>>, NodeId) -> Result<Job<A>, (FaultKind, String)>;

struct Entry<A> {
    allow: Allow,
    dispatch: Dispatch<A>,
}

/// The messages of a kind and who may send each (see [`TypedActor::protocol`]).
pub struct Protocol<A> {
    entries: BTreeMap<&'static str, Entry<A>>,
    mailbox: usize,
    problems: Vec<String>,
}

impl<A: TypedActor> Protocol<A> {
    pub(crate) fn of() -> Self {
        let mut p = Self { entries: BTreeMap::new(), mailbox: DEFAULT_MAILBOX, problems: Vec::new() };
        A::protocol(&mut p);
        p
    }

    /// Accepts `M` (a call or a tell) from senders `allow` lets through.
    pub fn request<M: RemoteMessage>(&mut self, allow: Allow) -> &mut Self
    where
        A: Handles<M>,
    {
        let name = M::NAME;
        if name.is_empty() || name.starts_with('@') || name.len() > troupe_transport::service::MAX_NAME {
            self.problems.push(format!("message name {name:?} must be 1-64 bytes and not start with '@'"));
        } else if self.entries.insert(name, Entry { allow, dispatch: remote_job::<A, M> }).is_some() {
            self.problems.push(format!("message name {name:?} is declared twice"));
        }
        self
    }

    /// Accepts `M` from holders of any of `roles`, a comma-separated list of role names that
    /// may be the kind's own (`p.request_from::<Add>("my-app")`, see
    /// [`troupe_transport::Role::named`]). A bad name or an empty list is this protocol's
    /// problem: spawning the kind fails, naming it.
    pub fn request_from<M: RemoteMessage>(&mut self, roles: &str) -> &mut Self
    where
        A: Handles<M>,
    {
        match troupe_transport::RoleSet::parse_list(roles) {
            Ok(set) if !set.is_empty() => self.request::<M>(Allow::Roles(set)),
            Ok(_) => {
                self.problems.push(format!("message {:?} names no role that may send it", M::NAME));
                self
            }
            Err(e) => {
                self.problems.push(format!("message {:?}: {e}", M::NAME));
                self
            }
        }
    }

    /// At most `messages` queued before further ones are refused as busy.
    pub fn mailbox(&mut self, messages: usize) -> &mut Self {
        self.mailbox = messages.max(1);
        self
    }

    pub(crate) fn problems(&self) -> &[String] {
        &self.problems
    }

    pub(crate) fn mailbox_bound(&self) -> usize {
        self.mailbox
    }

    pub(crate) fn rules(&self) -> impl Iterator<Item = (&'static str, Allow)> + '_ {
        self.entries.iter().map(|(n, e)| (*n, e.allow))
    }

    pub(crate) fn dispatch(
        &self,
        method: &str,
        body: &[u8],
        reply: Option<oneshot::Sender<WireReply>>,
        sender: NodeId,
    ) -> Result<Job<A>, (FaultKind, String)> {
        let entry = self.entries.get(method).ok_or_else(|| {
            (FaultKind::UnknownMethod, format!("a {} takes no message {method:?}", A::KIND))
        })?;
        (entry.dispatch)(body, reply, sender)
    }
}

/// A message from a peer: decoded through the checked path, then run like a local one, its
/// reply archived for the wire.
fn remote_job<A: Handles<M>, M: RemoteMessage>(
    body: &[u8],
    reply: Option<oneshot::Sender<WireReply>>,
    sender: NodeId,
) -> Result<Job<A>, (FaultKind, String)> {
    let msg = M::from_wire(M::NAME, body).map_err(|e| (FaultKind::BadRequest, e.to_string()))?;
    Ok(Box::new(move |actor: &mut A, ctx: &ActorContext| {
        Box::pin(async move {
            let ctx = ctx.with_sender(sender);
            let name = ctx.name.clone();
            let told = reply.is_none();
            let finish = move |out: Result<M::Reply, ActorFailure>| {
                let wire = match out {
                    Ok(r) => r.to_wire().map_err(|e| (FaultKind::Failed, format!("encoding the reply: {e}"))),
                    Err(f) => Err((FaultKind::Failed, f.to_string())),
                };
                match reply {
                    Some(tx) => {
                        let _ = tx.send(wire);
                    }
                    None => log_told_failure(&name, M::NAME, wire.err()),
                }
            };
            match actor.turn(msg, &ctx).await {
                // a told message's later reply is awaited in the actor's own turn: nobody holds
                // an admission slot for it, so its work must stay bounded by the mailbox
                Ok(Reply::Later(later)) if told => finish(later.await),
                Ok(Reply::Later(later)) => {
                    tokio::spawn(async move { finish(later.await) });
                }
                Ok(Reply::Now(r)) => finish(Ok(r)),
                Err(f) => finish(Err(f)),
            }
        }) as JobFuture<'_>
    }))
}

/// A message from this node: no encoding at all.
pub(crate) fn local_job<A: Handles<M>, M: RemoteMessage>(
    msg: M,
    reply: Option<oneshot::Sender<Result<M::Reply, ActorFailure>>>,
) -> Job<A> {
    Box::new(move |actor: &mut A, ctx: &ActorContext| {
        Box::pin(async move {
            let ctx = ctx.with_sender(ctx.actors.node().clone());
            let name = ctx.name.clone();
            let told = reply.is_none();
            let finish = move |out: Result<M::Reply, ActorFailure>| match reply {
                Some(tx) => {
                    let _ = tx.send(out);
                }
                None => {
                    log_told_failure(&name, M::NAME, out.err().map(|f| (FaultKind::Failed, f.to_string())))
                }
            };
            match actor.turn(msg, &ctx).await {
                // a told message's later reply is awaited in the actor's own turn: nobody holds
                // an admission slot for it, so its work must stay bounded by the mailbox
                Ok(Reply::Later(later)) if told => finish(later.await),
                Ok(Reply::Later(later)) => {
                    tokio::spawn(async move { finish(later.await) });
                }
                Ok(Reply::Now(r)) => finish(Ok(r)),
                Err(f) => finish(Err(f)),
            }
        }) as JobFuture<'_>
    })
}

fn log_told_failure(actor: &str, message: &str, failure: Option<(FaultKind, String)>) {
    if let Some((_, why)) = failure {
        tracing::warn!(actor, message, %why, "a told message failed (nobody waits for its reply)");
    }
}

/// Takes one off the queue depth when the message leaves the mailbox (handled or dropped).
pub(crate) struct Ticket(Arc<AtomicUsize>);

impl Drop for Ticket {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

/// A message in a host's mailbox.
pub struct HostMsg<A> {
    job: Job<A>,
    _ticket: Ticket,
    _queued: crate::mailbox::Queued,
}

impl<A: TypedActor> ractor::Message for HostMsg<A> {}

/// One running incarnation as the node sees it: where to queue messages, and which one it is.
pub(crate) struct Binding<A> {
    pub name: String,
    pub incarnation: u64,
    pub generation: u64,
    pub actor: ActorRef<HostMsg<A>>,
    pub protocol: Arc<Protocol<A>>,
    depth: Arc<AtomicUsize>,
    /// Its depth as node status and metrics show it ([`crate::mailbox`]).
    mailbox: crate::mailbox::Mailbox,
}

impl<A: TypedActor> Binding<A> {
    /// Queues `job`, or refuses it: busy at the mailbox bound, lost when the incarnation stopped.
    pub fn enqueue(&self, job: Job<A>) -> Result<(), ActorError> {
        let bound = self.protocol.mailbox_bound();
        if self.depth.fetch_add(1, Ordering::AcqRel) >= bound {
            self.depth.fetch_sub(1, Ordering::AcqRel);
            return Err(ActorError::Busy {
                actor: self.name.clone(),
                detail: format!("{bound} messages queued, the bound of its mailbox"),
            });
        }
        let msg = HostMsg { job, _ticket: Ticket(self.depth.clone()), _queued: self.mailbox.enter() };
        self.actor.cast(msg).map_err(|_| ActorError::PeerLost {
            actor: self.name.clone(),
            reason: format!("incarnation {:016x} stopped", self.incarnation),
        })
    }
}

/// Start arguments of a [`Host`].
pub struct HostArgs<A: TypedActor> {
    pub(crate) args: A::Args,
    pub(crate) name: String,
    pub(crate) generation: u64,
    pub(crate) actors: Actors,
}

/// The ractor actor hosting one incarnation of `A` at a time (restarts make new ones).
pub struct Host<A>(PhantomData<fn() -> A>);

impl<A> Default for Host<A> {
    fn default() -> Self {
        Self(PhantomData)
    }
}

impl<A: TypedActor> Actor for Host<A> {
    type Msg = HostMsg<A>;
    type State = (A, ActorContext);
    type Arguments = HostArgs<A>;

    async fn pre_start(
        &self,
        me: ActorRef<Self::Msg>,
        args: HostArgs<A>,
    ) -> Result<Self::State, ActorProcessingErr> {
        let ctx = ActorContext {
            name: args.name.clone(),
            incarnation: super::registry::fresh_incarnation(),
            generation: args.generation,
            actors: args.actors.clone(),
            sender: None,
        };
        let actor = A::start(args.args, &ctx)
            .await
            .map_err(|f| format!("{} {:?} did not start: {f}", A::KIND, ctx.name))?;
        let binding = Binding {
            name: ctx.name.clone(),
            incarnation: ctx.incarnation,
            generation: ctx.generation,
            actor: me,
            protocol: Arc::new(Protocol::of()),
            depth: Arc::new(AtomicUsize::new(0)),
            mailbox: crate::mailbox::Mailbox::named(&ctx.name),
        };
        args.actors.bind(Arc::new(binding));
        Ok((actor, ctx))
    }

    async fn handle(
        &self,
        _me: ActorRef<Self::Msg>,
        msg: Self::Msg,
        (actor, ctx): &mut Self::State,
    ) -> Result<(), ActorProcessingErr> {
        let HostMsg { job, _ticket, _queued } = msg;
        drop((_ticket, _queued));
        job(actor, ctx).await;
        Ok(())
    }

    async fn post_stop(
        &self,
        _me: ActorRef<Self::Msg>,
        (_, ctx): &mut Self::State,
    ) -> Result<(), ActorProcessingErr> {
        ctx.actors.unbind(&ctx.name, ctx.incarnation);
        Ok(())
    }
}
