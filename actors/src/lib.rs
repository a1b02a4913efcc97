//! troupe's actors: supervision, membership, the control plane, the actor kinds (device, expert,
//! scheduler), the journal and the fault switch. Decisions live in `troupe-policy`; these are the
//! shells that carry them out.

pub mod address;
pub mod allocator;
pub mod cgroup;
pub mod clock;
pub mod cluster;
pub mod coadapt;
#[cfg(feature = "onnx")]
pub mod coe;
pub mod decode;
pub mod fault;
pub mod hello;
pub mod join;
pub mod journal;
pub mod kinds;
pub mod live;
pub mod mailbox;
pub mod membership;
pub mod node;
#[cfg(feature = "onnx")]
pub mod pipeline;
pub mod service;
pub mod sim;
pub mod supervisor;
pub mod typed;
pub mod wire;
pub mod work;

pub use address::HostPort;
pub use kinds::device::{DeviceActor, DeviceArgs, DeviceMsg};
pub use kinds::scheduler::{Scheduler, SchedulerActor, SchedulerArgs, SchedulerMsg};
pub use membership::{Membership, MembershipConfig, MembershipMsg};
pub use node::{Children, MembershipEvents, NodeRuntime, NodeSpec, PeerAddr, RuntimeError, fixed_children};
pub use service::{Allow, CallError, Caller, ServiceConfig, ServiceSpec, Services};
pub use supervisor::{ChildSpec, Intensity, Supervisor, SupervisorArgs, SupervisorEvent, SupervisorMsg};
pub use typed::{ActorError, ActorHandle, Actors, Handles, RemoteMessage, TypedActor};
