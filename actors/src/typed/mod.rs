//! Typed remote actors: users' own actor kinds, reached from any node by name through typed,
//! role-checked handles, and supervised across nodes.
//!
//! - A kind implements [`TypedActor`] (its name, start arguments, and a [`Protocol`] listing
//!   each [`RemoteMessage`] it accepts with the roles that may send it) and [`Handles<M>`] per
//!   message. Messages and replies are rkyv values ([`Wire`]). A handler whose reply waits on
//!   work done elsewhere overrides [`Handles::turn`] to give it later ([`Reply::Later`]), so
//!   the actor's mailbox goes on meanwhile; [`ActorContext::sender`] names who sent a message.
//! - [`Actors::spawn`] starts one by name under the node's supervisor ([`Actors::child_spec`]
//!   under a supervisor of the caller's, e.g. among a node's children); [`Actors::lookup`] and
//!   [`Actors::wait_for`] (woken by announcements, never polling) give an [`ActorHandle`] on any
//!   node, with [`ActorHandle::call`] and [`ActorHandle::tell`].
//! - Every remote message rides the one wire path: the service router's role check and
//!   admission, checked rkyv access under the decoded-bytes budget, the same-host road when both
//!   nodes share a host. A handle to a local actor hands the message over without encoding.
//! - Errors are one enum, [`ActorError`]: unknown actor, wrong kind, forbidden, timeout, peer
//!   lost, busy, bad message, the actor's own failure.
//! - [`RemoteSupervisor`] places children on other nodes by role and declared capacity and
//!   restarts them elsewhere when their node is declared down; see [`placement`].
//! - [`Links`] is the one ordered call queue per peer, with one generation rule, that scheduler
//!   shells drive their executors and workers through; see [`queue`].
//!
//! ```no_run
//! use std::time::Duration;
//! use troupe_actors::service::Allow;
//! use troupe_actors::typed::{ActorContext, ActorFailure, Handles, Protocol, RemoteMessage, TypedActor};
//!
//! /// Adds to a running total.
//! #[derive(rkyv::Archive, rkyv::Serialize, rkyv::Deserialize)]
//! pub struct Add(pub u64);
//! impl RemoteMessage for Add {
//!     const NAME: &'static str = "add";
//!     type Reply = u64;
//! }
//!
//! pub struct Counter(u64);
//! impl TypedActor for Counter {
//!     const KIND: &'static str = "counter";
//!     type Args = u64;
//!     fn protocol(p: &mut Protocol<Self>) {
//!         p.request::<Add>(Allow::AnyMember);
//!     }
//!     async fn start(start: u64, _: &ActorContext) -> Result<Self, ActorFailure> {
//!         Ok(Counter(start))
//!     }
//! }
//! impl Handles<Add> for Counter {
//!     async fn handle(&mut self, Add(n): Add, _: &ActorContext) -> Result<u64, ActorFailure> {
//!         self.0 += n;
//!         Ok(self.0)
//!     }
//! }
//!
//! # async fn run(node: &troupe_actors::NodeRuntime) -> Result<(), Box<dyn std::error::Error>> {
//! node.actors.spawn::<Counter>("total", 0).await?;
//! // on this node or any other member:
//! let total = node.actors.wait_for::<Counter>("total", Duration::from_secs(5)).await?;
//! assert_eq!(total.call(Add(2), Duration::from_secs(1)).await?, 2);
//! # Ok(()) }
//! ```

mod actor;
mod error;
mod handle;
pub mod placement;
pub mod queue;
mod registry;
mod wire;

pub use actor::{
    ActorContext, DEFAULT_MAILBOX, Handles, Host, HostMsg, LaterReply, Protocol, Reply, TypedActor,
};
pub use error::{ActorError, ActorFailure};
pub use handle::{ActorHandle, MAX_TELL_WINDOW, TELL_FLOW_TIMEOUT};
pub use placement::{
    PLACEMENT, Placed, PlacementRules, RemoteChild, RemoteSupervisor, RemoteSupervisorArgs,
    RemoteSupervisorMsg,
};
pub use queue::{Links, NotQueued, Outcome, Sink};
#[cfg(feature = "onnx")]
pub(crate) use registry::fresh_incarnation;
pub use registry::{
    Actors, DESCRIBE, Described, MAX_ACTOR_NAME, QuicOnly, SpawnError, service_name, validate_name,
};
pub use wire::{RemoteMessage, Wire};
